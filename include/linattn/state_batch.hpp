// SPDX-License-Identifier: MIT
// Many recurrent states stepped together: one state per session (or per session and head),
// of the engine (RecurrentStateBatch) or of the delta rule (DeltaRuleStateBatch).
#pragma once

#include <algorithm>
#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/delta_rule.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/state_batch.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/recurrent_state.hpp>
#include <string>
#include <type_traits>
#include <vector>

namespace linattn {

/// `size()` independent RecurrentStates of the same shape and options, advanced by one call:
/// row i of every argument belongs to state i. For H heads of B sequences, state b * H + h
/// holds head h of sequence b (the order prefill_into uses). A step's q, k and v may be grouped
/// like the views' heads: B * H_in rows, state b * H + h reading row b * H_in + j with j =
/// h / (H / H_in), or h % H_in with Options::head_grouping tiled (Qwen3-Next's 16 q/k heads
/// over 32 v heads). A batch from a layer's make_states takes exactly the layer's H_in
/// (LayerHeads); one made by hand does not know its sequences and takes a row per state. Threads
/// (Options::threads, with OpenMP) go over the states; the result is the same as stepping each
/// state on its own.
/// T and Acc as for RecurrentState (Acc defaults to T, or to float for Eigen::half and
/// Eigen::bfloat16).
template <class T, class Acc = detail::default_accumulator_t<T>>
class RecurrentStateBatch : public detail::StateBatch<RecurrentState<T, Acc>> {
  using Base = detail::StateBatch<RecurrentState<T, Acc>>;
  using Base::input_row;
  using Base::require_rows;
  using Base::states_;

 public:
  /// The type of each state.
  using State = RecurrentState<T, Acc>;
  using Base::size;
  using Base::value_dim;

  /// @param count        number of states, >= 1
  /// @param feature_dim  C of every state
  /// @param value_dim    Dv of every state
  /// @param options      shared by every state (and Options::threads for the batch calls)
  RecurrentStateBatch(Eigen::Index count, Eigen::Index feature_dim, Eigen::Index value_dim,
                      const Options& options = {})
      : Base(count, State(feature_dim, value_dim, options), "RecurrentStateBatch") {}

  /// States with a constant decay per head (RetNet's multi-scale retention): state i decays
  /// by decays.values[i % H] (H = decays.values.size()), so state b * H + h is head h of
  /// sequence b, as prefill_into orders them. Each state keeps its decay in its own options;
  /// the batch's other options are shared.
  /// @param count        number of states, a multiple of H
  /// @param feature_dim  C of every state
  /// @param value_dim    Dv of every state
  /// @param decays       H decays in (0, 1]
  /// @param options      shared by every state; Options::decay must be 1
  RecurrentStateBatch(Eigen::Index count, Eigen::Index feature_dim, Eigen::Index value_dim,
                      const HeadDecays& decays, const Options& options = {})
      : RecurrentStateBatch(count, feature_dim, value_dim, options) {
    constexpr const char* where = "RecurrentStateBatch";
    const Eigen::Index heads = static_cast<Eigen::Index>(decays.values.size());
    if (heads < 1 || count % heads != 0) {
      throw Error(std::string(where) + ": count " + std::to_string(count) +
                  " must be a positive multiple of the " + std::to_string(heads) +
                  " heads of HeadDecays");
    }
    detail::validate_transition(decays, HeadShape{count / heads, heads, 1, feature_dim}, options,
                                where);
    for (Eigen::Index i = 0; i < count; ++i) {
      Options head = options;
      head.decay = decays.values[static_cast<std::size_t>(i % heads)];
      states_[static_cast<std::size_t>(i)] = State(feature_dim, value_dim, head);
    }
  }

  /// C of every state.
  Eigen::Index feature_dim() const { return states_.front().feature_dim(); }
  /// The options shared by every state (state 0's: with HeadDecays each state has its own
  /// decay).
  const Options& options() const { return states_.front().options(); }

