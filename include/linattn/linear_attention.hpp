// SPDX-License-Identifier: MIT
// Causal and non-causal linear attention, on featurized inputs or with a feature map.
#pragma once

#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/validate.hpp>

#include <type_traits>

namespace linattn {

namespace detail {

template <class DQ, class DK, class DV>
using enable_if_same_scalar =
    std::enable_if_t<std::is_same_v<typename DQ::Scalar, typename DK::Scalar> &&
                     std::is_same_v<typename DQ::Scalar, typename DV::Scalar>>;

template <class Map>
using enable_if_feature_map = std::enable_if_t<is_feature_map<Map>::value>;

template <class Scalar>
void static_check_scalar() {
  static_assert(is_supported_scalar<Scalar>, "linattn kernels take float or double inputs");
}

}  // namespace detail

/// Causal linear attention on featurized inputs, chunked (parallel) form, into `out`.
/// out_i = phi_q_i^T S_i / (phi_q_i . z_i + eps), S_i = sum_{j<=i} g^(i-j) phi_k_j v_j^T.
/// Allocates O(chunk * (C + Dv) + chunk^2 + C * Dv), nothing proportional to N.
/// @param phi_q  N x C featurized queries, one row per token
/// @param phi_k  N x C featurized keys
/// @param v      N x Dv values
/// @param out    N x Dv result (may not alias the inputs)
/// @param options  eps, decay, normalize, chunk, check_finite
template <class DQ, class DK, class DV, class = detail::enable_if_same_scalar<DQ, DK, DV>>
void causal_linear_attention_into(const Eigen::MatrixBase<DQ>& phi_q,
                                  const Eigen::MatrixBase<DK>& phi_k,
                                  const Eigen::MatrixBase<DV>& v,
                                  Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                                  const Options& options = {}) {
  using Scalar = typename DQ::Scalar;
  detail::static_check_scalar<Scalar>();
  constexpr const char* where = "causal_linear_attention";
  detail::validate_sequence(phi_q, phi_k, v, options, where, "phi_q", "phi_k");
  detail::require_output_shape(out, phi_q.rows(), v.cols(), where);
  const detail::FeaturizedSource<DQ, DK, DV> source(phi_q.derived(), phi_k.derived(), v.derived());
  detail::CarriedState<Scalar> state(phi_q.cols(), v.cols());
  detail::ChunkedKernel<Scalar> kernel(phi_q.cols(), v.cols(), phi_q.rows(), options);
  kernel.causal(source, state, out);
}

/// Causal linear attention on featurized inputs; returns N x Dv. See causal_linear_attention_into.
/// @param phi_q  N x C featurized queries
/// @param phi_k  N x C featurized keys
/// @param v      N x Dv values
template <class DQ, class DK, class DV, class = detail::enable_if_same_scalar<DQ, DK, DV>>
Matrix<typename DQ::Scalar> causal_linear_attention(const Eigen::MatrixBase<DQ>& phi_q,
                                                    const Eigen::MatrixBase<DK>& phi_k,
                                                    const Eigen::MatrixBase<DV>& v,
                                                    const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(phi_q.rows(), v.cols());
  causal_linear_attention_into(phi_q, phi_k, v, out, options);
  return out;
}

/// Causal linear attention with a feature map applied chunk by chunk, into `out`. Exponential
/// maps (PositiveRandomFeatures) go through the log-scale stabiliser: no overflow, same result.
/// @param q    N x Dk queries
/// @param k    N x Dk keys
/// @param v    N x Dv values
/// @param map  feature map (EluPlusOne, Relu, PositiveRandomFeatures, RandomFourierFeatures, ...)
/// @param out  N x Dv result
template <class DQ, class DK, class DV, class Map,
          class = detail::enable_if_same_scalar<DQ, DK, DV>,
          class = detail::enable_if_feature_map<Map>>
void causal_linear_attention_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                  const Eigen::MatrixBase<DV>& v, const Map& map,
                                  Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                                  const Options& options = {}) {
  using Scalar = typename DQ::Scalar;
  detail::static_check_scalar<Scalar>();
  constexpr const char* where = "causal_linear_attention";
  detail::validate_sequence(q, k, v, options, where, "q", "k");
  detail::require_output_shape(out, q.rows(), v.cols(), where);
  const detail::MappedSource<DQ, DK, DV, Map> source(q.derived(), k.derived(), v.derived(), map,
                                                      options.check_finite, where);
  detail::CarriedState<Scalar> state(source.feature_dim(), v.cols());
  detail::ChunkedKernel<Scalar> kernel(source.feature_dim(), v.cols(), q.rows(), options);
  kernel.causal(source, state, out);
}

