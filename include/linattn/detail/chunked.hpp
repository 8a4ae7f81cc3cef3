// SPDX-License-Identifier: MIT
// The chunked (parallel) forms of causal and non-causal linear attention.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/convert.hpp>
#include <linattn/detail/stream.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <string>
#include <type_traits>

namespace linattn::detail {

/// The recurrence state in scaled form: the true S and z are exp(log_scale) times s and z.
/// Plain feature maps keep log_scale at 0; exponential maps move it so nothing overflows.
template <class T>
struct CarriedState {
  Matrix<T> s;  ///< C x Dv
  Vector<T> z;  ///< C
  /// -infinity until the first token is absorbed.
  double log_scale = -std::numeric_limits<double>::infinity();
  /// C: per-feature gates not yet applied to the rows of s and z (each in [-drift, 0]), so a
  /// gate of 1 - 1e-8 is kept exactly in double instead of rounded away in T. Row c of the
  /// true S is exp(log_scale + row_log(c)) times row c of s; all 0 unless rows_pending.
  Eigen::Array<double, Eigen::Dynamic, 1> row_log;
  bool rows_pending = false;

  CarriedState(Eigen::Index feature_dim, Eigen::Index value_dim)
      : s(Matrix<T>::Zero(feature_dim, value_dim)),
        z(Vector<T>::Zero(feature_dim)),
        row_log(Eigen::Array<double, Eigen::Dynamic, 1>::Zero(feature_dim)) {}

  /// Forgets every token: zero sums, no scale, nothing pending.
  void clear() {
    s.setZero();
    z.setZero();
    log_scale = -std::numeric_limits<double>::infinity();
    row_log.setZero();
    rows_pending = false;
  }

  bool empty() const { return log_scale == -std::numeric_limits<double>::infinity(); }
  /// True while the state holds plain (unscaled) sums, so the cheaper unscaled path applies.
  bool unscaled() const { return (empty() || log_scale == 0.0) && !rows_pending; }

  /// Applies row_log to s and z and clears it (before any transition but a per-feature gate).
  void fold_rows() {
    if (!rows_pending) return;
    for (Eigen::Index c = 0; c < s.rows(); ++c) apply_row(c, row_log(c));
    rows_pending = false;
  }

  /// Moves every row c of the state on by exp(reach(c)), the total log gate since row_log
  /// (reach includes row_log): kept pending in row_log while it stays within `drift` of 0,
  /// applied to s and z (and that row_log cleared) once it passes.
  template <class Reach>
  void settle_rows(const Reach& reach, double drift) {
    rows_pending = true;
    // Usually every row stays pending: one vectorised pass.
    if (reach.minCoeff() >= -drift) {
      row_log = reach;
      return;
    }
    for (Eigen::Index c = 0; c < s.rows(); ++c) {
      const double r = reach(c);
      if (r >= -drift) {
        row_log(c) = r;
        continue;
      }
      apply_row(c, r);
    }
  }

 private:
  /// Multiplies row c of s and z by exp(log_factor) (0 for a reset, -infinity); clears
  /// row_log(c).
  void apply_row(Eigen::Index c, double log_factor) {
    if (log_factor != 0.0) {
      const T factor = static_cast<T>(std::exp(log_factor));
      s.row(c) *= factor;
      z(c) *= factor;
    }
    row_log(c) = 0.0;
  }
};

/// How far gated log scales drift (unapplied, exact in double) before they are applied to the
/// state: a factor of at most e, so every weight stays well inside the stream range.
inline constexpr double kGateDrift = 1.0;

/// The next running log-scale after a token with log gate `log_gate` and key scale `log_key`:
/// it follows the gate while it stays within `drift` of the key (nothing multiplies the
/// state, so gates near 1 are not rounded away), else jumps to the key's scale. drift = 0 is
/// max(previous + log_gate, log_key), the constant decay's rule.
inline double next_log_scale(double previous, double log_gate, double log_key, double drift) {
  const double decayed = previous + log_gate;
  return decayed >= log_key - drift ? decayed : log_key;
}

/// Where the stream kernel reads a chunk's phi_q, phi_k and v: row-major rows with leading
/// dimensions in elements, either the chunk buffers or the caller's memory itself.
template <class T>
struct ChunkRows {
  const T* q;
  Eigen::Index ldq;
  const T* k;
  Eigen::Index ldk;
  const T* v;
  Eigen::Index ldv;
};

/// True when `Derived` is row-major memory with adjacent columns, readable in place.
template <class Derived>
inline constexpr bool is_row_memory =
    bool(Derived::Flags& Eigen::DirectAccessBit) &&
    bool(Derived::IsRowMajor) && Derived::InnerStrideAtCompileTime == 1;

/// dst.topRows(src.rows()) = src converted to Acc. 16-bit rows in row-major memory go through
/// convert(), many at a time (Eigen's cast expression converts one element at a time, through
/// a routine that costs more than the kernel); everything else through Eigen's cast.
template <class Acc, class Derived>
void load_rows(const Eigen::MatrixBase<Derived>& src, Matrix<Acc>& dst) {
  const Eigen::Index rows = src.rows();
  if constexpr (is_half_scalar<typename Derived::Scalar> && is_row_memory<Derived>) {
    const Derived& memory = src.derived();
    for (Eigen::Index r = 0; r < rows; ++r) {
      convert(memory.data() + r * memory.outerStride(), dst.data() + r * dst.cols(), src.cols());
    }
  } else {
    dst.topRows(rows) = src.template cast<Acc>();
  }
}

/// out rows [0, rows) = src rows [0, rows) converted to O: load_rows' inverse. 16-bit rows with
/// adjacent entries go through convert(), many at a time (the values of Eigen's cast).
template <class O, class T, class Out>
void store_rows(const Matrix<T>& src, Eigen::Index rows, Out& out) {
  if constexpr (is_half_scalar<O> && std::is_same_v<T, float>) {
    if (out.innerStride() == 1) {
      for (Eigen::Index r = 0; r < rows; ++r) {
        convert(src.data() + r * src.cols(), &out.coeffRef(r, 0), src.cols());
      }
      return;
    }
  }
  out.topRows(rows) = src.topRows(rows).template cast<O>();
}

/// dst = the vector expression x converted to Acc (dst already has x.size() entries); as
/// load_rows, through convert() for 16-bit entries adjacent in memory.
template <class Acc, class Derived>
void load_vector(const Eigen::MatrixBase<Derived>& x, Vector<Acc>& dst) {
  using Scalar = typename Derived::Scalar;
  if constexpr (bool(Derived::Flags & Eigen::DirectAccessBit)) {
    // Adjacent unless the entries lie across the outer dimension (a column stored row-major):
    // then read as one flat vector (a reshaped row is copied element by element).
    const Derived& memory = x.derived();
    if (memory.innerStride() == 1 && (x.innerSize() == x.size() || memory.outerStride() == 1)) {
      if constexpr (is_half_scalar<Scalar>) {
        convert(memory.data(), dst.data(), x.size());
      } else {
        dst = Eigen::Map<const Vector<Scalar>>(memory.data(), x.size()).template cast<Acc>();
      }
      return;
    }
  }
  dst = x.reshaped().template cast<Acc>();
}

/// Per-call workspace, sized by the chunk length, never by N.
template <class T>
struct ChunkBuffers {
  Matrix<T> q, k, v;               ///< L x C, L x C, L x Dv
  Vector<double> log_q, log_k;     ///< L: per-row log scales of q and k features
  Vector<double> running_log;      ///< L: the running log-scale c_i after each token
  Vector<double> output_log;       ///< L: log_q_i + c_i, the log factor the output row misses
  Matrix<T> scores;                ///< L x L
  Matrix<T> weighted_keys;         ///< L x C
  Matrix<T> num;                   ///< L x Dv
  Vector<T> den;                   ///< L
  Vector<double> log_scratch;      ///< L: a log-scaled map's row scales, before they are stored
  Vector<double> key_factor;       ///< L: the scaled stream's per-key weights
  LogRows log_gate;                ///< L x G: the chunk's log gates (G = 1 or C), when gated
  Vector<double> decay, decay_lo;  ///< L: P_r, the log transition from the chunk start through
                                   ///< token r, as a double-double (hi + lo)
  LogRows cum;                     ///< L x C: per-feature log gates summed within a piece
  Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> feature_weights;  ///< L x C

