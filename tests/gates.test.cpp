// Gates on the one engine: log-space gates, hard resets, gates at the edges of float, long
// sequences, threads, feature maps, save/load, and the gate conventions of FLA, Mamba-2, RWKV-6
// and GLA, each against a naive recurrence written here in double in that library's own form.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/gated.hpp>
#include <linattn/gates.hpp>
#include <random>
#include <sstream>
#include <type_traits>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_gates {

using linattn::Matrix;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::naive_rwkv6;
using linattn_test::relative_error;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// docs/design.md's agreement bounds between the chunked and recurrent forms.
template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

/// exp(0.5 x) of Gaussian x: positive features, so denominators are well conditioned.
Matrix<double> positive(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed) {
  return gaussian<double>(rows, cols, seed, 0.5).array().exp().matrix();
}

/// Log gates uniform in [lo, hi] (both <= 0).
Matrix<double> uniform_logs(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed, double lo,
                            double hi) {
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<double> uniform(lo, hi);
  Matrix<double> m(rows, cols);
  for (Eigen::Index r = 0; r < rows; ++r) {
    for (Eigen::Index c = 0; c < cols; ++c) m(r, c) = uniform(engine);
  }
  return m;
}

/// The recurrence token by token in double, from log gates g (N x 1 or N x C):
/// S <- diag(exp g_t) S + k_t v_t^T, z alike; out = q^T S / (q . z + eps), or q^T S alone.
/// exp(-infinity) = 0 is the reset.
Matrix<double> naive(const Matrix<double>& q, const Matrix<double>& k, const Matrix<double>& v,
                     const Matrix<double>& g, bool normalize, double eps = 1e-6) {
  Matrix<double> s = Matrix<double>::Zero(q.cols(), v.cols());
  Eigen::VectorXd z = Eigen::VectorXd::Zero(q.cols());
  Matrix<double> out(q.rows(), v.cols());
  for (Eigen::Index t = 0; t < q.rows(); ++t) {
    for (Eigen::Index c = 0; c < q.cols(); ++c) {
      const double a = std::exp(g(t, g.cols() == 1 ? 0 : c));
      s.row(c) *= a;
      z(c) *= a;
    }
    s += k.row(t).transpose() * v.row(t);
    z += k.row(t).transpose();
    const Eigen::RowVectorXd num = q.row(t) * s;
    out.row(t) = normalize ? Eigen::RowVectorXd(num / (q.row(t).dot(z) + eps)) : num;
  }
  return out;
}

/// One problem in T and its double copy (the rounded inputs) for the reference.
template <class T>
struct Problem {
  Matrix<T> q, k, v;
  Matrix<double> qd, kd, vd;
  Problem(Eigen::Index n, Eigen::Index c, Eigen::Index dv, std::uint64_t seed)
      : q(positive(n, c, seed).cast<T>()),
        k(positive(n, c, seed + 1).cast<T>()),
        v(gaussian<T>(n, dv, seed + 2)),
        qd(q.template cast<double>()),
        kd(k.template cast<double>()),
        vd(v.template cast<double>()) {}
};

/// Steps a state token by token with log gates and returns every output.
template <class T>
Matrix<T> stepped(linattn::RecurrentState<T>& state, const Problem<T>& p, const Matrix<T>& g,
                  Eigen::Index first, Eigen::Index count) {
  Matrix<T> out(count, p.v.cols());
  for (Eigen::Index t = 0; t < count; ++t) {
    out.row(t) = state
                     .step(p.q.row(first + t), p.k.row(first + t), p.v.row(first + t),
                           linattn::log_gates(g.row(first + t)), linattn::Identity{})
                     .transpose();
  }
  return out;
}

const char* kind(Eigen::Index cols) { return cols == 1 ? "scalar" : "per-feature"; }

}  // namespace

TEMPLATE_TEST_CASE("gates: log gates give the same result as the gates themselves", "[gates]",
                   float, double) {
  using T = TestType;
  const Eigen::Index n = 150;
  const Problem<T> p(n, 8, 6, 11);
  for (const Eigen::Index cols : {Eigen::Index{1}, Eigen::Index{8}}) {
    SECTION(kind(cols)) {
      const Matrix<double> g = uniform_logs(n, cols, 12, -0.4, 0.0);
      const Matrix<T> logs = g.cast<T>();
      const Matrix<T> gates = logs.array().exp().matrix();
      const Matrix<double> expected = naive(p.qd, p.kd, p.vd, logs.template cast<double>(), true);
      const Matrix<T> by_log = linattn::causal_gated_linear_attention(
          p.q, p.k, p.v, linattn::log_gates(logs), linattn::Identity{});
      const Matrix<T> by_gate =
          linattn::causal_gated_linear_attention(p.q, p.k, p.v, gates, linattn::Identity{});
      CHECK(relative_error(by_log, expected) <= tolerance<T>());
      // exp in T rounds each gate once: the two agree to that rounding.
      CHECK(relative_error(by_gate, by_log) <= (std::is_same_v<T, float> ? 1e-5 : 1e-13));
    }
  }
}

