// The chunked causal and the non-causal routines against the naive O(N^2) formula.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <linattn/feature_maps.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/recurrent_state.hpp>
#include <string>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_linear_attention {

using linattn::Matrix;
using linattn_test::gaussian;
using linattn_test::naive_linear_attention;
using linattn_test::recurrent_linear_attention;

/// Longest sequence the tests check against the O(N^2) formula itself.
constexpr Eigen::Index kQuadraticMaxRows = 512;
using linattn_test::relative_error;

namespace {

constexpr Eigen::Index kDk = 12;  // Dk != Dv on purpose
constexpr Eigen::Index kDv = 7;

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

/// Inputs for a map: Fourier features get small inputs so the Gaussian kernel stays near 1
/// and denominators stay away from zero (the comparison is then well conditioned).
template <class T>
struct Inputs {
  Matrix<T> q, k, v;
  Inputs(Eigen::Index n, std::uint64_t seed, double stddev)
      : q(gaussian<T>(n, kDk, seed, stddev)),
        k(gaussian<T>(n, kDk, seed + 1, stddev)),
        v(gaussian<T>(n, kDv, seed + 2)) {}
};

/// Compares both entry points (featurized and with the map) against the naive formula for
/// every N, chunk, decay and normalize setting; returns the worst relative error.
template <class T, class Map>
double worst_error_against_reference(const Map& map, double stddev, bool causal,
                                     const std::vector<Eigen::Index>& sizes,
                                     const std::vector<double>& decays = {1.0, 0.93}) {
  double worst = 0.0;
  for (const Eigen::Index n : sizes) {
    const Inputs<T> in(n, 1000 + static_cast<std::uint64_t>(n), stddev);
    // The reference sees the same (rounded) inputs, featurized in double.
    const Matrix<double> qd = in.q.template cast<double>();
    const Matrix<double> kd = in.k.template cast<double>();
    const Matrix<double> vd = in.v.template cast<double>();
    const Matrix<double> phi_q_ref = map.queries(qd);
    const Matrix<double> phi_k_ref = map.keys(kd);
    const Matrix<T> phi_q = map.queries(in.q);
    const Matrix<T> phi_k = map.keys(in.k);
    for (const double decay : decays) {
      if (!causal && decay != 1.0) continue;  // non-causal ignores the decay
      for (const bool normalize : {true, false}) {
        // The quadratic formula up to N = 512, the recurrence beyond (both in double); where
        // both run they must agree, so the faster one is checked against the definition.
        const Matrix<double> expected =
            n <= kQuadraticMaxRows
                ? naive_linear_attention(phi_q_ref, phi_k_ref, vd, causal, decay, 1e-6, normalize)
                : recurrent_linear_attention(phi_q_ref, phi_k_ref, vd, causal, decay, 1e-6,
                                             normalize);
        if (n <= kQuadraticMaxRows) {
          const Matrix<double> recurrent =
              recurrent_linear_attention(phi_q_ref, phi_k_ref, vd, causal, decay, 1e-6, normalize);
          INFO("the two references, N = " << n << ", decay " << decay);
          CHECK(relative_error(recurrent, expected) <= 1e-12);
        }
        for (const Eigen::Index chunk : {16, 64, 128}) {
          linattn::Options options;
          options.decay = decay;
          options.normalize = normalize;
          options.chunk = chunk;
          const Matrix<T> featurized =
              causal ? linattn::causal_linear_attention(phi_q, phi_k, in.v, linattn::Identity{},
                                                        options)
                     : linattn::linear_attention(phi_q, phi_k, in.v, linattn::Identity{}, options);
          const Matrix<T> mapped =
              causal ? linattn::causal_linear_attention(in.q, in.k, in.v, map, options)
                     : linattn::linear_attention(in.q, in.k, in.v, map, options);
          const double e1 = relative_error(featurized, expected);
          const double e2 = relative_error(mapped, expected);
          INFO("N = " << n << ", decay = " << decay << ", normalize = " << normalize
                      << ", chunk = " << chunk);
          CHECK(e1 <= tolerance<T>());
          CHECK(e2 <= tolerance<T>());
          worst = std::max({worst, e1, e2});
        }
      }
    }
  }
  return worst;
}

const std::vector<Eigen::Index> kCausalSizes = {1, 2, 63, 64, 65, 500, 1000, 4096};
const std::vector<Eigen::Index> kNonCausalSizes = {1, 2, 63, 65, 500};

}  // namespace

