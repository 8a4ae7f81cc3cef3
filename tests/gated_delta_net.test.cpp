// GatedDeltaNet (Qwen3.5's and Kimi Linear's mixers between their projections) against the
// layer written out in double from HF's Qwen3.5 modeling code (causal conv1d + SiLU, split,
// l2norm with eps under the root, q scaled by Dk^-1/2, beta = sigmoid(b), g = -exp(A_log)
// softplus(a + dt_bias), repeat_interleave of q/k heads, the gated delta rule, w rmsnorm(o)
// silu(z)) and from FLA's KimiDeltaAttention (the same with a log gate per key channel, the
// state's rows decayed one by one, and sigmoid in the norm); prefill and steps continuing the
// forward; views of one fused projection row; every bad input.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <linattn/gated_delta_net.hpp>
#include <random>
#include <string>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_gated_delta_net {

namespace {

using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::GatedDeltaNet;
using linattn::GatedDeltaNetInputs;
using linattn::GatedDeltaNetModel;
using linattn::GatedDeltaNetShape;
using linattn::GatedDeltaNetWeights;
using linattn::HeadStrides;
using linattn::HeadsView;
using linattn::Matrix;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

/// A small mixer: 2 q/k heads of 16 over 4 value heads of 12 (Dk != Dv catches a transpose).
GatedDeltaNetShape small_shape(GatedDeltaNetModel model = GatedDeltaNetModel::qwen3_5) {
  GatedDeltaNetShape shape;
  shape.model = model;
  shape.key_heads = 2;
  shape.value_heads = 4;
  shape.key_dim = 16;
  shape.value_dim = 12;
  shape.conv_kernel = 4;
  return shape;
}

/// Weights drawn as Qwen3.5 initialises them: A = exp(A_log) uniform in (0, 16), dt_bias
/// around 1, the conv taps and norm weight around their defaults.
GatedDeltaNetWeights<double> random_weights(const GatedDeltaNetShape& shape, std::uint64_t seed) {
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<double> rate(0.5, 16.0);
  GatedDeltaNetWeights<double> w;
  w.conv_weight = gaussian<double>(shape.conv_channels(), shape.conv_kernel, seed + 1, 0.5);
  w.a_log.resize(shape.value_heads);
  for (Eigen::Index h = 0; h < shape.value_heads; ++h) w.a_log(h) = std::log(rate(engine));
  w.dt_bias = gaussian<double>(shape.value_heads * shape.gate_dim(), 1, seed + 2, 0.5, 1.0);
  w.norm_weight = gaussian<double>(shape.value_dim, 1, seed + 3, 0.2, 1.0);
  return w;
}

template <class T>
GatedDeltaNetWeights<T> cast_weights(const GatedDeltaNetWeights<double>& w) {
  return {w.conv_weight.cast<T>(), w.a_log.cast<T>(), w.dt_bias.cast<T>(), w.norm_weight.cast<T>()};
}

/// One sequence's projections: N x C, N x Hv Dv, N x Hv, N x Hv.
struct Sequence {
  Matrix<double> qkv, z, b, a;
};

Sequence random_sequence(const GatedDeltaNetShape& shape, Eigen::Index tokens, std::uint64_t seed) {
  return {gaussian<double>(tokens, shape.conv_channels(), seed),
          gaussian<double>(tokens, shape.value_channels(), seed + 1),
          gaussian<double>(tokens, shape.value_heads, seed + 2, 2.0),
          gaussian<double>(tokens, shape.value_heads * shape.gate_dim(), seed + 3, 2.0)};
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

/// HF's Qwen3.5 GatedDeltaNet (or FLA's KimiDeltaAttention) between its projections, in
/// double, from zero states: N x Hv Dv.
Matrix<double> reference(const GatedDeltaNetShape& shape, const GatedDeltaNetWeights<double>& w,
                         const Sequence& in, double eps) {
  const Eigen::Index n = in.qkv.rows(), c = shape.conv_channels(), taps = shape.conv_kernel;
  const Eigen::Index hk = shape.key_heads, hv = shape.value_heads;
  const Eigen::Index dk = shape.key_dim, dv = shape.value_dim;
  const bool kimi = shape.model == GatedDeltaNetModel::kimi_linear;
  // Depthwise causal conv1d (padding K - 1, cut to N) and SiLU.
  Matrix<double> x(n, c);
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index ch = 0; ch < c; ++ch) {
      double sum = 0.0;
      for (Eigen::Index i = 0; i < taps; ++i) {
        const Eigen::Index src = t - (taps - 1 - i);
        if (src >= 0) sum += w.conv_weight(ch, i) * in.qkv(src, ch);
      }
      x(t, ch) = sum * sigmoid(sum);
    }
  }
  Matrix<double> y(n, hv * dv);
  for (Eigen::Index h = 0; h < hv; ++h) {
    const Eigen::Index kh = h / (hv / hk);  // repeat_interleave
    Matrix<double> s = Matrix<double>::Zero(dk, dv);
    for (Eigen::Index t = 0; t < n; ++t) {
      Vector<double> q = x.row(t).segment(kh * dk, dk).transpose();
      Vector<double> k = x.row(t).segment(hk * dk + kh * dk, dk).transpose();
      const Vector<double> v = x.row(t).segment(2 * hk * dk + h * dv, dv).transpose();
      q /= std::sqrt(q.squaredNorm() + 1e-6);  // l2norm: eps inside the root
      k /= std::sqrt(k.squaredNorm() + 1e-6);
      q *= 1.0 / std::sqrt(static_cast<double>(dk));
      const double beta = sigmoid(in.b(t, h));
      if (kimi) {
        // KDA: row d of S (key channel d) decays by its own gate.
        for (Eigen::Index d = 0; d < dk; ++d) {
          const double x = in.a(t, h * dk + d) + w.dt_bias(h * dk + d);
          s.row(d) *= std::exp(-std::exp(w.a_log(h)) * std::log1p(std::exp(x)));
        }
      } else {
        s *= std::exp(-std::exp(w.a_log(h)) * std::log1p(std::exp(in.a(t, h) + w.dt_bias(h))));
      }
      const Vector<double> delta = beta * (v - s.transpose() * k);
      s += k * delta.transpose();
      const Vector<double> o = s.transpose() * q;
      const double rms = std::sqrt(o.squaredNorm() / static_cast<double>(dv) + eps);
      for (Eigen::Index d = 0; d < dv; ++d) {
        const double gate = in.z(t, h * dv + d);
        y(t, h * dv + d) = w.norm_weight(d) * (o(d) / rms) * (kimi ? 1.0 : gate) * sigmoid(gate);
      }
    }
  }
  return y;
}

