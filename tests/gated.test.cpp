// Gated linear attention: the chunked, recurrent and backward forms against naive token-by-token
// references written here in double, independent of the library's kernels.
// EIGEN_RUNTIME_NO_MALLOC lets a test forbid heap allocation inside Eigen.
#ifndef EIGEN_RUNTIME_NO_MALLOC  // a test bundle defines it for all its files
#define EIGEN_RUNTIME_NO_MALLOC
#endif
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/feature_maps.hpp>
#include <linattn/gated.hpp>
#include <random>
#include <type_traits>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_gated {

using linattn::Matrix;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

namespace {

constexpr Eigen::Index kC = 8;  // C != Dv on purpose
constexpr Eigen::Index kDv = 6;

/// docs/design.md's agreement bounds between the chunked and recurrent forms.
template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

/// exp(0.5 x) of Gaussian x: positive features, so denominators are well conditioned.
template <class T>
Matrix<T> positive_features(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed) {
  return gaussian<double>(rows, cols, seed, 0.5).array().exp().matrix().template cast<T>();
}

/// Gates uniform in [lo, hi), with about one in eight exactly 1 when `ones`.
template <class T>
Matrix<T> uniform_gates(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed, double lo,
                        double hi, bool ones = true) {
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<double> uniform(lo, hi);
  std::uniform_int_distribution<int> pick(0, 7);
  Matrix<T> m(rows, cols);
  for (Eigen::Index r = 0; r < rows; ++r) {
    for (Eigen::Index c = 0; c < cols; ++c) {
      const bool one = pick(engine) == 0 && ones;
      m(r, c) = one ? T(1) : static_cast<T>(uniform(engine));
    }
  }
  return m;
}

/// Each gate drawn from `choices` with equal odds.
template <class T>
Matrix<T> mixed_gates(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed,
                      const std::vector<T>& choices) {
  std::mt19937_64 engine(seed);
  std::uniform_int_distribution<std::size_t> pick(0, choices.size() - 1);
  Matrix<T> m(rows, cols);
  for (Eigen::Index r = 0; r < rows; ++r) {
    for (Eigen::Index c = 0; c < cols; ++c) m(r, c) = choices[pick(engine)];
  }
  return m;
}

/// The denominator guard as documented: |d| < eps becomes sign(d) eps.
double guarded(double raw, double eps) {
  if (std::abs(raw) >= eps) return raw;
  return raw < 0 ? -eps : eps;
}

/// S <- diag(a) S, z <- a o z, for a scalar (1 entry) or per-feature gate row.
void apply_gate(const Eigen::RowVectorXd& a, Matrix<double>& s, Eigen::VectorXd& z) {
  if (a.size() == 1) {
    s *= a(0);
    z *= a(0);
    return;
  }
  for (Eigen::Index c = 0; c < s.rows(); ++c) {
    s.row(c) *= a(c);
    z(c) *= a(c);
  }
}

/// Naive reference: the recurrence token by token, in double.
Matrix<double> naive_gated(const Matrix<double>& q, const Matrix<double>& k,
                           const Matrix<double>& v, const Matrix<double>& gates, double eps,
                           bool normalize) {
  const Eigen::Index n = q.rows();
  Matrix<double> s = Matrix<double>::Zero(q.cols(), v.cols());
  Eigen::VectorXd z = Eigen::VectorXd::Zero(q.cols());
  Matrix<double> out(n, v.cols());
  for (Eigen::Index t = 0; t < n; ++t) {
    apply_gate(gates.row(t), s, z);
    s += k.row(t).transpose() * v.row(t);
    z += k.row(t).transpose();
    const Eigen::RowVectorXd num = q.row(t) * s;
    if (!normalize) {
      out.row(t) = num;
      continue;
    }
    const double d = guarded(q.row(t).dot(z) + eps, eps);
    out.row(t) = d == 0.0 ? Eigen::RowVectorXd::Zero(v.cols()) : Eigen::RowVectorXd(num / d);
  }
  return out;
}

struct NaiveGradients {
  Matrix<double> q, k, v, gates;
};

/// Naive reverse mode through the recurrence, token by token, in double: keeps every S_t and
/// z_t (O(N C Dv), fine for a test) and walks back with dS, dz.
NaiveGradients naive_gated_backward(const Matrix<double>& q, const Matrix<double>& k,
                                    const Matrix<double>& v, const Matrix<double>& gates,
                                    const Matrix<double>& grad_out, double eps, bool normalize) {
  const Eigen::Index n = q.rows();
  const Eigen::Index c = q.cols();
  const Eigen::Index dv = v.cols();
  std::vector<Matrix<double>> states(static_cast<std::size_t>(n));
  std::vector<Eigen::VectorXd> sums(static_cast<std::size_t>(n));
  Matrix<double> s = Matrix<double>::Zero(c, dv);
  Eigen::VectorXd z = Eigen::VectorXd::Zero(c);
  for (Eigen::Index t = 0; t < n; ++t) {
    apply_gate(gates.row(t), s, z);
    s += k.row(t).transpose() * v.row(t);
    z += k.row(t).transpose();
    states[static_cast<std::size_t>(t)] = s;
    sums[static_cast<std::size_t>(t)] = z;
  }
  NaiveGradients g{Matrix<double>(n, c), Matrix<double>(n, c), Matrix<double>(n, dv),
                   Matrix<double>(n, gates.cols())};
  Matrix<double> ds = Matrix<double>::Zero(c, dv);
  Eigen::VectorXd dz = Eigen::VectorXd::Zero(c);
  for (Eigen::Index t = n - 1; t >= 0; --t) {
    const Matrix<double>& st = states[static_cast<std::size_t>(t)];
    const Eigen::VectorXd& zt = sums[static_cast<std::size_t>(t)];
    Eigen::RowVectorXd gnum = grad_out.row(t);
    double gden = 0.0;
    if (normalize) {
      const double raw = q.row(t).dot(zt) + eps;
      const double d = guarded(raw, eps);
      if (d == 0.0) {
        gnum.setZero();
      } else {
        const Eigen::RowVectorXd out = (q.row(t) * st) / d;
        gnum = grad_out.row(t) / d;
        gden = std::abs(raw) < eps ? 0.0 : -grad_out.row(t).dot(out) / d;
      }
    }
    g.q.row(t) = (st * gnum.transpose() + zt * gden).transpose();
    ds += q.row(t).transpose() * gnum;
    dz += q.row(t).transpose() * gden;
    g.k.row(t) = (ds * v.row(t).transpose() + dz).transpose();
    g.v.row(t) = k.row(t) * ds;
    Eigen::VectorXd da = Eigen::VectorXd::Zero(c);
    if (t > 0) {
      const Matrix<double>& prev = states[static_cast<std::size_t>(t - 1)];
      const Eigen::VectorXd& zprev = sums[static_cast<std::size_t>(t - 1)];
      da = ds.cwiseProduct(prev).rowwise().sum() + dz.cwiseProduct(zprev);
    }
    if (gates.cols() == 1) {
      g.gates(t, 0) = da.sum();
    } else {
      g.gates.row(t) = da.transpose();
    }
    apply_gate(gates.row(t), ds, dz);
  }
  return g;
}

/// A problem in T and the same (rounded) inputs in double for the reference.
template <class T>
struct Problem {
  Matrix<T> q, k, v, gates;
  Matrix<double> qd, kd, vd, gd;
  /// Gates in [lo, hi), about one in eight exactly 1 unless hi < 1.
  Problem(Eigen::Index n, Eigen::Index gate_cols, std::uint64_t seed, double lo = 0.75,
          double hi = 1.0, Eigen::Index c = kC, Eigen::Index dv = kDv)
      : q(positive_features<T>(n, c, seed)),
        k(positive_features<T>(n, c, seed + 1)),
        v(gaussian<T>(n, dv, seed + 2)),
        gates(uniform_gates<T>(n, gate_cols, seed + 3, lo, hi, hi >= 1.0)) {
    refresh();
  }
  void refresh() {
    qd = q.template cast<double>();
    kd = k.template cast<double>();
    vd = v.template cast<double>();
    gd = gates.template cast<double>();
  }
};

const char* gate_kind(Eigen::Index cols) { return cols == 1 ? "scalar" : "per-feature"; }

}  // namespace

