// SPDX-License-Identifier: MIT
// The delta rule's backward in its chunked (WY) form, for DeltaNet and Gated DeltaNet (no gates
// or one gate per token): reverse mode through the pieces DeltaKernel computes, every product
// a GEMM. Per piece of m tokens (a chunk, split at hard resets) with S0 the state before it,
// in-piece cumulative log gates G_i, g_i = exp(G_i), e_i = exp(G_m - G_i), D_ij = exp(G_i - G_j)
// (j <= i) and B = tril(K K^T o D, -1):
//     U = (I + diag(beta) B)^-1 Y,  Y = diag(beta) (V - diag(g) K S0)
//     O = diag(g) Q S0 + P U,  P = tril(Q K^T o D),   S = g_m S0 + (diag(e) K)^T U
// Given dO and dS (the gradient of the state after the piece):
//     dU = diag(e) K dS + P^T dO,  dY = (I + diag(beta) B)^-T dU,  dA = -dY U^T
//     dV = diag(beta) dY,  dbeta = rows of dY o R + rows of dA o B,  R = diag(1/beta) U + B U
//     dS0 = g_m dS + (diag(g) Q)^T dO - (diag(beta g) K)^T dY,  [dQ~; dK~] = [dO; -dY] S0^T
//     dQ = diag(g) dQ~ + (dP o D) K,  dP = tril(dO U^T)
//     dK = diag(e) U dS^T + diag(beta g) dK~ + (dP o D)^T Q + (dB + dB^T) K,
//          dB = tril(diag(beta) dA, -1) o D
// and the cumulative gates' gradient from every factor that holds them (the rows minus the
// columns of dP o P and dB o B, the diagonal factors' own products), summed from the piece's end
// into the per-token log gates. The forward runs once first, keeping S0 at every chunk's start,
// U and B: O(N (Dv + L) + (N / L) Dk Dv) memory. Threads split the value columns (each column
// of S evolves alone): each part repeats the key-side work and the parts' key gradients add.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/delta_rule.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/gates.hpp>
#include <type_traits>
#include <vector>

