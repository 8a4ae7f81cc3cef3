// SPDX-License-Identifier: MIT
// Gated linear attention (GLA / RetNet style): a data-dependent gate a_t in (0, 1] per token,
// scalar or per feature, in place of the constant decay. Chunked forward, recurrent stepper and
// backward pass.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/linear_attention.hpp>
#include <string>
#include <type_traits>
#include <utility>

/// The recurrence, with phi_q, phi_k: N x C, v: N x Dv and gates a: N x 1 or N x C:
///     S_t = diag(a_t) S_{t-1} + phi_k_t v_t^T,   z_t = a_t o z_{t-1} + phi_k_t
///     out_t = phi_q_t^T S_t / (phi_q_t . z_t + eps)   (the numerator alone without normalize)
/// Gates are given as a_t, not as logs. Options::decay must stay 1: the gates replace it (fold a
/// constant decay g into them as g a_t). Like the other kernels, every entry point takes an
/// optional first template argument, the accumulation type (default: the input scalar).
/// Options::threads only spreads the NaN/Inf scan: the gated kernels run on the calling thread.
namespace linattn {

namespace detail {

/// Which index of the state the gates scale.
enum class GateSide {
  keys,    ///< S = diag(a) S + k v^T: the forward pass (and d v in the backward pass)
  values,  ///< S = S diag(a) + k v^T: the backward passes for d phi_q and d phi_k
};

/// Throws unless Options::decay is 1: with gates a constant decay would be a second, silent gate.
inline void require_unit_decay(const Options& options, const char* where) {
  if (options.decay != 1.0) {
    throw Error(std::string(where) + ": Options::decay must be 1 with gates (the gates replace " +
                "the decay; fold a constant decay g into them as g * a_t), got " +
                std::to_string(options.decay));
  }
}

/// Throws naming the first entry of `gates` outside (0, 1] (NaN included) by row and column.
template <class Derived>
void require_gates_in_range(const Eigen::MatrixBase<Derived>& gates, const char* where,
                            const char* name) {
  using Scalar = typename Derived::Scalar;
  // NaN fails both comparisons, so one vectorised pass covers it.
  if (((gates.array() > Scalar(0)) && (gates.array() <= Scalar(1))).all()) return;
  for (Eigen::Index r = 0; r < gates.rows(); ++r) {
    for (Eigen::Index c = 0; c < gates.cols(); ++c) {
      const Scalar a = gates(r, c);
      if (!(a > Scalar(0) && a <= Scalar(1))) {
        throw Error(std::string(where) + ": " + name + " must lie in (0, 1], got " +
                    std::to_string(static_cast<double>(a)) + " at row " + std::to_string(r) +
                    ", column " + std::to_string(c));
      }
    }
  }
}

/// Throws unless gates is N x 1 (one gate per token) or N x C (one per feature and token).
template <class Derived>
void require_gate_shape(const Eigen::MatrixBase<Derived>& gates, Eigen::Index rows,
                        Eigen::Index features, const char* where) {
  if (gates.rows() != rows || (gates.cols() != 1 && gates.cols() != features)) {
    throw Error(std::string(where) + ": gates is " + shape_string(gates) + " but phi_q is " +
                shape_string(rows, features) + "; gates must be " + shape_string(rows, 1) +
                " (one gate per token) or " + shape_string(rows, features) + " (one per feature)");
  }
}

/// Every check of the sequence routines, before anything is written: shapes, options, gates in
/// (0, 1] (always), and NaN or Inf in phi_q, phi_k, v (with check_finite).
template <class DQ, class DK, class DV, class DG>
void validate_gated_sequence(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                             const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& gates,
                             const Options& options, const char* where) {
  validate_sequence_shapes(phi_q, phi_k, v, options, where, "phi_q", "phi_k");
  require_unit_decay(options, where);
  require_gate_shape(gates, phi_q.rows(), phi_q.cols(), where);
  scan_inputs(phi_q, phi_k, v, options, where, "phi_q", "phi_k");
  require_gates_in_range(gates, where, "gates");
}

/// One output row from its numerator and denominator, with the kernels' denominator guard:
/// num / guard(den + eps), a zero row where that is 0; num alone without normalize.
template <class A, class NumRow, class OutRow>
void write_gated_row(const Eigen::MatrixBase<NumRow>& num, A den, const Options& options,
                     const Eigen::MatrixBase<OutRow>& out_expr) {
  // Eigen's idiom for writing through an expression argument.
  Eigen::MatrixBase<OutRow>& out = const_cast<Eigen::MatrixBase<OutRow>&>(out_expr);
  using Out = typename OutRow::Scalar;
  if (!options.normalize) {
    out = num.template cast<Out>();
    return;
  }
  const A eps = static_cast<A>(options.eps);
  const A d = guard_denominator<A>(den + eps, eps);
  if (d == A(0)) {
    out.setZero();
  } else {
    out = (num / d).template cast<Out>();
  }
}

/// The unnormalized gated causal kernel in chunked form, continuing from a carried state.
/// Within a chunk, b_t is the running sum of log gates from the chunk's first token, so every
/// weight is exp(b_t - b_j) or exp(b_t) with a non-positive exponent: nothing overflows, however
/// close to 0 the gates are. b is kept as a double-double (hi + lo) because after strong gates
/// |b| reaches 1e4 and a plain double sum would lose the 1e-7 logs of nearly-1 gates that follow.
/// Per-feature gates take GLA's secondary chunks: sub-blocks of kSub rows, GEMMs between
/// sub-blocks (weights split at the boundary, both halves <= 1), exact weights inside them.
/// Memory: O(chunk * (C + Dv) + chunk^2), nothing proportional to N.
template <class Acc>
class GatedKernel {
  using Logs = Eigen::Array<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

