// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/detail/random.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <string>
#include <type_traits>
#include <utility>

namespace linattn {

namespace detail {

/// Entries per step of the maps' elementwise loops; a multiple of every SIMD width.
inline constexpr Eigen::Index kMapBlock = 16;

/// One step's entries: a fixed-size, aligned array, so Eigen evaluates exp, sin and cos on it
/// with the same SIMD code whatever the length, stride and alignment of the caller's rows. An
/// entry's value then depends on its input alone (the allocating and _into forms, a chunk and a
/// single token all give the same bits), where an expression over a whole matrix would take
/// the scalar std:: functions for unaligned heads and tails (up to an ulp apart).
template <class T>
using MapBlock = Eigen::Array<T, 1, kMapBlock>;

/// Calls step(start, length) over [0, n) in steps of kMapBlock.
template <class Step>
void for_each_block(Eigen::Index n, const Step& step) {
  for (Eigen::Index start = 0; start < n; start += kMapBlock) {
    step(start, std::min(kMapBlock, n - start));
  }
}

/// Entries [start, start + length) of the row `row` in a MapBlock of type T, zero-padded.
template <class T, class Row>
MapBlock<T> load_block(const Row& row, Eigen::Index start, Eigen::Index length) {
  MapBlock<T> block;
  if (length == kMapBlock) {
    block = row.template segment<kMapBlock>(start).array().template cast<T>();
  } else {
    block.setZero();
    block.head(length) = row.segment(start, length).array().template cast<T>();
  }
  return block;
}

/// Writes the first `length` entries of `block` to entries [start, start + length) of `row`,
/// rounded to the row's type.
template <class Row, class T>
void store_block(Row&& row, Eigen::Index start, Eigen::Index length, const MapBlock<T>& block) {
  using Out = typename std::decay_t<Row>::Scalar;
  if (length == kMapBlock) {
    row.template segment<kMapBlock>(start) = block.template cast<Out>().matrix();
  } else {
    row.segment(start, length) = block.head(length).template cast<Out>().matrix();
  }
}

/// x as the maps read it: itself for a Matrix, Map, block or transpose (no copy), an evaluated
/// copy of any other expression (a product, a scaled or cast matrix), so such an x maps exactly
/// as the matrix it evaluates to.
template <class Derived>
using nested_rows_t = typename Eigen::internal::nested_eval<Derived, 16>::type;

/// Throws unless `out` is rows x cols (an _into form's caller-provided output).
template <class DO>
void require_out_shape(const DO& out, Eigen::Index rows, Eigen::Index cols, const char* where) {
  if (out.rows() != rows || out.cols() != cols) {
    throw Error(std::string(where) + ": out is " + shape_string(out.rows(), out.cols()) +
                " but must be " + shape_string(rows, cols) + " (x.rows() x feature_dim)");
  }
}

}  // namespace detail

/// phi(x) = elu(x) + 1 (x + 1 for x > 0, exp(x) otherwise), C = Dk. Positive, the map of
/// "Transformers are RNNs".
struct EluPlusOne {
  /// x + 1 or exp(x <= 0): finite for finite x.
  static constexpr bool finite_features = true;

  /// @return C = input_dim
  Eigen::Index feature_dim(Eigen::Index input_dim) const { return input_dim; }

  /// @param x  N x Dk queries, one row per token
  /// @return   N x Dk features
  template <class Derived>
  Matrix<typename Derived::Scalar> queries(const Eigen::MatrixBase<Derived>& x) const {
    Matrix<typename Derived::Scalar> phi(x.rows(), x.cols());
    apply(x, phi, "EluPlusOne::queries");
    return phi;
  }

  /// @param x  N x Dk keys, one row per token
  /// @return   N x Dk features
  template <class Derived>
  Matrix<typename Derived::Scalar> keys(const Eigen::MatrixBase<Derived>& x) const {
    return queries(x);
  }

  /// As queries(x), bit for bit, into a caller's N x Dk `out` (which may be x itself).
  /// Allocates nothing (16-bit inputs included), unless x is an expression (a product, a scaled
  /// or cast matrix), which is evaluated first.
  /// @throws Error  if out is not N x Dk (out is then unchanged)
  template <class Derived>
  void queries_into(const Eigen::MatrixBase<Derived>& x,
                    Eigen::Ref<Matrix<typename Derived::Scalar>> out) const {
    apply(x, out, "EluPlusOne::queries_into");
  }

  /// As keys(x), bit for bit, into a caller's N x Dk `out`; see queries_into.
  template <class Derived>
  void keys_into(const Eigen::MatrixBase<Derived>& x,
                 Eigen::Ref<Matrix<typename Derived::Scalar>> out) const {
    apply(x, out, "EluPlusOne::keys_into");
  }

  /// Carries a gradient through the map (queries and keys alike): d phi / d x is 1 for x > 0
  /// and exp(x) otherwise.
  /// @param x         N x Dk inputs the features were computed from
  /// @param grad_phi  N x Dk gradient of the loss with respect to phi(x)
  /// @return          N x Dk gradient with respect to x
  template <class DX, class DG>
  Matrix<typename DX::Scalar> backward(const Eigen::MatrixBase<DX>& x,
                                       const Eigen::MatrixBase<DG>& grad_phi) const {
    using Scalar = typename DX::Scalar;
    detail::require_same_shape(x, grad_phi, "EluPlusOne::backward");
    Matrix<Scalar> grad = x;
    grad = grad_phi.array() * grad.array().min(Scalar(0)).exp();
    return grad;
  }

