// LinearAttentionLayer and DeltaRuleLayer: the parallel forward against prefill + token-by-token
// steps over the same weights, against the naive formula, over a fused QKV buffer, and errors.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/feature_maps.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/layer.hpp>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_layer {

using linattn::HeadStrides;
using linattn::HeadsView;
using linattn::LinearAttentionLayer;
using linattn::Matrix;
using linattn_test::gaussian;
using linattn_test::naive_linear_attention;
using linattn_test::relative_error;

namespace {

constexpr Eigen::Index kB = 2, kH = 4, kDk = 8, kDv = 6;

template <class T>
double tolerance() {  // docs/design.md: parallel and recurrent forms agree to this
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

/// max |prefilled - forward| over the prompt's tokens of every head, and max |forward| over
/// all of them: where a test's tally of recurrent against parallel outputs starts.
template <class T>
std::pair<double, double> prompt_difference(const HeadsView<T>& prefilled,
                                            const HeadsView<T>& forward, Eigen::Index prompt) {
  double diff = 0.0, scale = 0.0;
  for (Eigen::Index i = 0; i < kB * kH; ++i) {
    const Matrix<double> expected = forward.head(i / kH, i % kH).template cast<double>();
    scale = std::max(scale, expected.cwiseAbs().maxCoeff());
    diff = std::max(
        diff, (prefilled.head(i / kH, i % kH).template cast<double>() - expected.topRows(prompt))
                  .cwiseAbs()
                  .maxCoeff());
  }
  return {diff, scale};
}

template <class T>
double delta_tolerance() {  // docs/design.md's bound for the delta rule, with L2-normalised keys
  return std::is_same_v<T, float> ? 1e-4 : 1e-10;
}

/// The part of a view holding tokens [begin, begin + count).
template <class T>
HeadsView<T> token_range(const HeadsView<T>& view, Eigen::Index begin, Eigen::Index count) {
  return HeadsView<T>(view.data() + begin * view.strides().token, view.batch(), view.heads(), count,
                      view.dim(), view.strides());
}

/// kB x kH heads of N tokens in [B, N, H, D] caller memory (as a QKV projection leaves them),
/// plus a Matrix copy of each head, head b * kH + h.
template <class T>
struct HeadData {
  std::vector<T> data;
  std::vector<Matrix<T>> heads;
  Eigen::Index tokens, dim;

  HeadData(Eigen::Index n, Eigen::Index d, std::uint64_t seed)
      : data(static_cast<std::size_t>(kB * n * kH * d)), tokens(n), dim(d) {
    for (Eigen::Index i = 0; i < kB * kH; ++i) {
      heads.push_back(gaussian<T>(n, d, seed + 101 * static_cast<std::uint64_t>(i)));
      view().head(i / kH, i % kH) = heads.back();
    }
  }
  HeadsView<T> view() {
    return HeadsView<T>::bnhd(data.data(), linattn::BnhdShape{kB, tokens, kH, dim});
  }
  HeadsView<const T> cview() const {
    return HeadsView<const T>::bnhd(data.data(), linattn::BnhdShape{kB, tokens, kH, dim});
  }
};

struct Worst {
  double steps = 0.0;      ///< prefill + steps vs forward
  double reference = 0.0;  ///< forward vs the naive formula
};

/// forward_into over N tokens; then, for several prompt lengths P, prefill_into over the first
/// P tokens and step_into for the rest; every output against forward's.
template <class T, class Map>
void forward_vs_recurrent(const Map& map, double decay, Eigen::Index n, std::uint64_t seed,
                          Worst& worst) {
  linattn::Options options;
  options.decay = decay;
  options.threads = 2;
  const LinearAttentionLayer<T, Map> layer(map, kH, kDk, kDv, options);
  const HeadData<T> q(n, kDk, seed), k(n, kDk, seed + 1), v(n, kDv, seed + 2);
  std::vector<T> forward_data(static_cast<std::size_t>(kB * kH * n * kDv), T(-5));
  const auto forward = HeadsView<T>::bhnd(forward_data.data(), {kB, kH, n, kDv});
  layer.forward_into(q.cview(), k.cview(), v.cview(), forward);

  // An independent reference for two heads: the naive formula in double.
  for (const Eigen::Index i : {Eigen::Index(0), kB * kH - 1}) {
    const auto idx = static_cast<std::size_t>(i);
    const Matrix<double> expected = naive_linear_attention(
        map.queries(q.heads[idx].template cast<double>()),
        map.keys(k.heads[idx].template cast<double>()), v.heads[idx].template cast<double>(), true,
        decay, options.eps, true);
    const double error = relative_error(forward.head(i / kH, i % kH), expected);
    INFO("head " << i << " vs the naive formula");
    CHECK(error <= tolerance<T>());
    worst.reference = std::max(worst.reference, error);
  }

  for (const Eigen::Index prompt : {Eigen::Index(0), Eigen::Index(1), Eigen::Index(257), n}) {
    auto states = layer.make_states(kB);
    REQUIRE(states.size() == kB * kH);
    std::vector<Matrix<T>> recurrent(static_cast<std::size_t>(kB * kH), Matrix<T>(n, kDv));
    if (prompt > 0) {
      std::vector<T> out(static_cast<std::size_t>(kB * kH * prompt * kDv));
      const auto out_view = HeadsView<T>::bhnd(out.data(), {kB, kH, prompt, kDv});
      layer.prefill_into(states, token_range(q.cview(), 0, prompt),
                         token_range(k.cview(), 0, prompt), token_range(v.cview(), 0, prompt),
                         out_view);
      for (Eigen::Index i = 0; i < kB * kH; ++i) {
        recurrent[static_cast<std::size_t>(i)].topRows(prompt) = out_view.head(i / kH, i % kH);
      }
    }
    // One token of every head at a time: row b * H + h of a (B * H) x D matrix.
    Matrix<T> qt(kB * kH, kDk), kt(kB * kH, kDk), vt(kB * kH, kDv), ot(kB * kH, kDv);
    for (Eigen::Index t = prompt; t < n; ++t) {
      for (Eigen::Index i = 0; i < kB * kH; ++i) {
        const auto idx = static_cast<std::size_t>(i);
        qt.row(i) = q.heads[idx].row(t);
        kt.row(i) = k.heads[idx].row(t);
        vt.row(i) = v.heads[idx].row(t);
      }
      layer.step_into(states, qt, kt, vt, ot);
      for (Eigen::Index i = 0; i < kB * kH; ++i) {
        recurrent[static_cast<std::size_t>(i)].row(t) = ot.row(i);
      }
    }
    INFO("decay = " << decay << ", prompt of " << prompt << " tokens, then " << n - prompt
                    << " steps");
    for (Eigen::Index i = 0; i < kB * kH; ++i) {
      const auto& got = recurrent[static_cast<std::size_t>(i)];
      const Matrix<T> expected = forward.head(i / kH, i % kH);
      REQUIRE(got.allFinite());
      const double error = relative_error(got, expected);
      CHECK(error <= tolerance<T>());
      // The whole sequence as a prompt is the same kernel from an empty state.
      if (prompt == n) CHECK(got == expected);
      CHECK(states[i].tokens() == n);
      worst.steps = std::max(worst.steps, error);
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("layer: forward equals prefill then token-by-token steps", "[layer]", float,
                   double) {
  using T = TestType;
  const Eigen::Index n = 1000;
  SECTION("EluPlusOne") {
    Worst worst;
    for (const double decay : {1.0, 0.99}) {
      forward_vs_recurrent<T>(linattn::EluPlusOne{}, decay, n, 11, worst);
    }
    WARN("layer, EluPlusOne, N = 1000: worst relative error, recurrent vs parallel "
         << worst.steps << ", parallel vs naive " << worst.reference);
  }
  SECTION("PositiveRandomFeatures") {
    Worst worst;
    for (const double decay : {1.0, 0.99}) {
      forward_vs_recurrent<T>(linattn::PositiveRandomFeatures(kDk, 16, 21), decay, n, 31, worst);
    }
    WARN("layer, PositiveRandomFeatures, N = 1000: worst relative error, recurrent vs parallel "
         << worst.steps << ", parallel vs naive " << worst.reference);
  }
}

TEMPLATE_TEST_CASE("layer: views over a fused QKV buffer equal contiguous heads", "[layer]",
                   float) {
  using T = TestType;
  const Eigen::Index n = 100, d = kDk;  // one width for q, k and v in a fused projection
  // [B, N, 3, H, D]: per token, all query heads, then all key heads, then all value heads.
  const Matrix<T> qkv = gaussian<T>(kB * n, 3 * kH * d, 41);
  const HeadStrides strides{n * 3 * kH * d, d, 3 * kH * d, 1};
  const HeadsView<const T> q(qkv.data(), kB, kH, n, d, strides);
  const HeadsView<const T> k(qkv.data() + kH * d, kB, kH, n, d, strides);
  const HeadsView<const T> v(qkv.data() + 2 * kH * d, kB, kH, n, d, strides);
  // The same heads copied to [B, H, N, D].
  std::vector<T> qc(static_cast<std::size_t>(kB * kH * n * d)), kc(qc.size()), vc(qc.size());
  for (Eigen::Index b = 0; b < kB; ++b) {
    for (Eigen::Index h = 0; h < kH; ++h) {
      HeadsView<T>::bhnd(qc.data(), {kB, kH, n, d}).head(b, h) = q.head(b, h);
      HeadsView<T>::bhnd(kc.data(), {kB, kH, n, d}).head(b, h) = k.head(b, h);
      HeadsView<T>::bhnd(vc.data(), {kB, kH, n, d}).head(b, h) = v.head(b, h);
      // Spot check the addressing: token 7 of head h of sequence b.
      CHECK(q.head(b, h)(7, 3) == qkv(b * n + 7, h * d + 3));
      CHECK(v.head(b, h)(7, 3) == qkv(b * n + 7, 2 * kH * d + h * d + 3));
    }
  }
  linattn::Options options;
  options.decay = 0.97;
  const LinearAttentionLayer<T, linattn::PositiveRandomFeatures> layer(
      linattn::PositiveRandomFeatures(d, 16, 51), kH, d, d, options);
  std::vector<T> fused_out(qc.size()), copy_out(qc.size());
  layer.forward_into(q, k, v, HeadsView<T>::bhnd(fused_out.data(), {kB, kH, n, d}));
  layer.forward_into(HeadsView<const T>::bhnd(qc.data(), {kB, kH, n, d}),
                     HeadsView<const T>::bhnd(kc.data(), {kB, kH, n, d}),
                     HeadsView<const T>::bhnd(vc.data(), {kB, kH, n, d}),
                     HeadsView<T>::bhnd(copy_out.data(), {kB, kH, n, d}));
  CHECK(fused_out == copy_out);
}

TEMPLATE_TEST_CASE("layer: accessors and wrong shapes", "[layer][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  using Layer = LinearAttentionLayer<T, linattn::PositiveRandomFeatures>;
  const linattn::PositiveRandomFeatures map(kDk, 16, 61);
  linattn::Options options;
  options.decay = 0.9;
  const Layer layer(map, kH, kDk, kDv, options);
  CHECK(layer.heads() == kH);
  CHECK(layer.key_dim() == kDk);
  CHECK(layer.value_dim() == kDv);
  CHECK(layer.feature_dim() == 16);
  CHECK(layer.options().decay == 0.9);
  CHECK(layer.feature_map().projection() == map.projection());

  SECTION("constructor") {
    CHECK_THROWS_WITH(Layer(map, 0, kDk, kDv), Contains("heads must be >= 1"));
    CHECK_THROWS_WITH(Layer(map, kH, 0, kDv), Contains("key_dim must be >= 1"));
    CHECK_THROWS_WITH(Layer(map, kH, kDk, -1), Contains("value_dim must be >= 1"));
    CHECK_THROWS_AS(Layer(map, kH, kDk + 1, kDv), linattn::Error);  // map built for kDk
    linattn::Options bad;
    bad.chunk = 0;
    CHECK_THROWS_WITH(Layer(map, kH, kDk, kDv, bad), Contains("Options::chunk"));
    CHECK_THROWS_WITH(layer.make_states(0), Contains("batch must be >= 1"));
  }

  const Eigen::Index n = 12;
  auto buffer = [&](Eigen::Index b, Eigen::Index h, Eigen::Index d, std::uint64_t seed) {
    const Matrix<T> m = gaussian<T>(b * h * n, d, seed);
    return std::vector<T>(m.data(), m.data() + m.size());
  };
  const std::vector<T> q = buffer(kB, kH, kDk, 1), k = buffer(kB, kH, kDk, 2);
  const std::vector<T> v = buffer(kB, kH, kDv, 3);
  std::vector<T> out(static_cast<std::size_t>(kB * kH * n * kDv), T(8));
  const std::vector<T> out_before = out;
  auto view = [&](const std::vector<T>& data, Eigen::Index b, Eigen::Index h, Eigen::Index d) {
    return HeadsView<const T>::bhnd(data.data(), {b, h, n, d});
  };
  const auto qv = view(q, kB, kH, kDk), kv = view(k, kB, kH, kDk), vv = view(v, kB, kH, kDv);
  const auto ov = HeadsView<T>::bhnd(out.data(), {kB, kH, n, kDv});

  SECTION("forward_into and prefill_into") {
    // q holds B * H * n * Dk elements, so [B, H - 1, n, Dk] and such fit in it.
    CHECK_THROWS_WITH(layer.forward_into(view(q, kB, kH - 1, kDk), kv, vv, ov),
                      Contains("LinearAttentionLayer::forward") && Contains("H = 4"));
    CHECK_THROWS_WITH(layer.forward_into(view(q, kB, kH, kDk - 1), kv, vv, ov),
                      Contains("LinearAttentionLayer::forward") && Contains("Dk = 8"));
    CHECK_THROWS_WITH(layer.forward_into(qv, kv, view(v, kB, kH, kDv - 1), ov),
                      Contains("LinearAttentionLayer::forward") && Contains("Dv = 6"));
    CHECK_THROWS_WITH(layer.forward_into(qv, view(k, kB, kH, kDk - 1), vv, ov),
                      Contains("k is [2, 4, 12, 7]"));
    CHECK_THROWS_WITH(layer.forward_into(qv, view(k, 1, kH, kDk), vv, ov),
                      Contains("k is [1, 4, 12, 8]"));
    CHECK_THROWS_WITH(
        layer.forward_into(qv, kv, vv, HeadsView<T>::bhnd(out.data(), {kB, kH, n, kDv - 1})),
        Contains("out is [2, 4, 12, 5]"));
    auto states = layer.make_states(kB);
    auto one_sequence = layer.make_states(1);
    CHECK_THROWS_WITH(layer.prefill_into(one_sequence, qv, kv, vv, ov),
                      Contains("B x H = 8 heads, but the batch holds 4 states"));
    CHECK_THROWS_WITH(layer.prefill_into(states, view(q, kB, kH - 1, kDk), kv, vv, ov),
                      Contains("LinearAttentionLayer::prefill") && Contains("H = 4"));
    CHECK_THROWS_WITH(layer.prefill_into(states, qv, kv, view(v, kB, kH, kDv - 1), ov),
                      Contains("LinearAttentionLayer::prefill") && Contains("Dv = 6"));
    const bool unchanged = out == out_before;  // every error above is found before any work
    CHECK(unchanged);
    // A NaN in v (head 0, token 0, feature 5) throws and moves no state; it writes into a
    // scratch buffer, since the chunks are scanned as they are loaded.
    std::vector<T> bad = v, scratch(out.size());
    const auto sv = HeadsView<T>::bhnd(scratch.data(), {kB, kH, n, kDv});
    bad[5] = std::numeric_limits<T>::quiet_NaN();
    CHECK_THROWS_WITH(layer.prefill_into(states, qv, kv, view(bad, kB, kH, kDv), sv),
                      Contains("v[b=0, h=0]") && Contains("row 0, column 5"));
    CHECK_THROWS_WITH(layer.forward_into(qv, kv, view(bad, kB, kH, kDv), sv),
                      Contains("v[b=0, h=0]") && Contains("row 0, column 5"));
    for (Eigen::Index i = 0; i < states.size(); ++i) CHECK(states[i].tokens() == 0);
  }

  SECTION("step_into") {
    auto states = layer.make_states(kB);
    layer.prefill_into(states, qv, kv, vv, ov);
    const Matrix<T> qt = gaussian<T>(kB * kH, kDk, 7), kt = gaussian<T>(kB * kH, kDk, 8);
    const Matrix<T> vt = gaussian<T>(kB * kH, kDv, 9);
    Matrix<T> ot(kB * kH, kDv);
    CHECK_THROWS_WITH(layer.step_into(states, qt.leftCols(kDk - 1), kt, vt, ot),
                      Contains("LinearAttentionLayer::step: q is 8 x 7") && Contains("key_dim 8"));
    CHECK_THROWS_WITH(layer.step_into(states, qt.topRows(7), kt, vt, ot),
                      Contains("q has 7 rows but the states hold 2 sequences of 4 heads"));
    CHECK_THROWS_WITH(layer.step_into(states, qt, kt.leftCols(kDk - 1), vt, ot),
                      Contains("k is 8 x 7"));
    CHECK_THROWS_WITH(layer.step_into(states, qt, kt, vt.leftCols(kDv - 1), ot),
                      Contains("v is 8 x 5"));
    Matrix<T> narrow(kB * kH, kDv - 1);
    CHECK_THROWS_WITH(layer.step_into(states, qt, kt, vt, narrow), Contains("out is 8 x 5"));
    auto one_sequence = layer.make_states(1);
    CHECK_THROWS_WITH(layer.step_into(one_sequence, qt, kt, vt, ot),
                      Contains("q has 8 rows but the states hold 1 sequences of 4 heads"));
    for (Eigen::Index i = 0; i < states.size(); ++i) CHECK(states[i].tokens() == n);
    layer.step_into(states, qt, kt, vt, ot);
    CHECK(ot.allFinite());
    for (Eigen::Index i = 0; i < states.size(); ++i) CHECK(states[i].tokens() == n + 1);
  }
}

TEST_CASE("layer: float inputs with double accumulation", "[layer]") {
  // LinearAttentionLayer<float, Map, double>: float q, k, v and outputs, double states and sums.
  const Eigen::Index n = 400;
  linattn::Options options;
  options.decay = 0.995;
  const linattn::PositiveRandomFeatures map(kDk, 16, 71);
  const LinearAttentionLayer<float, linattn::PositiveRandomFeatures, double> layer(map, kH, kDk,
                                                                                   kDv, options);
  const HeadData<float> q(n, kDk, 81), k(n, kDk, 82), v(n, kDv, 83);
  std::vector<float> forward_data(static_cast<std::size_t>(kB * kH * n * kDv));
  const auto forward = HeadsView<float>::bhnd(forward_data.data(), {kB, kH, n, kDv});
  layer.forward_into(q.cview(), k.cview(), v.cview(), forward);
  auto states = layer.make_states(kB);
  Matrix<float> qt(kB * kH, kDk), kt(kB * kH, kDk), vt(kB * kH, kDv), ot(kB * kH, kDv);
  double worst_steps = 0.0, worst_reference = 0.0;
  std::vector<Matrix<float>> recurrent(static_cast<std::size_t>(kB * kH), Matrix<float>(n, kDv));
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index i = 0; i < kB * kH; ++i) {
      const auto idx = static_cast<std::size_t>(i);
      qt.row(i) = q.heads[idx].row(t);
      kt.row(i) = k.heads[idx].row(t);
      vt.row(i) = v.heads[idx].row(t);
    }
    layer.step_into(states, qt, kt, vt, ot);
    for (Eigen::Index i = 0; i < kB * kH; ++i)
      recurrent[static_cast<std::size_t>(i)].row(t) = ot.row(i);
  }
  for (Eigen::Index i = 0; i < kB * kH; ++i) {
    const auto idx = static_cast<std::size_t>(i);
    const Matrix<float> parallel = forward.head(i / kH, i % kH);
    // The reference: the same computation in double throughout.
    const Matrix<double> expected =
        linattn::causal_linear_attention(q.heads[idx].cast<double>(), k.heads[idx].cast<double>(),
                                         v.heads[idx].cast<double>(), map, options);
    const double e_steps = relative_error(recurrent[idx], parallel);
    const double e_reference = relative_error(parallel, expected);
    CHECK(e_steps <= 2e-5);
    CHECK(e_reference <= 2e-5);
    worst_steps = std::max(worst_steps, e_steps);
    worst_reference = std::max(worst_reference, e_reference);
  }
  WARN("layer<float, PRF, double>, N = 400: worst relative error, recurrent vs parallel "
       << worst_steps << ", parallel vs double " << worst_reference);
}

namespace {

/// The layer's forward against prefill + steps with a transition per head: HeadDecays given
/// to the layer (gate_dim 0), or per-token log gates, gate_dim 1 or C wide, in [B, N, H, G]
/// memory; with `bonus`, the gates carry RWKV-6's u (H x C, no normaliser). Prompts of 0, 1,
/// 257 and N tokens; every output against forward's.
template <class T, bool Bonus = false, class Map>
double transition_forward_vs_recurrent(const Map& map, Eigen::Index gate_dim, Eigen::Index n,
                                       std::uint64_t seed) {
  linattn::Options options;
  options.threads = 2;
  options.normalize = !Bonus;
  const Matrix<T> u = gaussian<T>(kH, kDk, seed + 4);
  // body(gates) with log_gates(view) (or a matrix's), with or without the bonus.
  auto with_gates = [&](const auto& log_values, const auto& body) {
    if constexpr (Bonus) {
      body(linattn::with_bonus(linattn::log_gates(log_values), u));
    } else {
      body(linattn::log_gates(log_values));
    }
  };
  linattn::HeadDecays decays;
  for (Eigen::Index h = 0; h < kH; ++h) decays.values.push_back(1.0 - std::exp2(-5.0 - h));
  const LinearAttentionLayer<T, Map> layer =
      gate_dim == 0 ? LinearAttentionLayer<T, Map>(map, kH, kDk, kDv, decays, options)
                    : LinearAttentionLayer<T, Map>(map, kH, kDk, kDv, options);
  const HeadData<T> q(n, kDk, seed), k(n, kDk, seed + 1), v(n, kDv, seed + 2);
  // Log gates in [-0.3, 0]; a reset at token 300 of head 1.
  HeadData<T> g(n, std::max<Eigen::Index>(gate_dim, 1), seed + 3);
  for (Eigen::Index i = 0; i < kB * kH; ++i) {
    Matrix<T>& head = g.heads[static_cast<std::size_t>(i)];
    head = (-T(0.1) * head.cwiseAbs()).cwiseMax(T(-0.3));
    if (i == 1) head.row(300).setConstant(-std::numeric_limits<T>::infinity());
    g.view().head(i / kH, i % kH) = head;
  }
  std::vector<T> forward_data(static_cast<std::size_t>(kB * kH * n * kDv), T(-5));
  const auto forward = HeadsView<T>::bhnd(forward_data.data(), {kB, kH, n, kDv});
  if (gate_dim == 0) {
    CHECK(layer.head_decays().values == decays.values);
    layer.forward_into(q.cview(), k.cview(), v.cview(), forward);
  } else {
    with_gates(g.cview(), [&](const auto& gates) {
      layer.forward_into(q.cview(), k.cview(), v.cview(), gates, forward);
    });
  }
  double worst = 0.0;
  for (const Eigen::Index prompt : {Eigen::Index(0), Eigen::Index(1), Eigen::Index(257), n}) {
    auto states = layer.make_states(kB);
    std::vector<Matrix<T>> recurrent(static_cast<std::size_t>(kB * kH), Matrix<T>(n, kDv));
    if (prompt > 0) {
      std::vector<T> out(static_cast<std::size_t>(kB * kH * prompt * kDv));
      const auto out_view = HeadsView<T>::bhnd(out.data(), {kB, kH, prompt, kDv});
      if (gate_dim == 0) {
        layer.prefill_into(states, token_range(q.cview(), 0, prompt),
                           token_range(k.cview(), 0, prompt), token_range(v.cview(), 0, prompt),
                           out_view);
      } else {
        with_gates(token_range(g.cview(), 0, prompt), [&](const auto& gates) {
          layer.prefill_into(states, token_range(q.cview(), 0, prompt),
                             token_range(k.cview(), 0, prompt), token_range(v.cview(), 0, prompt),
                             gates, out_view);
        });
      }
      for (Eigen::Index i = 0; i < kB * kH; ++i) {
        recurrent[static_cast<std::size_t>(i)].topRows(prompt) = out_view.head(i / kH, i % kH);
      }
    }
    Matrix<T> qt(kB * kH, kDk), kt(kB * kH, kDk), vt(kB * kH, kDv), ot(kB * kH, kDv);
    Matrix<T> gt(kB * kH, std::max<Eigen::Index>(gate_dim, 1));
    for (Eigen::Index t = prompt; t < n; ++t) {
      for (Eigen::Index i = 0; i < kB * kH; ++i) {
        const auto idx = static_cast<std::size_t>(i);
        qt.row(i) = q.heads[idx].row(t);
        kt.row(i) = k.heads[idx].row(t);
        vt.row(i) = v.heads[idx].row(t);
        gt.row(i) = g.heads[idx].row(t);
      }
      if (gate_dim == 0) {
        layer.step_into(states, qt, kt, vt, ot);
      } else {
        with_gates(gt, [&](const auto& gates) { layer.step_into(states, qt, kt, vt, gates, ot); });
      }
      for (Eigen::Index i = 0; i < kB * kH; ++i) {
        recurrent[static_cast<std::size_t>(i)].row(t) = ot.row(i);
      }
    }
    INFO("gate_dim = " << gate_dim << ", prompt of " << prompt << " tokens");
    for (Eigen::Index i = 0; i < kB * kH; ++i) {
      const Matrix<T>& got = recurrent[static_cast<std::size_t>(i)];
      const Matrix<T> expected = forward.head(i / kH, i % kH);
      REQUIRE(got.allFinite());
      const double error = relative_error(got, expected);
      CHECK(error <= tolerance<T>());
      // The whole sequence as a prompt is the same kernel, except that the token-major
      // forward runs in blocks, and a block edge may split a chunk that the prefill cuts
      // before a scalar reset differently: within rounding there.
      if (prompt == n && gate_dim != 1) CHECK(got == expected);
      worst = std::max(worst, error);
    }
  }
  return worst;
}

}  // namespace

TEMPLATE_TEST_CASE("layer: HeadDecays and gates, forward equals prefill then steps",
                   "[layer][gated]", float, double) {
  using T = TestType;
  const Eigen::Index n = 600;
  double worst = 0.0;
  for (const Eigen::Index gate_dim : {Eigen::Index(0), Eigen::Index(1), kDk}) {
    worst =
        std::max(worst, transition_forward_vs_recurrent<T>(linattn::EluPlusOne{}, gate_dim, n, 41));
  }
  worst = std::max(worst, transition_forward_vs_recurrent<T>(
                              linattn::PositiveRandomFeatures(kDk, 16, 21), 1, n, 51));
  // RWKV-6's bonus u on both forms: per-feature gates on features, scalar ones through a map.
  worst =
      std::max(worst, transition_forward_vs_recurrent<T, true>(linattn::Identity{}, kDk, n, 71));
  worst =
      std::max(worst, transition_forward_vs_recurrent<T, true>(linattn::EluPlusOne{}, 1, n, 81));
  WARN("layer with HeadDecays or gates, N = 600: worst relative error, recurrent vs parallel "
       << worst);
  // HeadDecays head h against a plain layer with Options::decay = values[h]: the same kernel.
  linattn::HeadDecays decays{{0.9, 0.95, 0.99, 1.0}};
  const LinearAttentionLayer<T, linattn::EluPlusOne> layer(linattn::EluPlusOne{}, kH, kDk, kDv,
                                                           decays);
  const HeadData<T> q(100, kDk, 61), k(100, kDk, 62), v(100, kDv, 63);
  std::vector<T> out(static_cast<std::size_t>(kB * kH * 100 * kDv));
  const auto out_view = HeadsView<T>::bhnd(out.data(), {kB, kH, 100, kDv});
  layer.forward_into(q.cview(), k.cview(), v.cview(), out_view);
  for (Eigen::Index i = 0; i < kB * kH; ++i) {
    linattn::Options head;
    head.decay = decays.values[static_cast<std::size_t>(i % kH)];
    const auto idx = static_cast<std::size_t>(i);
    const Matrix<T> expected = linattn::causal_linear_attention(
        q.heads[idx], k.heads[idx], v.heads[idx], linattn::EluPlusOne{}, head);
    CHECK(Matrix<T>(out_view.head(i / kH, i % kH)) == expected);
  }
}

TEMPLATE_TEST_CASE("layer: HeadDecays and gates errors", "[layer][gated][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  using Layer = LinearAttentionLayer<T, linattn::EluPlusOne>;
  using Batch = linattn::RecurrentStateBatch<T>;
  const linattn::EluPlusOne elu;
  CHECK_THROWS_WITH(Layer(elu, kH, kDk, kDv, linattn::HeadDecays{{0.9, 0.9}}), Contains("H = 4"));
  linattn::Options decayed;
  decayed.decay = 0.5;
  CHECK_THROWS_WITH(Layer(elu, kH, kDk, kDv, linattn::HeadDecays{{0.9, 0.9, 0.9, 0.9}}, decayed),
                    Contains("Options::decay must be 1"));
  CHECK_THROWS_WITH(Batch(6, kDk, kDv, linattn::HeadDecays{{0.9, 0.9, 0.9, 0.9}}),
                    Contains("multiple"));
  // Gates on a layer with HeadDecays throw before any state moves.
  const Layer layer(elu, kH, kDk, kDv, linattn::HeadDecays{{0.9, 0.8, 0.7, 0.6}});
  auto states = layer.make_states(kB);
  CHECK(states[1].options().decay == 0.8);
  const Matrix<T> q = gaussian<T>(kB * kH, kDk, 1), v = gaussian<T>(kB * kH, kDv, 2);
  const Matrix<T> g = Matrix<T>::Constant(kB * kH, 1, T(-0.1));
  Matrix<T> out(kB * kH, kDv);
  CHECK_THROWS_WITH(layer.step_into(states, q, q, v, linattn::log_gates(g), out),
                    Contains("HeadDecays"));
  // A batch of HeadDecays states refuses gates itself, naming a state.
  CHECK_THROWS_WITH(states.step_into(q, q, v, linattn::log_gates(g), elu, out),
                    Contains("Options::decay"));
  CHECK(states[0].tokens() == 0);
}

namespace {

/// The engine's gated recurrence token by token in double, from log gates g (N x 1 or N x C):
/// S <- diag(exp g_t) S + phi_k_t v_t^T, z alike, out_t = phi_q_t S / (phi_q_t . z + eps).
Matrix<double> naive_gated_recurrence(const Matrix<double>& phi_q, const Matrix<double>& phi_k,
                                      const Matrix<double>& v, const Matrix<double>& g,
                                      double eps) {
  Matrix<double> s = Matrix<double>::Zero(phi_k.cols(), v.cols());
  Eigen::VectorXd z = Eigen::VectorXd::Zero(phi_k.cols());
  Matrix<double> out(phi_q.rows(), v.cols());
  for (Eigen::Index t = 0; t < phi_q.rows(); ++t) {
    for (Eigen::Index c = 0; c < s.rows(); ++c) {
      const double a = std::exp(g(t, g.cols() == 1 ? 0 : c));
      s.row(c) *= a;
      z(c) *= a;
    }
    s += phi_k.row(t).transpose() * v.row(t);
    z += phi_k.row(t).transpose();
    out.row(t) = phi_q.row(t) * s / (phi_q.row(t).dot(z) + eps);
  }
  return out;
}

/// Rows a, then b, then c, in double.
template <class A, class B, class C>
Matrix<double> stacked(const A& a, const B& b, const C& c) {
  Matrix<double> m(a.rows() + b.rows() + c.rows(), a.cols());
  m.topRows(a.rows()) = a.template cast<double>();
  m.middleRows(a.rows(), b.rows()) = b.template cast<double>();  // b may have no rows
  m.bottomRows(c.rows()) = c.template cast<double>();
  return m;
}

}  // namespace

TEMPLATE_TEST_CASE("layer: varlen prefill continues each packed prompt's states, then steps",
                   "[layer][varlen]", float, double) {
  using T = TestType;
  using Layer = LinearAttentionLayer<T, linattn::EluPlusOne>;
  // Prompts of 5, 0, 17 and 1 tokens packed along N, H = 3 heads: state s * H + h. Every state
  // takes a step before the prompts and one after.
  const std::vector<std::int64_t> offsets{0, 5, 5, 22, 23};
  const Eigen::Index H = 3, S = 4, total = 23, count = S * H;
  const linattn::EluPlusOne elu;
  const linattn::HeadDecays decays{{0.9, 0.95, 1.0}};
  const char* names[] = {"Options::decay", "HeadDecays", "scalar log gates", "per-feature a_t",
                         "RWKV-6's bonus"};
  int differing = 0, compared = 0;
  double worst = 0.0;
  for (const int variant : {0, 1, 2, 3, 4}) {
    INFO(names[variant]);
    linattn::Options options;
    options.chunk = 4;  // the 17-token prompt spans several chunks
    options.threads = 2;
    if (variant == 0) options.decay = 0.97;
    if (variant == 4) {
      options.normalize = false;
      options.scale = 0.5;
    }
    const Layer layer =
        variant == 1 ? Layer(elu, H, kDk, kDv, decays, options) : Layer(elu, H, kDk, kDv, options);
    const bool gated = variant >= 2, log_space = variant != 3;
    const Eigen::Index gate_dim = variant == 2 ? 1 : kDk;
    const std::uint64_t seed = 1100 + 10 * static_cast<std::uint64_t>(variant);
    const Matrix<T> u = gaussian<T>(H, kDk, seed);
    // Packed rows, head h in columns h * D.. ([1, T, H, D] memory); log gates in [-0.3, 0],
    // a reset at token 10 (sequence 2) of head 1 in log space.
    const Matrix<T> q = gaussian<T>(total, H * kDk, seed + 1),
                    k = gaussian<T>(total, H * kDk, seed + 2);
    const Matrix<T> v = gaussian<T>(total, H * kDv, seed + 3);
    Matrix<T> g =
        (-T(0.1) * gaussian<T>(total, H * gate_dim, seed + 4).cwiseAbs()).cwiseMax(T(-0.3));
    if (log_space) {
      g.block(10, gate_dim, 1, gate_dim).setConstant(-std::numeric_limits<T>::infinity());
    }
    const Matrix<T> a = g.array().exp().matrix();
    auto view = [&](const Matrix<T>& m) {
      return HeadsView<const T>::bnhd(m.data(), linattn::BnhdShape{1, m.rows(), H, m.cols() / H});
    };
    // body(gates): the variant's gate argument over log gates or a_t.
    auto with_gates = [&](const auto& log_values, const auto& a_values, const auto& body) {
      if (variant == 2) body(linattn::log_gates(log_values));
      if (variant == 3) body(a_values);
      if (variant == 4) body(linattn::with_bonus(linattn::log_gates(log_values), u));
    };
    // One token of every state, (S * H) x D rows.
    struct Token {
      Matrix<T> q, k, v, g, a;
    };
    auto token = [&](std::uint64_t s) {
      Token t{gaussian<T>(count, kDk, s),
              gaussian<T>(count, kDk, s + 1),
              gaussian<T>(count, kDv, s + 2),
              (-T(0.1) * gaussian<T>(count, gate_dim, s + 3).cwiseAbs()).cwiseMax(T(-0.3)),
              {}};
      t.a = t.g.array().exp().matrix();
      return t;
    };
    auto step = [&](typename Layer::States& states, const Token& t, Matrix<T>& out) {
      if (!gated) {
        layer.step_into(states, t.q, t.k, t.v, out);
      } else {
        with_gates(t.g, t.a,
                   [&](const auto& gates) { layer.step_into(states, t.q, t.k, t.v, gates, out); });
      }
    };
    auto states = layer.make_states(S);
    const Token first = token(seed + 5), last = token(seed + 10);
    Matrix<T> first_out(count, kDv), last_out(count, kDv);
    step(states, first, first_out);
    std::vector<linattn::RecurrentState<T>> before;
    for (Eigen::Index i = 0; i < count; ++i) before.push_back(states[i]);

    Matrix<T> out = Matrix<T>::Constant(total, H * kDv, T(-7));
    const auto ov = HeadsView<T>::bnhd(out.data(), linattn::BnhdShape{1, total, H, kDv});
    if (!gated) {
      layer.prefill_varlen_into(states, view(q), view(k), view(v), offsets, ov);
    } else {
      with_gates(view(g), view(a), [&](const auto& gates) {
        layer.prefill_varlen_into(states, view(q), view(k), view(v), gates, offsets, ov);
      });
    }
    // Each prompt alone through prefill_into on its own states: bit for bit.
    for (Eigen::Index s = 0; s < S; ++s) {
      const Eigen::Index begin = offsets[std::size_t(s)], len = offsets[std::size_t(s) + 1] - begin;
      INFO("sequence " << s);
      if (len == 0) {
        for (Eigen::Index h = 0; h < H; ++h) {
          const auto& was = before[static_cast<std::size_t>(s * H + h)];
          CHECK(states[s * H + h].s() == was.s());
          CHECK(states[s * H + h].z() == was.z());
          CHECK(states[s * H + h].tokens() == 1);
        }
        continue;
      }
      auto one = layer.make_states(1);
      for (Eigen::Index h = 0; h < H; ++h) one[h] = before[static_cast<std::size_t>(s * H + h)];
      Matrix<T> alone(len, H * kDv);
      const auto av = HeadsView<T>::bnhd(alone.data(), linattn::BnhdShape{1, len, H, kDv});
      if (!gated) {
        layer.prefill_into(one, token_range(view(q), begin, len), token_range(view(k), begin, len),
                           token_range(view(v), begin, len), av);
      } else {
        with_gates(token_range(view(g), begin, len), token_range(view(a), begin, len),
                   [&](const auto& gates) {
                     layer.prefill_into(one, token_range(view(q), begin, len),
                                        token_range(view(k), begin, len),
                                        token_range(view(v), begin, len), gates, av);
                   });
      }
      const bool same = alone == Matrix<T>(out.middleRows(begin, len));
      CHECK(same);
      differing += same ? 0 : 1;
      ++compared;
      for (Eigen::Index h = 0; h < H; ++h) {
        CHECK(states[s * H + h].s() == one[h].s());
        CHECK(states[s * H + h].z() == one[h].z());
        CHECK(states[s * H + h].tokens() == 1 + len);
      }
    }
    // Then a step of every sequence, and the naive recurrence over step, prompt and step.
    step(states, last, last_out);
    for (Eigen::Index i = 0; i < count; ++i) {
      const Eigen::Index s = i / H, h = i % H;
      const Eigen::Index begin = offsets[std::size_t(s)], len = offsets[std::size_t(s) + 1] - begin;
      INFO("sequence " << s << ", head " << h);
      CHECK(states[i].tokens() == len + 2);
      const Matrix<double> phi_q =
          elu.queries(stacked(first.q.row(i), q.block(begin, h * kDk, len, kDk), last.q.row(i)));
      const Matrix<double> phi_k =
          elu.keys(stacked(first.k.row(i), k.block(begin, h * kDk, len, kDk), last.k.row(i)));
      const Matrix<double> vn =
          stacked(first.v.row(i), v.block(begin, h * kDv, len, kDv), last.v.row(i));
      Matrix<double> gn =
          stacked(first.g.row(i), g.block(begin, h * gate_dim, len, gate_dim), last.g.row(i));
      if (!log_space) {  // the a_t the kernel saw, rounded to T
        gn = stacked(first.a.row(i), a.block(begin, h * gate_dim, len, gate_dim), last.a.row(i))
                 .array()
                 .log()
                 .matrix();
      }
      Matrix<double> naive;
      if (variant == 0 || variant == 1) {
        const double decay = variant == 0 ? options.decay : decays.values[std::size_t(h)];
        naive = linattn_test::recurrent_linear_attention(phi_q, phi_k, vn, true, decay, options.eps,
                                                         true);
      } else if (variant == 4) {
        Matrix<double> state = Matrix<double>::Zero(kDk, kDv);
        naive = linattn_test::naive_rwkv6(phi_q, phi_k, vn, gn,
                                          u.row(h).transpose().template cast<double>(),
                                          options.scale, state);
      } else {
        naive = naive_gated_recurrence(phi_q, phi_k, vn, gn, options.eps);
      }
      Matrix<T> got(len + 1, kDv);
      got.topRows(len) = out.block(begin, h * kDv, len, kDv);
      got.row(len) = last_out.row(i);
      const double error = relative_error(got, naive.bottomRows(len + 1));
      CHECK(error <= tolerance<T>());
      worst = std::max(worst, error);
    }
  }
  CHECK(differing == 0);
  CHECK(compared == 5 * 3);  // variants x non-empty prompts
  WARN("layer varlen prefill: worst relative error against the naive recurrence " << worst);
}

TEMPLATE_TEST_CASE("layer: varlen prefill errors move no state", "[layer][varlen][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  using Layer = LinearAttentionLayer<T, linattn::EluPlusOne>;
  const std::vector<std::int64_t> offsets{0, 5, 5, 22, 23};
  const Eigen::Index H = 3, S = 4, total = 23;
  const linattn::EluPlusOne elu;
  const Layer layer(elu, H, kDk, kDv);
  const Layer decaying(elu, H, kDk, kDv, linattn::HeadDecays{{0.9, 0.8, 0.7}});
  const Matrix<T> q = gaussian<T>(total, H * kDk, 1200), v = gaussian<T>(total, H * kDv, 1201);
  const Matrix<T> g = Matrix<T>::Constant(total, H, T(-0.1));
  Matrix<T> out = Matrix<T>::Constant(total, H * kDv, T(3));
  const Matrix<T> out_before = out;
  auto view = [&](const Matrix<T>& m, Eigen::Index heads) {
    return HeadsView<const T>::bnhd(m.data(),
                                    linattn::BnhdShape{1, total, heads, m.cols() / heads});
  };
  const auto qv = view(q, H), vv = view(v, H), gv = view(g, H);
  const auto ov = HeadsView<T>::bnhd(out.data(), linattn::BnhdShape{1, total, H, kDv});
  auto states = layer.make_states(S);
  auto decay_states = decaying.make_states(S);
  const std::string where = "LinearAttentionLayer::prefill_varlen";
  // Heads that are not the layer's: q with 2 (not dividing H = 3), out with other than H.
  const Matrix<T> q2 = q.leftCols(2 * kDk);
  CHECK_THROWS_WITH(layer.prefill_varlen_into(states, view(q2, 2), view(q2, 2), vv, offsets, ov),
                    Contains(where) && Contains("H = 3"));
  const Matrix<T> v4 = gaussian<T>(total, 4 * kDv, 1202);
  Matrix<T> out4(total, 4 * kDv);
  CHECK_THROWS_WITH(layer.prefill_varlen_into(
                        states, qv, qv, view(v4, 4), offsets,
                        HeadsView<T>::bnhd(out4.data(), linattn::BnhdShape{1, total, 4, kDv})),
                    Contains(where) && Contains("H = 3"));
  const Matrix<T> narrow = q.leftCols(H * (kDk - 1));
  CHECK_THROWS_WITH(
      layer.prefill_varlen_into(states, view(narrow, H), view(narrow, H), vv, offsets, ov),
      Contains(where) && Contains("Dk = 8"));
  // Offsets and states that do not match.
  CHECK_THROWS_WITH(
      layer.prefill_varlen_into(states, qv, qv, vv, {1, 5, 5, 22, 23}, ov),
      Contains("RecurrentStateBatch::prefill_varlen") && Contains("offsets[0] must be 0"));
  CHECK_THROWS_WITH(layer.prefill_varlen_into(states, qv, qv, vv, {0, 5, 6, 5, 23}, ov),
                    Contains("offsets must not decrease"));
  CHECK_THROWS_WITH(layer.prefill_varlen_into(states, qv, qv, vv, {0, 5, 5, 22}, ov),
                    Contains("offsets.back() = 22"));
  auto three = layer.make_states(3);
  CHECK_THROWS_WITH(layer.prefill_varlen_into(three, qv, qv, vv, offsets, ov),
                    Contains("S x H = 12 heads, but the batch holds 9 states"));
  // Gates on a layer with HeadDecays, and gates of the wrong width.
  CHECK_THROWS_WITH(
      decaying.prefill_varlen_into(decay_states, qv, qv, vv, linattn::log_gates(gv), offsets, ov),
      Contains(where) && Contains("HeadDecays"));
  const Matrix<T> g2 = Matrix<T>::Constant(total, H * 2, T(-0.1));
  CHECK_THROWS_WITH(
      layer.prefill_varlen_into(states, qv, qv, vv, linattn::log_gates(view(g2, H)), offsets, ov),
      Contains("gates is [1, 3, 23, 2]"));
  CHECK(out == out_before);
  for (Eigen::Index i = 0; i < S * H; ++i) {
    CHECK(states[i].tokens() == 0);
    CHECK(decay_states[i].tokens() == 0);
  }
  CHECK(three[0].tokens() == 0);
  // And a good call after them.
  decaying.prefill_varlen_into(decay_states, qv, qv, vv, offsets, ov);
  CHECK(decay_states[H * 2].tokens() == 17);
  CHECK(decay_states[H].tokens() == 0);
}

TEMPLATE_TEST_CASE("layer: grouped heads, forward equals the matrix calls and prefill + steps",
                   "[layer][grouped]", float) {
  using T = TestType;
  const Eigen::Index n = 300, prompt = 129;
  const linattn::EluPlusOne elu;
  // Qwen3-Next's grouping (fewer q/k heads than v and out), and grouped-query attention's
  // (fewer k/v heads than q and out); FLA's and HF's interleaved heads, and ggml's tiled ones.
  for (const auto& [hq, hk, hv, grouping] :
       {std::tuple<Eigen::Index, Eigen::Index, Eigen::Index, linattn::HeadGrouping>{
            2, 2, kH, linattn::HeadGrouping::interleaved},
        {kH, 2, 2, linattn::HeadGrouping::interleaved},
        {1, 1, 1, linattn::HeadGrouping::interleaved},
        {2, 2, kH, linattn::HeadGrouping::tiled},
        {kH, 2, 2, linattn::HeadGrouping::tiled}}) {
    const bool tiled = grouping == linattn::HeadGrouping::tiled;
    INFO("H_q = " << hq << ", H_k = " << hk << ", H_v = " << hv
                  << (tiled ? ", tiled" : ", interleaved"));
    linattn::Options options;
    options.threads = 2;
    options.head_grouping = grouping;
    const LinearAttentionLayer<T, linattn::EluPlusOne> layer(
        elu, linattn::LayerHeads(kH, hq, hk, hv), kDk, kDv, options);
    auto heads = [&](Eigen::Index h, Eigen::Index d, std::uint64_t seed) {
      std::vector<Matrix<T>> m;
      for (Eigen::Index i = 0; i < kB * h; ++i) {
        m.push_back(gaussian<T>(n, d, seed + 13 * static_cast<std::uint64_t>(i)));
      }
      return m;
    };
    const std::vector<Matrix<T>> q = heads(hq, kDk, 91), k = heads(hk, kDk, 92),
                                 v = heads(hv, kDv, 93);
    // [B, N, H, D] buffers, as a projection writes them.
    auto pack = [&](const std::vector<Matrix<T>>& m, Eigen::Index h, Eigen::Index d) {
      std::vector<T> data(static_cast<std::size_t>(kB * n * h * d));
      const auto view = HeadsView<T>::bnhd(data.data(), linattn::BnhdShape{kB, n, h, d});
      for (Eigen::Index i = 0; i < kB * h; ++i) view.head(i / h, i % h) = m[std::size_t(i)];
      return data;
    };
    const std::vector<T> qd = pack(q, hq, kDk), kd = pack(k, hk, kDk), vd = pack(v, hv, kDv);
    auto view = [&](const std::vector<T>& data, Eigen::Index h, Eigen::Index d, Eigen::Index from,
                    Eigen::Index count) {
      return token_range(HeadsView<const T>::bnhd(data.data(), linattn::BnhdShape{kB, n, h, d}),
                         from, count);
    };
    std::vector<T> forward_data(static_cast<std::size_t>(kB * kH * n * kDv));
    const auto forward = HeadsView<T>::bhnd(forward_data.data(), {kB, kH, n, kDv});
    layer.forward_into(view(qd, hq, kDk, 0, n), view(kd, hk, kDk, 0, n), view(vd, hv, kDv, 0, n),
                       forward);
    for (Eigen::Index i = 0; i < kB * kH; ++i) {
      const Eigen::Index b = i / kH, h = i % kH;
      // The grouping written out: h / (H / H_in) (repeat_interleave), or h % H_in (ggml_repeat).
      const auto pick = [&](const std::vector<Matrix<T>>& m, Eigen::Index hin) {
        return m[static_cast<std::size_t>(b * hin + (tiled ? h % hin : h / (kH / hin)))];
      };
      const Matrix<T> expected =
          linattn::causal_linear_attention(pick(q, hq), pick(k, hk), pick(v, hv), elu, options);
      CHECK(relative_error(forward.head(b, h), expected) <= tolerance<T>());
    }
    // The prompt through prefill, the rest token by token with (B * H_in) x D rows.
    auto states = layer.make_states(kB);
    std::vector<T> prefill_data(static_cast<std::size_t>(kB * kH * prompt * kDv));
    const auto prefilled = HeadsView<T>::bhnd(prefill_data.data(), {kB, kH, prompt, kDv});
    layer.prefill_into(states, view(qd, hq, kDk, 0, prompt), view(kd, hk, kDk, 0, prompt),
                       view(vd, hv, kDv, 0, prompt), prefilled);
    // max |recurrent - forward| over every head and token, relative to max |forward|.
    double diff = 0.0, scale = 0.0;
    std::tie(diff, scale) = prompt_difference(prefilled, forward, prompt);
    Matrix<T> qt(kB * hq, kDk), kt(kB * hk, kDk), vt(kB * hv, kDv), ot(kB * kH, kDv);
    for (Eigen::Index t = prompt; t < n; ++t) {
      for (Eigen::Index i = 0; i < kB * hq; ++i) qt.row(i) = q[std::size_t(i)].row(t);
      for (Eigen::Index i = 0; i < kB * hk; ++i) kt.row(i) = k[std::size_t(i)].row(t);
      for (Eigen::Index i = 0; i < kB * hv; ++i) vt.row(i) = v[std::size_t(i)].row(t);
      layer.step_into(states, qt, kt, vt, ot);
      for (Eigen::Index i = 0; i < kB * kH; ++i) {
        const Eigen::RowVectorXd expected =
            forward.head(i / kH, i % kH).row(t).template cast<double>();
        diff = std::max(diff, (ot.row(i).template cast<double>() - expected).cwiseAbs().maxCoeff());
      }
    }
    CHECK(diff / scale <= tolerance<T>());
    CHECK(states[0].tokens() == n);
  }
  // Head counts that do not divide H, and out with other than H heads, throw.
  linattn::Options options;
  options.threads = 2;
  const LinearAttentionLayer<T, linattn::EluPlusOne> layer(elu, kH, kDk, kDv, options);
  auto states = layer.make_states(kB);
  const Matrix<T> q3 = gaussian<T>(kB * 3, kDk, 1), v = gaussian<T>(kB * kH, kDv, 2);
  Matrix<T> out(kB * kH, kDv);
  CHECK_THROWS_WITH(layer.step_into(states, q3, q3, v, out), Catch::Contains("B * 4 = 8 rows"));
  std::vector<T> data(static_cast<std::size_t>(kB * 3 * 10 * kDk));
  const auto three = HeadsView<const T>::bhnd(data.data(), {kB, 3, 10, kDk});
  std::vector<T> out_data(static_cast<std::size_t>(kB * kH * 10 * kDv));
  CHECK_THROWS_WITH(layer.forward_into(three, three, three,
                                       HeadsView<T>::bhnd(out_data.data(), {kB, kH, 10, kDv})),
                    Catch::Contains("grouped heads"));
  CHECK(states[0].tokens() == 0);
  // Head counts are exactly the layer's: with 2 q/k heads per sequence and B = 2, the q/k rows
  // of one sequence (2, which divides B * H) were read as one head per sequence (2.08 off).
  const LinearAttentionLayer<T, linattn::EluPlusOne> grouped(
      elu, linattn::LayerHeads::grouped_query_key(kH, 2), kDk, kDv, options);
  auto grouped_states = grouped.make_states(kB);
  const Matrix<T> one_sequence = gaussian<T>(2, kDk, 4);
  CHECK_THROWS_WITH(grouped.step_into(grouped_states, one_sequence, one_sequence, v, out),
                    Catch::Contains("B * 2 = 4 rows"));
  CHECK_THROWS_WITH(grouped_states.step_into(one_sequence, one_sequence, v, elu, out),
                    Catch::Contains("needs 4 x") && Catch::Contains("LayerHeads"));
  // A view whose head count divides H but is not the layer's: the layer, and its states.
  std::vector<T> one_head(static_cast<std::size_t>(kB * 10 * kDk));
  const auto single = HeadsView<const T>::bhnd(one_head.data(), {kB, 1, 10, kDk});
  std::vector<T> v_data(static_cast<std::size_t>(kB * kH * 10 * kDv));
  const auto full_v = HeadsView<const T>::bhnd(v_data.data(), {kB, kH, 10, kDv});
  const auto grouped_out = HeadsView<T>::bhnd(out_data.data(), {kB, kH, 10, kDv});
  CHECK_THROWS_WITH(grouped.forward_into(single, single, full_v, grouped_out),
                    Catch::Contains("q 2, k 2, v 4 heads"));
  CHECK_THROWS_WITH(grouped_states.prefill_into(single, single, full_v, elu, grouped_out),
                    Catch::Contains("the layer that made these states"));
  CHECK(grouped_states[0].tokens() == 0);
  // States with another grouping than the layer's, or than each other, are refused: grouped
  // rows would be read by another rule.
  linattn::Options tiled = options;
  tiled.head_grouping = linattn::HeadGrouping::tiled;
  const LinearAttentionLayer<T, linattn::EluPlusOne> tiled_layer(
      elu, linattn::LayerHeads::grouped_query_key(kH, 2), kDk, kDv, tiled);
  const Matrix<T> qk4 = gaussian<T>(kB * 2, kDk, 5);
  CHECK_THROWS_WITH(tiled_layer.step_into(grouped_states, qk4, qk4, v, out),
                    Catch::Contains("are not this layer's"));
  grouped_states[1] = tiled_layer.make_states(1)[1];
  CHECK_THROWS_WITH(grouped_states.step_into(qk4, qk4, v, elu, out),
                    Catch::Contains("state 1 has another head_grouping"));
  CHECK(grouped_states[0].tokens() == 0);
  // RWKV-6's bonus through a layer's states: u has a row per head (or per state), not any
  // divisor of the B * H states.
  linattn::Options plain = options;
  plain.normalize = false;
  const LinearAttentionLayer<T, linattn::Identity> rwkv(linattn::Identity{}, kH, kDk, kDv, plain);
  auto rwkv_states = rwkv.make_states(kB);
  const Matrix<T> qb = gaussian<T>(kB * kH, kDk, 6).cwiseAbs();
  const Matrix<T> gb = (T(-0.1) * gaussian<T>(kB * kH, kDk, 7).array().abs()).matrix();
  const Matrix<T> u2 = gaussian<T>(2, kDk, 8);
  CHECK_THROWS_WITH(
      rwkv_states.step_into(qb, qb, v, linattn::with_bonus(linattn::log_gates(gb), u2),
                            linattn::Identity{}, out),
      Catch::Contains("R = 4 (one row per head)"));
  CHECK(rwkv_states[0].tokens() == 0);
  CHECK_THROWS_WITH(static_cast<void>(LinearAttentionLayer<T, linattn::EluPlusOne>(
                        elu, linattn::LayerHeads(kH, 3, kH, kH), kDk, kDv)),
                    Catch::Contains("a divisor of H"));
  // Tiled grouping needs the heads per sequence: a batch made by hand does not know them.
  options.head_grouping = linattn::HeadGrouping::tiled;
  linattn::RecurrentStateBatch<T> by_hand(kB * kH, kDk, kDv, options);
  const Matrix<T> q2 = gaussian<T>(kB * 2, kDk, 3);
  CHECK_THROWS_WITH(by_hand.step_into(q2, q2, v, elu, out), Catch::Contains("make_states(B)"));
  CHECK(by_hand[0].tokens() == 0);
}

TEMPLATE_TEST_CASE("delta layer: forward equals prefill then steps and the naive recurrence",
                   "[layer][delta_rule]", float, double) {
  using T = TestType;
  const Eigen::Index n = 70, prompt = 50, hqk = 2;
  const Eigen::Index gate_cols = GENERATE(Eigen::Index(0), Eigen::Index(1), kDk);
  // FLA's and HF's interleaved q/k heads (Qwen3.5), and ggml's tiled ones.
  const linattn::HeadGrouping grouping =
      GENERATE(linattn::HeadGrouping::interleaved, linattn::HeadGrouping::tiled);
  const bool tiled = grouping == linattn::HeadGrouping::tiled;
  INFO((gate_cols == 0   ? "DeltaNet"
        : gate_cols == 1 ? "Gated DeltaNet"
                         : "KDA")
       << (tiled ? ", tiled" : ", interleaved"));
  linattn::DeltaOptions options;
  options.head_grouping = grouping;
  options.l2_normalize = true;
  options.chunk = 16;
  options.threads = 2;
  const linattn::DeltaRuleLayer<T> layer(linattn::LayerHeads::grouped_query_key(kH, hqk), kDk, kDv,
                                         options);
  CHECK(layer.heads() == kH);
  CHECK(layer.layer_heads().key == hqk);
  CHECK(layer.key_dim() == kDk);
  CHECK(layer.value_dim() == kDv);
  CHECK(layer.options().chunk == 16);
  // [B, N, H, D] buffers: q and k with hqk heads (Qwen3-Next's grouping), the rest with kH.
  const Eigen::Index gate_dim = std::max<Eigen::Index>(gate_cols, 1);
  auto buffer = [&](Eigen::Index heads, Eigen::Index dim, std::uint64_t seed) {
    std::vector<T> data(static_cast<std::size_t>(kB * n * heads * dim));
    const auto view = HeadsView<T>::bnhd(data.data(), linattn::BnhdShape{kB, n, heads, dim});
    for (Eigen::Index i = 0; i < kB * heads; ++i) {
      view.head(i / heads, i % heads) =
          gaussian<T>(n, dim, seed + 7 * static_cast<std::uint64_t>(i));
    }
    return data;
  };
  const std::vector<T> qd = buffer(hqk, kDk, 300), kd = buffer(hqk, kDk, 400),
                       vd = buffer(kH, kDv, 500);
  std::vector<T> bd = buffer(kH, 1, 600), gd = buffer(kH, gate_dim, 700);
  for (T& b : bd) b = T(0.05) + T(0.9) / (T(1) + std::exp(-b));  // sigmoid, in (0.05, 0.95)
  for (T& g : gd) g = -T(0.1) * std::abs(g);
  auto view = [&](const std::vector<T>& data, Eigen::Index heads, Eigen::Index dim,
                  Eigen::Index from, Eigen::Index count) {
    return token_range(HeadsView<const T>::bnhd(data.data(), linattn::BnhdShape{kB, n, heads, dim}),
                       from, count);
  };
  std::vector<T> forward_data(static_cast<std::size_t>(kB * kH * n * kDv));
  const auto forward = HeadsView<T>::bhnd(forward_data.data(), {kB, kH, n, kDv});
  if (gate_cols == 0) {
    layer.forward_into(view(qd, hqk, kDk, 0, n), view(kd, hqk, kDk, 0, n), view(vd, kH, kDv, 0, n),
                       view(bd, kH, 1, 0, n), forward);
  } else {
    layer.forward_into(view(qd, hqk, kDk, 0, n), view(kd, hqk, kDk, 0, n), view(vd, kH, kDv, 0, n),
                       linattn::log_gates(view(gd, kH, gate_dim, 0, n)), view(bd, kH, 1, 0, n),
                       forward);
  }
  // Every head against the naive recurrence: head h reads q/k head h / 2 (FLA) or h % 2 (ggml).
  for (Eigen::Index i = 0; i < kB * kH; ++i) {
    const Eigen::Index b = i / kH, h = i % kH, hq = tiled ? h % hqk : h / (kH / hqk);
    const Matrix<double> q = view(qd, hqk, kDk, 0, n).head(b, hq).template cast<double>();
    const Matrix<double> k = view(kd, hqk, kDk, 0, n).head(b, hq).template cast<double>();
    const Matrix<double> v = view(vd, kH, kDv, 0, n).head(b, h).template cast<double>();
    const linattn::Vector<double> beta = view(bd, kH, 1, 0, n).head(b, h).template cast<double>();
    const Matrix<double> g =
        gate_cols == 0
            ? Matrix<double>(n, 0)
            : Matrix<double>(view(gd, kH, gate_dim, 0, n).head(b, h).template cast<double>());
    const Matrix<double> expected =
        linattn_test::naive_delta_rule(q, k, v, beta, g, 1.0 / std::sqrt(double(kDk)), true);
    CHECK(relative_error(forward.head(b, h), expected) <= delta_tolerance<T>());
  }
  // The prompt through prefill, the rest token by token: (B * hqk) x Dk rows of q and k.
  auto states = layer.make_states(kB);
  CHECK(states.size() == kB * kH);
  std::vector<T> prefill_data(static_cast<std::size_t>(kB * kH * prompt * kDv));
  const auto prefilled = HeadsView<T>::bhnd(prefill_data.data(), {kB, kH, prompt, kDv});
  if (gate_cols == 0) {
    layer.prefill_into(states, view(qd, hqk, kDk, 0, prompt), view(kd, hqk, kDk, 0, prompt),
                       view(vd, kH, kDv, 0, prompt), view(bd, kH, 1, 0, prompt), prefilled);
  } else {
    layer.prefill_into(states, view(qd, hqk, kDk, 0, prompt), view(kd, hqk, kDk, 0, prompt),
                       view(vd, kH, kDv, 0, prompt),
                       linattn::log_gates(view(gd, kH, gate_dim, 0, prompt)),
                       view(bd, kH, 1, 0, prompt), prefilled);
  }
  double diff = 0.0, scale = 0.0;
  std::tie(diff, scale) = prompt_difference(prefilled, forward, prompt);
  Matrix<T> qt(kB * hqk, kDk), kt(kB * hqk, kDk), vt(kB * kH, kDv), gt(kB * kH, gate_cols),
      ot(kB * kH, kDv);
  linattn::Vector<T> bt(kB * kH);
  for (Eigen::Index t = prompt; t < n; ++t) {
    for (Eigen::Index i = 0; i < kB * hqk; ++i) {
      qt.row(i) = view(qd, hqk, kDk, 0, n).head(i / hqk, i % hqk).row(t);
      kt.row(i) = view(kd, hqk, kDk, 0, n).head(i / hqk, i % hqk).row(t);
    }
    for (Eigen::Index i = 0; i < kB * kH; ++i) {
      vt.row(i) = view(vd, kH, kDv, 0, n).head(i / kH, i % kH).row(t);
      bt(i) = view(bd, kH, 1, 0, n).head(i / kH, i % kH)(t, 0);
      if (gate_cols > 0) gt.row(i) = view(gd, kH, gate_dim, 0, n).head(i / kH, i % kH).row(t);
    }
    if (gate_cols == 0) {
      layer.step_into(states, qt, kt, vt, bt, ot);
    } else {
      layer.step_into(states, qt, kt, vt, linattn::log_gates(gt), bt, ot);
    }
    for (Eigen::Index i = 0; i < kB * kH; ++i) {
      const Eigen::RowVectorXd expected =
          forward.head(i / kH, i % kH).row(t).template cast<double>();
      diff = std::max(diff, (ot.row(i).template cast<double>() - expected).cwiseAbs().maxCoeff());
    }
  }
  CHECK(diff / scale <= delta_tolerance<T>());
  CHECK(states[0].tokens() == n);
}

TEMPLATE_TEST_CASE("delta layer: errors name the argument and move no state",
                   "[layer][delta_rule][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  CHECK_THROWS_WITH(linattn::DeltaRuleLayer<T>(0, kDk, kDv), Contains("heads"));
  CHECK_THROWS_WITH(linattn::DeltaRuleLayer<T>(kH, kDk, 0), Contains("value_dim"));
  linattn::DeltaOptions bad;
  bad.chunk = 0;
  CHECK_THROWS_WITH(linattn::DeltaRuleLayer<T>(kH, kDk, kDv, bad), Contains("DeltaOptions::chunk"));
  // The shared settings (KernelOptions) are checked once, named by the family's options.
  static_assert(std::is_base_of_v<linattn::KernelOptions, linattn::DeltaOptions> &&
                std::is_base_of_v<linattn::KernelOptions, linattn::Options>);
  linattn::DeltaOptions odd_grouping;
  odd_grouping.head_grouping = static_cast<linattn::HeadGrouping>(7);
  CHECK_THROWS_WITH(linattn::DeltaRuleLayer<T>(kH, kDk, kDv, odd_grouping),
                    Contains("DeltaOptions::head_grouping"));
  linattn::Options odd_engine;
  odd_engine.threads = -1;
  CHECK_THROWS_WITH(static_cast<void>(linattn::LinearAttentionLayer<T, linattn::EluPlusOne>(
                        linattn::EluPlusOne{}, kH, kDk, kDv, odd_engine)),
                    Contains("Options::threads"));
  const linattn::DeltaRuleLayer<T> layer(kH, kDk, kDv);
  CHECK_THROWS_WITH(layer.make_states(0), Contains("batch"));
  // States of another layer: other heads, widths or result-changing options.
  const Matrix<T> q = gaussian<T>(kB * kH, kDk, 1), v = gaussian<T>(kB * kH, kDv, 2);
  const linattn::Vector<T> beta = linattn::Vector<T>::Constant(kB * kH, T(0.5));
  Matrix<T> out(kB * kH, kDv);
  linattn::DeltaRuleStateBatch<T> odd(kB * kH + 1, kDk, kDv);
  CHECK_THROWS_WITH(layer.step_into(odd, q, q, v, beta, out),
                    Contains("are not this layer's: make them with make_states"));
  linattn::DeltaOptions other;
  other.l2_normalize = true;
  linattn::DeltaRuleStateBatch<T> normalised(kB * kH, kDk, kDv, other);
  CHECK_THROWS_WITH(layer.step_into(normalised, q, q, v, beta, out),
                    Contains("are not this layer's"));
  CHECK(normalised[0].tokens() == 0);
  // Rows that divide the batch's B * H states but are not B * H_in would hand one sequence's
  // rows to another's states: H = 4, B = 3, 12 states, 4 rows of q.
  auto three_sequences = layer.make_states(3);
  const Matrix<T> q4 = gaussian<T>(4, kDk, 3), v12 = gaussian<T>(12, kDv, 4);
  const linattn::Vector<T> beta12 = linattn::Vector<T>::Constant(12, T(0.5));
  Matrix<T> out12(12, kDv);
  CHECK_THROWS_WITH(
      layer.step_into(three_sequences, q4, q4, v12, beta12, out12),
      Contains("q has 4 rows but the states hold 3 sequences") && Contains("B * 4 = 12 rows"));
  CHECK(three_sequences[0].tokens() == 0);
  // Views of other widths or head counts.
  auto states = layer.make_states(kB);
  const Eigen::Index n = 10;
  std::vector<T> qd(static_cast<std::size_t>(kB * kH * n * kDk), T(0.1)),
      vd(static_cast<std::size_t>(kB * kH * n * kDv), T(0.1)),
      bd(static_cast<std::size_t>(kB * kH * n), T(0.5)), od(vd.size());
  const auto three = HeadsView<const T>::bhnd(qd.data(), {kB, 3, n, kDk});
  const auto vv = HeadsView<const T>::bhnd(vd.data(), {kB, kH, n, kDv});
  const auto bv = HeadsView<const T>::bhnd(bd.data(), {kB, kH, n, 1});
  const auto ov = HeadsView<T>::bhnd(od.data(), {kB, kH, n, kDv});
  CHECK_THROWS_WITH(layer.forward_into(three, three, vv, bv, ov), Contains("grouped heads"));
  CHECK_THROWS_WITH(layer.prefill_into(states, three, three, vv, bv, ov),
                    Contains("grouped heads"));
  const auto qk = HeadsView<const T>::bhnd(qd.data(), {kB, kH, n, kDk});
  CHECK_THROWS_WITH(layer.prefill_into(normalised, qk, qk, vv, bv, ov),
                    Contains("are not this layer's"));
  std::vector<T> packed(static_cast<std::size_t>(kH * n * kDk), T(0.1));
  const auto packed_view = HeadsView<const T>::bhnd(packed.data(), {1, kH, n, kDk});
  CHECK_THROWS_WITH(layer.prefill_varlen_into(normalised, packed_view, packed_view,
                                              HeadsView<const T>::bhnd(vd.data(), {1, kH, n, kDv}),
                                              HeadsView<const T>::bhnd(bd.data(), {1, kH, n, 1}),
                                              std::vector<std::int64_t>{0, 4, n},
                                              HeadsView<T>::bhnd(od.data(), {1, kH, n, kDv})),
                    Contains("are not this layer's"));
  const auto wide = HeadsView<const T>::bhnd(vd.data(), {kB, kH, n, kDv});
  CHECK_THROWS_WITH(layer.forward_into(wide, wide, vv, bv, ov), Contains("Dk = 8"));
  CHECK(states[0].tokens() == 0);
}

}  // namespace linattn_test_layer
