// SPDX-License-Identifier: MIT
// The delta rule's backward (DeltaNet, Gated DeltaNet, KDA) in its recurrent form: the state at
// the start of every block of L tokens (checkpoint_interval) from the chunked forward, then, block
// by block from the last, the block's states recomputed token by token from its checkpoint and
// reverse mode over its tokens from the last. Per token t, with dS the gradient flowing into
// S_t from later tokens and S' = diag(a_t) S_{t-1}:
//     dS += q^ do^T,  dq^ = S_t do = S' do + k^ (u . do)
//     dk^ = dS u,  du = dS^T k^,  dbeta = du . u / beta,  dv = beta du,  dpred = -beta du
//     dS' = dS + k^ dpred^T,  dk^ += S' dpred,  da = rows of (dS' o S_{t-1}) summed (or all)
//     dS_{t-1} = diag(a_t) dS',  dg_t = da a_t
// then through the scale and the L2 norm: J_n(x)^T y = (y - x^ (x^ . y)) / sqrt(|x|^2 + 1e-6).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <initializer_list>
#include <linattn/config.hpp>
#include <linattn/delta_rule.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/delta_chunk_backward.hpp>
#include <linattn/detail/delta_rule.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <string>
#include <type_traits>

namespace linattn::detail {

/// Throws unless the gradient `grad` is rows x cols; `name` is the gradient argument.
template <class Grad>
void require_delta_gradient_shape(const Grad& grad, Eigen::Index rows, Eigen::Index cols,
                                  const char* where, const char* name) {
  if (grad.rows() != rows || grad.cols() != cols) {
    throw Error(std::string(where) + ": " + name + " is " + shape_string(grad.rows(), grad.cols()) +
                " but the gradient is " + shape_string(rows, cols));
  }
}

/// Every check of a delta-rule backward call, before anything is written: the forward's
/// (options, shapes, beta, gates, and with check_finite q, k and v), grad_out's shape and (with
/// check_finite) its values, and the shapes of the gradients. `gates` and `grad_gates` are null
/// for DeltaNet.
template <class DQ, class DK, class DV, class DB, class DO, class Gates, class S>
void validate_delta_backward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DB>& beta, const Gates* gates, const Eigen::MatrixBase<DO>& grad_out,
    const Eigen::Ref<Matrix<S>>& grad_q, const Eigen::Ref<Matrix<S>>& grad_k,
    const Eigen::Ref<Matrix<S>>& grad_v, const Eigen::Ref<Matrix<S>>* grad_gates,
    const Eigen::Ref<Vector<S>>& grad_beta, const DeltaOptions& options, const char* where) {
  validate_delta_options(options, where);
  const Options engine = engine_options(options);
  validate_sequence_shapes(q, k, v, engine, where, "q", "k");
  validate_beta(beta, q.rows(), options, where);
  if (grad_out.rows() != v.rows() || grad_out.cols() != v.cols()) {
    throw Error(std::string(where) + ": grad_out is " + shape_string(grad_out) + " but v is " +
                shape_string(v) + "; the gradient has the output's shape");
  }
  require_delta_gradient_shape(grad_q, q.rows(), q.cols(), where, "grad_q");
  require_delta_gradient_shape(grad_k, k.rows(), k.cols(), where, "grad_k");
  require_delta_gradient_shape(grad_v, v.rows(), v.cols(), where, "grad_v");
  require_delta_gradient_shape(grad_beta, q.rows(), 1, where, "grad_beta");
  if constexpr (!std::is_void_v<Gates>) {
    validate_delta_gates(*gates, q.rows(), q.cols(), where);
    require_delta_gradient_shape(*grad_gates, q.rows(), gate_traits<Gates>::values(*gates).cols(),
                                 where, "grad_gates");
  }
  scan_delta_inputs(q, k, v, beta, options, where);
  if (options.check_finite) {
    require_finite_parallel(grad_out, where, "grad_out", resolve_threads(engine));
  }
}

/// The tokens between two checkpoints of the backward: at least the chunk (and at most N), and
/// at least ceil(sqrt(N)), where the checkpoints and one block's states, (N / L + L) Dk Dv,
/// take the least memory (2 sqrt(N) Dk Dv; at chunk = 1 a fixed L would keep all N states).
inline Eigen::Index checkpoint_interval(Eigen::Index chunk, Eigen::Index rows) {
  Eigen::Index root = static_cast<Eigen::Index>(std::sqrt(static_cast<double>(rows)));
  while (root * root < rows) ++root;
  return std::max<Eigen::Index>(1, std::min(std::max(chunk, root), rows));
}