TEMPLATE_TEST_CASE("gated: chunked, recurrent and prefill forms match the naive recurrence",
                   "[gated]", float, double) {
  using T = TestType;
  double worst_chunked = 0.0, worst_step = 0.0, worst_pieces = 0.0;
  for (const Eigen::Index n : {1, 7, 64, 65, 300, 1000}) {
    for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
      const Problem<T> p(n, gate_cols, 100 + static_cast<std::uint64_t>(n) + gate_cols);
      for (const bool normalize : {true, false}) {
        const Matrix<double> expected = naive_gated(p.qd, p.kd, p.vd, p.gd, 1e-6, normalize);
        REQUIRE(expected.allFinite());
        INFO("N = " << n << ", " << gate_kind(gate_cols) << " gates, normalize = " << normalize);
        for (const Eigen::Index chunk : {16, 64, 128}) {
          INFO("chunk = " << chunk);
          linattn::Options options;
          options.normalize = normalize;
          options.chunk = chunk;
          const Matrix<T> out = linattn::causal_gated_linear_attention(
              p.q, p.k, p.v, p.gates, linattn::Identity{}, options);
          const double e = relative_error(out, expected);
          CHECK(e <= tolerance<T>());
          worst_chunked = std::max(worst_chunked, e);

          // Prefill in three uneven pieces, from the state each leaves.
          linattn::GatedRecurrentState<T> pieces(kC, kDv, options);
          Matrix<T> joined(n, kDv);
          const Eigen::Index cut1 = n / 3;
          const Eigen::Index cut2 = std::max(cut1, (2 * n) / 3 + 1);
          const Eigen::Index ends[] = {cut1, std::min(cut2, n), n};
          Eigen::Index begin = 0;
          for (const Eigen::Index end : ends) {
            if (end > begin) {
              joined.middleRows(begin, end - begin) = pieces.prefill(
                  p.q.middleRows(begin, end - begin), p.k.middleRows(begin, end - begin),
                  p.v.middleRows(begin, end - begin), p.gates.middleRows(begin, end - begin),
                  linattn::Identity{});
            }
            begin = end;
          }
          CHECK(pieces.tokens() == n);
          const double ep = std::max(relative_error(joined, out), relative_error(joined, expected));
          CHECK(ep <= tolerance<T>());
          worst_pieces = std::max(worst_pieces, ep);
        }
        linattn::Options options;
        options.normalize = normalize;
        linattn::GatedRecurrentState<T> state(kC, kDv, options);
        Matrix<T> stepped(n, kDv);
        for (Eigen::Index t = 0; t < n; ++t) {
          stepped.row(t) =
              state.step(p.q.row(t), p.k.row(t), p.v.row(t), p.gates.row(t), linattn::Identity{});
        }
        const double es = relative_error(stepped, expected);
        CHECK(es <= tolerance<T>());
        worst_step = std::max(worst_step, es);
      }
    }
  }
  WARN("gated worst relative error: chunked " << worst_chunked << ", step " << worst_step
                                              << ", prefill in pieces " << worst_pieces);
}

TEMPLATE_TEST_CASE("gated: prefill then step continues the same sequence", "[gated]", float,
                   double) {
  using T = TestType;
  const Eigen::Index n = 200;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
    const Problem<T> p(n, gate_cols, 77 + gate_cols);
    const Matrix<double> expected = naive_gated(p.qd, p.kd, p.vd, p.gd, 1e-6, true);
    linattn::Options options;
    options.chunk = 32;
    linattn::GatedRecurrentState<T> state(kC, kDv, options);
    Matrix<T> out(n, kDv);
    out.topRows(150) = state.prefill(p.q.topRows(150), p.k.topRows(150), p.v.topRows(150),
                                     p.gates.topRows(150), linattn::Identity{});
    for (Eigen::Index t = 150; t < n; ++t) {
      out.row(t) =
          state.step(p.q.row(t), p.k.row(t), p.v.row(t), p.gates.row(t), linattn::Identity{});
    }
    const double e = relative_error(out, expected);
    INFO(gate_kind(gate_cols) << " gates");
    CHECK(e <= tolerance<T>());
    WARN("prefill then step, " << gate_kind(gate_cols) << ": " << e);
    CHECK(state.tokens() == n);
    state.reset();
    CHECK(state.tokens() == 0);
    CHECK(state.s().isZero(0));
    CHECK(state.z().isZero(0));
  }
}

TEMPLATE_TEST_CASE("gated: gates near 0 and near 1 with long chunks stay finite and match",
                   "[gated]", float, double) {
  using T = TestType;
  constexpr bool is_float = std::is_same_v<T, float>;
  const T tiny = is_float ? T(1e-20) : T(1e-30);
  const T nearly_one = is_float ? T(1 - 1e-6) : T(1 - 1e-7);
  struct Case {
    const char* name;
    std::vector<T> choices;
  };
  // The last case puts nearly-1 gates after strong ones inside a chunk: the log-gate sums
  // reach 1e4 and the 1e-7 logs that follow must not be lost.
  const std::vector<Case> cases = {{"near 0", {tiny}},
                                   {"near 0 mixed with 1", {tiny, T(1), T(0.5), T(0.9)}},
                                   {"near 1", {nearly_one}},
                                   {"1", {T(1)}},
                                   {"near 0 mixed with near 1", {tiny, nearly_one, nearly_one}}};
  const Eigen::Index n = 1000;
  double worst = 0.0;
  for (const Case& c : cases) {
    for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
      Problem<T> p(n, gate_cols, 500 + gate_cols);
      p.gates = mixed_gates<T>(n, gate_cols, 900 + gate_cols, c.choices);
      p.refresh();
      for (const bool normalize : {true, false}) {
        INFO(c.name << ", " << gate_kind(gate_cols) << " gates, normalize = " << normalize);
        linattn::Options options;
        options.chunk = 256;
        options.normalize = normalize;
        const Matrix<double> expected = naive_gated(p.qd, p.kd, p.vd, p.gd, 1e-6, normalize);
        const Matrix<T> out = linattn::causal_gated_linear_attention(p.q, p.k, p.v, p.gates,
                                                                     linattn::Identity{}, options);
        linattn::GatedRecurrentState<T> state(kC, kDv, options);
        Matrix<T> stepped(n, kDv);
        for (Eigen::Index t = 0; t < n; ++t) {
          stepped.row(t) =
              state.step(p.q.row(t), p.k.row(t), p.v.row(t), p.gates.row(t), linattn::Identity{});
        }
        REQUIRE(out.allFinite());
        REQUIRE(stepped.allFinite());
        const double e = std::max(relative_error(out, expected), relative_error(stepped, expected));
        CHECK(e <= tolerance<T>());
        worst = std::max(worst, e);
      }
    }
  }
  WARN("extreme gates worst relative error " << worst);
}

TEST_CASE("gated step: per-feature gates within float's rounding of 1 still decay the state",
          "[gated]") {
  // Ten tokens, then 100,000 that only decay (zero keys): log gates of -1e-8 round to a factor
  // of exactly 1 in float and a_t = 1 - 2^-24 (c + 1) moves S by about one rounding step, so a
  // state multiplied in float each step would keep little of the decay (1e-3 to 4e-3 of S
  // here); the pending logs in double must give exp(sum of the logs).
  const Eigen::Index c = 4, dv = 3, written = 10, n = 100000;
  const Matrix<float> phi_q = gaussian<float>(1, c, 611).array().exp().matrix();
  const Matrix<float> phi_k = gaussian<float>(written, c, 612).array().exp().matrix();
  const Matrix<float> v = gaussian<float>(written, dv, 613);
  const Vector<float> zero_key = Vector<float>::Zero(c), zero_value = Vector<float>::Zero(dv);
  Eigen::RowVectorXf log_gate(c), gate(c);
  Eigen::ArrayXd total_log(c), total_linear(c);
  for (Eigen::Index j = 0; j < c; ++j) {
    log_gate(j) = -1e-8f * static_cast<float>(j + 1);
    gate(j) = 1.0f - std::ldexp(1.0f, -24) * static_cast<float>(j + 1);
    total_log(j) = static_cast<double>(n) * static_cast<double>(log_gate(j));
    total_linear(j) = static_cast<double>(n) * std::log(static_cast<double>(gate(j)));
  }
  REQUIRE(std::exp(log_gate(0)) == 1.0f);  // what a per-step float factor would be
  linattn::Options options;
  options.normalize = false;
  for (const bool log_space : {true, false}) {
    INFO((log_space ? "log gates" : "gates a_t"));
    linattn::RecurrentState<float> state(c, dv, options);
    Matrix<double> s = Matrix<double>::Zero(c, dv);
    Vector<float> out(dv);
    const auto step = [&](const auto& key, const auto& value) {
      if (log_space) {
        state.step_into(phi_q.row(0), key, value, linattn::log_gates(log_gate), linattn::Identity{},
                        out);
      } else {
        state.step_into(phi_q.row(0), key, value, gate, linattn::Identity{}, out);
      }
    };
    for (Eigen::Index t = 0; t < written; ++t) {
      step(phi_k.row(t), v.row(t));
      s += phi_k.row(t).transpose().cast<double>() * v.row(t).cast<double>();
    }
    for (Eigen::Index t = 0; t < n; ++t) step(zero_key, zero_value);
    const Eigen::ArrayXd decay = (log_space ? total_log : total_linear).exp();
    const Matrix<double> expected = decay.matrix().asDiagonal() * s;
    REQUIRE((decay < 1.0 - 1e-4).all());  // the decay is well above float's rounding
    CHECK(relative_error(state.s(), expected) <= 1e-6);
    CHECK(relative_error(out, (phi_q.cast<double>() * expected).transpose().eval()) <= 1e-6);
  }
}

