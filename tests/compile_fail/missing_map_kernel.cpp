// expect: needs a feature map argument after v
// A kernel call without a feature map: raw q, k must not be taken for features.
#include <linattn/linattn.hpp>

int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  return linattn::causal_linear_attention(q, k, v, linattn::EluPlusOne{}).allFinite() ? 0 : 1;
#else
  return linattn::causal_linear_attention(q, k, v).allFinite() ? 0 : 1;
#endif
}