TEMPLATE_TEST_CASE("causal: chunked form matches the naive formula for every feature map",
                   "[linear_attention]", float, double) {
  using T = TestType;
  SECTION("EluPlusOne") {
    const double worst =
        worst_error_against_reference<T>(linattn::EluPlusOne{}, 1.0, true, kCausalSizes);
    WARN("EluPlusOne worst relative error " << worst);
  }
  SECTION("Relu") {
    const double worst = worst_error_against_reference<T>(linattn::Relu{}, 1.0, true, kCausalSizes);
    WARN("Relu worst relative error " << worst);
  }
  SECTION("PositiveRandomFeatures") {
    const linattn::PositiveRandomFeatures map(kDk, 24, 7);
    const double worst = worst_error_against_reference<T>(map, 1.0, true, kCausalSizes);
    WARN("PositiveRandomFeatures worst relative error " << worst);
  }
  SECTION("PositiveRandomFeatures, hyperbolic") {
    linattn::RandomFeatureOptions settings;
    settings.hyperbolic = true;
    const linattn::PositiveRandomFeatures map(kDk, 12, 8, settings);
    const double worst = worst_error_against_reference<T>(map, 1.0, true, {1, 63, 65, 500, 1000});
    WARN("hyperbolic PositiveRandomFeatures worst relative error " << worst);
  }
  SECTION("RandomFourierFeatures") {
    const linattn::RandomFourierFeatures map(kDk, 10, 9);
    const double worst = worst_error_against_reference<T>(map, 0.3, true, kCausalSizes);
    WARN("RandomFourierFeatures worst relative error " << worst);
  }
}

TEMPLATE_TEST_CASE("causal: strong decays take the masked-product path and still match",
                   "[linear_attention]", float, double) {
  // Decays this strong spread a chunk's weights past what the streamed path keeps in range
  // (g^-64 overflows its budget), so the chunk falls back to the masked Q K^T product.
  using T = TestType;
  const std::vector<double> decays = {0.3, 1e-3, 1e-30};
  const std::vector<Eigen::Index> sizes = {65, 300};
  double worst = 0.0;
  worst = std::max(
      worst, worst_error_against_reference<T>(linattn::EluPlusOne{}, 1.0, true, sizes, decays));
  worst =
      std::max(worst, worst_error_against_reference<T>(linattn::PositiveRandomFeatures(kDk, 24, 3),
                                                       1.0, true, sizes, decays));
  WARN("strong decay worst relative error " << worst);
  CHECK(worst <= tolerance<T>());
}

TEMPLATE_TEST_CASE("non-causal: matches the naive formula for every feature map",
                   "[linear_attention]", float, double) {
  using T = TestType;
  double worst = 0.0;
  worst = std::max(
      worst, worst_error_against_reference<T>(linattn::EluPlusOne{}, 1.0, false, kNonCausalSizes));
  worst = std::max(worst,
                   worst_error_against_reference<T>(linattn::Relu{}, 1.0, false, kNonCausalSizes));
  worst =
      std::max(worst, worst_error_against_reference<T>(linattn::PositiveRandomFeatures(kDk, 24, 3),
                                                       1.0, false, kNonCausalSizes));
  worst =
      std::max(worst, worst_error_against_reference<T>(linattn::RandomFourierFeatures(kDk, 10, 4),
                                                       0.3, false, kNonCausalSizes));
  WARN("non-causal worst relative error " << worst);
  CHECK(worst <= tolerance<T>());
}

