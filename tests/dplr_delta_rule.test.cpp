// The generalized (diagonal-plus-low-rank) delta rule: both forms and DplrDeltaRuleState
// against FLA's naive dplr recurrence and RWKV-7's own recurrence, written here in double.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <linattn/delta_rule.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/layer.hpp>
#include <linattn/session_pool.hpp>
#include <linattn/state_io.hpp>
#include <sstream>
#include <string>

#include "heads_support.hpp"
#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_dplr_delta_rule {

namespace {

using linattn::DeltaForm;
using linattn::DplrDeltaRuleState;
using linattn::DplrOptions;
using linattn::Matrix;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

constexpr double kMinusInf = -std::numeric_limits<double>::infinity();

/// FLA's naive_dplr_recurrence in double, token by token: q scaled by s, then
/// S <- diag(exp(g_t)) S + b_t (a_t^T S) + k_t v_t^T (the low rank reading S before the
/// decay), o_t = S^T q_t. `log_gates` has 1 or Dk columns; `state` enters as the initial state
/// and leaves as the final one.
Matrix<double> naive_dplr(const Matrix<double>& q, const Matrix<double>& k, const Matrix<double>& v,
                          const Matrix<double>& a, const Matrix<double>& b,
                          const Matrix<double>& log_gates, double scale, Matrix<double>& state) {
  Matrix<double> out(q.rows(), v.cols());
  for (Eigen::Index t = 0; t < q.rows(); ++t) {
    const Eigen::RowVectorXd u = a.row(t) * state;
    for (Eigen::Index d = 0; d < state.rows(); ++d) {
      const double w = std::exp(log_gates(t, log_gates.cols() == 1 ? 0 : d));
      state.row(d) = w * state.row(d) + b(t, d) * u + k(t, d) * v.row(t);
    }
    out.row(t) = scale * q.row(t) * state;
  }
  return out;
}

Matrix<double> naive_dplr(const Matrix<double>& q, const Matrix<double>& k, const Matrix<double>& v,
                          const Matrix<double>& a, const Matrix<double>& b,
                          const Matrix<double>& log_gates, double scale) {
  Matrix<double> state = Matrix<double>::Zero(q.cols(), v.cols());
  return naive_dplr(q, k, v, a, b, log_gates, scale, state);
}

/// RWKV-7's reference recurrence (RWKV-LM's RWKV_x070 time mixing, one head) in its own
/// layout: the state V x K, decays w (not logs), and
///     state = state * w (per key column) + state @ ((-kk) (kk * a)^T) + v k^T,  out = state @ r.
Matrix<double> naive_rwkv7(const Matrix<double>& r, const Matrix<double>& w,
                           const Matrix<double>& k, const Matrix<double>& v,
                           const Matrix<double>& kk, const Matrix<double>& a_coef,
                           Matrix<double>& state) {
  Matrix<double> out(r.rows(), v.cols());
  for (Eigen::Index t = 0; t < r.rows(); ++t) {
    const Matrix<double> vk = v.row(t).transpose() * k.row(t);
    const Matrix<double> ab = (-kk.row(t)).transpose() * kk.row(t).cwiseProduct(a_coef.row(t));
    Matrix<double> decayed = state;
    for (Eigen::Index j = 0; j < state.cols(); ++j) decayed.col(j) *= w(t, j);
    state = decayed + state * ab + vk;
    out.row(t) = (state * r.row(t).transpose()).transpose();
  }
  return out;
}

/// One RWKV-7-like sequence in double: kk unit rows, a = -kk, b = kk o alpha with alpha in
/// (0, 1), keys of norm about 1, log decays in [-0.6, 0] (RWKV-7's w = exp(-exp(w_raw)) with
/// w_raw <= -0.5), `gate_cols` columns.
struct Sequence {
  Matrix<double> q, k, v, a, b, log_gates;
  Sequence(Eigen::Index n, Eigen::Index dk, Eigen::Index dv, Eigen::Index gate_cols,
           std::uint64_t seed)
      : q(gaussian<double>(n, dk, seed)),
        k(gaussian<double>(n, dk, seed + 1, 1.0 / std::sqrt(static_cast<double>(dk)))),
        v(gaussian<double>(n, dv, seed + 2)),
        a(gaussian<double>(n, dk, seed + 3)),
        b(n, dk),
        log_gates(-0.3 * (gaussian<double>(n, gate_cols, seed + 4).array().abs().min(2.0))) {
    const Matrix<double> alpha =
        (0.5 + 0.45 * gaussian<double>(n, dk, seed + 5).array().tanh()).matrix();
    for (Eigen::Index t = 0; t < n; ++t) {
      a.row(t).normalize();
      b.row(t) = a.row(t).cwiseProduct(alpha.row(t));
      a.row(t) = -a.row(t);
    }
  }
};

template <class T>
Matrix<T> call(const Sequence& s, const DplrOptions& options) {
  const Matrix<T> q = s.q.cast<T>(), k = s.k.cast<T>(), v = s.v.cast<T>();
  const Matrix<T> a = s.a.cast<T>(), b = s.b.cast<T>(), g = s.log_gates.cast<T>();
  return linattn::causal_dplr_delta_rule(q, k, v, a, b, linattn::log_gates(g), options);
}

/// docs/design.md's bound for the delta family with normalised keys.
template <class T>
double bound() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-10;
}

DplrOptions with_form(DeltaForm form, Eigen::Index chunk = 64) {
  DplrOptions options;
  options.form = form;
  options.chunk = chunk;
  return options;
}

}  // namespace

