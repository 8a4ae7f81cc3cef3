// SPDX-License-Identifier: MIT
// The backward pass of the delta rule (DeltaNet, Gated DeltaNet, KDA): gradients of a loss with
// respect to q, k, v, beta and the gates of causal_delta_rule and causal_gated_delta_rule.
#pragma once

#include <cstddef>
#include <linattn/config.hpp>
#include <linattn/delta_rule.hpp>
#include <linattn/detail/delta_rule_backward.hpp>
#include <linattn/gates.hpp>
#include <linattn/gradients.hpp>
#include <type_traits>

/// Reverse mode through the forward of delta_rule.hpp (q^ = s n(q_t), k^ = n(k_t), n the
/// optional in-kernel L2 norm; S' = diag(a_t) S_{t-1}; u = beta_t (v_t - S'^T k^);
/// S_t = S' + k^ u^T; out_t = S_t^T q^), in its recurrent form, not the chunked (WY) backward
/// of FLA's kernels:
///   1. the chunked forward runs once, keeping the state at the start of every block of
///      L = min(N, max(chunk, ceil(sqrt(N)))) tokens (the checkpoints);
///   2. block by block from the last, the block's states S_{t-1} are recomputed token by token
///      from its checkpoint (delta_step), then reverse mode runs over its tokens from the last,
///      carrying dS, the gradient with respect to the state, from block to block.
/// Time O(N Dk Dv): per token a recomputed step (two passes over the Dk x Dv state and a copy)
/// and about eight matrix-vector and rank-1 passes over S_{t-1} and dS, on top of one chunked
/// forward: several times the chunked forward (about 5x for DeltaNet and Gated DeltaNet, 3x for
/// KDA, at N = 4096, Dk = Dv = 128 in float). Workspace: (ceil(N / L) + L) Dk Dv for the
/// checkpoints and one block's states, about 2 sqrt(N) Dk Dv unless the chunk is longer, plus
/// O(L (Dk + Dv)), allocated per call unless a DeltaBackwardWorkspace keeps it. Single-threaded:
/// DeltaOptions::threads splits only the finiteness scans.
namespace linattn {

/// The delta-rule backward's buffers, kept by the caller across calls (a training loop): the
/// checkpoints and one block's states and rows. A call of the shape of the last one allocates
/// nothing; another shape resizes what differs.
template <class Acc>
class DeltaBackwardWorkspace {
 public:
  static_assert(detail::is_supported_scalar<Acc>,
                "DeltaBackwardWorkspace<Acc> takes the accumulation type: float or double (the "
                "inputs' scalar for float and double inputs, float for Eigen::half and bfloat16)");

  /// Bytes a backward of N tokens holds: (ceil(N / L) + L) Dk Dv for the checkpoints and one
  /// block's states (L = max(chunk, ceil(sqrt(N))), at most N), L (4 Dk + 4 Dv + 2 G + 2) rows
  /// (2 L Dk more with l2_normalize), 2 Dk Dv and 6 (Dk + Dv) more, all of Acc.
  /// @param n           N, tokens
  /// @param key_dim     Dk
  /// @param value_dim   Dv
  /// @param gate_width  0 (DeltaNet), 1 (Gated DeltaNet) or Dk (KDA)
  /// @param options     the call's options (chunk, l2_normalize)
  static std::size_t bytes(Eigen::Index n, Eigen::Index key_dim, Eigen::Index value_dim,
                           Eigen::Index gate_width = 0, const DeltaOptions& options = {}) {
    const Eigen::Index l = detail::checkpoint_interval(options.chunk, n);
    const auto blocks = static_cast<std::size_t>((n + l - 1) / l);
    const auto rows = static_cast<std::size_t>(l);
    const auto dk = static_cast<std::size_t>(key_dim);
    const auto dv = static_cast<std::size_t>(value_dim);
    const auto g = static_cast<std::size_t>(std::max<Eigen::Index>(gate_width, 1));
    const std::size_t row_entries =
        4 * dk + 4 * dv + 2 * g + 2 + (options.l2_normalize ? 2 * dk : 0);
    return sizeof(Acc) *
           ((blocks + rows) * dk * dv + rows * row_entries + 2 * dk * dv + 6 * (dk + dv));
  }

