// SPDX-License-Identifier: MIT
// The delta rule (FLA's conventions): DeltaNet, Gated DeltaNet (Qwen3-Next) and KDA (Kimi
// Linear), in the chunked form for prefill and training and the recurrent form for decoding.
#pragma once

#include <cmath>
#include <cstdint>
#include <istream>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/delta_rule.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/serialize.hpp>
#include <linattn/detail/state_access.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/detail/state_record.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/multi_head.hpp>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

/// The recurrence, with q, k: N x Dk, v: N x Dv, beta: N and (gated forms) log gates g:
/// N x 1 (Gated DeltaNet) or N x Dk (KDA), a_t = exp(g_t):
///     S'_t = diag(a_t) S_{t-1}                                  (the decay first)
///     S_t  = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T             (the delta on the decayed state)
///     out_t = S_t^T (s q_t)                                      (no normaliser)
/// that is S_t = (I - beta_t k_t k_t^T) diag(a_t) S_{t-1} + beta_t k_t v_t^T, as FLA's
/// chunk_gated_delta_rule / chunk_kda compute it, with s = DeltaOptions::scale (Dk^-1/2 by
/// default) and q, k optionally L2-normalised inside the kernel. Every entry point takes an
/// optional first template argument, the accumulation type (default: the input scalar).
namespace linattn {

namespace detail {

/// Throws unless the inputs share one scalar type.
template <class DQ, class DK, class DV, class DB>
constexpr void check_delta_scalars();

/// The compile-time checks of a matrix call accumulating in Acc: one input scalar type for q,
/// k, v, beta and the gates (Gates void for DeltaNet), and a float or double accumulator.
template <class Acc, class DQ, class DK, class DV, class DB, class Gates>
constexpr void check_delta_call_scalars() {
  static_assert(is_supported_scalar<accumulator_t<Acc, typename DQ::Scalar>>,
                "the delta rule accumulates in float or double (Acc = float or double)");
  check_delta_scalars<DQ, DK, DV, DB>();
  if constexpr (!std::is_void_v<Gates>) {
    static_assert(std::is_same_v<gate_scalar_t<Gates>, typename DQ::Scalar>,
                  "the gates must have the inputs' scalar type");
  }
}

template <class DQ, class DK, class DV, class DB>
constexpr void check_delta_scalars() {
  static_assert(std::is_same_v<typename DQ::Scalar, typename DK::Scalar> &&
                    std::is_same_v<typename DQ::Scalar, typename DV::Scalar> &&
                    std::is_same_v<typename DQ::Scalar, typename DB::Scalar>,
                "the delta rule takes q, k, v and beta of one scalar type: cast them first");
  static_assert(is_input_scalar<typename DQ::Scalar>,
                "the delta rule takes float, double, Eigen::half or Eigen::bfloat16 inputs");
}

/// Every check of a delta-rule sequence before anything is written: options, shapes, beta,
/// the gates (`gates` null for DeltaNet), the output, then (check_finite) q, k and v.
template <class DQ, class DK, class DV, class DB, class Out>
void validate_delta_sequence(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                             const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
                             const Out& out, const DeltaOptions& options, const char* where) {
  validate_delta_options(options, where);
  const Options engine = engine_options(options);
  validate_sequence_shapes(q, k, v, engine, where, "q", "k");
  validate_beta(beta, q.rows(), options, where);
  require_output_shape(out, q.rows(), v.cols(), where);
}

/// The gates of a gated call: N x 1 or N x Dk, in range.
template <class Gates>
void validate_delta_gates(const Gates& gates, Eigen::Index rows, Eigen::Index key_dim,
                          const char* where) {
  using Traits = gate_traits<Gates>;
  require_gate_shape(Traits::values(gates), rows, key_dim, where, "q");
  require_gates_in_range<Traits::log_space>(Traits::values(gates), where, "gates");
}

/// True when a call runs the streamed recurrence: asked for, or (automatic) everywhere
/// bench_delta measured it faster than the chunked form (Dk = Dv = 64 and 128), except rows of
/// S a multiple of 4 KiB long, where its strips stall on 4K aliasing.
inline bool streams(const DeltaOptions& options, Eigen::Index value_dim, std::size_t scalar_size) {
  if (options.form != DeltaForm::automatic) return options.form == DeltaForm::streamed;
  return value_dim * static_cast<Eigen::Index>(scalar_size) % 4096 != 0;
}

/// Runs the chunked form over every token from `state` on (Dk x Dv, left after the last
/// token), writing out rows when `out` is not null. Inputs validated by the caller. With
/// threads > 1 the value columns are split between them: under the delta rule each column of
/// S (and of the output) evolves alone, so the parts need no synchronisation: the streamed
/// form's give one thread's outputs bit for bit, the chunked form's to rounding (its GEMMs
/// block narrower parts differently).
template <class T, class O, class DQ, class DK, class DV, class DB>
void run_delta_rule(const DQ& q, const DK& k, const DV& v, const DB& beta, const GateRows* gates,
                    const DeltaOptions& options, Matrix<T>& state, OutRows<O>* out,
                    const char* where, int threads = 1) {
  const SerialEigenScope serial;
  const BetaVector<T, DB> beta_rows(beta);
  const Eigen::Index dv = v.cols();
  const Eigen::Index parts =
      std::max<Eigen::Index>(1, std::min<Eigen::Index>(threads, dv / kDeltaMinColumnsPerThread));
  const bool streamed = streams(options, dv, sizeof(T));
  const auto run = [&](const ChunkSource<T>& source, Eigen::Index width, Matrix<T>& part_state,
                       OutRows<O>* part_out) {
    if (streamed) {
      DeltaStream<T, O>(q.cols(), width, options).run(source, beta_rows, part_state, part_out);
    } else {
      DeltaKernel<T, O>(q.rows(), q.cols(), width, options)
          .run(source, beta_rows, part_state, part_out);
    }
  };
  if (parts == 1) {
    with_source<T>(q, k, v, Identity{}, gates, false, where,
                   [&](ChunkSource<T>& source) { run(source, dv, state, out); });
    return;
  }
  parallel_for(parts, static_cast<int>(parts), [&](Eigen::Index p) {
    const Eigen::Index first = dv * p / parts, width = dv * (p + 1) / parts - first;
    Matrix<T> part_state = state.middleCols(first, width);
    with_source<T>(q, k, v.middleCols(first, width), Identity{}, gates, false, where,
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

/// scan_inputs with the delta rule's stability check: without l2_normalize and with
/// check_finite, k is read once for both (a row's squared norm is finite exactly when the row
/// is, barring overflow, which the stability check then reports), so the check costs no pass
/// over memory of its own. Errors as scan_inputs, then require_stable_steps.
template <class DQ, class DK, class DV, class DB>
void scan_delta_inputs(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                       const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
                       const DeltaOptions& options, const char* where) {
  const Options engine = engine_options(options);
  if (options.l2_normalize || !options.check_finite) {
    scan_inputs(q, k, v, engine, where, "q", "k");
    require_stable_steps(k, beta, options, where);
    return;
  }
  const int threads = resolve_threads(engine);
  require_finite_parallel(q, where, "q", threads);
  const Eigen::Index blocks =
      std::max<Eigen::Index>(1, std::min<Eigen::Index>(threads, k.rows() / kMinScanRows));
  std::vector<double> largest(static_cast<std::size_t>(blocks), 0.0);
  parallel_for(blocks, static_cast<int>(blocks), [&](Eigen::Index b) {
    const Eigen::Index first = k.rows() * b / blocks, last = k.rows() * (b + 1) / blocks;
    largest[static_cast<std::size_t>(b)] = largest_step_gain(
        k.middleRows(first, last - first), beta.reshaped().segment(first, last - first));
  });
  double worst = 0.0;  // NaN once any block is NaN (std::max_element would skip it)
  for (const double x : largest) {
    if (!std::isnan(worst)) worst = std::isnan(x) ? x : std::max(worst, x);
  }
  if (!std::isfinite(worst)) require_finite_parallel(k, where, "k", threads);
  require_finite_parallel(v, where, "v", threads);
  if (!(worst <= kMaxStepGain)) require_stable_steps(k, beta, options, where);
}

/// The matrix entry points: validate, then the chunked form from a zero state.
template <class Acc, class DQ, class DK, class DV, class DB, class Gates>
void delta_rule_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                     const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
                     const Gates* gates, Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                     const DeltaOptions& options, const char* where) {
  using Scalar = typename DQ::Scalar;
  using T = accumulator_t<Acc, Scalar>;
  check_delta_call_scalars<Acc, DQ, DK, DV, DB, Gates>();
  validate_delta_sequence(q, k, v, beta, out, options, where);
  if constexpr (!std::is_void_v<Gates>) validate_delta_gates(*gates, q.rows(), q.cols(), where);
  scan_delta_inputs(q, k, v, beta, options, where);
  Matrix<T> state = Matrix<T>::Zero(q.cols(), v.cols());
  OutRows<Scalar> rows(out);
  const int threads = resolve_threads(engine_options(options));
  if constexpr (std::is_void_v<Gates>) {
    run_delta_rule<T, Scalar>(q.derived(), k.derived(), v.derived(), beta.derived(), nullptr,
                              options, state, &rows, where, threads);
  } else {
    const GateMatrix<Gates> gate_rows(*gates);
    run_delta_rule<T, Scalar>(q.derived(), k.derived(), v.derived(), beta.derived(), &gate_rows,
                              options, state, &rows, where, threads);
  }
}

/// The gate argument of a multi-head gated delta-rule call: a view of a_t, or log_gates(view).
template <class G, class Scalar>
struct delta_head_gates {
  static constexpr bool valid = false;
};
template <class G, class Scalar>
struct delta_head_gates<HeadsView<G>, Scalar> : head_transition<HeadsView<G>, Scalar> {};
template <class G, class Scalar>
struct delta_head_gates<LogGates<HeadsView<G>>, Scalar>
    : head_transition<LogGates<HeadsView<G>>, Scalar> {};
template <class Gates, class O>
using enable_if_delta_head_gates = std::enable_if_t<delta_head_gates<Gates, O>::valid>;

/// Throws unless `view` is [B, H, N, dim] for out's B, H and N: beta and the gates belong to
/// the value heads (FLA's beta and g are [B, T, HV]); only q and k may have fewer heads.
/// `out_name` is how messages name out (grad_out in the backward).
template <class T, class O>
void require_head_view(const HeadsView<T>& view, const HeadsView<O>& out, Eigen::Index dim,
                       const char* what, const char* where, const char* name,
                       const char* out_name = "out") {
  if (view.batch() != out.batch() || view.tokens() != out.tokens() || view.heads() != out.heads() ||
      view.dim() != dim) {
    std::string message = std::string(where) + ": " + name + " is " + view.sizes_string() +
                          " but must be [" + std::to_string(out.batch()) + ", " +
                          std::to_string(out.heads()) + ", " + std::to_string(out.tokens()) + ", " +
                          what + "] (" + out_name + " is " + out.sizes_string() + ")";
    if (view.heads() != out.heads()) {
      message += ": " + std::string(name) + " needs one head per value head (" + out_name +
                 "'s H), as FLA's [B, T, HV]; only q, k and v may have fewer heads (grouped by " +
                 "DeltaOptions::head_grouping)";
    }
    throw Error(message);
  }
}

/// Checks a view call of the delta rule (`transition` empty for DeltaNet, else its gates; one
/// sequence per batch entry, or the packed sequences of `offsets`) before anything is written, and
/// returns its sequences. `out_name` is how messages name out (the backward's grad_out plays its
/// part). Compiled once per input type in the compiled mode.
template <class S>
SequenceRows check_delta_heads(const ConstHeadsView<S>& q, const ConstHeadsView<S>& k,
                               const ConstHeadsView<S>& v, const AnyHeadTransition<S>& transition,
                               const ConstHeadsView<S>& beta, const ConstHeadsView<S>& out,
                               const std::vector<std::int64_t>* offsets,
                               const DeltaOptions& options, const char* where,
                               const char* out_name) {
  validate_delta_options(options, where);
  const Options engine = engine_options(options);
  validate_heads(q, k, v, out, v.dim(), engine, where, "q", "k", false, out_name);
  require_head_view(beta, out, 1, "1", where, "beta", out_name);
  if (transition.gates() != nullptr) {
    const ConstHeadsView<S>& view = *transition.gates();
    if (view.dim() != 1) {
      require_head_view(view, out, q.dim(), "Dk (one gate per key feature) or 1", where, "gates",
                        out_name);
    } else {
      require_head_view(view, out, 1, "1 (one gate per token) or Dk", where, "gates", out_name);
    }
  }
  const SequenceRows sequences = sequence_rows(q, offsets, where, "q");
  const int threads = resolve_threads(engine);
  scan_view(
      beta, threads,
      [&](const auto& rows) {
        return ((rows.array() > S(0)) && (rows.array() <= S(max_beta(options)))).all();
      },
      [&](const auto& head, Eigen::Index b, Eigen::Index h) {
        require_beta_in_range(head, options, where, head_name("beta", b, h));
      });
  scan_transition(transition, threads, where);
  scan_heads(q, k, v, engine, where, "q", "k");
  if (!options.l2_normalize) {  // every head's steps, through the heads it reads
    for (Eigen::Index b = 0; b < out.batch(); ++b) {
      for (Eigen::Index h = 0; h < out.heads(); ++h) {
        const Eigen::Index hk = input_head(k, out.heads(), h, options.head_grouping);
        require_stable_steps(k.head(b, hk), beta.head(b, h), options, where, head_name("k", b, hk));
      }
    }
  }
  return sequences;
}

/// The gates of a delta-rule view call (null: DeltaNet), erased.
template <class S, class Gates>
AnyHeadTransition<S> delta_gates(const Gates* gates) {
  if constexpr (std::is_void_v<Gates>) {
    return AnyHeadTransition<S>();
  } else {
    return any_transition<S>(*gates);
  }
}

/// check_delta_heads for views of any constness and gates of any kind (`gates` null for
/// DeltaNet).
template <class Acc, class Q, class K, class V, class B, class O, class Gates>
SequenceRows check_heads_delta_rule(const HeadsView<Q>& q, const HeadsView<K>& k,
                                    const HeadsView<V>& v, const Gates* gates,
                                    const HeadsView<B>& beta, const HeadsView<O>& out,
                                    const std::vector<std::int64_t>* offsets,
                                    const DeltaOptions& options, const char* where,
                                    const char* out_name = "out") {
  using Scalar = std::remove_const_t<O>;
  static_assert(is_input_scalar<Scalar>,
                "the delta rule takes float, double, Eigen::half or Eigen::bfloat16 inputs");
  static_assert(is_supported_scalar<accumulator_t<Acc, Scalar>>,
                "the delta rule accumulates in float or double (Acc = float or double)");
  static_assert(std::is_same_v<std::remove_const_t<B>, Scalar>,
                "beta must have the inputs' scalar type: cast it first");
  return check_delta_heads<Scalar>(q, k, v, delta_gates<Scalar>(gates), beta, out, offsets, options,
                                   where, out_name);
}

/// What a delta-rule view driver asks its caller for each head: with_state(s, h, run) calls
/// run(S) with the state of head h of sequence s (Dk x Dv, in the accumulation type T).
template <class T>
using DeltaStateRun = FunctionRef<void(Matrix<T>&)>;
template <class T>
using DeltaWithState = FunctionRef<void(Eigen::Index, Eigen::Index, DeltaStateRun<T>)>;

/// Runs the delta rule over every sequence and head of checked views, threads over sequences
/// x heads, each head from the state with_state gives it, which the head leaves after its
/// last token. Compiled once per (T, S) in the compiled mode.
template <class T, class S>
void run_delta_heads(const ConstHeadsView<S>& q, const ConstHeadsView<S>& k,
                     const ConstHeadsView<S>& v, const AnyHeadTransition<S>& transition,
                     const ConstHeadsView<S>& beta, const HeadsView<S>& out,
                     const SequenceRows& sequences, const DeltaOptions& options, const char* where,
                     DeltaWithState<T> with_state) {
  for_each_sequence_head(q, k, v, out, sequences, engine_options(options),
                         [&](Eigen::Index s, Eigen::Index h, const auto& qs, const auto& ks,
                             const auto& vs, auto os, int inner_threads) {
                           const Eigen::Index b = sequences.batch_of(s), begin = sequences.begin(s);
                           const auto beta_rows = beta.head(b, h).col(0).segment(begin, qs.rows());
                           with_state(s, h, [&](Matrix<T>& state) {
                             OutRows<S> rows(os);
                             if (transition.gates() == nullptr) {
                               run_delta_rule<T, S>(qs, ks, vs, beta_rows, nullptr, options, state,
                                                    &rows, where, inner_threads);
                             } else {
                               with_gate_rows(transition, transition.gates()->head(b, h), begin,
                                              [&](const GateRows* gate_rows) {
                                                run_delta_rule<T, S>(qs, ks, vs, beta_rows,
                                                                     gate_rows, options, state,
                                                                     &rows, where, inner_threads);
                                              });
                             }
                           });
                         });
}

/// run_delta_heads for views of any constness, gates of any kind (null for DeltaNet) and any
/// with_state(s, h, run).
template <class Acc, class Q, class K, class V, class B, class O, class Gates, class WithState>
void run_heads_delta_rule(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                          const Gates* gates, const HeadsView<B>& beta, const HeadsView<O>& out,
                          const SequenceRows& sequences, const DeltaOptions& options,
                          const char* where, const WithState& with_state) {
  using T = accumulator_t<Acc, O>;
  run_delta_heads<T, O>(
      q, k, v, delta_gates<O>(gates), beta, out, sequences, options, where,
      [&](Eigen::Index s, Eigen::Index h, DeltaStateRun<T> run) { with_state(s, h, run); });
}

/// The delta rule over every sequence and head of the views, each from a zero state. Every
/// check runs before the first output is written.
template <class Acc, class Q, class K, class V, class B, class O, class Gates>
void heads_delta_rule(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                      const Gates* gates, const HeadsView<B>& beta, const HeadsView<O>& out,
                      const std::vector<std::int64_t>* offsets, const DeltaOptions& options,
                      const char* where) {
  using T = accumulator_t<Acc, O>;
  const SequenceRows sequences =
      check_heads_delta_rule<Acc>(q, k, v, gates, beta, out, offsets, options, where);
  run_heads_delta_rule<Acc>(q, k, v, gates, beta, out, sequences, options, where,
                            [&](Eigen::Index, Eigen::Index, const auto& run) {
                              Matrix<T> state = Matrix<T>::Zero(q.dim(), v.dim());
                              run(state);
                            });
}

}  // namespace detail

/// DeltaNet, chunked form, into `out`: S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
/// out_t = S_t^T (s q_t), from a zero state (DeltaRuleState carries one in and out).
/// Allocates O(chunk * (Dk + Dv + chunk) + Dk * Dv), nothing proportional to N.
/// @param q        N x Dk queries
/// @param k        N x Dk keys (L2-normalised, or DeltaOptions::l2_normalize)
/// @param v        N x Dv values
/// @param beta     N learning rates in (0, 1] ((0, 2] with allow_negative_eigenvalues), a row
///                 or column vector
/// @param out      N x Dv result, row-major; may not alias the inputs
/// @param options  scale, l2_normalize, allow_negative_eigenvalues, chunk, check_finite
template <class Acc = void, class DQ, class DK, class DV, class DB>
void causal_delta_rule_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                            const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
                            Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                            const DeltaOptions& options = {}) {
  detail::delta_rule_into<Acc, DQ, DK, DV, DB, void>(q, k, v, beta, nullptr, out, options,
                                                     "causal_delta_rule");
}

/// DeltaNet, chunked form; returns N x Dv. See causal_delta_rule_into.
/// @param q     N x Dk queries
/// @param k     N x Dk keys
/// @param v     N x Dv values
/// @param beta  N learning rates
template <class Acc = void, class DQ, class DK, class DV, class DB>
Matrix<typename DQ::Scalar> causal_delta_rule(const Eigen::MatrixBase<DQ>& q,
                                              const Eigen::MatrixBase<DK>& k,
                                              const Eigen::MatrixBase<DV>& v,
                                              const Eigen::MatrixBase<DB>& beta,
                                              const DeltaOptions& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  causal_delta_rule_into<Acc>(q, k, v, beta, out, options);
  return out;
}

/// Gated DeltaNet (scalar gates, Qwen3-Next) and KDA (per-feature gates, Kimi Linear),
/// chunked form, into `out`: S_t = (I - beta_t k_t k_t^T) diag(a_t) S_{t-1} + beta_t k_t v_t^T,
/// out_t = S_t^T (s q_t), from a zero state. Gates are given as FLA's log gates,
/// log_gates(g) with g_t = log a_t <= 0 (-infinity is a hard reset), or as a_t in (0, 1].
/// @param q        N x Dk queries
/// @param k        N x Dk keys (L2-normalised, or DeltaOptions::l2_normalize)
/// @param v        N x Dv values
/// @param gates    N x 1 (Gated DeltaNet's g) or N x Dk (KDA's g): log_gates(g) or a_t
/// @param beta     N learning rates in (0, 1] ((0, 2] with allow_negative_eigenvalues)
/// @param out      N x Dv result, row-major; may not alias the inputs
/// @param options  scale, l2_normalize, allow_negative_eigenvalues, chunk, check_finite
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DB,
          class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
void causal_gated_delta_rule_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                  const Eigen::MatrixBase<DV>& v, const Gates& gates,
                                  const Eigen::MatrixBase<DB>& beta,
                                  Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                                  const DeltaOptions& options = {}) {
  detail::delta_rule_into<Acc>(q, k, v, beta, &gates, out, options, "causal_gated_delta_rule");
}

/// Gated DeltaNet and KDA, chunked form; returns N x Dv. See causal_gated_delta_rule_into.
/// @param q      N x Dk queries
/// @param k      N x Dk keys
/// @param v      N x Dv values
/// @param gates  N x 1 or N x Dk: log_gates(g) or a_t
/// @param beta   N learning rates
template <class Acc = void, class DQ, class DK, class DV, class Gates, class DB,
          class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
Matrix<typename DQ::Scalar> causal_gated_delta_rule(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Gates& gates, const Eigen::MatrixBase<DB>& beta, const DeltaOptions& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  causal_gated_delta_rule_into<Acc>(q, k, v, gates, beta, out, options);
  return out;
}

/// DeltaNet for every head of every sequence on caller memory ([B, H, N, D] or [B, N, H, D],
/// any strides), written into `out`, each head from a zero state; threads over B x H
/// (DeltaOptions::threads). Head (b, h) gives exactly causal_delta_rule on q.head(b, hq), ...,
/// beta.head(b, h) up to rounding. Grouped heads (Qwen3-Next: 16 q/k heads, 32 v heads): an
/// input may have fewer heads than out, a divisor of its H, and out head h reads head
/// h / (H / H_in) of it (FLA's grouping; h % H_in with DeltaOptions::head_grouping tiled).
/// Every check runs before anything is written.
/// @param q        B x Hq x N x Dk queries (Hq divides H)
/// @param k        B x Hk x N x Dk keys (Hk divides H)
/// @param v        B x Hv x N x Dv values (Hv divides H)
/// @param beta     B x H x N x 1 learning rates (one head per value head), in (0, 1] ((0, 2] with
///                 allow_negative_eigenvalues)
/// @param out      B x H x N x Dv result; its heads may not overlap each other or the inputs
/// @param options  scale, l2_normalize, allow_negative_eigenvalues, chunk, check_finite, threads
template <class Acc = void, class Q, class K, class V, class B, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>>
void causal_delta_rule_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                            const HeadsView<B>& beta, const HeadsView<O>& out,
                            const DeltaOptions& options = {}) {
  detail::heads_delta_rule<Acc, Q, K, V, B, O, void>(q, k, v, nullptr, beta, out, nullptr, options,
                                                     "causal_delta_rule");
}

/// Gated DeltaNet and KDA for every head of every sequence on caller memory: gates as views
/// laid out like q, k and v ([B, H, N, 1] for Gated DeltaNet, [B, H, N, Dk] for KDA; a_t, or
/// log_gates(view) for FLA's g). Head (b, h) gives causal_gated_delta_rule on its heads up to
/// rounding; grouped heads and threads as causal_delta_rule_into.
/// @param q        B x Hq x N x Dk queries (Hq divides H)
/// @param k        B x Hk x N x Dk keys (Hk divides H)
/// @param v        B x Hv x N x Dv values (Hv divides H)
/// @param gates    B x H x N x 1 or B x H x N x Dk gates (one head per value head): a_t or
/// log_gates(view)
/// @param beta     B x H x N x 1 learning rates (one head per value head)
/// @param out      B x H x N x Dv result
/// @param options  as causal_delta_rule_into
template <class Acc = void, class Q, class K, class V, class Gates, class B, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>,
          class = detail::enable_if_delta_head_gates<Gates, O>>
void causal_gated_delta_rule_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                  const HeadsView<V>& v, const Gates& gates,
                                  const HeadsView<B>& beta, const HeadsView<O>& out,
                                  const DeltaOptions& options = {}) {
  const auto transition = detail::delta_head_gates<Gates, O>::read(gates);
  detail::heads_delta_rule<Acc>(q, k, v, &transition, beta, out, nullptr, options,
                                "causal_gated_delta_rule");
}

