// SPDX-License-Identifier: MIT
// The delta rule's backward in its chunked (WY) form (DeltaNet, Gated DeltaNet, KDA): reverse
// mode through the pieces DeltaKernel computes, every product a GEMM. Per piece of m tokens (a
// chunk; scalar gates split it at hard resets) with S0 the state before it, in-piece
// cumulative log gates G_i (one, or one per key feature), g_i = exp(G_i), e_i = exp(G_m - G_i),
// the decayed pairs x_i . k_j = sum_f x_if k_jf exp(G_if - G_jf), P = tril(Q . K) and
// B = tril(K . K, -1):
//     U = (I + diag(beta) B)^-1 Y,  Y = diag(beta) (V - (g o K) S0)
//     O = (g o Q) S0 + P U,   S = diag(g_m) S0 + (e o K)^T U
// Given dO and dS (the gradient of the state after the piece):
//     dU = (e o K) dS + P^T dO,  dY = (I + diag(beta) B)^-T dU,  dA = -dY U^T
//     dV = diag(beta) dY,  dbeta = rows of dY o R + rows of dA o B,  R = diag(1/beta) U + B U
//     dS0 = diag(g_m) dS + (g o Q)^T dO - (beta g o K)^T dY,  [dQ~; dK~] = [dO; -dY] S0^T
//     dQ = g o dQ~ + (the pairs' share of dP = tril(dO U^T)),
//     dK = e o (U dS^T) + beta g o dK~ + (the pairs' shares of dP and dB = beta dA)
// and each cumulative gate's gradient from the factors that hold it: for a pair's decay,
// x o (its share of dx) at the row minus k o (its share of dk) at the column (summed over the
// features for scalar gates); for a diagonal factor, the factor times its gradient. They are
// summed from the piece's end into the per-token log gates. Per-feature pairs go by sub-blocks
// as the forward's (kDeltaSubBlock tokens, factors referred to the token before), and KDA's
// partial resets run inside the chunk as a log gate of kFeatureResetLog, whose exp is 0 (to a
// denormal).
// The forward runs once first, keeping S0 at every chunk's start, U and B: O(N (Dv + L) +
// (N / L) Dk Dv) memory. Threads split the value columns (each column of S evolves alone):
// each part repeats the key-side work and the parts' key gradients add.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/delta_rule.hpp>
#include <linattn/detail/feature_pairs.hpp>
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

/// True when the chunked backward runs for these options: all but DeltaForm::streamed, which
/// keeps the recurrent backward (the reference the chunked one is tested against).
inline bool chunked_delta_backward(const DeltaOptions& options) {
  return options.form != DeltaForm::streamed;
}

/// Value-column parts of the chunked backward on `threads` threads: as the forward splits them.
inline Eigen::Index delta_backward_parts(int threads, Eigen::Index value_dim) {
  return std::max<Eigen::Index>(
      1, std::min<Eigen::Index>(threads, value_dim / kDeltaMinColumnsPerThread));
}

/// KDA's partial reset inside a chunk, and the floor of every log gate: a log gate whose exp
/// is 0 in float and double (Eigen's vectorised exp gives their smallest denormals, within
/// rounding of 0), small enough that sums of a chunk's gates keep 1e-11 of absolute precision.
inline constexpr double kFeatureResetLog = -1000.0;

