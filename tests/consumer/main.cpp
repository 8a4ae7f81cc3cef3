// A downstream program: it only needs the umbrella header and the linattn::linattn target.
#include <linattn/linattn.hpp>

int main() {
  linattn::Options opts;
  linattn::Matrix<double> m(2, 2);
  m.setOnes();
  const linattn::Matrix<double> out =
      linattn::causal_linear_attention(m, m, m, linattn::Identity{}, opts);
  return (out.rows() == 2 && out.allFinite()) ? 0 : 1;
}
