// SPDX-License-Identifier: MIT
#pragma once

#include <cmath>
#include <linattn/config.hpp>
#include <string>
#include <type_traits>
#include <utility>

namespace linattn::detail {

/// "R x C" for messages.
inline std::string shape_string(Eigen::Index rows, Eigen::Index cols) {
  return std::to_string(rows) + " x " + std::to_string(cols);
}

template <class Derived>
std::string shape_string(const Eigen::MatrixBase<Derived>& m) {
  return shape_string(m.rows(), m.cols());
}

template <class Scalar>
constexpr bool is_supported_scalar =
    std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>;

/// Throws unless the options are in range; `where` names the calling function.
inline void validate_options(const Options& options, const char* where) {
  if (!(options.eps >= 0.0) || !std::isfinite(options.eps)) {
    throw Error(std::string(where) + ": Options::eps must be finite and >= 0, got " +
                std::to_string(options.eps));
  }
  if (!(options.decay > 0.0 && options.decay <= 1.0)) {
    throw Error(std::string(where) + ": Options::decay must lie in (0, 1], got " +
                std::to_string(options.decay));
  }
  if (options.chunk < 1) {
    throw Error(std::string(where) + ": Options::chunk must be >= 1, got " +
                std::to_string(options.chunk));
  }
  if (options.threads < 0) {
    throw Error(std::string(where) +
                ": Options::threads must be >= 0 (0 = OpenMP's default), got " +
                std::to_string(options.threads));
  }
}

/// Throws if `m` has no rows or no columns.
template <class Derived>
void require_nonempty(const Eigen::MatrixBase<Derived>& m, const char* where, const char* name) {
  if (m.rows() == 0 || m.cols() == 0) {
    throw Error(std::string(where) + ": " + name + " is empty (" + shape_string(m) + ")");
  }
}

/// Throws naming the first NaN or Inf in `m` by row and column; `first_row` is the index the
/// caller knows m's row 0 by (m may be one chunk of a longer input).
template <class Derived>
void require_finite(const Eigen::MatrixBase<Derived>& m, const char* where, const char* name,
                    Eigen::Index first_row = 0) {
  using Scalar = typename Derived::Scalar;
  // x * 0 is NaN exactly for NaN and +-Inf: one vectorised pass (allFinite is not).
  if ((m.array() * Scalar(0)).sum() == Scalar(0)) return;
  for (Eigen::Index r = 0; r < m.rows(); ++r) {
    for (Eigen::Index c = 0; c < m.cols(); ++c) {
      if (!std::isfinite(m(r, c))) {
        throw Error(std::string(where) + ": " + name + " has a non-finite value (" +
                    std::to_string(static_cast<double>(m(r, c))) + ") at row " +
                    std::to_string(first_row + r) + ", column " + std::to_string(c));
      }
    }
  }
}

/// Shape checks shared by every sequence routine: q, k (N x Dq, N x Dk) and v (N x Dv).
/// `qk_name` is "phi_q"/"phi_k" for featurized inputs and "q"/"k" for raw ones. The linear
/// routines then scan for NaN and Inf with require_finite_parallel.
template <class DQ, class DK, class DV>
void validate_sequence_shapes(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                              const Eigen::MatrixBase<DV>& v, const Options& options,
                              const char* where, const char* q_name, const char* k_name) {
  validate_options(options, where);
  require_nonempty(q, where, q_name);
  require_nonempty(k, where, k_name);
  require_nonempty(v, where, "v");
  if (k.rows() != q.rows() || k.cols() != q.cols()) {
    throw Error(std::string(where) + ": " + k_name + " is " + shape_string(k) + " but " + q_name +
                " is " + shape_string(q) + "; both must have the same shape");
  }
  if (v.rows() != q.rows()) {
    throw Error(std::string(where) + ": v is " + shape_string(v) + " but " + q_name + " is " +
                shape_string(q) + "; they need the same number of rows (tokens)");
  }
}

/// validate_sequence_shapes, then (with check_finite) a scan of all three inputs.
template <class DQ, class DK, class DV>
void validate_sequence(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                       const Eigen::MatrixBase<DV>& v, const Options& options, const char* where,
                       const char* q_name, const char* k_name) {
  validate_sequence_shapes(q, k, v, options, where, q_name, k_name);
  if (options.check_finite) {
    require_finite(q, where, q_name);
    require_finite(k, where, k_name);
    require_finite(v, where, "v");
  }
}

/// Throws unless `out` is rows x cols.
template <class Out>
void require_output_shape(const Out& out, Eigen::Index rows, Eigen::Index cols, const char* where) {
  if (out.rows() != rows || out.cols() != cols) {
    throw Error(std::string(where) + ": out is " + shape_string(out.rows(), out.cols()) +
                " but the result is " + shape_string(rows, cols));
  }
}

/// Returns `dim` if it is >= 1, else throws naming the owner and the dimension.
inline Eigen::Index require_positive_dim(Eigen::Index dim, const char* owner, const char* name) {
  if (dim < 1) {
    throw Error(std::string(owner) + ": " + name + " must be >= 1, got " + std::to_string(dim));
  }
  return dim;
}

/// Throws unless `x` is a row or column vector of `size` entries.
template <class Derived>
void require_vector(const Eigen::MatrixBase<Derived>& x, Eigen::Index size, const char* where,
                    const char* name) {
  if ((x.rows() != 1 && x.cols() != 1) || x.size() != size || size == 0) {
    throw Error(std::string(where) + ": " + name + " is " + shape_string(x) +
                ", expected a vector of " + std::to_string(size) + " entries");
  }
}

/// require_vector and require_finite together.
template <class Derived>
void require_finite_vector(const Eigen::MatrixBase<Derived>& x, Eigen::Index size,
                           const char* where, const char* name) {
  require_vector(x, size, where, name);
  require_finite(x, where, name);
}

/// Throws unless the output vector has `size` entries.
template <class Out>
void require_output_size(const Out& out, Eigen::Index size, const char* where) {
  if (out.size() != size) {
    throw Error(std::string(where) + ": out has " + std::to_string(out.size()) +
                " entries, expected " + std::to_string(size));
  }
}

/// Detects the feature-map concept of DESIGN.md (a `feature_dim(Index)` member).
template <class Map, class = void>
struct is_feature_map : std::false_type {};
template <class Map>
struct is_feature_map<Map, std::void_t<decltype(std::declval<const Map&>().feature_dim(
                               std::declval<Eigen::Index>()))>> : std::true_type {};

/// Detects maps that return rows scaled to max 1 plus a per-row log scale (exponential maps).
template <class Map, class = void>
struct is_log_scaled : std::false_type {};
template <class Map>
struct is_log_scaled<Map, std::enable_if_t<Map::log_scaled>> : std::true_type {};

}  // namespace linattn::detail
