// SPDX-License-Identifier: MIT
// The backward pass of the delta rule (DeltaNet, Gated DeltaNet, KDA): gradients of a loss with
// respect to q, k, v, beta and the gates of causal_delta_rule and causal_gated_delta_rule.
#pragma once

#include <cstddef>
#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/delta_rule.hpp>
#include <linattn/detail/delta_rule_backward.hpp>
#include <linattn/detail/heads_backward.hpp>
#include <linattn/gates.hpp>
#include <linattn/gradients.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/multi_head.hpp>
#include <type_traits>
#include <vector>

/// Reverse mode through the forward of delta_rule.hpp (q^ = s n(q_t), k^ = n(k_t), n the
/// optional in-kernel L2 norm; S' = diag(a_t) S_{t-1}; u = beta_t (v_t - S'^T k^);
/// S_t = S' + k^ u^T; out_t = S_t^T q^), in the chunked (WY) form by default, as FLA's kernels:
///   1. the chunked forward runs once, keeping S at every chunk's start, U (N x Dv) and the
///      chunks' in-chunk key pairs B (N x L);
///   2. chunk by chunk from the last, reverse mode through the chunk's products (the pairs
///      recomputed, one transposed unit-triangular solve for dY), carrying dS, the gradient
///      with respect to the state, from chunk to chunk. docs/math.md section 12 derives it.
/// Every product a GEMM: about 2.5x the forward's FLOPs, measured 2.8x the chunked forward's
/// time for DeltaNet and Gated DeltaNet and 2.1x for KDA (N = 16,384, Dk = Dv = 128, float, one
/// thread; bench_backward). Workspace: (N / L) Dk Dv + N (Dv + L) for what the forward keeps
/// plus O(L (Dk + Dv + L)) for one chunk, allocated per call unless a DeltaBackwardWorkspace
/// keeps it. DeltaOptions::threads > 1 splits the value columns across threads (each repeats
/// the key-side work; their key gradients add, equal to one thread's to rounding); the view
/// calls run each head on one thread, exactly the matrix call with threads = 1.
///
/// DeltaForm::streamed runs the recurrent form instead, the reference the chunked one is
/// tested against: the state every L = min(N, max(chunk, ceil(sqrt(N)))) tokens, each block's
/// states recomputed token by token, reverse mode over them (about 5x the chunked forward for
/// DeltaNet and Gated DeltaNet, 3.4x for KDA; 2 sqrt(N) Dk Dv memory; one thread).
namespace linattn {

namespace detail {

/// A thread's buffers of the delta-rule view backward, kept from head to head: one head's
/// gradients (copied or added into the views) and the backward's checkpoints.
template <class T, class A>
struct DeltaHeadBuffers {
  Matrix<T> q, k, v, gates;
  Vector<T> beta;
  DeltaBackwardBuffers<A> backward;
};

/// The one driver of the delta rule's view backward calls (`gates` and `grad_gates` null for
/// DeltaNet): checks and scans everything before anything is written, then runs the matrix
/// backward of each (sequence, head) on the threads, over groups of heads that share no input
/// head with another group.
template <class Acc, class Q, class K, class V, class B, class G, class T, class Gates>
void heads_delta_rule_backward(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                               const Gates* gates, const HeadsView<B>& beta,
                               const HeadsView<G>& grad_out,
                               const std::vector<std::int64_t>* offsets, const HeadsView<T>& grad_q,
                               const HeadsView<T>& grad_k, const HeadsView<T>& grad_v,
                               const HeadsView<T>* grad_gates, const HeadsView<T>& grad_beta,
                               const DeltaOptions& options, const char* where) {
  static_assert(!std::is_const_v<T>,
                "the gradients must be writable views (HeadsView<float>, not "
                "HeadsView<const float>)");
  static_assert(is_supported_scalar<T>,
                "the delta rule's view backward takes float or double views (the matrix "
                "backward takes Eigen::half and bfloat16)");
  using A = accumulator_t<Acc, T>;
  require_gradient_view(grad_q, q, where, "grad_q", "q");
  require_gradient_view(grad_k, k, where, "grad_k", "k");
  require_gradient_view(grad_v, v, where, "grad_v", "v");
  require_gradient_view(grad_beta, beta, where, "grad_beta", "beta");
  if constexpr (!std::is_void_v<Gates>) {
    require_gradient_view(*grad_gates, gates->view, where, "grad_gates", "gates");
  }
  const SequenceRows sequences = check_heads_delta_rule<Acc>(q, k, v, gates, beta, grad_out,
                                                             offsets, options, where, "grad_out");
  const Options engine = engine_options(options);
  scan_grad_out(grad_out, engine, where);

  // Checked and scanned above: each head's call runs on one thread and rescans nothing.
  DeltaOptions head_options = options;
  head_options.threads = 1;
  head_options.check_finite = false;
  const Eigen::Index heads = grad_out.heads();
  Eigen::Index gate_heads = heads;
  if constexpr (!std::is_void_v<Gates>) gate_heads = gates->view.heads();
  const HeadGrouping grouping = options.head_grouping;
  const Eigen::Index group = backward_head_group(
      heads, {q.heads(), k.heads(), v.heads(), beta.heads(), gate_heads}, grouping);

  auto one_head = [&](Eigen::Index s, Eigen::Index h, DeltaHeadBuffers<T, A>& buffers) {
    const Eigen::Index b = sequences.batch_of(s), begin = sequences.begin(s),
                       rows = sequences.rows(s);
    const Eigen::Index hq = input_head(q, heads, h, grouping),
                       hk = input_head(k, heads, h, grouping),
                       hv = input_head(v, heads, h, grouping),
                       hb = input_head(beta, heads, h, grouping);
    // The first reader of an input head writes its gradient, the later ones add to it.
    auto later = [&](const auto& input) { return adds_to_input_head(input, heads, h, grouping); };
    const auto qs = q.head(b, hq).middleRows(begin, rows);
    const auto ks = k.head(b, hk).middleRows(begin, rows);
    const auto vs = v.head(b, hv).middleRows(begin, rows);
    const auto beta_rows = beta.head(b, hb).middleRows(begin, rows);  // N x 1
    const auto gs = grad_out.head(b, h).middleRows(begin, rows);
    Eigen::Ref<Matrix<T>> dq = buffer_rows(buffers.q, rows, q.dim());
    Eigen::Ref<Matrix<T>> dk = buffer_rows(buffers.k, rows, k.dim());
    Eigen::Ref<Matrix<T>> dv = buffer_rows(buffers.v, rows, v.dim());
    if (buffers.beta.size() < rows) buffers.beta.resize(rows);
    Eigen::Ref<Vector<T>> dbeta(buffers.beta.head(rows));
    if constexpr (std::is_void_v<Gates>) {
      using Rows = std::decay_t<decltype(qs)>;
      delta_rule_backward_into<Acc, Rows, Rows, Rows, Rows, Rows, void>(
          qs, ks, vs, beta_rows, nullptr, gs, dq, dk, dv, nullptr, dbeta, head_options, where,
          &buffers.backward);
    } else {
      const auto& gate_view = gates->view;
      const Eigen::Index hg = input_head(gate_view, heads, h, grouping);
      const auto gate_rows = gate_view.head(b, hg).middleRows(begin, rows);
      Eigen::Ref<Matrix<T>> dg = buffer_rows(buffers.gates, rows, gate_view.dim());
      if constexpr (Gates::log_space) {
        const LogGates<std::decay_t<decltype(gate_rows)>> logs(gate_rows);
        delta_rule_backward_into<Acc>(qs, ks, vs, beta_rows, &logs, gs, dq, dk, dv, &dg, dbeta,
                                      head_options, where, &buffers.backward);
      } else {
        delta_rule_backward_into<Acc>(qs, ks, vs, beta_rows, &gate_rows, gs, dq, dk, dv, &dg, dbeta,
                                      head_options, where, &buffers.backward);
      }
      store_head_rows(*grad_gates, b, hg, begin, dg, later(gate_view));
    }
    store_head_rows(grad_q, b, hq, begin, dq, later(q));
    store_head_rows(grad_k, b, hk, begin, dk, later(k));
    store_head_rows(grad_v, b, hv, begin, dv, later(v));
    store_head_rows(grad_beta, b, hb, begin, dbeta, later(beta));
  };
  for_each_head_group<DeltaHeadBuffers<T, A>>(sequences, heads, group, resolve_threads(engine),
                                              one_head);
}

}  // namespace detail

/// The delta-rule backward's buffers, kept by the caller across calls (a training loop): the
/// checkpoints and one block's states and rows. A call of the shape of the last one allocates
/// nothing; another shape resizes what differs.
template <class Acc>
class DeltaBackwardWorkspace {
 public:
  static_assert(detail::is_supported_scalar<Acc>,
                "DeltaBackwardWorkspace<Acc> takes the accumulation type: float or double (the "
                "inputs' scalar for float and double inputs, float for Eigen::half and bfloat16)");

