// One Nemotron-H Mamba-2 block, whole: where a port of Nemotron-H (or Granite 4, whose Mamba
// layers are the same mixer) starts.
//
// HF's NemotronHBlock with a Mamba-2 mixer (NemotronHMamba2Mixer), for a hidden state x:
//   [z | xBC | dt] = in_proj(rmsnorm(x))                 (d_inner, d_inner + 2 G N, H columns)
//   xBC = silu(conv1d(xBC) + conv_bias)                  (depthwise, causal, K = 4 taps)
//   x, B, C = xBC split (d_inner, G N, G N); dt = softplus(dt + dt_bias); A = -exp(A_log)
//   per head h, with B and C of group h / (H / G) (repeat_interleave):
//     S_t = exp(dt_t A_h) S_{t-1} + dt_t B_t x_t^T,  y_t = C_t^T S_t + D_h x_t
//   y = w * rmsnorm_per_group(y * silu(z))               (groups of d_inner / G channels)
//   out = x + out_proj(y)
// with rmsnorm(v) = w v / sqrt(mean(v^2) + 1e-5) (layer_norm_epsilon). linattn computes the
// block's norm (OutputNorm) and the mixer (Mamba2, reading in_proj's rows in place); the
// projections are the caller's GEMMs.
//
// The program prefills a prompt, then decodes token by token, and checks every output against
// the block written out in double from HF's modeling_nemotron_h.py (1e-4 relative). It fails
// otherwise.
//
// Usage: example_nemotron_h_layer
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

constexpr Eigen::Index kPrompt = 21, kTokens = 30;
constexpr double kEps = 1e-5;

/// Nemotron-H-8B: d_model 4096, 128 heads of 64, 8 groups, N = 128, K = 4. Small here.
linattn::Mamba2Shape mixer_shape() {
  linattn::Mamba2Shape shape;
  shape.heads = 8;
  shape.head_dim = 8;
  shape.groups = 2;
  shape.state_dim = 16;
  shape.conv_kernel = 4;
  return shape;
}
constexpr Eigen::Index kModel = 64;

Mat random_matrix(Eigen::Index rows, Eigen::Index cols, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

/// The block's weights (HF's Linear weights transposed: x W).
struct Block {
  Mat in_proj, out_proj;
  Vec norm;
  linattn::Mamba2Weights<float> mixer;
};

/// Weights as Mamba-2 initialises them: A in [1, 16], dt in [1e-3, 0.1] through dt_bias, D 1.
Block make_block(std::mt19937& rng) {
  const linattn::Mamba2Shape s = mixer_shape();
  Block block;
  const Eigen::Index width = s.inner() + s.conv_channels() + s.heads;
  block.in_proj = random_matrix(kModel, width, 1.0f / std::sqrt(float(kModel)), rng);
  block.out_proj = random_matrix(s.inner(), kModel, 1.0f / std::sqrt(float(s.inner())), rng);
  block.norm = Vec::Ones(kModel) + random_matrix(kModel, 1, 0.1f, rng);
  block.mixer.conv_weight = random_matrix(s.conv_channels(), s.conv_kernel, 0.5f, rng);
  block.mixer.conv_bias = random_matrix(s.conv_channels(), 1, 0.1f, rng);
  block.mixer.a_log.resize(s.heads);
  block.mixer.dt_bias.resize(s.heads);
  for (Eigen::Index h = 0; h < s.heads; ++h) {
    const float f = float(h) / float(s.heads);
    block.mixer.a_log(h) = std::log(1.0f + 15.0f * f);
    const float dt = 1e-3f * std::pow(100.0f, f);
    block.mixer.dt_bias(h) = dt + std::log(-std::expm1(-dt));  // softplus^-1(dt)
  }
  block.mixer.d = Vec::Ones(s.heads);
  block.mixer.norm_weight = Vec::Ones(s.inner()) + random_matrix(s.inner(), 1, 0.1f, rng);
  return block;
}

// --- The reference: HF's NemotronHBlock and NemotronHMamba2Mixer in double ---

double silu(double v) { return v / (1.0 + std::exp(-v)); }
double softplus(double v) { return v > 20.0 ? v : std::log1p(std::exp(v)); }

MatD reference(const Block& block, const MatD& x) {
  const linattn::Mamba2Shape s = mixer_shape();
  const Eigen::Index n = x.rows(), di = s.inner(), gn = s.groups * s.state_dim;
  const Eigen::Index c = s.conv_channels(), per_group = s.heads / s.groups;
  MatD normed(n, kModel);
  for (Eigen::Index t = 0; t < n; ++t) {
    normed.row(t) = x.row(t) / std::sqrt(x.row(t).squaredNorm() / double(kModel) + kEps);
    normed.row(t) = normed.row(t).cwiseProduct(block.norm.cast<double>().transpose());
  }
  const MatD proj = normed * block.in_proj.cast<double>();
  const MatD z = proj.leftCols(di), xbc_in = proj.middleCols(di, c),
             dt_in = proj.rightCols(s.heads);
  MatD xbc = MatD::Zero(n, c);
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index ch = 0; ch < c; ++ch) {
      double sum = block.mixer.conv_bias(ch);
      for (Eigen::Index i = 0; i < s.conv_kernel; ++i) {
        const Eigen::Index src = t - (s.conv_kernel - 1 - i);
        if (src >= 0) sum += double(block.mixer.conv_weight(ch, i)) * xbc_in(src, ch);
      }
      xbc(t, ch) = silu(sum);
    }
  }
  MatD y(n, di);
  for (Eigen::Index h = 0; h < s.heads; ++h) {
    const Eigen::Index g = h / per_group;
    const double a = -std::exp(double(block.mixer.a_log(h)));
    MatD state = MatD::Zero(s.state_dim, s.head_dim);  // N x P
    for (Eigen::Index t = 0; t < n; ++t) {
      const double dt = softplus(dt_in(t, h) + double(block.mixer.dt_bias(h)));
      const auto xh = xbc.block(t, h * s.head_dim, 1, s.head_dim);
      const auto bg = xbc.block(t, di + g * s.state_dim, 1, s.state_dim);
      const auto cg = xbc.block(t, di + gn + g * s.state_dim, 1, s.state_dim);
      state = std::exp(dt * a) * state + dt * bg.transpose() * xh;
      y.block(t, h * s.head_dim, 1, s.head_dim) = cg * state + double(block.mixer.d(h)) * xh;
    }
  }
  // MambaRMSNormGated: the gate first, then an RMS per group of d_inner / G channels.
  MatD gated = y.cwiseProduct(z.unaryExpr([](double v) { return silu(v); }));
  const Eigen::Index group = di / s.groups;
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index g = 0; g < s.groups; ++g) {
      auto part = gated.block(t, g * group, 1, group);
      part /= std::sqrt(part.squaredNorm() / double(group) + kEps);
    }
    gated.row(t) = gated.row(t).cwiseProduct(block.mixer.norm_weight.cast<double>().transpose());
  }
  return x + gated * block.out_proj.cast<double>();
}

