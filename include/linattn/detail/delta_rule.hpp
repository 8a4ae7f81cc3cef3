// SPDX-License-Identifier: MIT
// The delta rule's two forms on one state S (Dk x Dv): the chunked WY form (every product a
// GEMM) and the one-token step, for DeltaNet (no gates), Gated DeltaNet (a scalar log gate per
// token) and KDA (a log gate per token and key feature).
// Written as FLA runs it: the decay first, S'_t = diag(a_t) S_{t-1}, then the delta on the
// decayed state,
//     S_t = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T,   out_t = S_t^T (s q_t).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/gates.hpp>
#include <string>
#include <type_traits>

namespace linattn::detail {

/// Added under the square root of the in-kernel L2 normalisation, as FLA's l2norm.
inline constexpr double kL2NormEps = 1e-6;

/// Key sub-block of KDA's in-chunk products: pairs of tokens in one sub-block get their decays
/// one by one, pairs across sub-blocks through a GEMM on factors that are both <= 1.
inline constexpr Eigen::Index kDeltaSubBlock = 16;

/// s: DeltaOptions::scale, or Dk^-1/2 when it is negative.
inline double delta_scale(const DeltaOptions& options, Eigen::Index key_dim) {
  return options.scale < 0.0 ? 1.0 / std::sqrt(static_cast<double>(key_dim)) : options.scale;
}

/// The engine's Options for the checks the delta rule shares with it (chunk, scan, threads).
inline Options engine_options(const DeltaOptions& options) {
  Options engine;
  engine.chunk = options.chunk;
  engine.check_finite = options.check_finite;
  engine.threads = options.threads;
  return engine;
}

/// Throws unless the options are in range; `where` names the calling function.
inline void validate_delta_options(const DeltaOptions& options, const char* where) {
  if (!(options.scale < 0.0 || options.scale > 0.0) || !std::isfinite(options.scale)) {
    throw Error(std::string(where) +
                ": DeltaOptions::scale must be finite and > 0, or negative for Dk^-1/2, got " +
                std::to_string(options.scale));
  }
  validate_options(engine_options(options), where);
}

/// The largest beta the options allow: 1, or 2 with negative eigenvalues.
inline double max_beta(const DeltaOptions& options) {
  return options.allow_negative_eigenvalues ? 2.0 : 1.0;
}

/// Throws naming the first beta outside (0, max_beta] (NaN included) by its token.
template <class Derived>
void require_beta_in_range(const Eigen::MatrixBase<Derived>& beta, const DeltaOptions& options,
                           const char* where, const std::string& name = "beta") {
  const double top = max_beta(options);
  for (Eigen::Index i = 0; i < beta.size(); ++i) {
    const double b = static_cast<double>(beta.reshaped()(i));
    if (!(b > 0.0 && b <= top)) {
      throw Error(std::string(where) + ": " + name + " must lie in (0, " +
                  (top == 1.0 ? "1" : "2") + "]" +
                  (top == 1.0 ? " (or (0, 2] with DeltaOptions::allow_negative_eigenvalues)" : "") +
                  ", got " + std::to_string(b) + " at token " + std::to_string(i));
    }
  }
}

/// Throws unless beta is a vector of `tokens` entries, each in range.
template <class Derived>
void validate_beta(const Eigen::MatrixBase<Derived>& beta, Eigen::Index tokens,
                   const DeltaOptions& options, const char* where) {
  require_vector(beta, tokens, where, "beta");
  require_beta_in_range(beta, options, where);
}

/// How messages name a delta-rule state's transition.
inline const char* delta_transition_name(TransitionKind kind) {
  switch (kind) {
    case TransitionKind::decay:
      return "no gates (DeltaNet)";
    case TransitionKind::scalar_gates:
      return "scalar gates (Gated DeltaNet)";
    case TransitionKind::feature_gates:
      return "per-feature gates (KDA)";
    default:
      return "no transition yet";
  }
}

/// Where the delta kernel reads beta_t, one chunk at a time, in the accumulation type.
template <class T>
class BetaRows {
 public:
  BetaRows(const BetaRows&) = delete;
  BetaRows& operator=(const BetaRows&) = delete;
  /// dst.head(len) = beta of tokens [begin, begin + len).
  virtual void load(Eigen::Index begin, Eigen::Index len, Vector<T>& dst) const = 0;

 protected:
  BetaRows() = default;
  ~BetaRows() = default;
};

/// BetaRows over a caller's vector expression (a row or a column).
template <class T, class DB>
class BetaVector final : public BetaRows<T> {
 public:
  explicit BetaVector(const DB& beta) : beta_(beta) {}
  void load(Eigen::Index begin, Eigen::Index len, Vector<T>& dst) const override {
    for (Eigen::Index i = 0; i < len; ++i) {
      dst(i) = static_cast<T>(beta_.reshaped()(begin + i));
    }
  }

