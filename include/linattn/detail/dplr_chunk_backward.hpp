// SPDX-License-Identifier: MIT
// The generalized delta rule's backward in its chunked (WY) form: reverse mode through the
// pieces DplrKernel computes, every product a GEMM. Per chunk of m tokens with S0 the state
// before it, in-chunk cumulative log gates G_t per key feature (G_{-1} = 0), the decayed rows
// Q~ = q o exp(G_t), A~ = a o exp(G_{t-1}), B~ = b o exp(G_m - G_t), K~ = k o exp(G_m - G_t),
// and the decayed pairs x_t . y_i = sum_f x_tf y_if exp(G_tf - G_if) (FeaturePairs):
//     Ab = tril(a_t . b_i through exp(G_{t-1} - G_i), -1), Ak likewise with k,
//     Qb = tril(q_t . b_i through exp(G_t - G_i)), Qk likewise with k,
//     U = (I - Ab)^-1 (A~ S0 + Ak V),  O = Q~ S0 + Qb U + Qk V,
//     S = diag(exp(G_m)) S0 + B~^T U + K~^T V.
// Given dO and dS (the gradient of the state after the chunk):
//     dU = Qb^T dO + B~ dS,  dY = (I - Ab)^-T dU,
//     dAb = tril(dY U^T, -1), dAk = tril(dY V^T, -1), dQb = tril(dO U^T), dQk = tril(dO V^T),
//     dV = Ak^T dY + Qk^T dO + K~ dS,  dB~ = U dS^T,  dK~ = V dS^T,
//     [dQ~; dA~] = [dO; dY] S0^T,  dS0 = diag(exp(G_m)) dS + Q~^T dO + A~^T dY,
// the rows' gradients through their factors (each cumulative gate's share the factor times its
// gradient) and the pairs' through FeaturePairs::gradients; the a-side pairs read a_t against
// G_{t-1}, so they run as pairs of the rows shifted by one token. Resets (log gate -infinity)
// run inside the chunk as kFeatureResetLog, whose exp is 0, their gradient 0; scalar gates run
// as per-feature ones, their gradient the sum over the features.
// The forward runs once first, keeping S0 at every chunk's start, U, Ab and Ak: O(N (Dv + 2L)
// + (N / L) Dk Dv) memory. One thread: the callers split the value columns (one sequence) or the
// heads across threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/delta_chunk_backward.hpp>
#include <linattn/detail/dplr_delta_rule.hpp>
#include <linattn/detail/dplr_delta_rule_backward.hpp>
#include <linattn/detail/feature_pairs.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/gates.hpp>
#include <linattn/gradients.hpp>
#include <type_traits>
#include <vector>

namespace linattn::detail {

/// The longest chunk of the backward: past it the in-chunk pairs (L Dk a token, four of them
/// and their gradients) cost more than the GEMMs they save (measured at Dk = 32 to 128).
inline constexpr Eigen::Index kDplrBackwardChunk = 16;

/// True when the chunked backward runs for these options and shape: DeltaForm::chunked, or
/// automatic at Dk Dv >= 64 x 64 (measured: at 32 x 32 the recurrent form is 1.1x faster, at
/// 64 x 64 the chunked one 1.1x, at 128 x 128 1.5-1.8x); DeltaForm::streamed keeps the recurrent
/// backward (the reference the chunked one is tested against).
inline bool chunked_dplr_backward(const DplrOptions& options, Eigen::Index key_dim,
                                  Eigen::Index value_dim) {
  if (options.form == DeltaForm::automatic) return key_dim * value_dim >= 64 * 64;
  return options.form == DeltaForm::chunked;
}

/// The chunked backward of one sequence of the generalized delta rule on validated inputs, in
/// T (see the header's comment). Workspace, allocated by reshape: the chunks' starting states,
/// N rows of U, one chunk's rows and products.
template <class T>
class DplrChunkBackward {
 public:
  /// Sizes the buffers for a call of N = rows tokens (gate_dim 1 or Dk); buffers of the same
  /// size as the last call's are kept.
  void reshape(Eigen::Index rows, Eigen::Index key_dim, Eigen::Index value_dim,
               Eigen::Index gate_dim, const DplrOptions& options) {
    n_ = rows;
    dk_ = key_dim;
    gates_ = gate_dim;
    chunk_ = std::max<Eigen::Index>(1, std::min({options.chunk, kDplrBackwardChunk, rows}));
    scale_ = static_cast<T>(dplr_scale(options, key_dim));
    layout(this, n_, dk_, value_dim, chunk_, gates_, [](auto* m, Eigen::Index r, Eigen::Index c) {
      if (m->rows() != r || m->cols() != c) m->resize(r, c);
    });
    pairs_.reshape(chunk_, dk_);
    reset_.assign(static_cast<std::size_t>(chunk_ * dk_), 0);
  }

