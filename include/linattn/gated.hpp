// SPDX-License-Identifier: MIT
// Gated linear attention (GLA, Mamba-2, RWKV-6 style): a data-dependent gate a_t in (0, 1]
// per token, scalar or per feature, in place of the constant decay. The forward runs on the one
// chunked kernel (detail/chunked.hpp), the recurrent form is RecurrentState's gated step; the
// backward pass still has its own chunked kernel here (GatedKernel), until it moves onto the
// engine too.
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
#include <linattn/gates.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/recurrent_state.hpp>
#include <string>
#include <type_traits>
#include <utility>

/// The recurrence, with phi_q, phi_k: N x C, v: N x Dv and gates a: N x 1 or N x C:
///     S_t = diag(a_t) S_{t-1} + phi_k_t v_t^T,   z_t = a_t o z_{t-1} + phi_k_t
///     out_t = phi_q_t^T S_t / (phi_q_t . z_t + eps)   (the numerator alone without normalize)
/// Gates are given as a_t, or in log space as log_gates(g) (g_t = log a_t, -infinity resets).
/// Options::decay must stay 1: the gates replace it (fold a constant decay g into them as
/// g a_t). Like the other kernels, every entry point takes an optional first template
/// argument, the accumulation type (default: the input scalar).
namespace linattn {

namespace detail {

/// Which index of the state the gates scale.
enum class GateSide {
  keys,    ///< S = diag(a) S + k v^T: the forward pass (and d v in the backward pass)
  values,  ///< S = S diag(a) + k v^T: the backward passes for d phi_q and d phi_k
};

/// Every check of the sequence routines, before anything is written: shapes, options, gates in
/// (0, 1] (always), and NaN or Inf in phi_q, phi_k, v (with check_finite).
template <class DQ, class DK, class DV, class DG>
void validate_gated_sequence(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                             const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& gates,
                             const Options& options, const char* where) {
  validate_sequence_shapes(phi_q, phi_k, v, options, where, "phi_q", "phi_k");
  require_unit_scale(options, where);
  validate_gates(gates.derived(), phi_q.rows(), phi_q.cols(), options, where);
  scan_inputs(phi_q, phi_k, v, options, where, "phi_q", "phi_k");
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

namespace detail {

/// The gate argument of a gated entry point: a_t or log_gates(g), of the inputs' scalar.
template <class DQ, class DK, class DV, class Gates>
using enable_if_gates = std::enable_if_t<gate_traits<Gates>::is_gate &&
                                         std::is_same_v<typename DQ::Scalar, typename DK::Scalar> &&
                                         std::is_same_v<typename DQ::Scalar, typename DV::Scalar>>;

/// Validates everything, then runs the one chunked kernel with the gates attached to the
/// source. Per-feature gates read plain features (an exponential map's are checked finite).
template <class Acc, class DQ, class DK, class DV, class Gates, class Map>
void gated_attention(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                     const Eigen::MatrixBase<DV>& v, const Gates& gates, const Map& map,
                     Eigen::Ref<Matrix<typename DQ::Scalar>> out, const Options& options,
                     const char* where) {
  using Scalar = typename DQ::Scalar;
  using T = accumulator_t<Acc, Scalar>;
  static_assert(std::is_same_v<gate_scalar_t<Gates>, Scalar>,
                "the gates must have the inputs' scalar type");
  if constexpr (check_feature_map<Map, T>()) {
    constexpr bool features = is_identity_map<Map>;
    validate_sequence_shapes(q, k, v, options, where, features ? "phi_q" : "q",
                             features ? "phi_k" : "k");
    require_output_shape(out, q.rows(), v.cols(), where);
    const GateMatrix<Gates> gate_rows(gates);
    if constexpr (features) {
      validate_gates(gates, q.rows(), q.cols(), options, where);
      scan_inputs(q, k, v, options, where, "phi_q", "phi_k");
      FeaturizedSource<T, DQ, DK, DV> source(q.derived(), k.derived(), v.derived());
      source.attach_gates(gate_rows);
      run_attention<true>(source, out, options);
    } else {
      MappedSource<T, DQ, DK, DV, Map> source(q.derived(), k.derived(), v.derived(), map,
                                              options.check_finite, where, gate_rows.cols() == 1);
      validate_gates(gates, q.rows(), source.feature_dim(), options, where);
      scan_inputs(q, k, v, options, where, "q", "k");
      source.attach_gates(gate_rows);
      run_attention<true>(source, out, options);
    }
  }
}

}  // namespace detail

/// Gated causal linear attention, chunked (parallel) form, into `out`:
///     S_t = diag(a_t) S_{t-1} + phi(k_t) v_t^T,   z_t = a_t o z_{t-1} + phi(k_t)
///     out_t = phi(q_t)^T S_t / (phi(q_t) . z_t + eps)   (the numerator alone without normalize)
/// The same engine as causal_linear_attention: scalar gates are per-token factors of the
/// register-tiled stream, per-feature gates weight its queries and keys per feature. O(N) time;
/// allocates O(chunk * (C + Dv) + chunk^2 + C * Dv), nothing proportional to N. Gates near 0
/// (1e-30) stay finite, and a log gate of -infinity resets the state (a document boundary).
/// @param q        N x Dk queries, one row per token (features, with Identity)
/// @param k        N x Dk keys
/// @param v        N x Dv values
/// @param gates    N x 1 (scalar) or N x C (per feature): a_t in (0, 1], or log_gates(g) with
///                 g_t = log a_t <= 0
/// @param map      feature map (Identity{} for precomputed features)
/// @param out      N x Dv result, row-major (may not alias the inputs)
/// @param options  eps, normalize, chunk, check_finite, threads; decay must be 1
template <class Acc = void, class DQ, class DK, class DV, class Gates, class Map,
          class = detail::enable_if_gates<DQ, DK, DV, Gates>>
void causal_gated_linear_attention_into(const Eigen::MatrixBase<DQ>& q,
                                        const Eigen::MatrixBase<DK>& k,
                                        const Eigen::MatrixBase<DV>& v, const Gates& gates,
                                        const Map& map, Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                                        const Options& options = {}) {
  detail::gated_attention<Acc>(q, k, v, gates, map, out, options, "causal_gated_linear_attention");
}

/// Gated causal linear attention; returns N x Dv. See causal_gated_linear_attention_into.
/// @param q        N x Dk queries
/// @param k        N x Dk keys
/// @param v        N x Dv values
/// @param gates    N x 1 or N x C gates a_t in (0, 1], or log_gates(g)
/// @param map      feature map (Identity{} for precomputed features); a call without one does
///                 not compile
/// @param options  eps, normalize, chunk, check_finite, threads; decay must be 1
template <class Acc = void, class DQ, class DK, class DV, class Gates,
          class Map = detail::MissingFeatureMap, class = detail::enable_if_gates<DQ, DK, DV, Gates>>
Matrix<typename DQ::Scalar> causal_gated_linear_attention(const Eigen::MatrixBase<DQ>& q,
                                                          const Eigen::MatrixBase<DK>& k,
                                                          const Eigen::MatrixBase<DV>& v,
                                                          const Gates& gates, const Map& map = {},
                                                          const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  detail::gated_attention<Acc>(q, k, v, gates, map, out, options, "causal_gated_linear_attention");
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

}  // namespace linattn
