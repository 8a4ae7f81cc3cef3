// The backward pass: against central finite differences and a naive reverse-mode reference.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <linattn/backward.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/linear_attention.hpp>
#include <string>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_backward {

using linattn::AttentionGradients;
using linattn::Matrix;
using linattn_test::gaussian;
using linattn_test::relative_error;

namespace {

/// Reverse mode straight through the O(N^2) formula, in double:
/// out_i = sum_j w_ij v_j / d_i, w_ij = g^(i-j) phi_q_i . phi_k_j (j <= i when causal),
/// d_i = guard(sum_j w_ij + eps). Returns d loss / d (phi_q, phi_k, v) for loss = sum(G o out).
/// `magnitude`, when given, receives the same sums over absolute values of every term: the
/// scale that rounding errors are relative to where the terms cancel (N = 1 normalized: the
/// gradients of phi_q, phi_k are O(eps) differences of O(1) terms). The N x N weights are
/// formed a block of rows at a time, as matrices (W = (Q K^T) o F with F_ij = g^(i-j) on the
/// mask), so N = 4096 stays quick under the sanitizers.
AttentionGradients<double> naive_backward(const Matrix<double>& q, const Matrix<double>& k,
                                          const Matrix<double>& v, const Matrix<double>& grad_out,
                                          bool causal, double decay, double eps, bool normalize,
                                          AttentionGradients<double>* magnitude = nullptr) {
  const Eigen::Index n = q.rows();
  // One thread: Eigen's threaded GEMM on these large temporaries spends more on page-table
  // traffic (and on the cores ctest gives the test beside this one) than it saves.
  const int eigen_threads = Eigen::nbThreads();
  Eigen::setNbThreads(1);
  std::vector<double> power(static_cast<std::size_t>(n), 1.0);
  for (Eigen::Index t = 1; t < n; ++t) power[t] = power[t - 1] * decay;
  AttentionGradients<double> grads{Matrix<double>::Zero(n, q.cols()),
                                   Matrix<double>::Zero(n, k.cols()),
                                   Matrix<double>::Zero(n, v.cols())};
  AttentionGradients<double> abs_sums = grads;
  const Matrix<double> abs_q = q.cwiseAbs(), abs_k = k.cwiseAbs(), abs_v = v.cwiseAbs();
  constexpr Eigen::Index kBlock = 256;
  for (Eigen::Index first = 0; first < n; first += kBlock) {
    const Eigen::Index rows = std::min(kBlock, n - first);
    Matrix<double> factor(rows, n);  // F: g^(i-j) where row i sees key j, else 0
    for (Eigen::Index r = 0; r < rows; ++r) {
      const Eigen::Index i = first + r;
      for (Eigen::Index j = 0; j < n; ++j) {
        factor(r, j) = !causal ? 1.0 : (j <= i ? power[static_cast<std::size_t>(i - j)] : 0.0);
      }
    }
    const Matrix<double> w = (q.middleRows(first, rows) * k.transpose()).cwiseProduct(factor);
    const Matrix<double> num = w * v;
    const Eigen::VectorXd den = w.rowwise().sum();
    Matrix<double> grad_num = grad_out.middleRows(first, rows);
    Eigen::VectorXd grad_den = Eigen::VectorXd::Zero(rows);
    if (normalize) {
      for (Eigen::Index r = 0; r < rows; ++r) {
        double d = den(r) + eps;
        const bool clamped = std::abs(d) < eps;
        if (clamped) d = d < 0 ? -eps : eps;
        if (d == 0.0) {  // a zero output row: nothing flows back through it
          grad_num.row(r).setZero();
          continue;
        }
        grad_num.row(r) /= d;
        grad_den(r) = clamped ? 0.0 : -grad_out.row(first + r).dot(num.row(r) / d) / d;
      }
    }
    // d loss / d w_ij = grad_num_i . v_j + grad_den_i; through w_ij = F_ij q_i . k_j.
    const Matrix<double> grad_w =
        ((grad_num * v.transpose()).colwise() + grad_den).cwiseProduct(factor);
    grads.v.noalias() += w.transpose() * grad_num;
    grads.q.middleRows(first, rows).noalias() += grad_w * k;
    grads.k.noalias() += grad_w.transpose() * q.middleRows(first, rows);
    const Matrix<double> abs_grad_num = grad_num.cwiseAbs();
    const Matrix<double> abs_grad_w =
        ((abs_grad_num * abs_v.transpose()).colwise() + grad_den.cwiseAbs()).cwiseProduct(factor);
    abs_sums.v.noalias() += w.cwiseAbs().transpose() * abs_grad_num;
    abs_sums.q.middleRows(first, rows).noalias() += abs_grad_w * abs_k;
    abs_sums.k.noalias() += abs_grad_w.transpose() * abs_q.middleRows(first, rows);
  }
  Eigen::setNbThreads(eigen_threads);
  if (magnitude != nullptr) *magnitude = abs_sums;
  return grads;
}

/// max|a - b| / max|scale| for each gradient; the worst of the three.
template <class T>
double scaled_error(const AttentionGradients<T>& got, const AttentionGradients<double>& want,
                    const AttentionGradients<double>& scale) {
  const auto one = [](const Matrix<T>& a, const Matrix<double>& b, const Matrix<double>& s) {
    return (a.template cast<double>() - b).cwiseAbs().maxCoeff() / s.cwiseAbs().maxCoeff();
  };
  return std::max(
      {one(got.q, want.q, scale.q), one(got.k, want.k, scale.k), one(got.v, want.v, scale.v)});
}

/// Worst of the three relative errors.
template <class T>
double worst_error(const AttentionGradients<T>& got, const AttentionGradients<double>& want) {
  return std::max({relative_error(got.q, want.q), relative_error(got.k, want.k),
                   relative_error(got.v, want.v)});
}

/// Central differences of loss(x) = sum(grad_out o f(x)) for every entry of `x`.
Matrix<double> finite_differences(Matrix<double> x, const Matrix<double>& grad_out,
                                  const std::function<Matrix<double>(const Matrix<double>&)>& f) {
  Matrix<double> grad(x.rows(), x.cols());
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    for (Eigen::Index c = 0; c < x.cols(); ++c) {
      const double saved = x(r, c);
      const double h = 1e-6 * std::max(1.0, std::abs(saved));
      x(r, c) = saved + h;
      const double up = grad_out.cwiseProduct(f(x)).sum();
      x(r, c) = saved - h;
      const double down = grad_out.cwiseProduct(f(x)).sum();
      x(r, c) = saved;
      grad(r, c) = (up - down) / (2 * h);
    }
  }
  return grad;
}

