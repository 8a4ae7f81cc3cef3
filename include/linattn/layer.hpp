// SPDX-License-Identifier: MIT
// The layer-level objects: multi-head causal linear attention with its feature map, and the
// delta rule, each in both forms (parallel over whole sequences, recurrent over a batch of states).
#pragma once

#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/delta_rule.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/state_batch.hpp>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn {
namespace detail {

/// Throws unless q, k, v and out have exactly the layer's head counts and widths.
template <class Q, class K, class V, class O>
void require_layer_heads(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                         const HeadsView<O>& out, const LayerHeads& heads, Eigen::Index key_dim,
                         Eigen::Index value_dim, const char* where) {
  if (q.heads() != heads.query || k.heads() != heads.key || v.heads() != heads.value ||
      out.heads() != heads.out || q.dim() != key_dim || v.dim() != value_dim) {
    const bool counts_differ = q.heads() != heads.query || k.heads() != heads.key ||
                               v.heads() != heads.value || out.heads() != heads.out;
    throw Error(std::string(where) + ": q is " + q.sizes_string() + ", k " + k.sizes_string() +
                ", v " + v.sizes_string() + " and out " + out.sizes_string() +
                " but the layer has " + heads_string(heads) + ", Dk = " + std::to_string(key_dim) +
                ", Dv = " + std::to_string(value_dim) +
                (counts_differ ? std::string(" (grouped heads are the layer's: make it with "
                                             "LayerHeads, e.g. LayerHeads::grouped_query_key(H, "
                                             "H_qk))")
                               : std::string()));
  }
}

/// Throws unless a step's argument has B * H_in rows, H_in = heads.*input, for the `states`
/// states of heads.out heads per sequence: other row counts could divide the batch's size and
/// still hand one sequence's rows to another's states.
inline void require_layer_rows(Eigen::Index rows, Eigen::Index states, const LayerHeads& heads,
                               Eigen::Index LayerHeads::*input, const char* name,
                               const char* where) {
  const Eigen::Index batch = states / heads.out, per_sequence = heads.*input;
  if (rows != batch * per_sequence) {
    throw Error(std::string(where) + ": " + name + " has " + std::to_string(rows) +
                " rows but the states hold " + std::to_string(batch) + " sequences of " +
                std::to_string(heads.out) + " heads and the layer takes " +
                std::to_string(per_sequence) + " " + name + " heads per sequence (LayerHeads: " +
                heads_string(heads) + "): it needs B * " + std::to_string(per_sequence) + " = " +
                std::to_string(batch * per_sequence) + " rows (row b * " +
                std::to_string(per_sequence) + " + j for head j of sequence b)");
  }
}

/// Throws unless a batch of states can be a layer's: states.size() a multiple of H, the layer's
/// head grouping, and its head counts when a layer's make_states made the batch.
template <class States>
void require_layer_states(const States& states, const LayerHeads& heads, HeadGrouping grouping,
                          const char* where) {
  const LayerHeads& made = BatchHeads::get(states);
  const bool same_heads = made.out == 0 || (made.out == heads.out && made.query == heads.query &&
                                            made.key == heads.key && made.value == heads.value);
  if (states.size() % heads.out != 0 || !same_heads || states.options().head_grouping != grouping) {
    throw Error(std::string(where) + ": the states (" + std::to_string(states.size()) +
                (made.out > 0 ? ", made for " + heads_string(made) : std::string()) +
                ") are not this layer's: make them with make_states (the layer's " +
                heads_string(heads) + " per sequence and its head_grouping)");
  }
}

/// The options of a layer's family validated as the family's calls validate them.
inline void validate_layer_options(const Options& options, const char* owner) {
  validate_options(options, owner);
}
inline void validate_layer_options(const DeltaOptions& options, const char* owner) {
  validate_delta_options(options, owner);
}
inline void validate_layer_options(const DplrOptions& options, const char* owner) {
  validate_dplr_options(options, owner);
}

/// What every layer holds and checks alike, whatever its family: H with q's, k's and v's head
/// counts (LayerHeads), Dk, Dv and the family's options, validated when the layer is made; the
/// exact head counts of its views and step rows; the batches its make_states returns.
/// @tparam LayerOptions  the family's options (Options, DeltaOptions)
template <class LayerOptions>
class LayerShape {
 public:
  /// H, (value) heads per sequence.
  Eigen::Index heads() const { return heads_.out; }
  /// H and the head counts of q, k and v that every call takes.
  const LayerHeads& layer_heads() const { return heads_; }
  /// Dk, width of each head's q and k.
  Eigen::Index key_dim() const { return key_dim_; }
  /// Dv, width of each head's v and output.
  Eigen::Index value_dim() const { return value_dim_; }
  /// The options both forms run with.
  const LayerOptions& options() const { return options_; }

