// SPDX-License-Identifier: MIT
// Many heads of many sequences at once, read from and written to caller memory (HeadsView),
// with threads over batch x heads; and packed variable-length batches.
#pragma once

#include <algorithm>
#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/detail/bonus.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/function_ref.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/sequence_rows.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/softmax.hpp>
#include <string>
#include <type_traits>
#include <vector>

namespace linattn {

/// Per-head constant decays for the multi-head entry points, in one call: head h's state is
/// multiplied by values[h] in (0, 1] before each token (RetNet's multi-scale retention,
/// 1 - 2^(-5-h); MiniMax lightning attention's lambda_h). Every head runs the constant-decay
/// kernel, as causal_linear_attention with Options::decay = values[h] would.
struct HeadDecays {
  std::vector<double> values;  ///< H decays, one per head, each in (0, 1]
};

/// Marks a gate view ([B, H, N, 1] or [B, H, N, C], any strides) as log gates g = log a <= 0
/// for the multi-head gated entry points (-infinity resets). Pass it straight to the call.
/// @param g  the log gates, laid out like q, k and v (e.g. HeadsView<const float>::bnhd)
template <class T>
LogGates<HeadsView<T>> log_gates(const HeadsView<T>& g) {
  return LogGates<HeadsView<T>>(g);
}

/// Gate views with RWKV-6's bonus u, one row of C weights per head (FLA's u, [H, K]), for
/// causal_gated_linear_attention_into on views, RecurrentStateBatch::prefill_into and the
/// layer: head h reads out_t = s phi(q_t)^T (S_{t-1} + diag(u.row(h)) phi(k_t) v_t^T).
/// Options::normalize must be false and the map plain, as for one sequence. Pass it straight
/// to the call.
/// @param gates  B x H x N x 1 or B x H x N x C gate view (a_t), or log_gates(view)
/// @param u      H x C bonus weights, of the views' scalar
template <class T, class DU>
BonusGates<HeadsView<T>, DU> with_bonus(const HeadsView<T>& gates, const Eigen::MatrixBase<DU>& u) {
  static_assert(std::is_same_v<typename DU::Scalar, std::remove_const_t<T>>,
                "the bonus u must have the gate view's scalar type");
  return BonusGates<HeadsView<T>, DU>(gates, u.derived());
}

/// Log gate views with RWKV-6's bonus u: with_bonus(log_gates(view), u). See above.
/// @param gates  log_gates(view): B x H x N x 1 or B x H x N x C log gates
/// @param u      H x C bonus weights, of the views' scalar
template <class T, class DU>
BonusGates<LogGates<HeadsView<T>>, DU> with_bonus(const LogGates<HeadsView<T>>& gates,
                                                  const Eigen::MatrixBase<DU>& u) {
  static_assert(std::is_same_v<typename DU::Scalar, std::remove_const_t<T>>,
                "the bonus u must have the gate view's scalar type");
  return BonusGates<LogGates<HeadsView<T>>, DU>(gates, u.derived());
}

namespace detail {

/// Output rows with any strides.
template <class T>
using StridedRef = Eigen::Ref<Matrix<T>, 0, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>>;

template <class Q, class K, class V, class O>
using enable_if_heads_scalars =
    std::enable_if_t<std::is_same_v<std::remove_const_t<Q>, std::remove_const_t<K>> &&
                     std::is_same_v<std::remove_const_t<Q>, std::remove_const_t<V>> &&
                     std::is_same_v<std::remove_const_t<Q>, O>>;

/// "q[b=1, h=3]", for messages about one head (b is the sequence of a packed batch).
inline std::string head_name(const char* name, Eigen::Index b, Eigen::Index h) {
  return std::string(name) + "[b=" + std::to_string(b) + ", h=" + std::to_string(h) + "]";
}

/// Shape checks for q, k (B x H x N x Dq), v (B x H x N x Dv) and out (B x H x N x out_dim).
/// With `cross`, k and v may hold N_k tokens of their own (non-causal cross-attention).
/// `out_name` is how messages name out (the view backward's grad_out plays its part).
template <class Q, class K, class V, class O>
void validate_heads(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const HeadsView<O>& out, Eigen::Index out_dim, const Options& options,
                    const char* where, const char* q_name, const char* k_name, bool cross = false,
                    const char* out_name = "out") {
  validate_options(options, where);
  // Grouped heads: an input may have fewer heads than out, a divisor of its H.
  auto same_bhn = [&](auto& view, const char* name, Eigen::Index tokens) {
    if (view.batch() != out.batch() || view.tokens() != tokens || out.heads() % view.heads() != 0) {
      throw Error(std::string(where) + ": " + name + " is " + view.sizes_string() + " but " +
                  out_name + " is " + out.sizes_string() +
                  (cross ? std::string("; B and H must match (or H divide ") + out_name +
                               "'s), and v's N be " + k_name +
                               "'s (cross-attention: N_k keys and values, N_q queries)"
                         : std::string("; B, H and N must match (or H divide ") + out_name +
                               "'s: " + out_name + " head h reads head " +
                               (options.head_grouping == HeadGrouping::tiled
                                    ? std::string("h % H")
                                    : "h / (" + std::to_string(out.heads()) + " / H)") +
                               " of " + name + ")"));
    }
  };
  same_bhn(q, q_name, out.tokens());
  same_bhn(k, k_name, cross ? k.tokens() : out.tokens());
  same_bhn(v, "v", cross ? k.tokens() : out.tokens());
  if (k.dim() != q.dim()) {
    throw Error(std::string(where) + ": " + k_name + " is " + k.sizes_string() + " but " + q_name +
                " is " + q.sizes_string() + "; D must match");
  }
  if (out.dim() != out_dim) {
    throw Error(std::string(where) + ": " + out_name + " is " + out.sizes_string() +
                " but the result has D = " + std::to_string(out_dim));
  }
}

/// Runs check(head, b, h) over every head of `view` (it throws naming the head), on the
/// threads; head is a map with adjacent features where the view has them. When the heads of a
/// token sit side by side (token-major), ok(rows) first passes over blocks of whole tokens in
/// memory order (one head alone would read one row per H * D elements, each a wait on memory),
/// and the heads are checked one by one only after a block fails.
template <class T, class Ok, class Check>
void scan_view(const HeadsView<T>& view, int threads, const Ok& ok, const Check& check) {
  const HeadStrides& st = view.strides();
  const Eigen::Index heads = view.heads(), tokens = view.tokens(), width = heads * view.dim();
  auto check_heads = [&](Eigen::Index b) {
    for (Eigen::Index h = 0; h < heads; ++h) {
      if (st.dim == 1) {
        check(view.head_rows(b, h), b, h);
      } else {
        check(view.head(b, h), b, h);
      }
    }
  };
  if (st.dim == 1 && st.head == view.dim() && st.token >= width && heads > 1) {
    using Rows =
        Eigen::Map<const Matrix<std::remove_const_t<T>>, Eigen::Unaligned, Eigen::OuterStride<>>;
    // Each sequence in up to `threads` blocks of tokens.
    const Eigen::Index parts = std::max<Eigen::Index>(
        1, std::min<Eigen::Index>(tokens / 256, threads / std::max<Eigen::Index>(view.batch(), 1)));
    parallel_for(view.batch() * parts, threads, [&](Eigen::Index i) {
      const Eigen::Index b = i / parts, p = i % parts;
      const Eigen::Index begin = tokens * p / parts, end = tokens * (p + 1) / parts;
      const Rows rows(view.data() + b * st.batch + begin * st.token, end - begin, width,
                      Eigen::OuterStride<>(st.token));
      if (!ok(rows)) check_heads(b);
    });
    return;
  }
  parallel_for(view.batch() * heads, threads, [&](Eigen::Index i) {
    const Eigen::Index b = i / heads, h = i % heads;
    if (st.dim == 1) {
      check(view.head_rows(b, h), b, h);
    } else {
      check(view.head(b, h), b, h);
    }
  });
}

/// With check_finite, scans every head of q, k and v over the threads (scan_view); called
/// before anything is written, so bad input leaves the output views as they were.
template <class Q, class K, class V>
void scan_heads(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                const Options& options, const char* where, const char* q_name, const char* k_name) {
  if (!options.check_finite) return;
  const int threads = resolve_threads(options);
  auto scan = [&](const auto& view, const char* name) {
    scan_view(
        view, threads, [](const auto& rows) { return all_finite(rows); },
        [&](const auto& head, Eigen::Index b, Eigen::Index h) {
          if (!all_finite(head)) require_finite(head, where, head_name(name, b, h).c_str());
        });
  };
  scan(q, q_name);
  scan(k, k_name);
  scan(v, "v");
}

/// The head of `input` that output head h reads under `grouping`: h / (H_out / H_in)
/// interleaved, FLA's and HF's (with 16 q/k heads and 32 v heads, v head h reads q/k head
/// h / 2), or h % H_in tiled, ggml's.
template <class T>
Eigen::Index input_head(const HeadsView<T>& input, Eigen::Index out_heads, Eigen::Index h,
                        HeadGrouping grouping) {
  return grouped_input_head(grouping, h, out_heads, input.heads());
}

/// Calls body(q_head, k_head, v_head, out_head) with N x D maps of output head h of batch entry
/// b and the input heads it reads; maps with adjacent features when all four views have them,
/// so loads vectorise.
template <class Q, class K, class V, class O, class Body>
void with_heads(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                const HeadsView<O>& out, Eigen::Index b, Eigen::Index h, HeadGrouping grouping,
                const Body& body) {
  const Eigen::Index heads = out.heads();
  const Eigen::Index hq = input_head(q, heads, h, grouping), hk = input_head(k, heads, h, grouping),
                     hv = input_head(v, heads, h, grouping);
  if (q.strides().dim == 1 && k.strides().dim == 1 && v.strides().dim == 1 &&
      out.strides().dim == 1) {
    body(q.head_rows(b, hq), k.head_rows(b, hk), v.head_rows(b, hv),
         Eigen::Ref<Matrix<O>>(out.head_rows(b, h)));
  } else {
    body(q.head(b, hq), k.head(b, hk), v.head(b, hv), StridedRef<O>(out.head(b, h)));
  }
}

/// Rows [begin, begin + rows) of a head, as a map of the head's own type (middleRows would
/// make a Block of it: one more type for every kernel that reads rows).
template <class M>
Eigen::Map<M, Eigen::Unaligned, Eigen::OuterStride<>> middle_rows(
    Eigen::Map<M, Eigen::Unaligned, Eigen::OuterStride<>> head, Eigen::Index begin,
    Eigen::Index rows) {
  return {head.data() + begin * head.outerStride(), rows, head.cols(),
          Eigen::OuterStride<>(head.outerStride())};
}
template <class M>
Eigen::Map<M, Eigen::Unaligned, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>> middle_rows(
    Eigen::Map<M, Eigen::Unaligned, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>> head,
    Eigen::Index begin, Eigen::Index rows) {
  return {head.data() + begin * head.outerStride(), rows, head.cols(),
          Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(head.outerStride(), head.innerStride())};
}

/// Runs every (sequence, head) pair: over pairs on the threads when there are enough of them,
/// else one pair at a time with the threads splitting the sequence.
/// run(s, h, q_rows, k_rows, v_rows, out_rows, threads) attends sequence s of head h; the
/// input rows are maps (HeadsView's RowsMap or HeadMap), the output rows a Ref.
template <class Q, class K, class V, class O, class Run>
void for_each_sequence_head(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                            const HeadsView<O>& out, const SequenceRows& sequences,
                            const Options& options, const Run& run) {
  const Eigen::Index heads = out.heads();
  const Eigen::Index items = sequences.count * heads;
  const int threads = resolve_threads(options);
  const SerialEigenScope serial_eigen;
  const bool over_items = items >= threads;
  auto one = [&](Eigen::Index i, int inner_threads) {
    const Eigen::Index s = i / heads;
    const Eigen::Index h = i % heads;
    const Eigen::Index begin = sequences.begin(s);
    const Eigen::Index rows = sequences.rows(s);
    if (rows == 0) return;
    const Eigen::Index key_rows = sequences.key_rows(s);
    with_heads(q, k, v, out, sequences.batch_of(s), h, options.head_grouping,
               [&](const auto& qh, const auto& kh, const auto& vh, auto oh) {
                 run(s, h, middle_rows(qh, begin, rows), middle_rows(kh, begin, key_rows),
                     middle_rows(vh, begin, key_rows), decltype(oh)(oh.middleRows(begin, rows)),
                     inner_threads);
               });
  };
  if (over_items) {
    parallel_for(items, threads, [&](Eigen::Index i) { one(i, 1); });
  } else {
    for (Eigen::Index i = 0; i < items; ++i) one(i, threads);
  }
}

/// The transition of every head when a call has none: Options::decay.
struct UniformDecay {};

/// A multi-head call's gate views: head (b, h) is moved by gates.head(b, h), a_t or (LogSpace)
/// log a_t, one column (scalar) or C (per feature).
template <class S, bool LogSpace>
struct HeadGates {
  static constexpr bool log_space = LogSpace;
  ConstHeadsView<S> view;
};

template <class Transition>
inline constexpr bool is_head_gates = false;
template <class S, bool LogSpace>
inline constexpr bool is_head_gates<HeadGates<S, LogSpace>> = true;

/// Gate views with RWKV-6's bonus: head h is moved by gates.view.head(b, h) and reads
/// u.row(h) (H x C, copied: a few hundred weights).
template <class S, bool LogSpace>
struct HeadBonus {
  static constexpr bool log_space = LogSpace;
  HeadGates<S, LogSpace> gates;
  Matrix<S> u;
};

template <class Transition>
inline constexpr bool is_head_bonus = false;
template <class S, bool LogSpace>
inline constexpr bool is_head_bonus<HeadBonus<S, LogSpace>> = true;

/// A view call's transition with its type erased, for the drivers compiled once: none
/// (Options::decay for every head), one constant decay per head, or a gate view (a_t, or log
/// gates). At most one of decays() and gates() is set: the constructors are the only way in.
template <class S>
class AnyHeadTransition {
 public:
  /// No transition of its own: every head decays by Options::decay.
  AnyHeadTransition() = default;
  /// One constant decay per head (kept by reference).
  explicit AnyHeadTransition(const HeadDecays& decays) : decays_(&decays) {}
  /// A gate view (kept by reference); `log_space` when it holds g = log a.
  AnyHeadTransition(const ConstHeadsView<S>& gates, bool log_space)
      : gates_(&gates), log_space_(log_space) {}

