// SPDX-License-Identifier: MIT
// The generalized delta rule's backward in its recurrent form: the state at the start of every
// block of L tokens (checkpoint_interval) from the forward, then, block by block from the last,
// the block's states recomputed token by token from its checkpoint and reverse mode over its
// tokens from the last. Per token t, with P = S_{t-1}, u = P^T a, w = exp(g_t), q^ = s q and dS
// the gradient flowing into S_t = diag(w) P + b u^T + k v^T from later tokens:
//     dS += q^ do^T,  dq^ = S_t do = w o (P do) + b (u . do) + k (v . do)
//     dk = dS v,  dv = dS^T k,  db = dS u,  du = dS^T b,  da = P du
//     dw = rows of dS o P summed (or all of it, one gate a token),  dg = dw w
//     dS_{t-1} = diag(w) dS + a du^T
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/delta_rule_backward.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/gates.hpp>
#include <linattn/gradients.hpp>

namespace linattn::detail {

/// A sequence's gates from token `first` on: what one block's forward reads.
class OffsetGateRows final : public GateRows {
 public:
  OffsetGateRows(const GateRows& all, Eigen::Index first)
      : GateRows(all.cols()), all_(all), first_(first) {}
  void log_rows(Eigen::Index begin, Eigen::Index len, LogRows& dst) const override {
    all_.log_rows(first_ + begin, len, dst);
  }

 private:
  const GateRows& all_;
  Eigen::Index first_;
};

/// Rows [begin, begin + len) of grads' q, k, v, a, b and gates from the first len rows of a
/// backward's buffers for them (in that order), converted to S.
template <class T, class S>
void store_dplr_gradients(const std::array<const Matrix<T>*, 6>& rows, Eigen::Index begin,
                          Eigen::Index len, DplrGradients<S>& grads) {
  const std::array<Matrix<S>*, 6> out = {&grads.q, &grads.k, &grads.v,
                                         &grads.a, &grads.b, &grads.gates};
  for (std::size_t i = 0; i < out.size(); ++i) {
    auto dst = out[i]->middleRows(begin, len);
    store_rows<S>(*rows[i], len, dst);
  }
}

/// The recurrent-form backward of one sequence of the generalized delta rule on validated
/// inputs, in T. Workspace, allocated once: the checkpoints (ceil(N / L) states) and one block's
/// L states and rows; nothing else grows with N.
template <class T>
class DplrBackward {
 public:
  /// gate_dim: 1 (one decay a token) or Dk (per key feature).
  void reshape(Eigen::Index rows, Eigen::Index key_dim, Eigen::Index value_dim,
               Eigen::Index gate_dim, const DplrOptions& options);

  /// Bytes of T the buffers hold now.
  std::size_t held_bytes() const {
    std::size_t entries = 0;
    for (const Matrix<T>* m : const_cast<DplrBackward*>(this)->matrices()) {
      entries += static_cast<std::size_t>(m->size());
    }
    return entries * sizeof(T);
  }

  /// Blocks of L tokens, the last possibly shorter.
  Eigen::Index blocks() const { return (n_ + block_ - 1) / block_; }