// --- linattn ---

/// The block over rows x (n x d) continuing `states` (n = 1: one decoding step).
Mat run(const Block& block, const linattn::OutputNorm<float>& norm,
        const linattn::Mamba2<float>& mixer, linattn::Mamba2<float>::States& states, const Mat& x) {
  const linattn::Mamba2Shape s = mixer_shape();
  const Eigen::Index n = x.rows();
  Mat normed(n, kModel);
  norm.apply_into(ConstHeadsView<float>::bnhd(x.data(), BnhdShape(1, n, 1, kModel)),
                  HeadsView<float>::bnhd(normed.data(), BnhdShape(1, n, 1, kModel)));
  const Mat proj = normed * block.in_proj;  // [z | xBC | dt] per token, read in place
  const Eigen::Index w = proj.cols();
  const auto view = [&](Eigen::Index column, Eigen::Index heads, Eigen::Index dim) {
    return ConstHeadsView<float>(proj.data() + column, 1, heads, n, dim,
                                 HeadStrides{n * w, dim, w, 1});
  };
  const linattn::Mamba2Inputs<float> in{view(0, s.heads, s.head_dim),
                                        view(s.inner(), 1, s.conv_channels()),
                                        view(s.inner() + s.conv_channels(), s.heads, 1)};
  Mat y(n, s.inner());
  const auto out = HeadsView<float>::bnhd(y.data(), BnhdShape(1, n, s.heads, s.head_dim));
  if (n == 1) {
    mixer.step_into(states, in, out);
  } else {
    mixer.prefill_into(states, in, out);
  }
  return x + y * block.out_proj;
}

int run_example() {
  std::mt19937 rng(7);
  const Block block = make_block(rng);
  const Mat x = random_matrix(kTokens, kModel, 1.0f, rng);
  linattn::OutputNormOptions norm_options;
  norm_options.type = linattn::NormType::rms;
  norm_options.gate = linattn::NormGate::none;
  norm_options.eps = kEps;
  const linattn::OutputNorm<float> norm(block.norm, norm_options);
  linattn::Mamba2Options options;  // norm per group of d_inner / G, eps 1e-5: Nemotron-H's
  const linattn::Mamba2<float> mixer(mixer_shape(), block.mixer, options);
  auto states = mixer.make_states(1);

  Mat y(kTokens, kModel);
  y.topRows(kPrompt) = run(block, norm, mixer, states, x.topRows(kPrompt));
  for (Eigen::Index t = kPrompt; t < kTokens; ++t)
    y.row(t) = run(block, norm, mixer, states, x.row(t));
  const MatD want = reference(block, x.cast<double>());
  const double error = (y.cast<double>() - want).cwiseAbs().maxCoeff() / want.cwiseAbs().maxCoeff();
  const linattn::Mamba2Shape s = mixer_shape();
  std::printf(
      "Nemotron-H Mamba-2 block: %lld heads of %lld in %lld groups (B and C shared by %lld "
      "consecutive heads), N = %lld; %lld prompt tokens in one call, %lld decoded\n",
      static_cast<long long>(s.heads), static_cast<long long>(s.head_dim),
      static_cast<long long>(s.groups), static_cast<long long>(s.heads / s.groups),
      static_cast<long long>(s.state_dim), static_cast<long long>(kPrompt),
      static_cast<long long>(kTokens - kPrompt));
  std::printf("  against HF's NemotronHBlock written out in double: %.2e relative (bound 1e-4)\n",
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
