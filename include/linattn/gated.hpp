// SPDX-License-Identifier: MIT
// Gated linear attention (GLA, Mamba-2, RWKV-6 style): a data-dependent gate a_t in (0, 1]
// per token, scalar or per feature, in place of the constant decay. Every form runs on the one
// engine: the forward and the backward on the chunked kernel (detail/chunked.hpp, backward.hpp),
// the recurrent form is RecurrentState's gated step.
#pragma once

#include <linattn/backward.hpp>
#include <linattn/config.hpp>
#include <linattn/detail/bonus.hpp>
#include <linattn/detail/bonus_backward.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/recurrent_state.hpp>
#include <type_traits>

/// The recurrence, with phi_q, phi_k: N x C, v: N x Dv and gates a: N x 1 or N x C:
///     S_t = diag(a_t) S_{t-1} + phi_k_t v_t^T,   z_t = a_t o z_{t-1} + phi_k_t
///     out_t = phi_q_t^T S_t / (phi_q_t . z_t + eps)   (the numerator alone without normalize)
/// Gates are given as a_t, or in log space as log_gates(g) (g_t = log a_t, -infinity resets).
/// Options::decay must stay 1: the gates replace it (fold a constant decay g into them as
/// g a_t). Like the other kernels, every entry point takes an optional first template
/// argument, the accumulation type (default: the input scalar).
namespace linattn {

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

/// Validates everything, then runs the bonus form (detail/bonus.hpp) from an empty state.
template <class Acc, class DQ, class DK, class DV, class Gates, class DU, class Map>
void bonus_attention(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                     const Eigen::MatrixBase<DV>& v, const BonusGates<Gates, DU>& gates,
                     const Map& map, Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                     const Options& options, const char* where) {
  using Scalar = typename DQ::Scalar;
  using T = accumulator_t<Acc, Scalar>;
  static_assert(std::is_same_v<gate_scalar_t<Gates>, Scalar>,
                "the gates must have the inputs' scalar type");
  if constexpr (check_feature_map<Map, T>()) {
    require_plain_features<Map>();
    constexpr bool features = is_identity_map<Map>;
    validate_sequence_shapes(q, k, v, options, where, features ? "phi_q" : "q",
                             features ? "phi_k" : "k");
    require_output_shape(out, q.rows(), v.cols(), where);
    const Eigen::Index c = features ? q.cols() : map.feature_dim(q.cols());
    validate_gates(gates.gates(), q.rows(), c, options, where);
    validate_bonus(gates.bonus(), c, options, where);
    scan_inputs(q, k, v, options, where, features ? "phi_q" : "q", features ? "phi_k" : "k");
    bonus_rows<T>(q, k, v, gates.gates(), gates.bonus(), map, out, options,
                  resolve_threads(options), where);
  }
}

}  // namespace detail

/// Gated causal linear attention with RWKV-6's bonus u (made by with_bonus(gates, u)), into
/// `out`: out_t = s phi(q_t)^T (S_{t-1} + diag(u) phi(k_t) v_t^T), S_t = diag(a_t) S_{t-1} +
/// phi(k_t) v_t^T: FLA's chunk_rwkv6 with r = q and w = log a_t (pass log_gates(w)). The state
/// before the token is the gated kernel's, so this runs at its speed.
/// @param q        N x Dk receptances (queries; features, with Identity)
/// @param k        N x Dk keys
/// @param v        N x Dv values
/// @param gates    with_bonus(gates, u): gates N x 1 or N x C (a_t, or log_gates(w)), u C
/// @param map      a plain feature map (Identity{} for precomputed features)
/// @param out      N x Dv result, row-major (may not alias the inputs)
/// @param options  normalize must be false; scale, chunk, check_finite, threads; decay 1
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DU, class Map>
void causal_gated_linear_attention_into(const Eigen::MatrixBase<DQ>& q,
                                        const Eigen::MatrixBase<DK>& k,
                                        const Eigen::MatrixBase<DV>& v,
                                        const BonusGates<Gates, DU>& gates, const Map& map,
                                        Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                                        const Options& options = {}) {
  detail::bonus_attention<Acc>(q, k, v, gates, map, out, options, "causal_gated_linear_attention");
}

/// Gated causal linear attention with RWKV-6's bonus u; returns N x Dv. See the _into form.
/// @param q        N x Dk receptances (queries)
/// @param k        N x Dk keys
/// @param v        N x Dv values
/// @param gates    with_bonus(gates, u)
/// @param map      a plain feature map (Identity{} for precomputed features)
/// @param options  normalize must be false
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DU,
          class Map = detail::MissingFeatureMap>
Matrix<typename DQ::Scalar> causal_gated_linear_attention(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const BonusGates<Gates, DU>& gates, const Map& map = {}, const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  detail::bonus_attention<Acc>(q, k, v, gates, map, out, options, "causal_gated_linear_attention");
  return out;
}

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