 public:
  /// @param key_dim    width of the queries and keys, rows of S
  /// @param value_dim  width of the values and outputs, columns of S
  /// @param gate_dim   1 (scalar gates), key_dim (GateSide::keys) or value_dim (values)
  GatedKernel(Eigen::Index key_dim, Eigen::Index value_dim, Eigen::Index gate_dim, GateSide side,
              Eigen::Index rows, Eigen::Index chunk)
      : chunk_(std::max<Eigen::Index>(1, std::min(chunk, rows))),
        gate_dim_(gate_dim),
        side_(side),
        q_(chunk_, key_dim),
        k_(chunk_, key_dim),
        v_(chunk_, value_dim),
        log_(chunk_, gate_dim),
        hi_(chunk_, gate_dim),
        lo_(chunk_, gate_dim),
        ex_(chunk_, gate_dim),
        last_(gate_dim),
        scores_(chunk_, chunk_),
        weighted_(chunk_, std::max(key_dim, value_dim)),
        block_(std::min(kSub, chunk_), std::max(key_dim, value_dim)),
        num_(chunk_, value_dim),
        den_(chunk_) {
    LINATTN_ASSERT(gate_dim == 1 || (side == GateSide::keys && gate_dim == key_dim) ||
                   (side == GateSide::values && gate_dim == value_dim));
  }

  /// Runs all rows of (q, k, v) with `gates` (N x gate_dim, a_t in (0, 1]) from state (s, z),
  /// leaving the state after the last row. After each chunk calls
  /// sink(begin, len, num, den): rows [0, len) of num (chunk x value_dim) and den (chunk; only
  /// computed when z is given) belong to tokens begin .. begin + len - 1.
  template <class DQ, class DK, class DV, class DG, class Sink>
  void run(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
           const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& gates, Matrix<Acc>& s,
           Vector<Acc>* z, Sink&& sink) {
    LINATTN_ASSERT(z == nullptr || side_ == GateSide::keys || gate_dim_ == 1);
    const Eigen::Index n = q.rows();
    for (Eigen::Index begin = 0; begin < n; begin += chunk_) {
      const Eigen::Index len = std::min(chunk_, n - begin);
      q_.topRows(len) = q.middleRows(begin, len).template cast<Acc>();
      k_.topRows(len) = k.middleRows(begin, len).template cast<Acc>();
      v_.topRows(len) = v.middleRows(begin, len).template cast<Acc>();
      log_.topRows(len) = gates.middleRows(begin, len).template cast<double>().array().log();
      prefix(len);
      if (gate_dim_ == 1) {
        scalar_chunk(len, s, z);
      } else if (side_ == GateSide::keys) {
        key_gated_chunk(len, s, z);
      } else {
        value_gated_chunk(len, s);
      }
      sink(begin, len, static_cast<const Matrix<Acc>&>(num_),
           static_cast<const Vector<Acc>&>(den_));
    }
  }

 private:
  /// Rows per secondary chunk: exact per-pair weights inside, GEMMs between.
  static constexpr Eigen::Index kSub = 16;

  /// hi + lo = b_t, the running sum of log_ from the chunk's first row, by TwoSum.
  void prefix(Eigen::Index len) {
    for (Eigen::Index c = 0; c < gate_dim_; ++c) {
      double hi = 0.0;
      double lo = 0.0;
      for (Eigen::Index t = 0; t < len; ++t) {
        const double x = log_(t, c);
        const double sum = hi + x;
        const double x_part = sum - hi;
        lo += (hi - (sum - x_part)) + (x - x_part);
        hi = sum;
        hi_(t, c) = hi;
        lo_(t, c) = lo;
      }
    }
  }

  /// ex_ rows [0, m) = exp(b_t - b_j) for j = first .. first + m - 1 (every j <= t).
  void weights_to(Eigen::Index t, Eigen::Index first, Eigen::Index m) {
    ex_.topRows(m) = (((-hi_.middleRows(first, m)).rowwise() + hi_.row(t)) +
                      ((-lo_.middleRows(first, m)).rowwise() + lo_.row(t)))
                         .exp();
  }

  /// ex_ rows [0, m) = exp(b_t - b_r) for t = first .. first + m - 1 (every t >= r).
  void weights_from(Eigen::Index r, Eigen::Index first, Eigen::Index m) {
    ex_.topRows(m) = ((hi_.middleRows(first, m).rowwise() - hi_.row(r)) +
                      (lo_.middleRows(first, m).rowwise() - lo_.row(r)))
                         .exp();
  }

  /// Scalar gates: one GEMM, then each score scaled by exp(b_t - b_j) and masked. Same for both
  /// sides, since a scalar commutes with S.
  void scalar_chunk(Eigen::Index len, Matrix<Acc>& s, Vector<Acc>* z) {
    Eigen::Ref<Matrix<Acc>> q = q_.topRows(len);
    Eigen::Ref<Matrix<Acc>> k = k_.topRows(len);
    Eigen::Ref<Matrix<Acc>> v = v_.topRows(len);
    Eigen::Ref<Matrix<Acc>> scores = scores_.topLeftCorner(len, len);
    Eigen::Ref<Matrix<Acc>> num = num_.topRows(len);
    Eigen::Ref<Vector<Acc>> den = den_.head(len);

    weights_from_start(len);
    num.noalias() = q * s;
    for (Eigen::Index t = 0; t < len; ++t) num.row(t) *= static_cast<Acc>(ex_(t, 0));
    if (z != nullptr) {
      den.noalias() = q * *z;
      den.array() *= ex_.col(0).head(len).template cast<Acc>();
    }
    scores.noalias() = q * k.transpose();
    for (Eigen::Index t = 0; t < len; ++t) {
      weights_to(t, 0, t + 1);
      scores.row(t).head(t + 1).array() *= ex_.col(0).head(t + 1).transpose().template cast<Acc>();
      scores.row(t).tail(len - 1 - t).setZero();
    }
    num.noalias() += scores * v;
    if (z != nullptr) den += scores.rowwise().sum();

    const Eigen::Index last = len - 1;
    weights_to(last, 0, len);
    Eigen::Ref<Matrix<Acc>> weighted = weighted_.topLeftCorner(len, k.cols());
    for (Eigen::Index j = 0; j < len; ++j) weighted.row(j) = k.row(j) * static_cast<Acc>(ex_(j, 0));
    const Acc carry = static_cast<Acc>(std::exp(hi_(last, 0) + lo_(last, 0)));
    s *= carry;
    s.noalias() += weighted.transpose() * v;
    if (z != nullptr) {
      *z *= carry;
      *z += weighted.colwise().sum().transpose();
    }
  }