  /// The per-head decays, or null.
  const HeadDecays* decays() const { return decays_; }
  /// The gate view, or null.
  const ConstHeadsView<S>* gates() const { return gates_; }
  /// True when gates() holds log gates.
  bool log_space() const { return log_space_; }

 private:
  const HeadDecays* decays_ = nullptr;
  const ConstHeadsView<S>* gates_ = nullptr;
  bool log_space_ = false;
};

/// The erased form of each transition a view call takes (kept by reference: the transition
/// must outlive it). RWKV-6's bonus erases to its gates (the bonus path reads u itself).
template <class S>
AnyHeadTransition<S> any_transition(const UniformDecay&) {
  return AnyHeadTransition<S>();
}
template <class S>
AnyHeadTransition<S> any_transition(const HeadDecays& decays) {
  return AnyHeadTransition<S>(decays);
}
template <class S, bool LogSpace>
AnyHeadTransition<S> any_transition(const HeadGates<S, LogSpace>& gates) {
  return AnyHeadTransition<S>(gates.view, LogSpace);
}
template <class S, bool LogSpace>
AnyHeadTransition<S> any_transition(const HeadBonus<S, LogSpace>& bonus) {
  return any_transition<S>(bonus.gates);
}

/// The TransitionKind a multi-head transition gives each head's state.
inline TransitionKind transition_kind(const UniformDecay&) { return TransitionKind::decay; }
inline TransitionKind transition_kind(const HeadDecays&) { return TransitionKind::decay; }
template <class S, bool LogSpace>
TransitionKind transition_kind(const HeadGates<S, LogSpace>& gates) {
  return transition_of_gate_dim(gates.view.dim());
}
template <class S, bool LogSpace>
TransitionKind transition_kind(const HeadBonus<S, LogSpace>& bonus) {
  return transition_kind(bonus.gates);
}

/// How a multi-head transition argument is read: HeadDecays, a gate view, or log_gates(view).
template <class G, class Scalar>
struct head_transition {
  static constexpr bool valid = false;
};
template <class Scalar>
struct head_transition<HeadDecays, Scalar> {
  static constexpr bool valid = true;
  static const HeadDecays& read(const HeadDecays& decays) { return decays; }
};
template <class G, class Scalar>
struct head_transition<HeadsView<G>, Scalar> {
  static constexpr bool valid = std::is_same_v<std::remove_const_t<G>, Scalar>;
  static HeadGates<Scalar, false> read(const HeadsView<G>& gates) { return {gates}; }
};
template <class G, class Scalar>
struct head_transition<LogGates<HeadsView<G>>, Scalar> {
  static constexpr bool valid = std::is_same_v<std::remove_const_t<G>, Scalar>;
  static HeadGates<Scalar, true> read(const LogGates<HeadsView<G>>& gates) {
    return {gates.values()};
  }
};

template <class G, class DU, class Scalar>
struct head_transition<BonusGates<G, DU>, Scalar> {
  using GateTransition = head_transition<G, Scalar>;
  static constexpr bool valid = !std::is_same_v<G, HeadDecays> && GateTransition::valid &&
                                std::is_same_v<typename DU::Scalar, Scalar>;
  static auto read(const BonusGates<G, DU>& bonus) {
    const auto gates = GateTransition::read(bonus.gates());
    return HeadBonus<Scalar, decltype(gates)::log_space>{gates, bonus.bonus()};
  }
};

template <class Gates, class O>
using enable_if_head_transition = std::enable_if_t<head_transition<Gates, O>::valid>;

/// Tokens [begin, begin + rows) of one head's gate view, as the engine reads gates.
template <class S, bool LogSpace>
class HeadGateRows final : public GateRows {
 public:
  HeadGateRows(const typename ConstHeadsView<S>::HeadMap& gates, Eigen::Index begin)
      : GateRows(gates.cols()), gates_(gates), begin_(begin) {}