TEMPLATE_TEST_CASE("gates: a log gate of -infinity resets the state, mid-chunk or on a boundary",
                   "[gates]", float, double) {
  using T = TestType;
  const Eigen::Index n = 200;
  const Problem<T> p(n, 8, 6, 21);
  for (const Eigen::Index cols : {Eigen::Index{1}, Eigen::Index{8}}) {
    SECTION(kind(cols)) {
      Matrix<double> g = uniform_logs(n, cols, 22, -0.3, 0.0);
      // Resets at token 37 (mid-chunk), 64 (a chunk's first token), 65 and 199 (the last).
      for (const Eigen::Index r : {37, 64, 65, 199}) g.row(r).setConstant(-kInf);
      if (cols > 1) g(120, 3) = -kInf;  // one feature alone forgets
      const Matrix<T> logs = g.cast<T>();
      const Matrix<double> expected = naive(p.qd, p.kd, p.vd, g, true);
      const Matrix<T> chunked = linattn::causal_gated_linear_attention(
          p.q, p.k, p.v, linattn::log_gates(logs), linattn::Identity{});
      REQUIRE(chunked.allFinite());
      CHECK(relative_error(chunked, expected) <= tolerance<T>());

      // After the reset at 65 nothing before it matters: the tail alone gives the same rows.
      const Eigen::Index tail = n - 65;
      const Matrix<T> alone = linattn::causal_gated_linear_attention(
          p.q.bottomRows(tail), p.k.bottomRows(tail), p.v.bottomRows(tail),
          linattn::log_gates(logs.bottomRows(tail)), linattn::Identity{});
      CHECK(relative_error(chunked.bottomRows(tail), alone) <= tolerance<T>());

      linattn::RecurrentState<T> state(8, 6);
      const Matrix<T> steps = stepped(state, p, logs, 0, n);
      CHECK(relative_error(steps, expected) <= tolerance<T>());
      linattn::RecurrentState<T> pieces(8, 6);
      const Matrix<T> first =
          pieces.prefill(p.q.topRows(50), p.k.topRows(50), p.v.topRows(50),
                         linattn::log_gates(logs.topRows(50)), linattn::Identity{});
      const Matrix<T> rest = stepped(pieces, p, logs, 50, n - 50);
      CHECK(relative_error(first, expected.topRows(50)) <= tolerance<T>());
      CHECK(relative_error(rest, expected.bottomRows(n - 50)) <= tolerance<T>());
    }
  }
}

TEMPLATE_TEST_CASE("gates: from 1e-30 to 1 in log space, mixed within a chunk", "[gates]", float,
                   double) {
  using T = TestType;
  const Eigen::Index n = 300;
  const Problem<T> p(n, 8, 6, 31);
  std::mt19937_64 engine(32);
  const std::vector<double> choices{std::log(1e-30), std::log(1e-3), -1.0, -1e-8, 0.0, -0.05};
  std::uniform_int_distribution<std::size_t> pick(0, choices.size() - 1);
  for (const Eigen::Index cols : {Eigen::Index{1}, Eigen::Index{8}}) {
    SECTION(kind(cols)) {
      Matrix<double> g(n, cols);
      for (Eigen::Index r = 0; r < n; ++r) {
        for (Eigen::Index c = 0; c < cols; ++c) g(r, c) = choices[pick(engine)];
      }
      const Matrix<T> logs = g.cast<T>();
      const Matrix<double> expected = naive(p.qd, p.kd, p.vd, logs.template cast<double>(), true);
      for (const Eigen::Index chunk : {Eigen::Index{1}, Eigen::Index{16}, Eigen::Index{64}}) {
        linattn::Options options;
        options.chunk = chunk;
        const Matrix<T> chunked = linattn::causal_gated_linear_attention(
            p.q, p.k, p.v, linattn::log_gates(logs), linattn::Identity{}, options);
        REQUIRE(chunked.allFinite());
        CHECK(relative_error(chunked, expected) <= tolerance<T>());
      }
      linattn::RecurrentState<T> state(8, 6);
      CHECK(relative_error(stepped(state, p, logs, 0, n), expected) <= tolerance<T>());
    }
  }
}