  /// Bytes a backward of N tokens holds, all of Acc (the gates' logs in double). The chunked
  /// form, per part of the value columns (one per thread, at least 32 columns each; a view
  /// call's heads run on one thread each) of width W: (ceil(N / L) Dk + N) W + N L for the
  /// chunks' starting states, U and the in-chunk pairs, one chunk's rows and products (about
  /// L (8 Dk + 7 W + 6 L), and with KDA's per-feature gates about (L / 16 + 5) L Dk more for
  /// its sub-blocks' factors), and with several parts N (2 Dk + 1 + G) more each for their key
  /// gradients. The recurrent form (DeltaForm::streamed): (ceil(N / L) + L) Dk Dv for the
  /// checkpoints and one block's states (L = max(chunk, ceil(sqrt(N))), at most N),
  /// L (4 Dk + 4 Dv + 2 G + 2) rows (2 L Dk more with l2_normalize), 2 Dk Dv and 6 (Dk + Dv)
  /// more.
  /// @param n           N, tokens
  /// @param key_dim     Dk
  /// @param value_dim   Dv
  /// @param gate_width  0 (DeltaNet), 1 (Gated DeltaNet) or Dk (KDA)
  /// @param options     the call's options (chunk, l2_normalize, form, threads)
  static std::size_t bytes(Eigen::Index n, Eigen::Index key_dim, Eigen::Index value_dim,
                           Eigen::Index gate_width = 0, const DeltaOptions& options = {}) {
    if (detail::chunked_delta_backward(options)) {
      return detail::DeltaChunkBackward<Acc>::bytes(
          n, key_dim, value_dim, gate_width, options,
          detail::resolve_threads(detail::engine_options(options)));
    }
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
  std::size_t held_bytes() const {
    return buffers_.recurrent.held_bytes() + buffers_.chunked.held_bytes();
  }

  /// The buffers, for the backward calls.
  detail::DeltaBackwardBuffers<Acc>& buffers() { return buffers_; }

 private:
  detail::DeltaBackwardBuffers<Acc> buffers_;
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
///                   chunk, check_finite), form (streamed: the recurrent backward), threads
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
      "causal_delta_rule_backward", &workspace.buffers());
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
///                    reset), d loss / d a_t for gates a_t (in the chunked form (d / d log a_t)
///                    / a_t, whose rounding grows as 1 / a_t: give decays far below 1 as logs)
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
                                        "causal_gated_delta_rule_backward", &workspace.buffers());
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

/// Backward of causal_delta_rule_into on views (DeltaNet over [B, H, N, D] or [B, N, H, D]
/// caller memory, any strides): the gradients of a loss with respect to q, k, v and beta of
/// every head of every sequence, given grad_out = d loss / d out, written into caller memory.
/// Head (b, h) gets exactly causal_delta_rule_backward_into on q.head(b, hq), ...,
/// grad_out.head(b, h) with threads = 1. Grouped heads (Qwen3-Next's 16 q/k heads for 32 v heads):
/// a shared input head's gradient is the sum over the output heads that read it, added in
/// increasing h. Threads (DeltaOptions::threads) go over sequences x groups of heads that share no
/// input head, each head on one thread with its own workspace kept from head to head; the gradients
/// are the same on any number of threads. Every shape, option and value is checked before anything
/// is written.
/// @param q          B x Hq x N x Dk queries, as given to the forward (Hq divides H)
/// @param k          B x Hk x N x Dk keys (Hk divides H)
/// @param v          B x Hv x N x Dv values (Hv divides H)
/// @param beta       B x H x N x 1 learning rates (one head per value head)
/// @param grad_out   B x H x N x Dv gradient of the loss with respect to the forward's out
/// @param grad_q     B x Hq x N x Dk result: d loss / d q (the raw queries)
/// @param grad_k     B x Hk x N x Dk result: d loss / d k (the raw keys)
/// @param grad_v     B x Hv x N x Dv result: d loss / d v
/// @param grad_beta  B x H x N x 1 result: d loss / d beta; the gradient views may not overlap
///                   each other or the inputs (nor their own heads)
/// @param options    the forward's options, threads
template <class Acc = void, class Q, class K, class V, class B, class G, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>>
void causal_delta_rule_backward_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                     const HeadsView<V>& v, const HeadsView<B>& beta,
                                     const HeadsView<G>& grad_out, const HeadsView<T>& grad_q,
                                     const HeadsView<T>& grad_k, const HeadsView<T>& grad_v,
                                     const HeadsView<T>& grad_beta,
                                     const DeltaOptions& options = {}) {
  detail::heads_delta_rule_backward<Acc, Q, K, V, B, G, T, void>(
      q, k, v, nullptr, beta, grad_out, nullptr, grad_q, grad_k, grad_v, nullptr, grad_beta,
      options, "causal_delta_rule_backward");
}

