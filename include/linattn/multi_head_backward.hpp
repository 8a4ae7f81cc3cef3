// SPDX-License-Identifier: MIT
// Gradients of the multi-head view calls (multi_head.hpp): every head of every sequence of a
// [B, H, N, D] or [B, N, H, D] batch (any strides), padded or packed (varlen), grouped heads
// included, in one call with threads over sequences x heads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <linattn/backward.hpp>
#include <linattn/config.hpp>
#include <linattn/detail/heads_backward.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gated.hpp>
#include <linattn/gates.hpp>
#include <linattn/gradients.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/multi_head.hpp>
#include <string>
#include <type_traits>
#include <vector>

/// Each head (b, h) (or sequence s, head h of a packed batch) gets exactly the matrix backward
/// (backward.hpp, gated.hpp) on its rows: the view call validates and scans everything once,
/// then runs the public matrix call per head on the head's Eigen::Map, into the gradient view
/// directly where it has adjacent features and is written by that head alone, else into
/// buffers of the thread (reused from head to head) that are copied or added into the view.
///
/// Grouped heads (as the forward: output head h reads head h / (H / H_in) of an input with H_in
/// heads, or h % H_in with Options::head_grouping tiled): the gradient of a shared input head is
/// the sum, over the output heads that read it, of each one's matrix gradient, added in
/// increasing h (the first reader writes, each later one adds). The threads go over (sequence,
/// group of L consecutive output heads), L the least common multiple of H / Hq, H / Hk and
/// H / Hv interleaved, all H heads tiled when an input is grouped: every reader of an input head
/// falls in one group, so one thread owns each gradient head it writes, and the sums are
/// race-free and the same on any number of threads.
namespace linattn {

namespace detail {

/// A view call without gates has no gate gradients.
struct NoGateGradients {};

/// A thread's buffers for the gradients that cannot be written in place; reused across heads.
template <class T>
struct HeadGradientBuffers {
  Matrix<T> q, k, v;
  GatedAttentionGradients<T> gated;
};

/// body(q_head, k_head, v_head, grad_out_head, gates_head) with the N x D maps of input heads
/// hq, hk, hv and output head h of batch entry b (gates_head 0 without gate views). With
/// RowMaps (the causal backward, which reads rows in place), maps with adjacent features when
/// every view has them, as with_heads; else head(b, h) itself (the non-causal backward copies
/// its inputs first, and Eigen's dot over a row map would sum grad_out's rows in another order
/// than the matrix call on head(b, h)).
template <bool RowMaps, class Q, class K, class V, class G, class Transition, class Body>
void with_backward_heads(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                         const HeadsView<G>& grad_out, const Transition& transition, Eigen::Index b,
                         Eigen::Index hq, Eigen::Index hk, Eigen::Index hv, Eigen::Index h,
                         const Body& body) {
  if constexpr (RowMaps) {
    bool rows = q.strides().dim == 1 && k.strides().dim == 1 && v.strides().dim == 1 &&
                grad_out.strides().dim == 1;
    if constexpr (is_head_gates<Transition>) rows = rows && transition.view.strides().dim == 1;
    if (rows) {
      if constexpr (is_head_gates<Transition>) {
        body(q.head_rows(b, hq), k.head_rows(b, hk), v.head_rows(b, hv), grad_out.head_rows(b, h),
             transition.view.head_rows(b, h));
      } else {
        body(q.head_rows(b, hq), k.head_rows(b, hk), v.head_rows(b, hv), grad_out.head_rows(b, h),
             0);
      }
      return;
    }
  }
  if constexpr (is_head_gates<Transition>) {
    body(q.head(b, hq), k.head(b, hk), v.head(b, hv), grad_out.head(b, h),
         transition.view.head(b, h));
  } else {
    body(q.head(b, hq), k.head(b, hk), v.head(b, hv), grad_out.head(b, h), 0);
  }
}

/// The one driver of the view backward calls: validates and scans everything (nothing is
/// written before), then runs the matrix backward of each (sequence, head) on the threads,
/// over groups of heads that share no input head with another group.
template <class Acc, bool Causal, class Q, class K, class V, class G, class Map, class T,
          class Transition, class GradGates>
void heads_backward(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const HeadsView<G>& grad_out, const Map& map, const HeadsView<T>& grad_q,
                    const HeadsView<T>& grad_k, const HeadsView<T>& grad_v,
                    const GradGates& grad_gates, const std::vector<std::int64_t>* offsets,
                    const Options& options, const Transition& transition, const char* where) {
  static_assert(!std::is_const_v<T>,
                "grad_q, grad_k and grad_v must be writable views (HeadsView<float>, not "
                "HeadsView<const float>)");
  static_assert(is_supported_scalar<T>, "the view backward takes float or double views");
  using A = accumulator_t<Acc, T>;
  static_assert(is_supported_scalar<A>, "the view backward accumulates in float or double");
  if constexpr (check_feature_map<Map, A>()) {
    constexpr bool featurized = is_identity_map<Map>;
    const char* q_name = featurized ? "phi_q" : "q";
    const char* k_name = featurized ? "phi_k" : "k";
    if (!Causal && k.tokens() != q.tokens()) {
      throw Error(std::string(where) + ": " + k_name + " is " + k.sizes_string() + " but " +
                  q_name + " is " + q.sizes_string() +
                  "; cross-attention (N_k keys != N_q queries) has no backward: q, k and v need "
                  "the same N");
    }
    validate_heads(q, k, v, grad_out, v.dim(), options, where, q_name, k_name, false, "grad_out");
    const SequenceRows sequences = sequence_rows(q, offsets, where, q_name);
    Eigen::Index feature_dim = q.dim();
    if constexpr (!featurized) {
      feature_dim = map.feature_dim(q.dim());
      if (feature_dim < 1) {
        throw Error(std::string(where) + ": the feature map gives feature_dim " +
                    std::to_string(feature_dim) + " for input_dim " + std::to_string(q.dim()));
      }
    }
    require_gradient_view(grad_q, q, where, "grad_q", q_name);
    require_gradient_view(grad_k, k, where, "grad_k", k_name);
    require_gradient_view(grad_v, v, where, "grad_v", "v");
    validate_transition(
        transition, HeadShape{grad_out.batch(), grad_out.heads(), grad_out.tokens(), feature_dim},
        options, where);
    if constexpr (is_head_gates<Transition>) {
      require_gradient_view(grad_gates, transition.view, where, "grad_gates", "gates");
    }
    scan_transition(transition, resolve_threads(options), where);
    scan_heads(q, k, v, options, where, q_name, k_name);
    scan_grad_out(grad_out, options, where);

    // Checked and scanned above: each head's call runs on one thread and rescans nothing.
    Options head_options = options;
    head_options.threads = 1;
    head_options.check_finite = false;
    const Eigen::Index heads = grad_out.heads();
    const HeadGrouping grouping = options.head_grouping;
    const Eigen::Index group =
        backward_head_group(heads, {q.heads(), k.heads(), v.heads()}, grouping);

    auto one_head = [&](Eigen::Index s, Eigen::Index h, HeadGradientBuffers<T>& buffers) {
      const Eigen::Index b = sequences.batch_of(s), begin = sequences.begin(s),
                         rows = sequences.rows(s);
      const Eigen::Index hq = input_head(q, heads, h, grouping),
                         hk = input_head(k, heads, h, grouping),
                         hv = input_head(v, heads, h, grouping);
      // The first reader of an input head writes its gradient, the later ones add to it.
      const bool add_q = adds_to_input_head(q, heads, h, grouping),
                 add_k = adds_to_input_head(k, heads, h, grouping),
                 add_v = adds_to_input_head(v, heads, h, grouping);
      Options run_options = head_options;
      if constexpr (std::is_same_v<Transition, HeadDecays>) {
        run_options.decay = transition.values[static_cast<std::size_t>(h)];
      }
      with_backward_heads<Causal>(
          q, k, v, grad_out, transition, b, hq, hk, hv, h,
          [&](const auto& qh, const auto& kh, const auto& vh, const auto& gh, const auto& gates_h) {
            const auto qs = qh.middleRows(begin, rows);
            const auto ks = kh.middleRows(begin, rows);
            const auto vs = vh.middleRows(begin, rows);
            const auto gs = gh.middleRows(begin, rows);
            if constexpr (is_head_gates<Transition>) {
              const auto gate_rows = gates_h.middleRows(begin, rows);
              GatedAttentionGradients<T>& result = buffers.gated;
              if constexpr (Transition::log_space) {
                const LogGates<std::decay_t<decltype(gate_rows)>> logs(gate_rows);
                causal_gated_linear_attention_backward_into<Acc>(qs, ks, vs, logs, gs, map, result,
                                                                 run_options);
              } else {
                causal_gated_linear_attention_backward_into<Acc>(qs, ks, vs, gate_rows, gs, map,
                                                                 result, run_options);
              }
              store_head_rows(grad_q, b, hq, begin, result.q, add_q);
              store_head_rows(grad_k, b, hk, begin, result.k, add_k);
              store_head_rows(grad_v, b, hv, begin, result.v, add_v);
              store_head_rows(grad_gates, b, h, begin, result.gates, false);
            } else {
              static_cast<void>(gates_h);
              // In place where the head's rows are row-major memory and no other head adds.
              const bool direct_q = !add_q && grad_q.strides().dim == 1;
              const bool direct_k = !add_k && grad_k.strides().dim == 1;
              const bool direct_v = !add_v && grad_v.strides().dim == 1;
              auto target = [&](const HeadsView<T>& view, Eigen::Index head, bool direct,
                                Matrix<T>& buffer) {
                return direct
                           ? Eigen::Ref<Matrix<T>>(view.head_rows(b, head).middleRows(begin, rows))
                           : buffer_rows(buffer, rows, view.dim());
              };
              Eigen::Ref<Matrix<T>> dq = target(grad_q, hq, direct_q, buffers.q);
              Eigen::Ref<Matrix<T>> dk = target(grad_k, hk, direct_k, buffers.k);
              Eigen::Ref<Matrix<T>> dv = target(grad_v, hv, direct_v, buffers.v);
              if constexpr (Causal) {
                causal_linear_attention_backward_into<Acc>(qs, ks, vs, gs, map, dq, dk, dv,
                                                           run_options);
              } else {
                linear_attention_backward_into<Acc>(qs, ks, vs, gs, map, dq, dk, dv, run_options);
              }
              if (!direct_q) store_head_rows(grad_q, b, hq, begin, dq, add_q);
              if (!direct_k) store_head_rows(grad_k, b, hk, begin, dk, add_k);
              if (!direct_v) store_head_rows(grad_v, b, hv, begin, dv, add_v);
            }
          });
    };

    for_each_head_group<HeadGradientBuffers<T>>(sequences, heads, group, resolve_threads(options),
                                                one_head);
  }
}

/// The gate views of a gated view backward, as the forward reads them.
template <class Gates, class T>
auto read_gate_view(const Gates& gates) {
  return head_transition<Gates, std::remove_const_t<T>>::read(gates);
}

}  // namespace detail

/// Backward of causal_linear_attention_into on views: the gradients of a loss with respect to
/// q, k and v of every head of every sequence, given grad_out = d loss / d out, written into
/// caller memory ([B, H, N, D] or [B, N, H, D], any strides). Head (b, h) gets exactly
/// causal_linear_attention_backward_into on q.head(b, h), ..., grad_out.head(b, h). Grouped
/// heads: a shared input head's gradient is the sum over the output heads that read it (added
/// in increasing h). Threads (Options::threads) go over sequences x groups of heads, each head
/// on one thread. Every shape, option and (with check_finite) value is checked before anything
/// is written; only a feature map that overflows the accumulation type on some head (found by
/// that head's call) can throw after other heads' gradients were written.
/// @param q         B x Hq x N x Dk queries (Hq divides H; features, with Identity)
/// @param k         B x Hk x N x Dk keys (Hk divides H)
/// @param v         B x Hv x N x Dv values (Hv divides H)
/// @param grad_out  B x H x N x Dv gradient of the loss with respect to the forward's out
/// @param map       the forward's feature map; needs a backward member unless Identity
/// @param grad_q    B x Hq x N x Dk result: d loss / d q (d loss / d phi_q with Identity)
/// @param grad_k    B x Hk x N x Dk result: d loss / d k
/// @param grad_v    B x Hv x N x Dv result: d loss / d v; the gradient views may not overlap
///                  each other or the inputs (nor their own heads)
/// @param options   the forward's options
template <class Acc = void, class Q, class K, class V, class G, class Map, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>>
void causal_linear_attention_backward_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                           const HeadsView<V>& v, const HeadsView<G>& grad_out,
                                           const Map& map, const HeadsView<T>& grad_q,
                                           const HeadsView<T>& grad_k, const HeadsView<T>& grad_v,
                                           const Options& options = {}) {
  detail::heads_backward<Acc, true>(q, k, v, grad_out, map, grad_q, grad_k, grad_v,
                                    detail::NoGateGradients{}, nullptr, options,
                                    detail::UniformDecay{}, "causal_linear_attention_backward");
}