TEMPLATE_TEST_CASE("inputs may be any Eigen expression and out any row-major block",
                   "[linear_attention]", float, double) {
  using T = TestType;
  using ColMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic>;
  const Eigen::Index n = 150;
  const Matrix<T> q = gaussian<T>(n, kDk, 11);
  const Matrix<T> k = gaussian<T>(n, kDk, 12);
  const Matrix<T> v = gaussian<T>(n, kDv, 13);
  linattn::Options options;
  options.decay = 0.97;
  options.chunk = 32;
  const linattn::EluPlusOne map;
  const Matrix<T> expected = linattn::causal_linear_attention(q, k, v, map, options);

  const ColMajor q_cm = q, k_cm = k, v_cm = v;
  CHECK(relative_error(linattn::causal_linear_attention(q_cm, k_cm, v_cm, map, options),
                       expected) <= tolerance<T>());

  // Eigen::Map over a caller's buffer, and blocks of bigger matrices.
  std::vector<T> buffer(static_cast<std::size_t>(n * kDk));
  Eigen::Map<Matrix<T>>(buffer.data(), n, kDk) = q;
  const Eigen::Map<const Matrix<T>> q_map(buffer.data(), n, kDk);
  Matrix<T> wide = Matrix<T>::Zero(n + 4, kDk + 3);
  wide.block(2, 1, n, kDk) = k;
  Matrix<T> big_out = Matrix<T>::Constant(n + 2, kDv + 5, T(-7));
  linattn::causal_linear_attention_into(q_map, wide.block(2, 1, n, kDk), v, map,
                                        big_out.block(1, 2, n, kDv), options);
  CHECK(relative_error(big_out.block(1, 2, n, kDv), expected) <= tolerance<T>());
  // Nothing outside the block was touched.
  CHECK((big_out.row(0).array() == T(-7)).all());
  CHECK((big_out.row(n + 1).array() == T(-7)).all());
  CHECK((big_out.leftCols(2).array() == T(-7)).all());
  CHECK((big_out.rightCols(3).array() == T(-7)).all());

  // Featurized inputs as expressions.
  const Matrix<T> phi_k = map.keys(k);
  const Matrix<T> from_expr = linattn::causal_linear_attention(
      map.queries(q), phi_k.array().matrix(), v.leftCols(kDv), linattn::Identity{}, options);
  CHECK(relative_error(from_expr, expected) <= tolerance<T>());
}

TEMPLATE_TEST_CASE("the chunk size changes nothing but rounding", "[linear_attention]", float,
                   double) {
  using T = TestType;
  const Eigen::Index n = 777;
  const Matrix<T> q = gaussian<T>(n, kDk, 21), k = gaussian<T>(n, kDk, 22);
  const Matrix<T> v = gaussian<T>(n, kDv, 23);
  const linattn::PositiveRandomFeatures map(kDk, 32, 5);
  linattn::Options options;
  options.decay = 0.99;
  options.chunk = 1;
  const Matrix<T> one = linattn::causal_linear_attention(q, k, v, map, options);
  for (const Eigen::Index chunk : {3, 50, 256, 776, 777, 5000}) {
    options.chunk = chunk;
    INFO("chunk = " << chunk);
    CHECK(relative_error(linattn::causal_linear_attention(q, k, v, map, options), one) <=
          tolerance<T>());
  }
}

