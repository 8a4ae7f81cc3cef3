// SPDX-License-Identifier: MIT
// libFuzzer target: RecurrentState<T, Acc>::load_unchecked and load(is, map, options) for
// <float>, <double> and <float, double> on arbitrary bytes (format 1 of linattn 0.1.0,
// formats 2, 3 and 4). Properties checked:
//   * only linattn::Error may escape either load (anything else reaches libFuzzer as a
//     crash), and a load that throws leaves no object behind;
//   * load_unchecked that succeeds consumed exactly the bytes of one state: re-saving it
//     (save(os), no map, format 4) reproduces the consumed input byte for byte outside the map
//     record (a format-3 or format-2 input is compared with the save rearranged into its
//     layout), or loads back to the same sums and options (format 1);
//   * load(is, map, options) never accepts what load_unchecked refuses, and when it succeeds
//     the state equals load_unchecked's but for the caller's options, and save(os, map)
//     reproduces the input but for the fields that only say how W was drawn (seed,
//     projection, row_norm: not compared); it is tried with the maps of the seed corpus, a
//     map rebuilt from the record itself, and both the file's options and the defaults;
//   * DeltaRuleState<float> and <double>: only Error escapes load_unchecked and load; an
//     accepted stream is what save writes for the loaded state (rearranged into the layout of
//     the delta rule's LNATTND 1 for an input of that format), load with its own options
//     accepts it, and a step that throws leaves it as it was;
//   * SessionPool<>::add_bytes over a small hybrid model (fuzz/session_model.hpp: one layer of
//     every kind a pool holds): only linattn::Error escapes, a refused blob leaves the pool
//     empty, an accepted one saves again, in its own storage, to exactly its bytes, and the
//     session then takes a few tokens through every layer (or Error, at the token limit);
//   * a loaded state is usable: a step, a gated step and a short prefill either work or throw
//     linattn::Error leaving the state as it was (a state keeps its transition kind, so some
//     must throw), and the state then saves and loads again.
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
#include <vector>

#include "session_model.hpp"