 private:
  template <class Derived>
  static void apply(const Eigen::MatrixBase<Derived>& x,
                    Eigen::Ref<Matrix<typename Derived::Scalar>> out, const char* where) {
    using Scalar = typename Derived::Scalar;
    // 16-bit inputs are computed in float and rounded once (their arithmetic is emulated).
    using Work = detail::default_accumulator_t<Scalar>;
    detail::require_out_shape(out, x.rows(), x.cols(), where);
    const detail::nested_rows_t<Derived> rows(x.derived());
    for (Eigen::Index r = 0; r < out.rows(); ++r) {
      detail::for_each_block(out.cols(), [&](Eigen::Index start, Eigen::Index length) {
        detail::MapBlock<Work> block = detail::load_block<Work>(rows.row(r), start, length);
        // max(x, 0) + exp(min(x, 0)) is elu(x) + 1 exactly, and vectorises where select does not.
        block = block.max(Work(0)) + block.min(Work(0)).exp();
        detail::store_block(out.row(r), start, length, block);
      });
    }
  }
};

/// phi(x) = max(x, 0), C = Dk. A row of non-positive inputs maps to zeros; the denominator
/// guard then gives a zero output for that query (see Options::eps).
struct Relu {
  /// max(x, 0): finite for finite x.
  static constexpr bool finite_features = true;

  /// @return C = input_dim
  Eigen::Index feature_dim(Eigen::Index input_dim) const { return input_dim; }

  /// @param x  N x Dk queries
  /// @return   N x Dk features
  template <class Derived>
  Matrix<typename Derived::Scalar> queries(const Eigen::MatrixBase<Derived>& x) const {
    Matrix<typename Derived::Scalar> out(x.rows(), x.cols());
    features(x, out);
    return out;
  }

  /// @param x  N x Dk keys
  /// @return   N x Dk features
  template <class Derived>
  Matrix<typename Derived::Scalar> keys(const Eigen::MatrixBase<Derived>& x) const {
    Matrix<typename Derived::Scalar> out(x.rows(), x.cols());
    features(x, out);
    return out;
  }

  /// As queries(x), bit for bit, into a caller's N x Dk `out` (which may be x itself).
  /// Allocates nothing (16-bit inputs included), unless x is an expression such as a product.
  /// @throws Error  if out is not N x Dk (out is then unchanged)
  template <class Derived>
  void queries_into(const Eigen::MatrixBase<Derived>& x,
                    Eigen::Ref<Matrix<typename Derived::Scalar>> out) const {
    detail::require_out_shape(out, x.rows(), x.cols(), "Relu::queries_into");
    features(x, out);
  }

  /// As keys(x), bit for bit, into a caller's N x Dk `out`; see queries_into.
  template <class Derived>
  void keys_into(const Eigen::MatrixBase<Derived>& x,
                 Eigen::Ref<Matrix<typename Derived::Scalar>> out) const {
    detail::require_out_shape(out, x.rows(), x.cols(), "Relu::keys_into");
    features(x, out);
  }

  /// Carries a gradient through the map: d phi / d x is 1 for x > 0 and 0 otherwise.
  /// @param x         N x Dk inputs the features were computed from
  /// @param grad_phi  N x Dk gradient of the loss with respect to phi(x)
  /// @return          N x Dk gradient with respect to x
  template <class DX, class DG>
  Matrix<typename DX::Scalar> backward(const Eigen::MatrixBase<DX>& x,
                                       const Eigen::MatrixBase<DG>& grad_phi) const {
    using Scalar = typename DX::Scalar;
    detail::require_same_shape(x, grad_phi, "Relu::backward");
    return (x.array() > Scalar(0)).select(grad_phi, Scalar(0));
  }