/// Positive features of a small problem: exp of Gaussians, well away from any guard.
Matrix<double> positive_features(Eigen::Index n, Eigen::Index c, std::uint64_t seed) {
  return gaussian<double>(n, c, seed, 0.5).array().exp();
}

template <class T>
double reference_tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

}  // namespace

TEST_CASE("featurized backward matches central finite differences", "[backward]") {
  constexpr Eigen::Index n = 11, c = 5, dv = 3;
  const Matrix<double> q = positive_features(n, c, 11);
  const Matrix<double> k = positive_features(n, c, 12);
  const Matrix<double> v = gaussian<double>(n, dv, 13);
  const Matrix<double> grad_out = gaussian<double>(n, dv, 14);
  double worst = 0.0;
  for (const bool causal : {true, false}) {
    for (const double decay : {1.0, 0.8}) {
      if (!causal && decay != 1.0) continue;
      for (const bool normalize : {true, false}) {
        linattn::Options options;
        options.decay = decay;
        options.normalize = normalize;
        options.chunk = 4;  // several chunks, so carried states are differentiated too
        const auto forward = [&](const Matrix<double>& a, const Matrix<double>& b,
                                 const Matrix<double>& values) {
          return causal
                     ? linattn::causal_linear_attention(a, b, values, linattn::Identity{}, options)
                     : linattn::linear_attention(a, b, values, linattn::Identity{}, options);
        };
        const AttentionGradients<double> got =
            causal ? linattn::causal_linear_attention_backward(q, k, v, grad_out,
                                                               linattn::Identity{}, options)
                   : linattn::linear_attention_backward(q, k, v, grad_out, linattn::Identity{},
                                                        options);
        const AttentionGradients<double> want{
            finite_differences(q, grad_out,
                               [&](const Matrix<double>& x) { return forward(x, k, v); }),
            finite_differences(k, grad_out,
                               [&](const Matrix<double>& x) { return forward(q, x, v); }),
            finite_differences(v, grad_out,
                               [&](const Matrix<double>& x) { return forward(q, k, x); })};
        const double error = worst_error(got, want);
        INFO("causal = " << causal << ", decay = " << decay << ", normalize = " << normalize);
        CHECK(error <= 1e-6);
        worst = std::max(worst, error);
      }
    }
  }
  WARN("featurized backward vs finite differences: worst relative error " << worst);
}

