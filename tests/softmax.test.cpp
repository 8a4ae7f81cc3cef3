// Softmax baselines (forward and backward) against naive double references written here.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <linattn/gradients.hpp>
#include <linattn/softmax.hpp>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_softmax {

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
        CHECK(relative_error(
                  linattn::softmax_attention(
                      q, k, v, causal ? linattn::Mask::causal : linattn::Mask::none, scale),
                  expected) <= tolerance<T>());
        CHECK(relative_error(
                  linattn::materialized_softmax_attention(
                      q, k, v, causal ? linattn::Mask::causal : linattn::Mask::none, scale),
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
  const Matrix<T> out = linattn::softmax_attention(q, k, v, linattn::Mask::causal);
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

TEMPLATE_TEST_CASE("softmax baselines reject bad input", "[softmax][errors]", float) {
  using T = TestType;
  using Catch::Matchers::Contains;
  const Matrix<T> q = gaussian<T>(10, 4, 801), k = gaussian<T>(10, 4, 802),
                  v = gaussian<T>(10, 3, 803);
  CHECK_THROWS_WITH(linattn::softmax_attention(q, k.topRows(9), v, linattn::Mask::causal),
                    Contains("k is 9 x 4"));
  CHECK_THROWS_WITH(linattn::softmax_attention(q, k, v.topRows(9), linattn::Mask::none),
                    Contains("v is 9 x 3"));
  CHECK_THROWS_WITH(
      linattn::materialized_softmax_attention(q, k.leftCols(3), v, linattn::Mask::causal),
      Contains("k is 10 x 3"));
  CHECK_THROWS_WITH(linattn::sliding_window_attention(q, k, v, 0), Contains("window must be >= 1"));
  CHECK_THROWS_WITH(linattn::softmax_attention(q, k, v, linattn::Mask::causal, std::nan("")),
                    Contains("scale"));
  Matrix<T> bad = q;
  bad(2, 3) = std::numeric_limits<T>::infinity();
  CHECK_THROWS_WITH(linattn::softmax_attention(bad, k, v, linattn::Mask::causal),
                    Contains("row 2, column 3"));
  Matrix<T> wrong_out(10, 4);
  CHECK_THROWS_WITH(linattn::softmax_attention_into(q, k, v, linattn::Mask::causal, wrong_out),
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

namespace {

/// Reverse mode through the materialised N x N softmax, in double: P = softmax(s Q K^T) (masked
/// when causal), dV = P^T dO, dP = dO V^T, dS_ij = P_ij (dP_ij - sum_l P_il dP_il) (the
/// softmax Jacobian row by row), dQ = s dS K, dK = s dS^T Q.
linattn::AttentionGradients<double> naive_softmax_backward(const Matrix<double>& q,
                                                           const Matrix<double>& k,
                                                           const Matrix<double>& v,
                                                           const Matrix<double>& dout, bool causal,
                                                           double scale) {
  const Eigen::Index n = q.rows();
  Matrix<double> p = scale * q * k.transpose();
  for (Eigen::Index i = 0; i < n; ++i) {
    const Eigen::Index visible = causal ? i + 1 : n;
    p.row(i).tail(n - visible).setConstant(-std::numeric_limits<double>::infinity());
    p.row(i) = (p.row(i).array() - p.row(i).maxCoeff()).exp().matrix();
    p.row(i) /= p.row(i).sum();
  }
  const Matrix<double> dp = dout * v.transpose();
  const Vector<double> row_dot = p.cwiseProduct(dp).rowwise().sum();
  const Matrix<double> ds = p.cwiseProduct(dp.colwise() - row_dot);
  return {scale * ds * k, scale * ds.transpose() * q, p.transpose() * dout};
}

/// sum(w .* softmax_attention(q, k, v)) in double: the scalar loss whose gradient the backward
/// computes when grad_out = w.
double weighted_output(const Matrix<double>& q, const Matrix<double>& k, const Matrix<double>& v,
                       const Matrix<double>& w, bool causal, double scale) {
  return linattn::softmax_attention(q, k, v, causal ? linattn::Mask::causal : linattn::Mask::none,
                                    scale)
      .cwiseProduct(w)
      .sum();
}

/// Each gradient entry sums up to N products and its dS term cancels (dP - D), so errors grow
/// with N; measured at N = 700 both types land near 100 ulps of max|gradient| (float 4.1e-6,
/// double 1.3e-14). The bounds are ~500 ulps in float and ~9000 in double, where the reference's
/// own rounding is of the same order as the kernel's.
template <class T>
double backward_tolerance() {
  return std::is_same_v<T, float> ? 3e-5 : 1e-12;
}

}  // namespace

TEMPLATE_TEST_CASE("softmax backward matches central finite differences", "[softmax][backward]",
                   float, double) {
  using T = TestType;
  const Eigen::Index n = 9, dk = 5, dv = 3;
  const Matrix<T> q = gaussian<T>(n, dk, 901), k = gaussian<T>(n, dk, 902);
  const Matrix<T> v = gaussian<T>(n, dv, 903), dout = gaussian<T>(n, dv, 904);
  // The finite differences see the same (rounded) inputs as the kernel, in double.
  const Matrix<double> qd = q.template cast<double>(), kd = k.template cast<double>(),
                       vd = v.template cast<double>(), wd = dout.template cast<double>();
  const double h = 1e-5;  // truncation O(h^2) ~ 1e-10, rounding O(1e-16 / h) ~ 1e-11
  for (const bool causal : {true, false}) {
    for (const double scale : {-1.0, 0.7}) {
      const double s = scale < 0 ? 1.0 / std::sqrt(double(dk)) : scale;
      const linattn::AttentionGradients<T> grads = linattn::softmax_attention_backward(
          q, k, v, dout, causal ? linattn::Mask::causal : linattn::Mask::none, scale);
      // d loss / d x by central differences, one entry of one input at a time.
      const auto numeric = [&](int which) {
        Matrix<double> x[3] = {qd, kd, vd};
        Matrix<double> grad(x[which].rows(), x[which].cols());
        for (Eigen::Index r = 0; r < grad.rows(); ++r) {
          for (Eigen::Index c = 0; c < grad.cols(); ++c) {
            const double saved = x[which](r, c);
            x[which](r, c) = saved + h;
            const double up = weighted_output(x[0], x[1], x[2], wd, causal, s);
            x[which](r, c) = saved - h;
            const double down = weighted_output(x[0], x[1], x[2], wd, causal, s);
            x[which](r, c) = saved;
            grad(r, c) = (up - down) / (2 * h);
          }
        }
        return grad;
      };
      INFO("causal = " << causal << ", scale = " << scale);
      // Double: the differences themselves (~3e-10 measured). Float: the kernel's own rounding
      // (1.0e-6 measured), not the differences, sets the error.
      const double bound = std::is_same_v<T, float> ? 5e-6 : 1e-6;
      CHECK(relative_error(grads.q, numeric(0)) <= bound);
      CHECK(relative_error(grads.k, numeric(1)) <= bound);
      CHECK(relative_error(grads.v, numeric(2)) <= bound);
    }
  }
}

TEMPLATE_TEST_CASE("softmax backward matches reverse mode through the materialised softmax",
                   "[softmax][backward]", float, double) {
  using T = TestType;
  const Eigen::Index dk = 12, dv = 7;                  // Dk != Dv
  for (const Eigen::Index n : {1, 5, 64, 100, 700}) {  // one tile, tile edges, several tiles
    const Matrix<T> q = gaussian<T>(n, dk, 1000 + n, 1.5), k = gaussian<T>(n, dk, 1100 + n, 1.5);
    const Matrix<T> v = gaussian<T>(n, dv, 1200 + n), dout = gaussian<T>(n, dv, 1300 + n);
    const Matrix<double> qd = q.template cast<double>(), kd = k.template cast<double>(),
                         vd = v.template cast<double>(), dd = dout.template cast<double>();
    for (const bool causal : {true, false}) {
      for (const double scale : {-1.0, 0.7}) {
        const double s = scale < 0 ? 1.0 / std::sqrt(double(dk)) : scale;
        const linattn::AttentionGradients<double> expected =
            naive_softmax_backward(qd, kd, vd, dd, causal, s);
        const linattn::AttentionGradients<T> grads = linattn::softmax_attention_backward(
            q, k, v, dout, causal ? linattn::Mask::causal : linattn::Mask::none, scale);
        INFO("N = " << n << ", causal = " << causal << ", scale = " << scale);
        CHECK(relative_error(grads.q, expected.q) <= backward_tolerance<T>());
        CHECK(relative_error(grads.k, expected.k) <= backward_tolerance<T>());
        CHECK(relative_error(grads.v, expected.v) <= backward_tolerance<T>());
        // Softmax ignores a shift shared by all keys a query sees, so the key gradients sum
        // to zero.
        const double shift = grads.k.template cast<double>().colwise().sum().cwiseAbs().maxCoeff();
        CHECK(shift <= backward_tolerance<T>() * std::max(1.0, expected.k.cwiseAbs().maxCoeff()));
      }
    }
  }
}

TEMPLATE_TEST_CASE("softmax backward takes views and writes into strided outputs",
                   "[softmax][backward]", float, double) {
  using T = TestType;
  const Eigen::Index n = 300, dk = 8, dv = 5;
  const Matrix<T> q = gaussian<T>(n, dk, 1401), k = gaussian<T>(n, dk, 1402);
  const Matrix<T> v = gaussian<T>(n, dv, 1403), dout = gaussian<T>(n, dv, 1404);
  const linattn::AttentionGradients<T> plain =
      linattn::softmax_attention_backward(q, k, v, dout, linattn::Mask::causal);
  // Column-major inputs, a block of a wider matrix, and outputs that are column blocks.
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> q_col = q;
  Matrix<T> wide = Matrix<T>::Zero(n, dv + 3);
  wide.middleCols(2, dv) = dout;
  Matrix<T> out(n, 2 * dk + dv + 1);
  out.setConstant(T(7));
  linattn::softmax_attention_backward_into(q_col, k, v, wide.middleCols(2, dv),
                                           linattn::Mask::causal, out.leftCols(dk),
                                           out.middleCols(dk, dk), out.middleCols(2 * dk, dv));
  // Same operations in the same order: identical bits.
  CHECK(out.leftCols(dk) == plain.q);
  CHECK(out.middleCols(dk, dk) == plain.k);
  CHECK(out.middleCols(2 * dk, dv) == plain.v);
  CHECK((out.rightCols(1).array() == T(7)).all());  // nothing written outside the outputs
}

TEMPLATE_TEST_CASE("softmax reads rows with an outer stride of 0 (one row repeated)", "[softmax]",
                   float) {
  using T = TestType;
  const Eigen::Index n = 300, dk = 8, dv = 5;
  const Matrix<T> q = gaussian<T>(n, dk, 1501), k = gaussian<T>(n, dk, 1502);
  const Matrix<T> v_row = gaussian<T>(1, dv, 1503), dout = gaussian<T>(n, dv, 1504);
  // Every token's value is one row in memory (Eigen's Ref would take the stride 0 as unset and
  // read n rows dv apart): the weights sum to 1, so every output row is that row.
  const Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> v(v_row.data(), n, dv,
                                                               Eigen::OuterStride<>(0));
  const Matrix<T> repeated = v_row.replicate(n, 1);
  for (const linattn::Mask mask : {linattn::Mask::causal, linattn::Mask::none}) {
    const Matrix<T> out = linattn::softmax_attention(q, k, v, mask);
    CHECK(out == linattn::softmax_attention(q, k, repeated, mask));  // the same rows, bit for bit
    CHECK(relative_error(out, repeated) <= tolerance<T>());
  }
  CHECK(linattn::sliding_window_attention(q, k, v, 16) ==
        linattn::sliding_window_attention(q, k, repeated, 16));
  const linattn::AttentionGradients<T> shared =
      linattn::softmax_attention_backward(q, k, v, dout, linattn::Mask::causal);
  const linattn::AttentionGradients<T> plain =
      linattn::softmax_attention_backward(q, k, repeated, dout, linattn::Mask::causal);
  CHECK(shared.q == plain.q);
  CHECK(shared.k == plain.k);
  CHECK(shared.v == plain.v);
}

TEMPLATE_TEST_CASE("softmax backward stays finite for large logits", "[softmax][backward]", float,
                   double) {
  using T = TestType;
  const Eigen::Index n = 300;
  const Matrix<T> q = gaussian<T>(n, 8, 1501, 30.0), k = gaussian<T>(n, 8, 1502, 30.0);
  const Matrix<T> v = gaussian<T>(n, 4, 1503), dout = gaussian<T>(n, 4, 1504);
  const linattn::AttentionGradients<T> grads =
      linattn::softmax_attention_backward(q, k, v, dout, linattn::Mask::causal);
  REQUIRE(grads.q.allFinite());
  REQUIRE(grads.k.allFinite());
  REQUIRE(grads.v.allFinite());
  const linattn::AttentionGradients<double> expected = naive_softmax_backward(
      q.template cast<double>(), k.template cast<double>(), v.template cast<double>(),
      dout.template cast<double>(), true, 1 / std::sqrt(8.0));
  // Logits of several hundred carry an absolute error of ~1e-4 in float (~2e-13 in double),
  // which P inherits: 4.4e-4 and 6.7e-13 measured.
  const double bound = std::is_same_v<T, float> ? 2e-3 : 1e-11;
  CHECK(relative_error(grads.q, expected.q) <= bound);
  CHECK(relative_error(grads.k, expected.k) <= bound);
  CHECK(relative_error(grads.v, expected.v) <= bound);
}

TEMPLATE_TEST_CASE("softmax backward rejects bad input", "[softmax][backward][errors]", float) {
  using T = TestType;
  using Catch::Matchers::Contains;
  const Matrix<T> q = gaussian<T>(10, 4, 1601), k = gaussian<T>(10, 4, 1602),
                  v = gaussian<T>(10, 3, 1603), dout = gaussian<T>(10, 3, 1604);
  CHECK_THROWS_WITH(
      linattn::softmax_attention_backward(q, k.topRows(9), v, dout, linattn::Mask::causal),
      Contains("k is 9 x 4"));
  CHECK_THROWS_WITH(
      linattn::softmax_attention_backward(q, k.leftCols(3), v, dout, linattn::Mask::causal),
      Contains("k is 10 x 3"));
  CHECK_THROWS_WITH(
      linattn::softmax_attention_backward(q, k, v.topRows(9), dout, linattn::Mask::none),
      Contains("v is 9 x 3"));
  CHECK_THROWS_WITH(
      linattn::softmax_attention_backward(q, k, v, dout.topRows(9), linattn::Mask::causal),
      Contains("grad_out is 9 x 3"));
  CHECK_THROWS_WITH(
      linattn::softmax_attention_backward(q, k, v, dout.leftCols(2), linattn::Mask::causal),
      Contains("grad_out is 10 x 2"));
  CHECK_THROWS_WITH(linattn::softmax_attention_backward(q.topRows(0), k.topRows(0), v.topRows(0),
                                                        dout.topRows(0), linattn::Mask::causal),
                    Contains("q is empty"));
  CHECK_THROWS_WITH(
      linattn::softmax_attention_backward(q, k, v, dout, linattn::Mask::causal, std::nan("")),
      Contains("scale"));
  Matrix<T> bad_dout = dout, bad_k = k;
  bad_dout(4, 1) = std::numeric_limits<T>::quiet_NaN();
  bad_k(3, 2) = -std::numeric_limits<T>::infinity();
  CHECK_THROWS_WITH(linattn::softmax_attention_backward(q, k, v, bad_dout, linattn::Mask::causal),
                    Contains("grad_out has a non-finite value"));
  CHECK_THROWS_WITH(linattn::softmax_attention_backward(q, bad_k, v, dout, linattn::Mask::causal),
                    Contains("row 3, column 2"));
  // Wrong output shapes are named, and a failed call leaves every output as it was.
  Matrix<T> gq = Matrix<T>::Constant(10, 4, T(5)), gk = gq, gv = Matrix<T>::Constant(10, 3, T(5));
  Matrix<T> wrong(10, 3);
  CHECK_THROWS_WITH(
      linattn::softmax_attention_backward_into(q, k, v, dout, linattn::Mask::causal, wrong, gk, gv),
      Contains("grad_q is 10 x 3"));
  CHECK_THROWS_WITH(
      linattn::softmax_attention_backward_into(q, k, v, dout, linattn::Mask::causal, gq, wrong, gv),
      Contains("grad_k is 10 x 3"));
  CHECK_THROWS_WITH(linattn::softmax_attention_backward_into(q, k, v, dout, linattn::Mask::causal,
                                                             gq, gk, gq.topRows(9)),
                    Contains("grad_v is 9 x 4"));
  CHECK_THROWS_WITH(linattn::softmax_attention_backward_into(q, k, v, bad_dout,
                                                             linattn::Mask::causal, gq, gk, gv),
                    Contains("grad_out has a non-finite value"));
  CHECK((gq.array() == T(5)).all());
  CHECK((gk.array() == T(5)).all());
  CHECK((gv.array() == T(5)).all());
}

}  // namespace linattn_test_softmax
