// expect: (no matching function|cannot convert|could not convert)
// A scale where the softmax mask goes (0.1.0 read it as causal = true).
#include <linattn/linattn.hpp>

int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  (void)linattn::softmax_attention(q, k, v, linattn::Mask::none, 0.125);
#else
  (void)linattn::softmax_attention(q, k, v, 0.125);
#endif
  return 0;
}