/// B sequences' projections in contiguous [B, N, ...] buffers of T, and the views of them.
template <class T>
struct Batch {
  Matrix<T> qkv, z, b, a;  // rows b * N + t
  Eigen::Index batch, tokens;
  Batch(const std::vector<Sequence>& sequences, Eigen::Index first, Eigen::Index count)
      : batch(static_cast<Eigen::Index>(sequences.size())), tokens(count) {
    auto stack = [&](auto member) {
      const Matrix<double>& m0 = sequences.front().*member;
      Matrix<T> out(batch * count, m0.cols());
      for (Eigen::Index s = 0; s < batch; ++s) {
        out.middleRows(s * count, count) = (sequences[static_cast<std::size_t>(s)].*member)
                                               .middleRows(first, count)
                                               .template cast<T>();
      }
      return out;
    };
    qkv = stack(&Sequence::qkv);
    z = stack(&Sequence::z);
    b = stack(&Sequence::b);
    a = stack(&Sequence::a);
  }
  GatedDeltaNetInputs<T> inputs(const GatedDeltaNetShape& shape) const {
    return {ConstHeadsView<T>::bnhd(qkv.data(), BnhdShape(batch, tokens, 1, qkv.cols())),
            ConstHeadsView<T>::bnhd(z.data(),
                                    BnhdShape(batch, tokens, shape.value_heads, shape.value_dim)),
            ConstHeadsView<T>::bnhd(b.data(), BnhdShape(batch, tokens, shape.value_heads, 1)),
            ConstHeadsView<T>::bnhd(a.data(),
                                    BnhdShape(batch, tokens, shape.value_heads, shape.gate_dim()))};
  }
};