TEMPLATE_TEST_CASE("gates: 65,536 tokens with gates of 1 - 1e-8, chunked and stepped", "[gates]",
                   float, double) {
  // exp(-1e-8) rounds to 1 in float: a state multiplied by it every token would forget
  // nothing, 6.5e-4 off after 65,536 tokens, 30 times the bound.
  using T = TestType;
  const Eigen::Index n = 65536;
  const Problem<T> p(n, 4, 4, 41);
  for (const Eigen::Index cols : {Eigen::Index{1}, Eigen::Index{4}}) {
    SECTION(kind(cols)) {
      Matrix<double> g = uniform_logs(n, cols, 42, -2e-8, 0.0);
      g.row(n / 2).setConstant(-0.7);  // one strong gate halfway
      const Matrix<T> logs = g.cast<T>();
      const Matrix<double> expected = naive(p.qd, p.kd, p.vd, logs.template cast<double>(), false);
      linattn::Options options;
      options.normalize = false;  // the numerator alone shows the decay undiluted
      const Matrix<T> chunked = linattn::causal_gated_linear_attention(
          p.q, p.k, p.v, linattn::log_gates(logs), linattn::Identity{}, options);
      CHECK(relative_error(chunked, expected) <= tolerance<T>());
      linattn::RecurrentState<T> state(4, 4, options);
      const Matrix<T> steps = stepped(state, p, logs, 0, n);
      CHECK(relative_error(steps, expected) <= tolerance<T>());
      // The gates moved the state: the ungated result is far from it.
      const Matrix<T> ungated =
          linattn::causal_linear_attention(p.q, p.k, p.v, linattn::Identity{}, options);
      CHECK(relative_error(ungated, expected) > 1e-4);
    }
  }
}

TEMPLATE_TEST_CASE("gates: threads give the one-thread result", "[gates][threads]", float, double) {
  using T = TestType;
  const Eigen::Index n = 6000;
  const Problem<T> p(n, 8, 8, 51);
  for (const Eigen::Index cols : {Eigen::Index{1}, Eigen::Index{8}}) {
    SECTION(kind(cols)) {
      Matrix<double> g = uniform_logs(n, cols, 52, -0.2, 0.0);
      g.row(2500).setConstant(-kInf);
      const Matrix<T> logs = g.cast<T>();
      linattn::Options one;
      one.threads = 1;
      linattn::Options two;
      two.threads = 2;
      const Matrix<T> serial = linattn::causal_gated_linear_attention(
          p.q, p.k, p.v, linattn::log_gates(logs), linattn::Identity{}, one);
      const Matrix<T> threaded = linattn::causal_gated_linear_attention(
          p.q, p.k, p.v, linattn::log_gates(logs), linattn::Identity{}, two);
      CHECK(relative_error(threaded, serial) <= tolerance<T>());
      CHECK(relative_error(serial, naive(p.qd, p.kd, p.vd, logs.template cast<double>(), true)) <=
            tolerance<T>());
    }
  }
}

TEMPLATE_TEST_CASE("gates: feature maps featurize chunk by chunk, also exponential ones", "[gates]",
                   float, double) {
  using T = TestType;
  const Eigen::Index n = 180;
  const Eigen::Index dk = 6;
  const Matrix<T> q = gaussian<T>(n, dk, 61, 0.6);
  const Matrix<T> k = gaussian<T>(n, dk, 62, 0.6);
  const Matrix<T> v = gaussian<T>(n, 5, 63);
  const linattn::EluPlusOne elu;
  const linattn::PositiveRandomFeatures favor(dk, 16, 64);
  const auto check_map = [&](const auto& map, Eigen::Index cols) {
    const Eigen::Index c = map.feature_dim(dk);
    const Matrix<double> g = uniform_logs(n, cols == 1 ? 1 : c, 65, -0.3, 0.0);
    const Matrix<T> logs = g.cast<T>();
    const Matrix<double> phi_q = map.queries(q.template cast<double>());
    const Matrix<double> phi_k = map.keys(k.template cast<double>());
    const Matrix<double> expected =
        naive(phi_q, phi_k, v.template cast<double>(), logs.template cast<double>(), true);
    const Matrix<T> chunked =
        linattn::causal_gated_linear_attention(q, k, v, linattn::log_gates(logs), map);
    CHECK(relative_error(chunked, expected) <= tolerance<T>());
    linattn::RecurrentState<T> state(c, 5);
    Matrix<T> steps(n, 5);
    for (Eigen::Index t = 0; t < n; ++t) {
      steps.row(t) = state.step(q.row(t), k.row(t), v.row(t), linattn::log_gates(logs.row(t)), map)
                         .transpose();
    }
    CHECK(relative_error(steps, expected) <= tolerance<T>());
  };
  SECTION("elu + 1, scalar") { check_map(elu, 1); }
  SECTION("elu + 1, per feature") { check_map(elu, 2); }
  SECTION("FAVOR+, scalar") { check_map(favor, 1); }
  SECTION("FAVOR+, per feature") { check_map(favor, 2); }
}