 private:
  const DB& beta_;
};

/// x <- x / sqrt(|x|^2 + kL2NormEps), in place: FLA's l2norm of one token's q or k.
template <class Derived>
void l2_normalize(Eigen::MatrixBase<Derived>& x) {
  using T = typename Derived::Scalar;
  x *= static_cast<T>(1.0 / std::sqrt(static_cast<double>(x.squaredNorm()) + kL2NormEps));
}

/// l2_normalize on rows [0, rows) of x.
template <class T>
void l2_normalize_rows(Matrix<T>& x, Eigen::Index rows) {
  for (Eigen::Index r = 0; r < rows; ++r) {
    auto row = x.row(r);
    l2_normalize(row);
  }
}

/// Per-call workspace of the chunked form, sized by the chunk length, never by N.
template <class T>
struct DeltaBuffers {
  using Array = Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  ChunkBuffers<T> io;  ///< q, k, v of the chunk (L x Dk, L x Dk, L x Dv)
  Vector<T> beta;      ///< L
  LogRows log_gate;    ///< L x G: the chunk's log gates, G = 1 or Dk
  LogRows cum;         ///< L x G: log gates summed within a piece
  Matrix<T> attn;      ///< L x L: decayed q_i . k_j, i >= j
  Matrix<T> kk;        ///< L x L: beta_i times the decayed k_i . k_j, i > j
  Matrix<T> wu;        ///< L x (Dk + Dv): [W U], solved in place
  Matrix<T> qg, kd;    ///< L x Dk: decayed queries; keys decayed to the piece's end
  Matrix<T> out;       ///< L x Dv
  Array factor;        ///< L x Dk: decays of one sub-block
  Array right;         ///< L x Dk: decayed keys of the earlier sub-blocks
  Vector<T> last;      ///< Dk: the piece's total decay per key feature

  DeltaBuffers(Eigen::Index chunk, Eigen::Index key_dim, Eigen::Index value_dim)
      : io(chunk, key_dim, value_dim),
        beta(chunk),
        attn(chunk, chunk),
        kk(chunk, chunk),
        wu(chunk, key_dim + value_dim),
        qg(chunk, key_dim),
        kd(chunk, key_dim),
        out(chunk, value_dim),
        last(key_dim) {}
};

/// The delta rule over a sequence, chunk by chunk, on a state S (Dk x Dv) carried in and out.
/// Per piece of m tokens (a chunk, split at hard resets) with in-piece cumulative log gates
/// G_i and decays D_ij = exp(G_i - G_j):
///     A = tril(diag(beta) (K K^T o D), -1),   [W U] = (I + A)^-1 diag(beta) [exp(G) o K, V]
///     V~ = U - W S,   O = (exp(G) o Q) S + (Q K^T o D o M) V~,
///     S <- exp(G_m) S + (exp(G_m - G) o K)^T V~
/// every product a GEMM, the unit-triangular solve in T, every decay the exp of a difference.
/// T is the accumulation type, O the output's scalar.
template <class T, class O>
class DeltaKernel {
 public:
  /// s (DeltaOptions::scale) multiplies the queries after their normalisation.
  DeltaKernel(Eigen::Index rows, Eigen::Index key_dim, Eigen::Index value_dim,
              const DeltaOptions& options)
      : chunk_(std::max<Eigen::Index>(1, std::min(options.chunk, rows))),
        scale_(static_cast<T>(delta_scale(options, key_dim))),
        l2_normalize_(options.l2_normalize),
        buf_(chunk_, key_dim, value_dim) {}

  /// Runs every token of `src` (q, k, v as raw rows, gates attached when gated) with `beta`,
  /// from `state` on, leaving it after the last token. out: N x Dv, or null for the state only.
  void run(const ChunkSource<T>& src, const BetaRows<T>& beta, Matrix<T>& state, OutRows<O>* out) {
    const Eigen::Index gates = src.gate_dim();
    Eigen::Index len = 0;
    for (Eigen::Index begin = 0; begin < src.rows(); begin += len) {
      len = std::min(chunk_, src.rows() - begin);
      src.load_queries(begin, len, buf_.io);
      src.load_keys_values(begin, len, buf_.io);
      beta.load(begin, len, buf_.beta);
      if (l2_normalize_) {
        l2_normalize_rows(buf_.io.q, len);
        l2_normalize_rows(buf_.io.k, len);
      }
      buf_.io.q.topRows(len) *= scale_;
      if (gates > 0) {
        buf_.log_gate.resize(chunk_, gates);
        src.load_log_gates(begin, len, buf_.log_gate);
      }
      // Pieces end before each hard reset (a gate of exactly 0): the reset zeroes the state
      // (or its rows, per feature) and the token continues with a gate of 1 on the rest.
      Eigen::Index piece = 0;
      while (piece < len) {
        if (gates > 0) apply_resets(piece, state);
        Eigen::Index end = piece + 1;
        while (end < len && (gates == 0 || !has_reset(end))) ++end;
        run_piece(piece, end - piece, gates, state);
        if (out != nullptr) {
          OutRows<O> rows(out->middleRows(begin + piece, end - piece));
          store_rows<O>(buf_.out, end - piece, rows);
        }
        piece = end;
      }
    }
  }

