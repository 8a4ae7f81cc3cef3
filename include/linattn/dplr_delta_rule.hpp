// SPDX-License-Identifier: MIT
// The generalized (diagonal-plus-low-rank) delta rule, FLA's dplr conventions: RWKV-7's
// recurrence, in the chunked form for prefill and the recurrent form for decoding.
#pragma once

#include <cmath>
#include <cstdint>
#include <istream>
#include <linattn/config.hpp>
#include <linattn/delta_rule.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/dplr_delta_rule.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/state_access.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/detail/state_record.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

/// The recurrence, with q, k, a, b: N x Dk, v: N x Dv and log decays g: N x Dk (or N x 1,
/// one per token), w_t = exp(g_t):
///     S_t = (diag(w_t) + b_t a_t^T) S_{t-1} + k_t v_t^T       (the low rank reads S_{t-1})
///     out_t = S_t^T (s q_t)                                     (no normaliser)
/// as FLA's chunk_dplr_delta_rule / fused_recurrent_dplr_delta_rule compute it (its `alpha` is
/// a, its `beta` b, its `gk` g), s = DplrOptions::scale (Dk^-1/2 by default; RWKV-7 passes 1).
/// RWKV-7: a = -kk, b = kk * a_coef (kk the L2-normalised key), g = -exp(w_raw), scale 1, its
/// state stored here as S = its V x K state transposed. DeltaNet, Gated DeltaNet and KDA:
/// a = -beta_t exp(g_t) o k_t (the decay folded in, since the low rank reads S_{t-1}), b = k_t,
/// the key beta_t k_t. The recurrence is computed as given: the forms agree within
/// docs/design.md's bounds while the transitions' products stay bounded (spectral radius <= 1,
/// as RWKV-7's a and b give); inputs past that grow the state without an Error. Every entry
/// point takes an optional first template argument, the accumulation type (default: the input
/// scalar).
namespace linattn {

namespace detail {

/// The compile-time checks of a generalized delta-rule call accumulating in Acc.
template <class Acc, class DQ, class DK, class DV, class DA, class DB, class Gates>
constexpr void check_dplr_call_scalars() {
  using S = typename DQ::Scalar;
  static_assert(
      is_supported_scalar<accumulator_t<Acc, S>>,
      "the generalized delta rule accumulates in float or double (Acc = float or double)");
  static_assert(std::is_same_v<S, typename DK::Scalar> && std::is_same_v<S, typename DV::Scalar> &&
                    std::is_same_v<S, typename DA::Scalar> &&
                    std::is_same_v<S, typename DB::Scalar> &&
                    std::is_same_v<S, gate_scalar_t<Gates>>,
                "the generalized delta rule takes q, k, v, a, b and the gates of one scalar type: "
                "cast them first");
  static_assert(is_input_scalar<S>,
                "the generalized delta rule takes float, double, Eigen::half or Eigen::bfloat16 "
                "inputs");
}

/// Throws unless `x` (a or b) is rows x key_dim.
template <class Derived>
void require_pair_shape(const Eigen::MatrixBase<Derived>& x, Eigen::Index rows,
                        Eigen::Index key_dim, const char* where, const char* name) {
  if (x.rows() != rows || x.cols() != key_dim) {
    throw Error(std::string(where) + ": " + name + " is " + shape_string(x) +
                " but must be N x Dk = " + shape_string(rows, key_dim) +
                ", as k (one vector of Dk per token)");
  }
}

/// Every shape and range check of a sequence before anything is written.
template <class DQ, class DK, class DV, class DA, class DB, class Gates, class Out>
void validate_dplr_sequence(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                            const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DA>& a,
                            const Eigen::MatrixBase<DB>& b, const Gates& gates, const Out& out,
                            const DplrOptions& options, const char* where) {
  validate_dplr_options(options, where);
  validate_sequence_shapes(q, k, v, engine_options(options), where, "q", "k");
  require_pair_shape(a, q.rows(), q.cols(), where, "a");
  require_pair_shape(b, q.rows(), q.cols(), where, "b");
  using Traits = gate_traits<Gates>;
  require_gate_shape(Traits::values(gates), q.rows(), q.cols(), where, "q");
  require_gates_in_range<Traits::log_space>(Traits::values(gates), where, "gates");
  require_output_shape(out, q.rows(), v.cols(), where);
}

/// With check_finite, scans q, k, v, a and b for NaN and Inf.
template <class DQ, class DK, class DV, class DA, class DB>
void scan_dplr_inputs(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                      const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DA>& a,
                      const Eigen::MatrixBase<DB>& b, const DplrOptions& options,
                      const char* where) {
  const Options engine = engine_options(options);
  scan_inputs(q, k, v, engine, where, "q", "k");
  if (!options.check_finite) return;
  const int threads = resolve_threads(engine);
  require_finite_parallel(a, where, "a", threads);
  require_finite_parallel(b, where, "b", threads);
}

/// True when a call runs the streamed recurrence: asked for, or (automatic) everywhere but rows
/// of S a multiple of 4 KiB long, where its strips stall on 4K aliasing: bench_dplr measured it
/// 3.4x the chunked form at D = 64 and 2.4x at D = 128 (float, one thread; the chunked form
/// does 1.4-2.5x the recurrence's flops in GEMMs of chunk-sized panels).
inline bool dplr_streams(const DplrOptions& options, Eigen::Index value_dim,
                         std::size_t scalar_size) {
  if (options.form != DeltaForm::automatic) return options.form == DeltaForm::streamed;
  return value_dim * static_cast<Eigen::Index>(scalar_size) % 4096 != 0;
}

/// Runs the generalized delta rule over every token from `state` on (Dk x Dv, left after the
/// last token), writing out rows when `out` is not null. Inputs validated by the caller. With
/// threads > 1 the value columns are split between them: each column of S evolves alone (the
/// transition acts on the left), so the streamed form's parts give one thread's outputs bit
/// for bit, the chunked form's to rounding.
template <class T, class O, class DQ, class DK, class DV, class DA, class DB>
void run_dplr_rule(const DQ& q, const DK& k, const DV& v, const DA& a, const DB& b,
                   const GateRows& gates, const DplrOptions& options, Matrix<T>& state,
                   OutRows<O>* out, const char* where, int threads = 1) {
  const SerialEigenScope serial;
  const PairMatrices<T, DA, DB> pairs(a, b);
  const Eigen::Index dv = v.cols();
  const Eigen::Index parts =
      std::max<Eigen::Index>(1, std::min<Eigen::Index>(threads, dv / kDeltaMinColumnsPerThread));
  const bool streamed = dplr_streams(options, dv, sizeof(T));
  const auto run = [&](const ChunkSource<T>& source, Eigen::Index width, Matrix<T>& part_state,
                       OutRows<O>* part_out) {
    if (streamed) {
      DplrStream<T, O>(q.cols(), width, options).run(source, pairs, part_state, part_out);
    } else {
      DplrKernel<T, O>(q.rows(), q.cols(), width, options).run(source, pairs, part_state, part_out);
    }
  };
  if (parts == 1) {
    with_source<T>(q, k, v, Identity{}, &gates, false, where,
                   [&](ChunkSource<T>& source) { run(source, dv, state, out); });
    return;
  }
  parallel_for(parts, static_cast<int>(parts), [&](Eigen::Index p) {
    const Eigen::Index first = dv * p / parts, width = dv * (p + 1) / parts - first;
    Matrix<T> part_state = state.middleCols(first, width);
    with_source<T>(q, k, v.middleCols(first, width), Identity{}, &gates, false, where,
                   [&](ChunkSource<T>& source) {
                     if (out == nullptr) {
                       run(source, width, part_state, nullptr);
                     } else {
                       OutRows<O> part_out(out->middleCols(first, width));
                       run(source, width, part_state, &part_out);
                     }
                   });
    state.middleCols(first, width) = part_state;
  });
}

/// Checks a view call of the generalized delta rule (one sequence per batch entry, or the
/// packed sequences of `offsets`) before anything is written, and returns its sequences: q, k,
/// v as the delta rule's (grouped heads allowed), a and b [B, H, N, Dk] and the gates
/// [B, H, N, Dk or 1], one head per output head. Compiled once per input type in the compiled
/// mode.
template <class S>
SequenceRows check_dplr_heads(const ConstHeadsView<S>& q, const ConstHeadsView<S>& k,
                              const ConstHeadsView<S>& v, const ConstHeadsView<S>& a,
                              const ConstHeadsView<S>& b, const AnyHeadTransition<S>& transition,
                              const ConstHeadsView<S>& out,
                              const std::vector<std::int64_t>* offsets, const DplrOptions& options,
                              const char* where) {
  validate_dplr_options(options, where);
  const Options engine = engine_options(options);
  validate_heads(q, k, v, out, v.dim(), engine, where, "q", "k");
  require_head_view(a, out, q.dim(), "Dk", where, "a");
  require_head_view(b, out, q.dim(), "Dk", where, "b");
  LINATTN_ASSERT(transition.gates() != nullptr);
  const ConstHeadsView<S>& gates = *transition.gates();
  if (gates.dim() != 1) {
    require_head_view(gates, out, q.dim(), "Dk (one decay per key feature) or 1", where, "gates");
  } else {
    require_head_view(gates, out, 1, "1 (one decay per token) or Dk", where, "gates");
  }
  const SequenceRows sequences = sequence_rows(q, offsets, where, "q");
  const int threads = resolve_threads(engine);
  scan_transition(transition, threads, where);
  scan_heads(q, k, v, engine, where, "q", "k");
  if (options.check_finite) {
    for (const auto* view : {&a, &b}) {
      const char* name = view == &a ? "a" : "b";
      scan_view(
          *view, threads, [](const auto& rows) { return all_finite(rows); },
          [&](const auto& head, Eigen::Index batch, Eigen::Index h) {
            if (!all_finite(head)) require_finite(head, where, head_name(name, batch, h).c_str());
          });
    }
  }
  return sequences;
}

/// Where a generalized delta-rule view driver finds the state of head h of sequence s
/// (Dk x Dv, in the accumulation type T): the caller's, alive for the whole call, which the
/// head leaves after its last token.
template <class T>
using DplrStateOf = FunctionRef<Matrix<T>&(Eigen::Index, Eigen::Index)>;

/// Runs the generalized delta rule over every sequence and head of checked views from the
/// states state_of gives. Threads over sequences x heads; in the streamed form each thread
/// takes a sequence's group of heads token-major, a block of tokens of every head of the group
/// before the next block: in a [B, N, H, D] buffer those heads' rows share the block's token
/// rows (their pages and lines), where one head at a time reads one row per H * D elements
/// across the whole sequence (measured 1.4x slower at H = 32, D = 64, N = 4,096). Compiled once
/// per (T, S) in the compiled mode.
template <class T, class S>
void run_dplr_heads(const ConstHeadsView<S>& q, const ConstHeadsView<S>& k,
                    const ConstHeadsView<S>& v, const ConstHeadsView<S>& a,
                    const ConstHeadsView<S>& b, const AnyHeadTransition<S>& transition,
                    const HeadsView<S>& out, const SequenceRows& sequences,
                    const DplrOptions& options, const char* where, DplrStateOf<T> state_of) {
  const Options engine = engine_options(options);
  const Eigen::Index heads = out.heads();
  const int threads = resolve_threads(engine);
  if (!dplr_streams(options, v.dim(), sizeof(T)) || heads == 1 ||
      sequences.count * heads < threads) {
    for_each_sequence_head(
        q, k, v, out, sequences, engine,
        [&](Eigen::Index s, Eigen::Index h, const auto& qs, const auto& ks, const auto& vs, auto os,
            int inner_threads) {
          const Eigen::Index batch = sequences.batch_of(s), begin = sequences.begin(s);
          const auto as = a.head(batch, h).middleRows(begin, qs.rows());
          const auto bs = b.head(batch, h).middleRows(begin, qs.rows());
          OutRows<S> rows(os);
          with_gate_rows(transition, transition.gates()->head(batch, h), begin,
                         [&](const GateRows* gate_rows) {
                           run_dplr_rule<T, S>(qs, ks, vs, as, bs, *gate_rows, options,
                                               state_of(s, h), &rows, where, inner_threads);
                         });
        });
    return;
  }
  const SerialEigenScope serial;
  const Eigen::Index groups = std::max<Eigen::Index>(
      1, std::min<Eigen::Index>(heads, threads / std::max<Eigen::Index>(sequences.count, 1)));
  parallel_for(sequences.count * groups, threads, [&](Eigen::Index i) {
    const Eigen::Index s = i / groups, group = i % groups;
    const Eigen::Index tokens = sequences.rows(s);
    if (tokens == 0) return;
    const Eigen::Index batch = sequences.batch_of(s), first = sequences.begin(s);
    DplrStream<T, S> stream(q.dim(), v.dim(), options);
    for (Eigen::Index begin = 0; begin < tokens; begin += kDplrBlock) {
      const Eigen::Index len = std::min(kDplrBlock, tokens - begin), at = first + begin;
      for (Eigen::Index h = heads * group / groups; h < heads * (group + 1) / groups; ++h) {
        with_heads(
            q, k, v, out, batch, h, options.head_grouping,
            [&](const auto& qh, const auto& kh, const auto& vh, auto oh) {
              const auto as = a.head(batch, h).middleRows(at, len);
              const auto bs = b.head(batch, h).middleRows(at, len);
              const PairMatrices<T, std::decay_t<decltype(as)>, std::decay_t<decltype(bs)>> pairs(
                  as, bs);
              OutRows<S> rows(oh.middleRows(at, len));
              with_gate_rows(transition, transition.gates()->head(batch, h), at,
                             [&](const GateRows* gate_rows) {
                               with_source<T>(middle_rows(qh, at, len), middle_rows(kh, at, len),
                                              middle_rows(vh, at, len), Identity{}, gate_rows,
                                              false, where, [&](ChunkSource<T>& source) {
                                                stream.run(source, pairs, state_of(s, h), &rows);
                                              });
                             });
            });
      }
    }
  });
}

/// check_dplr_heads for views of any constness and gates of either form.
template <class Acc, class Q, class K, class V, class A, class B, class O, class Gates>
SequenceRows check_heads_dplr_rule(const HeadsView<Q>& q, const HeadsView<K>& k,
                                   const HeadsView<V>& v, const HeadsView<A>& a,
                                   const HeadsView<B>& b, const Gates& gates,
                                   const HeadsView<O>& out,
                                   const std::vector<std::int64_t>* offsets,
                                   const DplrOptions& options, const char* where) {
  using Scalar = std::remove_const_t<O>;
  static_assert(is_input_scalar<Scalar>,
                "the generalized delta rule takes float, double, Eigen::half or Eigen::bfloat16 "
                "inputs");
  static_assert(is_supported_scalar<accumulator_t<Acc, Scalar>>,
                "the generalized delta rule accumulates in float or double (Acc = float or "
                "double)");
  static_assert(std::is_same_v<std::remove_const_t<A>, Scalar> &&
                    std::is_same_v<std::remove_const_t<B>, Scalar>,
                "a and b must have the inputs' scalar type: cast them first");
  const auto transition = delta_head_gates<Gates, Scalar>::read(gates);
  return check_dplr_heads<Scalar>(q, k, v, a, b, any_transition<Scalar>(transition), out, offsets,
                                  options, where);
}

/// run_dplr_heads for views of any constness, gates of either form and any state_of(s, h).
template <class Acc, class Q, class K, class V, class A, class B, class O, class Gates,
          class StateOf>
void run_heads_dplr_rule(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                         const HeadsView<A>& a, const HeadsView<B>& b, const Gates& gates,
                         const HeadsView<O>& out, const SequenceRows& sequences,
                         const DplrOptions& options, const char* where, const StateOf& state_of) {
  using T = accumulator_t<Acc, O>;
  const auto transition = delta_head_gates<Gates, O>::read(gates);
  run_dplr_heads<T, O>(
      q, k, v, a, b, any_transition<O>(transition), out, sequences, options, where,
      [&](Eigen::Index s, Eigen::Index h) -> Matrix<T>& { return state_of(s, h); });
}

/// Every check, then every sequence and head from a zero state.
template <class Acc, class Q, class K, class V, class A, class B, class O, class Gates>
void heads_dplr_rule(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                     const HeadsView<A>& a, const HeadsView<B>& b, const Gates& gates,
                     const HeadsView<O>& out, const std::vector<std::int64_t>* offsets,
                     const DplrOptions& options, const char* where) {
  using T = accumulator_t<Acc, O>;
  const SequenceRows sequences =
      check_heads_dplr_rule<Acc>(q, k, v, a, b, gates, out, offsets, options, where);
  // Every head's state for the whole call: the token-major pass moves many at once.
  std::vector<Matrix<T>> states(static_cast<std::size_t>(sequences.count * out.heads()),
                                Matrix<T>::Zero(q.dim(), v.dim()));
  run_heads_dplr_rule<Acc>(q, k, v, a, b, gates, out, sequences, options, where,
                           [&](Eigen::Index s, Eigen::Index h) -> Matrix<T>& {
                             return states[static_cast<std::size_t>(s * out.heads() + h)];
                           });
}

/// How messages name a generalized delta-rule state's transition.
inline const char* dplr_transition_name(TransitionKind kind) {
  return kind == TransitionKind::none ? "no transition yet" : "diagonal plus low rank";
}

}  // namespace detail

/// The generalized delta rule (RWKV-7), into `out`: S_t = (diag(w_t) + b_t a_t^T) S_{t-1} +
/// k_t v_t^T, out_t = S_t^T (s q_t), from a zero state (DplrDeltaRuleState carries one in and
/// out). Allocates O(chunk * (Dk + Dv + chunk) + Dk * Dv), nothing proportional to N.
/// @param q        N x Dk queries (RWKV-7's r)
/// @param k        N x Dk keys
/// @param v        N x Dv values
/// @param a        N x Dk vectors read against S_{t-1} (FLA's alpha; RWKV-7's -kk)
/// @param b        N x Dk vectors the low rank writes along (FLA's beta; RWKV-7's kk * a)
/// @param gates    N x Dk (or N x 1) decays: log_gates(g) with g <= 0 (FLA's gk; -infinity
///                 forgets a row of S_{t-1} in the diagonal term), or w_t in (0, 1]
/// @param out      N x Dv result, row-major; may not alias the inputs
/// @param options  scale, chunk, form, check_finite, threads
template <class Acc = void, class DQ, class DK, class DV, class DA, class DB, class Gates,
          class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
void causal_dplr_delta_rule_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DA>& a,
                                 const Eigen::MatrixBase<DB>& b, const Gates& gates,
                                 Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                                 const DplrOptions& options = {}) {
  constexpr const char* where = "causal_dplr_delta_rule";
  using Scalar = typename DQ::Scalar;
  using T = detail::accumulator_t<Acc, Scalar>;
  detail::check_dplr_call_scalars<Acc, DQ, DK, DV, DA, DB, Gates>();
  detail::validate_dplr_sequence(q, k, v, a, b, gates, out, options, where);
  detail::scan_dplr_inputs(q, k, v, a, b, options, where);
  Matrix<T> state = Matrix<T>::Zero(q.cols(), v.cols());
  detail::OutRows<Scalar> rows(out);
  const detail::GateMatrix<Gates> gate_rows(gates);
  detail::run_dplr_rule<T, Scalar>(q.derived(), k.derived(), v.derived(), a.derived(), b.derived(),
                                   gate_rows, options, state, &rows, where,
                                   detail::resolve_threads(detail::engine_options(options)));
}