TEMPLATE_TEST_CASE("gates: a state saved after gated tokens loads and goes on the same", "[gates]",
                   float, double) {
  using T = TestType;
  const Eigen::Index n = 90;
  const Problem<T> p(n, 8, 6, 71);
  const Matrix<T> logs = uniform_logs(n, 8, 72, -0.05, 0.0).cast<T>();
  linattn::RecurrentState<T> state(8, 6);
  stepped(state, p, logs, 0, 40);
  CHECK((linattn::detail::StateAccess::held(state).row_log < 0.0).any());  // factors pending
  std::stringstream stream;
  state.save(stream, linattn::Identity{});
  linattn::RecurrentState<T> loaded =
      linattn::RecurrentState<T>::load(stream, linattn::Identity{}, {});
  const Matrix<T> a = stepped(state, p, logs, 40, n - 40);
  const Matrix<T> b = stepped(loaded, p, logs, 40, n - 40);
  CHECK(relative_error(b, a) <= tolerance<T>());
}

TEMPLATE_TEST_CASE("gates: 16-bit inputs give the float routine's result, rounded", "[gates]",
                   Eigen::half, Eigen::bfloat16) {
  using H = TestType;
  const Eigen::Index n = 130;
  const Problem<float> p(n, 8, 6, 81);
  const Matrix<H> q = p.q.cast<H>(), k = p.k.cast<H>(), v = p.v.cast<H>();
  for (const Eigen::Index cols : {Eigen::Index{1}, Eigen::Index{8}}) {
    SECTION(kind(cols)) {
      const Matrix<H> logs = uniform_logs(n, cols, 82, -0.3, 0.0).cast<H>();
      const Matrix<H> half = linattn::causal_gated_linear_attention(
          q, k, v, linattn::log_gates(logs), linattn::Identity{});
      const Matrix<float> single = linattn::causal_gated_linear_attention(
          q.template cast<float>(), k.template cast<float>(), v.template cast<float>(),
          linattn::log_gates(logs.template cast<float>()), linattn::Identity{});
      CHECK(relative_error(half.template cast<float>(), single) <=
            (std::is_same_v<H, Eigen::half> ? 1e-3 : 8e-3));
    }
  }
}

TEMPLATE_TEST_CASE("gates: bad log gates throw linattn::Error and write nothing", "[gates]",
                   float) {
  using T = TestType;
  const Eigen::Index n = 10;
  const Problem<T> p(n, 8, 6, 91);
  Matrix<T> logs = Matrix<T>::Constant(n, 8, T(-0.1));
  Matrix<T> out = Matrix<T>::Constant(n, 6, T(7));
  const auto message = [&] {
    try {
      linattn::causal_gated_linear_attention_into(p.q, p.k, p.v, linattn::log_gates(logs),
                                                  linattn::Identity{}, out);
    } catch (const linattn::Error& e) {
      return std::string(e.what());
    }
    return std::string("no throw");
  };
  CHECK(message() == "no throw");
  out.setConstant(T(7));
  logs(4, 2) = T(0.01);
  CHECK_THAT(message(), Catch::Contains("<= 0") && Catch::Contains("row 4, column 2"));
  logs(4, 2) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THAT(message(), Catch::Contains("row 4, column 2"));
  logs(4, 2) = std::numeric_limits<T>::infinity();
  CHECK_THAT(message(), Catch::Contains("row 4, column 2"));
  CHECK((out.array() == T(7)).all());

  linattn::RecurrentState<T> state(8, 6);
  Vector<T> gate = Vector<T>::Constant(8, T(-0.1));
  gate(5) = T(0.5);
  CHECK_THROWS_AS(
      state.step(p.q.row(0), p.k.row(0), p.v.row(0), linattn::log_gates(gate), linattn::Identity{}),
      linattn::Error);
  CHECK(state.tokens() == 0);
}

// ---- The conventions of other libraries, each against a reference in that library's form ----