  /// ex_ rows [0, len) = exp(b_t), the decay of the carried state at each token.
  void weights_from_start(Eigen::Index len) {
    ex_.topRows(len) = (hi_.topRows(len) + lo_.topRows(len)).exp();
  }

  /// last_ = exp(b_last), the decay of the carried state over the whole chunk.
  void chunk_decay(Eigen::Index last) { last_ = (hi_.row(last) + lo_.row(last)).exp(); }

  /// Per-feature gates on the contracted index: A_tj = sum_c q_tc k_jc exp(b_tc - b_jc).
  void key_gated_chunk(Eigen::Index len, Matrix<Acc>& s, Vector<Acc>* z) {
    const Eigen::Index c = q_.cols();
    Eigen::Ref<Matrix<Acc>> q = q_.topRows(len);
    Eigen::Ref<Matrix<Acc>> k = k_.topRows(len);
    Eigen::Ref<Matrix<Acc>> v = v_.topRows(len);
    Eigen::Ref<Matrix<Acc>> scores = scores_.topLeftCorner(len, len);
    Eigen::Ref<Matrix<Acc>> num = num_.topRows(len);
    Eigen::Ref<Vector<Acc>> den = den_.head(len);

    weights_from_start(len);
    {
      Eigen::Ref<Matrix<Acc>> decayed = weighted_.topLeftCorner(len, c);
      decayed = (q.array() * ex_.topRows(len).template cast<Acc>()).matrix();
      num.noalias() = decayed * s;
      if (z != nullptr) den.noalias() = decayed * *z;
    }

    for (Eigen::Index t0 = 0; t0 < len; t0 += kSub) {
      const Eigen::Index n = std::min(kSub, len - t0);
      if (t0 > 0) {
        // Split exp(b_t - b_j) at r = t0 - 1, between the blocks: both halves are <= 1.
        const Eigen::Index r = t0 - 1;
        Eigen::Ref<Matrix<Acc>> queries = block_.topLeftCorner(n, c);
        weights_from(r, t0, n);
        queries = (q.middleRows(t0, n).array() * ex_.topRows(n).template cast<Acc>()).matrix();
        Eigen::Ref<Matrix<Acc>> keys = weighted_.topLeftCorner(t0, c);
        weights_to(r, 0, t0);
        keys = (k.topRows(t0).array() * ex_.topRows(t0).template cast<Acc>()).matrix();
        scores.block(t0, 0, n, t0).noalias() = queries * keys.transpose();
      }
      for (Eigen::Index i = 0; i < n; ++i) {
        const Eigen::Index t = t0 + i;
        Eigen::Ref<Matrix<Acc>> keys = weighted_.topLeftCorner(i + 1, c);
        weights_to(t, t0, i + 1);
        keys = (k.middleRows(t0, i + 1).array() * ex_.topRows(i + 1).template cast<Acc>()).matrix();
        scores.row(t).segment(t0, i + 1).noalias() = q.row(t) * keys.transpose();
        scores.row(t).tail(len - 1 - t).setZero();
      }
    }
    num.noalias() += scores * v;
    if (z != nullptr) den += scores.rowwise().sum();

    const Eigen::Index last = len - 1;
    Eigen::Ref<Matrix<Acc>> weighted = weighted_.topLeftCorner(len, c);
    weights_to(last, 0, len);
    weighted = (k.array() * ex_.topRows(len).template cast<Acc>()).matrix();
    chunk_decay(last);
    for (Eigen::Index f = 0; f < c; ++f) s.row(f) *= static_cast<Acc>(last_(f));
    s.noalias() += weighted.transpose() * v;
    if (z != nullptr) {
      z->array() *= last_.transpose().template cast<Acc>();
      *z += weighted.colwise().sum().transpose();
    }
  }

  /// Per-feature gates on the output index: out_tc = sum_j s_tj exp(b_tc - b_jc) v_jc,
  /// s = Q K^T. No denominator (the backward pass folds it into the values).
  void value_gated_chunk(Eigen::Index len, Matrix<Acc>& s) {
    const Eigen::Index dv = v_.cols();
    Eigen::Ref<Matrix<Acc>> q = q_.topRows(len);
    Eigen::Ref<Matrix<Acc>> k = k_.topRows(len);
    Eigen::Ref<Matrix<Acc>> v = v_.topRows(len);
    Eigen::Ref<Matrix<Acc>> scores = scores_.topLeftCorner(len, len);
    Eigen::Ref<Matrix<Acc>> num = num_.topRows(len);

    num.noalias() = q * s;
    weights_from_start(len);
    num.array() *= ex_.topRows(len).template cast<Acc>();
    scores.noalias() = q * k.transpose();

    for (Eigen::Index t0 = 0; t0 < len; t0 += kSub) {
      const Eigen::Index n = std::min(kSub, len - t0);
      if (t0 > 0) {
        const Eigen::Index r = t0 - 1;
        Eigen::Ref<Matrix<Acc>> values = weighted_.topLeftCorner(t0, dv);
        weights_to(r, 0, t0);
        values = (v.topRows(t0).array() * ex_.topRows(t0).template cast<Acc>()).matrix();
        Eigen::Ref<Matrix<Acc>> partial = block_.topLeftCorner(n, dv);
        partial.noalias() = scores.block(t0, 0, n, t0) * values;
        weights_from(r, t0, n);
        num.middleRows(t0, n).array() += partial.array() * ex_.topRows(n).template cast<Acc>();
      }
      for (Eigen::Index i = 0; i < n; ++i) {
        const Eigen::Index t = t0 + i;
        Eigen::Ref<Matrix<Acc>> values = weighted_.topLeftCorner(i + 1, dv);
        weights_to(t, t0, i + 1);
        values =
            (v.middleRows(t0, i + 1).array() * ex_.topRows(i + 1).template cast<Acc>()).matrix();
        num.row(t).noalias() += scores.row(t).segment(t0, i + 1) * values;
      }
    }

    const Eigen::Index last = len - 1;
    Eigen::Ref<Matrix<Acc>> weighted = weighted_.topLeftCorner(len, dv);
    weights_to(last, 0, len);
    weighted = (v.array() * ex_.topRows(len).template cast<Acc>()).matrix();
    chunk_decay(last);
    s.array().rowwise() *= last_.template cast<Acc>();
    s.noalias() += k.transpose() * weighted;
  }