  ChunkBuffers(Eigen::Index chunk, Eigen::Index feature_dim, Eigen::Index value_dim)
      : q(chunk, feature_dim),
        k(chunk, feature_dim),
        v(chunk, value_dim),
        log_q(Vector<double>::Zero(chunk)),
        log_k(Vector<double>::Zero(chunk)),
        running_log(chunk),
        output_log(chunk),
        scores(chunk, chunk),
        weighted_keys(chunk, feature_dim),
        num(chunk, value_dim),
        den(chunk),
        key_factor(chunk),
        decay(chunk),
        decay_lo(chunk) {}
};

/// exp(x) as T; an argument of -infinity gives exactly 0.
template <class T>
T exp_as(double x) {
  return static_cast<T>(std::exp(x));
}

/// The denominator guard: keeps |d| >= eps so a sign-changing feature map cannot divide by
/// (nearly) zero. Positive maps always give d >= eps, so for them it never changes a value.
/// Returns 0 only when eps == 0 and d == 0; the caller then writes a zero row.
template <class T>
T guard_denominator(T d, T eps) {
  if (std::abs(d) >= eps) return d;
  return d < T(0) ? -eps : eps;
}

/// Writes one output row from its numerator and denominator, both missing the factor
/// exp(log_factor) (0 for unscaled sums): num / guard(den + eps exp(-log_factor)), or with
/// normalize off num exp(log_factor). `out` is a writable row or vector expression.
template <class T, class NumRow, class OutRow>
void write_output_row(const Eigen::MatrixBase<NumRow>& num, T den, double log_factor,
                      const Options& options, const Eigen::MatrixBase<OutRow>& out_expr) {
  // Eigen's idiom for writing through an expression argument.
  Eigen::MatrixBase<OutRow>& out = const_cast<Eigen::MatrixBase<OutRow>&>(out_expr);
  using Out = typename OutRow::Scalar;
  if (!options.normalize) {
    if (log_factor == 0.0) {
      out = num.template cast<Out>();
    } else {
      out = (num * exp_as<T>(log_factor)).template cast<Out>();
    }
    return;
  }
  // eps = 0 stays 0 (0 * inf would be NaN); an eps scaled past the range gives a zero row.
  const double scaled_eps =
      (options.eps == 0.0 || log_factor == 0.0) ? options.eps : options.eps * std::exp(-log_factor);
  const T eps = static_cast<T>(scaled_eps);
  const T d = guard_denominator<T>(den + eps, eps);
  if (d == T(0)) {
    out.setZero();
  } else {
    out = (num / d).template cast<Out>();
  }
}

/// Where the chunked kernel reads its tokens, in the accumulation type T: the one interface
/// every input form (featurized, mapped, strided, reversed) implements, so the kernel is
/// compiled once per accumulation and output type, not once per input expression and map.
template <class T>
class ChunkSource {
  static_assert(is_supported_scalar<T>,
                "linattn kernels accumulate in float or double (Acc = float or double)");

 public:
  ChunkSource(const ChunkSource&) = delete;
  ChunkSource& operator=(const ChunkSource&) = delete;

  /// N, the tokens of the source.
  Eigen::Index rows() const { return rows_; }
  /// C, the width of phi_q and phi_k.
  Eigen::Index feature_dim() const { return feature_dim_; }
  /// Dv, the width of v.
  Eigen::Index value_dim() const { return value_dim_; }
  /// True when the loaded features come with per-row log scales (buf.log_q, buf.log_k).
  bool log_scaled() const { return log_scaled_; }
  /// 0 without gates (the transition is Options::decay), 1 for scalar gates, C per feature.
  Eigen::Index gate_dim() const { return gates_ == nullptr ? gate_dim_ : gates_->cols(); }

  /// Reads the gates of every token from `gates` (rows() tokens; kept by reference).
  void attach_gates(const GateRows& gates) { gates_ = &gates; }
  /// dst rows [0, len) = log a_t for tokens [begin, begin + len); only when gate_dim() > 0.
  virtual void load_log_gates(Eigen::Index begin, Eigen::Index len, LogRows& dst) const {
    LINATTN_ASSERT(gates_ != nullptr);
    gates_->log_rows(begin, len, dst);
  }