  void log_rows(Eigen::Index begin, Eigen::Index len, LogRows& dst) const override {
    load_log_rows<LogSpace>(gates_, begin_ + begin, len, dst);
  }

 private:
  typename ConstHeadsView<S>::HeadMap gates_;
  Eigen::Index begin_;
};

inline void validate_transition(const UniformDecay&, const HeadShape&, const Options&,
                                const char*) {}

/// Throws unless there is one decay in (0, 1] per head and Options::decay is 1.
inline void validate_transition(const HeadDecays& decays, const HeadShape& shape,
                                const Options& options, const char* where) {
  if (options.decay != 1.0) {
    throw Error(std::string(where) + ": Options::decay must be 1 with HeadDecays (they replace " +
                "it), got " + std::to_string(options.decay));
  }
  if (static_cast<Eigen::Index>(decays.values.size()) != shape.heads) {
    throw Error(std::string(where) + ": HeadDecays holds " + std::to_string(decays.values.size()) +
                " decays but the views have H = " + std::to_string(shape.heads) + " heads");
  }
  for (std::size_t h = 0; h < decays.values.size(); ++h) {
    const double g = decays.values[h];
    if (!(g > 0.0 && g <= 1.0)) {
      throw Error(std::string(where) + ": HeadDecays values[" + std::to_string(h) +
                  "] must lie in (0, 1], got " + std::to_string(g));
    }
  }
}

/// Throws unless the gate view is [B, H, N, 1] or [B, H, N, C] for the call's shape, with C
/// the feature width, and Options::decay is 1.
template <class S, bool LogSpace>
void validate_transition(const HeadGates<S, LogSpace>& gates, const HeadShape& shape,
                         const Options& options, const char* where) {
  require_unit_decay(options, where);
  const ConstHeadsView<S>& g = gates.view;
  if (g.batch() != shape.batch || g.heads() != shape.heads || g.tokens() != shape.tokens ||
      (g.dim() != 1 && g.dim() != shape.dim)) {
    const auto sizes = [](Eigen::Index d, const HeadShape& s) {
      return "[" + std::to_string(s.batch) + ", " + std::to_string(s.heads) + ", " +
             std::to_string(s.tokens) + ", " + std::to_string(d) + "]";
    };
    throw Error(std::string(where) + ": gates is " + g.sizes_string() + " but must be " +
                sizes(1, shape) + " (one gate per token) or " + sizes(shape.dim, shape) +
                " (one per feature)");
  }
}

/// Throws unless the bonus u is H x C and finite and normalize is off.
template <class S>
void validate_head_bonus(const Matrix<S>& u, const HeadShape& shape, const Options& options,
                         const char* where) {
  if (u.rows() != shape.heads || u.cols() != shape.dim) {
    throw Error(std::string(where) + ": the bonus u is " + shape_string(u) + " but must be " +
                shape_string(shape.heads, shape.dim) + " (H x C, one row per head)");
  }
  validate_bonus(u.reshaped(), shape.heads * shape.dim, options, where);
}

/// Throws unless the gate view fits (as above), u is H x C and finite, and normalize is off.
template <class S, bool LogSpace>
void validate_transition(const HeadBonus<S, LogSpace>& bonus, const HeadShape& shape,
                         const Options& options, const char* where) {
  validate_transition(bonus.gates, shape, options, where);
  validate_head_bonus(bonus.u, shape, options, where);
}

/// The checks above, for an erased transition.
template <class S>
void validate_transition(const AnyHeadTransition<S>& transition, const HeadShape& shape,
                         const Options& options, const char* where) {
  if (transition.decays() != nullptr)
    validate_transition(*transition.decays(), shape, options, where);
  // The shape checks do not depend on how the gates are given.
  if (transition.gates() != nullptr) {
    validate_transition(HeadGates<S, false>{*transition.gates()}, shape, options, where);
  }
}

/// The range check of every head's gates (always, like the matrix form's), over the threads.
inline void scan_transition(const UniformDecay&, int, const char*) {}
inline void scan_transition(const HeadDecays&, int, const char*) {}
template <class S, bool LogSpace>
void scan_transition(const HeadBonus<S, LogSpace>& bonus, int threads, const char* where) {
  scan_transition(bonus.gates, threads, where);
}
template <class S, bool LogSpace>
void scan_transition(const HeadGates<S, LogSpace>& gates, int threads, const char* where) {
  scan_view(
      gates.view, threads, [](const auto& rows) { return gates_in_range<LogSpace>(rows); },
      [&](const auto& head, Eigen::Index b, Eigen::Index h) {
        if (!gates_in_range<LogSpace>(head)) {
          require_gates_in_range<LogSpace>(head, where, head_name("gates", b, h).c_str());
        }
      });
}
template <class S>
void scan_transition(const AnyHeadTransition<S>& transition, int threads, const char* where) {
  if (transition.gates() == nullptr) return;
  if (transition.log_space()) {
    scan_transition(HeadGates<S, true>{*transition.gates()}, threads, where);
  } else {
    scan_transition(HeadGates<S, false>{*transition.gates()}, threads, where);
  }
}

/// body(gates) with tokens [begin, ...) of a head's gates of an erased transition.
template <class S, class Body>
void with_gate_rows(const AnyHeadTransition<S>& transition,
                    const typename ConstHeadsView<S>::HeadMap& head, Eigen::Index begin,
                    const Body& body) {
  if (transition.log_space()) {
    const HeadGateRows<S, true> rows(head, begin);
    body(static_cast<const GateRows*>(&rows));
  } else {
    const HeadGateRows<S, false> rows(head, begin);
    body(static_cast<const GateRows*>(&rows));
  }
}

/// body(gates, options) for tokens [begin, begin + rows) of head h of batch entry b: the
/// gates to attach (null for a constant decay) and the options with head h's decay.
template <class S, class Body>
void with_transition(const AnyHeadTransition<S>& transition, Eigen::Index b, Eigen::Index h,
                     Eigen::Index begin, Options& options, const Body& body) {
  if (transition.decays() != nullptr) {
    options.decay = transition.decays()->values[static_cast<std::size_t>(h)];
    body(static_cast<const GateRows*>(nullptr), options);
  } else if (transition.gates() != nullptr) {
    with_gate_rows(transition, transition.gates()->head(b, h), begin,
                   [&](const GateRows* gates) { body(gates, options); });
  } else {
    body(static_cast<const GateRows*>(nullptr), options);
  }
}

/// One head's rows in a view call: adjacent features, or any strides.
template <class S>
using HeadRows = typename ConstHeadsView<S>::RowsMap;
template <class S>
using StridedHeadRows = typename ConstHeadsView<S>::HeadMap;

/// What a driver does with the token source it was given.
template <class T>
using SourceBody = FunctionRef<void(ChunkSource<T>&)>;

/// A view call's feature map with its type erased: builds the token source (ChunkSource) of
/// one head's rows, in accumulation type T from input scalar S. The one piece of a view call
/// compiled for the caller's map; the drivers that run the heads are compiled once.
template <class T, class S>
class HeadSources {
 public:
  HeadSources(const HeadSources&) = delete;
  HeadSources& operator=(const HeadSources&) = delete;

