// One Qwen3.5 linear-attention layer, whole: where a port of Qwen3.5 (or Kimi Linear, with
// GatedDeltaNetModel::kimi_linear) starts.
//
// From a hidden state x ([B, N, d_model]) the model's four input projections (in_proj_qkv,
// in_proj_z, in_proj_b, in_proj_a) are one GEMM here, writing each token's row as
//   [ qkv (C = 2 Hk Dk + Hv Dv) | z (Hv Dv) | b (Hv) | a (Hv) ],
// and linattn::GatedDeltaNet reads the four parts of those rows in place (views, no copies):
// the short convolution and SiLU, the L2 norms, beta and the decay gates, the gated delta
// rule, the gated RMSNorm. Its output is the input of out_proj, the second GEMM.
//
// The program prefills B prompts, decodes tokens for every sequence in one call each, then
// runs a round of speculative decoding: 4 draft tokens stepped through a DraftRing, m of them
// kept, and checks that the states are bit for bit those of decoding the m tokens alone. It
// also checks that prefill + steps give what the parallel form gives over the whole sequence
// (1e-4 relative: two forms in float). It fails otherwise.
//
// Usage: example_qwen35_layer [--qwen3.5-9b]
//   default: 2 q/k heads and 4 v heads of 64, d_model 256 (fast enough for the test suite)
//   --qwen3.5-9b: 16 q/k heads and 32 v heads of 128, d_model 4096
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <linattn/linattn.hpp>
#include <random>
#include <vector>