TEMPLATE_TEST_CASE("gates: FLA's GLA (gk in log space, scale on q, no normaliser)",
                   "[gates][ports]", float, double) {
  // fla.ops.gla: S_t = diag(exp(gk_t)) S_{t-1} + k_t v_t^T, o_t = (scale q_t)^T S_t with
  // scale = Dk^-1/2; gk = logsigmoid(x) / 16 in GLA's layer (gate_logit_normalizer = 16).
  using T = TestType;
  const Eigen::Index n = 140;
  const Eigen::Index dk = 16;
  const Eigen::Index dv = 8;
  const Matrix<T> q = gaussian<T>(n, dk, 101), k = gaussian<T>(n, dk, 102);
  const Matrix<T> v = gaussian<T>(n, dv, 103);
  const Matrix<double> x = gaussian<double>(n, dk, 104, 2.0);
  const Matrix<T> gk = (-(1.0 + (-x.array()).exp()).log() / 16.0).matrix().cast<T>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));

  Matrix<double> s = Matrix<double>::Zero(dk, dv);
  Matrix<double> expected(n, dv);
  for (Eigen::Index t = 0; t < n; ++t) {
    s = gk.row(t).template cast<double>().array().exp().matrix().asDiagonal() * s;
    s += k.row(t).template cast<double>().transpose() * v.row(t).template cast<double>();
    expected.row(t) = (scale * q.row(t).template cast<double>()) * s;
  }
  linattn::Options options;
  options.normalize = false;
  options.scale = scale;  // FLA's scale, on q
  const Matrix<T> out = linattn::causal_gated_linear_attention(q, k, v, linattn::log_gates(gk),
                                                               linattn::Identity{}, options);
  CHECK(relative_error(out, expected) <= tolerance<T>() * 5);
  linattn::RecurrentState<T> state(dk, dv, options);
  Matrix<T> steps(n, dv);
  for (Eigen::Index t = 0; t < n; ++t) {
    steps.row(t) =
        state.step(q.row(t), k.row(t), v.row(t), linattn::log_gates(gk.row(t)), linattn::Identity{})
            .transpose();
  }
  CHECK(relative_error(steps, expected) <= tolerance<T>() * 5);
}

TEMPLATE_TEST_CASE("gates: Mamba-2's SSD (a_t = exp(dt_t A), input scaled by dt_t)",
                   "[gates][ports]", float, double) {
  // Mamba-2, one head: h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T, y_t = C_t^T h_t, with A < 0
  // a scalar per head and dt_t = softplus(.) > 0: here q = C, k = dt B, v = x, log gate dt A.
  using T = TestType;
  const Eigen::Index n = 160;
  const Eigen::Index state_dim = 16;  // Mamba-2's d_state
  const Eigen::Index head_dim = 8;
  const Matrix<double> b = gaussian<double>(n, state_dim, 111);
  const Matrix<double> c = gaussian<double>(n, state_dim, 112);
  const Matrix<double> x = gaussian<double>(n, head_dim, 113);
  const Eigen::VectorXd dt = (1.0 + gaussian<double>(n, 1, 114).array().exp()).log().matrix();
  const double a_head = -std::exp(0.8);  // A = -exp(A_log)

  Matrix<double> h = Matrix<double>::Zero(state_dim, head_dim);
  Matrix<double> expected(n, head_dim);
  for (Eigen::Index t = 0; t < n; ++t) {
    h = std::exp(dt(t) * a_head) * h + dt(t) * b.row(t).transpose() * x.row(t);
    expected.row(t) = c.row(t) * h;
  }
  const Matrix<T> q = c.cast<T>();
  const Matrix<T> k = (b.array().colwise() * dt.array()).matrix().cast<T>();
  const Matrix<T> v = x.cast<T>();
  const Matrix<T> g = (dt * a_head).cast<T>();
  linattn::Options options;
  options.normalize = false;
  const Matrix<T> out = linattn::causal_gated_linear_attention(q, k, v, linattn::log_gates(g),
                                                               linattn::Identity{}, options);
  CHECK(relative_error(out, expected) <= tolerance<T>() * 5);
}

TEMPLATE_TEST_CASE("gates: RWKV-6's decay (w = -exp(w_raw), per key feature)", "[gates][ports]",
                   float, double) {
  // RWKV-6 without the bonus: S_t = diag(exp(w_t)) S_{t-1} + k_t v_t^T with w_t = -exp(x_t),
  // read by the receptance r_t: o_t = r_t^T S_t.
  using T = TestType;
  const Eigen::Index n = 120;
  const Eigen::Index dk = 8;
  const Matrix<double> r = gaussian<double>(n, dk, 121);
  const Matrix<double> k = gaussian<double>(n, dk, 122);
  const Matrix<double> v = gaussian<double>(n, 8, 123);
  const Matrix<double> w = -(gaussian<double>(n, dk, 124, 0.5).array() - 1.0).exp().matrix();

  Matrix<double> s = Matrix<double>::Zero(dk, 8);
  Matrix<double> expected(n, 8);
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index i = 0; i < dk; ++i) s.row(i) *= std::exp(w(t, i));
    s += k.row(t).transpose() * v.row(t);
    expected.row(t) = r.row(t) * s;
  }
  linattn::Options options;
  options.normalize = false;
  const Matrix<T> out = linattn::causal_gated_linear_attention(
      r.cast<T>(), k.cast<T>(), v.cast<T>(), linattn::log_gates(w.cast<T>()), linattn::Identity{},
      options);
  CHECK(relative_error(out, expected) <= tolerance<T>() * 5);
}

