// The generalized delta rule's backward: against central finite differences of the library's
// forward in double, and against the delta rule's own backward through the mapping that makes
// DeltaNet and Gated DeltaNet special cases (its gradients chained by hand here).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/delta_rule.hpp>
#include <linattn/delta_rule_backward.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/dplr_delta_rule_backward.hpp>
#include <linattn/heads_view.hpp>
#include <string>
#include <utility>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_dplr_delta_rule_backward {

namespace {

using linattn::DplrGradients;
using linattn::DplrOptions;
using linattn::Matrix;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

constexpr double kMinusInf = -std::numeric_limits<double>::infinity();

/// One sequence's inputs in double: q, k, v Gaussian, a = -alpha kk and b = kk (kk unit rows,
/// alpha in (0, 1): RWKV-7's shape, a transition of spectral radius <= 1), log gates in
/// [-0.5, -0.01] (1 or Dk columns).
struct Inputs {
  Matrix<double> q, k, v, a, b, log_gates;
  Inputs(Eigen::Index n, Eigen::Index dk, Eigen::Index dv, Eigen::Index gate_cols,
         std::uint64_t seed)
      : q(gaussian<double>(n, dk, seed)),
        k(gaussian<double>(n, dk, seed + 1, 0.5)),
        v(gaussian<double>(n, dv, seed + 2)),
        a(n, dk),
        b(gaussian<double>(n, dk, seed + 3)),
        log_gates(
            -(0.01 + 0.49 * (gaussian<double>(n, gate_cols, seed + 4).array().abs().min(1.0)))) {
    const Matrix<double> alpha = gaussian<double>(n, dk, seed + 5).array().abs().min(0.95);
    for (Eigen::Index t = 0; t < n; ++t) b.row(t).normalize();
    a = -(alpha.array() * b.array()).matrix();
  }
};

Matrix<double> forward(const Inputs& in, const DplrOptions& options) {
  return linattn::causal_dplr_delta_rule(in.q, in.k, in.v, in.a, in.b,
                                         linattn::log_gates(in.log_gates), options);
}

/// Central differences of L = sum(grad_out o forward) for every entry, step h (1 + |x|);
/// g = -infinity has no neighbourhood and gets 0.
DplrGradients<double> finite_differences(Inputs in, const Matrix<double>& grad_out,
                                         const DplrOptions& options, double h) {
  const auto loss = [&] { return (forward(in, options).array() * grad_out.array()).sum(); };
  const auto differentiate = [&](Matrix<double>& x) {
    return linattn_test::central_differences(x, loss, h);
  };
  DplrGradients<double> grads;
  grads.q = differentiate(in.q);
  grads.k = differentiate(in.k);
  grads.v = differentiate(in.v);
  grads.a = differentiate(in.a);
  grads.b = differentiate(in.b);
  grads.gates = differentiate(in.log_gates);
  return grads;
}

/// The largest of the six gradients' relative errors, each one reported.
double gradient_error(const DplrGradients<double>& got, const DplrGradients<double>& expected) {
  const double q = relative_error(got.q, expected.q);
  const double k = relative_error(got.k, expected.k);
  const double v = relative_error(got.v, expected.v);
  const double a = relative_error(got.a, expected.a);
  const double b = relative_error(got.b, expected.b);
  const double gates = relative_error(got.gates, expected.gates);
  CAPTURE(q, k, v, a, b, gates);
  CHECK(got.gates.rows() == expected.gates.rows());
  CHECK(got.gates.cols() == expected.gates.cols());
  return std::max({q, k, v, a, b, gates});
}

}  // namespace