 private:
  bool has_reset(Eigen::Index r) const {
    return (buf_.log_gate.row(r) == -std::numeric_limits<double>::infinity()).any();
  }

  /// Row r's hard resets: the state (scalar gates) or its rows (per feature) forgotten, and
  /// those log gates set to 0.
  void apply_resets(Eigen::Index r, Matrix<T>& state) {
    constexpr double minus_inf = -std::numeric_limits<double>::infinity();
    for (Eigen::Index c = 0; c < buf_.log_gate.cols(); ++c) {
      if (buf_.log_gate(r, c) != minus_inf) continue;
      if (buf_.log_gate.cols() == 1) {
        state.setZero();
      } else {
        state.row(c).setZero();
      }
      buf_.log_gate(r, c) = 0.0;
    }
  }

  /// Tokens [p, p + m) of the loaded chunk, none a reset but (already applied) the first.
  void run_piece(Eigen::Index p, Eigen::Index m, Eigen::Index gates, Matrix<T>& state) {
    const Eigen::Index dk = state.rows();
    const Eigen::Index dv = state.cols();
    const auto q = buf_.io.q.middleRows(p, m);
    const auto k = buf_.io.k.middleRows(p, m);
    auto attn = buf_.attn.topLeftCorner(m, m);
    auto kk = buf_.kk.topLeftCorner(m, m);
    auto w = buf_.wu.block(0, 0, m, dk);
    auto u = buf_.wu.block(0, dk, m, dv);
    u = buf_.io.v.middleRows(p, m);
    if (gates <= 1) {
      attn.noalias() = q * k.transpose();
      kk.noalias() = k * k.transpose();
    }
    if (gates == 0) {
      w = k;
    } else if (gates == 1) {
      scalar_decays(p, m);
    } else {
      feature_decays(p, m);
    }
    // A = beta_i times the strictly lower part of kk; the solve reads nothing else of it.
    kk.array().colwise() *= buf_.beta.segment(p, m).array();
    w.array().colwise() *= buf_.beta.segment(p, m).array();
    u.array().colwise() *= buf_.beta.segment(p, m).array();
    buf_.kk.topLeftCorner(m, m).template triangularView<Eigen::UnitLower>().solveInPlace(
        buf_.wu.topRows(m));
    u.noalias() -= w * state;  // V~
    auto out = buf_.out.topRows(m);
    // Without gates nothing decays: the queries and keys as loaded.
    const auto decayed_q = gates == 0 ? q : buf_.qg.topRows(m);
    const auto decayed_k = gates == 0 ? k : buf_.kd.topRows(m);
    out.noalias() = decayed_q * state;
    out.noalias() += attn.template triangularView<Eigen::Lower>() * u;
    if (gates == 1) {
      state *= buf_.last(0);
    } else if (gates > 1) {
      state.array().colwise() *= buf_.last.array();
    }
    state.noalias() += decayed_k.transpose() * u;
  }

  /// One gate per token: decays of pairs, of queries, of keys to the end (all <= 1).
  void scalar_decays(Eigen::Index p, Eigen::Index m) {
    buf_.cum.resize(chunk_, 1);
    double sum = 0.0;
    for (Eigen::Index i = 0; i < m; ++i) buf_.cum(i, 0) = sum += buf_.log_gate(p + i, 0);
    for (Eigen::Index i = 0; i < m; ++i) {
      for (Eigen::Index j = 0; j <= i; ++j) {
        const T d = exp_as<T>(buf_.cum(i, 0) - buf_.cum(j, 0));
        buf_.attn(i, j) *= d;
        buf_.kk(i, j) *= d;
      }
      const T to_query = exp_as<T>(buf_.cum(i, 0));
      const T to_end = exp_as<T>(buf_.cum(m - 1, 0) - buf_.cum(i, 0));
      buf_.qg.row(i) = to_query * buf_.io.q.row(p + i);
      buf_.wu.row(i).head(buf_.qg.cols()) = to_query * buf_.io.k.row(p + i);
      buf_.kd.row(i) = to_end * buf_.io.k.row(p + i);
    }
    buf_.last(0) = exp_as<T>(buf_.cum(m - 1, 0));
  }