/// The recurrent-form backward of one sequence on validated inputs, in T. Workspace, allocated
/// once: the checkpoints (ceil(N / L) states, L = checkpoint_interval(chunk, N)) and one block's
/// L states and rows; nothing else grows with N.
template <class T>
class DeltaBackward {
 public:
  DeltaBackward() = default;
  /// gate_dim: 0 (DeltaNet), 1 (scalar gates) or Dk (per key feature).
  DeltaBackward(Eigen::Index rows, Eigen::Index key_dim, Eigen::Index value_dim,
                Eigen::Index gate_dim, const DeltaOptions& options) {
    reshape(rows, key_dim, value_dim, gate_dim, options);
  }

  /// Sizes the workspace for a call (as the constructor): buffers of the same size as the last
  /// call's are kept, others reallocated.
  void reshape(Eigen::Index rows, Eigen::Index key_dim, Eigen::Index value_dim,
               Eigen::Index gate_dim, const DeltaOptions& options);

  /// Frees every buffer (another form of the backward runs).
  void release() {
    for (Matrix<T>* m : matrices()) m->resize(0, 0);
    for (Vector<T>* x : vectors()) x->resize(0);
  }

  /// Bytes of T the buffers hold now.
  std::size_t held_bytes() const {
    auto* self = const_cast<DeltaBackward*>(this);  // the lists only; nothing is written
    std::size_t entries = 0;
    for (const Matrix<T>* m : self->matrices()) entries += static_cast<std::size_t>(m->size());
    for (const Vector<T>* x : self->vectors()) entries += static_cast<std::size_t>(x->size());
    return entries * sizeof(T);
  }

  /// Blocks of L tokens, the last possibly shorter.
  Eigen::Index blocks() const { return (n_ + block_ - 1) / block_; }

  /// The whole backward: q, k, v, beta, the gate values (null for DeltaNet; a_t, or log a_t
  /// with LogSpace) and their GateRows, and grad_out, as the caller gave them; the gradients
  /// are written block by block, from the last.
  template <bool LogSpace, class DQ, class DK, class DV, class DB, class DO, class GV, class S>
  void run(const DQ& q, const DK& k, const DV& v, const DB& beta, const GV* gate_values,
           const GateRows* gate_rows, const DO& grad_out, Eigen::Ref<Matrix<S>> grad_q,
           Eigen::Ref<Matrix<S>> grad_k, Eigen::Ref<Matrix<S>> grad_v,
           Eigen::Ref<Matrix<S>>* grad_gates, Eigen::Ref<Vector<S>> grad_beta, const char* where) {
    const SerialEigenScope serial;
    ds_.setZero();
    checkpoint(q, k, v, beta, gate_rows, where);
    for (Eigen::Index b = blocks() - 1; b >= 0; --b) {
      const Eigen::Index begin = b * block_;
      const Eigen::Index len = std::min(block_, n_ - begin);
      load_block<LogSpace>(q, k, v, beta, gate_values, grad_out, begin, len);
      recompute(b, len);
      for (Eigen::Index i = len - 1; i >= 0; --i) reverse_token(i, LogSpace);
      finish_block(len);
      store(grad_q_, len, grad_q.middleRows(begin, len));
      store(grad_k_, len, grad_k.middleRows(begin, len));
      store(grad_v_, len, grad_v.middleRows(begin, len));
      grad_beta.segment(begin, len) = grad_beta_.head(len).template cast<S>();
      if (gates_ > 0) store(grad_gates_, len, grad_gates->middleRows(begin, len));
    }
  }

 private:
  /// The chunked forward from a zero state, keeping S at each block's start (the last block's
  /// end is not needed). One kernel and one source for every block.
  template <class DQ, class DK, class DV, class DB>
  void checkpoint(const DQ& q, const DK& k, const DV& v, const DB& beta, const GateRows* gate_rows,
                  const char* where) {
    state_.setZero();
    with_source<T>(q, k, v, Identity{}, gate_rows, false, where, [&](ChunkSource<T>& source) {
      DeltaKernel<T, T> kernel(n_, dk_, dv_, options_);
      for (Eigen::Index b = 0; b < blocks(); ++b) {
        checkpoints_.middleRows(b * dk_, dk_) = state_;
        if (b + 1 == blocks()) break;
        const RowRange<T> rows(source, b * block_, block_);
        const BetaVector<T, DB> betas(beta, b * block_);
        kernel.run(rows, betas, state_, nullptr);
      }
    });
  }