TEST_CASE("a million tokens run in memory linear in N (no N x N buffer)", "[linear_attention]") {
  const Eigen::Index n = 1 << 20;
  const Matrix<float> q = gaussian<float>(n, 4, 31), k = gaussian<float>(n, 4, 32);
  const Matrix<float> v = gaussian<float>(n, 2, 33);
  const linattn::EluPlusOne map;
  const Matrix<float> out = linattn::causal_linear_attention(q, k, v, map);
  REQUIRE(out.allFinite());
  // The last row is a weighted mean of all values: check it against a direct double sum.
  const Matrix<double> phi_q = map.queries(q.bottomRows(1).cast<double>());
  const Matrix<double> phi_k = map.keys(k.cast<double>());
  const Eigen::VectorXd w = phi_k * phi_q.transpose();
  const Eigen::RowVectorXd expected = (w.transpose() * v.cast<double>()) / (w.sum() + 1e-6);
  CHECK(relative_error(out.bottomRows(1), expected) <= 1e-4);
}

TEMPLATE_TEST_CASE("bad input throws linattn::Error naming the argument and leaves out alone",
                   "[linear_attention][errors]", float) {
  using T = TestType;
  using Catch::Matchers::Contains;
  const Matrix<T> q = gaussian<T>(10, 4, 41), k = gaussian<T>(10, 4, 42);
  const Matrix<T> v = gaussian<T>(10, 3, 43);
  Matrix<T> out = Matrix<T>::Constant(10, 3, T(5));
  const Matrix<T> untouched = out;
  const linattn::EluPlusOne map;
  const linattn::Options ok;

  auto causal = [&](const auto& a, const auto& b, const auto& c, const linattn::Options& o) {
    linattn::causal_linear_attention_into(a, b, c, linattn::Identity{}, out, o);
  };
  auto non_causal = [&](const auto& a, const auto& b, const auto& c, const linattn::Options& o) {
    linattn::linear_attention_into(a, b, c, linattn::Identity{}, out, o);
  };

  SECTION("shape mismatches") {
    CHECK_THROWS_WITH(causal(q, k.topRows(9), v, ok), Contains("phi_k is 9 x 4"));
    CHECK_THROWS_WITH(causal(q, k.leftCols(3), v, ok), Contains("phi_k is 10 x 3"));
    CHECK_THROWS_WITH(causal(q, k, v.topRows(8), ok), Contains("v is 8 x 3"));
    CHECK_THROWS_WITH(non_causal(q, k, v.topRows(8), ok), Contains("v is 8 x 3"));
    CHECK_THROWS_WITH(linattn::causal_linear_attention(q, k.topRows(9), v, map),
                      Contains("k is 9 x 4"));
    Matrix<T> wrong(10, 2);
    CHECK_THROWS_WITH(linattn::causal_linear_attention_into(q, k, v, linattn::Identity{}, wrong),
                      Contains("out is 10 x 2"));
    CHECK_THROWS_WITH(linattn::causal_linear_attention_into(q, k, v, map, wrong),
                      Contains("out is 10 x 2"));
    const linattn::PositiveRandomFeatures prf(5, 8, 1);
    CHECK_THROWS_AS(linattn::causal_linear_attention(q, k, v, prf), linattn::Error);
    CHECK_THROWS_AS(linattn::linear_attention(q, k, v, prf), linattn::Error);
  }
  SECTION("empty sizes") {
    const Matrix<T> none(0, 4), no_cols(10, 0), no_values(10, 0);
    CHECK_THROWS_WITH(causal(none, none, v.topRows(0), ok), Contains("phi_q is empty"));
    CHECK_THROWS_WITH(causal(no_cols, no_cols, v, ok), Contains("phi_q is empty"));
    CHECK_THROWS_WITH(causal(q, k, no_values, ok), Contains("v is empty"));
    CHECK_THROWS_WITH(non_causal(none, none, v.topRows(0), ok), Contains("phi_q is empty"));
  }
  SECTION("options out of range") {
    for (const double eps : {-1e-9, std::numeric_limits<double>::quiet_NaN(),
                             std::numeric_limits<double>::infinity()}) {
      linattn::Options bad;
      bad.eps = eps;
      CHECK_THROWS_WITH(causal(q, k, v, bad), Contains("Options::eps"));
      CHECK_THROWS_WITH(non_causal(q, k, v, bad), Contains("Options::eps"));
    }
    for (const double decay : {0.0, -0.5, 1.0000001, std::numeric_limits<double>::quiet_NaN()}) {
      linattn::Options bad;
      bad.decay = decay;
      CHECK_THROWS_WITH(causal(q, k, v, bad), Contains("Options::decay"));
    }
    for (const Eigen::Index chunk : {0, -3}) {
      linattn::Options bad;
      bad.chunk = chunk;
      CHECK_THROWS_WITH(causal(q, k, v, bad), Contains("Options::chunk"));
    }
  }
  SECTION("NaN or Inf in an input, named by row and column") {
    for (const T poison :
         {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity()}) {
      Matrix<T> bad = q;
      bad(6, 2) = poison;
      CHECK_THROWS_WITH(causal(bad, k, v, ok), Contains("phi_q") && Contains("row 6, column 2"));
      CHECK_THROWS_WITH(causal(q, bad, v, ok), Contains("phi_k") && Contains("row 6, column 2"));
      CHECK_THROWS_WITH(linattn::causal_linear_attention(q, bad, v, map),
                        Contains("k has a non-finite value"));
      Matrix<T> bad_v = v;
      bad_v(9, 0) = poison;
      CHECK_THROWS_WITH(non_causal(q, k, bad_v, ok), Contains("v") && Contains("row 9, column 0"));
      // With the check off the caller gets what the arithmetic gives, and no throw.
      linattn::Options unchecked;
      unchecked.check_finite = false;
      CHECK_NOTHROW(causal(bad, k, v, unchecked));
      out = untouched;
    }
  }
  CHECK(out == untouched);
}