 private:
  /// out = max(x, 0) + 0 (out N x Dk, may be x): the added 0 turns max(-0, 0) into +0, which
  /// Eigen's vectorised max (ARM) and its scalar tail give with different signs, so that every
  /// form of the map (whole matrices, _into, blocks, single rows) gives the same bits.
  template <class Derived, class Out>
  static void features(const Eigen::MatrixBase<Derived>& x, Out& out) {
    using Scalar = typename Derived::Scalar;
    out = (x.cwiseMax(Scalar(0)).array() + Scalar(0)).matrix();
  }
};

/// How the random projection W (m x Dk) is drawn.
enum class Projection {
  orthogonal,  ///< blocks of Dk orthogonal rows (lower estimator variance), the default
  iid          ///< independent Gaussian entries
};

/// The norms given to the rows of W.
enum class RowNorm {
  chi,   ///< each row's norm drawn as the norm of a Dk-dim Gaussian (unbiased), the default
  fixed  ///< every row has norm sqrt(Dk)
};

/// Settings of the random-feature maps.
struct RandomFeatureOptions {
  /// How W is drawn.
  Projection projection = Projection::orthogonal;
  /// The norms given to the rows of W.
  RowNorm row_norm = RowNorm::chi;
  /// Softmax temperature tau: the map estimates exp(tau q.k) (positive features) or
  /// exp(-tau |q - k|^2 / 2) (Fourier features); u = sqrt(tau) x. Negative means 1/sqrt(Dk).
  double temperature = -1.0;
  /// PositiveRandomFeatures only: [exp(W u), exp(-W u)] features (C = 2m), lower variance.
  bool hyperbolic = false;
};

namespace detail {

/// The random projection shared by both random-feature maps: W (m x Dk) kept in double as
/// drawn or given, and sqrt(tau) W in double and float, so logits W u = x (sqrt(tau) W)^T take
/// one product (at float speed for float inputs) and no copy of x.
class RandomProjection {
 public:
  RandomProjection(Eigen::Index input_dim, Eigen::Index num_features, std::uint64_t seed,
                   const RandomFeatureOptions& options, const char* owner)
      : options_(options) {
    if (input_dim < 1 || num_features < 1) {
      throw Error(std::string(owner) + ": input_dim and num_features must be >= 1, got " +
                  std::to_string(input_dim) + " and " + std::to_string(num_features));
    }
    temperature_ = resolve_temperature(options, input_dim, owner);
    w_.resize(num_features, input_dim);
    redraw(seed);
  }

  /// A caller's W, validated: non-empty, input_dim columns when `check_width`, finite.
  template <class Derived>
  RandomProjection(const Eigen::MatrixBase<Derived>& w, bool check_width, Eigen::Index input_dim,
                   const RandomFeatureOptions& options, const char* owner)
      : options_(options) {
    using Given = typename Derived::Scalar;
    static_assert(is_input_scalar<Given>,
                  "linattn: a projection W must have float, double, Eigen::half or "
                  "Eigen::bfloat16 entries");
    require_nonempty(w, owner, "projection");
    if (check_width && w.cols() != input_dim) {
      throw Error(std::string(owner) + ": projection is " + shape_string(w) + " but input_dim is " +
                  std::to_string(input_dim) + "; W must be num_features x input_dim (m x Dk)");
    }
    // Every float, double and 16-bit value is a double exactly, so projection() is W itself.
    Matrix<double> given;
    if constexpr (is_half_scalar<Given>) {
      given = w.template cast<float>().template cast<double>();
    } else {
      given = w.template cast<double>();
    }
    require_finite(given, owner, "projection");
    temperature_ = resolve_temperature(options, given.cols(), owner);
    w_ = std::move(given);
    seeded_ = false;
    update_scaled();
  }

  void redraw(std::uint64_t seed) {
    const Eigen::Index m = w_.rows();
    const Eigen::Index d = w_.cols();
    NormalSampler sample(seed);
    if (options_.projection == Projection::orthogonal) {
      for (Eigen::Index row = 0; row < m; row += d) {
        Matrix<double> block = gaussian_matrix(d, d, sample);
        orthonormalize_rows(block);
        const Eigen::Index take = std::min(d, m - row);
        w_.middleRows(row, take) = block.topRows(take);
      }
    } else {
      w_ = gaussian_matrix(m, d, sample);
    }
    const bool chi = options_.row_norm == RowNorm::chi;
    // iid Gaussian rows already have chi-distributed norms.
    if (!(chi && options_.projection == Projection::iid)) {
      for (Eigen::Index row = 0; row < m; ++row) {
        double norm = std::sqrt(static_cast<double>(d));
        if (chi) {
          const Matrix<double> g = gaussian_matrix(1, d, sample);
          norm = std::sqrt(ordered_dot(g.data(), g.data(), d));
        }
        set_row_norm(w_, row, norm);
      }
    }
    seed_ = seed;
    seeded_ = true;
    update_scaled();
  }

  /// sqrt(tau) W, m x Dk, in Scalar (float or double): the logits of x are x * scaled()^T.
  template <class Scalar>
  const Matrix<Scalar>& scaled() const {
    static_assert(is_supported_scalar<Scalar>, "linattn supports float and double");
    if constexpr (std::is_same_v<Scalar, float>) {
      return scaled_float_;
    } else {
      return scaled_;
    }
  }

  /// Throws unless x has input_dim() columns.
  template <class Derived>
  void require_width(const Eigen::MatrixBase<Derived>& x, const char* owner) const {
    if (x.cols() != w_.cols()) {
      throw Error(std::string(owner) + ": x is " + shape_string(x) + " but the map was built for " +
                  std::to_string(w_.cols()) + " input columns");
    }
  }

  Eigen::Index input_dim() const { return w_.cols(); }
  Eigen::Index num_features() const { return w_.rows(); }
  double temperature() const { return temperature_; }
  std::uint64_t seed() const { return seed_; }
  bool seeded() const { return seeded_; }
  const RandomFeatureOptions& options() const { return options_; }
  const Matrix<double>& matrix() const { return w_; }