  /// The whole backward: the caller's q, k, v, a, b, their gates' rows (log a_t, LogSpace: the
  /// gradient is d / d log w_t, else d / d w_t) and grad_out; gradients written block by block
  /// from the last.
  template <bool LogSpace, class DQ, class DK, class DV, class DA, class DB, class DO, class S>
  void run(const DQ& q, const DK& k, const DV& v, const DA& a, const DB& b,
           const GateRows& gate_rows, const DO& grad_out, DplrGradients<S>& grads,
           const char* where) {
    const SerialEigenScope serial;
    state_.setZero();
    for (Eigen::Index blk = 0; blk < blocks(); ++blk) {
      checkpoints_.middleRows(blk * dk_, dk_) = state_;
      if (blk + 1 == blocks()) break;
      const Eigen::Index begin = blk * block_;
      const OffsetGateRows rows(gate_rows, begin);
      run_dplr_rule<T, T>(q.middleRows(begin, block_), k.middleRows(begin, block_),
                          v.middleRows(begin, block_), a.middleRows(begin, block_),
                          b.middleRows(begin, block_), rows, options_, state_, nullptr, where);
    }
    ds_.setZero();
    for (Eigen::Index blk = blocks() - 1; blk >= 0; --blk) {
      const Eigen::Index begin = blk * block_;
      const Eigen::Index len = std::min(block_, n_ - begin);
      load_rows(q.middleRows(begin, len), q_);
      load_rows(k.middleRows(begin, len), k_);
      load_rows(v.middleRows(begin, len), v_);
      load_rows(a.middleRows(begin, len), a_);
      load_rows(b.middleRows(begin, len), b_);
      load_rows(grad_out.middleRows(begin, len), grad_out_);
      logs_.resize(len, gates_);
      gate_rows.log_rows(begin, len, logs_);
      reverse_block(blk, len, LogSpace);
      store_dplr_gradients<T, S>({&grad_q_, &grad_k_, &grad_v_, &grad_a_, &grad_b_, &grad_gates_},
                                 begin, len, grads);
    }
  }

 private:
  /// Every buffer, for held_bytes.
  std::array<Matrix<T>*, 20> matrices() {
    return {&checkpoints_, &states_,     &q_,        &k_,      &v_,      &a_,      &b_,
            &u_,           &w_,          &grad_out_, &grad_q_, &grad_k_, &grad_v_, &grad_a_,
            &grad_b_,      &grad_gates_, &ds_,       &state_,  &dq_,     &du_};
  }

  /// The loaded block: its states recomputed from checkpoint `blk`, then reverse mode over its
  /// tokens from the last (log_space: the gradient is d / d log w_t).
  void reverse_block(Eigen::Index blk, Eigen::Index len, bool log_space);

  /// Token i of the loaded block, P = its S_{t-1}.
  void reverse_token(Eigen::Index i, bool log_space);

  /// y <- diag(w_t) y for token i of the block.
  template <class Y>
  void decay(Eigen::Index i, Y&& y) const {
    if (gates_ == 1) {
      y *= w_(i, 0);
    } else {
      y.array().colwise() *= w_.row(i).transpose().array();
    }
  }

