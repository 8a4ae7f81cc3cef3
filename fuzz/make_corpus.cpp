// SPDX-License-Identifier: MIT
// Writes the seed corpora of the fuzzers (deterministic; the files in fuzz/corpus/ came from it):
//   make_corpus <load dir> <kernels dir>
// load/:    format-4 states (files v4_*) of both scalar types: fresh, saved without a map and
//           with one, stepped with each kind of map (Identity, EluPlusOne, Relu, FAVOR+ plain
//           and hyperbolic, Fourier orthogonal and iid, a user map with and without
//           fingerprint()) and with scalar and per-feature gates, with options off their
//           defaults; one followed by trailing bytes, a truncated one, a corrupted one, one
//           whose W hash is wrong under a valid checksum, and two with token
//           counts at and past the limit (regressions); delta-rule states (delta4_*); hybrid
//           session blobs (session_*: fuzz/session_model.hpp, fresh and in each storage). The v1_*
//           files are format 1, written by linattn 0.1.0; the v2_* files (format 2), v3_* (format
//           3) and delta1_* (the delta rule's LNATTND 1) were written by this program while those
//           formats were current (the same states): they must keep loading, and are never
//           regenerated (v2_empty and v3_empty are the empty input);
// kernels/: a few inputs in the layout of kernel_input.hpp, one per feature map and type.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <linattn/linattn.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kernel_input.hpp"
#include "session_model.hpp"

namespace {

using Eigen::Index;

std::uint64_t g_rng = 0x9E3779B97F4A7C15ull;

std::uint64_t next_random() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}

template <class T>
linattn::Matrix<T> random_matrix(Index rows, Index cols) {
  linattn::Matrix<T> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) {
    m.data()[i] = static_cast<T>(static_cast<double>(next_random() >> 11) * 0x1p-53 * 4.0 - 2.0);
  }
  return m;
}

bool write_file(const std::string& path, const std::string& bytes) {
  std::ofstream os(path, std::ios::binary | std::ios::trunc);
  os.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!os) {
    std::fprintf(stderr, "make_corpus: cannot write %s\n", path.c_str());
    return false;
  }
  return true;
}

