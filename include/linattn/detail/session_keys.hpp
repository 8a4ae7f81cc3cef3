// SPDX-License-Identifier: MIT
// The live sessions of a pool by key and position: what every SessionPool checks and keeps
// alike, whatever its layers hold.
#pragma once

#include <algorithm>
#include <cstdint>
#include <linattn/config.hpp>
#include <string>
#include <unordered_map>
#include <vector>

namespace linattn::detail {

/// Keys in position order and each key's position. Every check throws Error before a change.
class SessionKeys {
 public:
  using Key = std::int64_t;

  Eigen::Index size() const { return static_cast<Eigen::Index>(keys_.size()); }
  const std::vector<Key>& keys() const { return keys_; }
  bool contains(Key key) const { return positions_.count(key) != 0; }

  /// The position of `key`; throws (starting with `where`) unless it is live.
  Eigen::Index position_of(Key key, const char* where) const {
    const auto found = positions_.find(key);
    if (found == positions_.end()) {
      throw Error(std::string(where) + ": no live session " + std::to_string(key));
    }
    return found->second;
  }

  /// The positions of `keys`, each live and named once (`name`: the argument).
  std::vector<std::size_t> positions_of(const std::vector<Key>& keys, const char* where,
                                        const char* name) const {
    std::vector<std::size_t> at;
    at.reserve(keys.size());
    std::vector<bool> named(keys_.size(), false);
    for (Key key : keys) {
      const std::size_t s = static_cast<std::size_t>(position_of(key, where));
      if (named[s]) {
        throw Error(std::string(where) + ": " + name + " names session " + std::to_string(key) +
                    " twice");
      }
      named[s] = true;
      at.push_back(s);
    }
    return at;
  }

  /// The positions of `order`, a permutation of the live keys.
  std::vector<std::size_t> permutation_of(const std::vector<Key>& order, const char* where) const {
    std::vector<std::size_t> from = positions_of(order, where, "order");
    if (order.size() != keys_.size()) {
      throw Error(std::string(where) + ": order names " + std::to_string(order.size()) +
                  " sessions but " + std::to_string(keys_.size()) +
                  " are live; it must name each live session once");
    }
    return from;
  }

  void require_new(Key key, const char* where) const {
    if (contains(key)) {
      throw Error(std::string(where) + ": session " + std::to_string(key) + " is already live");
    }
  }

  /// Makes room for one more key (may throw); append then cannot.
  void reserve_one() {
    if (keys_.capacity() < keys_.size() + 1)
      keys_.reserve(std::max<std::size_t>(4, 2 * keys_.size()));
    positions_.reserve(keys_.size() + 1);
  }
  /// Appends `key` (new) at position size(), after reserve_one.
  void append(Key key) {
    positions_.emplace(key, static_cast<Eigen::Index>(keys_.size()));
    keys_.push_back(key);
  }
  /// Removes the key at position `at`; the later ones move up.
  void erase(std::size_t at) {
    positions_.erase(keys_[at]);
    keys_.erase(keys_.begin() + static_cast<std::ptrdiff_t>(at));
    renumber(at);
  }
  /// Takes `order` (checked by permutation_of, a copy the caller made) as the new position
  /// order; allocates nothing.
  void reorder(std::vector<Key>& order) noexcept {
    keys_.swap(order);
    renumber(0);
  }

 private:
  void renumber(std::size_t from) {
    for (std::size_t s = from; s < keys_.size(); ++s)
      positions_[keys_[s]] = static_cast<Eigen::Index>(s);
  }

  std::vector<Key> keys_;  // by position
  std::unordered_map<Key, Eigen::Index> positions_;
};

/// `layer` as an index into a pool's `layers` layers; throws (starting with `where`) outside.
inline std::size_t checked_layer(Eigen::Index layer, Eigen::Index layers, const char* where) {
  if (layer < 0 || layer >= layers) {
    throw Error(std::string(where) + ": layer " + std::to_string(layer) + " but the pool has " +
                std::to_string(layers) + " layers");
  }
  return static_cast<std::size_t>(layer);
}

}  // namespace linattn::detail