 protected:
  /// `owner` names the layer in messages.
  LayerShape(LayerHeads heads, Eigen::Index key_dim, Eigen::Index value_dim,
             const LayerOptions& options, const char* owner)
      : heads_(heads),
        key_dim_(require_positive_dim(key_dim, owner, "key_dim")),
        value_dim_(require_positive_dim(value_dim, owner, "value_dim")),
        options_(options) {
    validate_layer_options(options, owner);
    validate_layer_heads(heads_, owner);
  }

  /// Throws unless q, k, v and out have the layer's head counts and widths.
  template <class Q, class K, class V, class O>
  void require_views(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                     const HeadsView<O>& out, const char* where) const {
    require_layer_heads(q, k, v, out, heads_, key_dim_, value_dim_, where);
  }

  /// Throws unless a step's q, k and v hold B * H_in rows each, for `states` states.
  void require_step_rows(Eigen::Index states, Eigen::Index q_rows, Eigen::Index k_rows,
                         Eigen::Index v_rows, const char* where) const {
    require_layer_rows(q_rows, states, heads_, &LayerHeads::query, "q", where);
    require_layer_rows(k_rows, states, heads_, &LayerHeads::key, "k", where);
    require_layer_rows(v_rows, states, heads_, &LayerHeads::value, "v", where);
  }

  /// batch * H, the states make_states makes for `batch` sequences (`owner` names the layer).
  Eigen::Index state_count(Eigen::Index batch, const char* owner) const {
    return require_positive_dim(batch, owner, "batch") * heads_.out;
  }

  /// `states` marked with the layer's head counts (the rows of grouped inputs they take).
  template <class States>
  States with_layer_heads(States states) const {
    BatchHeads::set(states, heads_);
    return states;
  }

  LayerHeads heads_;
  Eigen::Index key_dim_, value_dim_;
  LayerOptions options_;
};

}  // namespace detail

/// Multi-head causal linear attention that owns its feature map (so FAVOR+'s W is shared by
/// both forms): `forward` is the parallel form, for training and prompts; `prefill` and `step`
/// are the recurrent form over a RecurrentStateBatch, for decoding. Both give the same outputs.
/// The projections around attention (W_q, W_k, W_v, W_o) stay with the caller's model.
/// Grouped heads: H is the output's head count; q, k and v may have fewer heads, a divisor of
/// H, declared when the layer is made (LayerHeads) and then required of every call (output
/// head h reads head h / (H / H_in), or h % H_in with HeadGrouping::tiled; a step's rows
/// alike: (B * H_in) x D).
/// @tparam T    float, double, Eigen::half or Eigen::bfloat16: the type of q, k, v and the
///              outputs
/// @tparam Map  feature map type (EluPlusOne, Relu, PositiveRandomFeatures, ...)
/// @tparam Acc  accumulation type of the sums and states, float or double (default T, or float
///              for the 16-bit types)
template <class T, class Map, class Acc = detail::default_accumulator_t<T>>
class LinearAttentionLayer : public detail::LayerShape<Options> {
  static_assert(detail::check_feature_map<Map, Acc>(), "LinearAttentionLayer needs a feature map");
  using Shape = detail::LayerShape<Options>;
  using Shape::heads_;
  using Shape::key_dim_;
  using Shape::options_;
  using Shape::value_dim_;

 public:
  /// The states make_states returns, one per (sequence, head).
  using States = RecurrentStateBatch<T, Acc>;

  /// @param map        feature map applied to every head's queries and keys
  /// @param heads      H, heads per sequence; or LayerHeads with fewer heads of q, k or v
  /// @param key_dim    Dk, width of each head's q and k
  /// @param value_dim  Dv, width of each head's v and output
  /// @param options    eps, decay, normalize, chunk, check_finite, threads, head_grouping
  LinearAttentionLayer(Map map, LayerHeads heads, Eigen::Index key_dim, Eigen::Index value_dim,
                       const Options& options = {})
      : Shape(heads, key_dim, value_dim, options, "LinearAttentionLayer"), map_(std::move(map)) {
    feature_dim_ = map_.feature_dim(key_dim);
    if (feature_dim_ < 1) {
      throw Error("LinearAttentionLayer: the feature map gives feature_dim " +
                  std::to_string(feature_dim_) + " for key_dim " + std::to_string(key_dim));
    }
  }

  /// A layer whose heads decay by a constant each (RetNet's multi-scale retention, MiniMax's
  /// lambda_h): head h by decays.values[h], in both forms.
  /// @param map        feature map applied to every head's queries and keys
  /// @param heads      H, heads per sequence; or LayerHeads with fewer heads of q, k or v
  /// @param key_dim    Dk, width of each head's q and k
  /// @param value_dim  Dv, width of each head's v and output
  /// @param decays     H decays in (0, 1]
  /// @param options    eps, normalize, chunk, check_finite, threads, scale; decay must be 1
  LinearAttentionLayer(Map map, LayerHeads heads, Eigen::Index key_dim, Eigen::Index value_dim,
                       HeadDecays decays, const Options& options = {})
      : LinearAttentionLayer(std::move(map), heads, key_dim, value_dim, options) {
    detail::validate_transition(decays, HeadShape{1, heads_.out, 1, feature_dim_}, options_,
                                "LinearAttentionLayer");
    decays_ = std::move(decays);
  }