/// The user maps fuzz_load.cpp tries (the same two).
struct TwiceFeatures {
  Index feature_dim(Index input_dim) const { return input_dim; }
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

template <class T>
std::string saved(const linattn::RecurrentState<T>& state) {
  std::ostringstream os;
  state.save(os);
  return os.str();
}

template <class T, class Map>
std::string saved(const linattn::RecurrentState<T>& state, const Map& map) {
  std::ostringstream os;
  state.save(os, map);
  return os.str();
}

/// A state of C x Dv after `tokens` steps with `map`, saved with the map; with gates of
/// `gate_dim` entries per token (1: scalar, C: per feature) when gate_dim > 0.
template <class T, class Map>
std::string stepped_state(Index dk, Index dv, const Map& map, Index tokens,
                          const linattn::Options& options, Index gate_dim = 0) {
  linattn::RecurrentState<T> state(map.feature_dim(dk), dv, options);
  const linattn::Matrix<T> q = random_matrix<T>(tokens, dk);
  const linattn::Matrix<T> k = random_matrix<T>(tokens, dk);
  const linattn::Matrix<T> v = random_matrix<T>(tokens, dv);
  const linattn::Vector<T> gate = linattn::Vector<T>::LinSpaced(gate_dim, T(0.5), T(1));
  for (Index i = 0; i < tokens; ++i) {
    if (gate_dim > 0) {
      (void)state.step(q.row(i), k.row(i), v.row(i), gate, map);
    } else {
      (void)state.step(q.row(i), k.row(i), v.row(i), map);
    }
  }
  return saved(state, map);
}

/// `state` (as save wrote it) with the CRC-32 recomputed after an edit.
std::string with_checksum(std::string state) {
  linattn::detail::Crc32 crc;
  crc.update(reinterpret_cast<const unsigned char*>(state.data()), state.size() - 4);
  const std::uint32_t sum = crc.value();
  for (std::size_t i = 0; i < 4; ++i) {
    state[state.size() - 4 + i] = static_cast<char>((sum >> (8 * i)) & 0xFFu);
  }
  return state;
}

/// `state` with the little-endian uint64 at `at` replaced, the CRC-32 recomputed.
std::string with_u64(std::string state, std::size_t at, std::uint64_t value) {
  for (std::size_t i = 0; i < 8; ++i) {
    state[at + i] = static_cast<char>((value >> (8 * i)) & 0xFFu);
  }
  return with_checksum(state);
}

// Format 4 (detail/state_record.hpp documents the layout): the token count at byte 34, the map
// record's W hash at byte 103.
constexpr std::size_t kTokensAt = 34;
constexpr std::size_t kHashAt = 103;

std::string kernel_input(std::uint8_t flags, int map, int n, int dk, int dv, int m, int seed,
                         int eps, int decay, int chunk, int scale, int window, int split,
                         int magnitude, int temperature, int value_bytes) {
  std::string bytes;
  bytes.push_back(static_cast<char>(flags | (map << linattn_fuzz::kMapShift)));
  bytes.push_back(static_cast<char>(n - 1));
  bytes.push_back(static_cast<char>((dk - 1) | ((dv - 1) << 4)));
  bytes.push_back(static_cast<char>((m - 1) | (seed << 4)));
  bytes.push_back(static_cast<char>(eps));
  bytes.push_back(static_cast<char>(decay));
  bytes.push_back(static_cast<char>(chunk));
  bytes.push_back(static_cast<char>(scale | (window << 4)));
  bytes.push_back(static_cast<char>(split));
  bytes.push_back(static_cast<char>(magnitude | (temperature << 4)));
  for (int i = 0; i < value_bytes; ++i) bytes.push_back(static_cast<char>(next_random() >> 56));
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: make_corpus <load dir> <kernels dir>\n");
    return 2;
  }
  const std::string load = std::string(argv[1]) + "/";
  const std::string kernels = std::string(argv[2]) + "/";
  bool ok = true;

  // --- load/ ---
  linattn::Options decayed;
  decayed.decay = 0.9;
  decayed.eps = 1e-3;
  decayed.chunk = 16;
  linattn::Options plain;
  plain.normalize = false;
  plain.check_finite = false;
  plain.eps = 0.0;

