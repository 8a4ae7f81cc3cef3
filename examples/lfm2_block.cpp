// One LFM2 convolution block, whole: where a port of LFM2 (Liquid's hybrid of gated short
// convolutions and attention) starts.
//
// HF's Lfm2DecoderLayer with a short-convolution operator, for a hidden state x [N, d]:
//   h = x + out_proj(c * conv(b * x')),  [b | c | x'] = in_proj(rmsnorm(x))   (Lfm2ShortConv)
//   y = h + w2(silu(w1(g)) * w3(g)),     g = rmsnorm(h)                       (Lfm2MLP)
// where rmsnorm is x / sqrt(mean(x^2) + eps) times its weight (w itself, eps = norm_eps, 1e-5)
// and conv is a depthwise causal Conv1d of L_cache = 3 taps without bias (conv_bias = false).
// linattn computes the norm (OutputNorm, ungated RMS over one head of d channels) and the
// operator (GatedShortConv, reading in_proj's rows in place); the projections and the MLP are
// the caller's GEMMs.
//
// The program prefills a prompt, then decodes token by token from the convolution's window,
// and checks every output against the block written out in double from HF's modeling_lfm2.py
// (1e-4 relative), and the window against HF's conv cache after the prompt (which holds the
// last L_cache inputs of the convolution, the window the last L_cache - 1). It fails otherwise.
//
// Usage: example_lfm2_block
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
using linattn::HeadsView;

constexpr Eigen::Index kModel = 64, kFeedForward = 128, kTaps = 3;  // LFM2-350M: 1024, 6656, 3
constexpr double kNormEps = 1e-5;
constexpr Eigen::Index kPrompt = 9, kTokens = 16;

Mat random_matrix(Eigen::Index rows, Eigen::Index cols, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

/// The block's weights, HF's Linear weights transposed (x W: d_in x d_out).
struct Block {
  Mat in_proj, conv, out_proj, w1, w3, w2;
  Vec operator_norm, ffn_norm;
};

Block make_block(std::mt19937& rng) {
  const float s = 1.0f / std::sqrt(float(kModel));
  return {random_matrix(kModel, 3 * kModel, s, rng),
          random_matrix(kModel, kTaps, 0.5f, rng),
          random_matrix(kModel, kModel, s, rng),
          random_matrix(kModel, kFeedForward, s, rng),
          random_matrix(kModel, kFeedForward, s, rng),
          random_matrix(kFeedForward, kModel, 1.0f / std::sqrt(float(kFeedForward)), rng),
          (Vec::Ones(kModel) + random_matrix(kModel, 1, 0.1f, rng)).eval(),
          (Vec::Ones(kModel) + random_matrix(kModel, 1, 0.1f, rng)).eval()};
}

// --- The reference: HF's modeling_lfm2.py written out in double ---

MatD rmsnorm(const MatD& x, const linattn::Vector<double>& w) {
  MatD y(x.rows(), x.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    const double scale = 1.0 / std::sqrt(x.row(t).squaredNorm() / double(x.cols()) + kNormEps);
    y.row(t) = (x.row(t) * scale).cwiseProduct(w.transpose());
  }
  return y;
}

double silu(double v) { return v / (1.0 + std::exp(-v)); }

/// The block over x (N x d) from nothing cached; `cache` gets HF's conv cache after it
/// (d x L_cache: the last L_cache inputs b * x', zeros before the first).
MatD reference(const Block& block, const MatD& x, MatD& cache) {
  const Eigen::Index n = x.rows();
  const MatD bcx = rmsnorm(x, block.operator_norm.cast<double>()) * block.in_proj.cast<double>();
  const MatD b = bcx.leftCols(kModel), c = bcx.middleCols(kModel, kModel);
  const MatD bx = b.cwiseProduct(bcx.rightCols(kModel));
  // Conv1d(d, d, L_cache, groups=d, padding=L_cache - 1)[..., :N]: tap i reads t - (K-1-i).
  MatD conv_out = MatD::Zero(n, kModel);
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index i = 0; i < kTaps; ++i) {
      const Eigen::Index src = t - (kTaps - 1 - i);
      if (src < 0) continue;
      conv_out.row(t) += bx.row(src).cwiseProduct(block.conv.col(i).cast<double>().transpose());
    }
  }
  cache = MatD::Zero(kModel, kTaps);
  for (Eigen::Index j = 0; j < kTaps; ++j) {
    const Eigen::Index src = n - kTaps + j;
    if (src >= 0) cache.col(j) = bx.row(src).transpose();
  }
  const MatD h = x + c.cwiseProduct(conv_out) * block.out_proj.cast<double>();
  const MatD g = rmsnorm(h, block.ffn_norm.cast<double>());
  MatD gate = g * block.w1.cast<double>();
  gate = gate.unaryExpr([](double v) { return silu(v); });
  return h + gate.cwiseProduct(g * block.w3.cast<double>()) * block.w2.cast<double>();
}