  /// Points `rows` at tokens [begin, ...) in the caller's memory when they can be read in
  /// place (featurized row-major T with adjacent columns); false when they must be loaded.
  virtual bool rows_in_place(Eigen::Index begin, ChunkRows<T>& rows) const {
    static_cast<void>(begin);
    static_cast<void>(rows);
    return false;
  }
  /// buf.q (and buf.log_q when log_scaled) for tokens [begin, begin + len).
  virtual void load_queries(Eigen::Index begin, Eigen::Index len, ChunkBuffers<T>& buf) const = 0;
  /// buf.k, buf.v (and buf.log_k when log_scaled) for tokens [begin, begin + len).
  virtual void load_keys_values(Eigen::Index begin, Eigen::Index len,
                                ChunkBuffers<T>& buf) const = 0;

 protected:
  ChunkSource(Eigen::Index rows, Eigen::Index feature_dim, Eigen::Index value_dim, bool log_scaled,
              Eigen::Index gate_dim = 0)
      : rows_(rows),
        feature_dim_(feature_dim),
        value_dim_(value_dim),
        log_scaled_(log_scaled),
        gate_dim_(gate_dim) {}
  ~ChunkSource() = default;

 private:
  Eigen::Index rows_;
  Eigen::Index feature_dim_;
  Eigen::Index value_dim_;
  bool log_scaled_;
  Eigen::Index gate_dim_;            ///< a forwarding source's gates (RowRange)
  const GateRows* gates_ = nullptr;  ///< the attached gates, if any
};

/// Token source over featurized inputs phi_q, phi_k (N x C) and v (N x Dv), read as T.
template <class T, class DQ, class DK, class DV>
class FeaturizedSource final : public ChunkSource<T> {
 public:
  static_assert(is_input_scalar<typename DQ::Scalar>,
                "linattn kernels take float, double, Eigen::half or Eigen::bfloat16 inputs");

  FeaturizedSource(const DQ& phi_q, const DK& phi_k, const DV& v)
      : ChunkSource<T>(phi_q.rows(), phi_q.cols(), v.cols(), false),
        phi_q_(phi_q),
        phi_k_(phi_k),
        v_(v) {}

  bool rows_in_place(Eigen::Index begin, ChunkRows<T>& rows) const override {
    if constexpr (std::is_same_v<T, typename DQ::Scalar> && is_row_memory<DQ> &&
                  is_row_memory<DK> && is_row_memory<DV>) {
      rows = {phi_q_.data() + begin * phi_q_.outerStride(), phi_q_.outerStride(),
              phi_k_.data() + begin * phi_k_.outerStride(), phi_k_.outerStride(),
              v_.data() + begin * v_.outerStride(),         v_.outerStride()};
      return true;
    } else {
      return ChunkSource<T>::rows_in_place(begin, rows);
    }
  }

  void load_queries(Eigen::Index begin, Eigen::Index len, ChunkBuffers<T>& buf) const override {
    load_rows(phi_q_.middleRows(begin, len), buf.q);
  }
  void load_keys_values(Eigen::Index begin, Eigen::Index len, ChunkBuffers<T>& buf) const override {
    load_rows(phi_k_.middleRows(begin, len), buf.k);
    load_rows(v_.middleRows(begin, len), buf.v);
  }

 private:
  const DQ& phi_q_;
  const DK& phi_k_;
  const DV& v_;
};

/// Token source over raw q, k (N x Dk) and v, featurized one chunk at a time by `map`, in T.
template <class T, class DQ, class DK, class DV, class Map>
class MappedSource final : public ChunkSource<T> {
 public:
  static_assert(is_input_scalar<typename DQ::Scalar>,
                "linattn kernels take float, double, Eigen::half or Eigen::bfloat16 inputs");
  static constexpr bool kLogScaled = is_log_scaled<Map>::value;

  /// @param log_scale  false reads an exponential map's plain features (per-feature gates,
  ///                   whose kernel keeps no per-token scale), checked finite
  MappedSource(const DQ& q, const DK& k, const DV& v, const Map& map, bool check_finite,
               const char* where, bool log_scale = true)
      : ChunkSource<T>(q.rows(), map.feature_dim(q.cols()), v.cols(), kLogScaled && log_scale),
        q_(q),
        k_(k),
        v_(v),
        map_(map),
        check_finite_(check_finite || (kLogScaled && !log_scale)),
        where_(where) {
    if (this->feature_dim() < 1) {
      throw Error(std::string(where) + ": the feature map gives feature_dim " +
                  std::to_string(this->feature_dim()) + " for input_dim " +
                  std::to_string(q.cols()));
    }
  }

  // Featurized in the accumulation type: a double accumulator also gets double features,
  // 16-bit inputs float (or double) ones.
  void load_queries(Eigen::Index begin, Eigen::Index len, ChunkBuffers<T>& buf) const override {
    const Matrix<T> x = converted(q_.middleRows(begin, len));
    if constexpr (kLogScaled) {
      if (this->log_scaled()) {
        store(map_.scaled_features(x, buf.log_scratch), buf.q, len, "queries");
        buf.log_q.head(len) = buf.log_scratch;
        return;
      }
    }
    store(map_.queries(x), buf.q, len, "queries");
  }
  void load_keys_values(Eigen::Index begin, Eigen::Index len, ChunkBuffers<T>& buf) const override {
    const Matrix<T> x = converted(k_.middleRows(begin, len));
    if constexpr (kLogScaled) {
      if (this->log_scaled()) {
        store(map_.scaled_features(x, buf.log_scratch), buf.k, len, "keys");
        buf.log_k.head(len) = buf.log_scratch;
        load_rows(v_.middleRows(begin, len), buf.v);
        return;
      }
    }
    store(map_.keys(x), buf.k, len, "keys");
    load_rows(v_.middleRows(begin, len), buf.v);
  }

 private:
  /// The chunk `rows` in T, for the feature map.
  template <class Rows>
  static Matrix<T> converted(const Eigen::MatrixBase<Rows>& rows) {
    if constexpr (is_half_scalar<typename Rows::Scalar>) {
      Matrix<T> x(rows.rows(), rows.cols());
      load_rows(rows, x);
      return x;
    } else {
      return rows.template cast<T>();
    }
  }

  void store(const Matrix<T>& phi, Matrix<T>& dst, Eigen::Index len, const char* what) const {
    if (phi.rows() != len || phi.cols() != this->feature_dim()) {
      throw Error(std::string(where_) + ": the feature map's " + what + " returned " +
                  shape_string(phi) + " for " + std::to_string(len) + " rows; expected " +
                  shape_string(len, this->feature_dim()));
    }
    if (check_finite_) require_finite(phi, where_, what);  // a feature map's own overflow
    dst.topRows(len) = phi;
  }

