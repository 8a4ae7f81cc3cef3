// The delta rule (DeltaNet, Gated DeltaNet, KDA): the chunked form and DeltaRuleState against
// an independent recurrence written here in double, FLA's naive_recurrent_* token by token.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <linattn/delta_rule.hpp>
#include <linattn/recurrent_state.hpp>
#include <linattn/state_batch.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_delta_rule {

namespace {

using linattn::DeltaOptions;
using linattn::DeltaRuleState;
using linattn::Matrix;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::naive_delta_rule;
using linattn_test::relative_error;

constexpr double kMinusInf = -std::numeric_limits<double>::infinity();

/// One sequence's inputs in double: q, k, v Gaussian (keys normalised unless raw_keys), beta
/// in [0.05, 1], log gates of `gate_cols` columns in [-0.2, 0] (0: DeltaNet).
struct Sequence {
  Matrix<double> q, k, v, log_gates;
  Vector<double> beta;
  Sequence(Eigen::Index n, Eigen::Index dk, Eigen::Index dv, Eigen::Index gate_cols,
           std::uint64_t seed)
      : q(gaussian<double>(n, dk, seed)),
        k(gaussian<double>(n, dk, seed + 1)),
        v(gaussian<double>(n, dv, seed + 2)),
        log_gates(-0.1 * (gaussian<double>(n, gate_cols, seed + 3).array().abs())),
        beta(0.05 + 0.95 * (gaussian<double>(n, 1, seed + 4).array().abs().min(1.0))) {
    for (Eigen::Index t = 0; t < n; ++t) k.row(t).normalize();
  }
};

/// The matrix call in T on the sequence (in options.form): DeltaNet without gates, else
/// log_gates(g).
template <class T>
Matrix<T> chunked(const Sequence& s, const DeltaOptions& options) {
  const Matrix<T> q = s.q.cast<T>();
  const Matrix<T> k = s.k.cast<T>();
  const Matrix<T> v = s.v.cast<T>();
  const Vector<T> beta = s.beta.cast<T>();
  if (s.log_gates.cols() == 0) return linattn::causal_delta_rule(q, k, v, beta, options);
  const Matrix<T> g = s.log_gates.cast<T>();
  return linattn::causal_gated_delta_rule(q, k, v, linattn::log_gates(g), beta, options);
}

/// The bound on the chunked form against the naive recurrence: docs/design.md's for the delta rule.
template <class T>
double bound() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-10;
}

const char* variant_name(Eigen::Index gate_cols) {
  return gate_cols == 0 ? "DeltaNet" : gate_cols == 1 ? "Gated DeltaNet" : "KDA";
}

}  // namespace