/// The generalized delta rule; returns N x Dv. See causal_dplr_delta_rule_into.
/// @param q      N x Dk queries
/// @param k      N x Dk keys
/// @param v      N x Dv values
/// @param a      N x Dk (FLA's alpha)
/// @param b      N x Dk (FLA's beta)
/// @param gates  N x Dk or N x 1: log_gates(g) or w_t
template <class Acc = void, class DQ, class DK, class DV, class DA, class DB, class Gates,
          class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
Matrix<typename DQ::Scalar> causal_dplr_delta_rule(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b, const Gates& gates,
    const DplrOptions& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  causal_dplr_delta_rule_into<Acc>(q, k, v, a, b, gates, out, options);
  return out;
}

/// The generalized delta rule for every head of every sequence on caller memory ([B, H, N, D]
/// or [B, N, H, D], any strides), written into `out`, each head from a zero state; threads
/// over B x H (DplrOptions::threads). Head (b, h) gives causal_dplr_delta_rule on its heads up
/// to rounding; q, k and v may have fewer heads (a divisor of H, shared by
/// DplrOptions::head_grouping), a, b and the gates have one head per output head. Every check
/// runs before anything is written.
/// @param q        B x Hq x N x Dk queries (Hq divides H)
/// @param k        B x Hk x N x Dk keys (Hk divides H)
/// @param v        B x Hv x N x Dv values (Hv divides H)
/// @param a        B x H x N x Dk (FLA's alpha)
/// @param b        B x H x N x Dk (FLA's beta)
/// @param gates    B x H x N x Dk (or x 1) decays: a view of w_t, or log_gates(view)
/// @param out      B x H x N x Dv result; its heads may not overlap each other or the inputs
/// @param options  scale, chunk, form, check_finite, threads, head_grouping
template <class Acc = void, class Q, class K, class V, class A, class B, class Gates, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>,
          class = detail::enable_if_delta_head_gates<Gates, O>>
