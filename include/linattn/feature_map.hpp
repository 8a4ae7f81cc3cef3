// SPDX-License-Identifier: MIT
// The feature-map concept every kernel and state takes, and Identity, the map of precomputed
// features.
#pragma once

#include <linattn/config.hpp>
#include <linattn/detail/validate.hpp>
#include <type_traits>
#include <utility>

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

/// True for Identity: the kernels then read the inputs as features, in place.
template <class Map>
constexpr bool is_identity_map = std::is_same_v<std::decay_t<Map>, Identity>;

/// A dependent false, for static_asserts in the overloads that catch a missing map.
template <class...>
constexpr bool always_false = false;

}  // namespace detail

}  // namespace linattn
