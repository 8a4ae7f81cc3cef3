// SPDX-License-Identifier: MIT
// Gradients of causal and non-causal linear attention: the backward pass for training.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
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

/// The backward pass reuses the forward kernel. With V' = [v, 1] and G' the gradient of the
/// loss with respect to [numerator, denominator] of every row,
///
///     d phi_q_i = sum_{j<=i} g^(i-j) (G'_i . V'_j) phi_k_j     a causal pass (G', V', phi_k)
///     d phi_k_j = sum_{i>=j} g^(i-j) (G'_i . V'_j) phi_q_i     a reversed pass (V', G', phi_q)
///     d v_j     = sum_{i>=j} g^(i-j) (phi_q_i . phi_k_j) G_i   a reversed pass (phi_k, phi_q, G)
///
/// so it runs in O(N C Dv) time on the chunked kernel (four passes in all, with the forward
/// recomputed) and keeps no per-token state: each pass carries one state across its chunks.
namespace linattn {

namespace detail {

/// The gates of a whole sequence as log a_t in double, N x G: what the gated backward's
/// passes read forwards and, through reversed(), backwards.
class SequenceGates final : public GateRows {
 public:
  /// Reads every gate of `gates` (a_t, or log_gates(g)).
  template <class G>
  explicit SequenceGates(const G& gates)
      : GateRows(gate_traits<G>::values(gates).cols()),
        logs_(gate_traits<G>::values(gates).rows(), cols()) {
    GateMatrix<G>(gates).log_rows(0, logs_.rows(), logs_);
  }

  /// The gates of the anti-causal passes, which run over the reversed sequence:
  /// dS_t = ... + diag(a_{t+1}) dS_{t+1}, so reversed token r is moved by a_{N-r}, the first by 1.
  SequenceGates reversed() const {
    const Eigen::Index n = logs_.rows();
    LogRows logs(n, cols());
    logs.row(0).setZero();
    logs.bottomRows(n - 1) = logs_.bottomRows(n - 1).colwise().reverse();
    return SequenceGates(std::move(logs));
  }

  /// N x G: log a_t of every token.
  const LogRows& logs() const { return logs_; }

  void log_rows(Eigen::Index begin, Eigen::Index len, LogRows& dst) const override {
    dst.topRows(len) = logs_.middleRows(begin, len);
  }

 private:
  explicit SequenceGates(LogRows logs) : GateRows(logs.cols()), logs_(std::move(logs)) {}