namespace linattn::detail {

/// grad rows <- factor J_n(x)^T grad, J_n^T y = (y - x^ (x^ . y)) / r, r = sqrt(|x|^2 + eps),
/// x^ = x / r: the backward of l2_normalize (1 / r as it computes it) and the scale, on rows
/// [0, len) of raw (the inputs as given) and grad.
template <class T>
void l2_normalize_backward(const Matrix<T>& raw, Matrix<T>& grad, Eigen::Index len, T factor) {
  for (Eigen::Index r = 0; r < len; ++r) {
    const T inv =
        static_cast<T>(1.0 / std::sqrt(static_cast<double>(raw.row(r).squaredNorm()) + kL2NormEps));
    const T along = inv * raw.row(r).dot(grad.row(r));  // x^ . y
    grad.row(r) = (factor * inv) * (grad.row(r) - (along * inv) * raw.row(r));
  }
}

/// True when the chunked backward runs for these options and gates (0, 1 or Dk per token): the
/// chunked form without per-feature gates; DeltaForm::streamed keeps the recurrent backward.
inline bool chunked_delta_backward(const DeltaOptions& options, Eigen::Index gate_dim) {
  return options.form != DeltaForm::streamed && gate_dim <= 1;
}

/// Value-column parts of the chunked backward on `threads` threads: as the forward splits them.
inline Eigen::Index delta_backward_parts(int threads, Eigen::Index value_dim) {
  return std::max<Eigen::Index>(
      1, std::min<Eigen::Index>(threads, value_dim / kDeltaMinColumnsPerThread));
}

/// One value-column part's buffers of the chunked backward: what it keeps of the forward, one
/// chunk's rows and products, and (with several parts) its share of the key-side gradients.
template <class T>
struct DeltaChunkPart {
  Eigen::Index first = 0, width = 0;  ///< value columns [first, first + width)
  Matrix<T> checkpoints;              ///< (chunks Dk) x W: S before each chunk
  Matrix<T> u_all;                    ///< N x W: U of every token
  Matrix<T> b_all;                    ///< N x L: each chunk's B (strictly lower, zeros above)
  Matrix<T> state, ds;                ///< Dk x W: S; dS
  Matrix<T> q, k, raw_q, raw_k;       ///< L x Dk: the chunk's q^, k^ (and as given, with l2)
  Matrix<T> v, dout;                  ///< L x W
  Matrix<T> beta;                     ///< L x 1
  Matrix<double> log_gate, cum;       ///< L x 1: the chunk's log gates; summed in a piece
  Matrix<T> gamma, to_end, dcum;      ///< L x 1: exp(G_i), exp(G_m - G_i), dL / dG_i
  Matrix<T> decay;                    ///< L x L: D (zeros above the diagonal)
  Matrix<T> pairs, dpairs, kk, dkk;   ///< L x L: P, dP; B then A = diag(beta) B, dA then dB
  Matrix<T> wu;                       ///< L x (Dk + W): [W U] of the forward's solve
  Matrix<T> lhs;                      ///< 2L x Dk: [diag(g) Q; diag(beta g) K]
  Matrix<T> rhs;                      ///< 2L x W: [dO; -dY]
  Matrix<T> s0_products;              ///< 2L x max(Dk, W): [W S0]; [dO; -dY] S0^T
  Matrix<T> du, ratio;                ///< L x W: dU then dY; R
  Matrix<T> kd, dkd;                  ///< L x Dk: diag(e) K; dK_e = U dS^T
  Matrix<T> grad_q, grad_k;           ///< L x Dk
  Matrix<T> grad_v;                   ///< L x W
  Matrix<T> grad_beta, grad_gate;     ///< L x 1
  Matrix<T> sum_q, sum_k;             ///< N x Dk: the part's key gradients, with parts > 1
  Matrix<T> sum_beta, sum_gate;       ///< N x 1
  std::vector<unsigned char> reset;   ///< L: the chunk's tokens that reset the state

