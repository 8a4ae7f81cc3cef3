// SPDX-License-Identifier: MIT
#pragma once

#include <cmath>
#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/detail/convert.hpp>
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

/// The accumulation types: every sum and state is float or double.
template <class Scalar>
constexpr bool is_supported_scalar =
    std::is_same_v<Scalar, float> || std::is_same_v<Scalar, double>;

/// Eigen's 16-bit floats: accepted as inputs and outputs, never accumulated in (their
/// arithmetic is emulated on most CPUs and a sum of a few thousand terms loses every digit).
template <class Scalar>
constexpr bool is_half_scalar =
    std::is_same_v<Scalar, Eigen::half> || std::is_same_v<Scalar, Eigen::bfloat16>;

/// The input and output types of the linear routines and RecurrentState.
template <class Scalar>
constexpr bool is_input_scalar = is_supported_scalar<Scalar> || is_half_scalar<Scalar>;

/// The accumulation type when the caller names none: float for 16-bit inputs, else the input
/// type itself.
template <class Scalar>
using default_accumulator_t = std::conditional_t<is_half_scalar<Scalar>, float, Scalar>;

/// The accumulation type: Acc, or when Acc is void the input scalar (float for 16-bit inputs).
template <class Acc, class Scalar>
using accumulator_t = std::conditional_t<std::is_void_v<Acc>, default_accumulator_t<Scalar>, Acc>;

/// True if any entry of `m` (a 16-bit float type) is NaN or +-Inf: a pass over the bits, since
/// the arithmetic scan of require_finite would be emulated element by element.
template <class Derived>
bool has_nonfinite_half(const Eigen::MatrixBase<Derived>& m) {
  using Scalar = typename Derived::Scalar;
  if constexpr (bool(Derived::Flags & Eigen::DirectAccessBit) &&
                Derived::InnerStrideAtCompileTime == 1) {
    const Derived& memory = m.derived();
    for (Eigen::Index o = 0; o < memory.outerSize(); ++o) {
      if (has_nonfinite_bits(memory.data() + o * memory.outerStride(), memory.innerSize())) {
        return true;
      }
    }
    return false;
  } else {
    constexpr std::uint16_t exponent = kExponentBits<Scalar>;
    const Eigen::internal::evaluator<Derived> eval(m.derived());
    for (Eigen::Index c = 0; c < m.cols(); ++c) {
      for (Eigen::Index r = 0; r < m.rows(); ++r) {
        const Scalar x = eval.coeff(r, c);
        if ((Eigen::numext::bit_cast<std::uint16_t>(x) & exponent) == exponent) return true;
      }
    }
    return false;
  }
}

/// Throws unless the settings every family shares are in range; `where` names the calling
/// function, `owner` the options struct the caller passed ("DeltaOptions", ...).
inline void validate_kernel_options(const KernelOptions& options, const char* where,
                                    const char* owner) {
  if (options.chunk < 1) {
    throw Error(std::string(where) + ": " + owner + "::chunk must be >= 1, got " +
                std::to_string(options.chunk));
  }
  if (options.threads < 0) {
    throw Error(std::string(where) + ": " + owner +
                "::threads must be >= 0 (0 = OpenMP's default), got " +
                std::to_string(options.threads));
  }
  if (options.head_grouping != HeadGrouping::interleaved &&
      options.head_grouping != HeadGrouping::tiled) {
    throw Error(std::string(where) + ": " + owner +
                "::head_grouping must be HeadGrouping::interleaved or HeadGrouping::tiled, got " +
                std::to_string(static_cast<int>(options.head_grouping)));
  }
}

/// Throws unless the engine's options are in range (the shared ones through
/// validate_kernel_options); `where` names the calling function, `owner` the options' type.
inline void validate_options(const Options& options, const char* where,
                             const char* owner = "Options") {
  if (!(options.eps >= 0.0) || !std::isfinite(options.eps)) {
    throw Error(std::string(where) + ": " + owner + "::eps must be finite and >= 0, got " +
                std::to_string(options.eps));
  }
  if (!(options.decay > 0.0 && options.decay <= 1.0)) {
    throw Error(std::string(where) + ": " + owner + "::decay must lie in (0, 1], got " +
                std::to_string(options.decay));
  }
  if (!(options.scale > 0.0) || !std::isfinite(options.scale)) {
    throw Error(std::string(where) + ": " + owner + "::scale must be finite and > 0, got " +
                std::to_string(options.scale));
  }
  validate_kernel_options(options, where, owner);
}

/// A layer's head counts for messages: "H = 32 (q 16, k 16, v 32 heads)".
inline std::string heads_string(const LayerHeads& heads) {
  return "H = " + std::to_string(heads.out) + " (q " + std::to_string(heads.query) + ", k " +
         std::to_string(heads.key) + ", v " + std::to_string(heads.value) + " heads)";
}

/// Throws unless every head count is >= 1 and q's, k's and v's divide H.
inline void validate_layer_heads(const LayerHeads& heads, const char* where) {
  if (heads.out < 1) {
    throw Error(std::string(where) + ": heads must be >= 1, got " + std::to_string(heads.out));
  }
  const auto divides = [&](Eigen::Index in) { return in >= 1 && heads.out % in == 0; };
  if (!divides(heads.query) || !divides(heads.key) || !divides(heads.value)) {
    throw Error(std::string(where) + ": the heads are " + heads_string(heads) +
                "; each input's heads must be a divisor of H (grouped heads), e.g. "
                "LayerHeads::grouped_query_key(32, 16) for 16 q/k heads over 32 value heads");
  }
}

