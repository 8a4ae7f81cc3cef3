// SPDX-License-Identifier: MIT
// The recurrent (decoding) form: S <- g S + phi(k) v^T, z <- g z + phi(k), one token at a time.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <istream>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/bonus.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/convert.hpp>
#include <linattn/detail/fingerprint.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/serialize.hpp>
#include <linattn/detail/state_access.hpp>
#include <linattn/detail/state_core.hpp>
#include <linattn/detail/state_record.hpp>
#include <linattn/detail/stream.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn {

template <class T, class Acc>
class RecurrentStateBatch;

/// A RecurrentState's sums in the form that never overflows (RecurrentState::sums()): the true
/// S is exp(log_scale) * s and the true z is exp(log_scale) * z.
template <class Acc>
struct ScaledSums {
  Matrix<Acc> s;  ///< C x Dv
  Vector<Acc> z;  ///< C
  /// Natural log of the factor s and z miss: 0 for plain maps without pending gate factors,
  /// -infinity before the first token.
  double log_scale = 0.0;
};

/// The running sums of causal linear attention for one sequence: S (C x Dv), z (C) and the
/// tokens seen. `step` adds one token in O(C * Dv); `prefill` adds many through the chunked
/// form; both give the outputs of one causal_linear_attention call over the whole sequence.
/// One state serves every transition: Options::decay, or per-token gates given to the gated
/// step and prefill (scalar or per feature, a_t or log_gates(g)), as
/// causal_gated_linear_attention computes them.
///
/// s() and z() are the true sums. Inside, the state keeps gate factors in double until they
/// pass a factor of e, and exponential maps (PositiveRandomFeatures, passed to the map
/// overloads) keep a log scale so nothing overflows; sums() gives that exact form
/// (exp(log_scale) times s and z), which from_sums takes back.
///
/// Acc is the type of the state and of every sum (default T): RecurrentState<float, double>
/// takes and returns float but accumulates in double, for sequences long enough that float
/// sums lose digits (a million tokens and more).
///
/// T may also be Eigen::half or Eigen::bfloat16: inputs and outputs in the 16-bit type, the
/// state and every sum in Acc, which then defaults to float (RecurrentState<Eigen::half> is
/// RecurrentState<Eigen::half, float>; ask for double with RecurrentState<Eigen::half, double>).
/// A 16-bit state is never allowed: its sums would stop growing after a few thousand tokens.
///
/// save() records the accumulation type, not T: the stream of a RecurrentState<Eigen::half>
/// loads as any RecurrentState<T, float> (the sums are the same float sums whatever type the
/// tokens came in), while a state accumulating in double refuses it.
template <class T, class Acc = detail::default_accumulator_t<T>>
class RecurrentState : public detail::StateCore<detail::CarriedState<Acc>, Options> {
  using Core = detail::StateCore<detail::CarriedState<Acc>, Options>;
  using Core::carried_;
  using Core::options_;
  using Core::progress_;
  using Core::require_token_room;
  static_assert(detail::is_input_scalar<T>,
                "RecurrentState<T, Acc> takes float, double, Eigen::half or Eigen::bfloat16 "
                "inputs (T)");
  static_assert(detail::is_supported_scalar<Acc>,
                "RecurrentState<T, Acc> accumulates in float or double: for 16-bit inputs "
                "write RecurrentState<Eigen::half, float> (or bfloat16, or double)");

 public:
  /// @param feature_dim  C, the width of phi(q) and phi(k)
  /// @param value_dim    Dv, the width of v
  /// @param options      eps, decay, normalize, check_finite (and chunk, for prefill)
  RecurrentState(Eigen::Index feature_dim, Eigen::Index value_dim, const Options& options = {})
      : Core(detail::CarriedState<Acc>(
                 detail::require_positive_dim(feature_dim, "RecurrentState", "feature_dim"),
                 detail::require_positive_dim(value_dim, "RecurrentState", "value_dim")),
             options),
        query_(feature_dim),
        key_(feature_dim),
        value_(value_dim),
        output_(std::is_same_v<T, Acc> ? 0 : value_dim),
        feature_log_gate_(feature_dim),
        feature_factor_(feature_dim) {
    detail::validate_options(options, "RecurrentState");
  }