TEST_CASE("the generalized delta rule's backward matches central finite differences",
          "[dplr_delta_rule_backward]") {
  // Dk != Dv so that a transposed state cannot pass; N = 23 over chunks (or checkpoints) of 8
  // tokens (the last shorter); a reset of a whole token and, per feature, of one row; both
  // forms.
  const Eigen::Index n = 23, dk = 5, dv = 4;
  using linattn::DeltaForm;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, dk}) {
    for (const auto& [scale, form] :
         {std::pair(-1.0, DeltaForm::chunked), std::pair(1.0, DeltaForm::chunked),
          std::pair(1.0, DeltaForm::streamed)}) {
      CAPTURE(gate_cols, scale, form == DeltaForm::chunked);
      Inputs in(n, dk, dv, gate_cols, 100 + static_cast<std::uint64_t>(gate_cols));
      in.log_gates.row(9).setConstant(kMinusInf);
      if (gate_cols > 1) in.log_gates(15, 2) = kMinusInf;
      const Matrix<double> grad_out = gaussian<double>(n, dv, 7);
      DplrOptions options;
      options.chunk = 8;
      options.scale = scale;
      options.form = form;
      const DplrGradients<double> got = linattn::causal_dplr_delta_rule_backward(
          in.q, in.k, in.v, in.a, in.b, linattn::log_gates(in.log_gates), grad_out, options);
      // Step 1e-5 (1 + |x|): the loss's rounding over the step and the h^2 term both stay near
      // 1e-10; a wrong term errs by O(1).
      CHECK(gradient_error(got, finite_differences(in, grad_out, options, 1e-5)) <= 1e-7);
      // A reset's gradient is 0.
      CHECK((got.gates.row(9).array() == 0.0).all());
    }
  }
}

TEMPLATE_TEST_CASE("the generalized delta rule's chunked backward equals its recurrent one",
                   "[dplr_delta_rule_backward]", float, double) {
  using T = TestType;
  // N = 150 over chunks of 16 and 64 (the last shorter); resets of a whole token mid-chunk and
  // at a chunk's first token, per feature one row's; decays of e^-25 (sub-blocks pairing
  // directly) and exactly 1; Dk != Dv. The recurrent form in double is the reference.
  const Eigen::Index n = 150, dk = 12, dv = 7;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, dk}) {
    for (const Eigen::Index chunk : {Eigen::Index{16}, Eigen::Index{64}}) {
      CAPTURE(gate_cols, chunk);
      Inputs in(n, dk, dv, gate_cols, 600 + static_cast<std::uint64_t>(gate_cols));
      in.log_gates.row(40).setConstant(kMinusInf);
      in.log_gates.row(64).setConstant(kMinusInf);
      in.log_gates.row(90).setConstant(-25.0);
      in.log_gates.row(91).setZero();
      if (gate_cols > 1) {
        in.log_gates(70, 3) = kMinusInf;
        in.log_gates(100, 5) = -25.0;
      }
      const Matrix<double> grad_out = gaussian<double>(n, dv, 11);
      DplrOptions options;
      options.chunk = chunk;
      options.form = linattn::DeltaForm::streamed;
      const DplrGradients<double> reference = linattn::causal_dplr_delta_rule_backward(
          in.q, in.k, in.v, in.a, in.b, linattn::log_gates(in.log_gates), grad_out, options);
      options.form = linattn::DeltaForm::chunked;
      const auto t = [](const Matrix<double>& x) { return Matrix<T>(x.cast<T>()); };
      const DplrGradients<T> got = linattn::causal_dplr_delta_rule_backward(
          t(in.q), t(in.k), t(in.v), t(in.a), t(in.b), linattn::log_gates(t(in.log_gates)),
          t(grad_out), options);
      DplrGradients<double> as_double{
          got.q.template cast<double>(), got.k.template cast<double>(),
          got.v.template cast<double>(), got.a.template cast<double>(),
          got.b.template cast<double>(), got.gates.template cast<double>()};
      CHECK(gradient_error(as_double, reference) <= (std::is_same_v<T, float> ? 1e-4 : 1e-10));
      CHECK((got.gates.row(40).array() == T(0)).all());
      CHECK((got.gates.row(64).array() == T(0)).all());
    }
  }
}

TEMPLATE_TEST_CASE(
    "the generalized delta rule's backward on two threads splits the value "
    "columns and equals one thread's",
    "[dplr_delta_rule_backward]", float, double) {
  using T = TestType;
  // Dv = 70: two parts of 35 columns (with OpenMP; one part without), both forms.
  const Eigen::Index n = 90, dk = 10, dv = 70;
  const Inputs in(n, dk, dv, dk, 800);
  const auto t = [](const Matrix<double>& x) { return Matrix<T>(x.cast<T>()); };
  const Matrix<double> grad_out = gaussian<double>(n, dv, 12);
  for (const auto form : {linattn::DeltaForm::chunked, linattn::DeltaForm::streamed}) {
    CAPTURE(form == linattn::DeltaForm::chunked);
    DplrOptions options;
    options.form = form;
    options.chunk = 16;
    options.threads = 1;
    const DplrGradients<T> one = linattn::causal_dplr_delta_rule_backward(
        t(in.q), t(in.k), t(in.v), t(in.a), t(in.b), linattn::log_gates(t(in.log_gates)),
        t(grad_out), options);
    options.threads = 2;
    const DplrGradients<T> two = linattn::causal_dplr_delta_rule_backward(
        t(in.q), t(in.k), t(in.v), t(in.a), t(in.b), linattn::log_gates(t(in.log_gates)),
        t(grad_out), options);
    const double bound = std::is_same_v<T, float> ? 1e-5 : 1e-13;
    CHECK(relative_error(two.v, one.v) <= bound);
    CHECK(relative_error(two.q, one.q) <= bound);
    CHECK(relative_error(two.k, one.k) <= bound);
    CHECK(relative_error(two.a, one.a) <= bound);
    CHECK(relative_error(two.b, one.b) <= bound);
    CHECK(relative_error(two.gates, one.gates) <= bound);
  }
}

