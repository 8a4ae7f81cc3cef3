// SPDX-License-Identifier: MIT
// What every batch of recurrent states shares: the states, grouped rows, checks, threads.
#pragma once

#include <algorithm>
#include <linattn/config.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/state_access.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/gates.hpp>
#include <string>
#include <vector>

namespace linattn {
/// The live sessions of a server (session_pool.hpp): SessionPool<Batch> for layers of one batch
/// type, SessionPool<> for a hybrid model's layers of any kind.
template <class Batch = void>
class SessionPool;
}  // namespace linattn

namespace linattn::detail {

/// The part of a batch of states that does not depend on the recurrence: the states (one per
/// sequence and head, state b * H + h for head h of sequence b), the row of a grouped input
/// each state reads, the checks that run before any state moves, and the split of the states
/// across threads. RecurrentStateBatch and DeltaRuleStateBatch add their recurrence's calls.
/// @tparam State  RecurrentState<T, Acc> or DeltaRuleState<T, Acc>
template <class State>
class StateBatch {
 public:
  /// Number of states.
  Eigen::Index size() const { return static_cast<Eigen::Index>(states_.size()); }
  /// Dv of every state.
  Eigen::Index value_dim() const { return states_.front().value_dim(); }

  /// State i, e.g. to save or load one session.
  State& operator[](Eigen::Index i) { return states_.at(static_cast<std::size_t>(i)); }
  /// State i, read-only.
  const State& operator[](Eigen::Index i) const { return states_.at(static_cast<std::size_t>(i)); }

  /// Clears every state.
  void reset() {
    for (State& state : states_) state.reset();
  }

 protected:
  /// `count` copies of `state`; count >= 1, checked as the argument `count` of `where`.
  StateBatch(Eigen::Index count, const State& state, const char* where)
      : states_(static_cast<std::size_t>(require_positive_dim(count, where, "count")), state) {}
  StateBatch(const StateBatch&) = default;
  StateBatch(StateBatch&&) noexcept = default;
  StateBatch& operator=(const StateBatch&) = default;
  StateBatch& operator=(StateBatch&&) noexcept = default;
  ~StateBatch() = default;  // protected: a batch is not deleted through its base

  /// The row of a grouped input of `rows` rows that state i reads. With H states per sequence
  /// and H_in rows per sequence, state b * H + h reads row b * H_in + j, j the input head of
  /// Options::head_grouping: h / (H / H_in) interleaved (FLA's, the views' default), which is
  /// i / (size() / rows) whatever H is, or h % H_in tiled (ggml_repeat's), which needs H.
  Eigen::Index input_row(Eigen::Index rows, Eigen::Index i) const {
    if (rows == size()) return i;  // always so in a batch made by hand (require_rows)
    const HeadGrouping grouping = states_.front().options().head_grouping;
    if (grouping == HeadGrouping::interleaved) return i / (size() / rows);
    const Eigen::Index per_sequence = heads_.out;
    const Eigen::Index in = rows / (size() / per_sequence);  // H_in
    return (i / per_sequence) * in +
           grouped_input_head(grouping, i % per_sequence, per_sequence, in);
  }

  /// True when a layer's make_states made the batch: it knows its head counts.
  bool knows_heads() const { return heads_.out > 0; }
  /// The head counts of the layer that made the batch (out = 0: made by hand).
  const LayerHeads& layer_heads() const { return heads_; }

  /// Throws unless an argument of a batch step is size() x cols, or for a grouped input
  /// (`input`: the LayerHeads member of its head count) of a batch a layer's make_states made,
  /// exactly B * H_in x cols, H_in the layer's count. A batch made by hand does not know its
  /// sequences, so it takes a row per state: any smaller count that divides size() could be
  /// one sequence's rows read as the grouped rows of all.
  void require_rows(Eigen::Index rows, Eigen::Index cols, Eigen::Index want_cols,
                    const std::string& shape, const char* name, Eigen::Index LayerHeads::*input,
                    const char* where) const {
    const Eigen::Index sequences = knows_heads() ? size() / heads_.out : 0;
    const Eigen::Index want_rows =
        input != nullptr && knows_heads() ? sequences * (heads_.*input) : size();
    if (rows != want_rows || cols != want_cols) {
      std::string why = " (one row per state)";
      if (input != nullptr && knows_heads()) {
        why = " (B = " + std::to_string(sequences) + " sequences of " +
              std::to_string(heads_.*input) + " " + name +
              " heads, the layer's LayerHeads; row b * " + std::to_string(heads_.*input) +
              " + j for head j of sequence b)";
      } else if (input != nullptr && rows < size() && rows >= 1 && size() % rows == 0) {
        why =
            " (one row per state: a batch made by hand does not know its sequences, so grouped "
            "rows need the layer's make_states(B), whose LayerHeads say how many heads each "
            "input has)";
      }
      throw Error(std::string(where) + ": " + name + " is " + shape + " but the batch needs " +
                  shape_string(want_rows, want_cols) + why);
    }
    if (rows == size()) return;
    // Grouped rows are read by state 0's grouping: every state must have it (one assigned
    // through operator[] may not).
    const HeadGrouping grouping = states_.front().options().head_grouping;
    for (std::size_t i = 1; i < states_.size(); ++i) {
      if (states_[i].options().head_grouping != grouping) {
        throw Error(std::string(where) + ": " + name + " is " + shape +
                    ", grouped heads, but state " + std::to_string(i) +
                    " has another head_grouping than state 0; every state of a batch must have "
                    "the same");
      }
    }
  }