  /// One token for every state through a feature map (Identity{} for precomputed features).
  /// Every state and every input is checked, and every token featurized, before any state
  /// moves: a throwing call changes nothing.
  /// @param q    size() x Dk queries, row i for state i (or (B * H_in) x Dk, grouped)
  /// @param k    size() x Dk keys (or (B * H_in) x Dk, grouped)
  /// @param v    size() x Dv values (or (B * H_in) x Dv, grouped)
  /// @param map  feature map with map.feature_dim(Dk) == C
  /// @param out  size() x Dv outputs, row-major
  template <class DQ, class DK, class DV, class Map>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Map& map, Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "RecurrentStateBatch::step";
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      constexpr bool features = detail::is_identity_map<Map>;
      check_rows(q, k, v, out, features ? feature_dim() : q.cols(), where, features ? "phi_q" : "q",
                 features ? "phi_k" : "k");
      require_transitions(TransitionKind::decay, where);
      if constexpr (detail::is_identity_map<Map>) {
        for_each_state([&](Eigen::Index i) {
          states_[i].step_into(q.row(input_row(q.rows(), i)), k.row(input_row(k.rows(), i)),
                               v.row(input_row(v.rows(), i)), map, out.row(i).transpose());
        });
      } else {
        // Every state featurizes its token (which can throw) before any state advances.
        for_each_state([&](Eigen::Index i) {
          states_[i].featurize_token(q.row(input_row(q.rows(), i)), k.row(input_row(k.rows(), i)),
                                     v.row(input_row(v.rows(), i)), map, value_dim(), where);
        });
        constexpr bool log_scaled = detail::is_log_scaled<Map>::value;
        for_each_state([&](Eigen::Index i) {
          states_[i].advance_featurized(v.row(input_row(v.rows(), i)), log_scaled,
                                        out.row(i).transpose());
        });
      }
    }
  }

  /// One gated token for every state: row i of `gates` moves state i, as its gated step
  /// would (Options::decay must be 1). Every state, input and gate is checked, and every
  /// token featurized, before any state moves: a throwing call changes nothing.
  /// @param q      size() x Dk queries, row i for state i (features, with Identity), or R x Dk
  ///               grouped
  /// @param k      size() x Dk keys (or (B * H_in) x Dk, grouped)
  /// @param v      size() x Dv values (or (B * H_in) x Dv, grouped)
  /// @param gates  size() x 1 or size() x C gates a_t in (0, 1], or log_gates(g) with g <= 0
  /// @param map    feature map with map.feature_dim(Dk) == C
  /// @param out    size() x Dv outputs, row-major
  template <class DQ, class DK, class DV, class Gates, class Map,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Gates& gates, const Map& map,
                 Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "RecurrentStateBatch::step";
    static_assert(std::is_same_v<detail::gate_scalar_t<Gates>, T>,
                  "the gates must have the states' input scalar type");
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      constexpr bool features = detail::is_identity_map<Map>;
      check_rows(q, k, v, out, features ? feature_dim() : q.cols(), where, features ? "phi_q" : "q",
                 features ? "phi_k" : "k");
      detail::validate_gates(gates, size(), feature_dim(), options(), where);
      require_unit_decays(where);
      const bool per_feature = detail::gate_traits<Gates>::values(gates).cols() > 1;
      require_transitions(
          per_feature ? TransitionKind::feature_gates : TransitionKind::scalar_gates, where);
      if constexpr (!features) {
        // Every state featurizes its token (which can throw) before any state advances.
        for_each_state([&](Eigen::Index i) {
          State& state = states_[i];
          state.featurize_token(q.row(input_row(q.rows(), i)), k.row(input_row(k.rows(), i)),
                                v.row(input_row(v.rows(), i)), map, value_dim(), where);
          if (per_feature) state.unscale_token(where);
        });
      }
      for_each_state([&](Eigen::Index i) {
        detail::with_gate_row(gates, i, [&](const auto& gate) {
          if constexpr (features) {
            states_[i].step_into(q.row(input_row(q.rows(), i)), k.row(input_row(k.rows(), i)),
                                 v.row(input_row(v.rows(), i)), gate, map, out.row(i).transpose());
          } else {
            State& state = states_[i];
            state.load_gate(gate, where);
            const typename State::GateScope scope(state);
            state.advance_featurized(v.row(input_row(v.rows(), i)), true, out.row(i).transpose());
          }
        });
      });
    }
  }

  /// One token with RWKV-6's bonus for every state (with_bonus(gates, u)): row i of `gates`
  /// moves state i, which reads row i % R of u (R rows: one per head, state b * H + h reading
  /// row h, or one per state), as its bonus step would. Options::normalize must be false, the
  /// map plain. Everything is checked, and every token featurized, before any state moves.
  /// @param q      size() x Dk receptances (queries), row i for state i (features, with
  ///               Identity), or R x Dk grouped
  /// @param k      size() x Dk keys (or (B * H_in) x Dk, grouped)
  /// @param v      size() x Dv values (or (B * H_in) x Dv, grouped)
  /// @param gates  with_bonus(gates, u): gates size() x 1 or size() x C (a_t, or log_gates(w)),
  ///               u R x C: R = H (a row per head) in a layer's batch, R = size(), or in a
  ///               batch made by hand R dividing size() (state i reads row i % R)
  /// @param map    a plain feature map with map.feature_dim(Dk) == C
  /// @param out    size() x Dv outputs, row-major
  template <class DQ, class DK, class DV, class Gates, class DU, class Map>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const BonusGates<Gates, DU>& gates, const Map& map,
                 Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "RecurrentStateBatch::step";
    static_assert(std::is_same_v<detail::gate_scalar_t<Gates>, T>,
                  "the gates must have the states' input scalar type");
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      detail::require_plain_features<Map>();
      constexpr bool features = detail::is_identity_map<Map>;
      check_rows(q, k, v, out, features ? feature_dim() : q.cols(), where, features ? "phi_q" : "q",
                 features ? "phi_k" : "k");
      detail::validate_gates(gates.gates(), size(), feature_dim(), options(), where);
      const DU& u = gates.bonus();
      const Eigen::Index heads = this->layer_heads().out;  // 0: a batch made by hand
      const bool rows_ok = this->knows_heads() ? u.rows() == heads || u.rows() == size()
                                               : u.rows() >= 1 && size() % u.rows() == 0;
      if (!rows_ok || u.cols() != feature_dim()) {
        throw Error(std::string(where) + ": the bonus u is " + detail::shape_string(u) +
                    " but must be R x " + std::to_string(feature_dim()) +
                    (this->knows_heads()
                         ? " with R = " + std::to_string(heads) + " (one row per head) or " +
                               std::to_string(size()) + " (one per state)"
                         : " with R dividing the batch's " + std::to_string(size()) +
                               " states (state i reads row i % R)"));
      }
      detail::validate_bonus(u.reshaped(), u.size(), options(), where);
      require_unit_decays(where);
      const bool per_feature = detail::gate_traits<Gates>::values(gates.gates()).cols() > 1;
      require_transitions(
          per_feature ? TransitionKind::feature_gates : TransitionKind::scalar_gates, where);
      // Every state featurizes its token (which can throw) before any state advances.
      for_each_state([&](Eigen::Index i) {
        State& state = states_[i];
        if constexpr (features) {
          state.load_token(q.row(input_row(q.rows(), i)), k.row(input_row(k.rows(), i)),
                           v.row(input_row(v.rows(), i)), out.row(i).transpose(), where, "phi_q",
                           "phi_k");
        } else {
          state.featurize_token(q.row(input_row(q.rows(), i)), k.row(input_row(k.rows(), i)),
                                v.row(input_row(v.rows(), i)), map, value_dim(), where);
          detail::load_vector(v.row(input_row(v.rows(), i)), state.value_);
        }
      });
      for_each_state([&](Eigen::Index i) {
        detail::with_gate_row(gates.gates(), i, [&](const auto& gate) {
          State& state = states_[i];
          state.load_gate(gate, where);
          const typename State::GateScope scope(state);
          state.advance_bonus(u.row(i % u.rows()), out.row(i).transpose());
        });
      });
    }
  }

  /// As step_into, returning size() x Dv.
  template <class DQ, class DK, class DV, class Map = detail::MissingFeatureMap>
  Matrix<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Map& map = {}) {
    Matrix<T> out(size(), value_dim());
    step_into(q, k, v, map, out);
    return out;
  }

  /// A prompt for every state from multi-head views through the chunked form: state
  /// b * H + h takes head h of sequence b and ends where stepping each token would leave it.
  /// This is the parallel routine with initial states in and final states out.
  /// @param q    B x H x N x Dk queries, B * H == size() (features, with Identity)
  /// @param k    B x H x N x Dk keys
  /// @param v    B x H x N x Dv values
  /// @param map  feature map (Identity{} for precomputed features)
  /// @param out  B x H x N x Dv outputs
  template <class Q, class K, class V, class Map, class O,
            class = detail::enable_if_heads_scalars<Q, K, V, O>>
  void prefill_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const Map& map, const HeadsView<O>& out) {
    prefill_dispatch(q, k, v, map, out, detail::UniformDecay{}, nullptr);
  }

  /// A gated prompt for every state from multi-head views: state b * H + h takes head h of
  /// sequence b with gates.head(b, h), and ends where its gated steps would leave it
  /// (Options::decay must be 1).
  /// @param q      B x H x N x Dk queries, B * H == size() (features, with Identity)
  /// @param k      B x H x N x Dk keys
  /// @param v      B x H x N x Dv values
  /// @param gates  B x H x N x 1 or B x H x N x C gates a_t in (0, 1], or log_gates(view)
  /// @param map    feature map (Identity{} for precomputed features)
  /// @param out    B x H x N x Dv outputs
  template <class Q, class K, class V, class Gates, class Map, class O,
            class = detail::enable_if_heads_scalars<Q, K, V, O>,
            class = std::enable_if_t<detail::head_transition<Gates, O>::valid &&
                                     !std::is_same_v<Gates, HeadDecays>>>
  void prefill_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const Gates& gates, const Map& map, const HeadsView<O>& out) {
    prefill_dispatch(q, k, v, map, out, detail::head_transition<Gates, O>::read(gates), nullptr);
  }

  /// Prompts of different lengths packed along N (FLA's cu_seqlens), one per sequence: state
  /// s * H + h takes head h of sequence s (rows offsets[s] to offsets[s + 1]) and continues
  /// from where it is, as prefill_into; an empty sequence leaves its states as they are.
  /// @param q        1 x H x T x Dk queries, T = offsets.back() (features, with Identity)
  /// @param k        1 x H x T x Dk keys
  /// @param v        1 x H x T x Dv values
  /// @param map      feature map (Identity{} for precomputed features)
  /// @param offsets  S + 1 nondecreasing offsets from 0 to T
  /// @param out      1 x H x T x Dv outputs, S * H == size() for S sequences
  template <class Q, class K, class V, class Map, class O,
            class = detail::enable_if_heads_scalars<Q, K, V, O>>
  void prefill_varlen_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                           const Map& map, const std::vector<std::int64_t>& offsets,
                           const HeadsView<O>& out) {
    prefill_dispatch(q, k, v, map, out, detail::UniformDecay{}, &offsets);
  }

  /// Gated prompts of different lengths packed along N, as the plain varlen prefill: state
  /// s * H + h takes head h of sequence s with its rows of gates' head h (Options::decay must
  /// be 1).
  /// @param q        1 x H x T x Dk queries, T = offsets.back() (features, with Identity)
  /// @param k        1 x H x T x Dk keys
  /// @param v        1 x H x T x Dv values
  /// @param gates    1 x H x T x 1 or 1 x H x T x C gates a_t in (0, 1], or log_gates(view); or
  ///                 with_bonus(either, u) with u H x C (RWKV-6; normalize false, a plain map)
  /// @param map      feature map (Identity{} for precomputed features)
  /// @param offsets  S + 1 nondecreasing offsets from 0 to T
  /// @param out      1 x H x T x Dv outputs, S * H == size() for S sequences
  template <class Q, class K, class V, class Gates, class Map, class O,
            class = detail::enable_if_heads_scalars<Q, K, V, O>,
            class = std::enable_if_t<detail::head_transition<Gates, O>::valid &&
                                     !std::is_same_v<Gates, HeadDecays>>>
  void prefill_varlen_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                           const Gates& gates, const Map& map,
                           const std::vector<std::int64_t>& offsets, const HeadsView<O>& out) {
    prefill_dispatch(q, k, v, map, out, detail::head_transition<Gates, O>::read(gates), &offsets);
  }

 private:
  /// Shapes, finiteness and token room of a batch step, before any state moves.
  template <class DQ, class DK, class DV>
  void check_rows(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                  const Eigen::MatrixBase<DV>& v, const Eigen::Ref<Matrix<T>>& out,
                  Eigen::Index q_cols, const char* where, const char* q_name,
                  const char* k_name) const {
    static_assert(std::is_same_v<typename DQ::Scalar, T> &&
                      std::is_same_v<typename DK::Scalar, T> &&
                      std::is_same_v<typename DV::Scalar, T>,
                  "RecurrentStateBatch<T>: inputs must have scalar type T");
    // Inputs may be grouped (the layer's head counts); out has a row per state.
    require_rows(q.rows(), q.cols(), q_cols, detail::shape_string(q), q_name, &LayerHeads::query,
                 where);
    require_rows(k.rows(), k.cols(), q_cols, detail::shape_string(k), k_name, &LayerHeads::key,
                 where);
    require_rows(v.rows(), v.cols(), value_dim(), detail::shape_string(v), "v", &LayerHeads::value,
                 where);
    require_rows(out.rows(), out.cols(), value_dim(), detail::shape_string(out), "out", nullptr,
                 where);
    if (options().check_finite) {
      detail::require_finite(q, where, q_name);
      detail::require_finite(k, where, k_name);
      detail::require_finite(v, where, "v");
    }
    require_uniform_states(where);
    for (const State& state : states_) state.require_token_room(1, where);
  }

  /// Throws unless every state has the batch's dimensions (a state assigned through
  /// operator[] may not), so that no state moves before another one throws.
  void require_uniform_states(const char* where) const {
    this->require_uniform_dims("C x Dv", where);
  }

  /// Throws unless every state's Options::decay is 1, as gates need (HeadDecays states and
  /// states assigned through operator[] may have their own), before any state moves.
  void require_unit_decays(const char* where) const {
    for (std::size_t i = 0; i < states_.size(); ++i) {
      if (states_[i].options().decay != 1.0) {
        throw Error(std::string(where) + ": state " + std::to_string(i) + " has Options::decay " +
                    std::to_string(states_[i].options().decay) +
                    "; gates replace the decay, so every state's must be 1");
      }
    }
  }

  /// Throws unless every state continues with `kind` (see RecurrentState::transition()),
  /// before any state moves.
  void require_transitions(TransitionKind kind, const char* where) const {
    Base::require_transitions(kind, detail::transition_name, where);
  }

  /// body(i) for every state, the states split in equal blocks across the threads.
  template <class Body>
  void for_each_state(const Body& body) {
    Base::for_each_state(detail::resolve_threads(options()), body);
  }

  /// The view prefills: checks the map concept, then reads Identity inputs in place as
  /// features and featurizes any other map chunk by chunk (`offsets` for packed sequences).
  template <class Q, class K, class V, class Map, class O, class Transition>
  void prefill_dispatch(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                        const Map& map, const HeadsView<O>& out, const Transition& transition,
                        const std::vector<std::int64_t>* offsets) {
    static_assert(std::is_same_v<O, T>, "RecurrentStateBatch<T>: views must hold T");
    if constexpr (detail::check_feature_map<Map, Acc>()) {
      if constexpr (detail::is_identity_map<Map>) {
        prefill_heads(q, k, v, static_cast<const void*>(nullptr), out, transition, offsets, "phi_q",
                      "phi_k");
      } else {
        prefill_heads(q, k, v, &map, out, transition, offsets, "q", "k");
      }
    }
  }

  template <class Map, class Transition>
  void prefill_heads(const ConstHeadsView<T>& q, const ConstHeadsView<T>& k,
                     const ConstHeadsView<T>& v, const Map* map, const HeadsView<T>& out,
                     const Transition& transition, const std::vector<std::int64_t>* offsets,
                     const char* q_name, const char* k_name) {
    const char* where =
        offsets ? "RecurrentStateBatch::prefill_varlen" : "RecurrentStateBatch::prefill";
    detail::validate_heads(q, k, v, out, value_dim(), options(), where, q_name, k_name);
    this->require_view_heads(q.heads(), k.heads(), v.heads(), out.heads(), where);
    if (v.dim() != value_dim()) {
      throw Error(std::string(where) + ": v is " + v.sizes_string() +
                  " but the states hold Dv = " + std::to_string(value_dim()));
    }
    // B sequences of N tokens, or (offsets, checked) the packed sequences of a B = 1 view.
    const detail::SequenceRows sequences = detail::sequence_rows(q, offsets, where, q_name);
    if (sequences.count * out.heads() != size()) {
      throw Error(std::string(where) + ": out is " + out.sizes_string() +
                  (offsets ? " over S = " + std::to_string(sequences.count) + " sequences, S x H = "
                           : ", B x H = ") +
                  std::to_string(sequences.count * out.heads()) + " heads, but the batch holds " +
                  std::to_string(size()) + " states");
    }
    Eigen::Index features = q.dim();
    if constexpr (!std::is_same_v<Map, void>) features = map->feature_dim(q.dim());
    if (features != feature_dim()) {
      throw Error(std::string(where) + ": " + q_name + " gives " + std::to_string(features) +
                  " features per token but the states hold " + std::to_string(feature_dim()));
    }
    if constexpr (detail::is_head_bonus<Transition> && !std::is_same_v<Map, void>) {
      detail::require_plain_features<Map>();
    }
    detail::validate_transition(transition,
                                HeadShape{out.batch(), out.heads(), out.tokens(), feature_dim()},
                                options(), where);
    require_uniform_states(where);
    if constexpr (!std::is_same_v<Transition, detail::UniformDecay>) require_unit_decays(where);
    require_transitions(detail::transition_kind(transition), where);
    for (Eigen::Index i = 0; i < size(); ++i) {
      states_[static_cast<std::size_t>(i)].require_token_room(sequences.rows(i / out.heads()),
                                                              where);
    }
    detail::scan_transition(transition, detail::resolve_threads(options()), where);
    detail::scan_heads(q, k, v, options(), where, q_name, k_name);
    // Each state works on a copy and is replaced only when every head succeeded; an empty
    // sequence's heads are not run, so their states stay as they were.
    std::vector<State> next = states_;
    if constexpr (detail::is_head_bonus<Transition>) {
      detail::for_each_sequence_head(
          q, k, v, out, sequences, options(),
          [&](Eigen::Index s, Eigen::Index h, const auto& qs, const auto& ks, const auto& vs,
              auto os, int threads) {
            State& state = next[static_cast<std::size_t>(s * out.heads() + h)];
            const Eigen::Index b = sequences.batch_of(s), begin = sequences.begin(s);
            detail::with_map(map, [&](const auto& head_map) {
              const auto gates = transition.gates.view.head(b, h).middleRows(begin, qs.rows());
              if constexpr (Transition::log_space) {
                state.prefill_bonus(qs, ks, vs, LogGates<std::decay_t<decltype(gates)>>(gates),
                                    transition.u.row(h), head_map, os, threads, where);
              } else {
                state.prefill_bonus(qs, ks, vs, gates, transition.u.row(h), head_map, os, threads,
                                    where);
              }
            });
          });
    } else {
      // Every other transition through the view driver compiled once: only the map's token
      // source is built here.
      detail::with_map(map, [&](const auto& head_map) {
        using HeadMapType = std::decay_t<decltype(head_map)>;
        const detail::HeadSourcesOf<Acc, T, HeadMapType> sources(head_map);
        detail::for_each_head_source<Acc, T>(
            q, k, v, out, sequences, sources, detail::any_transition<T>(transition), options(),
            where,
            [&](Eigen::Index s, Eigen::Index h, detail::ChunkSource<Acc>& source,
                const detail::ChunkSource<Acc>*, detail::OutRows<T> os, int threads,
                const Options&) {
              next[static_cast<std::size_t>(s * out.heads() + h)].run_chunked(source, os, threads);
            });
      });
    }
    states_ = std::move(next);
  }
};