// --- linattn ---

/// The block over rows x (n x d) continuing `windows` (n = 1: one decoding step).
Mat run(const Block& block, const linattn::OutputNorm<float>& operator_norm,
        const linattn::OutputNorm<float>& ffn_norm, const linattn::GatedShortConv<float>& conv,
        linattn::ConvWindows<float>& windows, const Mat& x) {
  const Eigen::Index n = x.rows();
  const BnhdShape rows(1, n, 1, kModel);
  Mat normed(n, kModel);
  operator_norm.apply_into(ConstHeadsView<float>::bnhd(x.data(), rows),
                           HeadsView<float>::bnhd(normed.data(), rows));
  const Mat bcx = normed * block.in_proj;  // [b | c | x'] per token, read in place
  Mat y(n, kModel);
  const auto in = ConstHeadsView<float>::bnhd(bcx.data(), BnhdShape(1, n, 1, 3 * kModel));
  const auto out = HeadsView<float>::bnhd(y.data(), rows);
  if (n == 1) {
    conv.step_into(windows, in, out);
  } else {
    conv.prefill_into(windows, in, out);
  }
  const Mat h = x + y * block.out_proj;
  Mat g(n, kModel);
  ffn_norm.apply_into(ConstHeadsView<float>::bnhd(h.data(), rows),
                      HeadsView<float>::bnhd(g.data(), rows));
  Mat gate = g * block.w1;
  gate = gate.unaryExpr([](float v) { return v / (1.0f + std::exp(-v)); });
  return h + gate.cwiseProduct(g * block.w3) * block.w2;
}

linattn::OutputNorm<float> rms_norm(const Vec& weight) {
  linattn::OutputNormOptions options;
  options.type = linattn::NormType::rms;
  options.gate = linattn::NormGate::none;
  options.eps = kNormEps;
  return linattn::OutputNorm<float>(weight, options);
}

int run_example() {
  std::mt19937 rng(42);
  const Block block = make_block(rng);
  const Mat x = random_matrix(kTokens, kModel, 1.0f, rng);
  const linattn::OutputNorm<float> operator_norm = rms_norm(block.operator_norm);
  const linattn::OutputNorm<float> ffn_norm = rms_norm(block.ffn_norm);
  const linattn::GatedShortConv<float> conv(block.conv);  // no bias: conv_bias = false
  auto windows = conv.make_states(1);

  // The prompt in one call, then a token at a time.
  Mat y(kTokens, kModel);
  y.topRows(kPrompt) = run(block, operator_norm, ffn_norm, conv, windows, x.topRows(kPrompt));
  MatD cache;
  reference(block, x.topRows(kPrompt).cast<double>(), cache);
  // HF's conv cache after the prompt: the window is its last L_cache - 1 columns, transposed.
  const double window_error =
      (windows.window(0).cast<double>() - cache.rightCols(kTaps - 1).transpose())
          .cwiseAbs()
          .maxCoeff() /
      cache.cwiseAbs().maxCoeff();
  for (Eigen::Index t = kPrompt; t < kTokens; ++t) {
    y.row(t) = run(block, operator_norm, ffn_norm, conv, windows, x.row(t));
  }
  const MatD want = reference(block, x.cast<double>(), cache);
  const double error = (y.cast<double>() - want).cwiseAbs().maxCoeff() / want.cwiseAbs().maxCoeff();
  std::printf(
      "LFM2 block, d = %lld, L_cache = %lld: %lld prompt tokens in one call, %lld decoded\n",
      static_cast<long long>(kModel), static_cast<long long>(kTaps),
      static_cast<long long>(kPrompt), static_cast<long long>(kTokens - kPrompt));
  std::printf("  against HF's Lfm2DecoderLayer written out in double: %.2e relative (bound 1e-4)\n",
              error);
  std::printf("  the window against HF's conv cache after the prompt: %.2e (bound 1e-5)\n",
              window_error);
  if (!(error < 1e-4) || !(window_error < 1e-5)) {
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
