// Two RWKV-7 time-mixing layers, whole: where a port of RWKV-7 ("Goose", x070) starts.
//
// RWKV-LM's reference (RWKV-v7/rwkv_v7_numpy.py, time_mixing), for a token x [C] after ln1, the
// previous token's x (last_x, zeros before the first) and a V x K state per head:
//   xr, xw, xk, xv, xa, xg = x + m (last_x - x)            the token shift, one mix each
//   r = Wr xr,  k = Wk xk,  v = Wv xv
//   w = exp(-sigmoid(tanh(xw Ww1) Ww2 + w0) / sqrt(e))      a decay per channel, in (0.54, 1)
//   v += (v_first - v) sigmoid(xv Wv1 Wv2 + v0)             all but the first layer, whose v
//                                                           is v_first
//   a = sigmoid(xa Wa1 Wa2 + a0),  g = sigmoid(xg Wg1) Wg2
//   kk = normalize(k o k_k) per head,  k = k o (1 + (a - 1) o k_a)
//   per head: S = S diag(w) - S kk (kk o a)^T + v k^T,  y = S r
//   y = GroupNorm(y) per head (eps 64e-5) + ((r o k o r_k) . 1) v per head
//   out = Wo (y o g)
// linattn's Rwkv7TimeMix is this whole function but W_o: the token shift (its window the
// last x), the projections and LoRAs, the value residual, the generalized delta rule (q = r,
// a = -kk, b = kk o a, log decays log w, scale 1; its state the reference's transposed), ln_x
// and the bonus. The caller keeps W_o and the residual stream.
//
// The program prefills a prompt through both layers, then decodes token by token (each
// layer's Rwkv7TimeMixStates carrying its last x and states), and checks every output against
// the layers written out in double from the reference (1e-4 relative). It fails otherwise.
//
// Usage: example_rwkv7_layer
#include <cmath>
#include <cstdio>
#include <exception>
#include <linattn/linattn.hpp>
#include <random>
#include <vector>