/// `size()` independent DeltaRuleStates of the same shape and options, advanced by one call:
/// row i of every argument belongs to state i, and state b * H + h holds head h of sequence b
/// (the order prefill_into uses). q, k and v may be grouped like the views' heads, as in
/// RecurrentStateBatch (exactly the layer's counts in a batch from make_states; Qwen3-Next's 16
/// q/k heads over 32 value heads); beta, the gates and out have a row per state. Threads
/// (DeltaOptions::threads, with OpenMP) go over the states; the result is the same as stepping each
/// state on its own. Every call checks every state and input before any state moves: a throwing
/// call changes nothing. The calls run with state 0's chunk, form and threads (a prefill works on a
/// copy of the states, swapped in when every head is done), and scan for NaN and Inf when any
/// state's check_finite is on.
/// @tparam T    float, double, Eigen::half or Eigen::bfloat16: the inputs' and outputs' type
/// @tparam Acc  the states' type, float or double (default T, or float for the 16-bit types)
template <class T, class Acc = detail::default_accumulator_t<T>>
class DeltaRuleStateBatch : public detail::StateBatch<DeltaRuleState<T, Acc>> {
  using Base = detail::StateBatch<DeltaRuleState<T, Acc>>;
  using Base::input_row;
  using Base::require_rows;
  using Base::states_;