/// One value-column part's buffers of the chunked backward: what it keeps of the forward, one
/// chunk's rows and products, and (with several parts) its share of the key-side gradients.
/// G is the gates' width (0, 1, or Dk per key feature).
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
  Matrix<double> log_gate, cum;       ///< L x G: the chunk's log gates; summed in a piece
  LogRows logs;                       ///< L x G: the gates' rows as GateRows gives them
  Matrix<T> gamma, to_end, dcum;      ///< L x G: exp(G_i), exp(G_m - G_i), dL / dG_i
  Matrix<T> decay;                    ///< L x L: D, scalar gates (zeros above the diagonal)
  Matrix<T> pairs, dpairs, kk, dkk;   ///< L x L: P, dP; B then A = diag(beta) B, dA then dB
  Matrix<T> wu;                       ///< L x (Dk + W): [W U] of the forward's solve
  Matrix<T> lhs;                      ///< 2L x Dk: [g o Q; beta g o K]
  Matrix<T> rhs;                      ///< 2L x W: [dO; -dY]
  Matrix<T> s0_products;              ///< 2L x max(Dk, W): [W S0]; [dO; -dY] S0^T
  Matrix<T> du, ratio;                ///< L x W: dU then dY; R
  Matrix<T> kd, dkd;                  ///< L x Dk: e o K; dK_e = U dS^T
  FeaturePairs<T> feature_pairs;      ///< per feature: the decayed pairs by sub-blocks
  Matrix<T> block_grad;               ///< L x Dk, per feature: dK_e o K_e
  Matrix<T> grad_q, grad_k;           ///< L x Dk
  Matrix<T> grad_v;                   ///< L x W
  Matrix<T> grad_beta;                ///< L x 1
  Matrix<T> grad_gate;                ///< L x G
  Matrix<T> sum_q, sum_k;             ///< N x Dk: the part's key gradients, with parts > 1
  Matrix<T> sum_beta, sum_gate;       ///< N x 1, N x G
  std::vector<unsigned char> reset;   ///< L x max(G, 1): the chunk's resets (token, feature)

  /// visit(buffer, rows, cols) for each Matrix above (buffer of its type, possibly null).
  template <class Part, class Visit>
  static void layout(Part* part, Eigen::Index n, Eigen::Index dk, Eigen::Index w, Eigen::Index l,
                     Eigen::Index gates, bool l2, bool sums, Visit&& visit) {
    const Eigen::Index chunks = (n + l - 1) / l;
    const Eigen::Index kept_n = sums ? n : 0;
    const Eigen::Index per_feature = gates > 1 ? 1 : 0;
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
      visit(at(m), l, gates);
    }
    for (auto m : {&DeltaChunkPart::log_gate, &DeltaChunkPart::cum}) visit(at(m), l, gates);
    visit(at(&DeltaChunkPart::logs), l, gates);
    visit(at(&DeltaChunkPart::decay), per_feature ? 0 : l, per_feature ? 0 : l);
    for (auto m : {&DeltaChunkPart::pairs, &DeltaChunkPart::dpairs, &DeltaChunkPart::kk,
                   &DeltaChunkPart::dkk}) {
      visit(at(m), l, l);
    }
    visit(at(&DeltaChunkPart::wu), l, dk + w);
    visit(at(&DeltaChunkPart::lhs), 2 * l, dk);
    visit(at(&DeltaChunkPart::rhs), 2 * l, w);
    visit(at(&DeltaChunkPart::s0_products), 2 * l, std::max(dk, w));
    visit(at(&DeltaChunkPart::block_grad), per_feature * l, dk);
    for (auto m : {&DeltaChunkPart::sum_q, &DeltaChunkPart::sum_k}) visit(at(m), kept_n, dk);
    visit(at(&DeltaChunkPart::sum_beta), kept_n, 1);
    visit(at(&DeltaChunkPart::sum_gate), kept_n, gates);
  }
};

