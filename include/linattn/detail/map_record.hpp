// SPDX-License-Identifier: MIT
// The feature-map record of a saved linear-attention state: its fields, its 44-byte encoding,
// its validation, and the check RecurrentState::load(is, map, options) makes against it. Kept
// apart from the feature maps so that the state reader (detail/state_record.hpp) needs none.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <linattn/config.hpp>
#include <linattn/detail/serialize.hpp>
#include <string>

namespace linattn::detail {

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
