// SPDX-License-Identifier: MIT
// The fused causal backward: two streamed passes over the sequence, each 3 C Dv FMAs a token.
// The forward pass recomputes the state S and reads d phi_q (and the numerator, for the
// normalized gradient) out of it; the reversed pass carries dS and reads d phi_k and d v out
// of it. Every transition (none, a constant decay, scalar or per-feature gates) is folded into
// per-token weights of pieces whose log transitions stay within the stream's range.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/stream.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <string>
#include <type_traits>

namespace linattn::detail {

/// Rows of an input as the gradient stream reads them: the first row and the leading dimension.
template <class Acc>
struct InputRows {
  const Acc* data;
  Eigen::Index ld;
};

/// Gives `m` rows x cols unless it has them (a no-op from the second chunk on).
template <class M>
void fit_buffer(M& m, Eigen::Index rows, Eigen::Index cols) {
  if (m.rows() != rows || m.cols() != cols) m.resize(rows, cols);
}

/// Rows [begin, begin + len) of `x` as Acc rows: in place when x is row-major Acc memory,
/// else converted into `buffer` (sized on first use: chunk x x's columns).
template <class Acc, class Derived>
InputRows<Acc> input_rows(const Eigen::MatrixBase<Derived>& x, Eigen::Index begin, Eigen::Index len,
                          Eigen::Index chunk, Matrix<Acc>& buffer) {
  if constexpr (is_row_memory<Derived> && std::is_same_v<typename Derived::Scalar, Acc>) {
    static_cast<void>(chunk);
    static_cast<void>(buffer);
    const Derived& memory = x.derived();
    return {memory.data() + begin * memory.outerStride(), memory.outerStride()};
  } else {
    fit_buffer(buffer, chunk, x.cols());
    load_rows<Acc>(x.middleRows(begin, len), buffer);
    return {buffer.data(), buffer.cols()};
  }
}

/// The operands of a sequence's causal backward, as the gradient stream reads them.
enum class GradientOperand { q, k, v, grad_out };

/// The inputs and gradients of one sequence's causal backward behind one interface, so that
/// the passes and their thread split (causal_backward_rows) are compiled once per Acc: rows of
/// phi_q, phi_k (q and k themselves, or a map's features of them, recomputed in Acc for each
/// pass), v and grad_out a chunk at a time, and the gradients' rows stored back (a map's
/// backward carries them to q and k chunk by chunk: a feature map acts on each token alone).
/// `buffer` and `raw` belong to the calling stream, so one source serves every thread.
template <class Acc>
class GradientSource {
 public:
  virtual ~GradientSource() = default;
  /// Rows [begin, begin + len) of an operand: in place when they are Acc rows in memory, else
  /// in `buffer` (chunk x width, sized on first use); `raw` holds a chunk of q or k for a map.
  virtual InputRows<Acc> rows(GradientOperand operand, Eigen::Index begin, Eigen::Index len,
                              Eigen::Index chunk, Matrix<Acc>& buffer, Matrix<Acc>& raw) const = 0;
  /// Gradient rows [begin, begin + len) of q, k or v from d loss / d phi_q, d phi_k or d v in
  /// the first len rows of `grad`.
  virtual void store(GradientOperand operand, const Matrix<Acc>& grad, Eigen::Index begin,
                     Eigen::Index len, Matrix<Acc>& raw) const = 0;
  /// Throws unless every feature is finite (unscaled exponential features can overflow where
  /// the forward's stabiliser does not): a map's features, chunk by chunk, before any gradient
  /// is written, unless the map declares finite_features.
  virtual void require_finite(Eigen::Index chunk, const char* where) const = 0;

 protected:
  GradientSource() = default;
  GradientSource(const GradientSource&) = default;
  GradientSource& operator=(const GradientSource&) = default;
};

/// The GradientSource of a causal backward's matrices: q and k (features for Identity), v,
/// grad_out, and the gradients grad_q, grad_k, grad_v (any row-addressable outputs).
template <class Acc, class DQ, class DK, class DV, class DG, class OutQ, class OutK, class OutV,
          class Map>
class GradientSourceOf final : public GradientSource<Acc> {
 public:
  GradientSourceOf(const DQ& q, const DK& k, const DV& v, const DG& grad_out, OutQ& grad_q,
                   OutK& grad_k, OutV& grad_v, const Map& map)
      : q_(q),
        k_(k),
        v_(v),
        grad_out_(grad_out),
        grad_q_(grad_q),
        grad_k_(grad_k),
        grad_v_(grad_v),
        map_(map) {}

