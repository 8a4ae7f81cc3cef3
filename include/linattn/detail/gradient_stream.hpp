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

/// The features the gradient stream reads, a chunk at a time: q and k themselves (Identity),
/// or a map's features of them, recomputed in Acc for each pass, whose gradients the map's
/// backward carries back to q and k chunk by chunk (a feature map acts on each token alone).
template <class Acc, class DQ, class DK, class Map>
class FeatureChunks {
 public:
  FeatureChunks(const DQ& q, const DK& k, const Map& map) : q_(q), k_(k), map_(map) {}

  /// Rows [begin, begin + len) of phi_q (`buffer`: chunk x C, used unless read in place).
  InputRows<Acc> queries(Eigen::Index begin, Eigen::Index len, Eigen::Index chunk,
                         Matrix<Acc>& buffer) const {
    return features(q_, begin, len, chunk, buffer, false);
  }
  /// Rows [begin, begin + len) of phi_k.
  InputRows<Acc> keys(Eigen::Index begin, Eigen::Index len, Eigen::Index chunk,
                      Matrix<Acc>& buffer) const {
    return features(k_, begin, len, chunk, buffer, true);
  }
  /// grad_q rows [begin, begin + len) from the rows of d loss / d phi_q in `grad`.
  template <class Out>
  void store_queries(const Matrix<Acc>& grad, Eigen::Index begin, Eigen::Index len,
                     Out& out) const {
    store(q_, grad, begin, len, out);
  }
  /// grad_k rows [begin, begin + len) from the rows of d loss / d phi_k in `grad`.
  template <class Out>
  void store_keys(const Matrix<Acc>& grad, Eigen::Index begin, Eigen::Index len, Out& out) const {
    store(k_, grad, begin, len, out);
  }

  /// Throws unless every feature is finite (unscaled exponential features can overflow where
  /// the forward's stabiliser does not): a map's features, chunk by chunk, before any gradient
  /// is written, unless the map declares finite_features.
  void require_finite(Eigen::Index chunk, const char* where) const {
    if constexpr (!is_identity_map<Map> && !has_finite_features<Map>::value) {
      Matrix<Acc> buffer;
      for (int keys = 0; keys < 2; ++keys) {
        for (Eigen::Index begin = 0; begin < q_.rows(); begin += chunk) {
          const Eigen::Index len = std::min(chunk, q_.rows() - begin);
          features(keys ? k_ : q_, begin, len, chunk, buffer, keys != 0);
          if (!buffer.topRows(len).allFinite()) {
            throw Error(std::string(where) + ": the feature map overflows " +
                        (std::is_same_v<Acc, float> ? "float" : "double") + " on " +
                        (keys ? "k" : "q") +
                        "; the backward needs finite features (accumulate in double, "
                        "the backward<double>, or scale the inputs down)");
          }
        }
      }
    } else {
      static_cast<void>(chunk);
      static_cast<void>(where);
    }
  }

 private:
  template <class X>
  InputRows<Acc> features(const X& x, Eigen::Index begin, Eigen::Index len, Eigen::Index chunk,
                          Matrix<Acc>& buffer, bool keys) const {
    if constexpr (is_identity_map<Map>) {
      static_cast<void>(keys);
      return input_rows<Acc>(x, begin, len, chunk, buffer);
    } else {
      fit_buffer(buffer, chunk, map_.feature_dim(x.cols()));
      raw_ = x.middleRows(begin, len).template cast<Acc>();
      if constexpr (has_queries_into<Map, Acc>::value && has_keys_into<Map, Acc>::value) {
        if (keys) {
          map_.keys_into(raw_, buffer.topRows(len));
        } else {
          map_.queries_into(raw_, buffer.topRows(len));
        }
      } else {
        buffer.topRows(len) = keys ? map_.keys(raw_) : map_.queries(raw_);
      }
      return {buffer.data(), buffer.cols()};
    }
  }

  template <class X, class Out>
  void store(const X& x, const Matrix<Acc>& grad, Eigen::Index begin, Eigen::Index len,
             Out& out) const {
    using O = typename Out::Scalar;
    if constexpr (is_identity_map<Map>) {
      auto rows = out.middleRows(begin, len);
      store_rows<O>(grad, len, rows);
    } else {
      raw_ = x.middleRows(begin, len).template cast<Acc>();
      out.middleRows(begin, len) = map_.backward(raw_, grad.topRows(len)).template cast<O>();
    }
  }