/// Causal linear attention with a feature map; returns N x Dv.
/// @param q    N x Dk queries
/// @param k    N x Dk keys
/// @param v    N x Dv values
/// @param map  feature map
template <class DQ, class DK, class DV, class Map,
          class = detail::enable_if_same_scalar<DQ, DK, DV>,
          class = detail::enable_if_feature_map<Map>>
Matrix<typename DQ::Scalar> causal_linear_attention(const Eigen::MatrixBase<DQ>& q,
                                                    const Eigen::MatrixBase<DK>& k,
                                                    const Eigen::MatrixBase<DV>& v,
                                                    const Map& map, const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  causal_linear_attention_into(q, k, v, map, out, options);
  return out;
}

/// Non-causal linear attention on featurized inputs, into `out`: every query attends to all
/// keys, out_i = phi_q_i^T S / (phi_q_i . z + eps). Options::decay is not used.
/// @param phi_q  N x C featurized queries
/// @param phi_k  N x C featurized keys
/// @param v      N x Dv values
/// @param out    N x Dv result
template <class DQ, class DK, class DV, class = detail::enable_if_same_scalar<DQ, DK, DV>>
void linear_attention_into(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                           const Eigen::MatrixBase<DV>& v,
                           Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                           const Options& options = {}) {
  using Scalar = typename DQ::Scalar;
  detail::static_check_scalar<Scalar>();
  constexpr const char* where = "linear_attention";
  detail::validate_sequence(phi_q, phi_k, v, options, where, "phi_q", "phi_k");
  detail::require_output_shape(out, phi_q.rows(), v.cols(), where);
  const detail::FeaturizedSource<DQ, DK, DV> source(phi_q.derived(), phi_k.derived(), v.derived());
  detail::CarriedState<Scalar> state(phi_q.cols(), v.cols());
  detail::ChunkedKernel<Scalar> kernel(phi_q.cols(), v.cols(), phi_q.rows(), options);
  kernel.non_causal(source, state, out);
}

/// Non-causal linear attention on featurized inputs; returns N x Dv.
/// @param phi_q  N x C featurized queries
/// @param phi_k  N x C featurized keys
/// @param v      N x Dv values
template <class DQ, class DK, class DV, class = detail::enable_if_same_scalar<DQ, DK, DV>>
Matrix<typename DQ::Scalar> linear_attention(const Eigen::MatrixBase<DQ>& phi_q,
                                             const Eigen::MatrixBase<DK>& phi_k,
                                             const Eigen::MatrixBase<DV>& v,
                                             const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(phi_q.rows(), v.cols());
  linear_attention_into(phi_q, phi_k, v, out, options);
  return out;
}

/// Non-causal linear attention with a feature map, into `out`.
/// @param q    N x Dk queries
/// @param k    N x Dk keys
/// @param v    N x Dv values
/// @param map  feature map
/// @param out  N x Dv result
template <class DQ, class DK, class DV, class Map,
          class = detail::enable_if_same_scalar<DQ, DK, DV>,
          class = detail::enable_if_feature_map<Map>>
void linear_attention_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                           const Eigen::MatrixBase<DV>& v, const Map& map,
                           Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                           const Options& options = {}) {
  using Scalar = typename DQ::Scalar;
  detail::static_check_scalar<Scalar>();
  constexpr const char* where = "linear_attention";
  detail::validate_sequence(q, k, v, options, where, "q", "k");
  detail::require_output_shape(out, q.rows(), v.cols(), where);
  const detail::MappedSource<DQ, DK, DV, Map> source(q.derived(), k.derived(), v.derived(), map,
                                                      options.check_finite, where);
  detail::CarriedState<Scalar> state(source.feature_dim(), v.cols());
  detail::ChunkedKernel<Scalar> kernel(source.feature_dim(), v.cols(), q.rows(), options);
  kernel.non_causal(source, state, out);
}

/// Non-causal linear attention with a feature map; returns N x Dv.
/// @param q    N x Dk queries
/// @param k    N x Dk keys
/// @param v    N x Dv values
/// @param map  feature map
template <class DQ, class DK, class DV, class Map,
          class = detail::enable_if_same_scalar<DQ, DK, DV>,
          class = detail::enable_if_feature_map<Map>>
Matrix<typename DQ::Scalar> linear_attention(const Eigen::MatrixBase<DQ>& q,
                                             const Eigen::MatrixBase<DK>& k,
                                             const Eigen::MatrixBase<DV>& v, const Map& map,
                                             const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  linear_attention_into(q, k, v, map, out, options);
  return out;
}

}  // namespace linattn