 public:
  /// The type of each state.
  using State = DeltaRuleState<T, Acc>;
  using Base::size;
  using Base::value_dim;

  /// @param count      number of states, >= 1
  /// @param key_dim    Dk of every state
  /// @param value_dim  Dv of every state
  /// @param options    shared by every state (and DeltaOptions::threads for the batch calls)
  DeltaRuleStateBatch(Eigen::Index count, Eigen::Index key_dim, Eigen::Index value_dim,
                      const DeltaOptions& options = {})
      : Base(count, State(key_dim, value_dim, options), "DeltaRuleStateBatch") {}

  /// Dk of every state.
  Eigen::Index key_dim() const { return states_.front().key_dim(); }
  /// The options shared by every state (state 0's).
  const DeltaOptions& options() const { return states_.front().options(); }

  /// DeltaNet: one token for every state.
  /// @param q     size() x Dk queries, row i for state i (or (B * H_in) x Dk, grouped)
  /// @param k     size() x Dk keys (or (B * H_in) x Dk, grouped)
  /// @param v     size() x Dv values (or (B * H_in) x Dv, grouped)
  /// @param beta  size() learning rates, one per state (a row or column vector)
  /// @param out   size() x Dv outputs, row-major
  template <class DQ, class DK, class DV, class DB>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
                 Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "DeltaRuleStateBatch::step";
    check_step(q, k, v, beta, out, where);
    require_transitions(TransitionKind::decay, where);
    for_each_state([&](Eigen::Index i) {
      State& state = states_[static_cast<std::size_t>(i)];
      state.load_token(q.row(input_row(q.rows(), i)), k.row(input_row(k.rows(), i)),
                       v.row(input_row(v.rows(), i)));
      state.advance(static_cast<T>(beta.reshaped()(i)), 0, out.row(i).transpose());
    });
  }

  /// Gated DeltaNet and KDA: one gated token for every state, row i of `gates` moving state i.
  /// @param q      size() x Dk queries, row i for state i (or (B * H_in) x Dk, grouped)
  /// @param k      size() x Dk keys (or (B * H_in) x Dk, grouped)
  /// @param v      size() x Dv values (or (B * H_in) x Dv, grouped)
  /// @param gates  size() x 1 (Gated DeltaNet) or size() x Dk (KDA): log_gates(g) or a_t
  /// @param beta   size() learning rates, one per state
  /// @param out    size() x Dv outputs, row-major
  template <class DQ, class DK, class DV, class Gates, class DB,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Gates& gates,
                 const Eigen::MatrixBase<DB>& beta, Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "DeltaRuleStateBatch::step";
    using Traits = detail::gate_traits<Gates>;
    static_assert(std::is_same_v<detail::gate_scalar_t<Gates>, T>,
                  "the gates must have the states' input scalar type");
    check_step(q, k, v, beta, out, where);
    detail::validate_delta_gates(gates, size(), key_dim(), where);
    const auto& values = Traits::values(gates);
    require_transitions(detail::transition_of_gate_dim(values.cols()), where);
    for_each_state([&](Eigen::Index i) {
      State& state = states_[static_cast<std::size_t>(i)];
      state.load_token(q.row(input_row(q.rows(), i)), k.row(input_row(k.rows(), i)),
                       v.row(input_row(v.rows(), i)));
      state.template load_gates<Traits::log_space>(values.row(i));
      state.advance(static_cast<T>(beta.reshaped()(i)), values.cols(), out.row(i).transpose());
    });
  }

  /// DeltaNet: as step_into, returning size() x Dv.
  template <class DQ, class DK, class DV, class DB>
  Matrix<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta) {
    Matrix<T> out(size(), value_dim());
    step_into(q, k, v, beta, out);
    return out;
  }

  /// Gated DeltaNet and KDA: as step_into, returning size() x Dv.
  template <class DQ, class DK, class DV, class Gates, class DB,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  Matrix<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Gates& gates,
                 const Eigen::MatrixBase<DB>& beta) {
    Matrix<T> out(size(), value_dim());
    step_into(q, k, v, gates, beta, out);
    return out;
  }

  /// DeltaNet: a prompt for every state from multi-head views: state b * H + h takes head h
  /// of sequence b from where it is and ends where stepping each token would leave it (FLA's
  /// initial_state in, final_state out).
  /// @param q     B x H_in x N x Dk queries, H_in dividing H (the layer's count in its batches)
  /// @param k     B x H_in x N x Dk keys
  /// @param v     B x H_in x N x Dv values
  /// @param beta  B x H x N x 1 learning rates
  /// @param out   B x H x N x Dv outputs, B * H == size()
  template <class Q, class K, class V, class B, class O,
            class = detail::enable_if_heads_scalars<Q, K, V, O>>
  void prefill_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const HeadsView<B>& beta, const HeadsView<O>& out) {
    prefill_heads(q, k, v, static_cast<const void*>(nullptr), beta, out, nullptr);
  }

  /// Gated DeltaNet and KDA: a gated prompt for every state from multi-head views, as the
  /// DeltaNet prefill.
  /// @param gates  B x H x N x 1 or B x H x N x Dk views of a_t, or log_gates(view)
  template <class Q, class K, class V, class Gates, class B, class O,
            class = detail::enable_if_heads_scalars<Q, K, V, O>,
            class = detail::enable_if_delta_head_gates<Gates, O>>
  void prefill_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const Gates& gates, const HeadsView<B>& beta, const HeadsView<O>& out) {
    const auto transition = detail::delta_head_gates<Gates, O>::read(gates);
    prefill_heads(q, k, v, &transition, beta, out, nullptr);
  }

  /// DeltaNet: prompts of different lengths packed along N (FLA's cu_seqlens), one per
  /// sequence: state s * H + h takes head h of sequence s (rows offsets[s] to
  /// offsets[s + 1]) and continues from where it is.
  /// @param q        1 x H_in x T x Dk queries, T = offsets.back()
  /// @param k        1 x H_in x T x Dk keys
  /// @param v        1 x H_in x T x Dv values
  /// @param beta     1 x H x T x 1 learning rates
  /// @param offsets  S + 1 nondecreasing offsets from 0 to T
  /// @param out      1 x H x T x Dv outputs, S * H == size() for S sequences
  template <class Q, class K, class V, class B, class O,
            class = detail::enable_if_heads_scalars<Q, K, V, O>>
  void prefill_varlen_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                           const HeadsView<B>& beta, const std::vector<std::int64_t>& offsets,
                           const HeadsView<O>& out) {
    prefill_heads(q, k, v, static_cast<const void*>(nullptr), beta, out, &offsets);
  }

  /// Gated DeltaNet and KDA: packed prompts of different lengths, as the DeltaNet varlen
  /// prefill.
  /// @param gates  1 x H x T x 1 or 1 x H x T x Dk views of a_t, or log_gates(view)
  template <class Q, class K, class V, class Gates, class B, class O,
            class = detail::enable_if_heads_scalars<Q, K, V, O>,
            class = detail::enable_if_delta_head_gates<Gates, O>>
  void prefill_varlen_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                           const Gates& gates, const HeadsView<B>& beta,
                           const std::vector<std::int64_t>& offsets, const HeadsView<O>& out) {
    const auto transition = detail::delta_head_gates<Gates, O>::read(gates);
    prefill_heads(q, k, v, &transition, beta, out, &offsets);
  }

 private:
  /// Shapes, beta's range, finiteness and the states' agreement, before any state moves.
  template <class DQ, class DK, class DV, class DB>
  void check_step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                  const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
                  const Eigen::Ref<Matrix<T>>& out, const char* where) const {
    detail::check_delta_scalars<DQ, DK, DV, DB>();
    static_assert(std::is_same_v<typename DQ::Scalar, T>,
                  "DeltaRuleStateBatch<T>: inputs must have scalar type T");
    require_rows(q.rows(), q.cols(), key_dim(), detail::shape_string(q), "q", &LayerHeads::query,
                 where);
    require_rows(k.rows(), k.cols(), key_dim(), detail::shape_string(k), "k", &LayerHeads::key,
                 where);
    require_rows(v.rows(), v.cols(), value_dim(), detail::shape_string(v), "v", &LayerHeads::value,
                 where);
    require_rows(out.rows(), out.cols(), value_dim(), detail::shape_string(out), "out", nullptr,
                 where);
    detail::require_vector(beta, size(), where, "beta");
    detail::require_beta_in_range(beta, options(), where, "beta", "state");
    if (checks_finite()) {
      detail::require_finite(q, where, "q");
      detail::require_finite(k, where, "k");
      detail::require_finite(v, where, "v");
    }
    detail::require_stable_steps(k, beta, options(), where, "k", "state");
    require_uniform_states(where);
    for (const State& state : states_) state.require_token_room(1, where);
  }

  /// Throws unless every state has state 0's dimensions and the options that change results
  /// (a state assigned through operator[] may not), so that no state moves before another
  /// throws.
  void require_uniform_states(const char* where) const {
    this->require_uniform_dims("Dk x Dv", where);
    for (std::size_t i = 0; i < states_.size(); ++i) {
      if (!detail::same_delta_results(states_[i].options(), options(), key_dim())) {
        throw Error(std::string(where) + ": state " + std::to_string(i) +
                    " has other scale, l2_normalize or allow_negative_eigenvalues options than "
                    "state 0; every state of a batch must have the same");
      }
    }
  }

  void require_transitions(TransitionKind kind, const char* where) const {
    Base::require_transitions(kind, detail::delta_transition_name, where);
  }

  /// True when any state checks its inputs for NaN and Inf (DeltaOptions::check_finite): a
  /// state that asked for the scan gets it whatever state 0 says.
  bool checks_finite() const {
    return std::any_of(states_.begin(), states_.end(),
                       [](const State& state) { return state.options().check_finite; });
  }

  /// body(i) for every state, the states split in equal blocks across the threads; past
  /// kPrefetchBytes of states, each fetching the next one's S while it runs (which costs up to
  /// a tenth of a step whose states are in cache, and saves a quarter past the L3).
  template <class Body>
  void for_each_state(const Body& body) {
    constexpr std::size_t kPrefetchBytes = std::size_t(16) << 20;
    Base::for_each_state(detail::resolve_threads(detail::engine_options(options())), body,
                         this->state_bytes() > kPrefetchBytes);
  }

  /// The view prefills (`gates` null for DeltaNet, `offsets` for packed sequences).
  template <class Q, class K, class V, class Gates, class B, class O>
  void prefill_heads(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                     const Gates* gates, const HeadsView<B>& beta, const HeadsView<O>& out,
                     const std::vector<std::int64_t>* offsets) {
    constexpr const char* where = "DeltaRuleStateBatch::prefill";
    static_assert(std::is_same_v<O, T>, "DeltaRuleStateBatch<T>: views must hold T");
    if (q.dim() != key_dim() || v.dim() != value_dim()) {
      throw Error(std::string(where) + ": q is " + q.sizes_string() + " and v " + v.sizes_string() +
                  " but the states are Dk x Dv = " + detail::shape_string(key_dim(), value_dim()));
    }
    this->require_view_heads(q.heads(), k.heads(), v.heads(), out.heads(), where);
    DeltaOptions run_options = options();
    run_options.check_finite = checks_finite();
    const detail::SequenceRows sequences =
        detail::check_heads_delta_rule<Acc>(q, k, v, gates, beta, out, offsets, run_options, where);
    if (sequences.count * out.heads() != size()) {
      throw Error(std::string(where) + ": out is " + out.sizes_string() + ", " +
                  std::to_string(sequences.count) + " sequences x " + std::to_string(out.heads()) +
                  " heads, but the batch holds " + std::to_string(size()) + " states");
    }
    require_uniform_states(where);
    Eigen::Index gate_dim = 0;
    if constexpr (!std::is_void_v<Gates>) gate_dim = gates->view.dim();
    const TransitionKind kind = detail::transition_of_gate_dim(gate_dim);
    require_transitions(kind, where);
    for (Eigen::Index i = 0; i < size(); ++i) {
      states_[static_cast<std::size_t>(i)].require_token_room(sequences.rows(i / out.heads()),
                                                              where);
    }
    // Each state works on a copy and is replaced only when every head succeeded.
    std::vector<State> next = states_;
    detail::run_heads_delta_rule<Acc>(q, k, v, gates, beta, out, sequences, run_options, where,
                                      [&](Eigen::Index s, Eigen::Index h, const auto& run) {
                                        State& state =
                                            next[static_cast<std::size_t>(s * out.heads() + h)];
                                        run(state.carried_.s);
                                        state.progress_.advance(sequences.rows(s), kind);
                                      });
    states_ = std::move(next);
  }
};

