// expect: needs a feature map argument after v
// A backward call without a feature map.
#include <linattn/linattn.hpp>

int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  const linattn::Matrix<float> g = v;
  (void)linattn::causal_linear_attention_backward(q, k, v, g, linattn::Identity{});
#else
  const linattn::Matrix<float> g = v;
  (void)linattn::causal_linear_attention_backward(q, k, v, g);
#endif
  return 0;
}