  const DQ& q_;
  const DK& k_;
  const Map& map_;
  mutable Matrix<Acc> raw_;  ///< a chunk of raw q or k, for the map
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
  /// d q (through `features`), and the factors of the reversed pass. With `absorb_only`, the
  /// state moves over the tokens (one product a piece) and nothing is written; total() is
  /// their log transition.
  template <class Features, class DV, class DG, class Out>
  void forward_pass(const Features& features, const Eigen::MatrixBase<DV>& v,
                    const Eigen::MatrixBase<DG>& grad_out, Out& grad_q, Eigen::Index first,
                    Eigen::Index last, bool absorb_only = false) {
    total_.setZero();
    for (Eigen::Index begin = first; begin < last; begin += chunk_) {
      const Eigen::Index len = std::min(chunk_, last - begin);
      const InputRows<Acc> rk = features.keys(begin, len, chunk_, buf_.k);
      const InputRows<Acc> rv = input_rows<Acc>(v, begin, len, chunk_, buf_.v);
      for (Eigen::Index u = 0; u < len; ++u) load_lambda(u, begin + u);
      if (absorb_only) {
        for_each_piece(len, [&](Eigen::Index p, Eigen::Index m) {
          const InputRows<Acc> a = weighted(rk, p, 1, m, buf_.weight, buf_.weighted_a);
          absorb_rows(at(a, p), nullptr, at(rv, p), nullptr, m);
        });
        continue;
      }
      const InputRows<Acc> rq = features.queries(begin, len, chunk_, buf_.q);
      const InputRows<Acc> rg = input_rows<Acc>(grad_out, begin, len, chunk_, buf_.g);
      buf_.horiz.topRows(len).setZero();
      for_each_piece(len, [&](Eigen::Index p, Eigen::Index m) {
        const InputRows<Acc> a = weighted(rk, p, 1, m, buf_.weight, buf_.weighted_a);
        const InputRows<Acc> c =
            width_ > 1 ? weighted(rq, p, 1, m, buf_.lift, buf_.weighted_c) : rq;
        // No column readout: grad_out . num_t is q_t . (S_t grad_out_t), a row readout's dot.
        run(at(a, p), {&one_, 0}, at(rv, p), InputRows<Acc>{nullptr, 0}, at(rg, p), p, m, 1);
        for (Eigen::Index u = p; u < p + m; ++u) finish_query_row(u, begin + u, a, c, rq);
      });
      features.store_queries(buf_.horiz, begin, len, grad_q);
    }
  }

  /// The reversed pass over tokens [first, last), from the last, from the carried state (dS
  /// after token last - 1 moved on, 0 at the sequence's end): grad_k (through `features`) and
  /// grad_v rows, after forward_pass wrote the tokens' factors. `absorb_only` as above.
  template <class Features, class DV, class DG, class OutK, class OutV>
  void reversed_pass(const Features& features, const Eigen::MatrixBase<DV>& v,
                     const Eigen::MatrixBase<DG>& grad_out, OutK& grad_k, OutV& grad_v,
                     Eigen::Index first, Eigen::Index last, bool absorb_only = false) {
    total_.setZero();
    const Eigen::Index chunks = (last - first + chunk_ - 1) / chunk_;
    for (Eigen::Index chunk = chunks - 1; chunk >= 0; --chunk) {
      const Eigen::Index begin = first + chunk * chunk_;
      const Eigen::Index len = std::min(chunk_, last - begin);
      const InputRows<Acc> rq = features.queries(begin, len, chunk_, buf_.q);
      const InputRows<Acc> rg = input_rows<Acc>(grad_out, begin, len, chunk_, buf_.g);
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
      const InputRows<Acc> rk = features.keys(begin, len, chunk_, buf_.k);
      const InputRows<Acc> rv = input_rows<Acc>(v, begin, len, chunk_, buf_.v);
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
      features.store_keys(buf_.horiz, begin, len, grad_k);
      auto rows_v = grad_v.middleRows(begin, len);
      store_rows<typename OutV::Scalar>(buf_.vert, len, rows_v);
    }
  }

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
};

}  // namespace linattn::detail
