// expect: no matching function
// The 0.1.0 bnhd(data, B, N, H, D) order: sizes now go in a BnhdShape{B, N, H, D}.
#include <linattn/linattn.hpp>
#include <vector>
int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(8, 4);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(8, 3);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  std::vector<float> data(2 * 3 * 4 * 5);
  (void)linattn::HeadsView<const float>::bnhd(data.data(), linattn::BnhdShape{2, 3, 4, 5});
#else
  std::vector<float> data(2 * 3 * 4 * 5);
  (void)linattn::HeadsView<const float>::bnhd(data.data(), 2, 3, 4, 5);
#endif
  return 0;
}
