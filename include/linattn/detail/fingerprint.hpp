// SPDX-License-Identifier: MIT
// What RecurrentState::save(os, map) records about the feature map, and the check that
// RecurrentState::load(is, map, options) makes against it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <linattn/config.hpp>
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

/// The kinds of feature map a saved state can name (the byte value is in the stream).
enum class MapKind : std::uint8_t {
  unknown = 0,                ///< saved by save(os), without a map: cannot be checked
  identity = 1,               ///< Identity
  elu_plus_one = 2,           ///< EluPlusOne
  relu = 3,                   ///< Relu
  positive_random = 4,        ///< PositiveRandomFeatures
  random_fourier = 5,         ///< RandomFourierFeatures
  user = 6,                   ///< any other map, without a fingerprint() member
  user_with_fingerprint = 7,  ///< any other map, with `std::uint64_t fingerprint() const`
};
inline constexpr std::uint8_t kLastMapKind = 7;

inline const char* map_kind_name(MapKind kind) {
  switch (kind) {
    case MapKind::unknown:
      return "no feature map (saved by save(os))";
    case MapKind::identity:
      return "Identity";
    case MapKind::elu_plus_one:
      return "EluPlusOne";
    case MapKind::relu:
      return "Relu";
    case MapKind::positive_random:
      return "PositiveRandomFeatures";
    case MapKind::random_fourier:
      return "RandomFourierFeatures";
    case MapKind::user:
      return "a user map without fingerprint()";
    case MapKind::user_with_fingerprint:
      return "a user map with fingerprint()";
  }
  return "?";
}

/// The map record of formats 2 and 3 (44 bytes, in this order): kind, projection, row_norm,
/// hyperbolic (one byte each), input_dim, num_features (uint64), temperature (double), seed,
/// hash (uint64). Fields a kind does not have are 0.
struct MapFingerprint {
  MapKind kind = MapKind::unknown;
  std::uint8_t projection = 0;     ///< random maps: 0 orthogonal, 1 iid (how W was drawn)
  std::uint8_t row_norm = 0;       ///< random maps: 0 chi, 1 fixed (how W was drawn)
  std::uint8_t hyperbolic = 0;     ///< PositiveRandomFeatures: options().hyperbolic (Fourier: 0)
  std::uint64_t input_dim = 0;     ///< Dk: C for Identity, EluPlusOne, Relu; 0 for user maps
  std::uint64_t num_features = 0;  ///< random maps: m, rows of W
  double temperature = 0.0;        ///< random maps: the resolved tau, temperature()
  std::uint64_t seed = 0;          ///< random maps: seed() (shown in messages, not compared)
  std::uint64_t hash = 0;          ///< random maps: projection_hash(W); user: fingerprint()
};

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

/// The features a recorded map gives (0 when the record does not say).
inline std::uint64_t recorded_feature_dim(const MapFingerprint& print) {
  switch (print.kind) {
    case MapKind::identity:
    case MapKind::elu_plus_one:
    case MapKind::relu:
      return print.input_dim;
    case MapKind::positive_random:
      return print.hyperbolic ? 2 * print.num_features : print.num_features;
    case MapKind::random_fourier:
      return 2 * print.num_features;
    default:
      return 0;
  }
}

inline void write_fingerprint(LittleEndianWriter& out, const MapFingerprint& print) {
  out.put<std::uint8_t>(static_cast<std::uint8_t>(print.kind));
  out.put<std::uint8_t>(print.projection);
  out.put<std::uint8_t>(print.row_norm);
  out.put<std::uint8_t>(print.hyperbolic);
  out.put<std::uint64_t>(print.input_dim);
  out.put<std::uint64_t>(print.num_features);
  out.put<double>(print.temperature);
  out.put<std::uint64_t>(print.seed);
  out.put<std::uint64_t>(print.hash);
}

/// Reads the record as written; validate_fingerprint checks it once the checksum is known good.
inline MapFingerprint read_fingerprint(LittleEndianReader& in) {
  MapFingerprint print;
  const auto kind = in.get<std::uint8_t>("the feature map kind");
  print.projection = in.get<std::uint8_t>("the feature map's projection");
  print.row_norm = in.get<std::uint8_t>("the feature map's row_norm");
  print.hyperbolic = in.get<std::uint8_t>("the feature map's hyperbolic flag");
  print.input_dim = in.get<std::uint64_t>("the feature map's input_dim");
  print.num_features = in.get<std::uint64_t>("the feature map's num_features");
  print.temperature = in.get<double>("the feature map's temperature");
  print.seed = in.get<std::uint64_t>("the feature map's seed");
  print.hash = in.get<std::uint64_t>("the feature map's hash");
  // An out-of-range kind is kept as read (it fails validation): 0xFF is never a kind.
  print.kind = static_cast<MapKind>(kind <= kLastMapKind ? kind : 0xFF);
  return print;
}

