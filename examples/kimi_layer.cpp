// One Kimi Linear KDA layer, whole: where a port of Kimi Linear starts.
//
// FLA's KimiDeltaAttention (fla/layers/kda.py, the layer Kimi Linear runs), for a hidden state
// x [N, d]:
//   q, k, v = silu(conv(q_proj x)), silu(conv(k_proj x)), silu(conv(v_proj x))   (K = 4 taps)
//   g = -exp(A_log_h) softplus(f_proj(x) + dt_bias)   a decay per head and key channel
//       (f_proj is two GEMMs: d -> Dv -> H Dk)
//   beta = sigmoid(b_proj x)
//   q, k = l2norm(q), l2norm(k) (x / sqrt(|x|^2 + 1e-6)); q scaled by Dk^-1/2
//   per head: S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,
//             o_t = S_t^T q_t
//   o = w rmsnorm(o) sigmoid(g_proj x) per head (FusedRMSNormGated, activation "sigmoid",
//       eps = norm_eps 1e-5; g_proj is two GEMMs, the second with bias)
//   out = o_proj(o)
// linattn's GatedDeltaNet with GatedDeltaNetModel::kimi_linear computes everything between
// the projections, reading q_proj, k_proj and v_proj's outputs as one [N, C] buffer (three
// column blocks: the three convolutions as one), f_proj's as `a`, b_proj's as `b`, g_proj's as
// `z`. The projections are the caller's GEMMs.
//
// The program prefills a prompt, then decodes token by token, and checks every output against
// the layer written out in double from FLA's code (1e-4 relative). It fails otherwise.
//
// Usage: example_kimi_layer
#include <cmath>
#include <cstdio>
#include <exception>
#include <linattn/linattn.hpp>
#include <random>

namespace {

using Mat = linattn::Matrix<float>;  // row-major: one row per token
using MatD = linattn::Matrix<double>;
using Vec = linattn::Vector<float>;
using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::HeadStrides;
using linattn::HeadsView;

// Kimi Linear 48B: d 2304, 32 heads of 128, K = 4. Small here.
constexpr Eigen::Index kModel = 64, kHeads = 4, kDim = 16, kTaps = 4;
constexpr Eigen::Index kChannels = kHeads * kDim;  // key_dim = value_dim
constexpr double kNormEps = 1e-5;
constexpr Eigen::Index kPrompt = 70, kTokens = 80;

Mat random_matrix(Eigen::Index rows, Eigen::Index cols, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

/// The layer's weights (FLA's Linear weights transposed: x W).
struct Layer {
  Mat qkv_proj;        // d x 3 H Dk: q_proj, k_proj, v_proj side by side
  Mat f_a, f_b;        // f_proj: d x Dv, Dv x H Dk
  Mat b_proj;          // d x H
  Mat g_a, g_b;        // g_proj: d x Dv, Dv x H Dv
  Vec g_bias;          // H Dv: g_proj's second bias
  Mat o_proj;          // H Dv x d
  Mat conv;            // 3 H Dk x K: the three convolutions' taps
  Vec a_log, dt_bias;  // H; H Dk
  Vec norm_weight;     // Dv
};

Layer make_layer(std::mt19937& rng) {
  const float s = 1.0f / std::sqrt(float(kModel)), s_v = 1.0f / std::sqrt(float(kDim));
  Layer layer;
  layer.qkv_proj = random_matrix(kModel, 3 * kChannels, s, rng);
  layer.f_a = random_matrix(kModel, kDim, s, rng);
  layer.f_b = random_matrix(kDim, kChannels, s_v, rng);
  layer.b_proj = random_matrix(kModel, kHeads, s, rng);
  layer.g_a = random_matrix(kModel, kDim, s, rng);
  layer.g_b = random_matrix(kDim, kChannels, s_v, rng);
  layer.g_bias = random_matrix(kChannels, 1, 0.1f, rng);
  layer.o_proj = random_matrix(kChannels, kModel, 1.0f / std::sqrt(float(kChannels)), rng);
  layer.conv = random_matrix(3 * kChannels, kTaps, 0.5f, rng);
  std::uniform_real_distribution<float> rate(1.0f, 16.0f);  // A_log = log U(1, 16), as FLA
  layer.a_log.resize(kHeads);
  for (Eigen::Index h = 0; h < kHeads; ++h) layer.a_log(h) = std::log(rate(rng));
  layer.dt_bias = random_matrix(kChannels, 1, 0.5f, rng);
  layer.norm_weight = Vec::Ones(kDim) + random_matrix(kDim, 1, 0.1f, rng);
  return layer;
}

// --- The reference: FLA's KimiDeltaAttention in double ---

double silu(double v) { return v / (1.0 + std::exp(-v)); }
double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }
double softplus(double v) { return v > 20.0 ? v : std::log1p(std::exp(v)); }

MatD reference(const Layer& layer, const MatD& x) {
  const Eigen::Index n = x.rows();
  const MatD proj = x * layer.qkv_proj.cast<double>();
  MatD qkv(n, 3 * kChannels);  // ShortConvolution with silu, per channel
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index c = 0; c < 3 * kChannels; ++c) {
      double sum = 0;
      for (Eigen::Index i = 0; i < kTaps; ++i) {
        const Eigen::Index src = t - (kTaps - 1 - i);
        if (src >= 0) sum += double(layer.conv(c, i)) * proj(src, c);
      }
      qkv(t, c) = silu(sum);
    }
  }
  const MatD f = x * layer.f_a.cast<double>() * layer.f_b.cast<double>();
  const MatD b = x * layer.b_proj.cast<double>();
  MatD gate = x * layer.g_a.cast<double>() * layer.g_b.cast<double>();
  gate.rowwise() += layer.g_bias.cast<double>().transpose();
  MatD o(n, kChannels);
  const double scale = 1.0 / std::sqrt(double(kDim));
  for (Eigen::Index h = 0; h < kHeads; ++h) {
    MatD state = MatD::Zero(kDim, kDim);  // Dk x Dv
    const double a = std::exp(double(layer.a_log(h)));
    for (Eigen::Index t = 0; t < n; ++t) {
      linattn::Vector<double> q = qkv.block(t, h * kDim, 1, kDim).transpose();
      linattn::Vector<double> k = qkv.block(t, kChannels + h * kDim, 1, kDim).transpose();
      const linattn::Vector<double> v = qkv.block(t, 2 * kChannels + h * kDim, 1, kDim).transpose();
      q /= std::sqrt(q.squaredNorm() + 1e-6);
      k /= std::sqrt(k.squaredNorm() + 1e-6);
      q *= scale;
      for (Eigen::Index i = 0; i < kDim; ++i) {
        const double g = -a * softplus(f(t, h * kDim + i) + double(layer.dt_bias(h * kDim + i)));
        state.row(i) *= std::exp(g);
      }
      const double beta = sigmoid(b(t, h));
      const linattn::Vector<double> predicted = state.transpose() * k;
      state += beta * k * (v - predicted).transpose();
      o.block(t, h * kDim, 1, kDim) = (state.transpose() * q).transpose();
    }
  }
  for (Eigen::Index t = 0; t < n; ++t) {  // FusedRMSNormGated, sigmoid, per head
    for (Eigen::Index h = 0; h < kHeads; ++h) {
      auto head = o.block(t, h * kDim, 1, kDim);
      head /= std::sqrt(head.squaredNorm() / double(kDim) + kNormEps);
      for (Eigen::Index i = 0; i < kDim; ++i)
        head(0, i) *= double(layer.norm_weight(i)) * sigmoid(gate(t, h * kDim + i));
    }
  }
  return o * layer.o_proj.cast<double>();
}