  /// The block's rows in T: q^ = s n(q), k^ = n(k), v, beta, a_t, grad_out.
  template <bool LogSpace, class DQ, class DK, class DV, class DB, class DO, class GV>
  void load_block(const DQ& q, const DK& k, const DV& v, const DB& beta, const GV* gate_values,
                  const DO& grad_out, Eigen::Index begin, Eigen::Index len) {
    load_rows(q.middleRows(begin, len), q_);
    load_rows(k.middleRows(begin, len), k_);
    load_rows(v.middleRows(begin, len), v_);
    load_rows(grad_out.middleRows(begin, len), grad_out_);
    for (Eigen::Index i = 0; i < len; ++i) beta_(i) = static_cast<T>(beta.reshaped()(begin + i));
    if (l2_normalize_) {
      raw_q_.topRows(len) = q_.topRows(len);
      raw_k_.topRows(len) = k_.topRows(len);
      l2_normalize_rows(q_, len);
      l2_normalize_rows(k_, len);
    }
    q_.topRows(len) *= scale_;
    if constexpr (!std::is_void_v<GV>) {
      // As DeltaRuleState's step reads a gate: exp in double for log gates (-inf gives 0).
      for (Eigen::Index i = 0; i < len; ++i) {
        for (Eigen::Index c = 0; c < gates_; ++c) {
          const double x = static_cast<double>((*gate_values)(begin + i, c));
          gate_(i, c) = static_cast<T>(LogSpace ? std::exp(x) : x);
        }
      }
    }
  }

  /// S_{t-1} and u_t of the block's tokens from its checkpoint, by delta_step.
  void recompute(Eigen::Index b, Eigen::Index len);

  /// Token i of the loaded block: its gradients into the block's rows, ds_ moved to S_{t-1}
  /// (log_space: the gates were given as log gates, so their gradient is d / d log a_t).
  void reverse_token(Eigen::Index i, bool log_space);

  /// Every buffer, for release and held_bytes.
  std::array<Matrix<T>*, 16> matrices() {
    return {&checkpoints_, &states_, &q_,      &k_,      &raw_q_,  &raw_k_,      &v_,  &u_,
            &grad_out_,    &gate_,   &grad_q_, &grad_k_, &grad_v_, &grad_gates_, &ds_, &state_};
  }
  std::array<Vector<T>*, 14> vectors() {
    return {&beta_,    &grad_beta_, &dout_,   &du_,     &dpred_,     &dq_,        &dkey_,
            &product_, &step_.q,    &step_.k, &step_.v, &step_.gate, &step_.pred, &step_.out};
  }

  /// y <- diag(a_t) y: S' y from S_{t-1} y.
  void decay(Eigen::Index i, Vector<T>& y) const {
    if (gates_ == 1) {
      y *= gate_(i, 0);
    } else if (gates_ > 1) {
      y.array() *= gate_.row(i).transpose().array();
    }
  }

  /// The block's dq^ and dk^ through the scale and the L2 norm, to dq and dk.
  void finish_block(Eigen::Index len);

  /// Rows [0, len) of a block buffer into the caller's gradient rows.
  template <class Out>
  static void store(const Matrix<T>& src, Eigen::Index len, Out out) {
    using S = typename Out::Scalar;
    store_rows<S>(src, len, out);
  }

  Eigen::Index n_ = 0, dk_ = 0, dv_ = 0, gates_ = 0, block_ = 1;
  T scale_ = T(1);
  bool l2_normalize_ = false;
  DeltaOptions options_;
  Matrix<T> checkpoints_;          ///< (blocks Dk) x Dv: S before each block's first token
  Matrix<T> states_;               ///< (L Dk) x Dv: S_{t-1} of the loaded block's tokens
  Matrix<T> q_, k_;                ///< L x Dk: q^ = s n(q) and k^ = n(k)
  Matrix<T> raw_q_;                ///< L x Dk: q as given, with l2_normalize (else empty)
  Matrix<T> raw_k_;                ///< L x Dk: k as given, with l2_normalize (else empty)
  Matrix<T> v_, u_;                ///< L x Dv: v, and u_t = beta_t (v_t - S'^T k^_t)
  Matrix<T> grad_out_;             ///< L x Dv
  Matrix<T> gate_;                 ///< L x G: a_t
  Vector<T> beta_;                 ///< L
  Matrix<T> grad_q_;               ///< L x Dk: dq^, then dq
  Matrix<T> grad_k_;               ///< L x Dk: dk^, then dk
  Matrix<T> grad_v_;               ///< L x Dv
  Matrix<T> grad_gates_;           ///< L x G
  Vector<T> grad_beta_;            ///< L
  Matrix<T> ds_;                   ///< Dk x Dv: d loss / d S flowing back
  Matrix<T> state_;                ///< Dk x Dv: the recomputed S
  Vector<T> dout_, du_, dpred_;    ///< Dv
  Vector<T> dq_, dkey_, product_;  ///< Dk
  DeltaStepBuffers<T> step_;
};

