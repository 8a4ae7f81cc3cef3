// SPDX-License-Identifier: MIT
// Gradients of causal and non-causal linear attention: the backward pass for training.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/gradient_stream.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <linattn/gradients.hpp>
#include <linattn/linear_attention.hpp>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

/// The causal backward is two streamed passes (detail/gradient_stream.hpp). With
/// G'_i = d loss / d [numerator, denominator] of row i and V' = [v, 1],
///
///     d phi_q_i = sum_{j<=i} A_ij (G'_i . V'_j) phi_k_j     the forward pass (state S recomputed)
///     d phi_k_j = sum_{i>=j} A_ij (G'_i . V'_j) phi_q_i     the reversed pass (state dS)
///     d v_j     = sum_{i>=j} A_ij (phi_q_i . phi_k_j) G_i   the reversed pass
///
/// A_ij the transition from token j to i, so it runs in O(N C Dv) time, 6 C Dv FMAs a token in
/// all (5 without normalize) against the forward's 2, and keeps no per-token state but G'.
namespace linattn {

namespace detail {

/// The gates of a whole sequence as log a_t in double, N x G: what the gated backward's
/// passes read.
class SequenceGates final : public GateRows {
 public:
  /// Reads every gate of `gates` (a_t, or log_gates(g)).
  template <class G>
  explicit SequenceGates(const G& gates)
      : GateRows(gate_traits<G>::values(gates).cols()),
        logs_(gate_traits<G>::values(gates).rows(), cols()) {
    GateMatrix<G>(gates).log_rows(0, logs_.rows(), logs_);
  }

  /// N x G: log a_t of every token.
  const LogRows& logs() const { return logs_; }

  void log_rows(Eigen::Index begin, Eigen::Index len, LogRows& dst) const override {
    dst.topRows(len) = logs_.middleRows(begin, len);
  }