TEMPLATE_TEST_CASE("gates: RetNet's multi-scale decays and MiniMax's lambda_h (constant per head)",
                   "[gates][ports]", float, double) {
  // RetNet: head h of H decays by gamma_h = 1 - 2^(-5-h), o_t = sum_{j<=t} gamma^(t-j)
  // (q_t . k_j) v_j (no normaliser; RetNet normalises groups afterwards). MiniMax's lightning
  // attention has the same form with lambda_h = exp(-s_h). Both are Options::decay per head.
  using T = TestType;
  const Eigen::Index n = 200;
  const Eigen::Index heads = 4;
  for (Eigen::Index h = 0; h < heads; ++h) {
    const double retnet = 1.0 - std::pow(2.0, -5.0 - static_cast<double>(h));
    const double minimax = std::exp(-8.0 / static_cast<double>(heads) * static_cast<double>(h + 1));
    for (const double gamma : {retnet, minimax}) {
      const Matrix<T> q = gaussian<T>(n, 8, 131 + h), k = gaussian<T>(n, 8, 141 + h);
      const Matrix<T> v = gaussian<T>(n, 8, 151 + h);
      const Matrix<double> qd = q.template cast<double>(), kd = k.template cast<double>();
      const Matrix<double> vd = v.template cast<double>();
      Matrix<double> expected = Matrix<double>::Zero(n, 8);
      for (Eigen::Index t = 0; t < n; ++t) {
        for (Eigen::Index j = 0; j <= t; ++j) {
          expected.row(t) +=
              std::pow(gamma, static_cast<double>(t - j)) * qd.row(t).dot(kd.row(j)) * vd.row(j);
        }
      }
      linattn::Options options;
      options.normalize = false;
      options.decay = gamma;
      const Matrix<T> out = linattn::causal_linear_attention(q, k, v, linattn::Identity{}, options);
      CHECK(relative_error(out, expected) <= tolerance<T>() * 5);
      // The same constant given as scalar log gates.
      linattn::Options gated = options;
      gated.decay = 1.0;
      const Matrix<T> logs = Matrix<T>::Constant(n, 1, static_cast<T>(std::log(gamma)));
      const Matrix<T> by_gates = linattn::causal_gated_linear_attention(
          q, k, v, linattn::log_gates(logs), linattn::Identity{}, gated);
      CHECK(relative_error(by_gates, expected) <= tolerance<T>() * 5);
    }
  }
}

namespace {

/// The true S of a state, in double (s() applies the factors the state keeps pending).
template <class T>
Matrix<double> true_sums(const linattn::RecurrentState<T>& state) {
  return state.s().template cast<double>();
}

}  // namespace

