// SPDX-License-Identifier: MIT
// The sums a state holds, as it holds them, for the library's own code and its tests.
#pragma once

namespace linattn::detail {

/// What a state holds, as it holds it (a RecurrentState's sums are stored scaled; its s() and
/// z() are the true S and z): for a batch's shape checks and prefetches, and for tests that
/// compare two states bit for bit. Not a way to read a state's S.
struct StateAccess {
  /// The stored S (its shape and memory are the state's).
  template <class State>
  static const auto& held_s(const State& state) {
    return state.held_s();
  }
  /// Everything a state stores (a RecurrentState's detail::CarriedState).
  template <class State>
  static const auto& held(const State& state) {
    return state.held();
  }
  /// The record a state saves (args: a RecurrentState's map fingerprint, or nothing).
  template <class State, class... Args>
  static auto record(const State& state, const Args&... args) {
    return state.record(args...);
  }
  /// The state a verified record holds, checked as State::load checks a stream (args: the
  /// map's fingerprint for a RecurrentState, then the options; `where` names the caller).
  template <class State, class Record, class... Args>
  static State restore(const Record& stored, const Args&... args) {
    return State::restore(stored, args...);
  }
};

}  // namespace linattn::detail