  Eigen::Index checked_feature_dim(Eigen::Index input_dim, Eigen::Index per_row,
                                   const char* owner) const {
    if (input_dim != w_.cols()) {
      throw Error(std::string(owner) + ": built for input_dim " + std::to_string(w_.cols()) +
                  ", asked for " + std::to_string(input_dim));
    }
    return per_row * w_.rows();
  }

 private:
  /// tau: the option, or 1/sqrt(Dk) when it is negative; throws unless positive and finite.
  static double resolve_temperature(const RandomFeatureOptions& options, Eigen::Index input_dim,
                                    const char* owner) {
    if (options.temperature < 0.0) return 1.0 / std::sqrt(static_cast<double>(input_dim));
    if (!(options.temperature > 0.0 && std::isfinite(options.temperature))) {
      throw Error(std::string(owner) + ": temperature must be positive and finite, got " +
                  std::to_string(options.temperature));
    }
    return options.temperature;
  }

  void update_scaled() {
    scaled_ = std::sqrt(temperature_) * w_;
    scaled_float_ = scaled_.cast<float>();
  }

  RandomFeatureOptions options_;
  double temperature_ = 1.0;
  std::uint64_t seed_ = 0;
  bool seeded_ = true;
  Matrix<double> w_;
  Matrix<double> scaled_;
  Matrix<float> scaled_float_;
};

}  // namespace detail

/// FAVOR+ positive random features (Performer): phi(x) = exp(W u - |u|^2 / 2) / sqrt(m),
/// u = sqrt(tau) x, so E[phi(q) . phi(k)] = exp(tau q . k) and attention with it estimates
/// softmax attention at scale tau (default 1/sqrt(Dk)).
///
/// W (m x Dk) is drawn from a seed, or given: a trained Performer's projection. For
/// performer-pytorch, pass its `projection_matrix` buffer (m x Dk) with the default options:
/// its softmax_kernel computes ratio * exp(data_dash - diag - stabiliser) with
/// data_normalizer = Dk^(-1/4) (our u), ratio = m^(-1/2), data_dash = W u and diag = |u|^2 / 2,
/// which is phi(x) times exp(-stabiliser); the stabilisers (a per-query row maximum, one maximum
/// over all keys) cancel in normalised attention. It also adds eps = 1e-4 to every feature
/// before the ratio, which this map does not (the kernels' Options::eps guards the
/// denominator instead), so outputs differ from its by that bias, O(1e-4 m / (phi(q) . z)).
///
/// The kernels use `scaled_features`, which returns each row divided by its largest entry and
/// the log of that factor; the state carries a running log-scale, so nothing overflows and the
/// result is the same as with exact features. `queries`/`keys` return the unscaled features,
/// which can overflow float for large inputs.
class PositiveRandomFeatures {
 public:
  /// Tells the kernels to use scaled_features and the log-scale stabiliser.
  static constexpr bool log_scaled = true;
  /// Largest |W u| computed in float for float inputs: a row (token) whose float logits go past
  /// it is recomputed in double, the same whether it comes alone or in a chunk.
  static constexpr float kFloatLogitLimit = 32.0f;

  /// @param input_dim     Dk, the width of q and k
  /// @param num_features  m, rows of W (C = m, or 2m when hyperbolic)
  /// @param seed          W is a function of the seed alone, the same on every platform
  /// @param options       projection, row_norm, temperature, hyperbolic
  PositiveRandomFeatures(Eigen::Index input_dim, Eigen::Index num_features, std::uint64_t seed = 0,
                         const RandomFeatureOptions& options = {})
      : projection_(input_dim, num_features, seed, options, "PositiveRandomFeatures") {}

  /// A map over a caller's W, e.g. a trained model's projection; it computes exactly what a
  /// seeded map with that W would (stabiliser, hyperbolic, temperature included).
  /// @param projection  W, m x Dk: any Eigen expression of float, double, Eigen::half or
  ///                    Eigen::bfloat16 entries, copied into double (exactly), so projection()
  ///                    returns it; Dk is its number of columns
  /// @param options     temperature (negative: 1/sqrt(Dk)) and hyperbolic apply; projection and
  ///                    row_norm only say how redraw() draws a replacement
  /// @throws Error      if W is empty or has a NaN or Inf, or the temperature is not valid
  template <class Derived>
  explicit PositiveRandomFeatures(const Eigen::MatrixBase<Derived>& projection,
                                  const RandomFeatureOptions& options = {})
      : projection_(projection, false, 0, options, "PositiveRandomFeatures") {}

  /// As PositiveRandomFeatures(projection, options), and checks that W is m x input_dim.
  /// @throws Error  also if W does not have input_dim columns
  template <class Derived>
  PositiveRandomFeatures(Eigen::Index input_dim, const Eigen::MatrixBase<Derived>& projection,
                         const RandomFeatureOptions& options = {})
      : projection_(projection, true, input_dim, options, "PositiveRandomFeatures") {}

  /// Draws a new W from `seed`, keeping every other setting: afterwards the map equals
  /// PositiveRandomFeatures(input_dim(), num_features(), seed, options()). A map built from a
  /// caller's W gets a drawn W of the same shape in its place (as performer-pytorch's feature
  /// redraw does) and seeded() becomes true.
  void redraw(std::uint64_t seed) { projection_.redraw(seed); }