/// Backward of the non-causal linear_attention_into on views (self-attention: q, k and v hold
/// the same N; cross-attention shapes throw). Head (b, h) gets exactly
/// linear_attention_backward_into on its maps; grouped heads and threads as
/// causal_linear_attention_backward_into on views.
/// @param q         B x Hq x N x Dk queries (Hq divides H)
/// @param k         B x Hk x N x Dk keys (Hk divides H)
/// @param v         B x Hv x N x Dv values (Hv divides H)
/// @param grad_out  B x H x N x Dv gradient of the loss with respect to out
/// @param map       the forward's feature map; needs a backward member unless Identity
/// @param grad_q    B x Hq x N x Dk result
/// @param grad_k    B x Hk x N x Dk result
/// @param grad_v    B x Hv x N x Dv result
/// @param options   the forward's options
template <class Acc = void, class Q, class K, class V, class G, class Map, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>>
void linear_attention_backward_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                    const HeadsView<V>& v, const HeadsView<G>& grad_out,
                                    const Map& map, const HeadsView<T>& grad_q,
                                    const HeadsView<T>& grad_k, const HeadsView<T>& grad_v,
                                    const Options& options = {}) {
  detail::heads_backward<Acc, false>(q, k, v, grad_out, map, grad_q, grad_k, grad_v,
                                     detail::NoGateGradients{}, nullptr, options,
                                     detail::UniformDecay{}, "linear_attention_backward");
}