  const DQ& q_;
  const DK& k_;
  const DV& v_;
  const Map& map_;
  bool check_finite_;
  const char* where_;
};

/// body(source) with the one source every entry point builds over q, k, v: the rows read as
/// features (Identity) or featurized chunk by chunk by `map`, with `gates` attached when not
/// null. Per-feature gates read plain features (an exponential map's checked finite).
template <class T, class DQ, class DK, class DV, class Map, class Body>
void with_source(const DQ& q, const DK& k, const DV& v, const Map& map, const GateRows* gates,
                 bool check_finite, const char* where, const Body& body) {
  if constexpr (is_identity_map<Map>) {
    FeaturizedSource<T, DQ, DK, DV> source(q, k, v);
    if (gates != nullptr) source.attach_gates(*gates);
    body(static_cast<ChunkSource<T>&>(source));
  } else {
    MappedSource<T, DQ, DK, DV, Map> source(q, k, v, map, check_finite, where,
                                            gates == nullptr || gates->cols() == 1);
    if (gates != nullptr) source.attach_gates(*gates);
    body(static_cast<ChunkSource<T>&>(source));
  }
}

/// Rows [begin, begin + rows) of another source; the chunk buffers hold all scratch space, so
/// threads may read one source through ranges of their own.
template <class T>
class RowRange final : public ChunkSource<T> {
 public:
  RowRange(const ChunkSource<T>& source, Eigen::Index begin, Eigen::Index rows)
      : ChunkSource<T>(rows, source.feature_dim(), source.value_dim(), source.log_scaled(),
                       source.gate_dim()),
        source_(source),
        begin_(begin) {
    LINATTN_ASSERT(begin >= 0 && rows >= 0 && begin + rows <= source.rows());
  }

  bool rows_in_place(Eigen::Index begin, ChunkRows<T>& rows) const override {
    return source_.rows_in_place(begin_ + begin, rows);
  }
  void load_queries(Eigen::Index begin, Eigen::Index len, ChunkBuffers<T>& buf) const override {
    source_.load_queries(begin_ + begin, len, buf);
  }
  void load_keys_values(Eigen::Index begin, Eigen::Index len, ChunkBuffers<T>& buf) const override {
    source_.load_keys_values(begin_ + begin, len, buf);
  }
  void load_log_gates(Eigen::Index begin, Eigen::Index len, LogRows& dst) const override {
    source_.load_log_gates(begin_ + begin, len, dst);
  }

 private:
  const ChunkSource<T>& source_;
  Eigen::Index begin_;
};

/// Output rows of the kernel: row-major, any strides (one type, so one kernel per scalar).
template <class O>
using OutRows = Eigen::Ref<Matrix<O>, 0, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>>;

/// state <- exp(log_transition) state + segment: appends the sums of a segment, computed from
/// an empty state, to the sums before it. log_transition is the segment's total log decay or
/// log gate: rows * log g for a constant decay, 0 for non-causal sums, -infinity after a reset.
template <class T>
void append_segment(CarriedState<T>& state, const CarriedState<T>& segment, double log_transition) {
  if (segment.empty()) return;
  if (state.empty() || log_transition == -std::numeric_limits<double>::infinity()) {
    state = segment;
    return;
  }
  const double decayed = state.log_scale + log_transition;
  const double top = std::max(decayed, segment.log_scale);
  const T before = exp_as<T>(decayed - top);
  const T after = exp_as<T>(segment.log_scale - top);
  state.s = before * state.s + after * segment.s;
  state.z = before * state.z + after * segment.z;
  state.log_scale = top;
}

/// state <- diag(exp(log_transition)) state + segment, per feature: append_segment for
/// per-feature gates (log_transition: C entries, -infinity where a feature was reset).
template <class T>
void append_segment_rows(CarriedState<T>& state, CarriedState<T> segment,
                         const Eigen::Array<double, Eigen::Dynamic, 1>& log_transition) {
  if (segment.empty()) return;
  segment.fold_rows();
  if (state.empty()) {
    state = std::move(segment);
    return;
  }
  state.fold_rows();
  // The segment was summed from an empty state with plain features: log_scale 0.
  const T lift = exp_as<T>(segment.log_scale - state.log_scale);
  for (Eigen::Index c = 0; c < state.s.rows(); ++c) {
    const T carry = exp_as<T>(log_transition(c));
    state.s.row(c) = carry * state.s.row(c) + lift * segment.s.row(c);
    state.z(c) = carry * state.z(c) + lift * segment.z(c);
  }
}

/// Largest spread of log-scales inside one streamed chunk: factors down to exp(-range) stay
/// normal numbers, so nothing a later token does can flush an earlier one to zero.
template <class T>
inline constexpr double kStreamLogRange = std::is_same_v<T, float> ? 40.0 : 300.0;

/// Runs the recurrence chunk by chunk, for every transition: none, a constant decay, scalar
/// gates (per-token factors of the register-tiled stream, or a masked, weighted product of
/// queries and keys when they spread too far) and per-feature gates (the stream on queries and
/// keys weighted per feature, over pieces of the chunk short enough that every weight fits).
/// Across chunks the carried state. T is the accumulation type, O the output's scalar.
template <class T, class O>
class ChunkedKernel {
 public:
  ChunkedKernel(Eigen::Index feature_dim, Eigen::Index value_dim, Eigen::Index rows,
                const Options& options)
      : chunk_(std::max<Eigen::Index>(1, std::min(options.chunk, rows))),
        options_(options),
        log_decay_(std::log(options.decay)),
        log_output_scale_(output_log_scale(options)),
        buf_(chunk_, feature_dim, value_dim) {}

