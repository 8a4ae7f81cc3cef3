// SPDX-License-Identifier: MIT
// Rollback for speculative decoding: the states before and after each of K draft tokens, kept
// in storage allocated once, so that keeping the first m drafts is one copy.
#pragma once

#include <linattn/config.hpp>
#include <string>
#include <vector>

namespace linattn {

/// A ring of K + 1 copies of a layer's states (any copyable states: a mixer's States, a
/// StateBatch, ConvWindows): `begin` keeps the accepted states, `record` the states after
/// each draft token, and `rollback(states, m)` puts back the states after the first m drafts
/// (0 <= m <= recorded()). Decoding the drafts with the same per-token steps as plain decoding
/// makes a rollback to m bit for bit the states of decoding the m accepted tokens alone.
/// Storage grows to the most drafts a round has recorded; later rounds copy into it.
///
///   ring.begin(states);
///   for (t < K) { mixer.step_into(states, draft[t], y[t]); ring.record(states); }
///   ring.rollback(states, m);   // m drafts accepted (the target model's verdict)
///
/// The other way, replay, keeps only the accepted states (one copy) and, after putting them
/// back, steps the m accepted tokens again: two copies a round instead of K + 1, and m more
/// steps. Which wins depends on the shape (bench_mixer's BM_DraftRound, docs/performance.md):
/// at Qwen3.5-9B's Gated DeltaNet shape a copy of the states (2 MiB a sequence) costs more
/// than a step, and replay wins for every m of K = 4; at small shapes they tie. The rollback
/// itself is one copy either way, under one step's cost.
/// @tparam States  a copy-assignable states type
template <class States>
class DraftRing {
 public:
  /// @param capacity  K, the most draft tokens of a round (>= 1)
  explicit DraftRing(Eigen::Index capacity) : capacity_(capacity) {
    if (capacity < 1) {
      throw Error("DraftRing: capacity must be >= 1 draft token, got " + std::to_string(capacity));
    }
  }

  /// K, the most drafts a round records.
  Eigen::Index capacity() const { return capacity_; }
  /// Drafts recorded since begin().
  Eigen::Index recorded() const { return recorded_; }

  /// Starts a round from the accepted states (kept as the rollback to m = 0).
  void begin(const States& accepted) {
    store(0, accepted);
    recorded_ = 0;
    started_ = true;
  }

  /// Keeps the states after the next draft token.
  void record(const States& after) {
    if (!started_) throw Error("DraftRing::record: call begin(states) first");
    if (recorded_ == capacity_) {
      throw Error("DraftRing::record: the ring holds " + std::to_string(capacity_) +
                  " drafts; begin a new round (or make a larger ring)");
    }
    store(static_cast<std::size_t>(recorded_ + 1), after);
    ++recorded_;
  }

  /// states = the states after the first m drafts of this round (m = 0: the accepted states
  /// begin() kept). The round goes on from there: recorded() becomes m, so the next record()
  /// follows the m kept drafts.
  /// @param states  overwritten
  /// @param m       0 <= m <= recorded()
  void rollback(States& states, Eigen::Index m) {
    if (!started_) throw Error("DraftRing::rollback: no round begun");
    if (m < 0 || m > recorded_) {
      throw Error("DraftRing::rollback: m = " + std::to_string(m) + " but the round recorded " +
                  std::to_string(recorded_) + " drafts (0 <= m <= " + std::to_string(recorded_) +
                  ")");
    }
    states = slots_[static_cast<std::size_t>(m)];
    recorded_ = m;
  }

  /// The states after the first m drafts, read-only (0 <= m <= recorded()).
  const States& at(Eigen::Index m) const {
    if (!started_ || m < 0 || m > recorded_) {
      throw Error("DraftRing::at: m = " + std::to_string(m) + " is not a recorded position (0.." +
                  std::to_string(recorded_) + ")");
    }
    return slots_[static_cast<std::size_t>(m)];
  }

 private:
  void store(std::size_t slot, const States& states) {
    if (slot < slots_.size()) {
      slots_[slot] = states;  // into the storage of an earlier round
    } else {
      slots_.push_back(states);
    }
  }

  Eigen::Index capacity_;
  Eigen::Index recorded_ = 0;
  bool started_ = false;
  std::vector<States> slots_;
};

}  // namespace linattn