  /// One gate per token and key feature (KDA). In-piece products by sub-blocks of
  /// kDeltaSubBlock tokens: pairs across sub-blocks through one GEMM per sub-block on keys
  /// decayed to and from the token before it (both factors <= 1), pairs within one directly.
  void feature_decays(Eigen::Index p, Eigen::Index m) {
    const Eigen::Index dk = buf_.io.k.cols();
    buf_.cum.resize(chunk_, dk);
    buf_.cum.row(0) = buf_.log_gate.row(p);
    for (Eigen::Index i = 1; i < m; ++i)
      buf_.cum.row(i) = buf_.cum.row(i - 1) + buf_.log_gate.row(p + i);
    const auto q = buf_.io.q.middleRows(p, m).array();
    const auto k = buf_.io.k.middleRows(p, m).array();
    const auto cum = buf_.cum.topRows(m);
    buf_.factor.resize(chunk_, dk);
    buf_.right.resize(chunk_, dk);
    // Decays from the piece's start (queries and W's keys) and to its end (the state update).
    buf_.factor.topRows(m) = cum.template cast<T>().exp();
    buf_.qg.topRows(m).array() = q * buf_.factor.topRows(m);
    buf_.wu.topLeftCorner(m, dk).array() = k * buf_.factor.topRows(m);
    buf_.last = buf_.factor.row(m - 1).transpose().matrix();
    buf_.kd.topRows(m).array() =
        k * (cum.row(m - 1).replicate(m, 1) - cum).template cast<T>().exp();
    for (Eigen::Index i0 = 0; i0 < m; i0 += kDeltaSubBlock) {
      const Eigen::Index b = std::min(kDeltaSubBlock, m - i0);
      if (i0 > 0) {
        // Through token r = i0 - 1: exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j).
        const auto ref = cum.row(i0 - 1);
        buf_.right.topRows(i0) =
            k.topRows(i0) * (ref.replicate(i0, 1) - cum.topRows(i0)).template cast<T>().exp();
        buf_.factor.topRows(b) =
            (cum.middleRows(i0, b) - ref.replicate(b, 1)).template cast<T>().exp();
        const auto right = buf_.right.topRows(i0).matrix();
        buf_.attn.block(i0, 0, b, i0).noalias() =
            (q.middleRows(i0, b) * buf_.factor.topRows(b)).matrix() * right.transpose();
        buf_.kk.block(i0, 0, b, i0).noalias() =
            (k.middleRows(i0, b) * buf_.factor.topRows(b)).matrix() * right.transpose();
      }
      for (Eigen::Index i = i0; i < i0 + b; ++i) {
        for (Eigen::Index j = i0; j <= i; ++j) {
          buf_.factor.row(0) = (cum.row(i) - cum.row(j)).template cast<T>().exp();
          buf_.attn(i, j) = (q.row(i) * k.row(j) * buf_.factor.row(0)).sum();
          buf_.kk(i, j) = (k.row(i) * k.row(j) * buf_.factor.row(0)).sum();
        }
      }
    }
  }

  Eigen::Index chunk_;
  T scale_;
  bool l2_normalize_;
  DeltaBuffers<T> buf_;
};

/// Workspace of one token's step: the token in T and the prediction S'^T k.
template <class T>
struct DeltaStepBuffers {
  Vector<T> q, k, v, gate, pred, out;
  DeltaStepBuffers(Eigen::Index key_dim, Eigen::Index value_dim)
      : q(key_dim), k(key_dim), v(value_dim), gate(key_dim), pred(value_dim), out(value_dim) {}
};

/// One token on `state` from buf.q, buf.k (normalised and scaled already), buf.v, `beta`, and
/// buf.gate's first `gates` entries (0: none, 1: scalar, Dk: per feature; a_t, 0 resets);
/// buf.out = S_t^T q. Two passes over S: the prediction, then the update with the readout.
template <class T>
void delta_step(Matrix<T>& state, DeltaStepBuffers<T>& buf, T beta, Eigen::Index gates) {
  // pred = S'^T k with S' = diag(a) S; u = beta (v - pred) in buf.pred.
  if (gates > 1) {
    buf.pred.noalias() = state.transpose() * (buf.gate.array() * buf.k.array()).matrix();
  } else {
    buf.pred.noalias() = state.transpose() * buf.k;
    if (gates == 1) buf.pred *= buf.gate(0);
  }
  buf.pred = beta * (buf.v - buf.pred);
  buf.out.setZero();
  for (Eigen::Index d = 0; d < state.rows(); ++d) {
    auto row = state.row(d);
    if (gates == 1) {
      row = buf.gate(0) * row + buf.k(d) * buf.pred.transpose();
    } else if (gates > 1) {
      row = buf.gate(d) * row + buf.k(d) * buf.pred.transpose();
    } else {
      row += buf.k(d) * buf.pred.transpose();
    }
    buf.out += buf.q(d) * row.transpose();
  }
}

}  // namespace linattn::detail