  /// Bytes the buffers hold now.
  std::size_t held_bytes() const {
    std::size_t total = reset_.size() + FeaturePairs<T>::bytes(chunk_, dk_);
    layout(this, n_, dk_, value_dim(), chunk_, gates_,
           [&](const auto* m, Eigen::Index, Eigen::Index) {
             total += static_cast<std::size_t>(m->size()) *
                      sizeof(typename std::decay_t<decltype(*m)>::Scalar);
           });
    return total;
  }

  /// The whole backward: the caller's q, k, v, a, b, their gates' rows (log w_t; LogSpace: the
  /// gradient is d / d log w_t, else d / d w_t) and grad_out; gradients written chunk by chunk
  /// from the last.
  template <bool LogSpace, class DQ, class DK, class DV, class DA, class DB, class DO, class S>
  void run(const DQ& q, const DK& k, const DV& v, const DA& a, const DB& b,
           const GateRows& gate_rows, const DO& grad_out, DplrGradients<S>& grads) {
    const SerialEigenScope serial;
    const Eigen::Index chunks = (n_ + chunk_ - 1) / chunk_;
    state_.setZero();
    for (Eigen::Index c = 0; c < chunks; ++c) {
      const Eigen::Index begin = c * chunk_, len = std::min(chunk_, n_ - begin);
      checkpoints_.middleRows(c * dk_, dk_) = state_;
      load_rows(k.middleRows(begin, len), k_);
      load_rows(v.middleRows(begin, len), v_);
      load_rows(a.middleRows(begin, len), a_);
      load_rows(b.middleRows(begin, len), b_);
      load_gates(gate_rows, begin, len);
      forward_chunk(begin, len);
    }
    ds_.setZero();
    for (Eigen::Index c = chunks - 1; c >= 0; --c) {
      const Eigen::Index begin = c * chunk_, len = std::min(chunk_, n_ - begin);
      load_rows(q.middleRows(begin, len), q_);
      load_rows(k.middleRows(begin, len), k_);
      load_rows(v.middleRows(begin, len), v_);
      load_rows(a.middleRows(begin, len), a_);
      load_rows(b.middleRows(begin, len), b_);
      load_rows(grad_out.middleRows(begin, len), dout_);
      load_gates(gate_rows, begin, len);
      backward_chunk(c, len, LogSpace);
      store_dplr_gradients<T, S>({&grad_q_, &grad_k_, &grad_v_, &grad_a_, &grad_b_, &grad_gate_},
                                 begin, len, grads);
    }
  }

 private:
  Eigen::Index value_dim() const { return v_.cols(); }