void causal_dplr_delta_rule_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                 const HeadsView<V>& v, const HeadsView<A>& a,
                                 const HeadsView<B>& b, const Gates& gates, const HeadsView<O>& out,
                                 const DplrOptions& options = {}) {
  detail::heads_dplr_rule<Acc>(q, k, v, a, b, gates, out, nullptr, options,
                               "causal_dplr_delta_rule");
}

/// The generalized delta rule over a packed batch of sequences of different lengths: sequence
/// s is tokens [offsets[s], offsets[s+1]) of every view (FLA's cu_seqlens) and starts from a
/// zero state. See the view call above.
/// @param q        1 x Hq x total x Dk queries
/// @param k        1 x Hk x total x Dk keys
/// @param v        1 x Hv x total x Dv values
/// @param a        1 x H x total x Dk
/// @param b        1 x H x total x Dk
/// @param gates    1 x H x total x Dk (or x 1): a view of w_t, or log_gates(view)
/// @param offsets  S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
/// @param out      1 x H x total x Dv result
/// @param options  as the view call
template <class Acc = void, class Q, class K, class V, class A, class B, class Gates, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>,
          class = detail::enable_if_delta_head_gates<Gates, O>>
void causal_dplr_delta_rule_varlen_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                        const HeadsView<V>& v, const HeadsView<A>& a,
                                        const HeadsView<B>& b, const Gates& gates,
                                        const std::vector<std::int64_t>& offsets,
                                        const HeadsView<O>& out, const DplrOptions& options = {}) {
  detail::heads_dplr_rule<Acc>(q, k, v, a, b, gates, out, &offsets, options,
                               "causal_dplr_delta_rule_varlen");
}