  /// body(source) with the source over (q, k, v), `gates` attached when not null.
  virtual void with_source(const HeadRows<S>& q, const HeadRows<S>& k, const HeadRows<S>& v,
                           const GateRows* gates, bool check_finite, const char* where,
                           SourceBody<T> body) const = 0;
  virtual void with_source(const StridedHeadRows<S>& q, const StridedHeadRows<S>& k,
                           const StridedHeadRows<S>& v, const GateRows* gates, bool check_finite,
                           const char* where, SourceBody<T> body) const = 0;

 protected:
  HeadSources() = default;
  ~HeadSources() = default;
};

/// HeadSources of one feature map (Identity: the rows are the features), which it keeps by
/// reference. Its members are defined outside the class, so that the compiled mode's instance
/// for Identity keeps them out of other translation units.
template <class T, class S, class Map>
class HeadSourcesOf final : public HeadSources<T, S> {
 public:
  explicit HeadSourcesOf(const Map& map) : map_(map) {}
  explicit HeadSourcesOf(const Map&& map) = delete;  // would keep a temporary

  void with_source(const HeadRows<S>& q, const HeadRows<S>& k, const HeadRows<S>& v,
                   const GateRows* gates, bool check_finite, const char* where,
                   SourceBody<T> body) const override;
  void with_source(const StridedHeadRows<S>& q, const StridedHeadRows<S>& k,
                   const StridedHeadRows<S>& v, const GateRows* gates, bool check_finite,
                   const char* where, SourceBody<T> body) const override;