namespace {

using Mat = linattn::Matrix<float>;  // row-major: one row per token
using Vec = linattn::Vector<float>;
using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::HeadStrides;
using linattn::HeadsView;
using Clock = std::chrono::steady_clock;

Mat random_matrix(Eigen::Index rows, Eigen::Index cols, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

/// The layer's weights: the fused input projection (d_model x W, W = C + Hv Dv + 2 Hv), the
/// mixer's own parameters, and out_proj (Hv Dv x d_model).
struct Layer {
  linattn::GatedDeltaNetShape shape;
  Eigen::Index model_dim;
  Mat in_proj, out_proj;
  linattn::GatedDeltaNetWeights<float> mixer;
  Eigen::Index width() const {
    return shape.conv_channels() + shape.value_channels() + 2 * shape.value_heads;
  }
};

/// Weights drawn as Qwen3.5 initialises them: A = exp(A_log) uniform in (0, 16), dt_bias 1,
/// the norm's weight 1, the projections at unit output variance.
Layer make_layer(const linattn::GatedDeltaNetShape& shape, Eigen::Index model_dim,
                 std::mt19937& rng) {
  Layer layer{shape, model_dim, {}, {}, {}};
  const float stddev = 1.0f / std::sqrt(static_cast<float>(model_dim));
  layer.in_proj = random_matrix(model_dim, layer.width(), stddev, rng);
  layer.out_proj = random_matrix(shape.value_channels(), model_dim,
                                 1.0f / std::sqrt(static_cast<float>(shape.value_channels())), rng);
  std::uniform_real_distribution<float> rate(0.01f, 16.0f);
  layer.mixer.conv_weight = random_matrix(shape.conv_channels(), shape.conv_kernel, 0.5f, rng);
  layer.mixer.a_log.resize(shape.value_heads);
  for (Eigen::Index h = 0; h < shape.value_heads; ++h) layer.mixer.a_log(h) = std::log(rate(rng));
  layer.mixer.dt_bias = Vec::Ones(shape.value_heads);
  layer.mixer.norm_weight = Vec::Ones(shape.value_dim);
  return layer;
}

/// The views of the fused projection's rows [B, N, W] that the mixer reads.
linattn::GatedDeltaNetInputs<float> split(const Layer& layer, const Mat& rows, Eigen::Index batch) {
  const linattn::GatedDeltaNetShape& s = layer.shape;
  const Eigen::Index tokens = rows.rows() / batch, w = layer.width(), hv = s.value_heads;
  const Eigen::Index c = s.conv_channels(), vz = s.value_channels();
  auto part = [&](Eigen::Index column, Eigen::Index heads, Eigen::Index dim) {
    return ConstHeadsView<float>(rows.data() + column, batch, heads, tokens, dim,
                                 HeadStrides{tokens * w, dim, w, 1});
  };
  return {part(0, 1, c), part(c, hv, s.value_dim), part(c + vz, hv, 1), part(c + vz + hv, hv, 1)};
}

HeadsView<float> heads_of(const Layer& layer, Mat& y, Eigen::Index batch) {
  return HeadsView<float>::bnhd(
      y.data(), BnhdShape(batch, y.rows() / batch, layer.shape.value_heads, layer.shape.value_dim));
}

double relative_error(const Mat& a, const Mat& b) {
  return (a - b).cwiseAbs().maxCoeff() / std::max(1e-30f, b.cwiseAbs().maxCoeff());
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const bool big = argc > 1 && std::strcmp(argv[1], "--qwen3.5-9b") == 0;
    linattn::GatedDeltaNetShape shape;  // Qwen3.5-9B's by default
    Eigen::Index model_dim = 4096;
    if (!big) {
      shape.key_heads = 2;
      shape.value_heads = 4;
      shape.key_dim = 64;
      shape.value_dim = 64;
      model_dim = 256;
    }
    std::mt19937 rng(2026);
    const Layer layer = make_layer(shape, model_dim, rng);
    const linattn::GatedDeltaNet<float> mixer(shape, layer.mixer);
    const Eigen::Index batch = 2, prompt = big ? 1024 : 300, decoded = 8, total = prompt + decoded;

    // Hidden states of prompt + decoded tokens (teacher forcing: fixed in advance), [B, N, d].
    const Mat x = random_matrix(batch * total, model_dim, 1.0f, rng);
    auto tokens_of = [&](Eigen::Index first, Eigen::Index count) {
      Mat rows(batch * count, model_dim);
      for (Eigen::Index b = 0; b < batch; ++b) {
        rows.middleRows(b * count, count) = x.middleRows(b * total + first, count);
      }
      return rows;
    };

    // The parallel form over every token: the reference the recurrent form must match.
    Mat projected(batch * total, layer.width());
    projected.noalias() = x * layer.in_proj;
    Mat mixed(batch * total, shape.value_channels());
    mixer.forward_into(split(layer, projected, batch), heads_of(layer, mixed, batch));
    Mat reference(batch * total, model_dim);
    reference.noalias() = mixed * layer.out_proj;

    // Prefill, then one step per token for both sequences.
    auto states = mixer.make_states(batch);
    const auto start = Clock::now();
    const Mat prompt_x = tokens_of(0, prompt);
    Mat prompt_rows(batch * prompt, layer.width());
    prompt_rows.noalias() = prompt_x * layer.in_proj;
    Mat prompt_mixed(batch * prompt, shape.value_channels());
    mixer.prefill_into(states, split(layer, prompt_rows, batch),
                       heads_of(layer, prompt_mixed, batch));
    Mat prompt_out(batch * prompt, model_dim);
    prompt_out.noalias() = prompt_mixed * layer.out_proj;
    double worst = 0.0;
    for (Eigen::Index b = 0; b < batch; ++b) {
      worst = std::max(worst, relative_error(prompt_out.middleRows(b * prompt, prompt),
                                             reference.middleRows(b * total, prompt)));
    }
    Mat token_rows(batch, layer.width()), token_mixed(batch, shape.value_channels());
    Mat token_out(batch, model_dim);
    auto step = [&](decltype(states)& s, Eigen::Index t) {
      token_rows.noalias() = tokens_of(t, 1) * layer.in_proj;
      mixer.step_into(s, split(layer, token_rows, batch), heads_of(layer, token_mixed, batch));
      token_out.noalias() = token_mixed * layer.out_proj;
    };
    for (Eigen::Index t = prompt; t < prompt + decoded / 2; ++t) {
      step(states, t);
      for (Eigen::Index b = 0; b < batch; ++b) {
        worst = std::max(worst, relative_error(token_out.row(b), reference.row(b * total + t)));
      }
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

    // Speculative decoding: 4 drafts through the ring, the first m kept (here 3), against
    // decoding those 3 tokens alone from the same states.
    const Eigen::Index first_draft = prompt + decoded / 2, drafts = 4, kept = 3;
    linattn::DraftRing<linattn::GatedDeltaNetStates<float>> ring(drafts);
    auto alone = states;
    ring.begin(states);
    for (Eigen::Index t = first_draft; t < first_draft + drafts; ++t) {
      step(states, t);
      ring.record(states);
    }
    ring.rollback(states, kept);
    for (Eigen::Index t = first_draft; t < first_draft + kept; ++t) step(alone, t);
    bool same = true;
    for (Eigen::Index i = 0; i < states.recurrent.size(); ++i) {
      same = same && states.recurrent[i].s() == alone.recurrent[i].s();
    }
    for (Eigen::Index b = 0; b < batch; ++b) {
      same = same && states.conv.window(b) == alone.conv.window(b);
    }

    std::printf("Qwen3.5 layer: %ld q/k heads, %ld v heads of %ld, d_model %ld, B = %ld\n",
                static_cast<long>(shape.key_heads), static_cast<long>(shape.value_heads),
                static_cast<long>(shape.value_dim), static_cast<long>(model_dim),
                static_cast<long>(batch));
    std::printf(
        "prefill %ld tokens + %ld steps: %.1f ms; max relative error against the "
        "parallel form %.2e\n",
        static_cast<long>(prompt), static_cast<long>(decoded / 2), seconds * 1e3, worst);
    std::printf("speculative round: %ld drafts, %ld kept: states %s decoding them alone\n",
                static_cast<long>(drafts), static_cast<long>(kept),
                same ? "bit for bit" : "DIFFER from");
    if (!(worst < 1e-4) || !same) {
      std::fprintf(stderr, "example_qwen35_layer: FAILED\n");
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example_qwen35_layer: %s\n", e.what());
    return 1;
  }
}