TEMPLATE_TEST_CASE("zero feature rows give zero outputs, never NaN", "[linear_attention]", float,
                   double) {
  using T = TestType;
  // Relu of all-negative inputs is a zero feature row: 0 / (0 + eps) = 0, and with eps = 0 the
  // guard writes a zero row instead of 0 / 0.
  Matrix<T> q = gaussian<T>(40, 5, 51), k = gaussian<T>(40, 5, 52);
  const Matrix<T> v = gaussian<T>(40, 3, 53);
  q.row(0) = -q.row(0).cwiseAbs();
  q.row(17) = -q.row(17).cwiseAbs();
  k.row(0) = -k.row(0).cwiseAbs();
  for (const double eps : {1e-6, 0.0}) {
    linattn::Options options;
    options.eps = eps;
    const Matrix<T> out = linattn::causal_linear_attention(q, k, v, linattn::Relu{}, options);
    REQUIRE(out.allFinite());
    CHECK(out.row(0).cwiseAbs().maxCoeff() == T(0));
    CHECK(out.row(17).cwiseAbs().maxCoeff() == T(0));
  }
}

TEMPLATE_TEST_CASE("edge cases: C or Dv of 1, a single token, eps = 0, decay near 0 and 1",
                   "[linear_attention][numerics]", float, double) {
  using T = TestType;
  struct Case {
    Eigen::Index n, c, dv;
    double decay, eps;
  };
  const std::vector<Case> cases = {{1, 5, 3, 1.0, 1e-6},         {300, 1, 4, 1.0, 1e-6},
                                   {300, 6, 1, 0.9, 1e-6},       {1, 1, 1, 0.5, 0.0},
                                   {500, 4, 3, 1.0 - 1e-9, 0.0}, {200, 4, 3, 1e-6, 1e-6},
                                   {200, 4, 3, 1e-300, 0.0}};
  const linattn::EluPlusOne map;
  for (const Case& c : cases) {
    const Matrix<T> q = gaussian<T>(c.n, c.c, 901), k = gaussian<T>(c.n, c.c, 902);
    const Matrix<T> v = gaussian<T>(c.n, c.dv, 903);
    linattn::Options options;
    options.decay = c.decay;
    options.eps = c.eps;
    const Matrix<double> expected = naive_linear_attention(
        map.queries(q.template cast<double>()), map.keys(k.template cast<double>()),
        v.template cast<double>(), true, c.decay, c.eps, true);
    const Matrix<T> parallel = linattn::causal_linear_attention(q, k, v, map, options);
    linattn::RecurrentState<T> state(c.c, c.dv, options);
    Matrix<T> recurrent(c.n, c.dv);
    for (Eigen::Index i = 0; i < c.n; ++i) {
      recurrent.row(i) = state.step(q.row(i), k.row(i), v.row(i), map).transpose();
    }
    INFO("N = " << c.n << ", C = " << c.c << ", Dv = " << c.dv << ", decay = " << c.decay
                << ", eps = " << c.eps);
    REQUIRE(parallel.allFinite());
    REQUIRE(recurrent.allFinite());
    CHECK(relative_error(parallel, expected) <= tolerance<T>());
    CHECK(relative_error(recurrent, expected) <= tolerance<T>());
  }
}