 private:
  const Map& map_;
};

template <class T, class S, class Map>
void HeadSourcesOf<T, S, Map>::with_source(const HeadRows<S>& q, const HeadRows<S>& k,
                                           const HeadRows<S>& v, const GateRows* gates,
                                           bool check_finite, const char* where,
                                           SourceBody<T> body) const {
  detail::with_source<T>(q, k, v, map_, gates, check_finite, where, body);
}

template <class T, class S, class Map>
void HeadSourcesOf<T, S, Map>::with_source(const StridedHeadRows<S>& q, const StridedHeadRows<S>& k,
                                           const StridedHeadRows<S>& v, const GateRows* gates,
                                           bool check_finite, const char* where,
                                           SourceBody<T> body) const {
  detail::with_source<T>(q, k, v, map_, gates, check_finite, where, body);
}

/// What a driver does with one (sequence, head): run(s, h, source, queries, out, threads,
/// options) attends `source` (cross-attention: keys and values only, the queries from
/// `queries`; else null) into `out` with `threads` and head h's options.
template <class T, class S>
using HeadRun = FunctionRef<void(Eigen::Index, Eigen::Index, ChunkSource<T>&, const ChunkSource<T>*,
                                 OutRows<S>, int, const Options&)>;

/// Runs every (sequence, head) of a view call (for_each_sequence_head) through `sources` and
/// the transition: the one loop of the view forward and the batch prefill.
template <class T, class S>
void for_each_head_source(const ConstHeadsView<S>& q, const ConstHeadsView<S>& k,
                          const ConstHeadsView<S>& v, const HeadsView<S>& out,
                          const SequenceRows& sequences, const HeadSources<T, S>& sources,
                          const AnyHeadTransition<S>& transition, const Options& options,
                          const char* where, HeadRun<T, S> run) {
  for_each_sequence_head(
      q, k, v, out, sequences, options,
      [&](Eigen::Index s, Eigen::Index h, const auto& qs, const auto& ks, const auto& vs, auto os,
          int threads) {
        Options head_options = options;
        head_options.threads = threads;
        const OutRows<S> out_rows(os);
        with_transition(
            transition, sequences.batch_of(s), h, sequences.begin(s), head_options,
            [&](const GateRows* gates, const Options& run_options) {
              if (qs.rows() != ks.rows()) {
                // Cross-attention: the sums over N_k keys, read by N_q queries.
                sources.with_source(ks, ks, vs, nullptr, options.check_finite, where,
                                    [&](ChunkSource<T>& keys) {
                                      sources.with_source(qs, qs, vs, nullptr, options.check_finite,
                                                          where, [&](ChunkSource<T>& queries) {
                                                            run(s, h, keys, &queries, out_rows,
                                                                threads, run_options);
                                                          });
                                    });
                return;
              }
              sources.with_source(qs, ks, vs, gates, options.check_finite, where,
                                  [&](ChunkSource<T>& source) {
                                    run(s, h, source, nullptr, out_rows, threads, run_options);
                                  });
            });
      });
}

/// True when heads of one token lie side by side and a head's rows far apart (a token-major
/// [B, N, H, D] view): such heads run best chunk by chunk across heads (causal_head_group).
template <class T>
bool token_major(const HeadsView<T>& view) {
  return view.strides().dim == 1 && view.strides().token > view.dim() && view.heads() > 1;
}

/// Causal attention of heads [h0, h1) of sequence s, block by block of tokens across the heads,
/// each head with a state of its own, reading and writing the caller's rows in place. One head
/// alone reads one row per H * D elements, each a wait on memory; the heads of one block read
/// the lines the hardware fetched for the head before (8 heads of 64, N = 4,096 to 16,384:
/// 8-15% faster than packing each block's rows for all heads first, which it did before). Gates
/// are packed with the tokens.
template <class T, class S>
void causal_head_group(const ConstHeadsView<S>& q, const ConstHeadsView<S>& k,
                       const ConstHeadsView<S>& v, const HeadsView<S>& out,
                       const HeadSources<T, S>& sources, const AnyHeadTransition<S>& transition,
                       const SequenceRows& sequences, Eigen::Index s, Eigen::Index h0,
                       Eigen::Index h1, Eigen::Index feature_dim, const Options& options,
                       const char* where) {
  const Eigen::Index b = sequences.batch_of(s);
  const Eigen::Index first = sequences.begin(s);
  const Eigen::Index rows = sequences.rows(s);
  if (rows == 0) return;
  // Whole chunks, at least 64 tokens: a kernel call per head and block.
  const Eigen::Index block = options.chunk * ((64 + options.chunk - 1) / options.chunk);
  const Eigen::Index dv = v.dim();
  const ConstHeadsView<S>* gate_view = transition.gates();
  const Eigen::Index gate_cols = gate_view != nullptr ? gate_view->dim() : 0;
  struct Head {
    CarriedState<T> state;
    Matrix<S> g;
  };
  std::vector<Head> heads;
  heads.reserve(static_cast<std::size_t>(h1 - h0));
  for (Eigen::Index h = h0; h < h1; ++h) {
    heads.push_back(Head{CarriedState<T>(feature_dim, dv), Matrix<S>(block, gate_cols)});
  }
  const HeadGrouping grouping = options.head_grouping;
  for (Eigen::Index begin = 0; begin < rows; begin += block) {
    const Eigen::Index len = std::min(block, rows - begin);
    const Eigen::Index at = first + begin;
    if (gate_view != nullptr) {
      for (Eigen::Index t = at; t < at + len; ++t) {
        for (Eigen::Index h = h0; h < h1; ++h) {
          Head& head = heads[static_cast<std::size_t>(h - h0)];
          if (gate_view->strides().dim == 1) {
            head.g.row(t - at) = gate_view->head_rows(b, h).row(t);
          } else {
            head.g.row(t - at) = gate_view->head(b, h).row(t);
          }
        }
      }
    }
    // The block's rows of one head of a view, in the caller's memory.
    const auto rows_of = [&](const ConstHeadsView<S>& view, Eigen::Index input) {
      return HeadRows<S>(view.head_rows(b, input).row(at).data(), len, view.dim(),
                         Eigen::OuterStride<>(view.strides().token));
    };
    for (Eigen::Index h = h0; h < h1; ++h) {
      Head& head = heads[static_cast<std::size_t>(h - h0)];
      const HeadRows<S> qs = rows_of(q, input_head(q, out.heads(), h, grouping));
      const HeadRows<S> ks = rows_of(k, input_head(k, out.heads(), h, grouping));
      const HeadRows<S> vs = rows_of(v, input_head(v, out.heads(), h, grouping));
      const OutRows<S> out_rows(out.head_rows(b, h).middleRows(at, len));
      auto run = [&](const GateRows* gates, const Options& run_options) {
        sources.with_source(qs, ks, vs, gates, options.check_finite, where,
                            [&](ChunkSource<T>& source) {
                              causal_rows<T, S>(source, head.state, out_rows, run_options, 1);
                            });
      };
      Options head_options = options;
      head_options.threads = 1;
      if (gate_view != nullptr) {
        const typename ConstHeadsView<S>::HeadMap packed(
            head.g.data(), len, gate_cols,
            Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(gate_cols, 1));
        with_gate_rows(transition, packed, 0,
                       [&](const GateRows* gates) { run(gates, head_options); });
      } else {
        with_transition(transition, b, h, 0, head_options, run);
      }
    }
  }
}

/// Runs causal_head_group over every sequence, the heads of each split into as many groups as
/// the threads need; false (nothing done) when the views are not token-major or there are
/// fewer heads than threads (the per-head path splits each sequence across them instead).
template <class T, class S>
bool causal_token_major(const ConstHeadsView<S>& q, const ConstHeadsView<S>& k,
                        const ConstHeadsView<S>& v, const HeadsView<S>& out,
                        const HeadSources<T, S>& sources, const AnyHeadTransition<S>& transition,
                        const SequenceRows& sequences, Eigen::Index feature_dim,
                        const Options& options, const char* where) {
  const Eigen::Index heads = out.heads();
  const int threads = resolve_threads(options);
  if (!(token_major(q) || token_major(k) || token_major(v) || token_major(out)) ||
      q.strides().dim != 1 || k.strides().dim != 1 || v.strides().dim != 1 ||
      out.strides().dim != 1 || heads < 2 || sequences.count * heads < threads) {
    return false;
  }
  if (transition.gates() != nullptr && transition.gates()->strides().dim != 1 &&
      transition.gates()->dim() > 1) {
    return false;
  }
  const Eigen::Index groups =
      std::min<Eigen::Index>(heads, (threads + sequences.count - 1) / sequences.count);
  const SerialEigenScope serial_eigen;
  parallel_for(sequences.count * groups, threads, [&](Eigen::Index i) {
    const Eigen::Index s = i / groups, g = i % groups;
    causal_head_group<T>(q, k, v, out, sources, transition, sequences, s, heads * g / groups,
                         heads * (g + 1) / groups, feature_dim, options, where);
  });
  return true;
}

/// body(map) with the map of a view call: Identity for featurized inputs (map null).
template <class Map, class Body>
void with_map(const Map* map, const Body& body) {
  if constexpr (std::is_same_v<Map, void>) {
    body(Identity{});
  } else {
    body(*map);
  }
}

/// The shape checks of a view forward (validate_heads, then the offsets): its sequences.
template <class S>
SequenceRows check_view_call(const ConstHeadsView<S>& q, const ConstHeadsView<S>& k,
                             const ConstHeadsView<S>& v, const HeadsView<S>& out,
                             const std::vector<std::int64_t>* offsets, const Options& options,
                             bool causal, const char* where, const char* q_name,
                             const char* k_name) {
  const bool cross_ok = !causal && offsets == nullptr;
  validate_heads(q, k, v, out, v.dim(), options, where, q_name, k_name, cross_ok);
  SequenceRows sequences = sequence_rows(q, offsets, where, q_name);
  if (cross_ok && k.tokens() != q.tokens()) sequences.key_tokens = k.tokens();
  return sequences;
}

/// The transition's checks (and the bonus u's, when not null), then the scans for gates out
/// of range and (check_finite) non-finite inputs: the last checks before a view call writes.
template <class S>
void check_view_inputs(const ConstHeadsView<S>& q, const ConstHeadsView<S>& k,
                       const ConstHeadsView<S>& v, const AnyHeadTransition<S>& transition,
                       const Matrix<S>* bonus_u, const HeadShape& shape, const Options& options,
                       const char* where, const char* q_name, const char* k_name) {
  validate_transition(transition, shape, options, where);
  if (bonus_u != nullptr) validate_head_bonus(*bonus_u, shape, options, where);
  scan_transition(transition, resolve_threads(options), where);
  scan_heads(q, k, v, options, where, q_name, k_name);
}

/// Linear attention (causal or not) over every sequence and head of views already checked
/// (check_view_call, check_view_inputs): the driver of the view forward, compiled once per
/// (T, S) in the compiled mode. Cross-attention (sequences.key_tokens set) is non-causal only.
template <class T, class S>
void heads_attention_rows(const ConstHeadsView<S>& q, const ConstHeadsView<S>& k,
                          const ConstHeadsView<S>& v, const HeadSources<T, S>& sources,
                          const HeadsView<S>& out, const SequenceRows& sequences,
                          Eigen::Index feature_dim, const Options& options, bool causal,
                          const AnyHeadTransition<S>& transition, const char* where) {
  LINATTN_ASSERT(!causal || sequences.key_tokens < 0);
  if (causal && causal_token_major<T>(q, k, v, out, sources, transition, sequences, feature_dim,
                                      options, where)) {
    return;
  }
  for_each_head_source<T, S>(
      q, k, v, out, sequences, sources, transition, options, where,
      [&](Eigen::Index, Eigen::Index, ChunkSource<T>& source, const ChunkSource<T>* queries,
          OutRows<S> os, int threads, const Options& run_options) {
        CarriedState<T> state(feature_dim, v.dim());
        if (queries != nullptr) {
          run_cross(source, *queries, state, os, run_options, threads);
        } else if (causal) {
          run_causal(source, state, os, run_options, threads);
        } else {
          run_non_causal(source, state, os, run_options, threads);
        }
      });
}

/// Linear attention (causal or not) over every sequence and head: the checks, then the
/// bonus form here (per map and gate type) or every other transition in heads_attention_rows.
template <class Acc, class Q, class K, class V, class O, class Map, class Transition>
void heads_linear_attention(const HeadsView<Q>& q_view, const HeadsView<K>& k_view,
                            const HeadsView<V>& v_view, const Map& map, const HeadsView<O>& out,
                            const std::vector<std::int64_t>* offsets, const Options& options,
                            bool causal, const Transition& transition, const char* where) {
  using Scalar = accumulator_t<Acc, O>;
  static_assert(is_input_scalar<O>,
                "linattn kernels take float, double, Eigen::half or Eigen::bfloat16 inputs");
  static_assert(is_supported_scalar<Scalar>,
                "linattn kernels accumulate in float or double (Acc = float or double)");
  const ConstHeadsView<O> q = q_view, k = k_view, v = v_view;
  constexpr bool featurized = is_identity_map<Map>;
  const char* q_name = featurized ? "phi_q" : "q";
  const char* k_name = featurized ? "phi_k" : "k";
  const SequenceRows sequences =
      check_view_call(q, k, v, out, offsets, options, causal, where, q_name, k_name);
  Eigen::Index feature_dim = q.dim();
  if constexpr (!featurized) {
    feature_dim = map.feature_dim(q.dim());
    if (feature_dim < 1) {
      throw Error(std::string(where) + ": the feature map gives feature_dim " +
                  std::to_string(feature_dim) + " for input_dim " + std::to_string(q.dim()));
    }
  }
  const HeadShape shape{out.batch(), out.heads(), out.tokens(), feature_dim};
  if constexpr (is_head_bonus<Transition>) {
    if constexpr (!featurized) require_plain_features<Map>();
    check_view_inputs(q, k, v, any_transition<O>(transition), &transition.u, shape, options, where,
                      q_name, k_name);
    // The bonus form reads each head one row ahead: it runs head by head.
    for_each_sequence_head(q, k, v, out, sequences, options,
                           [&](Eigen::Index s, Eigen::Index h, const auto& qs, const auto& ks,
                               const auto& vs, auto os, int threads) {
                             const auto gates = transition.gates.view.head(sequences.batch_of(s), h)
                                                    .middleRows(sequences.begin(s), qs.rows());
                             auto attend = [&](const auto& gate_rows) {
                               bonus_rows<Scalar>(qs, ks, vs, gate_rows, transition.u.row(h), map,
                                                  os, options, threads, where);
                             };
                             if constexpr (Transition::log_space) {
                               attend(LogGates<std::decay_t<decltype(gates)>>(gates));
                             } else {
                               attend(gates);
                             }
                           });
  } else {
    const AnyHeadTransition<O> erased = any_transition<O>(transition);
    check_view_inputs(q, k, v, erased, static_cast<const Matrix<O>*>(nullptr), shape, options,
                      where, q_name, k_name);
    const HeadSourcesOf<Scalar, O, Map> sources(map);
    heads_attention_rows<Scalar, O>(q, k, v, sources, out, sequences, feature_dim, options, causal,
                                    erased, where);
  }
}

/// The one dispatch of the view entry points: checks the map concept, then runs the views
/// with it (Identity reads the inputs in place as features; any other map featurizes chunk by
/// chunk).
template <class Acc, class Q, class K, class V, class O, class Map, class Transition = UniformDecay>
void heads_attention(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                     const Map& map, const HeadsView<O>& out,
                     const std::vector<std::int64_t>* offsets, const Options& options, bool causal,
                     const char* where, const Transition& transition = {}) {
  if constexpr (check_feature_map<Map, accumulator_t<Acc, std::remove_const_t<O>>>()) {
    heads_linear_attention<Acc>(q, k, v, map, out, offsets, options, causal, transition, where);
  }
}

}  // namespace detail

/// Causal linear attention for every head of every sequence, on caller memory ([B, H, N, D]
/// or [B, N, H, D], any strides), written into `out`, with one feature map shared by all
/// heads (Identity{} for precomputed features). Threads go over B x H (Options::threads, with
/// OpenMP); with fewer heads than threads each sequence is split across them instead. Head
/// (b, h) gives exactly causal_linear_attention on q.head(b, h), ... up to rounding.
/// Grouped heads (Qwen3-Next's 16 q/k heads over 32 v heads; multi-query and grouped-query
/// attention's fewer k/v heads): an input may have fewer heads than out, a divisor of out's H,
/// and output head h reads head h / (H / H_in) of it (FLA's grouping; h % H_in with
/// Options::head_grouping tiled), in every view call.
/// @param q    B x Hq x N x Dk queries (Hq divides H)
/// @param k    B x Hk x N x Dk keys (Hk divides H)
/// @param v    B x Hv x N x Dv values (Hv divides H)
/// @param map  feature map
/// @param out  B x H x N x Dv result; its heads may not overlap each other or the inputs
template <class Acc = void, class Q, class K, class V, class Map, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>>
void causal_linear_attention_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                  const HeadsView<V>& v, const Map& map, const HeadsView<O>& out,
                                  const Options& options = {}) {
  detail::heads_attention<Acc>(q, k, v, map, out, nullptr, options, true,
                               "causal_linear_attention");
}