  /// visit(buffer, rows, cols) for each Matrix above (buffer of its type, possibly null).
  template <class Part, class Visit>
  static void layout(Part* part, Eigen::Index n, Eigen::Index dk, Eigen::Index w, Eigen::Index l,
                     bool gated, bool l2, bool sums, Visit&& visit) {
    const Eigen::Index chunks = (n + l - 1) / l;
    const Eigen::Index g = gated ? l : 0;
    const Eigen::Index kept_n = sums ? n : 0;
    auto at = [&](auto member) { return part == nullptr ? nullptr : &(part->*member); };
    visit(at(&DeltaChunkPart::checkpoints), chunks * dk, w);
    visit(at(&DeltaChunkPart::u_all), n, w);
    visit(at(&DeltaChunkPart::b_all), n, l);
    for (auto m : {&DeltaChunkPart::state, &DeltaChunkPart::ds}) visit(at(m), dk, w);
    for (auto m : {&DeltaChunkPart::q, &DeltaChunkPart::k, &DeltaChunkPart::kd,
                   &DeltaChunkPart::dkd, &DeltaChunkPart::grad_q, &DeltaChunkPart::grad_k}) {
      visit(at(m), l, dk);
    }
    for (auto m : {&DeltaChunkPart::raw_q, &DeltaChunkPart::raw_k}) visit(at(m), l2 ? l : 0, dk);
    for (auto m : {&DeltaChunkPart::v, &DeltaChunkPart::dout, &DeltaChunkPart::du,
                   &DeltaChunkPart::ratio, &DeltaChunkPart::grad_v}) {
      visit(at(m), l, w);
    }
    for (auto m : {&DeltaChunkPart::beta, &DeltaChunkPart::grad_beta}) visit(at(m), l, 1);
    for (auto m : {&DeltaChunkPart::gamma, &DeltaChunkPart::to_end, &DeltaChunkPart::dcum,
                   &DeltaChunkPart::grad_gate}) {
      visit(at(m), g, 1);
    }
    for (auto m : {&DeltaChunkPart::log_gate, &DeltaChunkPart::cum}) visit(at(m), g, 1);
    for (auto m : {&DeltaChunkPart::decay, &DeltaChunkPart::pairs, &DeltaChunkPart::dpairs,
                   &DeltaChunkPart::kk, &DeltaChunkPart::dkk}) {
      visit(at(m), l, l);
    }
    visit(at(&DeltaChunkPart::wu), l, dk + w);
    visit(at(&DeltaChunkPart::lhs), 2 * l, dk);
    visit(at(&DeltaChunkPart::rhs), 2 * l, w);
    visit(at(&DeltaChunkPart::s0_products), 2 * l, std::max(dk, w));
    for (auto m : {&DeltaChunkPart::sum_q, &DeltaChunkPart::sum_k}) visit(at(m), kept_n, dk);
    visit(at(&DeltaChunkPart::sum_beta), kept_n, 1);
    visit(at(&DeltaChunkPart::sum_gate), gated ? kept_n : 0, 1);
  }
};

/// The chunked backward of one sequence on validated inputs, in T (see the header's comment).
/// Workspace, allocated by reshape: per part, the chunks' starting states, N rows of U and of
/// B, one chunk's rows and products; with several parts, their key gradients (N rows each).
template <class T>
class DeltaChunkBackward {
 public:
  /// Sizes the buffers for a call of N = rows tokens (gate_dim 0 or 1) on `threads` threads;
  /// buffers of the same size as the last call's are kept.
  void reshape(Eigen::Index rows, Eigen::Index key_dim, Eigen::Index value_dim,
               Eigen::Index gate_dim, const DeltaOptions& options, int threads) {
    n_ = rows;
    dk_ = key_dim;
    dv_ = value_dim;
    gated_ = gate_dim > 0;
    chunk_ = std::max<Eigen::Index>(1, std::min(options.chunk, rows));
    scale_ = static_cast<T>(delta_scale(options, key_dim));
    l2_normalize_ = options.l2_normalize;
    const Eigen::Index parts = delta_backward_parts(threads, value_dim);
    parts_.resize(static_cast<std::size_t>(parts));
    for (Eigen::Index p = 0; p < parts; ++p) {
      DeltaChunkPart<T>& part = parts_[static_cast<std::size_t>(p)];
      part.first = value_dim * p / parts;
      part.width = value_dim * (p + 1) / parts - part.first;
      DeltaChunkPart<T>::layout(&part, rows, key_dim, part.width, chunk_, gated_, l2_normalize_,
                                parts > 1, [](auto* m, Eigen::Index r, Eigen::Index c) {
                                  if (m->rows() != r || m->cols() != c) m->resize(r, c);
                                });
      part.reset.assign(static_cast<std::size_t>(chunk_), 0);
    }
  }

  /// Frees every buffer (another form of the backward runs).
  void release() { parts_.clear(); }

  /// Bytes the buffers hold now.
  std::size_t held_bytes() const {
    std::size_t total = 0;
    for (const DeltaChunkPart<T>& part : parts_) {
      DeltaChunkPart<T>::layout(&part, n_, dk_, part.width, chunk_, gated_, l2_normalize_,
                                parts_.size() > 1, [&](const auto* m, Eigen::Index, Eigen::Index) {
                                  total += static_cast<std::size_t>(m->size()) *
                                           sizeof(typename std::decay_t<decltype(*m)>::Scalar);
                                });
    }
    return total;
  }