/// The chunked backward of one sequence on validated inputs, in T (see the header's comment).
/// Workspace, allocated by reshape: per part, the chunks' starting states, N rows of U and of
/// B, one chunk's rows and products; with several parts, their key gradients (N rows each).
template <class T>
class DeltaChunkBackward {
 public:
  /// Sizes the buffers for a call of N = rows tokens (gate_dim 0, 1 or Dk) on `threads`
  /// threads; buffers of the same size as the last call's are kept.
  void reshape(Eigen::Index rows, Eigen::Index key_dim, Eigen::Index value_dim,
               Eigen::Index gate_dim, const DeltaOptions& options, int threads) {
    n_ = rows;
    dk_ = key_dim;
    gates_ = gate_dim;
    chunk_ = std::max<Eigen::Index>(1, std::min(options.chunk, rows));
    scale_ = static_cast<T>(delta_scale(options, key_dim));
    l2_normalize_ = options.l2_normalize;
    const Eigen::Index parts = delta_backward_parts(threads, value_dim);
    parts_.resize(static_cast<std::size_t>(parts));
    for (Eigen::Index p = 0; p < parts; ++p) {
      DeltaChunkPart<T>& part = parts_[static_cast<std::size_t>(p)];
      part.first = value_dim * p / parts;
      part.width = value_dim * (p + 1) / parts - part.first;
      DeltaChunkPart<T>::layout(&part, rows, key_dim, part.width, chunk_, gates_, l2_normalize_,
                                parts > 1, [](auto* m, Eigen::Index r, Eigen::Index c) {
                                  if (m->rows() != r || m->cols() != c) m->resize(r, c);
                                });
      part.reset.assign(static_cast<std::size_t>(chunk_ * std::max<Eigen::Index>(gates_, 1)), 0);
      if (gates_ > 1) part.feature_pairs.reshape(chunk_, key_dim);
    }
  }

  /// Frees every buffer (another form of the backward runs).
  void release() { parts_.clear(); }