/// Non-causal linear attention for every head of every sequence, with a feature map. The keys
/// and values may hold N_k tokens and the queries N_q (cross-attention: a Perceiver's latents
/// over its inputs, a decoder over an encoder), as linear_attention on matrices.
/// @param q    B x Hq x N_q x Dk queries (Hq divides H)
/// @param k    B x Hk x N_k x Dk keys (Hk divides H)
/// @param v    B x Hv x N_k x Dv values (Hv divides H)
/// @param map  feature map (Identity{} for precomputed features)
/// @param out  B x H x N_q x Dv result
template <class Acc = void, class Q, class K, class V, class Map, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>>
void linear_attention_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                           const Map& map, const HeadsView<O>& out, const Options& options = {}) {
  detail::heads_attention<Acc>(q, k, v, map, out, nullptr, options, false, "linear_attention");
}

/// Causal linear attention over a packed batch of sequences of different lengths: sequence s
/// is tokens [offsets[s], offsets[s+1]) of the views (like cu_seqlens), and attends only to
/// itself. Threads go over sequences x heads.
/// @param q        1 x Hq x total x Dk queries (Hq divides H; B = 1: the sequences are packed along
/// N)
/// @param k        1 x Hk x total x Dk keys (Hk divides H)
/// @param v        1 x Hv x total x Dv values (Hv divides H)
/// @param map      feature map (Identity{} for precomputed features)
/// @param offsets  S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
/// @param out      1 x H x total x Dv result
template <class Acc = void, class Q, class K, class V, class Map, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>>
void causal_linear_attention_varlen_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                         const HeadsView<V>& v, const Map& map,
                                         const std::vector<std::int64_t>& offsets,
                                         const HeadsView<O>& out, const Options& options = {}) {
  detail::heads_attention<Acc>(q, k, v, map, out, &offsets, options, true,
                               "causal_linear_attention_varlen");
}