TEMPLATE_TEST_CASE("both forms of the generalized delta rule match the naive recurrence", "[dplr]",
                   float, double) {
  for (const Eigen::Index dk : {Eigen::Index{23}, Eigen::Index{24}}) {
    for (const Eigen::Index dv : {Eigen::Index{24}, Eigen::Index{37}}) {
      for (const Eigen::Index gate_cols : {Eigen::Index{1}, dk}) {
        const Sequence s(150, dk, dv, gate_cols, 11 + static_cast<std::uint64_t>(dv + gate_cols));
        const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
        const Matrix<double> expected = naive_dplr(s.q, s.k, s.v, s.a, s.b, s.log_gates, scale);
        CAPTURE(dk, dv, gate_cols);
        CHECK(relative_error(call<TestType>(s, with_form(DeltaForm::streamed)), expected) <=
              bound<TestType>());
        for (const Eigen::Index chunk : {Eigen::Index{16}, Eigen::Index{32}, Eigen::Index{64}}) {
          CAPTURE(chunk);
          CHECK(relative_error(call<TestType>(s, with_form(DeltaForm::chunked, chunk)), expected) <=
                bound<TestType>());
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("DplrDeltaRuleState: steps, prefill then steps, initial and final state",
                   "[dplr][state]", float, double) {
  const Eigen::Index dk = 16, dv = 20, n = 90;
  const Sequence s(n, dk, dv, dk, 5);
  const Matrix<double> s0 = 0.5 * gaussian<double>(dk, dv, 6);
  Matrix<double> final_state = s0;
  const Matrix<double> expected =
      naive_dplr(s.q, s.k, s.v, s.a, s.b, s.log_gates, 0.25, final_state);
  const Matrix<TestType> q = s.q.cast<TestType>(), k = s.k.cast<TestType>();
  const Matrix<TestType> v = s.v.cast<TestType>(), a = s.a.cast<TestType>();
  const Matrix<TestType> b = s.b.cast<TestType>(), g = s.log_gates.cast<TestType>();
  for (const DeltaForm form : {DeltaForm::chunked, DeltaForm::streamed}) {
    for (const Eigen::Index split : {Eigen::Index{0}, Eigen::Index{37}, n}) {
      CAPTURE(static_cast<int>(form), split);
      DplrOptions options = with_form(form, 32);
      auto state = DplrDeltaRuleState<TestType>::from_state(s0, options);
      Matrix<TestType> out(n, dv);
      if (split > 0) {
        out.topRows(split) =
            state.prefill(q.topRows(split), k.topRows(split), v.topRows(split), a.topRows(split),
                          b.topRows(split), linattn::log_gates(g.topRows(split)));
      }
      for (Eigen::Index t = split; t < n; ++t) {
        out.row(t) = state
                         .step(q.row(t), k.row(t), v.row(t), a.row(t), b.row(t),
                               linattn::log_gates(g.row(t)))
                         .transpose();
      }
      CHECK(relative_error(out, expected) <= bound<TestType>());
      CHECK(relative_error(state.s(), final_state) <= bound<TestType>());
      CHECK(state.tokens() == n);
      CHECK(state.transition() == linattn::TransitionKind::feature_gates);
    }
  }
  // A scalar gate per token is one decay for every feature; decays as w_t, not logs, agree.
  const Matrix<double> g1 = s.log_gates.col(0);
  const Matrix<double> expected1 = naive_dplr(s.q, s.k, s.v, s.a, s.b, g1, 0.25);
  DplrDeltaRuleState<TestType> state(dk, dv);
  const Matrix<TestType> w = g1.array().exp().matrix().cast<TestType>();
  const Matrix<TestType> out = state.prefill(q, k, v, a, b, w);
  CHECK(relative_error(out, expected1) <= bound<TestType>());
}

TEMPLATE_TEST_CASE("the generalized delta rule over decays from 1e-30 to 1, and resets", "[dplr]",
                   float, double) {
  const Eigen::Index dk = 16, dv = 24, n = 200;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, dk}) {
    Sequence s(n, dk, dv, gate_cols, 31 + static_cast<std::uint64_t>(gate_cols));
    for (Eigen::Index t = 0; t < n; ++t) {
      for (Eigen::Index c = 0; c < gate_cols; ++c) {
        const Eigen::Index pick = (t * 7 + c * 3) % 23;
        if (pick == 0) s.log_gates(t, c) = std::log(1e-30);
        if (pick == 1) s.log_gates(t, c) = std::log(1e-8);
        if (pick >= 2 && pick < 9) s.log_gates(t, c) = 0.0;  // exactly 1
      }
    }
    // Resets mid-chunk (a whole token, every feature), two in a row, on a chunk's first (64)
    // and last (79, chunk 16) token, around a piece of one token (101) and of 17 (111-127: a
    // sub-block of one), and of single features.
    for (const Eigen::Index t : {5, 40, 41, 64, 79, 100, 102, 110, 128}) {
      s.log_gates.row(t).setConstant(kMinusInf);
    }
    if (gate_cols > 1) {
      s.log_gates(77, 3) = kMinusInf;
      s.log_gates(130, 0) = kMinusInf;
      s.log_gates(130, 15) = kMinusInf;
    }
    const Matrix<double> expected = naive_dplr(s.q, s.k, s.v, s.a, s.b, s.log_gates, 0.25);
    CAPTURE(gate_cols);
    CHECK(relative_error(call<TestType>(s, with_form(DeltaForm::streamed)), expected) <=
          bound<TestType>());
    for (const Eigen::Index chunk : {Eigen::Index{16}, Eigen::Index{64}}) {
      CAPTURE(chunk);
      CHECK(relative_error(call<TestType>(s, with_form(DeltaForm::chunked, chunk)), expected) <=
            bound<TestType>());
    }
  }
}

TEST_CASE("the generalized delta rule gives DeltaNet, Gated DeltaNet and KDA", "[dplr]") {
  // (I - beta k k^T) diag(exp(g)) S + beta k v^T is diag(exp(g)) S + k (a^T S) + (beta k) v^T
  // with a = -beta exp(g) o k: the low rank reads S before the decay, so a carries it.
  const Eigen::Index dk = 16, dv = 24, n = 130;
  for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
    CAPTURE(gate_cols);
    const Matrix<double> q = gaussian<double>(n, dk, 41);
    Matrix<double> k = gaussian<double>(n, dk, 42);
    for (Eigen::Index t = 0; t < n; ++t) k.row(t).normalize();
    const Matrix<double> v = gaussian<double>(n, dv, 43);
    const Vector<double> beta =
        (0.1 + 0.85 * gaussian<double>(n, 1, 44).array().abs().min(1.0)).matrix();
    const Matrix<double> g =
        gate_cols == 0 ? Matrix<double>::Zero(n, 1)
                       : Matrix<double>(-0.2 * gaussian<double>(n, gate_cols, 45).array().abs());
    Matrix<double> a(n, dk), key(n, dk);
    for (Eigen::Index t = 0; t < n; ++t) {
      for (Eigen::Index d = 0; d < dk; ++d) {
        a(t, d) = -beta(t) * std::exp(g(t, g.cols() == 1 ? 0 : d)) * k(t, d);
      }
      key.row(t) = beta(t) * k.row(t);
    }
    const Matrix<double> own =
        gate_cols == 0 ? linattn::causal_delta_rule(q, k, v, beta)
                       : linattn::causal_gated_delta_rule(q, k, v, linattn::log_gates(g), beta);
    for (const DeltaForm form : {DeltaForm::chunked, DeltaForm::streamed}) {
      CAPTURE(static_cast<int>(form));
      const Matrix<double> general = linattn::causal_dplr_delta_rule(
          q, key, v, a, k, linattn::log_gates(g), with_form(form, 32));
      CHECK(relative_error(general, own) <= 1e-10);
    }
  }
}

TEST_CASE("RWKV-7's recurrence in its own layout is the generalized delta rule", "[dplr]") {
  // RWKV-7 stores its state V x K and decays by w = exp(-exp(w_raw)); here S = state^T,
  // a = -kk, b = kk * a_coef, g = log w, and the scale 1 its layer passes. Dk != Dv, so a
  // transposed state cannot pass.
  const Eigen::Index dk = 16, dv = 24, n = 100;
  const Matrix<double> r = gaussian<double>(n, dk, 51);
  const Matrix<double> k = gaussian<double>(n, dk, 52, 0.3);
  const Matrix<double> v = gaussian<double>(n, dv, 53);
  Matrix<double> kk = gaussian<double>(n, dk, 54);
  for (Eigen::Index t = 0; t < n; ++t) kk.row(t).normalize();
  const Matrix<double> a_coef =
      (1.0 / (1.0 + (-gaussian<double>(n, dk, 55)).array().exp())).matrix();  // sigmoid
  const Matrix<double> w_raw =
      (-(1.0 + gaussian<double>(n, dk, 56).array().exp()).log() - 0.5).matrix();
  const Matrix<double> w = (-w_raw.array().exp()).exp().matrix();
  Matrix<double> state = 0.1 * gaussian<double>(dv, dk, 57);
  const Matrix<double> s0 = state.transpose();
  const Matrix<double> expected = naive_rwkv7(r, w, k, v, kk, a_coef, state);

  const Matrix<double> log_w = -w_raw.array().exp().matrix();
  const Matrix<double> a = -kk;
  const Matrix<double> b = kk.cwiseProduct(a_coef);
  DplrOptions options;
  options.scale = 1.0;
  for (const DeltaForm form : {DeltaForm::chunked, DeltaForm::streamed}) {
    CAPTURE(static_cast<int>(form));
    options.form = form;
    options.chunk = 32;
    auto ours = DplrDeltaRuleState<double>::from_state(s0, options);
    const Matrix<double> out = ours.prefill(r, k, v, a, b, linattn::log_gates(log_w));
    CHECK(relative_error(out, expected) <= 1e-10);
    CHECK(relative_error(ours.s(), state.transpose()) <= 1e-10);
  }
}

TEMPLATE_TEST_CASE("the generalized delta rule at N = 65,536", "[dplr][long]", float, double) {
  const Eigen::Index dk = 16, dv = 16, n = 65536;
  const Sequence s(n, dk, dv, dk, 61);
  const Matrix<double> expected = naive_dplr(s.q, s.k, s.v, s.a, s.b, s.log_gates, 0.25);
  CHECK(relative_error(call<TestType>(s, with_form(DeltaForm::streamed)), expected) <=
        bound<TestType>());
  CHECK(relative_error(call<TestType>(s, with_form(DeltaForm::chunked)), expected) <=
        bound<TestType>());
}

TEMPLATE_TEST_CASE("the generalized delta rule up to a transition of spectral radius 1", "[dplr]",
                   float, double) {
  // No decay, a = -c kk, b = kk: I - c kk kk^T has the eigenvalue 1 - c along kk, -1 at c = 2.
  const Eigen::Index dk = 16, dv = 16, n = 300;
  for (const double c : {0.5, 1.0, 1.5, 1.9, 2.0}) {
    CAPTURE(c);
    Sequence s(n, dk, dv, 1, 71);
    s.log_gates.setZero();
    for (Eigen::Index t = 0; t < n; ++t) {
      s.b.row(t) = -s.a.row(t);
      s.a.row(t) *= c;
    }
    const Matrix<double> expected = naive_dplr(s.q, s.k, s.v, s.a, s.b, s.log_gates, 0.25);
    CHECK(relative_error(call<TestType>(s, with_form(DeltaForm::streamed)), expected) <=
          bound<TestType>());
    CHECK(relative_error(call<TestType>(s, with_form(DeltaForm::chunked, 32)), expected) <=
          10 * bound<TestType>());
  }
}

TEMPLATE_TEST_CASE("one generalized delta-rule sequence on two threads", "[dplr][threads]", float,
                   double) {
  const Eigen::Index dk = 16, dv = 72;
  const Sequence s(120, dk, dv, dk, 81);
  const Matrix<double> expected = naive_dplr(s.q, s.k, s.v, s.a, s.b, s.log_gates, 0.25);
  for (const DeltaForm form : {DeltaForm::chunked, DeltaForm::streamed}) {
    CAPTURE(static_cast<int>(form));
    DplrOptions options = with_form(form, 32);
    options.threads = 1;
    const Matrix<TestType> one = call<TestType>(s, options);
    options.threads = 2;
    const Matrix<TestType> two = call<TestType>(s, options);
    CHECK(relative_error(one, expected) <= bound<TestType>());
    CHECK(relative_error(two, expected) <= bound<TestType>());
    if (form == DeltaForm::streamed) CHECK(one == two);  // each column's arithmetic unchanged
  }
}

TEST_CASE("the generalized delta rule's step on rows 4 KiB long", "[dplr]") {
  // Dv = 1024 floats: the step runs on whole rows (strips would 4K-alias), the same numbers.
  const Eigen::Index dk = 4, dv = 1024, n = 20;
  const Sequence s(n, dk, dv, dk, 121);
  const Matrix<double> expected = naive_dplr(s.q, s.k, s.v, s.a, s.b, s.log_gates, 0.5);
  for (const DeltaForm form : {DeltaForm::chunked, DeltaForm::streamed}) {
    CAPTURE(static_cast<int>(form));
    CHECK(relative_error(call<float>(s, with_form(form)), expected) <= bound<float>());
  }
}

TEST_CASE("the generalized delta rule on 16-bit inputs and in double", "[dplr][half]") {
  const Eigen::Index dk = 16, dv = 24, n = 100;
  const Sequence s(n, dk, dv, dk, 91);
  // The naive recurrence on the inputs as rounded to bfloat16.
  using B16 = Eigen::bfloat16;
  const Matrix<B16> q = s.q.cast<B16>(), k = s.k.cast<B16>(), v = s.v.cast<B16>();
  const Matrix<B16> a = s.a.cast<B16>(), b = s.b.cast<B16>(), g = s.log_gates.cast<B16>();
  const Matrix<double> expected =
      naive_dplr(q.cast<double>(), k.cast<double>(), v.cast<double>(), a.cast<double>(),
                 b.cast<double>(), g.cast<double>(), 0.25);
  for (const DeltaForm form : {DeltaForm::chunked, DeltaForm::streamed}) {
    CAPTURE(static_cast<int>(form));
    const Matrix<B16> out =
        linattn::causal_dplr_delta_rule(q, k, v, a, b, linattn::log_gates(g), with_form(form));
    CHECK(relative_error(out, expected) <= 8e-3);  // bfloat16's output rounding, 2^-8
    // Float inputs accumulated in double: only the output's rounding.
    const Matrix<float> out_double = linattn::causal_dplr_delta_rule<double>(
        s.q.cast<float>(), s.k.cast<float>(), s.v.cast<float>(), s.a.cast<float>(),
        s.b.cast<float>(), linattn::log_gates(Matrix<float>(s.log_gates.cast<float>())),
        with_form(form));
    const Matrix<double> expected_float = naive_dplr(
        s.q.cast<float>().cast<double>(), s.k.cast<float>().cast<double>(),
        s.v.cast<float>().cast<double>(), s.a.cast<float>().cast<double>(),
        s.b.cast<float>().cast<double>(), s.log_gates.cast<float>().cast<double>(), 0.25);
    CHECK(relative_error(out_double, expected_float) <= 1e-6);
  }
  DplrDeltaRuleState<B16, float> state(dk, dv);
  Matrix<double> stepped(n, dv);
  for (Eigen::Index t = 0; t < n; ++t) {
    stepped.row(t) =
        state.step(q.row(t), k.row(t), v.row(t), a.row(t), b.row(t), linattn::log_gates(g.row(t)))
            .template cast<double>()
            .transpose();
  }
  CHECK(relative_error(stepped, expected) <= 8e-3);
}

TEMPLATE_TEST_CASE("the generalized delta rule on views: layouts, grouped q/k heads, varlen",
                   "[dplr][heads]", float, double) {
  using T = TestType;
  using linattn_test::Heads;
  using linattn_test::Layout;
  const Eigen::Index batch = 2, heads = 4, qk_heads = 2, n = 70, dk = 16, dv = 12;
  const T gap = T(-7);
  for (const Layout layout : {Layout::bhnd, Layout::bnhd, Layout::padded}) {
    CAPTURE(linattn_test::layout_name(layout));
    Heads<T> q(layout, batch, qk_heads, n, dk, gap), k(layout, batch, qk_heads, n, dk, gap);
    Heads<T> v(layout, batch, heads, n, dv, gap), a(layout, batch, heads, n, dk, gap);
    // One decay per token on the padded layout, one per key feature on the others.
    const Eigen::Index gate_cols = layout == Layout::padded ? 1 : dk;
    Heads<T> b(layout, batch, heads, n, dk, gap), g(layout, batch, heads, n, gate_cols, gap);
    Heads<T> out(layout, batch, heads, n, dv, gap);
    // NaN in every output row before each call, so a row left unwritten fails.
    const auto clear = [&] {
      for (Eigen::Index bi = 0; bi < batch; ++bi) {
        for (Eigen::Index h = 0; h < heads; ++h) {
          out.set_head(bi, h, Matrix<T>::Constant(n, dv, std::numeric_limits<T>::quiet_NaN()));
        }
      }
    };
    std::vector<Sequence> seqs;
    for (Eigen::Index i = 0; i < batch * heads; ++i) {
      seqs.emplace_back(n, dk, dv, gate_cols, 200 + static_cast<std::uint64_t>(i) * 10);
      const Sequence& s = seqs.back();
      const Eigen::Index bi = i / heads, h = i % heads;
      if (h % 2 == 0) {  // q/k head h / 2 is read by value heads h and h + 1 (interleaved)
        q.set_head(bi, h / 2, s.q.cast<T>());
        k.set_head(bi, h / 2, s.k.cast<T>());
      }
      v.set_head(bi, h, s.v.cast<T>());
      a.set_head(bi, h, s.a.cast<T>());
      b.set_head(bi, h, s.b.cast<T>());
      g.set_head(bi, h, s.log_gates.cast<T>());
    }
    const auto expected = [&](Eigen::Index bi, Eigen::Index h, Eigen::Index begin,
                              Eigen::Index len) {
      const Sequence& own = seqs[static_cast<std::size_t>(bi * heads + h)];
      const Sequence& lead = seqs[static_cast<std::size_t>(bi * heads + h - h % 2)];
      return naive_dplr(lead.q.middleRows(begin, len), lead.k.middleRows(begin, len),
                        own.v.middleRows(begin, len), own.a.middleRows(begin, len),
                        own.b.middleRows(begin, len), own.log_gates.middleRows(begin, len), 0.25);
    };
    // The streamed form on one thread runs a sequence's heads token-major; on two it splits
    // them (or the sequences) between the threads.
    for (const auto& [form, threads] :
         {std::pair{DeltaForm::chunked, 1}, std::pair{DeltaForm::streamed, 1},
          std::pair{DeltaForm::streamed, 2}}) {
      CAPTURE(static_cast<int>(form), threads);
      DplrOptions options = with_form(form, 32);
      options.threads = threads;
      clear();
      linattn::causal_dplr_delta_rule_into(q.cview(), k.cview(), v.cview(), a.cview(), b.cview(),
                                           linattn::log_gates(g.cview()), out.view(), options);
      CHECK(out.gaps_hold(gap));
      for (Eigen::Index bi = 0; bi < batch; ++bi) {
        for (Eigen::Index h = 0; h < heads; ++h) {
          CAPTURE(bi, h);
          CHECK(relative_error(out.head(bi, h), expected(bi, h, 0, n)) <= bound<T>());
        }
      }
      // Batch entry 0 packed as three sequences (one empty), each from a zero state.
      const std::vector<std::int64_t> offsets = {0, 25, 25, n};
      const auto first = [](const Heads<T>& x) {
        const auto view = x.cview();
        return linattn::ConstHeadsView<T>(view.data(), 1, view.heads(), view.tokens(), view.dim(),
                                          view.strides());
      };
      const auto first_out = [&]() {
        const auto view = out.view();
        return linattn::HeadsView<T>(view.data(), 1, view.heads(), view.tokens(), view.dim(),
                                     view.strides());
      };
      clear();
      linattn::causal_dplr_delta_rule_varlen_into(first(q), first(k), first(v), first(a), first(b),
                                                  linattn::log_gates(first(g)), offsets,
                                                  first_out(), options);
      for (Eigen::Index h = 0; h < heads; ++h) {
        for (std::size_t part = 0; part + 1 < offsets.size(); ++part) {
          const Eigen::Index begin = offsets[part], len = offsets[part + 1] - begin;
          if (len == 0) continue;
          CAPTURE(h, part);
          CHECK(relative_error(out.head(0, h).middleRows(begin, len), expected(0, h, begin, len)) <=
                bound<T>());
        }
      }
    }
    // a with another head count is refused before anything is written.
    Heads<T> short_a(layout, batch, qk_heads, n, dk, gap);
    CHECK_THROWS_WITH(
        linattn::causal_dplr_delta_rule_into(q.cview(), k.cview(), v.cview(), short_a.cview(),
                                             b.cview(), linattn::log_gates(g.cview()), out.view()),
        Catch::Contains("a needs one head per value head"));
  }
}

TEST_CASE("DplrDeltaRuleLayer: prefill on views, steps on rows, and the session pools",
          "[dplr][layer]") {
  using linattn_test::Heads;
  using linattn_test::Layout;
  using T = float;
  // RWKV-7 has as many q/k heads as value heads; two q/k heads over four test the grouping.
  const Eigen::Index batch = 2, heads = 4, qk_heads = 2, n = 40, split = 30, dk = 16, dv = 12;
  DplrOptions options;
  options.scale = 1.0;
  options.chunk = 16;
  const linattn::DplrDeltaRuleLayer<T> layer(
      linattn::LayerHeads::grouped_query_key(heads, qk_heads), dk, dv, options);
  std::vector<Sequence> seqs;
  for (Eigen::Index i = 0; i < batch * heads; ++i) {
    seqs.emplace_back(n, dk, dv, i % 2 == 0 ? dk : 1, 300 + static_cast<std::uint64_t>(i) * 10);
    // Gates of one width in a call: the odd heads' scalar gates broadcast to Dk columns.
    Sequence& s = seqs.back();
    if (s.log_gates.cols() == 1) s.log_gates = s.log_gates.replicate(1, dk).eval();
  }
  const auto own = [&](Eigen::Index bi, Eigen::Index h) -> const Sequence& {
    return seqs[static_cast<std::size_t>(bi * heads + h)];
  };
  Matrix<double> expected[2][4];
  for (Eigen::Index bi = 0; bi < batch; ++bi) {
    for (Eigen::Index h = 0; h < heads; ++h) {
      const Sequence& lead = own(bi, h - h % 2);
      expected[bi][h] = naive_dplr(lead.q, lead.k, own(bi, h).v, own(bi, h).a, own(bi, h).b,
                                   own(bi, h).log_gates, 1.0);
    }
  }
  // The prompt: tokens [0, split) as [B, N, H, D] views.
  const T gap = T(0);
  Heads<T> q(Layout::bnhd, batch, qk_heads, split, dk, gap),
      k(Layout::bnhd, batch, qk_heads, split, dk, gap);
  Heads<T> v(Layout::bnhd, batch, heads, split, dv, gap),
      a(Layout::bnhd, batch, heads, split, dk, gap);
  Heads<T> b(Layout::bnhd, batch, heads, split, dk, gap),
      g(Layout::bnhd, batch, heads, split, dk, gap);
  Heads<T> out(Layout::bnhd, batch, heads, split, dv, gap);
  for (Eigen::Index bi = 0; bi < batch; ++bi) {
    for (Eigen::Index h = 0; h < heads; ++h) {
      const Sequence& s = own(bi, h);
      if (h % 2 == 0) {
        q.set_head(bi, h / 2, s.q.topRows(split).cast<T>());
        k.set_head(bi, h / 2, s.k.topRows(split).cast<T>());
      }
      v.set_head(bi, h, s.v.topRows(split).cast<T>());
      a.set_head(bi, h, s.a.topRows(split).cast<T>());
      b.set_head(bi, h, s.b.topRows(split).cast<T>());
      g.set_head(bi, h, s.log_gates.topRows(split).cast<T>());
    }
  }
  // A step's rows: (B * H_qk) x Dk for q and k, (B * H) x ... for the rest.
  const auto step_rows = [&](Eigen::Index t, Matrix<T>& qt, Matrix<T>& kt, Matrix<T>& vt,
                             Matrix<T>& at, Matrix<T>& bt, Matrix<T>& gt) {
    qt.resize(batch * qk_heads, dk);
    kt.resize(batch * qk_heads, dk);
    vt.resize(batch * heads, dv);
    at.resize(batch * heads, dk);
    bt.resize(batch * heads, dk);
    gt.resize(batch * heads, dk);
    for (Eigen::Index bi = 0; bi < batch; ++bi) {
      for (Eigen::Index h = 0; h < heads; ++h) {
        const Sequence& s = own(bi, h);
        const Eigen::Index r = bi * heads + h;
        if (h % 2 == 0) {
          qt.row(bi * qk_heads + h / 2) = s.q.row(t).cast<T>();
          kt.row(bi * qk_heads + h / 2) = s.k.row(t).cast<T>();
        }
        vt.row(r) = s.v.row(t).cast<T>();
        at.row(r) = s.a.row(t).cast<T>();
        bt.row(r) = s.b.row(t).cast<T>();
        gt.row(r) = s.log_gates.row(t).cast<T>();
      }
    }
  };
  const auto check_prompt = [&]() {
    for (Eigen::Index bi = 0; bi < batch; ++bi) {
      for (Eigen::Index h = 0; h < heads; ++h) {
        CAPTURE(bi, h);
        CHECK(relative_error(out.head(bi, h), expected[bi][h].topRows(split)) <= bound<T>());
      }
    }
  };
  const auto check_step = [&](Eigen::Index t, const Matrix<T>& step_out) {
    for (Eigen::Index bi = 0; bi < batch; ++bi) {
      for (Eigen::Index h = 0; h < heads; ++h) {
        CAPTURE(t, bi, h);
        CHECK(relative_error(step_out.row(bi * heads + h), expected[bi][h].row(t)) <= bound<T>());
      }
    }
  };
  Matrix<T> qt, kt, vt, at, bt, gt, step_out(batch * heads, dv);

  // NaN in every output row before each prefill, so a row left unwritten fails.
  const auto clear = [&] {
    for (Eigen::Index bi = 0; bi < batch; ++bi) {
      for (Eigen::Index h = 0; h < heads; ++h) {
        out.set_head(bi, h, Matrix<T>::Constant(split, dv, std::numeric_limits<T>::quiet_NaN()));
      }
    }
  };
  // Tokens [begin, begin + len) of a view.
  const auto part = [](const auto& view, Eigen::Index begin, Eigen::Index len) {
    using View = std::decay_t<decltype(view)>;
    return View(view.data() + begin * view.strides().token, view.batch(), view.heads(), len,
                view.dim(), view.strides());
  };
  auto states = layer.make_states(batch);
  clear();
  // The prompt in two prefills: the second continues from the states the first left.
  for (const auto& [begin, len] :
       {std::pair<Eigen::Index, Eigen::Index>{0, 20}, {20, split - 20}}) {
    layer.prefill_into(states, part(q.cview(), begin, len), part(k.cview(), begin, len),
                       part(v.cview(), begin, len), part(a.cview(), begin, len),
                       part(b.cview(), begin, len), linattn::log_gates(part(g.cview(), begin, len)),
                       part(out.view(), begin, len));
  }
  check_prompt();
  CHECK(states[5].tokens() == split);
  for (Eigen::Index t = split; t < n; ++t) {
    step_rows(t, qt, kt, vt, at, bt, gt);
    if (t == split + 3) {
      // A NaN in one state's row: every state stays as it was.
      const Matrix<T> s5 = states[5].s();
      Matrix<T> bad = at;
      bad(6, 2) = std::numeric_limits<T>::quiet_NaN();
      CHECK_THROWS_WITH(
          layer.step_into(states, qt, kt, vt, bad, bt, linattn::log_gates(gt), step_out),
          Catch::Contains("a has a non-finite value"));
      CHECK(states[5].s() == s5);
      CHECK(states[0].tokens() == t);
    }
    layer.step_into(states, qt, kt, vt, at, bt, linattn::log_gates(gt), step_out);
    check_step(t, step_out);
  }
  // The forward over the prompt gives the prefill's outputs.
  Heads<T> forward(Layout::bnhd, batch, heads, split, dv, gap);
  layer.forward_into(q.cview(), k.cview(), v.cview(), a.cview(), b.cview(),
                     linattn::log_gates(g.cview()), forward.view());
  CHECK(forward.head(1, 3) == out.head(1, 3));

  // A pool of the layer's sessions: the same numbers; a session saved and added again steps
  // bit for bit as its original.
  linattn::SessionPool pool(layer);
  pool.add(10);
  pool.add(11);
  clear();
  pool.prefill_into(0, {10, 11}, q.cview(), k.cview(), v.cview(), a.cview(), b.cview(),
                    linattn::log_gates(g.cview()), out.view());
  check_prompt();
  std::stringstream saved;
  pool.save(10, saved);
  pool.drop(11);
  pool.add(12, saved);  // session 12 is session 10 again: rows as two copies of sequence 0
  linattn::SessionPool<> hybrid(layer);
  hybrid.add(20);
  hybrid.add(21);
  clear();
  hybrid.prefill_into(0, {20, 21}, layer, q.cview(), k.cview(), v.cview(), a.cview(), b.cview(),
                      linattn::log_gates(g.cview()), out.view());
  check_prompt();
  const std::vector<std::uint8_t> blob = hybrid.save_bytes(21, linattn::SessionStorage::exact);
  hybrid.add_bytes(22, blob);
  for (Eigen::Index t = split; t < n; ++t) {
    step_rows(t, qt, kt, vt, at, bt, gt);
    // Sequence 0's rows twice for the plain pool (sessions 10 and 12).
    Matrix<T> q0 = qt.topRows(qk_heads).replicate(2, 1), k0 = kt.topRows(qk_heads).replicate(2, 1);
    Matrix<T> v0 = vt.topRows(heads).replicate(2, 1), a0 = at.topRows(heads).replicate(2, 1);
    Matrix<T> b0 = bt.topRows(heads).replicate(2, 1), g0 = gt.topRows(heads).replicate(2, 1);
    pool.step_into(0, q0, k0, v0, a0, b0, linattn::log_gates(g0), step_out);
    CHECK(step_out.topRows(heads) == step_out.bottomRows(heads));
    for (Eigen::Index h = 0; h < heads; ++h) {
      CHECK(relative_error(step_out.row(h), expected[0][h].row(t)) <= bound<T>());
    }
    // Sessions 20, 21, 22 of the hybrid pool: 22 is 21 loaded from its blob.
    Matrix<T> q3(3 * qk_heads, dk), k3(3 * qk_heads, dk), v3(3 * heads, dv), a3(3 * heads, dk),
        b3(3 * heads, dk), g3(3 * heads, dk), out3(3 * heads, dv);
    q3 << qt, qt.bottomRows(qk_heads);
    k3 << kt, kt.bottomRows(qk_heads);
    v3 << vt, vt.bottomRows(heads);
    a3 << at, at.bottomRows(heads);
    b3 << bt, bt.bottomRows(heads);
    g3 << gt, gt.bottomRows(heads);
    hybrid.step_into(0, layer, q3, k3, v3, a3, b3, linattn::log_gates(g3), out3);
    check_step(t, out3.topRows(batch * heads));
    CHECK(out3.middleRows(heads, heads) == out3.bottomRows(heads));
  }
  // States made with another scale are not the layer's.
  DplrOptions other = options;
  other.scale = 0.5;
  auto foreign = linattn::DplrDeltaRuleLayer<T>(
                     linattn::LayerHeads::grouped_query_key(heads, qk_heads), dk, dv, other)
                     .make_states(batch);
  step_rows(0, qt, kt, vt, at, bt, gt);
  CHECK_THROWS_WITH(layer.step_into(foreign, qt, kt, vt, at, bt, linattn::log_gates(gt), step_out),
                    Catch::Contains("are not this layer's"));
}

TEST_CASE("DplrDeltaRuleState saves and loads bit for bit and refuses what does not fit",
          "[dplr][save]") {
  const Eigen::Index dk = 8, dv = 12;
  const Sequence s(30, dk, dv, dk, 101);
  DplrOptions options;
  options.scale = 1.0;
  DplrDeltaRuleState<float> state(dk, dv, options);
  const Matrix<float> q = s.q.cast<float>(), k = s.k.cast<float>(), v = s.v.cast<float>();
  const Matrix<float> a = s.a.cast<float>(), b = s.b.cast<float>(), g = s.log_gates.cast<float>();
  state.prefill(q.topRows(20), k.topRows(20), v.topRows(20), a.topRows(20), b.topRows(20),
                linattn::log_gates(g.topRows(20)));
  std::stringstream saved;
  state.save(saved);
  const std::string bytes = saved.str();
  std::istringstream in(bytes);
  auto loaded = DplrDeltaRuleState<float>::load(in, options);
  CHECK(loaded.s() == state.s());
  CHECK(loaded.tokens() == 20);
  std::stringstream again;
  loaded.save(again);
  CHECK(again.str() == bytes);
  for (Eigen::Index t = 20; t < 30; ++t) {
    const Vector<float> x =
        state.step(q.row(t), k.row(t), v.row(t), a.row(t), b.row(t), linattn::log_gates(g.row(t)));
    const Vector<float> y =
        loaded.step(q.row(t), k.row(t), v.row(t), a.row(t), b.row(t), linattn::log_gates(g.row(t)));
    CHECK(x == y);
  }
  const auto info = linattn::saved_state_info(bytes.data(), bytes.size());
  CHECK(info.family == linattn::StateFamily::dplr_delta_rule);
  // Another scale, another family, another scalar type.
  std::istringstream in2(bytes);
  CHECK_THROWS_WITH(DplrDeltaRuleState<float>::load(in2, DplrOptions{}),
                    Catch::Contains("saved with scale 1.000000") &&
                        Catch::Contains("options.scale gives 0.353553"));
  std::istringstream in3(bytes);
  CHECK_THROWS_WITH(linattn::DeltaRuleState<float>::load(in3, linattn::DeltaOptions{}),
                    Catch::Contains("holds a DplrDeltaRuleState, not a DeltaRuleState"));
  std::istringstream in4(bytes);
  CHECK_THROWS_WITH(DplrDeltaRuleState<double>::load(in4, options),
                    Catch::Contains("-byte scalars"));
  std::istringstream in5(bytes);
  CHECK(DplrDeltaRuleState<float>::load_unchecked(in5).options().scale == 1.0);
  // Settings this family never writes, with a valid checksum: refused by name.
  const auto edited = [&](std::size_t at, unsigned char value) {
    std::string e = bytes;
    e[at] = static_cast<char>(value);
    linattn::detail::Crc32 crc;
    crc.update(reinterpret_cast<const unsigned char*>(e.data()), e.size() - 4);
    for (int i = 0; i < 4; ++i)
      e[e.size() - 4 + i] = static_cast<char>((crc.value() >> (8 * i)) & 0xFF);
    std::istringstream is(e);
    try {
      (void)DplrDeltaRuleState<float>::load_unchecked(is);
    } catch (const linattn::Error& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  CHECK_THAT(edited(33, 2), Catch::Contains("invalid transition record 2 for 20 tokens"));
  CHECK_THAT(edited(49, 0x7F), Catch::Contains("invalid scale"));  // the scale's top byte: +inf
  CHECK_THAT(edited(32, 3), Catch::Contains("unknown state family 3"));
  CHECK(edited(33, 3).empty());  // per-feature decays: what it saved
}

TEST_CASE("the generalized delta rule's errors name the argument and change nothing",
          "[dplr][errors]") {
  const Eigen::Index dk = 8, dv = 6, n = 10;
  const Sequence s(n, dk, dv, dk, 111);
  const Matrix<float> q = s.q.cast<float>(), k = s.k.cast<float>(), v = s.v.cast<float>();
  const Matrix<float> a = s.a.cast<float>(), b = s.b.cast<float>(), g = s.log_gates.cast<float>();
  using Catch::Contains;
  using linattn::log_gates;
  CHECK_THROWS_WITH(linattn::causal_dplr_delta_rule(q, k, v, a.leftCols(7), b, log_gates(g)),
                    Contains("a is 10 x 7 but must be N x Dk = 10 x 8"));
  CHECK_THROWS_WITH(linattn::causal_dplr_delta_rule(q, k, v, a, b.topRows(9), log_gates(g)),
                    Contains("b is 9 x 8"));
  CHECK_THROWS_WITH(linattn::causal_dplr_delta_rule(q, k, v, a, b, log_gates(g.leftCols(3))),
                    Contains("gates is 10 x 3"));
  Matrix<float> positive = g;
  positive(4, 2) = 0.5f;
  CHECK_THROWS_WITH(linattn::causal_dplr_delta_rule(q, k, v, a, b, log_gates(positive)),
                    Contains("gates"));
  Matrix<float> bad = a;
  bad(3, 1) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH(linattn::causal_dplr_delta_rule(q, k, v, bad, b, log_gates(g)),
                    Contains("a has a non-finite value") && Contains("row 3, column 1"));
  DplrOptions zero;
  zero.scale = 0.0;
  CHECK_THROWS_WITH(linattn::causal_dplr_delta_rule(q, k, v, a, b, log_gates(g), zero),
                    Contains("DplrOptions::scale"));
  DplrOptions chunk;
  chunk.chunk = 0;
  CHECK_THROWS_WITH(linattn::causal_dplr_delta_rule(q, k, v, a, b, log_gates(g), chunk),
                    Contains("DplrOptions::chunk"));
  // A state refuses a bad token or sequence and stays as it was.
  DplrDeltaRuleState<float> state(dk, dv);
  state.prefill(q.topRows(4), k.topRows(4), v.topRows(4), a.topRows(4), b.topRows(4),
                log_gates(g.topRows(4)));
  const Matrix<float> before = state.s();
  CHECK_THROWS_WITH(
      state.step(q.row(5), k.row(5), v.row(5), bad.row(3), b.row(5), log_gates(g.row(5))),
      Contains("DplrDeltaRuleState::step: a has a non-finite value"));
  CHECK_THROWS_WITH(
      state.step(q.row(5), k.row(5), v.row(5), a.row(5), b.row(5).head(7), log_gates(g.row(5))),
      Contains("b is 1 x 7"));
  CHECK_THROWS_WITH(
      state.step(q.row(5), k.row(5), v.row(5), a.row(5), b.row(5), log_gates(g.row(5).head(3))),
      Contains("gate is 1 x 3"));
  CHECK_THROWS_WITH(state.prefill(q, k, v.leftCols(5), a, b, log_gates(g)),
                    Contains("the state is Dk x Dv = 8 x 6"));
  CHECK(state.s() == before);
  CHECK(state.tokens() == 4);
}

}  // namespace linattn_test_dplr_delta_rule