/// Backward of causal_gated_delta_rule_into on views (Gated DeltaNet with [B, Hg, N, 1] gates,
/// KDA with [B, Hg, N, Dk]; a_t, or log_gates(view) for FLA's g): head (b, h) gets exactly
/// causal_gated_delta_rule_backward_into on its heads; grouped heads (the gates' included) are
/// summed, and threads run, as causal_delta_rule_backward_into on views.
/// @param q           B x Hq x N x Dk queries (Hq divides H)
/// @param k           B x Hk x N x Dk keys (Hk divides H)
/// @param v           B x Hv x N x Dv values (Hv divides H)
/// @param gates       B x H x N x 1 or B x H x N x Dk gates (one head per value head): a_t or
///                    log_gates(view)
/// @param beta        B x H x N x 1 learning rates (one head per value head)
/// @param grad_out    B x H x N x Dv gradient of the loss with respect to out
/// @param grad_q      B x Hq x N x Dk result
/// @param grad_k      B x Hk x N x Dk result
/// @param grad_v      B x Hv x N x Dv result
/// @param grad_gates  the gates' shape, result: d loss / d g_t for log gates (0 at a reset),
///                    d loss / d a_t for gates a_t
/// @param grad_beta   B x H x N x 1 result
/// @param options     the forward's options, threads
template <class Acc = void, class Q, class K, class V, class Gates, class B, class G, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>,
          class = detail::enable_if_gate_view<Gates, T>>