TEST_CASE("gated: float inputs accumulated in double", "[gated]") {
  const Eigen::Index n = 1000;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
    const Problem<float> p(n, gate_cols, 31 + gate_cols);
    const Matrix<double> expected = naive_gated(p.qd, p.kd, p.vd, p.gd, 1e-6, true);
    const Matrix<float> out =
        linattn::causal_gated_linear_attention<double>(p.q, p.k, p.v, p.gates, linattn::Identity{});
    linattn::GatedRecurrentState<float, double> state(kC, kDv);
    const Matrix<float> pre = state.prefill(p.q, p.k, p.v, p.gates, linattn::Identity{});
    // Only the final rounding to float remains: a few float ulps of the largest entry.
    const double e = std::max(relative_error(out, expected), relative_error(pre, expected));
    INFO(gate_kind(gate_cols) << " gates");
    CHECK(e <= 3e-7);
    WARN("float in, double accumulator, " << gate_kind(gate_cols) << ": " << e);
  }
}

TEST_CASE("gated: any Eigen expression as input gives the same result", "[gated]") {
  const Eigen::Index n = 130;
  const Problem<double> p(n, kC, 8);
  linattn::Options options;
  options.chunk = 40;
  const Matrix<double> reference =
      linattn::causal_gated_linear_attention(p.q, p.k, p.v, p.gates, linattn::Identity{}, options);
  using ColMajor = Eigen::MatrixXd;
  const ColMajor q = p.q, k = p.k, v = p.v, gates = p.gates;
  const Matrix<double> wide = Matrix<double>::Ones(n, kC + 3);
  Matrix<double> padded = wide;
  padded.leftCols(kC) = p.q;
  Matrix<double> out = Matrix<double>::Zero(n + 4, kDv);
  linattn::causal_gated_linear_attention_into(padded.leftCols(kC), k, v.array().matrix(),
                                              gates * 1.0, linattn::Identity{},
                                              out.middleRows(2, n), options);
  CHECK(relative_error(out.middleRows(2, n), reference) <= 1e-14);
  CHECK(out.topRows(2).isZero(0));
  CHECK(out.bottomRows(2).isZero(0));
  const Matrix<double> from_col_major =
      linattn::causal_gated_linear_attention(q, k, v, gates, linattn::Identity{}, options);
  CHECK(relative_error(from_col_major, reference) <= 1e-14);
}

namespace {

/// L = sum(R o out), the scalar loss the finite differences differentiate.
double loss(const Matrix<double>& q, const Matrix<double>& k, const Matrix<double>& v,
            const Matrix<double>& gates, const Matrix<double>& r, const linattn::Options& options) {
  return linattn::causal_gated_linear_attention(q, k, v, gates, linattn::Identity{}, options)
      .cwiseProduct(r)
      .sum();
}

/// Central differences of `loss` in every entry of inputs[which]; h relative to the entry.
Matrix<double> finite_differences(std::vector<Matrix<double>> inputs, std::size_t which,
                                  const Matrix<double>& r, const linattn::Options& options) {
  Matrix<double>& x = inputs[which];
  Matrix<double> grad(x.rows(), x.cols());
  for (Eigen::Index i = 0; i < x.rows(); ++i) {
    for (Eigen::Index j = 0; j < x.cols(); ++j) {
      const double saved = x(i, j);
      const double h = 1e-6 * std::max(1.0, std::abs(saved));
      x(i, j) = saved + h;
      const double up = loss(inputs[0], inputs[1], inputs[2], inputs[3], r, options);
      x(i, j) = saved - h;
      const double down = loss(inputs[0], inputs[1], inputs[2], inputs[3], r, options);
      x(i, j) = saved;
      grad(i, j) = (up - down) / (2 * h);
    }
  }
  return grad;
}

}  // namespace

TEST_CASE("gated backward: matches central finite differences", "[gated][backward]") {
  const Eigen::Index c = 4;
  const Eigen::Index dv = 3;
  double worst = 0.0, worst_naive = 0.0;
  // N = 9 with chunk 4 crosses chunks; N = 40 with chunk 64 crosses secondary blocks.
  for (const auto& [n, chunk] : {std::pair<Eigen::Index, Eigen::Index>{9, 4}, {40, 64}}) {
    for (const Eigen::Index gate_cols : {Eigen::Index{1}, c}) {
      // Gates in (0.3, 0.95): a +- h stays inside (0, 1].
      const Problem<double> p(n, gate_cols, 60 + n + gate_cols, 0.3, 0.95, c, dv);
      const Matrix<double> r = gaussian<double>(n, dv, 61 + n);
      for (const bool normalize : {true, false}) {
        INFO("N = " << n << ", " << gate_kind(gate_cols) << " gates, normalize = " << normalize);
        linattn::Options options;
        options.normalize = normalize;
        options.chunk = chunk;
        const linattn::GatedAttentionGradients<double> g =
            linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, p.gates, r,
                                                            linattn::Identity{}, options);
        const NaiveGradients naive =
            naive_gated_backward(p.qd, p.kd, p.vd, p.gd, r, options.eps, normalize);
        const std::vector<Matrix<double>> inputs = {p.q, p.k, p.v, p.gates};
        const Matrix<double>* analytic[] = {&g.q, &g.k, &g.v, &g.gates};
        const Matrix<double>* reference[] = {&naive.q, &naive.k, &naive.v, &naive.gates};
        const char* names[] = {"phi_q", "phi_k", "v", "gates"};
        for (std::size_t i = 0; i < 4; ++i) {
          const Matrix<double> fd = finite_differences(inputs, i, r, options);
          REQUIRE(analytic[i]->rows() == fd.rows());
          REQUIRE(analytic[i]->cols() == fd.cols());
          const double e = relative_error(*analytic[i], fd);
          const double en = relative_error(*reference[i], fd);
          INFO("d " << names[i] << ": library " << e << ", naive reference " << en);
          CHECK(e <= 1e-6);
          CHECK(en <= 1e-6);
          worst = std::max(worst, e);
          worst_naive = std::max(worst_naive, en);
        }
      }
    }
  }
  WARN("backward vs finite differences: library " << worst << ", naive reference " << worst_naive);
}

TEMPLATE_TEST_CASE("gated backward: chunked matches the naive reverse mode", "[gated][backward]",
                   float, double) {
  // Float: each gradient is a sum over up to ~1/(1 - a) decayed terms computed in float, and the
  // gate gradient a reverse cumulative sum of differences phi_q o dphi_q - phi_k o dphi_k whose
  // terms are larger than the result; 1e-4 leaves room over the measured error. Double: the
  // same sums at 1e-16 per operation, with the gate sum over N = 4096 terms: 1e-10.
  using T = TestType;
  const double bound = std::is_same_v<T, float> ? 1e-4 : 1e-10;
  double worst[4] = {0, 0, 0, 0};
  const char* names[] = {"phi_q", "phi_k", "v", "gates"};
  for (const Eigen::Index n : {1, 2, 33, 300, 4096}) {
    for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
      const Problem<T> p(n, gate_cols, 700 + static_cast<std::uint64_t>(n) + gate_cols);
      const Matrix<T> grad_out = gaussian<T>(n, kDv, 701 + static_cast<std::uint64_t>(n));
      const Matrix<double> god = grad_out.template cast<double>();
      for (const bool normalize : {true, false}) {
        // One normalized token is ill-conditioned in phi_q, phi_k: out = v (q.k) / (q.k + eps)
        // barely depends on them, so their gradients are O(eps) differences of O(1) terms.
        if (n == 1 && normalize) continue;
        const NaiveGradients naive =
            naive_gated_backward(p.qd, p.kd, p.vd, p.gd, god, 1e-6, normalize);
        for (const Eigen::Index chunk : {16, 100}) {
          INFO("N = " << n << ", " << gate_kind(gate_cols) << " gates, normalize = " << normalize
                      << ", chunk = " << chunk);
          linattn::Options options;
          options.normalize = normalize;
          options.chunk = chunk;
          linattn::GatedAttentionGradients<T> g;
          linattn::causal_gated_linear_attention_backward_into(p.q, p.k, p.v, p.gates, grad_out,
                                                               linattn::Identity{}, g, options);
          const Matrix<T>* got[] = {&g.q, &g.k, &g.v, &g.gates};
          const Matrix<double>* want[] = {&naive.q, &naive.k, &naive.v, &naive.gates};
          for (int i = 0; i < 4; ++i) {
            REQUIRE(got[i]->rows() == want[i]->rows());
            REQUIRE(got[i]->cols() == want[i]->cols());
            const double e = relative_error(*got[i], *want[i]);
            INFO("d " << names[i] << " " << e);
            CHECK(e <= bound);
            worst[i] = std::max(worst[i], e);
          }
        }
      }
    }
  }
  WARN("backward vs naive reverse mode, worst relative error: phi_q "
       << worst[0] << ", phi_k " << worst[1] << ", v " << worst[2] << ", gates " << worst[3]);
}

