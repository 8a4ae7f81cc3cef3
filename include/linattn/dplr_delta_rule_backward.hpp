// SPDX-License-Identifier: MIT
// The backward pass of the generalized delta rule (RWKV-7): gradients of a loss with respect to
// q, k, v, a, b and the gates of causal_dplr_delta_rule.
#pragma once

#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/detail/dplr_chunk_backward.hpp>
#include <linattn/detail/dplr_delta_rule_backward.hpp>
#include <linattn/detail/heads_backward.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/gates.hpp>
#include <linattn/gradients.hpp>
#include <linattn/heads_view.hpp>
#include <string>
#include <type_traits>
#include <vector>

/// Reverse mode through causal_dplr_delta_rule (S_t = diag(w_t) S_{t-1} + b_t (a_t^T S_{t-1})
/// + k_t v_t^T, out_t = S_t^T (s q_t)) in one of two forms; with options.threads > 1 the value
/// columns split across the threads (at least 32 each: the columns of S evolve apart, each part
/// repeats the key-side work and the parts' key gradients add):
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
/// Both are O(N Dk Dv) time; the chunked form measured 1.1x faster at 64 x 64 and 1.5-1.8x at
/// 128 x 128, the recurrent one 1.1x at 32 x 32 (docs/performance.md).
namespace linattn {

/// Where a view backward of the generalized delta rule writes its gradients: one view per
/// input, each of that input's shape (float or double).
template <class T>
struct DplrGradientViews {
  HeadsView<T> q;      ///< B x Hq x N x Dk
  HeadsView<T> k;      ///< B x Hk x N x Dk
  HeadsView<T> v;      ///< B x Hv x N x Dv
  HeadsView<T> a;      ///< B x H x N x Dk
  HeadsView<T> b;      ///< B x H x N x Dk
  HeadsView<T> gates;  ///< B x H x N x Dk or x 1, the gates' shape
};

namespace detail {

/// The generalized delta rule's backward buffers in T: the chunked form's and the recurrent
/// form's, kept from call to call (a view call's thread, from head to head).
template <class T>
struct DplrBackwardBuffers {
  DplrChunkBackward<T> chunked;
  DplrBackward<T> recurrent;
};

/// The checks of a generalized delta-rule backward call, then the backward in Acc (in
/// `buffers`, or in buffers of its own when null).
template <class Acc, class DQ, class DK, class DV, class DA, class DB, class Gates, class DO>
void dplr_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b, const Gates& gates,
    const Eigen::MatrixBase<DO>& grad_out, DplrGradients<typename DQ::Scalar>& grads,
    const DplrOptions& options, const char* where,
    DplrBackwardBuffers<accumulator_t<Acc, typename DQ::Scalar>>* buffers = nullptr) {
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
  const bool chunked = chunked_dplr_backward(options, dk, dv);
  // Value columns [first, first + width) alone: the columns of S evolve apart, so their
  // backward is the rule's on those columns of v and grad_out (q, k, a, b and the gates get
  // that part's share of their gradients).
  const auto run_part = [&](DplrBackwardBuffers<T>& use, Eigen::Index first, Eigen::Index width,
                            DplrGradients<Scalar>& out) {
    const auto vs = v.derived().middleCols(first, width);
    const auto gs = grad_out.derived().middleCols(first, width);
    if (chunked) {
      use.chunked.reshape(n, dk, width, gate_dim, options);
      use.chunked.template run<Traits::log_space>(q.derived(), k.derived(), vs, a.derived(),
                                                  b.derived(), gate_rows, gs, out);
    } else {
      use.recurrent.reshape(n, dk, width, gate_dim, options);
      use.recurrent.template run<Traits::log_space>(q.derived(), k.derived(), vs, a.derived(),
                                                    b.derived(), gate_rows, gs, out, where);
    }
  };
  // Threads over one sequence split the value columns (at least 32 each), as the delta rule's
  // backward does: each part repeats the key-side work, and the parts' key gradients add.
  const int threads = resolve_threads(engine_options(options));
  const Eigen::Index parts = delta_backward_parts(threads, dv);
  if (parts == 1) {
    DplrBackwardBuffers<T> own;
    run_part(buffers != nullptr ? *buffers : own, 0, dv, grads);
    return;
  }
  std::vector<DplrBackwardBuffers<T>> part_buffers(static_cast<std::size_t>(parts));
  std::vector<DplrGradients<Scalar>> part_grads(static_cast<std::size_t>(parts));
  const auto first_column = [&](Eigen::Index p) { return dv * p / parts; };
  for (Eigen::Index p = 0; p < parts; ++p) {
    DplrGradients<Scalar>& g = part_grads[static_cast<std::size_t>(p)];
    for (Matrix<Scalar>* m : {&g.q, &g.k, &g.a, &g.b}) m->resize(n, dk);
    g.v.resize(n, first_column(p + 1) - first_column(p));
    g.gates.resize(n, gate_dim);
  }
  parallel_for(parts, threads, [&](Eigen::Index p) {
    const auto i = static_cast<std::size_t>(p);
    run_part(part_buffers[i], first_column(p), first_column(p + 1) - first_column(p),
             part_grads[i]);
  });
  grads = std::move(part_grads[0]);
  grads.v.conservativeResize(n, dv);
  for (Eigen::Index p = 1; p < parts; ++p) {
    const DplrGradients<Scalar>& g = part_grads[static_cast<std::size_t>(p)];
    grads.q += g.q;
    grads.k += g.k;
    grads.a += g.a;
    grads.b += g.b;
    grads.gates += g.gates;
    grads.v.middleCols(first_column(p), g.v.cols()) = g.v;
  }
}

/// A thread's buffers of the generalized delta rule's view backward, kept from head to head:
/// one head's gradients (copied or added into the views) and the backward's.
template <class T, class A>
struct DplrHeadBuffers {
  DplrGradients<T> grads;
  DplrBackwardBuffers<A> backward;
};

/// The one driver of the generalized delta rule's view backward calls: checks and scans
/// everything before anything is written, then runs the matrix backward of each (sequence,
/// head) on the threads, over groups of heads that share no input head with another group.
template <class Acc, class Q, class K, class V, class A, class B, class Gates, class G, class T>
void heads_dplr_backward(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                         const HeadsView<A>& a, const HeadsView<B>& b, const Gates& gates,
                         const HeadsView<G>& grad_out, const std::vector<std::int64_t>* offsets,
                         const DplrGradientViews<T>& grads, const DplrOptions& options,
                         const char* where) {
  static_assert(!std::is_const_v<T>,
                "the gradients must be writable views (HeadsView<float>, not "
                "HeadsView<const float>)");
  static_assert(is_supported_scalar<T>,
                "the generalized delta rule's view backward takes float or double views (the "
                "matrix backward takes Eigen::half and bfloat16)");
  using Acc_ = accumulator_t<Acc, T>;
  const auto transition = delta_head_gates<Gates, T>::read(gates);
  const ConstHeadsView<T>& gate_view = transition.view;
  require_gradient_view(grads.q, q, where, "grads.q", "q");
  require_gradient_view(grads.k, k, where, "grads.k", "k");
  require_gradient_view(grads.v, v, where, "grads.v", "v");
  require_gradient_view(grads.a, a, where, "grads.a", "a");
  require_gradient_view(grads.b, b, where, "grads.b", "b");
  require_gradient_view(grads.gates, gate_view, where, "grads.gates", "gates");
  const SequenceRows sequences =
      check_heads_dplr_rule<Acc>(q, k, v, a, b, gates, grad_out, offsets, options, where);
  const Options engine = engine_options(options);
  scan_grad_out(grad_out, engine, where);

  // Checked and scanned above: each head's call runs on one thread and rescans nothing.
  DplrOptions head_options = options;
  head_options.threads = 1;
  head_options.check_finite = false;
  const Eigen::Index heads = grad_out.heads();
  const HeadGrouping grouping = options.head_grouping;
  const Eigen::Index group = backward_head_group(
      heads, {q.heads(), k.heads(), v.heads(), a.heads(), b.heads(), gate_view.heads()}, grouping);
  auto one_head = [&](Eigen::Index s, Eigen::Index h, DplrHeadBuffers<T, Acc_>& buffers) {
    const Eigen::Index batch = sequences.batch_of(s), begin = sequences.begin(s),
                       rows = sequences.rows(s);
    const Eigen::Index hq = input_head(q, heads, h, grouping),
                       hk = input_head(k, heads, h, grouping),
                       hv = input_head(v, heads, h, grouping);
    // The first reader of an input head writes its gradient, the later ones add to it.
    auto later = [&](const auto& input) { return adds_to_input_head(input, heads, h, grouping); };
    const auto head_rows = [&](const auto& view, Eigen::Index head) {
      return view.head(batch, head).middleRows(begin, rows);
    };
    const auto gate_rows = head_rows(gate_view, h);
    DplrGradients<T>& g = buffers.grads;
    if constexpr (decltype(transition)::log_space) {
      const LogGates<std::decay_t<decltype(gate_rows)>> logs(gate_rows);
      dplr_backward_into<Acc>(head_rows(q, hq), head_rows(k, hk), head_rows(v, hv), head_rows(a, h),
                              head_rows(b, h), logs, head_rows(grad_out, h), g, head_options, where,
                              &buffers.backward);
    } else {
      dplr_backward_into<Acc>(head_rows(q, hq), head_rows(k, hk), head_rows(v, hv), head_rows(a, h),
                              head_rows(b, h), gate_rows, head_rows(grad_out, h), g, head_options,
                              where, &buffers.backward);
    }
    store_head_rows(grads.q, batch, hq, begin, g.q, later(q));
    store_head_rows(grads.k, batch, hk, begin, g.k, later(k));
    store_head_rows(grads.v, batch, hv, begin, g.v, later(v));
    store_head_rows(grads.a, batch, h, begin, g.a, false);
    store_head_rows(grads.b, batch, h, begin, g.b, false);
    store_head_rows(grads.gates, batch, h, begin, g.gates, false);
  };
  for_each_head_group<DplrHeadBuffers<T, Acc_>>(sequences, heads, group, resolve_threads(engine),
                                                one_head);
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
/// @param options   the forward's options (scale, chunk, form: see above, check_finite,
///                  threads)
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

/// Backward of causal_dplr_delta_rule_into on views ([B, H, N, D] or [B, N, H, D], any strides):
/// the matrix backward of each (sequence, head), on threads over the heads (options.threads).
/// Grouped q, k or v (fewer heads than the output, LayerHeads) get the sum over the heads that
/// read them. Checks and scans everything before writing anything.
/// @param q         B x Hq x N x Dk queries, as given to the forward
/// @param k         B x Hk x N x Dk keys
/// @param v         B x Hv x N x Dv values
/// @param a         B x H x N x Dk
/// @param b         B x H x N x Dk
/// @param gates     B x H x N x Dk (or x 1): a view of w_t, or log_gates(view)
/// @param grad_out  B x H x N x Dv gradient of the loss with respect to out
/// @param grads     results of the inputs' shapes (float or double views, none overlapping)
/// @param options   the forward's options, threads
template <class Acc = void, class Q, class K, class V, class A, class B, class Gates, class G,
          class T, class = detail::enable_if_backward_views<Q, K, V, G, T>,
          class = detail::enable_if_gate_view<Gates, T>>
void causal_dplr_delta_rule_backward_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                          const HeadsView<V>& v, const HeadsView<A>& a,
                                          const HeadsView<B>& b, const Gates& gates,
                                          const HeadsView<G>& grad_out,
                                          const DplrGradientViews<T>& grads,
                                          const DplrOptions& options = {}) {
  detail::heads_dplr_backward<Acc>(q, k, v, a, b, gates, grad_out, nullptr, grads, options,
                                   "causal_dplr_delta_rule_backward");
}

/// Backward of causal_dplr_delta_rule_varlen_into: sequence s is tokens [offsets[s],
/// offsets[s+1]) of every view and gets exactly the matrix backward on those rows. See the view
/// call above.
/// @param q         1 x Hq x total x Dk queries
/// @param k         1 x Hk x total x Dk keys
/// @param v         1 x Hv x total x Dv values
/// @param a         1 x H x total x Dk
/// @param b         1 x H x total x Dk
/// @param gates     1 x H x total x Dk (or x 1): a view of w_t, or log_gates(view)
/// @param grad_out  1 x H x total x Dv gradient of the loss with respect to out
/// @param offsets   S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
/// @param grads     results of the inputs' shapes
/// @param options   the forward's options, threads
template <class Acc = void, class Q, class K, class V, class A, class B, class Gates, class G,
          class T, class = detail::enable_if_backward_views<Q, K, V, G, T>,
          class = detail::enable_if_gate_view<Gates, T>>
void causal_dplr_delta_rule_varlen_backward_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                                 const HeadsView<V>& v, const HeadsView<A>& a,
                                                 const HeadsView<B>& b, const Gates& gates,
                                                 const HeadsView<G>& grad_out,
                                                 const std::vector<std::int64_t>& offsets,
                                                 const DplrGradientViews<T>& grads,
                                                 const DplrOptions& options = {}) {
  detail::heads_dplr_backward<Acc>(q, k, v, a, b, gates, grad_out, &offsets, grads, options,
                                   "causal_dplr_delta_rule_varlen_backward");
}

}  // namespace linattn