TEMPLATE_TEST_CASE("both forms of the delta rule match the naive recurrence", "[delta_rule]", float,
                   double) {
  const linattn::DeltaForm form =
      GENERATE(linattn::DeltaForm::chunked, linattn::DeltaForm::streamed);
  CAPTURE(static_cast<int>(form));
  const Eigen::Index dk = 32;
  for (const Eigen::Index dv : {Eigen::Index{32}, Eigen::Index{48}}) {
    for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
      for (const Eigen::Index chunk : {Eigen::Index{16}, Eigen::Index{32}, Eigen::Index{64}}) {
        for (const Eigen::Index n : {Eigen::Index{1}, Eigen::Index{37}, Eigen::Index{200}}) {
          CAPTURE(dv, gate_cols, chunk, n);
          const Sequence s(n, dk, dv, gate_cols, 10 + static_cast<std::uint64_t>(n));
          DeltaOptions options;
          options.chunk = chunk;
          options.form = form;
          const Matrix<double> expected =
              naive_delta_rule(s.q, s.k, s.v, s.beta, s.log_gates, 1.0 / std::sqrt(32.0), false);
          const Matrix<TestType> out = chunked<TestType>(s, options);
          INFO(variant_name(gate_cols));
          CHECK(relative_error(out, expected) <= bound<TestType>());
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("the delta rule takes FLA's conventions: scale and in-kernel L2 norm",
                   "[delta_rule]", float, double) {
  const linattn::DeltaForm form =
      GENERATE(linattn::DeltaForm::chunked, linattn::DeltaForm::streamed);
  CAPTURE(static_cast<int>(form));
  // Raw (unnormalised) q and k: l2_normalize divides by sqrt(|x|^2 + 1e-6) as FLA's l2norm.
  Sequence s(150, 24, 16, 1, 77);
  s.k = gaussian<double>(150, 24, 78, 3.0);
  DeltaOptions options;
  options.l2_normalize = true;
  options.chunk = 32;
  options.form = form;
  const Matrix<double> expected =
      naive_delta_rule(s.q, s.k, s.v, s.beta, s.log_gates, 1.0 / std::sqrt(24.0), true);
  CHECK(relative_error(chunked<TestType>(s, options), expected) <= bound<TestType>());
  // An explicit scale replaces Dk^-1/2.
  options.scale = 0.75;
  const Matrix<double> scaled = naive_delta_rule(s.q, s.k, s.v, s.beta, s.log_gates, 0.75, true);
  CHECK(relative_error(chunked<TestType>(s, options), scaled) <= bound<TestType>());
  // Scale multiplies the output and nothing else.
  CHECK(relative_error(scaled, (expected * (0.75 * std::sqrt(24.0))).eval()) <= 1e-13);
}

TEMPLATE_TEST_CASE("the delta rule's gates: 1 exactly, down to 1e-30, hard resets mid-chunk",
                   "[delta_rule]", float, double) {
  const linattn::DeltaForm form =
      GENERATE(linattn::DeltaForm::chunked, linattn::DeltaForm::streamed);
  CAPTURE(static_cast<int>(form));
  const Eigen::Index dk = 16;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, dk}) {
    CAPTURE(gate_cols);
    Sequence s(300, dk, 24, gate_cols, 91);
    // Stretches of gates of exactly 1, of 1e-30 (log -69), and two resets inside chunks.
    s.log_gates.middleRows(10, 40).setZero();
    s.log_gates.middleRows(60, 5).setConstant(std::log(1e-30));
    s.log_gates.row(100).setConstant(kMinusInf);
    if (gate_cols > 1) {
      s.log_gates(170, 3) = kMinusInf;  // one feature forgotten
      s.log_gates(171, 0) = std::log(1e-30);
    } else {
      s.log_gates(170, 0) = kMinusInf;
    }
    DeltaOptions options;
    options.chunk = 64;
    options.form = form;
    const Matrix<double> expected =
        naive_delta_rule(s.q, s.k, s.v, s.beta, s.log_gates, 0.25, false);
    CHECK(relative_error(chunked<TestType>(s, options), expected) <= bound<TestType>());
    // Gates as a_t give the same outputs as log gates, up to the rounding of a_t; a_t cannot
    // reset, so the resets become gates of 1e-30.
    const Matrix<double> tiny = s.log_gates.array().max(std::log(1e-30)).matrix();
    const Matrix<TestType> a = tiny.array().exp().matrix().cast<TestType>();
    const Matrix<TestType> by_gate =
        linattn::causal_gated_delta_rule(s.q.cast<TestType>(), s.k.cast<TestType>(),
                                         s.v.cast<TestType>(), a, s.beta.cast<TestType>(), options);
    const Matrix<double> expected_tiny = naive_delta_rule(s.q, s.k, s.v, s.beta, tiny, 0.25, false);
    CHECK(relative_error(by_gate, expected_tiny) <= bound<TestType>());
  }
}

TEMPLATE_TEST_CASE("a reset gate forgets exactly: the row of a feature whose key stays 0 is 0",
                   "[delta_rule]", float, double) {
  // Eigen's vectorised exp stops at the smallest normal number: without care a reset would
  // leave 1e-38 S in the row (float), which a key of 0 then never overwrites.
  const Eigen::Index dk = 16, dv = 8, n = 3, forgotten = 5;
  const Matrix<TestType> s0 = Matrix<TestType>::Ones(dk, dv);
  Matrix<TestType> q = gaussian<TestType>(n, dk, 17);
  Matrix<TestType> k = gaussian<TestType>(n, dk, 18);
  const Matrix<TestType> v = gaussian<TestType>(n, dv, 19);
  const Vector<TestType> beta = Vector<TestType>::Constant(n, TestType(0.5));
  Matrix<TestType> g = Matrix<TestType>::Constant(n, dk, TestType(-0.01));
  g(1, forgotten) = -std::numeric_limits<TestType>::infinity();
  k.bottomRows(2).col(forgotten).setZero();
  for (const linattn::DeltaForm form :
       {linattn::DeltaForm::chunked, linattn::DeltaForm::streamed}) {
    DeltaOptions options;
    options.l2_normalize = true;
    options.form = form;
    auto prefilled = DeltaRuleState<TestType>::from_state(s0, options);
    prefilled.prefill(q, k, v, linattn::log_gates(g), beta);
    CHECK(prefilled.s().row(forgotten).isZero(0));
    CHECK(prefilled.s().row(forgotten + 1).cwiseAbs().minCoeff() > TestType(1e-3));
  }
  DeltaOptions options;
  options.l2_normalize = true;
  auto stepped = DeltaRuleState<TestType>::from_state(s0, options);
  for (Eigen::Index t = 0; t < n; ++t) {
    stepped.step(q.row(t), k.row(t), v.row(t), linattn::log_gates(g.row(t)), beta(t));
  }
  CHECK(stepped.s().row(forgotten).isZero(0));
}

TEMPLATE_TEST_CASE("the delta rule's beta: near 0, 1, and 2 with negative eigenvalues",
                   "[delta_rule]", float, double) {
  const linattn::DeltaForm form =
      GENERATE(linattn::DeltaForm::chunked, linattn::DeltaForm::streamed);
  CAPTURE(static_cast<int>(form));
  for (const double beta : {1e-6, 1.0, 2.0}) {
    for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, Eigen::Index{16}}) {
      CAPTURE(beta, gate_cols);
      Sequence s(130, 16, 16, gate_cols, 5);
      s.beta.setConstant(beta);
      DeltaOptions options;
      options.allow_negative_eigenvalues = beta > 1.0;
      options.chunk = 32;
      options.form = form;
      const Matrix<double> expected =
          naive_delta_rule(s.q, s.k, s.v, s.beta, s.log_gates, 0.25, false);
      CHECK(relative_error(chunked<TestType>(s, options), expected) <= bound<TestType>());
    }
  }
}