/// A batch of DplrDeltaRuleStates (the generalized delta rule, RWKV-7): one state per sequence
/// and head (state b * H + h), stepped together (one token each) or prefilled from multi-head
/// views; every state is checked before the first one moves. Threads split the states
/// (DplrOptions::threads).
template <class T, class Acc = detail::default_accumulator_t<T>>
class DplrDeltaRuleStateBatch : public detail::StateBatch<DplrDeltaRuleState<T, Acc>> {
  using Base = detail::StateBatch<DplrDeltaRuleState<T, Acc>>;
  using Base::input_row;
  using Base::require_rows;
  using Base::states_;

 public:
  /// The type of each state.
  using State = DplrDeltaRuleState<T, Acc>;
  using Base::size;
  using Base::value_dim;

  /// @param count      number of states, >= 1
  /// @param key_dim    Dk of every state
  /// @param value_dim  Dv of every state
  /// @param options    shared by every state (and DplrOptions::threads for the batch calls)
  DplrDeltaRuleStateBatch(Eigen::Index count, Eigen::Index key_dim, Eigen::Index value_dim,
                          const DplrOptions& options = {})
      : Base(count, State(key_dim, value_dim, options), "DplrDeltaRuleStateBatch") {}

  /// Dk of every state.
  Eigen::Index key_dim() const { return states_.front().key_dim(); }
  /// The options shared by every state (state 0's).
  const DplrOptions& options() const { return states_.front().options(); }