/// Non-causal linear attention over a packed batch: each sequence attends to all of itself.
/// @param q        1 x Hq x total x Dk queries (Hq divides H)
/// @param k        1 x Hk x total x Dk keys (Hk divides H)
/// @param v        1 x Hv x total x Dv values (Hv divides H)
/// @param map      feature map (Identity{} for precomputed features)
/// @param offsets  S + 1 token offsets
/// @param out      1 x H x total x Dv result
template <class Acc = void, class Q, class K, class V, class Map, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>>
void linear_attention_varlen_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                  const HeadsView<V>& v, const Map& map,
                                  const std::vector<std::int64_t>& offsets, const HeadsView<O>& out,
                                  const Options& options = {}) {
  detail::heads_attention<Acc>(q, k, v, map, out, &offsets, options, false,
                               "linear_attention_varlen");
}

/// Causal linear attention with a transition per head, for every head of every sequence on
/// caller memory: per-token gates as views laid out like q, k and v ([B, H, N, 1] scalar or
/// [B, H, N, C] per feature, any strides; a_t, or log_gates(view) for g_t = log a_t), or one
/// constant decay per head (HeadDecays). Head (b, h) gives exactly
/// causal_gated_linear_attention on q.head(b, h), ..., gates.head(b, h) (with HeadDecays:
/// causal_linear_attention with Options::decay = values[h]) up to rounding; threads as
/// causal_linear_attention_into. Every gate is range-checked before anything is written.
/// @param q        B x Hq x N x Dk queries (Hq divides H; features, with Identity)
/// @param k        B x Hk x N x Dk keys (Hk divides H)
/// @param v        B x Hv x N x Dv values (Hv divides H)
/// @param gates    B x H x N x 1 or B x H x N x C gates a_t in (0, 1], log_gates(view) with
///                 g <= 0, or HeadDecays with H decays in (0, 1]
/// @param map      feature map (Identity{} for precomputed features)
/// @param out      B x H x N x Dv result
/// @param options  eps, normalize, chunk, check_finite, threads, scale; decay must be 1
template <class Acc = void, class Q, class K, class V, class Gates, class Map, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>,
          class = detail::enable_if_head_transition<Gates, O>>
