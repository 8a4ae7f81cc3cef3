// SPDX-License-Identifier: MIT
// The feature-map concept every kernel and state takes, and Identity, the map of precomputed
// features.
#pragma once

#include <linattn/config.hpp>
#include <linattn/detail/validate.hpp>
#include <type_traits>
#include <utility>

/// # The feature-map concept
///
/// Every kernel, state and layer takes a feature map phi: R^Dk -> R^C as an argument. A map is
/// a small copyable object; const objects may be shared by any number of threads. Required
/// (D is any Eigen expression; a template or overloads for Matrix<float>, Matrix<double>):
///
///     Eigen::Index feature_dim(Eigen::Index input_dim) const;          // C for width Dk
///     Matrix<typename D::Scalar> queries(const MatrixBase<D>& x) const;  // N x Dk -> N x C
///     Matrix<typename D::Scalar> keys(const MatrixBase<D>& x) const;     // N x Dk -> N x C
///
/// The kernels call them on chunks of rows converted to the accumulation type. Optional, each
/// used when present:
///
/// - `void queries_into(x, Eigen::Ref<Matrix<Scalar>> out) const` and `keys_into`: write into
///   a preallocated N x C `out`; with them RecurrentState::step_into allocates nothing.
/// - `Matrix backward(x, grad_phi) const`: d loss / d x (N x Dk) from d loss / d phi(x), for
///   the backward overloads.
/// - `std::uint64_t fingerprint() const`: saved with a state and compared on load, so a state
///   is never stepped with another map's weights.
/// - `static constexpr bool finite_features = true`: finite inputs always give finite
///   features, so the backward need not featurize q and k once more to check them first.
/// - `static constexpr bool log_scaled = true` with `scaled_features(x, log_scale)` (rows
///   divided by exp(log_scale(r))): exponential maps, carried in log space so nothing
///   overflows (see PositiveRandomFeatures).
///
/// A map missing a required member is a compile error that names the member
/// (detail::check_feature_map). Identity below is the smallest complete map;
/// examples/custom_feature_map.cpp writes a second-order Taylor map.
namespace linattn {

/// phi(x) = x, C = Dk: the map to pass when q and k are already features (computed by the
/// caller, e.g. by a learned projection). Every entry point that takes q, k takes a map, so
/// forgetting the map does not compile; Identity says "these are features" in so many words.
/// The kernels read Identity inputs in place (no copy).
struct Identity {
  /// @return C = input_dim
  Eigen::Index feature_dim(Eigen::Index input_dim) const { return input_dim; }

  /// @param x  N x Dk queries, one row per token
  /// @return   x itself, N x Dk
  template <class Derived>
  Matrix<typename Derived::Scalar> queries(const Eigen::MatrixBase<Derived>& x) const {
    return x;
  }

  /// @param x  N x Dk keys, one row per token
  /// @return   x itself, N x Dk
  template <class Derived>
  Matrix<typename Derived::Scalar> keys(const Eigen::MatrixBase<Derived>& x) const {
    return x;
  }

  /// As queries(x), into a caller's N x Dk `out`; allocates nothing.
  template <class Derived>
  void queries_into(const Eigen::MatrixBase<Derived>& x,
                    Eigen::Ref<Matrix<typename Derived::Scalar>> out) const {
    out = x;
  }

  /// As keys(x), into a caller's N x Dk `out`; allocates nothing.
  template <class Derived>
  void keys_into(const Eigen::MatrixBase<Derived>& x,
                 Eigen::Ref<Matrix<typename Derived::Scalar>> out) const {
    out = x;
  }

