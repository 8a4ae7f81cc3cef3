// expect: the feature map comes before the Options
// Options where the map goes.
#include <linattn/linattn.hpp>

int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  linattn::Options options;
  options.decay = 0.9;
  (void)linattn::causal_linear_attention(q, k, v, linattn::Identity{}, options);
#else
  linattn::Options options;
  options.decay = 0.9;
  (void)linattn::causal_linear_attention(q, k, v, options);
#endif
  return 0;
}
