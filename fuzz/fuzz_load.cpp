// SPDX-License-Identifier: MIT
// libFuzzer target: RecurrentState<float>::load, RecurrentState<double>::load and
// RecurrentState<float, double>::load on arbitrary bytes. Properties checked:
//   * only linattn::Error may escape load (anything else reaches libFuzzer as a crash);
//   * a load that succeeds consumed exactly the bytes save writes back: re-saving the loaded
//     state reproduces the consumed prefix of the input byte for byte;
//   * a loaded state is usable: one step and a short prefill (through EluPlusOne) either work
//     or throw linattn::Error leaving the state as it was, and the state then saves and loads
//     again.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <linattn/linattn.hpp>
#include <optional>
#include <sstream>
#include <string>

namespace {

[[noreturn]] void fail(const char* what, std::size_t size) {
  std::fprintf(stderr, "fuzz_load: property violated: %s (input of %zu bytes)\n", what, size);
  std::abort();
}

template <class T, class Acc>
std::string save_bytes(const linattn::RecurrentState<T, Acc>& state) {
  std::ostringstream os;
  state.save(os);
  return os.str();
}

/// Steps and prefills a loaded state a little (small states only, to keep the fuzzer fast).
template <class T, class Acc>
void exercise(linattn::RecurrentState<T, Acc>& state, std::size_t size) {
  const Eigen::Index c = state.feature_dim(), dv = state.value_dim();
  if (c * dv > 4096) return;
  const linattn::Vector<T> phi = linattn::Vector<T>::Constant(c, T(0.5));
  const linattn::Vector<T> v = linattn::Vector<T>::LinSpaced(dv, T(-1), T(1));
  // "On a throw the state is unchanged": compare what it saves before and after.
  std::string before = save_bytes(state);
  try {
    (void)state.step(phi, phi, v, linattn::Identity{});
  } catch (const linattn::Error&) {
    if (save_bytes(state) != before) fail("a step that threw changed the state", size);
  }
  before = save_bytes(state);
  try {
    const linattn::Matrix<T> x = linattn::Matrix<T>::Constant(3, c, T(0.25));
    const linattn::Matrix<T> vs = linattn::Matrix<T>::Constant(3, dv, T(2));
    (void)state.prefill(x, x, vs, linattn::EluPlusOne{});
  } catch (const linattn::Error&) {
    if (save_bytes(state) != before) fail("a prefill that threw changed the state", size);
  }
  // Whatever the steps did, the state must still save; if it holds finite sums it must load.
  const std::string bytes = save_bytes(state);
  std::istringstream is(bytes);
  try {
    (void)linattn::RecurrentState<T, Acc>::load(is);
  } catch (const linattn::Error&) {
    const double log_scale = state.log_scale();
    if (state.s().allFinite() && state.z().allFinite() && !std::isnan(log_scale) &&
        log_scale != std::numeric_limits<double>::infinity() && state.tokens() >= 0) {
      fail("a state with finite S, z and log scale saved, then failed to load", size);
    }
  }
}

template <class T, class Acc = T>
void try_load(const std::string& input) {
  std::istringstream is(input);
  std::optional<linattn::RecurrentState<T, Acc>> state;
  try {
    state.emplace(linattn::RecurrentState<T, Acc>::load(is));
  } catch (const linattn::Error&) {
    return;
  }
  const std::streamoff consumed = is.tellg();
  const std::string again = save_bytes(*state);
  if (consumed < 0 || static_cast<std::size_t>(consumed) != again.size()) {
    fail("load consumed a different number of bytes than save writes", input.size());
  }
  if (again.size() > input.size() || std::memcmp(again.data(), input.data(), again.size()) != 0) {
    fail("re-saving a loaded state does not reproduce the input bytes", input.size());
  }
  exercise(*state, input.size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  try_load<float>(input);
  try_load<double>(input);
  try_load<float, double>(input);  // float inputs, double state: reads the double format
  return 0;
}