  /// The map applied to every head's queries and keys.
  const Map& feature_map() const { return map_; }
  /// C = feature_map().feature_dim(key_dim()).
  Eigen::Index feature_dim() const { return feature_dim_; }
  /// The heads' constant decays (empty unless the layer was made with HeadDecays).
  const HeadDecays& head_decays() const { return decays_; }

  /// The parallel form over whole sequences.
  /// @param q    B x H_q x N x Dk queries (H_q, H_k, H_v: the layer's LayerHeads; any layout,
  ///             e.g. HeadsView::bnhd over a QKV buffer)
  /// @param k    B x H_k x N x Dk keys
  /// @param v    B x H_v x N x Dv values
  /// @param out  B x H x N x Dv outputs
  template <class Q, class K, class V, class O>
  void forward_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const HeadsView<O>& out) const {
    check_heads(q, k, v, out, "LinearAttentionLayer::forward");
    if (decays_.values.empty()) {
      causal_linear_attention_into<Acc>(q, k, v, map_, out, options_);
    } else {
      causal_gated_linear_attention_into<Acc>(q, k, v, decays_, map_, out, options_);
    }
  }

  /// The parallel form with per-token gates, laid out like q, k and v.
  /// @param q      B x H_q x N x Dk queries
  /// @param k      B x H_k x N x Dk keys
  /// @param v      B x H_v x N x Dv values
  /// @param gates  B x H x N x 1 or B x H x N x C gates a_t in (0, 1], or log_gates(view); or
  ///               with_bonus(either, u) with u H x C (RWKV-6)
  /// @param out    B x H x N x Dv outputs
  template <class Q, class K, class V, class Gates, class O,
            class = detail::enable_if_head_transition<Gates, O>>
  void forward_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const Gates& gates, const HeadsView<O>& out) const {
    constexpr const char* where = "LinearAttentionLayer::forward";
    check_heads(q, k, v, out, where);
    require_no_decays<Gates>(where);
    causal_gated_linear_attention_into<Acc>(q, k, v, gates, map_, out, options_);
  }

  /// Fresh (empty) states for `batch` sequences: batch * heads() of them, state b * H + h for
  /// head h of sequence b.
  States make_states(Eigen::Index batch) const {
    const Eigen::Index count = this->state_count(batch, "LinearAttentionLayer");
    return this->with_layer_heads(decays_.values.empty()
                                      ? States(count, feature_dim_, value_dim_, options_)
                                      : States(count, feature_dim_, value_dim_, decays_, options_));
  }

  /// A prompt through the parallel form that also leaves each sequence's states ready to step.
  /// @param states  from make_states(B)
  /// @param q       B x H_q x N x Dk queries; k B x H_k x N x Dk; v B x H_v x N x Dv
  /// @param out     B x H x N x Dv outputs
  template <class Q, class K, class V, class O>
  void prefill_into(States& states, const HeadsView<Q>& q, const HeadsView<K>& k,
                    const HeadsView<V>& v, const HeadsView<O>& out) const {
    check_heads(q, k, v, out, "LinearAttentionLayer::prefill");
    detail::require_layer_states(states, heads_, options_.head_grouping,
                                 "LinearAttentionLayer::prefill");
    states.prefill_into(q, k, v, map_, out);
  }

  /// A gated prompt through the parallel form, leaving the states ready for gated steps.
  /// @param states  from make_states(B)
  /// @param q       B x H_q x N x Dk queries; k B x H_k x N x Dk; v B x H_v x N x Dv
  /// @param gates   B x H x N x 1 or B x H x N x C gates a_t in (0, 1], or log_gates(view); or
  ///                with_bonus(either, u) with u H x C (RWKV-6)
  /// @param out     B x H x N x Dv outputs
  template <class Q, class K, class V, class Gates, class O,
            class = std::enable_if_t<detail::head_transition<Gates, O>::valid &&
                                     !std::is_same_v<Gates, HeadDecays>>>
  void prefill_into(States& states, const HeadsView<Q>& q, const HeadsView<K>& k,
                    const HeadsView<V>& v, const Gates& gates, const HeadsView<O>& out) const {
    constexpr const char* where = "LinearAttentionLayer::prefill";
    check_heads(q, k, v, out, where);
    detail::require_layer_states(states, heads_, options_.head_grouping, where);
    require_no_decays<Gates>(where);
    states.prefill_into(q, k, v, gates, map_, out);
  }

  /// Prompts of different lengths packed along N (FLA's cu_seqlens) through the parallel
  /// form, leaving the states of sequence s (s * H + h) ready to step; an empty prompt leaves
  /// its states as they are.
  /// @param states   from make_states(S) for S sequences
  /// @param q        1 x H_q x T x Dk queries, T = offsets.back(); k 1 x H_k x T x Dk;
  ///                 v 1 x H_v x T x Dv
  /// @param offsets  S + 1 nondecreasing offsets from 0 to T
  /// @param out      1 x H x T x Dv outputs
  template <class Q, class K, class V, class O>
  void prefill_varlen_into(States& states, const HeadsView<Q>& q, const HeadsView<K>& k,
                           const HeadsView<V>& v, const std::vector<std::int64_t>& offsets,
                           const HeadsView<O>& out) const {
    check_heads(q, k, v, out, "LinearAttentionLayer::prefill_varlen");
    detail::require_layer_states(states, heads_, options_.head_grouping,
                                 "LinearAttentionLayer::prefill_varlen");
    states.prefill_varlen_into(q, k, v, map_, offsets, out);
  }

  /// Gated prompts of different lengths packed along N, as the plain varlen prefill, leaving
  /// the states ready for gated steps.
  /// @param states   from make_states(S) for S sequences
  /// @param q        1 x H_q x T x Dk queries, T = offsets.back(); k 1 x H_k x T x Dk;
  ///                 v 1 x H_v x T x Dv
  /// @param gates    1 x H x T x 1 or 1 x H x T x C gates a_t in (0, 1], or log_gates(view); or
  ///                 with_bonus(either, u) with u H x C (RWKV-6)
  /// @param offsets  S + 1 nondecreasing offsets from 0 to T
  /// @param out      1 x H x T x Dv outputs
  template <class Q, class K, class V, class Gates, class O,
            class = std::enable_if_t<detail::head_transition<Gates, O>::valid &&
                                     !std::is_same_v<Gates, HeadDecays>>>
  void prefill_varlen_into(States& states, const HeadsView<Q>& q, const HeadsView<K>& k,
                           const HeadsView<V>& v, const Gates& gates,
                           const std::vector<std::int64_t>& offsets,
                           const HeadsView<O>& out) const {
    constexpr const char* where = "LinearAttentionLayer::prefill_varlen";
    check_heads(q, k, v, out, where);
    detail::require_layer_states(states, heads_, options_.head_grouping, where);
    require_no_decays<Gates>(where);
    states.prefill_varlen_into(q, k, v, gates, map_, offsets, out);
  }

  /// One token for each of B sequences; row b * H + h holds head h of sequence b (a [B, H, D]
  /// tensor viewed as a (B * H) x D row-major matrix).
  /// @param states  from make_states(B)
  /// @param q       (B * H_q) x Dk queries (H_q = H unless the layer's LayerHeads group them)
  /// @param k       (B * H_k) x Dk keys
  /// @param v       (B * H_v) x Dv values
  /// @param out     (B * H) x Dv outputs
  template <class DQ, class DK, class DV>
  void step_into(States& states, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, Eigen::Ref<Matrix<T>> out) const {
    check_step(states, q, k, v, "LinearAttentionLayer::step");
    states.step_into(q, k, v, map_, out);
  }

  /// One gated token for each of B sequences, rows as the ungated step.
  /// @param states  from make_states(B)
  /// @param q       (B * H_q) x Dk queries; k (B * H_k) x Dk; v (B * H_v) x Dv
  /// @param gates   (B * H) x 1 or (B * H) x C gates a_t in (0, 1], or log_gates(g)
  /// @param out     (B * H) x Dv outputs
  template <class DQ, class DK, class DV, class Gates,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  void step_into(States& states, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Gates& gates,
                 Eigen::Ref<Matrix<T>> out) const {
    constexpr const char* where = "LinearAttentionLayer::step";
    check_step(states, q, k, v, where);
    require_no_decays<Gates>(where);
    states.step_into(q, k, v, gates, map_, out);
  }

  /// One token with RWKV-6's bonus for each of B sequences, rows as the ungated step; head h
  /// reads row h of u (the layer's normalize must be false and its map plain).
  /// @param states  from make_states(B)
  /// @param q       (B * H_q) x Dk receptances (queries); k (B * H_k) x Dk; v (B * H_v) x Dv
  /// @param gates   with_bonus(gates, u): gates (B * H) x 1 or (B * H) x C (a_t, or
  ///                log_gates(w)), u H x C
  /// @param out     (B * H) x Dv outputs
  template <class DQ, class DK, class DV, class Gates, class DU>
  void step_into(States& states, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const BonusGates<Gates, DU>& gates,
                 Eigen::Ref<Matrix<T>> out) const {
    constexpr const char* where = "LinearAttentionLayer::step";
    check_step(states, q, k, v, where);
    if (gates.bonus().rows() != heads_.out) {
      throw Error(std::string(where) + ": the bonus u is " + detail::shape_string(gates.bonus()) +
                  " but the layer has H = " + std::to_string(heads_.out) + " heads (u is H x C)");
    }
    require_no_decays<Gates>(where);
    states.step_into(q, k, v, gates, map_, out);
  }

 private:
  /// Throws unless q, k, v and out have the layer's head counts and widths.
  template <class Q, class K, class V, class O>
  void check_heads(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                   const HeadsView<O>& out, const char* where) const {
    this->require_views(q, k, v, out, where);
  }

  /// Throws unless q has the layer's Dk and q, k and v hold B * H_in rows, the layer's H_in.
  template <class DQ, class DK, class DV>
  void check_step(const States& states, const Eigen::MatrixBase<DQ>& q,
                  const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                  const char* where) const {
    if (q.cols() != key_dim_) {
      throw Error(std::string(where) + ": q is " + detail::shape_string(q) +
                  " but the layer has key_dim " + std::to_string(key_dim_));
    }
    detail::require_layer_states(states, heads_, options_.head_grouping, where);
    this->require_step_rows(states.size(), q.rows(), k.rows(), v.rows(), where);
  }

  /// Gates replace the decay: a layer made with HeadDecays takes none.
  template <class Gates>
  void require_no_decays(const char* where) const {
    static_assert(!std::is_same_v<Gates, HeadDecays>,
                  "LinearAttentionLayer: give HeadDecays to the constructor, not to a call");
    if (!decays_.values.empty()) {
      throw Error(std::string(where) +
                  ": this layer decays by HeadDecays; gates replace the decay (fold it into "
                  "them as log g_h + g_t and make the layer without HeadDecays)");
    }
  }

  Map map_;
  Eigen::Index feature_dim_ = 0;
  HeadDecays decays_;  ///< empty: Options::decay for every head
};