TEST_CASE("backward through each feature map matches central finite differences", "[backward]") {
  constexpr Eigen::Index n = 9, dk = 4, dv = 3;
  const linattn::EluPlusOne elu;
  const linattn::Relu relu;
  const linattn::PositiveRandomFeatures favor(dk, 6, 21);
  linattn::RandomFeatureOptions hyperbolic_options;
  hyperbolic_options.hyperbolic = true;
  const linattn::PositiveRandomFeatures hyperbolic(dk, 6, 22, hyperbolic_options);
  const linattn::RandomFourierFeatures fourier(dk, 6, 23);
  // Relu's kink at 0 would break the differences: keep inputs at least 0.05 away from it.
  Matrix<double> q = gaussian<double>(n, dk, 24);
  Matrix<double> k = gaussian<double>(n, dk, 25);
  for (Matrix<double>* x : {&q, &k}) {
    *x = x->unaryExpr([](double a) { return a >= 0 ? a + 0.05 : a - 0.05; });
  }
  // Fourier features: small inputs keep the Gaussian kernel near 1 (denominators near N).
  const Matrix<double> q_small = 0.3 * q;
  const Matrix<double> k_small = 0.3 * k;
  const Matrix<double> v = gaussian<double>(n, dv, 26);
  const Matrix<double> grad_out = gaussian<double>(n, dv, 27);
  double worst = 0.0;
  const auto check = [&](const auto& map, const char* name, const Matrix<double>& qx,
                         const Matrix<double>& kx) {
    for (const bool causal : {true, false}) {
      linattn::Options options;
      options.chunk = 4;
      options.decay = causal ? 0.9 : 1.0;
      const auto forward = [&](const Matrix<double>& a, const Matrix<double>& b,
                               const Matrix<double>& values) {
        return causal ? linattn::causal_linear_attention(a, b, values, map, options)
                      : linattn::linear_attention(a, b, values, map, options);
      };
      const AttentionGradients<double> got =
          causal ? linattn::causal_linear_attention_backward(qx, kx, v, grad_out, map, options)
                 : linattn::linear_attention_backward(qx, kx, v, grad_out, map, options);
      const AttentionGradients<double> want{
          finite_differences(qx, grad_out,
                             [&](const Matrix<double>& x) { return forward(x, kx, v); }),
          finite_differences(kx, grad_out,
                             [&](const Matrix<double>& x) { return forward(qx, x, v); }),
          finite_differences(v, grad_out,
                             [&](const Matrix<double>& x) { return forward(qx, kx, x); })};
      const double error = worst_error(got, want);
      INFO(name << ", causal = " << causal);
      CHECK(error <= 1e-6);
      worst = std::max(worst, error);
    }
  };
  check(elu, "EluPlusOne", q, k);
  check(relu, "Relu", q, k);
  check(favor, "PositiveRandomFeatures", q, k);
  check(hyperbolic, "PositiveRandomFeatures (hyperbolic)", q, k);
  check(fourier, "RandomFourierFeatures", q_small, k_small);
  WARN("mapped backward vs finite differences: worst relative error " << worst);
}

