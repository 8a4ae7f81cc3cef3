// expect: needs a feature map argument after v
// A batch step without a feature map.
#include <linattn/linattn.hpp>

int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  linattn::RecurrentStateBatch<float> batch(8, 4, 3);
  (void)batch.step(q, k, v, linattn::Identity{});
#else
  linattn::RecurrentStateBatch<float> batch(8, 4, 3);
  (void)batch.step(q, k, v);
#endif
  return 0;
}
