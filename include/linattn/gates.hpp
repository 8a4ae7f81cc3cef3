// SPDX-License-Identifier: MIT
// Data-dependent gates: a_t in (0, 1] per token, scalar or per feature, given as a_t or in log
// space (g_t = log a_t, FLA's and ggml's convention), and how the engine reads them.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/validate.hpp>
#include <string>
#include <type_traits>

namespace linattn {

/// Gates in log space, g_t = log a_t <= 0, as FLA (`g`, `gk`) and ggml pass them; made by
/// log_gates(g). A gate of 1 - 1e-8 survives float this way (g = -1e-8 is a float, a = 1 - 1e-8
/// is not), and g = -infinity is a hard reset: the state before that token is forgotten.
/// A call-argument wrapper: it refers to a matrix `g`, so pass it straight to the call (a view,
/// HeadsView, is small and held by value).
template <class Derived>
class LogGates {
  static constexpr bool is_matrix = std::is_base_of_v<Eigen::MatrixBase<Derived>, Derived>;

 public:
  /// @param g  N x 1 or N x C log gates, each <= 0 (-infinity allowed)
  explicit LogGates(const Derived& g) : g_(g) {}
  /// The log gates.
  const Derived& values() const { return g_; }

 private:
  std::conditional_t<is_matrix, const Derived&, Derived> g_;
};

/// Marks `g` (N x 1 or N x C, each g_t = log a_t <= 0) as log gates for the gated entry
/// points: causal_gated_linear_attention(q, k, v, linattn::log_gates(g), map).
template <class Derived>
LogGates<Derived> log_gates(const Eigen::MatrixBase<Derived>& g) {
  return LogGates<Derived>(g.derived());
}

/// What moves a RecurrentState from token to token. A state keeps the first kind it is moved
/// with (and saves it): a step or prefill with another kind throws, since mixing them is a
/// model's bug (a GLA state stepped without its gates) that would compute silently wrong
/// numbers. reset() forgets it.
enum class TransitionKind : std::uint8_t {
  none = 0,           ///< not known yet (new, reset, from_sums, format 2): the next call sets it
  decay = 1,          ///< Options::decay, 1 for plain linear attention
  scalar_gates = 2,   ///< one gate per token (Mamba-2, simple GLA)
  feature_gates = 3,  ///< one gate per token and feature (GLA, RWKV-6)
};

/// Gates with RWKV-6's bonus u (C weights): each output reads the state before its token, and
/// the token itself through u,
///     out_t = s phi(q_t)^T (S_{t-1} + diag(u) phi(k_t) v_t^T),   S_t = diag(a_t) S_{t-1} +
///     phi(k_t) v_t^T
/// as FLA's chunk_rwkv6 / fused_recurrent_rwkv6 compute it (with w = log a_t as log_gates(w)).
/// Made by with_bonus(gates, u). No normaliser (Options::normalize = false) and plain features
/// (Identity, EluPlusOne, Relu, a user map without scaled features). A call-argument wrapper
/// that refers to u (and to gates given as a matrix), so pass it straight to the call.
template <class Gates, class DU>
class BonusGates {
  static constexpr bool is_matrix = std::is_base_of_v<Eigen::MatrixBase<Gates>, Gates>;

 public:
  /// @param gates  N x 1 or N x C gates: a_t in (0, 1], or log_gates(g)
  /// @param u      C bonus weights (a row or column vector)
  BonusGates(const Gates& gates, const DU& u) : gates_(gates), u_(u) {}
  /// The gates.
  const Gates& gates() const { return gates_; }
  /// The bonus weights u.
  const DU& bonus() const { return u_; }