TEMPLATE_TEST_CASE("gates: RWKV-6's bonus u, as FLA's naive_recurrent_rwkv6 computes it",
                   "[gates][ports][bonus]", float, double) {
  using T = TestType;
  const Eigen::Index n = 333, dk = 16, dv = 12;
  const Matrix<T> r = gaussian<T>(n, dk, 501), k = gaussian<T>(n, dk, 502);
  const Matrix<T> v = gaussian<T>(n, dv, 503);
  // w = -exp(x) per key feature (RWKV-6's data-dependent decay), a reset at token 150.
  Matrix<T> w = (-(gaussian<double>(n, dk, 504, 0.5).array() - 1.5).exp()).matrix().cast<T>();
  w.row(150).setConstant(-std::numeric_limits<T>::infinity());
  const Vector<T> u = gaussian<T>(dk, 1, 505);
  const Matrix<double> rd = r.template cast<double>(), kd = k.template cast<double>(),
                       vd = v.template cast<double>(), wd = w.template cast<double>();
  const Eigen::VectorXd ud = u.template cast<double>();
  linattn::Options options;
  options.normalize = false;
  options.scale = 1.0 / std::sqrt(double(dk));  // FLA's default scale
  Matrix<double> h = Matrix<double>::Zero(dk, dv);
  const Matrix<double> expected = naive_rwkv6(rd, kd, vd, wd, ud, options.scale, h);
  const auto bonus = linattn::with_bonus(linattn::log_gates(w), u);
  const linattn::Identity id;

  const Matrix<T> chunked = linattn::causal_gated_linear_attention(r, k, v, bonus, id, options);
  INFO("chunked: " << relative_error(chunked, expected));
  CHECK(relative_error(chunked, expected) <= tolerance<T>());
  // The same gates as a_t (Eigen's exp of -inf is 0, not a gate: keep the reset out).
  const Matrix<T> gentle = w.topRows(150);
  Matrix<double> h150 = Matrix<double>::Zero(dk, dv);
  const Matrix<double> expected150 = naive_rwkv6(rd.topRows(150), kd.topRows(150), vd.topRows(150),
                                                 wd.topRows(150), ud, options.scale, h150);
  const Matrix<T> multiplicative = linattn::causal_gated_linear_attention(
      r.topRows(150), k.topRows(150), v.topRows(150),
      linattn::with_bonus(Matrix<T>(gentle.array().exp().matrix()), u), id, options);
  CHECK(relative_error(multiplicative, expected150) <= tolerance<T>());

  // Step by step, and prefill / steps / prefill, each with the naive final state.
  linattn::RecurrentState<T> stepper(dk, dv, options), mixed(dk, dv, options);
  Matrix<T> steps(n, dv), pieces(n, dv);
  for (Eigen::Index t = 0; t < n; ++t) {
    steps.row(t) = stepper
                       .step(r.row(t), k.row(t), v.row(t),
                             linattn::with_bonus(linattn::log_gates(w.row(t)), u), id)
                       .transpose();
  }
  pieces.topRows(100) =
      mixed.prefill(r.topRows(100), k.topRows(100), v.topRows(100),
                    linattn::with_bonus(linattn::log_gates(w.topRows(100)), u), id);
  for (Eigen::Index t = 100; t < 160; ++t) {
    pieces.row(t) = mixed
                        .step(r.row(t), k.row(t), v.row(t),
                              linattn::with_bonus(linattn::log_gates(w.row(t)), u), id)
                        .transpose();
  }
  pieces.bottomRows(n - 160) =
      mixed.prefill(r.bottomRows(n - 160), k.bottomRows(n - 160), v.bottomRows(n - 160),
                    linattn::with_bonus(linattn::log_gates(w.bottomRows(n - 160)), u), id);
  CHECK(relative_error(steps, expected) <= tolerance<T>());
  CHECK(relative_error(pieces, expected) <= tolerance<T>());
  CHECK(relative_error(true_sums(stepper), h) <= tolerance<T>());
  CHECK(relative_error(true_sums(mixed), h) <= tolerance<T>());
  CHECK(stepper.tokens() == n);
  CHECK(mixed.tokens() == n);
  CHECK(mixed.transition() == linattn::TransitionKind::feature_gates);

  // Threads split the shifted kernel: the one-thread result within rounding.
  linattn::Options threaded = options;
  threaded.threads = 2;
  threaded.chunk = 32;
  CHECK(relative_error(linattn::causal_gated_linear_attention(r, k, v, bonus, id, threaded),
                       expected) <= tolerance<T>());
}

TEMPLATE_TEST_CASE("gates: the bonus with scalar gates, a feature map, a double accumulator",
                   "[gates][bonus]", float, double) {
  using T = TestType;
  const Eigen::Index n = 200, dk = 6, dv = 5;
  const linattn::EluPlusOne map;
  const Matrix<T> q = gaussian<T>(n, dk, 511), k = gaussian<T>(n, dk, 512);
  const Matrix<T> v = gaussian<T>(n, dv, 513);
  const Matrix<T> g = uniform_logs(n, 1, 514, -0.2, 0.0).cast<T>();
  const Vector<T> u = gaussian<T>(dk, 1, 515).cwiseAbs();
  linattn::Options options;
  options.normalize = false;
  Matrix<double> h = Matrix<double>::Zero(dk, dv);
  const Matrix<double> expected = naive_rwkv6(
      map.queries(q).template cast<double>(), map.keys(k).template cast<double>(),
      v.template cast<double>(), g.template cast<double>(), u.template cast<double>(), 1.0, h);
  const auto bonus = linattn::with_bonus(linattn::log_gates(g), u);
  CHECK(relative_error(linattn::causal_gated_linear_attention(q, k, v, bonus, map, options),
                       expected) <= tolerance<T>());
  CHECK(relative_error(linattn::causal_gated_linear_attention<double>(q, k, v, bonus, map, options),
                       expected) <= tolerance<T>());
  linattn::RecurrentState<T> state(dk, dv, options);
  const Matrix<T> prefilled = state.prefill(q, k, v, bonus, map);
  CHECK(relative_error(prefilled, expected) <= tolerance<T>());
  CHECK(relative_error(true_sums(state), h) <= tolerance<T>());
  CHECK(state.transition() == linattn::TransitionKind::scalar_gates);
  // One token (the bonus alone), and none.
  CHECK(relative_error(linattn::causal_gated_linear_attention(
                           q.topRows(1), k.topRows(1), v.topRows(1),
                           linattn::with_bonus(linattn::log_gates(g.topRows(1)), u), map, options),
                       expected.topRows(1)) <= tolerance<T>());
  // No tokens is an empty input, as everywhere.
  CHECK_THROWS_WITH(linattn::causal_gated_linear_attention(
                        q.topRows(0), k.topRows(0), v.topRows(0),
                        linattn::with_bonus(linattn::log_gates(g.topRows(0)), u), map, options),
                    Catch::Matchers::Contains("q is empty"));
}