TEMPLATE_TEST_CASE("chunked backward matches a naive reverse-mode reference", "[backward]", float,
                   double) {
  using T = TestType;
  constexpr Eigen::Index c = 16, dv = 12;
  double worst = 0.0;
  for (const Eigen::Index n : {1, 7, 64, 65, 700, 4096}) {
    const auto seed = static_cast<std::uint64_t>(300 + n);
    const Matrix<T> q = positive_features(n, c, seed).template cast<T>();
    const Matrix<T> k = positive_features(n, c, seed + 1).template cast<T>();
    const Matrix<T> v = gaussian<T>(n, dv, seed + 2);
    const Matrix<T> grad_out = gaussian<T>(n, dv, seed + 3);
    const Matrix<double> qd = q.template cast<double>(), kd = k.template cast<double>();
    const Matrix<double> vd = v.template cast<double>(), gd = grad_out.template cast<double>();
    for (const bool causal : {true, false}) {
      // Strong decays split each chunk into pieces whose weights stay in range (0.3: about
      // 33 tokens in float; 1e-3: 5 in float, 43 in double).
      for (const double decay : {1.0, 0.97, 0.3, 1e-3}) {
        if (!causal && decay != 1.0) continue;
        for (const bool normalize : {true, false}) {
          // The reference is O(N^2): at N = 4096 only the default settings.
          if (n == 4096 && !(normalize && decay == 1.0)) continue;
          linattn::Options options;
          options.decay = decay;
          options.normalize = normalize;
          AttentionGradients<double> magnitude;
          const AttentionGradients<double> want =
              naive_backward(qd, kd, vd, gd, causal, decay, options.eps, normalize, &magnitude);
          for (const Eigen::Index chunk : {16, 64}) {
            options.chunk = chunk;
            const AttentionGradients<T> got =
                causal ? linattn::causal_linear_attention_backward(q, k, v, grad_out,
                                                                   linattn::Identity{}, options)
                       : linattn::linear_attention_backward(q, k, v, grad_out, linattn::Identity{},
                                                            options);
            // Relative to the largest gradient; at N = 1 relative to the cancelling terms.
            const double error =
                n == 1 ? scaled_error(got, want, magnitude) : worst_error(got, want);
            INFO("N = " << n << ", causal = " << causal << ", decay = " << decay
                        << ", normalize = " << normalize << ", chunk = " << chunk);
            // With decay 1e-3 each output is nearly its own token's v, so d phi_q's two terms
            // (S_t G_t / d_t and z_t g_t) cancel to about 1e-3 of their size: float keeps
            // fewer correct digits of the difference (double passes the plain bound).
            const double tolerance = normalize && decay < 0.01 ? 50 * reference_tolerance<T>()
                                                               : reference_tolerance<T>();
            CHECK(error <= tolerance);
            worst = std::max(worst, error);
          }
        }
      }
    }
  }
  WARN("backward vs naive reverse mode (" << (std::is_same_v<T, float> ? "float" : "double")
                                          << "): worst relative error " << worst);
}

TEMPLATE_TEST_CASE("backward writes through Maps and column-major inputs, and _into matches",
                   "[backward]", float, double) {
  using T = TestType;
  constexpr Eigen::Index n = 150, c = 6, dv = 5;
  const Matrix<T> q = positive_features(n, c, 41).template cast<T>();
  const Matrix<T> k = positive_features(n, c, 42).template cast<T>();
  const Matrix<T> v = gaussian<T>(n, dv, 43);
  const Matrix<T> grad_out = gaussian<T>(n, dv, 44);
  const AttentionGradients<T> plain =
      linattn::causal_linear_attention_backward(q, k, v, grad_out, linattn::Identity{});
  const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic> k_col = k;
  const Eigen::Map<const Matrix<T>> v_map(v.data(), n, dv);
  Matrix<T> gq(n, c), gk(n, c), gv(n, dv);
  linattn::causal_linear_attention_backward_into(q, k_col, v_map, grad_out, linattn::Identity{}, gq,
                                                 gk, gv);
  CHECK(gq == plain.q);
  CHECK(gk == plain.k);
  CHECK(gv == plain.v);
  // The accumulation type: float inputs, double sums, at least as close to the reference.
  if constexpr (std::is_same_v<T, float>) {
    const AttentionGradients<double> want = naive_backward(
        q.template cast<double>(), k.template cast<double>(), v.template cast<double>(),
        grad_out.template cast<double>(), true, 1.0, 1e-6, true);
    const AttentionGradients<float> wide =
        linattn::causal_linear_attention_backward<double>(q, k, v, grad_out, linattn::Identity{});
    CHECK(worst_error(wide, want) <= 2e-7);  // float rounding of the result alone
    CHECK(worst_error(wide, want) <= worst_error(plain, want) + 1e-9);
  }
}

