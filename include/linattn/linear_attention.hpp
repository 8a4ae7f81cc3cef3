// SPDX-License-Identifier: MIT
// Causal and non-causal linear attention, on featurized inputs or with a feature map.
#pragma once

#include <algorithm>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
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

/// Runs the causal or non-causal kernel over `source` from an empty state into `out`, with
/// the state and every sum in T, on up to Options::threads threads.
template <bool Causal, class T, class OutRef>
void run_attention(const ChunkSource<T>& source, OutRef&& out, const Options& options) {
  CarriedState<T> state(source.feature_dim(), source.value_dim());
  const int threads = resolve_threads(options);
  const SerialEigenScope serial_eigen;
  if constexpr (Causal) {
    run_causal(source, state, out, options, threads);
  } else {
    run_non_causal(source, state, out, options, threads);
  }
}

/// Non-causal cross-attention into `out` from an empty state: the sums over every key of
/// `keys`, then every query of `queries` against them.
template <class T, class OutRef>
void run_cross_attention(const ChunkSource<T>& keys, const ChunkSource<T>& queries, OutRef&& out,
                         const Options& options) {
  CarriedState<T> state(keys.feature_dim(), keys.value_dim());
  const int threads = resolve_threads(options);
  const SerialEigenScope serial_eigen;
  run_cross(keys, queries, state, out, options, threads);
}

/// Validates the inputs of non-causal attention with N_q != N_k queries and keys, then runs it:
/// keys and values from a source over (k, k, v), queries from one over (q, q, v), of which the
/// kernel reads only the queries. make(a, b, c) builds a source.
template <class DQ, class DK, class DV, class Out, class Make>
void cross_attention(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                     const Eigen::MatrixBase<DV>& v, Out& out, const Options& options,
                     const char* where, const char* q_name, const char* k_name, const Make& make) {
  validate_cross_shapes(q, k, v, options, where, q_name, k_name);
  require_output_shape(out, q.rows(), v.cols(), where);
  auto keys = make(k.derived(), k.derived(), v.derived());
  auto queries = make(q.derived(), q.derived(), v.derived());
  scan_inputs(q, k, v, options, where, q_name, k_name);
  run_cross_attention(keys, queries, out, options);
}

/// Validates featurized inputs and runs the causal or non-causal kernel into `out`.
template <class Acc, bool Causal, class DQ, class DK, class DV>
void featurized_attention(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                          const Eigen::MatrixBase<DV>& v,
                          Eigen::Ref<Matrix<typename DQ::Scalar>> out, const Options& options,
                          const char* where) {
  using T = accumulator_t<Acc, typename DQ::Scalar>;
  if (!Causal && phi_q.rows() != phi_k.rows()) {
    cross_attention(phi_q, phi_k, v, out, options, where, "phi_q", "phi_k",
                    [](const auto& a, const auto& b, const auto& c) {
                      using A = std::decay_t<decltype(a)>;
                      using C = std::decay_t<decltype(c)>;
                      return FeaturizedSource<T, A, A, C>(a, b, c);
                    });
    return;
  }
  validate_sequence_threads(phi_q, phi_k, v, options, where, "phi_q", "phi_k");
  require_output_shape(out, phi_q.rows(), v.cols(), where);
  run_attention<Causal>(
      FeaturizedSource<T, DQ, DK, DV>(phi_q.derived(), phi_k.derived(), v.derived()), out, options);
}

/// Validates raw inputs and runs the kernel with `map` applied chunk by chunk.
template <class Acc, bool Causal, class DQ, class DK, class DV, class Map>
void mapped_attention(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                      const Eigen::MatrixBase<DV>& v, const Map& map,
                      Eigen::Ref<Matrix<typename DQ::Scalar>> out, const Options& options,
                      const char* where) {
  using T = accumulator_t<Acc, typename DQ::Scalar>;
  if (!Causal && q.rows() != k.rows()) {
    cross_attention(
        q, k, v, out, options, where, "q", "k", [&](const auto& a, const auto& b, const auto& c) {
          using A = std::decay_t<decltype(a)>;
          using C = std::decay_t<decltype(c)>;
          return MappedSource<T, A, A, C, Map>(a, b, c, map, options.check_finite, where);
        });
    return;
  }
  validate_sequence_threads(q, k, v, options, where, "q", "k");
  require_output_shape(out, q.rows(), v.cols(), where);
  run_attention<Causal>(MappedSource<T, DQ, DK, DV, Map>(q.derived(), k.derived(), v.derived(), map,
                                                         options.check_finite, where),
                        out, options);
}

/// The one dispatch of the matrix entry points: checks the map concept, then reads Identity
/// inputs in place as features and featurizes any other map chunk by chunk.
template <class Acc, bool Causal, class DQ, class DK, class DV, class Map>
void attention(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
               const Eigen::MatrixBase<DV>& v, const Map& map,
               Eigen::Ref<Matrix<typename DQ::Scalar>> out, const Options& options,
               const char* where) {
  if constexpr (check_feature_map<Map, accumulator_t<Acc, typename DQ::Scalar>>()) {
    if constexpr (is_identity_map<Map>) {
      featurized_attention<Acc, Causal>(q, k, v, out, options, where);
    } else {
      mapped_attention<Acc, Causal>(q, k, v, map, out, options, where);
    }
  }
}

}  // namespace detail