  /// Bytes reshape(rows, key_dim, value_dim, gate_dim, options, threads) holds.
  static std::size_t bytes(Eigen::Index rows, Eigen::Index key_dim, Eigen::Index value_dim,
                           Eigen::Index gate_dim, const DeltaOptions& options, int threads) {
    const Eigen::Index chunk = std::max<Eigen::Index>(1, std::min(options.chunk, rows));
    const Eigen::Index parts = delta_backward_parts(threads, value_dim);
    std::size_t total = 0;
    for (Eigen::Index p = 0; p < parts; ++p) {
      const Eigen::Index width = value_dim * (p + 1) / parts - value_dim * p / parts;
      DeltaChunkPart<T>::layout(
          static_cast<const DeltaChunkPart<T>*>(nullptr), rows, key_dim, width, chunk, gate_dim > 0,
          options.l2_normalize, parts > 1, [&](const auto* m, Eigen::Index r, Eigen::Index c) {
            using Buffer = std::decay_t<decltype(*m)>;
            total += static_cast<std::size_t>(r * c) * sizeof(typename Buffer::Scalar);
          });
    }
    return total;
  }

  /// The whole backward: q, k, v, beta, the gates (null for DeltaNet) as log rows, grad_out;
  /// gradients into the caller's rows (grad_gates d / d log a_t when LogSpace, else d / d a_t
  /// with gate_values the caller's a_t).
  template <bool LogSpace, class DQ, class DK, class DV, class DB, class DO, class S>
  void run(const DQ& q, const DK& k, const DV& v, const DB& beta, const GateRows* gate_rows,
           const DO& grad_out, Eigen::Ref<Matrix<S>> grad_q, Eigen::Ref<Matrix<S>> grad_k,
           Eigen::Ref<Matrix<S>> grad_v, Eigen::Ref<Matrix<S>>* grad_gates,
           Eigen::Ref<Vector<S>> grad_beta) {
    const SerialEigenScope serial;
    const Eigen::Index parts = static_cast<Eigen::Index>(parts_.size());
    const Eigen::Index chunks = (n_ + chunk_ - 1) / chunk_;
    parallel_for(parts, static_cast<int>(parts), [&](Eigen::Index index) {
      DeltaChunkPart<T>& part = parts_[static_cast<std::size_t>(index)];
      const auto vs = v.middleCols(part.first, part.width);
      const auto gs = grad_out.middleCols(part.first, part.width);
      part.state.setZero();
      for (Eigen::Index c = 0; c < chunks; ++c) {
        const Eigen::Index begin = c * chunk_, len = std::min(chunk_, n_ - begin);
        part.checkpoints.middleRows(c * dk_, dk_) = part.state;
        load_rows(k.middleRows(begin, len), part.k);
        load_rows(vs.middleRows(begin, len), part.v);
        load_common(part, beta, gate_rows, begin, len);
        forward_chunk(part, begin, len);
      }
      part.ds.setZero();
      for (Eigen::Index c = chunks - 1; c >= 0; --c) {
        const Eigen::Index begin = c * chunk_, len = std::min(chunk_, n_ - begin);
        load_rows(q.middleRows(begin, len), part.q);
        load_rows(k.middleRows(begin, len), part.k);
        load_rows(gs.middleRows(begin, len), part.dout);
        load_common(part, beta, gate_rows, begin, len);
        backward_chunk(part, c, len, LogSpace);
        auto dv = grad_v.block(begin, part.first, len, part.width);
        store_rows<S>(part.grad_v, len, dv);
        if (parts == 1) {
          auto dq = grad_q.middleRows(begin, len);
          auto dk = grad_k.middleRows(begin, len);
          store_rows<S>(part.grad_q, len, dq);
          store_rows<S>(part.grad_k, len, dk);
          grad_beta.segment(begin, len) = part.grad_beta.col(0).head(len).template cast<S>();
          if (gated_) {
            grad_gates->middleRows(begin, len) = part.grad_gate.topRows(len).template cast<S>();
          }
        } else {
          part.sum_q.middleRows(begin, len) = part.grad_q.topRows(len);
          part.sum_k.middleRows(begin, len) = part.grad_k.topRows(len);
          part.sum_beta.middleRows(begin, len) = part.grad_beta.topRows(len);
          if (gated_) part.sum_gate.middleRows(begin, len) = part.grad_gate.topRows(len);
        }
      }
    });
    if (parts == 1) return;
    DeltaChunkPart<T>& total = parts_[0];
    for (std::size_t p = 1; p < parts_.size(); ++p) {
      total.sum_q += parts_[p].sum_q;
      total.sum_k += parts_[p].sum_k;
      total.sum_beta += parts_[p].sum_beta;
      if (gated_) total.sum_gate += parts_[p].sum_gate;
    }
    store_rows<S>(total.sum_q, n_, grad_q);
    store_rows<S>(total.sum_k, n_, grad_k);
    grad_beta = total.sum_beta.col(0).template cast<S>();
    if (gated_) *grad_gates = total.sum_gate.template cast<S>();
  }