  Eigen::Index n_ = 0, dk_ = 0, gates_ = 1, block_ = 1;
  T scale_ = T(1);
  DplrOptions options_;
  Matrix<T> checkpoints_;       ///< (blocks Dk) x Dv: S before each block's first token
  Matrix<T> states_;            ///< (L Dk) x Dv: S_{t-1} of the loaded block's tokens
  Matrix<T> q_, k_, a_, b_;     ///< L x Dk: s q, k, a, b
  Matrix<T> v_, u_, grad_out_;  ///< L x Dv: v, u = S_{t-1}^T a, do
  Matrix<T> w_;                 ///< L x G: w_t = exp(g_t)
  Matrix<T> grad_q_, grad_k_;   ///< L x Dk
  Matrix<T> grad_a_, grad_b_;   ///< L x Dk
  Matrix<T> grad_v_;            ///< L x Dv
  Matrix<T> grad_gates_;        ///< L x G
  Matrix<T> ds_, state_;        ///< Dk x Dv: dS flowing back; the recomputed S
  Matrix<T> dq_, du_;           ///< Dk x 1, Dv x 1
  LogRows logs_;                ///< L x G: the block's log gates
};

// DplrBackward's members that do not depend on the inputs' types, outside the class so that
// the compiled mode's `extern template` keeps them out of every other translation unit.

template <class T>
void DplrBackward<T>::reshape(Eigen::Index rows, Eigen::Index key_dim, Eigen::Index value_dim,
                              Eigen::Index gate_dim, const DplrOptions& options) {
  n_ = rows;
  dk_ = key_dim;
  gates_ = gate_dim;
  block_ = checkpoint_interval(options.chunk, rows);
  scale_ = static_cast<T>(dplr_scale(options, key_dim));
  options_ = options;
  options_.threads = 1;
  options_.check_finite = false;
  checkpoints_.resize(blocks() * key_dim, value_dim);
  states_.resize(block_ * key_dim, value_dim);
  for (Matrix<T>* m : {&q_, &k_, &a_, &b_, &grad_q_, &grad_k_, &grad_a_, &grad_b_}) {
    m->resize(block_, key_dim);
  }
  for (Matrix<T>* m : {&v_, &u_, &grad_out_, &grad_v_}) m->resize(block_, value_dim);
  w_.resize(block_, gate_dim);
  grad_gates_.resize(block_, gate_dim);
  ds_.resize(key_dim, value_dim);
  state_.resize(key_dim, value_dim);
  dq_.resize(key_dim, 1);
  du_.resize(value_dim, 1);
}

template <class T>
void DplrBackward<T>::reverse_block(Eigen::Index blk, Eigen::Index len, bool log_space) {
  q_.topRows(len) *= scale_;
  w_.topRows(len) = logs_.topRows(len).template cast<T>().matrix();
  w_.topRows(len).array() = w_.topRows(len).array().exp();
  // Exactly 0 at -infinity (Eigen's vectorised exp gives the smallest denormal there).
  w_.topRows(len) = (logs_.topRows(len) == -std::numeric_limits<double>::infinity())
                        .select(T(0), w_.topRows(len).array())
                        .matrix();
  state_ = checkpoints_.middleRows(blk * dk_, dk_);
  for (Eigen::Index i = 0; i < len; ++i) {
    states_.middleRows(i * dk_, dk_) = state_;
    u_.row(i).noalias() = a_.row(i) * state_;
    decay(i, state_);
    state_.noalias() += b_.row(i).transpose() * u_.row(i);
    state_.noalias() += k_.row(i).transpose() * v_.row(i);
  }
  for (Eigen::Index i = len - 1; i >= 0; --i) reverse_token(i, log_space);
  grad_q_.topRows(len) *= scale_;
}

template <class T>
void DplrBackward<T>::reverse_token(Eigen::Index i, bool log_space) {
  const auto p = states_.middleRows(i * dk_, dk_);
  const auto q = q_.row(i).transpose();
  const auto k = k_.row(i).transpose();
  const auto a = a_.row(i).transpose();
  const auto b = b_.row(i).transpose();
  const auto v = v_.row(i).transpose();
  const auto u = u_.row(i).transpose();
  const auto dout = grad_out_.row(i).transpose();
  ds_.noalias() += q * dout.transpose();
  // dq^ = S_t do with S_t = diag(w) P + b u^T + k v^T: one pass over P, none over S_t.
  dq_.noalias() = p * dout;
  decay(i, dq_);
  grad_q_.row(i) = (dq_ + b * u.dot(dout) + k * v.dot(dout)).transpose();
  grad_k_.row(i).noalias() = (ds_ * v).transpose();
  grad_v_.row(i).noalias() = (ds_.transpose() * k).transpose();
  grad_b_.row(i).noalias() = (ds_ * u).transpose();
  du_.noalias() = ds_.transpose() * b;
  grad_a_.row(i).noalias() = (p * du_).transpose();
  // dw: d loss / d w_t, from S_t's diag(w) P; times w for the log gate.
  if (gates_ == 1) {
    const T dw = (ds_.array() * p.array()).sum();
    grad_gates_(i, 0) = log_space ? dw * w_(i, 0) : dw;
  } else {
    dq_ = (ds_.array() * p.array()).rowwise().sum().matrix();
    grad_gates_.row(i) = dq_.transpose();
    if (log_space) grad_gates_.row(i).array() *= w_.row(i).array();
  }
  // dS_{t-1} = diag(w) dS + a du^T.
  decay(i, ds_);
  ds_.noalias() += a * du_.transpose();
}

#ifdef LINATTN_COMPILED
extern template class DplrBackward<float>;
extern template class DplrBackward<double>;
#endif

}  // namespace linattn::detail