  LogRows logs_;
};

/// One unnormalized causal pass, out_i = sum_{j<=i} A_ij (q_i . k_j) v_j, or with `reversed`
/// the anti-causal one, out_j = sum_{i>=j} A_ij (q_i . k_j) v_i, where A_ij is the transition
/// from token j to token i: g^(i-j) for Options::decay, or the product of the gates between
/// them (given, with `reversed`, as the reversed gates). The arguments are expressions that
/// live for the whole call.
template <class Acc, class DQ, class DK, class DV, class Out>
void causal_pass(const DQ& q, const DK& k, const DV& v, Out out, const Options& inner,
                 bool reversed, const GateRows* gates = nullptr) {
  auto run = [&](ChunkSource<Acc>& source) {
    if (gates != nullptr) source.attach_gates(*gates);
    run_attention<true>(source, out, inner);
  };
  if (!reversed) {
    FeaturizedSource<Acc, DQ, DK, DV> source(q, k, v);
    run(source);
    return;
  }
  using RQ = Eigen::Reverse<const DQ, Eigen::Vertical>;
  using RK = Eigen::Reverse<const DK, Eigen::Vertical>;
  using RV = Eigen::Reverse<const DV, Eigen::Vertical>;
  const RQ rq(q);
  const RK rk(k);
  const RV rv(v);
  FeaturizedSource<Acc, RQ, RK, RV> source(rq, rk, rv);
  run(source);
  out.colwise().reverseInPlace();
}

/// out_t = sum_{j<=t} (q_t . k_j) diag(a_{j+1} ... a_t) v_j: per-feature gates on the output
/// index (the backward's d phi_q and d phi_k), which the forward's kernel does not have. The
/// engine's plain stream runs over pieces within which every feature's log gates sum to at
/// least -kStreamLogRange: with e_t the sum since the piece's first token, v_j is weighted by
/// exp(-e_j) and output t by exp(e_t), and the carried state's columns move between pieces.
template <class Acc, class DQ, class DK, class DV>
void value_gated_causal(const DQ& q, const DK& k, const DV& v, const LogRows& logs,
                        Eigen::Ref<Matrix<Acc>> out, const Options& inner) {
  const Eigen::Index n = q.rows();
  const Eigen::Index c = v.cols();
  const Eigen::Index most = std::min(n, 8 * std::max<Eigen::Index>(1, inner.chunk));
  ChunkedKernel<Acc, Acc> kernel(q.cols(), c, most, inner);
  CarriedState<Acc> state(q.cols(), c);
  Matrix<Acc> weighted(most, c);
  LogRows rise(most, c);  // e_t, rows of the piece
  Eigen::Array<Acc, 1, Eigen::Dynamic> factor(c);
  auto move_state = [&](const auto& log_factor) {
    factor = log_factor.exp().template cast<Acc>();  // a reset, -infinity, gives 0
    state.s.array().rowwise() *= factor;
  };
  for (Eigen::Index first = 0, len = 0; first < n; first += len) {
    move_state(logs.row(first));
    rise.row(0).setZero();
    for (len = 1; first + len < n && len < most; ++len) {
      rise.row(len) = rise.row(len - 1) + logs.row(first + len);
      if (!(rise.row(len).minCoeff() >= -kStreamLogRange<Acc>)) break;
    }
    weighted.topRows(len) = (v.middleRows(first, len).template cast<Acc>().array() *
                             (-rise.topRows(len)).exp().template cast<Acc>())
                                .matrix();
    using Weighted = Eigen::Block<Matrix<Acc>, Eigen::Dynamic, Eigen::Dynamic, true>;
    using RowsQ = decltype(q.middleRows(first, len));
    using RowsK = decltype(k.middleRows(first, len));
    const RowsQ rows_q = q.middleRows(first, len);
    const RowsK rows_k = k.middleRows(first, len);
    const Weighted rows_v = weighted.topRows(len);
    const FeaturizedSource<Acc, RowsQ, RowsK, Weighted> source(rows_q, rows_k, rows_v);
    kernel.causal(source, state, OutRows<Acc>(out.middleRows(first, len)));
    out.middleRows(first, len).array() *= rise.topRows(len).exp().template cast<Acc>();
    move_state(rise.row(len - 1));
  }
}

/// One pass of the backward: causal_pass, or value_gated_causal where per-feature gates scale
/// the output index (`gate_on_output`: d phi_q and d phi_k), reversed alike.
template <class Acc, class DQ, class DK, class DV, class Out>
void gradient_pass(const DQ& q, const DK& k, const DV& v, Out out, const Options& inner,
                   bool reversed, const SequenceGates* gates, bool gate_on_output) {
  if (gates == nullptr || gates->cols() == 1 || !gate_on_output) {
    causal_pass<Acc>(q, k, v, out, inner, reversed, gates);
    return;
  }
  if constexpr (std::is_same_v<typename Out::Scalar, Acc>) {
    if (!reversed) {
      value_gated_causal<Acc>(q, k, v, gates->logs(), out, inner);
      return;
    }
    value_gated_causal<Acc>(q.colwise().reverse(), k.colwise().reverse(), v.colwise().reverse(),
                            gates->logs(), out, inner);
    out.colwise().reverseInPlace();
  } else {
    LINATTN_ASSERT(false && "the gated backward computes its gradients in the accumulation type");
  }
}

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

/// The causal backward on validated inputs, every pass in Acc. Options::scale s multiplies
/// phi_q, so it multiplies every pass's output: each gradient is linear in s. With gates
/// (`gates` and `reversed_gates`, its reversed()) the outputs must be in Acc.
template <class Acc, class DQ, class DK, class DV, class DG, class T>
void causal_backward(const Eigen::MatrixBase<DQ>& phi_q, const Eigen::MatrixBase<DK>& phi_k,
                     const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DG>& grad_out,
                     Eigen::Ref<Matrix<T>> grad_phi_q, Eigen::Ref<Matrix<T>> grad_phi_k,
                     Eigen::Ref<Matrix<T>> grad_v, const Options& options,
                     const SequenceGates* gates = nullptr,
                     const SequenceGates* reversed_gates = nullptr) {
  Options inner = options;
  inner.normalize = false;
  inner.check_finite = false;
  if (!options.normalize) {
    gradient_pass<Acc>(grad_out.template cast<Acc>(), v.template cast<Acc>(),
                       phi_k.template cast<Acc>(), grad_phi_q, inner, false, gates, true);
    gradient_pass<Acc>(v.template cast<Acc>(), grad_out.template cast<Acc>(),
                       phi_q.template cast<Acc>(), grad_phi_k, inner, true, reversed_gates, true);
    gradient_pass<Acc>(phi_k.template cast<Acc>(), phi_q.template cast<Acc>(),
                       grad_out.template cast<Acc>(), grad_v, inner, true, reversed_gates, false);
    return;
  }
  const Eigen::Index n = v.rows();
  const Eigen::Index dv = v.cols();
  // Rows padded to whole cache lines: the kernel streams [v, 1] and G' by rows, and a row
  // stride of Dv + 1 puts most rows across line boundaries.
  constexpr Eigen::Index kLine = 64 / sizeof(Acc);
  const Eigen::Index stride = (dv + 1 + kLine - 1) / kLine * kLine;
  using Rows = Eigen::Block<Matrix<Acc>, Eigen::Dynamic, Eigen::Dynamic, false>;
  Matrix<Acc> values_storage(n, stride);
  Matrix<Acc> grads_storage(n, stride);
  const Rows values(values_storage, 0, 0, n, dv + 1);
  const Rows grads(grads_storage, 0, 0, n, dv + 1);
  values_storage.leftCols(dv) = v.template cast<Acc>();
  values_storage.col(dv).setOnes();
  causal_pass<Acc>(phi_q.template cast<Acc>(), phi_k.template cast<Acc>(), values,
                   Eigen::Ref<Matrix<Acc>>(grads_storage.leftCols(dv + 1)), inner, false, gates);
  normalization_gradients<Acc>(grads_storage.leftCols(dv + 1), grad_out, options.eps);
  gradient_pass<Acc>(grads, values, phi_k.template cast<Acc>(), grad_phi_q, inner, false, gates,
                     true);
  gradient_pass<Acc>(values, grads, phi_q.template cast<Acc>(), grad_phi_k, inner, true,
                     reversed_gates, true);
  const Rows grad_num(grads_storage, 0, 0, n, dv);
  gradient_pass<Acc>(phi_k.template cast<Acc>(), phi_q.template cast<Acc>(), grad_num, grad_v,
                     inner, true, reversed_gates, false);
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
                         bool causal, const char* where) {
  using T = typename DQ::Scalar;
  using A = accumulator_t<Acc, T>;
  static_assert(is_supported_scalar<T> && is_supported_scalar<A>,
                "linattn backward takes float or double inputs and accumulators");
  validate_backward(phi_q, phi_k, v, grad_out, options, where, "phi_q", "phi_k");
  require_gradient_shape(grad_phi_q, phi_q.rows(), phi_q.cols(), where, "grad_phi_q");
  require_gradient_shape(grad_phi_k, phi_k.rows(), phi_k.cols(), where, "grad_phi_k");
  require_gradient_shape(grad_v, v.rows(), v.cols(), where, "grad_v");
  if (causal) {
    causal_backward<A, DQ, DK, DV, DG, T>(phi_q, phi_k, v, grad_out, grad_phi_q, grad_phi_k, grad_v,
                                          options);
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
                     bool causal, const char* where) {
  using T = typename DQ::Scalar;
  using A = accumulator_t<Acc, T>;
  static_assert(has_map_backward<Map, A>::value,
                "this feature map has no backward(x, grad_phi) member, so gradients cannot "
                "reach q and k; featurize yourself and use the featurized backward");
  validate_backward(q, k, v, grad_out, options, where, "q", "k");
  require_gradient_shape(grad_q, q.rows(), q.cols(), where, "grad_q");
  require_gradient_shape(grad_k, k.rows(), k.cols(), where, "grad_k");
  require_gradient_shape(grad_v, v.rows(), v.cols(), where, "grad_v");
  const Matrix<A> raw_q = q.template cast<A>();
  const Matrix<A> raw_k = k.template cast<A>();
  const Matrix<A> phi_q = backward_features(map, raw_q, false, where);
  const Matrix<A> phi_k = backward_features(map, raw_k, true, where);
  Matrix<A> grad_phi_q(phi_q.rows(), phi_q.cols());
  Matrix<A> grad_phi_k(phi_k.rows(), phi_k.cols());
  Matrix<A> grad_values(v.rows(), v.cols());
  if (causal) {
    causal_backward<A, Matrix<A>, Matrix<A>, DV, DG, A>(phi_q, phi_k, v, grad_out, grad_phi_q,
                                                        grad_phi_k, grad_values, options);
  } else {
    non_causal_backward<A, Matrix<A>, Matrix<A>, DV, DG, A>(phi_q, phi_k, v, grad_out, grad_phi_q,
                                                            grad_phi_k, grad_values, options);
  }
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
  Eigen::Array<double, 1, Eigen::Dynamic> term(phi_q.cols());
  for (Eigen::Index t = n - 1; t >= 0; --t) {
    term = phi_q.row(t).template cast<double>().array() *
               grad_phi_q.row(t).template cast<double>().array() -
           phi_k.row(t).template cast<double>().array() *
               grad_phi_k.row(t).template cast<double>().array();
    if (g == 1) {
      running(0) += term.sum();
    } else {
      running += term;
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
                    const char* where) {
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
    const SequenceGates backward = forward.reversed();
    GatedAttentionGradients<T> result;
    Matrix<A> dq;  // the feature gradients in A: the gate gradients are sums of their products
    Matrix<A> dk;
    auto run = [&](const auto& phi_q, const auto& phi_k) {
      using PQ = std::decay_t<decltype(phi_q)>;
      using PK = std::decay_t<decltype(phi_k)>;
      dq.resize(q.rows(), phi_q.cols());
      dk.resize(k.rows(), phi_k.cols());
      Matrix<A> dv(v.rows(), v.cols());
      causal_backward<A, PQ, PK, DV, DO, A>(phi_q, phi_k, v, grad_out, dq, dk, dv, options,
                                            &forward, &backward);
      gate_gradients<gate_traits<Gates>::log_space>(phi_q, phi_k, dq, dk, forward.logs(),
                                                    result.gates);
      result.v = dv.template cast<T>();
    };
    if constexpr (features) {
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
              const char* where) {
  if constexpr (check_feature_map<Map, accumulator_t<Acc, typename DQ::Scalar>>()) {
    if constexpr (is_identity_map<Map>) {
      featurized_backward<Acc>(q, k, v, grad_out, grad_q, grad_k, grad_v, options, causal, where);
    } else {
      mapped_backward<Acc>(q, k, v, grad_out, map, grad_q, grad_k, grad_v, options, causal, where);
    }
  }
}

}  // namespace detail

/// Backward of causal_linear_attention, into caller-provided gradients. Time O(N C Dv) (four
/// chunked passes, the forward recomputed), workspace O(N Dv) when normalizing (none
/// otherwise), no per-token state. Honours eps, decay, normalize, chunk, check_finite (which
/// also scans grad_out) and threads. With a map other than Identity the map's features are
/// recomputed in the accumulation type and its `backward` carries the gradients to q and k;
/// the features must be finite there (exponential maps on large inputs: use Acc = double).
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