/// Causal linear attention, chunked (parallel) form, into `out`:
/// out_i = phi(q_i)^T S_i / (phi(q_i) . z_i + eps), S_i = sum_{j<=i} g^(i-j) phi(k_j) v_j^T.
/// The map is applied chunk by chunk (Identity{} reads precomputed features in place);
/// exponential maps (PositiveRandomFeatures) go through the log-scale stabiliser: no
/// overflow, same result. Allocates O(chunk * (C + Dv) + C * Dv), nothing proportional to N.
/// @param q        N x Dk queries, one row per token (features, with Identity)
/// @param k        N x Dk keys
/// @param v        N x Dv values
/// @param map      feature map: Identity, EluPlusOne, Relu, PositiveRandomFeatures, ...
/// @param out      N x Dv result, row-major (linattn::Matrix or a row-major block/map of one);
///                 may not alias the inputs
/// @param options  eps, decay, normalize, chunk, check_finite, threads
template <class Acc = void, class DQ, class DK, class DV, class Map,
          class = detail::enable_if_same_scalar<DQ, DK, DV>>
void causal_linear_attention_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                  const Eigen::MatrixBase<DV>& v, const Map& map,
                                  Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                                  const Options& options = {}) {
  detail::attention<Acc, true>(q, k, v, map, out, options, "causal_linear_attention");
}

/// Causal linear attention; returns N x Dv. See causal_linear_attention_into.
/// @param q    N x Dk queries
/// @param k    N x Dk keys
/// @param v    N x Dv values
/// @param map  feature map (Identity{} for precomputed features); a call without one does
///             not compile
template <class Acc = void, class DQ, class DK, class DV, class Map = detail::MissingFeatureMap,
          class = detail::enable_if_same_scalar<DQ, DK, DV>>
Matrix<typename DQ::Scalar> causal_linear_attention(const Eigen::MatrixBase<DQ>& q,
                                                    const Eigen::MatrixBase<DK>& k,
                                                    const Eigen::MatrixBase<DV>& v,
                                                    const Map& map = {},
                                                    const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  detail::attention<Acc, true>(q, k, v, map, out, options, "causal_linear_attention");
  return out;
}

/// Non-causal linear attention into `out`: every query attends to all keys,
/// out_i = phi(q_i)^T S / (phi(q_i) . z + eps), S = sum_j phi(k_j) v_j^T over every key.
/// Queries and keys may differ in number (cross-attention: a Perceiver's latents over its
/// inputs, a decoder over an encoder's outputs), without padding. Options::decay is not used.
/// @param q    N_q x Dk queries
/// @param k    N_k x Dk keys (N_k may differ from N_q)
/// @param v    N_k x Dv values
/// @param map  feature map (Identity{} for precomputed features)
/// @param out  N_q x Dv result, row-major
template <class Acc = void, class DQ, class DK, class DV, class Map,
          class = detail::enable_if_same_scalar<DQ, DK, DV>>
void linear_attention_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                           const Eigen::MatrixBase<DV>& v, const Map& map,
                           Eigen::Ref<Matrix<typename DQ::Scalar>> out,
                           const Options& options = {}) {
  detail::attention<Acc, false>(q, k, v, map, out, options, "linear_attention");
}

/// Non-causal linear attention; returns N_q x Dv. See linear_attention_into.
/// @param q    N_q x Dk queries
/// @param k    N_k x Dk keys (N_k may differ from N_q: cross-attention)
/// @param v    N_k x Dv values
/// @param map  feature map (Identity{} for precomputed features); a call without one does
///             not compile
template <class Acc = void, class DQ, class DK, class DV, class Map = detail::MissingFeatureMap,
          class = detail::enable_if_same_scalar<DQ, DK, DV>>
Matrix<typename DQ::Scalar> linear_attention(const Eigen::MatrixBase<DQ>& q,
                                             const Eigen::MatrixBase<DK>& k,
                                             const Eigen::MatrixBase<DV>& v, const Map& map = {},
                                             const Options& options = {}) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  detail::attention<Acc, false>(q, k, v, map, out, options, "linear_attention");
  return out;
}

/// Catches the map-less call of 0.1.0, causal_linear_attention_into(phi_q, phi_k, v, out).
template <class Acc = void, class DQ, class DK, class DV, class DO>
void causal_linear_attention_into(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                                  const Eigen::MatrixBase<DV>&, Eigen::MatrixBase<DO>&,
                                  const Options& = {}) {
  static_assert(detail::always_false<DQ>,
                "linattn: causal_linear_attention_into needs a feature map before out: pass "
                "linattn::Identity{} when q and k are already features");
}

/// Catches the map-less call of 0.1.0, linear_attention_into(phi_q, phi_k, v, out).
template <class Acc = void, class DQ, class DK, class DV, class DO>
void linear_attention_into(const Eigen::MatrixBase<DQ>&, const Eigen::MatrixBase<DK>&,
                           const Eigen::MatrixBase<DV>&, Eigen::MatrixBase<DO>&,
                           const Options& = {}) {
  static_assert(detail::always_false<DQ>,
                "linattn: linear_attention_into needs a feature map before out: pass "
                "linattn::Identity{} when q and k are already features");
}

}  // namespace linattn