template <class T>
HeadsView<T> out_view(Matrix<T>& y, const GatedDeltaNetShape& shape, Eigen::Index batch) {
  return HeadsView<T>::bnhd(y.data(),
                            BnhdShape(batch, y.rows() / batch, shape.value_heads, shape.value_dim));
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-10;
}

}  // namespace

TEMPLATE_TEST_CASE(
    "GatedDeltaNet: forward, prefill and steps against HF's Qwen3.5 and FLA's "
    "Kimi layers",
    "[gated_delta_net]", float, double) {
  using T = TestType;
  const auto model = GENERATE(GatedDeltaNetModel::qwen3_5, GatedDeltaNetModel::kimi_linear);
  CAPTURE(static_cast<int>(model));
  const GatedDeltaNetShape shape = small_shape(model);
  const GatedDeltaNetWeights<double> weights = random_weights(shape, 1);
  const GatedDeltaNet<T> mixer(shape, cast_weights<T>(weights));
  // N = 300 prompt tokens (more than a block of 256) and 6 decoded.
  const Eigen::Index prompt = 300, decoded = 6, total = prompt + decoded, batch = 2;
  std::vector<Sequence> sequences;
  for (Eigen::Index s = 0; s < batch; ++s) {
    sequences.push_back(random_sequence(shape, total, 10 + 10 * static_cast<std::uint64_t>(s)));
  }
  std::vector<Matrix<double>> expected;
  for (const Sequence& s : sequences) expected.push_back(reference(shape, weights, s, 1e-6));

  const Batch<T> whole(sequences, 0, total);
  Matrix<T> forward(batch * total, shape.value_channels());
  mixer.forward_into(whole.inputs(shape), out_view(forward, shape, batch));
  for (Eigen::Index s = 0; s < batch; ++s) {
    CAPTURE(s);
    CHECK(relative_error(forward.middleRows(s * total, total), expected[s]) < tolerance<T>());
  }

  // The prompt in one prefill, then one step per token, from the states it leaves.
  auto states = mixer.make_states(batch);
  const Batch<T> head(sequences, 0, prompt);
  Matrix<T> prefilled(batch * prompt, shape.value_channels());
  mixer.prefill_into(states, head.inputs(shape), out_view(prefilled, shape, batch));
  for (Eigen::Index s = 0; s < batch; ++s) {
    CAPTURE(s);
    CHECK(relative_error(prefilled.middleRows(s * prompt, prompt), expected[s].topRows(prompt)) <
          tolerance<T>());
  }
  for (Eigen::Index t = prompt; t < total; ++t) {
    CAPTURE(t);
    const Batch<T> token(sequences, t, 1);
    Matrix<T> y(batch, shape.value_channels());
    mixer.step_into(states, token.inputs(shape), out_view(y, shape, batch));
    for (Eigen::Index s = 0; s < batch; ++s) {
      CAPTURE(s);
      CHECK(relative_error(y.row(s), expected[s].row(t)) < tolerance<T>());
    }
  }
  // One sequence alone (its step reads the convolution's row in place, no gather).
  auto single = mixer.make_states(1);
  const std::vector<Sequence> first{sequences.front()};
  const Batch<T> first_prompt(first, 0, prompt);
  Matrix<T> first_prefill(prompt, shape.value_channels());
  mixer.prefill_into(single, first_prompt.inputs(shape), out_view(first_prefill, shape, 1));
  for (Eigen::Index t = prompt; t < total; ++t) {
    CAPTURE(t);
    const Batch<T> token(first, t, 1);
    Matrix<T> y(1, shape.value_channels());
    mixer.step_into(single, token.inputs(shape), out_view(y, shape, 1));
    CHECK(relative_error(y, expected[0].row(t)) < tolerance<T>());
  }
}