  /// Causal attention over all rows of `src`, continuing from `state` and leaving it after the
  /// last token. out: N x Dv.
  void causal(const ChunkSource<T>& src, CarriedState<T>& state, OutRows<O> out) {
    if (src.gate_dim() > 1) {
      feature_gated(src, state, out);
      return;
    }
    state.fold_rows();
    gated_ = src.gate_dim() == 1;
    const bool scaled = src.log_scaled() || !state.unscaled();
    const bool plain = !scaled && !gated_ && !has_decay();
    ChunkRows<T> in_place{};
    Eigen::Index len = 0;
    for (Eigen::Index begin = 0; begin < src.rows(); begin += len) {
      len = std::min(chunk_, src.rows() - begin);
      if (plain && src.rows_in_place(begin, in_place)) {
        // The plain stream reads the caller's rows directly: no copy through the buffers.
        OutRows<O> out_rows(out.middleRows(begin, len));
        plain_stream_chunk(len, in_place, state, out_rows);
        continue;
      }
      if (gated_) {
        len = load_scalar_gates(src, begin, len, state);
      } else {
        constant_decay(len);
      }
      OutRows<O> out_rows(out.middleRows(begin, len));
      // The scaled stream weights the keys into their own buffer, so plain features can stay
      // where they are; the masked product (the fallback) needs them loaded.
      const bool read_in_place = !src.log_scaled() && src.rows_in_place(begin, in_place);
      if (!read_in_place) {
        src.load_queries(begin, len, buf_);
        src.load_keys_values(begin, len, buf_);
      }
      if (plain) {
        plain_stream_chunk(len, buffer_rows(buf_.k), state, out_rows);
        continue;
      }
      if (!src.log_scaled()) {
        buf_.log_q.head(len).setZero();
        buf_.log_k.head(len).setZero();
      }
      scan_running_log(len, state.log_scale);
      const ChunkRows<T> rows = read_in_place ? in_place : buffer_rows(buf_.k);
      if (scaled_stream_chunk(len, rows, state, out_rows)) continue;
      if (read_in_place) {
        src.load_queries(begin, len, buf_);
        src.load_keys_values(begin, len, buf_);
      }
      masked_product_chunk(len, state, out_rows);
    }
  }

  /// Adds every row of `src` to `state` without computing outputs:
  /// S <- A S + sum_j A_j phi_k_j v_j^T (and z alike), A the transition over all rows and A_j
  /// the one after token j. The state of a segment on its own, for the sequence-parallel
  /// driver and the non-causal sums. Scalar gates or a constant decay only. When given,
  /// *log_transition receives log A (-infinity when a gate reset the state).
  void absorb(const ChunkSource<T>& src, CarriedState<T>& state, double* log_transition = nullptr) {
    LINATTN_ASSERT(src.gate_dim() <= 1);
    state.fold_rows();
    gated_ = src.gate_dim() == 1;
    const Eigen::Index n = src.rows();
    const bool plain = !gated_ && !has_decay() && !src.log_scaled();
    ChunkRows<T> in_place{};
    if (plain && state.unscaled() && src.rows_in_place(0, in_place)) {
      // The caller's rows, streamed in place: no copy, no GEMM on thin chunks.
      stream_sums(n, in_place, state);
      if (log_transition != nullptr) *log_transition = 0.0;
      return;
    }
    double total = 0.0;
    Eigen::Index len = 0;
    for (Eigen::Index begin = 0; begin < n; begin += len) {
      len = std::min(chunk_, n - begin);
      if (gated_) {
        len = load_scalar_gates(src, begin, len, state);
        if (reset_) total = -std::numeric_limits<double>::infinity();
      } else {
        constant_decay(len);
      }
      src.load_keys_values(begin, len, buf_);
      Eigen::Ref<Matrix<T>> keys = buf_.k.topRows(len);
      Eigen::Ref<Matrix<T>> values = buf_.v.topRows(len);
      total += decay_to(len - 1);
      if (plain && state.unscaled()) {
        stream_sums(len, buffer_rows(buf_.k), state);
        continue;
      }
      if (!src.log_scaled()) buf_.log_k.head(len).setZero();
      // Every weight is taken relative to the largest, so nothing overflows.
      const double decayed = state.log_scale + decay_to(len - 1);
      double top = decayed;
      for (Eigen::Index r = 0; r < len; ++r) {
        top = std::max(top, buf_.log_k(r) + span(len - 1, r));
      }
      Eigen::Ref<Matrix<T>> weighted = buf_.weighted_keys.topRows(len);
      for (Eigen::Index r = 0; r < len; ++r) {
        weighted.row(r) = keys.row(r) * exp_as<T>(buf_.log_k(r) + span(len - 1, r) - top);
      }
      const T carry = exp_as<T>(decayed - top);
      state.s *= carry;
      state.z *= carry;
      state.s.noalias() += weighted.transpose() * values;
      state.z += weighted.colwise().sum().transpose();
      state.log_scale = top;
    }
    if (log_transition != nullptr) *log_transition = total;
  }

  /// absorb for per-feature gates (plain features): S <- diag(exp(sum g)) S + sum_j
  /// diag(exp(sum_{i > j} g_i)) k_j v_j^T per chunk, the weights suffix sums of the log gates
  /// (a reset gives a weight of 0, never a NaN). log_transition receives the C total logs.
  void absorb_rows(const ChunkSource<T>& src, CarriedState<T>& state,
                   Eigen::Array<double, Eigen::Dynamic, 1>& log_transition) {
    const Eigen::Index c = state.s.rows();
    LINATTN_ASSERT(!src.log_scaled() && src.gate_dim() == c);
    size_feature_gates(c);
    if (state.empty()) state.log_scale = 0.0;  // s and z are zero
    const double base = state.log_scale;
    log_transition.setZero(c);
    for (Eigen::Index begin = 0; begin < src.rows(); begin += chunk_) {
      const Eigen::Index len = std::min(chunk_, src.rows() - begin);
      src.load_log_gates(begin, len, buf_.log_gate);
      src.load_keys_values(begin, len, buf_);
      LogRows& suffix = buf_.cum;  // row j: sum of the log gates after token j
      suffix.row(len - 1).setZero();
      for (Eigen::Index j = len - 2; j >= 0; --j) {
        suffix.row(j) = suffix.row(j + 1) + buf_.log_gate.row(j + 1);
      }
      // Row 0 of the gates becomes the chunk's whole log transition (no allocation per chunk).
      buf_.log_gate.row(0) += suffix.row(0);
      log_transition += buf_.log_gate.row(0).transpose();
      state.settle_rows(state.row_log + buf_.log_gate.row(0).transpose(), kGateDrift);
      Eigen::Ref<Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> w =
          buf_.feature_weights.topRows(len);
      // The exponents are taken in double (tiny gates survive), their exps in T; below -1e4
      // (a reset, or gates far past underflow) the weight is 0 either way, and T holds them.
      w = (((suffix.topRows(len).rowwise() - state.row_log.transpose()) - base).max(-1.0e4))
              .template cast<T>();
      Eigen::Ref<Matrix<T>> weighted = buf_.weighted_keys.topRows(len);
      weighted.array() = buf_.k.topRows(len).array() * w.exp();
      state.s.noalias() += weighted.transpose() * buf_.v.topRows(len);
      state.z += weighted.colwise().sum().transpose();
    }
  }

