// save_bytes / load_bytes and save_file / load_file: the stream format through a byte buffer
// and an atomically replaced file, for RecurrentState and DeltaRuleState.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <linattn/delta_rule.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/recurrent_state.hpp>
#include <linattn/state_io.hpp>
#include <sstream>
#include <string>
#include <vector>

#if !defined(_WIN32)
#include <dirent.h>
#include <unistd.h>
#endif

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_state_io {

namespace {

using linattn::DeltaOptions;
using linattn::DeltaRuleState;
using linattn::Matrix;
using linattn::RecurrentState;
using linattn::Vector;
using linattn_test::gaussian;

/// A fresh directory for one test's files (removed with its files by the caller).
std::string scratch_directory() {
  std::string path = "/tmp/linattn-state-io-XXXXXX";
  REQUIRE(::mkdtemp(path.data()) != nullptr);
  return path;
}

/// The names in a directory, "." and ".." left out.
std::vector<std::string> directory_entries(const std::string& path) {
  std::vector<std::string> names;
  DIR* dir = ::opendir(path.c_str());
  REQUIRE(dir != nullptr);
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  return names;
}

void remove_directory(const std::string& path) {
  for (const std::string& name : directory_entries(path)) {
    std::remove((path + "/" + name).c_str());
  }
  ::rmdir(path.c_str());
}

/// A RecurrentState stepped through `n` tokens of an ELU map.
template <class T>
RecurrentState<T> stepped_state(Eigen::Index n, std::uint64_t seed) {
  RecurrentState<T> state(8, 5);
  const Matrix<T> q = gaussian<T>(n, 8, seed), k = gaussian<T>(n, 8, seed + 1);
  const Matrix<T> v = gaussian<T>(n, 5, seed + 2);
  for (Eigen::Index t = 0; t < n; ++t) {
    (void)state.step(q.row(t), k.row(t), v.row(t), linattn::EluPlusOne{});
  }
  return state;
}

/// A Gated DeltaNet state stepped through `n` tokens.
template <class T>
DeltaRuleState<T> stepped_delta(Eigen::Index n, const DeltaOptions& options, std::uint64_t seed) {
  DeltaRuleState<T> state(6, 4, options);
  const Matrix<T> q = gaussian<T>(n, 6, seed), k = gaussian<T>(n, 6, seed + 1);
  const Matrix<T> v = gaussian<T>(n, 4, seed + 2);
  for (Eigen::Index t = 0; t < n; ++t) {
    const Matrix<T> g = Matrix<T>::Constant(1, 1, T(-0.05));
    (void)state.step(q.row(t), k.row(t), v.row(t), linattn::log_gates(g), T(0.5));
  }
  return state;
}

}  // namespace

TEMPLATE_TEST_CASE("save_bytes holds the stream's bytes; load_bytes continues bit for bit",
                   "[state_io]", float, double) {
  using T = TestType;
  using Catch::Contains;
  const linattn::EluPlusOne map;
  const RecurrentState<T> state = stepped_state<T>(20, 11);
  std::stringstream stream;
  state.save(stream, map);
  const std::string streamed = stream.str();
  const std::vector<std::uint8_t> bytes = linattn::save_bytes(state, map);
  CHECK(std::string(bytes.begin(), bytes.end()) == streamed);
  RecurrentState<T> loaded = linattn::load_bytes<RecurrentState<T>>(bytes, map, linattn::Options{});
  RecurrentState<T> original = state;
  const Matrix<T> q = gaussian<T>(1, 8, 40), k = gaussian<T>(1, 8, 41), v = gaussian<T>(1, 5, 42);
  CHECK(loaded.step(q.row(0), k.row(0), v.row(0), map) ==
        original.step(q.row(0), k.row(0), v.row(0), map));
  CHECK(loaded.tokens() == 21);
  // One byte more, one byte less, a flipped byte, the other map: refused.
  std::vector<std::uint8_t> longer = bytes;
  longer.push_back(0);
  CHECK_THROWS_WITH(linattn::load_bytes<RecurrentState<T>>(longer, map, linattn::Options{}),
                    Contains("1 bytes after the state"));
  CHECK_THROWS_AS(linattn::load_bytes<RecurrentState<T>>(bytes.data(), bytes.size() - 1, map,
                                                         linattn::Options{}),
                  linattn::Error);
  std::vector<std::uint8_t> flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x10;
  CHECK_THROWS_WITH(linattn::load_bytes<RecurrentState<T>>(flipped, map, linattn::Options{}),
                    Contains("checksum"));
  CHECK_THROWS_AS(
      linattn::load_bytes<RecurrentState<T>>(bytes, linattn::Relu{}, linattn::Options{}),
      linattn::Error);
  CHECK_THROWS_AS(linattn::load_bytes<RecurrentState<T>>(nullptr, 0, map, linattn::Options{}),
                  linattn::Error);

  // The delta rule's state, with its options.
  DeltaOptions options;
  options.l2_normalize = true;
  const DeltaRuleState<T> delta = stepped_delta<T>(15, options, 21);
  const std::vector<std::uint8_t> delta_bytes = linattn::save_bytes(delta);
  DeltaRuleState<T> delta_loaded = linattn::load_bytes<DeltaRuleState<T>>(delta_bytes, options);
  CHECK(delta_loaded.s() == delta.s());
  CHECK(delta_loaded.tokens() == 15);
  CHECK(delta_loaded.transition() == linattn::TransitionKind::scalar_gates);
  DeltaOptions other = options;
  other.l2_normalize = false;
  CHECK_THROWS_WITH(linattn::load_bytes<DeltaRuleState<T>>(delta_bytes, other),
                    Contains("l2_normalize"));
  // A RecurrentState's bytes are not a delta-rule state.
  CHECK_THROWS_AS(linattn::load_bytes<DeltaRuleState<T>>(bytes, options), linattn::Error);
}

TEST_CASE("every family saves in format 4; saved_state_info reads any state of any format",
          "[state_io][persistence]") {
  using Catch::Contains;
  using linattn::StateFamily;
  using linattn::TransitionKind;
  // One reader for both families, both scalar sizes, and what it says about each.
  DeltaOptions options;
  options.l2_normalize = true;
  const std::vector<std::uint8_t> delta =
      linattn::save_bytes(stepped_delta<float>(15, options, 21));
  const std::vector<std::uint8_t> linear =
      linattn::save_bytes(stepped_state<double>(20, 11), linattn::EluPlusOne{});
  const linattn::SavedStateInfo d = linattn::saved_state_info(delta);
  CHECK(d.family == StateFamily::delta_rule);
  CHECK(std::string(linattn::state_family_class(d.family)) == "DeltaRuleState");
  CHECK((d.format_version == 4 && d.scalar_bytes == 4 && d.rows == 6 && d.cols == 4));
  CHECK((d.transition == TransitionKind::scalar_gates && d.tokens == 15));
  const linattn::SavedStateInfo l = linattn::saved_state_info(linear);
  CHECK(l.family == StateFamily::linear);
  CHECK((l.format_version == 4 && l.scalar_bytes == 8 && l.rows == 8 && l.cols == 5));
  CHECK((l.transition == TransitionKind::decay && l.tokens == 20));
  // The same framing: the header's first 32 bytes differ only where the states do.
  CHECK(std::equal(delta.begin(), delta.begin() + 12, linear.begin()));
  // A session blob is one state after another: read one at a time.
  std::string both(delta.begin(), delta.end());
  both.append(linear.begin(), linear.end());
  std::istringstream session(both);
  CHECK(linattn::saved_state_info(session).family == StateFamily::delta_rule);
  CHECK(linattn::saved_state_info(session).family == StateFamily::linear);
  CHECK(static_cast<std::size_t>(session.tellg()) == both.size());
  // ... but a buffer holds exactly one, and every corruption is refused.
  CHECK_THROWS_WITH(
      linattn::saved_state_info(both.data(), both.size()),
      Contains("linattn::saved_state_info: the buffer holds") && Contains("bytes after the state"));
  std::vector<std::uint8_t> flipped = delta;
  flipped[20] ^= 0x10;
  CHECK_THROWS_AS(linattn::saved_state_info(flipped), linattn::Error);
  CHECK_THROWS_WITH(linattn::saved_state_info(nullptr, 0), Contains("the stream is empty"));
  // Each family's load names the class that loads the other's.
  CHECK_THROWS_WITH(
      linattn::load_bytes<RecurrentState<float>>(delta, linattn::EluPlusOne{}, linattn::Options{}),
      Contains("RecurrentState::load: the stream holds a DeltaRuleState, not a "
               "RecurrentState: load it with DeltaRuleState::load"));

  // DeltaRuleState's format before format 4 ("LNATTND" 1, make_state_v3.cpp): DeltaNet with
  // scale 0.5, beta 0.5, three dyadic tokens, exact in float.
  std::ifstream file(std::string(LINATTN_TEST_DATA_DIR) + "/delta_v1_float_deltanet.bin",
                     std::ios::binary);
  const std::string legacy((std::istreambuf_iterator<char>(file)),
                           std::istreambuf_iterator<char>());
  REQUIRE(legacy.size() == 51 + 3 * 2 * 4 + 4);
  CHECK(legacy.substr(0, 8) == std::string("LNATTND\0", 8));
  Matrix<double> k(3, 3), v(3, 2);
  k << 0.5, -0.25, 1.0, 0.25, 0.5, -0.5, -1.0, 0.25, 0.5;
  v << 2.0, -1.0, 0.5, 4.0, -3.0, 0.125;
  Matrix<double> s = Matrix<double>::Zero(3, 2);
  for (int t = 0; t < 3; ++t) {
    const Vector<double> kt = k.row(t).transpose();
    s += 0.5 * kt * (v.row(t) - kt.transpose() * s);
  }
  CHECK(s(0, 1) == -0x1.7p-3);  // as make_state_v3 printed it
  const linattn::SavedStateInfo old = linattn::saved_state_info(legacy.data(), legacy.size());
  CHECK((old.family == StateFamily::delta_rule && old.format_version == 1));
  CHECK((old.scalar_bytes == 4 && old.rows == 3 && old.cols == 2 && old.tokens == 3));
  CHECK(old.transition == TransitionKind::decay);
  DeltaOptions saved;
  saved.scale = 0.5;
  DeltaRuleState<float> state =
      linattn::load_bytes<DeltaRuleState<float>>(legacy.data(), legacy.size(), saved);
  CHECK(state.s().cast<double>() == s);
  CHECK(state.tokens() == 3);
  // It continues as the recurrence does, and saves in format 4 what loads the same.
  Vector<float> q(3), k4(3), v4(2);
  q << 1.0f, 0.5f, -0.25f;
  k4 << 0.5f, 0.5f, 0.25f;
  v4 << 1.0f, -2.0f;
  const Vector<float> out = state.step(q, k4, v4, 0.5f);
  const Vector<double> kd = k4.cast<double>();
  s += 0.5 * kd * (v4.cast<double>().transpose() - kd.transpose() * s);
  CHECK(state.s().cast<double>() == s);
  CHECK(out.cast<double>() == Vector<double>(s.transpose() * (0.5 * q.cast<double>())));
  const std::vector<std::uint8_t> upgraded = linattn::save_bytes(state);
  CHECK(linattn::saved_state_info(upgraded).format_version == 4);
  CHECK(linattn::load_bytes<DeltaRuleState<float>>(upgraded, saved).s() == state.s());
  DeltaOptions unscaled;  // Dk^-1/2 is not the 0.5 it was saved with
  CHECK_THROWS_WITH(
      linattn::load_bytes<DeltaRuleState<float>>(legacy.data(), legacy.size(), unscaled),
      Contains("the state was saved with scale"));
  // The legacy magic had only version 1.
  std::string later = legacy;
  later[8] = 2;
  CHECK_THROWS_WITH(linattn::saved_state_info(later.data(), later.size()),
                    Contains("format version 2 of the delta rule's LNATTND format"));
}

#if !defined(_WIN32)
TEMPLATE_TEST_CASE("save_file replaces the file whole and leaves no temporary file",
                   "[state_io][file]", float, double) {
  using T = TestType;
  using Catch::Contains;
  const std::string dir = scratch_directory();
  const std::string path = dir + "/session.state";
  const linattn::EluPlusOne map;
  const RecurrentState<T> first = stepped_state<T>(5, 51);
  linattn::save_file(first, path, map);
  CHECK(directory_entries(dir) == std::vector<std::string>{"session.state"});
  RecurrentState<T> loaded = linattn::load_file<RecurrentState<T>>(path, map, linattn::Options{});
  CHECK(loaded.s() == first.s());
  CHECK(loaded.tokens() == 5);
  // A second save replaces it: the file holds exactly the new state's bytes.
  const RecurrentState<T> second = stepped_state<T>(9, 61);
  linattn::save_file(second, path, map);
  CHECK(directory_entries(dir) == std::vector<std::string>{"session.state"});
  std::ifstream in(path, std::ios::binary);
  const std::string held((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::vector<std::uint8_t> expected = linattn::save_bytes(second, map);
  CHECK(held == std::string(expected.begin(), expected.end()));
  CHECK(linattn::load_file<RecurrentState<T>>(path, map, linattn::Options{}).tokens() == 9);
  // The delta rule's state through a file.
  DeltaOptions normalised;  // the keys are raw Gaussians: normalised in the kernel
  normalised.l2_normalize = true;
  const DeltaRuleState<T> delta = stepped_delta<T>(7, normalised, 71);
  linattn::save_file(delta, dir + "/delta.state");
  CHECK(linattn::load_file<DeltaRuleState<T>>(dir + "/delta.state", normalised).s() == delta.s());
  // A directory that does not exist: an Error naming the file, and nothing written.
  CHECK_THROWS_WITH(linattn::save_file(first, dir + "/missing/session.state", map),
                    Contains("linattn::save_file") && Contains("missing/session.state"));
  CHECK_THROWS_WITH(linattn::load_file<RecurrentState<T>>(dir + "/absent", map, linattn::Options{}),
                    Contains("cannot open") && Contains("absent"));
  CHECK(directory_entries(dir).size() == 2);
  remove_directory(dir);
}
#endif

}  // namespace linattn_test_state_io