TEST_CASE("GatedDeltaNet: checkpoints are the states of the prefixes run alone",
          "[gated_delta_net]") {
  using T = double;
  const GatedDeltaNetShape shape = small_shape(GatedDeltaNetModel::kimi_linear);
  const GatedDeltaNet<T> mixer(shape, cast_weights<T>(random_weights(shape, 5)));
  const Eigen::Index batch = 2, tokens = 300;
  std::vector<Sequence> sequences{random_sequence(shape, tokens, 70),
                                  random_sequence(shape, tokens, 80)};
  const Batch<T> data(sequences, 0, tokens);
  const std::vector<Eigen::Index> positions{1, 37, 256, 290, 300};
  std::vector<GatedDeltaNet<T>::States> snapshots;
  auto states = mixer.make_states(batch);
  Matrix<T> y(batch * tokens, shape.value_channels()),
      plain(batch * tokens, shape.value_channels());
  mixer.prefill_into(states, data.inputs(shape), out_view(y, shape, batch), positions, snapshots);
  REQUIRE(snapshots.size() == positions.size());
  auto plain_states = mixer.make_states(batch);
  mixer.prefill_into(plain_states, data.inputs(shape), out_view(plain, shape, batch));
  CHECK(relative_error(y, plain) < 1e-12);
  for (std::size_t i = 0; i < positions.size(); ++i) {
    CAPTURE(i);
    const Batch<T> prefix(sequences, 0, positions[i]);
    auto alone = mixer.make_states(batch);
    Matrix<T> out(batch * positions[i], shape.value_channels());
    mixer.prefill_into(alone, prefix.inputs(shape), out_view(out, shape, batch));
    for (Eigen::Index b = 0; b < batch; ++b)
      CHECK(snapshots[i].conv.window(b) == alone.conv.window(b));
    for (Eigen::Index j = 0; j < alone.recurrent.size(); ++j) {
      CHECK(relative_error(snapshots[i].recurrent[j].s(), alone.recurrent[j].s()) < 1e-12);
    }
  }
  // A second call fills the same snapshots in place; bad positions throw before anything moves.
  const Matrix<T> s0 = snapshots[0].recurrent[0].s();
  mixer.prefill_into(states, data.inputs(shape), out_view(y, shape, batch), positions, snapshots);
  CHECK(snapshots.size() == positions.size());
  CHECK(snapshots[0].recurrent[0].s() != s0);  // it continued from where the first call ended
  const auto before = states;
  using Catch::Matchers::Contains;
  for (const std::vector<Eigen::Index>& bad : {std::vector<Eigen::Index>{0}, {5, 5}, {301}}) {
    CHECK_THROWS_WITH(
        mixer.prefill_into(states, data.inputs(shape), out_view(y, shape, batch), bad, snapshots),
        Contains("positions must rise strictly within [1, N = 300]"));
  }
  CHECK(states.recurrent[3].s() == before.recurrent[3].s());
}