/// Many DplrDeltaRuleStates stepped together (state_batch.hpp).
template <class T, class Acc>
class DplrDeltaRuleStateBatch;

/// The generalized delta rule's recurrent form: the state S (Dk x Dv) of one sequence and its
/// tokens. `step` adds one token in two passes over S, allocating nothing; `prefill` adds many
/// through the automatic form; both give the outputs of one causal_dplr_delta_rule call over
/// the whole sequence. T is the input type (float, double, Eigen::half, Eigen::bfloat16), Acc
/// the state's (float or double).
template <class T, class Acc = detail::default_accumulator_t<T>>
class DplrDeltaRuleState : public detail::StateCore<detail::HeldMatrix<Acc>, DplrOptions> {
  using Core = detail::StateCore<detail::HeldMatrix<Acc>, DplrOptions>;
  using Core::carried_;
  using Core::options_;
  using Core::progress_;
  static_assert(detail::is_input_scalar<T>,
                "DplrDeltaRuleState<T, Acc> takes float, double, Eigen::half or Eigen::bfloat16 "
                "inputs (T)");
  static_assert(detail::is_supported_scalar<Acc>,
                "DplrDeltaRuleState<T, Acc> accumulates in float or double: for 16-bit inputs "
                "write DplrDeltaRuleState<Eigen::half, float>");

