// Tests of the feature maps (include/linattn/feature_maps.hpp): the exact maps entry by entry,
// the random maps' projection (reproducibility, orthogonal blocks, row norms), the estimators'
// expectations, the approximation of softmax attention, and the log-scale stabiliser where float
// exp overflows. Every expected value is computed here from the formulas in docs/design.md.
// EIGEN_RUNTIME_NO_MALLOC lets a test forbid heap allocation inside Eigen.
#ifndef EIGEN_RUNTIME_NO_MALLOC  // a test bundle defines it for all its files
#define EIGEN_RUNTIME_NO_MALLOC
#endif
#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <linattn/feature_maps.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/recurrent_state.hpp>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_feature_maps {

namespace {

using Eigen::Index;
using linattn::Matrix;
using linattn::PositiveRandomFeatures;
using linattn::Projection;
using linattn::RandomFeatureOptions;
using linattn::RandomFourierFeatures;
using linattn::RowNorm;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

/// Sample mean and its standard error (from the sample variance).
struct MeanSe {
  double mean = 0.0;
  double se = 0.0;
};

MeanSe mean_and_se(const std::vector<double>& xs) {
  const double n = static_cast<double>(xs.size());
  const double mean = std::accumulate(xs.begin(), xs.end(), 0.0) / n;
  double sq = 0.0;
  for (const double x : xs) sq += (x - mean) * (x - mean);
  return {mean, std::sqrt(sq / (n - 1.0) / n)};
}

/// Distance in units in the last place between two finite numbers of the same type.
template <class T>
std::int64_t ulp_distance(T a, T b) {
  using Bits = std::conditional_t<std::is_same_v<T, float>, std::int32_t, std::int64_t>;
  const auto ordered = [](T x) {
    Bits bits;
    std::memcpy(&bits, &x, sizeof bits);
    return bits >= 0 ? std::int64_t{bits} : -std::int64_t(bits & std::numeric_limits<Bits>::max());
  };
  const std::int64_t d = ordered(a) - ordered(b);
  return d < 0 ? -d : d;
}

/// Largest ulp distance between the entries of two matrices of the same shape; entries that are
/// both below the smallest normal number count as equal.
template <class DA, class DB>
std::int64_t max_ulp(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b) {
  using T = typename DA::Scalar;
  std::int64_t worst = 0;
  for (Index r = 0; r < a.rows(); ++r) {
    for (Index c = 0; c < a.cols(); ++c) {
      const T tiny = std::numeric_limits<T>::min();
      if (std::abs(a(r, c)) < tiny && std::abs(b(r, c)) < tiny) continue;
      worst = std::max(worst, ulp_distance<T>(a(r, c), b(r, c)));
    }
  }
  return worst;
}

/// Two 1 x dim rows with |q| = norm_q, |k| = norm_k and cos(q, k) = cos_qk, in random directions.
/// (The random maps' W is rotation invariant in distribution, so only these three numbers matter.)
std::pair<Matrix<double>, Matrix<double>> fixed_pair(Index dim, std::uint64_t seed, double norm_q,
                                                     double norm_k, double cos_qk) {
  const Matrix<double> g = gaussian<double>(2, dim, seed);
  const Eigen::RowVectorXd e1 = g.row(0).normalized();
  const Eigen::RowVectorXd e2 = (g.row(1) - g.row(1).dot(e1) * e1).normalized();
  const Matrix<double> q = norm_q * e1;
  const Matrix<double> k = norm_k * (cos_qk * e1 + std::sqrt(1.0 - cos_qk * cos_qk) * e2);
  return {q, k};
}

/// Bitwise equality of two double matrices of the same shape.
bool same_bits(const Matrix<double>& a, const Matrix<double>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(double) * static_cast<std::size_t>(a.size())) == 0;
}

/// |cos| of the angle between two rows.
double abs_cos(const Matrix<double>& w, Index a, Index b) {
  return std::abs(w.row(a).dot(w.row(b))) / (w.row(a).norm() * w.row(b).norm());
}

/// Exact non-causal softmax attention, in double: out_i = sum_j e^(s q_i.k_j) v_j / sum_j ...
Matrix<double> exact_softmax_attention(const Matrix<double>& q, const Matrix<double>& k,
                                       const Matrix<double>& v, double scale) {
  Matrix<double> out(q.rows(), v.cols());
  Vector<double> logits(k.rows());
  for (Index i = 0; i < q.rows(); ++i) {
    for (Index j = 0; j < k.rows(); ++j) logits(j) = scale * q.row(i).dot(k.row(j));
    const double top = logits.maxCoeff();
    Eigen::RowVectorXd num = Eigen::RowVectorXd::Zero(v.cols());
    double den = 0.0;
    for (Index j = 0; j < k.rows(); ++j) {
      const double w = std::exp(logits(j) - top);
      num += w * v.row(j);
      den += w;
    }
    out.row(i) = num / den;
  }
  return out;
}

/// FAVOR+ features in double straight from the formula: exp(W u - |u|^2 / 2) / sqrt(m) with
/// u = sqrt(tau) x; hyperbolic: [exp(W u), exp(-W u)] exp(-|u|^2 / 2) / sqrt(2m).
Matrix<double> prf_reference(const Matrix<double>& x, const Matrix<double>& w, double tau,
                             bool hyperbolic) {
  const Index m = w.rows();
  const Index c = hyperbolic ? 2 * m : m;
  Matrix<double> phi(x.rows(), c);
  for (Index r = 0; r < x.rows(); ++r) {
    const Eigen::RowVectorXd u = std::sqrt(tau) * x.row(r);
    const double half = 0.5 * u.squaredNorm();
    for (Index f = 0; f < m; ++f) {
      const double t = w.row(f).dot(u);
      phi(r, f) = std::exp(t - half) / std::sqrt(double(c));
      if (hyperbolic) phi(r, m + f) = std::exp(-t - half) / std::sqrt(double(c));
    }
  }
  return phi;
}

/// log phi(x) of the FAVOR+ features, in double (no exp, so nothing overflows).
Matrix<double> prf_log_features(const Matrix<double>& x, const Matrix<double>& w, double tau,
                                bool hyperbolic) {
  const Index m = w.rows();
  const Index c = hyperbolic ? 2 * m : m;
  const double log_norm = 0.5 * std::log(double(c));
  Matrix<double> out(x.rows(), c);
  for (Index r = 0; r < x.rows(); ++r) {
    const Eigen::RowVectorXd u = std::sqrt(tau) * x.row(r);
    const double half = 0.5 * u.squaredNorm();
    for (Index f = 0; f < m; ++f) {
      const double t = w.row(f).dot(u);
      out(r, f) = t - half - log_norm;
      if (hyperbolic) out(r, m + f) = -t - half - log_norm;
    }
  }
  return out;
}

/// log(phi(q_i) . phi(k_j)) for all i, j, as a logsumexp over the features.
Matrix<double> log_kernel(const Matrix<double>& log_q, const Matrix<double>& log_k) {
  Matrix<double> l(log_q.rows(), log_k.rows());
  for (Index i = 0; i < log_q.rows(); ++i) {
    for (Index j = 0; j < log_k.rows(); ++j) {
      const Eigen::RowVectorXd s = log_q.row(i) + log_k.row(j);
      const double top = s.maxCoeff();
      l(i, j) = top + std::log((s.array() - top).exp().sum());
    }
  }
  return l;
}