  InputRows<Acc> rows(GradientOperand operand, Eigen::Index begin, Eigen::Index len,
                      Eigen::Index chunk, Matrix<Acc>& buffer, Matrix<Acc>& raw) const override {
    switch (operand) {
      case GradientOperand::q:
        return features(q_, begin, len, chunk, buffer, raw, false);
      case GradientOperand::k:
        return features(k_, begin, len, chunk, buffer, raw, true);
      case GradientOperand::v:
        return input_rows<Acc>(v_, begin, len, chunk, buffer);
      case GradientOperand::grad_out:
        break;
    }
    return input_rows<Acc>(grad_out_, begin, len, chunk, buffer);
  }

  void store(GradientOperand operand, const Matrix<Acc>& grad, Eigen::Index begin, Eigen::Index len,
             Matrix<Acc>& raw) const override {
    switch (operand) {
      case GradientOperand::q:
        store_features(q_, grad, begin, len, raw, grad_q_);
        return;
      case GradientOperand::k:
        store_features(k_, grad, begin, len, raw, grad_k_);
        return;
      case GradientOperand::v:
      case GradientOperand::grad_out:
        break;
    }
    auto rows = grad_v_.middleRows(begin, len);
    store_rows<typename OutV::Scalar>(grad, len, rows);
  }

  void require_finite(Eigen::Index chunk, const char* where) const override {
    if constexpr (!is_identity_map<Map> && !has_finite_features<Map>::value) {
      // q and k each on their own: `keys ? k_ : q_` of two expression types would evaluate a
      // whole N-row matrix for every chunk.
      require_finite_features(q_, false, chunk, where);
      require_finite_features(k_, true, chunk, where);
    } else {
      static_cast<void>(chunk);
      static_cast<void>(where);
    }
  }

 private:
  /// Throws unless the map's features of every chunk of x (q, or k when `keys`) are finite.
  template <class X>
  void require_finite_features(const X& x, bool keys, Eigen::Index chunk, const char* where) const {
    Matrix<Acc> buffer, raw;
    for (Eigen::Index begin = 0; begin < x.rows(); begin += chunk) {
      const Eigen::Index len = std::min(chunk, x.rows() - begin);
      features(x, begin, len, chunk, buffer, raw, keys);
      if (!buffer.topRows(len).allFinite()) {
        throw Error(std::string(where) + ": the feature map overflows " +
                    (std::is_same_v<Acc, float> ? "float" : "double") + " on " +
                    (keys ? "k" : "q") +
                    "; the backward needs finite features (accumulate in double, "
                    "the backward<double>, or scale the inputs down)");
      }
    }
  }

  template <class X>
  InputRows<Acc> features(const X& x, Eigen::Index begin, Eigen::Index len, Eigen::Index chunk,
                          Matrix<Acc>& buffer, Matrix<Acc>& raw, bool keys) const {
    if constexpr (is_identity_map<Map>) {
      static_cast<void>(raw);
      static_cast<void>(keys);
      return input_rows<Acc>(x, begin, len, chunk, buffer);
    } else {
      fit_buffer(buffer, chunk, map_.feature_dim(x.cols()));
      raw = x.middleRows(begin, len).template cast<Acc>();
      if constexpr (has_queries_into<Map, Acc>::value && has_keys_into<Map, Acc>::value) {
        if (keys) {
          map_.keys_into(raw, buffer.topRows(len));
        } else {
          map_.queries_into(raw, buffer.topRows(len));
        }
      } else {
        buffer.topRows(len) = keys ? map_.keys(raw) : map_.queries(raw);
      }
      return {buffer.data(), buffer.cols()};
    }
  }

  template <class X, class Out>
  void store_features(const X& x, const Matrix<Acc>& grad, Eigen::Index begin, Eigen::Index len,
                      Matrix<Acc>& raw, Out& out) const {
    using O = typename Out::Scalar;
    if constexpr (is_identity_map<Map>) {
      static_cast<void>(x);
      static_cast<void>(raw);
      auto rows = out.middleRows(begin, len);
      store_rows<O>(grad, len, rows);
    } else {
      raw = x.middleRows(begin, len).template cast<Acc>();
      out.middleRows(begin, len) = map_.backward(raw, grad.topRows(len)).template cast<O>();
    }
  }