/// DeltaNet over a packed batch of sequences of different lengths: sequence s is tokens
/// [offsets[s], offsets[s+1]) of every view (FLA's cu_seqlens) and starts from a zero state.
/// @param q        1 x Hq x total x Dk queries (Hq divides H)
/// @param k        1 x Hk x total x Dk keys (Hk divides H)
/// @param v        1 x Hv x total x Dv values (Hv divides H)
/// @param beta     1 x H x total x 1 learning rates (one head per value head)
/// @param offsets  S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
/// @param out      1 x H x total x Dv result
/// @param options  as causal_delta_rule_into
template <class Acc = void, class Q, class K, class V, class B, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>>
void causal_delta_rule_varlen_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                   const HeadsView<V>& v, const HeadsView<B>& beta,
                                   const std::vector<std::int64_t>& offsets,
                                   const HeadsView<O>& out, const DeltaOptions& options = {}) {
  detail::heads_delta_rule<Acc, Q, K, V, B, O, void>(q, k, v, nullptr, beta, out, &offsets, options,
                                                     "causal_delta_rule_varlen");
}

/// Gated DeltaNet and KDA over a packed batch of sequences of different lengths (gates
/// packed like the tokens). See causal_gated_delta_rule_into and causal_delta_rule_varlen_into.
/// @param q        1 x Hq x total x Dk queries (Hq divides H)
/// @param k        1 x Hk x total x Dk keys (Hk divides H)
/// @param v        1 x Hv x total x Dv values (Hv divides H)
/// @param gates    1 x H x total x 1 or 1 x H x total x Dk gates: a_t or log_gates(view)
/// @param beta     1 x H x total x 1 learning rates (one head per value head)
/// @param offsets  S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
/// @param out      1 x H x total x Dv result
/// @param options  as causal_delta_rule_into
template <class Acc = void, class Q, class K, class V, class Gates, class B, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>,
          class = detail::enable_if_delta_head_gates<Gates, O>>