TEST_CASE(
    "the generalized delta rule's view and varlen backward give each head's matrix "
    "backward",
    "[dplr_delta_rule_backward]") {
  using linattn::BnhdShape;
  using linattn::ConstHeadsView;
  using linattn::HeadsView;
  // B = 2 sequences of N = 40, H = 2 heads reading one q/k head (grouped), Dk != Dv, gates
  // per feature; [B, N, H, D] buffers. q's and k's gradients sum over both heads.
  const Eigen::Index batch = 2, n = 40, heads = 2, dk = 8, dv = 6;
  const auto rows_of = [&](Eigen::Index h_count, Eigen::Index d, std::uint64_t seed) {
    return gaussian<double>(batch * n, h_count * d, seed);
  };
  const Matrix<double> q = rows_of(1, dk, 700), k = rows_of(1, dk, 701),
                       v = rows_of(heads, dv, 702);
  Matrix<double> a(batch * n, heads * dk), b = rows_of(heads, dk, 703);
  const Matrix<double> g = -(0.05 + 0.4 * rows_of(heads, dk, 704).array().abs().min(1.0)).matrix();
  for (Eigen::Index r = 0; r < batch * n; ++r) {
    for (Eigen::Index h = 0; h < heads; ++h) {
      auto bh = b.row(r).segment(h * dk, dk);
      bh.normalize();
      a.row(r).segment(h * dk, dk) = -0.7 * bh;
    }
  }
  const Matrix<double> grad_out = rows_of(heads, dv, 705);
  const auto view = [&](const Matrix<double>& m, Eigen::Index h_count) {
    return ConstHeadsView<double>::bnhd(m.data(), BnhdShape(batch, n, h_count, m.cols() / h_count));
  };
  // The expectation: each (sequence, head) through the matrix call.
  DplrOptions options;
  options.chunk = 16;
  options.form = linattn::DeltaForm::chunked;
  Matrix<double> eq = Matrix<double>::Zero(batch * n, dk), ek = eq;
  Matrix<double> ev(batch * n, heads * dv), ea(batch * n, heads * dk), eb = ea, eg = ea;
  for (Eigen::Index s = 0; s < batch; ++s) {
    for (Eigen::Index h = 0; h < heads; ++h) {
      const auto rows = [&](const Matrix<double>& m, Eigen::Index col, Eigen::Index d) {
        return Matrix<double>(m.block(s * n, col, n, d));
      };
      const DplrGradients<double> one = linattn::causal_dplr_delta_rule_backward(
          rows(q, 0, dk), rows(k, 0, dk), rows(v, h * dv, dv), rows(a, h * dk, dk),
          rows(b, h * dk, dk), linattn::log_gates(rows(g, h * dk, dk)), rows(grad_out, h * dv, dv),
          options);
      eq.middleRows(s * n, n) += one.q;
      ek.middleRows(s * n, n) += one.k;
      ev.block(s * n, h * dv, n, dv) = one.v;
      ea.block(s * n, h * dk, n, dk) = one.a;
      eb.block(s * n, h * dk, n, dk) = one.b;
      eg.block(s * n, h * dk, n, dk) = one.gates;
    }
  }
  for (const int threads : {1, 2}) {
    CAPTURE(threads);
    options.threads = threads;
    Matrix<double> gq(batch * n, dk), gk = gq, gv(batch * n, heads * dv), ga = ea, gb = ea, gg = ea;
    const auto out = [&](Matrix<double>& m, Eigen::Index h_count) {
      return HeadsView<double>::bnhd(m.data(), BnhdShape(batch, n, h_count, m.cols() / h_count));
    };
    linattn::causal_dplr_delta_rule_backward_into(
        view(q, 1), view(k, 1), view(v, heads), view(a, heads), view(b, heads),
        linattn::log_gates(view(g, heads)), view(grad_out, heads),
        linattn::DplrGradientViews<double>{out(gq, 1), out(gk, 1), out(gv, heads), out(ga, heads),
                                           out(gb, heads), out(gg, heads)},
        options);
    CHECK(relative_error(gq, eq) <= 1e-14);
    CHECK(relative_error(gk, ek) <= 1e-14);
    CHECK(gv == ev);
    CHECK(ga == ea);
    CHECK(gb == eb);
    CHECK(gg == eg);
  }
  // Packed: the same rows as one sequence of 15 tokens, an empty one and one of 65 ([1, total,
  // H, D]); each sequence's gradients are the matrix backward of its rows.
  const std::vector<std::int64_t> offsets{0, 15, 15, 80};
  const auto packed = [&](const Matrix<double>& m, Eigen::Index h_count) {
    return ConstHeadsView<double>::bnhd(m.data(),
                                        BnhdShape(1, batch * n, h_count, m.cols() / h_count));
  };
  Matrix<double> gq(batch * n, dk), gk = gq, gv(batch * n, heads * dv), ga = ea, gb = ea, gg = ea;
  const auto packed_out = [&](Matrix<double>& m, Eigen::Index h_count) {
    return HeadsView<double>::bnhd(m.data(), BnhdShape(1, batch * n, h_count, m.cols() / h_count));
  };
  linattn::causal_dplr_delta_rule_varlen_backward_into(
      packed(q, 1), packed(k, 1), packed(v, heads), packed(a, heads), packed(b, heads),
      linattn::log_gates(packed(g, heads)), packed(grad_out, heads), offsets,
      linattn::DplrGradientViews<double>{packed_out(gq, 1), packed_out(gk, 1),
                                         packed_out(gv, heads), packed_out(ga, heads),
                                         packed_out(gb, heads), packed_out(gg, heads)},
      options);
  for (const auto& sequence : {std::pair<Eigen::Index, Eigen::Index>(0, 15), {15, 65}}) {
    const Eigen::Index begin = sequence.first, len = sequence.second, h = 1;
    const auto rows = [&](const Matrix<double>& m, Eigen::Index col, Eigen::Index d) {
      return Matrix<double>(m.block(begin, col, len, d));
    };
    const DplrGradients<double> one = linattn::causal_dplr_delta_rule_backward(
        rows(q, 0, dk), rows(k, 0, dk), rows(v, h * dv, dv), rows(a, h * dk, dk),
        rows(b, h * dk, dk), linattn::log_gates(rows(g, h * dk, dk)), rows(grad_out, h * dv, dv),
        options);
    CHECK(gv.block(begin, h * dv, len, dv) == one.v);
    CHECK(ga.block(begin, h * dk, len, dk) == one.a);
    CHECK(gg.block(begin, h * dk, len, dk) == one.gates);
  }
  // A gradient view of the wrong shape: an Error before anything is written.
  const auto out = [&](Matrix<double>& m, Eigen::Index h_count) {
    return HeadsView<double>::bnhd(m.data(), BnhdShape(batch, n, h_count, m.cols() / h_count));
  };
  gv.setConstant(3.0);
  CHECK_THROWS_WITH(
      linattn::causal_dplr_delta_rule_backward_into(
          view(q, 1), view(k, 1), view(v, heads), view(a, heads), view(b, heads),
          linattn::log_gates(view(g, heads)), view(grad_out, heads),
          linattn::DplrGradientViews<double>{out(gq, 1), out(gk, 1), out(gv, heads), out(ga, heads),
                                             out(gb, heads), out(gk, 1)},
          options),
      Catch::Matchers::Contains("grads.gates"));
  CHECK((gv.array() == 3.0).all());
}

