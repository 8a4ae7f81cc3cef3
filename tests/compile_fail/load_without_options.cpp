// expect: RecurrentState::load\(is, map\) needs the options
// load(is, map) without the options must not compile either: the options that change results
// are checked too.
#include <linattn/feature_maps.hpp>
#include <linattn/recurrent_state.hpp>
#include <sstream>

int main() {
  std::istringstream is;
#ifdef LINATTN_COMPILE_FAIL_CONTROL
  const linattn::RecurrentState<double> state =
      linattn::RecurrentState<double>::load(is, linattn::EluPlusOne{}, linattn::Options{});
#else
  const linattn::RecurrentState<double> state =
      linattn::RecurrentState<double>::load(is, linattn::EluPlusOne{});
#endif
  return static_cast<int>(state.tokens());
}