#ifdef _OPENMP
TEMPLATE_TEST_CASE("backward on several threads matches one thread", "[backward][threads]", float,
                   double) {
  using T = TestType;
  constexpr Eigen::Index n = 5000, c = 8, dv = 8;
  const Matrix<T> q = positive_features(n, c, 51).template cast<T>();
  const Matrix<T> k = positive_features(n, c, 52).template cast<T>();
  const Matrix<T> v = gaussian<T>(n, dv, 53);
  const Matrix<T> grad_out = gaussian<T>(n, dv, 54);
  // Segments of at least 1024 tokens: 2 and 3 threads split N = 5000 in 2 and 3.
  for (const int threads : {2, 3}) {
    for (const double decay : {0.999, 1.0}) {
      for (const bool normalize : {true, false}) {
        linattn::Options one;
        one.threads = 1;
        one.decay = decay;
        one.normalize = normalize;
        linattn::Options many = one;
        many.threads = threads;
        const AttentionGradients<T> serial =
            linattn::causal_linear_attention_backward(q, k, v, grad_out, linattn::Identity{}, one);
        const AttentionGradients<T> parallel =
            linattn::causal_linear_attention_backward(q, k, v, grad_out, linattn::Identity{}, many);
        const double error =
            std::max({relative_error(parallel.q, serial.q), relative_error(parallel.k, serial.k),
                      relative_error(parallel.v, serial.v)});
        WARN("backward, " << threads << " threads vs 1 (decay " << decay << ", normalize "
                          << normalize << "): " << error);
        CHECK(error <= (std::is_same_v<T, float> ? 1e-5 : 1e-13));
      }
    }
  }
}
#endif

TEMPLATE_TEST_CASE("backward with Options::scale is the backward on scaled queries", "[backward]",
                   float, double) {
  // out(phi_q; s) = out(s phi_q; 1), so d/d phi_q at s is s times d/d(s phi_q) at 1, and the
  // gradients of phi_k and v are those of the call on s phi_q; causal (with a decay) and not.
  using T = TestType;
  const double bound = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  constexpr Eigen::Index n = 150, c = 5, dv = 4;
  const Matrix<T> q = positive_features(n, c, 71).template cast<T>();
  const Matrix<T> k = positive_features(n, c, 72).template cast<T>();
  const Matrix<T> v = gaussian<T>(n, dv, 73);
  const Matrix<T> grad_out = gaussian<T>(n, dv, 74);
  const T s = T(0.3);
  const Matrix<T> sq = q * s;
  for (const bool causal : {true, false}) {
    for (const bool normalize : {true, false}) {
      INFO("causal = " << causal << ", normalize = " << normalize);
      linattn::Options plain;
      plain.normalize = normalize;
      plain.decay = causal ? 0.98 : 1.0;
      plain.chunk = 32;
      linattn::Options scaled = plain;
      scaled.scale = static_cast<double>(s);
      const AttentionGradients<T> got =
          causal
              ? linattn::causal_linear_attention_backward(q, k, v, grad_out, linattn::Identity{},
                                                          scaled)
              : linattn::linear_attention_backward(q, k, v, grad_out, linattn::Identity{}, scaled);
      const AttentionGradients<T> want =
          causal
              ? linattn::causal_linear_attention_backward(sq, k, v, grad_out, linattn::Identity{},
                                                          plain)
              : linattn::linear_attention_backward(sq, k, v, grad_out, linattn::Identity{}, plain);
      CHECK(relative_error(got.q, (want.q * s).eval()) <= bound);
      CHECK(relative_error(got.k, want.k) <= bound);
      CHECK(relative_error(got.v, want.v) <= bound);
    }
  }
}

