// expect: RecurrentState::load\(is\) needs the feature map and the options
// RecurrentState::load(is) without a map and options must not compile: it used to load a state
// saved with other options or another feature map without a word. The static_assert names
// load(is, map, options) and load_unchecked(is).
#include <linattn/feature_map.hpp>
#include <linattn/recurrent_state.hpp>
#include <sstream>

int main() {
  std::istringstream is;
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  const linattn::RecurrentState<float> state =
      linattn::RecurrentState<float>::load(is, linattn::Identity{}, linattn::Options{});
#else
  const linattn::RecurrentState<float> state = linattn::RecurrentState<float>::load(is);
#endif
  return static_cast<int>(state.tokens());
}