/// Backward of causal_linear_attention_varlen_into: sequence s is tokens
/// [offsets[s], offsets[s+1]) of every view and gets exactly the matrix backward on those
/// rows; an empty sequence writes nothing. Threads go over sequences x groups of heads.
/// @param q         1 x Hq x total x Dk queries (Hq divides H)
/// @param k         1 x Hk x total x Dk keys (Hk divides H)
/// @param v         1 x Hv x total x Dv values (Hv divides H)
/// @param grad_out  1 x H x total x Dv gradient of the loss with respect to out
/// @param map       the forward's feature map; needs a backward member unless Identity
/// @param offsets   S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
/// @param grad_q    1 x Hq x total x Dk result
/// @param grad_k    1 x Hk x total x Dk result
/// @param grad_v    1 x Hv x total x Dv result
/// @param options   the forward's options
template <class Acc = void, class Q, class K, class V, class G, class Map, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>>
void causal_linear_attention_varlen_backward_into(
    const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
    const HeadsView<G>& grad_out, const Map& map, const std::vector<std::int64_t>& offsets,
    const HeadsView<T>& grad_q, const HeadsView<T>& grad_k, const HeadsView<T>& grad_v,
    const Options& options = {}) {
  detail::heads_backward<Acc, true>(
      q, k, v, grad_out, map, grad_q, grad_k, grad_v, detail::NoGateGradients{}, &offsets, options,
      detail::UniformDecay{}, "causal_linear_attention_varlen_backward");
}