  /// @return C = m, or 2m when hyperbolic; throws if input_dim is not the one it was built for
  Eigen::Index feature_dim(Eigen::Index input_dim) const {
    return projection_.checked_feature_dim(input_dim, projection_.options().hyperbolic ? 2 : 1,
                                           "PositiveRandomFeatures");
  }

  /// @param x  N x Dk queries
  /// @return   N x C unscaled features
  template <class Derived>
  Matrix<typename Derived::Scalar> queries(const Eigen::MatrixBase<Derived>& x) const {
    Matrix<typename Derived::Scalar> phi(x.rows(), columns());
    unscaled_into(x, phi, "PositiveRandomFeatures");
    return phi;
  }

  /// @param x  N x Dk keys
  /// @return   N x C unscaled features
  template <class Derived>
  Matrix<typename Derived::Scalar> keys(const Eigen::MatrixBase<Derived>& x) const {
    return queries(x);
  }

  /// Features with each row divided by its largest entry, so every entry is in (0, 1].
  /// @param x          N x Dk inputs (queries or keys)
  /// @param log_scale  out: N, the natural log of the factor each row was divided by
  /// @return           N x C scaled features; phi(x_i) = exp(log_scale_i) * row i
  template <class Derived>
  Matrix<typename Derived::Scalar> scaled_features(const Eigen::MatrixBase<Derived>& x,
                                                   Vector<double>& log_scale) const {
    projection_.require_width(x, "PositiveRandomFeatures");
    Matrix<typename Derived::Scalar> phi(x.rows(), columns());
    log_scale.resize(x.rows());
    scaled_features_into(x, phi, log_scale);
    return phi;
  }

  /// As queries(x), bit for bit, into a caller's N x C `out` (which must not overlap x).
  /// Allocates nothing for a single row of float or double x that is a Matrix, Map or block,
  /// when its logits |W u| stay within kFloatLogitLimit (always for double x). What remains:
  /// a float row past the limit is recomputed in double (two temporaries), 16-bit x goes
  /// through a float copy, an expression x (a product, a scaled or cast matrix) is evaluated
  /// first, and for many rows Eigen's matrix product may take workspace.
  /// @throws Error  if x does not have input_dim() columns or out is not N x C (out unchanged)
  template <class Derived>
  void queries_into(const Eigen::MatrixBase<Derived>& x,
                    Eigen::Ref<Matrix<typename Derived::Scalar>> out) const {
    unscaled_into(x, out, "PositiveRandomFeatures::queries_into");
  }

  /// As keys(x), bit for bit, into a caller's N x C `out`; allocates as queries_into.
  template <class Derived>
  void keys_into(const Eigen::MatrixBase<Derived>& x,
                 Eigen::Ref<Matrix<typename Derived::Scalar>> out) const {
    unscaled_into(x, out, "PositiveRandomFeatures::keys_into");
  }

  /// As scaled_features(x, log_scale), bit for bit, into a caller's N x C `out` (which must
  /// not overlap x) and N-entry `log_scale`; allocates as queries_into.
  /// @throws Error  if x does not have input_dim() columns, out is not N x C or log_scale does
  ///                not have N entries (out and log_scale are then unchanged)
  template <class Derived>
  void scaled_features_into(const Eigen::MatrixBase<Derived>& x,
                            Eigen::Ref<Matrix<typename Derived::Scalar>> out,
                            Eigen::Ref<Vector<double>> log_scale) const {
    using Scalar = typename Derived::Scalar;
    constexpr const char* where = "PositiveRandomFeatures::scaled_features_into";
    check_into(x, out, where);
    if (log_scale.size() != x.rows()) {
      throw Error(std::string(where) + ": log_scale has " + std::to_string(log_scale.size()) +
                  " entries but x has " + std::to_string(x.rows()) + " rows");
    }
    if constexpr (detail::is_half_scalar<Scalar>) {
      // Computed in float, rounded once: the entries are in (0, 1], so only the tiniest
      // underflow, and the scale stays in double.
      Matrix<float> phi(x.rows(), out.cols());
      scaled_features_into(x.template cast<float>(), phi, log_scale);
      out = phi.template cast<Scalar>();
    } else {
      features(x, out, [&](Eigen::Index r, double log_factor) { log_scale(r) = log_factor; });
    }
  }