/// Throws unless the record is one save could have written for a state of `feature_dim`
/// features: a known kind, 0/1 flags, zeros in the fields its kind lacks, and a map that gives
/// exactly feature_dim features.
inline void validate_fingerprint(const MapFingerprint& print, std::uint64_t feature_dim,
                                 const char* where) {
  const auto bad = [where](const std::string& what) {
    throw Error(std::string(where) + ": invalid feature map record (" + what + ")");
  };
  if (static_cast<std::uint8_t>(print.kind) > kLastMapKind) bad("unknown kind");
  if (print.projection > 1 || print.row_norm > 1 || print.hyperbolic > 1) bad("a flag over 1");
  const bool random =
      print.kind == MapKind::positive_random || print.kind == MapKind::random_fourier;
  if (random) {
    if (print.input_dim < 1 || print.num_features < 1 ||
        !(print.temperature > 0.0 && std::isfinite(print.temperature))) {
      bad("empty dims or a temperature that is not positive and finite");
    }
    if (print.kind == MapKind::random_fourier && print.hyperbolic != 0) {
      bad("hyperbolic on RandomFourierFeatures, which has no such setting");
    }
  } else {
    if (print.projection != 0 || print.row_norm != 0 || print.hyperbolic != 0 ||
        print.num_features != 0 || print.seed != 0 ||
        !(print.temperature == 0.0 && !std::signbit(print.temperature))) {
      bad(std::string("random-map settings on ") + map_kind_name(print.kind));
    }
    if (print.kind != MapKind::user_with_fingerprint && print.hash != 0) {
      bad(std::string("a hash on ") + map_kind_name(print.kind));
    }
    const bool plain = print.kind == MapKind::identity || print.kind == MapKind::elu_plus_one ||
                       print.kind == MapKind::relu;
    if (!plain && print.input_dim != 0) {
      bad(std::string("an input_dim on ") + map_kind_name(print.kind));
    }
  }
  const std::uint64_t gives = recorded_feature_dim(print);
  if (gives != 0 && gives != feature_dim) {
    bad(std::string(map_kind_name(print.kind)) + " giving " + std::to_string(gives) +
        " features on a state of " + std::to_string(feature_dim));
  }
}

/// The shortest decimal form that reads back as the same double, for messages.
inline std::string format_double(double value) {
  char buffer[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof buffer, "%.*g", precision, value);
    if (std::strtod(buffer, nullptr) == value) break;
  }
  return buffer;
}

inline std::string hex64(std::uint64_t value) {
  char buffer[24];
  std::snprintf(buffer, sizeof buffer, "0x%016llx", static_cast<unsigned long long>(value));
  return buffer;
}

/// "(seed 5, orthogonal, chi rows)": how a random map's W was drawn, for messages.
inline std::string drawn_as(const MapFingerprint& print) {
  return "(seed " + std::to_string(print.seed) + ", " + (print.projection ? "iid" : "orthogonal") +
         ", " + (print.row_norm ? "fixed rows" : "chi rows") + ")";
}

/// Throws Error naming the first setting in which the map a state was saved with (`saved`)
/// differs from the map it is loaded with (`given`). For random maps it compares the input
/// and feature counts, hyperbolic (PositiveRandomFeatures), the resolved temperature and the
/// hash of W; the seed, projection and row_norm only say how W was drawn, so they appear in
/// the message about W but are not compared (the same W from a seed or from a caller loads).
inline void require_same_map(const MapFingerprint& saved, const MapFingerprint& given,
                             const char* where) {
  const std::string head = std::string(where) + ": the state was saved with ";
  if (saved.kind != given.kind) {
    throw Error(head + "feature map " + map_kind_name(saved.kind) + " but the map given is " +
                map_kind_name(given.kind));
  }
  const std::string name = map_kind_name(saved.kind);
  switch (saved.kind) {
    case MapKind::identity:
    case MapKind::elu_plus_one:
    case MapKind::relu:
    case MapKind::user:
      return;
    case MapKind::user_with_fingerprint:
      if (saved.hash != given.hash) {
        throw Error(head + "a user map of fingerprint() " + hex64(saved.hash) +
                    " but the map's fingerprint() is " + hex64(given.hash));
      }
      return;
    case MapKind::positive_random:
    case MapKind::random_fourier:
      break;
    case MapKind::unknown:
    default:
      throw Error(std::string(where) + ": internal: unexpected map kind");
  }
  if (saved.input_dim != given.input_dim) {
    throw Error(head + name + " input_dim " + std::to_string(saved.input_dim) +
                " but the map's input_dim is " + std::to_string(given.input_dim));
  }
  if (saved.num_features != given.num_features) {
    throw Error(head + name + " num_features " + std::to_string(saved.num_features) +
                " but the map's num_features is " + std::to_string(given.num_features));
  }
  if (saved.kind == MapKind::positive_random && saved.hyperbolic != given.hyperbolic) {
    throw Error(head + name + " hyperbolic " + (saved.hyperbolic ? "on" : "off") +
                " but the map's options().hyperbolic is " + (given.hyperbolic ? "on" : "off"));
  }
  if (!(saved.temperature == given.temperature)) {
    throw Error(head + name + " temperature " + format_double(saved.temperature) +
                " but the map's temperature is " + format_double(given.temperature));
  }
  if (saved.hash != given.hash) {
    throw Error(head + name + " W hash " + hex64(saved.hash) + " " + drawn_as(saved) +
                " but the map's W differs: hash " + hex64(given.hash) + " " + drawn_as(given));
  }
}

}  // namespace linattn::detail