  Eigen::Index chunk_;
  Eigen::Index gate_dim_;
  GateSide side_;
  Matrix<Acc> q_, k_, v_;    ///< chunk x key_dim, chunk x key_dim, chunk x value_dim
  Logs log_, hi_, lo_, ex_;  ///< chunk x gate_dim
  Eigen::Array<double, 1, Eigen::Dynamic> last_;  ///< gate_dim
  Matrix<Acc> scores_;                            ///< chunk x chunk
  Matrix<Acc> weighted_;                          ///< chunk x max(key_dim, value_dim)
  Matrix<Acc> block_;                             ///< kSub x max(key_dim, value_dim)
  Matrix<Acc> num_;                               ///< chunk x value_dim
  Vector<Acc> den_;                               ///< chunk
};

/// Validates, then runs the normalized (or plain) gated forward into `out`.
template <class Acc, class DQ, class DK, class DV, class DG>
void gated_forward(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                   const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& gates,
                   Eigen::Ref<Matrix<typename DQ::Scalar>> out, const Options& options,
                   const char* where) {
  using A = accumulator_t<Acc, typename DQ::Scalar>;
  static_assert(is_supported_scalar<typename DQ::Scalar> && is_supported_scalar<A>,
                "gated linear attention takes float or double inputs and accumulators");
  validate_gated_sequence(phi_q, phi_k, v, gates, options, where);
  require_output_shape(out, phi_q.rows(), v.cols(), where);
  const SerialEigenScope serial_eigen;
  Matrix<A> s = Matrix<A>::Zero(phi_q.cols(), v.cols());
  Vector<A> z = Vector<A>::Zero(phi_q.cols());
  GatedKernel<A> kernel(phi_q.cols(), v.cols(), gates.cols(), GateSide::keys, phi_q.rows(),
                        options.chunk);
  kernel.run(phi_q, phi_k, v, gates, s, options.normalize ? &z : nullptr,
             [&](Eigen::Index begin, Eigen::Index len, const Matrix<A>& num, const Vector<A>& den) {
               for (Eigen::Index r = 0; r < len; ++r) {
                 write_gated_row(num.row(r), options.normalize ? den(r) : A(0), options,
                                 out.row(begin + r));
               }
             });
}

}  // namespace detail

namespace detail {

/// The features the gated kernels read, in the input type: Identity inputs as they are, any
/// other map applied to all rows in the accumulation type (checked finite: the gated kernels
/// have no log-scale stabiliser, so unscaled exponential features must not overflow).
template <class Acc, class Map, class DX>
Matrix<typename DX::Scalar> gated_features(const Map& map, const Eigen::MatrixBase<DX>& x,
                                           bool keys, const Options& options, const char* where,
                                           const char* name) {
  using T = typename DX::Scalar;
  using A = accumulator_t<Acc, T>;
  if (options.check_finite) require_finite(x, where, name);
  const Matrix<A> raw = x.template cast<A>();
  const Matrix<A> phi = keys ? map.keys(raw) : map.queries(raw);
  if (!phi.allFinite()) {
    throw Error(std::string(where) + ": the feature map gives non-finite features for " + name +
                " (the gated kernels need finite features: accumulate in double or scale the "
                "inputs down)");
  }
  return phi.template cast<T>();
}

/// Runs `body(phi_q, phi_k)` on the features of q and k: in place for Identity, else the
/// map's features of every row.
template <class Acc, class Map, class DQ, class DK, class Body>
void with_gated_features(const Map& map, const Eigen::MatrixBase<DQ>& q,
                         const Eigen::MatrixBase<DK>& k, const Options& options, const char* where,
                         const Body& body) {
  if constexpr (check_feature_map<Map, accumulator_t<Acc, typename DQ::Scalar>>()) {
    if constexpr (is_identity_map<Map>) {
      body(q.derived(), k.derived());
    } else {
      if (q.cols() != k.cols()) {
        throw Error(std::string(where) + ": q is " + shape_string(q) + " and k is " +
                    shape_string(k) + "; they must have the same width");
      }
      body(gated_features<Acc>(map, q, false, options, where, "q"),
           gated_features<Acc>(map, k, true, options, where, "k"));
    }
  }
}

}  // namespace detail

/// Gated causal linear attention, chunked (parallel) form, into `out`. O(N) time; allocates
/// O(chunk * (C + Dv) + chunk^2 + C * Dv) for Identity, plus the N x C features of any other
/// map. Gates near 0 (1e-30) and long chunks stay finite: every weight is exp of a
/// non-positive sum.
/// @param q        N x Dk queries, one row per token (features, with Identity)
/// @param k        N x Dk keys
/// @param v        N x Dv values
/// @param gates    N x 1 or N x C gates a_t in (0, 1] (not logs), scalar or per feature
/// @param map      feature map (Identity{} for precomputed features)
/// @param out      N x Dv result, row-major (may not alias the inputs)
/// @param options  eps, normalize, chunk, check_finite; decay must be 1
template <class Acc = void, class DQ, class DK, class DV, class DG, class Map,
          class = detail::enable_if_same_scalar4<DQ, DK, DV, DG>>
void causal_gated_linear_attention_into(const Eigen::MatrixBase<DQ>& q,
                                        const Eigen::MatrixBase<DK>& k,
                                        const Eigen::MatrixBase<DV>& v,
                                        const Eigen::MatrixBase<DG>& gates, const Map& map,
                                        Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                                        const Options& options = {}) {
  constexpr const char* where = "causal_gated_linear_attention";
  detail::with_gated_features<Acc>(
      map, q, k, options, where, [&](const auto& phi_q, const auto& phi_k) {
        detail::gated_forward<Acc>(phi_q, phi_k, v, gates, out, options, where);
      });
}

/// Gated causal linear attention; returns N x Dv. See causal_gated_linear_attention_into.
/// @param q        N x Dk queries
/// @param k        N x Dk keys
/// @param v        N x Dv values
/// @param gates    N x 1 or N x C gates a_t in (0, 1]
/// @param map      feature map (Identity{} for precomputed features); a call without one does
///                 not compile
/// @param options  eps, normalize, chunk, check_finite; decay must be 1
template <class Acc = void, class DQ, class DK, class DV, class DG,
          class Map = detail::MissingFeatureMap,
          class = detail::enable_if_same_scalar4<DQ, DK, DV, DG>>
Matrix<typename DQ::Scalar> causal_gated_linear_attention(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DG>& gates, const Map& map = {}, const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  causal_gated_linear_attention_into<Acc>(q, k, v, gates, map, out, options);
  return out;
}

/// Gradients of a scalar loss with respect to the inputs of causal_gated_linear_attention.
template <class T>
struct GatedAttentionGradients {
  /// N x C: d loss / d phi_q
  Matrix<T> q;
  /// N x C: d loss / d phi_k
  Matrix<T> k;
  /// N x Dv: d loss / d v
  Matrix<T> v;
  /// N x 1 or N x C (the shape of the gates): d loss / d a_t, with respect to the gate itself
  Matrix<T> gates;
};

namespace detail {

/// The backward pass. With V' = [v, 1] and G' = d loss / d [num, den] (V' = v, G' = grad_out
/// without normalize), all three input gradients are unnormalized gated kernels: the state
/// is recomputed chunk by chunk instead of stored per token, so memory stays O(N (C + Dv)).
template <class Acc, class DQ, class DK, class DV, class DG, class DO>
void gated_backward(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                    const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& gates,
                    const Eigen::MatrixBase<DO>& grad_out,
                    GatedAttentionGradients<typename DQ::Scalar>& grads, const Options& options,
                    const char* where) {
  using T = typename DQ::Scalar;
  using A = accumulator_t<Acc, T>;
  static_assert(is_supported_scalar<T> && is_supported_scalar<A>,
                "gated linear attention takes float or double inputs and accumulators");
  static_assert(std::is_same_v<typename DO::Scalar, T>, "grad_out must have the inputs' scalar");
  validate_gated_sequence(phi_q, phi_k, v, gates, options, where);
  if (grad_out.rows() != v.rows() || grad_out.cols() != v.cols()) {
    throw Error(std::string(where) + ": grad_out is " + shape_string(grad_out) +
                " but the output is " + shape_string(v) + " (N x Dv)");
  }
  if (options.check_finite) require_finite(grad_out, where, "grad_out");

  const SerialEigenScope serial_eigen;
  const Eigen::Index n = phi_q.rows();
  const Eigen::Index c = phi_q.cols();
  const Eigen::Index dv = v.cols();
  const Eigen::Index g = gates.cols();
  const Eigen::Index width = options.normalize ? dv + 1 : dv;  // of V' and G'

  Matrix<A> values(n, width);  // V'
  values.leftCols(dv) = v.template cast<A>();
  Matrix<A> grad(n, width);  // G'
  if (options.normalize) {
    values.col(dv).setOnes();
    Matrix<A> s = Matrix<A>::Zero(c, width);
    GatedKernel<A> kernel(c, width, g, GateSide::keys, n, options.chunk);
    const A eps = static_cast<A>(options.eps);
    kernel.run(phi_q, phi_k, values, gates, s, nullptr,
               [&](Eigen::Index begin, Eigen::Index len, const Matrix<A>& num, const Vector<A>&) {
                 for (Eigen::Index r = 0; r < len; ++r) {
                   const Eigen::Index t = begin + r;
                   const A raw = num(r, dv) + eps;
                   const A d = guard_denominator<A>(raw, eps);
                   if (d == A(0)) {
                     grad.row(t).setZero();  // the forward wrote a constant zero row
                     continue;
                   }
                   const A inv = A(1) / d;
                   grad.row(t).head(dv) = grad_out.row(t).template cast<A>() * inv;
                   // A clamped denominator is a constant: no gradient flows into den.
                   const bool clamped = std::abs(raw) < eps;
                   grad(t, dv) =
                       clamped ? A(0) : -(grad.row(t).head(dv).dot(num.row(r).head(dv))) * inv;
                 }
               });
  } else {
    grad = grad_out.template cast<A>();
  }

  // d phi_q_t = S'_t G'_t: forward in time, gates on the output (feature) index.
  Matrix<A> dq(n, c);
  {
    Matrix<A> s = Matrix<A>::Zero(width, c);
    GatedKernel<A> kernel(width, c, g, GateSide::values, n, options.chunk);
    kernel.run(grad, values, phi_k, gates, s, nullptr,
               [&](Eigen::Index begin, Eigen::Index len, const Matrix<A>& num, const Vector<A>&) {
                 dq.middleRows(begin, len) = num.topRows(len);
               });
  }

  // d phi_k and d v from dS_t = phi_q_t G'_t^T + diag(a_{t+1}) dS_{t+1}: the same kernels on
  // the reversed sequence, reversed token r = n-1-t gated by a_{t+1} (the first by 1).
  Matrix<T> reversed_gates(n, g);
  reversed_gates.row(0).setOnes();
  reversed_gates.bottomRows(n - 1) = gates.bottomRows(n - 1).colwise().reverse();
  Matrix<A> dk(n, c);
  {
    Matrix<A> s = Matrix<A>::Zero(width, c);
    GatedKernel<A> kernel(width, c, g, GateSide::values, n, options.chunk);
    kernel.run(values.colwise().reverse(), grad.colwise().reverse(), phi_q.colwise().reverse(),
               reversed_gates, s, nullptr,
               [&](Eigen::Index begin, Eigen::Index len, const Matrix<A>& num, const Vector<A>&) {
                 for (Eigen::Index r = 0; r < len; ++r) dk.row(n - 1 - begin - r) = num.row(r);
               });
  }
  grads.v.resize(n, dv);
  {
    Matrix<A> s = Matrix<A>::Zero(c, dv);
    GatedKernel<A> kernel(c, dv, g, GateSide::keys, n, options.chunk);
    kernel.run(phi_k.colwise().reverse(), phi_q.colwise().reverse(),
               grad.leftCols(dv).colwise().reverse(), reversed_gates, s, nullptr,
               [&](Eigen::Index begin, Eigen::Index len, const Matrix<A>& num, const Vector<A>&) {
                 for (Eigen::Index r = 0; r < len; ++r) {
                   grads.v.row(n - 1 - begin - r) = num.row(r).template cast<T>();
                 }
               });
  }

  // With b_t = sum_{s<=t} log a_s: d b_t = phi_q_t o d phi_q_t - phi_k_t o d phi_k_t, and
  // d log a_t = sum_{s>=t} d b_s. Summed in double: the terms cancel over long sequences.
  grads.gates.resize(n, g);
  Eigen::Array<double, 1, Eigen::Dynamic> running =
      Eigen::Array<double, 1, Eigen::Dynamic>::Zero(g);
  Eigen::Array<double, 1, Eigen::Dynamic> term(c);
  for (Eigen::Index t = n - 1; t >= 0; --t) {
    term =
        phi_q.row(t).template cast<double>().array() * dq.row(t).template cast<double>().array() -
        phi_k.row(t).template cast<double>().array() * dk.row(t).template cast<double>().array();
    if (g == 1) {
      running(0) += term.sum();
    } else {
      running += term;
    }
    grads.gates.row(t) =
        (running / gates.row(t).template cast<double>().array()).template cast<T>().matrix();
  }
  grads.q = dq.template cast<T>();
  grads.k = dk.template cast<T>();
}

}  // namespace detail

/// Backward pass of causal_gated_linear_attention: the gradients of a loss L with respect to
/// q, k, v and the gates, given grad_out = dL/d out. O(N) time and O(N (C + Dv)) memory:
/// chunk states are recomputed, never stored per token. Where the denominator guard clamped a
/// row, no gradient flows through its denominator; a zero row passes none at all. With a map
/// other than Identity the features are recomputed and the map's backward carries the
/// gradients to q and k.
/// @param q         N x Dk queries (features, with Identity)
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param gates     N x 1 or N x C gates a_t in (0, 1]
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param map       the forward's feature map; needs a backward member unless Identity
/// @param grads     receives q, k (N x Dk), v (N x Dv), gates (the gates' shape); resized
/// @param options   as given to the forward call; decay must be 1
template <class Acc = void, class DQ, class DK, class DV, class DG, class DO, class Map,
          class = detail::enable_if_same_scalar4<DQ, DK, DV, DG>>
void causal_gated_linear_attention_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DG>& gates, const Eigen::MatrixBase<DO>& grad_out, const Map& map,
    GatedAttentionGradients<typename DQ::Scalar>& grads, const Options& options = {}) {
  constexpr const char* where = "causal_gated_linear_attention_backward";
  detail::with_gated_features<Acc>(
      map, q, k, options, where, [&](const auto& phi_q, const auto& phi_k) {
        if constexpr (detail::is_identity_map<Map>) {
          detail::gated_backward<Acc>(phi_q, phi_k, v, gates, grad_out, grads, options, where);
        } else {
          static_assert(detail::has_map_backward<Map, typename DQ::Scalar>::value,
                        "this feature map has no backward(x, grad_phi) member, so gradients "
                        "cannot reach q and k; featurize yourself and pass linattn::Identity{}");
          // Computed into a copy so a throw leaves the caller's grads as they were.
          GatedAttentionGradients<typename DQ::Scalar> feature_grads;
          detail::gated_backward<Acc>(phi_q, phi_k, v, gates, grad_out, feature_grads, options,
                                      where);
          feature_grads.q = map.backward(q.derived(), feature_grads.q);
          feature_grads.k = map.backward(k.derived(), feature_grads.k);
          grads = std::move(feature_grads);
        }
      });
}

