// SPDX-License-Identifier: MIT
// The generalized (diagonal-plus-low-rank) delta rule's kernels on one state S (Dk x Dv): the
// chunked WY form (every product a GEMM), the streamed recurrence and the one-token step.
// FLA's dplr conventions: the low-rank term reads the state before the decay,
//     S_t = diag(w_t) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,   out_t = S_t^T (s q_t),
// with w_t = exp(g_t) (g_t <= 0, -infinity resets a row).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/delta_rule.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/gates.hpp>
#include <string>
#include <utility>

namespace linattn::detail {

/// s: DplrOptions::scale, or Dk^-1/2 when it is negative (FLA's chunk_dplr_delta_rule).
inline double dplr_scale(const DplrOptions& options, Eigen::Index key_dim) {
  return options.scale < 0.0 ? 1.0 / std::sqrt(static_cast<double>(key_dim)) : options.scale;
}

/// Throws unless the options are in range; `where` names the calling function.
inline void validate_dplr_options(const DplrOptions& options, const char* where) {
  if (!(options.scale < 0.0 || options.scale > 0.0) || !std::isfinite(options.scale)) {
    throw Error(std::string(where) +
                ": DplrOptions::scale must be finite and > 0, or negative for Dk^-1/2, got " +
                std::to_string(options.scale));
  }
  validate_kernel_options(options, where, "DplrOptions");
}

/// The engine's Options for the code the family shares with it (scans, threads, heads).
inline Options engine_options(const DplrOptions& options) {
  Options engine;
  static_cast<KernelOptions&>(engine) = options;
  return engine;
}

/// True when two options give the same numbers for keys of `key_dim` (the scale as resolved).
inline bool same_dplr_results(const DplrOptions& a, const DplrOptions& b, Eigen::Index key_dim) {
  return dplr_scale(a, key_dim) == dplr_scale(b, key_dim);
}

/// Where the DPLR kernels read a_t and b_t (Dk each), a block of tokens at a time, in T.
template <class T>
class PairRows {
 public:
  PairRows(const PairRows&) = delete;
  PairRows& operator=(const PairRows&) = delete;
  /// a.topRows(len), b.topRows(len) = a_t, b_t of tokens [begin, begin + len).
  virtual void load(Eigen::Index begin, Eigen::Index len, Matrix<T>& a, Matrix<T>& b) const = 0;

 protected:
  PairRows() = default;
  ~PairRows() = default;
};

/// PairRows over a caller's N x Dk expressions a and b.
template <class T, class DA, class DB>
class PairMatrices final : public PairRows<T> {
 public:
  PairMatrices(const DA& a, const DB& b) : a_(a), b_(b) {}
  void load(Eigen::Index begin, Eigen::Index len, Matrix<T>& a, Matrix<T>& b) const override {
    load_rows(a_.middleRows(begin, len), a);
    load_rows(b_.middleRows(begin, len), b);
  }