TEST_CASE("GatedDeltaNet: views of one fused projection row give the same bits",
          "[gated_delta_net]") {
  using T = float;
  const GatedDeltaNetShape shape = small_shape();
  const GatedDeltaNet<T> mixer(shape, cast_weights<T>(random_weights(shape, 2)));
  const Eigen::Index batch = 2, tokens = 70;
  std::vector<Sequence> sequences{random_sequence(shape, tokens, 20),
                                  random_sequence(shape, tokens, 30)};
  const Batch<T> separate(sequences, 0, tokens);
  Matrix<T> expected(batch * tokens, shape.value_channels());
  auto states = mixer.make_states(batch);
  mixer.prefill_into(states, separate.inputs(shape), out_view(expected, shape, batch));

  // One GEMM's rows: [a | qkv | z | b | 3 spare] per token, as a port fusing the four
  // projections' weights lays them out.
  const Eigen::Index hv = shape.value_heads, c = shape.conv_channels();
  const Eigen::Index width = hv + c + shape.value_channels() + hv + 3;
  Matrix<T> fused(batch * tokens, width);
  fused.leftCols(hv) = separate.a;
  fused.middleCols(hv, c) = separate.qkv;
  fused.middleCols(hv + c, shape.value_channels()) = separate.z;
  fused.middleCols(hv + c + shape.value_channels(), hv) = separate.b;
  auto view = [&](Eigen::Index column, Eigen::Index heads, Eigen::Index dim) {
    return ConstHeadsView<T>(fused.data() + column, batch, heads, tokens, dim,
                             HeadStrides{tokens * width, dim, width, 1});
  };
  const GatedDeltaNetInputs<T> in{view(hv, 1, c), view(hv + c, hv, shape.value_dim),
                                  view(hv + c + shape.value_channels(), hv, 1), view(0, hv, 1)};
  Matrix<T> y(batch * tokens, shape.value_channels());
  auto fused_states = mixer.make_states(batch);
  mixer.prefill_into(fused_states, in, out_view(y, shape, batch));
  CHECK(y == expected);
  // Stepping from either: the same bits again, the step reading a fused row in place.
  const Sequence next = random_sequence(shape, 1, 40);
  Matrix<T> row(batch, width);
  row.setZero();
  for (Eigen::Index b = 0; b < batch; ++b) {
    row.block(b, hv, 1, c) = next.qkv.cast<T>();
    row.block(b, hv + c, 1, shape.value_channels()) = next.z.cast<T>();
    row.block(b, hv + c + shape.value_channels(), 1, hv) = next.b.cast<T>();
    row.block(b, 0, 1, hv) = next.a.cast<T>();
  }
  auto row_view = [&](Eigen::Index column, Eigen::Index heads, Eigen::Index dim) {
    return ConstHeadsView<T>(row.data() + column, batch, heads, 1, dim,
                             HeadStrides{width, dim, width, 1});
  };
  const GatedDeltaNetInputs<T> step_in{row_view(hv, 1, c), row_view(hv + c, hv, shape.value_dim),
                                       row_view(hv + c + shape.value_channels(), hv, 1),
                                       row_view(0, hv, 1)};
  Matrix<T> y_fused(batch, shape.value_channels()), y_separate(batch, shape.value_channels());
  mixer.step_into(fused_states, step_in, out_view(y_fused, shape, batch));
  std::vector<Sequence> nexts{next, next};
  const Batch<T> next_batch(nexts, 0, 1);
  mixer.step_into(states, next_batch.inputs(shape), out_view(y_separate, shape, batch));
  CHECK(y_fused == y_separate);
  // One row shared by both sequences (batch stride 0): the same as the two rows apart.
  auto shared_states = fused_states;
  const auto zero_batch = [&](Eigen::Index column, Eigen::Index heads, Eigen::Index dim) {
    return ConstHeadsView<T>(row.data() + column, batch, heads, 1, dim,
                             HeadStrides{0, dim, width, 1});
  };
  const GatedDeltaNetInputs<T> shared_in{
      zero_batch(hv, 1, c), zero_batch(hv + c, hv, shape.value_dim),
      zero_batch(hv + c + shape.value_channels(), hv, 1), zero_batch(0, hv, 1)};
  auto apart_states = fused_states;
  Matrix<T> y_shared(batch, shape.value_channels()), y_apart(batch, shape.value_channels());
  mixer.step_into(shared_states, shared_in, out_view(y_shared, shape, batch));
  Matrix<T> two_rows(batch, width);
  two_rows.row(0) = row.row(0);
  two_rows.row(1) = row.row(0);
  const GatedDeltaNetInputs<T> apart_in{
      ConstHeadsView<T>(two_rows.data() + hv, batch, 1, 1, c, HeadStrides{width, c, width, 1}),
      ConstHeadsView<T>(two_rows.data() + hv + c, batch, hv, 1, shape.value_dim,
                        HeadStrides{width, shape.value_dim, width, 1}),
      ConstHeadsView<T>(two_rows.data() + hv + c + shape.value_channels(), batch, hv, 1, 1,
                        HeadStrides{width, 1, width, 1}),
      ConstHeadsView<T>(two_rows.data(), batch, hv, 1, 1, HeadStrides{width, 1, width, 1})};
  mixer.step_into(apart_states, apart_in, out_view(y_apart, shape, batch));
  CHECK(y_shared == y_apart);
  CHECK(fused_states.recurrent[5].s() == states.recurrent[5].s());
}

