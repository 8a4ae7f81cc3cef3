// expect: needs a feature map argument after v
// A prefill without a feature map.
#include <linattn/linattn.hpp>

int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  linattn::RecurrentState<float> state(4, 3);
  (void)state.prefill(q, k, v, linattn::EluPlusOne{});
#else
  linattn::RecurrentState<float> state(4, 3);
  (void)state.prefill(q, k, v);
#endif
  return 0;
}