 private:
  LogRows logs_;
};

/// Turns the rows [num, den] of the unnormalized forward over [v, 1] into G' = [d num, d den]
/// for grad_out, mirroring the forward's denominator guard: where it clamped d, or eps = 0
/// and d = 0 (a zero output row), d den is 0.
template <class Acc, class DG>
void normalization_gradients(Eigen::Ref<Matrix<Acc>> num_den, const Eigen::MatrixBase<DG>& grad_out,
                             double eps_option) {
  const Eigen::Index dv = grad_out.cols();
  const Acc eps = static_cast<Acc>(eps_option);
  for (Eigen::Index i = 0; i < num_den.rows(); ++i) {
    const Acc raw = num_den(i, dv) + eps;
    const Acc d = guard_denominator<Acc>(raw, eps);
    if (d == Acc(0)) {
      num_den.row(i).setZero();
      continue;
    }
    // d den = -(grad_out_i . out_i) / d, with out_i = num_i / d.
    const Acc grad_dot_out = grad_out.row(i).template cast<Acc>().dot(num_den.row(i).head(dv)) / d;
    num_den.row(i).head(dv) = grad_out.row(i).template cast<Acc>() / d;
    num_den(i, dv) = (d == raw) ? -grad_dot_out / d : Acc(0);
  }
}

/// Shape and finiteness checks of a backward call; nothing is written before they pass.
template <class DQ, class DK, class DV, class DG>
void validate_backward(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                       const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& grad_out,
                       const Options& options, const char* where, const char* q_name,
                       const char* k_name) {
  validate_sequence_shapes(q, k, v, options, where, q_name, k_name);
  if (grad_out.rows() != v.rows() || grad_out.cols() != v.cols()) {
    throw Error(std::string(where) + ": grad_out is " + shape_string(grad_out) + " but v is " +
                shape_string(v) + "; the gradient has the output's shape");
  }
  scan_inputs(q, k, v, options, where, q_name, k_name);
  if (options.check_finite) {
    require_finite_parallel(grad_out, where, "grad_out", resolve_threads(options));
  }
}

/// Throws unless `grad` is rows x cols; `name` is the gradient argument.
template <class Out>
void require_gradient_shape(const Out& grad, Eigen::Index rows, Eigen::Index cols,
                            const char* where, const char* name) {
  if (grad.rows() != rows || grad.cols() != cols) {
    throw Error(std::string(where) + ": " + name + " is " + shape_string(grad.rows(), grad.cols()) +
                " but the gradient is " + shape_string(rows, cols));
  }
}

/// The causal backward on validated inputs: causal_backward_rows over q and k as features
/// (Identity) or through `map` chunk by chunk, with `gates` (their log rows) or Options::decay
/// moving the state, and `scratch` (or buffers of its own) as its workspace.
template <class Acc, class DQ, class DK, class DV, class DG, class OutQ, class OutK, class OutV,
          class Map = Identity>
void causal_backward(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                     const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& grad_out,
                     OutQ&& grad_q, OutK&& grad_k, OutV&& grad_v, const Options& options,
                     const SequenceGates* gates = nullptr, GradientScratch<Acc>* scratch = nullptr,
                     const Map& map = {}, const char* where = "") {
  using Source =
      GradientSourceOf<Acc, DQ, DK, DV, DG, std::remove_reference_t<OutQ>,
                       std::remove_reference_t<OutK>, std::remove_reference_t<OutV>, Map>;
  const Source source(q.derived(), k.derived(), v.derived(), grad_out.derived(), grad_q, grad_k,
                      grad_v, map);
  const Eigen::Index feature_dim = is_identity_map<Map> ? q.cols() : map.feature_dim(q.cols());
  causal_backward_rows<Acc>(source, v.rows(), feature_dim, v.cols(), options,
                            gates != nullptr ? &gates->logs() : nullptr, scratch, where);
}

/// The non-causal backward on validated inputs: five GEMMs through C x (Dv + 1) sums.
template <class Acc, class DQ, class DK, class DV, class DG, class T>
void non_causal_backward(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                         const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& grad_out,
                         Eigen::Ref<Matrix<T>> grad_phi_q, Eigen::Ref<Matrix<T>> grad_phi_k,
                         Eigen::Ref<Matrix<T>> grad_v, const Options& options) {
  const Eigen::Index n = v.rows();
  const Eigen::Index dv = v.cols();
  const Eigen::Index width = options.normalize ? dv + 1 : dv;
  const Acc scale = static_cast<Acc>(options.scale);  // on phi_q, so on each gradient
  const Matrix<Acc> q = phi_q.template cast<Acc>() * scale;
  const Matrix<Acc> k = phi_k.template cast<Acc>();
  Matrix<Acc> values(n, width);
  values.leftCols(dv) = v.template cast<Acc>();
  if (options.normalize) values.col(dv).setOnes();
  Matrix<Acc> sums(k.cols(), width);
  sums.noalias() = k.transpose() * values;
  Matrix<Acc> grads(n, width);
  if (options.normalize) {
    grads.noalias() = q * sums;
    normalization_gradients<Acc>(grads, grad_out, options.eps);
  } else {
    grads = grad_out.template cast<Acc>();
  }
  Matrix<Acc> result(n, q.cols());
  result.noalias() = grads * sums.transpose();
  grad_phi_q = (result * scale).template cast<T>();
  Matrix<Acc> query_grads(q.cols(), width);
  query_grads.noalias() = q.transpose() * grads;
  result.noalias() = values * query_grads.transpose();
  grad_phi_k = result.template cast<T>();
  Matrix<Acc> value_grads(n, dv);
  value_grads.noalias() = k * query_grads.leftCols(dv);
  grad_v = value_grads.template cast<T>();
}

/// Validates a featurized backward call and runs it into the three gradients.
template <class Acc, class DQ, class DK, class DV, class DG>
void featurized_backward(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                         const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& grad_out,
                         Eigen::Ref<Matrix<typename DQ::Scalar>> grad_phi_q,
                         Eigen::Ref<Matrix<typename DQ::Scalar>> grad_phi_k,
                         Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v, const Options& options,
                         bool causal, const char* where,
                         GradientScratch<accumulator_t<Acc, typename DQ::Scalar>>* scratch) {
  using T = typename DQ::Scalar;
  using A = accumulator_t<Acc, T>;
  static_assert(is_supported_scalar<T> && is_supported_scalar<A>,
                "linattn backward takes float or double inputs and accumulators");
  validate_backward(phi_q, phi_k, v, grad_out, options, where, "phi_q", "phi_k");
  require_gradient_shape(grad_phi_q, phi_q.rows(), phi_q.cols(), where, "grad_phi_q");
  require_gradient_shape(grad_phi_k, phi_k.rows(), phi_k.cols(), where, "grad_phi_k");
  require_gradient_shape(grad_v, v.rows(), v.cols(), where, "grad_v");
  if (causal) {
    causal_backward<A>(phi_q, phi_k, v, grad_out, grad_phi_q, grad_phi_k, grad_v, options, nullptr,
                       scratch);
  } else {
    non_causal_backward<A, DQ, DK, DV, DG, T>(phi_q, phi_k, v, grad_out, grad_phi_q, grad_phi_k,
                                              grad_v, options);
  }
}

/// The map's features of the raw queries (or keys) x, in their type, which the backward needs
/// finite: unscaled exponential features can overflow where the forward's stabiliser does not.
template <class Map, class A>
Matrix<A> backward_features(const Map& map, const Matrix<A>& x, bool keys, const char* where) {
  Matrix<A> phi = keys ? map.keys(x) : map.queries(x);
  if (!phi.allFinite()) {
    throw Error(std::string(where) + ": the feature map overflows " +
                (std::is_same_v<A, float> ? "float" : "double") + " on " + (keys ? "k" : "q") +
                "; the backward needs finite features (accumulate in double, "
                "the backward<double>, or scale the inputs down)");
  }
  return phi;
}

/// Featurizes q and k in Acc, runs the featurized backward there and chains the map's backward.
template <class Acc, class DQ, class DK, class DV, class DG, class Map>
void mapped_backward(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                     const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& grad_out,
                     const Map& map, Eigen::Ref<Matrix<typename DQ::Scalar>> grad_q,
                     Eigen::Ref<Matrix<typename DQ::Scalar>> grad_k,
                     Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v, const Options& options,
                     bool causal, const char* where,
                     GradientScratch<accumulator_t<Acc, typename DQ::Scalar>>* scratch) {
  using T = typename DQ::Scalar;
  using A = accumulator_t<Acc, T>;
  static_assert(has_map_backward<Map, A>::value,
                "this feature map has no backward(x, grad_phi) member, so gradients cannot "
                "reach q and k; featurize yourself and use the featurized backward");
  validate_backward(q, k, v, grad_out, options, where, "q", "k");
  require_gradient_shape(grad_q, q.rows(), q.cols(), where, "grad_q");
  require_gradient_shape(grad_k, k.rows(), k.cols(), where, "grad_k");
  require_gradient_shape(grad_v, v.rows(), v.cols(), where, "grad_v");
  if (causal) {
    // Featurized, and carried back through the map, a chunk at a time: no N-row temporaries.
    causal_backward<A>(q, k, v, grad_out, grad_q, grad_k, grad_v, options, nullptr, scratch, map,
                       where);
    return;
  }
  const Matrix<A> raw_q = q.template cast<A>();
  const Matrix<A> raw_k = k.template cast<A>();
  const Matrix<A> phi_q = backward_features(map, raw_q, false, where);
  const Matrix<A> phi_k = backward_features(map, raw_k, true, where);
  Matrix<A> grad_phi_q(phi_q.rows(), phi_q.cols());
  Matrix<A> grad_phi_k(phi_k.rows(), phi_k.cols());
  Matrix<A> grad_values(v.rows(), v.cols());
  non_causal_backward<A, Matrix<A>, Matrix<A>, DV, DG, A>(phi_q, phi_k, v, grad_out, grad_phi_q,
                                                          grad_phi_k, grad_values, options);
  grad_q = map.backward(raw_q, grad_phi_q).template cast<T>();
  grad_k = map.backward(raw_k, grad_phi_k).template cast<T>();
  grad_v = grad_values.template cast<T>();
}

/// d loss / d gates from the feature gradients. With b_t = sum_{s<=t} g_s (g_t = log a_t),
/// d b_t = phi_q_t o d phi_q_t - phi_k_t o d phi_k_t and d g_t = sum_{s>=t} d b_s, summed in
/// double (the terms cancel over long sequences); d a_t = d g_t / a_t. A reset gets 0.
template <bool LogSpace, class DQ, class DK, class A, class T>
void gate_gradients(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                    const Matrix<A>& grad_phi_q, const Matrix<A>& grad_phi_k, const LogRows& logs,
                    Matrix<T>& grad) {
  const Eigen::Index n = logs.rows();
  const Eigen::Index g = logs.cols();
  grad.resize(n, g);
  Eigen::Array<double, 1, Eigen::Dynamic> running =
      Eigen::Array<double, 1, Eigen::Dynamic>::Zero(g);
  // Each token's term in A (its products carry A's rounding already), the sum in double.
  Eigen::Array<A, 1, Eigen::Dynamic> term(phi_q.cols());
  Eigen::Array<double, 1, Eigen::Dynamic> wide(phi_q.cols());
  for (Eigen::Index t = n - 1; t >= 0; --t) {
    term = phi_q.row(t).template cast<A>().array() * grad_phi_q.row(t).array() -
           phi_k.row(t).template cast<A>().array() * grad_phi_k.row(t).array();
    wide = term.template cast<double>();
    if (g == 1) {
      running(0) += wide.sum();
    } else {
      running += wide;
    }
    if constexpr (LogSpace) {
      // d g_t is the running sum itself, 0 at a reset (the output is flat in g_t there). The
      // select is element by element: only rows with a reset take it.
      constexpr double kReset = -std::numeric_limits<double>::infinity();
      if (logs.row(t).minCoeff() == kReset) {
        grad.row(t) = (logs.row(t) == kReset).select(0.0, running).template cast<T>();
      } else {
        grad.row(t) = running.template cast<T>();
      }
      continue;
    }
    for (Eigen::Index c = 0; c < g; ++c) {
      const double log_gate = logs(t, c);
      double d = 0.0;  // a reset: the output is flat in g_t
      if (log_gate != -std::numeric_limits<double>::infinity()) {
        d = LogSpace ? running(c) : running(c) / std::exp(log_gate);
      }
      grad(t, c) = static_cast<T>(d);
    }
  }
}

/// The scalar checks of a gated backward (plain or with the bonus), in one place.
template <class T, class A, class Gates, class DO>
constexpr void require_gated_backward_scalars() {
  static_assert(is_supported_scalar<T> && is_supported_scalar<A>,
                "the gated backward takes float or double inputs and accumulators");
  static_assert(std::is_same_v<gate_scalar_t<Gates>, T>,
                "the gates must have the inputs' scalar type");
  static_assert(std::is_same_v<typename DO::Scalar, T>, "grad_out must have the inputs' scalar");
}

/// The gated causal backward: validates everything, runs the passes of causal_backward with
/// the gates (featurized in Acc for a map other than Identity, whose backward is chained) and
/// the gate gradients, and writes `grads` only when all of it succeeded.
template <class Acc, class DQ, class DK, class DV, class Gates, class DO, class Map>
void gated_backward(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const Gates& gates,
                    const Eigen::MatrixBase<DO>& grad_out, const Map& map,
                    GatedAttentionGradients<typename DQ::Scalar>& grads, const Options& options,
                    const char* where,
                    GradientScratch<accumulator_t<Acc, typename DQ::Scalar>>* scratch = nullptr) {
  using T = typename DQ::Scalar;
  using A = accumulator_t<Acc, T>;
  require_gated_backward_scalars<T, A, Gates, DO>();
  if constexpr (check_feature_map<Map, A>()) {
    constexpr bool features = is_identity_map<Map>;
    validate_backward(q, k, v, grad_out, options, where, features ? "phi_q" : "q",
                      features ? "phi_k" : "k");
    validate_gates(gates, q.rows(), features ? q.cols() : map.feature_dim(q.cols()), options,
                   where);
    const SequenceGates forward(gates);
    GatedAttentionGradients<T> result;
    // Featurized in the inputs' type, the gradients are computed in the caller's matrices
    // (nothing is allocated once they have their shapes; nothing below throws).
    constexpr bool in_place = features && std::is_same_v<T, A>;
    GatedAttentionGradients<T>& out = in_place ? grads : result;
    Matrix<A> dq;  // the feature gradients in A: the gate gradients are sums of their products
    Matrix<A> dk;
    auto run = [&](const auto& phi_q, const auto& phi_k) {
      if constexpr (in_place) {
        out.q.resize(q.rows(), phi_q.cols());
        out.k.resize(k.rows(), phi_k.cols());
        out.v.resize(v.rows(), v.cols());
        causal_backward<A>(phi_q, phi_k, v, grad_out, out.q, out.k, out.v, options, &forward,
                           scratch);
        gate_gradients<gate_traits<Gates>::log_space>(phi_q, phi_k, out.q, out.k, forward.logs(),
                                                      out.gates);
      } else {
        dq.resize(q.rows(), phi_q.cols());
        dk.resize(k.rows(), phi_k.cols());
        Matrix<A> dv(v.rows(), v.cols());
        causal_backward<A>(phi_q, phi_k, v, grad_out, dq, dk, dv, options, &forward, scratch);
        gate_gradients<gate_traits<Gates>::log_space>(phi_q, phi_k, dq, dk, forward.logs(),
                                                      out.gates);
        out.v = dv.template cast<T>();
      }
    };
    if constexpr (in_place) {
      run(q.derived(), k.derived());
      return;
    } else if constexpr (features) {
      run(q.derived(), k.derived());
      result.q = dq.template cast<T>();
      result.k = dk.template cast<T>();
    } else {
      static_assert(has_map_backward<Map, A>::value,
                    "this feature map has no backward(x, grad_phi) member, so gradients cannot "
                    "reach q and k; featurize yourself and pass linattn::Identity{}");
      const Matrix<A> raw_q = q.template cast<A>();
      const Matrix<A> raw_k = k.template cast<A>();
      run(backward_features(map, raw_q, false, where), backward_features(map, raw_k, true, where));
      result.q = map.backward(raw_q, dq).template cast<T>();
      result.k = map.backward(raw_k, dk).template cast<T>();
    }
    grads = std::move(result);
  }
}

/// The one dispatch of the backward entry points: Identity runs the featurized backward on
/// the inputs in place, any other map recomputes its features and chains its backward.
template <class Acc, class DQ, class DK, class DV, class DG, class Map>
void backward(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
              const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& grad_out, const Map& map,
              Eigen::Ref<Matrix<typename DQ::Scalar>> grad_q,
              Eigen::Ref<Matrix<typename DQ::Scalar>> grad_k,
              Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v, const Options& options, bool causal,
              const char* where,
              GradientScratch<accumulator_t<Acc, typename DQ::Scalar>>* scratch = nullptr) {
  if constexpr (check_feature_map<Map, accumulator_t<Acc, typename DQ::Scalar>>()) {
    if constexpr (is_identity_map<Map>) {
      featurized_backward<Acc>(q, k, v, grad_out, grad_q, grad_k, grad_v, options, causal, where,
                               scratch);
    } else {
      mapped_backward<Acc>(q, k, v, grad_out, map, grad_q, grad_k, grad_v, options, causal, where,
                           scratch);
    }
  }
}

}  // namespace detail

/// Scratch memory of the causal backward, kept by the caller between calls so that a training
/// loop allocates it once (the calls without one allocate their own every time). It holds the
/// 2 N per-token factors the reversed pass reads from the forward one and chunk buffers of
/// L = max(Options::chunk, 64) rows; it grows to the longest N it has served. One workspace
/// serves one call at a time.
template <class Acc>
class BackwardWorkspace {
 public:
  static_assert(detail::is_supported_scalar<Acc>,
                "BackwardWorkspace<Acc> takes the accumulation type: float or double (the inputs' "
                "scalar for float and double inputs, float for Eigen::half and bfloat16)");