void causal_gated_delta_rule_varlen_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                         const HeadsView<V>& v, const Gates& gates,
                                         const HeadsView<B>& beta,
                                         const std::vector<std::int64_t>& offsets,
                                         const HeadsView<O>& out,
                                         const DeltaOptions& options = {}) {
  const auto transition = detail::delta_head_gates<Gates, O>::read(gates);
  detail::heads_delta_rule<Acc>(q, k, v, &transition, beta, out, &offsets, options,
                                "causal_gated_delta_rule_varlen");
}

/// Many DeltaRuleStates stepped together (state_batch.hpp).
template <class T, class Acc>
class DeltaRuleStateBatch;

/// The delta rule's recurrent form: the state S (Dk x Dv) of one sequence and its tokens.
/// `step` adds one token in two passes over S, allocating nothing; `prefill` adds many through
/// the chunked form; both give the outputs of one causal_(gated_)delta_rule call over the
/// whole sequence. A state keeps the transition it is first moved with (no gates, scalar or
/// per-feature gates): moving a Gated DeltaNet state without its gates throws. T is the input
/// type (float, double, Eigen::half, Eigen::bfloat16), Acc the state's (float or double).
template <class T, class Acc = detail::default_accumulator_t<T>>
class DeltaRuleState : public detail::StateCore<detail::HeldMatrix<Acc>, DeltaOptions> {
  using Core = detail::StateCore<detail::HeldMatrix<Acc>, DeltaOptions>;
  using Core::carried_;
  using Core::options_;
  using Core::progress_;
  using Core::require_token_room;
  static_assert(detail::is_input_scalar<T>,
                "DeltaRuleState<T, Acc> takes float, double, Eigen::half or Eigen::bfloat16 "
                "inputs (T)");
  static_assert(detail::is_supported_scalar<Acc>,
                "DeltaRuleState<T, Acc> accumulates in float or double: for 16-bit inputs write "
                "DeltaRuleState<Eigen::half, float>");

