// SPDX-License-Identifier: MIT
// The sequences of a view call: B padded ones, or packed ones split by offsets (cu_seqlens).
#pragma once

#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/heads_view.hpp>
#include <string>
#include <vector>

namespace linattn::detail {

/// Which rows of which batch entry each sequence covers: all N rows of entry s for a padded
/// batch, rows [offsets[s], offsets[s+1]) of entry 0 for a packed one. Cross-attention's keys
/// and values (padded batches only) have N_k rows of their own.
struct SequenceRows {
  Eigen::Index count = 0;
  Eigen::Index tokens = 0;                             ///< N, for a padded batch
  const std::vector<std::int64_t>* offsets = nullptr;  ///< S + 1 offsets, for a packed batch
  Eigen::Index key_tokens = -1;                        ///< N_k when not N (cross-attention)

  Eigen::Index batch_of(Eigen::Index s) const { return offsets ? 0 : s; }
  Eigen::Index begin(Eigen::Index s) const { return offsets ? (*offsets)[s] : 0; }
  Eigen::Index rows(Eigen::Index s) const {
    return offsets ? (*offsets)[s + 1] - (*offsets)[s] : tokens;
  }
  /// The rows of k and v: rows(s), or N_k for cross-attention.
  Eigen::Index key_rows(Eigen::Index s) const { return key_tokens >= 0 ? key_tokens : rows(s); }
};

/// Throws unless the offsets split `tokens` rows into sequences: 0 = o_0 <= o_1 <= ... = N.
inline void validate_offsets(const std::vector<std::int64_t>& offsets, Eigen::Index tokens,
                             const char* where) {
  if (offsets.size() < 2) {
    throw Error(std::string(where) + ": offsets needs at least 2 entries (0 and the total), got " +
                std::to_string(offsets.size()));
  }
  if (offsets.front() != 0) {
    throw Error(std::string(where) + ": offsets[0] must be 0, got " +
                std::to_string(offsets.front()));
  }
  for (std::size_t s = 1; s < offsets.size(); ++s) {
    if (offsets[s] < offsets[s - 1]) {
      throw Error(std::string(where) + ": offsets must not decrease, but offsets[" +
                  std::to_string(s) + "] = " + std::to_string(offsets[s]) + " < offsets[" +
                  std::to_string(s - 1) + "] = " + std::to_string(offsets[s - 1]));
    }
  }
  if (offsets.back() != tokens) {
    throw Error(std::string(where) + ": offsets.back() = " + std::to_string(offsets.back()) +
                " but the views hold " + std::to_string(tokens) + " tokens");
  }
}

/// The sequences of a view call: B of N tokens, or (offsets) the packed sequences of a B = 1
/// view, checked.
template <class Q>
SequenceRows sequence_rows(const HeadsView<Q>& q, const std::vector<std::int64_t>* offsets,
                           const char* where, const char* q_name) {
  SequenceRows sequences{q.batch(), q.tokens(), offsets};
  if (offsets) {
    if (q.batch() != 1) {
      throw Error(std::string(where) +
                  ": a packed batch is one row of sequences, so B must be 1; " + q_name + " is " +
                  q.sizes_string());
    }
    validate_offsets(*offsets, q.tokens(), where);
    sequences.count = static_cast<Eigen::Index>(offsets->size()) - 1;
  }
  return sequences;
}

}  // namespace linattn::detail
