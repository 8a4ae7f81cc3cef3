// expect: bnhd takes its sizes in memory order
// A HeadShape is the logical {B, H, N, D}; bnhd refuses it and says how to give its sizes.
#include <linattn/heads_view.hpp>
#include <vector>
int main() {
  std::vector<float> data(2 * 3 * 4 * 5);
  const linattn::HeadShape shape{2, 4, 3, 5};
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  (void)linattn::HeadsView<const float>::bnhd(data.data(), linattn::BnhdShape(shape));
#else
  (void)linattn::HeadsView<const float>::bnhd(data.data(), shape);
#endif
  return 0;
}