  /// Bytes the buffers hold now (bytes() of the last call's shape).
  std::size_t held_bytes() const { return backward_.held_bytes(); }

  /// The buffers, for the backward calls.
  detail::DeltaBackward<Acc>& backward() { return backward_; }

 private:
  detail::DeltaBackward<Acc> backward_;
};

/// Backward of causal_delta_rule (DeltaNet), into caller-provided gradients. Validates as the
/// forward does, plus grad_out (its shape, and its values under check_finite) and the shapes of
/// the gradients; throws linattn::Error before writing anything. See the header's comment for
/// the method, its cost and its workspace.
/// @param q          N x Dk queries, as given to the forward
/// @param k          N x Dk keys
/// @param v          N x Dv values
/// @param beta       N learning rates in (0, 1] ((0, 2] with allow_negative_eigenvalues), a row
///                   or column vector
/// @param grad_out   N x Dv gradient of the loss with respect to the forward's output
/// @param grad_q     N x Dk result: d loss / d q (the raw queries); row-major, may not alias the
///                   inputs
/// @param grad_k     N x Dk result: d loss / d k
/// @param grad_v     N x Dv result: d loss / d v
/// @param grad_beta  N result: d loss / d beta
/// @param options    the forward's options (scale, l2_normalize, allow_negative_eigenvalues,
///                   chunk: the forward's chunk and the least checkpoint interval, check_finite)
template <class Acc = void, class DQ, class DK, class DV, class DB, class DO>
void causal_delta_rule_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DO>& grad_out,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_q, Eigen::Ref<Matrix<typename DQ::Scalar>> grad_k,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v,
    Eigen::Ref<Vector<typename DQ::Scalar>> grad_beta, const DeltaOptions& options = {}) {
  detail::delta_rule_backward_into<Acc, DQ, DK, DV, DB, DO, void>(
      q, k, v, beta, nullptr, grad_out, grad_q, grad_k, grad_v, nullptr, grad_beta, options,
      "causal_delta_rule_backward");
}

/// causal_delta_rule_backward_into with the caller's workspace: the same gradients, bit for
/// bit, and no allocation when the shapes repeat. Arguments as there.
/// @param workspace  DeltaBackwardWorkspace of the accumulation type (the inputs' scalar for
///                   float and double, float for Eigen::half and bfloat16)
template <class Acc = void, class DQ, class DK, class DV, class DB, class DO>
void causal_delta_rule_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DO>& grad_out,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_q, Eigen::Ref<Matrix<typename DQ::Scalar>> grad_k,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v,
    Eigen::Ref<Vector<typename DQ::Scalar>> grad_beta, const DeltaOptions& options,
    DeltaBackwardWorkspace<detail::accumulator_t<Acc, typename DQ::Scalar>>& workspace) {
  detail::delta_rule_backward_into<Acc, DQ, DK, DV, DB, DO, void>(
      q, k, v, beta, nullptr, grad_out, grad_q, grad_k, grad_v, nullptr, grad_beta, options,
      "causal_delta_rule_backward", &workspace.backward());
}

/// Backward of causal_delta_rule (DeltaNet); returns the gradients (gates empty, N x 0). See
/// causal_delta_rule_backward_into.
/// @param q         N x Dk queries
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param beta      N learning rates
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param options   the forward's options
template <class Acc = void, class DQ, class DK, class DV, class DB, class DO>
DeltaRuleGradients<typename DQ::Scalar> causal_delta_rule_backward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DO>& grad_out,
    const DeltaOptions& options = {}) {
  using S = typename DQ::Scalar;
  DeltaRuleGradients<S> grads{{q.rows(), q.cols()},
                              {k.rows(), k.cols()},
                              {v.rows(), v.cols()},
                              Vector<S>(beta.size()),
                              Matrix<S>(q.rows(), 0)};
  causal_delta_rule_backward_into<Acc>(q, k, v, beta, grad_out, grads.q, grads.k, grads.v,
                                       grads.beta, options);
  return grads;
}