 public:
  /// @param key_dim    Dk, the width of q, k, a and b
  /// @param value_dim  Dv, the width of v
  /// @param options    scale, check_finite (and chunk and form, for prefill)
  DplrDeltaRuleState(Eigen::Index key_dim, Eigen::Index value_dim, const DplrOptions& options = {})
      : Core(detail::HeldMatrix<Acc>{Matrix<Acc>::Zero(
                 detail::require_positive_dim(key_dim, "DplrDeltaRuleState", "key_dim"),
                 detail::require_positive_dim(value_dim, "DplrDeltaRuleState", "value_dim"))},
             options),
        token_(key_dim, value_dim) {
    detail::validate_dplr_options(options, "DplrDeltaRuleState");
  }

  /// A state that starts from S = s0 (FLA's initial_state[b, h]; RWKV-7's V x K state
  /// transposed).
  /// @param s0       Dk x Dv, finite
  /// @param options  as the constructor's
  template <class DS>
  static DplrDeltaRuleState from_state(const Eigen::MatrixBase<DS>& s0,
                                       const DplrOptions& options = {}) {
    Matrix<Acc> s = detail::initial_state<Acc>(s0, "DplrDeltaRuleState::from_state");
    DplrDeltaRuleState state(s.rows(), s.cols(), options);
    state.carried_.s = std::move(s);
    return state;
  }