/// Backward pass of causal_gated_linear_attention: the gradients of a loss L with respect to
/// q, k, v and the gates, given grad_out = dL/d out, on the same engine as the forward (every
/// pass a chunked kernel, threads over the sequence as Options::threads allows). O(N C Dv)
/// time and O(N (C + Dv)) memory: chunk states are recomputed, never stored per token. Where
/// the denominator guard clamped a row, no gradient flows through its denominator; a zero row
/// passes none at all. With a map other than Identity the features are recomputed in the
/// accumulation type and the map's backward carries the gradients to q and k.
/// @param q         N x Dk queries (features, with Identity)
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param gates     N x 1 or N x C: a_t in (0, 1], or log_gates(g)
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param map       the forward's feature map; needs a backward member unless Identity
/// @param grads     receives q, k (N x Dk), v (N x Dv) and gates (the gates' shape: d L / d a_t,
///                  or d L / d g_t for log gates); written only when the call succeeds, and
///                  reused (no allocation once its matrices have these shapes); it may not
///                  share memory with the inputs
/// @param options   as given to the forward call (scale included); decay must be 1
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DO, class Map,
          class = detail::enable_if_gates<DQ, DK, DV, Gates>>
void causal_gated_linear_attention_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Gates& gates, const Eigen::MatrixBase<DO>& grad_out, const Map& map,
    GatedAttentionGradients<typename DQ::Scalar>& grads, const Options& options = {}) {
  detail::gated_backward<Acc>(q, k, v, gates, grad_out, map, grads, options,
                              "causal_gated_linear_attention_backward");
}

/// causal_gated_linear_attention_backward_into with the caller's workspace for the streamed
/// passes (the feature and gate gradients are still N-row matrices of the call's own).
/// @param workspace  BackwardWorkspace of the accumulation type
/// (other arguments as above)
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DO, class Map,
          class = detail::enable_if_gates<DQ, DK, DV, Gates>>
void causal_gated_linear_attention_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Gates& gates, const Eigen::MatrixBase<DO>& grad_out, const Map& map,
    GatedAttentionGradients<typename DQ::Scalar>& grads, const Options& options,
    BackwardWorkspace<detail::accumulator_t<Acc, typename DQ::Scalar>>& workspace) {
  detail::gated_backward<Acc>(q, k, v, gates, grad_out, map, grads, options,
                              "causal_gated_linear_attention_backward", &workspace.scratch());
}

/// Backward pass of causal_gated_linear_attention; returns the four gradients.
/// See causal_gated_linear_attention_backward_into.
/// @param q         N x Dk queries
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param gates     N x 1 or N x C: a_t in (0, 1], or log_gates(g)
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param map       the forward's feature map (Identity{} for precomputed features)
/// @param options   as given to the forward call; decay must be 1
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DO,
          class Map = detail::MissingFeatureMap, class = detail::enable_if_gates<DQ, DK, DV, Gates>>
GatedAttentionGradients<typename DQ::Scalar> causal_gated_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Gates& gates, const Eigen::MatrixBase<DO>& grad_out, const Map& map = {},
    const Options& options = {}) {
  GatedAttentionGradients<typename DQ::Scalar> grads;
  detail::gated_backward<Acc>(q, k, v, gates, grad_out, map, grads, options,
                              "causal_gated_linear_attention_backward");
  return grads;
}

/// Backward pass of causal_gated_linear_attention with RWKV-6's bonus (with_bonus(gates, u)):
/// the gradients of a loss L with respect to q, k, v, the gates and u, given grad_out = dL/d out.
/// The gated backward's chunked passes on the state part (the queries one row ahead), plus the
/// bonus term's gradients, in the accumulation type; O(N C Dv) time, O(N (C + Dv)) memory. The
/// last token's gate moves a state nothing reads, so its gradient is 0, as is a reset's.
/// @param q         N x Dk receptances (queries; features, with Identity)
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param gates     with_bonus(gates, u): gates N x 1 or N x C (a_t, or log_gates(w)), u C
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param map       the forward's plain feature map; needs a backward member unless Identity
/// @param grads     receives q, k (N x Dk), v (N x Dv), gates (the gates' shape: d L / d a_t,
///                  or d L / d w_t for log gates) and u (u's shape); written only when the call
///                  succeeds
/// @param options   as given to the forward call: normalize false, scale; decay must be 1
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DU, class DO,
          class Map>
void causal_gated_linear_attention_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const BonusGates<Gates, DU>& gates, const Eigen::MatrixBase<DO>& grad_out, const Map& map,
    BonusAttentionGradients<typename DQ::Scalar>& grads, const Options& options = {}) {
  detail::bonus_backward<Acc>(q, k, v, gates, grad_out, map, grads, options,
                              "causal_gated_linear_attention_backward");
}

/// Backward pass of causal_gated_linear_attention with RWKV-6's bonus; returns the five
/// gradients. See the _into form.
/// @param q         N x Dk receptances (queries)
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param gates     with_bonus(gates, u)
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param map       the forward's plain feature map (Identity{} for precomputed features)
/// @param options   as given to the forward call: normalize false; decay must be 1
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DU, class DO,
          class Map = detail::MissingFeatureMap>
BonusAttentionGradients<typename DQ::Scalar> causal_gated_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const BonusGates<Gates, DU>& gates, const Eigen::MatrixBase<DO>& grad_out, const Map& map = {},
    const Options& options = {}) {
  BonusAttentionGradients<typename DQ::Scalar> grads;
  detail::bonus_backward<Acc>(q, k, v, gates, grad_out, map, grads, options,
                              "causal_gated_linear_attention_backward");
  return grads;
}

}  // namespace linattn