  /// Carries a gradient through the map for fixed W (queries and keys alike):
  /// d loss / d u = (grad_phi o phi) W - u sum(grad_phi o phi) (hyperbolic: the second half of
  /// the features enters with -W), then d loss / d x = sqrt(tau) d loss / d u. The products
  /// grad_phi o phi are formed from the scaled features, so they overflow only if they are
  /// themselves out of range.
  /// @param x         N x Dk inputs the features were computed from
  /// @param grad_phi  N x C gradient of the loss with respect to phi(x)
  /// @return          N x Dk gradient with respect to x
  template <class DX, class DG>
  Matrix<typename DX::Scalar> backward(const Eigen::MatrixBase<DX>& x,
                                       const Eigen::MatrixBase<DG>& grad_phi) const {
    using Scalar = typename DX::Scalar;
    const Eigen::Index m = projection_.num_features();
    const bool hyperbolic = projection_.options().hyperbolic;
    detail::require_backward_shape(x, grad_phi, hyperbolic ? 2 * m : m,
                                   "PositiveRandomFeatures::backward");
    Vector<double> log_scale;
    const Matrix<Scalar> scaled = scaled_features(x, log_scale);
    Matrix<Scalar> weighted(x.rows(), m);
    Vector<Scalar> total(x.rows());
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
      const Eigen::Array<double, 1, Eigen::Dynamic> product =
          grad_phi.row(r).template cast<double>().array() *
          scaled.row(r).template cast<double>().array() * std::exp(log_scale(r));
      total(r) = static_cast<Scalar>(product.sum());
      if (hyperbolic) {
        weighted.row(r) = (product.head(m) - product.tail(m)).template cast<Scalar>();
      } else {
        weighted.row(r) = product.template cast<Scalar>();
      }
    }
    const Scalar tau = static_cast<Scalar>(projection_.temperature());
    // d loss / d x = sqrt(tau) (weighted W - u total) = weighted (sqrt(tau) W) - tau x total.
    Matrix<Scalar> grad(x.rows(), x.cols());
    grad.noalias() = weighted * projection_.scaled<Scalar>();
    grad -= (x.array().colwise() * (total.array() * tau)).matrix();
    return grad;
  }

  /// W, m x Dk, in double: the drawn one, or the caller's (the same values exactly).
  const Matrix<double>& projection() const { return projection_.matrix(); }
  /// tau: E[phi(q) . phi(k)] = exp(tau q . k).
  double temperature() const { return projection_.temperature(); }
  /// Dk, the width of q and k.
  Eigen::Index input_dim() const { return projection_.input_dim(); }
  /// m, rows of W.
  Eigen::Index num_features() const { return projection_.num_features(); }
  /// The seed of the current W (the constructor's or the last redraw's); 0 for a caller's W.
  std::uint64_t seed() const { return projection_.seed(); }
  /// false while W is a caller's (built from a projection and not redrawn since).
  bool seeded() const { return projection_.seeded(); }
  /// The options as given; temperature() is the resolved tau.
  const RandomFeatureOptions& options() const { return projection_.options(); }

 private:
  /// C: m, or 2m when hyperbolic.
  Eigen::Index columns() const {
    return (projection_.options().hyperbolic ? 2 : 1) * projection_.num_features();
  }

  template <class Derived, class Out>
  void check_into(const Eigen::MatrixBase<Derived>& x, const Out& out, const char* where) const {
    projection_.require_width(x, where);
    detail::require_out_shape(out, x.rows(), columns(), where);
  }

  template <class Derived>
  void unscaled_into(const Eigen::MatrixBase<Derived>& x,
                     Eigen::Ref<Matrix<typename Derived::Scalar>> out, const char* where) const {
    using Scalar = typename Derived::Scalar;
    check_into(x, out, where);
    if constexpr (detail::is_half_scalar<Scalar>) {
      // Scaled in float, so only values past the 16-bit range become Inf (not a product
      // of an underflowed feature and an overflowed scale).
      Matrix<float> phi(x.rows(), out.cols());
      unscaled_into(x.template cast<float>(), phi, where);
      out = phi.template cast<Scalar>();
    } else {
      features(x, out, [&](Eigen::Index r, double log_factor) {
        out.row(r) *= static_cast<Scalar>(std::exp(log_factor));
      });
    }
  }

  /// The scaled features of float or double x into out (checked: N x C), calling
  /// done(r, log_scale_r) once row r is in place.
  template <class Derived, class Done>
  void features(const Eigen::MatrixBase<Derived>& x,
                Eigen::Ref<Matrix<typename Derived::Scalar>> out, const Done& done) const {
    using Scalar = typename Derived::Scalar;
    const Eigen::Index m = projection_.num_features();
    const detail::nested_rows_t<Derived> rows(x.derived());
    // The logits go into the first m columns, and each row is exponentiated in place.
    out.leftCols(m).noalias() = rows * projection_.scaled<Scalar>().transpose();
    const double half_tau = 0.5 * projection_.temperature();
    const double log_norm = 0.5 * std::log(static_cast<double>(out.cols()));
    for (Eigen::Index r = 0; r < out.rows(); ++r) {
      // |u|^2 / 2 = tau |x|^2 / 2, in double.
      const double half_sq = half_tau * rows.row(r).template cast<double>().squaredNorm();
      double top = 0.0;
      if constexpr (std::is_same_v<Scalar, float>) {
        // Float logits are exact enough while they are small; past kFloatLogitLimit their
        // rounding (~1e-5 relative in the features at exponents near 200) would also differ
        // between a chunk's GEMM and a single token's GEMV, so such a row goes through double.
        if (!(out.row(r).head(m).cwiseAbs().maxCoeff() <= kFloatLogitLimit)) {
          const Eigen::Matrix<double, 1, Eigen::Dynamic> wide =
              rows.row(r).template cast<double>() * projection_.scaled<double>().transpose();
          top = exponentiate_row(wide, out.row(r));
          done(r, top - half_sq - log_norm);
          continue;
        }
      }
      top = exponentiate_row(out.row(r).head(m), out.row(r));
      done(r, top - half_sq - log_norm);
    }
  }