 public:
  /// @param key_dim    Dk, the width of q and k
  /// @param value_dim  Dv, the width of v
  /// @param options    scale, l2_normalize, allow_negative_eigenvalues, check_finite (and
  ///                   chunk, for prefill)
  DeltaRuleState(Eigen::Index key_dim, Eigen::Index value_dim, const DeltaOptions& options = {})
      : Core(detail::HeldMatrix<Acc>{Matrix<Acc>::Zero(
                 detail::require_positive_dim(key_dim, "DeltaRuleState", "key_dim"),
                 detail::require_positive_dim(value_dim, "DeltaRuleState", "value_dim"))},
             options),
        token_(key_dim, value_dim) {
    detail::validate_delta_options(options, "DeltaRuleState");
  }

  /// A state that starts from S = s0 (an initial state, FLA's initial_state[b, h]).
  /// @param s0       Dk x Dv, finite
  /// @param options  as the constructor's
  template <class DS>
  static DeltaRuleState from_state(const Eigen::MatrixBase<DS>& s0,
                                   const DeltaOptions& options = {}) {
    Matrix<Acc> s = detail::initial_state<Acc>(s0, "DeltaRuleState::from_state");
    DeltaRuleState state(s.rows(), s.cols(), options);
    state.carried_.s = std::move(s);
    return state;
  }

