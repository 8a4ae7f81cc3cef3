// SPDX-License-Identifier: MIT
#pragma once

#include <cmath>
#include <cstdint>
#include <linattn/config.hpp>
#include <random>

namespace linattn::detail {

/// Standard normal samples from std::mt19937_64 by Box-Muller. The engine's stream is fixed by
/// the C++ standard and the transform is ours, so a seed gives the same numbers on every
/// standard library (std::normal_distribution does not).
class NormalSampler {
 public:
  explicit NormalSampler(std::uint64_t seed) : engine_(seed) {}

  double operator()() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    // 53 random bits in (0, 1]: log never sees 0.
    const double u1 = (static_cast<double>(engine_() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(engine_() >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 6.283185307179586476925286766559 * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

/// Fills an m x d matrix with iid N(0, 1) entries, row by row.
inline Matrix<double> gaussian_matrix(Eigen::Index rows, Eigen::Index cols, NormalSampler& sample) {
  Matrix<double> g(rows, cols);
  for (Eigen::Index r = 0; r < rows; ++r) {
    for (Eigen::Index c = 0; c < cols; ++c) g(r, c) = sample();
  }
  return g;
}

/// Orthonormalises the rows of a square Gaussian block in place (modified Gram-Schmidt, run
/// twice for orthogonality to working precision). Gram-Schmidt of iid Gaussian rows gives a
/// Haar-distributed orthogonal matrix, the same as QR with the sign of R's diagonal fixed.
inline void orthonormalize_rows(Matrix<double>& block) {
  for (Eigen::Index r = 0; r < block.rows(); ++r) {
    for (int pass = 0; pass < 2; ++pass) {
      for (Eigen::Index p = 0; p < r; ++p) {
        block.row(r) -= block.row(r).dot(block.row(p)) * block.row(p);
      }
    }
    const double norm = block.row(r).norm();
    LINATTN_ASSERT(norm > 0.0);
    block.row(r) /= norm;
  }
}

}  // namespace linattn::detail