// DeltaBackward's members that do not depend on the inputs' types, outside the class so that
// the compiled mode's `extern template` keeps them out of every other translation unit.

template <class T>
void DeltaBackward<T>::reshape(Eigen::Index rows, Eigen::Index key_dim, Eigen::Index value_dim,
                               Eigen::Index gate_dim, const DeltaOptions& options) {
  n_ = rows;
  dk_ = key_dim;
  dv_ = value_dim;
  gates_ = gate_dim;
  block_ = checkpoint_interval(options.chunk, rows);
  scale_ = static_cast<T>(delta_scale(options, key_dim));
  l2_normalize_ = options.l2_normalize;
  options_ = options;
  const Eigen::Index g = std::max<Eigen::Index>(gate_dim, 1);
  checkpoints_.resize(blocks() * key_dim, value_dim);
  states_.resize(block_ * key_dim, value_dim);
  for (Matrix<T>* m : {&q_, &k_, &grad_q_, &grad_k_}) m->resize(block_, key_dim);
  for (Matrix<T>* m : {&raw_q_, &raw_k_}) m->resize(l2_normalize_ ? block_ : 0, key_dim);
  for (Matrix<T>* m : {&v_, &u_, &grad_out_, &grad_v_}) m->resize(block_, value_dim);
  gate_.resize(block_, g);
  grad_gates_.resize(block_, g);
  beta_.resize(block_);
  grad_beta_.resize(block_);
  ds_.resize(key_dim, value_dim);
  state_.resize(key_dim, value_dim);
  for (Vector<T>* x : {&dout_, &du_, &dpred_}) x->resize(value_dim);
  for (Vector<T>* x : {&dq_, &dkey_, &product_}) x->resize(key_dim);
  step_.resize(key_dim, value_dim);
}

template <class T>
void DeltaBackward<T>::recompute(Eigen::Index b, Eigen::Index len) {
  state_ = checkpoints_.middleRows(b * dk_, dk_);
  for (Eigen::Index i = 0; i < len; ++i) {
    states_.middleRows(i * dk_, dk_) = state_;
    step_.q = q_.row(i).transpose();
    step_.k = k_.row(i).transpose();
    step_.v = v_.row(i).transpose();
    if (gates_ > 0) step_.gate.head(gates_) = gate_.row(i).head(gates_).transpose();
    delta_step(state_, step_, beta_(i), gates_);
    u_.row(i) = step_.pred.transpose();  // delta_step leaves u = beta (v - pred) there
  }
}

template <class T>
void DeltaBackward<T>::reverse_token(Eigen::Index i, bool log_space) {
  const auto s_prev = states_.middleRows(i * dk_, dk_);
  const auto q = q_.row(i).transpose();
  const auto k = k_.row(i).transpose();
  const auto u = u_.row(i).transpose();
  const T beta = beta_(i);
  dout_ = grad_out_.row(i).transpose();
  ds_.noalias() += q * dout_.transpose();
  // dq^ = S_t do with S_t = S' + k^ u^T: one pass over S_{t-1}, none over S_t.
  product_.noalias() = s_prev * dout_;
  decay(i, product_);
  dq_ = product_ + k * u.dot(dout_);
  dkey_.noalias() = ds_ * u;
  du_.noalias() = ds_.transpose() * k;
  // v - pred = u / beta, beta > 0 by validation.
  grad_beta_(i) = du_.dot(u) / beta;
  grad_v_.row(i) = beta * du_.transpose();
  dpred_ = -beta * du_;
  ds_.noalias() += k * dpred_.transpose();  // now dS'
  product_.noalias() = s_prev * dpred_;
  decay(i, product_);
  dkey_ += product_;
  if (gates_ == 1) {
    const T da = (ds_.array() * s_prev.array()).sum();
    grad_gates_(i, 0) = log_space ? da * gate_(i, 0) : da;
    ds_ *= gate_(i, 0);
  } else if (gates_ > 1) {
    product_ = (ds_.array() * s_prev.array()).rowwise().sum().matrix();
    if (log_space) {
      grad_gates_.row(i) = product_.transpose().cwiseProduct(gate_.row(i));
    } else {
      grad_gates_.row(i) = product_.transpose();
    }
    ds_.array().colwise() *= gate_.row(i).transpose().array();
  }
  grad_q_.row(i) = dq_.transpose();
  grad_k_.row(i) = dkey_.transpose();
}

