// SPDX-License-Identifier: MIT
// What fuzz_kernels' translation units share: the decoded input, the value stream, the
// comparisons and the failure report, and the checks each unit defines (fuzz_kernels.cpp says
// what they check). The checks are split over units so that the fuzz build compiles them side
// by side.
#pragma once

#include <algorithm>
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
#include <type_traits>
#include <vector>

#include "kernel_input.hpp"

namespace linattn_fuzz {

using Eigen::Index;
using linattn::Matrix;
using linattn::Vector;
namespace lf = ::linattn_fuzz;

/// The decoded input.
struct Input {
  bool is_double = false;
  lf::MapKind map = lf::MapKind::elu_plus_one;
  bool specials = false;
  bool softmax_causal = true;
  Index n = 1, dk = 1, dv = 1, m = 1;
  std::uint64_t seed = 0;
  linattn::Options options;
  bool options_valid = true;
  double scale = -1;
  bool scale_valid = true;
  Index window = 1;
  bool window_valid = true;
  Index split = 0;
  double magnitude = 10;
  bool bounded_magnitude = true;
  double temperature = -1;
  bool temperature_valid = true;
  const std::uint8_t* values = nullptr;
  std::size_t value_bytes = 0;
  std::uint64_t stream_seed = 0;
};

inline std::string describe(const Input& in) {
  static const char* const kMaps[] = {"EluPlusOne",    "Relu",
                                      "PRF",           "PRF hyperbolic",
                                      "PRF iid/fixed", "RandomFourierFeatures",
                                      "raw features",  "RandomFourierFeatures iid"};
  char buf[512];
  std::snprintf(
      buf, sizeof(buf),
      "%s %s N=%lld Dk=%lld Dv=%lld m=%lld seed=%llu eps=%g decay=%g chunk=%lld "
      "normalize=%d check_finite=%d specials=%d magnitude=%g temperature=%g "
      "scale=%g window=%lld split=%lld softmax_causal=%d",
      in.is_double ? "double" : "float", kMaps[static_cast<int>(in.map)],
      static_cast<long long>(in.n), static_cast<long long>(in.dk), static_cast<long long>(in.dv),
      static_cast<long long>(in.m), static_cast<unsigned long long>(in.seed), in.options.eps,
      in.options.decay, static_cast<long long>(in.options.chunk), in.options.normalize,
      in.options.check_finite, in.specials, in.magnitude, in.temperature, in.scale,
      static_cast<long long>(in.window), static_cast<long long>(in.split), in.softmax_causal);
  return buf;
}

inline const Input* g_input = nullptr;  // for the failure message

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_kernels: property violated: %s\n  input: %s\n", what.c_str(),
               g_input ? describe(*g_input).c_str() : "?");
  std::abort();
}

/// int16 values: from the input while it lasts, then from a xorshift stream.
class ValueStream {
 public:
  explicit ValueStream(const Input& in)
      : data_(in.values), size_(in.value_bytes), state_(in.stream_seed) {}

  std::int16_t next() {
    std::uint16_t bits;
    if (pos_ + 2 <= size_) {
      bits = static_cast<std::uint16_t>(data_[pos_] | (data_[pos_ + 1] << 8));
      pos_ += 2;
    } else {
      state_ ^= state_ << 13;
      state_ ^= state_ >> 7;
      state_ ^= state_ << 17;
      bits = static_cast<std::uint16_t>(state_ >> 24);
    }
    std::int16_t value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
  std::uint64_t state_;
};

template <class T>
T to_scalar(double x) {
  // A double beyond float's range converts to +-Inf explicitly (the plain cast is undefined).
  if (std::is_same_v<T, float> && std::isfinite(x) &&
      std::abs(x) > static_cast<double>(std::numeric_limits<float>::max())) {
    return std::copysign(std::numeric_limits<T>::infinity(), static_cast<T>(x > 0 ? 1 : -1));
  }
  return static_cast<T>(x);
}

template <class T>
Matrix<T> fill(Index rows, Index cols, ValueStream& stream, const Input& in) {
  Matrix<T> m(rows, cols);
  for (Index i = 0; i < m.size(); ++i) {
    const std::int16_t raw = stream.next();
    double x = static_cast<double>(raw) * (in.magnitude / 32768.0);
    if (in.specials) {
      if (raw == 32767) x = lf::kInf;
      if (raw == -32767) x = -lf::kInf;
      if (raw == -32768) x = lf::kNaN;
    }
    m.data()[i] = to_scalar<T>(x);
  }
  return m;
}

template <class T>
constexpr double kRelTol = std::is_same_v<T, float> ? 1e-3 : 1e-8;

template <class D>
double max_abs(const Eigen::MatrixBase<D>& m) {
  return m.size() == 0 ? 0.0 : static_cast<double>(m.cwiseAbs().maxCoeff());
}

template <class A, class B>
void require_close(const char* what, const Eigen::MatrixBase<A>& a, const Eigen::MatrixBase<B>& b,
                   double tol) {
  if (a.rows() != b.rows() || a.cols() != b.cols()) fail(std::string(what) + ": shapes differ");
  double worst = 0.0;
  Index where = 0;
  for (Index r = 0; r < a.rows(); ++r) {
    for (Index c = 0; c < a.cols(); ++c) {
      const double d = std::abs(static_cast<double>(a(r, c)) - static_cast<double>(b(r, c)));
      if (!(d <= worst)) {
        worst = d;
        where = r;
      }
    }
  }
  if (!(worst <= tol)) {
    char buf[256];
    std::snprintf(buf, sizeof(buf), "%s: max |a - b| = %g at row %lld exceeds %g", what, worst,
                  static_cast<long long>(where), tol);
    fail(buf);
  }
}

template <class D>
void require_finite(const char* what, const Eigen::MatrixBase<D>& m) {
  if (!m.allFinite()) fail(std::string(what) + ": non-finite output for finite bounded input");
}

template <class D>
bool bit_equal(const Eigen::MatrixBase<D>& a, const Eigen::MatrixBase<D>& b) {
  // An empty matrix may have no data pointer at all (memcmp must not see it).
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.size() == 0 ||
          std::memcmp(a.derived().data(), b.derived().data(),
                      static_cast<std::size_t>(a.size()) * sizeof(typename D::Scalar)) == 0);
}