// --- linattn ---

/// The layer over rows x (n x d) continuing `states` (n = 1: one decoding step).
Mat run(const Layer& layer, const linattn::GatedDeltaNet<float>& mixer,
        linattn::GatedDeltaNet<float>::States& states, const Mat& x) {
  const Eigen::Index n = x.rows();
  const Mat qkv = x * layer.qkv_proj;       // [q | k | v]: the three convolutions' inputs
  const Mat f = x * layer.f_a * layer.f_b;  // the decay gates' input, H x Dk per token
  const Mat b = x * layer.b_proj;           // beta's input
  Mat z = x * layer.g_a * layer.g_b;        // the norm's gate
  z.rowwise() += layer.g_bias.transpose();
  const BnhdShape heads(1, n, kHeads, kDim);
  const linattn::GatedDeltaNetInputs<float> in{
      ConstHeadsView<float>::bnhd(qkv.data(), BnhdShape(1, n, 1, 3 * kChannels)),
      ConstHeadsView<float>::bnhd(z.data(), heads),
      ConstHeadsView<float>::bnhd(b.data(), BnhdShape(1, n, kHeads, 1)),
      ConstHeadsView<float>::bnhd(f.data(), heads)};
  Mat o(n, kChannels);
  const auto out = HeadsView<float>::bnhd(o.data(), heads);
  if (n == 1) {
    mixer.step_into(states, in, out);
  } else {
    mixer.prefill_into(states, in, out);
  }
  return o * layer.o_proj;
}

int run_example() {
  std::mt19937 rng(3);
  const Layer layer = make_layer(rng);
  const Mat x = random_matrix(kTokens, kModel, 1.0f, rng);
  linattn::GatedDeltaNetShape shape;
  shape.model = linattn::GatedDeltaNetModel::kimi_linear;
  shape.key_heads = kHeads;
  shape.value_heads = kHeads;
  shape.key_dim = kDim;
  shape.value_dim = kDim;
  shape.conv_kernel = kTaps;
  linattn::GatedDeltaNetOptions options;
  options.norm_eps = kNormEps;  // FLA's norm_eps default
  const linattn::GatedDeltaNet<float> mixer(
      shape,
      linattn::GatedDeltaNetWeights<float>{layer.conv, layer.a_log, layer.dt_bias,
                                           layer.norm_weight},
      options);
  auto states = mixer.make_states(1);

  Mat y(kTokens, kModel);
  y.topRows(kPrompt) = run(layer, mixer, states, x.topRows(kPrompt));
  for (Eigen::Index t = kPrompt; t < kTokens; ++t) y.row(t) = run(layer, mixer, states, x.row(t));
  const MatD want = reference(layer, x.cast<double>());
  const double error = (y.cast<double>() - want).cwiseAbs().maxCoeff() / want.cwiseAbs().maxCoeff();
  std::printf(
      "Kimi Linear KDA layer: %lld heads of %lld, decay gates per key channel; %lld "
      "prompt tokens in one call, %lld decoded\n",
      static_cast<long long>(kHeads), static_cast<long long>(kDim), static_cast<long long>(kPrompt),
      static_cast<long long>(kTokens - kPrompt));
  std::printf(
      "  against FLA's KimiDeltaAttention written out in double: %.2e relative (bound "
      "1e-4)\n",
      error);
  if (!(error < 1e-4)) {
    std::printf("FAIL\n");
    return 1;
  }
  std::printf("OK\n");
  return 0;
}

}  // namespace

int main() {
  try {
    return run_example();
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
}