  /// DeltaNet: adds one token and returns its output.
  /// @param q     Dk query (any row or column vector expression)
  /// @param k     Dk key
  /// @param v     Dv value
  /// @param beta  the token's learning rate
  /// @return      Dv output S_t^T (s q)
  template <class DQ, class DK, class DV>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, T beta) {
    Vector<T> out(value_dim());
    step_into(q, k, v, beta, out);
    return out;
  }

  /// Gated DeltaNet and KDA: adds one token with its gate and returns its output.
  /// @param gate  1 (scalar) or Dk (per feature) gates: log_gates(g) or a_t
  template <class DQ, class DK, class DV, class Gate,
            class = std::enable_if_t<detail::gate_traits<Gate>::is_gate>>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Gate& gate, T beta) {
    Vector<T> out(value_dim());
    step_into(q, k, v, gate, beta, out);
    return out;
  }

  /// As step(q, k, v, beta), writing into `out` (Dv); allocates nothing. On a throw the
  /// state is unchanged.
  template <class DQ, class DK, class DV>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, T beta, Eigen::Ref<Vector<T>> out) {
    constexpr const char* where = "DeltaRuleState::step";
    check_token(q, k, v, beta, out, where);
    require_advance(TransitionKind::decay, 1, where);
    load_token(q, k, v);
    advance(beta, 0, out);
  }

  /// As the gated step, writing into `out` (Dv); allocates nothing. On a throw the state is
  /// unchanged.
  template <class DQ, class DK, class DV, class Gate,
            class = std::enable_if_t<detail::gate_traits<Gate>::is_gate>>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Gate& gate, T beta,
                 Eigen::Ref<Vector<T>> out) {
    constexpr const char* where = "DeltaRuleState::step";
    using Traits = detail::gate_traits<Gate>;
    static_assert(std::is_same_v<detail::gate_scalar_t<Gate>, T>,
                  "the gate must have the state's input scalar type");
    check_token(q, k, v, beta, out, where);
    const auto& values = Traits::values(gate);
    if ((values.rows() != 1 && values.cols() != 1) ||
        (values.size() != 1 && values.size() != key_dim())) {
      throw Error(std::string(where) + ": gate is " + detail::shape_string(values) +
                  ", expected 1 gate (scalar) or " + std::to_string(key_dim()) +
                  " (one per key feature)");
    }
    detail::require_gates_in_range<Traits::log_space>(values, where, "gate");
    require_advance(detail::transition_of_gate_dim(values.size()), 1, where);
    load_token(q, k, v);
    load_gates<Traits::log_space>(values);
    advance(beta, values.size(), out);
  }

  /// DeltaNet: adds many tokens through the chunked form and returns their outputs (N x Dv),
  /// the same as steps.
  /// @param q     N x Dk queries
  /// @param k     N x Dk keys
  /// @param v     N x Dv values
  /// @param beta  N learning rates
  template <class DQ, class DK, class DV, class DB>
  Matrix<T> prefill(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta) {
    Matrix<T> out(q.rows(), v.cols());
    prefill_into(q, k, v, beta, out);
    return out;
  }

  /// Gated DeltaNet and KDA: adds many tokens with their gates (N x 1 or N x Dk, log_gates(g)
  /// or a_t) through the chunked form and returns their outputs (N x Dv).
  template <class DQ, class DK, class DV, class Gates, class DB,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  Matrix<T> prefill(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Gates& gates,
                    const Eigen::MatrixBase<DB>& beta) {
    Matrix<T> out(q.rows(), v.cols());
    prefill_into(q, k, v, gates, beta, out);
    return out;
  }

  /// As prefill(q, k, v, beta), writing into `out` (N x Dv). On a throw the state is unchanged.
  template <class DQ, class DK, class DV, class DB>
  void prefill_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
                    Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "DeltaRuleState::prefill";
    validate_prefill(q, k, v, beta, out, where);
    require_advance(TransitionKind::decay, q.rows(), where);
    detail::scan_delta_inputs(q, k, v, beta, options_, where);
    run(q, k, v, beta, static_cast<const detail::GateRows*>(nullptr), out, where);
  }

  /// As the gated prefill, writing into `out` (N x Dv). On a throw the state is unchanged.
  template <class DQ, class DK, class DV, class Gates, class DB,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  void prefill_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Gates& gates,
                    const Eigen::MatrixBase<DB>& beta, Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "DeltaRuleState::prefill";
    static_assert(std::is_same_v<detail::gate_scalar_t<Gates>, T>,
                  "the gates must have the state's input scalar type");
    validate_prefill(q, k, v, beta, out, where);
    detail::validate_delta_gates(gates, q.rows(), key_dim(), where);
    const Eigen::Index gate_dim = detail::gate_traits<Gates>::values(gates).cols();
    require_advance(detail::transition_of_gate_dim(gate_dim), q.rows(), where);
    detail::scan_delta_inputs(q, k, v, beta, options_, where);
    const detail::GateMatrix<Gates> gate_rows(gates);
    run(q, k, v, beta, &gate_rows, out, where);
  }

  /// S, Dk x Dv: out_t = S_t^T (s q_t).
  const Matrix<Acc>& s() const { return carried_.s; }
  /// Dk, rows of S.
  Eigen::Index key_dim() const { return carried_.s.rows(); }
  /// What every family's state answers (detail::StateCore): tokens() seen since construction or
  /// reset(), the transition() that moves the state (none before its first token), Dv
  /// (value_dim()), the options() given at construction or read by load, and reset(), which
  /// forgets every token (S = 0) and keeps the dimensions and options.
  using Core::options;
  using Core::reset;
  using Core::tokens;
  using Core::transition;
  using Core::value_dim;

  /// Writes the state in the format every state saves in (format 4, detail/state_record.hpp:
  /// dims, the family, the transition, the token count, the options that change results, S)
  /// little-endian with a CRC-32; load(is, options) reads it back bit for bit.
  /// @param os  binary output stream
  void save(std::ostream& os) const {
    detail::write_state_record<Acc>(os, record(), carried_.s, nullptr, "DeltaRuleState::save");
  }

  /// Reads a state written by save and checks that it fits the caller: the options that change
  /// results (the scale as resolved for Dk, l2_normalize, allow_negative_eigenvalues) must be
  /// `options`'; chunk, check_finite and threads are taken from `options`. Throws Error, and
  /// returns nothing, naming the first difference, and for everything load_unchecked refuses.
  /// @param is       binary stream positioned at a saved state; read up to its last byte
  /// @param options  the options the caller runs with
  static DeltaRuleState load(std::istream& is, const DeltaOptions& options) {
    constexpr const char* where = "DeltaRuleState::load";
    detail::validate_delta_options(options, where);
    const detail::StateRecord stored =
        detail::read_state_of<Acc>(is, StateFamily::delta_rule, where);
    return restore(stored, options, where);
  }

  /// Reads a state written by save checking nothing against the caller: the state gets the
  /// options it was saved with (and the defaults of chunk, check_finite, threads). For tools
  /// that inspect files; a server loads with load(is, options). Throws Error, and returns
  /// nothing, for an empty, failed, truncated or corrupt stream, a wrong magic, format version
  /// or scalar type, another family's state (a RecurrentState's), dims over 2^26 entries,
  /// invalid options or transition record, or a non-finite S. Reads format 4 and the delta
  /// rule's earlier format ("LNATTND" 1).
  /// @param is  binary stream positioned at a saved state; read up to its last byte
  static DeltaRuleState load_unchecked(std::istream& is) {
    const detail::StateRecord stored =
        detail::read_state_of<Acc>(is, StateFamily::delta_rule, "DeltaRuleState::load_unchecked");
    return build(stored, detail::saved_options(stored.delta));
  }

 private:
  /// The record save writes (its S is carried_.s).
  detail::StateRecord record() const {
    detail::StateRecord record = this->record_of(StateFamily::delta_rule);
    record.delta.scale = options_.scale;
    record.delta.l2_normalize = options_.l2_normalize;
    record.delta.allow_negative_eigenvalues = options_.allow_negative_eigenvalues;
    return record;
  }

  /// The state a verified record holds, checked against the caller's options as load checks
  /// them: what load and a SessionPool's session load give.
  static DeltaRuleState restore(const detail::StateRecord& stored, const DeltaOptions& options,
                                const char* where) {
    const auto dk = static_cast<Eigen::Index>(stored.rows);
    const std::string head = std::string(where) + ": the state was saved with ";
    const double saved_scale = detail::delta_scale(detail::saved_options(stored.delta), dk);
    const double scale = detail::delta_scale(options, dk);
    if (!(saved_scale == scale)) {
      throw Error(head + "scale " + std::to_string(saved_scale) + " (for Dk = " +
                  std::to_string(dk) + ") but options.scale gives " + std::to_string(scale));
    }
    if (stored.delta.l2_normalize != options.l2_normalize) {
      throw Error(head + "l2_normalize " + (stored.delta.l2_normalize ? "on" : "off") +
                  " but options.l2_normalize is " + (options.l2_normalize ? "on" : "off"));
    }
    if (stored.delta.allow_negative_eigenvalues != options.allow_negative_eigenvalues) {
      throw Error(head + "allow_negative_eigenvalues " +
                  (stored.delta.allow_negative_eigenvalues ? "on" : "off") +
                  " but options.allow_negative_eigenvalues is " +
                  (options.allow_negative_eigenvalues ? "on" : "off"));
    }
    return build(stored, options);
  }

  /// The state a verified record holds, with the given options.
  static DeltaRuleState build(const detail::StateRecord& stored, const DeltaOptions& options) {
    DeltaRuleState state(static_cast<Eigen::Index>(stored.rows),
                         static_cast<Eigen::Index>(stored.cols), options);
    state.carried_.s = detail::record_s<Acc>(stored);
    state.take_progress(stored);
    return state;
  }

  template <class, class>
  friend class DeltaRuleStateBatch;
  friend struct detail::StateAccess;

  using Core::held_s;

  /// Throws unless q, k, v, beta and out fit one step (shapes, beta's range, finite).
  template <class DQ, class DK, class DV>
  void check_token(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                   const Eigen::MatrixBase<DV>& v, T beta, const Eigen::Ref<Vector<T>>& out,
                   const char* where) const {
    detail::check_delta_scalars<DQ, DK, DV, DQ>();
    static_assert(std::is_same_v<typename DQ::Scalar, T>,
                  "the token must have the state's input scalar type");
    detail::require_vector(q, key_dim(), where, "q");
    detail::require_vector(k, key_dim(), where, "k");
    detail::require_vector(v, value_dim(), where, "v");
    detail::require_output_size(out, value_dim(), where);
    detail::require_beta_in_range(Eigen::Matrix<T, 1, 1>::Constant(beta), options_, where);
    detail::scan_delta_token(q, k, v, static_cast<double>(beta), options_, where);
  }

  /// Copies a checked token into the step's buffers, in Acc.
  template <class DQ, class DK, class DV>
  void load_token(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                  const Eigen::MatrixBase<DV>& v) {
    detail::load_vector(q, token_.q);
    detail::load_vector(k, token_.k);
    detail::load_vector(v, token_.v);
  }

  /// The step's gates a_t from a checked vector of 1 or Dk gates (log gates when LogSpace).
  template <bool LogSpace, class DG>
  void load_gates(const Eigen::MatrixBase<DG>& values) {
    const Eigen::Index n = values.size();
    for (Eigen::Index i = 0; i < n; ++i) token_.gate(i) = static_cast<Acc>(values.reshaped()(i));
    if constexpr (LogSpace) detail::exp_log_gates(token_.gate.data(), n);
  }

  /// The loaded token through the recurrence; out = its output.
  void advance(T beta, Eigen::Index gates, Eigen::Ref<Vector<T>> out) {
    if (options_.l2_normalize) {
      detail::l2_normalize(token_.q);
      detail::l2_normalize(token_.k);
    }
    token_.q *= static_cast<Acc>(detail::delta_scale(options_, key_dim()));
    detail::delta_step(carried_.s, token_, static_cast<Acc>(beta), gates);
    out = token_.out.template cast<T>();
    progress_.advance(1, detail::transition_of_gate_dim(gates));
  }

  template <class DQ, class DK, class DV, class DB>
  void validate_prefill(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                        const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
                        const Eigen::Ref<Matrix<T>>& out, const char* where) const {
    detail::check_delta_scalars<DQ, DK, DV, DB>();
    static_assert(std::is_same_v<typename DQ::Scalar, T>,
                  "the tokens must have the state's input scalar type");
    detail::validate_delta_sequence(q, k, v, beta, out, options_, where);
    if (q.cols() != key_dim() || v.cols() != value_dim()) {
      throw Error(std::string(where) + ": q is " + detail::shape_string(q) + " and v " +
                  detail::shape_string(v) +
                  " but the state is Dk x Dv = " + detail::shape_string(key_dim(), value_dim()));
    }
  }

  template <class DQ, class DK, class DV, class DB>
  void run(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
           const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
           const detail::GateRows* gates, Eigen::Ref<Matrix<T>> out, const char* where) {
    detail::OutRows<T> rows(out);
    detail::run_delta_rule<Acc, T>(q.derived(), k.derived(), v.derived(), beta.derived(), gates,
                                   options_, carried_.s, &rows, where,
                                   detail::resolve_threads(detail::engine_options(options_)));
    progress_.advance(q.rows(),
                      detail::transition_of_gate_dim(gates == nullptr ? 0 : gates->cols()));
  }

  /// Throws unless a call of `count` tokens moved by `kind` may continue the state.
  void require_advance(TransitionKind kind, Eigen::Index count, const char* where) const {
    Core::require_advance(kind, count, where, detail::delta_transition_name);
  }

  detail::DeltaStepBuffers<Acc> token_;
};

}  // namespace linattn