  /// visit(buffer, rows, cols) for each buffer (of its type, possibly null).
  template <class Self, class Visit>
  static void layout(Self* self, Eigen::Index n, Eigen::Index dk, Eigen::Index dv, Eigen::Index l,
                     Eigen::Index gates, Visit&& visit) {
    using B = DplrChunkBackward;
    auto at = [&](auto member) { return self == nullptr ? nullptr : &(self->*member); };
    visit(at(&B::checkpoints_), ((n + l - 1) / l) * dk, dv);
    visit(at(&B::u_all_), n, dv);
    for (auto m : {&B::ab_all_, &B::ak_all_}) visit(at(m), n, l);
    for (auto m : {&B::state_, &B::ds_}) visit(at(m), dk, dv);
    for (auto m :
         {&B::q_, &B::k_, &B::a_, &B::b_, &B::a_next_, &B::q_decayed_, &B::a_decayed_,
          &B::b_decayed_, &B::k_decayed_, &B::grad_q_, &B::grad_k_, &B::grad_a_, &B::grad_b_,
          &B::grad_a_next_, &B::dcum_, &B::gamma_, &B::gamma_prev_, &B::to_end_}) {
      visit(at(m), l, dk);
    }
    for (auto m : {&B::v_, &B::dout_, &B::du_, &B::grad_v_}) visit(at(m), l, dv);
    for (auto m : {&B::qb_, &B::qk_, &B::dab_}) visit(at(m), l, l);
    for (auto m : {&B::log_gate_, &B::cum_}) visit(at(m), l, dk);
    visit(at(&B::logs_), l, gates);
    visit(at(&B::grad_gate_), l, gates);
    visit(at(&B::products_), 2 * l, dk);
    visit(at(&B::lhs_), 2 * l, dv);
  }

  /// The chunk's log gates (per feature, a scalar gate broadcast) with resets marked and set
  /// to kFeatureResetLog (as is anything below it), their cumulative sums, the factors
  /// exp(G_t), exp(G_{t-1}), exp(G_m - G_t), and FeaturePairs' factors.
  void load_gates(const GateRows& gate_rows, Eigen::Index begin, Eigen::Index len) {
    constexpr double minus_inf = -std::numeric_limits<double>::infinity();
    gate_rows.log_rows(begin, len, logs_);
    const auto logs = logs_.topRows(len);
    has_reset_ = logs.minCoeff() == minus_inf;  // a vectorised reduction
    if (has_reset_) {
      for (Eigen::Index i = 0; i < len; ++i) {
        for (Eigen::Index f = 0; f < dk_; ++f) {
          const bool reset = logs(i, gates_ == 1 ? 0 : f) == minus_inf;
          reset_[static_cast<std::size_t>(i * dk_ + f)] = reset ? 1 : 0;
        }
      }
    }
    if (gates_ == 1) {
      log_gate_.topRows(len) = logs.col(0).max(kFeatureResetLog).matrix().replicate(1, dk_);
    } else {
      log_gate_.topRows(len) = logs.max(kFeatureResetLog).matrix();
    }
    auto cum = cum_.topRows(len);
    cum.row(0) = log_gate_.row(0);
    for (Eigen::Index i = 1; i < len; ++i) cum.row(i) = cum.row(i - 1) + log_gate_.row(i);
    const auto exp_of = [](auto&& logs, auto&& out) {
      out = logs.template cast<T>();
      out.array() = out.array().exp();
    };
    exp_of(cum, gamma_.topRows(len));
    gamma_prev_.row(0).setOnes();
    if (len > 1) gamma_prev_.middleRows(1, len - 1) = gamma_.topRows(len - 1);
    // G_m - G_t in log_gate_'s rows (read no more), broadcast row by row, then converted: a
    // cast of the difference itself, or a difference with replicate(), runs one element at a
    // time.
    log_gate_.topRows(len) = (-cum).rowwise() + cum.row(len - 1);
    exp_of(log_gate_.topRows(len), to_end_.topRows(len));
    pairs_.decays(cum_, len);
  }

  /// a shifted up one token (a_{t+1}, read against G_t; the last row 0).
  void shift_a(Eigen::Index m) {
    a_next_.topRows(m - 1) = a_.middleRows(1, m - 1);
    a_next_.row(m - 1).setZero();
  }

