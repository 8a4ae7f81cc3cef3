// expect: needs a feature map argument after v
// A gated call without a feature map.
#include <linattn/linattn.hpp>

int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  const linattn::Matrix<float> a = linattn::Matrix<float>::Constant(8, 1, 0.9f);
  (void)linattn::causal_gated_linear_attention(q, k, v, a, linattn::Identity{});
#else
  const linattn::Matrix<float> a = linattn::Matrix<float>::Constant(8, 1, 0.9f);
  (void)linattn::causal_gated_linear_attention(q, k, v, a);
#endif
  return 0;
}