/// The compiled mode's instances of the delta rule's view drivers:
/// LINATTN_DELTA_HEADS_INSTANCES for each (accumulation T, input S) pair of
/// LINATTN_KERNEL_TYPES, LINATTN_DELTA_HEADS_CHECK_INSTANCES for each input type S; `prefix` is
/// `extern template` (every TU that defines LINATTN_COMPILED) or `template` (the library).
#define LINATTN_DELTA_HEADS_INSTANCES(prefix, T, S)                                    \
  prefix void linattn::detail::run_delta_heads<T, S>(                                  \
      const linattn::ConstHeadsView<S>&, const linattn::ConstHeadsView<S>&,            \
      const linattn::ConstHeadsView<S>&, const linattn::detail::AnyHeadTransition<S>&, \
      const linattn::ConstHeadsView<S>&, const linattn::HeadsView<S>&,                 \
      const linattn::detail::SequenceRows&, const linattn::DeltaOptions&, const char*, \
      linattn::detail::DeltaWithState<T>);
#define LINATTN_DELTA_HEADS_CHECK_INSTANCES(prefix, S)                                 \
  prefix linattn::detail::SequenceRows linattn::detail::check_delta_heads<S>(          \
      const linattn::ConstHeadsView<S>&, const linattn::ConstHeadsView<S>&,            \
      const linattn::ConstHeadsView<S>&, const linattn::detail::AnyHeadTransition<S>&, \
      const linattn::ConstHeadsView<S>&, const linattn::ConstHeadsView<S>&,            \
      const std::vector<std::int64_t>*, const linattn::DeltaOptions&, const char*, const char*);

#ifdef LINATTN_COMPILED
#define LINATTN_DECLARE_DELTA_HEADS(T, S) LINATTN_DELTA_HEADS_INSTANCES(extern template, T, S)
LINATTN_KERNEL_TYPES(LINATTN_DECLARE_DELTA_HEADS)
#undef LINATTN_DECLARE_DELTA_HEADS
#define LINATTN_DECLARE_DELTA_HEADS_CHECKS(S) \
  LINATTN_DELTA_HEADS_CHECK_INSTANCES(extern template, S)
LINATTN_INPUT_TYPES(LINATTN_DECLARE_DELTA_HEADS_CHECKS)
#undef LINATTN_DECLARE_DELTA_HEADS_CHECKS
#endif