TEMPLATE_TEST_CASE("gated backward: gates near 0 stay finite and match", "[gated][backward]", float,
                   double) {
  using T = TestType;
  const T tiny = std::is_same_v<T, float> ? T(1e-20) : T(1e-30);
  const double bound = std::is_same_v<T, float> ? 1e-4 : 1e-10;
  const Eigen::Index n = 600;
  double worst = 0.0;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
    Problem<T> p(n, gate_cols, 40 + gate_cols);
    p.gates = mixed_gates<T>(n, gate_cols, 41 + gate_cols, {tiny, T(1), T(0.9)});
    p.refresh();
    const Matrix<T> grad_out = gaussian<T>(n, kDv, 42);
    linattn::Options options;
    options.chunk = 256;
    const linattn::GatedAttentionGradients<T> g = linattn::causal_gated_linear_attention_backward(
        p.q, p.k, p.v, p.gates, grad_out, linattn::Identity{}, options);
    const NaiveGradients naive =
        naive_gated_backward(p.qd, p.kd, p.vd, p.gd, grad_out.template cast<double>(), 1e-6, true);
    REQUIRE(g.q.allFinite());
    REQUIRE(g.k.allFinite());
    REQUIRE(g.v.allFinite());
    REQUIRE(g.gates.allFinite());
    // d a_t = d log a_t / a_t is huge for a tiny gate, so compare d log a_t = a_t d a_t.
    const Matrix<double> dlog = g.gates.template cast<double>().cwiseProduct(p.gd);
    const Matrix<double> dlog_naive = naive.gates.cwiseProduct(p.gd);
    const double e = std::max({relative_error(g.q, naive.q), relative_error(g.k, naive.k),
                               relative_error(g.v, naive.v), relative_error(dlog, dlog_naive)});
    INFO(gate_kind(gate_cols) << " gates");
    CHECK(e <= bound);
    worst = std::max(worst, e);
  }
  WARN("backward with gates near 0, worst relative error " << worst);
}

TEMPLATE_TEST_CASE("gated backward: log gates give d L / d g, and a reset splits the documents",
                   "[gated][backward]", float, double) {
  // The gradient with respect to g = log a is a * (d L / d a). A reset (g = -infinity) makes the
  // tokens after it a document of their own: the gradients of q, k, v are those of two
  // separate calls, and the reset gate's own gradient is 0 (nothing depends on it).
  using T = TestType;
  const double bound = std::is_same_v<T, float> ? 1e-4 : 1e-10;
  const Eigen::Index n = 300;
  const Eigen::Index cut = 117;  // inside a chunk of 64
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
    INFO(gate_kind(gate_cols) << " gates");
    const Problem<T> p(n, gate_cols, 810 + gate_cols);
    const Matrix<T> grad_out = gaussian<T>(n, kDv, 811);
    const Matrix<T> logs = p.gates.array().log().matrix();
    const linattn::GatedAttentionGradients<T> by_a =
        linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, p.gates, grad_out,
                                                        linattn::Identity{});
    const linattn::GatedAttentionGradients<T> by_g =
        linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, linattn::log_gates(logs),
                                                        grad_out, linattn::Identity{});
    CHECK(relative_error(by_g.q, by_a.q) <= bound);
    CHECK(relative_error(by_g.k, by_a.k) <= bound);
    CHECK(relative_error(by_g.v, by_a.v) <= bound);
    const Matrix<T> chain = by_a.gates.cwiseProduct(p.gates);
    CHECK(relative_error(by_g.gates, chain) <= bound);

    Matrix<T> reset = logs;
    reset.row(cut).setConstant(-std::numeric_limits<T>::infinity());
    const linattn::GatedAttentionGradients<T> whole =
        linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, linattn::log_gates(reset),
                                                        grad_out, linattn::Identity{});
    const auto part = [&](Eigen::Index first, Eigen::Index rows) {
      return linattn::causal_gated_linear_attention_backward(
          p.q.middleRows(first, rows), p.k.middleRows(first, rows), p.v.middleRows(first, rows),
          linattn::log_gates(reset.middleRows(first, rows)), grad_out.middleRows(first, rows),
          linattn::Identity{});
    };
    const linattn::GatedAttentionGradients<T> before = part(0, cut);
    const linattn::GatedAttentionGradients<T> after = part(cut, n - cut);
    CHECK(relative_error(whole.q.topRows(cut), before.q) <= bound);
    CHECK(relative_error(whole.k.topRows(cut), before.k) <= bound);
    CHECK(relative_error(whole.v.topRows(cut), before.v) <= bound);
    CHECK(relative_error(whole.gates.topRows(cut), before.gates) <= bound);
    CHECK(relative_error(whole.q.bottomRows(n - cut), after.q) <= bound);
    CHECK(relative_error(whole.k.bottomRows(n - cut), after.k) <= bound);
    CHECK(relative_error(whole.v.bottomRows(n - cut), after.v) <= bound);
    CHECK(whole.gates.row(cut).isZero(0));
    CHECK(after.gates.row(0).isZero(0));
    CHECK(relative_error(whole.gates.bottomRows(n - cut - 1),
                         after.gates.bottomRows(n - cut - 1)) <= bound);
  }
}

TEMPLATE_TEST_CASE("gated backward: Options::scale scales phi_q", "[gated][backward]", float,
                   double) {
  // FLA's scale: out(q; s) = out(s q; 1), so d/dq at s is s times d/d(s q) at 1, and the
  // gradients of k, v and the gates are those of the call on s q.
  using T = TestType;
  const double bound = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  const T s = T(0.125);
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
    for (const bool normalize : {true, false}) {
      INFO(gate_kind(gate_cols) << " gates, normalize = " << normalize);
      const Problem<T> p(200, gate_cols, 830 + gate_cols);
      const Matrix<T> grad_out = gaussian<T>(200, kDv, 831);
      linattn::Options scaled;
      scaled.normalize = normalize;
      scaled.scale = static_cast<double>(s);
      linattn::Options plain;
      plain.normalize = normalize;
      const Matrix<T> sq = p.q * s;
      const linattn::GatedAttentionGradients<T> got =
          linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, p.gates, grad_out,
                                                          linattn::Identity{}, scaled);
      const linattn::GatedAttentionGradients<T> want =
          linattn::causal_gated_linear_attention_backward(sq, p.k, p.v, p.gates, grad_out,
                                                          linattn::Identity{}, plain);
      CHECK(relative_error(got.q, (want.q * s).eval()) <= bound);
      CHECK(relative_error(got.k, want.k) <= bound);
      CHECK(relative_error(got.v, want.v) <= bound);
      CHECK(relative_error(got.gates, want.gates) <= bound);
    }
  }
}

TEST_CASE("gated backward: threads give the one-thread gradients", "[gated][backward]") {
  // 8192 tokens split across the sequence (scalar and per-feature gates alike).
  const Eigen::Index n = 8192;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
    INFO(gate_kind(gate_cols) << " gates");
    const Problem<double> p(n, gate_cols, 850 + gate_cols, 0.97, 1.0);
    const Matrix<double> grad_out = gaussian<double>(n, kDv, 851);
    linattn::Options one;
    one.threads = 1;
    linattn::Options two;
    two.threads = 2;
    const linattn::GatedAttentionGradients<double> a =
        linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, p.gates, grad_out,
                                                        linattn::Identity{}, one);
    const linattn::GatedAttentionGradients<double> b =
        linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, p.gates, grad_out,
                                                        linattn::Identity{}, two);
    CHECK(relative_error(b.q, a.q) <= 1e-12);
    CHECK(relative_error(b.k, a.k) <= 1e-12);
    CHECK(relative_error(b.v, a.v) <= 1e-12);
    CHECK(relative_error(b.gates, a.gates) <= 1e-10);
    // Log gates with resets in every segment (and strong gates that split pieces), on two and
    // three threads: the states absorbed per segment carry the resets across.
    Matrix<double> g = p.gates.array().log().matrix();
    for (const Eigen::Index t : {100, 2047, 2048, 3000, 5000, 8191}) {
      g.row(t).setConstant(-std::numeric_limits<double>::infinity());
    }
    g.middleRows(6000, 50).setConstant(-3.0);
    const auto serial = linattn::causal_gated_linear_attention_backward(
        p.q, p.k, p.v, linattn::log_gates(g), grad_out, linattn::Identity{}, one);
    for (const int threads : {2, 3}) {
      linattn::Options many;
      many.threads = threads;
      const auto parallel = linattn::causal_gated_linear_attention_backward(
          p.q, p.k, p.v, linattn::log_gates(g), grad_out, linattn::Identity{}, many);
      INFO(threads << " threads, log gates with resets");
      CHECK(relative_error(parallel.q, serial.q) <= 1e-12);
      CHECK(relative_error(parallel.k, serial.k) <= 1e-12);
      CHECK(relative_error(parallel.v, serial.v) <= 1e-12);
      CHECK(relative_error(parallel.gates, serial.gates) <= 1e-10);
    }
  }
}