  const DQ& q_;
  const DK& k_;
  const DV& v_;
  const DG& grad_out_;
  OutQ& grad_q_;
  OutK& grad_k_;
  OutV& grad_v_;
  const Map& map_;
};

/// Scratch memory of the fused backward: the per-token factors the reversed pass reads from
/// the forward one (2 N scalars) and chunk buffers (L x (C + Dv) scalars, and L x C more for
/// each input not read in place and each weighted operand of a transition; L the chunk).
/// Kept between calls, it is allocated once by a training loop of equal lengths.
template <class Acc>
struct GradientScratch {
  Vector<Acc> inv;         ///< N: s / d_t, the scaled reciprocal denominators (s without normalize)
  Vector<Acc> gden;        ///< N: s d loss / d den_t (0 without normalize)
  Matrix<Acc> q, k, v, g;  ///< L x C, L x C, L x Dv, L x Dv: input rows not read in place
  Matrix<Acc> weighted_a;  ///< L x C: the update's broadcast operand, weighted (transitions)
  Matrix<Acc> weighted_c;  ///< L x C: the column readout's operand, weighted (per feature)
  Matrix<Acc> vert;        ///< L x Dv: column readouts
  Matrix<Acc> horiz;       ///< L x C: row readouts
  LogRows lambda;          ///< L x G: log transitions in processing order (G = 1 or C)
  LogRows rise;            ///< L x G: their sums within a piece
  Eigen::Array<Acc, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> weight;  ///< L x G
  Eigen::Array<Acc, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> lift;    ///< L x G

  /// Sizes the chunk buffers every call needs (gate_width: 0 without a transition, else G).
  void reserve(Eigen::Index c, Eigen::Index dv, Eigen::Index chunk, Eigen::Index gate_width) {
    fit_buffer(vert, chunk, dv);
    fit_buffer(horiz, chunk, c);
    if (gate_width > 0) {
      fit_buffer(weighted_a, chunk, c);
      if (gate_width > 1) fit_buffer(weighted_c, chunk, c);
      fit_buffer(lambda, chunk, gate_width);
      fit_buffer(rise, chunk, gate_width);
      fit_buffer(weight, chunk, gate_width);
      fit_buffer(lift, chunk, gate_width);
    }
  }
};

/// The fused causal backward of one sequence on validated inputs, in Acc:
///   forward pass   S_t = A_t S_{t-1} + phi_k_t v_t^T (and z), d phi_q_t = s (S_t G_t + z_t g_t)
///   reversed pass  dS_t = A_{t+1} dS_{t+1} + phi_q_t G_t^T, d phi_k_t = dS_t v_t + dz_t,
///                  d v_t = dS_t^T phi_k_t
/// with G_t = s grad_out_t / d_t and g_t = s d loss / d den_t (G_t = s grad_out_t, g_t = 0
/// without normalize), A_t the transition (Options::decay, or the gates' log rows).
template <class Acc>
class GradientStream {
 public:
  /// @param logs     N x 1 or N x C log gates, or null (then Options::decay moves the state)
  /// @param scratch  this stream's chunk buffers
  /// @param factors  the scratch whose inv and gden (N each) all streams of the call share
  GradientStream(Eigen::Index feature_dim, Eigen::Index value_dim, const Options& options,
                 const LogRows* logs, GradientScratch<Acc>& scratch, GradientScratch<Acc>& factors,
                 Eigen::Index n)
      : c_(feature_dim),
        dv_(value_dim),
        n_(n),
        chunk_(std::max<Eigen::Index>(1, std::min(std::max<Eigen::Index>(options.chunk, 64), n))),
        options_(options),
        scale_(static_cast<Acc>(options.scale)),
        logs_(logs),
        log_decay_(std::log(options.decay)),
        width_(logs != nullptr ? logs->cols() : (options.decay != 1.0 ? 1 : 0)),
        x_(Matrix<Acc>::Zero(feature_dim, value_dim)),
        z_(Vector<Acc>::Zero(feature_dim)),
        total_(Eigen::Array<double, 1, Eigen::Dynamic>::Zero(std::max<Eigen::Index>(1, width_))),
        buf_(scratch),
        factors_(factors) {
    buf_.reserve(feature_dim, value_dim, chunk_, width_);
    if (factors_.inv.size() < n) {
      factors_.inv.resize(n);
      factors_.gden.resize(n);
    }
  }

  /// Tokens per chunk: what the passes load, featurize and write at a time.
  Eigen::Index chunk() const { return chunk_; }
  /// C x Dv: the carried state (S, or dS in the reversed pass).
  Matrix<Acc>& state() { return x_; }
  const Matrix<Acc>& state() const { return x_; }
  /// C: the carried z (or dz).
  Vector<Acc>& z() { return z_; }
  const Vector<Acc>& z() const { return z_; }
  /// The log transition of the last absorb over all its tokens (1 or G entries; 0 without a
  /// transition, -infinity where a reset cleared the state).
  const Eigen::Array<double, 1, Eigen::Dynamic>& total() const { return total_; }