TEMPLATE_TEST_CASE("DeltaRuleState: steps, prefill, prefill then steps, initial state",
                   "[delta_rule]", float, double) {
  const Eigen::Index dk = 32;
  const Eigen::Index dv = 24;
  for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
    CAPTURE(gate_cols);
    const Sequence s(260, dk, dv, gate_cols, 31);
    const Matrix<TestType> q = s.q.cast<TestType>();
    const Matrix<TestType> k = s.k.cast<TestType>();
    const Matrix<TestType> v = s.v.cast<TestType>();
    const Vector<TestType> beta = s.beta.cast<TestType>();
    const Matrix<TestType> g = s.log_gates.cast<TestType>();
    const Matrix<TestType> s0 = gaussian<TestType>(dk, dv, 32, 0.5);
    Matrix<double> state = s0.template cast<double>();
    const Matrix<double> expected =
        naive_delta_rule(s.q, s.k, s.v, s.beta, s.log_gates, 1.0 / std::sqrt(32.0), false, state);
    DeltaOptions options;
    options.chunk = 16;

    // Token by token, from the initial state.
    // Token t through a state's step: with its gate unless DeltaNet.
    const auto step = [&](DeltaRuleState<TestType>& state, Eigen::Index t) {
      if (gate_cols == 0) return state.step(q.row(t), k.row(t), v.row(t), beta(t));
      return state.step(q.row(t), k.row(t), v.row(t), linattn::log_gates(g.row(t)), beta(t));
    };
    auto stepped = DeltaRuleState<TestType>::from_state(s0, options);
    Matrix<TestType> step_out(q.rows(), dv);
    for (Eigen::Index t = 0; t < q.rows(); ++t) step_out.row(t) = step(stepped, t).transpose();
    CHECK(relative_error(step_out, expected) <= bound<TestType>());
    CHECK(relative_error(stepped.s(), state) <= bound<TestType>());
    CHECK(stepped.tokens() == q.rows());

    // A prefill of 100 tokens, then steps; and two prefills: the same outputs and state.
    auto mixed = DeltaRuleState<TestType>::from_state(s0, options);
    auto twice = DeltaRuleState<TestType>::from_state(s0, options);
    Matrix<TestType> mixed_out(q.rows(), dv);
    Matrix<TestType> twice_out(q.rows(), dv);
    const Eigen::Index head = 100;
    if (gate_cols == 0) {
      mixed_out.topRows(head) =
          mixed.prefill(q.topRows(head), k.topRows(head), v.topRows(head), beta.head(head));
      twice_out.topRows(head) =
          twice.prefill(q.topRows(head), k.topRows(head), v.topRows(head), beta.head(head));
      twice_out.bottomRows(q.rows() - head) =
          twice.prefill(q.bottomRows(q.rows() - head), k.bottomRows(q.rows() - head),
                        v.bottomRows(q.rows() - head), beta.tail(q.rows() - head));
    } else {
      mixed_out.topRows(head) = mixed.prefill(q.topRows(head), k.topRows(head), v.topRows(head),
                                              linattn::log_gates(g.topRows(head)), beta.head(head));
      twice_out.topRows(head) = twice.prefill(q.topRows(head), k.topRows(head), v.topRows(head),
                                              linattn::log_gates(g.topRows(head)), beta.head(head));
      twice_out.bottomRows(q.rows() - head) = twice.prefill(
          q.bottomRows(q.rows() - head), k.bottomRows(q.rows() - head),
          v.bottomRows(q.rows() - head), linattn::log_gates(g.bottomRows(q.rows() - head)),
          beta.tail(q.rows() - head));
    }
    for (Eigen::Index t = head; t < q.rows(); ++t) mixed_out.row(t) = step(mixed, t).transpose();
    CHECK(relative_error(mixed_out, expected) <= bound<TestType>());
    CHECK(relative_error(twice_out, expected) <= bound<TestType>());
    CHECK(relative_error(twice.s(), state) <= bound<TestType>());
    CHECK(twice.tokens() == q.rows());
    CHECK(twice.transition() == linattn::detail::transition_of_gate_dim(gate_cols));
  }
}

TEMPLATE_TEST_CASE("DeltaRuleState saves and loads bit for bit and refuses what does not fit",
                   "[delta_rule][save]", float, double) {
  const Eigen::Index dk = 16;
  const Eigen::Index dv = 12;
  for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
    CAPTURE(gate_cols);
    const Sequence s(90, dk, dv, gate_cols, 41);
    const Matrix<TestType> q = s.q.cast<TestType>();
    const Matrix<TestType> k = s.k.cast<TestType>();
    const Matrix<TestType> v = s.v.cast<TestType>();
    const Vector<TestType> beta = s.beta.cast<TestType>();
    const Matrix<TestType> g = s.log_gates.cast<TestType>();
    DeltaOptions options;
    options.chunk = 16;
    options.l2_normalize = true;
    const auto step = [&](DeltaRuleState<TestType>& state, Eigen::Index t) {
      if (gate_cols == 0) return state.step(q.row(t), k.row(t), v.row(t), beta(t));
      return state.step(q.row(t), k.row(t), v.row(t), linattn::log_gates(g.row(t)), beta(t));
    };
    DeltaRuleState<TestType> state(dk, dv, options);
    for (Eigen::Index t = 0; t < 50; ++t) step(state, t);
    std::stringstream saved;
    state.save(saved);
    const std::string bytes = saved.str();
    const Matrix<TestType> s_saved = state.s();
    // 52 header bytes (format 4, family 1 at byte 32), S, the checksum.
    CHECK(bytes.size() == 52 + sizeof(TestType) * dk * dv + 4);
    CHECK(bytes[8] == 4);
    CHECK(bytes[32] == 1);

    // Loaded, it is the same state, saves the same bytes and continues bit for bit.
    DeltaOptions runtime = options;
    runtime.chunk = 32;
    runtime.check_finite = false;
    std::istringstream in(bytes);
    auto loaded = DeltaRuleState<TestType>::load(in, runtime);
    CHECK(loaded.s() == state.s());
    CHECK(loaded.tokens() == 50);
    CHECK(loaded.transition() == state.transition());
    CHECK(loaded.options().chunk == 32);
    std::stringstream again;
    loaded.save(again);
    CHECK(again.str() == bytes);
    for (Eigen::Index t = 50; t < q.rows(); ++t) {
      const Vector<TestType> a = step(state, t);
      const Vector<TestType> b = step(loaded, t);
      REQUIRE(a == b);
    }
    CHECK(loaded.s() == state.s());
    // The scale resolves for Dk: Dk^-1/2 given outright loads a state saved with -1.
    DeltaOptions explicit_scale = options;
    explicit_scale.scale = 0.25;
    std::istringstream same_scale(bytes);
    CHECK(DeltaRuleState<TestType>::load(same_scale, explicit_scale).s() == s_saved);

    // Options that change results must match; nothing is returned on a throw.
    const auto refuses = [&](const std::string& stream, const DeltaOptions& with,
                             const char* says) {
      std::istringstream is(stream);
      CHECK_THROWS_WITH(DeltaRuleState<TestType>::load(is, with), Catch::Contains(says));
    };
    DeltaOptions other = options;
    other.scale = 0.5;
    refuses(bytes, other, "scale");
    other = options;
    other.l2_normalize = false;
    refuses(bytes, other, "l2_normalize");
    other = options;
    other.allow_negative_eigenvalues = true;
    refuses(bytes, other, "allow_negative_eigenvalues");
    // Every truncation and every flipped bit of a byte is refused.
    for (std::size_t n = 0; n < bytes.size(); ++n) {
      refuses(bytes.substr(0, n), options, n == 0 ? "empty" : "truncated");
    }
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      std::string corrupt = bytes;
      corrupt[i] = static_cast<char>(corrupt[i] ^ 0x10);
      std::istringstream is(corrupt);
      CHECK_THROWS_AS(DeltaRuleState<TestType>::load(is, options), linattn::Error);
    }
    // The other accumulation type, and the engine's RecurrentState streams, are refused.
    using Other = std::conditional_t<std::is_same_v<TestType, float>, double, float>;
    std::istringstream wrong_type(bytes);
    CHECK_THROWS_WITH(DeltaRuleState<Other>::load(wrong_type, options),
                      Catch::Contains("-byte scalars"));
    std::stringstream engine;
    linattn::RecurrentState<TestType>(dk, dv).save(engine);
    refuses(engine.str(), options,
            "the stream holds a RecurrentState, not a DeltaRuleState: load it with "
            "RecurrentState::load");
    std::istringstream unchecked(bytes);
    const auto inspected = DeltaRuleState<TestType>::load_unchecked(unchecked);
    CHECK(inspected.options().l2_normalize);
    CHECK(inspected.options().scale == options.scale);
    CHECK(inspected.s() == s_saved);
  }
}