TEMPLATE_TEST_CASE("gated: bad input throws linattn::Error and writes nothing", "[gated]", float) {
  using T = TestType;
  const Eigen::Index n = 10;
  const Problem<T> p(n, 1, 3);
  const Matrix<T> per_feature = uniform_gates<T>(n, kC, 4, 0.5, 1.0);
  Matrix<T> out = Matrix<T>::Constant(n, kDv, T(7));
  const auto run = [&](const Matrix<T>& gates, const linattn::Options& options = {}) {
    linattn::causal_gated_linear_attention_into(p.q, p.k, p.v, gates, linattn::Identity{}, out,
                                                options);
  };
  const auto message = [&](const Matrix<T>& gates, const linattn::Options& options = {}) {
    try {
      run(gates, options);
    } catch (const linattn::Error& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };

  CHECK_THROWS_AS(run(Matrix<T>::Constant(n, 2, T(0.5))), linattn::Error);
  CHECK_THROWS_AS(run(Matrix<T>::Constant(n - 1, 1, T(0.5))), linattn::Error);
  CHECK_THAT(message(Matrix<T>::Constant(n, 3, T(0.5))), Catch::Contains("gates is 10 x 3") &&
                                                             Catch::Contains("10 x 1") &&
                                                             Catch::Contains("10 x 8"));

  Matrix<T> bad = per_feature;
  bad(3, 5) = T(0);
  CHECK_THAT(message(bad), Catch::Contains("(0, 1]") && Catch::Contains("row 3, column 5"));
  bad(3, 5) = T(1.0001);
  CHECK_THAT(message(bad), Catch::Contains("row 3, column 5"));
  bad(3, 5) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THAT(message(bad), Catch::Contains("row 3, column 5"));
  bad(3, 5) = T(-0.5);
  CHECK_THROWS_AS(run(bad), linattn::Error);
  // A NaN gate throws even with check_finite off: it is out of range, not merely non-finite.
  linattn::Options unchecked;
  unchecked.check_finite = false;
  bad(3, 5) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_AS(run(bad, unchecked), linattn::Error);

  linattn::Options decayed;
  decayed.decay = 0.9;
  CHECK_THAT(message(per_feature, decayed), Catch::Contains("decay"));
  linattn::Options no_chunk;
  no_chunk.chunk = 0;
  CHECK_THROWS_AS(run(per_feature, no_chunk), linattn::Error);

  Matrix<T> q_nan = p.q;
  q_nan(2, 1) = std::numeric_limits<T>::infinity();
  CHECK_THROWS_AS(linattn::causal_gated_linear_attention_into(q_nan, p.k, p.v, per_feature,
                                                              linattn::Identity{}, out, {}),
                  linattn::Error);
  Matrix<T> wrong_out(n, kDv + 1);
  CHECK_THROWS_AS(linattn::causal_gated_linear_attention_into(p.q, p.k, p.v, per_feature,
                                                              linattn::Identity{}, wrong_out, {}),
                  linattn::Error);
  CHECK((out.array() == T(7)).all());

  // Backward: the same checks, plus grad_out.
  Matrix<T> grad_out = gaussian<T>(n, kDv, 5);
  CHECK_NOTHROW(linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, p.gates, grad_out,
                                                                linattn::Identity{}));
  CHECK_THROWS_AS(linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, bad, grad_out,
                                                                  linattn::Identity{}),
                  linattn::Error);
  CHECK_THROWS_AS(linattn::causal_gated_linear_attention_backward(
                      p.q, p.k, p.v, p.gates, grad_out.leftCols(kDv - 1), linattn::Identity{}),
                  linattn::Error);
  CHECK_THROWS_AS(linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, p.gates, grad_out,
                                                                  linattn::Identity{}, decayed),
                  linattn::Error);
  grad_out(4, 0) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_AS(linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, p.gates, grad_out,
                                                                  linattn::Identity{}),
                  linattn::Error);

  // One state type serves every transition: a decayed state refuses gated tokens.
  linattn::RecurrentState<T> decayed_state(kC, kDv, decayed);
  CHECK_THROWS_WITH(
      decayed_state.step(p.q.row(0), p.k.row(0), p.v.row(0), p.gates.row(0), linattn::Identity{}),
      Catch::Contains("decay"));
  CHECK(decayed_state.tokens() == 0);
  CHECK_THROWS_AS(linattn::GatedRecurrentState<T>(0, kDv), linattn::Error);
}

TEMPLATE_TEST_CASE("gated state: a throwing call leaves the state unchanged", "[gated]", float) {
  using T = TestType;
  const Eigen::Index n = 20;
  const Problem<T> p(n, kC, 12);
  linattn::GatedRecurrentState<T> state(kC, kDv);
  state.prefill(p.q.topRows(10), p.k.topRows(10), p.v.topRows(10), p.gates.topRows(10),
                linattn::Identity{});
  const Matrix<T> s = state.s();
  const Vector<T> z = state.z();
  const Vector<T> q = p.q.row(10).transpose();
  const Vector<T> k = p.k.row(10).transpose();
  const Vector<T> v = p.v.row(10).transpose();
  Vector<T> gate = p.gates.row(10).transpose();
  Vector<T> out = Vector<T>::Constant(kDv, T(3));

  const auto unchanged = [&] {
    CHECK(state.s() == s);
    CHECK(state.z() == z);
    CHECK(state.tokens() == 10);
    CHECK((out.array() == T(3)).all());
  };
  gate(2) = T(0);
  CHECK_THROWS_AS(state.step_into(q, k, v, gate, linattn::Identity{}, out), linattn::Error);
  unchanged();
  gate(2) = T(1.5);
  CHECK_THROWS_AS(state.step_into(q, k, v, gate, linattn::Identity{}, out), linattn::Error);
  unchanged();
  gate(2) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_AS(state.step_into(q, k, v, gate, linattn::Identity{}, out), linattn::Error);
  unchanged();
  CHECK_THROWS_AS(
      state.step_into(q, k, v, Vector<T>::Constant(3, T(0.5)), linattn::Identity{}, out),
      linattn::Error);
  unchanged();
  CHECK_THROWS_AS(state.step_into(q, k, v, T(0), linattn::Identity{}, out), linattn::Error);
  unchanged();
  CHECK_THROWS_AS(state.step_into(q, k, v, T(2), linattn::Identity{}, out), linattn::Error);
  unchanged();
  Vector<T> q_nan = q;
  q_nan(0) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_AS(state.step_into(q_nan, k, v, T(0.5), linattn::Identity{}, out), linattn::Error);
  unchanged();
  CHECK_THROWS_AS(state.step_into(q, k, v.head(kDv - 1), T(0.5), linattn::Identity{}, out),
                  linattn::Error);
  unchanged();

  Matrix<T> bad_gates = p.gates.bottomRows(10);
  bad_gates(9, 7) = T(0);
  Matrix<T> rows_out = Matrix<T>::Constant(10, kDv, T(3));
  CHECK_THROWS_AS(state.prefill_into(p.q.bottomRows(10), p.k.bottomRows(10), p.v.bottomRows(10),
                                     bad_gates, linattn::Identity{}, rows_out),
                  linattn::Error);
  CHECK((rows_out.array() == T(3)).all());
  CHECK_THROWS_AS(state.prefill(p.q.bottomRows(10), p.k.bottomRows(10), p.v.bottomRows(10),
                                p.gates.bottomRows(10).leftCols(2), linattn::Identity{}),
                  linattn::Error);
  CHECK_THROWS_AS(state.prefill(p.q.bottomRows(10).leftCols(kC - 1),
                                p.k.bottomRows(10).leftCols(kC - 1), p.v.bottomRows(10),
                                p.gates.bottomRows(10).leftCols(kC - 1), linattn::Identity{}),
                  linattn::Error);
  unchanged();
}

TEMPLATE_TEST_CASE("gated state: step_into allocates nothing; scalar gate overloads agree",
                   "[gated]", float, double) {
  using T = TestType;
  const Eigen::Index n = 12;
  const Problem<T> p(n, 1, 21);
  const Matrix<T> per_feature = uniform_gates<T>(n, kC, 22, 0.5, 1.0);
  linattn::GatedRecurrentState<T> by_scalar(kC, kDv);
  linattn::GatedRecurrentState<T> by_vector(kC, kDv);
  linattn::GatedRecurrentState<T> by_features(kC, kDv);
  linattn::GatedRecurrentState<T> by_broadcast(kC, kDv);
  Vector<T> a(kDv), b(kDv), c(kDv), d(kDv);
  for (Eigen::Index t = 0; t < n; ++t) {
    const Vector<T> broadcast = Vector<T>::Constant(kC, p.gates(t, 0));
    Eigen::internal::set_is_malloc_allowed(false);
    by_scalar.step_into(p.q.row(t), p.k.row(t), p.v.row(t), p.gates(t, 0), linattn::Identity{}, a);
    by_vector.step_into(p.q.row(t), p.k.row(t), p.v.row(t), p.gates.row(t), linattn::Identity{}, b);
    by_features.step_into(p.q.row(t), p.k.row(t), p.v.row(t), per_feature.row(t),
                          linattn::Identity{}, c);
    by_broadcast.step_into(p.q.row(t), p.k.row(t), p.v.row(t), broadcast, linattn::Identity{}, d);
    Eigen::internal::set_is_malloc_allowed(true);
    CHECK(a == b);
    CHECK(relative_error(d, a) <= tolerance<T>());
    CHECK(c.allFinite());
  }
  CHECK(by_scalar.tokens() == n);
  const Matrix<double> expected =
      naive_gated(p.qd, p.kd, p.vd, per_feature.template cast<double>(), 1e-6, true);
  linattn::GatedRecurrentState<T> fresh(kC, kDv);
  Matrix<T> stepped(n, kDv);
  for (Eigen::Index t = 0; t < n; ++t) {
    fresh.step_into(p.q.row(t), p.k.row(t), p.v.row(t), per_feature.row(t), linattn::Identity{}, c);
    stepped.row(t) = c.transpose();
  }
  CHECK(relative_error(stepped, expected) <= tolerance<T>());
}