  /// Bytes a causal backward of N tokens needs at most: 2 N factors, L x (5 C + 3 Dv) chunk
  /// buffers, and 4 L x G for gates (G = 1 or C), all of Acc.
  /// @param n            N, tokens
  /// @param feature_dim  C, the feature width (Dk with Identity)
  /// @param value_dim    Dv
  /// @param gate_width   0 without gates or decay, 1 for scalar gates or a decay, C per feature
  /// @param options      the call's options (its chunk)
  static std::size_t bytes(Eigen::Index n, Eigen::Index feature_dim, Eigen::Index value_dim,
                           Eigen::Index gate_width = 0, const Options& options = {}) {
    const auto l = static_cast<std::size_t>(std::max<Eigen::Index>(options.chunk, 64));
    const auto c = static_cast<std::size_t>(feature_dim);
    const auto dv = static_cast<std::size_t>(value_dim);
    const auto g = static_cast<std::size_t>(gate_width);
    return sizeof(Acc) * (2 * static_cast<std::size_t>(n) + l * (5 * c + 3 * dv) + 2 * l * g) +
           sizeof(double) * 2 * l * g;
  }

  /// The buffers, for the backward calls.
  detail::GradientScratch<Acc>& scratch() { return scratch_; }

 private:
  detail::GradientScratch<Acc> scratch_;
};

/// Backward of causal_linear_attention, into caller-provided gradients. Time 10 N C Dv FLOPs
/// (two fused streamed passes, the forward's state recomputed; the forward is 4 N C Dv),
/// workspace 2 N factors and one chunk of buffers (allocated per call; the overload with a
/// BackwardWorkspace keeps them), no per-token state. Honours eps, decay, normalize, chunk,
/// check_finite (which also scans grad_out) and threads (a long sequence is split across
/// them). With a map other than Identity the map's features are recomputed in the accumulation
/// type a chunk at a time and its `backward` carries the gradients to q and k; the features
/// must be finite there (exponential maps on large inputs: use Acc = double).
/// @param q         N x Dk queries, as given to the forward (features, with Identity)
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param grad_out  N x Dv gradient of the loss with respect to the forward's output
/// @param map       the forward's feature map; needs a backward member unless Identity
/// @param grad_q    N x Dk result: d loss / d q (may not alias the inputs)
/// @param grad_k    N x Dk result: d loss / d k
/// @param grad_v    N x Dv result: d loss / d v
/// @param options   the forward's options
template <class Acc = void, class DQ, class DK, class DV, class DG, class Map,
          class = detail::enable_if_same_scalar4<DQ, DK, DV, DG>>
void causal_linear_attention_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DG>& grad_out, const Map& map,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_q, Eigen::Ref<Matrix<typename DQ::Scalar>> grad_k,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v, const Options& options = {}) {
  detail::backward<Acc>(q, k, v, grad_out, map, grad_q, grad_k, grad_v, options, true,
                        "causal_linear_attention_backward");
}