void causal_gated_delta_rule_backward_into(
    const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v, const Gates& gates,
    const HeadsView<B>& beta, const HeadsView<G>& grad_out, const HeadsView<T>& grad_q,
    const HeadsView<T>& grad_k, const HeadsView<T>& grad_v, const HeadsView<T>& grad_gates,
    const HeadsView<T>& grad_beta, const DeltaOptions& options = {}) {
  const auto transition = detail::delta_head_gates<Gates, std::remove_const_t<T>>::read(gates);
  detail::heads_delta_rule_backward<Acc>(q, k, v, &transition, beta, grad_out, nullptr, grad_q,
                                         grad_k, grad_v, &grad_gates, grad_beta, options,
                                         "causal_gated_delta_rule_backward");
}

/// Backward of causal_delta_rule_varlen_into: sequence s is tokens [offsets[s], offsets[s+1])
/// of every view and gets exactly the matrix backward on those rows; an empty sequence writes
/// nothing. See causal_delta_rule_backward_into on views.
/// @param q          1 x Hq x total x Dk queries (Hq divides H)
/// @param k          1 x Hk x total x Dk keys (Hk divides H)
/// @param v          1 x Hv x total x Dv values (Hv divides H)
/// @param beta       1 x H x total x 1 learning rates (one head per value head)
/// @param grad_out   1 x H x total x Dv gradient of the loss with respect to out
/// @param offsets    S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
/// @param grad_q     1 x Hq x total x Dk result
/// @param grad_k     1 x Hk x total x Dk result
/// @param grad_v     1 x Hv x total x Dv result
/// @param grad_beta  1 x H x total x 1 result
/// @param options    the forward's options, threads
template <class Acc = void, class Q, class K, class V, class B, class G, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>>
void causal_delta_rule_varlen_backward_into(
    const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v, const HeadsView<B>& beta,
    const HeadsView<G>& grad_out, const std::vector<std::int64_t>& offsets,
    const HeadsView<T>& grad_q, const HeadsView<T>& grad_k, const HeadsView<T>& grad_v,
    const HeadsView<T>& grad_beta, const DeltaOptions& options = {}) {
  detail::heads_delta_rule_backward<Acc, Q, K, V, B, G, T, void>(
      q, k, v, nullptr, beta, grad_out, &offsets, grad_q, grad_k, grad_v, nullptr, grad_beta,
      options, "causal_delta_rule_varlen_backward");
}