  const std::string v4 = load + "v4_";
  linattn::RandomFeatureOptions hyperbolic;
  hyperbolic.hyperbolic = true;
  linattn::RandomFeatureOptions iid;
  iid.projection = linattn::Projection::iid;
  iid.row_norm = linattn::RowNorm::fixed;
  ok &= write_file(v4 + "float_fresh_4x3_no_map", saved(linattn::RecurrentState<float>(4, 3)));
  ok &= write_file(v4 + "double_fresh_1x1_identity",
                   saved(linattn::RecurrentState<double>(1, 1), linattn::Identity{}));
  const std::string float_elu = stepped_state<float>(4, 3, linattn::EluPlusOne{}, 5, decayed);
  ok &= write_file(v4 + "float_elu_decay", float_elu);
  ok &= write_file(v4 + "double_identity",
                   stepped_state<double>(3, 2, linattn::Identity{}, 3, linattn::Options{}));
  ok &= write_file(v4 + "double_relu_unnormalized",
                   stepped_state<double>(2, 5, linattn::Relu{}, 4, plain));
  const std::string double_favor =
      stepped_state<double>(3, 2, linattn::PositiveRandomFeatures(3, 6, 7), 6, linattn::Options{});
  ok &= write_file(v4 + "double_favor", double_favor);
  ok &=
      write_file(v4 + "float_favor_decay",
                 stepped_state<float>(2, 2, linattn::PositiveRandomFeatures(2, 4, 1), 3, decayed));
  ok &= write_file(v4 + "double_favor_hyperbolic",
                   stepped_state<double>(2, 2, linattn::PositiveRandomFeatures(2, 3, 4, hyperbolic),
                                         4, linattn::Options{}));
  ok &= write_file(
      v4 + "double_fourier",
      stepped_state<double>(2, 3, linattn::RandomFourierFeatures(2, 2, 3), 4, linattn::Options{}));
  ok &= write_file(
      v4 + "float_fourier_iid",
      stepped_state<float>(3, 2, linattn::RandomFourierFeatures(3, 2, 5, iid), 3, plain));
  ok &= write_file(v4 + "float_user_map",
                   stepped_state<float>(2, 2, TwiceFeatures{}, 2, linattn::Options{}));
  ok &= write_file(v4 + "double_user_fingerprint",
                   stepped_state<double>(2, 3, FingerprintedFeatures{}, 3, decayed));
  ok &= write_file(v4 + "float_scalar_gates",
                   stepped_state<float>(3, 2, linattn::Identity{}, 4, linattn::Options{}, 1));
  ok &= write_file(v4 + "double_feature_gates",
                   stepped_state<double>(3, 2, linattn::EluPlusOne{}, 5, plain, 3));
  ok &= write_file(v4 + "float_trailing_bytes", float_elu + "trailing");
  // Regressions: a token count at the limit (loads; the next step must throw linattn::Error)
  // and one past it (INT64_MAX: refused by load; once accepted, and ++tokens overflowed).
  ok &=
      write_file(v4 + "float_tokens_limit", with_u64(float_elu, kTokensAt, std::uint64_t{1} << 62));
  ok &= write_file(v4 + "float_tokens_int64_max",
                   with_u64(float_elu, kTokensAt,
                            static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())));
  ok &= write_file(v4 + "float_truncated", float_elu.substr(0, float_elu.size() - 7));
  std::string corrupted = float_elu;
  corrupted[corrupted.size() / 2] = static_cast<char>(corrupted[corrupted.size() / 2] ^ 0x10);
  ok &= write_file(v4 + "float_corrupted", corrupted);
  // Loads unchecked; a checked load with PositiveRandomFeatures(3, 6, 7) names the W hash.
  ok &= write_file(v4 + "double_favor_wrong_hash", with_u64(double_favor, kHashAt, 0));

  // Delta-rule states: Gated DeltaNet in float, KDA in double,
  // a fresh one, and a truncated one.
  {
    linattn::DeltaOptions delta;
    delta.l2_normalize = true;
    linattn::DeltaRuleState<float> gdn(4, 3, delta);
    linattn::DeltaRuleState<double> kda(3, 2);
    const linattn::Vector<float> kf = linattn::Vector<float>::Constant(4, 0.5f);
    const linattn::Vector<float> vf = linattn::Vector<float>::LinSpaced(3, -1.0f, 1.0f);
    const linattn::Vector<double> kd = linattn::Vector<double>::Constant(3, 0.5);
    const linattn::Vector<double> vd = linattn::Vector<double>::LinSpaced(2, -1.0, 1.0);
    for (int t = 0; t < 3; ++t) {
      (void)gdn.step(kf, kf, vf, linattn::log_gates(linattn::Vector<float>::Constant(1, -0.1f)),
                     0.5f);
      (void)kda.step(kd, kd, vd, linattn::Vector<double>::Constant(3, 0.9), 0.7);
    }
    std::ostringstream gdn_bytes, kda_bytes, fresh;
    gdn.save(gdn_bytes);
    kda.save(kda_bytes);
    linattn::DeltaRuleState<float>(2, 2).save(fresh);
    ok &= write_file(load + "delta4_float_gated", gdn_bytes.str());
    ok &= write_file(load + "delta4_double_kda", kda_bytes.str());
    ok &= write_file(load + "delta4_float_fresh", fresh.str());
    ok &= write_file(load + "delta4_float_truncated",
                     gdn_bytes.str().substr(0, gdn_bytes.str().size() - 3));
  }

  // Hybrid sessions (fuzz/session_model.hpp) in each storage: fresh, and after 5 tokens.
  {
    const linattn_fuzz::SessionModel model;
    linattn::SessionPool<> pool = model.pool();
    pool.add(1);
    const auto blob = [&](linattn::SessionStorage storage) {
      const std::vector<std::uint8_t> bytes = pool.save_bytes(1, storage);
      return std::string(bytes.begin(), bytes.end());
    };
    ok &= write_file(load + "session_fresh", blob(linattn::SessionStorage::exact));
    model.advance(pool, 1, 5, 7);
    ok &= write_file(load + "session_exact", blob(linattn::SessionStorage::exact));
    ok &= write_file(load + "session_bf16", blob(linattn::SessionStorage::bf16));
    ok &= write_file(load + "session_int8", blob(linattn::SessionStorage::int8));
  }

  // The kernels/ files were written after the 185 draws of 0.1.0's load/ section; replaying
  // them from the seed keeps those files as committed.
  g_rng = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < 185; ++i) (void)next_random();

  // --- kernels/ --- (flags, map, N, Dk, Dv, m, seed, eps, decay, chunk, scale, window, split,
  //                    magnitude, temperature, value bytes)
  using namespace linattn_fuzz;
  ok &= write_file(kernels + "float_elu",
                   kernel_input(0, 0, 20, 4, 3, 1, 0, 0, 0, 0, 0, 4, 7, 0, 0, 64));
  ok &= write_file(kernels + "double_relu_decay",
                   kernel_input(kFlagDouble, 1, 33, 3, 5, 1, 0, 1, 2, 4, 3, 2, 16, 1, 0, 48));
  ok &= write_file(kernels + "float_favor",
                   kernel_input(0, 2, 64, 5, 4, 8, 3, 0, 1, 5, 0, 5, 63, 0, 0, 80));
  ok &= write_file(kernels + "double_favor_hyperbolic",
                   kernel_input(kFlagDouble, 3, 17, 8, 2, 6, 1, 2, 3, 2, 1, 3, 9, 0, 2, 40));
  ok &= write_file(kernels + "float_favor_iid_unnormalized",
                   kernel_input(kFlagNoNormalize, 4, 40, 2, 2, 3, 5, 0, 4, 6, 4, 1, 20, 0, 1, 32));
  ok &= write_file(kernels + "double_fourier",
                   kernel_input(kFlagDouble, 5, 12, 3, 3, 4, 2, 4, 0, 1, 2, 6, 5, 1, 3, 24));
  ok &= write_file(kernels + "float_raw_features", kernel_input(kFlagNonCausalSoftmax, 6, 9, 2, 4,
                                                                1, 0, 3, 5, 3, 0, 0, 3, 0, 0, 16));
  ok &= write_file(kernels + "float_fourier_iid_big",
                   kernel_input(0, 7, 30, 6, 6, 16, 9, 0, 0, 0, 0, 2, 0, 4, 0, 32));
  // Values 32767, -32768 and -32767 are +Inf, NaN and -Inf under the specials flag.
  std::string specials = kernel_input(kFlagSpecials | kFlagNoCheckFinite, 0, 8, 2, 2, 1, 0, 0, 0, 0,
                                      0, 1, 4, 0, 0, 96);
  specials.replace(kHeaderBytes + 6, 6, std::string("\xff\x7f\x00\x80\x01\x80", 6));
  ok &= write_file(kernels + "float_specials_unchecked", specials);
  specials[0] = static_cast<char>(specials[0] & ~kFlagNoCheckFinite);
  ok &= write_file(kernels + "float_specials_checked", specials);
  ok &= write_file(kernels + "double_invalid_options",
                   kernel_input(kFlagDouble, 2, 4, 2, 2, 2, 0, 7, 8, 9, 5, 7, 2, 5, 4, 8));
  return ok ? 0 : 1;
}