  /// Adds one token through a feature map and returns its output. Exponential maps go
  /// through the log-scale stabiliser. Allocates only the returned vector.
  /// @param q    Dk query (any row or column vector expression; features, with Identity)
  /// @param k    Dk key
  /// @param v    Dv value
  /// @param map  feature map with map.feature_dim(Dk) == C (Identity{} for precomputed
  ///             features); a call without one does not compile
  /// @return     Dv output
  template <class DQ, class DK, class DV, class Map = detail::MissingFeatureMap,
            class = std::enable_if_t<!detail::gate_traits<Map>::is_gate>>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Map& map = {}) {
    Vector<T> out(value_dim());
    step_into(q, k, v, map, out);
    return out;
  }

  /// Adds one token with a gate (instead of Options::decay, which must be 1) and returns its
  /// output: S <- diag(a) S + phi(k) v^T, z alike. Pending gate factors stay in double
  /// until they pass a factor of e, so gates of 1 - 1e-8 are not rounded away in a float state.
  /// @param q     Dk query (features, with Identity)
  /// @param k     Dk key
  /// @param v     Dv value
  /// @param gate  1 gate (scalar) or C gates (per feature): a vector of a in (0, 1], or
  ///              log_gates(g) with g <= 0 (-infinity resets the state)
  /// @param map   feature map (Identity{} for precomputed features)
  /// @return      Dv output
  template <class DQ, class DK, class DV, class Gate, class Map = detail::MissingFeatureMap,
            class = std::enable_if_t<detail::gate_traits<Gate>::is_gate>>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Gate& gate, const Map& map = {}) {
    Vector<T> out(value_dim());
    step_into(q, k, v, gate, map, out);
    return out;
  }

  /// Adds one token with the scalar gate a in (0, 1]; see the gated step.
  template <class DQ, class DK, class DV, class Map = detail::MissingFeatureMap>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, T gate, const Map& map = {}) {
    Vector<T> out(value_dim());
    step_into(q, k, v, Eigen::Matrix<T, 1, 1>::Constant(gate), map, out);
    return out;
  }

  /// As the gated step, writing the output into `out` (Dv); allocates nothing once the first
  /// token has sized the workspace. On a throw the state is unchanged.
  template <class DQ, class DK, class DV, class Gate, class Map,
            class = std::enable_if_t<detail::gate_traits<Gate>::is_gate>>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Gate& gate, const Map& map,
                 Eigen::Ref<Vector<T>> out) {
    constexpr const char* where = "RecurrentState::step";
    check_scalars<DQ, DK, DV>();
    static_assert(std::is_same_v<detail::gate_scalar_t<Gate>, T>,
                  "the gate must have the state's input scalar type");
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      load_gate(gate, where);
      const GateScope scope(*this);
      require_transition(token_transition(), where);
      if constexpr (detail::is_identity_map<Map>) {
        load_token(q, k, v, out, where, "phi_q", "phi_k");
        advance(0.0, 0.0, true, out);
      } else {
        featurize_token(q, k, v, map, out.size(), where);
        if (token_gate_ == TokenGate::feature) unscale_token(where);
        advance_featurized(v, true, out);
      }
    }
  }

  /// As the gated step with a scalar gate a in (0, 1], writing into `out` (Dv).
  template <class DQ, class DK, class DV, class Map>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, T gate, const Map& map,
                 Eigen::Ref<Vector<T>> out) {
    step_into(q, k, v, Eigen::Matrix<T, 1, 1>::Constant(gate), map, out);
  }

  /// As step(q, k, v, map), writing the output into `out` (Dv). Allocates nothing once the
  /// first token has sized the workspace (for maps with queries_into / keys_into, which every
  /// linattn map has). On a throw the state is unchanged.
  template <class DQ, class DK, class DV, class Map>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Map& map, Eigen::Ref<Vector<T>> out) {
    constexpr const char* where = "RecurrentState::step";
    check_scalars<DQ, DK, DV>();
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      require_transition(TransitionKind::decay, where);
      if constexpr (detail::is_identity_map<Map>) {
        load_token(q, k, v, out, where, "phi_q", "phi_k");
        advance(0.0, 0.0, !carried_.unscaled(), out);
      } else {
        step_mapped(q, k, v, map, out, where);
      }
    }
  }

  /// Adds one token with RWKV-6's bonus u (with_bonus(gate, u)) and returns its output, read
  /// before the token moves the state: out = s phi(q)^T (S + diag(u) phi(k) v^T), then
  /// S <- diag(a) S + phi(k) v^T. Options::normalize must be false, the map plain. Two passes
  /// over S; allocates only the returned vector once the first such step sized the workspace.
  /// @param q     Dk query (receptance; features, with Identity)
  /// @param k     Dk key
  /// @param v     Dv value
  /// @param gate  with_bonus(gate, u): 1 or C gates (a, or log_gates(w)) and C weights u
  /// @param map   a plain feature map (Identity{} for precomputed features)
  /// @return      Dv output
  template <class DQ, class DK, class DV, class Gate, class DU,
            class Map = detail::MissingFeatureMap>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const BonusGates<Gate, DU>& gate,
                 const Map& map = {}) {
    Vector<T> out(value_dim());
    step_into(q, k, v, gate, map, out);
    return out;
  }

  /// As the bonus step, writing into `out` (Dv). On a throw the state is unchanged.
  template <class DQ, class DK, class DV, class Gate, class DU, class Map>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const BonusGates<Gate, DU>& gate, const Map& map,
                 Eigen::Ref<Vector<T>> out) {
    constexpr const char* where = "RecurrentState::step";
    check_scalars<DQ, DK, DV>();
    static_assert(std::is_same_v<detail::gate_scalar_t<Gate>, T>,
                  "the gate must have the state's input scalar type");
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      detail::require_plain_features<Map>();
      detail::validate_bonus(gate.bonus(), feature_dim(), options_, where);
      load_gate(gate.gates(), where);
      const GateScope scope(*this);
      require_transition(token_transition(), where);
      load_any_token(q, k, v, map, out, where);
      advance_bonus(gate.bonus(), out);
    }
  }

  /// Catches the map-less call of 0.1.0, step_into(phi_q, phi_k, v, out).
  template <class DQ, class DK, class DV, class DO>
  void step_into(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                 const Eigen::MatrixBase<DV>&, Eigen::MatrixBase<DO>&) {
    static_assert(detail::always_false<DQ>,
                  "linattn: RecurrentState::step_into needs a feature map before out: pass "
                  "linattn::Identity{} when q and k are already features");
  }

  /// Adds many tokens through the chunked form, the map applied chunk by chunk; returns their
  /// outputs, the same (within rounding) as calling step for each row. On a throw the state
  /// is unchanged.
  /// @param q    N x Dk queries (features, with Identity)
  /// @param k    N x Dk keys
  /// @param v    N x Dv values
  /// @param map  feature map with map.feature_dim(Dk) == C (Identity{} for precomputed
  ///             features); a call without one does not compile
  /// @return     N x Dv outputs
  template <class DQ, class DK, class DV, class Map = detail::MissingFeatureMap,
            class = std::enable_if_t<!detail::gate_traits<Map>::is_gate>>
  Matrix<T> prefill(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Map& map = {}) {
    Matrix<T> out(q.rows(), value_dim());
    prefill_into(q, k, v, map, out);
    return out;
  }

  /// Adds many gated tokens through the chunked form (Options::decay must be 1); the same
  /// (within rounding) as calling the gated step for each row. On a throw the state is
  /// unchanged.
  /// @param q      N x Dk queries (features, with Identity)
  /// @param k      N x Dk keys
  /// @param v      N x Dv values
  /// @param gates  N x 1 or N x C gates a_t in (0, 1], or log_gates(g) with g <= 0
  /// @param map    feature map (Identity{} for precomputed features)
  /// @return       N x Dv outputs
  template <class DQ, class DK, class DV, class Gates, class Map = detail::MissingFeatureMap,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  Matrix<T> prefill(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Gates& gates, const Map& map = {}) {
    Matrix<T> out(q.rows(), value_dim());
    prefill_into(q, k, v, gates, map, out);
    return out;
  }

  /// As the gated prefill, writing into `out` (N x Dv, row-major).
  template <class DQ, class DK, class DV, class Gates, class Map,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  void prefill_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Gates& gates, const Map& map,
                    Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "RecurrentState::prefill";
    check_scalars<DQ, DK, DV>();
    static_assert(std::is_same_v<detail::gate_scalar_t<Gates>, T>,
                  "the gates must have the state's input scalar type");
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      constexpr bool features = detail::is_identity_map<Map>;
      detail::validate_sequence_shapes(q, k, v, options_, where, features ? "phi_q" : "q",
                                       features ? "phi_k" : "k");
      const detail::GateMatrix<Gates> gate_rows(gates);
      if constexpr (features) {
        check_dims(q.cols(), v.cols(), where, "phi_q");
        detail::validate_gates(gates, q.rows(), feature_dim(), options_, where);
        detail::require_output_shape(out, q.rows(), value_dim(), where);
        detail::scan_inputs(q, k, v, options_, where, "phi_q", "phi_k");
        detail::FeaturizedSource<Acc, DQ, DK, DV> source(q.derived(), k.derived(), v.derived());
        source.attach_gates(gate_rows);
        run_chunked(source, out);
      } else {
        // Per-feature gates take plain features (their kernel keeps no per-token scale).
        detail::MappedSource<Acc, DQ, DK, DV, Map> source(q.derived(), k.derived(), v.derived(),
                                                          map, options_.check_finite, where,
                                                          gate_rows.cols() == 1);
        check_dims(source.feature_dim(), v.cols(), where, "phi(q)");
        detail::validate_gates(gates, q.rows(), feature_dim(), options_, where);
        detail::require_output_shape(out, q.rows(), value_dim(), where);
        detail::scan_inputs(q, k, v, options_, where, "q", "k");
        source.attach_gates(gate_rows);
        run_chunked(source, out);
      }
    }
  }

  /// Adds many tokens with RWKV-6's bonus u (with_bonus(gates, u)) through the chunked form;
  /// returns their outputs, as the bonus step gives them. On a throw the state is unchanged.
  /// @param q      N x Dk receptances (queries; features, with Identity)
  /// @param k      N x Dk keys
  /// @param v      N x Dv values
  /// @param gates  with_bonus(gates, u): N x 1 or N x C gates (a_t, or log_gates(w)), C weights
  /// @param map    a plain feature map (Identity{} for precomputed features)
  /// @return       N x Dv outputs
  template <class DQ, class DK, class DV, class Gates, class DU,
            class Map = detail::MissingFeatureMap>
  Matrix<T> prefill(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const BonusGates<Gates, DU>& gates,
                    const Map& map = {}) {
    Matrix<T> out(q.rows(), value_dim());
    prefill_into(q, k, v, gates, map, out);
    return out;
  }

  /// As the bonus prefill, writing into `out` (N x Dv, row-major). Row 0 reads the state as
  /// it stands; rows 1.. are the gated prefill's with queries one row ahead (each reads the
  /// state after the token before); the last token then only moves the state.
  template <class DQ, class DK, class DV, class Gates, class DU, class Map>
  void prefill_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const BonusGates<Gates, DU>& gates,
                    const Map& map, Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "RecurrentState::prefill";
    check_scalars<DQ, DK, DV>();
    static_assert(std::is_same_v<detail::gate_scalar_t<Gates>, T>,
                  "the gates must have the state's input scalar type");
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      detail::require_plain_features<Map>();
      constexpr bool features = detail::is_identity_map<Map>;
      const char* q_name = features ? "phi_q" : "q";
      const char* k_name = features ? "phi_k" : "k";
      detail::validate_sequence_shapes(q, k, v, options_, where, q_name, k_name);
      check_dims(features ? q.cols() : map.feature_dim(q.cols()), v.cols(), where,
                 features ? "phi_q" : "phi(q)");
      detail::validate_gates(gates.gates(), q.rows(), feature_dim(), options_, where);
      detail::validate_bonus(gates.bonus(), feature_dim(), options_, where);
      detail::require_output_shape(out, q.rows(), value_dim(), where);
      detail::scan_inputs(q, k, v, options_, where, q_name, k_name);
      using GateTraits = detail::gate_traits<Gates>;
      require_transition(detail::transition_of_gate_dim(GateTraits::values(gates.gates()).cols()),
                         where);
      require_token_room(q.rows(), where);
      prefill_bonus(q, k, v, gates.gates(), gates.bonus(), map, out, 0, where);
    }
  }

  /// As prefill(q, k, v, map), writing into `out` (N x Dv, row-major).
  template <class DQ, class DK, class DV, class Map>
  void prefill_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Map& map, Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "RecurrentState::prefill";
    check_scalars<DQ, DK, DV>();
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      constexpr bool features = detail::is_identity_map<Map>;
      detail::validate_sequence_shapes(q, k, v, options_, where, features ? "phi_q" : "q",
                                       features ? "phi_k" : "k");
      if constexpr (features) {
        check_dims(q.cols(), v.cols(), where, "phi_q");
        detail::require_output_shape(out, q.rows(), value_dim(), where);
        detail::scan_inputs(q, k, v, options_, where, "phi_q", "phi_k");
        run_chunked(
            detail::FeaturizedSource<Acc, DQ, DK, DV>(q.derived(), k.derived(), v.derived()), out);
      } else {
        const detail::MappedSource<Acc, DQ, DK, DV, Map> source(
            q.derived(), k.derived(), v.derived(), map, options_.check_finite, where);
        check_dims(source.feature_dim(), v.cols(), where, "phi(q)");
        detail::require_output_shape(out, q.rows(), value_dim(), where);
        detail::scan_inputs(q, k, v, options_, where, "q", "k");
        run_chunked(source, out);
      }
    }
  }

  /// Catches the map-less call of 0.1.0, prefill_into(phi_q, phi_k, v, out).
  template <class DQ, class DK, class DV, class DO>
  void prefill_into(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                    const Eigen::MatrixBase<DV>&, Eigen::MatrixBase<DO>&) {
    static_assert(detail::always_false<DQ>,
                  "linattn: RecurrentState::prefill_into needs a feature map before out: pass "
                  "linattn::Identity{} when q and k are already features");
  }

  /// S, C x Dv: the true sums, whatever the state holds internally (gate factors kept in
  /// double, an exponential map's scale): FLA's final state for the features. Throws Error when
  /// they overflow Acc (an exponential map with large inputs): read sums() then.
  Matrix<Acc> s() const {
    Matrix<Acc> out(carried_.s.rows(), carried_.s.cols());
    for (Eigen::Index c = 0; c < out.rows(); ++c) {
      out.row(c) = carried_.s.row(c) * true_factor(c, "s");
    }
    require_representable(out, "s");
    return out;
  }
  /// z, C: the true normaliser sums (see s()).
  Vector<Acc> z() const {
    Vector<Acc> out(carried_.z.size());
    for (Eigen::Index c = 0; c < out.size(); ++c) out(c) = carried_.z(c) * true_factor(c, "z");
    require_representable(out, "z");
    return out;
  }
  /// The sums in a form that never overflows: S = exp(log_scale) s, z = exp(log_scale) z, as
  /// save() writes them and from_sums(sums, options) takes them back.
  ScaledSums<Acc> sums() const {
    detail::CarriedState<Acc> folded = carried_;
    folded.fold_rows();
    return ScaledSums<Acc>{std::move(folded.s), std::move(folded.z), folded.log_scale};
  }
  /// C, rows of S.
  Eigen::Index feature_dim() const { return carried_.s.rows(); }
  /// What every family's state answers (detail::StateCore): tokens() seen since construction or
  /// reset(), the transition() that moves the state (none before its first token), Dv
  /// (value_dim()), the options() given at construction or read by load, and reset(), which
  /// forgets every token and keeps the dimensions and options.
  using Core::options;
  using Core::reset;
  using Core::tokens;
  using Core::transition;
  using Core::value_dim;

  /// A state holding the caller's sums, as if the tokens that made them had been added (FLA's
  /// initial_state): the true sums are exp(log_scale) * s0 and exp(log_scale) * z0, and every
  /// step or prefill continues from them. tokens() starts at 0. Throws Error for an empty s0,
  /// a z0 that is not a vector of s0.rows() entries, a NaN or Inf in s0 or z0 (after the
  /// conversion to Acc), or a log_scale that is NaN, +infinity, or -infinity while s0 or z0
  /// holds a non-zero entry.
  /// @param s0         C x Dv, S (any Eigen expression of float, double or a 16-bit type)
  /// @param z0         C, z (a row or column vector expression); used when normalize is on
  ///                   (without normalize, from_sums(s0, options) needs none)
  /// @param options    as for the constructor
  /// @param log_scale  log of the factor s0 and z0 miss: 0 for plain sums (exponential maps
  ///                   may use any finite value; -infinity only with all-zero sums, a fresh
  ///                   state, as sums() reports it)
  template <class DS, class DZ>
  static RecurrentState from_sums(const Eigen::MatrixBase<DS>& s0, const Eigen::MatrixBase<DZ>& z0,
                                  const Options& options = {}, double log_scale = 0.0) {
    constexpr const char* where = "RecurrentState::from_sums";
    static_assert(detail::is_input_scalar<typename DS::Scalar> &&
                      detail::is_input_scalar<typename DZ::Scalar>,
                  "RecurrentState::from_sums takes sums of float, double, Eigen::half or "
                  "Eigen::bfloat16");
    detail::validate_options(options, where);
    if (s0.rows() < 1 || s0.cols() < 1) {
      throw Error(std::string(where) + ": s0 is empty (" + detail::shape_string(s0) +
                  "), expected C x Dv with C, Dv >= 1");
    }
    detail::require_vector(z0, s0.rows(), where, "z0");
    const Matrix<Acc> s = s0.template cast<Acc>();
    const Vector<Acc> z = z0.reshaped().template cast<Acc>();
    detail::require_finite(s, where, "s0");
    detail::require_finite(z, where, "z0");
    if (std::isnan(log_scale) || log_scale == std::numeric_limits<double>::infinity()) {
      throw Error(std::string(where) +
                  ": log_scale must be finite (or -infinity for zero sums), got " +
                  std::to_string(log_scale));
    }
    if (log_scale == -std::numeric_limits<double>::infinity() && !(s.isZero(0) && z.isZero(0))) {
      throw Error(std::string(where) +
                  ": log_scale is -infinity (no token yet) but s0 or z0 holds a non-zero entry");
    }
    RecurrentState state(s.rows(), s.cols(), options);
    state.carried_.s = s;
    state.carried_.z = z;
    state.carried_.log_scale = log_scale;
    return state;
  }

  /// A state holding the caller's S alone, for Options::normalize off (the numerator only, as
  /// FLA's linear attention: its initial_state has no z); z starts at zero. Throws Error when
  /// normalize is on (the denominator needs z0: call from_sums(s0, z0, options)), and as the
  /// call with z0 otherwise.
  /// @param s0         C x Dv, S (any Eigen expression of float, double or a 16-bit type)
  /// @param options    as for the constructor, with normalize off
  /// @param log_scale  as for from_sums(s0, z0, options, log_scale)
  template <class DS>
  static RecurrentState from_sums(const Eigen::MatrixBase<DS>& s0, const Options& options,
                                  double log_scale = 0.0) {
    if (options.normalize) {
      throw Error(
          "RecurrentState::from_sums: Options::normalize is on, so the state needs z0 as well "
          "as s0: call from_sums(s0, z0, options), or turn normalize off for numerator-only "
          "attention");
    }
    return from_sums(s0, Vector<Acc>::Zero(s0.rows()), options, log_scale);
  }

  /// The state whose sums() are `sums` (another state's, or save's), as if its tokens had been
  /// added: from_sums(sums.s, sums.z, options, sums.log_scale).
  static RecurrentState from_sums(const ScaledSums<Acc>& sums, const Options& options = {}) {
    return from_sums(sums.s, sums.z, options, sums.log_scale);
  }

  /// Writes the state without a record of its feature map (the map kind "unknown"): only
  /// load_unchecked reads it back, since load(is, map, options) cannot check the map. Prefer
  /// save(os, map).
  void save(std::ostream& os) const { write(os, detail::MapFingerprint{}); }

  /// Writes the state in the format every state saves in (format 4: dims, the family, the
  /// transition kind, the token count, eps, decay, normalize, scale, a fingerprint of `map`,
  /// log scale, S and z) little-endian with a CRC-32;
  /// load(is, map, options) reads it back bit for bit and checks both. The fingerprint names the
  /// map's kind (Identity, EluPlusOne, Relu, PositiveRandomFeatures, RandomFourierFeatures, or a
  /// user map), its input and feature counts, and for the random maps their settings and an FNV-1a
  /// hash of W; a user map can add `std::uint64_t fingerprint() const`, a hash of its own
  /// settings, which is then recorded and compared. Throws Error, writing nothing, if the map
  /// gives another number of features than the state holds, and if the stream fails.
  /// @param os   binary stream
  /// @param map  the feature map the state was stepped with
  template <class Map>
  void save(std::ostream& os, const Map& map) const {
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      const detail::MapFingerprint print = detail::fingerprint_of(map, feature_dim());
      const std::uint64_t gives = detail::recorded_feature_dim(print);
      if (gives != 0 && gives != static_cast<std::uint64_t>(feature_dim())) {
        throw Error(std::string("RecurrentState::save: the feature map (") +
                    detail::map_kind_name(print.kind) + ") gives " + std::to_string(gives) +
                    " features but the state holds " + std::to_string(feature_dim()));
      }
      write(os, print);
    }
  }

  /// Reads a state written by save and checks that it fits the server that loads it: the
  /// options that change results (eps, decay, normalize, scale) must equal `options`, bit for
  /// bit, and the map recorded by save(os, map) must be `map` (same kind, input_dim,
  /// num_features, hyperbolic, temperature and hash of W, or a user map's fingerprint()).
  /// The state gets `options` (chunk, threads, check_finite included). Throws Error naming the
  /// first setting that differs, and refuses states whose map cannot be checked: saved by
  /// save(os) without a map, or in format 1 (linattn 0.1.0, which records no map). Read those
  /// with load_unchecked, then compare options() with yours and save(os, map) to upgrade them.
  /// Also throws, returning nothing, for everything load_unchecked refuses.
  /// @param is       binary stream positioned at a saved state; read up to its last byte
  /// @param map      the feature map this server steps with
  /// @param options  the options this server runs with
  template <class Map>
  static RecurrentState load(std::istream& is, const Map& map, const Options& options) {
    constexpr const char* where = "RecurrentState::load";
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      detail::validate_options(options, where);
      const detail::StateRecord stored = detail::read_state_of<Acc>(is, StateFamily::linear, where);
      require_same_options(stored.linear, options, where);
      if (stored.version == 1) {
        throw Error(std::string(where) +
                    ": the stream is format version 1 (linattn 0.1.0), which records no feature "
                    "map, so the map cannot be checked; read it with load_unchecked(is), compare "
                    "its options() with yours and save it again with save(os, map)");
      }
      return restore(stored, detail::fingerprint_of(map, static_cast<Eigen::Index>(stored.rows)),
                     options, where);
    } else {
      return load_unchecked(is);  // not reached: check_feature_map failed to compile
    }
  }

  /// Reads a state written by save (format 4, or 3, 2, 1 of earlier releases) checking nothing
  /// against the caller: the state gets the options it was saved with (eps, decay, normalize,
  /// scale; format 1 also chunk and check_finite; the rest default), and nothing about the map
  /// is checked. For tools that inspect or convert files; a server loads with
  /// load(is, map, options). Throws Error, and returns nothing, for an empty, failed,
  /// truncated or corrupt stream, a wrong magic, format version or scalar type, another
  /// family's state (a DeltaRuleState's), dims over 2^26 entries, invalid options, map or
  /// transition record, or non-finite sums.
  /// @param is  binary stream positioned at a saved state; read up to its last byte
  static RecurrentState load_unchecked(std::istream& is) {
    const detail::StateRecord stored =
        detail::read_state_of<Acc>(is, StateFamily::linear, "RecurrentState::load_unchecked");
    return build(stored, detail::saved_options(stored.linear));
  }

  /// load(is) without the map and the options no longer exists: it loaded states saved with
  /// other options or another map without a word. This overload only explains that.
  template <class Stream>
  static RecurrentState load(Stream& is) {
    static_assert(detail::always_false<Stream>,
                  "linattn: RecurrentState::load(is) needs the feature map and the options the "
                  "server runs with: load(is, map, options) checks that the state was saved with "
                  "them; tools that only read a file use load_unchecked(is)");
    return load_unchecked(is);
  }

  /// As load(is): the options are needed too.
  template <class Stream, class Map>
  static RecurrentState load(Stream& is, const Map&) {
    static_assert(detail::always_false<Stream, Map>,
                  "linattn: RecurrentState::load(is, map) needs the options the server runs "
                  "with as well: load(is, map, options)");
    return load_unchecked(is);
  }

 private:
  /// Writes format 4 (detail/state_record.hpp has the layout) with the map record `print`.
  void write(std::ostream& os, const detail::MapFingerprint& print) const {
    // Pending per-feature gate factors are applied to the written sums (the format has no field).
    const ScaledSums<Acc> sums = this->sums();
    detail::write_state_record<Acc>(os, record(print), sums.s, &sums.z, "RecurrentState::save");
  }

  /// Throws Error naming the first result-changing option that differs from the saved one.
  static void require_same_options(const detail::LinearRecord& saved, const Options& options,
                                   const char* where) {
    const std::string head = std::string(where) + ": the state was saved with ";
    if (!(saved.eps == options.eps)) {
      throw Error(head + "eps " + detail::format_double(saved.eps) + " but options.eps is " +
                  detail::format_double(options.eps));
    }
    if (!(saved.decay == options.decay)) {
      throw Error(head + "decay " + detail::format_double(saved.decay) + " but options.decay is " +
                  detail::format_double(options.decay));
    }
    if (saved.normalize != options.normalize) {
      throw Error(head + "normalize " + (saved.normalize ? "on" : "off") +
                  " but options.normalize is " + (options.normalize ? "on" : "off"));
    }
    if (!(saved.scale == options.scale)) {
      throw Error(head + "scale " + detail::format_double(saved.scale) + " but options.scale is " +
                  detail::format_double(options.scale));
    }
  }

  /// The state a verified record holds, checked against the caller's map (its fingerprint)
  /// and options as load checks them: what load and a SessionPool's session load give.
  static RecurrentState restore(const detail::StateRecord& stored,
                                const detail::MapFingerprint& print, const Options& options,
                                const char* where) {
    require_same_options(stored.linear, options, where);
    if (stored.linear.map.kind == detail::MapKind::unknown) {
      throw Error(std::string(where) +
                  ": the state was saved without its feature map (save(os)), so the map "
                  "cannot be checked; save it with save(os, map), or read it with "
                  "load_unchecked(is)");
    }
    detail::require_same_map(stored.linear.map, print, where);
    return build(stored, options);
  }

  /// The record save(os, map) writes, the map recorded as `print`, its S and z in the
  /// returned sums (pending per-feature gate factors applied: the format has no field).
  detail::StateRecord record(const detail::MapFingerprint& print) const {
    detail::StateRecord record = this->record_of(StateFamily::linear);
    record.linear.eps = options_.eps;
    record.linear.decay = options_.decay;
    record.linear.normalize = options_.normalize;
    record.linear.scale = options_.scale;
    record.linear.map = print;
    record.linear.log_scale = carried_.log_scale;
    return record;
  }

  /// The state a verified record holds, with the given options.
  static RecurrentState build(const detail::StateRecord& stored, const Options& options) {
    RecurrentState state(static_cast<Eigen::Index>(stored.rows),
                         static_cast<Eigen::Index>(stored.cols), options);
    state.carried_.s = detail::record_s<Acc>(stored);
    state.carried_.z = detail::record_z<Acc>(stored);
    state.take_progress(stored);
    state.carried_.log_scale = stored.linear.log_scale;
    return state;
  }
  template <class DQ, class DK, class DV>
  static void check_scalars() {
    static_assert(std::is_same_v<typename DQ::Scalar, T> &&
                      std::is_same_v<typename DK::Scalar, T> &&
                      std::is_same_v<typename DV::Scalar, T>,
                  "inputs must have the state's scalar type");
  }

  void check_dims(Eigen::Index features, Eigen::Index values, const char* where,
                  const char* feature_name) const {
    if (features != feature_dim() || values != value_dim()) {
      throw Error(std::string(where) + ": " + feature_name + " has " + std::to_string(features) +
                  " columns and v has " + std::to_string(values) + "; the state is " +
                  detail::shape_string(feature_dim(), value_dim()) + " (C x Dv)");
    }
  }

  /// Throws unless `x` is one token: a row or column vector (of `size` entries when size > 0).
  template <class Derived>
  static void require_token(const Eigen::MatrixBase<Derived>& x, Eigen::Index size,
                            const char* where, const char* name) {
    if ((x.rows() != 1 && x.cols() != 1) || x.size() == 0) {
      throw Error(std::string(where) + ": " + name + " is " + detail::shape_string(x) +
                  "; step takes one token, a row or column vector (use prefill for several)");
    }
    if (size > 0 && x.size() != size) {
      throw Error(std::string(where) + ": " + name + " has " + std::to_string(x.size()) +
                  " entries, expected " + std::to_string(size));
    }
  }

  /// One raw token through `map`: featurized into the step workspace, then advanced.
  template <class DQ, class DK, class DV, class Map>
  void step_mapped(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                   const Eigen::MatrixBase<DV>& v, const Map& map, Eigen::Ref<Vector<T>> out,
                   const char* where) {
    featurize_token(q, k, v, map, out.size(), where);
    advance_featurized(v, detail::is_log_scaled<Map>::value, out);
  }

  /// The first half of a mapped step: validates the token and writes phi(q), phi(k) (and
  /// their log scales) into the step workspace, sized by the first token and then reused
  /// (no allocation). S, z and the token count do not move, so a batch can featurize every
  /// state before it advances any.
  template <class DQ, class DK, class DV, class Map>
  void featurize_token(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                       const Eigen::MatrixBase<DV>& v, const Map& map, Eigen::Index out_size,
                       const char* where) {
    require_token_room(1, where);
    require_token(q, 0, where, "q");
    require_token(k, q.size(), where, "k");
    require_token(v, value_dim(), where, "v");
    if (out_size != value_dim()) {
      throw Error(std::string(where) + ": out has " + std::to_string(out_size) +
                  " entries, expected " + std::to_string(value_dim()));
    }
    const Eigen::Index dim = map.feature_dim(q.size());
    if (dim != feature_dim()) {
      throw Error(std::string(where) + ": the feature map gives " + std::to_string(dim) +
                  " features for q of size " + std::to_string(q.size()) + " but the state holds " +
                  std::to_string(feature_dim()));
    }
    if (raw_q_.size() != q.size()) {
      raw_q_.resize(q.size());
      raw_k_.resize(q.size());
    }
    // Featurized in the accumulation type, as prefill does.
    detail::load_vector(q, raw_q_);
    detail::load_vector(k, raw_k_);
    if (options_.check_finite) {
      detail::require_finite(raw_q_, where, "q");
      detail::require_finite(raw_k_, where, "k");
      detail::require_finite(v, where, "v");
    }
    Eigen::Map<Matrix<Acc>> phi_q(query_.data(), 1, feature_dim());
    Eigen::Map<Matrix<Acc>> phi_k(key_.data(), 1, feature_dim());
    token_log_q_ = 0.0;
    token_log_k_ = 0.0;
    if constexpr (detail::is_log_scaled<Map>::value) {
      Eigen::Map<Vector<double>> log_q(&token_log_q_, 1), log_k(&token_log_k_, 1);
      detail::map_scaled_features_into(map, raw_q_.transpose(), phi_q, log_q);
      detail::map_scaled_features_into(map, raw_k_.transpose(), phi_k, log_k);
    } else {
      detail::map_queries_into(map, raw_q_.transpose(), phi_q);
      detail::map_keys_into(map, raw_k_.transpose(), phi_k);
    }
    if (options_.check_finite) {
      detail::require_finite(query_, where, "phi(q)");
      detail::require_finite(key_, where, "phi(k)");
    }
  }

  /// The second half of a mapped step: advances by the token featurize_token left in the
  /// workspace. Throws nothing.
  template <class DV>
  void advance_featurized(const Eigen::MatrixBase<DV>& v, bool log_scaled,
                          Eigen::Ref<Vector<T>> out) {
    detail::load_vector(v, value_);
    advance(token_log_q_, token_log_k_, log_scaled || !carried_.unscaled(), out);
  }

  /// Validates one token and copies it into the step workspace (no allocation).
  template <class DQ, class DK, class DV>
  void load_token(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                  const Eigen::MatrixBase<DV>& v, const Eigen::Ref<Vector<T>>& out,
                  const char* where, const char* q_name, const char* k_name) {
    require_token_room(1, where);
    detail::require_vector(phi_q, feature_dim(), where, q_name);
    detail::require_vector(phi_k, feature_dim(), where, k_name);
    detail::require_vector(v, value_dim(), where, "v");
    detail::require_output_size(out, value_dim(), where);
    if (options_.check_finite) {
      detail::require_finite(phi_q, where, q_name);
      detail::require_finite(phi_k, where, k_name);
      detail::require_finite(v, where, "v");
    }
    detail::load_vector(phi_q, query_);
    detail::load_vector(phi_k, key_);
    detail::load_vector(v, value_);
  }

  /// The recurrence for the token in the workspace: S and z rescaled if the scale moves, then
  /// the stream kernel's one-token pass (update S, read S^T q in the same sweep).
  /// `scaled`: key_ and query_ miss exp(log_k) and exp(log_q), or the state carries a scale.
  void advance(double log_q, double log_k, bool scaled, Eigen::Ref<Vector<T>> out) {
    if constexpr (std::is_same_v<T, Acc>) {
      advance_in_accumulator(log_q, log_k, scaled, out);
    } else {
      advance_in_accumulator(log_q, log_k, scaled, output_);
      if constexpr (detail::is_half_scalar<T>) {
        detail::convert(output_.data(), out.data(), output_.size());
      } else {
        out = output_.template cast<T>();
      }
    }
  }

  void advance_in_accumulator(double log_q, double log_k, bool scaled,
                              Eigen::Ref<Vector<Acc>> out) {
    if (token_gate_ == TokenGate::feature) {
      advance_feature_gated(out);
      return;
    }
    carried_.fold_rows();
    const bool gated = token_gate_ == TokenGate::scalar;
    Acc carry = static_cast<Acc>(options_.decay);
    double new_log = 0.0;
    if (scaled || gated) {
      const double log_step = gated ? token_log_gate_ : std::log(options_.decay);
      new_log = detail::next_log_scale(carried_.log_scale, log_step, log_k,
                                       gated ? detail::kGateDrift : 0.0);
      carry = detail::exp_as<Acc>(carried_.log_scale + log_step - new_log);
      key_ *= detail::exp_as<Acc>(log_k - new_log);
    }
    if (carry != Acc(1)) {
      carried_.s *= carry;
      carried_.z *= carry;
    }
    carried_.log_scale = new_log;
    stream_token(log_q + new_log, out);
  }

  /// The stream kernel's one-token pass over the workspace (update S and z, read S^T q and
  /// q . z in the same sweep), then the output row, missing exp(log_factor) before the scale.
  void stream_token(double log_factor, Eigen::Ref<Vector<Acc>> out) {
    const Eigen::Index c = feature_dim();
    const Eigen::Index dv = value_dim();
    out.setZero();
    const detail::StreamOperands<Acc> operands{query_.data(),
                                               c,
                                               key_.data(),
                                               c,
                                               value_.data(),
                                               dv,
                                               carried_.s.data(),
                                               dv,
                                               out.data(),
                                               dv,
                                               1,
                                               c,
                                               dv};
    detail::stream_one_token(operands);
    const Acc den = detail::token_denominator(query_.data(), key_.data(), c, carried_.z.data());
    progress_.advance(1, token_transition());
    // out holds the numerator; normalising it in place is coefficient-wise.
    detail::write_output_row(out, den, log_factor + detail::output_log_scale(options_), options_,
                             out);
  }

  /// One token with per-feature gates (feature_log_gate_) and plain features: the pending
  /// row logs take the gates, and the stream runs on q exp(row_log), k exp(-row_log - L).
  void advance_feature_gated(Eigen::Ref<Vector<Acc>> out) {
    if (carried_.empty()) carried_.log_scale = 0.0;  // s and z are zero
    const double base = carried_.log_scale;
    carried_.settle_rows(carried_.row_log + feature_log_gate_, detail::kGateDrift);
    // The pending logs stay exact in double; the factors they give this token (within a
    // factor of e of 1) are taken in Acc, vectorised.
    feature_factor_ = carried_.row_log.template cast<Acc>();
    query_.array() *= feature_factor_.exp();
    if (base == 0.0) {
      key_.array() *= (-feature_factor_).exp();
    } else {
      key_.array() *= (-carried_.row_log - base).exp().template cast<Acc>();
    }
    stream_token(base, out);
  }

  /// The transition of the token being stepped: Options::decay, or the gate of a gated step.
  enum class TokenGate { decay, scalar, feature };

  /// Validates one token's gate (1 or C entries, in range) and keeps it, in log space, for
  /// the advance; nothing in the state moves.
  template <class Gate>
  void load_gate(const Gate& gate, const char* where) {
    using Traits = detail::gate_traits<Gate>;
    const auto& values = Traits::values(gate);
    if ((values.rows() != 1 && values.cols() != 1) ||
        (values.size() != 1 && values.size() != feature_dim())) {
      throw Error(std::string(where) + ": gate is " + detail::shape_string(values) +
                  ", expected a vector of " + std::to_string(feature_dim()) +
                  " entries (per feature) or 1 (scalar)");
    }
    detail::require_unit_decay(options_, where);
    detail::require_gates_in_range<Traits::log_space>(values, where, "gate");
    const auto log_of = [](double x) { return Traits::log_space ? x : std::log(x); };
    if (values.size() == 1) {
      token_gate_ = TokenGate::scalar;
      token_log_gate_ = log_of(static_cast<double>(values(0, 0)));
      return;
    }
    // The logs of gates a_t are taken in Acc over the whole vector (vectorised): a float log
    // of a float gate is within an ulp of the gate's own log; the sums stay in double.
    feature_factor_ = values.reshaped().template cast<Acc>();
    if constexpr (!Traits::log_space) feature_factor_ = feature_factor_.log();
    feature_log_gate_ = feature_factor_.template cast<double>();
    token_gate_ = TokenGate::feature;
  }

  /// One token into the step workspace: features as given (Identity) or through `map`, and v.
  template <class DQ, class DK, class DV, class Map>
  void load_any_token(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                      const Eigen::MatrixBase<DV>& v, const Map& map, Eigen::Ref<Vector<T>> out,
                      const char* where) {
    if constexpr (detail::is_identity_map<Map>) {
      load_token(q, k, v, out, where, "phi_q", "phi_k");
    } else {
      featurize_token(q, k, v, map, out.size(), where);
      detail::load_vector(v, value_);
    }
  }

  /// prior_ = S^T phi(q) for the query in the workspace, the state as it stands (no scale).
  void read_before() {
    if (prior_.size() != value_dim()) prior_.resize(value_dim());
    prior_.setZero();
    if (carried_.empty()) return;
    for (Eigen::Index c = 0; c < feature_dim(); ++c) {
      const Acc f = query_(c) * detail::exp_as<Acc>(carried_.log_scale + carried_.row_log(c));
      if (f != Acc(0)) prior_.noalias() += f * carried_.s.row(c).transpose();
    }
  }

  /// The bonus step of the token in the workspace (its gate loaded): out = s phi(q)^T (S +
  /// diag(u) phi(k) v^T) read before the token moves the state.
  template <class DU>
  void advance_bonus(const Eigen::MatrixBase<DU>& u, Eigen::Ref<Vector<T>> out) {
    const Acc weight = bonus_weight(u);
    read_before();
    if (discarded_.size() != value_dim()) discarded_.resize(value_dim());
    advance_in_accumulator(0.0, 0.0, true, discarded_);
    prior_ = static_cast<Acc>(options_.scale) * (prior_ + weight * value_);
    write_token_output(prior_, out);
  }

  /// (phi(q) o u) . phi(k) for the token in the workspace.
  template <class DU>
  Acc bonus_weight(const Eigen::MatrixBase<DU>& u) const {
    Acc weight(0);
    for (Eigen::Index c = 0; c < feature_dim(); ++c) {
      weight += query_(c) * static_cast<Acc>(u.reshaped()(c)) * key_(c);
    }
    return weight;
  }

  /// out = src, rounded to T.
  static void write_token_output(const Vector<Acc>& src, Eigen::Ref<Vector<T>> out) {
    if constexpr (std::is_same_v<T, Acc>) {
      out = src;
    } else if constexpr (detail::is_half_scalar<T>) {
      detail::convert(src.data(), out.data(), src.size());
    } else {
      out = src.template cast<T>();
    }
  }

  /// The kind of the token being stepped.
  TransitionKind token_transition() const {
    switch (token_gate_) {
      case TokenGate::scalar:
        return TransitionKind::scalar_gates;
      case TokenGate::feature:
        return TransitionKind::feature_gates;
      default:
        return TransitionKind::decay;
    }
  }

  /// Throws unless `kind` continues the state: the state has no kind yet, or the same one.
  void require_transition(TransitionKind kind, const char* where) const {
    progress_.require_continues(kind, where);
  }

  /// Puts the transition back to Options::decay when a gated step ends, thrown or not.
  class GateScope {
   public:
    explicit GateScope(RecurrentState& state) : state_(state) {}
    GateScope(const GateScope&) = delete;
    GateScope& operator=(const GateScope&) = delete;
    ~GateScope() { state_.token_gate_ = TokenGate::decay; }

   private:
    RecurrentState& state_;
  };

  /// A per-feature gated step takes plain features: folds an exponential map's log scales
  /// into the token's features, throwing (the state untouched) when they overflow.
  void unscale_token(const char* where) {
    if (token_log_q_ != 0.0) query_ *= detail::exp_as<Acc>(token_log_q_);
    if (token_log_k_ != 0.0) key_ *= detail::exp_as<Acc>(token_log_k_);
    token_log_q_ = 0.0;
    token_log_k_ = 0.0;
    if (!query_.allFinite() || !key_.allFinite()) {
      throw Error(std::string(where) +
                  ": the feature map's features overflow, and per-feature gates take plain "
                  "features: accumulate in double or scale the inputs down");
    }
  }

  template <class T2, class Acc2>
  friend class RecurrentStateBatch;
  friend struct detail::StateAccess;

  using Core::held_s;
  const detail::CarriedState<Acc>& held() const { return carried_; }

  /// The factor row c of the held sums misses, in Acc (0 before any token).
  Acc true_factor(Eigen::Index c, const char* what) const {
    if (carried_.empty()) return Acc(0);
    const double log_factor =
        carried_.log_scale + (carried_.rows_pending ? carried_.row_log(c) : 0.0);
    if (log_factor == 0.0) return Acc(1);
    const auto factor = static_cast<Acc>(std::exp(log_factor));
    if (!std::isfinite(factor)) overflow(what, log_factor);
    return factor;
  }

  template <class Derived>
  void require_representable(const Eigen::MatrixBase<Derived>& sums, const char* what) const {
    if (!sums.allFinite()) overflow(what, carried_.log_scale);
  }

  [[noreturn]] static void overflow(const char* what, double log_factor) {
    throw Error(std::string("RecurrentState::") + what + ": the true sums overflow " +
                (std::is_same_v<Acc, float> ? "float" : "double") + " (a scale of exp(" +
                detail::format_double(log_factor) +
                "), from an exponential feature map's large inputs): read sums(), which holds "
                "them as exp(log_scale) times finite sums");
  }

  /// The bonus prefill on validated input (gates: a gate argument, u: C weights) into `out`
  /// (N x Dv rows, any strides): row 0 reads the state as it stands; rows 1.. are the chunked
  /// form with queries one row ahead (each reads the state after the token before); the last
  /// token then only moves the state; every row adds its bonus term. On a throw the state is
  /// unchanged.
  template <class DQ, class DK, class DV, class Gates, class DU, class Map, class Out>
  void prefill_bonus(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                     const Eigen::MatrixBase<DV>& v, const Gates& gates,
                     const Eigen::MatrixBase<DU>& u, const Map& map, Out&& out, int threads,
                     const char* where) {
    const Eigen::Index n = q.rows();
    if (n == 0) return;
    RecurrentState next = *this;
    Vector<T> row(value_dim());
    next.load_any_token(q.row(0), k.row(0), v.row(0), map, row, where);
    next.read_before();
    next.prior_ *= static_cast<Acc>(options_.scale);
    write_token_output(next.prior_, row);
    out.row(0) = row.transpose();
    if (n > 1) {
      detail::with_gate_block(gates, 0, n - 1, [&](const auto& ahead) {
        const detail::GateMatrix<std::decay_t<decltype(ahead)>> gate_rows(ahead);
        detail::with_source<Acc>(q.bottomRows(n - 1), k.topRows(n - 1), v.topRows(n - 1), map,
                                 &gate_rows, options_.check_finite, where,
                                 [&](detail::ChunkSource<Acc>& source) {
                                   next.run_chunked(source, out.bottomRows(n - 1), threads);
                                 });
      });
    }
    detail::with_gate_row(gates, n - 1, [&](const auto& gate) {
      next.step_into(q.row(n - 1), k.row(n - 1), v.row(n - 1), gate, map, row);
    });
    detail::add_bonus<Acc>(q, k, v, u, map, options_, out, where);
    *this = std::move(next);
  }

  template <class OutRef>
  void run_chunked(const detail::ChunkSource<Acc>& source, OutRef&& out, int threads = 0) {
    const TransitionKind kind = detail::transition_of_gate_dim(source.gate_dim());
    require_transition(kind, "RecurrentState::prefill");
    require_token_room(source.rows(), "RecurrentState::prefill");
    // Work on a copy so a throw from a feature map leaves the state as it was.
    detail::CarriedState<Acc> next = carried_;
    const int usable = threads > 0 ? threads : detail::resolve_threads(options_);
    const detail::SerialEigenScope serial_eigen;
    detail::run_causal(source, next, out, options_, usable);
    carried_ = std::move(next);
    progress_.advance(source.rows(), kind);
  }

  Vector<Acc> query_, key_, value_;
  Vector<Acc> raw_q_, raw_k_;  ///< Dk: a mapped step's token in Acc, sized by the first one
  double token_log_q_ = 0.0, token_log_k_ = 0.0;  ///< its features' log scales
  Vector<Acc> output_;                            ///< Dv; used when Acc differs from T
  Vector<Acc> prior_, discarded_;  ///< Dv: a bonus step's readout before the token, the other
  TokenGate token_gate_ = TokenGate::decay;                   ///< the stepped token's transition
  double token_log_gate_ = 0.0;                               ///< its scalar log gate
  Eigen::Array<double, Eigen::Dynamic, 1> feature_log_gate_;  ///< C: its per-feature log gates
  Eigen::Array<Acc, Eigen::Dynamic, 1> feature_factor_;       ///< C: their logs, or factors, in Acc
};

/// The gated state of linattn 0.2.0 is RecurrentState: one state for every transition.
template <class T, class Acc = detail::default_accumulator_t<T>>
using GatedRecurrentState = RecurrentState<T, Acc>;

}  // namespace linattn