  /// phi = exp(logits - top) (hyperbolic: then exp(-logits - top)) with top the largest
  /// (absolute) logit, into the row `phi` (C entries; `logits` may be its first m); returns top.
  /// The logit type L may be wider than the feature type.
  template <class Logits, class Phi>
  double exponentiate_row(const Logits& logits, Phi&& phi) const {
    using L = typename Logits::Scalar;
    using Scalar = typename std::decay_t<Phi>::Scalar;
    const Eigen::Index m = logits.cols();
    const bool hyperbolic = projection_.options().hyperbolic;
    const L top = hyperbolic ? logits.cwiseAbs().maxCoeff() : logits.maxCoeff();
    // Eigen's vectorised exp clamps arguments below about -88 (float) to exp(-88) instead of
    // flushing to 0; exp(x / 2)^2 flushes them, so tiny features cannot pose as weights.
    // The second half first: it reads logits that the first half overwrites.
    if (hyperbolic) {
      detail::for_each_block(m, [&](Eigen::Index start, Eigen::Index length) {
        const detail::MapBlock<L> block = detail::load_block<L>(logits, start, length);
        detail::MapBlock<Scalar> e = (L(-0.5) * (block + top)).template cast<Scalar>();
        e = e.exp().square();
        detail::store_block(phi, m + start, length, e);
      });
    }
    detail::for_each_block(m, [&](Eigen::Index start, Eigen::Index length) {
      const detail::MapBlock<L> block = detail::load_block<L>(logits, start, length);
      detail::MapBlock<Scalar> e = (L(0.5) * (block - top)).template cast<Scalar>();
      e = e.exp().square();
      detail::store_block(phi, start, length, e);
    });
    return static_cast<double>(top);
  }

  detail::RandomProjection projection_;
};

/// Random Fourier features of the Gaussian kernel: phi(x) = [sin(W u), cos(W u)] / sqrt(m),
/// u = sqrt(tau) x, so E[phi(q) . phi(k)] = exp(-tau |q - k|^2 / 2). C = 2m. Features can be
/// negative, so phi(q) . z can be near zero; the kernels' denominator guard handles it.
class RandomFourierFeatures {
 public:
  /// @param input_dim     Dk
  /// @param num_features  m, rows of W (C = 2m)
  /// @param seed          W is a function of the seed alone
  /// @param options       projection, row_norm, temperature (hyperbolic is ignored)
  RandomFourierFeatures(Eigen::Index input_dim, Eigen::Index num_features, std::uint64_t seed = 0,
                        const RandomFeatureOptions& options = {})
      : projection_(input_dim, num_features, seed, options, "RandomFourierFeatures") {}

  /// A map over a caller's W (e.g. a trained model's); it computes exactly what a seeded map
  /// with that W would.
  /// @param projection  W, m x Dk: any Eigen expression of float, double, Eigen::half or
  ///                    Eigen::bfloat16 entries, copied into double (exactly), so projection()
  ///                    returns it; Dk is its number of columns
  /// @param options     temperature (negative: 1/sqrt(Dk)) applies; projection and row_norm only
  ///                    say how redraw() draws a replacement (hyperbolic is ignored)
  /// @throws Error      if W is empty or has a NaN or Inf, or the temperature is not valid
  template <class Derived>
  explicit RandomFourierFeatures(const Eigen::MatrixBase<Derived>& projection,
                                 const RandomFeatureOptions& options = {})
      : projection_(projection, false, 0, options, "RandomFourierFeatures") {}

  /// As RandomFourierFeatures(projection, options), and checks that W is m x input_dim.
  /// @throws Error  also if W does not have input_dim columns
  template <class Derived>
  RandomFourierFeatures(Eigen::Index input_dim, const Eigen::MatrixBase<Derived>& projection,
                        const RandomFeatureOptions& options = {})
      : projection_(projection, true, input_dim, options, "RandomFourierFeatures") {}

  /// Draws a new W from `seed`, keeping every other setting: afterwards the map equals
  /// RandomFourierFeatures(input_dim(), num_features(), seed, options()). A map built from a
  /// caller's W gets a drawn W of the same shape in its place and seeded() becomes true.
  void redraw(std::uint64_t seed) { projection_.redraw(seed); }

  /// @return C = 2m; throws if input_dim is not the one it was built for
  Eigen::Index feature_dim(Eigen::Index input_dim) const {
    return projection_.checked_feature_dim(input_dim, 2, "RandomFourierFeatures");
  }

  /// @param x  N x Dk queries
  /// @return   N x 2m features
  template <class Derived>
  Matrix<typename Derived::Scalar> queries(const Eigen::MatrixBase<Derived>& x) const {
    projection_.require_width(x, "RandomFourierFeatures");
    Matrix<typename Derived::Scalar> phi(x.rows(), 2 * projection_.num_features());
    map_into(x, phi, "RandomFourierFeatures");
    return phi;
  }