 private:
  const DA& a_;
  const DB& b_;
};

/// One token as the step's strips read it: k, a, b, the decays w and wq = w o q^ (Dk each, q^
/// scaled), the dots b . q^ and k . q^, and v and the output from the strip's first column.
template <class T>
struct DplrTokenRefs {
  const T* q;
  const T* k;
  const T* a;
  const T* b;
  const T* w;
  const T* v;
  T* out;
  const T* wq = nullptr;  ///< set by dplr_step
  T bq = T(0), kq = T(0);
};

/// Columns [0, WP packets) at `s` of one DPLR step (columns evolve alone). One pass down the
/// rows reads S_{t-1} twice over, u = S^T a and S^T (w o q), so that the output needs no pass
/// of its own: out = S_{t-1}^T (w o q) + (b . q) u + (k . q) v = S_t^T q. A second pass back up
/// writes S = diag(w) S + b u^T + k v^T, starting on rows still in L1.
template <class T, class Packet, int WP>
void dplr_step_strip(T* const s, Eigen::Index rows, Eigen::Index lds,
                     const DplrTokenRefs<T>& token) {
  using Eigen::internal::padd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pmul;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  constexpr int P = Eigen::internal::unpacket_traits<Packet>::size;
  constexpr auto packets = std::make_integer_sequence<int, WP>{};
  const T* const a = token.a;
  const T* const wq = token.wq;
  // Two rows a step, into two sets of accumulators: half the dependency chains.
  Packet ue[WP], uo[WP], oe[WP], oo[WP];
  for_each_packet(packets, [&](auto w) { ue[w] = uo[w] = oe[w] = oo[w] = pset1<Packet>(T(0)); });
  Eigen::Index d = 0;
  for (; d + 1 < rows; d += 2) {
    const Packet a0 = pset1<Packet>(a[d]), a1 = pset1<Packet>(a[d + 1]);
    const Packet q0 = pset1<Packet>(wq[d]), q1 = pset1<Packet>(wq[d + 1]);
    const T* const row = s + d * lds;
    for_each_packet(packets, [&](auto w) {
      const Packet x0 = ploadu<Packet>(row + w * P), x1 = ploadu<Packet>(row + lds + w * P);
      ue[w] = pmadd(a0, x0, ue[w]);
      uo[w] = pmadd(a1, x1, uo[w]);
      oe[w] = pmadd(q0, x0, oe[w]);
      oo[w] = pmadd(q1, x1, oo[w]);
    });
  }
  if (d < rows) {
    const Packet a0 = pset1<Packet>(a[d]), q0 = pset1<Packet>(wq[d]);
    const T* const row = s + d * lds;
    for_each_packet(packets, [&](auto w) {
      const Packet x0 = ploadu<Packet>(row + w * P);
      ue[w] = pmadd(a0, x0, ue[w]);
      oe[w] = pmadd(q0, x0, oe[w]);
    });
  }
  Packet u[WP], v[WP];
  const Packet bq = pset1<Packet>(token.bq), kq = pset1<Packet>(token.kq);
  for_each_packet(packets, [&](auto w) {
    u[w] = padd(ue[w], uo[w]);
    v[w] = ploadu<Packet>(token.v + w * P);
    pstoreu<T>(token.out + w * P, pmadd(kq, v[w], pmadd(bq, u[w], padd(oe[w], oo[w]))));
  });
  const T* const k = token.k;
  const T* const b = token.b;
  const T* const decay = token.w;
  // x = w x + b u + k v per row, two rows at a time, from the last row back.
  d = rows;
  for (; d > 1; d -= 2) {
    const Packet w0 = pset1<Packet>(decay[d - 1]), w1 = pset1<Packet>(decay[d - 2]);
    const Packet b0 = pset1<Packet>(b[d - 1]), b1 = pset1<Packet>(b[d - 2]);
    const Packet k0 = pset1<Packet>(k[d - 1]), k1 = pset1<Packet>(k[d - 2]);
    T* const row = s + (d - 2) * lds;
    for_each_packet(packets, [&](auto w) {
      Packet x0 = pmul(w0, ploadu<Packet>(row + lds + w * P));
      Packet x1 = pmul(w1, ploadu<Packet>(row + w * P));
      x0 = pmadd(k0, v[w], pmadd(b0, u[w], x0));
      x1 = pmadd(k1, v[w], pmadd(b1, u[w], x1));
      pstoreu<T>(row + lds + w * P, x0);
      pstoreu<T>(row + w * P, x1);
    });
  }
  if (d == 1) {
    const Packet w0 = pset1<Packet>(decay[0]), b0 = pset1<Packet>(b[0]), k0 = pset1<Packet>(k[0]);
    for_each_packet(packets, [&](auto w) {
      const Packet x0 = pmul(w0, ploadu<Packet>(s + w * P));
      pstoreu<T>(s + w * P, pmadd(k0, v[w], pmadd(b0, u[w], x0)));
    });
  }
}

/// dplr_step_strip over columns [col, cols) of the Dk rows at `s` (row stride lds): WP packets
/// wide, then halving widths, then scalars.
template <int WP, class T>
void dplr_strips(T* s, Eigen::Index rows, Eigen::Index lds, Eigen::Index col, Eigen::Index cols,
                 const DplrTokenRefs<T>& token) {
  using Packet = typename DeltaStepShape<T>::Packet;
  constexpr Eigen::Index width = WP * DeltaStepShape<T>::kPacket;
  const auto at = [&](Eigen::Index c) {
    DplrTokenRefs<T> moved = token;
    moved.v += c;
    moved.out += c;
    return moved;
  };
  for (; col + width <= cols; col += width) {
    dplr_step_strip<T, Packet, WP>(s + col, rows, lds, at(col));
  }
  if constexpr (WP > 1) {
    dplr_strips<WP / 2>(s, rows, lds, col, cols, token);
  } else {
    for (; col < cols; ++col) dplr_step_strip<T, T, 1>(s + col, rows, lds, at(col));
  }
}

/// The same step in two sweeps over whole rows, for row strides where strips 4K-alias.
/// u: Dv scratch.
template <class T>
void dplr_step_rows(Matrix<T>& state, const DplrTokenRefs<T>& token, Vector<T>& u) {
  const Eigen::Index dk = state.rows(), dv = state.cols();
  using ConstMap = Eigen::Map<const Vector<T>>;
  using RowMap = Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>;
  u.noalias() = state.transpose() * ConstMap(token.a, dk);
  const ConstMap v(token.v, dv);
  RowMap out(token.out, dv);
  out.noalias() = (state.transpose() * ConstMap(token.wq, dk)).transpose();
  out += token.bq * u.transpose() + token.kq * v.transpose();
  for (Eigen::Index d = 0; d < dk; ++d) {
    auto row = state.row(d);
    row = token.w[d] * row + token.b[d] * u.transpose() + token.k[d] * v.transpose();
  }
}

/// One DPLR token on `state` (Dk x Dv, row-major): out = S_t^T q. Strip by strip of columns,
/// each updated while still cached from its first pass; allocates nothing. wq: Dk scratch;
/// u: Dv scratch for the row strides where strips 4K-alias.
template <class T>
void dplr_step(Matrix<T>& state, DplrTokenRefs<T> token, Vector<T>& wq, Vector<T>& u) {
  const Eigen::Index dk = state.rows();
  using ConstMap = Eigen::Map<const Vector<T>>;
  const ConstMap q(token.q, dk);
  wq.noalias() = (ConstMap(token.w, dk).array() * q.array()).matrix();
  token.wq = wq.data();
  token.bq = ConstMap(token.b, dk).dot(q);
  token.kq = ConstMap(token.k, dk).dot(q);
  if (state.cols() * static_cast<Eigen::Index>(sizeof(T)) % 4096 == 0) {
    dplr_step_rows(state, token, u);
    return;
  }
  dplr_strips<DeltaStepShape<T>::kPackets>(state.data(), state.rows(), state.cols(), 0,
                                           state.cols(), token);
}

/// Workspace of one DPLR token's step, in T: the token, its decays and its output.
template <class T>
struct DplrStepBuffers {
  Vector<T> q, k, a, b, w, wq, v, out, u;
  DplrStepBuffers() = default;
  DplrStepBuffers(Eigen::Index key_dim, Eigen::Index value_dim) { resize(key_dim, value_dim); }
  void resize(Eigen::Index key_dim, Eigen::Index value_dim) {
    for (Vector<T>* x : {&q, &k, &a, &b, &w, &wq}) x->resize(key_dim);
    for (Vector<T>* x : {&v, &out, &u}) x->resize(value_dim);
  }
  DplrTokenRefs<T> refs() {
    return {q.data(), k.data(), a.data(), b.data(), w.data(), v.data(), out.data()};
  }
};

/// Block of loaded tokens of the streamed form, and the largest chunk of the chunked form whose
/// in-chunk work is worth its GEMMs.
inline constexpr Eigen::Index kDplrBlock = 64;

/// w_t = exp(log gates) of loaded rows [first, first + len) into decay's first len rows (Dk
/// each), a scalar gate broadcast. Converted to T first, then one exp over T: Eigen vectorises
/// exp over T, not over a cast.
template <class T>
void dplr_decays(const LogRows& log_gate, Eigen::Index first, Eigen::Index len,
                 Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>& decay) {
  auto rows = decay.topRows(len);
  if (log_gate.cols() == 1) {
    for (Eigen::Index r = 0; r < len; ++r) {
      rows.row(r).setConstant(static_cast<T>(log_gate(first + r, 0)));
    }
  } else {
    rows = log_gate.middleRows(first, len).template cast<T>();
  }
  rows = rows.exp();
}

/// The recurrent form over a sequence, streamed: blocks of tokens loaded and scaled once, then
/// token by token through dplr_step's strips. Exactly the recurrence's flops; resets as decays
/// of 0.
template <class T, class O>
class DplrStream {
 public:
  DplrStream(Eigen::Index key_dim, Eigen::Index value_dim, const DplrOptions& options)
      : scale_(static_cast<T>(dplr_scale(options, key_dim))),
        io_(kDplrBlock, key_dim, value_dim),
        a_(kDplrBlock, key_dim),
        b_(kDplrBlock, key_dim),
        decay_(kDplrBlock, key_dim),
        wq_(key_dim),
        u_(value_dim),
        out_(kDplrBlock, value_dim) {}