  /// Outputs of every row of `src` against fixed sums `state` (the non-causal second pass).
  void attend_fixed(const ChunkSource<T>& src, const CarriedState<T>& state, OutRows<O> out) {
    LINATTN_ASSERT(!state.rows_pending);
    const Eigen::Index n = src.rows();
    for (Eigen::Index begin = 0; begin < n; begin += chunk_) {
      const Eigen::Index len = std::min(chunk_, n - begin);
      src.load_queries(begin, len, buf_);
      Eigen::Ref<Matrix<T>> queries = buf_.q.topRows(len);
      buf_.num.topRows(len).noalias() = queries * state.s;
      buf_.den.head(len).noalias() = queries * state.z;
      OutRows<O> out_rows(out.middleRows(begin, len));
      if (src.log_scaled()) {
        buf_.output_log.head(len) = buf_.log_q.head(len).array() + state.log_scale;
        write_scaled_output(len, out_rows);
      } else {
        write_unscaled_output(len, out_rows);
      }
    }
  }

 private:
  bool has_decay() const { return options_.decay != 1.0; }

  static constexpr double kStreamRange = kStreamLogRange<T>;

  /// The log transition of token r of the chunk (its gate, or the constant decay).
  double step_log(Eigen::Index r) const { return gated_ ? buf_.log_gate(r, 0) : log_decay_; }
  /// How far the running log-scale may drift below a key's: gates keep their factors pending.
  double drift() const { return gated_ ? kGateDrift : 0.0; }
  /// P_r: the log transition from the chunk's start through token r.
  double decay_to(Eigen::Index r) const { return buf_.decay(r) + buf_.decay_lo(r); }
  /// P_i - P_j, from the double-double: exact enough for gates of 1 - 1e-8 after strong ones.
  double span(Eigen::Index i, Eigen::Index j) const {
    return (buf_.decay(i) - buf_.decay(j)) + (buf_.decay_lo(i) - buf_.decay_lo(j));
  }

  /// P_r = (r + 1) log g for the constant decay.
  void constant_decay(Eigen::Index len) {
    for (Eigen::Index r = 0; r < len; ++r) buf_.decay(r) = static_cast<double>(r + 1) * log_decay_;
    buf_.decay_lo.head(len).setZero();
  }

  /// Sizes the gate buffer for `cols` gates per token.
  void size_gates(Eigen::Index cols) {
    if (buf_.log_gate.rows() != chunk_ || buf_.log_gate.cols() != cols) {
      buf_.log_gate.resize(chunk_, cols);
    }
  }

  /// Sizes the buffers of per-feature gates: the gates, their sums and the weights, L x C.
  void size_feature_gates(Eigen::Index c) {
    size_gates(c);
    if (buf_.cum.rows() != chunk_ || buf_.cum.cols() != c) {
      buf_.cum.resize(chunk_, c);
      buf_.feature_weights.resize(chunk_, c);
    }
  }

  /// Loads the scalar log gates of tokens [begin, begin + len) and their prefix sums P_r;
  /// returns the chunk's length, cut before the next reset. A reset on the first token clears
  /// the state (it forgets everything before; reset_ says so), and then moves nothing.
  Eigen::Index load_scalar_gates(const ChunkSource<T>& src, Eigen::Index begin, Eigen::Index len,
                                 CarriedState<T>& state) {
    constexpr double kReset = -std::numeric_limits<double>::infinity();
    size_gates(1);
    src.load_log_gates(begin, len, buf_.log_gate);
    for (Eigen::Index r = 1; r < len; ++r) {
      if (buf_.log_gate(r, 0) == kReset) {
        len = r;
        break;
      }
    }
    reset_ = buf_.log_gate(0, 0) == kReset;
    if (reset_) {
      state.s.setZero();
      state.z.setZero();
      state.log_scale = kReset;
      buf_.log_gate(0, 0) = 0.0;
    }
    // TwoSum: hi + lo is the exact running sum to double-double precision.
    double hi = 0.0;
    double lo = 0.0;
    for (Eigen::Index r = 0; r < len; ++r) {
      const double x = buf_.log_gate(r, 0);
      const double sum = hi + x;
      const double x_part = sum - hi;
      lo += (hi - (sum - x_part)) + (x - x_part);
      hi = sum;
      buf_.decay(r) = hi;
      buf_.decay_lo(r) = lo;
    }
    return len;
  }

  /// No decay, no scale: the register-tiled stream over the chunk, S and z updated in place.
  void plain_stream_chunk(Eigen::Index len, const ChunkRows<T>& rows, CarriedState<T>& state,
                          OutRows<O>& out) {
    stream_chunk(0, len, rows, state);
    state.log_scale = 0.0;
    write_unscaled_output(len, out);
  }

  /// S += sum_t k_t v_t^T, z += sum_t k_t over `len` tokens of `rows` (q unused): the stream
  /// kernel without its readout, half its FLOPs.
  void stream_sums(Eigen::Index len, const ChunkRows<T>& rows, CarriedState<T>& state) {
    const Eigen::Index c = state.s.rows();
    const Eigen::Index dv = state.s.cols();
    const StreamOperands<T> operands{
        nullptr, 0, rows.k, rows.ldk, rows.v, rows.ldv, state.s.data(), dv, nullptr, 0, len, c, dv};
    stream_product(operands);
    // Token by token, as S: the same sums however the rows are split into chunks.
    for (Eigen::Index t = 0; t < len; ++t) {
      state.z += Eigen::Map<const Vector<T>>(rows.k + t * rows.ldk, c);
    }
    state.log_scale = 0.0;
  }

  /// The chunk buffers' q and v, with keys taken from `keys`.
  ChunkRows<T> buffer_rows(const Matrix<T>& keys) const {
    return {buf_.q.data(), buf_.q.cols(), keys.data(), keys.cols(), buf_.v.data(), buf_.v.cols()};
  }

  /// num, den for tokens [first, first + len) of the chunk by the stream kernel (`rows` points
  /// at the chunk's first token).
  void stream_chunk(Eigen::Index first, Eigen::Index len, const ChunkRows<T>& rows,
                    CarriedState<T>& state) {
    const Eigen::Index c = state.s.rows();
    const Eigen::Index dv = state.s.cols();
    buf_.num.middleRows(first, len).setZero();
    const T* q = rows.q + first * rows.ldq;
    const T* k = rows.k + first * rows.ldk;
    const StreamOperands<T> operands{q,
                                     rows.ldq,
                                     k,
                                     rows.ldk,
                                     rows.v + first * rows.ldv,
                                     rows.ldv,
                                     state.s.data(),
                                     dv,
                                     buf_.num.data() + first * dv,
                                     dv,
                                     len,
                                     c,
                                     dv};
    stream_product(operands);
    stream_denominator(q, rows.ldq, k, rows.ldk, len, c, state.z.data(), buf_.den.data() + first);
  }