  /// One token for every state, row i of a, b and gates moving state i.
  /// @param q      size() x Dk queries, row i for state i (or (B * H_in) x Dk, grouped)
  /// @param k      size() x Dk keys (or (B * H_in) x Dk, grouped)
  /// @param v      size() x Dv values (or (B * H_in) x Dv, grouped)
  /// @param a      size() x Dk (FLA's alpha), one row per state
  /// @param b      size() x Dk (FLA's beta), one row per state
  /// @param gates  size() x Dk (or x 1) decays: log_gates(g) or w_t
  /// @param out    size() x Dv outputs, row-major
  template <class DQ, class DK, class DV, class DA, class DB, class Gates,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DA>& a,
                 const Eigen::MatrixBase<DB>& b, const Gates& gates, Eigen::Ref<Matrix<T>> out) {
    constexpr const char* where = "DplrDeltaRuleStateBatch::step";
    using Traits = detail::gate_traits<Gates>;
    detail::check_dplr_call_scalars<Acc, DQ, DK, DV, DA, DB, Gates>();
    static_assert(std::is_same_v<typename DQ::Scalar, T>,
                  "DplrDeltaRuleStateBatch<T>: inputs must have scalar type T");
    require_rows(q.rows(), q.cols(), key_dim(), detail::shape_string(q), "q", &LayerHeads::query,
                 where);
    require_rows(k.rows(), k.cols(), key_dim(), detail::shape_string(k), "k", &LayerHeads::key,
                 where);
    require_rows(v.rows(), v.cols(), value_dim(), detail::shape_string(v), "v", &LayerHeads::value,
                 where);
    require_rows(a.rows(), a.cols(), key_dim(), detail::shape_string(a), "a", nullptr, where);
    require_rows(b.rows(), b.cols(), key_dim(), detail::shape_string(b), "b", nullptr, where);
    require_rows(out.rows(), out.cols(), value_dim(), detail::shape_string(out), "out", nullptr,
                 where);
    const auto& values = Traits::values(gates);
    detail::require_gate_shape(values, size(), key_dim(), where, "a");
    detail::require_gates_in_range<Traits::log_space>(values, where, "gates");
    if (checks_finite()) {
      detail::require_finite(q, where, "q");
      detail::require_finite(k, where, "k");
      detail::require_finite(v, where, "v");
      detail::require_finite(a, where, "a");
      detail::require_finite(b, where, "b");
    }
    require_uniform_states(where);
    require_transitions(where);
    for (const State& state : states_) state.require_token_room(1, where);
    for_each_state([&](Eigen::Index i) {
      State& state = states_[static_cast<std::size_t>(i)];
      state.load_token(q.row(input_row(q.rows(), i)), k.row(input_row(k.rows(), i)),
                       v.row(input_row(v.rows(), i)));
      state.template load_pairs<Traits::log_space>(a.row(i), b.row(i), values.row(i));
      state.advance(out.row(i).transpose());
    });
  }

  /// As step_into, returning size() x Dv.
  template <class DQ, class DK, class DV, class DA, class DB, class Gates,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  Matrix<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DA>& a,
                 const Eigen::MatrixBase<DB>& b, const Gates& gates) {
    Matrix<T> out(size(), value_dim());
    step_into(q, k, v, a, b, gates, out);
    return out;
  }

  /// A prompt for every state from multi-head views: state b * H + h takes head h of sequence
  /// b from where it is and ends where stepping each token would leave it.
  /// @param q      B x H_in x N x Dk queries, H_in dividing H
  /// @param k      B x H_in x N x Dk keys
  /// @param v      B x H_in x N x Dv values
  /// @param a      B x H x N x Dk
  /// @param b      B x H x N x Dk
  /// @param gates  B x H x N x Dk (or x 1) views of w_t, or log_gates(view)
  /// @param out    B x H x N x Dv outputs, B * H == size()
  template <class Q, class K, class V, class A, class B, class Gates, class O,
            class = detail::enable_if_heads_scalars<Q, K, V, O>,
            class = detail::enable_if_delta_head_gates<Gates, O>>
  void prefill_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const HeadsView<A>& a, const HeadsView<B>& b, const Gates& gates,
                    const HeadsView<O>& out) {
    prefill_heads(q, k, v, a, b, gates, out, nullptr);
  }

  /// Prompts of different lengths packed along N (FLA's cu_seqlens), one per sequence: state
  /// s * H + h takes head h of sequence s and continues from where it is.
  /// @param offsets  S + 1 nondecreasing offsets from 0 to T; S * H == size()
  template <class Q, class K, class V, class A, class B, class Gates, class O,
            class = detail::enable_if_heads_scalars<Q, K, V, O>,
            class = detail::enable_if_delta_head_gates<Gates, O>>
  void prefill_varlen_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                           const HeadsView<A>& a, const HeadsView<B>& b, const Gates& gates,
                           const std::vector<std::int64_t>& offsets, const HeadsView<O>& out) {
    prefill_heads(q, k, v, a, b, gates, out, &offsets);
  }

 private:
  /// Throws unless every state has state 0's dimensions and scale.
  void require_uniform_states(const char* where) const {
    this->require_uniform_dims("Dk x Dv", where);
    for (std::size_t i = 0; i < states_.size(); ++i) {
      if (!detail::same_dplr_results(states_[i].options(), options(), key_dim())) {
        throw Error(std::string(where) + ": state " + std::to_string(i) +
                    " has another scale than state 0; every state of a batch must have the same");
      }
    }
  }

  void require_transitions(const char* where) const {
    Base::require_transitions(TransitionKind::feature_gates, detail::dplr_transition_name, where);
  }

  bool checks_finite() const {
    return std::any_of(states_.begin(), states_.end(),
                       [](const State& state) { return state.options().check_finite; });
  }

  template <class Body>
  void for_each_state(const Body& body) {
    constexpr std::size_t kPrefetchBytes = std::size_t(16) << 20;
    Base::for_each_state(detail::resolve_threads(detail::engine_options(options())), body,
                         this->state_bytes() > kPrefetchBytes);
  }

  template <class Q, class K, class V, class A, class B, class Gates, class O>
  void prefill_heads(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                     const HeadsView<A>& a, const HeadsView<B>& b, const Gates& gates,
                     const HeadsView<O>& out, const std::vector<std::int64_t>* offsets) {
    constexpr const char* where = "DplrDeltaRuleStateBatch::prefill";
    static_assert(std::is_same_v<O, T>, "DplrDeltaRuleStateBatch<T>: views must hold T");
    if (q.dim() != key_dim() || v.dim() != value_dim()) {
      throw Error(std::string(where) + ": q is " + q.sizes_string() + " and v " + v.sizes_string() +
                  " but the states are Dk x Dv = " + detail::shape_string(key_dim(), value_dim()));
    }
    this->require_view_heads(q.heads(), k.heads(), v.heads(), out.heads(), where);
    DplrOptions run_options = options();
    run_options.check_finite = checks_finite();
    const detail::SequenceRows sequences =
        detail::check_heads_dplr_rule<Acc>(q, k, v, a, b, gates, out, offsets, run_options, where);
    if (sequences.count * out.heads() != size()) {
      throw Error(std::string(where) + ": out is " + out.sizes_string() + ", " +
                  std::to_string(sequences.count) + " sequences x " + std::to_string(out.heads()) +
                  " heads, but the batch holds " + std::to_string(size()) + " states");
    }
    require_uniform_states(where);
    require_transitions(where);
    for (Eigen::Index i = 0; i < size(); ++i) {
      states_[static_cast<std::size_t>(i)].require_token_room(sequences.rows(i / out.heads()),
                                                              where);
    }
    // Each state works on a copy and is replaced only when every head succeeded.
    std::vector<State> next = states_;
    detail::run_heads_dplr_rule<Acc>(
        q, k, v, a, b, gates, out, sequences, run_options, where,
        [&](Eigen::Index s, Eigen::Index h) -> Matrix<Acc>& {
          return next[static_cast<std::size_t>(s * out.heads() + h)].carried_.s;
        });
    for (Eigen::Index i = 0; i < size(); ++i) {
      next[static_cast<std::size_t>(i)].progress_.advance(sequences.rows(i / out.heads()),
                                                          TransitionKind::feature_gates);
    }
    states_ = std::move(next);
  }
};

}  // namespace linattn