TEST_CASE("a delta-rule state counts at most 2^62 tokens, as the engine's does",
          "[delta_rule][save][errors]") {
  using Catch::Contains;
  DeltaOptions options;
  options.l2_normalize = true;
  const Sequence seq(3, 4, 2, 0, 77);
  DeltaRuleState<double> state(4, 2, options);
  (void)state.step(seq.q.row(0), seq.k.row(0), seq.v.row(0), seq.beta(0));
  std::stringstream saved;
  state.save(saved);
  // Tokens at 34-41 of format 4: 2^62, the most a state counts, with the checksum recomputed.
  std::string bytes = saved.str();
  const std::uint64_t limit = std::uint64_t{1} << 62;
  for (int i = 0; i < 8; ++i) bytes[34 + i] = static_cast<char>((limit >> (8 * i)) & 0xFF);
  linattn::detail::Crc32 crc;
  crc.update(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size() - 4);
  for (int i = 0; i < 4; ++i) {
    bytes[bytes.size() - 4 + i] = static_cast<char>((crc.value() >> (8 * i)) & 0xFF);
  }
  std::istringstream in(bytes);
  DeltaRuleState<double> full = DeltaRuleState<double>::load(in, options);
  REQUIRE(full.tokens() == static_cast<std::int64_t>(limit));
  const Matrix<double> s_before = full.s();
  // One more token, by a step, a prefill or a batch, is refused and moves nothing (before,
  // the count passed the limit and the state saved what no load accepts).
  CHECK_THROWS_WITH(full.step(seq.q.row(1), seq.k.row(1), seq.v.row(1), seq.beta(1)),
                    Contains("DeltaRuleState::step: the token count would pass 2^62"));
  CHECK_THROWS_WITH(full.prefill(seq.q, seq.k, seq.v, seq.beta),
                    Contains("DeltaRuleState::prefill: the token count would pass 2^62"));
  linattn::DeltaRuleStateBatch<double> batch(2, 4, 2, options);
  batch[1] = full;
  CHECK_THROWS_WITH(
      batch.step(seq.q.topRows(2), seq.k.topRows(2), seq.v.topRows(2), seq.beta.head(2)),
      Contains("DeltaRuleStateBatch::step: the token count would pass 2^62"));
  CHECK(batch[0].tokens() == 0);
  CHECK((full.s() == s_before && full.tokens() == static_cast<std::int64_t>(limit)));
}

namespace {

/// [B, N, H, D] (token-major, FLA's layout) or [B, H, N, D] storage of one tensor, filled
/// from per-(b, h) N x D matrices.
template <class T>
struct Heads {
  std::vector<T> data;
  linattn::HeadShape shape;
  bool token_major;
  Heads(const linattn::HeadShape& sizes, bool bnhd)
      : data(static_cast<std::size_t>(sizes.batch * sizes.heads * sizes.tokens * sizes.dim), T(7)),
        shape(sizes),
        token_major(bnhd) {}
  linattn::HeadsView<T> view() {
    return token_major ? linattn::HeadsView<T>::bnhd(data.data(), linattn::BnhdShape(shape))
                       : linattn::HeadsView<T>::bhnd(data.data(), shape);
  }
  linattn::HeadsView<const T> cview() const {
    auto* p = const_cast<T*>(data.data());
    return token_major ? linattn::HeadsView<const T>::bnhd(p, linattn::BnhdShape(shape))
                       : linattn::HeadsView<const T>::bhnd(p, shape);
  }
  Matrix<T> head(Eigen::Index b, Eigen::Index h) const { return cview().head(b, h); }
  void set(Eigen::Index b, Eigen::Index h, const Matrix<T>& x) { view().head(b, h) = x; }
};

}  // namespace