  /// c_i = next_log_scale(c_{i-1}, the token's log transition, log_k_i) from the carried c.
  void scan_running_log(Eigen::Index len, double carried) {
    double previous = carried;
    for (Eigen::Index r = 0; r < len; ++r) {
      previous = next_log_scale(previous, step_log(r), buf_.log_k(r), drift());
      buf_.running_log(r) = previous;
    }
  }

  /// The stream with the transition and log-scales folded into per-token factors. Relative to
  /// one reference rho for the chunk, key j is weighted exp(log_k_j - P_j - rho) and output i
  /// multiplied by exp(rho - c_i + P_i); every factor is exp of at most kStreamRange. Returns
  /// false, touching nothing, when the chunk spreads wider.
  bool scaled_stream_chunk(Eigen::Index len, const ChunkRows<T>& rows, CarriedState<T>& state,
                           OutRows<O>& out) {
    const double carried = state.log_scale;
    double rho = carried;
    double lowest = std::numeric_limits<double>::infinity();
    for (Eigen::Index r = 0; r < len; ++r) {
      const double step = decay_to(r);
      rho = std::max(rho, buf_.log_k(r) - step);
      lowest = std::min(lowest, buf_.running_log(r) - step);
    }
    if (!(rho - lowest <= kStreamRange)) return false;

    const Eigen::Index c = state.s.rows();
    // The per-token factors, their exps vectorised: key weights in key_factor, output
    // lifts in output_log (which gets its final value below).
    for (Eigen::Index r = 0; r < len; ++r) {
      buf_.key_factor(r) = buf_.log_k(r) - decay_to(r) - rho;
      buf_.output_log(r) = rho - (buf_.running_log(r) - decay_to(r));
    }
    buf_.key_factor.head(len) = buf_.key_factor.head(len).array().exp();
    buf_.output_log.head(len) = buf_.output_log.head(len).array().exp();
    Eigen::Ref<Matrix<T>> weighted = buf_.weighted_keys.topRows(len);
    for (Eigen::Index r = 0; r < len; ++r) {
      weighted.row(r) =
          Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(rows.k + r * rows.ldk, c) *
          static_cast<T>(buf_.key_factor(r));
    }
    const T carry = exp_as<T>(carried - rho);
    if (carry != T(1)) {
      state.s *= carry;
      state.z *= carry;
    }
    stream_chunk(0, len, {rows.q, rows.ldq, weighted.data(), c, rows.v, rows.ldv}, state);
    for (Eigen::Index r = 0; r < len; ++r) {
      const T lift = static_cast<T>(buf_.output_log(r));
      buf_.num.row(r) *= lift;
      buf_.den(r) *= lift;
    }
    const double last = buf_.running_log(len - 1);
    const T settle = exp_as<T>(rho - (last - decay_to(len - 1)));
    if (settle != T(1)) {
      state.s *= settle;
      state.z *= settle;
    }
    state.log_scale = last;
    buf_.output_log.head(len) = buf_.log_q.head(len) + buf_.running_log.head(len);
    write_scaled_output(len, out);
    return true;
  }

  /// The chunk as a masked, weighted Q K^T product plus the carried state, all GEMMs. Token
  /// i's output is computed relative to its own running scale c_i (scan_running_log), which
  /// looks at no later token, so every weight below is exp of at most the drift and nothing
  /// overflows, however wide the chunk's log-scales and gates spread.
  void masked_product_chunk(Eigen::Index len, CarriedState<T>& state, OutRows<O>& out) {
    Eigen::Ref<Matrix<T>> queries = buf_.q.topRows(len);
    Eigen::Ref<Matrix<T>> keys = buf_.k.topRows(len);
    Eigen::Ref<Matrix<T>> values = buf_.v.topRows(len);
    Eigen::Ref<Matrix<T>> scores = buf_.scores.topLeftCorner(len, len);
    Eigen::Ref<Matrix<T>> num = buf_.num.topRows(len);
    Eigen::Ref<Vector<T>> den = buf_.den.head(len);
    const double carried = state.log_scale;

    scores.noalias() = queries * keys.transpose();
    for (Eigen::Index i = 0; i < len; ++i) {
      const double c_i = buf_.running_log(i);
      for (Eigen::Index j = 0; j <= i; ++j) {
        scores(i, j) *= exp_as<T>(buf_.log_k(j) + span(i, j) - c_i);
      }
      for (Eigen::Index j = i + 1; j < len; ++j) scores(i, j) = T(0);
    }
    if (state.empty()) {
      num.setZero();
      den.setZero();
    } else {
      num.noalias() = queries * state.s;
      den.noalias() = queries * state.z;
      for (Eigen::Index r = 0; r < len; ++r) {
        const T carry = exp_as<T>(carried + decay_to(r) - buf_.running_log(r));
        num.row(r) *= carry;
        den(r) *= carry;
      }
    }
    num.noalias() += scores * values;
    den += scores.rowwise().sum();

    const double last = buf_.running_log(len - 1);
    Eigen::Ref<Matrix<T>> weighted = buf_.weighted_keys.topRows(len);
    for (Eigen::Index r = 0; r < len; ++r) {
      weighted.row(r) = keys.row(r) * exp_as<T>(buf_.log_k(r) + span(len - 1, r) - last);
    }
    const T carry = exp_as<T>(carried + decay_to(len - 1) - last);
    state.s *= carry;
    state.z *= carry;
    state.s.noalias() += weighted.transpose() * values;
    state.z += weighted.colwise().sum().transpose();
    state.log_scale = last;

    buf_.output_log.head(len) = buf_.log_q.head(len) + buf_.running_log.head(len);
    write_scaled_output(len, out);
  }