TEMPLATE_TEST_CASE("gates: bad bonus input throws linattn::Error and changes nothing",
                   "[gates][bonus][errors]", float) {
  using T = TestType;
  using Catch::Matchers::Contains;
  const Eigen::Index n = 10, c = 4, dv = 3;
  const Matrix<T> q = gaussian<T>(n, c, 521), k = gaussian<T>(n, c, 522),
                  v = gaussian<T>(n, dv, 523);
  const Matrix<T> g = uniform_logs(n, c, 524, -0.3, 0.0).cast<T>();
  const Vector<T> u = Vector<T>::Constant(c, T(0.5));
  const linattn::Identity id;
  linattn::Options plain;
  plain.normalize = false;
  Matrix<T> out = Matrix<T>::Constant(n, dv, T(7));
  const auto untouched = [&] { return (out.array() == T(7)).all(); };
  const auto call = [&](const auto& gates, const linattn::Options& options) {
    linattn::causal_gated_linear_attention_into(q, k, v, gates, id, out, options);
  };
  CHECK_THROWS_WITH(call(linattn::with_bonus(linattn::log_gates(g), u), linattn::Options{}),
                    Contains("the bonus u (RWKV-6) has no normaliser"));
  const Vector<T> short_u = Vector<T>::Ones(c - 1);
  CHECK_THROWS_WITH(call(linattn::with_bonus(linattn::log_gates(g), short_u), plain),
                    Contains("u is 3 x 1, expected a vector of 4 entries"));
  Vector<T> nan_u = u;
  nan_u(2) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH(call(linattn::with_bonus(linattn::log_gates(g), nan_u), plain), Contains("u"));
  Matrix<T> bad = g;
  bad(n - 1, 1) = T(0.5);  // the last token's gate moves no output, and is still checked
  CHECK_THROWS_WITH(call(linattn::with_bonus(linattn::log_gates(bad), u), plain),
                    Contains("row 9, column 1"));
  Matrix<T> late_nan = k;
  late_nan(n - 1, 0) =
      std::numeric_limits<T>::quiet_NaN();  // the last key: only its bonus reads it
  CHECK_THROWS_WITH(
      linattn::causal_gated_linear_attention_into(
          q, late_nan, v, linattn::with_bonus(linattn::log_gates(g), u), id, out, plain),
      Contains("phi_k"));
  CHECK(untouched());
  // The state: a throwing step or prefill leaves it as it was.
  linattn::RecurrentState<T> state(c, dv, plain);
  (void)state.prefill(q.topRows(4), k.topRows(4), v.topRows(4),
                      linattn::with_bonus(linattn::log_gates(g.topRows(4)), u), id);
  const Matrix<T> s_before = state.s();
  CHECK_THROWS_WITH(
      state.prefill(q, late_nan, v, linattn::with_bonus(linattn::log_gates(g), u), id),
      Contains("phi_k"));
  CHECK_THROWS_WITH(state.step(q.row(0), k.row(0), v.row(0),
                               linattn::with_bonus(linattn::log_gates(g.row(0)), short_u), id),
                    Contains("u is"));
  CHECK_THROWS_WITH(state.step(q.row(0), k.row(0), v.row(0),
                               linattn::with_bonus(linattn::log_gates(g.col(0).row(0)), u), id),
                    Contains("per-feature gates but this call gives scalar gates"));
  CHECK(state.s() == s_before);
  CHECK(state.tokens() == 4);
  linattn::RecurrentState<T> normalised(c, dv);
  CHECK_THROWS_WITH(normalised.step(q.row(0), k.row(0), v.row(0),
                                    linattn::with_bonus(linattn::log_gates(g.row(0)), u), id),
                    Contains("no normaliser"));
  CHECK(normalised.tokens() == 0);
}

}  // namespace linattn_test_gates