/// Backward of causal_gated_delta_rule_varlen_into (gates and grad_gates packed like the
/// tokens). See causal_gated_delta_rule_backward_into on views.
/// @param q           1 x Hq x total x Dk queries (Hq divides H)
/// @param k           1 x Hk x total x Dk keys (Hk divides H)
/// @param v           1 x Hv x total x Dv values (Hv divides H)
/// @param gates       1 x H x total x 1 or 1 x H x total x Dk gates: a_t or log_gates(view)
/// @param beta        1 x H x total x 1 learning rates (one head per value head)
/// @param grad_out    1 x H x total x Dv gradient of the loss with respect to out
/// @param offsets     S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
/// @param grad_q      1 x Hq x total x Dk result
/// @param grad_k      1 x Hk x total x Dk result
/// @param grad_v      1 x Hv x total x Dv result
/// @param grad_gates  the gates' shape, result
/// @param grad_beta   1 x H x total x 1 result
/// @param options     the forward's options, threads
template <class Acc = void, class Q, class K, class V, class Gates, class B, class G, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>,
          class = detail::enable_if_gate_view<Gates, T>>
void causal_gated_delta_rule_varlen_backward_into(
    const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v, const Gates& gates,
    const HeadsView<B>& beta, const HeadsView<G>& grad_out,
    const std::vector<std::int64_t>& offsets, const HeadsView<T>& grad_q,
    const HeadsView<T>& grad_k, const HeadsView<T>& grad_v, const HeadsView<T>& grad_gates,
    const HeadsView<T>& grad_beta, const DeltaOptions& options = {}) {
  const auto transition = detail::delta_head_gates<Gates, std::remove_const_t<T>>::read(gates);
  detail::heads_delta_rule_backward<Acc>(q, k, v, &transition, beta, grad_out, &offsets, grad_q,
                                         grad_k, grad_v, &grad_gates, grad_beta, options,
                                         "causal_gated_delta_rule_varlen_backward");
}

}  // namespace linattn
