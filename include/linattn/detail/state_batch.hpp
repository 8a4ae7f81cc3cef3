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
template <class Batch>
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
  /// i / (size() / rows) whatever H is, or h % H_in tiled (ggml's), which needs H.
  Eigen::Index input_row(Eigen::Index rows, Eigen::Index i) const {
    if (rows == size()) return i;
    const HeadGrouping grouping = states_.front().options().head_grouping;
    if (grouping == HeadGrouping::interleaved) return i / (size() / rows);
    const Eigen::Index in = rows / (size() / heads_);  // H_in
    return (i / heads_) * in + grouped_input_head(grouping, i % heads_, heads_, in);
  }

  /// Throws unless an argument of a batch step is size() x cols, or with `grouped` R x cols:
  /// B * H_in rows with H_in dividing H when the batch knows its H heads per sequence (made by
  /// a layer's make_states), else R dividing size() with interleaved heads.
  void require_rows(Eigen::Index rows, Eigen::Index cols, Eigen::Index want_cols,
                    const std::string& shape, const char* name, bool grouped,
                    const char* where) const {
    const Eigen::Index sequences = heads_ > 0 ? size() / heads_ : 0;
    bool rows_ok = rows == size();
    if (grouped && !rows_ok && rows >= 1) {
      rows_ok = heads_ > 0 ? rows % sequences == 0 && heads_ % (rows / sequences) == 0
                           : size() % rows == 0;
    }
    if (!rows_ok || cols != want_cols) {
      std::string grouping = ")";
      if (grouped && heads_ > 0) {
        grouping = ", or B * H_in rows with H_in dividing H = " + std::to_string(heads_) +
                   " for B = " + std::to_string(sequences) +
                   " sequences: grouped heads, row b * H_in + j for input head j of sequence b)";
      } else if (grouped) {
        grouping = ", or R rows with R dividing " + std::to_string(size()) + ": grouped heads)";
      }
      throw Error(std::string(where) + ": " + name + " is " + shape + " but the batch needs " +
                  shape_string(size(), want_cols) + " (one row per state" + grouping);
    }
    if (rows != size() && heads_ == 0 &&
        states_.front().options().head_grouping == HeadGrouping::tiled) {
      throw Error(std::string(where) + ": " + name + " is " + shape +
                  ", grouped heads with HeadGrouping::tiled, but this batch was made by hand and "
                  "does not know its heads per sequence; make it with the layer's "
                  "make_states(B), or give every state its own row");
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
  /// H, the states per sequence, when a layer's make_states made the batch (0: made by hand).
  Eigen::Index heads_ = 0;

 private:
  friend struct BatchHeads;
  // The pool lends its sessions' states to a batch for each call, by swapping vectors.
  template <class Batch>
  friend class linattn::SessionPool;
};

/// Lets a layer tell the batch it makes its heads per sequence.
struct BatchHeads {
  template <class State>
  static void set(StateBatch<State>& batch, Eigen::Index heads) {
    batch.heads_ = heads;
  }
};

}  // namespace linattn::detail