/// log Options::scale, the log factor every output row gets for it (0 for the default 1).
inline double output_log_scale(const Options& options) {
  return options.scale == 1.0 ? 0.0 : std::log(options.scale);
}

/// Throws if `m` has no rows or no columns.
template <class Derived>
void require_nonempty(const Eigen::MatrixBase<Derived>& m, const char* where, const char* name) {
  if (m.rows() == 0 || m.cols() == 0) {
    throw Error(std::string(where) + ": " + name + " is empty (" + shape_string(m) + ")");
  }
}

/// std::isfinite, extended to the 16-bit float types.
template <class Scalar>
bool is_finite_value(Scalar x) {
  if constexpr (is_half_scalar<Scalar>) {
    return (Eigen::numext::isfinite)(x);
  } else {
    return std::isfinite(x);
  }
}

/// True when `m` holds no NaN and no infinity: one vectorised pass.
template <class Derived>
bool all_finite(const Eigen::MatrixBase<Derived>& m) {
  using Scalar = typename Derived::Scalar;
  if constexpr (is_half_scalar<Scalar>) {
    return !has_nonfinite_half(m);
  } else {
    // x * 0 is NaN exactly for NaN and +-Inf (allFinite is not vectorised).
    return (m.array() * Scalar(0)).sum() == Scalar(0);
  }
}

/// Throws naming the first NaN or Inf in `m` by row and column; `first_row` is the index the
/// caller knows m's row 0 by (m may be one chunk of a longer input).
template <class Derived>
void require_finite(const Eigen::MatrixBase<Derived>& m, const char* where, const char* name,
                    Eigen::Index first_row = 0) {
  using Scalar = typename Derived::Scalar;
  if (all_finite(m)) return;
  for (Eigen::Index r = 0; r < m.rows(); ++r) {
    for (Eigen::Index c = 0; c < m.cols(); ++c) {
      if (!is_finite_value<Scalar>(m(r, c))) {
        throw Error(std::string(where) + ": " + name + " has a non-finite value (" +
                    std::to_string(static_cast<double>(m(r, c))) + ") at row " +
                    std::to_string(first_row + r) + ", column " + std::to_string(c));
      }
    }
  }
}

/// Shape checks of non-causal attention, whose queries and keys may differ in number
/// (cross-attention): q N_q x Dk, k N_k x Dk and v N_k x Dv.
template <class DQ, class DK, class DV>
void validate_cross_shapes(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                           const Eigen::MatrixBase<DV>& v, const Options& options,
                           const char* where, const char* q_name, const char* k_name) {
  validate_options(options, where);
  require_nonempty(q, where, q_name);
  require_nonempty(k, where, k_name);
  require_nonempty(v, where, "v");
  if (k.cols() != q.cols()) {
    throw Error(std::string(where) + ": " + k_name + " is " + shape_string(k) + " but " + q_name +
                " is " + shape_string(q) + "; they need the same number of columns (features)");
  }
  if (v.rows() != k.rows()) {
    throw Error(std::string(where) + ": v is " + shape_string(v) + " but " + k_name + " is " +
                shape_string(k) + "; they need the same number of rows (keys)");
  }
}

/// Shape checks shared by every sequence routine: q, k (N x Dq, N x Dk) and v (N x Dv), the
/// cross-attention checks with one N. `qk_name` is "phi_q"/"phi_k" for featurized inputs and
/// "q"/"k" for raw ones. The linear routines then scan for NaN and Inf with
/// require_finite_parallel.
template <class DQ, class DK, class DV>
void validate_sequence_shapes(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                              const Eigen::MatrixBase<DV>& v, const Options& options,
                              const char* where, const char* q_name, const char* k_name) {
  // Queries and keys first, so a short k is named as such, not through v.
  if (k.rows() != q.rows()) {
    throw Error(std::string(where) + ": " + k_name + " is " + shape_string(k) + " but " + q_name +
                " is " + shape_string(q) + "; both must have the same shape");
  }
  validate_cross_shapes(q, k, v, options, where, q_name, k_name);
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

/// Throws unless `grad` has x's shape (a gradient of an elementwise map).
template <class DX, class DG>
void require_same_shape(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad,
                        const char* where) {
  if (grad.rows() != x.rows() || grad.cols() != x.cols()) {
    throw Error(std::string(where) + ": grad_phi is " + shape_string(grad) + " but x is " +
                shape_string(x) + "; they must have the same shape");
  }
}

/// Throws unless `grad` is x.rows() x `features` (the gradient of a map with C = features).
template <class DX, class DG>
void require_backward_shape(const Eigen::MatrixBase<DX>& x, const Eigen::MatrixBase<DG>& grad,
                            Eigen::Index features, const char* where) {
  if (grad.rows() != x.rows() || grad.cols() != features) {
    throw Error(std::string(where) + ": grad_phi is " + shape_string(grad) + " but x is " +
                shape_string(x) + "; expected " + shape_string(x.rows(), features));
  }
}

}  // namespace linattn::detail