  /// Per-feature gates over all rows of `src` (plain features: the source keeps no per-token
  /// scale), chunk by chunk.
  void feature_gated(const ChunkSource<T>& src, CarriedState<T>& state, OutRows<O> out) {
    LINATTN_ASSERT(!src.log_scaled() && src.gate_dim() == state.s.rows());
    const Eigen::Index c = state.s.rows();
    size_feature_gates(c);
    ChunkRows<T> rows{};
    for (Eigen::Index begin = 0; begin < src.rows(); begin += chunk_) {
      const Eigen::Index len = std::min(chunk_, src.rows() - begin);
      src.load_log_gates(begin, len, buf_.log_gate);
      // In place, the weighting reads the caller's q and k once and v is never copied.
      if (!src.rows_in_place(begin, rows)) {
        src.load_queries(begin, len, buf_);
        src.load_keys_values(begin, len, buf_);
        rows = buffer_rows(buf_.k);
      }
      OutRows<O> out_rows(out.middleRows(begin, len));
      feature_gated_chunk(len, rows, state, out_rows);
    }
  }

  /// One chunk with per-feature gates, as pieces [p, m]. Token p's gate moves the state on
  /// (settle_rows: into the pending row logs R while they stay within the drift), and then
  /// x_t = R + sum_{p < i <= t} g_i per feature, in double, while it stays within kStreamRange
  /// of 0 in every feature (a reset, g = -infinity, ends the piece). The stream runs on
  /// q_t exp(x_t) and k_t exp(-x_t - log_scale): S read and written at token p's reference,
  /// every pair's weight exp(x_t - x_j) <= 1; then x_m settles as the rows' new pending logs.
  /// So S is only multiplied when the logs pass the drift, and a gate of 1 - 1e-8 is not lost
  /// to rounding. The sums and weights are formed a few tokens at a time, in cache.
  void feature_gated_chunk(Eigen::Index len, const ChunkRows<T>& in, CarriedState<T>& state,
                           OutRows<O>& out) {
    using Rows = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                            0, Eigen::OuterStride<>>;
    // Tokens whose sums are formed and range-checked together: x_t only falls, so the last
    // one's check covers them all.
    constexpr Eigen::Index kAhead = 8;
    if (state.empty()) state.log_scale = 0.0;  // s and z are zero
    const double base = state.log_scale;
    const Eigen::Index c = state.s.rows();
    LogRows& x = buf_.cum;  // row t: x_t
    // The weighted q and k go to the buffers; v is read where it is.
    const ChunkRows<T> rows{buf_.q.data(), buf_.q.cols(), buf_.k.data(),
                            buf_.k.cols(), in.v,          in.ldv};
    // q_t exp(x_t) and k_t exp(-x_t - base) for tokens [first, first + n).
    const auto weigh = [&](Eigen::Index first, Eigen::Index n) {
      Eigen::Ref<Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> w =
          buf_.feature_weights.topRows(n);
      w = x.middleRows(first, n).template cast<T>();  // a plain block: converted vectorised
      const Rows queries(in.q + first * in.ldq, n, c, Eigen::OuterStride<>(in.ldq));
      const Rows keys(in.k + first * in.ldk, n, c, Eigen::OuterStride<>(in.ldk));
      if (base == 0.0) {
        // One exponential a weight: the key's is the query's inverse.
        w = w.exp();
        buf_.q.middleRows(first, n).array() = queries * w;
        buf_.k.middleRows(first, n).array() = keys / w;
      } else {
        buf_.q.middleRows(first, n).array() = queries * w.exp();
        buf_.k.middleRows(first, n).array() = keys * (-w - static_cast<T>(base)).exp();
      }
    };
    Eigen::Index p = 0;
    while (p < len) {
      state.settle_rows(state.row_log + buf_.log_gate.row(p).transpose(), kGateDrift);
      x.row(p) = state.row_log.transpose();
      weigh(p, 1);
      Eigen::Index m = p;  // the piece's last token so far
      while (m + 1 < len) {
        const Eigen::Index ahead = std::min(kAhead, len - 1 - m);
        for (Eigen::Index t = m + 1; t <= m + ahead; ++t) {
          x.row(t) = x.row(t - 1) + buf_.log_gate.row(t);
        }
        Eigen::Index fits = ahead;
        if (!(x.row(m + ahead).minCoeff() >= -kStreamRange)) {
          fits = 0;
          while (x.row(m + 1 + fits).minCoeff() >= -kStreamRange) ++fits;
        }
        if (fits > 0) weigh(m + 1, fits);
        m += fits;
        if (fits < ahead) break;
      }
      stream_chunk(p, m - p + 1, rows, state);
      state.settle_rows(x.row(m).transpose(), kGateDrift);
      p = m + 1;
    }
    if (base == 0.0) {
      write_unscaled_output(len, out);
    } else {
      buf_.output_log.head(len).setConstant(base);
      write_scaled_output(len, out);
    }
  }

  void write_unscaled_output(Eigen::Index len, OutRows<O>& out) {
    for (Eigen::Index r = 0; r < len; ++r) write_row(r, 0.0, out);
  }

  /// Rows whose num and den miss the factor exp(output_log).
  void write_scaled_output(Eigen::Index len, OutRows<O>& out) {
    for (Eigen::Index r = 0; r < len; ++r) write_row(r, buf_.output_log(r), out);
  }

  /// Output row r of the chunk. Rows with adjacent entries are written through a plain row
  /// map (vectorised); a 16-bit row is finished in T, then rounded by convert(), many at a
  /// time: the same values as Eigen's cast, element by element.
  void write_row(Eigen::Index r, double log_factor, OutRows<O>& out) {
    if (out.cols() == 0) return;
    log_factor += log_output_scale_;  // Options::scale on phi(q): the same factor on num, den
    if (out.innerStride() == 1) {
      Eigen::Map<Eigen::Matrix<O, 1, Eigen::Dynamic>> row(&out.coeffRef(r, 0), out.cols());
      if constexpr (is_half_scalar<O>) {
        out_row_.resize(buf_.num.cols());
        write_output_row(buf_.num.row(r), buf_.den(r), log_factor, options_, out_row_);
        convert(out_row_.data(), row.data(), out_row_.size());
      } else {
        write_output_row(buf_.num.row(r), buf_.den(r), log_factor, options_, row);
      }
    } else {
      write_output_row(buf_.num.row(r), buf_.den(r), log_factor, options_, out.row(r));
    }
  }

  Eigen::Index chunk_;
  Options options_;
  double log_decay_;
  double log_output_scale_;  ///< log Options::scale
  bool gated_ = false;       ///< the current call's source has scalar gates
  bool reset_ = false;       ///< the last chunk loaded by load_scalar_gates began with a reset
  ChunkBuffers<T> buf_;
  Eigen::Matrix<T, 1, Eigen::Dynamic> out_row_;  ///< Dv, for 16-bit outputs only
};

}  // namespace linattn::detail