/// A delta-rule layer (DeltaNet, Gated DeltaNet as in Qwen3-Next, KDA as in Kimi Linear) in
/// both forms over the same options: `forward` is the chunked or streamed parallel form, for
/// training and prompts; `prefill` and `step` are the recurrent form over a
/// DeltaRuleStateBatch, for decoding. Both give the same outputs. The projections, the
/// short convolution, beta = sigmoid(.) and the gates stay with the caller's model.
/// Grouped heads: H is the output's (value) head count; q and k (and v) may have fewer heads, a
/// divisor of H, declared when the layer is made (LayerHeads::grouped_query_key(32, 16) for
/// Qwen3.5) and then required of every call (output head h reads head h / (H / H_in), or
/// h % H_in with HeadGrouping::tiled); in a step q, k and v likewise ((B * H_in) x D rows);
/// beta and the gates have one head per value head (one row per state).
/// @tparam T    float, double, Eigen::half or Eigen::bfloat16: the type of q, k, v, beta, the
///              gates and the outputs
/// @tparam Acc  accumulation type of the sums and states, float or double (default T, or float
///              for the 16-bit types)
template <class T, class Acc = detail::default_accumulator_t<T>>
class DeltaRuleLayer : public detail::LayerShape<DeltaOptions> {
  using Shape = detail::LayerShape<DeltaOptions>;
  using Shape::heads_;
  using Shape::key_dim_;
  using Shape::options_;
  using Shape::value_dim_;