  /// Runs every token of `src` (gates attached) with `pairs` from `state` on; out: N x Dv, or
  /// null for the state only.
  void run(const ChunkSource<T>& src, const PairRows<T>& pairs, Matrix<T>& state, OutRows<O>* out);

 private:
  T scale_;
  ChunkBuffers<T> io_;  ///< the block's q^, k, v
  Matrix<T> a_, b_;
  LogRows log_gate_;
  Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> decay_;  ///< w_t
  Vector<T> wq_, u_;
  Matrix<T> out_;
};

template <class T, class O>
void DplrStream<T, O>::run(const ChunkSource<T>& src, const PairRows<T>& pairs, Matrix<T>& state,
                           OutRows<O>* out) {
  const Eigen::Index dk = state.rows(), dv = state.cols();
  for (Eigen::Index begin = 0; begin < src.rows(); begin += kDplrBlock) {
    const Eigen::Index len = std::min(kDplrBlock, src.rows() - begin);
    src.load_queries(begin, len, io_);
    src.load_keys_values(begin, len, io_);
    pairs.load(begin, len, a_, b_);
    io_.q.topRows(len) *= scale_;
    log_gate_.resize(kDplrBlock, src.gate_dim());
    src.load_log_gates(begin, len, log_gate_);
    dplr_decays(log_gate_, 0, len, decay_);  // -inf: 0, a reset of the row
    for (Eigen::Index t = 0; t < len; ++t) {
      const DplrTokenRefs<T> token{
          io_.q.data() + t * dk,  io_.k.data() + t * dk, a_.data() + t * dk,  b_.data() + t * dk,
          decay_.data() + t * dk, io_.v.data() + t * dv, out_.data() + t * dv};
      dplr_step(state, token, wq_, u_);
    }
    if (out != nullptr) {
      OutRows<O> rows(out->middleRows(begin, len));
      store_rows<O>(out_, len, rows);
    }
  }
}

/// Per-call workspace of the DPLR chunked form, sized by the chunk length, never by N.
template <class T>
struct DplrBuffers {
  using Array = Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  ChunkBuffers<T> io;  ///< q^, k, v of the chunk (L x Dk, L x Dk, L x Dv)
  Matrix<T> a, b;      ///< L x Dk
  LogRows log_gate;    ///< L x G: the chunk's log gates, G = 1 or Dk
  LogRows cum;         ///< L x Dk: log gates summed within a piece
  LogRows ref;         ///< 1 x Dk: the cumulative log gates before a sub-block
  Array decay;         ///< L x Dk: w_t, for the tokens that reset a row (run as steps)
  Matrix<T> qb, qk;    ///< L x L: q_t . b_i and q_t . k_i pairs, lower (diagonal included)
  Matrix<T> ab;        ///< L x L: strictly lower a_t . b_i pairs, negated: I + ab = I - Ab
  Matrix<T> ak;        ///< L x L: strictly lower a_t . k_i pairs
  Matrix<T> wu;        ///< L x (Dk + Dv): [W U0], solved in place
  Matrix<T> lhs;       ///< 2L x Dk: [W; Q~], the rows multiplied by S in one GEMM
  Matrix<T> ws;        ///< 2L x Dv: [W S; Q~ S]
  Matrix<T> uv;        ///< 2L x Dv: [U; V]
  Matrix<T> bk;        ///< 2L x Dk: [B; K] decayed to the piece's end
  Matrix<T> out;       ///< L x Dv
  Array factor;        ///< L x Dk: decays of a sub-block's rows
  Array right;         ///< 2L x Dk: keys and b decayed to a sub-block's reference
  Array left;          ///< 2B x Dk: a sub-block's queries and a decayed from its reference
  Matrix<T> pairs;     ///< 2B x 2L: their products with `right`
  Vector<T> last;      ///< Dk: the piece's total decay per key feature
  Vector<T> wq, u;     ///< Dk, Dv: a step's scratch