TEST_CASE("the generalized delta rule's backward for decays w_t: d / d log w = (d / d w) w",
          "[dplr_delta_rule_backward]") {
  const Eigen::Index n = 30, dk = 6, dv = 7;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, dk}) {
    CAPTURE(gate_cols);
    const Inputs in(n, dk, dv, gate_cols, 200);
    const Matrix<double> w = in.log_gates.array().exp().matrix();
    const Matrix<double> grad_out = gaussian<double>(n, dv, 8);
    const DplrGradients<double> by_log = linattn::causal_dplr_delta_rule_backward(
        in.q, in.k, in.v, in.a, in.b, linattn::log_gates(in.log_gates), grad_out);
    const DplrGradients<double> by_w =
        linattn::causal_dplr_delta_rule_backward(in.q, in.k, in.v, in.a, in.b, w, grad_out);
    CHECK(relative_error((by_w.gates.array() * w.array()).matrix(), by_log.gates) <= 1e-13);
    CHECK(relative_error(by_w.q, by_log.q) <= 1e-13);
    CHECK(relative_error(by_w.a, by_log.a) <= 1e-13);
  }
}

TEMPLATE_TEST_CASE(
    "the generalized delta rule's backward gives the delta rule's gradients through the "
    "mapping a = -beta exp(g) k, b = k, key beta k",
    "[dplr_delta_rule_backward]", float, double) {
  using T = TestType;
  // Gated DeltaNet (one gate a token) and KDA (one per key feature), the delta rule's chunked
  // backward on one side, this one on the other: N = 200 spans several checkpoints of both.
  const Eigen::Index n = 200, dk = 16, dv = 12;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, dk}) {
    CAPTURE(gate_cols);
    const Matrix<T> q = gaussian<double>(n, dk, 300).cast<T>();
    Matrix<T> k = gaussian<double>(n, dk, 301).cast<T>();
    for (Eigen::Index t = 0; t < n; ++t) k.row(t) *= T(0.9) / k.row(t).norm();
    const Matrix<T> v = gaussian<double>(n, dv, 302).cast<T>();
    const Vector<T> beta =
        (0.05 + 0.9 * gaussian<double>(n, 1, 303).array().abs().min(1.0)).matrix().cast<T>();
    const Matrix<T> g =
        (-(0.01 + 0.49 * gaussian<double>(n, gate_cols, 304).array().abs().min(1.0)))
            .matrix()
            .cast<T>();
    const Matrix<T> grad_out = gaussian<double>(n, dv, 305).cast<T>();
    linattn::DeltaOptions delta_options;  // scale Dk^-1/2, keys as given
    const auto delta = linattn::causal_gated_delta_rule_backward(q, k, v, linattn::log_gates(g),
                                                                 beta, grad_out, delta_options);
    // The mapping: decay exp(g) o k in a (the low rank reads S_{t-1}), the key beta k.
    Matrix<T> decayed_k(n, dk);
    for (Eigen::Index t = 0; t < n; ++t) {
      for (Eigen::Index d = 0; d < dk; ++d) {
        decayed_k(t, d) = std::exp(g(t, gate_cols == 1 ? 0 : d)) * k(t, d);
      }
    }
    const Matrix<T> a = -(decayed_k.array().colwise() * beta.array()).matrix();
    const Matrix<T> key = (k.array().colwise() * beta.array()).matrix();
    const DplrGradients<T> dplr = linattn::causal_dplr_delta_rule_backward(
        q, key, v, a, k, linattn::log_gates(g), grad_out, DplrOptions{});
    // The chain rule through a(beta, g, k), b = k and key(beta, k), in double.
    const Matrix<double> da = dplr.a.template cast<double>();
    const Matrix<double> dkey = dplr.k.template cast<double>();
    const Matrix<double> kd = k.template cast<double>(), ad = a.template cast<double>();
    const Vector<double> bd = beta.template cast<double>();
    Matrix<double> grad_k =
        dplr.b.template cast<double>() + (dkey.array().colwise() * bd.array()).matrix();
    Matrix<double> grad_gates(n, gate_cols);
    Vector<double> grad_beta(n);
    for (Eigen::Index t = 0; t < n; ++t) {
      for (Eigen::Index d = 0; d < dk; ++d) {
        // a_td = -beta_t exp(g_td) k_td.
        const double factor = -bd(t) * std::exp(static_cast<double>(g(t, gate_cols == 1 ? 0 : d)));
        grad_k(t, d) += da(t, d) * factor;
      }
      // d a / d beta = a / beta, d key / d beta = k.
      grad_beta(t) = (da.row(t).array() * ad.row(t).array()).sum() / bd(t) +
                     (dkey.row(t).array() * kd.row(t).array()).sum();
      // d a / d g = a (per feature, or summed over them for one gate a token).
      if (gate_cols == 1) {
        grad_gates(t, 0) = dplr.gates.template cast<double>()(t, 0) +
                           (da.row(t).array() * ad.row(t).array()).sum();
      } else {
        grad_gates.row(t) = dplr.gates.template cast<double>().row(t).array() +
                            da.row(t).array() * ad.row(t).array();
      }
    }
    const double bound = std::is_same_v<T, float> ? 1e-4 : 1e-10;
    CHECK(relative_error(dplr.q.template cast<double>(), delta.q.template cast<double>()) <= bound);
    CHECK(relative_error(dplr.v.template cast<double>(), delta.v.template cast<double>()) <= bound);
    CHECK(relative_error(grad_k, delta.k.template cast<double>()) <= bound);
    CHECK(relative_error(grad_beta, delta.beta.template cast<double>()) <= bound);
    CHECK(relative_error(grad_gates, delta.gates.template cast<double>()) <= bound);
  }
}