  /// Throws unless a view prefill's q, k, v and out have the layer's head counts, when a
  /// layer's make_states made the batch (the views' own checks allow any divisor of H).
  void require_view_heads(Eigen::Index q_heads, Eigen::Index k_heads, Eigen::Index v_heads,
                          Eigen::Index out_heads, const char* where) const {
    if (!knows_heads()) return;
    if (q_heads != heads_.query || k_heads != heads_.key || v_heads != heads_.value ||
        out_heads != heads_.out) {
      throw Error(std::string(where) + ": q, k, v and out have " + std::to_string(q_heads) + ", " +
                  std::to_string(k_heads) + ", " + std::to_string(v_heads) + " and " +
                  std::to_string(out_heads) + " heads but the layer that made these states has " +
                  heads_string(heads_));
    }
  }

  /// Throws unless every state's S has state 0's shape (a state assigned through operator[]
  /// may not), so that no state moves before another one throws.
  /// @param dims  how the message names S's dimensions, e.g. "C x Dv"
  void require_uniform_dims(const char* dims, const char* where) const {
    const auto& first = StateAccess::held_s(states_.front());
    for (std::size_t i = 0; i < states_.size(); ++i) {
      const auto& s = StateAccess::held_s(states_[i]);
      if (s.rows() != first.rows() || s.cols() != first.cols()) {
        throw Error(std::string(where) + ": state " + std::to_string(i) + " is " + shape_string(s) +
                    " (" + dims + ") but state 0 is " + shape_string(first) +
                    "; every state of a batch must have the same dimensions");
      }
    }
  }

  /// Throws unless every state continues with `kind` (see the states' transition()), before
  /// any state moves.
  /// @param name  how the message names a transition kind
  void require_transitions(TransitionKind kind, const char* (*name)(TransitionKind),
                           const char* where) const {
    for (std::size_t i = 0; i < states_.size(); ++i) {
      const TransitionKind had = states_[i].transition();
      if (!continues_transition(had, kind)) {
        throw transition_mismatch(had, kind, where, "state " + std::to_string(i), name);
      }
    }
  }

  /// body(i) for every state, the states split in equal blocks across `threads`. With
  /// `prefetch`, the next state's S is fetched while a state runs: past the L3 a delta-rule
  /// step is a pass over memory whose strips the hardware's prefetchers do not follow (the
  /// engine's kernel reads S in order and gains nothing).
  template <class Body>
  void for_each_state(int threads, const Body& body, bool prefetch = false) {
    const Eigen::Index count = size();
    const Eigen::Index blocks = std::min<Eigen::Index>(threads, count);
    parallel_for(blocks, static_cast<int>(blocks), [&](Eigen::Index block) {
      const Eigen::Index end = count * (block + 1) / blocks;
      for (Eigen::Index i = count * block / blocks; i < end; ++i) {
        if (prefetch && i + 1 < end) prefetch_state(states_[static_cast<std::size_t>(i + 1)]);
        body(i);
      }
    });
  }

  /// The states' S in bytes, all together.
  std::size_t state_bytes() const {
    const auto& s = StateAccess::held_s(states_.front());
    return states_.size() * static_cast<std::size_t>(s.size()) * sizeof(*s.data());
  }

  /// Asks for every cache line of `state`'s S, to be written (the step updates it in place).
  static void prefetch_state(const State& state) {
#if defined(__GNUC__) || defined(__clang__)
    const auto& s = StateAccess::held_s(state);
    const char* bytes = reinterpret_cast<const char*>(s.data());
    const std::size_t size = static_cast<std::size_t>(s.size()) * sizeof(*s.data());
    for (std::size_t at = 0; at < size; at += 64) __builtin_prefetch(bytes + at, 1, 2);
#else
    (void)state;
#endif
  }

  std::vector<State> states_;
  /// The head counts of the layer whose make_states made the batch (out = 0: made by hand).
  LayerHeads heads_{0};

 private:
  friend struct BatchHeads;
  // The pool lends its sessions' states to a batch for each call, by swapping vectors.
  template <class Batch>
  friend class linattn::SessionPool;
  friend struct PoolAccess;
};

/// Lets a layer tell the batch it makes its head counts.
struct BatchHeads {
  template <class State>
  static void set(StateBatch<State>& batch, const LayerHeads& heads) {
    batch.heads_ = heads;
  }
  template <class State>
  static const LayerHeads& get(const StateBatch<State>& batch) {
    return batch.heads_;
  }
};

}  // namespace linattn::detail
