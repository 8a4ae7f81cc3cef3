// expect: needs a feature map argument after v
// A state step without a feature map.
#include <linattn/linattn.hpp>

int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  linattn::RecurrentState<float> state(4, 3);
  (void)state.step(q.row(0), k.row(0), v.row(0), linattn::Identity{});
#else
  linattn::RecurrentState<float> state(4, 3);
  (void)state.step(q.row(0), k.row(0), v.row(0));
#endif
  return 0;
}