template <class T>
void DeltaBackward<T>::finish_block(Eigen::Index len) {
  if (!l2_normalize_) {
    grad_q_.topRows(len) *= scale_;
    return;
  }
  l2_normalize_backward(raw_q_, grad_q_, len, scale_);
  l2_normalize_backward(raw_k_, grad_k_, len, T(1));
}

/// The delta-rule backward's buffers of both forms (DeltaBackwardWorkspace's): a call sizes
/// the one it runs and frees the other.
template <class T>
struct DeltaBackwardBuffers {
  DeltaBackward<T> recurrent;
  DeltaChunkBackward<T> chunked;
};

#ifdef LINATTN_COMPILED
LINATTN_DELTA_BACKWARD_INSTANCES(extern template, float)
LINATTN_DELTA_BACKWARD_INSTANCES(extern template, double)
#endif

/// The matrix entry points: the scalar checks, validation, then the backward in Acc.
template <class Acc, class DQ, class DK, class DV, class DB, class DO, class Gates>
void delta_rule_backward_into(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DB>& beta, const Gates* gates, const Eigen::MatrixBase<DO>& grad_out,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_q, Eigen::Ref<Matrix<typename DQ::Scalar>> grad_k,
    Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v,
    Eigen::Ref<Matrix<typename DQ::Scalar>>* grad_gates,
    Eigen::Ref<Vector<typename DQ::Scalar>> grad_beta, const DeltaOptions& options,
    const char* where,
    DeltaBackwardBuffers<accumulator_t<Acc, typename DQ::Scalar>>* workspace = nullptr) {
  using Scalar = typename DQ::Scalar;
  using T = accumulator_t<Acc, Scalar>;
  check_delta_call_scalars<Acc, DQ, DK, DV, DB, Gates>();
  static_assert(std::is_same_v<typename DO::Scalar, Scalar>,
                "grad_out must have the inputs' scalar type: cast it first");
  validate_delta_backward(q, k, v, beta, gates, grad_out, grad_q, grad_k, grad_v, grad_gates,
                          grad_beta, options, where);
  DeltaBackwardBuffers<T> own;
  DeltaBackwardBuffers<T>& buffers = workspace != nullptr ? *workspace : own;
  constexpr bool log_space = [] {
    if constexpr (std::is_void_v<Gates>) {
      return false;
    } else {
      return gate_traits<Gates>::log_space;
    }
  }();
  const auto run = [&](const GateRows* gate_rows, const auto* values,
                       Eigen::Ref<Matrix<Scalar>>* grad_g) {
    using GV = std::remove_const_t<std::remove_pointer_t<decltype(values)>>;
    const Eigen::Index gate_dim = gate_rows == nullptr ? 0 : gate_rows->cols();
    if (chunked_delta_backward(options)) {
      const int threads = resolve_threads(engine_options(options));
      buffers.recurrent.release();
      buffers.chunked.reshape(q.rows(), q.cols(), v.cols(), gate_dim, options, threads);
      buffers.chunked.template run<log_space>(q.derived(), k.derived(), v.derived(), beta.derived(),
                                              gate_rows, grad_out.derived(), grad_q, grad_k, grad_v,
                                              grad_g, grad_beta);
      return;
    }
    buffers.chunked.release();
    buffers.recurrent.reshape(q.rows(), q.cols(), v.cols(), gate_dim, options);
    buffers.recurrent.template run<log_space, DQ, DK, DV, DB, DO, GV, Scalar>(
        q.derived(), k.derived(), v.derived(), beta.derived(), values, gate_rows,
        grad_out.derived(), grad_q, grad_k, grad_v, grad_g, grad_beta, where);
  };
  if constexpr (std::is_void_v<Gates>) {
    run(nullptr, static_cast<const void*>(nullptr), nullptr);
  } else {
    const GateMatrix<Gates> gate_rows(*gates);
    run(&gate_rows, &gate_traits<Gates>::values(*gates), grad_gates);
  }
}

}  // namespace linattn::detail