/// Backward of linear_attention_varlen_into: each packed sequence attends to all of itself.
/// @param q         1 x Hq x total x Dk queries (Hq divides H)
/// @param k         1 x Hk x total x Dk keys (Hk divides H)
/// @param v         1 x Hv x total x Dv values (Hv divides H)
/// @param grad_out  1 x H x total x Dv gradient of the loss with respect to out
/// @param map       the forward's feature map; needs a backward member unless Identity
/// @param offsets   S + 1 nondecreasing token offsets
/// @param grad_q    1 x Hq x total x Dk result
/// @param grad_k    1 x Hk x total x Dk result
/// @param grad_v    1 x Hv x total x Dv result
/// @param options   the forward's options
template <class Acc = void, class Q, class K, class V, class G, class Map, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>>
void linear_attention_varlen_backward_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                           const HeadsView<V>& v, const HeadsView<G>& grad_out,
                                           const Map& map, const std::vector<std::int64_t>& offsets,
                                           const HeadsView<T>& grad_q, const HeadsView<T>& grad_k,
                                           const HeadsView<T>& grad_v,
                                           const Options& options = {}) {
  detail::heads_backward<Acc, false>(q, k, v, grad_out, map, grad_q, grad_k, grad_v,
                                     detail::NoGateGradients{}, &offsets, options,
                                     detail::UniformDecay{}, "linear_attention_varlen_backward");
}