TEMPLATE_TEST_CASE("Options::scale multiplies phi(q), in every form", "[linear_attention]", float,
                   double) {
  // out = s phi(q)^T S / (s phi(q) . z + eps): the naive formula on s phi(q). eps = 0.5 makes
  // the normalised form depend on s, so a scale that were dropped would show.
  using T = TestType;
  const Eigen::Index n = 300;
  const Matrix<T> q = gaussian<T>(n, kDk, 501), k = gaussian<T>(n, kDk, 502);
  const Matrix<T> v = gaussian<T>(n, kDv, 503);
  const linattn::EluPlusOne map;
  const Matrix<double> phi_q = map.queries(q.template cast<double>());
  const Matrix<double> phi_k = map.keys(k.template cast<double>());
  const double s = 0.125;
  for (const bool normalize : {true, false}) {
    for (const double decay : {1.0, 0.97}) {
      linattn::Options options;
      options.scale = s;
      options.eps = 0.5;
      options.normalize = normalize;
      options.decay = decay;
      const Matrix<double> expected = naive_linear_attention(
          s * phi_q, phi_k, v.template cast<double>(), true, decay, 0.5, normalize);
      const Matrix<T> chunked = linattn::causal_linear_attention(q, k, v, map, options);
      CHECK(relative_error(chunked, expected) <= tolerance<T>());
      linattn::RecurrentState<T> state(kDk, kDv, options);
      Matrix<T> steps(n, kDv);
      for (Eigen::Index t = 0; t < n; ++t) {
        steps.row(t) = state.step(q.row(t), k.row(t), v.row(t), map).transpose();
      }
      CHECK(relative_error(steps, expected) <= tolerance<T>());
      if (decay == 1.0) {
        const Matrix<double> full = naive_linear_attention(
            s * phi_q, phi_k, v.template cast<double>(), false, 1.0, 0.5, normalize);
        CHECK(relative_error(linattn::linear_attention(q, k, v, map, options), full) <=
              tolerance<T>());
      }
    }
  }
  linattn::Options bad;
  for (const double scale : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                             std::numeric_limits<double>::quiet_NaN()}) {
    bad.scale = scale;
    CHECK_THROWS_WITH(linattn::causal_linear_attention(q, k, v, map, bad),
                      Catch::Contains("Options::scale"));
  }
  // The backward takes the scale too: tests/backward.test.cpp checks its gradients.
}