  /// Ab and Ak of the loaded chunk (strictly lower, zeros above) into rows [begin, begin + m)
  /// of ab_all_ and ak_all_: the pairs of the shifted a rows moved down one row.
  void a_pairs(Eigen::Index begin, Eigen::Index m) {
    shift_a(m);
    for (Matrix<T>* all : {&ab_all_, &ak_all_}) {
      const Matrix<T>& y = all == &ab_all_ ? b_ : k_;
      auto pairs = dab_.topLeftCorner(m, m);  // scratch: the shifted pairs
      pairs_.pairs(a_next_.topRows(m), y.topRows(m), m, pairs);
      auto out = all->block(begin, 0, m, m);
      out.row(0).setZero();
      out.bottomRows(m - 1) = pairs.topRows(m - 1);
    }
  }

  /// The forward over the loaded chunk: U kept, S advanced (not past the last chunk).
  void forward_chunk(Eigen::Index begin, Eigen::Index m);

  /// Reverse mode over the loaded chunk c: its gradients into the chunk's rows, dS moved to
  /// the chunk's start.
  void backward_chunk(Eigen::Index c, Eigen::Index m, bool log_space);

  Eigen::Index n_ = 0, dk_ = 0, chunk_ = 1, gates_ = 1;
  T scale_ = T(1);
  bool has_reset_ = false;  ///< the loaded chunk holds a reset
  FeaturePairs<T> pairs_;
  Matrix<T> checkpoints_;                        ///< (chunks Dk) x Dv: S before each chunk
  Matrix<T> u_all_;                              ///< N x Dv: U of every token
  Matrix<T> ab_all_, ak_all_;                    ///< N x L: each chunk's Ab and Ak
  Matrix<T> state_, ds_;                         ///< Dk x Dv: S; dS
  Matrix<T> q_, k_, a_, b_;                      ///< L x Dk: the chunk's s q, k, a, b
  Matrix<T> a_next_;                             ///< L x Dk: a shifted up one token
  Matrix<T> q_decayed_, a_decayed_;              ///< L x Dk: Q~, A~
  Matrix<T> b_decayed_, k_decayed_;              ///< L x Dk: B~, K~
  Matrix<T> v_, dout_, du_;                      ///< L x Dv: v, dO, dU then dY
  Matrix<T> qb_, qk_;                            ///< L x L: the q-side pairs
  Matrix<T> dab_;                                ///< L x L: scratch (the shifted pairs, I - Ab, dP)
  Matrix<double> log_gate_, cum_;                ///< L x Dk: the chunk's log gates; summed
  LogRows logs_;                                 ///< L x G: the gates' rows as GateRows gives them
  Matrix<T> gamma_, gamma_prev_, to_end_;        ///< L x Dk: exp(G_t), exp(G_{t-1}), exp(G_m - G_t)
  Matrix<T> grad_q_, grad_k_, grad_a_, grad_b_;  ///< L x Dk
  Matrix<T> grad_a_next_;                        ///< L x Dk: the shifted pairs' share of da
  Matrix<T> grad_v_;                             ///< L x Dv
  Matrix<T> dcum_;                               ///< L x Dk: dL / dG_t
  Matrix<T> grad_gate_;                          ///< L x G
  Matrix<T> products_;                           ///< 2L x Dk: [dO; dY] S0^T
  Matrix<T> lhs_;                                ///< 2L x Dv: [dO; dY]
  std::vector<unsigned char> reset_;             ///< L x Dk: the chunk's resets
};

// DplrChunkBackward's members that do not depend on the inputs' types, outside the class so
// that the compiled mode's `extern template` keeps them out of every other translation unit.

template <class T>
void DplrChunkBackward<T>::forward_chunk(Eigen::Index begin, Eigen::Index m) {
  a_pairs(begin, m);
  const auto ab = ab_all_.block(begin, 0, m, m);
  const auto ak = ak_all_.block(begin, 0, m, m);
  auto u = u_all_.middleRows(begin, m);
  auto a_decayed = a_decayed_.topRows(m);
  a_decayed.array() = a_.topRows(m).array() * gamma_prev_.topRows(m).array();
  // U = (I - Ab)^-1 (A~ S + Ak V).
  u.noalias() = a_decayed * state_;
  u.noalias() += ak.template triangularView<Eigen::StrictlyLower>() * v_.topRows(m);
  auto solve = dab_.topLeftCorner(m, m);
  solve = -ab;
  solve.template triangularView<Eigen::UnitLower>().solveInPlace(u);
  if (begin + m == n_) return;  // the state after the last token is not needed
  auto b_decayed = b_decayed_.topRows(m);
  auto k_decayed = k_decayed_.topRows(m);
  b_decayed.array() = b_.topRows(m).array() * to_end_.topRows(m).array();
  k_decayed.array() = k_.topRows(m).array() * to_end_.topRows(m).array();
  state_.array().colwise() *= gamma_.row(m - 1).transpose().array();
  state_.noalias() += b_decayed.transpose() * u;
  state_.noalias() += k_decayed.transpose() * v_.topRows(m);
}

template <class T>
void DplrChunkBackward<T>::backward_chunk(Eigen::Index c, Eigen::Index m, bool log_space) {
  const auto s0 = checkpoints_.middleRows(c * dk_, dk_);
  const auto u = u_all_.middleRows(c * chunk_, m);
  const auto v = v_.topRows(m);
  const auto dout = dout_.topRows(m);
  auto q = q_.topRows(m);
  q *= scale_;
  auto q_decayed = q_decayed_.topRows(m);
  auto a_decayed = a_decayed_.topRows(m);
  auto b_decayed = b_decayed_.topRows(m);
  auto k_decayed = k_decayed_.topRows(m);
  q_decayed.array() = q.array() * gamma_.topRows(m).array();
  a_decayed.array() = a_.topRows(m).array() * gamma_prev_.topRows(m).array();
  b_decayed.array() = b_.topRows(m).array() * to_end_.topRows(m).array();
  k_decayed.array() = k_.topRows(m).array() * to_end_.topRows(m).array();
  shift_a(m);
  auto qb = qb_.topLeftCorner(m, m);
  auto qk = qk_.topLeftCorner(m, m);
  pairs_.pairs(q, b_.topRows(m), m, qb);
  pairs_.pairs(q, k_.topRows(m), m, qk);
  const auto ab = ab_all_.block(c * chunk_, 0, m, m);
  const auto ak = ak_all_.block(c * chunk_, 0, m, m);
  auto du = du_.topRows(m);
  auto dv = grad_v_.topRows(m);
  // dU = Qb^T dO + B~ dS; dY = (I - Ab)^-T dU.
  du.noalias() = qb.template triangularView<Eigen::Lower>().transpose() * dout;
  du.noalias() += b_decayed * ds_;
  auto solve = dab_.topLeftCorner(m, m);
  solve = -ab;
  solve.template triangularView<Eigen::UnitLower>().transpose().solveInPlace(du);
  // dV = Ak^T dY + Qk^T dO + K~ dS.
  dv.noalias() = ak.template triangularView<Eigen::StrictlyLower>().transpose() * du;
  dv.noalias() += qk.template triangularView<Eigen::Lower>().transpose() * dout;
  dv.noalias() += k_decayed * ds_;
  // dB~ = U dS^T, dK~ = V dS^T (with dS after the chunk), then their factors exp(G_m - G_t).
  auto grad_b = grad_b_.topRows(m);
  auto grad_k = grad_k_.topRows(m);
  auto dcum = dcum_.topRows(m);
  grad_b.noalias() = u * ds_.transpose();
  grad_k.noalias() = v * ds_.transpose();
  {
    auto through_end = grad_a_next_.topRows(m);  // scratch
    through_end.array() = b_decayed.array() * grad_b.array() + k_decayed.array() * grad_k.array();
    dcum = -through_end;
    dcum.row(m - 1) += through_end.colwise().sum();
  }
  grad_b.array() *= to_end_.topRows(m).array();
  grad_k.array() *= to_end_.topRows(m).array();
  // exp(G_m) o S0 in S: dG_m += exp(G_m) o rows of S0 o dS.
  dcum.row(m - 1).array() +=
      gamma_.row(m - 1).array() * (s0.array() * ds_.array()).rowwise().sum().transpose();
  // [dQ~; dA~] = [dO; dY] S0^T; then dS0 = diag(exp(G_m)) dS + Q~^T dO + A~^T dY.
  auto lhs = lhs_.topRows(2 * m);
  lhs.topRows(m) = dout;
  lhs.bottomRows(m) = du;
  auto products = products_.topRows(2 * m);
  products.noalias() = lhs * s0.transpose();
  auto grad_q = grad_q_.topRows(m);
  auto grad_a = grad_a_.topRows(m);
  grad_q.array() = products.topRows(m).array() * gamma_.topRows(m).array();
  grad_a.array() = products.bottomRows(m).array() * gamma_prev_.topRows(m).array();
  dcum.array() += q_decayed.array() * products.topRows(m).array();
  // A~_t reads G_{t-1}: its share goes to row t - 1 (G_{-1} = 0 is no gate's).
  if (m > 1) {
    dcum.topRows(m - 1).array() +=
        a_decayed.bottomRows(m - 1).array() * products.bottomRows(m - 1).array();
  }
  ds_.array().colwise() *= gamma_.row(m - 1).transpose().array();
  ds_.noalias() += q_decayed.transpose() * dout;
  ds_.noalias() += a_decayed.transpose() * du;
  // The pairs' gradients: dQb = tril(dO U^T), dQk = tril(dO V^T); dAb = tril(dY U^T, -1) and
  // dAk = tril(dY V^T, -1) as the shifted pairs' (row t - 1 of theirs is row t of these).
  {
    auto dpairs = dab_.topLeftCorner(m, m);
    dpairs.noalias() = dout * u.transpose();
    dpairs.template triangularView<Eigen::StrictlyUpper>().setZero();
    pairs_.gradients(q, b_.topRows(m), dpairs, m, grad_q, grad_b, dcum);
    dpairs.noalias() = dout * v.transpose();
    dpairs.template triangularView<Eigen::StrictlyUpper>().setZero();
    pairs_.gradients(q, k_.topRows(m), dpairs, m, grad_q, grad_k, dcum);
  }
  auto grad_a_next = grad_a_next_.topRows(m);
  grad_a_next.setZero();
  if (m > 1) {
    auto dpairs = dab_.topLeftCorner(m, m);
    const auto dy = du.bottomRows(m - 1);
    for (int side = 0; side < 2; ++side) {
      dpairs.topRows(m - 1).noalias() = dy * (side == 0 ? u : v).transpose();
      dpairs.row(m - 1).setZero();
      dpairs.template triangularView<Eigen::StrictlyUpper>().setZero();
      pairs_.gradients(a_next_.topRows(m), (side == 0 ? b_ : k_).topRows(m), dpairs, m, grad_a_next,
                       side == 0 ? grad_b : grad_k, dcum);
    }
    grad_a.bottomRows(m - 1) += grad_a_next.topRows(m - 1);
  }
  grad_q *= scale_;
  // Per-token log gates from the cumulative ones: dg_t = the sum of dG over t' >= t; a reset
  // has no neighbourhood in log space: its gradient is 0 (FLA's convention).
  for (Eigen::Index i = m - 2; i >= 0; --i) dcum.row(i) += dcum.row(i + 1);
  for (Eigen::Index i = 0; has_reset_ && i < m; ++i) {
    for (Eigen::Index f = 0; f < dk_; ++f) {
      if (reset_[static_cast<std::size_t>(i * dk_ + f)] != 0) dcum(i, f) = T(0);
    }
  }
  auto grad_gate = grad_gate_.topRows(m);
  if (gates_ == 1) {
    grad_gate.col(0) = dcum.rowwise().sum();
  } else {
    grad_gate = dcum;
  }
  if (!log_space) {
    // d / d w_t = (d / d log w_t) / w_t (w_t > 0: gates w_t never reset).
    grad_gate.array() /= logs_.topRows(m).template cast<T>().exp();
  }
}

#ifdef LINATTN_COMPILED
extern template class DplrChunkBackward<float>;
extern template class DplrChunkBackward<double>;
#endif

}  // namespace linattn::detail