 public:
  /// The states make_states returns, one per (sequence, head).
  using States = DeltaRuleStateBatch<T, Acc>;

  /// @param heads      H, value heads per sequence; or LayerHeads with fewer q/k heads
  ///                   (LayerHeads::grouped_query_key(H, H_qk))
  /// @param key_dim    Dk, width of each head's q and k
  /// @param value_dim  Dv, width of each head's v and output
  /// @param options    scale, l2_normalize, allow_negative_eigenvalues, chunk, form,
  ///                   check_finite, threads, head_grouping
  DeltaRuleLayer(LayerHeads heads, Eigen::Index key_dim, Eigen::Index value_dim,
                 const DeltaOptions& options = {})
      : Shape(heads, key_dim, value_dim, options, "DeltaRuleLayer") {}

  /// DeltaNet over whole sequences, each from a zero state.
  /// @param q     B x H_in x N x Dk queries (any layout, e.g. HeadsView::bnhd over a QKV buffer)
  /// @param k     B x H_in x N x Dk keys
  /// @param v     B x H_in x N x Dv values
  /// @param beta  B x H x N x 1 learning rates
  /// @param out   B x H x N x Dv outputs
  template <class Q, class K, class V, class B, class O>
  void forward_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const HeadsView<B>& beta, const HeadsView<O>& out) const {
    this->require_views(q, k, v, out, "DeltaRuleLayer::forward");
    causal_delta_rule_into<Acc>(q, k, v, beta, out, options_);
  }

  /// Gated DeltaNet and KDA over whole sequences, each from a zero state.
  /// @param q      B x H_in x N x Dk queries
  /// @param k      B x H_in x N x Dk keys
  /// @param v      B x H_in x N x Dv values
  /// @param gates  B x H x N x 1 (Gated DeltaNet) or B x H x N x Dk (KDA) views of a_t, or
  ///               log_gates(view)
  /// @param beta   B x H x N x 1 learning rates
  /// @param out    B x H x N x Dv outputs
  template <class Q, class K, class V, class Gates, class B, class O,
            class = detail::enable_if_delta_head_gates<Gates, O>>
  void forward_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const Gates& gates, const HeadsView<B>& beta, const HeadsView<O>& out) const {
    this->require_views(q, k, v, out, "DeltaRuleLayer::forward");
    causal_gated_delta_rule_into<Acc>(q, k, v, gates, beta, out, options_);
  }

  /// Fresh (zero) states for `batch` sequences: batch * heads() of them, state b * H + h for
  /// head h of sequence b.
  States make_states(Eigen::Index batch) const {
    return this->with_layer_heads(
        States(this->state_count(batch, "DeltaRuleLayer"), key_dim_, value_dim_, options_));
  }

  /// DeltaNet: a prompt through the parallel form that also leaves each sequence's states
  /// ready to step (continuing from where they were).
  /// @param states  from make_states(B)
  /// @param q       B x H_in x N x Dk queries; k likewise; v B x H_in x N x Dv
  /// @param beta    B x H x N x 1 learning rates
  /// @param out     B x H x N x Dv outputs
  template <class Q, class K, class V, class B, class O>
  void prefill_into(States& states, const HeadsView<Q>& q, const HeadsView<K>& k,
                    const HeadsView<V>& v, const HeadsView<B>& beta,
                    const HeadsView<O>& out) const {
    constexpr const char* where = "DeltaRuleLayer::prefill";
    this->require_views(q, k, v, out, where);
    require_states(states, where);
    states.prefill_into(q, k, v, beta, out);
  }

  /// Gated DeltaNet and KDA: a gated prompt through the parallel form, leaving the states
  /// ready for gated steps.
  /// @param states  from make_states(B)
  /// @param q       B x H_in x N x Dk queries; k likewise; v B x H_in x N x Dv
  /// @param gates   B x H x N x 1 or B x H x N x Dk views of a_t, or log_gates(view)
  /// @param beta    B x H x N x 1 learning rates
  /// @param out     B x H x N x Dv outputs
  template <class Q, class K, class V, class Gates, class B, class O,
            class = detail::enable_if_delta_head_gates<Gates, O>>
  void prefill_into(States& states, const HeadsView<Q>& q, const HeadsView<K>& k,
                    const HeadsView<V>& v, const Gates& gates, const HeadsView<B>& beta,
                    const HeadsView<O>& out) const {
    constexpr const char* where = "DeltaRuleLayer::prefill";
    this->require_views(q, k, v, out, where);
    require_states(states, where);
    states.prefill_into(q, k, v, gates, beta, out);
  }

  /// DeltaNet: prompts of different lengths packed along N (FLA's cu_seqlens), leaving the
  /// states of sequence s (s * H + h) ready to step.
  /// @param states   from make_states(S) for S sequences
  /// @param q        1 x H_in x T x Dk queries, T = offsets.back(); k likewise; v 1 x H_in x T x Dv
  /// @param beta     1 x H x T x 1 learning rates
  /// @param offsets  S + 1 nondecreasing offsets from 0 to T
  /// @param out      1 x H x T x Dv outputs
  template <class Q, class K, class V, class B, class O>
  void prefill_varlen_into(States& states, const HeadsView<Q>& q, const HeadsView<K>& k,
                           const HeadsView<V>& v, const HeadsView<B>& beta,
                           const std::vector<std::int64_t>& offsets,
                           const HeadsView<O>& out) const {
    constexpr const char* where = "DeltaRuleLayer::prefill_varlen";
    this->require_views(q, k, v, out, where);
    require_states(states, where);
    states.prefill_varlen_into(q, k, v, beta, offsets, out);
  }

  /// Gated DeltaNet and KDA: packed prompts of different lengths, as the DeltaNet varlen
  /// prefill.
  /// @param gates  1 x H x T x 1 or 1 x H x T x Dk views of a_t, or log_gates(view)
  template <class Q, class K, class V, class Gates, class B, class O,
            class = detail::enable_if_delta_head_gates<Gates, O>>
  void prefill_varlen_into(States& states, const HeadsView<Q>& q, const HeadsView<K>& k,
                           const HeadsView<V>& v, const Gates& gates, const HeadsView<B>& beta,
                           const std::vector<std::int64_t>& offsets,
                           const HeadsView<O>& out) const {
    constexpr const char* where = "DeltaRuleLayer::prefill_varlen";
    this->require_views(q, k, v, out, where);
    require_states(states, where);
    states.prefill_varlen_into(q, k, v, gates, beta, offsets, out);
  }

  /// DeltaNet: one token for each of B sequences; row b * H + h holds head h of sequence b (a
  /// [B, H, D] tensor viewed as a (B * H) x D row-major matrix).
  /// @param states  from make_states(B)
  /// @param q       (B * H_q) x Dk queries (H_q = H unless the layer's LayerHeads group them)
  /// @param k       (B * H_k) x Dk keys
  /// @param v       (B * H_v) x Dv values
  /// @param beta    B * H learning rates
  /// @param out     (B * H) x Dv outputs
  template <class DQ, class DK, class DV, class DB>
  void step_into(States& states, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DB>& beta,
                 Eigen::Ref<Matrix<T>> out) const {
    check_step(states, q.rows(), k.rows(), v.rows());
    states.step_into(q, k, v, beta, out);
  }

  /// Gated DeltaNet and KDA: one gated token for each of B sequences, rows as the DeltaNet
  /// step.
  /// @param states  from make_states(B)
  /// @param q       (B * H) x Dk queries (or grouped); k likewise; v (B * H) x Dv
  /// @param gates   (B * H) x 1 or (B * H) x Dk: log_gates(g) or a_t
  /// @param beta    B * H learning rates
  /// @param out     (B * H) x Dv outputs
  template <class DQ, class DK, class DV, class Gates, class DB,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  void step_into(States& states, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Gates& gates,
                 const Eigen::MatrixBase<DB>& beta, Eigen::Ref<Matrix<T>> out) const {
    check_step(states, q.rows(), k.rows(), v.rows());
    states.step_into(q, k, v, gates, beta, out);
  }

 private:
  /// Throws unless `states` could come from make_states: H states per sequence of the layer's
  /// Dk x Dv, with the options that change results and the layer's check_finite.
  void require_states(const States& states, const char* where) const {
    detail::require_layer_states(states, heads_, options_.head_grouping, where);
    const DeltaOptions& own = states.options();
    if (states.key_dim() != key_dim_ || states.value_dim() != value_dim_ ||
        !detail::same_delta_results(own, options_, key_dim_) ||
        own.check_finite != options_.check_finite) {
      throw Error(
          std::string(where) + ": the states (" + std::to_string(states.size()) + " of " +
          detail::shape_string(states.key_dim(), states.value_dim()) +
          ") are not this layer's: make them with make_states (H = " + std::to_string(heads_.out) +
          " per sequence, Dk x Dv = " + detail::shape_string(key_dim_, value_dim_) +
          ", the same scale, l2_normalize, allow_negative_eigenvalues and check_finite)");
    }
  }

  /// The layer's checks of a step: its states, and B * H_in rows of q, k and v.
  void check_step(const States& states, Eigen::Index q_rows, Eigen::Index k_rows,
                  Eigen::Index v_rows) const {
    constexpr const char* where = "DeltaRuleLayer::step";
    require_states(states, where);
    this->require_step_rows(states.size(), q_rows, k_rows, v_rows, where);
  }
};