  DplrBuffers(Eigen::Index chunk, Eigen::Index key_dim, Eigen::Index value_dim)
      : io(chunk, key_dim, value_dim),
        a(chunk, key_dim),
        b(chunk, key_dim),
        cum(chunk, key_dim),
        ref(1, key_dim),
        decay(chunk, key_dim),
        qb(chunk, chunk),
        qk(chunk, chunk),
        ab(chunk, chunk),
        ak(chunk, chunk),
        wu(chunk, key_dim + value_dim),
        lhs(2 * chunk, key_dim),
        ws(2 * chunk, value_dim),
        uv(2 * chunk, value_dim),
        bk(2 * chunk, key_dim),
        out(chunk, value_dim),
        factor(chunk, key_dim),
        right(2 * chunk, key_dim),
        left(2 * std::min(chunk, kDeltaSubBlock), key_dim),
        pairs(2 * std::min(chunk, kDeltaSubBlock), 2 * chunk),
        last(key_dim),
        wq(key_dim),
        u(value_dim) {}
};

/// The DPLR rule over a sequence, chunk by chunk, on a state S (Dk x Dv) carried in and out.
/// Per piece of m tokens (a chunk, split at tokens that reset a row, which run as steps) with
/// in-piece cumulative log decays G_t (G_{-1} = 0) and u_t = S_{t-1}^T a_t:
///     U = (I - Ab)^-1 (A~ S + Ak V),   A~ = a o exp(G_{t-1}),
///     O = (q o exp(G)) S + Qb U + Qk V,
///     S <- exp(G_m) o S + (b o exp(G_m - G))^T U + (k o exp(G_m - G))^T V,
/// where Ab, Ak (strictly lower) pair a_t with b_i, k_i through exp(G_{t-1} - G_i), and Qb, Qk
/// (lower, diagonal included) pair q_t with them through exp(G_t - G_i). Every product a GEMM,
/// the unit-triangular solve in T, every decay the exp of a difference within a sub-block of
/// kDeltaSubBlock tokens (KDA's scheme: a sub-block whose decays spread past kDeltaSpread
/// computes its own pairs directly). T is the accumulation type, O the output's scalar.
template <class T, class O>
class DplrKernel {
 public:
  DplrKernel(Eigen::Index rows, Eigen::Index key_dim, Eigen::Index value_dim,
             const DplrOptions& options)
      : chunk_(std::max<Eigen::Index>(1, std::min(options.chunk, rows))),
        scale_(static_cast<T>(dplr_scale(options, key_dim))),
        buf_(chunk_, key_dim, value_dim) {}