/// causal_linear_attention_backward_into with the caller's workspace: no allocation once the
/// workspace has served a call of N tokens (a feature map other than Identity still allocates
/// its chunk's features and their backward: L rows at a time).
/// @param workspace  BackwardWorkspace of the accumulation type (float for float, half and
///                   bfloat16 inputs; double for double, or with Acc = double)
/// (other arguments as above)
template <class Acc = void, class DQ, class DK, class DV, class DG, class Map,
          class = detail::enable_if_same_scalar4<DQ, DK, DV, DG>>
void causal_linear_attention_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DG>& grad_out, const Map& map,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_q, Eigen::Ref<Matrix<typename DQ::Scalar>> grad_k,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v, const Options& options,
    BackwardWorkspace<detail::accumulator_t<Acc, typename DQ::Scalar>>& workspace) {
  detail::backward<Acc>(q, k, v, grad_out, map, grad_q, grad_k, grad_v, options, true,
                        "causal_linear_attention_backward", &workspace.scratch());
}

/// Backward of causal_linear_attention. See causal_linear_attention_backward_into.
/// @param q         N x Dk queries
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param map       the forward's feature map (Identity{} for precomputed features); a call
///                  without one does not compile
/// @return          gradients with respect to q (N x Dk), k (N x Dk) and v (N x Dv)
template <class Acc = void, class DQ, class DK, class DV, class DG,
          class Map = detail::MissingFeatureMap,
          class = detail::enable_if_same_scalar4<DQ, DK, DV, DG>>