  /// Bytes the buffers hold now.
  std::size_t held_bytes() const {
    std::size_t total = 0;
    for (const DeltaChunkPart<T>& part : parts_) {
      DeltaChunkPart<T>::layout(&part, n_, dk_, part.width, chunk_, gates_, l2_normalize_,
                                parts_.size() > 1, [&](const auto* m, Eigen::Index, Eigen::Index) {
                                  total += static_cast<std::size_t>(m->size()) *
                                           sizeof(typename std::decay_t<decltype(*m)>::Scalar);
                                });
      total += part.reset.size();
      if (gates_ > 1) total += FeaturePairs<T>::bytes(chunk_, dk_);
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
          static_cast<const DeltaChunkPart<T>*>(nullptr), rows, key_dim, width, chunk, gate_dim,
          options.l2_normalize, parts > 1, [&](const auto* m, Eigen::Index r, Eigen::Index c) {
            using Buffer = std::decay_t<decltype(*m)>;
            total += static_cast<std::size_t>(r * c) * sizeof(typename Buffer::Scalar);
          });
      total += static_cast<std::size_t>(chunk * std::max<Eigen::Index>(gate_dim, 1));
      if (gate_dim > 1) total += FeaturePairs<T>::bytes(chunk, key_dim);
    }
    return total;
  }

  /// The whole backward: q, k, v, beta, the gates (null for DeltaNet) as log rows, grad_out;
  /// gradients into the caller's rows (grad_gates d / d log a_t when LogSpace, else d / d a_t).
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
          if (gates_ > 0) {
            grad_gates->middleRows(begin, len) = part.grad_gate.topRows(len).template cast<S>();
          }
        } else {
          part.sum_q.middleRows(begin, len) = part.grad_q.topRows(len);
          part.sum_k.middleRows(begin, len) = part.grad_k.topRows(len);
          part.sum_beta.middleRows(begin, len) = part.grad_beta.topRows(len);
          if (gates_ > 0) part.sum_gate.middleRows(begin, len) = part.grad_gate.topRows(len);
        }
      }
    });
    if (parts == 1) return;
    // The parts' key gradients added, the rows split across the threads.
    parallel_for(parts, static_cast<int>(parts), [&](Eigen::Index index) {
      const Eigen::Index first = n_ * index / parts, rows = n_ * (index + 1) / parts - first;
      DeltaChunkPart<T>& total = parts_[0];
      for (std::size_t p = 1; p < parts_.size(); ++p) {
        const DeltaChunkPart<T>& part = parts_[p];
        total.sum_q.middleRows(first, rows) += part.sum_q.middleRows(first, rows);
        total.sum_k.middleRows(first, rows) += part.sum_k.middleRows(first, rows);
        total.sum_beta.middleRows(first, rows) += part.sum_beta.middleRows(first, rows);
        if (gates_ > 0) {
          total.sum_gate.middleRows(first, rows) += part.sum_gate.middleRows(first, rows);
        }
      }
      grad_q.middleRows(first, rows) = total.sum_q.middleRows(first, rows).template cast<S>();
      grad_k.middleRows(first, rows) = total.sum_k.middleRows(first, rows).template cast<S>();
      grad_beta.segment(first, rows) =
          total.sum_beta.col(0).segment(first, rows).template cast<S>();
      if (gates_ > 0) {
        grad_gates->middleRows(first, rows) =
            total.sum_gate.middleRows(first, rows).template cast<S>();
      }
    });
  }

 private:
  using RowsRef = Eigen::Ref<const Matrix<T>>;
  using PairsRef = Eigen::Ref<Matrix<T>>;

  /// beta, the log gates and the rows prepare_rows makes. Rows [0, len) of the part's buffers.
  template <class DB>
  void load_common(DeltaChunkPart<T>& part, const DB& beta, const GateRows* gate_rows,
                   Eigen::Index begin, Eigen::Index len) const {
    for (Eigen::Index i = 0; i < len; ++i) {
      part.beta(i, 0) = static_cast<T>(beta.reshaped()(begin + i));
    }
    if (gates_ > 0) {
      gate_rows->log_rows(begin, len, part.logs);
      part.log_gate.topRows(len) = part.logs.topRows(len).matrix();
    }
    prepare_rows(part, len);
  }

  /// The loaded chunk's resets marked (scalar gates: set to 0, the piece restarts there; per
  /// feature: set to kFeatureResetLog), q^ and k^ made.
  void prepare_rows(DeltaChunkPart<T>& part, Eigen::Index len) const;

  /// The forward over the loaded chunk (k^, v, beta, gates): U and B kept, S advanced.
  void forward_chunk(DeltaChunkPart<T>& part, Eigen::Index begin, Eigen::Index len);

  /// Reverse mode over the loaded chunk c (q^, k^, dO, beta, gates): its gradients into the
  /// part's rows, dS moved to the chunk's start.
  void backward_chunk(DeltaChunkPart<T>& part, Eigen::Index c, Eigen::Index len, bool log_space);

  /// Piece [p, p + m) of the loaded chunk: G, g, e, and D for scalar gates.
  void piece_decays(DeltaChunkPart<T>& part, Eigen::Index p, Eigen::Index m) const;

  /// Reverse mode over piece [p, p + m) of chunk c.
  void backward_piece(DeltaChunkPart<T>& part, Eigen::Index c, Eigen::Index p, Eigen::Index m);

  /// The end of the piece that starts at p (scalar gates: the next reset; else len).
  Eigen::Index piece_end(const DeltaChunkPart<T>& part, Eigen::Index p, Eigen::Index len) const {
    if (gates_ != 1) return len;
    Eigen::Index end = p + 1;
    while (end < len && part.reset[static_cast<std::size_t>(end)] == 0) ++end;
    return end;
  }

  /// rows <- factors o rows: one factor per row (G = 1) or per entry (G = Dk).
  template <class Rows, class Factors>
  void decay_rows(Rows&& rows, const Factors& factors) const {
    if (gates_ == 1) {
      rows.array().colwise() *= factors.col(0).array();
    } else {
      rows.array() *= factors.array();
    }
  }

  /// state <- diag(exp(G_m)) state, `last` the piece's last row of g (1 x G).
  template <class Last>
  void decay_state(Matrix<T>& state, const Last& last) const {
    if (gates_ == 1) {
      state *= last(0, 0);
    } else {
      state.array().colwise() *= last.transpose().array();
    }
  }

  Eigen::Index n_ = 0, dk_ = 0, chunk_ = 1, gates_ = 0;
  T scale_ = T(1);
  bool l2_normalize_ = false;
  std::vector<DeltaChunkPart<T>> parts_;
};

