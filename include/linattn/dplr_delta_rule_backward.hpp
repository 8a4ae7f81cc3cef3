// SPDX-License-Identifier: MIT
// The backward pass of the generalized delta rule (RWKV-7): gradients of a loss with respect to
// q, k, v, a, b and the gates of causal_dplr_delta_rule.
#pragma once

#include <linattn/config.hpp>
#include <linattn/detail/dplr_chunk_backward.hpp>
#include <linattn/detail/dplr_delta_rule_backward.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/gates.hpp>
#include <linattn/gradients.hpp>
#include <string>
#include <type_traits>

/// Reverse mode through causal_dplr_delta_rule (S_t = diag(w_t) S_{t-1} + b_t (a_t^T S_{t-1})
/// + k_t v_t^T, out_t = S_t^T (s q_t)) in one of two forms, on one thread:
///   - chunked (WY; DeltaForm::chunked, and automatic at Dk Dv >= 64 x 64): the forward runs
///     once by chunks of min(chunk, 16) tokens keeping S at each chunk's start, U and the
///     chunk's a-side pairs, then reverse mode runs through each chunk's GEMMs from the last
///     (detail/dplr_chunk_backward.hpp; docs/math.md section 13). Workspace (N / L) Dk Dv +
///     N (Dv + 2L) numbers.
///   - recurrent (DeltaForm::streamed, and automatic below 64 x 64): the forward keeps the
///     state at the start of every block of L = min(N, max(chunk, ceil(sqrt(N)))) tokens; block
///     by block from the last, the block's states are recomputed token by token from its
///     checkpoint, then reverse mode runs over its tokens, carrying dS: ten matrix-vector and
///     rank-1 passes over S_{t-1} and dS a token, about 2 sqrt(N) Dk Dv numbers of workspace.
/// Both are O(N Dk Dv) time; the chunked form is 1.15x faster at 64 x 64 and 1.6x at 128 x 128,
/// the recurrent one 1.2x at 32 x 32 (docs/performance.md).
namespace linattn {

namespace detail {

/// The checks of a generalized delta-rule backward call, then the backward in Acc.
template <class Acc, class DQ, class DK, class DV, class DA, class DB, class Gates, class DO>
void dplr_backward_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                        const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DA>& a,
                        const Eigen::MatrixBase<DB>& b, const Gates& gates,
                        const Eigen::MatrixBase<DO>& grad_out,
                        DplrGradients<typename DQ::Scalar>& grads, const DplrOptions& options,
                        const char* where) {
  using Scalar = typename DQ::Scalar;
  using T = accumulator_t<Acc, Scalar>;
  check_dplr_call_scalars<Acc, DQ, DK, DV, DA, DB, Gates>();
  static_assert(std::is_same_v<typename DO::Scalar, Scalar>,
                "grad_out must have the inputs' scalar type: cast it first");
  using Traits = gate_traits<Gates>;
  validate_dplr_options(options, where);
  validate_sequence_shapes(q, k, v, engine_options(options), where, "q", "k");
  require_pair_shape(a, q.rows(), q.cols(), where, "a");
  require_pair_shape(b, q.rows(), q.cols(), where, "b");
  require_gate_shape(Traits::values(gates), q.rows(), q.cols(), where, "q");
  require_gates_in_range<Traits::log_space>(Traits::values(gates), where, "gates");
  if (grad_out.rows() != v.rows() || grad_out.cols() != v.cols()) {
    throw Error(std::string(where) + ": grad_out is " + shape_string(grad_out) + " but v is " +
                shape_string(v) + "; the gradient has the output's shape");
  }
  scan_dplr_inputs(q, k, v, a, b, options, where);
  if (options.check_finite) {
    require_finite_parallel(grad_out, where, "grad_out", resolve_threads(engine_options(options)));
  }
  const Eigen::Index n = q.rows(), dk = q.cols(), dv = v.cols();
  const Eigen::Index gate_dim = Traits::values(gates).cols();
  grads.q.resize(n, dk);
  grads.k.resize(n, dk);
  grads.v.resize(n, dv);
  grads.a.resize(n, dk);
  grads.b.resize(n, dk);
  grads.gates.resize(n, gate_dim);
  const GateMatrix<Gates> gate_rows(gates);
  if (chunked_dplr_backward(options, dk, dv)) {
    DplrChunkBackward<T> backward;
    backward.reshape(n, dk, dv, gate_dim, options);
    backward.template run<Traits::log_space>(q.derived(), k.derived(), v.derived(), a.derived(),
                                             b.derived(), gate_rows, grad_out.derived(), grads);
    return;
  }
  DplrBackward<T> backward;
  backward.reshape(n, dk, dv, gate_dim, options);
  backward.template run<Traits::log_space>(q.derived(), k.derived(), v.derived(), a.derived(),
                                           b.derived(), gate_rows, grad_out.derived(), grads,
                                           where);
}

}  // namespace detail

/// Backward of causal_dplr_delta_rule into `grads` (resized to the inputs' shapes): validates
/// as the forward does, plus grad_out (its shape, and its values under check_finite); throws
/// linattn::Error before writing anything. See the header's comment for the method and cost.
/// @param q         N x Dk queries, as given to the forward
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param a         N x Dk (FLA's alpha; RWKV-7's -kk)
/// @param b         N x Dk (FLA's beta; RWKV-7's kk * a)
/// @param gates     N x Dk or N x 1: log_gates(g) or w_t, as given to the forward
/// @param grad_out  N x Dv gradient of the loss with respect to the forward's output
/// @param grads     result: the gradients with respect to q, k, v, a, b and the gates (d / d g_t
///                  for log_gates(g), 0 where g_t = -infinity; d / d w_t for decays w_t)
/// @param options   the forward's options (scale, chunk, form: see above, check_finite)
template <class Acc = void, class DQ, class DK, class DV, class DA, class DB, class Gates, class DO,
          class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
void causal_dplr_delta_rule_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b, const Gates& gates,
    const Eigen::MatrixBase<DO>& grad_out, DplrGradients<typename DQ::Scalar>& grads,
    const DplrOptions& options = {}) {
  detail::dplr_backward_into<Acc>(q, k, v, a, b, gates, grad_out, grads, options,
                                  "causal_dplr_delta_rule_backward");
}

/// Backward of causal_dplr_delta_rule; returns the gradients. See
/// causal_dplr_delta_rule_backward_into.
/// @param q         N x Dk queries
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param a         N x Dk
/// @param b         N x Dk
/// @param gates     N x Dk or N x 1: log_gates(g) or w_t
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param options   the forward's options
template <class Acc = void, class DQ, class DK, class DV, class DA, class DB, class Gates, class DO,
          class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
DplrGradients<typename DQ::Scalar> causal_dplr_delta_rule_backward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b, const Gates& gates,
    const Eigen::MatrixBase<DO>& grad_out, const DplrOptions& options = {}) {
  DplrGradients<typename DQ::Scalar> grads;
  causal_dplr_delta_rule_backward_into<Acc>(q, k, v, a, b, gates, grad_out, grads, options);
  return grads;
}

}  // namespace linattn