TEST_CASE("gated: zero denominators give zero rows and zero gradients", "[gated][backward]") {
  // eps = 0 and an all-zero key before the first real one: den = 0 exactly, the guard keeps 0
  // and the row is zero, in the forward and in the gradient.
  const Eigen::Index n = 5;
  Problem<double> p(n, 1, 90, 0.5, 0.9, 3, 2);
  p.k.row(0).setZero();
  p.refresh();
  linattn::Options options;
  options.eps = 0.0;
  const Matrix<double> out =
      linattn::causal_gated_linear_attention(p.q, p.k, p.v, p.gates, linattn::Identity{}, options);
  CHECK(out.row(0).isZero(0));
  const Matrix<double> expected = naive_gated(p.qd, p.kd, p.vd, p.gd, 0.0, true);
  CHECK(relative_error(out, expected) <= 1e-14);
  const Matrix<double> r = gaussian<double>(n, 2, 91);
  const linattn::GatedAttentionGradients<double> g =
      linattn::causal_gated_linear_attention_backward(p.q, p.k, p.v, p.gates, r,
                                                      linattn::Identity{}, options);
  const NaiveGradients naive = naive_gated_backward(p.qd, p.kd, p.vd, p.gd, r, 0.0, true);
  CHECK(g.q.row(0).isZero(0));
  CHECK(relative_error(g.q, naive.q) <= 1e-12);
  CHECK(relative_error(g.k, naive.k) <= 1e-12);
  CHECK(relative_error(g.v, naive.v) <= 1e-12);
  CHECK(relative_error(g.gates, naive.gates) <= 1e-12);
}

namespace {

/// RWKV-6's bonus form in T and double: raw q, k (Gaussian, so features of either sign: there
/// is no normaliser), v, gates a_t in [lo, hi) and u (a column, or a row with `u_row`).
template <class T>
struct BonusProblem {
  Matrix<T> q, k, v, gates, u;
  BonusProblem(Eigen::Index n, Eigen::Index gate_cols, std::uint64_t seed, Eigen::Index c,
               Eigen::Index dv, double lo, double hi, bool u_row = false)
      : q(gaussian<T>(n, c, seed)),
        k(gaussian<T>(n, c, seed + 1)),
        v(gaussian<T>(n, dv, seed + 2)),
        gates(uniform_gates<T>(n, gate_cols, seed + 3, lo, hi, hi >= 1.0)),
        u(u_row ? gaussian<T>(1, c, seed + 4) : gaussian<T>(c, 1, seed + 4)) {}
};

/// Central differences of loss() in every entry of x, which is moved and put back; h relative
/// to the entry.
template <class Loss>
Matrix<double> central_differences(Matrix<double>& x, const Loss& loss) {
  Matrix<double> grad(x.rows(), x.cols());
  for (Eigen::Index i = 0; i < x.rows(); ++i) {
    for (Eigen::Index j = 0; j < x.cols(); ++j) {
      const double saved = x(i, j);
      const double h = 1e-6 * std::max(1.0, std::abs(saved));
      x(i, j) = saved + h;
      const double up = loss();
      x(i, j) = saved - h;
      const double down = loss();
      x(i, j) = saved;
      grad(i, j) = (up - down) / (2 * h);
    }
  }
  return grad;
}

/// elu(x) + 1 and its backward, written here (the reference must not use the library's map).
Matrix<double> elu_plus_one(const Matrix<double>& x) {
  return x.unaryExpr([](double e) { return e > 0 ? e + 1 : std::exp(e); });
}

Matrix<double> elu_plus_one_backward(const Matrix<double>& x, const Matrix<double>& grad_phi) {
  return grad_phi.cwiseProduct(x.unaryExpr([](double e) { return e > 0 ? 1.0 : std::exp(e); }));
}

struct NaiveBonus {
  Matrix<double> out, q, k, v, gates;  // gates: d L / d a_t
  Eigen::VectorXd u;
};

/// RWKV-6's bonus form token by token in double, on features, and its reverse mode:
///     out_t = s phi_q_t^T (P_t + diag(u) phi_k_t v_t^T),   P_{t+1} = diag(a_t) P_t + phi_k_t v_t^T
/// from P_0 = 0. Keeps every P_t (O(N C Dv), fine for a test) and walks back with
/// dP_t = diag(a_t) dP_{t+1} + s phi_q_t grad_out_t^T. a_t = 0 is a reset.
NaiveBonus naive_bonus(const Matrix<double>& q, const Matrix<double>& k, const Matrix<double>& v,
                       const Matrix<double>& a, const Eigen::VectorXd& u,
                       const Matrix<double>& grad_out, double s) {
  const Eigen::Index n = q.rows();
  const Eigen::Index c = q.cols();
  const Eigen::Index dv = v.cols();
  const auto gate = [&](Eigen::Index t, Matrix<double>& m) {
    for (Eigen::Index f = 0; f < c; ++f) m.row(f) *= a(t, a.cols() == 1 ? 0 : f);
  };
  NaiveBonus r{Matrix<double>(n, dv), Matrix<double>(n, c),        Matrix<double>(n, c),
               Matrix<double>(n, dv), Matrix<double>(n, a.cols()), Eigen::VectorXd::Zero(c)};
  std::vector<Matrix<double>> before(static_cast<std::size_t>(n));
  Matrix<double> state = Matrix<double>::Zero(c, dv);
  for (Eigen::Index t = 0; t < n; ++t) {
    before[static_cast<std::size_t>(t)] = state;
    const double bonus = q.row(t).dot(k.row(t).cwiseProduct(u.transpose()));
    r.out.row(t) = s * (q.row(t) * state + bonus * v.row(t));
    gate(t, state);
    state += k.row(t).transpose() * v.row(t);
  }
  Matrix<double> ds = Matrix<double>::Zero(c, dv);  // d L / d P_{t+1}
  for (Eigen::Index t = n - 1; t >= 0; --t) {
    const Matrix<double>& p = before[static_cast<std::size_t>(t)];
    const Eigen::RowVectorXd go = grad_out.row(t);
    const double db = go.dot(v.row(t));
    // Through P_{t+1} = diag(a_t) P_t + phi_k_t v_t^T.
    Eigen::RowVectorXd dk = (ds * v.row(t).transpose()).transpose();
    Eigen::RowVectorXd dvt = k.row(t) * ds;
    const Eigen::VectorXd da = ds.cwiseProduct(p).rowwise().sum();
    if (a.cols() == 1) {
      r.gates(t, 0) = da.sum();
    } else {
      r.gates.row(t) = da.transpose();
    }
    // Through out_t.
    r.q.row(t) = s * ((p * go.transpose()).transpose() + db * k.row(t).cwiseProduct(u.transpose()));
    dk += s * db * q.row(t).cwiseProduct(u.transpose());
    dvt += s * q.row(t).dot(k.row(t).cwiseProduct(u.transpose())) * go;
    r.u += s * db * q.row(t).cwiseProduct(k.row(t)).transpose();
    r.k.row(t) = dk;
    r.v.row(t) = dvt;
    gate(t, ds);
    ds += s * q.row(t).transpose() * go;
  }
  return r;
}

}  // namespace