AttentionGradients<typename DQ::Scalar> causal_linear_attention_backward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DG>& grad_out, const Map& map = {}, const Options& options = {}) {
  AttentionGradients<typename DQ::Scalar> grads{
      {q.rows(), q.cols()}, {k.rows(), k.cols()}, {v.rows(), v.cols()}};
  detail::backward<Acc>(q, k, v, grad_out, map, grads.q, grads.k, grads.v, options, true,
                        "causal_linear_attention_backward");
  return grads;
}

/// Backward of the non-causal linear_attention, into caller-provided gradients: five GEMMs
/// through the C x (Dv + 1) sums, workspace O(N (C + Dv)).
/// @param q         N x Dk queries (features, with Identity)
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param map       the forward's feature map; needs a backward member unless Identity
/// @param grad_q    N x Dk result
/// @param grad_k    N x Dk result
/// @param grad_v    N x Dv result
template <class Acc = void, class DQ, class DK, class DV, class DG, class Map,
          class = detail::enable_if_same_scalar4<DQ, DK, DV, DG>>
void linear_attention_backward_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                    const Eigen::MatrixBase<DV>& v,
                                    const Eigen::MatrixBase<DG>& grad_out, const Map& map,
                                    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_q,
                                    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_k,
                                    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v,
                                    const Options& options = {}) {
  detail::backward<Acc>(q, k, v, grad_out, map, grad_q, grad_k, grad_v, options, false,
                        "linear_attention_backward");
}

/// Backward of the non-causal linear_attention.
/// @param q         N x Dk queries
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param grad_out  N x Dv gradient of the loss with respect to the output
/// @param map       the forward's feature map (Identity{} for precomputed features)
/// @return          gradients with respect to q, k and v
template <class Acc = void, class DQ, class DK, class DV, class DG,
          class Map = detail::MissingFeatureMap,
          class = detail::enable_if_same_scalar4<DQ, DK, DV, DG>>
AttentionGradients<typename DQ::Scalar> linear_attention_backward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DG>& grad_out, const Map& map = {}, const Options& options = {}) {
  AttentionGradients<typename DQ::Scalar> grads{
      {q.rows(), q.cols()}, {k.rows(), k.cols()}, {v.rows(), v.cols()}};
  detail::backward<Acc>(q, k, v, grad_out, map, grads.q, grads.k, grads.v, options, false,
                        "linear_attention_backward");
  return grads;
}

}  // namespace linattn