  /// @param x  N x Dk keys
  /// @return   N x 2m features
  template <class Derived>
  Matrix<typename Derived::Scalar> keys(const Eigen::MatrixBase<Derived>& x) const {
    return queries(x);
  }

  /// As queries(x), bit for bit, into a caller's N x 2m `out` (which must not overlap x).
  /// Allocates nothing for a single row of float or double x that is a Matrix, Map or block.
  /// What remains: 16-bit x goes through a float copy, an expression x (a product, a cast) is
  /// evaluated first, and for many rows Eigen's matrix product may take workspace.
  /// @throws Error  if x does not have input_dim() columns or out is not N x 2m (out unchanged)
  template <class Derived>
  void queries_into(const Eigen::MatrixBase<Derived>& x,
                    Eigen::Ref<Matrix<typename Derived::Scalar>> out) const {
    map_into(x, out, "RandomFourierFeatures::queries_into");
  }

  /// As keys(x), bit for bit, into a caller's N x 2m `out`; allocates as queries_into.
  template <class Derived>
  void keys_into(const Eigen::MatrixBase<Derived>& x,
                 Eigen::Ref<Matrix<typename Derived::Scalar>> out) const {
    map_into(x, out, "RandomFourierFeatures::keys_into");
  }

  /// Carries a gradient through the map for fixed W (queries and keys alike):
  /// d loss / d x = sqrt(tau) ((g_sin o cos(W u) - g_cos o sin(W u)) / sqrt(m)) W.
  /// @param x         N x Dk inputs the features were computed from
  /// @param grad_phi  N x 2m gradient of the loss with respect to phi(x)
  /// @return          N x Dk gradient with respect to x
  template <class DX, class DG>
  Matrix<typename DX::Scalar> backward(const Eigen::MatrixBase<DX>& x,
                                       const Eigen::MatrixBase<DG>& grad_phi) const {
    using Scalar = typename DX::Scalar;
    const Eigen::Index m = projection_.num_features();
    detail::require_backward_shape(x, grad_phi, 2 * m, "RandomFourierFeatures::backward");
    projection_.require_width(x, "RandomFourierFeatures::backward");
    Matrix<Scalar> logits(x.rows(), m);
    logits.noalias() = x * projection_.scaled<Scalar>().transpose();
    const Scalar norm = Scalar(1) / std::sqrt(static_cast<Scalar>(m));
    const Matrix<Scalar> weighted = norm * (grad_phi.leftCols(m).array() * logits.array().cos() -
                                            grad_phi.rightCols(m).array() * logits.array().sin());
    // d loss / d x = weighted (sqrt(tau) W).
    Matrix<Scalar> grad(x.rows(), x.cols());
    grad.noalias() = weighted * projection_.scaled<Scalar>();
    return grad;
  }

  /// W, m x Dk, in double: the drawn one, or the caller's (the same values exactly).
  const Matrix<double>& projection() const { return projection_.matrix(); }
  /// tau: E[phi(q) . phi(k)] = exp(-tau |q - k|^2 / 2).
  double temperature() const { return projection_.temperature(); }
  /// Dk, the width of q and k.
  Eigen::Index input_dim() const { return projection_.input_dim(); }
  /// m, rows of W.
  Eigen::Index num_features() const { return projection_.num_features(); }
  /// The seed of the current W (the constructor's or the last redraw's); 0 for a caller's W.
  std::uint64_t seed() const { return projection_.seed(); }
  /// false while W is a caller's (built from a projection and not redrawn since).
  bool seeded() const { return projection_.seeded(); }
  /// The options as given; temperature() is the resolved tau.
  const RandomFeatureOptions& options() const { return projection_.options(); }

 private:
  template <class Derived>
  void map_into(const Eigen::MatrixBase<Derived>& x,
                Eigen::Ref<Matrix<typename Derived::Scalar>> out, const char* where) const {
    using Scalar = typename Derived::Scalar;
    const Eigen::Index m = projection_.num_features();
    projection_.require_width(x, where);
    detail::require_out_shape(out, x.rows(), 2 * m, where);
    if constexpr (detail::is_half_scalar<Scalar>) {
      Matrix<float> phi(x.rows(), 2 * m);  // in float, rounded once
      map_into(x.template cast<float>(), phi, where);
      out = phi.template cast<Scalar>();
    } else {
      const detail::nested_rows_t<Derived> rows(x.derived());
      // The logits go into the cosine half, and each row is mapped in place.
      out.rightCols(m).noalias() = rows * projection_.scaled<Scalar>().transpose();
      const Scalar norm = Scalar(1) / std::sqrt(static_cast<Scalar>(m));
      for (Eigen::Index r = 0; r < out.rows(); ++r) {
        detail::for_each_block(m, [&](Eigen::Index start, Eigen::Index length) {
          const detail::MapBlock<Scalar> t =
              detail::load_block<Scalar>(out.row(r).tail(m), start, length);
          const detail::MapBlock<Scalar> sin = norm * t.sin();
          const detail::MapBlock<Scalar> cos = norm * t.cos();
          detail::store_block(out.row(r), start, length, sin);
          detail::store_block(out.row(r), m + start, length, cos);
        });
      }
    }
  }

  detail::RandomProjection projection_;
};

}  // namespace linattn