 private:
  /// beta, the log gates (their resets marked and set to 0) and, with l2_normalize, the raw
  /// rows kept and q^, k^ normalised; q^ scaled. Rows [0, len) of the part's buffers.
  template <class DB>
  void load_common(DeltaChunkPart<T>& part, const DB& beta, const GateRows* gate_rows,
                   Eigen::Index begin, Eigen::Index len) const {
    for (Eigen::Index i = 0; i < len; ++i) {
      part.beta(i, 0) = static_cast<T>(beta.reshaped()(begin + i));
    }
    if (gated_) {
      LogRows logs(len, 1);
      gate_rows->log_rows(begin, len, logs);
      part.log_gate.topRows(len) = logs.matrix();
    }
    prepare_rows(part, len);
  }

  /// The loaded chunk's resets marked (and their log gates set to 0), q^ and k^ made.
  void prepare_rows(DeltaChunkPart<T>& part, Eigen::Index len) const;

  /// The forward over the loaded chunk (k^, v, beta, gates): U and B kept, S advanced.
  void forward_chunk(DeltaChunkPart<T>& part, Eigen::Index begin, Eigen::Index len);

  /// Reverse mode over the loaded chunk c (q^, k^, dO, beta, gates): its gradients into the
  /// part's rows, dS moved to the chunk's start.
  void backward_chunk(DeltaChunkPart<T>& part, Eigen::Index c, Eigen::Index len, bool log_space);

  /// One piece [p, p + m) of the chunk at `begin`: its decays from the loaded log gates.
  void piece_decays(DeltaChunkPart<T>& part, Eigen::Index p, Eigen::Index m) const;

  /// Reverse mode over piece [p, p + m) of chunk c.
  void backward_piece(DeltaChunkPart<T>& part, Eigen::Index c, Eigen::Index p, Eigen::Index m,
                      bool log_space);

  /// The end of the piece that starts at p (the next reset, or len).
  static Eigen::Index piece_end(const DeltaChunkPart<T>& part, Eigen::Index p, Eigen::Index len) {
    Eigen::Index end = p + 1;
    while (end < len && part.reset[static_cast<std::size_t>(end)] == 0) ++end;
    return end;
  }