namespace {

[[noreturn]] void fail(const char* what, std::size_t size) {
  std::fprintf(stderr, "fuzz_load: property violated: %s (input of %zu bytes)\n", what, size);
  std::abort();
}

/// The user maps of the seed corpus (make_corpus.cpp has the same two).
struct TwiceFeatures {
  Eigen::Index feature_dim(Eigen::Index input_dim) const { return input_dim; }
  template <class D>
  linattn::Matrix<typename D::Scalar> queries(const Eigen::MatrixBase<D>& x) const {
    return x * typename D::Scalar(2);
  }
  template <class D>
  linattn::Matrix<typename D::Scalar> keys(const Eigen::MatrixBase<D>& x) const {
    return x * typename D::Scalar(2);
  }
};
struct FingerprintedFeatures : TwiceFeatures {
  std::uint64_t fingerprint() const { return 0x1234567890abcdefull; }
};

// Offsets of a linear-attention state (detail/state_record.hpp documents format 4, the one
// save writes, and the formats before it). Format 4 holds the family (32), the transition
// (33) and the token count (34-41) before the settings; format 3 had the settings from 32,
// then the transition (101), the tokens and the log scale; format 2 is format 3 without the
// transition byte; format 1 had no map record.
constexpr std::size_t kVersionAt = 8;
constexpr std::size_t kHeaderEnd = 32;   // magic, version, scalar size, rows, cols
constexpr std::size_t kV4Settings = 42;  // format 4: eps, decay, normalize, scale, map record
constexpr std::size_t kV4LogScale = 111;

/// Where a format's map record and header lie.
struct Layout {
  std::size_t map_at = 0, header = 0;
  std::size_t map_end() const { return map_at + 44; }
  std::size_t projection_at() const { return map_at + 1; }
  std::size_t row_norm_at() const { return map_at + 2; }
  std::size_t seed_at() const { return map_at + 28; }
  std::size_t seed_end() const { return map_at + 36; }
};

Layout layout_of(int version) {
  switch (version) {
    case 4:
      return {67, 119};
    case 3:
      return {57, 118};
    case 2:
      return {57, 117};
    default:
      return {0, 74};  // format 1: no map record
  }
}

/// The format version of `input` (0 when it is too short to say, or not 1 to 4).
int version_of(const std::string& input) {
  if (input.size() <= kVersionAt) return 0;
  const int version = static_cast<unsigned char>(input[kVersionAt]);
  return version >= 1 && version <= 4 ? version : 0;
}

/// `saved` (format 4, as save writes it) in the layout of an input of format `version`: for
/// format 3, the settings, then the transition, the token count and the log scale; for format
/// 2 the same without the transition byte (the checksum is left stale).
std::string in_layout_of(const std::string& saved, int version) {
  if ((version != 2 && version != 3) || saved.size() < kV4LogScale + 8) return saved;
  std::string old = saved.substr(0, kHeaderEnd);
  old += saved.substr(kV4Settings, kV4LogScale - kV4Settings);
  if (version == 3) old += saved.substr(33, 1);
  old += saved.substr(34, 8);
  old += saved.substr(kV4LogScale);
  old[kVersionAt] = static_cast<char>(version);
  return old;
}

template <class T, class Acc>
std::string save_bytes(const linattn::RecurrentState<T, Acc>& state) {
  std::ostringstream os;
  state.save(os);
  return os.str();
}

template <class T, class Acc, class Map>
std::string save_bytes(const linattn::RecurrentState<T, Acc>& state, const Map& map) {
  std::ostringstream os;
  state.save(os, map);
  return os.str();
}

template <class T, class Acc>
bool same_sums(const linattn::RecurrentState<T, Acc>& a, const linattn::RecurrentState<T, Acc>& b) {
  // Bit for bit, as the states hold them (memcmp: -0.0 and 0.0 differ, as in the stream).
  const auto& held_a = linattn::detail::StateAccess::held(a);
  const auto& held_b = linattn::detail::StateAccess::held(b);
  return a.feature_dim() == b.feature_dim() && a.value_dim() == b.value_dim() &&
         std::memcmp(held_a.s.data(), held_b.s.data(), sizeof(Acc) * held_a.s.size()) == 0 &&
         std::memcmp(held_a.z.data(), held_b.z.data(), sizeof(Acc) * held_a.z.size()) == 0 &&
         a.tokens() == b.tokens() &&
         std::memcmp(&held_a.log_scale, &held_b.log_scale, sizeof(double)) == 0;
}

bool same_result_options(const linattn::Options& a, const linattn::Options& b) {
  return a.eps == b.eps && a.decay == b.decay && a.normalize == b.normalize;
}

/// True if bytes [from, to) of a and b agree (both long enough).
bool same_range(const std::string& a, const std::string& b, std::size_t from, std::size_t to) {
  return a.size() >= to && b.size() >= to &&
         std::memcmp(a.data() + from, b.data() + from, to - from) == 0;
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
  const bool continues = state.transition() == linattn::TransitionKind::none ||
                         state.transition() == linattn::TransitionKind::feature_gates;
  try {
    const linattn::Vector<T> gate = linattn::Vector<T>::Constant(c, T(0.5));
    (void)state.step(phi, phi, v, gate, linattn::Identity{});
    if (!continues) fail("a gated step continued a state of another transition", size);
  } catch (const linattn::Error&) {
    if (save_bytes(state) != before) fail("a gated step that threw changed the state", size);
  }
  before = save_bytes(state);
  try {
    const linattn::Matrix<T> x = linattn::Matrix<T>::Constant(3, c, T(0.25));
    const linattn::Matrix<T> vs = linattn::Matrix<T>::Constant(3, dv, T(2));
    (void)state.prefill(x, x, vs, linattn::EluPlusOne{});
  } catch (const linattn::Error&) {
    if (save_bytes(state) != before) fail("a prefill that threw changed the state", size);
  }
  // Whatever the steps did, the state must still save; if it holds finite sums it must load,
  // unchecked and checked.
  const auto& held = linattn::detail::StateAccess::held(state);
  const bool finite = held.s.allFinite() && held.z.allFinite() && !std::isnan(held.log_scale) &&
                      held.log_scale != std::numeric_limits<double>::infinity() &&
                      state.tokens() >= 0;
  const std::string bytes = save_bytes(state, linattn::EluPlusOne{});
  std::istringstream is(bytes);
  try {
    const auto again =
        linattn::RecurrentState<T, Acc>::load(is, linattn::EluPlusOne{}, state.options());
    // Bytes, not s(): save folds per-feature gates' pending factors into the sums it writes.
    if (save_bytes(again, linattn::EluPlusOne{}) != bytes) {
      fail("a saved and loaded state differs from the original", size);
    }
  } catch (const linattn::Error&) {
    if (finite) fail("a state with finite S, z and log scale saved, then failed to load", size);
  }
}

/// The checked load of `input` with `map` and `options`; `unchecked` is load_unchecked's state
/// (nothing when it refused the input).
template <class T, class Acc, class Map>
void try_checked(const std::string& input, const Map& map, const linattn::Options& options,
                 const std::optional<linattn::RecurrentState<T, Acc>>& unchecked) {
  using State = linattn::RecurrentState<T, Acc>;
  std::istringstream is(input);
  std::optional<State> state;
  try {
    state.emplace(State::load(is, map, options));
  } catch (const linattn::Error&) {
    if (state) fail("a load that threw left an object behind", input.size());
    return;
  }
  if (!unchecked) fail("load(is, map, options) accepted what load_unchecked refuses", input.size());
  const int version = version_of(input);
  if (version < 2) {
    fail("load(is, map, options) accepted a stream that is not format 2, 3 or 4", input.size());
  }
  const Layout layout = layout_of(version);
  if (!same_sums(*state, *unchecked)) fail("checked and unchecked loads differ", input.size());
  if (!same_result_options(state->options(), unchecked->options())) {
    fail("load(is, map, options) accepted other options", input.size());
  }
  const linattn::Options& got = state->options();
  if (got.chunk != options.chunk || got.check_finite != options.check_finite ||
      got.threads != options.threads) {
    fail("the checked load did not give the state the caller's options", input.size());
  }
  // save(os, map) writes the same record but for how W was drawn (not compared on load).
  const std::string saved = save_bytes(*state, map);
  std::string again = in_layout_of(saved, version);
  if (again.size() > input.size()) fail("re-saving wrote more than the input", input.size());
  std::string expected = input.substr(0, again.size());
  for (std::size_t at : {layout.projection_at(), layout.row_norm_at()}) expected[at] = again[at];
  std::memcpy(&expected[layout.seed_at()], &again[layout.seed_at()],
              layout.seed_end() - layout.seed_at());
  if (!same_range(again, expected, 0, again.size() - 4)) {
    fail("save(os, map) after load(is, map, options) does not reproduce the input", input.size());
  }
  std::istringstream reread(saved);
  if (!same_sums(State::load(reread, map, options), *state)) {
    fail("save(os, map) -> load(is, map, options) changed the state", input.size());
  }
}

/// A random-feature map rebuilt from a map record (format 2 and later), when it names one of
/// a modest size.
template <class Map>
std::optional<Map> map_from_record(const std::string& input) {
  const int version = version_of(input);
  const Layout layout = layout_of(version);
  if (version < 2 || input.size() < layout.map_end()) return std::nullopt;
  const auto u64_at = [&](std::size_t at) {
    std::uint64_t value = 0;
    for (int i = 0; i < 8; ++i) {
      value |= std::uint64_t{static_cast<unsigned char>(input[at + i])} << (8 * i);
    }
    return value;
  };
  const std::uint64_t dk = u64_at(layout.map_at + 4), m = u64_at(layout.map_at + 12);
  const std::uint64_t tau_bits = u64_at(layout.map_at + 20), seed = u64_at(layout.seed_at());
  if (dk < 1 || dk > 16 || m < 1 || m > 32) return std::nullopt;
  linattn::RandomFeatureOptions options;
  options.projection = input[layout.projection_at()] == 1 ? linattn::Projection::iid
                                                          : linattn::Projection::orthogonal;
  options.row_norm =
      input[layout.row_norm_at()] == 1 ? linattn::RowNorm::fixed : linattn::RowNorm::chi;
  options.hyperbolic = input[layout.map_at + 3] == 1;
  std::memcpy(&options.temperature, &tau_bits, sizeof(double));
  try {
    return Map(static_cast<Eigen::Index>(dk), static_cast<Eigen::Index>(m), seed, options);
  } catch (const linattn::Error&) {
    return std::nullopt;  // e.g. a temperature that is not positive and finite
  }
}

/// The random maps make_corpus.cpp saves states with, drawn once.
struct CorpusMaps {
  std::vector<linattn::PositiveRandomFeatures> favor;
  std::vector<linattn::RandomFourierFeatures> fourier;
  CorpusMaps() {
    linattn::RandomFeatureOptions hyperbolic;
    hyperbolic.hyperbolic = true;
    linattn::RandomFeatureOptions iid;
    iid.projection = linattn::Projection::iid;
    iid.row_norm = linattn::RowNorm::fixed;
    favor.emplace_back(3, 6, 7);
    favor.emplace_back(2, 4, 1);
    favor.emplace_back(2, 3, 4, hyperbolic);
    fourier.emplace_back(2, 2, 3);
    fourier.emplace_back(3, 2, 5, iid);
  }
};
const CorpusMaps corpus;

template <class T, class Acc = T>
void try_load(const std::string& input) {
  using State = linattn::RecurrentState<T, Acc>;
  std::istringstream is(input);
  std::optional<State> state;
  try {
    state.emplace(State::load_unchecked(is));
  } catch (const linattn::Error&) {
    if (state) fail("a load that threw left an object behind", input.size());
  }
  if (state) {
    const std::streamoff consumed = is.tellg();
    const std::size_t payload =
        sizeof(Acc) * static_cast<std::size_t>(state->s().size() + state->z().size());
    const int version = version_of(input);
    const Layout layout = layout_of(version);
    if (consumed < 0 || static_cast<std::size_t>(consumed) != layout.header + payload + 4) {
      fail("load_unchecked consumed a different number of bytes than one state", input.size());
    }
    const std::string saved = save_bytes(*state);
    const std::string again = in_layout_of(saved, version);
    if (version >= 2) {
      // save(os) writes the no-map record; everything else must be the input's bytes.
      if (again.size() != static_cast<std::size_t>(consumed) ||
          !same_range(again, input, 0, layout.map_at) ||
          !same_range(again, input, layout.map_end(), again.size() - 4)) {
        fail("re-saving a loaded state does not reproduce the input bytes", input.size());
      }
      if (version == 4 && input[layout.map_at] == 0 && !same_range(again, input, 0, again.size())) {
        fail("re-saving a state saved without a map changed its bytes", input.size());
      }
    }
    std::istringstream reread(saved);
    const State loaded = State::load_unchecked(reread);
    if (!same_sums(loaded, *state) || !same_result_options(loaded.options(), state->options()) ||
        loaded.transition() != state->transition()) {
      fail("save -> load_unchecked changed the state", input.size());
    }
  }
  // Checked loads with the corpus' maps, a map rebuilt from the record, and two sets of options.
  linattn::Options decayed;  // make_corpus's
  decayed.decay = 0.9;
  decayed.eps = 1e-3;
  decayed.chunk = 16;
  linattn::Options plain;
  plain.normalize = false;
  plain.check_finite = false;
  plain.eps = 0.0;
  const linattn::Options defaults;
  const linattn::Options* all_options[] = {&defaults, &decayed, &plain, nullptr};
  linattn::Options own;
  if (state) {
    own = state->options();
    own.chunk = 5;  // not compared: the state must take it
    own.check_finite = !own.check_finite;
    all_options[3] = &own;
  }
  const std::optional<linattn::PositiveRandomFeatures> favor =
      map_from_record<linattn::PositiveRandomFeatures>(input);
  const std::optional<linattn::RandomFourierFeatures> fourier =
      map_from_record<linattn::RandomFourierFeatures>(input);
  for (const linattn::Options* options : all_options) {
    if (options == nullptr) continue;
    try_checked<T, Acc>(input, linattn::Identity{}, *options, state);
    try_checked<T, Acc>(input, linattn::EluPlusOne{}, *options, state);
    try_checked<T, Acc>(input, linattn::Relu{}, *options, state);
    try_checked<T, Acc>(input, TwiceFeatures{}, *options, state);
    try_checked<T, Acc>(input, FingerprintedFeatures{}, *options, state);
    for (const auto& map : corpus.favor) try_checked<T, Acc>(input, map, *options, state);
    for (const auto& map : corpus.fourier) try_checked<T, Acc>(input, map, *options, state);
    if (favor) try_checked<T, Acc>(input, *favor, *options, state);
    if (fourier) try_checked<T, Acc>(input, *fourier, *options, state);
  }
  if (state) exercise(*state, input.size());
}

template <class T, class Acc>
std::string save_bytes(const linattn::DeltaRuleState<T, Acc>& state) {
  std::ostringstream os;
  state.save(os);
  return os.str();
}

/// DeltaRuleState<T, Acc>::load_unchecked and load(is, options) on the same bytes: only Error
/// escapes; an accepted stream is exactly what save writes for the state it gives, the checked
/// load accepts it with the saved options (and the caller's chunk) and gives the same state,
/// and a step that throws on it leaves it as it was.
template <class T, class Acc = linattn::detail::default_accumulator_t<T>>
void try_load_delta(const std::string& input) {
  using State = linattn::DeltaRuleState<T, Acc>;
  std::optional<State> state;
  try {
    std::istringstream is(input);
    state.emplace(State::load_unchecked(is));
  } catch (const linattn::Error&) {
    if (state) fail("a delta-rule load that threw left an object behind", input.size());
  }
  linattn::DeltaOptions other;
  other.chunk = 5;
  try {
    std::istringstream is(input);
    (void)State::load(is, state ? state->options() : other);
    if (!state) fail("DeltaRuleState::load accepted what load_unchecked refuses", input.size());
  } catch (const linattn::Error&) {
    if (state) fail("DeltaRuleState::load refused a stream with its own options", input.size());
  }
  if (!state) return;
  const std::string saved = save_bytes(*state);
  // The delta rule's LNATTND 1: scale, the two flags, the transition, the tokens, then S.
  const bool legacy = input.compare(0, 8, std::string("LNATTND\0", 8)) == 0;
  if (legacy) {
    std::string old = std::string("LNATTND\0", 8) + saved.substr(8, kHeaderEnd - 8);
    old[kVersionAt] = 1;
    old += saved.substr(kV4Settings, 10) + saved.substr(33, 9) + saved.substr(52);
    if (old.size() > input.size() || !same_range(old, input, 0, old.size() - 4)) {
      fail("DeltaRuleState: save after loading an LNATTND stream does not reproduce it",
           input.size());
    }
  } else if (!same_range(saved, input, 0, saved.size())) {
    fail("DeltaRuleState: save after load_unchecked does not reproduce the input", input.size());
  }
  // load_bytes takes the buffer only when it holds the state and nothing after it.
  try {
    const State from_bytes =
        linattn::load_bytes<State>(input.data(), input.size(), state->options());
    if (input.size() != saved.size() - (legacy ? 1 : 0)) {
      fail("load_bytes took trailing bytes", input.size());
    }
    if (save_bytes(from_bytes) != saved) fail("load_bytes gave another state", input.size());
  } catch (const linattn::Error&) {
    if (input.size() == saved.size() - (legacy ? 1 : 0)) {
      fail("load_bytes refused a whole state", input.size());
    }
  }
  const Eigen::Index dk = state->key_dim(), dv = state->value_dim();
  if (dk * dv > 4096) return;
  const linattn::Vector<T> k = linattn::Vector<T>::Constant(dk, T(1) / T(std::sqrt(double(dk))));
  const linattn::Vector<T> v = linattn::Vector<T>::LinSpaced(dv, T(-1), T(1));
  const linattn::Vector<T> gate = linattn::Vector<T>::Constant(dk, T(0.5));
  const std::string before = save_bytes(*state);
  const bool keeps = state->transition() == linattn::TransitionKind::none ||
                     state->transition() == linattn::TransitionKind::feature_gates;
  try {
    (void)state->step(k, k, v, gate, T(0.5));
    if (!keeps)
      fail("a per-feature step continued a delta-rule state of another kind", input.size());
  } catch (const linattn::Error&) {
    if (save_bytes(*state) != before) fail("a delta-rule step that threw moved it", input.size());
  }
}

/// A hybrid model's session blob: SessionPool<>::add_bytes, then the properties above.
void try_session(const std::string& input) {
  static const linattn_fuzz::SessionModel model;
  linattn::SessionPool<> pool = model.pool();
  try {
    pool.add_bytes(1, input.data(), input.size());
  } catch (const linattn::Error&) {
    if (pool.size() != 0) fail("a refused session blob joined the pool", input.size());
    return;
  }
  const auto storage = static_cast<linattn::SessionStorage>(static_cast<unsigned char>(input[12]));
  const std::vector<std::uint8_t> again = pool.save_bytes(1, storage);
  if (std::string(again.begin(), again.end()) != input) {
    fail("an accepted session blob saves to other bytes", input.size());
  }
  try {
    model.advance(pool, 1, 2, 99);
  } catch (const linattn::Error&) {
    // A session at the token limit refuses more: legitimate, and nothing else is checked.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  try_load<float>(input);
  try_load<double>(input);
  try_load<float, double>(input);  // float inputs, double state: reads the double format
  try_load_delta<float>(input);
  try_load_delta<double>(input);
  try_session(input);
  return 0;
}