 private:
  std::conditional_t<is_matrix, const Gates&, Gates> gates_;  ///< log_gates(g) is held by value
  const DU& u_;
};

namespace detail {

/// How a gate argument is read: a plain Eigen expression holds a_t, LogGates holds log a_t.
template <class G, class = void>
struct gate_traits {
  static constexpr bool is_gate = false;
};

template <class Derived>
struct gate_traits<Derived,
                   std::enable_if_t<std::is_base_of_v<Eigen::MatrixBase<Derived>, Derived>>> {
  static constexpr bool is_gate = true;
  static constexpr bool log_space = false;
  using Values = Derived;
  static const Derived& values(const Derived& gates) { return gates; }
};

template <class Derived>
struct gate_traits<LogGates<Derived>,
                   std::enable_if_t<std::is_base_of_v<Eigen::MatrixBase<Derived>, Derived>>> {
  static constexpr bool is_gate = true;
  static constexpr bool log_space = true;
  using Values = Derived;
  static const Derived& values(const LogGates<Derived>& gates) { return gates.values(); }
};

/// The kind of a sequence's transition from its gates' width (0: no gates, Options::decay).
inline TransitionKind transition_of_gate_dim(Eigen::Index gate_dim) {
  if (gate_dim == 0) return TransitionKind::decay;
  return gate_dim == 1 ? TransitionKind::scalar_gates : TransitionKind::feature_gates;
}

/// How messages name a transition kind.
inline const char* transition_name(TransitionKind kind) {
  switch (kind) {
    case TransitionKind::decay:
      return "Options::decay (no gates)";
    case TransitionKind::scalar_gates:
      return "scalar gates";
    case TransitionKind::feature_gates:
      return "per-feature gates";
    default:
      return "no transition yet";
  }
}

/// True when a state moved by `had` can continue with `kind`: had is none or kind.
inline bool continues_transition(TransitionKind had, TransitionKind kind) {
  return had == TransitionKind::none || had == kind;
}

/// The error for a call whose transition `kind` does not continue `had`; `state` names the
/// state in the message ("the state", "state 3"), `name` the kinds (the delta rule's differ).
inline Error transition_mismatch(TransitionKind had, TransitionKind kind, const char* where,
                                 const std::string& state,
                                 const char* (*name)(TransitionKind) = transition_name) {
  return Error(std::string(where) + ": " + state + " is moved by " + name(had) +
               " but this call gives " + name(kind) +
               "; a state keeps one transition (reset() it to start another)");
}

/// The scalar type of a gate argument's entries.
template <class G>
using gate_scalar_t = typename gate_traits<G>::Values::Scalar;

/// Throws unless Options::decay is 1: with gates a constant decay would be a second, silent gate.
inline void require_unit_decay(const Options& options, const char* where) {
  if (options.decay != 1.0) {
    throw Error(std::string(where) + ": Options::decay must be 1 with gates (the gates replace " +
                "the decay; fold a constant decay g into them as g * a_t, or log g + g_t), got " +
                std::to_string(options.decay));
  }
}

/// Throws naming the first gate outside its range by row and column: a_t in (0, 1], or for
/// log gates g_t <= 0 (-infinity allowed); NaN is out of range in both.
/// True when every gate is in range (see require_gates_in_range): one vectorised pass.
template <bool LogSpace, class Derived>
bool gates_in_range(const Eigen::MatrixBase<Derived>& gates) {
  using Scalar = typename Derived::Scalar;
  if (gates.size() == 0) return true;
  if constexpr (is_half_scalar<Scalar>) {
    // NaN fails every comparison, so one pass covers it.
    if constexpr (LogSpace) {
      return (gates.array() <= Scalar(0)).all();
    } else {
      return ((gates.array() > Scalar(0)) && (gates.array() <= Scalar(1))).all();
    }
  } else {
    // The extremes; PropagateNaN makes a NaN the extreme, out of range.
    const Scalar top = gates.template maxCoeff<Eigen::PropagateNaN>();
    if constexpr (LogSpace) {
      return top <= Scalar(0);
    } else {
      const Scalar bottom = gates.template minCoeff<Eigen::PropagateNaN>();
      return bottom > Scalar(0) && top <= Scalar(1);
    }
  }
}

template <bool LogSpace, class Derived>
void require_gates_in_range(const Eigen::MatrixBase<Derived>& gates, const char* where,
                            const char* name) {
  using Scalar = typename Derived::Scalar;
  const auto in_range = [](Scalar a) {
    if constexpr (LogSpace) {
      return a <= Scalar(0);
    } else {
      return a > Scalar(0) && a <= Scalar(1);
    }
  };
  if (gates_in_range<LogSpace>(gates)) return;
  for (Eigen::Index r = 0; r < gates.rows(); ++r) {
    for (Eigen::Index c = 0; c < gates.cols(); ++c) {
      const Scalar a = gates(r, c);
      if (!in_range(a)) {
        throw Error(std::string(where) + ": " + name +
                    (LogSpace ? " (log gates) must be <= 0 (-inf resets), got "
                              : " must lie in (0, 1], got ") +
                    std::to_string(static_cast<double>(a)) + " at row " + std::to_string(r) +
                    ", column " + std::to_string(c));
      }
    }
  }
}

/// Throws unless gates is rows x 1 (one gate per token) or rows x features (one per feature);
/// `q_name` names the queries whose shape the message quotes.
template <class Derived>
void require_gate_shape(const Eigen::MatrixBase<Derived>& gates, Eigen::Index rows,
                        Eigen::Index features, const char* where, const char* q_name = "phi_q") {
  if (gates.rows() != rows || (gates.cols() != 1 && gates.cols() != features)) {
    throw Error(std::string(where) + ": gates is " + shape_string(gates) + " but " + q_name +
                " is " + shape_string(rows, features) + "; gates must be " + shape_string(rows, 1) +
                " (one gate per token) or " + shape_string(rows, features) + " (one per feature)");
  }
}

/// Every check of a sequence's gates: unit decay, the shape, and the range (always, also
/// without check_finite: a NaN gate is out of range, not merely non-finite).
template <class G>
void validate_gates(const G& gates, Eigen::Index rows, Eigen::Index features,
                    const Options& options, const char* where) {
  using Traits = gate_traits<G>;
  require_unit_decay(options, where);
  require_gate_shape(Traits::values(gates), rows, features, where);
  require_gates_in_range<Traits::log_space>(Traits::values(gates), where, "gates");
}

/// body(gate) with row i of a gate argument, in the argument's own form (a_t or log_gates).
template <class G, class Body>
void with_gate_row(const G& gates, Eigen::Index i, const Body& body) {
  using Traits = gate_traits<G>;
  using Row = std::remove_const_t<typename Traits::Values::ConstRowXpr>;
  const Row row = Traits::values(gates).row(i);
  if constexpr (Traits::log_space) {
    body(LogGates<Row>(row));
  } else {
    body(row);
  }
}

/// body(block) with rows [begin, begin + len) of a gate argument, in its own form.
template <class G, class Body>
void with_gate_block(const G& gates, Eigen::Index begin, Eigen::Index len, const Body& body) {
  using Traits = gate_traits<G>;
  const auto block = Traits::values(gates).middleRows(begin, len);
  if constexpr (Traits::log_space) {
    body(LogGates<std::decay_t<decltype(block)>>(block));
  } else {
    body(block);
  }
}

/// Throws unless RWKV-6's bonus u fits: C finite weights, and no normaliser (the bonus form
/// reads the state before the token; FLA's has no z).
template <class DU>
void validate_bonus(const Eigen::MatrixBase<DU>& u, Eigen::Index features, const Options& options,
                    const char* where) {
  if (options.normalize) {
    throw Error(std::string(where) +
                ": the bonus u (RWKV-6) has no normaliser: set Options::normalize = false");
  }
  require_finite_vector(u, features, where, "u");
}

/// Log gates of a chunk in double, rows x (1 or C).
using LogRows = Eigen::Array<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Where the engine reads a sequence's gates, one chunk at a time, as log a_t in double.
class GateRows {
 public:
  GateRows(const GateRows&) = delete;
  GateRows& operator=(const GateRows&) = delete;