namespace {

using Mat = linattn::Matrix<float>;  // row-major: one row per token
using MatD = linattn::Matrix<double>;
using VecD = linattn::Vector<double>;
using linattn::BnhdShape;
using linattn::HeadsView;
using Weights = linattn::Rwkv7TimeMixWeights<float>;

// RWKV-7 0.1B: C 768, 12 heads of 64. Small here.
constexpr Eigen::Index kHeads = 2, kHeadSize = 64, kChannels = kHeads * kHeadSize;
constexpr Eigen::Index kLora = 16, kPrompt = 40, kTokens = 50, kLayers = 2;
constexpr double kGroupNormEps = 64e-5;  // 1e-5 * head_size_divisor^2

Mat random_matrix(Eigen::Index rows, Eigen::Index cols, float stddev, float mean,
                  std::mt19937& rng) {
  std::normal_distribution<float> normal(mean, stddev);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

linattn::Vector<float> random_vector(float stddev, float mean, std::mt19937& rng) {
  return random_matrix(kChannels, 1, stddev, mean, rng);
}

/// One layer's parameters in the checkpoint's layouts (Linear weights [out, in]).
Weights random_layer(std::mt19937& rng) {
  const float s = 1.0f / std::sqrt(float(kChannels));
  Weights p;
  for (auto* mix : {&p.x_r, &p.x_w, &p.x_k, &p.x_v, &p.x_a, &p.x_g}) {
    *mix = random_vector(0.2f, 0.5f, rng).cwiseMax(0.0f).cwiseMin(1.0f);
  }
  p.receptance = random_matrix(kChannels, kChannels, s, 0, rng);
  p.key = random_matrix(kChannels, kChannels, s, 0, rng);
  p.value = random_matrix(kChannels, kChannels, s, 0, rng);
  p.w1 = random_matrix(kChannels, kLora, s, 0, rng);
  p.w2 = random_matrix(kLora, kChannels, 0.5f, 0, rng);
  p.w0 = random_vector(1.0f, 0, rng);
  p.a1 = random_matrix(kChannels, kLora, s, 0, rng);
  p.a2 = random_matrix(kLora, kChannels, 0.5f, 0, rng);
  p.a0 = random_vector(1.0f, 0, rng);
  p.v1 = random_matrix(kChannels, kLora, s, 0, rng);
  p.v2 = random_matrix(kLora, kChannels, 0.5f, 0, rng);
  p.v0 = random_vector(1.0f, 0, rng);
  p.g1 = random_matrix(kChannels, kLora, s, 0, rng);
  p.g2 = random_matrix(kLora, kChannels, 0.5f, 0, rng);
  p.k_k = random_vector(0.2f, 1.0f, rng);
  p.k_a = random_vector(0.2f, 1.0f, rng);
  p.r_k = random_matrix(kHeads, kHeadSize, 0.5f, 0, rng);
  p.ln_x_weight = random_vector(0.1f, 1.0f, rng);
  p.ln_x_bias = random_vector(0.1f, 0, rng);
  return p;
}

VecD sigmoid(const VecD& x) { return (1.0 / (1.0 + (-x.array()).exp())).matrix(); }

/// The reference's time mixing in double, one token (x, last_x: C), its V x K states; Wo
/// applied.
VecD reference_token(const Weights& p, const Mat& wo, Eigen::Index layer, const VecD& x,
                     const VecD& last_x, VecD& v_first, std::vector<MatD>& states) {
  const auto d = [](const auto& m) { return m.template cast<double>(); };
  const auto shifted = [&](const linattn::Vector<float>& mix) -> VecD {
    return x + d(mix).cwiseProduct(last_x - x);
  };
  const VecD xr = shifted(p.x_r), xw = shifted(p.x_w), xk = shifted(p.x_k);
  const VecD xv = shifted(p.x_v), xa = shifted(p.x_a), xg = shifted(p.x_g);
  const VecD r = d(p.receptance) * xr;
  VecD k = d(p.key) * xk;
  VecD v = d(p.value) * xv;
  const VecD lw =
      d(p.w2).transpose() * (d(p.w1).transpose() * xw).array().tanh().matrix() + d(p.w0);
  const VecD w = (-sigmoid(lw).array() / std::sqrt(std::exp(1.0))).exp().matrix();
  if (layer == 0) {
    v_first = v;
  } else {
    const VecD gate = sigmoid(d(p.v2).transpose() * (d(p.v1).transpose() * xv) + d(p.v0));
    v += (v_first - v).cwiseProduct(gate);
  }
  const VecD a = sigmoid(d(p.a2).transpose() * (d(p.a1).transpose() * xa) + d(p.a0));
  const VecD g = d(p.g2).transpose() * sigmoid(d(p.g1).transpose() * xg);
  const VecD kk = k.cwiseProduct(d(p.k_k));
  k = (k.array() * (1.0 + (a.array() - 1.0) * d(p.k_a).array())).matrix();
  VecD y(kChannels);
  for (Eigen::Index h = 0; h < kHeads; ++h) {
    const Eigen::Index c = h * kHeadSize;
    VecD kkh = kk.segment(c, kHeadSize);
    kkh /= std::max(kkh.norm(), 1e-12);
    const VecD rh = r.segment(c, kHeadSize), kh = k.segment(c, kHeadSize);
    const VecD vh = v.segment(c, kHeadSize), wh = w.segment(c, kHeadSize);
    const VecD ah = a.segment(c, kHeadSize);
    MatD& s = states[static_cast<std::size_t>(h)];  // V x K
    const VecD s_kk = s * kkh;
    s = s * wh.asDiagonal();
    s -= s_kk * kkh.cwiseProduct(ah).transpose();
    s += vh * kh.transpose();
    VecD yh = s * rh;
    const double mean = yh.mean();
    const double var = (yh.array() - mean).square().mean();
    yh = ((yh.array() - mean) / std::sqrt(var + kGroupNormEps)).matrix();
    yh = yh.cwiseProduct(d(p.ln_x_weight).segment(c, kHeadSize)) +
         d(p.ln_x_bias).segment(c, kHeadSize);
    const double bonus = (rh.array() * kh.array() * d(p.r_k).row(h).transpose().array()).sum();
    y.segment(c, kHeadSize) = yh + bonus * vh;
  }
  return d(wo) * y.cwiseProduct(g);
}

}  // namespace

int main() {
  try {
    std::mt19937 rng(7);
    std::vector<Weights> weights;
    std::vector<Mat> wo;  // the output projections, [out, in]
    for (Eigen::Index l = 0; l < kLayers; ++l) {
      weights.push_back(random_layer(rng));
      wo.push_back(random_matrix(kChannels, kChannels, 1.0f / std::sqrt(float(kChannels)), 0, rng));
    }
    const Mat x = random_matrix(kTokens, kChannels, 1.0f, 0, rng);  // the layers' input

    // The reference, token by token, each layer fed the previous layer's x + out.
    std::vector<std::vector<MatD>> ref_states(
        kLayers, std::vector<MatD>(kHeads, MatD::Zero(kHeadSize, kHeadSize)));
    std::vector<VecD> ref_last(kLayers, VecD::Zero(kChannels));
    MatD expected(kTokens, kChannels);
    for (Eigen::Index t = 0; t < kTokens; ++t) {
      VecD h = x.row(t).transpose().cast<double>();
      VecD v_first;
      for (Eigen::Index l = 0; l < kLayers; ++l) {
        const auto li = static_cast<std::size_t>(l);
        const VecD out =
            reference_token(weights[li], wo[li], l, h, ref_last[li], v_first, ref_states[li]);
        ref_last[li] = h;
        h += out;
      }
      expected.row(t) = h.transpose();
    }

    // linattn: one Rwkv7TimeMix per layer, the prompt through both at once, then one token at
    // a time; W_o and the residual are the caller's.
    std::vector<linattn::Rwkv7TimeMix<float>> mixers;
    std::vector<linattn::Rwkv7TimeMixStates<float>> states;
    for (Eigen::Index l = 0; l < kLayers; ++l) {
      linattn::Rwkv7TimeMixShape shape;
      shape.heads = kHeads;
      shape.head_dim = kHeadSize;
      shape.first_layer = l == 0;
      mixers.emplace_back(shape, weights[static_cast<std::size_t>(l)]);
      states.push_back(mixers.back().make_states(1));
    }
    Mat got(kTokens, kChannels);
    const auto run = [&](Eigen::Index begin, Eigen::Index n) {
      Mat h = x.middleRows(begin, n), v_first(n, kChannels), y(n, kChannels);
      const BnhdShape heads{1, n, kHeads, kHeadSize};
      for (Eigen::Index l = 0; l < kLayers; ++l) {
        const auto li = static_cast<std::size_t>(l);
        const auto x_view =
            linattn::ConstHeadsView<float>::bnhd(h.data(), BnhdShape{1, n, 1, kChannels});
        const auto v_view = HeadsView<float>::bnhd(v_first.data(), heads);
        const auto y_view = HeadsView<float>::bnhd(y.data(), heads);
        if (n == 1) {
          mixers[li].step_into(states[li], x_view, v_view, y_view);
        } else {
          mixers[li].prefill_into(states[li], x_view, v_view, y_view);
        }
        h.noalias() += y * wo[li].transpose();
      }
      got.middleRows(begin, n) = h;
    };
    run(0, kPrompt);
    for (Eigen::Index t = kPrompt; t < kTokens; ++t) run(t, 1);

    const double scale = expected.cwiseAbs().maxCoeff();
    const double prompt_error =
        (got.topRows(kPrompt).cast<double>() - expected.topRows(kPrompt)).cwiseAbs().maxCoeff() /
        scale;
    const double decode_error =
        (got.bottomRows(kTokens - kPrompt).cast<double>() - expected.bottomRows(kTokens - kPrompt))
            .cwiseAbs()
            .maxCoeff() /
        scale;
    // The reference's state is linattn's transposed: the last layer's head 1, compared.
    const double state_error =
        (states.back().recurrent[1].s().cast<double>() - ref_states.back()[1].transpose())
            .cwiseAbs()
            .maxCoeff() /
        ref_states.back()[1].cwiseAbs().maxCoeff();
    std::printf("RWKV-7, %ld layers of %ld heads of %ld: prompt of %ld tokens, %ld decoded\n",
                static_cast<long>(kLayers), static_cast<long>(kHeads), static_cast<long>(kHeadSize),
                static_cast<long>(kPrompt), static_cast<long>(kTokens - kPrompt));
    std::printf(
        "max relative error against the reference in double: prompt %.2e, decoding "
        "%.2e, state %.2e\n",
        prompt_error, decode_error, state_error);
    if (!(prompt_error < 1e-4 && decode_error < 1e-4 && state_error < 1e-4)) {
      std::printf("FAILED: above 1e-4\n");
      return 1;
    }
    std::printf("ok\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