/// Runs f; a linattn::Error is fine unless `must_succeed`. Returns whether f completed.
template <class F>
bool attempt(const char* what, bool must_succeed, F&& f) {
  try {
    f();
    return true;
  } catch (const linattn::Error& e) {
    if (must_succeed) fail(std::string(what) + " threw for valid input: " + e.what());
    return false;
  }
}

/// phi(x) = x as a user's map: raw q and k used as (signed) features through the mapped
/// (featurize-per-chunk) path, where linattn::Identity reads them in place.
struct PassThrough {
  Index feature_dim(Index input_dim) const { return input_dim; }
  template <class D>
  Matrix<typename D::Scalar> queries(const Eigen::MatrixBase<D>& x) const {
    return x;
  }
  template <class D>
  Matrix<typename D::Scalar> keys(const Eigen::MatrixBase<D>& x) const {
    return x;
  }
};

/// What the linear-kernel checks may assume.
struct Regime {
  bool must_succeed;  // finite |x| <= 10 inputs, valid options: no Error
  bool check;         // and a positive map: finite outputs
  bool agree;         // and a well-conditioned denominator: forms agree
};

/// Log gates for the gated kernels, drawn from the seed: scalar (N x 1) or per feature (N x C)
/// by the seed's low bit, each log(decay) times a uniform in [0, 2] (0: no gate), and resets
/// (-infinity) at about one token in eight when the seed's second bit is set.
template <class T>
Matrix<T> draw_log_gates(const Input& in, Index feature_dim) {
  std::uint64_t x = in.seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
  const auto next = [&x] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return x;
  };
  const Index cols = (in.seed & 1u) ? feature_dim : 1;
  const bool resets = (in.seed & 2u) != 0;
  // A decay the gated calls may not take (they need decay 1) still sets the gates' strength.
  const double strength =
      in.options_valid && in.options.decay > 0.0 ? std::log(in.options.decay) : std::log(0.5);
  Matrix<T> g(in.n, cols);
  for (Index r = 0; r < in.n; ++r) {
    const bool reset = resets && (next() % 8 == 0);
    for (Index c = 0; c < cols; ++c) {
      const double u = static_cast<double>(next() % 1025) / 512.0;
      g(r, c) = reset ? -std::numeric_limits<T>::infinity() : static_cast<T>(strength * u);
    }
  }
  return g;
}

/// The linear engine on one map (fuzz_kernels_engine.cpp): the forward kernels, then the
/// backward with it.
template <class T, class Map>
void run_engine(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                const Matrix<T>& grad_out, const Map& map, bool positive, bool bounded,
                bool backward_bounded);

/// The softmax baselines (fuzz_kernels_delta.cpp).
template <class T>
void run_softmax(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                 bool bounded);

/// The delta rule, forward and backward (fuzz_kernels_delta.cpp).
template <class T>
void run_delta(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
               bool bounded);
/// The generalized delta rule on RWKV-7's pairs, every surface (fuzz_kernels_delta.cpp).
template <class T>
void run_dplr(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
              bool bounded);

/// The short convolution, forward, windows and backward (fuzz_kernels_delta.cpp).
template <class T>
void run_conv(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
              bool bounded);

/// Qwen3.5's Gated DeltaNet mixer, forward, prefill and steps (fuzz_kernels_delta.cpp).
template <class T>
void run_gated_delta_net(const Input& in, const Matrix<T>& q, const Matrix<T>& k,
                         const Matrix<T>& v, bool bounded);

/// The Mamba-2 mixer, forward, prefill and steps (fuzz_kernels_delta.cpp).
template <class T>
void run_mamba2(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                bool bounded);

/// RWKV-7's time-mixing mixer, forward, prefill and steps (fuzz_kernels_delta.cpp).
template <class T>
void run_rwkv7_time_mix(const Input& in, const Matrix<T>& q, const Matrix<T>& k, bool bounded);

}  // namespace linattn_fuzz