void causal_gated_linear_attention_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                        const HeadsView<V>& v, const Gates& gates, const Map& map,
                                        const HeadsView<O>& out, const Options& options = {}) {
  detail::heads_attention<Acc>(q, k, v, map, out, nullptr, options, true,
                               "causal_gated_linear_attention",
                               detail::head_transition<Gates, O>::read(gates));
}

/// Gated causal linear attention over a packed batch of sequences of different lengths:
/// sequence s is tokens [offsets[s], offsets[s+1]) of every view, gates included, and starts
/// from an empty state. See causal_gated_linear_attention_into and
/// causal_linear_attention_varlen_into.
/// @param q        1 x Hq x total x Dk queries (Hq divides H)
/// @param k        1 x Hk x total x Dk keys (Hk divides H)
/// @param v        1 x Hv x total x Dv values (Hv divides H)
/// @param gates    1 x H x total x 1 or 1 x H x total x C gates (a_t or log_gates(view)), or
///                 HeadDecays
/// @param map      feature map (Identity{} for precomputed features)
/// @param offsets  S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
/// @param out      1 x H x total x Dv result
/// @param options  as causal_gated_linear_attention_into
template <class Acc = void, class Q, class K, class V, class Gates, class Map, class O,
          class = detail::enable_if_heads_scalars<Q, K, V, O>,
          class = detail::enable_if_head_transition<Gates, O>>
void causal_gated_linear_attention_varlen_into(const HeadsView<Q>& q, const HeadsView<K>& k,
                                               const HeadsView<V>& v, const Gates& gates,
                                               const Map& map,
                                               const std::vector<std::int64_t>& offsets,
                                               const HeadsView<O>& out,
                                               const Options& options = {}) {
  detail::heads_attention<Acc>(q, k, v, map, out, &offsets, options, true,
                               "causal_gated_linear_attention_varlen",
                               detail::head_transition<Gates, O>::read(gates));
}

/// Softmax attention (the tiled baseline) for every head of every sequence, threads over
/// B x H. A head whose features are not adjacent (dim stride other than 1) or whose tokens
/// share a row (token stride 0) is copied once into rows first, by the thread that attends it.
/// @param q        B x Hq x N x Dk queries (Hq divides H)
/// @param k        B x Hk x N x Dk keys (Hk divides H)
/// @param v        B x Hv x N x Dv values (Hv divides H)
/// @param mask     Mask::causal (query i sees keys j <= i) or Mask::none
/// @param out      B x H x N x Dv result
/// @param scale    multiplies q . k; negative means 1/sqrt(Dk)
/// @param threads  as Options::threads (0: OpenMP's default)
template <class Q, class K, class V, class O, class = detail::enable_if_heads_scalars<Q, K, V, O>>
void softmax_attention_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                            Mask mask, const HeadsView<O>& out, double scale = -1,
                            int threads = 0) {
  static_assert(detail::is_supported_scalar<O>, "linattn kernels take float or double inputs");
  constexpr const char* where = "softmax_attention";
  Options options;
  options.threads = threads;
  detail::validate_heads(q, k, v, out, v.dim(), options, where, "q", "k");
  detail::scan_heads(q, k, v, options, where, "q", "k");
  const O s = static_cast<O>(detail::resolve_scale(scale, q.dim(), where));
  const detail::SequenceRows sequences{q.batch(), q.tokens(), nullptr};
  // Softmax has no sequence split: one head per thread.
  detail::for_each_sequence_head(
      q, k, v, out, sequences, options,
      [&](Eigen::Index, Eigen::Index, const auto& qs, const auto& ks, const auto& vs, auto os,
          int) { detail::tiled_softmax(qs, ks, vs, s, mask == Mask::causal, 0, os); });
}

}  // namespace linattn

/// The compiled mode's instances of the view forward's drivers: LINATTN_HEADS_INSTANCES for
/// each (accumulation T, input S) pair of LINATTN_KERNEL_TYPES, LINATTN_HEADS_CHECK_INSTANCES
/// for each input type S; `prefix` is `extern template` (every TU that defines
/// LINATTN_COMPILED) or `template` (the library).
#define LINATTN_HEADS_INSTANCES(prefix, T, S)                                                    \
  prefix void linattn::detail::heads_attention_rows<T, S>(                                       \
      const linattn::ConstHeadsView<S>&, const linattn::ConstHeadsView<S>&,                      \
      const linattn::ConstHeadsView<S>&, const linattn::detail::HeadSources<T, S>&,              \
      const linattn::HeadsView<S>&, const linattn::detail::SequenceRows&, Eigen::Index,          \
      const linattn::Options&, bool, const linattn::detail::AnyHeadTransition<S>&, const char*); \
  prefix void linattn::detail::for_each_head_source<T, S>(                                       \
      const linattn::ConstHeadsView<S>&, const linattn::ConstHeadsView<S>&,                      \
      const linattn::ConstHeadsView<S>&, const linattn::HeadsView<S>&,                           \
      const linattn::detail::SequenceRows&, const linattn::detail::HeadSources<T, S>&,           \
      const linattn::detail::AnyHeadTransition<S>&, const linattn::Options&, const char*,        \
      linattn::detail::HeadRun<T, S>);                                                           \
  prefix class linattn::detail::HeadSourcesOf<T, S, linattn::Identity>;
#define LINATTN_HEADS_CHECK_INSTANCES(prefix, S)                                                  \
  prefix linattn::detail::SequenceRows linattn::detail::check_view_call<S>(                       \
      const linattn::ConstHeadsView<S>&, const linattn::ConstHeadsView<S>&,                       \
      const linattn::ConstHeadsView<S>&, const linattn::HeadsView<S>&,                            \
      const std::vector<std::int64_t>*, const linattn::Options&, bool, const char*, const char*,  \
      const char*);                                                                               \
  prefix void linattn::detail::check_view_inputs<S>(                                              \
      const linattn::ConstHeadsView<S>&, const linattn::ConstHeadsView<S>&,                       \
      const linattn::ConstHeadsView<S>&, const linattn::detail::AnyHeadTransition<S>&,            \
      const linattn::Matrix<S>*, const linattn::HeadShape&, const linattn::Options&, const char*, \
      const char*, const char*);

#ifdef LINATTN_COMPILED
#define LINATTN_DECLARE_HEADS_KERNELS(T, S) LINATTN_HEADS_INSTANCES(extern template, T, S)
LINATTN_KERNEL_TYPES(LINATTN_DECLARE_HEADS_KERNELS)
#undef LINATTN_DECLARE_HEADS_KERNELS
#define LINATTN_DECLARE_HEADS_CHECKS(S) LINATTN_HEADS_CHECK_INSTANCES(extern template, S)
LINATTN_INPUT_TYPES(LINATTN_DECLARE_HEADS_CHECKS)
#undef LINATTN_DECLARE_HEADS_CHECKS
#endif
