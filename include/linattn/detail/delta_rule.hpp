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
#include <utility>
#include <vector>

namespace linattn::detail {

/// Added under the square root of the in-kernel L2 normalisation, as FLA's l2norm.
inline constexpr double kL2NormEps = 1e-6;

/// Key sub-block of KDA's in-chunk products: pairs of tokens in one sub-block get their decays
/// one by one, pairs across sub-blocks through a GEMM on factors that are both <= 1.
inline constexpr Eigen::Index kDeltaSubBlock = 16;

/// The largest total log decay within one KDA sub-block whose pairs still go through a GEMM:
/// its factors lie in [e^-20, e^20], far from float's range limits, and carry the relative
/// precision of a direct exp.
inline constexpr double kDeltaSpread = 20.0;

/// Value columns below this per thread are not split further (each part repeats the
/// key-side work: K K^T, the solve for W, Q K^T; the generalized rule's pairs alike).
inline constexpr Eigen::Index kDeltaMinColumnsPerThread = 32;

/// s: DeltaOptions::scale, or Dk^-1/2 when it is negative.
inline double delta_scale(const DeltaOptions& options, Eigen::Index key_dim) {
  return options.scale < 0.0 ? 1.0 / std::sqrt(static_cast<double>(key_dim)) : options.scale;
}

/// The engine's Options for the code the delta rule shares with it (scans, threads, heads):
/// the shared KernelOptions, whatever they grow to, and the engine's defaults.
inline Options engine_options(const DeltaOptions& options) {
  Options engine;
  static_cast<KernelOptions&>(engine) = options;
  return engine;
}

/// Throws unless the options are in range; `where` names the calling function.
inline void validate_delta_options(const DeltaOptions& options, const char* where) {
  if (!(options.scale < 0.0 || options.scale > 0.0) || !std::isfinite(options.scale)) {
    throw Error(std::string(where) +
                ": DeltaOptions::scale must be finite and > 0, or negative for Dk^-1/2, got " +
                std::to_string(options.scale));
  }
  validate_kernel_options(options, where, "DeltaOptions");
}

/// The largest beta the options allow: 1, or 2 with negative eigenvalues.
inline double max_beta(const DeltaOptions& options) {
  return options.allow_negative_eigenvalues ? 2.0 : 1.0;
}

/// Throws naming the first beta outside (0, max_beta] (NaN included) by its index, called
/// `entry` in the message (a token; a state, in a batch step).
template <class Derived>
void require_beta_in_range(const Eigen::MatrixBase<Derived>& beta, const DeltaOptions& options,
                           const char* where, const std::string& name = "beta",
                           const char* entry = "token") {
  const double top = max_beta(options);
  for (Eigen::Index i = 0; i < beta.size(); ++i) {
    const double b = static_cast<double>(beta.reshaped()(i));
    if (!(b > 0.0 && b <= top)) {
      throw Error(std::string(where) + ": " + name + " must lie in (0, " +
                  (top == 1.0 ? "1" : "2") + "]" +
                  (top == 1.0 ? " (or (0, 2] with DeltaOptions::allow_negative_eigenvalues)" : "") +
                  ", got " + std::to_string(b) + " at " + entry + " " + std::to_string(i));
    }
  }
}

/// The largest beta |k|^2 of a step on keys the kernel does not normalise: I - beta k k^T has
/// the eigenvalue 1 - beta |k|^2 along k, outside [-1, 1] past 2, and then S grows without
/// bound (outputs of 1e7 and more). The slack admits keys the caller normalised in float or a
/// 16-bit type and beta at 2 (allow_negative_eigenvalues).
inline constexpr double kMaxStepGain = 2.0 * (1.0 + 1e-3);

/// The precision of the stability check's norms: float but for double keys (the slack of
/// kMaxStepGain dwarfs float's rounding).
template <class Scalar>
using step_gain_t = std::conditional_t<std::is_same_v<Scalar, double>, double, float>;

/// max_t beta_t |k_t|^2 over the rows of k in one vectorised pass; NaN when any is NaN.
template <class DK, class DB>
double largest_step_gain(const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DB>& beta) {
  using Work = step_gain_t<typename DK::Scalar>;
  if (k.rows() == 0) return 0.0;
  return static_cast<double>((k.template cast<Work>().rowwise().squaredNorm().array() *
                              beta.reshaped().template cast<Work>().array())
                                 .template maxCoeff<Eigen::PropagateNaN>());
}

/// Throws unless every beta_t |k_t|^2 <= kMaxStepGain (rows t of k, entries of beta) when the
/// options leave the keys as given (l2_normalize off); NaN passes (check_finite's to report).
/// `entry` names a row in the message (a token; a state, in a batch step).
template <class DK, class DB>
void require_stable_steps(const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DB>& beta,
                          const DeltaOptions& options, const char* where,
                          const std::string& k_name = "k", const char* entry = "token") {
  if (options.l2_normalize) return;
  // Only a failing call (or one with a NaN, which passes itself) looks for the first such
  // token, in double.
  if (largest_step_gain(k, beta) <= kMaxStepGain) return;
  for (Eigen::Index t = 0; t < k.rows(); ++t) {
    const double b = static_cast<double>(beta.reshaped()(t));
    const double norm2 = k.row(t).template cast<double>().squaredNorm();
    if (b * norm2 > kMaxStepGain) {
      throw Error(std::string(where) + ": beta |k|^2 is " + std::to_string(b * norm2) + " at " +
                  entry + " " + std::to_string(t) + " of " + k_name + " (beta " +
                  std::to_string(b) + ", |k|^2 " + std::to_string(norm2) +
                  "), above 2: the step I - beta k k^T then grows the state without bound. Set "
                  "DeltaOptions::l2_normalize (FLA's use_qk_l2norm_in_kernel, as every released "
                  "model does) or pass keys with beta |k|^2 <= 2");
    }
  }
}

/// One token's checks after its shapes and beta: with check_finite, q, k and v finite; without
/// l2_normalize, beta |k|^2 <= kMaxStepGain. k's squared norm serves both (it is finite exactly
/// when k is, barring overflow, which the stability check reports), so a decoding step reads k
/// once.
template <class DQ, class DK, class DV>
void scan_delta_token(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                      const Eigen::MatrixBase<DV>& v, double beta, const DeltaOptions& options,
                      const char* where) {
  using Work = step_gain_t<typename DK::Scalar>;
  const bool stability = !options.l2_normalize;
  const double norm2 = stability ? static_cast<double>(k.template cast<Work>().squaredNorm()) : 0.0;
  if (options.check_finite) {
    require_finite(q, where, "q");
    if (!stability || !std::isfinite(norm2)) require_finite(k, where, "k");
    require_finite(v, where, "v");
  }
  if (stability && !(beta * norm2 <= kMaxStepGain)) {  // throws unless a NaN slipped through
    require_stable_steps(k.reshaped().transpose(), Eigen::Matrix<double, 1, 1>::Constant(beta),
                         options, where);
  }
}

/// True when two options give the same numbers for keys of `key_dim`: the scale as resolved,
/// l2_normalize and allow_negative_eigenvalues (chunk, form, threads and check_finite do not).
inline bool same_delta_results(const DeltaOptions& a, const DeltaOptions& b, Eigen::Index key_dim) {
  return delta_scale(a, key_dim) == delta_scale(b, key_dim) && a.l2_normalize == b.l2_normalize &&
         a.allow_negative_eigenvalues == b.allow_negative_eigenvalues;
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

/// gates[i] = exp(gates[i]) for n log gates in T, one vectorised exp (an exp of a cast expression,
/// or one std::exp at a time, was 30-40% of KDA's prefill and step). Eigen's vectorised exp stops
/// at the smallest normal number, so a reset (-infinity) would not give 0: gates holding one
/// (a document boundary, rare) take the scalar exp instead, exact 0 included.
template <class T>
void exp_log_gates(T* gates, Eigen::Index n) {
  Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> logs(gates, n);
  constexpr T kReset = -std::numeric_limits<T>::infinity();
  if (n == 0 || logs.minCoeff() > kReset) {
    logs = logs.exp();
    return;
  }
  for (Eigen::Index i = 0; i < n; ++i) gates[i] = gates[i] == kReset ? T(0) : std::exp(gates[i]);
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

/// BetaRows over a caller's vector expression (a row or a column) from its entry `first` on.
template <class T, class DB>
class BetaVector final : public BetaRows<T> {
 public:
  explicit BetaVector(const DB& beta, Eigen::Index first = 0) : beta_(beta), first_(first) {}
  void load(Eigen::Index begin, Eigen::Index len, Vector<T>& dst) const override {
    for (Eigen::Index i = 0; i < len; ++i) {
      dst(i) = static_cast<T>(beta_.reshaped()(first_ + begin + i));
    }
  }

 private:
  const DB& beta_;
  Eigen::Index first_;
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
  LogRows ref;         ///< 1 x Dk: G at a KDA sub-block's reference token
  LogRows spread;      ///< L x Dk: differences of G, converted to T as a whole buffer
  Matrix<T> attn;      ///< L x L: decayed q_i . k_j, i >= j
  Matrix<T> kk;        ///< L x L: beta_i times the decayed k_i . k_j, i > j
  Matrix<T> wu;        ///< L x (Dk + Dv): [W U], solved in place
  Matrix<T> lhs;       ///< 2L x Dk: [W; exp(G) o Q], the rows multiplied by S in one GEMM
  Matrix<T> ws;        ///< 2L x Dv: [W S; (exp(G) o Q) S]
  Matrix<T> kd;        ///< L x Dk: keys decayed to the piece's end
  Matrix<T> out;       ///< L x Dv
  Array factor;        ///< L x max(L, Dk): decays of a row (scalar gates) or of a sub-block
  Array right;         ///< L x Dk: keys decayed to a KDA sub-block's reference token
  Array left;          ///< 2B x Dk: a KDA sub-block's queries and keys decayed from it
  Matrix<T> pairs;     ///< 2B x L: their products with `right`
  Vector<T> last;      ///< Dk: the piece's total decay per key feature

  DeltaBuffers(Eigen::Index chunk, Eigen::Index key_dim, Eigen::Index value_dim)
      : io(chunk, key_dim, value_dim),
        beta(chunk),
        attn(chunk, chunk),
        kk(chunk, chunk),
        wu(chunk, key_dim + value_dim),
        lhs(2 * chunk, key_dim),
        ws(2 * chunk, value_dim),
        kd(chunk, key_dim),
        out(chunk, value_dim),
        pairs(2 * std::min(chunk, kDeltaSubBlock), chunk),
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
  void run(const ChunkSource<T>& src, const BetaRows<T>& beta, Matrix<T>& state, OutRows<O>* out);

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
      buf_.lhs.middleRows(m, m) = q;
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
    // Both products with S in one GEMM, [W; exp(G) o Q] S, so that S is packed once.
    buf_.lhs.topRows(m) = w;
    buf_.ws.topRows(2 * m).noalias() = buf_.lhs.topRows(2 * m) * state;
    u -= buf_.ws.topRows(m);  // V~
    auto out = buf_.out.topRows(m);
    out = buf_.ws.middleRows(m, m);
    out.noalias() += attn.template triangularView<Eigen::Lower>() * u;
    // Without gates nothing decays: the keys as loaded.
    const auto decayed_k = gates == 0 ? k : buf_.kd.topRows(m);
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
    const auto cum = buf_.cum.col(0).head(m);
    buf_.factor.resize(chunk_, std::max(chunk_, buf_.io.k.cols()));
    for (Eigen::Index i = 0; i < m; ++i) {
      // exp(G_i - G_j) for j <= i, one vectorised exp per row.
      auto d = buf_.factor.row(0).head(i + 1);
      d = (cum(i) - cum.head(i + 1).transpose()).template cast<T>().exp();
      buf_.attn.row(i).head(i + 1).array() *= d;
      buf_.kk.row(i).head(i + 1).array() *= d;
      const T to_query = exp_as<T>(buf_.cum(i, 0));
      const T to_end = exp_as<T>(buf_.cum(m - 1, 0) - buf_.cum(i, 0));
      buf_.lhs.row(m + i) = to_query * buf_.io.q.row(p + i);
      buf_.wu.row(i).head(buf_.io.k.cols()) = to_query * buf_.io.k.row(p + i);
      buf_.kd.row(i) = to_end * buf_.io.k.row(p + i);
    }
    buf_.last(0) = exp_as<T>(buf_.cum(m - 1, 0));
  }

  /// One gate per token and key feature (KDA). In-piece products by sub-blocks of
  /// kDeltaSubBlock tokens, each row block through one GEMM against the keys up to its end, on
  /// factors referred to the token r before the sub-block (G_r = 0 before the piece):
  /// exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), the first <= 1, the second <= 1 for
  /// j <= r and at most e^kDeltaSpread inside the sub-block. A sub-block whose gates spread
  /// further computes its own pairs directly.
  void feature_decays(Eigen::Index p, Eigen::Index m) {
    const Eigen::Index dk = buf_.io.k.cols();
    buf_.cum.resize(chunk_, dk);
    buf_.cum.row(0) = buf_.log_gate.row(p);
    for (Eigen::Index i = 1; i < m; ++i)
      buf_.cum.row(i) = buf_.cum.row(i - 1) + buf_.log_gate.row(p + i);
    const auto q = buf_.io.q.middleRows(p, m).array();
    const auto k = buf_.io.k.middleRows(p, m).array();
    const auto cum = buf_.cum.topRows(m);
    buf_.factor.resize(chunk_, std::max(chunk_, dk));
    buf_.right.resize(chunk_, dk);
    buf_.left.resize(2 * chunk_, dk);
    // Decays from the piece's start (queries and W's keys) and to its end (the state update).
    // Every exp on a T buffer, vectorised (an exp of a cast expression runs scalar expf).
    auto from_start = buf_.factor.topLeftCorner(m, dk);
    from_start = cum.template cast<T>();
    from_start = from_start.exp();
    buf_.lhs.middleRows(m, m).array() = q * from_start;
    buf_.wu.topLeftCorner(m, dk).array() = k * from_start;
    buf_.last = from_start.row(m - 1).transpose().matrix();
    // Differences of G formed in double first, broadcast row by row: a cast of the difference
    // itself, or a difference with replicate(), runs one element at a time.
    buf_.spread.resize(chunk_, dk);
    buf_.spread.topRows(m) = (-cum).rowwise() + cum.row(m - 1);
    buf_.kd.topRows(m).array() = buf_.spread.topRows(m).template cast<T>();
    buf_.kd.topRows(m).array() = k * buf_.kd.topRows(m).array().exp();
    for (Eigen::Index i0 = 0; i0 < m; i0 += kDeltaSubBlock) {
      const Eigen::Index b = std::min(kDeltaSubBlock, m - i0);
      // G_r, 0 before the piece.
      buf_.ref.resize(1, dk);
      if (i0 > 0) {
        buf_.ref = cum.row(i0 - 1);
      } else {
        buf_.ref.setZero();
      }
      const double spread = (buf_.ref - cum.row(i0 + b - 1)).maxCoeff();
      const bool inside = spread <= kDeltaSpread;
      const Eigen::Index width = inside ? i0 + b : i0;
      if (width > 0) {
        buf_.spread.topRows(width) = (-cum.topRows(width)).rowwise() + buf_.ref.row(0);
        buf_.right.topRows(width) = buf_.spread.topRows(width).template cast<T>();
        buf_.right.topRows(width) = k.topRows(width) * buf_.right.topRows(width).exp();
        auto to_ref = buf_.factor.topLeftCorner(b, dk);
        buf_.spread.topRows(b) = cum.middleRows(i0, b).rowwise() - buf_.ref.row(0);
        to_ref = buf_.spread.topRows(b).template cast<T>();
        to_ref = to_ref.exp();
        buf_.left.topRows(b) = q.middleRows(i0, b) * to_ref;
        buf_.left.middleRows(b, b) = k.middleRows(i0, b) * to_ref;
        const auto right = buf_.right.topRows(width).matrix();
        // Rows of attn and kk together: [q; k] of the sub-block times the keys to its end.
        buf_.pairs.topLeftCorner(2 * b, width).noalias() =
            buf_.left.topRows(2 * b).matrix() * right.transpose();
        buf_.attn.block(i0, 0, b, width) = buf_.pairs.topLeftCorner(b, width);
        buf_.kk.block(i0, 0, b, width) = buf_.pairs.block(b, 0, b, width);
      }
      if (inside) continue;
      for (Eigen::Index i = i0; i < i0 + b; ++i) {
        for (Eigen::Index j = i0; j <= i; ++j) {
          auto d = buf_.factor.row(0).head(dk);
          d = (cum.row(i) - cum.row(j)).template cast<T>().exp();
          buf_.attn(i, j) = (q.row(i) * k.row(j) * d).sum();
          buf_.kk(i, j) = (k.row(i) * k.row(j) * d).sum();
        }
      }
    }
  }

  Eigen::Index chunk_;
  T scale_;
  bool l2_normalize_;
  DeltaBuffers<T> buf_;
};

template <class T, class O>
void DeltaKernel<T, O>::run(const ChunkSource<T>& src, const BetaRows<T>& beta, Matrix<T>& state,
                            OutRows<O>* out) {
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

/// Workspace of one token's step: the token in T; the step leaves u = beta (v - S'^T k) in
/// pred (the backward pass reads it) and its output in out.
template <class T>
struct DeltaStepBuffers {
  Vector<T> q, k, v, gate, pred, out;
  DeltaStepBuffers() = default;
  DeltaStepBuffers(Eigen::Index key_dim, Eigen::Index value_dim) { resize(key_dim, value_dim); }
  void resize(Eigen::Index key_dim, Eigen::Index value_dim) {
    q.resize(key_dim);
    k.resize(key_dim);
    v.resize(value_dim);
    gate.resize(key_dim);
    pred.resize(value_dim);
    out.resize(value_dim);
  }
};

/// delta_step's strips: >= 128 bytes of a row (narrower ran up to 1.8x slower), <= 8 packets so
/// that the accumulators stay in registers.
template <class T>
struct DeltaStepShape {
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  static constexpr int kPacket = Eigen::internal::unpacket_traits<Packet>::size;
  static constexpr int kPackets = std::clamp(128 / static_cast<int>(sizeof(Packet)), 4, 8);
};

/// One token as a strip reads it: q^ and k^ (Dk, normalised and scaled), the gates a_t (1 or
/// Dk, unread without), and v, u (null: not kept) and the output from the strip's first column.
template <class T>
struct DeltaTokenRefs {
  const T* q;
  const T* k;
  const T* a;
  const T* v;
  T* u;
  T* out;
};

/// f(std::integral_constant<int, W>{}) for each W: unrolled even at -O2, so that packet arrays
/// indexed by W stay in registers.
template <class F, int... W>
void for_each_packet(std::integer_sequence<int, W...>, F&& f) {
  (f(std::integral_constant<int, W>{}), ...);
}

/// Columns [col, col + WP packets) of delta_step (columns evolve alone): the prediction down the
/// rows, then the update and readout back up them, so that it starts on rows still in L1.
template <TransitionKind Kind, class T, class Packet, int WP>
void delta_step_strip(T* const s, Eigen::Index rows, Eigen::Index lds,
                      const DeltaTokenRefs<T>& token, T beta) {
  using Eigen::internal::padd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pmul;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  using Eigen::internal::psub;
  constexpr int P = Eigen::internal::unpacket_traits<Packet>::size;
  constexpr auto packets = std::make_integer_sequence<int, WP>{};
  const T* const k = token.k;
  const T* const q = token.q;
  const T* const a = token.a;
  const Packet scalar_gate = pset1<Packet>(Kind == TransitionKind::scalar_gates ? a[0] : T(1));
  // Two rows a step, into two sets of accumulators: half the dependency chain.
  Packet even[WP], odd[WP], u[WP];
  for_each_packet(packets, [&](auto w) { even[w] = odd[w] = pset1<Packet>(T(0)); });
  // pred = S'^T k; per-feature gates fold into the key, a scalar gate multiplies the sum.
  const auto key = [&](Eigen::Index d) {
    return pset1<Packet>(Kind == TransitionKind::feature_gates ? a[d] * k[d] : k[d]);
  };
  Eigen::Index d = 0;
  for (; d + 1 < rows; d += 2) {
    const Packet k0 = key(d), k1 = key(d + 1);
    const T* const row = s + d * lds;
    for_each_packet(packets, [&](auto w) {
      even[w] = pmadd(k0, ploadu<Packet>(row + w * P), even[w]);
      odd[w] = pmadd(k1, ploadu<Packet>(row + lds + w * P), odd[w]);
    });
  }
  if (d < rows) {
    const Packet k0 = key(d);
    const T* const row = s + d * lds;
    for_each_packet(packets,
                    [&](auto w) { even[w] = pmadd(k0, ploadu<Packet>(row + w * P), even[w]); });
  }
  const Packet b = pset1<Packet>(beta);
  for_each_packet(packets, [&](auto w) {
    Packet pred = padd(even[w], odd[w]);
    if constexpr (Kind == TransitionKind::scalar_gates) pred = pmul(scalar_gate, pred);
    u[w] = pmul(b, psub(ploadu<Packet>(token.v + w * P), pred));
    if (token.u != nullptr) pstoreu<T>(token.u + w * P, u[w]);
    even[w] = odd[w] = pset1<Packet>(T(0));
  });
  // S = S' + k u^T and out = S^T q, from the last row back.
  const auto gate = [&](Eigen::Index d) {
    return Kind == TransitionKind::feature_gates ? pset1<Packet>(a[d]) : scalar_gate;
  };
  d = rows;
  for (; d > 1; d -= 2) {
    const Packet k0 = pset1<Packet>(k[d - 1]), k1 = pset1<Packet>(k[d - 2]);
    const Packet q0 = pset1<Packet>(q[d - 1]), q1 = pset1<Packet>(q[d - 2]);
    const Packet a0 = gate(d - 1), a1 = gate(d - 2);
    T* const row = s + (d - 2) * lds;
    for_each_packet(packets, [&](auto w) {
      Packet x0 = ploadu<Packet>(row + lds + w * P), x1 = ploadu<Packet>(row + w * P);
      if constexpr (Kind != TransitionKind::decay) {
        x0 = pmul(a0, x0);
        x1 = pmul(a1, x1);
      }
      x0 = pmadd(k0, u[w], x0);
      x1 = pmadd(k1, u[w], x1);
      pstoreu<T>(row + lds + w * P, x0);
      pstoreu<T>(row + w * P, x1);
      even[w] = pmadd(q0, x0, even[w]);
      odd[w] = pmadd(q1, x1, odd[w]);
    });
  }
  if (d == 1) {
    const Packet k0 = pset1<Packet>(k[0]), q0 = pset1<Packet>(q[0]), a0 = gate(0);
    for_each_packet(packets, [&](auto w) {
      Packet x0 = ploadu<Packet>(s + w * P);
      if constexpr (Kind != TransitionKind::decay) x0 = pmul(a0, x0);
      x0 = pmadd(k0, u[w], x0);
      pstoreu<T>(s + w * P, x0);
      even[w] = pmadd(q0, x0, even[w]);
    });
  }
  for_each_packet(packets, [&](auto w) { pstoreu<T>(token.out + w * P, padd(even[w], odd[w])); });
}

/// delta_step_strip over columns [col, cols) of the Dk rows at `s` (row stride lds) for each
/// token token_at(t), t in [0, tokens), a strip meeting every token before the next strip
/// starts: WP packets wide, then halving widths, then scalars.
template <TransitionKind Kind, int WP, class T, class TokenAt>
void delta_strips(T* s, Eigen::Index rows, Eigen::Index lds, Eigen::Index col, Eigen::Index cols,
                  Eigen::Index tokens, const TokenAt& token_at) {
  using Packet = typename DeltaStepShape<T>::Packet;
  constexpr Eigen::Index width = WP * DeltaStepShape<T>::kPacket;
  const auto run = [&](auto strip, Eigen::Index c) {
    for (Eigen::Index t = 0; t < tokens; ++t) {
      DeltaTokenRefs<T> token = token_at(t);
      token.v += c;
      if (token.u != nullptr) token.u += c;
      token.out += c;
      strip(s + c, token, token_at.beta(t));
    }
  };
  for (; col + width <= cols; col += width) {
    run([&](T* at, const DeltaTokenRefs<T>& token,
            T beta) { delta_step_strip<Kind, T, Packet, WP>(at, rows, lds, token, beta); },
        col);
  }
  if constexpr (WP > 1) {
    delta_strips<Kind, WP / 2>(s, rows, lds, col, cols, tokens, token_at);
  } else {
    for (; col < cols; ++col) {
      run([&](T* at, const DeltaTokenRefs<T>& token,
              T beta) { delta_step_strip<Kind, T, T, 1>(at, rows, lds, token, beta); },
          col);
    }
  }
}

/// The one token of delta_step, as delta_strips reads tokens.
template <class T>
struct StepTokenAt {
  DeltaStepBuffers<T>& buf;
  T step_beta;
  DeltaTokenRefs<T> operator()(Eigen::Index) const {
    return {buf.q.data(), buf.k.data(),    buf.gate.data(),
            buf.v.data(), buf.pred.data(), buf.out.data()};
  }
  T beta(Eigen::Index) const { return step_beta; }
};

/// delta_step in two sweeps over whole rows, for the row strides where strips 4K-alias.
template <class T>
void delta_step_rows(Matrix<T>& state, DeltaStepBuffers<T>& buf, T beta, Eigen::Index gates) {
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

/// One token on `state` from buf.q, buf.k (normalised and scaled already), buf.v, `beta`, and
/// buf.gate's first `gates` entries (0: none, 1: scalar, Dk: per feature; a_t, 0 resets);
/// buf.out = S_t^T q, buf.pred = u. Strip by strip of columns, each updated while still cached
/// from its prediction rather than after a whole sweep over S (2x faster at Dk = Dv = 128
/// float); allocates nothing.
template <class T>
void delta_step(Matrix<T>& state, DeltaStepBuffers<T>& buf, T beta, Eigen::Index gates) {
  // Rows a multiple of 4 KiB apart put a strip's loads behind its stores to the rows before at
  // the same address mod 4 KiB (4K aliasing): measured 1.3-1.6x slower than whole rows.
  if (state.cols() * static_cast<Eigen::Index>(sizeof(T)) % 4096 == 0) {
    delta_step_rows(state, buf, beta, gates);
    return;
  }
  constexpr int kPackets = DeltaStepShape<T>::kPackets;
  const StepTokenAt<T> token{buf, beta};
  const Eigen::Index rows = state.rows(), cols = state.cols();
  switch (transition_of_gate_dim(gates)) {
    case TransitionKind::scalar_gates:
      delta_strips<TransitionKind::scalar_gates, kPackets>(state.data(), rows, cols, 0, cols, 1,
                                                           token);
      break;
    case TransitionKind::feature_gates:
      delta_strips<TransitionKind::feature_gates, kPackets>(state.data(), rows, cols, 0, cols, 1,
                                                            token);
      break;
    default:
      delta_strips<TransitionKind::decay, kPackets>(state.data(), rows, cols, 0, cols, 1, token);
      break;
  }
}

/// The recurrent form over a sequence, streamed: blocks of tokens loaded, normalised and scaled
/// once, then token by token through delta_step's strips (each strip's update right after its
/// prediction, while it is still cached). Exactly the recurrence's 6 Dk Dv flops a token (the
/// chunked form does 1.6-2x that), hard resets as gates of 0. Strip-major order (a strip kept in
/// L1 across the block's tokens) measured 10-20% slower at Dk = Dv = 128 and level at 64.
template <class T, class O>
class DeltaStream {
 public:
  DeltaStream(Eigen::Index key_dim, Eigen::Index value_dim, const DeltaOptions& options)
      : scale_(static_cast<T>(delta_scale(options, key_dim))),
        l2_normalize_(options.l2_normalize),
        io_(kBlock, key_dim, value_dim),
        beta_(kBlock),
        out_(kBlock, value_dim) {}

  /// Runs every token of `src` with `beta` from `state` on; out: N x Dv, or null.
  void run(const ChunkSource<T>& src, const BetaRows<T>& beta, Matrix<T>& state, OutRows<O>* out);

 private:
  static constexpr Eigen::Index kBlock = 64;

  template <TransitionKind Kind, class TokenAt>
  static void strips(T* s, Eigen::Index rows, Eigen::Index cols, const TokenAt& token) {
    delta_strips<Kind, DeltaStepShape<T>::kPackets>(s, rows, cols, 0, cols, 1, token);
  }

  /// Token t of the loaded block.
  struct BlockTokenAt {
    DeltaStream& self;
    Eigen::Index dk, dv, gates;
    DeltaTokenRefs<T> operator()(Eigen::Index t) const {
      return {self.io_.q.data() + t * dk,
              self.io_.k.data() + t * dk,
              gates > 0 ? self.gate_.data() + t * gates : nullptr,
              self.io_.v.data() + t * dv,
              nullptr,
              self.out_.data() + t * dv};
    }
    T beta(Eigen::Index t) const { return self.beta_(t); }
  };
  /// Token t of the block, as delta_strips reads the one token of a pass.
  struct OneTokenAt {
    const BlockTokenAt& block;
    Eigen::Index t;
    DeltaTokenRefs<T> operator()(Eigen::Index) const { return block(t); }
    T beta(Eigen::Index) const { return block.beta(t); }
  };

  T scale_;
  bool l2_normalize_;
  ChunkBuffers<T> io_;  ///< the block's q^, k^, v
  Vector<T> beta_;
  LogRows log_gate_;
  Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> gate_;  ///< a_t
  Matrix<T> out_;
};

template <class T, class O>
void DeltaStream<T, O>::run(const ChunkSource<T>& src, const BetaRows<T>& beta, Matrix<T>& state,
                            OutRows<O>* out) {
  const Eigen::Index gates = src.gate_dim();
  const Eigen::Index dk = state.rows(), dv = state.cols();
  for (Eigen::Index begin = 0; begin < src.rows(); begin += kBlock) {
    const Eigen::Index len = std::min(kBlock, src.rows() - begin);
    src.load_queries(begin, len, io_);
    src.load_keys_values(begin, len, io_);
    beta.load(begin, len, beta_);
    if (l2_normalize_) {
      l2_normalize_rows(io_.q, len);
      l2_normalize_rows(io_.k, len);
    }
    io_.q.topRows(len) *= scale_;
    if (gates > 0) {
      log_gate_.resize(kBlock, gates);
      src.load_log_gates(begin, len, log_gate_);
      gate_ = log_gate_.topRows(len).template cast<T>();  // converted first: see exp_log_gates
      exp_log_gates(gate_.data(), gate_.size());
    }
    const BlockTokenAt block{*this, dk, dv, gates};
    for (Eigen::Index t = 0; t < len; ++t) {
      const OneTokenAt token{block, t};
      switch (transition_of_gate_dim(gates)) {
        case TransitionKind::scalar_gates:
          strips<TransitionKind::scalar_gates>(state.data(), dk, dv, token);
          break;
        case TransitionKind::feature_gates:
          strips<TransitionKind::feature_gates>(state.data(), dk, dv, token);
          break;
        default:
          strips<TransitionKind::decay>(state.data(), dk, dv, token);
          break;
      }
    }
    if (out != nullptr) {
      OutRows<O> rows(out->middleRows(begin, len));
      store_rows<O>(out_, len, rows);
    }
  }
}

}  // namespace linattn::detail

#include <linattn/detail/compiled.hpp>  // the compiled mode's declarations, after the definitions
#ifdef LINATTN_COMPILED
#define LINATTN_DECLARE_DELTA_KERNELS(T, O) LINATTN_DELTA_INSTANCES(extern template, T, O)
LINATTN_KERNEL_TYPES(LINATTN_DECLARE_DELTA_KERNELS)
#undef LINATTN_DECLARE_DELTA_KERNELS
LINATTN_DELTA_STEP_INSTANCES(extern template, float)
LINATTN_DELTA_STEP_INSTANCES(extern template, double)
#endif