/// Backward pass of causal_gated_linear_attention; returns the four gradients.
/// See causal_gated_linear_attention_backward_into.
/// @param q         N x Dk queries
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param gates     N x 1 or N x C gates a_t in (0, 1]
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param map       the forward's feature map (Identity{} for precomputed features)
/// @param options   as given to the forward call; decay must be 1
template <class Acc = void, class DQ, class DK, class DV, class DG, class DO,
          class Map = detail::MissingFeatureMap,
          class = detail::enable_if_same_scalar4<DQ, DK, DV, DG>>
GatedAttentionGradients<typename DQ::Scalar> causal_gated_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DG>& gates, const Eigen::MatrixBase<DO>& grad_out, const Map& map = {},
    const Options& options = {}) {
  GatedAttentionGradients<typename DQ::Scalar> grads;
  causal_gated_linear_attention_backward_into<Acc>(q, k, v, gates, grad_out, map, grads, options);
  return grads;
}

/// The recurrent (decoding) form of gated linear attention for one sequence: S (C x Dv), z (C)
/// and the tokens seen. `step` adds one token in O(C * Dv) and allocates nothing in step_into;
/// `prefill` adds many through the chunked form. Both give the outputs of one
/// causal_gated_linear_attention call over the whole sequence. A throwing call leaves the state
/// unchanged. Acc is the type of the state and of every sum (default T).
template <class T, class Acc = T>
class GatedRecurrentState {
  static_assert(detail::is_supported_scalar<T> && detail::is_supported_scalar<Acc>,
                "GatedRecurrentState<T, Acc> takes float or double");