/// Backward of causal_gated_linear_attention_into on gate views: the gradients with respect to
/// q, k, v and the gates of every head. Head (b, h) gets exactly
/// causal_gated_linear_attention_backward_into on q.head(b, h), ..., gates.head(b, h) (as a_t,
/// or log_gates of it); grouped heads' q, k, v gradients are summed as in
/// causal_linear_attention_backward_into on views (the gates belong to output heads: no sum).
/// Every shape, option, gate and (with check_finite) value is checked before anything is
/// written.
/// @param q           B x Hq x N x Dk queries (Hq divides H; features, with Identity)
/// @param k           B x Hk x N x Dk keys (Hk divides H)
/// @param v           B x Hv x N x Dv values (Hv divides H)
/// @param gates       B x H x N x 1 or B x H x N x C gates a_t in (0, 1], or log_gates(view)
/// @param grad_out    B x H x N x Dv gradient of the loss with respect to out
/// @param map         the forward's feature map; needs a backward member unless Identity
/// @param grad_q      B x Hq x N x Dk result
/// @param grad_k      B x Hk x N x Dk result
/// @param grad_v      B x Hv x N x Dv result
/// @param grad_gates  the gates' shape, result: d loss / d a_t, or d loss / d g_t for log gates
///                    (0 at a reset)
/// @param options     the forward's options; decay must be 1
template <class Acc = void, class Q, class K, class V, class Gates, class G, class Map, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>,
          class = detail::enable_if_gate_view<Gates, T>>
void causal_gated_linear_attention_backward_into(
    const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v, const Gates& gates,
    const HeadsView<G>& grad_out, const Map& map, const HeadsView<T>& grad_q,
    const HeadsView<T>& grad_k, const HeadsView<T>& grad_v, const HeadsView<T>& grad_gates,
    const Options& options = {}) {
  detail::heads_backward<Acc, true>(q, k, v, grad_out, map, grad_q, grad_k, grad_v, grad_gates,
                                    nullptr, options, detail::read_gate_view<Gates, T>(gates),
                                    "causal_gated_linear_attention_backward");
}

/// Backward of causal_gated_linear_attention_varlen_into on gate views: sequence s is tokens
/// [offsets[s], offsets[s+1]) of every view, gates and grad_gates included. See
/// causal_gated_linear_attention_backward_into on views.
/// @param q           1 x Hq x total x Dk queries (Hq divides H)
/// @param k           1 x Hk x total x Dk keys (Hk divides H)
/// @param v           1 x Hv x total x Dv values (Hv divides H)
/// @param gates       1 x H x total x 1 or 1 x H x total x C gates (a_t or log_gates(view))
/// @param grad_out    1 x H x total x Dv gradient of the loss with respect to out
/// @param map         the forward's feature map; needs a backward member unless Identity
/// @param offsets     S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
/// @param grad_q      1 x Hq x total x Dk result
/// @param grad_k      1 x Hk x total x Dk result
/// @param grad_v      1 x Hv x total x Dv result
/// @param grad_gates  the gates' shape, result
/// @param options     the forward's options; decay must be 1
template <class Acc = void, class Q, class K, class V, class Gates, class G, class Map, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>,
          class = detail::enable_if_gate_view<Gates, T>>