TEST_CASE("the generalized delta rule's backward accumulates float inputs in double",
          "[dplr_delta_rule_backward]") {
  const Eigen::Index n = 40, dk = 8, dv = 8;
  const Inputs in(n, dk, dv, dk, 400);
  const Matrix<double> grad_out = gaussian<double>(n, dv, 9);
  const auto f = [](const Matrix<double>& x) { return Matrix<float>(x.cast<float>()); };
  const DplrGradients<float> in_double = linattn::causal_dplr_delta_rule_backward<double>(
      f(in.q), f(in.k), f(in.v), f(in.a), f(in.b), linattn::log_gates(f(in.log_gates)),
      f(grad_out));
  const DplrGradients<float> in_float =
      linattn::causal_dplr_delta_rule_backward(f(in.q), f(in.k), f(in.v), f(in.a), f(in.b),
                                               linattn::log_gates(f(in.log_gates)), f(grad_out));
  const DplrGradients<double> reference = linattn::causal_dplr_delta_rule_backward(
      Matrix<double>(f(in.q).cast<double>()), Matrix<double>(f(in.k).cast<double>()),
      Matrix<double>(f(in.v).cast<double>()), Matrix<double>(f(in.a).cast<double>()),
      Matrix<double>(f(in.b).cast<double>()),
      linattn::log_gates(Matrix<double>(f(in.log_gates).cast<double>())),
      Matrix<double>(f(grad_out).cast<double>()));
  const double error_double = relative_error(in_double.a.cast<double>(), reference.a);
  const double error_float = relative_error(in_float.a.cast<double>(), reference.a);
  CAPTURE(error_double, error_float);
  CHECK(error_double <= 1e-6);
  CHECK(error_float <= 1e-4);
}

