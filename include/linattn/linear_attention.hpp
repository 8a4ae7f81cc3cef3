// SPDX-License-Identifier: MIT
// Causal and non-causal linear attention, on featurized inputs or with a feature map.
#pragma once

#include <algorithm>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/validate.hpp>
#include <type_traits>

/// Every entry point takes an optional first template argument, the accumulation type of the
/// state and the sums: `causal_linear_attention<double>(q_float, k_float, v_float, map)` keeps
/// float inputs and outputs but accumulates in double (at the double rate), for very long
/// sequences. It defaults to the input type.
///
/// Inputs may also be Eigen::half or Eigen::bfloat16 (matrices, maps or expressions of them):
/// each chunk is converted to the accumulation type as it is read (float by default, double
/// on request; never the 16-bit type), feature maps run on the converted chunk, and each
/// output is rounded to the input type once. The result is the float routine's result on the
/// same inputs rounded to 16 bits (within half an ulp of it); nothing is summed in 16 bits,
/// so the error does not grow with the sequence. Build with F16C (-mf16c, -march=native) for
/// fast half conversions; the other conversions are plain loops the compiler vectorises.
namespace linattn {

namespace detail {

template <class DQ, class DK, class DV>
using enable_if_same_scalar =
    std::enable_if_t<std::is_same_v<typename DQ::Scalar, typename DK::Scalar> &&
                     std::is_same_v<typename DQ::Scalar, typename DV::Scalar>>;

/// The same for the four inputs of a backward call (grad_out, or gates, fourth).
template <class DQ, class DK, class DV, class DG>
using enable_if_same_scalar4 =
    std::enable_if_t<std::is_same_v<typename DQ::Scalar, typename DK::Scalar> &&
                     std::is_same_v<typename DQ::Scalar, typename DV::Scalar> &&
                     std::is_same_v<typename DQ::Scalar, typename DG::Scalar>>;

template <class Map>
using enable_if_feature_map = std::enable_if_t<is_feature_map<Map>::value>;

/// The accumulation type: Acc, or when Acc is void the input scalar (float for 16-bit inputs).
template <class Acc, class Scalar>
using accumulator_t = std::conditional_t<std::is_void_v<Acc>, default_accumulator_t<Scalar>, Acc>;

/// Runs the causal or non-causal kernel over `source` from an empty state into `out`, with
/// the state and every sum in Acc, on up to Options::threads threads.
template <class Acc, class Source, class OutRef>
void run_attention(const Source& source, OutRef out, const Options& options, bool causal) {
  using Scalar = accumulator_t<Acc, typename Source::Scalar>;
  static_assert(is_input_scalar<typename Source::Scalar>,
                "linattn kernels take float, double, Eigen::half or Eigen::bfloat16 inputs");
  static_assert(is_supported_scalar<Scalar>,
                "linattn kernels accumulate in float or double (Acc = float or double)");
  CarriedState<Scalar> state(source.feature_dim(), source.value_dim());
  const int threads = resolve_threads(options);
  const SerialEigenScope serial_eigen;
  if (causal) {
    run_causal(source, state, out, options, threads);
  } else {
    run_non_causal(source, state, out, options, threads);
  }
}

/// Validates featurized inputs and runs the causal or non-causal kernel into `out`.
template <class Acc, class DQ, class DK, class DV>
void featurized_attention(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                          const Eigen::MatrixBase<DV>& v,
                          Eigen::Ref<Matrix<typename DQ::Scalar>> out, const Options& options,
                          bool causal, const char* where) {
  validate_sequence_threads(phi_q, phi_k, v, options, where, "phi_q", "phi_k");
  require_output_shape(out, phi_q.rows(), v.cols(), where);
  run_attention<Acc>(FeaturizedSource<DQ, DK, DV>(phi_q.derived(), phi_k.derived(), v.derived()),
                     Eigen::Ref<Matrix<typename DQ::Scalar>>(out), options, causal);
}

/// Validates raw inputs and runs the kernel with `map` applied chunk by chunk.
template <class Acc, class DQ, class DK, class DV, class Map>
void mapped_attention(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                      const Eigen::MatrixBase<DV>& v, const Map& map,
                      Eigen::Ref<Matrix<typename DQ::Scalar>> out, const Options& options,
                      bool causal, const char* where) {
  validate_sequence_threads(q, k, v, options, where, "q", "k");
  require_output_shape(out, q.rows(), v.cols(), where);
  run_attention<Acc>(MappedSource<DQ, DK, DV, Map>(q.derived(), k.derived(), v.derived(), map,
                                                   options.check_finite, where),
                     Eigen::Ref<Matrix<typename DQ::Scalar>>(out), options, causal);
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
template <class Acc = void, class DQ, class DK, class DV,
          class = detail::enable_if_same_scalar<DQ, DK, DV>>
void causal_linear_attention_into(const Eigen::MatrixBase<DQ>& phi_q,
                                  const Eigen::MatrixBase<DK>& phi_k,
                                  const Eigen::MatrixBase<DV>& v,
                                  Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                                  const Options& options = {}) {
  detail::featurized_attention<Acc>(phi_q, phi_k, v, out, options, true, "causal_linear_attention");
}

/// Causal linear attention on featurized inputs; returns N x Dv. See causal_linear_attention_into.
/// @param phi_q  N x C featurized queries
/// @param phi_k  N x C featurized keys
/// @param v      N x Dv values
template <class Acc = void, class DQ, class DK, class DV,
          class = detail::enable_if_same_scalar<DQ, DK, DV>>
Matrix<typename DQ::Scalar> causal_linear_attention(const Eigen::MatrixBase<DQ>& phi_q,
                                                    const Eigen::MatrixBase<DK>& phi_k,
                                                    const Eigen::MatrixBase<DV>& v,
                                                    const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(phi_q.rows(), v.cols());
  causal_linear_attention_into<Acc>(phi_q, phi_k, v, out, options);
  return out;
}

/// Causal linear attention with a feature map applied chunk by chunk, into `out`. Exponential
/// maps (PositiveRandomFeatures) go through the log-scale stabiliser: no overflow, same result.
/// @param q    N x Dk queries
/// @param k    N x Dk keys
/// @param v    N x Dv values
/// @param map  feature map (EluPlusOne, Relu, PositiveRandomFeatures, RandomFourierFeatures, ...)
/// @param out  N x Dv result
template <class Acc = void, class DQ, class DK, class DV, class Map,
          class = detail::enable_if_same_scalar<DQ, DK, DV>,
          class = detail::enable_if_feature_map<Map>>
void causal_linear_attention_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                  const Eigen::MatrixBase<DV>& v, const Map& map,
                                  Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                                  const Options& options = {}) {
  detail::mapped_attention<Acc>(q, k, v, map, out, options, true, "causal_linear_attention");
}

/// Causal linear attention with a feature map; returns N x Dv.
/// @param q    N x Dk queries
/// @param k    N x Dk keys
/// @param v    N x Dv values
/// @param map  feature map
template <class Acc = void, class DQ, class DK, class DV, class Map,
          class = detail::enable_if_same_scalar<DQ, DK, DV>,
          class = detail::enable_if_feature_map<Map>>
Matrix<typename DQ::Scalar> causal_linear_attention(const Eigen::MatrixBase<DQ>& q,
                                                    const Eigen::MatrixBase<DK>& k,
                                                    const Eigen::MatrixBase<DV>& v, const Map& map,
                                                    const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  causal_linear_attention_into<Acc>(q, k, v, map, out, options);
  return out;
}

/// Non-causal linear attention on featurized inputs, into `out`: every query attends to all
/// keys, out_i = phi_q_i^T S / (phi_q_i . z + eps). Options::decay is not used.
/// @param phi_q  N x C featurized queries
/// @param phi_k  N x C featurized keys
/// @param v      N x Dv values
/// @param out    N x Dv result
template <class Acc = void, class DQ, class DK, class DV,
          class = detail::enable_if_same_scalar<DQ, DK, DV>>
void linear_attention_into(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                           const Eigen::MatrixBase<DV>& v,
                           Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                           const Options& options = {}) {
  detail::featurized_attention<Acc>(phi_q, phi_k, v, out, options, false, "linear_attention");
}

/// Non-causal linear attention on featurized inputs; returns N x Dv.
/// @param phi_q  N x C featurized queries
/// @param phi_k  N x C featurized keys
/// @param v      N x Dv values
template <class Acc = void, class DQ, class DK, class DV,
          class = detail::enable_if_same_scalar<DQ, DK, DV>>
Matrix<typename DQ::Scalar> linear_attention(const Eigen::MatrixBase<DQ>& phi_q,
                                             const Eigen::MatrixBase<DK>& phi_k,
                                             const Eigen::MatrixBase<DV>& v,
                                             const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(phi_q.rows(), v.cols());
  linear_attention_into<Acc>(phi_q, phi_k, v, out, options);
  return out;
}

/// Non-causal linear attention with a feature map, into `out`.
/// @param q    N x Dk queries
/// @param k    N x Dk keys
/// @param v    N x Dv values
/// @param map  feature map
/// @param out  N x Dv result
template <class Acc = void, class DQ, class DK, class DV, class Map,
          class = detail::enable_if_same_scalar<DQ, DK, DV>,
          class = detail::enable_if_feature_map<Map>>
void linear_attention_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                           const Eigen::MatrixBase<DV>& v, const Map& map,
                           Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                           const Options& options = {}) {
  detail::mapped_attention<Acc>(q, k, v, map, out, options, false, "linear_attention");
}

/// Non-causal linear attention with a feature map; returns N x Dv.
/// @param q    N x Dk queries
/// @param k    N x Dk keys
/// @param v    N x Dv values
/// @param map  feature map
template <class Acc = void, class DQ, class DK, class DV, class Map,
          class = detail::enable_if_same_scalar<DQ, DK, DV>,
          class = detail::enable_if_feature_map<Map>>
Matrix<typename DQ::Scalar> linear_attention(const Eigen::MatrixBase<DQ>& q,
                                             const Eigen::MatrixBase<DK>& k,
                                             const Eigen::MatrixBase<DV>& v, const Map& map,
                                             const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  linear_attention_into<Acc>(q, k, v, map, out, options);
  return out;
}

}  // namespace linattn
