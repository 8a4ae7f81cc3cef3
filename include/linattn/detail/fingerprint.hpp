// SPDX-License-Identifier: MIT
// What RecurrentState::save(os, map) records about a feature map: the record of a map object
// (detail/map_record.hpp holds the record itself, its encoding and the load-time check).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <linattn/config.hpp>
#include <linattn/detail/map_record.hpp>
#include <linattn/detail/serialize.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/feature_maps.hpp>
#include <string>
#include <type_traits>
#include <utility>

namespace linattn::detail {

/// FNV-1a, 64 bits (offset basis 0xcbf29ce484222325, prime 0x100000001b3), over bytes: the
/// same value on every platform for the same bytes. FNV-1a("") = 0xcbf29ce484222325,
/// FNV-1a("a") = 0xaf63dc4c8601ec8c.
class Fnv1a64 {
 public:
  void update(const unsigned char* data, std::size_t size) {
    for (std::size_t i = 0; i < size; ++i) {
      hash_ ^= data[i];
      hash_ *= 0x100000001b3ull;
    }
  }
  /// The 8 bytes of `value`, least significant first.
  void update_u64(std::uint64_t value) {
    unsigned char bytes[8];
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>((value >> (8 * i)) & 0xFFu);
    update(bytes, 8);
  }
  std::uint64_t value() const { return hash_; }

 private:
  std::uint64_t hash_ = 0xcbf29ce484222325ull;
};

/// The hash of a random-feature projection W (m x Dk, double): FNV-1a 64 over rows and cols
/// (each a little-endian uint64), then every entry in row-major order as the 8 little-endian
/// bytes of its IEEE-754 binary64 bits. Exact bits: -0.0 and 0.0 hash differently.
template <class Derived>
std::uint64_t projection_hash(const Eigen::MatrixBase<Derived>& w) {
  static_assert(std::is_same_v<typename Derived::Scalar, double>, "W is kept in double");
  Fnv1a64 hash;
  hash.update_u64(static_cast<std::uint64_t>(w.rows()));
  hash.update_u64(static_cast<std::uint64_t>(w.cols()));
  for (Eigen::Index r = 0; r < w.rows(); ++r) {
    for (Eigen::Index c = 0; c < w.cols(); ++c) {
      const double entry = w(r, c);
      std::uint64_t bits;
      std::memcpy(&bits, &entry, sizeof bits);
      hash.update_u64(bits);
    }
  }
  return hash.value();
}

/// A user map's optional extension point: `std::uint64_t fingerprint() const`, a hash of
/// whatever changes its features (its weights, its settings), saved and compared on load.
template <class Map, class = void>
struct has_fingerprint : std::false_type {};
template <class Map>
struct has_fingerprint<Map, std::void_t<decltype(std::declval<const Map&>().fingerprint())>>
    : std::is_convertible<decltype(std::declval<const Map&>().fingerprint()), std::uint64_t> {};

template <class Map>
MapFingerprint random_map_fingerprint(const Map& map, MapKind kind) {
  MapFingerprint print;
  print.kind = kind;
  const RandomFeatureOptions& options = map.options();
  print.projection = options.projection == Projection::iid ? 1 : 0;
  print.row_norm = options.row_norm == RowNorm::fixed ? 1 : 0;
  // RandomFourierFeatures ignores hyperbolic: recorded as 0, so it is no setting of that map.
  print.hyperbolic = kind == MapKind::positive_random && options.hyperbolic ? 1 : 0;
  print.input_dim = static_cast<std::uint64_t>(map.input_dim());
  print.num_features = static_cast<std::uint64_t>(map.num_features());
  print.temperature = map.temperature();
  print.seed = map.seed();
  print.hash = projection_hash(map.projection());
  return print;
}

/// What save(os, map) records for `map` on a state of `feature_dim` features. Only the exact
/// library types are recognised; anything else (derived classes included) is a user map.
template <class Map>
MapFingerprint fingerprint_of(const Map& map, Eigen::Index feature_dim) {
  using M = std::decay_t<Map>;
  MapFingerprint print;
  if constexpr (std::is_same_v<M, Identity> || std::is_same_v<M, EluPlusOne> ||
                std::is_same_v<M, Relu>) {
    print.kind = std::is_same_v<M, Identity>     ? MapKind::identity
                 : std::is_same_v<M, EluPlusOne> ? MapKind::elu_plus_one
                                                 : MapKind::relu;
    print.input_dim = static_cast<std::uint64_t>(feature_dim);
  } else if constexpr (std::is_same_v<M, PositiveRandomFeatures>) {
    print = random_map_fingerprint(map, MapKind::positive_random);
  } else if constexpr (std::is_same_v<M, RandomFourierFeatures>) {
    print = random_map_fingerprint(map, MapKind::random_fourier);
  } else if constexpr (has_fingerprint<M>::value) {
    print.kind = MapKind::user_with_fingerprint;
    print.hash = static_cast<std::uint64_t>(map.fingerprint());
  } else {
    print.kind = MapKind::user;
  }
  return print;
}

}  // namespace linattn::detail