  /// Adds one token and returns its output S_t^T (s q).
  /// @param q     Dk query (any row or column vector expression)
  /// @param k     Dk key
  /// @param v     Dv value
  /// @param a     Dk (FLA's alpha)
  /// @param b     Dk (FLA's beta)
  /// @param gate  Dk (or 1) decays: log_gates(g) or w_t
  template <class DQ, class DK, class DV, class DA, class DB, class Gate,
            class = std::enable_if_t<detail::gate_traits<Gate>::is_gate>>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DA>& a,
                 const Eigen::MatrixBase<DB>& b, const Gate& gate) {
    Vector<T> out(value_dim());
    step_into(q, k, v, a, b, gate, out);
    return out;
  }

  /// As step, writing into `out` (Dv); allocates nothing. On a throw the state is unchanged.
  template <class DQ, class DK, class DV, class DA, class DB, class Gate,
            class = std::enable_if_t<detail::gate_traits<Gate>::is_gate>>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DA>& a,
                 const Eigen::MatrixBase<DB>& b, const Gate& gate, Eigen::Ref<Vector<T>> out) {
    constexpr const char* where = "DplrDeltaRuleState::step";
    using Traits = detail::gate_traits<Gate>;
    detail::check_dplr_call_scalars<Acc, DQ, DK, DV, DA, DB, Gate>();
    static_assert(std::is_same_v<typename DQ::Scalar, T>,
                  "the token must have the state's input scalar type");
    detail::require_vector(q, key_dim(), where, "q");
    detail::require_vector(k, key_dim(), where, "k");
    detail::require_vector(v, value_dim(), where, "v");
    detail::require_output_size(out, value_dim(), where);
    const auto& values = Traits::values(gate);
    if ((values.rows() != 1 && values.cols() != 1) ||
        (values.size() != 1 && values.size() != key_dim())) {
      throw Error(std::string(where) + ": gate is " + detail::shape_string(values) + ", expected " +
                  std::to_string(key_dim()) + " decays (one per key feature) or 1 (one for all)");
    }
    check_pairs<Traits::log_space>(a, b, values, where);
    if (options_.check_finite) {
      detail::require_finite(q, where, "q");
      detail::require_finite(k, where, "k");
      detail::require_finite(v, where, "v");
    }
    require_advance(1, where);
    load_token(q, k, v);
    load_pairs<Traits::log_space>(a, b, values);
    advance(out);
  }

  /// Adds many tokens (the automatic form) and returns their outputs (N x Dv), the same as
  /// steps.
  /// @param q      N x Dk queries
  /// @param k      N x Dk keys
  /// @param v      N x Dv values
  /// @param a      N x Dk
  /// @param b      N x Dk
  /// @param gates  N x Dk or N x 1: log_gates(g) or w_t
  template <class DQ, class DK, class DV, class DA, class DB, class Gates,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  Matrix<T> prefill(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DA>& a,
                    const Eigen::MatrixBase<DB>& b, const Gates& gates) {
    Matrix<T> out(q.rows(), v.cols());
    prefill_into(q, k, v, a, b, gates, out);
    return out;
  }

  /// As prefill, writing into `out` (N x Dv). On a throw the state is unchanged.
  template <class DQ, class DK, class DV, class DA, class DB, class Gates,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  void prefill_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DA>& a,
                    const Eigen::MatrixBase<DB>& b, const Gates& gates, Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "DplrDeltaRuleState::prefill";
    detail::check_dplr_call_scalars<Acc, DQ, DK, DV, DA, DB, Gates>();
    static_assert(std::is_same_v<typename DQ::Scalar, T>,
                  "the tokens must have the state's input scalar type");
    detail::validate_dplr_sequence(q, k, v, a, b, gates, out, options_, where);
    if (q.cols() != key_dim() || v.cols() != value_dim()) {
      throw Error(std::string(where) + ": q is " + detail::shape_string(q) + " and v " +
                  detail::shape_string(v) +
                  " but the state is Dk x Dv = " + detail::shape_string(key_dim(), value_dim()));
    }
    require_advance(q.rows(), where);
    detail::scan_dplr_inputs(q, k, v, a, b, options_, where);
    detail::OutRows<T> rows(out);
    const detail::GateMatrix<Gates> gate_rows(gates);
    detail::run_dplr_rule<Acc, T>(q.derived(), k.derived(), v.derived(), a.derived(), b.derived(),
                                  gate_rows, options_, carried_.s, &rows, where,
                                  detail::resolve_threads(detail::engine_options(options_)));
    progress_.advance(q.rows(), TransitionKind::feature_gates);
  }

  /// S, Dk x Dv: out_t = S_t^T (s q_t) (RWKV-7's state transposed).
  const Matrix<Acc>& s() const { return carried_.s; }
  /// Dk, rows of S.
  Eigen::Index key_dim() const { return carried_.s.rows(); }
  /// What every family's state answers (detail::StateCore): tokens(), transition() (none
  /// before the first token, then feature_gates: a scalar gate is one broadcast over the
  /// features), value_dim(), options() and reset().
  using Core::options;
  using Core::reset;
  using Core::tokens;
  using Core::transition;
  using Core::value_dim;

  /// Writes the state in format 4 (detail/state_record.hpp: dims, the family, the transition,
  /// the token count, the scale as given, S) little-endian with a CRC-32; load(is, options)
  /// reads it back bit for bit.
  /// @param os  binary output stream
  void save(std::ostream& os) const {
    detail::write_state_record<Acc>(os, record(), carried_.s, nullptr, "DplrDeltaRuleState::save");
  }

  /// Reads a state written by save and checks that it fits the caller: the scale as resolved
  /// for Dk must be options.scale's; chunk, form, check_finite and threads are taken from
  /// `options`. Throws Error, and returns nothing, naming the first difference, and for
  /// everything load_unchecked refuses.
  /// @param is       binary stream positioned at a saved state; read up to its last byte
  /// @param options  the options the caller runs with
  static DplrDeltaRuleState load(std::istream& is, const DplrOptions& options) {
    constexpr const char* where = "DplrDeltaRuleState::load";
    detail::validate_dplr_options(options, where);
    const detail::StateRecord stored =
        detail::read_state_of<Acc>(is, StateFamily::dplr_delta_rule, where);
    return restore(stored, options, where);
  }

  /// Reads a state written by save checking nothing against the caller (the state gets the
  /// scale it was saved with). Throws Error for an empty, failed, truncated or corrupt stream,
  /// a wrong magic, format version or scalar type, another family's state, or a non-finite S.
  /// @param is  binary stream positioned at a saved state; read up to its last byte
  static DplrDeltaRuleState load_unchecked(std::istream& is) {
    const detail::StateRecord stored = detail::read_state_of<Acc>(
        is, StateFamily::dplr_delta_rule, "DplrDeltaRuleState::load_unchecked");
    return build(stored, detail::saved_options(stored.dplr));
  }

 private:
  detail::StateRecord record() const {
    detail::StateRecord record = this->record_of(StateFamily::dplr_delta_rule);
    record.dplr.scale = options_.scale;
    return record;
  }

  static DplrDeltaRuleState restore(const detail::StateRecord& stored, const DplrOptions& options,
                                    const char* where) {
    const auto dk = static_cast<Eigen::Index>(stored.rows);
    const double saved_scale = detail::dplr_scale(detail::saved_options(stored.dplr), dk);
    const double scale = detail::dplr_scale(options, dk);
    if (!(saved_scale == scale)) {
      throw Error(std::string(where) + ": the state was saved with scale " +
                  std::to_string(saved_scale) + " (for Dk = " + std::to_string(dk) +
                  ") but options.scale gives " + std::to_string(scale));
    }
    return build(stored, options);
  }

  static DplrDeltaRuleState build(const detail::StateRecord& stored, const DplrOptions& options) {
    DplrDeltaRuleState state(static_cast<Eigen::Index>(stored.rows),
                             static_cast<Eigen::Index>(stored.cols), options);
    state.carried_.s = detail::record_s<Acc>(stored);
    state.take_progress(stored);
    return state;
  }

  template <class, class>
  friend class DplrDeltaRuleStateBatch;
  friend struct detail::StateAccess;
  using Core::held_s;

  /// Throws unless a and b are Dk vectors (finite with check_finite) and the decays, 1 or Dk
  /// of them, in range.
  template <bool LogSpace, class DA, class DB, class DG>
  void check_pairs(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b,
                   const Eigen::MatrixBase<DG>& values, const char* where) const {
    detail::require_vector(a, key_dim(), where, "a");
    detail::require_vector(b, key_dim(), where, "b");
    detail::require_gates_in_range<LogSpace>(values, where, "gate");
    if (options_.check_finite) {
      detail::require_finite(a, where, "a");
      detail::require_finite(b, where, "b");
    }
  }

  /// Copies a checked token's q, k and v into the step's buffers, in Acc.
  template <class DQ, class DK, class DV>
  void load_token(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                  const Eigen::MatrixBase<DV>& v) {
    detail::load_vector(q, token_.q);
    detail::load_vector(k, token_.k);
    detail::load_vector(v, token_.v);
  }

  /// Copies a checked token's a, b and decays w (from 1 or Dk gates, log gates when LogSpace).
  template <bool LogSpace, class DA, class DB, class DG>
  void load_pairs(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b,
                  const Eigen::MatrixBase<DG>& values) {
    detail::load_vector(a, token_.a);
    detail::load_vector(b, token_.b);
    // The decays in Acc, one vectorised exp (a scalar gate broadcast).
    if (values.size() == 1) {
      const double g = static_cast<double>(values.reshaped()(0));
      token_.w.setConstant(static_cast<Acc>(LogSpace ? std::exp(g) : g));
    } else {
      detail::load_vector(values, token_.w);  // then exp over Acc: vectorised, unlike a cast's
      if constexpr (LogSpace) token_.w = token_.w.array().exp().matrix();
    }
  }

  /// The loaded token through the recurrence; out = its output.
  void advance(Eigen::Ref<Vector<T>> out) {
    token_.q *= static_cast<Acc>(detail::dplr_scale(options_, key_dim()));
    detail::dplr_step(carried_.s, token_.refs(), token_.wq, token_.u);
    out = token_.out.template cast<T>();
    progress_.advance(1, TransitionKind::feature_gates);
  }

  void require_advance(Eigen::Index count, const char* where) const {
    Core::require_advance(TransitionKind::feature_gates, count, where,
                          detail::dplr_transition_name);
  }

  detail::DplrStepBuffers<Acc> token_;
};

}  // namespace linattn