// DeltaChunkBackward's members that do not depend on the inputs' types, outside the class so
// that the compiled mode's `extern template` keeps them out of every other translation unit.

template <class T>
void DeltaChunkBackward<T>::prepare_rows(DeltaChunkPart<T>& part, Eigen::Index len) const {
  constexpr double minus_inf = -std::numeric_limits<double>::infinity();
  const Eigen::Index g = std::max<Eigen::Index>(gates_, 1);
  for (Eigen::Index i = 0; i < len; ++i) {
    for (Eigen::Index f = 0; f < g; ++f) {
      const bool reset = gates_ > 0 && part.log_gate(i, f) == minus_inf;
      part.reset[static_cast<std::size_t>(i * g + f)] = reset ? 1 : 0;
      if (reset) {
        part.log_gate(i, f) = gates_ == 1 ? 0.0 : kFeatureResetLog;
      } else if (gates_ > 0 && part.log_gate(i, f) < kFeatureResetLog) {
        // A decay below e^-1000 is 0 as it is (and its gradient, a_t times the rest, too): at
        // -1000 it cannot absorb the rest of the chunk's sum of gates, or overflow it.
        part.log_gate(i, f) = kFeatureResetLog;
      }
    }
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
  // Every exp below on a T buffer, vectorised (an exp of a cast expression is not).
  const auto exp_of = [](auto&& logs, auto&& out) {
    out = logs.template cast<T>();
    out.array() = out.array().exp();
  };
  if (gates_ == 0) {
    auto decay = part.decay.topLeftCorner(m, m);
    decay.setZero();
    decay.template triangularView<Eigen::Lower>().setOnes();
    return;
  }
  auto cum = part.cum.topRows(m);
  cum.row(0) = part.log_gate.row(p);
  for (Eigen::Index i = 1; i < m; ++i) cum.row(i) = cum.row(i - 1) + part.log_gate.row(p + i);
  exp_of(cum, part.gamma.topRows(m));
  // G_m - G broadcast row by row, then one exp (a difference with replicate() runs one element
  // at a time; exp_of still casts the expression, the whole of it at once).
  exp_of((-cum).rowwise() + cum.row(m - 1), part.to_end.topRows(m));
  if (gates_ == 1) {
    // exp(G_i - G_j) for j <= i (all <= 1); zeros above.
    auto decay = part.decay.topLeftCorner(m, m);
    exp_of(cum.col(0).replicate(1, m) - cum.col(0).transpose().replicate(m, 1), decay);
    decay.template triangularView<Eigen::StrictlyUpper>().setZero();
    return;
  }
  // Per feature: the pairs' factors by sub-blocks.
  part.feature_pairs.decays(part.cum, m);
}

template <class T>
void DeltaChunkBackward<T>::forward_chunk(DeltaChunkPart<T>& part, Eigen::Index begin,
                                          Eigen::Index len) {
  const Eigen::Index w = part.width;
  for (Eigen::Index p = 0; p < len;) {
    const Eigen::Index m = piece_end(part, p, len) - p;
    if (gates_ == 1 && part.reset[static_cast<std::size_t>(p)] != 0) part.state.setZero();
    piece_decays(part, p, m);
    const auto k = part.k.middleRows(p, m);
    const auto beta = part.beta.col(0).segment(p, m).array();
    auto kk = part.kk.topLeftCorner(m, m);
    if (gates_ > 1) {
      part.feature_pairs.pairs(k, k, m, kk);
    } else {
      kk.noalias() = k * k.transpose();
      kk.array() *= part.decay.topLeftCorner(m, m).array();
    }
    kk.template triangularView<Eigen::Upper>().setZero();  // B: strictly lower
    part.b_all.block(begin + p, p, m, m) = kk;
    auto wk = part.wu.block(0, 0, m, dk_);
    auto u = part.wu.block(0, dk_, m, w);
    wk = k;
    if (gates_ > 0) decay_rows(wk, part.gamma.topRows(m));
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
    if (gates_ > 0) {
      decay_rows(kd, part.to_end.topRows(m));
      decay_state(part.state, part.gamma.row(m - 1));
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
    while (p > 0 && (gates_ != 1 || part.reset[static_cast<std::size_t>(p)] == 0)) --p;
    backward_piece(part, c, p, end - p);
    end = p;
  }
  if (gates_ > 0) {
    // A reset has no neighbourhood in log space: its gradient is 0 (FLA's convention).
    for (Eigen::Index i = 0; i < len; ++i) {
      for (Eigen::Index f = 0; f < gates_; ++f) {
        if (part.reset[static_cast<std::size_t>(i * gates_ + f)] != 0) part.grad_gate(i, f) = 0;
      }
    }
    if (!log_space) {
      // d / d a_t = (d / d log a_t) / a_t (a_t > 0: gates a_t never reset).
      part.grad_gate.topRows(len).array() /=
          part.log_gate.topRows(len).template cast<T>().array().exp();
    }
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
                                           Eigen::Index m) {
  const Eigen::Index begin = c * chunk_;
  const bool reset = gates_ == 1 && part.reset[static_cast<std::size_t>(p)] != 0;
  // S0: the chunk's checkpoint for its first piece, zero after a reset or before the sequence.
  const bool has_state = p == 0 && !reset && c > 0;
  const auto s0 = part.checkpoints.middleRows(c * dk_, dk_);
  piece_decays(part, p, m);
  const auto q = part.q.middleRows(p, m);
  const auto k = part.k.middleRows(p, m);
  const auto dout = part.dout.middleRows(p, m);
  const auto u = part.u_all.middleRows(begin + p, m);
  const auto b = part.b_all.block(begin + p, p, m, m);
  const auto beta = part.beta.col(0).segment(p, m).array();
  const auto gamma = part.gamma.topRows(gates_ > 0 ? m : 0);
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
  auto dcum = part.dcum.topRows(gates_ > 0 ? m : 0);  // empty without gates
  // The forward's pieces: P = tril(Q . K), K_e = e o K.
  if (gates_ > 1) {
    part.feature_pairs.pairs(q, k, m, pairs);
  } else {
    pairs.noalias() = q * k.transpose();
    pairs.array() *= part.decay.topLeftCorner(m, m).array();
  }
  kd = k;
  if (gates_ > 0) decay_rows(kd, part.to_end.topRows(m));
  // dU = K_e dS + P^T dO; dK_e = U dS^T; dP = tril(dO U^T).
  du.noalias() = kd * part.ds;
  du.noalias() += pairs.template triangularView<Eigen::Lower>().transpose() * dout;
  dkd.noalias() = u * part.ds.transpose();
  dpairs.noalias() = dout * u.transpose();
  dpairs.template triangularView<Eigen::StrictlyUpper>().setZero();
  if (gates_ == 1) {
    // Scalar gates: each pair's decay gets rows minus columns of dP o P.
    const auto z = dpairs.array() * pairs.array();
    dcum.col(0) = z.rowwise().sum().matrix() - z.colwise().sum().transpose().matrix();
  } else if (gates_ > 1) {
    dcum.setZero();
  }
  // dY = (I + A)^-T dU, A = diag(beta) B; dA = -dY U^T, kept strictly lower.
  kk = b;
  kk.array().colwise() *= beta;
  kk.template triangularView<Eigen::UnitLower>().transpose().solveInPlace(du);
  dkk.noalias() = -du * u.transpose();
  dkk.template triangularView<Eigen::Upper>().setZero();
  // R = V - (g o K) S0 = diag(1 / beta) U + B U; dbeta = dY . R + (dA o B) summed by rows.
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
  if (gates_ == 1) {
    const auto z = dkk.array() * b.array();
    dcum.col(0) += z.rowwise().sum().matrix() - z.colwise().sum().transpose().matrix();
  }
  // e_s = exp(G_m - G_s): dG_s -= k_s o e_s o dK_e_s, dG_m += their sum over s.
  if (gates_ > 0) {
    Eigen::Ref<Matrix<T>> through_end = part.block_grad.topRows(gates_ > 1 ? m : 0);
    if (gates_ == 1) {
      const auto end = (kd.array() * dkd.array()).rowwise().sum();
      dcum.col(0) -= end.matrix();
      dcum(m - 1, 0) += end.sum();
    } else {
      through_end = (kd.array() * dkd.array()).matrix();
      dcum -= through_end;
      dcum.row(m - 1) += through_end.colwise().sum();
    }
  }
  // S0's terms: [g o Q; beta g o K] and [dO; -dY]. A piece after a reset starts from zero
  // and passes no gradient back; the sequence's first needs none.
  if (has_state) {
    auto lhs = part.lhs.topRows(2 * m);
    auto rhs = part.rhs.topRows(2 * m);
    lhs.topRows(m) = q;
    lhs.bottomRows(m) = k;
    lhs.bottomRows(m).array().colwise() *= beta;
    if (gates_ > 0) {
      decay_rows(lhs.topRows(m), gamma);
      decay_rows(lhs.bottomRows(m), gamma);
    }
    rhs.topRows(m) = dout;
    rhs.bottomRows(m) = -du;
    auto products = part.s0_products.block(0, 0, 2 * m, dk_);
    products.noalias() = rhs * s0.transpose();
    // The gates' share: each diagonal factor times its gradient.
    if (gates_ == 1) {
      const auto shares = (lhs.array() * products.array()).rowwise().sum();
      dcum.col(0) += (shares.topRows(m) + shares.bottomRows(m)).matrix();
      dcum(m - 1, 0) += gamma(m - 1, 0) * (s0.array() * part.ds.array()).sum();
    } else if (gates_ > 1) {
      dcum.array() += lhs.topRows(m).array() * products.topRows(m).array() +
                      lhs.bottomRows(m).array() * products.bottomRows(m).array();
      dcum.row(m - 1).array() +=
          gamma.row(m - 1).array() * (s0.array() * part.ds.array()).rowwise().sum().transpose();
    }
    // dQ += g o dQ~, dK += beta g o dK~.
    auto to_query = products.topRows(m);
    auto to_key = products.bottomRows(m);
    to_key.array().colwise() *= beta;
    if (gates_ > 0) {
      decay_rows(to_query, gamma);
      decay_rows(to_key, gamma);
    }
    grad_q += to_query;
    grad_k += to_key;
    if (gates_ > 0) decay_state(part.ds, gamma.row(m - 1));
    part.ds.noalias() += lhs.transpose() * rhs;
  } else {
    part.ds.setZero();
  }
  // The pairs' shares: dQ, dK from dP o D and dB o D.
  if (gates_ > 1) {
    part.feature_pairs.gradients(q, k, dpairs, m, grad_q, grad_k, dcum);
    part.feature_pairs.gradients(k, k, dkk, m, grad_k, grad_k, dcum);
  } else {
    dpairs.array() *= part.decay.topLeftCorner(m, m).array();
    dkk.array() *= part.decay.topLeftCorner(m, m).array();
    grad_q.noalias() += dpairs.template triangularView<Eigen::Lower>() * k;
    grad_k.noalias() += dpairs.template triangularView<Eigen::Lower>().transpose() * q;
    pairs = dkk.transpose();  // P is read no more
    dkk += pairs;             // dB + dB^T: both keys of a pair in one product
    grad_k.noalias() += dkk * k;
  }
  if (gates_ > 0) decay_rows(dkd, part.to_end.topRows(m));
  grad_k += dkd;
  if (gates_ == 0) return;
  // Per-token log gates from the cumulative ones: dg_i = sum of dG_j over j >= i.
  auto grad_gate = part.grad_gate.middleRows(p, m);
  grad_gate.row(m - 1) = dcum.row(m - 1);
  for (Eigen::Index i = m - 2; i >= 0; --i) grad_gate.row(i) = grad_gate.row(i + 1) + dcum.row(i);
}

}  // namespace linattn::detail