  /// The forward pass over tokens [first, last) from the carried state: grad_q rows = d loss /
  /// d q, and the factors of the reversed pass. With `absorb_only`, the state moves over the
  /// tokens (one product a piece) and nothing is written; total() is their log transition.
  void forward_pass(const GradientSource<Acc>& source, Eigen::Index first, Eigen::Index last,
                    bool absorb_only = false);

  /// The reversed pass over tokens [first, last), from the last, from the carried state (dS
  /// after token last - 1 moved on, 0 at the sequence's end): grad_k and grad_v rows, after
  /// forward_pass wrote the tokens' factors. `absorb_only` as above.
  void reversed_pass(const GradientSource<Acc>& source, Eigen::Index first, Eigen::Index last,
                     bool absorb_only = false);

 private:
  static constexpr double kRange = kStreamLogRange<Acc>;

  /// lambda row u = the log transition that moves the state onto token t (0 past the end).
  void load_lambda(Eigen::Index u, Eigen::Index t) {
    if (width_ == 0) return;
    if (t >= n_) {
      buf_.lambda.row(u).setZero();
    } else if (logs_ != nullptr) {
      buf_.lambda.row(u) = logs_->row(t);
    } else {
      buf_.lambda(u, 0) = log_decay_;
    }
  }

  /// body(p, m) for the pieces [p, p + m) of processing steps [0, len): before each, the state
  /// is moved by exp(lambda_p); within it rise_u = sum_{p < i <= u} lambda_i stays at least
  /// -kRange in every feature, and weight_u = exp(-rise_u), lift_u = exp(rise_u). After it the
  /// state (kept as sum weight_j a_j b_j^T from the moved state) is lifted by exp(rise_last).
  template <class Body>
  void for_each_piece(Eigen::Index len, const Body& body) {
    if (width_ == 0) {
      body(0, len);
      return;
    }
    total_ += buf_.lambda.topRows(len).colwise().sum();
    for (Eigen::Index p = 0; p < len;) {
      move_state(buf_.lambda.row(p));
      buf_.rise.row(p).setZero();
      Eigen::Index m = 1;
      for (; p + m < len; ++m) {
        buf_.rise.row(p + m) = buf_.rise.row(p + m - 1) + buf_.lambda.row(p + m);
        if (!(buf_.rise.row(p + m).minCoeff() >= -kRange)) break;
      }
      // In Acc, as the forward weights its pieces; converted first, so exp runs vectorised,
      // and the weights as reciprocals (a division costs less than a second exp; both stay
      // normal numbers within the range).
      auto lift = buf_.lift.middleRows(p, m);
      lift = buf_.rise.middleRows(p, m).template cast<Acc>();
      lift = lift.exp();
      buf_.weight.middleRows(p, m) = lift.inverse();
      body(p, m);
      move_state(buf_.rise.row(p + m - 1));
      p += m;
    }
  }

  /// x and z <- diag(exp(log_factor)) x and z (one factor, or one per feature; -infinity
  /// clears them).
  template <class Row>
  void move_state(const Row& log_factor) {
    if (log_factor.size() == 1) {
      const double f = log_factor(0);
      if (f == 0.0) return;
      const Acc factor = exp_as<Acc>(f);
      x_ *= factor;
      z_ *= factor;
      return;
    }
    if ((log_factor == 0.0).all()) return;
    const Eigen::Array<Acc, Eigen::Dynamic, 1> factor =
        log_factor.transpose().exp().template cast<Acc>();
    x_.array().colwise() *= factor;
    z_.array() *= factor;
  }

  /// The state over m rows from `a` and `b` without readouts: x += sum_i a_i b_i^T and
  /// z += sum_i a_i, or with per-row factors f (the reversed pass) x += sum_i f_i a_i b_i^T and
  /// z += sum_i e_i a_i (no z update when e is null).
  void absorb_rows(const InputRows<Acc>& a, const Acc* f, const InputRows<Acc>& b, const Acc* e,
                   Eigen::Index m) {
    using Rows = Eigen::Map<const Matrix<Acc>, 0, Eigen::OuterStride<>>;
    const Rows keys(a.data, m, c_, Eigen::OuterStride<>(a.ld));
    const Rows values(b.data, m, dv_, Eigen::OuterStride<>(b.ld));
    if (f == nullptr) {
      x_.noalias() += keys.transpose() * values;
      z_ += keys.colwise().sum().transpose();
      return;
    }
    fit_buffer(buf_.weighted_c, chunk_, c_);
    auto scaled = buf_.weighted_c.topRows(m);
    scaled = keys.array().colwise() * Eigen::Map<const Eigen::Array<Acc, Eigen::Dynamic, 1>>(f, m);
    x_.noalias() += scaled.transpose() * values;
    if (e != nullptr) z_.noalias() += keys.transpose() * Eigen::Map<const Vector<Acc>>(e, m);
  }

