// Softmax baselines against a naive double reference written here.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <linattn/softmax.hpp>
#include <vector>

#include "support.hpp"

using linattn::Matrix;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

namespace {

/// out_i = sum_{j in [lo_i, hi_i]} exp(s q_i.k_j) v_j / sum exp(...), computed row by row.
/// window <= 0: all keys (or j <= i when causal).
Matrix<double> naive_softmax(const Matrix<double>& q, const Matrix<double>& k,
                             const Matrix<double>& v, bool causal, Eigen::Index window,
                             double scale) {
  const Eigen::Index n = q.rows();
  Matrix<double> out(n, v.cols());
  for (Eigen::Index i = 0; i < n; ++i) {
    const Eigen::Index hi = causal ? i : n - 1;
    const Eigen::Index lo = window > 0 ? std::max<Eigen::Index>(0, i - window + 1) : 0;
    std::vector<double> logits;
    double top = -std::numeric_limits<double>::infinity();
    for (Eigen::Index j = lo; j <= hi; ++j) {
      logits.push_back(scale * q.row(i).dot(k.row(j)));
      top = std::max(top, logits.back());
    }
    Eigen::RowVectorXd num = Eigen::RowVectorXd::Zero(v.cols());
    double den = 0.0;
    for (Eigen::Index j = lo; j <= hi; ++j) {
      const double w = std::exp(logits[static_cast<std::size_t>(j - lo)] - top);
      num += w * v.row(j);
      den += w;
    }
    out.row(i) = num / den;
  }
  return out;
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

}  // namespace

TEMPLATE_TEST_CASE("tiled and materialised softmax match the naive formula", "[softmax]", float,
                   double) {
  using T = TestType;
  for (const Eigen::Index n : {1, 2, 63, 65, 300, 700}) {  // not multiples of the tiles
    const Matrix<T> q = gaussian<T>(n, 12, 200 + n, 1.5), k = gaussian<T>(n, 12, 300 + n, 1.5);
    const Matrix<T> v = gaussian<T>(n, 5, 400 + n);
    const Matrix<double> qd = q.template cast<double>(), kd = k.template cast<double>(),
                         vd = v.template cast<double>();
    for (const bool causal : {true, false}) {
      for (const double scale : {-1.0, 0.7}) {
        const double s = scale < 0 ? 1.0 / std::sqrt(12.0) : scale;
        const Matrix<double> expected = naive_softmax(qd, kd, vd, causal, 0, s);
        INFO("N = " << n << ", causal = " << causal << ", scale = " << scale);
        CHECK(relative_error(linattn::softmax_attention(q, k, v, causal, scale), expected) <=
              tolerance<T>());
        CHECK(relative_error(linattn::materialized_softmax_attention(q, k, v, causal, scale),
                             expected) <= tolerance<T>());
      }
    }
  }
}

TEMPLATE_TEST_CASE("large logits stay finite (online softmax is stable)", "[softmax]", float,
                   double) {
  using T = TestType;
  const Eigen::Index n = 300;
  // Logits of several hundred: exp would overflow without the running max.
  const Matrix<T> q = gaussian<T>(n, 8, 501, 30.0), k = gaussian<T>(n, 8, 502, 30.0);
  const Matrix<T> v = gaussian<T>(n, 4, 503);
  const Matrix<T> out = linattn::softmax_attention(q, k, v, true);
  REQUIRE(out.allFinite());
  const Matrix<double> expected =
      naive_softmax(q.template cast<double>(), k.template cast<double>(), v.template cast<double>(),
                    true, 0, 1 / std::sqrt(8.0));
  CHECK(relative_error(out, expected) <= (std::is_same_v<T, float> ? 1e-4 : 1e-11));
}

TEMPLATE_TEST_CASE("sliding window matches the naive windowed formula", "[softmax]", float,
                   double) {
  using T = TestType;
  const Eigen::Index n = 900;
  const Matrix<T> q = gaussian<T>(n, 10, 601), k = gaussian<T>(n, 10, 602);
  const Matrix<T> v = gaussian<T>(n, 6, 603);
  const Matrix<double> qd = q.template cast<double>(), kd = k.template cast<double>(),
                       vd = v.template cast<double>();
  for (const Eigen::Index window : {1, 5, 64, 256, 300, 2000}) {
    const Matrix<double> expected = naive_softmax(qd, kd, vd, true, window, 1 / std::sqrt(10.0));
    INFO("window = " << window);
    CHECK(relative_error(linattn::sliding_window_attention(q, k, v, window), expected) <=
          tolerance<T>());
    // The decoding twin, one token at a time.
    linattn::SlidingWindowCache<T> cache(10, 6, window);
    Matrix<T> stepped(n, 6);
    for (Eigen::Index i = 0; i < n; ++i)
      stepped.row(i) = cache.step(q.row(i), k.row(i), v.row(i)).transpose();
    CHECK(relative_error(stepped, expected) <= tolerance<T>());
    CHECK(cache.bytes() == static_cast<std::size_t>(window * 16) * sizeof(T));
  }
}

TEMPLATE_TEST_CASE("the KV cache step equals causal softmax", "[softmax]", float, double) {
  using T = TestType;
  const Eigen::Index n = 500;
  const Matrix<T> q = gaussian<T>(n, 16, 701), k = gaussian<T>(n, 16, 702);
  const Matrix<T> v = gaussian<T>(n, 7, 703);
  const Matrix<double> expected =
      naive_softmax(q.template cast<double>(), k.template cast<double>(), v.template cast<double>(),
                    true, 0, 0.3);
  linattn::SoftmaxKVCache<T> cache(16, 7, 0.3);
  Matrix<T> stepped(n, 7);
  for (Eigen::Index i = 0; i < 200; ++i)
    stepped.row(i) = cache.step(q.row(i), k.row(i), v.row(i)).transpose();
  // Rollback and redo: truncate, then continue through append + step.
  cache.truncate(150);
  CHECK(cache.tokens() == 150);
  cache.append(k.middleRows(150, 49), v.middleRows(150, 49));
  for (Eigen::Index i = 199; i < n; ++i)
    stepped.row(i) = cache.step(q.row(i), k.row(i), v.row(i)).transpose();
  CHECK(relative_error(stepped, expected) <= tolerance<T>());
  CHECK(cache.tokens() == n);
  CHECK(cache.capacity() >= n);
  CHECK(cache.capacity() <= 2 * n);  // amortised doubling, not one row per step
  CHECK(cache.bytes() == static_cast<std::size_t>(n * 23) * sizeof(T));
  CHECK(cache.keys() == k);
  CHECK(cache.values() == v);
}

TEMPLATE_TEST_CASE("softmax baselines reject bad input", "[softmax][errors]", float, double) {
  using T = TestType;
  using Catch::Matchers::Contains;
  const Matrix<T> q = gaussian<T>(10, 4, 801), k = gaussian<T>(10, 4, 802),
                  v = gaussian<T>(10, 3, 803);
  CHECK_THROWS_WITH(linattn::softmax_attention(q, k.topRows(9), v, true), Contains("k is 9 x 4"));
  CHECK_THROWS_WITH(linattn::softmax_attention(q, k, v.topRows(9), false), Contains("v is 9 x 3"));
  CHECK_THROWS_WITH(linattn::materialized_softmax_attention(q, k.leftCols(3), v, true),
                    Contains("k is 10 x 3"));
  CHECK_THROWS_WITH(linattn::sliding_window_attention(q, k, v, 0), Contains("window must be >= 1"));
  CHECK_THROWS_WITH(linattn::softmax_attention(q, k, v, true, std::nan("")), Contains("scale"));
  Matrix<T> bad = q;
  bad(2, 3) = std::numeric_limits<T>::infinity();
  CHECK_THROWS_WITH(linattn::softmax_attention(bad, k, v, true), Contains("row 2, column 3"));
  Matrix<T> wrong_out(10, 4);
  CHECK_THROWS_WITH(linattn::softmax_attention_into(q, k, v, true, wrong_out),
                    Contains("out is 10 x 4"));

  linattn::SoftmaxKVCache<T> cache(4, 3);
  CHECK_THROWS_WITH(cache.step(q.row(0).head(3), k.row(0), v.row(0)), Contains("q is 1 x 3"));
  CHECK_THROWS_WITH(cache.step(q.row(0), k.row(0), v.row(0).head(2)), Contains("v is 1 x 2"));
  CHECK(cache.tokens() == 0);  // nothing appended by a failed step
  CHECK_THROWS_AS(cache.truncate(1), linattn::Error);
  CHECK_THROWS_AS(cache.append(k, v.topRows(9)), linattn::Error);
  cache.append(k.topRows(0), v.topRows(0));  // zero tokens is a no-op (found by the fuzzer)
  CHECK(cache.tokens() == 0);
  CHECK_THROWS_AS(linattn::SoftmaxKVCache<T>(0, 3), linattn::Error);
  CHECK_THROWS_AS(linattn::SlidingWindowCache<T>(4, 3, 0), linattn::Error);
}