/// A generalized delta-rule layer (RWKV-7's time mixing core): H heads of Dk x Dv states and
/// its options. `forward_into` runs whole sequences from zero states; `make_states`,
/// `prefill_into` (views, or packed varlen) and `step_into` carry states across calls (a
/// server's sessions: SessionPool). q, k and v may have fewer heads (LayerHeads); a, b and the
/// gates have one head per output head.
/// @tparam T    float, double, Eigen::half or Eigen::bfloat16: the inputs' and outputs' type
/// @tparam Acc  accumulation type of the states, float or double
template <class T, class Acc = detail::default_accumulator_t<T>>
class DplrDeltaRuleLayer : public detail::LayerShape<DplrOptions> {
  using Shape = detail::LayerShape<DplrOptions>;
  using Shape::heads_;
  using Shape::key_dim_;
  using Shape::options_;
  using Shape::value_dim_;

 public:
  /// The states make_states returns, one per (sequence, head).
  using States = DplrDeltaRuleStateBatch<T, Acc>;

  /// @param heads      H, heads per sequence (or LayerHeads with fewer q/k/v heads)
  /// @param key_dim    Dk, width of each head's q, k, a and b
  /// @param value_dim  Dv, width of each head's v and output
  /// @param options    scale (RWKV-7: 1), chunk, form, check_finite, threads, head_grouping
  DplrDeltaRuleLayer(LayerHeads heads, Eigen::Index key_dim, Eigen::Index value_dim,
                     const DplrOptions& options = {})
      : Shape(heads, key_dim, value_dim, options, "DplrDeltaRuleLayer") {}