TEMPLATE_TEST_CASE("gated bonus backward: matches central finite differences",
                   "[gated][backward][bonus]", float, double) {
  // L = sum(R o out) differentiated in double on the inputs rounded to T, in every input (q, k,
  // v, the gates as a_t or as log_gates(g), u). Double: the central differences' own error
  // bounds it, 1e-6 as in the gated test. Float: the float backward's rounding over sums of
  // ~1/(1 - a) terms, 1e-4; float accumulated in double rounds once at the end, 1e-6.
  using T = TestType;
  constexpr bool is_float = std::is_same_v<T, float>;
  const double bound = is_float ? 1e-4 : 1e-6;
  const Eigen::Index n = 70;  // 5 chunks of 16
  const Eigen::Index c = 4;
  const Eigen::Index dv = 3;
  linattn::Options options;
  options.normalize = false;
  options.chunk = 16;
  options.scale = 0.6;
  double worst = 0.0;
  const char* names[] = {"q", "k", "v", "gates", "u"};
  const auto check = [&](const auto& map, const char* map_name) {
    for (const Eigen::Index gate_cols : {Eigen::Index{1}, c}) {
      for (const bool log_space : {false, true}) {
        INFO(map_name << ", " << gate_kind(gate_cols) << " gates, "
                      << (log_space ? "log_gates(g)" : "a_t"));
        // Gates in (0.3, 0.95): a +- h stays in (0, 1] and g +- h <= 0. A row u with log gates.
        const BonusProblem<T> p(n, gate_cols, 1200 + 10 * gate_cols + (log_space ? 1 : 0), c, dv,
                                0.3, 0.95, log_space);
        const Matrix<T> r = gaussian<T>(n, dv, 1201 + gate_cols);
        const Matrix<T> given = log_space ? Matrix<T>(p.gates.array().log().matrix()) : p.gates;
        const auto grads_of = [&](auto accumulator) {
          using Acc = decltype(accumulator);
          if (log_space) {
            return linattn::causal_gated_linear_attention_backward<Acc>(
                p.q, p.k, p.v, linattn::with_bonus(linattn::log_gates(given), p.u), r, map,
                options);
          }
          return linattn::causal_gated_linear_attention_backward<Acc>(
              p.q, p.k, p.v, linattn::with_bonus(given, p.u), r, map, options);
        };
        std::vector<Matrix<double>> x = {p.q.template cast<double>(), p.k.template cast<double>(),
                                         p.v.template cast<double>(), given.template cast<double>(),
                                         p.u.template cast<double>()};
        const Matrix<double> rd = r.template cast<double>();
        const auto loss = [&] {
          const Matrix<double> out =
              log_space ? linattn::causal_gated_linear_attention(
                              x[0], x[1], x[2], linattn::with_bonus(linattn::log_gates(x[3]), x[4]),
                              map, options)
                        : linattn::causal_gated_linear_attention(
                              x[0], x[1], x[2], linattn::with_bonus(x[3], x[4]), map, options);
          return out.cwiseProduct(rd).sum();
        };
        const linattn::BonusAttentionGradients<T> g = grads_of(T{});
        const linattn::BonusAttentionGradients<T> wide = grads_of(double{});
        const Matrix<T>* got[] = {&g.q, &g.k, &g.v, &g.gates, &g.u};
        const Matrix<T>* got_wide[] = {&wide.q, &wide.k, &wide.v, &wide.gates, &wide.u};
        for (std::size_t i = 0; i < 5; ++i) {
          const Matrix<double> fd = central_differences(x[i], loss);
          REQUIRE(got[i]->rows() == fd.rows());
          REQUIRE(got[i]->cols() == fd.cols());
          REQUIRE(got_wide[i]->rows() == fd.rows());
          REQUIRE(got_wide[i]->cols() == fd.cols());
          const double e = relative_error(*got[i], fd);
          const double ew = relative_error(*got_wide[i], fd);
          INFO("d " << names[i] << ": " << e << ", accumulated in double " << ew);
          CHECK(e <= bound);
          CHECK(ew <= 1e-6);
          worst = std::max(worst, e);
        }
        // Nothing reads the state after the last token, so its gate has no gradient at all.
        CHECK(g.gates.row(n - 1).isZero(0));
      }
    }
  };
  check(linattn::Identity{}, "Identity");
  check(linattn::EluPlusOne{}, "EluPlusOne");
  WARN("bonus backward vs finite differences, worst relative error " << worst);
}

TEMPLATE_TEST_CASE("gated bonus backward: matches a naive reverse mode, resets included",
                   "[gated][backward][bonus]", float, double) {
  // The reference walks the per-token recurrence back in double (naive_bonus); the map's
  // backward is chained here by hand. Log gates carry hard resets (-infinity) at the first
  // token, inside a chunk and at the last token. Bounds as the gated reverse-mode test: float
  // 1e-4 (long decayed sums in float), double 1e-10.
  using T = TestType;
  constexpr bool is_float = std::is_same_v<T, float>;
  const double bound = is_float ? 1e-4 : 1e-10;
  const char* names[] = {"q", "k", "v", "gates", "u"};
  double worst[5] = {0, 0, 0, 0, 0};
  for (const Eigen::Index n : {1, 2, 33, 300, 2000}) {
    for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
      for (const bool elu : {false, true}) {
        const auto seed = 1300 + static_cast<std::uint64_t>(n) + 10 * gate_cols + (elu ? 1 : 0);
        const BonusProblem<T> p(n, gate_cols, seed, kC, kDv, 0.75, 1.0);
        const Matrix<T> grad_out = gaussian<T>(n, kDv, seed + 7);
        Matrix<T> logs = p.gates.array().log().matrix();
        // 2n/5 + 3 is inside a chunk of 16 and of 64 for N = 300 and 2000.
        const Eigen::Index resets[] = {0, std::min<Eigen::Index>(2 * n / 5 + 3, n - 1), n - 1};
        for (const Eigen::Index t : resets) {
          logs.row(t).setConstant(-std::numeric_limits<T>::infinity());
        }
        const Matrix<double> qd = p.q.template cast<double>();
        const Matrix<double> kd = p.k.template cast<double>();
        const Matrix<double> phi_q = elu ? elu_plus_one(qd) : qd;
        const Matrix<double> phi_k = elu ? elu_plus_one(kd) : kd;
        const Eigen::VectorXd ud = p.u.template cast<double>();
        const Matrix<double> god = grad_out.template cast<double>();
        for (const bool log_space : {false, true}) {
          const Matrix<double> a =
              log_space ? Matrix<double>(logs.template cast<double>().array().exp().matrix())
                        : Matrix<double>(p.gates.template cast<double>());
          NaiveBonus naive =
              naive_bonus(phi_q, phi_k, p.v.template cast<double>(), a, ud, god, 0.7);
          if (elu) {
            naive.q = elu_plus_one_backward(qd, naive.q);
            naive.k = elu_plus_one_backward(kd, naive.k);
          }
          if (log_space) naive.gates = naive.gates.cwiseProduct(a);  // d L / d g = a d L / d a
          for (const Eigen::Index chunk : {16, 64}) {
            INFO("N = " << n << ", " << gate_kind(gate_cols) << " gates, "
                        << (elu ? "EluPlusOne" : "Identity") << ", "
                        << (log_space ? "log gates with resets" : "a_t") << ", chunk = " << chunk);
            linattn::Options options;
            options.normalize = false;
            options.chunk = chunk;
            options.scale = 0.7;
            linattn::BonusAttentionGradients<T> g;
            Matrix<T> out(n, kDv);
            const auto run = [&](const auto& map) {
              if (log_space) {
                const auto bonus = linattn::with_bonus(linattn::log_gates(logs), p.u);
                linattn::causal_gated_linear_attention_into(p.q, p.k, p.v, bonus, map, out,
                                                            options);
                linattn::causal_gated_linear_attention_backward_into(p.q, p.k, p.v, bonus, grad_out,
                                                                     map, g, options);
              } else {
                const auto bonus = linattn::with_bonus(p.gates, p.u);
                linattn::causal_gated_linear_attention_into(p.q, p.k, p.v, bonus, map, out,
                                                            options);
                linattn::causal_gated_linear_attention_backward_into(p.q, p.k, p.v, bonus, grad_out,
                                                                     map, g, options);
              }
            };
            if (elu) {
              run(linattn::EluPlusOne{});
            } else {
              run(linattn::Identity{});
            }
            // The reference's own forward is the library's.
            CHECK(relative_error(out, naive.out) <= tolerance<T>());
            const Matrix<T>* got[] = {&g.q, &g.k, &g.v, &g.gates, &g.u};
            const Matrix<double> naive_u = naive.u;
            const Matrix<double>* want[] = {&naive.q, &naive.k, &naive.v, &naive.gates, &naive_u};
            for (int i = 0; i < 5; ++i) {
              REQUIRE(got[i]->rows() == want[i]->rows());
              REQUIRE(got[i]->cols() == want[i]->cols());
              REQUIRE(got[i]->allFinite());
              const double e = relative_error(*got[i], *want[i]);
              INFO("d " << names[i] << " " << e);
              CHECK(e <= bound);
              worst[i] = std::max(worst[i], e);
            }
            CHECK(g.gates.row(n - 1).isZero(0));
            if (log_space) {
              for (const Eigen::Index t : resets) CHECK(g.gates.row(t).isZero(0));
            }
          }
        }
      }
    }
  }
  WARN("bonus backward vs naive reverse mode, worst relative error: q "
       << worst[0] << ", k " << worst[1] << ", v " << worst[2] << ", gates " << worst[3] << ", u "
       << worst[4]);
}

TEMPLATE_TEST_CASE("gated bonus backward: threads give the one-thread gradients",
                   "[gated][backward][bonus]", float) {
  // 8192 tokens split across the sequence; only the order of the sums changes: 1e-5 (1e-4 for
  // the gates' long reverse sums). Float only: threads against one thread run the same kernels.
  using T = TestType;
  const double bound = 1e-5;
  const double gate_bound = 1e-4;
  const Eigen::Index n = 8192;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
    INFO(gate_kind(gate_cols) << " gates");
    const BonusProblem<T> p(n, gate_cols, 1400 + gate_cols, kC, kDv, 0.97, 1.0);
    const Matrix<T> grad_out = gaussian<T>(n, kDv, 1401);
    const Matrix<T> logs = p.gates.array().log().matrix();
    linattn::Options one;
    one.normalize = false;
    one.threads = 1;
    linattn::Options two = one;
    two.threads = 2;
    const auto bonus = linattn::with_bonus(linattn::log_gates(logs), p.u);
    const linattn::BonusAttentionGradients<T> a = linattn::causal_gated_linear_attention_backward(
        p.q, p.k, p.v, bonus, grad_out, linattn::EluPlusOne{}, one);
    const linattn::BonusAttentionGradients<T> b = linattn::causal_gated_linear_attention_backward(
        p.q, p.k, p.v, bonus, grad_out, linattn::EluPlusOne{}, two);
    CHECK(relative_error(b.q, a.q) <= bound);
    CHECK(relative_error(b.k, a.k) <= bound);
    CHECK(relative_error(b.v, a.v) <= bound);
    CHECK(relative_error(b.u, a.u) <= bound);
    CHECK(relative_error(b.gates, a.gates) <= gate_bound);
    WARN("bonus backward, " << gate_kind(gate_cols) << " gates, 2 threads vs 1: q "
                            << relative_error(b.q, a.q) << ", k " << relative_error(b.k, a.k)
                            << ", v " << relative_error(b.v, a.v) << ", u "
                            << relative_error(b.u, a.u) << ", gates "
                            << relative_error(b.gates, a.gates));
  }
}