TEST_CASE("GatedDeltaNet: bad input throws before anything moves", "[gated_delta_net]") {
  using T = float;
  using Catch::Matchers::Contains;
  const GatedDeltaNetShape shape = small_shape();
  const GatedDeltaNetWeights<T> weights = cast_weights<T>(random_weights(shape, 3));
  GatedDeltaNetShape odd = shape;
  odd.value_heads = 3;
  CHECK_THROWS_WITH(GatedDeltaNet<T>(odd, weights), Contains("Hv a multiple of Hk"));
  GatedDeltaNetWeights<T> bad = weights;
  bad.conv_weight = Matrix<T>::Zero(shape.conv_channels(), 3);
  CHECK_THROWS_WITH(GatedDeltaNet<T>(shape, bad), Contains("conv_weight is 112 x 3"));
  bad = weights;
  bad.norm_weight = Vector<T>::Ones(16);
  CHECK_THROWS_WITH(GatedDeltaNet<T>(shape, bad), Contains("norm_weight has 16 entries"));
  bad = weights;
  bad.a_log(1) = 100.0f;
  CHECK_THROWS_WITH(GatedDeltaNet<T>(shape, bad), Contains("a_log has an entry whose exp"));
  bad = weights;
  bad.dt_bias = Vector<T>::Zero(3);
  CHECK_THROWS_WITH(GatedDeltaNet<T>(shape, bad), Contains("dt_bias"));

  linattn::GatedDeltaNetOptions bad_options;
  bad_options.chunk = 0;
  CHECK_THROWS_WITH(GatedDeltaNet<T>(shape, weights, bad_options),
                    Contains("GatedDeltaNetOptions::chunk must be >= 1"));
  bad_options = {};
  bad_options.norm_eps = 0.0;
  CHECK_THROWS_WITH(GatedDeltaNet<T>(shape, weights, bad_options),
                    Contains("GatedDeltaNetOptions::norm_eps must be finite and > 0"));

  const GatedDeltaNet<T> mixer(shape, weights);
  const Eigen::Index batch = 2, tokens = 9;
  std::vector<Sequence> sequences{random_sequence(shape, tokens, 50),
                                  random_sequence(shape, tokens, 60)};
  Batch<T> data(sequences, 0, tokens);
  auto states = mixer.make_states(batch);
  Matrix<T> warm(batch * tokens, shape.value_channels());
  mixer.prefill_into(states, data.inputs(shape), out_view(warm, shape, batch));
  const auto before = states;
  auto unchanged = [&] {
    for (Eigen::Index b = 0; b < batch; ++b) {
      if (states.conv.window(b) != before.conv.window(b)) return false;
    }
    for (Eigen::Index i = 0; i < states.recurrent.size(); ++i) {
      if (states.recurrent[i].s() != before.recurrent[i].s()) return false;
    }
    return true;
  };
  Matrix<T> y(batch * tokens, shape.value_channels());
  const auto out = out_view(y, shape, batch);
  GatedDeltaNetInputs<T> in = data.inputs(shape);

  GatedDeltaNetInputs<T> wrong = in;
  wrong.z = ConstHeadsView<T>::bnhd(data.z.data(), BnhdShape(batch, tokens, 2, 24));
  CHECK_THROWS_WITH(mixer.prefill_into(states, wrong, out),
                    Contains("z is [B, H, N, D] = [2, 2, 9, 24]"));
  wrong = in;
  wrong.a = ConstHeadsView<T>::bnhd(data.a.data(), BnhdShape(batch, tokens - 1, 4, 1));
  CHECK_THROWS_WITH(mixer.prefill_into(states, wrong, out), Contains("a is [B, H, N, D]"));
  // out over z's memory: the norm reads z after the recurrence wrote out.
  Matrix<T> z_copy = data.z;
  GatedDeltaNetInputs<T> aliased = in;
  aliased.z = ConstHeadsView<T>::bnhd(z_copy.data(), BnhdShape(batch, tokens, 4, 12));
  CHECK_THROWS_WITH(mixer.prefill_into(states, aliased, out_view(z_copy, shape, batch)),
                    Contains("out overlaps z's memory"));
  auto three = mixer.make_states(3);
  CHECK_THROWS_WITH(mixer.prefill_into(three, in, out), Contains("make_states(B)"));
  // A Kimi mixer of the same sizes: the used Qwen states do not continue as KDA states.
  const GatedDeltaNetShape kimi_shape = small_shape(GatedDeltaNetModel::kimi_linear);
  const GatedDeltaNet<T> kimi(kimi_shape, cast_weights<T>(random_weights(kimi_shape, 6)));
  std::vector<Sequence> kimi_sequences{random_sequence(kimi_shape, tokens, 90),
                                       random_sequence(kimi_shape, tokens, 91)};
  const Batch<T> kimi_data(kimi_sequences, 0, tokens);
  CHECK_THROWS_WITH(kimi.prefill_into(states, kimi_data.inputs(kimi_shape), out),
                    Contains("not this mixer's"));
  const GatedDeltaNet<T> other(shape, cast_weights<T>(random_weights(shape, 4)));
  GatedDeltaNetShape wider = shape;
  wider.conv_kernel = 3;
  GatedDeltaNetWeights<T> wider_weights = weights;
  wider_weights.conv_weight = Matrix<T>::Ones(shape.conv_channels(), 3);
  auto other_states = GatedDeltaNet<T>(wider, wider_weights).make_states(batch);
  CHECK_THROWS_WITH(mixer.prefill_into(other_states, in, out), Contains("not this mixer's"));
  // Non-finite inputs, each named: nothing moved.
  for (const auto member : {&Batch<T>::qkv, &Batch<T>::z, &Batch<T>::b, &Batch<T>::a}) {
    Batch<T> poisoned = data;
    (poisoned.*member)(tokens + 3, 0) = std::numeric_limits<T>::quiet_NaN();
    CHECK_THROWS_WITH(mixer.prefill_into(states, poisoned.inputs(shape), out),
                      Contains("(sequence 1, head 0; rows are tokens) has a non-finite value"));
  }
  CHECK_THROWS_WITH(mixer.step_into(states, in, out), Contains("a step takes one"));
  CHECK(unchanged());
  // Unchecked, a NaN gate input still throws before the convolution moves.
  linattn::GatedDeltaNetOptions unchecked;
  unchecked.check_finite = false;
  const GatedDeltaNet<T> loose(shape, weights, unchecked);
  auto loose_states = loose.make_states(batch);
  Batch<T> poisoned = data;
  poisoned.b(2, 1) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH(loose.prefill_into(loose_states, poisoned.inputs(shape), out),
                    Contains("b or a holds NaN or Inf"));
  CHECK(loose_states.conv.window(0).isZero());
}

}  // namespace linattn_test_gated_delta_net