/// The compiled mode's instances of the generalized delta rule's view drivers:
/// LINATTN_DPLR_HEADS_INSTANCES for each (accumulation T, input S) pair of
/// LINATTN_KERNEL_TYPES, LINATTN_DPLR_HEADS_CHECK_INSTANCES for each input type S.
#define LINATTN_DPLR_HEADS_INSTANCES(prefix, T, S)                                     \
  prefix void linattn::detail::run_dplr_heads<T, S>(                                   \
      const linattn::ConstHeadsView<S>&, const linattn::ConstHeadsView<S>&,            \
      const linattn::ConstHeadsView<S>&, const linattn::ConstHeadsView<S>&,            \
      const linattn::ConstHeadsView<S>&, const linattn::detail::AnyHeadTransition<S>&, \
      const linattn::HeadsView<S>&, const linattn::detail::SequenceRows&,              \
      const linattn::DplrOptions&, const char*, linattn::detail::DplrStateOf<T>);
#define LINATTN_DPLR_HEADS_CHECK_INSTANCES(prefix, S)                                  \
  prefix linattn::detail::SequenceRows linattn::detail::check_dplr_heads<S>(           \
      const linattn::ConstHeadsView<S>&, const linattn::ConstHeadsView<S>&,            \
      const linattn::ConstHeadsView<S>&, const linattn::ConstHeadsView<S>&,            \
      const linattn::ConstHeadsView<S>&, const linattn::detail::AnyHeadTransition<S>&, \
      const linattn::ConstHeadsView<S>&, const std::vector<std::int64_t>*,             \
      const linattn::DplrOptions&, const char*);

#ifdef LINATTN_COMPILED
#define LINATTN_DECLARE_DPLR_HEADS(T, S) LINATTN_DPLR_HEADS_INSTANCES(extern template, T, S)
LINATTN_KERNEL_TYPES(LINATTN_DECLARE_DPLR_HEADS)
#undef LINATTN_DECLARE_DPLR_HEADS
#define LINATTN_DECLARE_DPLR_HEADS_CHECKS(S) LINATTN_DPLR_HEADS_CHECK_INSTANCES(extern template, S)
LINATTN_INPUT_TYPES(LINATTN_DECLARE_DPLR_HEADS_CHECKS)
#undef LINATTN_DECLARE_DPLR_HEADS_CHECKS
#endif
