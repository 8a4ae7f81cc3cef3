// expect: explicit|no matching function|could not convert
// bnhd's sizes as a bare list: {B, N, H, D} in memory order once ran with N and H swapped (the
// list was read as a HeadShape{B, H, N, D}); a list is no BnhdShape, so it does not compile.
#include <linattn/heads_view.hpp>
#include <vector>
int main() {
  std::vector<float> data(2 * 3 * 4 * 5);
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  (void)linattn::HeadsView<const float>::bnhd(data.data(), linattn::BnhdShape{2, 3, 4, 5});
#else
  (void)linattn::HeadsView<const float>::bnhd(data.data(), {2, 3, 4, 5});
#endif
  return 0;
}
