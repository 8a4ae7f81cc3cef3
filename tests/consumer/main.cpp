// A downstream program: it only needs the umbrella header and the linattn::linattn target.
// It steps a state. Linked to linattn::compiled it also runs the chunked call, whose kernel that
// library alone defines, so a consumer that does not link it fails; linked to linattn::native
// (LINATTN_CONSUMER_CHUNKED) it runs it header-only, with -march=native. The kernels compiled
// header-only without -march are consumer_strict's check (strict.cpp).
#include <linattn/linattn.hpp>

int main() {
  linattn::RecurrentState<double> state(2, 2);
  const linattn::Vector<double> x = linattn::Vector<double>::Ones(2);
  const linattn::Vector<double> stepped = state.step(x, x, x, linattn::Identity{});
  bool ok = stepped.size() == 2 && stepped.allFinite();
#if defined(LINATTN_COMPILED) || defined(LINATTN_CONSUMER_CHUNKED)
  linattn::Matrix<double> m(2, 2);
  m.setOnes();
  const linattn::Matrix<double> out =
      linattn::causal_linear_attention(m, m, m, linattn::Identity{});
  ok = ok && out.rows() == 2 && out.allFinite();
#endif
  return ok ? 0 : 1;
}