  /// Row `row` of `rows`.
  static InputRows<Acc> at(const InputRows<Acc>& rows, Eigen::Index row) {
    return {rows.data == nullptr ? nullptr : rows.data + row * rows.ld, rows.ld};
  }

  /// The rows first, first + dir, ... of `in` (m of them, processing steps step0, step0 + 1,
  /// ...) times `factors` at their steps, into the same rows of `out`; `in` itself without a
  /// transition.
  template <class Factors>
  InputRows<Acc> weighted(const InputRows<Acc>& in, Eigen::Index first, int dir, Eigen::Index m,
                          const Factors& factors, Matrix<Acc>& out, Eigen::Index step0 = -1) {
    if (width_ == 0) return in;
    if (step0 < 0) step0 = first;
    using Row = Eigen::Map<const Eigen::Array<Acc, 1, Eigen::Dynamic>>;
    for (Eigen::Index j = 0; j < m; ++j) {
      const Eigen::Index row = first + dir * j;
      if (width_ == 1) {
        out.row(row).array() = Row(in.data + row * in.ld, c_) * factors(step0 + j, 0);
      } else {
        out.row(row).array() = Row(in.data + row * in.ld, c_) * factors.row(step0 + j);
      }
    }
    return {out.data(), out.cols()};
  }

  /// The streamed product over m rows from `row` (walking dir): a, the factors f (ld 0: one
  /// for all), b, c (data null: no column readout) and d point at that row; the readouts go to the
  /// same rows of vert and horiz.
  void run(const InputRows<Acc>& a, const InputRows<Acc>& f, const InputRows<Acc>& b,
           const InputRows<Acc>& c, const InputRows<Acc>& d, Eigen::Index row, Eigen::Index m,
           int dir) {
    const GradientOperands<Acc> operands{a.data,
                                         dir * a.ld,
                                         f.data,
                                         dir * f.ld,
                                         b.data,
                                         dir * b.ld,
                                         c.data,
                                         dir * c.ld,
                                         d.data,
                                         dir * d.ld,
                                         x_.data(),
                                         dv_,
                                         buf_.vert.data() + row * dv_,
                                         dir * dv_,
                                         buf_.horiz.data() + row * c_,
                                         dir * c_,
                                         m,
                                         c_,
                                         dv_};
    gradient_product(operands);
  }

  /// Row u of the forward pass (token t): d phi_q_t from its readouts, and the factors.
  void finish_query_row(Eigen::Index u, Eigen::Index t, const InputRows<Acc>& a,
                        const InputRows<Acc>& c, const InputRows<Acc>& rq) {
    using RowMap = Eigen::Map<const Eigen::Matrix<Acc, 1, Eigen::Dynamic>>;
    const RowMap key(a.data + u * a.ld, c_);
    z_.transpose() += key;  // z~ (the state's frame within the piece)
    Eigen::Ref<Eigen::Matrix<Acc, 1, Eigen::Dynamic>> dq = buf_.horiz.row(u);
    const Acc lift = width_ == 1 ? buf_.lift(u, 0) : Acc(1);
    Acc inv = scale_;
    Acc gden = Acc(0);
    if (options_.normalize) {
      const Acc dot = width_ > 1 ? RowMap(c.data + u * c.ld, c_).dot(z_.transpose())
                                 : RowMap(rq.data + u * rq.ld, c_).dot(z_.transpose()) * lift;
      const Acc eps = static_cast<Acc>(options_.eps);
      const Acc raw = scale_ * dot + eps;
      const Acc d = guard_denominator<Acc>(raw, eps);
      if (d == Acc(0)) {
        dq.setZero();
        factors_.inv(t) = Acc(0);
        factors_.gden(t) = Acc(0);
        return;
      }
      const Acc num_dot = width_ > 1 ? RowMap(c.data + u * c.ld, c_).dot(dq) * scale_
                                     : RowMap(rq.data + u * rq.ld, c_).dot(dq) * scale_ * lift;
      gden = d == raw ? -num_dot / (d * d) : Acc(0);
      dq = dq / d + z_.transpose() * gden;
      inv = scale_ / d;
    }
    if (width_ > 1) {
      dq.array() *= buf_.lift.row(u) * scale_;
    } else {
      dq *= scale_ * lift;
    }
    factors_.inv(t) = inv;
    factors_.gden(t) = scale_ * gden;
  }

