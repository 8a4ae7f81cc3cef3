// A downstream program: it only needs the umbrella header and the linattn::linattn target.
// Header-only it steps a state (the kernels compiled header-only in a consumer's build are
// consumer_strict's job: strict.cpp); linked to linattn::compiled it also runs the chunked
// call, whose kernel that library alone defines, so a consumer that does not link it fails.
#include <linattn/linattn.hpp>

int main() {
  linattn::RecurrentState<double> state(2, 2);
  const linattn::Vector<double> x = linattn::Vector<double>::Ones(2);
  const linattn::Vector<double> stepped = state.step(x, x, x, linattn::Identity{});
  bool ok = stepped.size() == 2 && stepped.allFinite();
#ifdef LINATTN_COMPILED
  linattn::Matrix<double> m(2, 2);
  m.setOnes();
  const linattn::Matrix<double> out =
      linattn::causal_linear_attention(m, m, m, linattn::Identity{});
  ok = ok && out.rows() == 2 && out.allFinite();
#endif
  return ok ? 0 : 1;
}
