// SPDX-License-Identifier: MIT
// What every family's recurrent state is besides its recurrence: what it carries, its options,
// the tokens it has seen, and the frame of the record it saves.
#pragma once

#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/detail/state_progress.hpp>
#include <linattn/detail/state_record.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/gates.hpp>
#include <string>
#include <utility>

namespace linattn::detail {

/// The part of a recurrent state that does not depend on its family: what it carries from
/// token to token, its options, the tokens it has seen and the transition that moves it
/// (StateProgress), the frame of its saved record, and the reads every state answers.
/// RecurrentState and DeltaRuleState derive from it and add their recurrence: the step and
/// prefill calls, their checks, and the settings their record holds.
/// @tparam Carried        what moves from token to token, all of it (reset() clears only
///                        this): a struct whose member `s` is S, rows x Dv (the record's
///                        dims; keys or features by values), with `clear()` to forget every token
///                        (CarriedState<Acc> for the engine, HeldMatrix<Acc> for the delta rule)
/// @tparam FamilyOptions  the family's options (Options, DeltaOptions)
template <class Carried, class FamilyOptions>
class StateCore {
 public:
  /// Tokens seen since construction or the last reset().
  std::int64_t tokens() const { return progress_.tokens(); }
  /// What moves the state: none until its first token (and after reset(), or when an earlier
  /// format's file did not say); save and load keep it. A step or prefill with another kind
  /// throws.
  TransitionKind transition() const { return progress_.transition(); }
  /// Dv, the columns of S.
  Eigen::Index value_dim() const { return carried_.s.cols(); }
  /// The options given at construction (or read by load).
  const FamilyOptions& options() const { return options_; }
  /// Forgets every token; keeps the dimensions and options.
  void reset() {
    carried_.clear();
    progress_.reset();
  }

 protected:
  StateCore(Carried carried, const FamilyOptions& options)
      : carried_(std::move(carried)), options_(options) {}
  StateCore(const StateCore&) = default;
  StateCore(StateCore&&) = default;
  StateCore& operator=(const StateCore&) = default;
  StateCore& operator=(StateCore&&) = default;
  ~StateCore() = default;  // protected: a state is not deleted through its core

  /// A record to save: the family, the dims of S, the tokens and the transition filled in;
  /// the family adds its settings.
  StateRecord record_of(StateFamily family) const {
    StateRecord record;
    record.family = family;
    record.rows = static_cast<std::uint64_t>(carried_.s.rows());
    record.cols = static_cast<std::uint64_t>(carried_.s.cols());
    progress_.write(record);
    return record;
  }

  /// Takes the tokens and the transition of a verified record (the family reads its sums).
  void take_progress(const StateRecord& stored) { progress_ = StateProgress::of(stored); }

  /// Throws unless a call of `count` tokens moved by `kind` may continue the state.
  /// @param name  how the family's messages name a transition kind
  void require_advance(TransitionKind kind, Eigen::Index count, const char* where,
                       const char* (*name)(TransitionKind)) const {
    progress_.require_continues(kind, where, name);
    require_token_room(count, where);
  }

  /// Throws unless `count` more tokens keep the count within 2^62 (a batch asks each state).
  void require_token_room(Eigen::Index count, const char* where) const {
    progress_.require_room(count, where);
  }

  /// The stored S (StateAccess::held_s: a batch's shape checks and prefetches).
  const auto& held_s() const { return carried_.s; }

  Carried carried_;
  FamilyOptions options_;
  StateProgress progress_;  ///< the tokens seen, what has moved the state
};

/// S = s0 in Acc for a state's from_state, checked: not empty and finite. `where` names the
/// caller in messages.
template <class Acc, class DS>
Matrix<Acc> initial_state(const Eigen::MatrixBase<DS>& s0, const char* where) {
  if (s0.rows() < 1 || s0.cols() < 1) {
    throw Error(std::string(where) + ": s0 is empty (" + shape_string(s0) +
                "), expected Dk x Dv with Dk, Dv >= 1");
  }
  Matrix<Acc> s = s0.template cast<Acc>();
  require_finite(s, where, "s0");
  return s;
}

/// What a state carries when S is all of it (the delta rule's).
template <class Acc>
struct HeldMatrix {
  Matrix<Acc> s;  ///< rows x Dv
  /// S = 0.
  void clear() { s.setZero(); }
};

}  // namespace linattn::detail