/// Causal linear attention from log-weights, in double:
/// out_i = sum_{j<=i} e^(l_ij + (i-j) log g - L) v_j / (sum_{j<=i} e^(...) + eps e^(-L)).
Matrix<double> causal_from_log_weights(const Matrix<double>& l, const Matrix<double>& v,
                                       double decay, double eps) {
  const double lg = std::log(decay);
  Matrix<double> out(l.rows(), v.cols());
  for (Index i = 0; i < l.rows(); ++i) {
    double top = -std::numeric_limits<double>::infinity();
    for (Index j = 0; j <= i; ++j) top = std::max(top, l(i, j) + double(i - j) * lg);
    Eigen::RowVectorXd num = Eigen::RowVectorXd::Zero(v.cols());
    double den = 0.0;
    for (Index j = 0; j <= i; ++j) {
      const double w = std::exp(l(i, j) + double(i - j) * lg - top);
      num += w * v.row(j);
      den += w;
    }
    // eps = 0 stays 0 (0 * exp(-top) would be 0 * inf for very negative log weights).
    out.row(i) = num / (den + (eps == 0.0 ? 0.0 : eps * std::exp(-top)));
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Exact maps
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("EluPlusOne is x + 1 above zero and exp(x) elsewhere, entry by entry",
                   "[feature_maps][elu]", float, double) {
  using T = TestType;
  Matrix<T> x = gaussian<T>(37, 19, 101, 3.0);
  // Edge values: zero of both signs, tiny, exp underflow (float, double), large.
  x(0, 0) = T(0);
  x(0, 1) = -T(0);
  x(0, 2) = std::numeric_limits<T>::min();
  x(0, 3) = -std::numeric_limits<T>::min();
  x(0, 4) = T(-200);
  x(0, 5) = T(50);
  x(0, 6) = T(-1000);
  const linattn::EluPlusOne map;
  CHECK(map.feature_dim(19) == 19);
  CHECK(map.feature_dim(1) == 1);
  const Matrix<T> phi_q = map.queries(x);
  const Matrix<T> phi_k = map.keys(x);
  REQUIRE(phi_q.rows() == x.rows());
  REQUIRE(phi_q.cols() == x.cols());

  // x > 0: x + 1 is one rounding in T, so exact. x <= 0: std::exp(x) within one ulp (Eigen's
  // vectorised exp is not std::exp); where exp(x) is below the smallest normal T, anything in
  // [0, min normal] (Eigen's float exp floors at ~exp(-88.7) rather than flushing to zero).
  Index positives = 0;
  Index exact = 0;
  Index underflows = 0;
  Index bad_positive = 0;
  Index bad_underflow = 0;
  std::int64_t worst_ulp = 0;
  for (Index r = 0; r < x.rows(); ++r) {
    for (Index c = 0; c < x.cols(); ++c) {
      const T xi = x(r, c);
      const T phi = phi_q(r, c);
      if (phi_k(r, c) != phi) ++bad_positive;  // keys and queries use the same map
      if (xi > T(0)) {
        ++positives;
        if (phi != xi + T(1)) ++bad_positive;
        continue;
      }
      const double reference = std::exp(static_cast<double>(xi));
      if (reference < static_cast<double>(std::numeric_limits<T>::min())) {
        ++underflows;
        if (!(phi >= T(0) && phi <= std::numeric_limits<T>::min())) ++bad_underflow;
        continue;
      }
      const T expected = std::exp(xi);
      if (phi == expected) ++exact;
      worst_ulp = std::max(worst_ulp, ulp_distance(phi, expected));
    }
  }
  WARN("EluPlusOne<" << (std::is_same_v<T, float> ? "float" : "double") << ">: " << positives
                     << " positive entries, " << exact << " of "
                     << x.size() - positives - underflows
                     << " non-positive ones equal to std::exp, worst " << worst_ulp << " ulp, "
                     << underflows << " underflowing");
  CHECK(bad_positive == 0);
  CHECK(worst_ulp <= 1);
  CHECK(bad_underflow == 0);
  CHECK(underflows >= 1);
  CHECK(positives > x.size() / 4);
  CHECK(phi_q(0, 0) == T(1));
  CHECK(phi_q(0, 1) == T(1));
  CHECK(phi_q(0, 5) == T(51));

  // Any Eigen expression: a column-major copy and a block give the same rows (up to the ulp by
  // which Eigen's packet exp and std::exp, used for unaligned tails, may differ).
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> col_major = x;
  const Matrix<T> from_col_major = map.queries(col_major);
  const Matrix<T> from_block = map.keys(x.block(3, 2, 5, 7));
  REQUIRE(from_col_major.rows() == x.rows());
  REQUIRE(from_block.rows() == 5);
  REQUIRE(from_block.cols() == 7);
  CHECK(max_ulp(from_col_major, phi_q) <= 2);
  CHECK(max_ulp(from_block, phi_q.block(3, 2, 5, 7)) <= 2);
}

TEMPLATE_TEST_CASE("Relu is max(x, 0), entry by entry", "[feature_maps][relu]", float, double) {
  using T = TestType;
  Matrix<T> x = gaussian<T>(41, 13, 102, 2.0);
  x(0, 0) = T(0);
  x(0, 1) = -T(0);
  x(0, 2) = -std::numeric_limits<T>::min();
  const linattn::Relu map;
  CHECK(map.feature_dim(13) == 13);
  const Matrix<T> phi_q = map.queries(x);
  const Matrix<T> phi_k = map.keys(x);
  REQUIRE(phi_q.rows() == x.rows());
  REQUIRE(phi_q.cols() == x.cols());
  Index mismatches = 0;
  Index zeros = 0;
  for (Index r = 0; r < x.rows(); ++r) {
    for (Index c = 0; c < x.cols(); ++c) {
      const T expected = x(r, c) > T(0) ? x(r, c) : T(0);
      if (phi_q(r, c) != expected || phi_k(r, c) != expected) ++mismatches;
      if (expected == T(0)) ++zeros;
    }
  }
  CAPTURE(zeros);
  CHECK(mismatches == 0);
  CHECK(zeros > x.size() / 4);  // both branches were exercised
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> col_major = x;
  CHECK(map.queries(col_major) == phi_q);
}

// ---------------------------------------------------------------------------------------------
// PositiveRandomFeatures: the features themselves
// ---------------------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("PositiveRandomFeatures computes exp(W u - |u|^2/2) / sqrt(m)",
                   "[feature_maps][favor]", float, double) {
  using T = TestType;
  const Index dk = 12;
  const Index m = 40;
  const double tol = std::is_same_v<T, float> ? 2e-5 : 1e-13;
  struct Case {
    const char* name;
    RandomFeatureOptions options;
  };
  std::vector<Case> cases(4);
  cases[0].name = "default";
  cases[1].name = "hyperbolic";
  cases[1].options.hyperbolic = true;
  cases[2].name = "iid, temperature 0.4";
  cases[2].options.projection = Projection::iid;
  cases[2].options.temperature = 0.4;
  cases[3].name = "fixed row norm";
  cases[3].options.row_norm = RowNorm::fixed;
  for (const Case& c : cases) {
    INFO(c.name);
    const PositiveRandomFeatures map(dk, m, 7, c.options);
    const Matrix<T> x = gaussian<T>(23, dk, 103, 1.0);
    const Matrix<double> ref = prf_reference(x.template cast<double>(), map.projection(),
                                             map.temperature(), c.options.hyperbolic);
    const Matrix<T> phi_q = map.queries(x);
    const Matrix<T> phi_k = map.keys(x);
    REQUIRE(phi_q.cols() == map.feature_dim(dk));
    REQUIRE(phi_q.cols() == (c.options.hyperbolic ? 2 * m : m));
    // Entry-wise relative error (the features span several orders of magnitude).
    const double err =
        ((phi_q.template cast<double>() - ref).array() / ref.array()).abs().maxCoeff();
    const double err_k =
        ((phi_k.template cast<double>() - ref).array() / ref.array()).abs().maxCoeff();
    CAPTURE(err, err_k);
    CHECK(err <= tol);
    CHECK(err_k <= tol);
    CHECK((phi_q.array() > T(0)).all());

    // scaled_features: rows with max entry 1 and phi = exp(log_scale) * row.
    Vector<double> log_scale;
    const Matrix<T> scaled = map.scaled_features(x, log_scale);
    REQUIRE(log_scale.size() == x.rows());
    double scaled_err = 0.0;
    for (Index r = 0; r < x.rows(); ++r) {
      CHECK(scaled.row(r).maxCoeff() == T(1));
      const Eigen::RowVectorXd back =
          scaled.row(r).template cast<double>() * std::exp(log_scale(r));
      scaled_err =
          std::max(scaled_err, ((back - ref.row(r)).array() / ref.row(r).array()).abs().maxCoeff());
    }
    CAPTURE(scaled_err);
    CHECK(scaled_err <= tol);
  }
  if constexpr (std::is_same_v<T, double>) {
    // A column-major input gives the same features.
    const PositiveRandomFeatures map(dk, m, 7);
    const Matrix<double> x = gaussian<double>(9, dk, 104);
    const Eigen::MatrixXd col_major = x;
    CHECK(relative_error(map.queries(col_major), map.queries(x)) <= 1e-14);
  }
}

TEST_CASE("PositiveRandomFeatures is reproducible from its seed", "[feature_maps][favor]") {
  const Index dk = 16;
  const Index m = 40;
  std::vector<RandomFeatureOptions> all(4);
  all[1].projection = Projection::iid;
  all[2].row_norm = RowNorm::fixed;
  all[3].hyperbolic = true;
  for (std::size_t o = 0; o < all.size(); ++o) {
    INFO("options #" << o);
    const PositiveRandomFeatures a(dk, m, 2024, all[o]);
    const PositiveRandomFeatures b(dk, m, 2024, all[o]);
    const PositiveRandomFeatures c(dk, m, 2025, all[o]);
    REQUIRE(a.projection().rows() == m);
    REQUIRE(a.projection().cols() == dk);
    CHECK(a.seed() == 2024);
    CHECK(same_bits(a.projection(), b.projection()));
    const double seed_diff = (a.projection() - c.projection()).cwiseAbs().maxCoeff();
    CAPTURE(seed_diff);
    CHECK(seed_diff > 0.5);  // entries are O(1); another seed is another draw

    PositiveRandomFeatures d(dk, m, 99, all[o]);
    d.redraw(2024);
    CHECK(d.seed() == 2024);
    CHECK(same_bits(d.projection(), a.projection()));
    CHECK(d.options().hyperbolic == all[o].hyperbolic);

    // Equal maps give equal features.
    const Matrix<double> x = gaussian<double>(5, dk, 105);
    CHECK(a.queries(x) == b.queries(x));
    CHECK(a.keys(x) == d.keys(x));
  }
  // The Fourier map draws W the same way.
  const RandomFourierFeatures f1(dk, m, 31);
  RandomFourierFeatures f2(dk, m, 32);
  CHECK_FALSE(same_bits(f1.projection(), f2.projection()));
  f2.redraw(31);
  CHECK(same_bits(f1.projection(), f2.projection()));
}

TEST_CASE("PositiveRandomFeatures: orthogonal blocks of Dk rows", "[feature_maps][favor]") {
  const Index dk = 16;
  for (const Index m : {Index(5), Index(16), Index(40)}) {
    for (const RowNorm norm : {RowNorm::chi, RowNorm::fixed}) {
      RandomFeatureOptions options;
      options.row_norm = norm;
      const PositiveRandomFeatures map(dk, m, 300 + static_cast<std::uint64_t>(m), options);
      const Matrix<double>& w = map.projection();
      double worst_in_block = 0.0;
      double max_across = 0.0;
      for (Index a = 0; a < m; ++a) {
        for (Index b = a + 1; b < m; ++b) {
          if (a / dk == b / dk) {
            worst_in_block = std::max(worst_in_block, abs_cos(w, a, b));
          } else {
            max_across = std::max(max_across, abs_cos(w, a, b));
          }
        }
      }
      double worst_norm = 0.0;
      for (Index r = 0; r < m; ++r) {
        worst_norm = std::max(worst_norm, std::abs(w.row(r).norm() - std::sqrt(double(dk))));
      }
      INFO("m = " << m << (norm == RowNorm::chi ? ", chi" : ", fixed"));
      CAPTURE(worst_in_block, max_across, worst_norm);
      CHECK(worst_in_block <= 1e-12);
      // Blocks are independent draws: no row repeats (up to scale) in another block.
      CHECK(max_across < 0.99);
      if (m > dk) CHECK(max_across > 1e-3);
      if (norm == RowNorm::fixed) {
        CHECK(worst_norm <= 1e-12);
      } else {
        CHECK(worst_norm > 0.1);  // chi norms vary
      }
    }
  }
  // iid rows are not orthogonal.
  RandomFeatureOptions iid;
  iid.projection = Projection::iid;
  const PositiveRandomFeatures map(dk, 16, 301, iid);
  double max_cos = 0.0;
  for (Index a = 0; a < 16; ++a) {
    for (Index b = a + 1; b < 16; ++b) max_cos = std::max(max_cos, abs_cos(map.projection(), a, b));
  }
  CAPTURE(max_cos);
  CHECK(max_cos > 0.1);
}

TEST_CASE("PositiveRandomFeatures: row norms and entries have the Gaussian's moments",
          "[feature_maps][favor]") {
  // Each row of W is marginally N(0, I_Dk): |w|^2 ~ chi^2_Dk (mean Dk, variance 2 Dk) and each
  // entry has variance 1. Bounds are 5 standard errors.
  const Index dk = 16;
  const Index m = 4096;
  for (const Projection projection : {Projection::orthogonal, Projection::iid}) {
    RandomFeatureOptions options;
    options.projection = projection;
    const PositiveRandomFeatures map(dk, m, 400, options);
    const Vector<double> sq = map.projection().rowwise().squaredNorm();
    const double n = double(m);
    const double mean = sq.mean();
    const double var = (sq.array() - mean).square().sum() / (n - 1.0);
    const double k = double(dk);
    const double se_mean = std::sqrt(2.0 * k / n);
    // Var of the sample variance: (mu4 - sigma^4) / n, mu4 = 12 k (k + 4) for chi^2_k.
    const double se_var = std::sqrt((12.0 * k * (k + 4.0) - 4.0 * k * k) / n);
    const double entry_mean = map.projection().mean();
    const double entry_se = 1.0 / std::sqrt(n * k);
    INFO((projection == Projection::orthogonal ? "orthogonal" : "iid"));
    WARN("mean |w|^2 = " << mean << " (Dk = " << dk << ", 5 SE = " << 5 * se_mean
                         << "), var |w|^2 = " << var << " (2 Dk = " << 2 * dk
                         << ", 5 SE = " << 5 * se_var << "), entry mean " << entry_mean);
    CHECK(std::abs(mean - k) <= 5.0 * se_mean);
    CHECK(std::abs(var - 2.0 * k) <= 5.0 * se_var);
    CHECK(std::abs(entry_mean) <= 5.0 * entry_se);
  }
}

// ---------------------------------------------------------------------------------------------
// Estimators: E[phi(q) . phi(k)]
// ---------------------------------------------------------------------------------------------

TEST_CASE("PositiveRandomFeatures estimates exp(tau q.k) without bias", "[feature_maps][favor]") {
  const Index dk = 8;
  const Index m = 256;
  const int draws = 2000;
  // |q| = |k| = 1.7, cos 0.7: tau q.k = 0.715, exp = 2.04 (1.29 with tau = 1/Dk).
  const auto [q, k] = fixed_pair(dk, 12, 1.7, 1.7, 0.7);
  const double qk = q.row(0).dot(k.row(0));

  const PositiveRandomFeatures plain(dk, m, 0);
  CHECK(plain.temperature() == Approx(1.0 / std::sqrt(8.0)).epsilon(1e-15));

  struct Case {
    const char* name;
    RandomFeatureOptions options;
  };
  std::vector<Case> cases(4);
  cases[0].name = "orthogonal (default)";
  cases[1].name = "hyperbolic";
  cases[1].options.hyperbolic = true;
  cases[2].name = "iid";
  cases[2].options.projection = Projection::iid;
  cases[3].name = "temperature 0.5";
  cases[3].options.temperature = 0.5;
  for (const Case& c : cases) {
    PositiveRandomFeatures map(dk, m, 0, c.options);
    const double tau = c.options.temperature > 0 ? c.options.temperature : 1.0 / std::sqrt(8.0);
    CHECK(map.temperature() == Approx(tau).epsilon(1e-15));
    std::vector<double> samples;
    for (int s = 0; s < draws; ++s) {
      map.redraw(5000 + static_cast<std::uint64_t>(s));
      samples.push_back(map.queries(q).row(0).dot(map.keys(k).row(0)));
    }
    const MeanSe est = mean_and_se(samples);
    const double target = std::exp(tau * qk);
    const double z = (est.mean - target) / est.se;
    WARN(c.name << ": mean phi(q).phi(k) = " << est.mean << " +- " << est.se
                << " (SE), exp(tau q.k) = " << target << ", z = " << z);
    CHECK(std::abs(z) <= 5.0);
    // Power: 5 SE (~4% of the target here, ~10% at temperature 0.5) is well below the 25-40% a
    // wrong temperature (1/Dk, or the default instead of the option) would move the mean.
    CHECK(5.0 * est.se <= 0.2 * target);
  }
}

TEST_CASE("RandomFourierFeatures estimate the Gaussian kernel", "[feature_maps][fourier]") {
  const Index dk = 8;
  const Index m = 64;
  const int draws = 2000;
  // |q - k| = 1.7: exp(-tau |q - k|^2 / 2) = 0.60 (0.84 with tau = 1/Dk).
  const auto [q, d] = fixed_pair(dk, 13, 1.5, 1.7, 0.0);
  const Matrix<double> k = q + d;
  const double dist2 = (q - k).squaredNorm();
  for (const bool iid : {false, true}) {
    RandomFeatureOptions options;
    if (iid) options.projection = Projection::iid;
    RandomFourierFeatures map(dk, m, 0, options);
    CHECK(map.feature_dim(dk) == 2 * m);
    const double tau = map.temperature();
    CHECK(tau == Approx(1.0 / std::sqrt(8.0)).epsilon(1e-15));
    std::vector<double> samples;
    for (int s = 0; s < draws; ++s) {
      map.redraw(7000 + static_cast<std::uint64_t>(s));
      samples.push_back(map.queries(q).row(0).dot(map.keys(k).row(0)));
    }
    const MeanSe est = mean_and_se(samples);
    const double target = std::exp(-tau * dist2 / 2.0);
    const double z = (est.mean - target) / est.se;
    WARN("Fourier (" << (iid ? "iid" : "orthogonal") << "): mean phi(q).phi(k) = " << est.mean
                     << " +- " << est.se << ", exp(-tau |q-k|^2 / 2) = " << target
                     << ", z = " << z);
    CHECK(std::abs(z) <= 5.0);
    CHECK(5.0 * est.se <= 0.05 * target);  // power: tau = 1/Dk would move the mean by 40%
  }
}

TEMPLATE_TEST_CASE("RandomFourierFeatures are [sin(W u), cos(W u)] / sqrt(m)",
                   "[feature_maps][fourier]", float, double) {
  using T = TestType;
  const Index dk = 10;
  const Index m = 24;
  RandomFeatureOptions options;
  options.temperature = 0.3;
  const RandomFourierFeatures map(dk, m, 17, options);
  const Matrix<T> x = gaussian<T>(50, dk, 106, 3.0);
  const Matrix<T> phi = map.queries(x);
  REQUIRE(phi.rows() == x.rows());
  REQUIRE(phi.cols() == 2 * m);
  CHECK(map.keys(x) == phi);
  double err = 0.0;
  double bound_excess = 0.0;
  double pair_err = 0.0;
  const double inv = 1.0 / std::sqrt(double(m));
  for (Index r = 0; r < x.rows(); ++r) {
    const Eigen::RowVectorXd u = std::sqrt(0.3) * x.row(r).template cast<double>();
    for (Index f = 0; f < m; ++f) {
      const double t = map.projection().row(f).dot(u);
      err = std::max(err, std::abs(double(phi(r, f)) - std::sin(t) * inv));
      err = std::max(err, std::abs(double(phi(r, m + f)) - std::cos(t) * inv));
      bound_excess = std::max(bound_excess, std::abs(double(phi(r, f))) - inv);
      bound_excess = std::max(bound_excess, std::abs(double(phi(r, m + f))) - inv);
      pair_err = std::max(pair_err, std::abs(double(phi(r, f)) * phi(r, f) +
                                             double(phi(r, m + f)) * phi(r, m + f) - 1.0 / m));
    }
  }
  CAPTURE(err, bound_excess, pair_err);
  // Arguments reach ~30, so float sin/cos of a float-rounded argument differ by ~1e-5.
  CHECK(err <= (std::is_same_v<T, float> ? 1e-4 : 1e-12) * inv);
  CHECK(bound_excess <= (std::is_same_v<T, float> ? 1e-6 : 1e-15) * inv);
  CHECK(pair_err <= (std::is_same_v<T, float> ? 1e-6 : 1e-15));
}

// ---------------------------------------------------------------------------------------------
// Softmax approximation
// ---------------------------------------------------------------------------------------------

namespace {

struct SoftmaxProblem {
  Matrix<double> q, k, v, exact;
};

/// N = 128, Dk = 16, Dv = 8. q and k have stddev 0.4: the FAVOR+ relative variance grows like
/// exp(|u_q + u_k|^2), so at stddev 0.75 the error at m = 1024 is still ~0.45 and the decay with
/// m is hidden by the heavy tail; at 0.4 it follows 1/sqrt(m).
SoftmaxProblem softmax_problem(std::uint64_t seed) {
  SoftmaxProblem p;
  p.q = gaussian<double>(128, 16, 3 * seed + 1, 0.4);
  p.k = gaussian<double>(128, 16, 3 * seed + 2, 0.4);
  p.v = gaussian<double>(128, 8, 3 * seed + 3, 1.0);
  p.exact = exact_softmax_attention(p.q, p.k, p.v, 1.0 / std::sqrt(16.0));
  return p;
}

double favor_error(const SoftmaxProblem& p, Index m, std::uint64_t seed, Projection projection) {
  RandomFeatureOptions options;
  options.projection = projection;
  const PositiveRandomFeatures map(16, m, seed, options);
  linattn::Options opts;
  opts.eps = 0.0;
  const Matrix<double> out = linattn::linear_attention(p.q, p.k, p.v, map, opts);
  return (out - p.exact).norm() / p.exact.norm();
}

}  // namespace

TEST_CASE("PositiveRandomFeatures attention approaches softmax attention as m grows",
          "[feature_maps][favor][softmax]") {
  const std::array<Index, 4> ms{16, 64, 256, 1024};
  const int seeds = 16;
  std::array<double, 4> mean_err{};
  for (int s = 0; s < seeds; ++s) {
    const SoftmaxProblem p = softmax_problem(static_cast<std::uint64_t>(s));
    for (std::size_t i = 0; i < ms.size(); ++i) {
      mean_err[i] +=
          favor_error(p, ms[i], 900 + static_cast<std::uint64_t>(s), Projection::orthogonal) /
          seeds;
    }
  }
  WARN("mean relative error vs softmax (16 seeds), m = 16, 64, 256, 1024: "
       << mean_err[0] << ", " << mean_err[1] << ", " << mean_err[2] << ", " << mean_err[3]
       << " (ratios " << mean_err[0] / mean_err[1] << ", " << mean_err[1] / mean_err[2] << ", "
       << mean_err[2] / mean_err[3] << "; 1/sqrt(m) gives 2)");
  for (std::size_t i = 0; i + 1 < ms.size(); ++i) {
    INFO("m = " << ms[i] << " -> " << ms[i + 1]);
    CHECK(mean_err[i] >= 1.4 * mean_err[i + 1]);
  }
  CHECK(mean_err[0] >= 4.0 * mean_err[3]);
  // The estimator converges to softmax attention, not to something else.
  CHECK(mean_err[3] <= 0.08);
}

TEST_CASE("Orthogonal random features beat iid ones on softmax attention",
          "[feature_maps][favor][softmax]") {
  // The gain is ~10% of the error for Dk = 16, so it takes ~128 seeds to see it reliably.
  const int seeds = 128;
  const std::array<Index, 2> ms{64, 256};
  std::array<double, 2> orth{}, iid{};
  for (int s = 0; s < seeds; ++s) {
    const auto seed = static_cast<std::uint64_t>(s);
    const SoftmaxProblem p = softmax_problem(1000 + seed);
    for (std::size_t i = 0; i < ms.size(); ++i) {
      orth[i] += favor_error(p, ms[i], 5000 + seed, Projection::orthogonal) / seeds;
      iid[i] += favor_error(p, ms[i], 5000 + seed, Projection::iid) / seeds;
    }
  }
  for (std::size_t i = 0; i < ms.size(); ++i) {
    WARN("m = " << ms[i] << ": mean relative error orthogonal " << orth[i] << ", iid " << iid[i]
                << " (iid / orthogonal = " << iid[i] / orth[i] << ")");
    CHECK(iid[i] >= 1.03 * orth[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Overflow: the stabiliser
// ---------------------------------------------------------------------------------------------

TEST_CASE("PositiveRandomFeatures stays finite and exact where float exp overflows",
          "[feature_maps][favor][overflow]") {
  // Dk = 128: the largest rows of W have |w|^2 ~ 160-185, and a query and a key aligned with the
  // same row give phi(q).phi(k) ~ exp(|w|^2) / m ~ e^160, far past FLT_MAX (e^88.7). The first
  // quarter of the tokens are ordinary (|x| ~ 1 per entry), so a scale taken from later tokens
  // would flush their weights to zero. Queries and keys cycle through the 4 largest rows at
  // different rates, so some queries meet no earlier key on their row: their weights lie far
  // below (their largest feature) x (the running largest key feature), where a floored exp
  // would add spurious weight (see the next test).
  const Index dk = 128;
  const Index m = 128;
  const Index n = 200;
  const Index dv = 8;
  const bool hyperbolic = GENERATE(false, true);
  INFO((hyperbolic ? "hyperbolic" : "plain"));
  RandomFeatureOptions options;
  options.hyperbolic = hyperbolic;
  const PositiveRandomFeatures map(dk, m, 1, options);
  const Matrix<double>& w = map.projection();
  const double tau = map.temperature();

  std::vector<Index> rows(static_cast<std::size_t>(m));
  std::iota(rows.begin(), rows.end(), Index(0));
  std::sort(rows.begin(), rows.end(),
            [&](Index a, Index b) { return w.row(a).squaredNorm() > w.row(b).squaredNorm(); });
  const Matrix<double> noise_q = gaussian<double>(n, dk, 201, 0.05);
  const Matrix<double> noise_k = gaussian<double>(n, dk, 202, 0.05);
  const Matrix<double> plain_q = gaussian<double>(n, dk, 203, 1.0);
  const Matrix<double> plain_k = gaussian<double>(n, dk, 204, 1.0);
  Matrix<double> qd(n, dk), kd(n, dk);
  for (Index t = 0; t < n; ++t) {
    if (t < n / 4) {
      qd.row(t) = plain_q.row(t);
      kd.row(t) = plain_k.row(t);
      continue;
    }
    // u = a w_r + noise, a in [0.55, 1.15): log phi_r(u) = |w|^2 (a - a^2 / 2) + ...
    const double golden = 0.6180339887498949;
    const double aq = 0.55 + 0.6 * std::fmod(double(t) * golden, 1.0);
    const double ak = 0.55 + 0.6 * std::fmod(double(t) * golden * golden, 1.0);
    const Index rq = rows[static_cast<std::size_t>(t % 4)];
    const Index rk = rows[static_cast<std::size_t>((t / 3) % 4)];
    qd.row(t) = (aq * w.row(rq) + noise_q.row(t)) / std::sqrt(tau);
    kd.row(t) = (ak * w.row(rk) + noise_k.row(t)) / std::sqrt(tau);
  }
  const Matrix<float> q = qd.cast<float>();
  const Matrix<float> k = kd.cast<float>();
  const Matrix<float> v = gaussian<float>(n, dv, 205, 1.0);

  // Reference in log space, from the float inputs, in double.
  const Matrix<double> l = log_kernel(prf_log_features(q.cast<double>(), w, tau, hyperbolic),
                                      prf_log_features(k.cast<double>(), w, tau, hyperbolic));
  double max_log_weight = -std::numeric_limits<double>::infinity();
  for (Index i = 0; i < n; ++i)
    max_log_weight = std::max(max_log_weight, l.row(i).head(i + 1).maxCoeff());

  // The point: without the stabiliser float overflows.
  const Matrix<float> phi_q = map.queries(q);
  const Matrix<float> phi_k = map.keys(k);
  linattn::Options unchecked;
  unchecked.check_finite = false;
  const Matrix<float> raw =
      linattn::causal_linear_attention(phi_q, phi_k, v, linattn::Identity{}, unchecked);
  const bool features_overflow = !phi_q.allFinite() || !phi_k.allFinite();
  const bool raw_overflow = !raw.allFinite();
  WARN("largest log(phi(q_i).phi(k_j)), j <= i: "
       << max_log_weight << " (float overflows past " << std::log(std::numeric_limits<float>::max())
       << "); unscaled features finite: " << !features_overflow
       << ", unstabilised outputs finite: " << !raw_overflow);
  REQUIRE(max_log_weight > std::log(std::numeric_limits<float>::max()) + 20.0);
  REQUIRE((features_overflow || raw_overflow));

  for (const double decay : {1.0, 0.9}) {
    linattn::Options opts;
    opts.decay = decay;
    INFO("decay " << decay);
    const Matrix<double> ref = causal_from_log_weights(l, v.cast<double>(), decay, opts.eps);
    REQUIRE(ref.allFinite());
    const double ref_scale = ref.cwiseAbs().maxCoeff();
    const double early_scale = ref.topRows(n / 4).cwiseAbs().maxCoeff();

    const Matrix<float> parallel = linattn::causal_linear_attention(q, k, v, map, opts);
    linattn::RecurrentState<float> state(map.feature_dim(dk), dv, opts);
    Matrix<float> recurrent(n, dv);
    for (Index i = 0; i < n; ++i) recurrent.row(i) = state.step(q.row(i), k.row(i), v.row(i), map);

    const double err_parallel = relative_error(parallel, ref);
    const double err_recurrent = relative_error(recurrent, ref);
    WARN("overflow inputs, " << (hyperbolic ? "hyperbolic" : "plain") << ", decay " << decay
                             << ": max|out - ref| / max|ref| = " << err_parallel << " (parallel), "
                             << err_recurrent << " (recurrent); parallel vs "
                             << "recurrent " << relative_error(parallel, recurrent) << "; max|ref| "
                             << ref_scale << ", early rows " << early_scale);
    CHECK(early_scale > 0.1);  // the ordinary tokens' outputs are not flushed to zero
    CHECK(parallel.allFinite());
    CHECK(recurrent.allFinite());
    CHECK(err_parallel <= 1e-4);
    CHECK(err_recurrent <= 1e-4);
    // docs/design.md: the two forms agree within 2e-5 in float, here too.
    CHECK(relative_error(parallel, recurrent) <= 2e-5);
    CHECK(std::isfinite(state.sums().log_scale));
  }
}

TEST_CASE("PositiveRandomFeatures in float: a far-off key adds no spurious weight",
          "[feature_maps][favor][overflow]") {
  // Two tokens on two orthogonal rows A, B of W (one block, m = Dk = 256, |w|^2 ~ 256). Key 0 is
  // w_A (in u units) and has log-scale lk0 = |w_A|^2 / 2 - log(m) / 2; query 1 is w_B and key 1
  // is c w_B with log-scale lk0 - 85. Key 0's true weight for query 1 is below e^-80 of key 1's,
  // so out_1 = v_1. In the scaled form key 1's weight is e^-85 relative to the running scale (a
  // normal float), and key 0's is q1_s . k0_s, whose entries are exp of arguments near -|w|^2:
  // they must be (near) zero. An exp that floors at ~e^-88.7 instead of returning 0 (Eigen 3.4's
  // SSE float exp) gives key 0 a weight ~e^-88 next to key 1's e^-85 and moves out_1 by ~5%.
  const Index dk = 256;
  const PositiveRandomFeatures map(dk, dk, 1);
  const Matrix<double>& w = map.projection();
  const double tau = map.temperature();
  const double h = 0.5 * std::log(double(dk));
  Index a = 0;
  Index b = 1;
  w.rowwise().squaredNorm().maxCoeff(&a);
  for (Index r = 0; r < dk; ++r) {
    if (r != a && w.row(r).squaredNorm() > w.row(b).squaredNorm()) b = r;
  }
  if (b == a) b = a == 0 ? 1 : 0;
  const double alpha = w.row(a).squaredNorm();
  const double beta = w.row(b).squaredNorm();
  // log-scale of c w_B: c beta (1 - c / 2) - h; solve for lk0 - 85.
  const double lk0 = alpha / 2.0 - h;
  const double d = lk0 - 85.0 + h;
  const double c = 1.0 - std::sqrt(1.0 - 2.0 * d / beta);
  Matrix<double> qd = gaussian<double>(2, dk, 501, 1.0);
  Matrix<double> kd(2, dk);
  kd.row(0) = w.row(a) / std::sqrt(tau);
  qd.row(1) = w.row(b) / std::sqrt(tau);
  kd.row(1) = c * w.row(b) / std::sqrt(tau);
  const Matrix<float> q = qd.cast<float>();
  const Matrix<float> k = kd.cast<float>();
  Matrix<float> v(2, 2);
  v << 1.0f, 0.0f, 0.0f, 1.0f;

  const Matrix<double> log_k = prf_log_features(k.cast<double>(), w, tau, false);
  const Matrix<double> l = log_kernel(prf_log_features(q.cast<double>(), w, tau, false), log_k);
  const double scale_gap = log_k.row(0).maxCoeff() - log_k.row(1).maxCoeff();
  const linattn::Options opts;
  const Matrix<double> ref = causal_from_log_weights(l, v.cast<double>(), 1.0, opts.eps);
  CAPTURE(alpha, beta, c, scale_gap, l(1, 0), l(1, 1));
  REQUIRE(std::abs(scale_gap - 85.0) < 0.5);
  REQUIRE(l(1, 1) - l(1, 0) > 80.0);  // out_1 is v_1 to working precision

  const Matrix<float> parallel = linattn::causal_linear_attention(q, k, v, map, opts);
  linattn::RecurrentState<float> state(dk, 2, opts);
  Matrix<float> recurrent(2, 2);
  for (Index i = 0; i < 2; ++i) recurrent.row(i) = state.step(q.row(i), k.row(i), v.row(i), map);
  const double err_parallel = relative_error(parallel, ref);
  const double err_recurrent = relative_error(recurrent, ref);
  WARN("far-off key: out_1 = " << parallel.row(1) << " (parallel), " << recurrent.row(1)
                               << " (recurrent), reference " << ref.row(1) << "; errors "
                               << err_parallel << ", " << err_recurrent);
  CHECK(err_parallel <= 1e-4);
  CHECK(err_recurrent <= 1e-4);
}

// ---------------------------------------------------------------------------------------------
// Fourier features: the denominator guard
// ---------------------------------------------------------------------------------------------

TEST_CASE("RandomFourierFeatures attention stays finite where denominators cross zero",
          "[feature_maps][fourier]") {
  const Index dk = 16;
  const Index m = 4;
  const Index n = 500;
  const Index dv = 8;
  const RandomFourierFeatures map(dk, m, 11);
  const Matrix<double> q = gaussian<double>(n, dk, 301, 1.0);
  const Matrix<double> k = gaussian<double>(n, dk, 302, 1.0);
  const Matrix<double> v = gaussian<double>(n, dv, 303, 1.0);

  // Denominators phi(q_i) . z_i, z_i = sum_{j<=i} phi(k_j), in double in the test.
  const Matrix<double> phi_q = map.queries(q);
  const Matrix<double> phi_k = map.keys(k);
  Vector<double> den(n);
  Eigen::RowVectorXd z = Eigen::RowVectorXd::Zero(2 * m);
  for (Index i = 0; i < n; ++i) {
    z += phi_k.row(i);
    den(i) = phi_q.row(i).dot(z);
  }
  const double min_abs = den.cwiseAbs().minCoeff();
  Index negatives = 0;
  for (Index i = 0; i < n; ++i) negatives += den(i) < 0 ? 1 : 0;
  WARN("Fourier m = 4: " << negatives << " of " << n << " denominators negative, min |den| "
                         << min_abs);
  REQUIRE(negatives > 0);  // the denominators change sign along the sequence
  REQUIRE(negatives < n);

  const linattn::Options opts;  // default eps
  const Matrix<double> out = linattn::causal_linear_attention(q, k, v, map, opts);
  const Matrix<float> out_f = linattn::causal_linear_attention(
      q.cast<float>().eval(), k.cast<float>().eval(), v.cast<float>().eval(), map, opts);
  CHECK(out.allFinite());
  CHECK(out_f.allFinite());

  linattn::RecurrentState<float> state(map.feature_dim(dk), dv, opts);
  bool steps_finite = true;
  for (Index i = 0; i < n; ++i) {
    const Vector<float> o =
        state.step(q.row(i).cast<float>(), k.row(i).cast<float>(), v.row(i).cast<float>(), map);
    steps_finite = steps_finite && o.allFinite();
  }
  CHECK(steps_finite);

  // Where the denominator is well away from zero the output is the formula's.
  const Matrix<double> ref =
      linattn_test::naive_linear_attention(phi_q, phi_k, v, true, 1.0, opts.eps, true);
  double diff = 0.0;
  double scale = 0.0;
  Index compared = 0;
  for (Index i = 0; i < n; ++i) {
    if (std::abs(den(i)) < 1e-3) continue;
    ++compared;
    diff = std::max(diff, (out.row(i) - ref.row(i)).cwiseAbs().maxCoeff());
    scale = std::max(scale, ref.row(i).cwiseAbs().maxCoeff());
  }
  CAPTURE(compared, diff, scale);
  CHECK(compared > n / 2);
  CHECK(diff <= 1e-8 * scale);
}

// ---------------------------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------------------------

TEST_CASE("Random feature maps reject bad input with linattn::Error", "[feature_maps][errors]") {
  const Index dk = 8;
  const PositiveRandomFeatures prf(dk, 16, 1);
  const RandomFourierFeatures rff(dk, 16, 1);
  const Matrix<double> wide = gaussian<double>(4, dk + 1, 401);
  const Matrix<float> wide_f = wide.cast<float>();
  const Matrix<double> narrow = gaussian<double>(4, dk - 1, 402);
  const Matrix<double> v = gaussian<double>(4, 3, 403);

  REQUIRE_THROWS_AS(prf.queries(wide), linattn::Error);
  REQUIRE_THROWS_AS(prf.keys(wide_f), linattn::Error);
  REQUIRE_THROWS_AS(prf.queries(narrow), linattn::Error);
  REQUIRE_THROWS_AS(rff.queries(wide), linattn::Error);
  REQUIRE_THROWS_AS(rff.keys(narrow), linattn::Error);
  Vector<double> log_scale;
  REQUIRE_THROWS_AS(prf.scaled_features(wide, log_scale), linattn::Error);

  CHECK(prf.feature_dim(dk) == 16);
  CHECK(rff.feature_dim(dk) == 32);
  REQUIRE_THROWS_AS(prf.feature_dim(dk + 1), linattn::Error);
  REQUIRE_THROWS_AS(rff.feature_dim(dk - 1), linattn::Error);

  // The message names the problem.
  try {
    (void)prf.queries(wide);
    FAIL("no throw");
  } catch (const linattn::Error& e) {
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("PositiveRandomFeatures") != std::string::npos);
    CHECK(what.find("9") != std::string::npos);
  }

  // The kernels with a map built for another width.
  REQUIRE_THROWS_AS(linattn::causal_linear_attention(wide, wide, v, prf), linattn::Error);
  REQUIRE_THROWS_AS(linattn::linear_attention(wide, wide, v, rff), linattn::Error);
  linattn::RecurrentState<double> state(prf.feature_dim(dk), 3);
  REQUIRE_THROWS_AS(state.step(wide.row(0), wide.row(0), v.row(0), prf), linattn::Error);
  CHECK(state.tokens() == 0);

  // Sizes.
  REQUIRE_THROWS_AS(PositiveRandomFeatures(dk, 0, 1), linattn::Error);
  REQUIRE_THROWS_AS(PositiveRandomFeatures(0, 16, 1), linattn::Error);
  REQUIRE_THROWS_AS(PositiveRandomFeatures(-3, 16, 1), linattn::Error);
  REQUIRE_THROWS_AS(RandomFourierFeatures(dk, 0, 1), linattn::Error);
  REQUIRE_THROWS_AS(RandomFourierFeatures(0, 16, 1), linattn::Error);

  // Temperature: 0, NaN and infinity are errors; negative means the default.
  for (const double bad : {0.0, -0.0, std::numeric_limits<double>::quiet_NaN(),
                           std::numeric_limits<double>::infinity()}) {
    RandomFeatureOptions options;
    options.temperature = bad;
    CAPTURE(bad);
    REQUIRE_THROWS_AS(PositiveRandomFeatures(dk, 16, 1, options), linattn::Error);
    REQUIRE_THROWS_AS(RandomFourierFeatures(dk, 16, 1, options), linattn::Error);
  }
  RandomFeatureOptions negative;
  negative.temperature = -2.0;
  CHECK(PositiveRandomFeatures(dk, 16, 1, negative).temperature() ==
        Approx(1.0 / std::sqrt(8.0)).epsilon(1e-15));
}

TEST_CASE("W is pinned bit for bit: the same seed gives the same W on every platform",
          "[feature_maps][reproducible]") {
  // Golden values from this implementation (mt19937_64, polar method with a libm-free log,
  // fma-ordered Gram-Schmidt). They hold for every compiler, flag and SIMD width; a change in
  // the sampling or orthogonalisation that would silently change users' W fails here.
  const linattn::PositiveRandomFeatures map(8, 8, 12345);
  const Matrix<double>& w = map.projection();
  CHECK(w(0, 0) == -0x1.3c7c7c1ba920ap+0);
  CHECK(w(0, 1) == -0x1.baa0cd07c9e0ap-1);
  CHECK(w(0, 2) == 0x1.5839494b63232p+0);
  CHECK(w(0, 3) == 0x1.b24d6502857c2p-2);
  CHECK(w(7, 7) == 0x1.da26a122308c9p-2);
  CHECK(w(3, 5) == -0x1.b6fd0df45b415p+0);
  // The log behind the sampler agrees with libm's to the last bit or two.
  for (const double x : {1e-300, 1e-10, 0.3, 0.7071, 1.0, 1.5, 1e10, 1e300}) {
    INFO("x = " << x);
    CHECK(std::abs(linattn::detail::portable_log(x) - std::log(x)) <=
          4e-16 * std::max(1.0, std::abs(std::log(x))));
  }
}

TEST_CASE("FAVOR+ in float with inputs of norm 10 to 100 matches a log-space reference",
          "[feature_maps][favor][overflow]") {
  // With inputs this large every phi(q) . phi(k) is below exp(-300); eps = 1e-6 added outside
  // would then dominate and make the exact output ~1e-290, zero in float, so eps = 0 here
  // (the normalised output is then a weighted mean of values, scale-free).
  // Up to norm ~30 the float path holds; at norm 100 single feature products span more than
  // float's exponent range, and the double accumulator (which also computes the features in
  // double) is the documented remedy.
  const Index dk = 16, m = 32, n = 120, dv = 3;
  const PositiveRandomFeatures map(dk, m, 21);
  linattn::Options opts;
  opts.eps = 0.0;
  for (const double norm : {10.0, 30.0, 100.0}) {
    Matrix<double> qd = gaussian<double>(n, dk, 611, 1.0), kd = gaussian<double>(n, dk, 612, 1.0);
    qd.rowwise().normalize();
    kd.rowwise().normalize();
    qd *= norm;
    kd *= norm;
    const Matrix<float> q = qd.cast<float>(), k = kd.cast<float>();
    const Matrix<float> v = gaussian<float>(n, dv, 613, 1.0);
    const Matrix<double> l =
        log_kernel(prf_log_features(q.cast<double>(), map.projection(), map.temperature(), false),
                   prf_log_features(k.cast<double>(), map.projection(), map.temperature(), false));
    const Matrix<double> ref = causal_from_log_weights(l, v.cast<double>(), 1.0, 0.0);
    const bool wide = norm > 30.0;
    const Matrix<float> parallel =
        wide ? linattn::causal_linear_attention<double>(q, k, v, map, opts)
             : linattn::causal_linear_attention(q, k, v, map, opts);
    Matrix<float> recurrent(n, dv);
    linattn::RecurrentState<float> narrow_state(m, dv, opts);
    linattn::RecurrentState<float, double> wide_state(m, dv, opts);
    for (Index i = 0; i < n; ++i) {
      recurrent.row(i) = wide ? wide_state.step(q.row(i), k.row(i), v.row(i), map)
                              : narrow_state.step(q.row(i), k.row(i), v.row(i), map);
    }
    const Matrix<float> plain = linattn::causal_linear_attention(q, k, v, map, opts);
    WARN("FAVOR+ input norm " << norm << ": log weights in [" << l.minCoeff() << ", "
                              << l.maxCoeff() << "], error " << relative_error(parallel, ref)
                              << (wide ? " (double accumulator; plain float: " : " (plain float")
                              << (wide ? relative_error(plain, ref) : 0.0) << ")");
    if (norm == 100.0) REQUIRE(l.maxCoeff() < -100.0);  // plain float features underflow to 0
    CHECK(parallel.allFinite());
    CHECK(recurrent.allFinite());
    CHECK(plain.allFinite());
    CHECK(relative_error(parallel, ref) <= 1e-4);
    CHECK(relative_error(recurrent, ref) <= 1e-4);
  }
}

// ---------------------------------------------------------------------------------------------
// A caller's W (a trained model's projection)
// ---------------------------------------------------------------------------------------------

namespace {

/// performer-pytorch's softmax_kernel without its "+ eps", in double, step by step as it is
/// written there: data_normalizer = Dk^-0.25, ratio = m^-0.5, data_dash = (x data_normalizer)
/// W^T, diag = |x|^2 / 2 data_normalizer^2, phi = ratio exp(data_dash - diag - stab), where stab
/// is each row's max of data_dash for queries and the max over every row for keys. `stab`
/// returns the stabiliser each row was shifted by.
Matrix<double> performer_pytorch_features(const Matrix<double>& data,
                                          const Matrix<double>& projection_matrix, bool is_query,
                                          Vector<double>& stab) {
  const Index n = data.rows();
  const Index d = data.cols();
  const Index m = projection_matrix.rows();
  const double data_normalizer = std::pow(double(d), -0.25);
  const double ratio = std::pow(double(m), -0.5);
  Matrix<double> data_dash(n, m);
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < m; ++j) {
      double sum = 0.0;
      for (Index c = 0; c < d; ++c) sum += data_normalizer * data(i, c) * projection_matrix(j, c);
      data_dash(i, j) = sum;
    }
  }
  stab.resize(n);
  for (Index i = 0; i < n; ++i) {
    stab(i) = is_query ? data_dash.row(i).maxCoeff() : data_dash.maxCoeff();
  }
  Matrix<double> phi(n, m);
  for (Index i = 0; i < n; ++i) {
    double sq = 0.0;
    for (Index c = 0; c < d; ++c) sq += data(i, c) * data(i, c);
    const double diag = sq / 2.0 * data_normalizer * data_normalizer;
    for (Index j = 0; j < m; ++j) phi(i, j) = ratio * std::exp(data_dash(i, j) - diag - stab(i));
  }
  return phi;
}

/// performer-pytorch's linear attention from features: out_i = phi_q_i . sum_j phi_k_j v_j /
/// phi_q_i . sum_j phi_k_j over j <= i (causal) or all j; no eps in the denominator.
Matrix<double> feature_attention(const Matrix<double>& phi_q, const Matrix<double>& phi_k,
                                 const Matrix<double>& v, bool causal) {
  Matrix<double> out(phi_q.rows(), v.cols());
  for (Index i = 0; i < phi_q.rows(); ++i) {
    Eigen::RowVectorXd num = Eigen::RowVectorXd::Zero(v.cols());
    double den = 0.0;
    const Index last = causal ? i : phi_k.rows() - 1;
    for (Index j = 0; j <= last; ++j) {
      const double w = phi_q.row(i).dot(phi_k.row(j));
      num += w * v.row(j);
      den += w;
    }
    out.row(i) = num / den;
  }
  return out;
}

/// The message of the linattn::Error that f throws ("" if it throws none).
template <class F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const linattn::Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEMPLATE_TEST_CASE("PositiveRandomFeatures from a Performer's W gives performer-pytorch's features",
                   "[feature_maps][favor][given]", float, double) {
  using T = TestType;
  constexpr bool is_float = std::is_same_v<T, float>;
  // performer-pytorch's default nb_features for dim_head 16: int(16 ln 16) = 44 (not a multiple
  // of Dk). W is the projection_matrix buffer as a checkpoint holds it, in T.
  const Index dk = 16, m = 44, n = 40, dv = 5;
  const Matrix<T> w = gaussian<T>(m, dk, 801);
  Matrix<T> q = gaussian<T>(n, dk, 802, 0.5);
  Matrix<T> k = gaussian<T>(n, dk, 803, 0.5);
  // A few large rows, so the stabilisers are far from zero and differ between rows.
  q.row(3) *= T(6);
  k.row(7) *= T(6);
  const Matrix<T> v = gaussian<T>(n, dv, 804);

  const PositiveRandomFeatures map(dk, w);
  REQUIRE(map.projection().rows() == m);
  REQUIRE(map.projection().cols() == dk);
  CHECK(map.projection() == w.template cast<double>());  // exactly the given W
  CHECK_FALSE(map.seeded());
  CHECK(map.seed() == 0);
  CHECK(map.input_dim() == dk);
  CHECK(map.num_features() == m);
  CHECK(map.feature_dim(dk) == m);
  CHECK(map.temperature() == 0.25);  // 1/sqrt(16): u = x Dk^-1/4, performer's data_normalizer

  const Matrix<double> wd = w.template cast<double>();
  Vector<double> stab_q, stab_k;
  const Matrix<double> pt_q =
      performer_pytorch_features(q.template cast<double>(), wd, true, stab_q);
  const Matrix<double> pt_k =
      performer_pytorch_features(k.template cast<double>(), wd, false, stab_k);
  REQUIRE(stab_q.maxCoeff() - stab_q.minCoeff() > 5.0);
  REQUIRE(stab_k(0) > 5.0);

  // Ours = performer's times exp(stab), entry by entry (relative), in both directions.
  const Matrix<T> phi_q = map.queries(q);
  const Matrix<T> phi_k = map.keys(k);
  Vector<double> log_q, log_k;
  const Matrix<T> scaled_q = map.scaled_features(q, log_q);
  const Matrix<T> scaled_k = map.scaled_features(k, log_k);
  double err_q = 0.0, err_k = 0.0, err_scaled = 0.0;
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < m; ++j) {
      err_q =
          std::max(err_q, std::abs(double(phi_q(i, j)) * std::exp(-stab_q(i)) / pt_q(i, j) - 1));
      err_k =
          std::max(err_k, std::abs(double(phi_k(i, j)) * std::exp(-stab_k(i)) / pt_k(i, j) - 1));
      // log of (scaled entry) + log-scale - stabiliser = log of performer's entry.
      err_scaled = std::max(err_scaled, std::abs(std::log(double(scaled_q(i, j))) + log_q(i) -
                                                 stab_q(i) - std::log(pt_q(i, j))));
      err_scaled = std::max(err_scaled, std::abs(std::log(double(scaled_k(i, j))) + log_k(i) -
                                                 stab_k(i) - std::log(pt_k(i, j))));
    }
  }
  // Logits reach ~12 here: float rounds them to ~1e-6 absolute, i.e. relative in the features.
  const double feature_tol = is_float ? 1e-5 : 1e-13;
  WARN("given W vs performer-pytorch (" << (is_float ? "float" : "double")
                                        << "): features rel. error " << err_q << " (q), " << err_k
                                        << " (k), log of scaled features " << err_scaled);
  CHECK(err_q <= feature_tol);
  CHECK(err_k <= feature_tol);
  CHECK(err_scaled <= feature_tol);

  // The stabilisers cancel in normalised attention: with eps = 0 our outputs are performer's.
  linattn::Options opts;
  opts.eps = 0.0;
  const Matrix<double> ref = feature_attention(pt_q, pt_k, v.template cast<double>(), false);
  const Matrix<double> ref_causal = feature_attention(pt_q, pt_k, v.template cast<double>(), true);
  const Matrix<T> out = linattn::linear_attention(q, k, v, map, opts);
  const Matrix<T> out_causal = linattn::causal_linear_attention(q, k, v, map, opts);
  const double err = relative_error(out, ref);
  const double err_causal = relative_error(out_causal, ref_causal);
  WARN("given W vs performer-pytorch attention: " << err << " (non-causal), " << err_causal
                                                  << " (causal)");
  const double attention_tol = is_float ? 3e-6 : 1e-14;
  CHECK(err <= attention_tol);
  CHECK(err_causal <= attention_tol);
  // Not vacuous: the outputs vary across rows.
  CHECK(ref_causal.cwiseAbs().maxCoeff() > 0.3);
}

TEMPLATE_TEST_CASE("A map from a given W computes exactly what the seeded map with that W does",
                   "[feature_maps][given]", float, double) {
  using T = TestType;
  const Index dk = 12, m = 40, n = 30, dv = 4;
  struct Case {
    const char* name;
    RandomFeatureOptions options;
  };
  std::vector<Case> cases(4);
  cases[0].name = "default";
  cases[1].name = "hyperbolic";
  cases[1].options.hyperbolic = true;
  cases[2].name = "iid, temperature 0.4";
  cases[2].options.projection = Projection::iid;
  cases[2].options.temperature = 0.4;
  cases[3].name = "fixed row norm";
  cases[3].options.row_norm = RowNorm::fixed;
  // Ordinary rows, then rows of norm 40: logits past kFloatLogitLimit and exp past float's range,
  // so the stabiliser and the double path are exercised too.
  Matrix<T> x = gaussian<T>(n, dk, 811);
  x.bottomRows(10) *= T(40);
  const Matrix<T> v = gaussian<T>(n, dv, 812);
  const Matrix<T> grad = gaussian<T>(n, 2 * m, 813);
  for (const Case& c : cases) {
    INFO(c.name);
    const PositiveRandomFeatures seeded(dk, m, 7, c.options);
    const PositiveRandomFeatures given(seeded.projection(), c.options);
    const PositiveRandomFeatures given_checked(dk, seeded.projection(), c.options);
    CHECK(given.temperature() == seeded.temperature());
    CHECK(given.feature_dim(dk) == seeded.feature_dim(dk));
    CHECK(same_bits(given.projection(), seeded.projection()));
    CHECK(same_bits(given_checked.projection(), seeded.projection()));
    CHECK(given.queries(x) == seeded.queries(x));
    CHECK(given.keys(x) == seeded.keys(x));
    Vector<double> log_a, log_b;
    CHECK(given.scaled_features(x, log_a) == seeded.scaled_features(x, log_b));
    CHECK(log_a == log_b);
    const Index c_dim = seeded.feature_dim(dk);
    CHECK(given.backward(x, grad.leftCols(c_dim)) == seeded.backward(x, grad.leftCols(c_dim)));
    const Matrix<T> out = linattn::causal_linear_attention(x, x, v, given);
    CHECK(out.allFinite());
    CHECK(out == linattn::causal_linear_attention(x, x, v, seeded));
    CHECK(linattn::linear_attention(x, x, v, given) == linattn::linear_attention(x, x, v, seeded));
    linattn::RecurrentState<T> a(c_dim, dv), b(c_dim, dv);
    for (Index i = 0; i < n; ++i) {
      CHECK(a.step(x.row(i), x.row(i), v.row(i), given) ==
            b.step(x.row(i), x.row(i), v.row(i), seeded));
    }

    const RandomFourierFeatures fourier_seeded(dk, m, 9, c.options);
    const RandomFourierFeatures fourier_given(dk, fourier_seeded.projection(), c.options);
    CHECK(fourier_given.temperature() == fourier_seeded.temperature());
    CHECK(fourier_given.queries(x) == fourier_seeded.queries(x));
    CHECK(fourier_given.keys(x) == fourier_seeded.keys(x));
    CHECK(fourier_given.backward(x, grad) == fourier_seeded.backward(x, grad));
  }
}

TEST_CASE("A given W is taken from any Eigen expression of float, double or 16-bit entries",
          "[feature_maps][given]") {
  const Index dk = 8, m = 20;
  const Matrix<double> w = gaussian<double>(m, dk, 821);
  const Matrix<float> wf = w.cast<float>();
  // A row-major float buffer, as a checkpoint loader hands it over.
  std::vector<float> buffer(wf.data(), wf.data() + wf.size());
  const Eigen::Map<const Matrix<float>> mapped(buffer.data(), m, dk);
  const Eigen::MatrixXd col_major = w;
  Matrix<double> wide = gaussian<double>(m + 3, dk + 5, 822);
  wide.block(2, 3, m, dk) = w;
  const Matrix<Eigen::bfloat16> wb = w.cast<Eigen::bfloat16>();

  CHECK(PositiveRandomFeatures(mapped).projection() == wf.cast<double>());
  CHECK(PositiveRandomFeatures(dk, wf).projection() == wf.cast<double>());
  CHECK(same_bits(PositiveRandomFeatures(col_major).projection(), w));
  CHECK(same_bits(PositiveRandomFeatures(dk, wide.block(2, 3, m, dk)).projection(), w));
  CHECK(same_bits(RandomFourierFeatures(w.transpose().transpose()).projection(), w));
  CHECK(same_bits(RandomFourierFeatures(dk, 2.0 * w).projection(), Matrix<double>(2.0 * w)));
  const Matrix<double> from_bf16 = wb.cast<float>().cast<double>();
  CHECK(same_bits(PositiveRandomFeatures(wb).projection(), from_bf16));
  CHECK(same_bits(RandomFourierFeatures(dk, wb).projection(), from_bf16));
  // Dk comes from W: the default temperature is 1/sqrt(Dk), and other widths are refused.
  const PositiveRandomFeatures map(wf);
  CHECK(map.temperature() == Approx(1.0 / std::sqrt(8.0)).epsilon(1e-15));
  CHECK(map.feature_dim(dk) == m);
  REQUIRE_THROWS_AS(map.feature_dim(dk + 1), linattn::Error);
  REQUIRE_THROWS_AS(map.queries(gaussian<double>(2, dk + 1, 823)), linattn::Error);
}

TEMPLATE_TEST_CASE("RandomFourierFeatures from a given W are [sin(W u), cos(W u)] / sqrt(m)",
                   "[feature_maps][fourier][given]", float, double) {
  using T = TestType;
  constexpr bool is_float = std::is_same_v<T, float>;
  const Index dk = 10, m = 24;
  const Matrix<T> w = gaussian<T>(m, dk, 831);
  RandomFeatureOptions options;
  options.temperature = 0.3;
  const RandomFourierFeatures map(dk, w, options);
  CHECK(map.projection() == w.template cast<double>());
  CHECK(map.feature_dim(dk) == 2 * m);
  CHECK(map.temperature() == 0.3);
  CHECK(RandomFourierFeatures(w).temperature() == Approx(1.0 / std::sqrt(10.0)).epsilon(1e-15));
  const Matrix<T> x = gaussian<T>(50, dk, 832, 3.0);
  const Matrix<T> phi = map.queries(x);
  REQUIRE(phi.rows() == x.rows());
  REQUIRE(phi.cols() == 2 * m);
  CHECK(map.keys(x) == phi);
  // Naive: u = sqrt(tau) x, t_f = w_f . u, [sin(t), cos(t)] / sqrt(m), in double.
  const double inv = 1.0 / std::sqrt(double(m));
  double err = 0.0;
  double largest_t = 0.0;
  for (Index r = 0; r < x.rows(); ++r) {
    for (Index f = 0; f < m; ++f) {
      double t = 0.0;
      for (Index c = 0; c < dk; ++c) t += double(w(f, c)) * std::sqrt(0.3) * double(x(r, c));
      largest_t = std::max(largest_t, std::abs(t));
      err = std::max(err, std::abs(double(phi(r, f)) - std::sin(t) * inv));
      err = std::max(err, std::abs(double(phi(r, m + f)) - std::cos(t) * inv));
    }
  }
  WARN("Fourier features from a given W (" << (is_float ? "float" : "double") << "): max error "
                                           << err << " (" << err / inv
                                           << " of 1/sqrt(m)), |W u| up to " << largest_t);
  REQUIRE(largest_t > 10.0);
  // |W u| reaches ~20: a float argument is rounded by ~1e-6, and so is its sin and cos.
  CHECK(err <= (is_float ? 1e-5 : 1e-13) * inv);
}

TEST_CASE("A given W is redrawn as a seeded W of the same shape and options",
          "[feature_maps][given]") {
  const Index dk = 8, m = 20;
  RandomFeatureOptions options;
  options.hyperbolic = true;
  options.temperature = 0.5;
  options.projection = Projection::iid;
  const Matrix<double> w = gaussian<double>(m, dk, 841);
  PositiveRandomFeatures map(w, options);
  map.redraw(5);
  const PositiveRandomFeatures drawn(dk, m, 5, options);
  CHECK(map.seeded());
  CHECK(map.seed() == 5);
  CHECK(same_bits(map.projection(), drawn.projection()));
  CHECK(map.temperature() == 0.5);
  const Matrix<double> x = gaussian<double>(4, dk, 842);
  CHECK(map.queries(x) == drawn.queries(x));
  CHECK(map.feature_dim(dk) == 2 * m);

  RandomFourierFeatures fourier(w.cast<float>());
  CHECK_FALSE(fourier.seeded());
  fourier.redraw(6);
  CHECK(fourier.seeded());
  CHECK(same_bits(fourier.projection(), RandomFourierFeatures(dk, m, 6).projection()));
}

namespace {

/// Every way a given W is refused, for one map type and one W scalar type; each message names
/// the map, "projection" and the shape or the bad entry, and nothing changes on a throw.
template <class Map, class T>
void check_bad_projections(const std::string& name) {
  INFO(name << " with a " << (std::is_same_v<T, float> ? "float" : "double") << " W");
  const Index dk = 8, m = 16;
  const Matrix<T> good = gaussian<T>(m, dk, 851);

  // Wrong width.
  const Matrix<T> wide = gaussian<T>(m, dk + 1, 852);
  std::string what = error_message([&] { (void)Map(dk, wide); });
  CAPTURE(what);
  CHECK(contains(what, "linattn: " + name + ": projection is 16 x 9 but input_dim is 8"));
  what = error_message([&] { (void)Map(dk, good.leftCols(dk - 1)); });
  CHECK(contains(what, name + ": projection is 16 x 7 but input_dim is 8"));
  what = error_message([&] { (void)Map(dk, good.transpose()); });
  CHECK(contains(what, name + ": projection is 8 x 16 but input_dim is 8"));

  // NaN and +-Inf, named by row and column.
  Matrix<T> bad = good;
  bad(2, 3) = std::numeric_limits<T>::quiet_NaN();
  what = error_message([&] { (void)Map(bad); });
  CHECK(contains(what, name + ": projection has a non-finite value (nan) at row 2, column 3"));
  what = error_message([&] { (void)Map(dk, bad); });
  CHECK(contains(what, "(nan) at row 2, column 3"));
  bad = good;
  bad(15, 0) = std::numeric_limits<T>::infinity();
  what = error_message([&] { (void)Map(bad); });
  CHECK(contains(what, name + ": projection has a non-finite value (inf) at row 15, column 0"));
  bad(15, 0) = -std::numeric_limits<T>::infinity();
  what = error_message([&] { (void)Map(dk, bad); });
  CHECK(contains(what, "(-inf) at row 15, column 0"));

  // Empty, either way, with or without input_dim.
  what = error_message([&] { (void)Map(Matrix<T>(0, dk)); });
  CHECK(contains(what, name + ": projection is empty (0 x 8)"));
  what = error_message([&] { (void)Map(Matrix<T>(m, 0)); });
  CHECK(contains(what, name + ": projection is empty (16 x 0)"));
  what = error_message([&] { (void)Map(dk, Matrix<T>(0, dk)); });
  CHECK(contains(what, name + ": projection is empty (0 x 8)"));

  // The options are checked as for a seeded map.
  RandomFeatureOptions zero;
  zero.temperature = 0.0;
  what = error_message([&] { (void)Map(good, zero); });
  CHECK(contains(what, name + ": temperature must be positive and finite"));

  // Nothing changes on a throw: a map assigned from a failed construction keeps its W and
  // features, and the caller's matrix is untouched.
  Map map(good);
  const Matrix<double> before = map.projection();
  const Matrix<double> x = gaussian<double>(3, dk, 853);
  const Matrix<double> features = map.queries(x);
  bad = good;
  bad(2, 3) = std::numeric_limits<T>::quiet_NaN();
  const Matrix<T> bad_copy = bad;
  REQUIRE_THROWS_AS(map = Map(bad), linattn::Error);
  REQUIRE_THROWS_AS(map = Map(dk, wide), linattn::Error);
  REQUIRE_THROWS_AS(map = Map(Matrix<T>(0, dk)), linattn::Error);
  CHECK(same_bits(map.projection(), before));
  CHECK(map.queries(x) == features);
  CHECK_FALSE(map.seeded());
  CHECK(std::memcmp(bad.data(), bad_copy.data(), sizeof(T) * std::size_t(bad.size())) == 0);
}

}  // namespace

TEST_CASE("A bad given W is refused with linattn::Error naming the argument and shape",
          "[feature_maps][given][errors]") {
  check_bad_projections<PositiveRandomFeatures, float>("PositiveRandomFeatures");
  check_bad_projections<PositiveRandomFeatures, double>("PositiveRandomFeatures");
  check_bad_projections<RandomFourierFeatures, float>("RandomFourierFeatures");
  check_bad_projections<RandomFourierFeatures, double>("RandomFourierFeatures");
}

// ---------------------------------------------------------------------------------------------
// The _into forms
// ---------------------------------------------------------------------------------------------

namespace {

/// Bit-for-bit equality of two matrices of the same scalar type (so -0 differs from +0).
template <class DA, class DB>
bool same_entries(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b) {
  static_assert(std::is_same_v<typename DA::Scalar, typename DB::Scalar>);
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  for (Index r = 0; r < a.rows(); ++r) {
    for (Index c = 0; c < a.cols(); ++c) {
      const typename DA::Scalar x = a(r, c);
      const typename DB::Scalar y = b(r, c);
      if (std::memcmp(&x, &y, sizeof x) != 0) return false;
    }
  }
  return true;
}

/// The maps with _into forms, each with its name, for inputs of width dk.
struct IntoMaps {
  linattn::EluPlusOne elu;
  linattn::Relu relu;
  PositiveRandomFeatures prf;
  PositiveRandomFeatures hyperbolic;
  RandomFourierFeatures fourier;

  IntoMaps(Index dk, Index m)
      : prf(dk, m, 61), hyperbolic(dk, m, 62, hyperbolic_options()), fourier(dk, m, 63) {}

  static RandomFeatureOptions hyperbolic_options() {
    RandomFeatureOptions options;
    options.hyperbolic = true;
    return options;
  }

  /// Calls f(name, map) for every map.
  template <class F>
  void each(const F& f) const {
    f("EluPlusOne", elu);
    f("Relu", relu);
    f("PositiveRandomFeatures", prf);
    f("PositiveRandomFeatures (hyperbolic)", hyperbolic);
    f("RandomFourierFeatures", fourier);
  }
};

template <class Map>
constexpr bool is_prf = std::is_same_v<Map, PositiveRandomFeatures>;

/// The _into forms of `map` on x equal its allocating forms bit for bit: into a plain matrix,
/// into a block of a wider buffer (every row unaligned; the rest of the buffer untouched),
/// through the kernels' dispatch helpers, and, row by row, as a recurrent step asks for them.
/// A matrix of any of the input types in double.
template <class T>
Matrix<double> in_double(const Matrix<T>& m) {
  if constexpr (linattn::detail::is_half_scalar<T>) {
    return m.template cast<float>().template cast<double>();
  } else {
    return m.template cast<double>();
  }
}

template <class Map, class T>
void check_into_equals_allocating(const Map& map, const Matrix<T>& x, bool row_by_row = true) {
  const Index n = x.rows();
  const Index c = map.feature_dim(x.cols());
  const Matrix<T> q = map.queries(x);
  const Matrix<T> k = map.keys(x);
  Matrix<T> out(n, c);
  map.queries_into(x, out);
  CHECK(same_entries(out, q));
  map.keys_into(x, out);
  CHECK(same_entries(out, k));

  const T fill = T(7);
  Matrix<T> buffer = Matrix<T>::Constant(n + 2, c + 3, fill);
  map.queries_into(x, buffer.block(1, 1, n, c));
  CHECK(same_entries(buffer.block(1, 1, n, c), q));
  map.keys_into(x, buffer.block(1, 1, n, c));
  CHECK(same_entries(buffer.block(1, 1, n, c), k));
  buffer.block(1, 1, n, c).setConstant(fill);
  CHECK((buffer.array() == fill).all());  // nothing was written outside the block

  out.setZero();
  linattn::detail::map_queries_into(map, x, out);
  CHECK(same_entries(out, q));
  out.setZero();
  linattn::detail::map_keys_into(map, x, out);
  CHECK(same_entries(out, k));

  if constexpr (is_prf<Map>) {
    Vector<double> log_scale;
    const Matrix<T> scaled = map.scaled_features(x, log_scale);
    Vector<double> log_into = Vector<double>::Constant(n, 99.0);
    map.scaled_features_into(x, buffer.block(1, 1, n, c), log_into);
    CHECK(same_entries(buffer.block(1, 1, n, c), scaled));
    CHECK(same_entries(log_into, log_scale));
    out.setZero();
    log_into.setZero();
    linattn::detail::map_scaled_features_into(map, x, out, log_into);
    CHECK(same_entries(out, scaled));
    CHECK(same_entries(log_into, log_scale));
  }

  // One row at a time (a 1 x Dk input, as RecurrentState::step_into passes). The exact maps
  // give the same bits; the random maps' logits come from a vector product instead of a matrix
  // product, which may round differently (FAVOR+ is compared on its scaled features).
  if (!row_by_row) return;
  Matrix<T> rows(n, c);
  Matrix<T> one(1, c);
  Vector<double> one_log(1);
  for (Index i = 0; i < n; ++i) {
    if constexpr (is_prf<Map>) {
      map.scaled_features_into(x.row(i), one, one_log);
      rows.row(i) = one;
    } else {
      map.queries_into(x.row(i), one);
      rows.row(i) = one;
    }
  }
  if constexpr (std::is_same_v<Map, linattn::EluPlusOne> || std::is_same_v<Map, linattn::Relu>) {
    CHECK(same_entries(rows, q));
  } else {
    Matrix<T> whole = q;
    if constexpr (is_prf<Map>) {
      Vector<double> log_scale;
      whole = map.scaled_features(x, log_scale);
    }
    const double err = relative_error(in_double(rows), in_double(whole));
    const double tol = std::is_same_v<T, double>        ? 1e-13
                       : std::is_same_v<T, float>       ? 1e-5
                       : std::is_same_v<T, Eigen::half> ? 4e-3
                                                        : 2e-2;
    CAPTURE(err);
    CHECK(err <= tol);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("The _into forms equal the allocating forms bit for bit", "[feature_maps][into]",
                   float, double) {
  using T = TestType;
  struct Shape {
    Index n, dk, m;
  };
  // One token, a few, a chunk (matrix products), tiny sizes (Eigen's coefficient-wise
  // product); odd widths leave partial blocks.
  for (const Shape shape :
       {Shape{1, 13, 37}, Shape{7, 13, 37}, Shape{130, 16, 64}, Shape{3, 4, 5}, Shape{2, 1, 1}}) {
    const IntoMaps maps(shape.dk, shape.m);
    Matrix<T> x = gaussian<T>(shape.n, shape.dk, 901 + std::uint64_t(shape.n), 1.5);
    x(0, 0) = -T(0);  // elu(-0) + 1 and relu(-0) keep their exact bits through both forms
    maps.each([&](const char* name, const auto& map) {
      INFO(name << ", N = " << shape.n << ", Dk = " << shape.dk << ", m = " << shape.m);
      check_into_equals_allocating(map, x);
    });
  }
  // Float rows past kFloatLogitLimit (recomputed in double), mixed with ordinary rows; and any
  // Eigen expression as x.
  {
    const Index dk = 16, m = 40;
    const IntoMaps maps(dk, m);
    Matrix<T> x = gaussian<T>(9, dk, 911);
    x.row(2) *= T(40);
    x.row(5) *= T(25);
    const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> col_major = x;
    maps.each([&](const char* name, const auto& map) {
      INFO(name << ", rows of norm 100 and 160");
      check_into_equals_allocating(map, x, false);
      const Index c = map.feature_dim(dk);
      Matrix<T> out(x.rows(), c);
      map.queries_into(col_major, out);
      CHECK(same_entries(out, map.queries(col_major)));
      map.keys_into(x * T(0.5), out);
      CHECK(same_entries(out, map.keys(Matrix<T>(x * T(0.5)))));
      Matrix<T> wide = gaussian<T>(x.rows() + 1, dk + 2, 912);
      wide.block(1, 2, x.rows(), dk) = x;
      map.queries_into(wide.block(1, 2, x.rows(), dk), out);
      CHECK(same_entries(out, map.queries(x)));
    });
    // The tall rows do go through double.
    const double top = (maps.prf.projection() * x.row(2).transpose().template cast<double>())
                           .cwiseAbs()
                           .maxCoeff() *
                       std::sqrt(maps.prf.temperature());
    CAPTURE(top);
    REQUIRE(top > 2.0 * PositiveRandomFeatures::kFloatLogitLimit);
  }
}

TEST_CASE("The _into forms take 16-bit inputs and equal the allocating forms bit for bit",
          "[feature_maps][into][half]") {
  using H = Eigen::half;
  const IntoMaps maps(12, 20);
  const Matrix<H> x = gaussian<float>(5, 12, 921, 1.5).cast<H>();
  maps.each([&](const char* name, const auto& map) {
    INFO(name);
    check_into_equals_allocating(map, x);
  });
  const Matrix<Eigen::bfloat16> b = gaussian<float>(4, 12, 922).cast<Eigen::bfloat16>();
  check_into_equals_allocating(maps.elu, b);
  check_into_equals_allocating(maps.prf, b);
}

TEMPLATE_TEST_CASE("The _into forms allocate nothing for a single row", "[feature_maps][into]",
                   float, double) {
  using T = TestType;
  const Index dk = 16, m = 40;
  const IntoMaps maps(dk, m);
  const Matrix<T> xs = gaussian<T>(6, dk, 931);
  const Matrix<T> x = xs.row(0);                              // a 1 x Dk matrix
  std::vector<T> buffer(xs.data() + dk, xs.data() + 2 * dk);  // a caller's buffer
  const Eigen::Map<const Matrix<T>> mapped(buffer.data(), 1, dk);
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> col_major = xs;
  Matrix<T> out(1, 2 * m), expected(1, 2 * m);
  Vector<double> log_scale(1);
  maps.each([&](const char* name, const auto& map) {
    INFO(name);
    using MapType = std::decay_t<decltype(map)>;
    const Index c = map.feature_dim(dk);
    auto dst = out.leftCols(c);
    const auto run = [&](const auto& input) {
      Eigen::internal::set_is_malloc_allowed(false);
      map.queries_into(input, dst);
      Eigen::internal::set_is_malloc_allowed(true);
      expected.leftCols(c) = map.queries(input);
      CHECK(same_entries(dst, expected.leftCols(c)));
      Eigen::internal::set_is_malloc_allowed(false);
      map.keys_into(input, dst);
      Eigen::internal::set_is_malloc_allowed(true);
      expected.leftCols(c) = map.keys(input);
      CHECK(same_entries(dst, expected.leftCols(c)));
      if constexpr (is_prf<MapType>) {
        Eigen::internal::set_is_malloc_allowed(false);
        map.scaled_features_into(input, dst, log_scale);
        Eigen::internal::set_is_malloc_allowed(true);
        Vector<double> log_expected;
        expected.leftCols(c) = map.scaled_features(input, log_expected);
        CHECK(same_entries(dst, expected.leftCols(c)));
        CHECK(log_scale(0) == log_expected(0));
      }
    };
    run(x);
    run(mapped);
    run(xs.row(3));
    run(col_major.row(4));
    // The dispatch helpers RecurrentState::step_into calls.
    Eigen::internal::set_is_malloc_allowed(false);
    linattn::detail::map_queries_into(map, x, dst);
    linattn::detail::map_keys_into(map, x, dst);
    if constexpr (is_prf<MapType>) {
      linattn::detail::map_scaled_features_into(map, x, dst, log_scale);
    }
    Eigen::internal::set_is_malloc_allowed(true);
    CHECK(dst.allFinite());
  });
  // Not vacuous: the largest logit of these rows is well inside the float range limit.
  CHECK((maps.prf.projection() * xs.transpose().template cast<double>()).cwiseAbs().maxCoeff() *
            std::sqrt(maps.prf.temperature()) <
        PositiveRandomFeatures::kFloatLogitLimit);
}

TEST_CASE("The _into forms reject bad shapes with linattn::Error and leave out unchanged",
          "[feature_maps][into][errors]") {
  const Index dk = 8, m = 12;
  const IntoMaps maps(dk, m);
  const Matrix<double> x = gaussian<double>(3, dk, 941);
  const Matrix<double> wide = gaussian<double>(3, dk + 1, 942);

  Matrix<double> out = Matrix<double>::Constant(3, dk - 1, 5.0);
  std::string what = error_message([&] { maps.elu.queries_into(x, out); });
  CHECK(contains(what, "EluPlusOne::queries_into: out is 3 x 7 but must be 3 x 8"));
  what = error_message([&] { maps.relu.keys_into(x, out); });
  CHECK(contains(what, "Relu::keys_into: out is 3 x 7 but must be 3 x 8"));
  CHECK((out.array() == 5.0).all());

  // x of the wrong width, out of the wrong shape (the hyperbolic map needs 2m columns), and
  // log_scale of the wrong size.
  Matrix<double> out_m = Matrix<double>::Constant(3, m, 5.0);
  Matrix<double> out_short = Matrix<double>::Constant(2, m, 5.0);
  Matrix<double> out_2m = Matrix<double>::Constant(3, 2 * m, 5.0);
  Vector<double> log_scale = Vector<double>::Constant(3, 5.0);
  Vector<double> log_short = Vector<double>::Constant(2, 5.0);
  what = error_message([&] { maps.prf.queries_into(wide, out_m); });
  CHECK(contains(what,
                 "PositiveRandomFeatures::queries_into: x is 3 x 9 but the map was built "
                 "for 8 input columns"));
  what = error_message([&] { maps.prf.keys_into(x, out_short); });
  CHECK(contains(what, "PositiveRandomFeatures::keys_into: out is 2 x 12 but must be 3 x 12"));
  what = error_message([&] { maps.hyperbolic.queries_into(x, out_m); });
  CHECK(contains(what, "out is 3 x 12 but must be 3 x 24"));
  what = error_message([&] { maps.prf.scaled_features_into(x, out_m, log_short); });
  CHECK(contains(what,
                 "PositiveRandomFeatures::scaled_features_into: log_scale has 2 entries "
                 "but x has 3 rows"));
  what = error_message([&] { maps.prf.scaled_features_into(wide, out_m, log_scale); });
  CHECK(contains(what, "x is 3 x 9"));
  what = error_message([&] { maps.prf.scaled_features_into(x, out_2m, log_scale); });
  CHECK(contains(what, "out is 3 x 24 but must be 3 x 12"));
  what = error_message([&] { maps.fourier.queries_into(x, out_m); });
  CHECK(contains(what, "RandomFourierFeatures::queries_into: out is 3 x 12 but must be 3 x 24"));
  what = error_message([&] { maps.fourier.keys_into(wide, out_2m); });
  CHECK(contains(what, "RandomFourierFeatures::keys_into: x is 3 x 9"));
  CHECK((out_m.array() == 5.0).all());
  CHECK((out_short.array() == 5.0).all());
  CHECK((out_2m.array() == 5.0).all());
  CHECK((log_scale.array() == 5.0).all());
  CHECK((log_short.array() == 5.0).all());
}

}  // namespace linattn_test_feature_maps