  /// Whole sequences, each from a zero state.
  /// @param q      B x H_in x N x Dk queries; k likewise; v B x H_in x N x Dv
  /// @param a      B x H x N x Dk
  /// @param b      B x H x N x Dk
  /// @param gates  B x H x N x Dk (or x 1) views of w_t, or log_gates(view)
  /// @param out    B x H x N x Dv outputs
  template <class Q, class K, class V, class A, class B, class Gates, class O,
            class = detail::enable_if_delta_head_gates<Gates, O>>
  void forward_into(const HeadsView<Q>& q, const HeadsView<K>& k, const HeadsView<V>& v,
                    const HeadsView<A>& a, const HeadsView<B>& b, const Gates& gates,
                    const HeadsView<O>& out) const {
    this->require_views(q, k, v, out, "DplrDeltaRuleLayer::forward");
    causal_dplr_delta_rule_into<Acc>(q, k, v, a, b, gates, out, options_);
  }

  /// Fresh (zero) states for `batch` sequences: state b * H + h for head h of sequence b.
  States make_states(Eigen::Index batch) const {
    return this->with_layer_heads(
        States(this->state_count(batch, "DplrDeltaRuleLayer"), key_dim_, value_dim_, options_));
  }

  /// A prompt through the automatic form that also leaves each sequence's states ready to
  /// step (continuing from where they were). Arguments as forward_into.
  /// @param states  from make_states(B)
  template <class Q, class K, class V, class A, class B, class Gates, class O,
            class = detail::enable_if_delta_head_gates<Gates, O>>
  void prefill_into(States& states, const HeadsView<Q>& q, const HeadsView<K>& k,
                    const HeadsView<V>& v, const HeadsView<A>& a, const HeadsView<B>& b,
                    const Gates& gates, const HeadsView<O>& out) const {
    constexpr const char* where = "DplrDeltaRuleLayer::prefill";
    this->require_views(q, k, v, out, where);
    require_states(states, where);
    states.prefill_into(q, k, v, a, b, gates, out);
  }