TEMPLATE_TEST_CASE("cross-attention: N_q queries over N_k keys match the naive formula",
                   "[linear_attention][cross]", float, double) {
  using T = TestType;
  using Catch::Matchers::Contains;
  const linattn::PositiveRandomFeatures prf(kDk, 32, 9);
  double worst = 0.0;
  struct Lengths {
    Eigen::Index queries, keys;
  };
  for (const Lengths n : {Lengths{37, 300}, Lengths{500, 20}, Lengths{1, 1}, Lengths{64, 2500}}) {
    const Matrix<T> q = gaussian<T>(n.queries, kDk, 71, 0.5);
    const Matrix<T> k = gaussian<T>(n.keys, kDk, 72, 0.5);
    const Matrix<T> v = gaussian<T>(n.keys, kDv, 73);
    for (const bool normalize : {true, false}) {
      for (const int threads : {1, 2}) {
        linattn::Options options;
        options.normalize = normalize;
        options.threads = threads;
        options.scale = normalize ? 1.0 : 0.25;
        auto check = [&](const auto& map, const char* name) {
          const Matrix<T> got = linattn::linear_attention(q, k, v, map, options);
          Matrix<T> into = Matrix<T>::Constant(n.queries, kDv, T(-3));
          linattn::linear_attention_into(q, k, v, map, into, options);
          // The formula, in double: out_i = sum_j w_ij v_j / (sum_j w_ij + eps).
          const Matrix<double> pq = options.scale * map.queries(q.template cast<double>());
          const Matrix<double> pk = map.keys(k.template cast<double>());
          const Matrix<double> w = pq * pk.transpose();
          Matrix<double> expected = w * v.template cast<double>();
          if (normalize) {
            for (Eigen::Index i = 0; i < n.queries; ++i) {
              expected.row(i) /= w.row(i).sum() + options.eps;
            }
          }
          INFO(name << ", N_q = " << n.queries << ", N_k = " << n.keys
                    << ", normalize = " << normalize << ", threads = " << threads);
          REQUIRE(got.rows() == n.queries);
          CHECK(got == into);
          const double error = relative_error(got, expected);
          CHECK(error <= tolerance<T>());
          worst = std::max(worst, error);
        };
        check(linattn::EluPlusOne{}, "EluPlusOne");
        check(prf, "PositiveRandomFeatures");
        const Matrix<T> phi_q = linattn::EluPlusOne{}.queries(q);
        const Matrix<T> phi_k = linattn::EluPlusOne{}.keys(k);
        CHECK(linattn::linear_attention(phi_q, phi_k, v, linattn::Identity{}, options) ==
              linattn::linear_attention(q, k, v, linattn::EluPlusOne{}, options));
      }
    }
  }
  WARN("cross-attention vs the naive formula: worst relative error " << worst);
  // Shapes: keys and values must agree in rows, queries and keys in columns; causal attention
  // still needs N_q == N_k.
  const Matrix<T> q = gaussian<T>(10, kDk, 74), k = gaussian<T>(30, kDk, 75);
  const Matrix<T> v = gaussian<T>(30, kDv, 76);
  Matrix<T> out = Matrix<T>::Constant(10, kDv, T(5));
  const Matrix<T> untouched = out;
  CHECK_THROWS_WITH(
      linattn::linear_attention_into(q, k, v.topRows(29), linattn::EluPlusOne{}, out),
      Contains("v is 29 x 7 but k is 30 x 12") && Contains("same number of rows (keys)"));
  CHECK_THROWS_WITH(linattn::linear_attention_into(q, k.leftCols(5), v, linattn::Identity{}, out),
                    Contains("phi_k is 30 x 5") && Contains("same number of columns"));
  CHECK_THROWS_WITH(linattn::causal_linear_attention_into(q, k, v, linattn::Identity{}, out),
                    Contains("phi_k is 30 x 12"));
  Matrix<T> bad_k = k;
  bad_k(29, 1) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH(linattn::linear_attention_into(q, bad_k, v, linattn::Identity{}, out),
                    Contains("phi_k") && Contains("row 29"));
  Matrix<T> wrong(30, kDv);
  CHECK_THROWS_WITH(linattn::linear_attention_into(q, k, v, linattn::Identity{}, wrong),
                    Contains("out is 30 x 7"));
  CHECK(out == untouched);
}

}  // namespace linattn_test_linear_attention
