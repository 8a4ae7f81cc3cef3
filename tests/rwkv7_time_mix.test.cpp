// Rwkv7TimeMix (RWKV-7's time mixing between ln1 and the output projection) against the layer
// written out in double from RWKV-LM's reference (rwkv_v7_numpy.py's time_mixing: the token
// shift, r/k/v, the LoRAs, the value residual, kk, the V x K state updated as
// S diag(w) - S kk (kk o a)^T + v k^T, GroupNorm per head, the bonus, the gate), two layers
// chained by v_first; prefill and steps continuing it; checkpoints; a pool's save and load;
// every bad input.
#include <catch2/catch.hpp>
#include <cmath>
#include <linattn/rwkv7_time_mix.hpp>
#include <linattn/session_pool.hpp>
#include <string>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_rwkv7_time_mix {

namespace {

using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::HeadStrides;
using linattn::HeadsView;
using linattn::Matrix;
using linattn::Rwkv7TimeMix;
using linattn::Rwkv7TimeMixOptions;
using linattn::Rwkv7TimeMixShape;
using linattn::Rwkv7TimeMixWeights;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

constexpr Eigen::Index kHeads = 2, kDim = 16, kChannels = kHeads * kDim;

Rwkv7TimeMixShape small_shape(bool first_layer) {
  Rwkv7TimeMixShape shape;
  shape.heads = kHeads;
  shape.head_dim = kDim;
  shape.first_layer = first_layer;
  return shape;
}

/// Weights drawn near RWKV-7's initialisation: mixes in (0, 1), LoRAs of ranks 8, 6, 4 and
/// 10, k_k and k_a near 1 and 0.5, ln_x near (1, 0).
Rwkv7TimeMixWeights<double> random_weights(std::uint64_t seed) {
  const Eigen::Index c = kChannels;
  const double s = 1.0 / std::sqrt(double(c));
  Rwkv7TimeMixWeights<double> w;
  const auto mix = [&](std::uint64_t k) {
    return Vector<double>(gaussian<double>(c, 1, seed + k, 0.25, 0.5).cwiseMax(0.0).cwiseMin(1.0));
  };
  w.x_r = mix(1), w.x_w = mix(2), w.x_k = mix(3), w.x_v = mix(4), w.x_a = mix(5), w.x_g = mix(6);
  w.receptance = gaussian<double>(c, c, seed + 7, s);
  w.key = gaussian<double>(c, c, seed + 8, s);
  w.value = gaussian<double>(c, c, seed + 9, s);
  w.w1 = gaussian<double>(c, 8, seed + 10, s);
  w.w2 = gaussian<double>(8, c, seed + 11, 0.5);
  w.w0 = gaussian<double>(c, 1, seed + 12, 1.0, -0.5);
  w.a1 = gaussian<double>(c, 6, seed + 13, s);
  w.a2 = gaussian<double>(6, c, seed + 14, 0.5);
  w.a0 = gaussian<double>(c, 1, seed + 15, 1.0);
  w.v1 = gaussian<double>(c, 4, seed + 16, s);
  w.v2 = gaussian<double>(4, c, seed + 17, 0.5);
  w.v0 = gaussian<double>(c, 1, seed + 18, 1.0);
  w.g1 = gaussian<double>(c, 10, seed + 19, s);
  w.g2 = gaussian<double>(10, c, seed + 20, 0.5);
  w.k_k = gaussian<double>(c, 1, seed + 21, 0.2, 1.0);
  w.k_a = gaussian<double>(c, 1, seed + 22, 0.2, 0.5);
  w.r_k = gaussian<double>(kHeads, kDim, seed + 23, 0.5);
  w.ln_x_weight = gaussian<double>(c, 1, seed + 24, 0.1, 1.0);
  w.ln_x_bias = gaussian<double>(c, 1, seed + 25, 0.1);
  return w;
}

template <class T>
Rwkv7TimeMixWeights<T> cast_weights(const Rwkv7TimeMixWeights<double>& w) {
  Rwkv7TimeMixWeights<T> c;
  c.x_r = w.x_r.cast<T>(), c.x_w = w.x_w.cast<T>(), c.x_k = w.x_k.cast<T>();
  c.x_v = w.x_v.cast<T>(), c.x_a = w.x_a.cast<T>(), c.x_g = w.x_g.cast<T>();
  c.receptance = w.receptance.cast<T>(), c.key = w.key.cast<T>(), c.value = w.value.cast<T>();
  c.w1 = w.w1.cast<T>(), c.w2 = w.w2.cast<T>(), c.w0 = w.w0.cast<T>();
  c.a1 = w.a1.cast<T>(), c.a2 = w.a2.cast<T>(), c.a0 = w.a0.cast<T>();
  c.v1 = w.v1.cast<T>(), c.v2 = w.v2.cast<T>(), c.v0 = w.v0.cast<T>();
  c.g1 = w.g1.cast<T>(), c.g2 = w.g2.cast<T>();
  c.k_k = w.k_k.cast<T>(), c.k_a = w.k_a.cast<T>(), c.r_k = w.r_k.cast<T>();
  c.ln_x_weight = w.ln_x_weight.cast<T>(), c.ln_x_bias = w.ln_x_bias.cast<T>();
  return c;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
Vector<double> sigmoid(const Vector<double>& x) {
  return x.unaryExpr([](double e) { return sigmoid(e); });
}

/// RWKV-LM's time mixing of one sequence (N x C, its x after ln1) in double from zero states,
/// token by token with V x K states; v_first read (or, first layer, written): N x C outputs.
Matrix<double> reference(const Rwkv7TimeMixWeights<double>& p, bool first_layer,
                         const Matrix<double>& xs, Matrix<double>& v_first, double eps) {
  const Eigen::Index n = xs.rows(), c = kChannels;
  if (first_layer) v_first.resize(n, c);
  std::vector<Matrix<double>> states(kHeads, Matrix<double>::Zero(kDim, kDim));
  Vector<double> last = Vector<double>::Zero(c);
  Matrix<double> y(n, c);
  for (Eigen::Index t = 0; t < n; ++t) {
    const Vector<double> x = xs.row(t).transpose();
    const auto shifted = [&](const Vector<double>& mix) -> Vector<double> {
      return x + mix.cwiseProduct(last - x);
    };
    const Vector<double> xr = shifted(p.x_r), xw = shifted(p.x_w), xk = shifted(p.x_k);
    const Vector<double> xv = shifted(p.x_v), xa = shifted(p.x_a), xg = shifted(p.x_g);
    last = x;
    const Vector<double> r = p.receptance * xr;
    Vector<double> k = p.key * xk;
    Vector<double> v = p.value * xv;
    const Vector<double> w_lora =
        p.w2.transpose() * (p.w1.transpose() * xw).array().tanh().matrix() + p.w0;
    const Vector<double> w = (-sigmoid(w_lora) / std::sqrt(std::exp(1.0))).array().exp();
    if (first_layer) {
      v_first.row(t) = v.transpose();
    } else {
      const Vector<double> gate = sigmoid(p.v2.transpose() * (p.v1.transpose() * xv) + p.v0);
      v += (v_first.row(t).transpose() - v).cwiseProduct(gate);
    }
    const Vector<double> a = sigmoid(p.a2.transpose() * (p.a1.transpose() * xa) + p.a0);
    const Vector<double> g = p.g2.transpose() * sigmoid(p.g1.transpose() * xg);
    const Vector<double> kk_all = k.cwiseProduct(p.k_k);
    k = k.array() * (1.0 + (a.array() - 1.0) * p.k_a.array());
    for (Eigen::Index h = 0; h < kHeads; ++h) {
      const Eigen::Index at = h * kDim;
      Vector<double> kk = kk_all.segment(at, kDim);
      kk /= std::max(kk.norm(), 1e-12);
      Matrix<double>& s = states[static_cast<std::size_t>(h)];  // V x K
      const Vector<double> s_kk = s * kk;
      s = s * w.segment(at, kDim).asDiagonal();
      s -= s_kk * kk.cwiseProduct(a.segment(at, kDim)).transpose();
      s += v.segment(at, kDim) * k.segment(at, kDim).transpose();
      Vector<double> o = s * r.segment(at, kDim);
      const double mean = o.mean();
      const double var = (o.array() - mean).square().mean();
      o = (o.array() - mean) / std::sqrt(var + eps);
      o = o.cwiseProduct(p.ln_x_weight.segment(at, kDim)) + p.ln_x_bias.segment(at, kDim);
      const double bonus = (r.segment(at, kDim).array() * k.segment(at, kDim).array() *
                            p.r_k.row(h).transpose().array())
                               .sum();
      o += bonus * v.segment(at, kDim);
      y.row(t).segment(at, kDim) = o.cwiseProduct(g.segment(at, kDim)).transpose();
    }
  }
  return y;
}

/// [B, N, C] rows of B sequences (row b * N + t) as the mixer's views.
template <class T>
ConstHeadsView<T> x_view(const Matrix<T>& x, Eigen::Index batch) {
  return ConstHeadsView<T>::bnhd(x.data(), BnhdShape(batch, x.rows() / batch, 1, kChannels));
}
template <class T>
HeadsView<T> heads_view(Matrix<T>& m, Eigen::Index batch) {
  return HeadsView<T>::bnhd(m.data(), BnhdShape(batch, m.rows() / batch, kHeads, kDim));
}

}  // namespace

TEMPLATE_TEST_CASE(
    "Rwkv7TimeMix: two layers equal RWKV-LM's reference, forward and prefill "
    "then steps",
    "[rwkv7_time_mix]", float, double) {
  using T = TestType;
  const double bound = std::is_same_v<T, float> ? 1e-4 : 1e-10;
  const Eigen::Index batch = 2, n = 300;  // past one block of 256, and not a multiple of 64
  const Rwkv7TimeMixWeights<double> w0 = random_weights(100), w1 = random_weights(200);
  const Rwkv7TimeMix<T> first(small_shape(true), cast_weights<T>(w0));
  Rwkv7TimeMixOptions streamed;
  streamed.form = linattn::DeltaForm::streamed;
  streamed.chunk = 32;
  const Rwkv7TimeMix<T> second(small_shape(false), cast_weights<T>(w1));
  const Rwkv7TimeMix<T> second_streamed(small_shape(false), cast_weights<T>(w1), streamed);
  const Matrix<double> x = gaussian<double>(batch * n, kChannels, 7);
  const Matrix<T> xt = x.cast<T>();

  // The reference per sequence: layer 0 gives v_first and y0, layer 1 reads x + y0.
  Matrix<double> expected0(batch * n, kChannels), expected1(batch * n, kChannels);
  for (Eigen::Index b = 0; b < batch; ++b) {
    Matrix<double> v_first;
    const Matrix<double> xb = x.middleRows(b * n, n);
    expected0.middleRows(b * n, n) = reference(w0, true, xb, v_first, 64e-5);
    const Matrix<double> x1 = xb + expected0.middleRows(b * n, n);
    expected1.middleRows(b * n, n) = reference(w1, false, x1, v_first, 64e-5);
  }

  Matrix<T> v_first(batch * n, kChannels), y0(batch * n, kChannels), y1(batch * n, kChannels);
  first.forward_into(x_view(xt, batch), heads_view(v_first, batch), heads_view(y0, batch));
  CHECK(relative_error(y0.template cast<double>(), expected0) < bound);
  const Matrix<T> x1 = xt + y0;
  second.forward_into(x_view(x1, batch), heads_view(v_first, batch), heads_view(y1, batch));
  CHECK(relative_error(y1.template cast<double>(), expected1) < bound);
  Matrix<T> y1_streamed(batch * n, kChannels);
  second_streamed.forward_into(x_view(x1, batch), heads_view(v_first, batch),
                               heads_view(y1_streamed, batch));
  CHECK(relative_error(y1_streamed.template cast<double>(), expected1) < bound);

  // Each layer: a prefill of 100 tokens, 5 steps, a prefill of the rest, on the layer's own
  // input rows (the forward's x and x1), equal the forward's outputs.
  const Eigen::Index head = 100, steps = 5;
  for (const Rwkv7TimeMix<T>* mix : {&first, &second}) {
    const Matrix<T>& in = mix == &first ? xt : x1;
    const Matrix<T>& whole = mix == &first ? y0 : y1;
    Matrix<T> vf = v_first;  // the second layer reads it; the first rewrites the same values
    Matrix<T> got(batch * n, kChannels);
    typename Rwkv7TimeMix<T>::States states = mix->make_states(batch);
    const auto part = [&](Eigen::Index begin, Eigen::Index count) {
      const HeadStrides heads{n * kChannels, kDim, kChannels, 1};
      const ConstHeadsView<T> xv(in.data() + begin * kChannels, batch, 1, count, kChannels,
                                 HeadStrides{n * kChannels, kChannels, kChannels, 1});
      const HeadsView<T> fv(vf.data() + begin * kChannels, batch, kHeads, count, kDim, heads);
      const HeadsView<T> out(got.data() + begin * kChannels, batch, kHeads, count, kDim, heads);
      if (count == 1) {
        mix->step_into(states, xv, fv, out);
      } else {
        mix->prefill_into(states, xv, fv, out);
      }
    };
    part(0, head);
    for (Eigen::Index t = head; t < head + steps; ++t) part(t, 1);
    part(head + steps, n - head - steps);
    CHECK(relative_error(got.template cast<double>(), whole.template cast<double>()) < bound);
    if (mix == &first) CHECK(relative_error(vf, v_first) < bound);
  }
}

TEST_CASE("Rwkv7TimeMix: checkpoints are the states of the prefixes run alone",
          "[rwkv7_time_mix]") {
  const Eigen::Index n = 290;
  const Rwkv7TimeMix<double> mix(small_shape(false), random_weights(300));
  const Matrix<double> x = gaussian<double>(n, kChannels, 8);
  Matrix<double> v_first = gaussian<double>(n, kChannels, 9), out(n, kChannels);
  auto states = mix.make_states(1);
  std::vector<linattn::Rwkv7TimeMixStates<double>> snapshots;
  const std::vector<Eigen::Index> positions{1, 37, 256, 290};
  mix.prefill_into(states, x_view(x, 1), heads_view(v_first, 1), heads_view(out, 1), positions,
                   snapshots);
  REQUIRE(snapshots.size() == positions.size());
  for (std::size_t i = 0; i < positions.size(); ++i) {
    const Eigen::Index m = positions[i];
    auto alone = mix.make_states(1);
    const Matrix<double> xm = x.topRows(m);
    Matrix<double> vm = v_first.topRows(m), om(m, kChannels);
    mix.prefill_into(alone, x_view(xm, 1), heads_view(vm, 1), heads_view(om, 1));
    CHECK(snapshots[i].conv.window(0) == alone.conv.window(0));
    for (Eigen::Index h = 0; h < kHeads; ++h) {
      CHECK(relative_error(snapshots[i].recurrent[h].s(), alone.recurrent[h].s()) < 1e-12);
      CHECK(snapshots[i].recurrent[h].tokens() == m);
    }
  }
  CHECK(relative_error(snapshots.back().recurrent[1].s(), states.recurrent[1].s()) == 0.0);
}

TEST_CASE("Rwkv7TimeMix: a pool saves and loads a session, which continues bit for bit",
          "[rwkv7_time_mix]") {
  using F = float;
  const Rwkv7TimeMix<F> mix(small_shape(false), cast_weights<F>(random_weights(400)));
  linattn::SessionPool<> pool(mix);
  pool.add(5);
  auto& states = pool.states<linattn::Rwkv7TimeMixStates<F>>(5, 0);
  const Matrix<F> x = gaussian<F>(12, kChannels, 10);
  Matrix<F> v_first = gaussian<F>(12, kChannels, 11), out(12, kChannels);
  const auto rows = [&](const Matrix<F>& m, Eigen::Index t) {
    return ConstHeadsView<F>(m.data() + t * kChannels, 1, 1, 1, kChannels,
                             HeadStrides{kChannels, kChannels, kChannels, 1});
  };
  const auto heads = [&](Matrix<F>& m, Eigen::Index t) {
    return HeadsView<F>(m.data() + t * kChannels, 1, kHeads, 1, kDim,
                        HeadStrides{kChannels, kDim, kChannels, 1});
  };
  for (Eigen::Index t = 0; t < 6; ++t)
    mix.step_into(states, rows(x, t), heads(v_first, t), heads(out, t));
  const std::vector<std::uint8_t> blob = pool.save_bytes(5);
  linattn::SessionPool<> loaded(mix);
  loaded.add_bytes(7, blob.data(), blob.size());
  auto& copy = loaded.states<linattn::Rwkv7TimeMixStates<F>>(7, 0);
  CHECK(copy.conv.window(0) == states.conv.window(0));
  Matrix<F> again = out;
  for (Eigen::Index t = 6; t < 12; ++t) {
    mix.step_into(states, rows(x, t), heads(v_first, t), heads(out, t));
    mix.step_into(copy, rows(x, t), heads(v_first, t), heads(again, t));
  }
  CHECK(out.bottomRows(6) == again.bottomRows(6));
}

TEST_CASE("Rwkv7TimeMix: bad input throws before anything moves", "[rwkv7_time_mix]") {
  using Catch::Matchers::Contains;
  const Rwkv7TimeMixWeights<double> w = random_weights(500);
  SECTION("weights") {
    Rwkv7TimeMixWeights<double> bad = w;
    bad.w2 = Matrix<double>::Zero(7, kChannels);
    CHECK_THROWS_WITH(Rwkv7TimeMix<double>(small_shape(false), bad), Contains("w2 is 7 x 32"));
    bad = w;
    bad.v0.resize(0);
    CHECK_THROWS_WITH(Rwkv7TimeMix<double>(small_shape(false), bad), Contains("v0"));
    CHECK_NOTHROW(Rwkv7TimeMix<double>(small_shape(true), bad));  // the first layer has none
    bad = w;
    bad.r_k = Matrix<double>::Zero(kDim, kHeads);
    CHECK_THROWS_WITH(Rwkv7TimeMix<double>(small_shape(false), bad), Contains("r_k"));
    bad = w;
    bad.key(3, 4) = std::nan("");
    CHECK_THROWS_WITH(Rwkv7TimeMix<double>(small_shape(false), bad), Contains("key"));
    bad = w;
    bad.x_g.resize(kChannels - 1);
    CHECK_THROWS_WITH(Rwkv7TimeMix<double>(small_shape(false), bad), Contains("x_g"));
    Rwkv7TimeMixOptions options;
    options.norm_eps = 0.0;
    CHECK_THROWS_WITH(Rwkv7TimeMix<double>(small_shape(false), w, options), Contains("norm_eps"));
  }
  SECTION("views and states") {
    const Rwkv7TimeMix<double> first(small_shape(true), w), second(small_shape(false), w);
    const Eigen::Index n = 4;
    Matrix<double> x = gaussian<double>(n, kChannels, 12);
    Matrix<double> v_first = gaussian<double>(n, kChannels, 13), out(n, kChannels);
    auto states = second.make_states(1);
    const Matrix<double> before = gaussian<double>(1, kChannels, 14);
    second.prefill_into(states, x_view(x, 1), heads_view(v_first, 1), heads_view(out, 1));
    const auto saved = states;
    const auto unchanged = [&] {
      CHECK(states.conv.window(0) == saved.conv.window(0));
      for (Eigen::Index h = 0; h < kHeads; ++h)
        CHECK(states.recurrent[h].s() == saved.recurrent[h].s());
    };
    const Matrix<double> wide = gaussian<double>(n, kChannels + 1, 15);
    CHECK_THROWS_WITH(
        second.prefill_into(
            states, ConstHeadsView<double>::bnhd(wide.data(), BnhdShape(1, n, 1, kChannels + 1)),
            heads_view(v_first, 1), heads_view(out, 1)),
        Contains("x is [B, H, N, D] = [1, 1, 4, 33]"));
    CHECK_THROWS_WITH(
        second.prefill_into(states, x_view(x, 1), heads_view(v_first, 1), heads_view(x, 1)),
        Contains("out overlaps x"));
    CHECK_THROWS_WITH(first.forward_into(x_view(x, 1), heads_view(x, 1), heads_view(out, 1)),
                      Contains("writes v_first"));
    auto others = first.make_states(2);
    CHECK_THROWS_WITH(
        second.prefill_into(others, x_view(x, 1), heads_view(v_first, 1), heads_view(out, 1)),
        Contains("not this mixer's"));
    CHECK_THROWS_WITH(
        second.step_into(states, x_view(x, 1), heads_view(v_first, 1), heads_view(out, 1)),
        Contains("a step takes one"));
    x(2, 5) = std::nan("");
    CHECK_THROWS_WITH(
        second.prefill_into(states, x_view(x, 1), heads_view(v_first, 1), heads_view(out, 1)),
        Contains("non-finite value (nan) at row 2, column 5"));
    x(2, 5) = 0.0;
    v_first(3, 1) = std::nan("");
    CHECK_THROWS_WITH(
        second.prefill_into(states, x_view(x, 1), heads_view(v_first, 1), heads_view(out, 1)),
        Contains("v_first"));
    unchanged();
  }
}

}  // namespace linattn_test_rwkv7_time_mix