TEST_CASE("the generalized delta rule's backward rejects bad input and writes nothing",
          "[dplr_delta_rule_backward]") {
  const Eigen::Index n = 10, dk = 4, dv = 3;
  const Inputs in(n, dk, dv, 1, 500);
  const Matrix<double> grad_out = gaussian<double>(n, dv, 10);
  DplrGradients<double> grads;
  grads.q = Matrix<double>::Constant(2, 2, 7.0);
  const auto rejects = [&](const std::string& needle, auto&& call) {
    CAPTURE(needle);
    try {
      call();
      FAIL("no Error");
    } catch (const linattn::Error& e) {
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
    CHECK(grads.q.rows() == 2);  // untouched
    CHECK(grads.q(0, 0) == 7.0);
  };
  const auto g = linattn::log_gates(in.log_gates);
  rejects("grad_out", [&] {
    linattn::causal_dplr_delta_rule_backward_into(in.q, in.k, in.v, in.a, in.b, g,
                                                  grad_out.leftCols(2), grads);
  });
  rejects("a is", [&] {
    linattn::causal_dplr_delta_rule_backward_into(in.q, in.k, in.v, in.a.topRows(n - 1), in.b, g,
                                                  grad_out, grads);
  });
  Matrix<double> bad_out = grad_out;
  bad_out(3, 1) = std::numeric_limits<double>::quiet_NaN();
  rejects("grad_out", [&] {
    linattn::causal_dplr_delta_rule_backward_into(in.q, in.k, in.v, in.a, in.b, g, bad_out, grads);
  });
  Matrix<double> positive = in.log_gates;
  positive(2, 0) = 0.5;
  rejects("gates", [&] {
    linattn::causal_dplr_delta_rule_backward_into(in.q, in.k, in.v, in.a, in.b,
                                                  linattn::log_gates(positive), grad_out, grads);
  });
}

}  // namespace linattn_test_dplr_delta_rule_backward