TEMPLATE_TEST_CASE("the delta rule on heads: views, grouped heads, varlen, threads",
                   "[delta_rule][heads]", float, double) {
  using T = TestType;
  const Eigen::Index batch = 2, qk_heads = 2, heads = 4, n = 70, dk = 16, dv = 12;
  DeltaOptions options;
  options.chunk = 16;
  options.l2_normalize = true;
  for (const bool bnhd : {true, false}) {
    for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
      CAPTURE(bnhd, gate_cols);
      Heads<T> q({batch, qk_heads, n, dk}, bnhd), k({batch, qk_heads, n, dk}, bnhd);
      Heads<T> v({batch, heads, n, dv}, bnhd), beta({batch, heads, n, 1}, bnhd);
      Heads<T> g({batch, heads, n, std::max<Eigen::Index>(gate_cols, 1)}, bnhd);
      Heads<T> out({batch, heads, n, dv}, bnhd), out2({batch, heads, n, dv}, bnhd);
      std::vector<Sequence> seqs;
      for (Eigen::Index b = 0; b < batch; ++b) {
        for (Eigen::Index h = 0; h < heads; ++h) {
          seqs.emplace_back(n, dk, dv, gate_cols, 100 + 10 * (b * heads + h));
          const Sequence& s = seqs.back();
          if (h % 2 == 0) {  // q/k head h / 2 serves v heads h and h + 1
            q.set(b, h / 2, s.q.cast<T>());
            k.set(b, h / 2, s.k.cast<T>());
          }
          v.set(b, h, s.v.cast<T>());
          beta.set(b, h, s.beta.cast<T>());
          if (gate_cols > 0) g.set(b, h, s.log_gates.cast<T>());
        }
      }
      const auto run = [&](Heads<T>& dst, const DeltaOptions& o,
                           const std::vector<std::int64_t>* offsets) {
        if (gate_cols == 0) {
          if (offsets) {
            linattn::causal_delta_rule_varlen_into(q.cview(), k.cview(), v.cview(), beta.cview(),
                                                   *offsets, dst.view(), o);
          } else {
            linattn::causal_delta_rule_into(q.cview(), k.cview(), v.cview(), beta.cview(),
                                            dst.view(), o);
          }
        } else if (offsets) {
          linattn::causal_gated_delta_rule_varlen_into(q.cview(), k.cview(), v.cview(),
                                                       linattn::log_gates(g.cview()), beta.cview(),
                                                       *offsets, dst.view(), o);
        } else {
          linattn::causal_gated_delta_rule_into(q.cview(), k.cview(), v.cview(),
                                                linattn::log_gates(g.cview()), beta.cview(),
                                                dst.view(), o);
        }
      };
      DeltaOptions one = options;
      one.threads = 1;
      run(out, one, nullptr);
      DeltaOptions two = options;
      two.threads = 2;
      run(out2, two, nullptr);
      CHECK(out.data == out2.data);  // threads split heads, never the sums of one head
      for (Eigen::Index b = 0; b < batch; ++b) {
        for (Eigen::Index h = 0; h < heads; ++h) {
          CAPTURE(b, h);
          const Sequence& own = seqs[static_cast<std::size_t>(b * heads + h)];
          const Sequence& lead = seqs[static_cast<std::size_t>(b * heads + h - h % 2)];
          const Matrix<double> expected =
              naive_delta_rule(lead.q, lead.k, own.v, own.beta, own.log_gates, 0.25, true);
          CHECK(relative_error(out.head(b, h), expected) <= bound<T>());
        }
      }
      // Varlen: batch entry 0 packed as three sequences (one empty), each from zero.
      Heads<T> packed_out({1, heads, n, dv}, bnhd);
      const std::vector<std::int64_t> offsets = {0, 20, 20, n};
      Heads<T> q1({1, qk_heads, n, dk}, bnhd), k1({1, qk_heads, n, dk}, bnhd);
      Heads<T> v1({1, heads, n, dv}, bnhd), beta1({1, heads, n, 1}, bnhd);
      Heads<T> g1({1, heads, n, std::max<Eigen::Index>(gate_cols, 1)}, bnhd);
      for (Eigen::Index h = 0; h < heads; ++h) {
        if (h < qk_heads) {
          q1.set(0, h, q.head(0, h));
          k1.set(0, h, k.head(0, h));
        }
        v1.set(0, h, v.head(0, h));
        beta1.set(0, h, beta.head(0, h));
        g1.set(0, h, g.head(0, h));
      }
      std::swap(q, q1);
      std::swap(k, k1);
      std::swap(v, v1);
      std::swap(beta, beta1);
      std::swap(g, g1);
      run(packed_out, options, &offsets);
      for (Eigen::Index h = 0; h < heads; ++h) {
        CAPTURE(h);
        const Sequence& own = seqs[static_cast<std::size_t>(h)];
        const Sequence& lead = seqs[static_cast<std::size_t>(h - h % 2)];
        for (std::size_t part = 0; part + 1 < offsets.size(); ++part) {
          const Eigen::Index begin = offsets[part], len = offsets[part + 1] - begin;
          if (len == 0) continue;
          const Matrix<double> expected =
              naive_delta_rule(lead.q.middleRows(begin, len), lead.k.middleRows(begin, len),
                               own.v.middleRows(begin, len), own.beta.segment(begin, len),
                               own.log_gates.middleRows(begin, len), 0.25, true);
          CHECK(relative_error(packed_out.head(0, h).middleRows(begin, len), expected) <=
                bound<T>());
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("one delta-rule sequence on two threads: the value columns split",
                   "[delta_rule][threads]", float, double) {
  const Eigen::Index dk = 32, dv = 72;
  for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
    CAPTURE(gate_cols);
    const Sequence s(150, dk, dv, gate_cols, 77);
    const Matrix<double> expected =
        naive_delta_rule(s.q, s.k, s.v, s.beta, s.log_gates, 1.0 / std::sqrt(32.0), false);
    DeltaOptions options;
    options.chunk = 32;
    options.threads = 1;
    const Matrix<TestType> one = chunked<TestType>(s, options);
    options.threads = 2;
    const Matrix<TestType> two = chunked<TestType>(s, options);
    CHECK(relative_error(one, expected) <= bound<TestType>());
    CHECK(relative_error(two, expected) <= bound<TestType>());
    // The streamed form (automatic here) runs each column's arithmetic unchanged: bit for bit.
    CHECK(one == two);
    // The chunked form's GEMMs round narrower parts differently: within the bound.
    DeltaOptions wy = options;
    wy.form = linattn::DeltaForm::chunked;
    CHECK(relative_error(chunked<TestType>(s, wy), expected) <= bound<TestType>());
    wy.threads = 1;
    CHECK(relative_error(chunked<TestType>(s, wy), expected) <= bound<TestType>());
    // The state a two-thread prefill leaves continues like one stepped token by token.
    DeltaRuleState<TestType> state(dk, dv, options);
    const Matrix<TestType> q = s.q.cast<TestType>(), k = s.k.cast<TestType>();
    const Matrix<TestType> v = s.v.cast<TestType>(), g = s.log_gates.cast<TestType>();
    const Vector<TestType> beta = s.beta.cast<TestType>();
    Matrix<TestType> out(q.rows(), dv);
    if (gate_cols == 0) {
      out.topRows(149) =
          state.prefill(q.topRows(149), k.topRows(149), v.topRows(149), beta.head(149));
      out.row(149) = state.step(q.row(149), k.row(149), v.row(149), beta(149)).transpose();
    } else {
      out.topRows(149) = state.prefill(q.topRows(149), k.topRows(149), v.topRows(149),
                                       linattn::log_gates(g.topRows(149)), beta.head(149));
      out.row(149) =
          state.step(q.row(149), k.row(149), v.row(149), linattn::log_gates(g.row(149)), beta(149))
              .transpose();
    }
    CHECK(relative_error(out, expected) <= bound<TestType>());
  }
}

TEST_CASE("the delta rule on heads rejects bad input and writes nothing", "[delta_rule][heads]") {
  const Eigen::Index batch = 2, heads = 4, n = 24, dk = 8, dv = 6;
  Heads<double> q({batch, heads, n, dk}, true), k({batch, heads, n, dk}, true);
  Heads<double> v({batch, heads, n, dv}, true), beta({batch, heads, n, 1}, true);
  Heads<double> g({batch, heads, n, 1}, true), out({batch, heads, n, dv}, true);
  for (auto* t : {&q, &k, &v}) {
    for (std::size_t i = 0; i < t->data.size(); ++i) t->data[i] = std::sin(0.37 * double(i));
  }
  for (double& x : k.data) x *= 0.3;  // |k|^2 <= 0.72: stable steps without l2_normalize
  for (std::size_t i = 0; i < beta.data.size(); ++i) beta.data[i] = 0.5;
  for (std::size_t i = 0; i < g.data.size(); ++i) g.data[i] = -0.1;
  std::fill(out.data.begin(), out.data.end(), 7.0);
  const auto unchanged = [&] {
    return std::all_of(out.data.begin(), out.data.end(), [](double x) { return x == 7.0; });
  };
  using Catch::Matchers::Contains;
  const auto delta = [&] {
    linattn::causal_delta_rule_into(q.cview(), k.cview(), v.cview(), beta.cview(), out.view());
  };
  const auto gated = [&] {
    linattn::causal_gated_delta_rule_into(q.cview(), k.cview(), v.cview(),
                                          linattn::log_gates(g.cview()), beta.cview(), out.view());
  };
  beta.view().head(1, 2)(9, 0) = 1.5;
  CHECK_THROWS_WITH(delta(), Contains("beta[b=1, h=2] must lie in (0, 1]") && Contains("token 9"));
  CHECK(unchanged());
  beta.view().head(1, 2)(9, 0) = 0.5;
  g.view().head(0, 3)(4, 0) = 0.2;
  CHECK_THROWS_WITH(gated(), Contains("gates[b=0, h=3]"));
  CHECK(unchanged());
  g.view().head(0, 3)(4, 0) = -0.1;
  k.view().head(1, 1)(3, 2) = std::nan("");
  CHECK_THROWS_WITH(delta(), Contains("k[b=1, h=1]"));
  CHECK(unchanged());
  k.view().head(1, 1)(3, 2) = 0.1;
  // Raw keys without l2_normalize: beta |k|^2 = 0.5 * 9+ > 2, a step that grows S unboundedly.
  const double kept = k.view().head(0, 2)(5, 1);
  k.view().head(0, 2)(5, 1) = 3.0;
  CHECK_THROWS_WITH(delta(), Contains("k[b=0, h=2]") && Contains("token 5") &&
                                 Contains("DeltaOptions::l2_normalize"));
  CHECK(unchanged());
  k.view().head(0, 2)(5, 1) = kept;
  Heads<double> wide_beta({batch, heads, n, 2}, true);
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q.cview(), k.cview(), v.cview(),
                                                    wide_beta.cview(), out.view()),
                    Contains("beta is [2, 4, 24, 2]"));
  Heads<double> three_heads({batch, 3, n, 1}, true);
  CHECK_THROWS_WITH(linattn::causal_gated_delta_rule_into(q.cview(), k.cview(), v.cview(),
                                                          linattn::log_gates(three_heads.cview()),
                                                          beta.cview(), out.view()),
                    Contains("gates is [2, 3, 24, 1]"));
  // Beta and gates with q/k's 2 heads where out has 4 value heads (a divisor: these ran, 0.88
  // off): one per value head, as FLA's [B, T, HV].
  Heads<double> two_heads({batch, 2, n, 1}, true);
  for (double& x : two_heads.data) x = 0.5;
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q.cview(), k.cview(), v.cview(),
                                                    two_heads.cview(), out.view()),
                    Contains("beta is [2, 2, 24, 1] but must be [2, 4, 24, 1]") &&
                        Contains("beta needs one head per value head"));
  for (double& x : two_heads.data) x = -0.1;
  CHECK_THROWS_WITH(linattn::causal_gated_delta_rule_into(q.cview(), k.cview(), v.cview(),
                                                          linattn::log_gates(two_heads.cview()),
                                                          beta.cview(), out.view()),
                    Contains("gates needs one head per value head"));
  CHECK_THROWS_WITH(linattn::causal_delta_rule_varlen_into(q.cview(), k.cview(), v.cview(),
                                                           beta.cview(), {0, 30}, out.view()),
                    Contains("B must be 1"));
  CHECK(unchanged());
  CHECK_NOTHROW(gated());
  CHECK_FALSE(unchanged());
}