  Eigen::Index n_ = 0, dk_ = 0, dv_ = 0, chunk_ = 1;
  bool gated_ = false;
  T scale_ = T(1);
  bool l2_normalize_ = false;
  std::vector<DeltaChunkPart<T>> parts_;
};

// DeltaChunkBackward's members that do not depend on the inputs' types, outside the class so
// that the compiled mode's `extern template` keeps them out of every other translation unit.

template <class T>
void DeltaChunkBackward<T>::prepare_rows(DeltaChunkPart<T>& part, Eigen::Index len) const {
  constexpr double minus_inf = -std::numeric_limits<double>::infinity();
  for (Eigen::Index i = 0; i < len; ++i) {
    const bool reset = gated_ && part.log_gate(i, 0) == minus_inf;
    part.reset[static_cast<std::size_t>(i)] = reset ? 1 : 0;
    if (reset) part.log_gate(i, 0) = 0.0;
  }
  if (l2_normalize_) {
    part.raw_q.topRows(len) = part.q.topRows(len);
    part.raw_k.topRows(len) = part.k.topRows(len);
    l2_normalize_rows(part.q, len);
    l2_normalize_rows(part.k, len);
  }
  part.q.topRows(len) *= scale_;
}

template <class T>
void DeltaChunkBackward<T>::piece_decays(DeltaChunkPart<T>& part, Eigen::Index p,
                                         Eigen::Index m) const {
  auto decay = part.decay.topLeftCorner(m, m);
  if (!gated_) {
    decay.setZero();
    decay.template triangularView<Eigen::Lower>().setOnes();
    return;
  }
  double sum = 0.0;
  for (Eigen::Index i = 0; i < m; ++i) part.cum(i, 0) = sum += part.log_gate(p + i, 0);
  const auto cum = part.cum.col(0).head(m);
  for (Eigen::Index i = 0; i < m; ++i) {
    // exp(G_i - G_j) for j <= i, all <= 1.
    decay.row(i).head(i + 1) =
        (cum(i) - cum.head(i + 1).transpose().array()).template cast<T>().exp().matrix();
    decay.row(i).tail(m - i - 1).setZero();
    part.gamma(i, 0) = exp_as<T>(cum(i));
    part.to_end(i, 0) = exp_as<T>(cum(m - 1) - cum(i));
  }
}

template <class T>
void DeltaChunkBackward<T>::forward_chunk(DeltaChunkPart<T>& part, Eigen::Index begin,
                                          Eigen::Index len) {
  const Eigen::Index w = part.width;
  for (Eigen::Index p = 0; p < len;) {
    const Eigen::Index m = piece_end(part, p, len) - p;
    if (part.reset[static_cast<std::size_t>(p)] != 0) part.state.setZero();
    piece_decays(part, p, m);
    const auto k = part.k.middleRows(p, m);
    const auto beta = part.beta.col(0).segment(p, m).array();
    auto kk = part.kk.topLeftCorner(m, m);
    kk.noalias() = k * k.transpose();
    kk.array() *= part.decay.topLeftCorner(m, m).array();
    kk.template triangularView<Eigen::Upper>().setZero();  // B: strictly lower
    part.b_all.block(begin + p, p, m, m) = kk;
    auto wk = part.wu.block(0, 0, m, dk_);
    auto u = part.wu.block(0, dk_, m, w);
    wk = k;
    if (gated_) wk.array().colwise() *= part.gamma.col(0).head(m).array();
    wk.array().colwise() *= beta;
    u = part.v.middleRows(p, m);
    u.array().colwise() *= beta;
    kk.array().colwise() *= beta;
    kk.template triangularView<Eigen::UnitLower>().solveInPlace(part.wu.topRows(m));
    auto ws = part.s0_products.block(0, 0, m, w);
    ws.noalias() = wk * part.state;
    u -= ws;
    part.u_all.middleRows(begin + p, m) = u;
    if (begin + p + m == n_) break;  // the state after the last token is not needed
    auto kd = part.kd.topRows(m);
    kd = k;
    if (gated_) {
      kd.array().colwise() *= part.to_end.col(0).head(m).array();
      part.state *= part.gamma(m - 1, 0);
    }
    part.state.noalias() += kd.transpose() * u;
    p += m;
  }
}

template <class T>
void DeltaChunkBackward<T>::backward_chunk(DeltaChunkPart<T>& part, Eigen::Index c,
                                           Eigen::Index len, bool log_space) {
  part.grad_q.topRows(len).setZero();
  part.grad_k.topRows(len).setZero();
  // The pieces from the last: each starts at a reset or at the chunk's start.
  for (Eigen::Index end = len; end > 0;) {
    Eigen::Index p = end - 1;
    while (p > 0 && part.reset[static_cast<std::size_t>(p)] == 0) --p;
    backward_piece(part, c, p, end - p, log_space);
    end = p;
  }
  if (!l2_normalize_) {
    part.grad_q.topRows(len) *= scale_;
    return;
  }
  l2_normalize_backward(part.raw_q, part.grad_q, len, scale_);
  l2_normalize_backward(part.raw_k, part.grad_k, len, T(1));
}

template <class T>
void DeltaChunkBackward<T>::backward_piece(DeltaChunkPart<T>& part, Eigen::Index c, Eigen::Index p,
                                           Eigen::Index m, bool log_space) {
  const Eigen::Index begin = c * chunk_;
  const bool reset = part.reset[static_cast<std::size_t>(p)] != 0;
  // S0: the chunk's checkpoint for its first piece, zero after a reset or before the sequence.
  const bool has_state = p == 0 && !reset && c > 0;
  const auto s0 = part.checkpoints.middleRows(c * dk_, dk_);
  piece_decays(part, p, m);
  const auto q = part.q.middleRows(p, m);
  const auto k = part.k.middleRows(p, m);
  const auto dout = part.dout.middleRows(p, m);
  const auto u = part.u_all.middleRows(begin + p, m);
  const auto b = part.b_all.block(begin + p, p, m, m);
  const auto decay = part.decay.topLeftCorner(m, m);
  const auto beta = part.beta.col(0).segment(p, m).array();
  auto pairs = part.pairs.topLeftCorner(m, m);
  auto dpairs = part.dpairs.topLeftCorner(m, m);
  auto kk = part.kk.topLeftCorner(m, m);
  auto dkk = part.dkk.topLeftCorner(m, m);
  auto du = part.du.topRows(m);
  auto ratio = part.ratio.topRows(m);
  auto kd = part.kd.topRows(m);
  auto dkd = part.dkd.topRows(m);
  auto grad_q = part.grad_q.middleRows(p, m);
  auto grad_k = part.grad_k.middleRows(p, m);
  const T last = gated_ ? part.gamma(m - 1, 0) : T(1);
  // The forward's pieces: P = tril(Q K^T o D), K_e = diag(e) K.
  pairs.noalias() = q * k.transpose();
  pairs.array() *= decay.array();
  kd = k;
  if (gated_) kd.array().colwise() *= part.to_end.col(0).head(m).array();
  // dU = K_e dS + P^T dO; dK_e = U dS^T; dP = dO U^T.
  du.noalias() = kd * part.ds;
  du.noalias() += pairs.template triangularView<Eigen::Lower>().transpose() * dout;
  dkd.noalias() = u * part.ds.transpose();
  dpairs.noalias() = dout * u.transpose();
  // The cumulative gates' gradient from the pairs: rows minus columns of dP o P (here) and
  // of dB o B (below, B decayed already); the diagonal factors' shares follow.
  auto dcum = part.dcum.col(0).head(gated_ ? m : 0);  // empty without gates
  if (gated_) {
    const auto z = dpairs.array() * pairs.array();
    dcum = z.rowwise().sum().matrix() - z.colwise().sum().transpose().matrix();
  }
  dpairs.array() *= decay.array();  // dP o D, zero above the diagonal
  // dY = (I + A)^-T dU, A = diag(beta) B; dA = -dY U^T, kept strictly lower.
  kk = b;
  kk.array().colwise() *= beta;
  kk.template triangularView<Eigen::UnitLower>().transpose().solveInPlace(du);
  dkk.noalias() = -du * u.transpose();
  dkk.template triangularView<Eigen::Upper>().setZero();
  // R = V - diag(g) K S0 = diag(1 / beta) U + B U; dbeta = dY . R + (dA o B) summed by rows.
  ratio = u;
  ratio.array().colwise() /= beta;
  ratio.noalias() += b.template triangularView<Eigen::StrictlyLower>() * u;
  auto grad_beta = part.grad_beta.col(0).segment(p, m);
  grad_beta = (du.array() * ratio.array()).rowwise().sum().matrix() +
              (dkk.array() * b.array()).rowwise().sum().matrix();
  auto grad_v = part.grad_v.middleRows(p, m);
  grad_v = du;
  grad_v.array().colwise() *= beta;
  dkk.array().colwise() *= beta;  // dB
  if (gated_) {
    const auto z = dkk.array() * b.array();
    dcum += z.rowwise().sum().matrix() - z.colwise().sum().transpose().matrix();
    // e_s = exp(G_m - G_s): dG_s -= e_s k_s . dK_e_s, dG_m += the sum.
    const Eigen::Array<T, Eigen::Dynamic, 1> through_end =
        (kd.array() * dkd.array()).rowwise().sum();
    dcum -= through_end.matrix();
    dcum(m - 1) += through_end.sum();
  }
  dkk.array() *= decay.array();  // the keys' pair gradient, strictly lower
  // S0's terms: [diag(g) Q; diag(beta g) K] and [dO; -dY]. A piece after a reset starts
  // from zero and passes no gradient back; the sequence's first needs none.
  if (has_state) {
    auto lhs = part.lhs.topRows(2 * m);
    auto rhs = part.rhs.topRows(2 * m);
    lhs.topRows(m) = q;
    lhs.bottomRows(m) = k;
    lhs.bottomRows(m).array().colwise() *= beta;
    if (gated_) {
      lhs.topRows(m).array().colwise() *= part.gamma.col(0).head(m).array();
      lhs.bottomRows(m).array().colwise() *= part.gamma.col(0).head(m).array();
    }
    rhs.topRows(m) = dout;
    rhs.bottomRows(m) = -du;
    auto products = part.s0_products.block(0, 0, 2 * m, dk_);
    products.noalias() = rhs * s0.transpose();
    // dQ += diag(g) dQ~, dK += diag(beta g) dK~; the gates' share: their rows' dot products.
    if (gated_) {
      dcum.array() += (lhs.array() * products.array()).rowwise().sum().topRows(m) +
                      (lhs.array() * products.array()).rowwise().sum().bottomRows(m);
      dcum(m - 1) += last * (s0.array() * part.ds.array()).sum();
    }
    auto to_query = products.topRows(m);
    auto to_key = products.bottomRows(m);
    to_key.array().colwise() *= beta;
    if (gated_) {
      to_query.array().colwise() *= part.gamma.col(0).head(m).array();
      to_key.array().colwise() *= part.gamma.col(0).head(m).array();
    }
    grad_q += to_query;
    grad_k += to_key;
    part.ds *= last;
    part.ds.noalias() += lhs.transpose() * rhs;
  } else {
    part.ds.setZero();
  }
  // The pairs' gradients: dQ += (dP o D) K, dK += (dP o D)^T Q + (dB + dB^T) K, diag(e) dK_e.
  grad_q.noalias() += dpairs.template triangularView<Eigen::Lower>() * k;
  grad_k.noalias() += dpairs.template triangularView<Eigen::Lower>().transpose() * q;
  pairs = dkk.transpose();  // P is read no more
  dkk += pairs;             // dB + dB^T: both keys of a pair in one product
  grad_k.noalias() += dkk * k;
  if (gated_) dkd.array().colwise() *= part.to_end.col(0).head(m).array();
  grad_k += dkd;
  if (!gated_) return;
  // Per-token log gates from the cumulative ones: dg_i = sum of dG_j over j >= i.
  auto grad_gate = part.grad_gate.col(0).segment(p, m);
  T sum = T(0);
  for (Eigen::Index i = m - 1; i >= 0; --i) grad_gate(i) = sum += dcum(i);
  if (reset) grad_gate(0) = T(0);  // no neighbourhood in log space: FLA's and ours, 0
  if (log_space) return;
  // d / d a_t = (d / d log a_t) / a_t (a_t > 0: gates a_t never reset).
  for (Eigen::Index i = 0; i < m; ++i) grad_gate(i) /= exp_as<T>(part.log_gate(p + i, 0));
}

}  // namespace linattn::detail
