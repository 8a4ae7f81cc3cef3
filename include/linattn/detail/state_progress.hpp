// SPDX-License-Identifier: MIT
// What every family's state keeps besides its sums: the tokens it has seen and the transition
// that moves it, with one set of rules for all of them.
#pragma once

#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/detail/state_record.hpp>
#include <linattn/gates.hpp>
#include <string>

namespace linattn::detail {

/// The token count and the transition kind of a state. A state keeps the first transition it
/// is moved by (none until then; reset() forgets it) and counts at most 2^62 tokens; both are
/// saved with it. Every family's state holds one, so the rules are the same for all of them.
class StateProgress {
 public:
  /// Tokens seen since construction or the last reset().
  std::int64_t tokens() const { return tokens_; }
  /// What moves the state (none until the first token).
  TransitionKind transition() const { return transition_; }

  /// Throws unless a call moving the state by `kind` continues its transition.
  /// @param name  how the family's messages name a transition (transition_name for the engine)
  void require_continues(TransitionKind kind, const char* where,
                         const char* (*name)(TransitionKind) = transition_name) const {
    if (!continues_transition(transition_, kind)) {
      throw transition_mismatch(transition_, kind, where, "the state", name);
    }
  }

  /// Throws unless `count` more tokens keep the count within 2^62.
  void require_room(Eigen::Index count, const char* where) const {
    if (tokens_ > kMaxStateTokens - static_cast<std::int64_t>(count)) {
      throw Error(std::string(where) + ": the token count would pass 2^62");
    }
  }

  /// Counts `count` tokens moved by `kind` (checked first); no token changes nothing.
  void advance(Eigen::Index count, TransitionKind kind) {
    if (count <= 0) return;
    tokens_ += static_cast<std::int64_t>(count);
    transition_ = kind;
  }

  /// No tokens, no transition.
  void reset() { *this = StateProgress(); }

  /// Copies the count and the transition into a record to save.
  void write(StateRecord& record) const {
    record.tokens = tokens_;
    record.transition = transition_;
  }

  /// The count and the transition of a verified record.
  static StateProgress of(const StateRecord& record) {
    StateProgress progress;
    progress.tokens_ = record.tokens;
    progress.transition_ = record.transition;
    return progress;
  }

 private:
  std::int64_t tokens_ = 0;
  TransitionKind transition_ = TransitionKind::none;
};

}  // namespace linattn::detail
