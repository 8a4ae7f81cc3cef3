// expect: needs a feature map before out
// The map-less _into call of 0.1.0.
#include <linattn/linattn.hpp>

int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  linattn::Matrix<float> out(8, 3);
  linattn::causal_linear_attention_into(q, k, v, linattn::Identity{}, out);
#else
  linattn::Matrix<float> out(8, 3);
  linattn::causal_linear_attention_into(q, k, v, out);
#endif
  return 0;
}