  /// Step u of the reversed pass (chunk row i, token t): d phi_k_t and d v_t from the readouts.
  void finish_key_row(Eigen::Index u, Eigen::Index i, Eigen::Index t, const InputRows<Acc>& a) {
    using RowMap = Eigen::Map<const Eigen::Matrix<Acc, 1, Eigen::Dynamic>>;
    Eigen::Ref<Eigen::Matrix<Acc, 1, Eigen::Dynamic>> dk = buf_.horiz.row(i);
    if (options_.normalize) {
      z_.transpose() += RowMap(a.data + i * a.ld, c_) * factors_.gden(t);
      dk += z_.transpose();
    }
    if (width_ > 1) {
      dk.array() *= buf_.lift.row(u);
    } else if (width_ == 1) {
      dk *= buf_.lift(u, 0);
      buf_.vert.row(i) *= buf_.lift(u, 0);
    }
  }

  Eigen::Index c_, dv_, n_, chunk_;
  Options options_;
  Acc scale_;
  const LogRows* logs_;
  double log_decay_;
  Eigen::Index width_;  ///< 0: no transition, 1: one log per token, C: per feature
  Acc one_ = Acc(1);    ///< the forward pass's update factor
  Matrix<Acc> x_;       ///< C x Dv: S, or dS in the reversed pass
  Vector<Acc> z_;       ///< C: z, or dz
  Eigen::Array<double, 1, Eigen::Dynamic> total_;  ///< the last absorb's log transition
  GradientScratch<Acc>& buf_;
  GradientScratch<Acc>& factors_;
  Matrix<Acc> raw_;  ///< a chunk of raw q or k, for a map's features and backward
};

template <class Acc>
void GradientStream<Acc>::forward_pass(const GradientSource<Acc>& source, Eigen::Index first,
                                       Eigen::Index last, bool absorb_only) {
  total_.setZero();
  for (Eigen::Index begin = first; begin < last; begin += chunk_) {
    const Eigen::Index len = std::min(chunk_, last - begin);
    const InputRows<Acc> rk = source.rows(GradientOperand::k, begin, len, chunk_, buf_.k, raw_);
    const InputRows<Acc> rv = source.rows(GradientOperand::v, begin, len, chunk_, buf_.v, raw_);
    for (Eigen::Index u = 0; u < len; ++u) load_lambda(u, begin + u);
    if (absorb_only) {
      for_each_piece(len, [&](Eigen::Index p, Eigen::Index m) {
        const InputRows<Acc> a = weighted(rk, p, 1, m, buf_.weight, buf_.weighted_a);
        absorb_rows(at(a, p), nullptr, at(rv, p), nullptr, m);
      });
      continue;
    }
    const InputRows<Acc> rq = source.rows(GradientOperand::q, begin, len, chunk_, buf_.q, raw_);
    const InputRows<Acc> rg =
        source.rows(GradientOperand::grad_out, begin, len, chunk_, buf_.g, raw_);
    buf_.horiz.topRows(len).setZero();
    for_each_piece(len, [&](Eigen::Index p, Eigen::Index m) {
      const InputRows<Acc> a = weighted(rk, p, 1, m, buf_.weight, buf_.weighted_a);
      const InputRows<Acc> c = width_ > 1 ? weighted(rq, p, 1, m, buf_.lift, buf_.weighted_c) : rq;
      // No column readout: grad_out . num_t is q_t . (S_t grad_out_t), a row readout's dot.
      run(at(a, p), {&one_, 0}, at(rv, p), InputRows<Acc>{nullptr, 0}, at(rg, p), p, m, 1);
      for (Eigen::Index u = p; u < p + m; ++u) finish_query_row(u, begin + u, a, c, rq);
    });
    source.store(GradientOperand::q, buf_.horiz, begin, len, raw_);
  }
}

template <class Acc>
void GradientStream<Acc>::reversed_pass(const GradientSource<Acc>& source, Eigen::Index first,
                                        Eigen::Index last, bool absorb_only) {
  total_.setZero();
  const Eigen::Index chunks = (last - first + chunk_ - 1) / chunk_;
  for (Eigen::Index chunk = chunks - 1; chunk >= 0; --chunk) {
    const Eigen::Index begin = first + chunk * chunk_;
    const Eigen::Index len = std::min(chunk_, last - begin);
    const InputRows<Acc> rq = source.rows(GradientOperand::q, begin, len, chunk_, buf_.q, raw_);
    const InputRows<Acc> rg =
        source.rows(GradientOperand::grad_out, begin, len, chunk_, buf_.g, raw_);
    // Processing order u runs from the chunk's last row; token t is moved by A_{t+1}.
    for (Eigen::Index u = 0; u < len; ++u) {
      const Eigen::Index t = begin + len - 1 - u;
      load_lambda(u, t + 1);
    }
    const Acc* inv = factors_.inv.data() + begin;
    if (absorb_only) {
      for_each_piece(len, [&](Eigen::Index p, Eigen::Index m) {
        const Eigen::Index top = len - 1 - p;
        const InputRows<Acc> a = weighted(rq, top, -1, m, buf_.weight, buf_.weighted_a, p);
        const Eigen::Index low = top - m + 1;  // the piece's rows are [low, top]
        absorb_rows(at(a, low), inv + low, at(rg, low),
                    options_.normalize ? factors_.gden.data() + begin + low : nullptr, m);
      });
      continue;
    }
    const InputRows<Acc> rk = source.rows(GradientOperand::k, begin, len, chunk_, buf_.k, raw_);
    const InputRows<Acc> rv = source.rows(GradientOperand::v, begin, len, chunk_, buf_.v, raw_);
    buf_.horiz.topRows(len).setZero();
    buf_.vert.topRows(len).setZero();
    for_each_piece(len, [&](Eigen::Index p, Eigen::Index m) {
      // Processing steps p..p+m-1 are the chunk's rows len-1-p down to len-p-m.
      const Eigen::Index top = len - 1 - p;
      const InputRows<Acc> a = weighted(rq, top, -1, m, buf_.weight, buf_.weighted_a, p);
      const InputRows<Acc> c =
          width_ > 1 ? weighted(rk, top, -1, m, buf_.lift, buf_.weighted_c, p) : rk;
      // The update's factor s / d_t of each token: G_t = s grad_out_t / d_t, read in place.
      run(at(a, top), {inv + top, 1}, at(rg, top), at(c, top), at(rv, top), top, m, -1);
      for (Eigen::Index u = p; u < p + m; ++u) {
        finish_key_row(u, len - 1 - u, begin + len - 1 - u, a);
      }
    });
    source.store(GradientOperand::k, buf_.horiz, begin, len, raw_);
    source.store(GradientOperand::v, buf_.vert, begin, len, raw_);
  }
}

/// The causal backward of one sequence of n tokens on validated inputs: the fused two-pass
/// stream over `source`, in Acc, with `logs` (N x G log gates) or Options::decay moving the
/// state, and `scratch` (or buffers of its own) as its workspace; a long sequence is split
/// across Options::threads. Options::scale s multiplies phi_q. Compiled once per Acc; the
/// compiled mode (LINATTN_COMPILED) instantiates it in the library.
template <class Acc>
void causal_backward_rows(const GradientSource<Acc>& source, Eigen::Index n,
                          Eigen::Index feature_dim, Eigen::Index value_dim, const Options& options,
                          const LogRows* logs, GradientScratch<Acc>* scratch, const char* where) {
  GradientScratch<Acc> own;
  GradientScratch<Acc>& first = scratch != nullptr ? *scratch : own;
  const int threads = resolve_threads(options);
  const Eigen::Index parts = std::min<Eigen::Index>(threads, n / kMinRowsPerThread);
  if (parts < 2) {
    GradientStream<Acc> stream(feature_dim, value_dim, options, logs, first, first, n);
    source.require_finite(stream.chunk(), where);
    stream.forward_pass(source, 0, n);
    stream.state().setZero();
    stream.z().setZero();
    stream.reversed_pass(source, 0, n);
    return;
  }
  // One long sequence on several threads, each pass as the forward's driver does it: a short
  // first segment (the last, for the reversed pass) streams while the others are absorbed
  // (one product a piece); a prefix (suffix) through each segment's transition gives every
  // later segment its starting state; then they stream, a thread each.
  const SerialEigenScope serial_eigen;
  const Eigen::Index chunk =
      GradientStream<Acc>(feature_dim, value_dim, options, logs, first, first, n).chunk();
  source.require_finite(chunk, where);
  const std::vector<Eigen::Index> bounds =
      segment_bounds(n, static_cast<int>(parts), chunk, kBackwardAbsorbCost);
  const Eigen::Index segments = static_cast<Eigen::Index>(bounds.size()) - 1;
  std::vector<GradientScratch<Acc>> scratches(static_cast<std::size_t>(segments - 1));
  std::vector<GradientStream<Acc>> streams;
  streams.reserve(static_cast<std::size_t>(segments));
  for (Eigen::Index s = 0; s < segments; ++s) {
    streams.emplace_back(feature_dim, value_dim, options, logs,
                         s == 0 ? first : scratches[static_cast<std::size_t>(s - 1)], first, n);
  }
  std::vector<Matrix<Acc>> xs(static_cast<std::size_t>(segments));
  std::vector<Vector<Acc>> zs(static_cast<std::size_t>(segments));
  std::vector<Eigen::Array<double, 1, Eigen::Dynamic>> moved(static_cast<std::size_t>(segments));
  // Segments are counted in streaming order i (the reversed pass from the last): segment(i)
  // is the stream that runs it, [begin_of(i), end_of(i)) its rows (bounds mirrored).
  auto run_pass = [&](bool reversed) {
    auto segment = [&](Eigen::Index i) { return reversed ? segments - 1 - i : i; };
    auto begin_of = [&](Eigen::Index i) {
      return reversed ? n - bounds[static_cast<std::size_t>(i + 1)]
                      : bounds[static_cast<std::size_t>(i)];
    };
    auto end_of = [&](Eigen::Index i) {
      return reversed ? n - bounds[static_cast<std::size_t>(i)]
                      : bounds[static_cast<std::size_t>(i + 1)];
    };
    auto pass = [&](Eigen::Index i, bool absorb_only) {
      GradientStream<Acc>& stream = streams[static_cast<std::size_t>(segment(i))];
      if (reversed) {
        stream.reversed_pass(source, begin_of(i), end_of(i), absorb_only);
      } else {
        stream.forward_pass(source, begin_of(i), end_of(i), absorb_only);
      }
    };
    for (GradientStream<Acc>& stream : streams) {
      stream.state().setZero();
      stream.z().setZero();
    }
    parallel_for(segments - 1, static_cast<int>(segments - 1),
                 [&](Eigen::Index i) { pass(i, i > 0); });
    for (Eigen::Index i = 1; i + 1 < segments; ++i) {
      GradientStream<Acc>& local = streams[static_cast<std::size_t>(segment(i))];
      const auto at = static_cast<std::size_t>(i);
      xs[at] = local.state();
      zs[at] = local.z();
      moved[at] = local.total();
    }
    for (Eigen::Index i = 1; i + 1 < segments; ++i) {
      // The state entering segment i + 1: segment i's start moved across it, plus its sums.
      const GradientStream<Acc>& before = streams[static_cast<std::size_t>(segment(i - 1))];
      GradientStream<Acc>& into = streams[static_cast<std::size_t>(segment(i))];
      const auto at = static_cast<std::size_t>(i);
      if (i == 1) {
        into.state() = before.state();  // segment 0 streamed: its final state
        into.z() = before.z();
      }
      GradientStream<Acc>& next = streams[static_cast<std::size_t>(segment(i + 1))];
      const Eigen::Array<double, 1, Eigen::Dynamic>& log_moved = moved[at];
      if (log_moved.size() == 1) {
        const Acc factor = static_cast<Acc>(std::exp(log_moved(0)));
        next.state() = into.state() * factor + xs[at];
        next.z() = into.z() * factor + zs[at];
      } else {
        const Eigen::Array<Acc, Eigen::Dynamic, 1> factor =
            log_moved.transpose().exp().template cast<Acc>();
        next.state() = (into.state().array().colwise() * factor).matrix() + xs[at];
        next.z() = (into.z().array() * factor).matrix() + zs[at];
      }
    }
    parallel_for(segments - 1, static_cast<int>(segments - 1),
                 [&](Eigen::Index i) { pass(i + 1, false); });
  };
  run_pass(false);
  run_pass(true);
}

}  // namespace linattn::detail

/// The compiled mode's instances of the causal backward, one accumulation type T each;
/// `prefix` is `extern template` (every TU that defines LINATTN_COMPILED) or `template` (the
/// library).
#define LINATTN_GRADIENT_INSTANCES(prefix, T)                                              \
  prefix class linattn::detail::GradientStream<T>;                                         \
  prefix void linattn::detail::causal_backward_rows<T>(                                    \
      const linattn::detail::GradientSource<T>&, Eigen::Index, Eigen::Index, Eigen::Index, \
      const linattn::Options&, const linattn::detail::LogRows*,                            \
      linattn::detail::GradientScratch<T>*, const char*);

#ifdef LINATTN_COMPILED
#define LINATTN_DECLARE_GRADIENT_KERNELS(T) LINATTN_GRADIENT_INSTANCES(extern template, T)
LINATTN_DECLARE_GRADIENT_KERNELS(float)
LINATTN_DECLARE_GRADIENT_KERNELS(double)
#undef LINATTN_DECLARE_GRADIENT_KERNELS
#endif