  /// 1 (scalar gates) or C (per feature).
  Eigen::Index cols() const { return cols_; }
  /// dst rows [0, len) = log a_t for tokens [begin, begin + len).
  virtual void log_rows(Eigen::Index begin, Eigen::Index len, LogRows& dst) const = 0;

 protected:
  explicit GateRows(Eigen::Index cols) : cols_(cols) {}
  ~GateRows() = default;

 private:
  Eigen::Index cols_;
};

/// dst rows [0, len) = log a_t of rows [begin, begin + len) of `values` (a_t, or log a_t when
/// LogSpace), in double.
template <bool LogSpace, class Values>
void load_log_rows(const Values& values, Eigen::Index begin, Eigen::Index len, LogRows& dst) {
  if constexpr (!is_half_scalar<typename Values::Scalar>) {
    // Converted first, then the logs in dst: vectorised, and the same whatever the strides.
    dst.topRows(len) = values.middleRows(begin, len).template cast<double>().array();
    if constexpr (!LogSpace) dst.topRows(len) = dst.topRows(len).log();
  } else {
    for (Eigen::Index r = 0; r < len; ++r) {
      for (Eigen::Index c = 0; c < values.cols(); ++c) {
        const double x = static_cast<double>(values(begin + r, c));
        dst(r, c) = LogSpace ? x : std::log(x);
      }
    }
  }
}

/// GateRows over a caller's gate argument (a_t, or log a_t with LogGates).
template <class G>
class GateMatrix final : public GateRows {
  using Traits = gate_traits<G>;
  using Values = typename Traits::Values;

 public:
  explicit GateMatrix(const G& gates)
      : GateRows(Traits::values(gates).cols()), values_(Traits::values(gates)) {}

  void log_rows(Eigen::Index begin, Eigen::Index len, LogRows& dst) const override {
    load_log_rows<Traits::log_space>(values_, begin, len, dst);
  }

 private:
  const Values& values_;
};

}  // namespace detail
/// Gates (a_t, or log_gates(g)) with RWKV-6's bonus u, for causal_gated_linear_attention and
/// RecurrentState's step and prefill: causal_gated_linear_attention(r, k, v,
/// linattn::with_bonus(linattn::log_gates(w), u), linattn::Identity{}, options).
/// @param gates  N x 1 or N x C gates: a_t in (0, 1], or log_gates(g)
/// @param u      C bonus weights, a row or column vector of the inputs' scalar
template <class Gates, class DU>
BonusGates<Gates, DU> with_bonus(const Gates& gates, const Eigen::MatrixBase<DU>& u) {
  static_assert(detail::gate_traits<Gates>::is_gate,
                "with_bonus takes gates: a_t as an Eigen expression, or log_gates(g)");
  static_assert(std::is_same_v<typename DU::Scalar, detail::gate_scalar_t<Gates>>,
                "the bonus u must have the gates' scalar type");
  return BonusGates<Gates, DU>(gates, u.derived());
}

}  // namespace linattn