/// Backward of causal_gated_delta_rule (Gated DeltaNet with N x 1 gates, KDA with N x Dk), into
/// caller-provided gradients. Validates as the forward does, plus grad_out and the shapes of
/// the gradients; throws linattn::Error before writing anything. See the header's comment for
/// the method, its cost and its workspace.
/// @param q           N x Dk queries, as given to the forward
/// @param k           N x Dk keys
/// @param v           N x Dv values
/// @param gates       N x 1 or N x Dk: log_gates(g) (g_t <= 0, -infinity resets) or a_t in (0, 1]
/// @param beta        N learning rates in (0, 1] ((0, 2] with allow_negative_eigenvalues)
/// @param grad_out    N x Dv gradient of the loss with respect to the forward's output
/// @param grad_q      N x Dk result: d loss / d q; row-major, may not alias the inputs
/// @param grad_k      N x Dk result: d loss / d k
/// @param grad_v      N x Dv result: d loss / d v
/// @param grad_gates  the gates' shape, N x 1 or N x Dk: d loss / d g_t for log_gates(g) (0 at a
///                    reset), d loss / d a_t for gates a_t
/// @param grad_beta   N result: d loss / d beta
/// @param options     the forward's options
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DB, class DO,
          class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
void causal_gated_delta_rule_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Gates& gates, const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DO>& grad_out,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_q, Eigen::Ref<Matrix<typename DQ::Scalar>> grad_k,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_gates,
    Eigen::Ref<Vector<typename DQ::Scalar>> grad_beta, const DeltaOptions& options = {}) {
  detail::delta_rule_backward_into<Acc>(q, k, v, beta, &gates, grad_out, grad_q, grad_k, grad_v,
                                        &grad_gates, grad_beta, options,
                                        "causal_gated_delta_rule_backward");
}

/// causal_gated_delta_rule_backward_into with the caller's workspace: the same gradients, bit
/// for bit, and no allocation when the shapes repeat. Arguments as there.
/// @param workspace  DeltaBackwardWorkspace of the accumulation type
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DB, class DO,
          class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
void causal_gated_delta_rule_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Gates& gates, const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DO>& grad_out,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_q, Eigen::Ref<Matrix<typename DQ::Scalar>> grad_k,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_gates,
    Eigen::Ref<Vector<typename DQ::Scalar>> grad_beta, const DeltaOptions& options,
    DeltaBackwardWorkspace<detail::accumulator_t<Acc, typename DQ::Scalar>>& workspace) {
  detail::delta_rule_backward_into<Acc>(q, k, v, beta, &gates, grad_out, grad_q, grad_k, grad_v,
                                        &grad_gates, grad_beta, options,
                                        "causal_gated_delta_rule_backward", &workspace.backward());
}

/// Backward of causal_gated_delta_rule (Gated DeltaNet, KDA); returns the gradients. See
/// causal_gated_delta_rule_backward_into.
/// @param q         N x Dk queries
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param gates     N x 1 or N x Dk: log_gates(g) or a_t
/// @param beta      N learning rates
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param options   the forward's options
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DB, class DO,
          class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
DeltaRuleGradients<typename DQ::Scalar> causal_gated_delta_rule_backward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Gates& gates, const Eigen::MatrixBase<DB>& beta, const Eigen::MatrixBase<DO>& grad_out,
    const DeltaOptions& options = {}) {
  using S = typename DQ::Scalar;
  const auto& values = detail::gate_traits<Gates>::values(gates);
  DeltaRuleGradients<S> grads{{q.rows(), q.cols()},
                              {k.rows(), k.cols()},
                              {v.rows(), v.cols()},
                              Vector<S>(beta.size()),
                              {values.rows(), values.cols()}};
  causal_gated_delta_rule_backward_into<Acc>(q, k, v, gates, beta, grad_out, grads.q, grads.k,
                                             grads.v, grads.gates, grads.beta, options);
  return grads;
}

}  // namespace linattn