TEMPLATE_TEST_CASE("the delta rule at N = 65,536", "[delta_rule][long]", float, double) {
  // One long sequence per type: Gated DeltaNet in float, KDA in double.
  const Eigen::Index n = 65536;
  const Eigen::Index gate_cols = std::is_same_v<TestType, float> ? 1 : 8;
  const Sequence s(n, 8, 8, gate_cols, 123);
  const Matrix<double> expected =
      naive_delta_rule(s.q, s.k, s.v, s.beta, s.log_gates, 1.0 / std::sqrt(8.0), false);
  for (const linattn::DeltaForm form :
       {linattn::DeltaForm::chunked, linattn::DeltaForm::streamed}) {
    DeltaOptions options;
    options.form = form;
    CHECK(relative_error(chunked<TestType>(s, options), expected) <= bound<TestType>());
  }
}

TEST_CASE("the delta rule takes 16-bit inputs and accumulates in float or double", "[delta_rule]") {
  const Sequence s(90, 16, 16, 1, 55);
  using Half = Eigen::half;
  const Matrix<Half> q = s.q.cast<Half>();
  const Matrix<Half> k = s.k.cast<Half>();
  const Matrix<Half> v = s.v.cast<Half>();
  const Vector<Half> beta = s.beta.cast<Half>();
  const Matrix<Half> g = s.log_gates.cast<Half>();
  // Against the float call on the same (rounded) inputs: the only difference is the output's
  // rounding to half.
  const Matrix<float> reference = linattn::causal_gated_delta_rule(
      q.cast<float>(), k.cast<float>(), v.cast<float>(), linattn::log_gates(g.cast<float>().eval()),
      beta.cast<float>(), {});
  const Matrix<Half> out = linattn::causal_gated_delta_rule(q, k, v, linattn::log_gates(g), beta);
  CHECK(relative_error(out, reference) <= 2e-3);
  // Float inputs accumulated in double: within double's bound of the naive recurrence on the
  // float inputs.
  const Matrix<float> qf = s.q.cast<float>();
  const Matrix<float> kf = s.k.cast<float>();
  const Matrix<float> vf = s.v.cast<float>();
  const Vector<float> bf = s.beta.cast<float>();
  const Matrix<float> gf = s.log_gates.cast<float>();
  const Matrix<float> in_double =
      linattn::causal_gated_delta_rule<double>(qf, kf, vf, linattn::log_gates(gf), bf);
  const Matrix<double> expected =
      naive_delta_rule(qf.cast<double>(), kf.cast<double>(), vf.cast<double>(), bf.cast<double>(),
                       gf.cast<double>(), 0.25, false);
  CHECK(relative_error(in_double, expected) <= 1e-6);  // the float rounding of the output
  DeltaRuleState<Half> state(16, 16);
  const Vector<Half> first =
      state.step(q.row(0), k.row(0), v.row(0), linattn::log_gates(g.row(0)), beta(0));
  CHECK(relative_error(first.transpose(), reference.row(0)) <= 2e-3);
}