TEMPLATE_TEST_CASE("gated bonus backward: bad input throws linattn::Error and writes nothing",
                   "[gated][backward][bonus]", float) {
  using T = TestType;
  using Catch::Contains;
  const Eigen::Index n = 10;
  const BonusProblem<T> p(n, kC, 1500, kC, kDv, 0.5, 1.0);
  const Matrix<T> grad_out = gaussian<T>(n, kDv, 1501);
  linattn::Options plain;
  plain.normalize = false;
  // Sentinels of shapes no call gives: any write would show.
  linattn::BonusAttentionGradients<T> grads{
      Matrix<T>::Constant(2, 3, T(7)), Matrix<T>::Constant(2, 3, T(7)),
      Matrix<T>::Constant(2, 3, T(7)), Matrix<T>::Constant(2, 3, T(7)),
      Matrix<T>::Constant(2, 3, T(7))};
  const auto untouched = [&] {
    for (const Matrix<T>* m : {&grads.q, &grads.k, &grads.v, &grads.gates, &grads.u}) {
      if (m->rows() != 2 || m->cols() != 3 || !(m->array() == T(7)).all()) return false;
    }
    return true;
  };
  const auto message = [&](const auto& q, const auto& k, const auto& v, const auto& bonus,
                           const auto& go, const auto& map, const linattn::Options& options) {
    try {
      linattn::causal_gated_linear_attention_backward_into(q, k, v, bonus, go, map, grads, options);
    } catch (const linattn::Error& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };
  const linattn::Identity id;
  const auto with = [&](const Matrix<T>& gates, const Matrix<T>& u, const linattn::Options& o) {
    return message(p.q, p.k, p.v, linattn::with_bonus(gates, u), grad_out, id, o);
  };

  // The good call works (on its own gradients).
  CHECK_NOTHROW(linattn::causal_gated_linear_attention_backward(
      p.q, p.k, p.v, linattn::with_bonus(p.gates, p.u), grad_out, id, plain));

  CHECK_THAT(with(p.gates, p.u, linattn::Options{}), Contains("no normaliser"));
  CHECK(untouched());
  CHECK_THAT(with(p.gates, Matrix<T>::Ones(kC - 1, 1), plain),
             Contains("u is 7 x 1, expected a vector of 8 entries"));
  CHECK_THAT(with(p.gates, Matrix<T>::Ones(2, kC), plain), Contains("u is 2 x 8"));
  Matrix<T> nan_u = p.u;
  nan_u(3, 0) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THAT(with(p.gates, nan_u, plain), Contains("u has a non-finite value"));
  CHECK(untouched());

  Matrix<T> bad = p.gates;
  bad(4, 2) = T(0);
  CHECK_THAT(with(bad, p.u, plain),
             Contains("gates must lie in (0, 1]") && Contains("row 4, column 2"));
  bad(4, 2) = T(1.5);
  CHECK_THAT(with(bad, p.u, plain), Contains("row 4, column 2"));
  bad(4, 2) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THAT(with(bad, p.u, plain), Contains("row 4, column 2"));
  bad = p.gates;
  bad(n - 1, 0) = T(2);  // the last token's gate moves no output, and is still checked
  CHECK_THAT(with(bad, p.u, plain), Contains("row 9, column 0"));
  Matrix<T> logs = p.gates.array().log().matrix();
  logs(6, 1) = T(0.25);
  CHECK_THAT(message(p.q, p.k, p.v, linattn::with_bonus(linattn::log_gates(logs), p.u), grad_out,
                     id, plain),
             Contains("log gates") && Contains("row 6, column 1"));
  CHECK_THAT(with(Matrix<T>::Constant(n, 3, T(0.5)), p.u, plain), Contains("gates is 10 x 3"));
  CHECK(untouched());

  const auto bonus = linattn::with_bonus(p.gates, p.u);
  CHECK_THAT(message(p.q, p.k, p.v, bonus, grad_out.leftCols(kDv - 1), id, plain),
             Contains("grad_out is 10 x 5"));
  CHECK_THAT(message(p.q, p.k, p.v, bonus, grad_out.topRows(n - 1), id, plain),
             Contains("grad_out is 9 x 6"));
  Matrix<T> nan_grad = grad_out;
  nan_grad(2, 3) = std::numeric_limits<T>::infinity();
  CHECK_THAT(message(p.q, p.k, p.v, bonus, nan_grad, id, plain), Contains("grad_out"));
  CHECK(untouched());

  Matrix<T> nan_k = p.k;
  nan_k(n - 1, 0) = std::numeric_limits<T>::quiet_NaN();  // only the last bonus reads it
  CHECK_THAT(message(p.q, nan_k, p.v, bonus, grad_out, id, plain), Contains("phi_k"));
  CHECK_THAT(message(p.q, nan_k, p.v, bonus, grad_out, linattn::EluPlusOne{}, plain),
             Contains("k has a non-finite"));
  linattn::Options decayed = plain;
  decayed.decay = 0.9;
  CHECK_THAT(with(p.gates, p.u, decayed), Contains("decay"));
  linattn::Options no_chunk = plain;
  no_chunk.chunk = 0;
  CHECK_THAT(with(p.gates, p.u, no_chunk), Contains("chunk"));
  // No tokens is an empty input, as everywhere.
  CHECK_THAT(message(p.q.topRows(0), p.k.topRows(0), p.v.topRows(0),
                     linattn::with_bonus(p.gates.topRows(0), p.u), grad_out.topRows(0), id, plain),
             Contains("phi_q is empty"));
  CHECK(untouched());
}

TEMPLATE_TEST_CASE("gated bonus backward: one token is the bonus term alone",
                   "[gated][backward][bonus]", float, double) {
  // N = 1: out = s (phi_q o u) . phi_k v, so every gradient is the bonus term's, in closed form,
  // and the gate (never read) gets exactly 0.
  using T = TestType;
  const double bound = std::is_same_v<T, float> ? 1e-6 : 1e-14;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
    INFO(gate_kind(gate_cols) << " gates");
    const BonusProblem<T> p(1, gate_cols, 1600 + gate_cols, kC, kDv, 0.5, 1.0);
    const Matrix<T> grad_out = gaussian<T>(1, kDv, 1601);
    linattn::Options options;
    options.normalize = false;
    options.scale = 0.5;
    const linattn::BonusAttentionGradients<T> g = linattn::causal_gated_linear_attention_backward(
        p.q, p.k, p.v, linattn::with_bonus(p.gates, p.u), grad_out, linattn::Identity{}, options);
    const Eigen::RowVectorXd q = p.q.template cast<double>();
    const Eigen::RowVectorXd k = p.k.template cast<double>();
    const Eigen::RowVectorXd u = p.u.template cast<double>().transpose();
    const Eigen::RowVectorXd v = p.v.template cast<double>();
    const Eigen::RowVectorXd go = grad_out.template cast<double>();
    const double db = go.dot(v);
    CHECK(relative_error(g.q, (0.5 * db * u.cwiseProduct(k)).eval()) <= bound);
    CHECK(relative_error(g.k, (0.5 * db * u.cwiseProduct(q)).eval()) <= bound);
    CHECK(relative_error(g.v, (0.5 * q.dot(u.cwiseProduct(k)) * go).eval()) <= bound);
    CHECK(relative_error(g.u, (0.5 * db * q.cwiseProduct(k)).transpose().eval()) <= bound);
    CHECK(g.gates.rows() == 1);
    CHECK(g.gates.cols() == gate_cols);
    CHECK(g.gates.isZero(0));
  }
}

TEMPLATE_TEST_CASE("gated backward: a workspace gives the allocating call's gradients, bit for bit",
                   "[gated][backward][workspace]", float) {
  using T = TestType;
  linattn::BackwardWorkspace<T> workspace;
  for (const Eigen::Index n : {300, 17, 600}) {
    for (const Eigen::Index gate_cols : {Eigen::Index{1}, kC}) {
      // Gates down to 0.05: pieces shorter than the chunk in float.
      const Problem<T> p(n, gate_cols, 950 + static_cast<std::uint64_t>(n) + gate_cols, 0.05);
      const Matrix<T> grad_out = gaussian<T>(n, kDv, 951 + static_cast<std::uint64_t>(n));
      linattn::Options options;
      options.threads = 1;
      const auto want = linattn::causal_gated_linear_attention_backward(
          p.q, p.k, p.v, p.gates, grad_out, linattn::Identity{}, options);
      linattn::GatedAttentionGradients<T> got;
      linattn::causal_gated_linear_attention_backward_into(
          p.q, p.k, p.v, p.gates, grad_out, linattn::Identity{}, got, options, workspace);
      INFO("N = " << n << ", gate columns = " << gate_cols);
      CHECK(got.q == want.q);
      CHECK(got.k == want.k);
      CHECK(got.v == want.v);
      CHECK(got.gates == want.gates);
    }
  }
}

}  // namespace linattn_test_gated