 public:
  /// @param feature_dim  C, the width of phi(q) and phi(k)
  /// @param value_dim    Dv, the width of v
  /// @param options      eps, normalize, check_finite (and chunk, for prefill); decay must be 1
  GatedRecurrentState(Eigen::Index feature_dim, Eigen::Index value_dim, const Options& options = {})
      : s_(Matrix<Acc>::Zero(
            detail::require_positive_dim(feature_dim, "GatedRecurrentState", "feature_dim"),
            detail::require_positive_dim(value_dim, "GatedRecurrentState", "value_dim"))),
        z_(Vector<Acc>::Zero(feature_dim)),
        options_(options),
        query_(feature_dim),
        key_(feature_dim),
        value_(value_dim),
        gate_(feature_dim),
        num_(value_dim) {
    detail::validate_options(options, "GatedRecurrentState");
    detail::require_unit_decay(options, "GatedRecurrentState");
  }

  /// Adds one token through a feature map and returns its output.
  /// @param q     Dk query (any row or column vector expression; features, with Identity)
  /// @param k     Dk key
  /// @param v     Dv value
  /// @param gate  C gates (per feature) or 1 gate, each in (0, 1]
  /// @param map   feature map with map.feature_dim(Dk) == C (Identity{} for precomputed
  ///              features); a call without one does not compile
  /// @return      Dv output
  template <class DQ, class DK, class DV, class DG, class Map = detail::MissingFeatureMap>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& gate,
                 const Map& map = {}) {
    Vector<T> out(value_dim());
    step_into(q, k, v, gate, map, out);
    return out;
  }

  /// Adds one token with a scalar gate a in (0, 1] through a feature map.
  template <class DQ, class DK, class DV, class Map = detail::MissingFeatureMap>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, T gate, const Map& map = {}) {
    Vector<T> out(value_dim());
    step_into(q, k, v, gate, map, out);
    return out;
  }

  /// As step, writing the output into `out` (Dv); with Identity it allocates nothing.
  template <class DQ, class DK, class DV, class DG, class Map>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& gate, const Map& map,
                 Eigen::Ref<Vector<T>> out) {
    with_token_features(map, q, k, [&](const auto& phi_q, const auto& phi_k) {
      step_features_into(phi_q, phi_k, v, gate, out);
    });
  }

  /// As step with a scalar gate, writing the output into `out` (Dv).
  template <class DQ, class DK, class DV, class Map>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, T gate, const Map& map,
                 Eigen::Ref<Vector<T>> out) {
    with_token_features(map, q, k, [&](const auto& phi_q, const auto& phi_k) {
      step_features_into(phi_q, phi_k, v, gate, out);
    });
  }

  /// Adds many tokens through the chunked form from the current state; returns their outputs,
  /// the same (within rounding) as calling step for each row.
  /// @param q      N x Dk queries (features, with Identity)
  /// @param k      N x Dk keys
  /// @param v      N x Dv values
  /// @param gates  N x 1 or N x C gates a_t in (0, 1]
  /// @param map    feature map (Identity{} for precomputed features)
  /// @return       N x Dv outputs
  template <class DQ, class DK, class DV, class DG, class Map = detail::MissingFeatureMap>
  Matrix<T> prefill(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& gates,
                    const Map& map = {}) {
    Matrix<T> out(q.rows(), value_dim());
    prefill_into(q, k, v, gates, map, out);
    return out;
  }

  /// As prefill, writing into `out` (N x Dv, row-major).
  template <class DQ, class DK, class DV, class DG, class Map>
  void prefill_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& gates,
                    const Map& map, Eigen::Ref<Matrix<T>> out) {
    detail::with_gated_features<Acc>(map, q, k, options_, "GatedRecurrentState::prefill",
                                     [&](const auto& phi_q, const auto& phi_k) {
                                       prefill_features_into(phi_q, phi_k, v, gates, out);
                                     });
  }

  /// S, C x Dv.
  const Matrix<Acc>& s() const { return s_; }
  /// z, C.
  const Vector<Acc>& z() const { return z_; }
  /// Tokens added since construction or reset.
  std::int64_t tokens() const { return tokens_; }
  /// C, rows of S.
  Eigen::Index feature_dim() const { return s_.rows(); }
  /// Dv, columns of S.
  Eigen::Index value_dim() const { return s_.cols(); }
  /// The options given at construction.
  const Options& options() const { return options_; }

  /// Forgets every token; keeps the dimensions and options.
  void reset() {
    s_.setZero();
    z_.setZero();
    tokens_ = 0;
  }

 private:
  /// Adds one token and writes its output; allocates nothing.
  /// @param phi_q  C featurized query
  /// @param phi_k  C featurized key
  /// @param v      Dv value
  /// @param gate   C gates (per feature) or 1 gate, each in (0, 1]
  /// @param out    Dv output
  template <class DQ, class DK, class DV, class DG>
  void step_features_into(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                          const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& gate,
                          Eigen::Ref<Vector<T>> out) {
    constexpr const char* where = "GatedRecurrentState::step";
    check_scalars<DQ, DK, DV>();
    static_assert(std::is_same_v<typename DG::Scalar, T>, "gate must have the state's scalar");
    if ((gate.rows() != 1 && gate.cols() != 1) ||
        (gate.size() != 1 && gate.size() != feature_dim())) {
      throw Error(std::string(where) + ": gate is " + detail::shape_string(gate) +
                  ", expected a vector of " + std::to_string(feature_dim()) +
                  " entries (per feature) or 1 (scalar)");
    }
    validate_token(phi_q, phi_k, v, out, where);
    detail::require_gates_in_range(gate, where, "gate");
    load_token(phi_q, phi_k, v);
    if (gate.size() == 1) {
      advance(false, static_cast<Acc>(gate(0, 0)), out);
    } else {
      gate_ = gate.reshaped().template cast<Acc>();
      advance(true, Acc(1), out);
    }
  }

  /// Adds one token with a scalar gate and writes its output; allocates nothing.
  /// @param phi_q  C featurized query
  /// @param phi_k  C featurized key
  /// @param v      Dv value
  /// @param gate   the gate a in (0, 1]
  /// @param out    Dv output
  template <class DQ, class DK, class DV>
  void step_features_into(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                          const Eigen::MatrixBase<DV>& v, T gate, Eigen::Ref<Vector<T>> out) {
    constexpr const char* where = "GatedRecurrentState::step";
    check_scalars<DQ, DK, DV>();
    validate_token(phi_q, phi_k, v, out, where);
    if (!(gate > T(0) && gate <= T(1))) {
      throw Error(std::string(where) + ": gate must lie in (0, 1], got " +
                  std::to_string(static_cast<double>(gate)));
    }
    load_token(phi_q, phi_k, v);
    advance(false, static_cast<Acc>(gate), out);
  }

  /// As prefill, writing into `out`.
  /// @param phi_q  N x C featurized queries
  /// @param phi_k  N x C featurized keys
  /// @param v      N x Dv values
  /// @param gates  N x 1 or N x C gates a_t in (0, 1]
  /// @param out    N x Dv outputs
  template <class DQ, class DK, class DV, class DG>
  void prefill_features_into(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                             const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& gates,
                             Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "GatedRecurrentState::prefill";
    check_scalars<DQ, DK, DV>();
    static_assert(std::is_same_v<typename DG::Scalar, T>, "gates must have the state's scalar");
    detail::validate_gated_sequence(phi_q, phi_k, v, gates, options_, where);
    if (phi_q.cols() != feature_dim() || v.cols() != value_dim()) {
      throw Error(std::string(where) + ": phi_q has " + std::to_string(phi_q.cols()) +
                  " columns and v has " + std::to_string(v.cols()) + "; the state is " +
                  detail::shape_string(feature_dim(), value_dim()) + " (C x Dv)");
    }
    detail::require_output_shape(out, phi_q.rows(), value_dim(), where);
    const detail::SerialEigenScope serial_eigen;
    // Run on a copy, committed at the end, so the state moves all at once or not at all.
    Matrix<Acc> s = s_;
    Vector<Acc> z = z_;
    detail::GatedKernel<Acc> kernel(feature_dim(), value_dim(), gates.cols(),
                                    detail::GateSide::keys, phi_q.rows(), options_.chunk);
    kernel.run(
        phi_q, phi_k, v, gates, s, &z,
        [&](Eigen::Index begin, Eigen::Index len, const Matrix<Acc>& num, const Vector<Acc>& den) {
          for (Eigen::Index r = 0; r < len; ++r) {
            detail::write_gated_row(num.row(r), options_.normalize ? den(r) : Acc(0), options_,
                                    out.row(begin + r));
          }
        });
    s_.swap(s);
    z_.swap(z);
    tokens_ += phi_q.rows();
  }

  /// Runs `body(phi_q, phi_k)` on one token's features: in place for Identity, else the
  /// map's features of q and k (checked: one token each, the state's feature count).
  template <class Map, class DQ, class DK, class Body>
  void with_token_features(const Map& map, const Eigen::MatrixBase<DQ>& q,
                           const Eigen::MatrixBase<DK>& k, const Body& body) {
    constexpr const char* where = "GatedRecurrentState::step";
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      if constexpr (detail::is_identity_map<Map>) {
        body(q.derived(), k.derived());
      } else {
        detail::require_vector(q, q.size(), where, "q");
        detail::require_vector(k, q.size(), where, "k");
        const Eigen::Index dim = map.feature_dim(q.size());
        if (dim != feature_dim()) {
          throw Error(std::string(where) + ": the feature map gives " + std::to_string(dim) +
                      " features for q of size " + std::to_string(q.size()) +
                      " but the state holds " + std::to_string(feature_dim()));
        }
        const Matrix<T> phi_q =
            detail::gated_features<Acc>(map, q.reshaped().transpose(), false, options_, where, "q");
        const Matrix<T> phi_k =
            detail::gated_features<Acc>(map, k.reshaped().transpose(), true, options_, where, "k");
        body(phi_q, phi_k);
      }
    }
  }

  template <class DQ, class DK, class DV>
  static void check_scalars() {
    static_assert(std::is_same_v<typename DQ::Scalar, T> &&
                      std::is_same_v<typename DK::Scalar, T> &&
                      std::is_same_v<typename DV::Scalar, T>,
                  "inputs must have the state's scalar type");
  }

  template <class DQ, class DK, class DV>
  void validate_token(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                      const Eigen::MatrixBase<DV>& v, const Eigen::Ref<Vector<T>>& out,
                      const char* where) const {
    detail::require_vector(phi_q, feature_dim(), where, "phi_q");
    detail::require_vector(phi_k, feature_dim(), where, "phi_k");
    detail::require_vector(v, value_dim(), where, "v");
    detail::require_output_size(out, value_dim(), where);
    if (options_.check_finite) {
      detail::require_finite(phi_q, where, "phi_q");
      detail::require_finite(phi_k, where, "phi_k");
      detail::require_finite(v, where, "v");
    }
  }

  template <class DQ, class DK, class DV>
  void load_token(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                  const Eigen::MatrixBase<DV>& v) {
    query_ = phi_q.reshaped().template cast<Acc>();
    key_ = phi_k.reshaped().template cast<Acc>();
    value_ = v.reshaped().template cast<Acc>();
  }

  /// The recurrence for the token in the workspace; gate_ holds per-feature gates when
  /// `per_feature`, else `scalar` is the gate.
  void advance(bool per_feature, Acc scalar, Eigen::Ref<Vector<T>> out) {
    if (per_feature) {
      for (Eigen::Index c = 0; c < feature_dim(); ++c) s_.row(c) *= gate_(c);
      z_.array() *= gate_.array();
    } else {
      s_ *= scalar;
      z_ *= scalar;
    }
    s_.noalias() += key_ * value_.transpose();
    z_ += key_;
    num_.noalias() = s_.transpose() * query_;
    detail::write_gated_row(num_, query_.dot(z_), options_, out);
    ++tokens_;
  }

  Matrix<Acc> s_;
  Vector<Acc> z_;
  Options options_;
  std::int64_t tokens_ = 0;
  Vector<Acc> query_, key_, value_, gate_, num_;
};

}  // namespace linattn