  /// The gradient passes through unchanged.
  /// @param x         N x Dk inputs
  /// @param grad_phi  N x Dk gradient with respect to phi(x)
  /// @return          grad_phi, N x Dk
  template <class DX, class DG>
  Matrix<typename DX::Scalar> backward(const Eigen::MatrixBase<DX>& x,
                                       const Eigen::MatrixBase<DG>& grad_phi) const {
    detail::require_same_shape(x, grad_phi, "Identity::backward");
    return grad_phi;
  }
};

namespace detail {

/// Detects the feature-map concept (a `feature_dim(Index) const` member).
template <class Map, class = void>
struct is_feature_map : std::false_type {};
template <class Map>
struct is_feature_map<Map, std::void_t<decltype(std::declval<const Map&>().feature_dim(
                               std::declval<Eigen::Index>()))>> : std::true_type {};

/// Detects maps that return rows scaled to max 1 plus a per-row log scale (exponential maps).
template <class Map, class = void>
struct is_log_scaled : std::false_type {};
template <class Map>
struct is_log_scaled<Map, std::enable_if_t<Map::log_scaled>> : std::true_type {};

/// The default of every `map` parameter: a call that names no map gets a static_assert
/// telling it to pass one, instead of treating raw q, k as features.
struct MissingFeatureMap {};

template <class Map, class = void>
struct has_feature_dim : std::false_type {};
template <class Map>
struct has_feature_dim<Map,
                       std::void_t<decltype(Eigen::Index{std::declval<const Map&>().feature_dim(
                           std::declval<Eigen::Index>())})>> : std::true_type {};

template <class Map, class Scalar, class = void>
struct has_queries : std::false_type {};
template <class Map, class Scalar>
struct has_queries<Map, Scalar,
                   std::void_t<decltype(Matrix<Scalar>(std::declval<const Map&>().queries(
                       std::declval<const Matrix<Scalar>&>())))>> : std::true_type {};

template <class Map, class Scalar, class = void>
struct has_keys : std::false_type {};
template <class Map, class Scalar>
struct has_keys<Map, Scalar,
                std::void_t<decltype(Matrix<Scalar>(std::declval<const Map&>().keys(
                    std::declval<const Matrix<Scalar>&>())))>> : std::true_type {};

template <class Map, class Scalar, class = void>
struct has_queries_into : std::false_type {};
template <class Map, class Scalar>
struct has_queries_into<
    Map, Scalar,
    std::void_t<decltype(std::declval<const Map&>().queries_into(
        std::declval<const Matrix<Scalar>&>(), std::declval<Eigen::Ref<Matrix<Scalar>>>()))>>
    : std::true_type {};

template <class Map, class Scalar, class = void>
struct has_keys_into : std::false_type {};
template <class Map, class Scalar>
struct has_keys_into<
    Map, Scalar,
    std::void_t<decltype(std::declval<const Map&>().keys_into(
        std::declval<const Matrix<Scalar>&>(), std::declval<Eigen::Ref<Matrix<Scalar>>>()))>>
    : std::true_type {};

template <class Map, class Scalar, class = void>
struct has_scaled_features_into : std::false_type {};
template <class Map, class Scalar>
struct has_scaled_features_into<
    Map, Scalar,
    std::void_t<decltype(std::declval<const Map&>().scaled_features_into(
        std::declval<const Matrix<Scalar>&>(), std::declval<Eigen::Ref<Matrix<Scalar>>>(),
        std::declval<Eigen::Ref<Vector<double>>>()))>> : std::true_type {};

/// True for a map that declares finite features for finite inputs (finite_features).
template <class Map, class = void>
struct has_finite_features : std::false_type {};
template <class Map>
struct has_finite_features<Map, std::enable_if_t<Map::finite_features>> : std::true_type {};

/// Detects a feature map with a `backward(x, grad_phi)` member.
template <class Map, class Scalar, class = void>
struct has_map_backward : std::false_type {};
template <class Map, class Scalar>
struct has_map_backward<
    Map, Scalar,
    std::void_t<decltype(std::declval<const Map&>().backward(
        std::declval<const Matrix<Scalar>&>(), std::declval<const Matrix<Scalar>&>()))>>
    : std::true_type {};

/// True when Map satisfies the whole concept for inputs of type Scalar.
template <class Map, class Scalar>
constexpr bool is_usable_feature_map =
    has_feature_dim<Map>::value&& has_queries<Map, Scalar>::value&& has_keys<Map, Scalar>::value;

/// The concept check of every entry point that takes a map: each failure names what to do.
/// Returns whether Map is usable, so callers can skip the body (and its follow-on errors).
template <class Map, class Scalar>
constexpr bool check_feature_map() {
  static_assert(!std::is_same_v<Map, MissingFeatureMap>,
                "linattn: this call needs a feature map argument after v: pass "
                "linattn::Identity{} when q and k are already features, or a map such as "
                "linattn::EluPlusOne{}");
  static_assert(std::is_same_v<Map, MissingFeatureMap> || !std::is_same_v<Map, Options>,
                "linattn: the feature map comes before the Options: write f(q, k, v, "
                "linattn::Identity{}, options) for precomputed features");
  static_assert(std::is_same_v<Map, MissingFeatureMap> || std::is_same_v<Map, Options> ||
                    has_feature_dim<Map>::value,
                "linattn: a feature map needs a member `Eigen::Index feature_dim(Eigen::Index "
                "input_dim) const` (see linattn/feature_map.hpp)");
  static_assert(!has_feature_dim<Map>::value || has_queries<Map, Scalar>::value,
                "linattn: a feature map needs a const member `queries(x)` taking an N x Dk "
                "linattn::Matrix and returning its N x C features (see linattn/feature_map.hpp)");
  static_assert(!has_feature_dim<Map>::value || has_keys<Map, Scalar>::value,
                "linattn: a feature map needs a const member `keys(x)` taking an N x Dk "
                "linattn::Matrix and returning its N x C features (see linattn/feature_map.hpp)");
  return is_usable_feature_map<Map, Scalar>;
}

/// out = map.queries(x), through map.queries_into when the map has it (no allocation).
template <class Map, class DX>
void map_queries_into(const Map& map, const Eigen::MatrixBase<DX>& x,
                      Eigen::Ref<Matrix<typename DX::Scalar>> out) {
  if constexpr (has_queries_into<Map, typename DX::Scalar>::value) {
    map.queries_into(x, out);
  } else {
    out = map.queries(x);
  }
}

/// out = map.keys(x), through map.keys_into when the map has it (no allocation).
template <class Map, class DX>
void map_keys_into(const Map& map, const Eigen::MatrixBase<DX>& x,
                   Eigen::Ref<Matrix<typename DX::Scalar>> out) {
  if constexpr (has_keys_into<Map, typename DX::Scalar>::value) {
    map.keys_into(x, out);
  } else {
    out = map.keys(x);
  }
}

/// out, log_scale = map.scaled_features(x), through scaled_features_into when the map has it.
template <class Map, class DX>
void map_scaled_features_into(const Map& map, const Eigen::MatrixBase<DX>& x,
                              Eigen::Ref<Matrix<typename DX::Scalar>> out,
                              Eigen::Ref<Vector<double>> log_scale) {
  if constexpr (has_scaled_features_into<Map, typename DX::Scalar>::value) {
    map.scaled_features_into(x, out, log_scale);
  } else {
    Vector<double> log;
    out = map.scaled_features(x, log);
    log_scale = log;
  }
}

/// True for Identity: the kernels then read the inputs as features, in place.
template <class Map>
constexpr bool is_identity_map = std::is_same_v<std::decay_t<Map>, Identity>;

/// A dependent false, for static_asserts in the overloads that catch a missing map.
template <class...>
constexpr bool always_false = false;

}  // namespace detail

}  // namespace linattn