  /// Runs every token of `src` (gates attached) with `pairs` from `state` on, leaving it after
  /// the last token. out: N x Dv, or null for the state only.
  void run(const ChunkSource<T>& src, const PairRows<T>& pairs, Matrix<T>& state, OutRows<O>* out);

 private:
  bool has_reset(Eigen::Index r) const {
    return (buf_.log_gate.row(r) == -std::numeric_limits<double>::infinity()).any();
  }

  /// Token r of the loaded chunk through the step (its decays exp(g), a reset's 0).
  void step_token(Eigen::Index r, Matrix<T>& state) {
    const Eigen::Index dk = state.rows(), dv = state.cols();
    dplr_decays(buf_.log_gate, r, 1, buf_.decay);
    const DplrTokenRefs<T> token{buf_.io.q.data() + r * dk,
                                 buf_.io.k.data() + r * dk,
                                 buf_.a.data() + r * dk,
                                 buf_.b.data() + r * dk,
                                 buf_.decay.data(),
                                 buf_.io.v.data() + r * dv,
                                 buf_.out.data()};
    dplr_step(state, token, buf_.wq, buf_.u);
  }

  void run_piece(Eigen::Index p, Eigen::Index m, Matrix<T>& state);
  void piece_pairs(Eigen::Index p, Eigen::Index m);