  /// Prompts of different lengths packed along N (FLA's cu_seqlens), leaving the states of
  /// sequence s (s * H + h) ready to step.
  /// @param states   from make_states(S) for S sequences
  /// @param offsets  S + 1 nondecreasing offsets from 0 to T
  template <class Q, class K, class V, class A, class B, class Gates, class O,
            class = detail::enable_if_delta_head_gates<Gates, O>>
  void prefill_varlen_into(States& states, const HeadsView<Q>& q, const HeadsView<K>& k,
                           const HeadsView<V>& v, const HeadsView<A>& a, const HeadsView<B>& b,
                           const Gates& gates, const std::vector<std::int64_t>& offsets,
                           const HeadsView<O>& out) const {
    constexpr const char* where = "DplrDeltaRuleLayer::prefill_varlen";
    this->require_views(q, k, v, out, where);
    require_states(states, where);
    states.prefill_varlen_into(q, k, v, a, b, gates, offsets, out);
  }

  /// One token for each of B sequences; row b * H + h holds head h of sequence b.
  /// @param states  from make_states(B)
  /// @param q       (B * H_q) x Dk queries; k likewise; v (B * H_v) x Dv
  /// @param a       (B * H) x Dk
  /// @param b       (B * H) x Dk
  /// @param gates   (B * H) x Dk (or x 1): log_gates(g) or w_t
  /// @param out     (B * H) x Dv outputs
  template <class DQ, class DK, class DV, class DA, class DB, class Gates,
            class = std::enable_if_t<detail::gate_traits<Gates>::is_gate>>
  void step_into(States& states, const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DA>& a,
                 const Eigen::MatrixBase<DB>& b, const Gates& gates,
                 Eigen::Ref<Matrix<T>> out) const {
    constexpr const char* where = "DplrDeltaRuleLayer::step";
    require_states(states, where);
    this->require_step_rows(states.size(), q.rows(), k.rows(), v.rows(), where);
    states.step_into(q, k, v, a, b, gates, out);
  }

 private:
  /// Throws unless `states` could come from make_states: H states per sequence of the layer's
  /// Dk x Dv, with its scale and check_finite.
  void require_states(const States& states, const char* where) const {
    detail::require_layer_states(states, heads_, options_.head_grouping, where);
    const DplrOptions& own = states.options();
    if (states.key_dim() != key_dim_ || states.value_dim() != value_dim_ ||
        !detail::same_dplr_results(own, options_, key_dim_) ||
        own.check_finite != options_.check_finite) {
      throw Error(
          std::string(where) + ": the states (" + std::to_string(states.size()) + " of " +
          detail::shape_string(states.key_dim(), states.value_dim()) +
          ") are not this layer's: make them with make_states (H = " + std::to_string(heads_.out) +
          " per sequence, Dk x Dv = " + detail::shape_string(key_dim_, value_dim_) +
          ", the same scale and check_finite)");
    }
  }
};

}  // namespace linattn
