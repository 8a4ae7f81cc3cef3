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

/// phi(x) = elu(x) + 1 (x + 1 for x > 0, exp(x) otherwise), C = Dk. Positive, the map of
/// "Transformers are RNNs".
struct EluPlusOne {
  /// @return C = input_dim
  Eigen::Index feature_dim(Eigen::Index input_dim) const { return input_dim; }

  /// @param x  N x Dk queries, one row per token
  /// @return   N x Dk features
  template <class Derived>
  Matrix<typename Derived::Scalar> queries(const Eigen::MatrixBase<Derived>& x) const {
    return map(x);
  }

  /// @param x  N x Dk keys, one row per token
  /// @return   N x Dk features
  template <class Derived>
  Matrix<typename Derived::Scalar> keys(const Eigen::MatrixBase<Derived>& x) const {
    return map(x);
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
  static Matrix<typename Derived::Scalar> map(const Eigen::MatrixBase<Derived>& x) {
    using Scalar = typename Derived::Scalar;
    if constexpr (detail::is_half_scalar<Scalar>) {
      // Computed in float and rounded once (16-bit arithmetic is emulated anyway).
      return map(x.template cast<float>()).template cast<Scalar>();
    } else {
      // max(x, 0) + exp(min(x, 0)) is elu(x) + 1 exactly, and vectorises where select does not.
      Matrix<Scalar> phi = x;
      phi = phi.array().max(Scalar(0)) + phi.array().min(Scalar(0)).exp();
      return phi;
    }
  }
};

/// phi(x) = max(x, 0), C = Dk. A row of non-positive inputs maps to zeros; the denominator
/// guard then gives a zero output for that query (see Options::eps).
struct Relu {
  /// @return C = input_dim
  Eigen::Index feature_dim(Eigen::Index input_dim) const { return input_dim; }

  /// @param x  N x Dk queries
  /// @return   N x Dk features
  template <class Derived>
  Matrix<typename Derived::Scalar> queries(const Eigen::MatrixBase<Derived>& x) const {
    return x.cwiseMax(typename Derived::Scalar(0));
  }

  /// @param x  N x Dk keys
  /// @return   N x Dk features
  template <class Derived>
  Matrix<typename Derived::Scalar> keys(const Eigen::MatrixBase<Derived>& x) const {
    return x.cwiseMax(typename Derived::Scalar(0));
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

/// The random projection shared by both random-feature maps: W (m x Dk) kept in double, with
/// a float copy so float inputs multiply at float speed.
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
    w_float_ = w_.cast<float>();
    seeded_ = false;
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
    w_float_ = w_.cast<float>();
    seed_ = seed;
    seeded_ = true;
  }

  template <class Scalar>
  const Matrix<Scalar>& weights() const {
    if constexpr (std::is_same_v<Scalar, float>) {
      return w_float_;
    } else {
      return w_;
    }
  }

  /// Checks the input width and computes U W^T with U = sqrt(tau) X (N x m) and |u_i|^2 / 2,
  /// in the scalar type Acc (double for the exponential map: see scaled_features).
  template <class Acc, class Derived>
  void project(const Eigen::MatrixBase<Derived>& x, Matrix<Acc>& logits, Vector<Acc>& half_sq_norm,
               const char* owner) const {
    static_assert(is_supported_scalar<typename Derived::Scalar>,
                  "linattn supports float and double");
    if (x.cols() != w_.cols()) {
      throw Error(std::string(owner) + ": x is " + shape_string(x) + " but the map was built for " +
                  std::to_string(w_.cols()) + " input columns");
    }
    const Matrix<Acc> u = x.template cast<Acc>() * static_cast<Acc>(std::sqrt(temperature_));
    logits.resize(u.rows(), w_.rows());
    logits.noalias() = u * weights<Acc>().transpose();
    half_sq_norm = Acc(0.5) * u.rowwise().squaredNorm();
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

  RandomFeatureOptions options_;
  double temperature_ = 1.0;
  std::uint64_t seed_ = 0;
  bool seeded_ = true;
  Matrix<double> w_;
  Matrix<float> w_float_;
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
  /// Largest |W u| computed in float for float inputs; beyond it the logits use double.
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
    return unscaled(x);
  }

  /// @param x  N x Dk keys
  /// @return   N x C unscaled features
  template <class Derived>
  Matrix<typename Derived::Scalar> keys(const Eigen::MatrixBase<Derived>& x) const {
    return unscaled(x);
  }