TEST_CASE("the delta rule rejects bad input and changes nothing", "[delta_rule]") {
  const Sequence s(20, 8, 4, 1, 3);
  const Matrix<double>& q = s.q;
  const Matrix<double>& k = s.k;
  const Matrix<double>& v = s.v;
  const Vector<double>& beta = s.beta;
  const Matrix<double>& g = s.log_gates;
  Matrix<double> out = Matrix<double>::Constant(20, 4, 7.0);
  const auto unchanged = [&] { return (out.array() == 7.0).all(); };
  using Catch::Matchers::Contains;

  // beta out of range, NaN, the wrong size.
  Vector<double> bad_beta = beta;
  bad_beta(5) = 1.5;
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q, k, v, bad_beta, out),
                    Contains("beta must lie in (0, 1]") && Contains("token 5"));
  DeltaOptions negative;
  negative.allow_negative_eigenvalues = true;
  CHECK_NOTHROW(linattn::causal_delta_rule(q, k, v, bad_beta, negative));
  bad_beta(5) = 0.0;
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q, k, v, bad_beta, out), Contains("beta"));
  bad_beta(5) = std::nan("");
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q, k, v, bad_beta, out, negative),
                    Contains("beta must lie in (0, 2]"));
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q, k, v, beta.head(19), out),
                    Contains("beta is 19 x 1"));
  // Unnormalised keys without l2_normalize: beta |k|^2 > 2 would grow S without bound (outputs
  // near 1e7 in a 4-layer port); the call names the option instead. With it, they are fine.
  const Matrix<double> raw_k = 3.0 * k;
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q, raw_k, v, beta, out),
                    Contains("beta |k|^2 is") && Contains("DeltaOptions::l2_normalize"));
  CHECK_THROWS_WITH(
      linattn::causal_gated_delta_rule_into(q, raw_k, v, linattn::log_gates(g), beta, out),
      Contains("DeltaOptions::l2_normalize"));
  DeltaRuleState<double> raw_state(8, 4);
  CHECK_THROWS_WITH(raw_state.step(q.row(0), raw_k.row(0), v.row(0), 1.0),
                    Contains("token 0 of k") && Contains("DeltaOptions::l2_normalize"));
  CHECK(raw_state.tokens() == 0);
  DeltaOptions normalised;
  normalised.l2_normalize = true;
  Matrix<double> raw_out(20, 4);
  CHECK_NOTHROW(linattn::causal_delta_rule_into(q, raw_k, v, beta, raw_out, normalised));
  // Gates: > 0 in log space, > 1 as a_t, the wrong width.
  Matrix<double> bad_g = g;
  bad_g(3, 0) = 0.1;
  CHECK_THROWS_WITH(
      linattn::causal_gated_delta_rule_into(q, k, v, linattn::log_gates(bad_g), beta, out),
      Contains("log gates") && Contains("row 3"));
  CHECK_THROWS_WITH(
      linattn::causal_gated_delta_rule_into(q, k, v, (g.array().exp() + 0.5).matrix(), beta, out),
      Contains("(0, 1]"));
  const Matrix<double> wide = Matrix<double>::Zero(20, 3);
  CHECK_THROWS_WITH(
      linattn::causal_gated_delta_rule_into(q, k, v, linattn::log_gates(wide), beta, out),
      Contains("gates is 20 x 3 but q is 20 x 8"));
  // NaN in an input, shapes, options.
  Matrix<double> bad_q = q;
  bad_q(7, 2) = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(bad_q, k, v, beta, out),
                    Contains("q has a non-finite value") && Contains("row 7"));
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q, k.topRows(19), v, beta, out),
                    Contains("k is 19 x 8"));
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q, k, v.topRows(19), beta, out),
                    Contains("v is 19 x 4"));
  Matrix<double> small_out(20, 3);
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q, k, v, beta, small_out),
                    Contains("out is 20 x 3"));
  DeltaOptions bad;
  bad.scale = 0.0;
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q, k, v, beta, out, bad),
                    Contains("DeltaOptions::scale"));
  bad = {};
  bad.chunk = 0;
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q, k, v, beta, out, bad),
                    Contains("DeltaOptions::chunk"));
  bad = {};
  bad.threads = -1;
  CHECK_THROWS_WITH(linattn::causal_delta_rule_into(q, k, v, beta, out, bad),
                    Contains("DeltaOptions::threads"));
  CHECK(unchanged());

  // The state: nothing moves on a throw, and it keeps its transition.
  DeltaRuleState<double> state(8, 4);
  const Vector<double> first =
      state.step(q.row(0), k.row(0), v.row(0), linattn::log_gates(g.row(0)), beta(0));
  const Matrix<double> before = state.s();
  Vector<double> token_out(4);
  CHECK_THROWS_WITH(
      state.step_into(q.row(1), k.row(1), v.row(1), beta(1), token_out),
      Contains("moved by scalar gates (Gated DeltaNet) but this call gives no gates"));
  CHECK_THROWS_WITH(
      state.step_into(q.row(1), k.row(1), v.row(1), linattn::log_gates(g.row(1)), 1.5, token_out),
      Contains("beta"));
  CHECK_THROWS_WITH(state.step_into(bad_q.row(7), k.row(1), v.row(1), linattn::log_gates(g.row(1)),
                                    beta(1), token_out),
                    Contains("q has a non-finite value"));
  const Matrix<double> three = Matrix<double>::Zero(1, 3);
  CHECK_THROWS_WITH(
      state.step_into(q.row(1), k.row(1), v.row(1), linattn::log_gates(three), beta(1), token_out),
      Contains("gate is 1 x 3"));
  Matrix<double> prefill_out(20, 4);
  CHECK_THROWS_WITH(state.prefill_into(q, k, v, linattn::log_gates(bad_g), beta, prefill_out),
                    Contains("row 3"));
  CHECK_THROWS_WITH(state.prefill_into(q, k, v, beta, prefill_out), Contains("moved by"));
  const Matrix<double> per_feature = Matrix<double>::Zero(20, 8);
  CHECK_THROWS_WITH(state.prefill_into(q, k, v, linattn::log_gates(per_feature), beta, prefill_out),
                    Contains("per-feature gates (KDA)"));
  CHECK(state.s() == before);
  CHECK(state.tokens() == 1);
  state.reset();
  CHECK(state.s().isZero(0));
  CHECK(state.transition() == linattn::TransitionKind::none);
  CHECK_NOTHROW(state.step(q.row(0), k.row(0), v.row(0), beta(0)));
  CHECK_THROWS_WITH(DeltaRuleState<double>(0, 4), Contains("key_dim must be >= 1"));
  CHECK_THROWS_WITH(DeltaRuleState<double>::from_state(Matrix<double>::Constant(2, 2, NAN)),
                    Contains("s0 has a non-finite value"));
  CHECK(first.allFinite());
}

}  // namespace linattn_test_delta_rule