void causal_gated_linear_attention_varlen_backward_into(
    const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v, const Gates& gates,
    const HeadsView<G>& grad_out, const Map& map, const std::vector<std::int64_t>& offsets,
    const HeadsView<T>& grad_q, const HeadsView<T>& grad_k, const HeadsView<T>& grad_v,
    const HeadsView<T>& grad_gates, const Options& options = {}) {
  detail::heads_backward<Acc, true>(q, k, v, grad_out, map, grad_q, grad_k, grad_v, grad_gates,
                                    &offsets, options, detail::read_gate_view<Gates, T>(gates),
                                    "causal_gated_linear_attention_varlen_backward");
}

/// Backward of causal_gated_linear_attention_into with HeadDecays (RetNet's per-head decays,
/// constants: no gradient of their own): head (b, h) gets exactly
/// causal_linear_attention_backward_into with Options::decay = decays.values[h].
/// @param q         B x Hq x N x Dk queries (Hq divides H)
/// @param k         B x Hk x N x Dk keys (Hk divides H)
/// @param v         B x Hv x N x Dv values (Hv divides H)
/// @param decays    H decays in (0, 1], one per output head
/// @param grad_out  B x H x N x Dv gradient of the loss with respect to out
/// @param map       the forward's feature map; needs a backward member unless Identity
/// @param grad_q    B x Hq x N x Dk result
/// @param grad_k    B x Hk x N x Dk result
/// @param grad_v    B x Hv x N x Dv result
/// @param options   the forward's options; decay must be 1
template <class Acc = void, class Q, class K, class V, class G, class Map, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>>
void causal_gated_linear_attention_backward_into(
    const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v, const HeadDecays& decays,
    const HeadsView<G>& grad_out, const Map& map, const HeadsView<T>& grad_q,
    const HeadsView<T>& grad_k, const HeadsView<T>& grad_v, const Options& options = {}) {
  detail::heads_backward<Acc, true>(q, k, v, grad_out, map, grad_q, grad_k, grad_v,
                                    detail::NoGateGradients{}, nullptr, options, decays,
                                    "causal_gated_linear_attention_backward");
}

/// Backward of causal_gated_linear_attention_varlen_into with HeadDecays. See above.
/// @param q         1 x Hq x total x Dk queries (Hq divides H)
/// @param k         1 x Hk x total x Dk keys (Hk divides H)
/// @param v         1 x Hv x total x Dv values (Hv divides H)
/// @param decays    H decays in (0, 1]
/// @param grad_out  1 x H x total x Dv gradient of the loss with respect to out
/// @param map       the forward's feature map; needs a backward member unless Identity
/// @param offsets   S + 1 nondecreasing token offsets
/// @param grad_q    1 x Hq x total x Dk result
/// @param grad_k    1 x Hk x total x Dk result
/// @param grad_v    1 x Hv x total x Dv result
/// @param options   the forward's options; decay must be 1
template <class Acc = void, class Q, class K, class V, class G, class Map, class T,
          class = detail::enable_if_backward_views<Q, K, V, G, T>>
void causal_gated_linear_attention_varlen_backward_into(
    const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v, const HeadDecays& decays,
    const HeadsView<G>& grad_out, const Map& map, const std::vector<std::int64_t>& offsets,
    const HeadsView<T>& grad_q, const HeadsView<T>& grad_k, const HeadsView<T>& grad_v,
    const Options& options = {}) {
  detail::heads_backward<Acc, true>(q, k, v, grad_out, map, grad_q, grad_k, grad_v,
                                    detail::NoGateGradients{}, &offsets, options, decays,
                                    "causal_gated_linear_attention_varlen_backward");
}

}  // namespace linattn