  /// Features with each row divided by its largest entry, so every entry is in (0, 1].
  /// @param x          N x Dk inputs (queries or keys)
  /// @param log_scale  out: N, the natural log of the factor each row was divided by
  /// @return           N x C scaled features; phi(x_i) = exp(log_scale_i) * row i
  template <class Derived>
  Matrix<typename Derived::Scalar> scaled_features(const Eigen::MatrixBase<Derived>& x,
                                                   Vector<double>& log_scale) const {
    using Scalar = typename Derived::Scalar;
    if constexpr (detail::is_half_scalar<Scalar>) {
      // Computed in float, rounded once: the entries are in (0, 1], so only the tiniest
      // underflow, and the scale stays in double.
      return scaled_features(x.template cast<float>(), log_scale).template cast<Scalar>();
    } else {
      Matrix<Scalar> phi;
      if constexpr (std::is_same_v<Scalar, float>) {
        // Float logits are exact enough while they are small; past kFloatLogitLimit their
        // rounding (~1e-5 relative in the features at exponents near 200) would also differ
        // between a chunk's GEMM and a single token's GEMV, so those inputs go through double.
        Matrix<float> logits;
        Vector<float> half_sq;
        projection_.project<float>(x, logits, half_sq, "PositiveRandomFeatures");
        if (logits.cwiseAbs().maxCoeff() <= kFloatLogitLimit) {
          exponentiate(logits, half_sq, phi, log_scale);
          return phi;
        }
      }
      Matrix<double> logits;
      Vector<double> half_sq;
      projection_.project<double>(x, logits, half_sq, "PositiveRandomFeatures");
      exponentiate(logits, half_sq, phi, log_scale);
      return phi;
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
    const Scalar root_tau = static_cast<Scalar>(std::sqrt(projection_.temperature()));
    Matrix<Scalar> grad(x.rows(), x.cols());
    grad.noalias() = weighted * projection_.weights<Scalar>();
    // u = sqrt(tau) x, so the |u|^2 / 2 term gives -u sum(grad_phi o phi) = -sqrt(tau) x total.
    grad -= (x.array().colwise() * (total.array() * root_tau)).matrix();
    grad *= root_tau;
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
  template <class Derived>
  Matrix<typename Derived::Scalar> unscaled(const Eigen::MatrixBase<Derived>& x) const {
    using Scalar = typename Derived::Scalar;
    if constexpr (detail::is_half_scalar<Scalar>) {
      // Scaled in float, so only values past the 16-bit range become Inf (not a product
      // of an underflowed feature and an overflowed scale).
      return unscaled(x.template cast<float>()).template cast<Scalar>();
    } else {
      Vector<double> log_scale;
      Matrix<Scalar> phi = scaled_features(x, log_scale);
      for (Eigen::Index r = 0; r < phi.rows(); ++r) {
        phi.row(r) *= static_cast<Scalar>(std::exp(log_scale(r)));
      }
      return phi;
    }
  }

  /// phi rows = exp(logits - row max) (hyperbolic: also exp(-logits - row max)), and the log
  /// of each row's factor. Logit type L may be wider than the feature type Scalar.
  template <class L, class Scalar>
  void exponentiate(const Matrix<L>& logits, const Vector<L>& half_sq, Matrix<Scalar>& phi,
                    Vector<double>& log_scale) const {
    const bool hyperbolic = projection_.options().hyperbolic;
    const Eigen::Index m = logits.cols();
    phi.resize(logits.rows(), hyperbolic ? 2 * m : m);
    log_scale.resize(logits.rows());
    const double log_norm = 0.5 * std::log(static_cast<double>(phi.cols()));
    for (Eigen::Index r = 0; r < logits.rows(); ++r) {
      const L top = hyperbolic ? logits.row(r).cwiseAbs().maxCoeff() : logits.row(r).maxCoeff();
      // Eigen's vectorised exp clamps arguments below about -88 (float) to exp(-88) instead of
      // flushing to 0; exp(x / 2)^2 flushes them, so tiny features cannot pose as weights.
      phi.row(r).head(m) =
          (L(0.5) * (logits.row(r).array() - top)).template cast<Scalar>().exp().square();
      if (hyperbolic) {
        phi.row(r).tail(m) =
            (L(-0.5) * (logits.row(r).array() + top)).template cast<Scalar>().exp().square();
      }
      log_scale(r) = static_cast<double>(top) - static_cast<double>(half_sq(r)) - log_norm;
    }
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
    return map(x);
  }

  /// @param x  N x Dk keys
  /// @return   N x 2m features
  template <class Derived>
  Matrix<typename Derived::Scalar> keys(const Eigen::MatrixBase<Derived>& x) const {
    return map(x);
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
    Matrix<Scalar> logits;
    Vector<Scalar> half_sq;
    projection_.project<Scalar>(x, logits, half_sq, "RandomFourierFeatures::backward");
    const Scalar norm = Scalar(1) / std::sqrt(static_cast<Scalar>(m));
    const Matrix<Scalar> weighted = norm * (grad_phi.leftCols(m).array() * logits.array().cos() -
                                            grad_phi.rightCols(m).array() * logits.array().sin());
    Matrix<Scalar> grad(x.rows(), x.cols());
    grad.noalias() = weighted * projection_.weights<Scalar>();
    grad *= static_cast<Scalar>(std::sqrt(projection_.temperature()));
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
  Matrix<typename Derived::Scalar> map(const Eigen::MatrixBase<Derived>& x) const {
    using Scalar = typename Derived::Scalar;
    if constexpr (detail::is_half_scalar<Scalar>) {
      return map(x.template cast<float>()).template cast<Scalar>();  // in float, rounded once
    } else {
      Matrix<Scalar> logits;
      Vector<Scalar> half_sq;
      projection_.project<Scalar>(x, logits, half_sq, "RandomFourierFeatures");
      const Eigen::Index m = logits.cols();
      const Scalar norm = Scalar(1) / std::sqrt(static_cast<Scalar>(m));
      Matrix<Scalar> phi(logits.rows(), 2 * m);
      phi.leftCols(m) = norm * logits.array().sin();
      phi.rightCols(m) = norm * logits.array().cos();
      return phi;
    }
  }

  detail::RandomProjection projection_;
};

}  // namespace linattn
