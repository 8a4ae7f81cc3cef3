// SPDX-License-Identifier: MIT
#pragma once

#include <cmath>
#include <cstdint>
#include <linattn/config.hpp>
#include <random>

// Everything here uses only operations IEEE 754 rounds exactly (+, -, *, /, sqrt, fma, frexp)
// in a fixed order, and no libm transcendental, so a seed gives the same W bit for bit on every
// platform and compiler (unless -ffast-math lets the compiler reorder floating point).
namespace linattn::detail {

/// Natural log of a positive finite x from frexp and a fixed atanh series.
inline double portable_log(double x) {
  constexpr double kLn2 = 0.69314718055994530941723212145818;
  constexpr double kSqrtHalf = 0.70710678118654752440084436210485;
  int exponent = 0;
  double mantissa = std::frexp(x, &exponent);  // [0.5, 1)
  if (mantissa < kSqrtHalf) {
    mantissa *= 2.0;
    --exponent;
  }
  // log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.1716: 12 odd terms reach 1e-18.
  const double s = (mantissa - 1.0) / (mantissa + 1.0);
  const double s2 = s * s;
  double series = 1.0 / 23.0;
  for (int k = 21; k >= 1; k -= 2) series = std::fma(series, s2, 1.0 / k);
  return std::fma(static_cast<double>(exponent), kLn2, 2.0 * s * series);
}

/// Standard normal samples by Marsaglia's polar method from std::mt19937_64, whose stream the
/// C++ standard fixes; std::normal_distribution's output differs between standard libraries.
class NormalSampler {
 public:
  explicit NormalSampler(std::uint64_t seed) : engine_(seed) {}

  double operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u1 = 0.0, u2 = 0.0, radius2 = 0.0;
    do {
      u1 = 2.0 * uniform() - 1.0;
      u2 = 2.0 * uniform() - 1.0;
      radius2 = std::fma(u1, u1, u2 * u2);
    } while (radius2 >= 1.0 || radius2 == 0.0);
    const double factor = std::sqrt(-2.0 * portable_log(radius2) / radius2);
    spare_ = u2 * factor;
    has_spare_ = true;
    return u1 * factor;
  }

 private:
  /// 53 random bits in [0, 1).
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }

  std::mt19937_64 engine_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

/// Fills a rows x cols matrix with iid N(0, 1) entries, row by row.
inline Matrix<double> gaussian_matrix(Eigen::Index rows, Eigen::Index cols, NormalSampler& sample) {
  Matrix<double> g(rows, cols);
  for (Eigen::Index r = 0; r < rows; ++r) {
    for (Eigen::Index c = 0; c < cols; ++c) g(r, c) = sample();
  }
  return g;
}

/// Sequential fma dot product of rows a and b of length n (fixed order, no SIMD reduction).
inline double ordered_dot(const double* a, const double* b, Eigen::Index n) {
  double sum = 0.0;
  for (Eigen::Index i = 0; i < n; ++i) sum = std::fma(a[i], b[i], sum);
  return sum;
}

/// Scales row r of m to Euclidean norm `norm`, in a fixed order.
inline void set_row_norm(Matrix<double>& m, Eigen::Index r, double norm) {
  double* row = m.row(r).data();
  const double factor = norm / std::sqrt(ordered_dot(row, row, m.cols()));
  for (Eigen::Index i = 0; i < m.cols(); ++i) row[i] *= factor;
}

/// Orthonormalises the rows of a square Gaussian block in place (modified Gram-Schmidt, run
/// twice for orthogonality to working precision). Gram-Schmidt of iid Gaussian rows gives a
/// Haar-distributed orthogonal matrix, the same as QR with the sign of R's diagonal fixed.
inline void orthonormalize_rows(Matrix<double>& block) {
  const Eigen::Index n = block.cols();
  for (Eigen::Index r = 0; r < block.rows(); ++r) {
    double* row = block.row(r).data();
    for (int pass = 0; pass < 2; ++pass) {
      for (Eigen::Index p = 0; p < r; ++p) {
        const double* previous = block.row(p).data();
        const double projection = ordered_dot(row, previous, n);
        for (Eigen::Index i = 0; i < n; ++i) row[i] = std::fma(-projection, previous[i], row[i]);
      }
    }
    LINATTN_ASSERT(ordered_dot(row, row, n) > 0.0);
    set_row_norm(block, r, 1.0);
  }
}

}  // namespace linattn::detail