  Eigen::Index chunk_;
  T scale_;
  DplrBuffers<T> buf_;
};

/// Cumulative decays of the piece, the decayed rows that meet S, and the in-piece pairs.
template <class T, class O>
void DplrKernel<T, O>::piece_pairs(Eigen::Index p, Eigen::Index m) {
  const Eigen::Index dk = buf_.io.k.cols();
  auto cum = buf_.cum.topRows(m);
  if (buf_.log_gate.cols() == 1) {
    double sum = 0.0;
    for (Eigen::Index i = 0; i < m; ++i) cum.row(i).setConstant(sum += buf_.log_gate(p + i, 0));
  } else {
    cum.row(0) = buf_.log_gate.row(p);
    for (Eigen::Index i = 1; i < m; ++i) cum.row(i) = cum.row(i - 1) + buf_.log_gate.row(p + i);
  }
  const auto q = buf_.io.q.middleRows(p, m).array();
  const auto k = buf_.io.k.middleRows(p, m).array();
  const auto a = buf_.a.middleRows(p, m).array();
  const auto b = buf_.b.middleRows(p, m).array();
  // Decays from the piece's start (queries; a after the token before) and to its end.
  auto from_start = buf_.factor.topRows(m);
  from_start = cum.template cast<T>().exp();
  buf_.lhs.middleRows(m, m).array() = q * from_start;
  buf_.wu.topLeftCorner(1, dk) = buf_.a.row(p);
  if (m > 1)
    buf_.wu.block(1, 0, m - 1, dk).array() = a.bottomRows(m - 1) * from_start.topRows(m - 1);
  buf_.last = from_start.row(m - 1).transpose().matrix();
  from_start = (cum.row(m - 1).replicate(m, 1) - cum).template cast<T>().exp();  // to the end
  buf_.bk.topRows(m).array() = b * from_start;
  buf_.bk.middleRows(m, m).array() = k * from_start;
  // The pairs of sub-block rows [i0, i0 + n) with every token up to its end, on factors
  // referred to the cumulative decay before the sub-block.
  for (Eigen::Index i0 = 0; i0 < m; i0 += kDeltaSubBlock) {
    const Eigen::Index n = std::min(kDeltaSubBlock, m - i0);
    if (i0 > 0) {
      buf_.ref = cum.row(i0 - 1);
    } else {
      buf_.ref.setZero();
    }
    const auto ref = [&](Eigen::Index rows) { return buf_.ref.replicate(rows, 1); };
    const bool inside = (buf_.ref - cum.row(i0 + n - 1)).maxCoeff() <= kDeltaSpread;
    const Eigen::Index width = inside ? i0 + n : i0;
    if (width > 0) {
      auto to_ref = buf_.factor.topRows(width);
      to_ref = (ref(width) - cum.topRows(width)).template cast<T>().exp();
      buf_.right.topRows(width) = b.topRows(width) * to_ref;
      buf_.right.middleRows(width, width) = k.topRows(width) * to_ref;
      auto from_ref = buf_.factor.topRows(n);
      from_ref = (cum.middleRows(i0, n) - ref(n)).template cast<T>().exp();
      buf_.left.topRows(n) = q.middleRows(i0, n) * from_ref;
      // a_t decays from the token before it: exp(G_{t-1} - G_ref), 1 at the sub-block's start.
      buf_.left.row(n) = a.row(i0);
      if (n > 1)
        buf_.left.middleRows(n + 1, n - 1) = a.middleRows(i0 + 1, n - 1) * from_ref.topRows(n - 1);
      buf_.pairs.topLeftCorner(2 * n, 2 * width).noalias() =
          buf_.left.topRows(2 * n).matrix() * buf_.right.topRows(2 * width).matrix().transpose();
      buf_.qb.block(i0, 0, n, width) = buf_.pairs.topLeftCorner(n, width);
      buf_.qk.block(i0, 0, n, width) = buf_.pairs.block(0, width, n, width);
      buf_.ab.block(i0, 0, n, width) = -buf_.pairs.block(n, 0, n, width);
      buf_.ak.block(i0, 0, n, width) = buf_.pairs.block(n, width, n, width);
    }
    if (!inside) {
      // Pairs within the sub-block, each through its own decays (all <= 1).
      auto d = buf_.factor.row(0);
      for (Eigen::Index t = i0; t < i0 + n; ++t) {
        for (Eigen::Index i = i0; i <= t; ++i) {
          d = (cum.row(t) - cum.row(i)).template cast<T>().exp();
          buf_.qb(t, i) = (q.row(t) * b.row(i) * d).sum();
          buf_.qk(t, i) = (q.row(t) * k.row(i) * d).sum();
          if (i == t) continue;
          d = (cum.row(t - 1) - cum.row(i)).template cast<T>().exp();
          buf_.ab(t, i) = -(a.row(t) * b.row(i) * d).sum();
          buf_.ak(t, i) = (a.row(t) * k.row(i) * d).sum();
        }
      }
    }
  }
}

/// Tokens [p, p + m) of the loaded chunk, none of which resets a row.
template <class T, class O>
void DplrKernel<T, O>::run_piece(Eigen::Index p, Eigen::Index m, Matrix<T>& state) {
  const Eigen::Index dk = state.rows(), dv = state.cols();
  piece_pairs(p, m);
  const auto v = buf_.io.v.middleRows(p, m);
  auto w = buf_.wu.block(0, 0, m, dk);
  auto u = buf_.wu.block(0, dk, m, dv);
  // [W U0] = (I - Ab)^-1 [A~ (Ak V)]: the solve reads only the strictly lower part of ab.
  u.noalias() = buf_.ak.topLeftCorner(m, m).template triangularView<Eigen::StrictlyLower>() * v;
  buf_.ab.topLeftCorner(m, m).template triangularView<Eigen::UnitLower>().solveInPlace(
      buf_.wu.topRows(m));
  // Both products with S in one GEMM, [W; Q~] S, so that S is packed once.
  buf_.lhs.topRows(m) = w;
  buf_.ws.topRows(2 * m).noalias() = buf_.lhs.topRows(2 * m) * state;
  buf_.uv.topRows(m) = u + buf_.ws.topRows(m);
  buf_.uv.middleRows(m, m) = v;
  auto out = buf_.out.topRows(m);
  out = buf_.ws.middleRows(m, m);
  // What the pairs' GEMMs wrote above the diagonals is not a pair: triangular products.
  out.noalias() +=
      buf_.qb.topLeftCorner(m, m).template triangularView<Eigen::Lower>() * buf_.uv.topRows(m);
  out.noalias() += buf_.qk.topLeftCorner(m, m).template triangularView<Eigen::Lower>() * v;
  state.array().colwise() *= buf_.last.array();
  state.noalias() += buf_.bk.topRows(2 * m).transpose() * buf_.uv.topRows(2 * m);
}

template <class T, class O>
void DplrKernel<T, O>::run(const ChunkSource<T>& src, const PairRows<T>& pairs, Matrix<T>& state,
                           OutRows<O>* out) {
  Eigen::Index len = 0;
  for (Eigen::Index begin = 0; begin < src.rows(); begin += len) {
    len = std::min(chunk_, src.rows() - begin);
    src.load_queries(begin, len, buf_.io);
    src.load_keys_values(begin, len, buf_.io);
    pairs.load(begin, len, buf_.a, buf_.b);
    buf_.io.q.topRows(len) *= scale_;
    buf_.log_gate.resize(chunk_, src.gate_dim());
    src.load_log_gates(begin, len, buf_.log_gate);
    // Pieces end before each token that resets a row (a log gate of -infinity): that token
    // runs as a step, whose low-rank term still reads the row before it is forgotten.
    Eigen::Index piece = 0;
    while (piece < len) {
      Eigen::Index end = piece;
      while (end < len && !has_reset(end)) ++end;
      if (end > piece) {
        run_piece(piece, end - piece, state);
        if (out != nullptr) {
          OutRows<O> rows(out->middleRows(begin + piece, end - piece));
          store_rows<O>(buf_.out, end - piece, rows);
        }
      } else {
        step_token(piece, state);
        ++end;
        if (out != nullptr) {
          OutRows<O> rows(out->middleRows(begin + piece, 1));
          store_rows<O>(buf_.out, 1, rows);
        }
      }
      piece = end;
    }
  }
}

}  // namespace linattn::detail

#include <linattn/detail/compiled.hpp>  // the compiled mode's declarations, after the definitions
#ifdef LINATTN_COMPILED
#define LINATTN_DECLARE_DPLR_KERNELS(T, O) LINATTN_DPLR_INSTANCES(extern template, T, O)
LINATTN_KERNEL_TYPES(LINATTN_DECLARE_DPLR_KERNELS)
#undef LINATTN_DECLARE_DPLR_KERNELS
LINATTN_DPLR_STEP_INSTANCES(extern template, float)
LINATTN_DPLR_STEP_INSTANCES(extern template, double)
#endif