TEMPLATE_TEST_CASE("backward rejects bad input and writes nothing", "[backward][errors]", float) {
  using T = TestType;
  constexpr Eigen::Index n = 20, c = 4, dv = 3;
  const Matrix<T> q = positive_features(n, c, 61).template cast<T>();
  const Matrix<T> k = positive_features(n, c, 62).template cast<T>();
  const Matrix<T> v = gaussian<T>(n, dv, 63);
  Matrix<T> grad_out = gaussian<T>(n, dv, 64);
  Matrix<T> gq = Matrix<T>::Constant(n, c, T(7)), gk = gq, gv = Matrix<T>::Constant(n, dv, T(7));
  const auto untouched = [&] {
    return (gq.array() == T(7)).all() && (gk.array() == T(7)).all() && (gv.array() == T(7)).all();
  };
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(linattn::causal_linear_attention_backward(
                        q, k, v, grad_out.topRows(n - 1).eval(), linattn::Identity{}),
                    Contains("grad_out is 19 x 3"));
  CHECK_THROWS_WITH(linattn::causal_linear_attention_backward_into(
                        q, k, v, grad_out, linattn::Identity{}, gq.leftCols(c - 1), gk, gv),
                    Contains("grad_phi_q is 20 x 3"));
  CHECK_THROWS_WITH(linattn::linear_attention_backward_into(q, k, v, grad_out, linattn::Identity{},
                                                            gq, gk, gv.topRows(n - 2)),
                    Contains("grad_v is 18 x 3"));
  grad_out(n - 1, 2) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH(linattn::causal_linear_attention_backward_into(q, k, v, grad_out,
                                                                   linattn::Identity{}, gq, gk, gv),
                    Contains("grad_out has a non-finite value") && Contains("row 19, column 2"));
  CHECK(untouched());
  const Matrix<T> raw = gaussian<T>(n, 5, 65);
  CHECK_THROWS_WITH(linattn::EluPlusOne{}.backward(raw, raw.leftCols(4)),
                    Contains("EluPlusOne::backward: grad_phi is 20 x 4"));
  const linattn::PositiveRandomFeatures favor(5, 8, 1);
  CHECK_THROWS_WITH(favor.backward(raw, raw), Contains("expected 20 x 8"));
}

TEST_CASE("mapped backward says when exponential features overflow the accumulation type",
          "[backward][errors]") {
  constexpr Eigen::Index n = 6, dk = 256, dv = 2;
  const linattn::PositiveRandomFeatures favor(dk, 16, 3);
  // u = w_r gives the feature exp(|w_r|^2 / 2) / sqrt(m), near exp(128): past float, not double.
  const Matrix<double> aligned = favor.projection().topRows(n) / std::sqrt(favor.temperature());
  const Matrix<float> q = aligned.cast<float>();
  const Matrix<float> k = aligned.colwise().reverse().cast<float>();
  const Matrix<float> v = gaussian<float>(n, dv, 73);
  const Matrix<float> grad_out = gaussian<float>(n, dv, 74);
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(linattn::causal_linear_attention_backward(q, k, v, grad_out, favor),
                    Contains("overflows float"));
  const AttentionGradients<float> wide =
      linattn::causal_linear_attention_backward<double>(q, k, v, grad_out, favor);
  CHECK(wide.q.allFinite());
  CHECK(wide.k.allFinite());
  CHECK(wide.v.allFinite());
}

TEMPLATE_TEST_CASE("backward with a workspace gives the allocating call's gradients, bit for bit",
                   "[backward][workspace]", float, double) {
  using T = TestType;
  constexpr Eigen::Index c = 16, dv = 12;
  linattn::BackwardWorkspace<T> workspace;
  // Lengths that grow, shrink and grow again: the workspace serves each one.
  for (const Eigen::Index n : {700, 64, 1, 1500}) {
    const auto seed = static_cast<std::uint64_t>(900 + n);
    const Matrix<T> q = positive_features(n, c, seed).template cast<T>();
    const Matrix<T> k = positive_features(n, c, seed + 1).template cast<T>();
    const Matrix<T> v = gaussian<T>(n, dv, seed + 2);
    const Matrix<T> grad_out = gaussian<T>(n, dv, seed + 3);
    for (const double decay : {1.0, 0.9}) {
      linattn::Options options;
      options.decay = decay;
      options.threads = 1;
      auto check = [&](const auto& map) {
        const AttentionGradients<T> want =
            linattn::causal_linear_attention_backward(q, k, v, grad_out, map, options);
        Matrix<T> gq(n, c), gk(n, c), gv(n, dv);
        linattn::causal_linear_attention_backward_into(q, k, v, grad_out, map, gq, gk, gv, options,
                                                       workspace);
        INFO("N = " << n << ", decay = " << decay);
        CHECK(gq == want.q);
        CHECK(gk == want.k);
        CHECK(gv == want.v);
      };
      check(linattn::Identity{});
      check(linattn::EluPlusOne{});
    }
  }
  // The documented size bounds what the buffers hold for the longest call.
  const std::size_t bytes = linattn::BackwardWorkspace<T>::bytes(1500, c, dv, 1);
  CHECK(bytes >= sizeof(T) * (2 * 1500 + 64 * (c + dv)));
  CHECK(bytes <= sizeof(T) * (2 * 1500 + 64 * (5 * c + 3 * dv + 2)) + sizeof(double) * 2 * 64);
}

}  // namespace linattn_test_backward
