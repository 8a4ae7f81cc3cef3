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
// The recurrence is linattn's generalized delta rule with q = r, a = -kk, b = kk o a, log
// decays log w and scale 1, its state S = the reference's transposed (DplrDeltaRuleLayer,
// states from make_states); the GroupNorm is OutputNorm::rwkv7. The projections, LoRAs, token
// shift and bonus are the caller's (here, Eigen).
//
// The program prefills a prompt through both layers, then decodes token by token (carrying
// each layer's last x and states), and checks every output against the layers written out in
// double from the reference (1e-4 relative). It fails otherwise.
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
using linattn::BnhdShape;
using linattn::HeadsView;

// RWKV-7 0.1B: C 768, 12 heads of 64. Small here.
constexpr Eigen::Index kHeads = 2, kHeadSize = 64, kChannels = kHeads * kHeadSize;
constexpr Eigen::Index kLora = 16, kPrompt = 40, kTokens = 50, kLayers = 2;
constexpr double kGroupNormEps = 64e-5;  // 1e-5 * head_size_divisor^2

Mat random_matrix(Eigen::Index rows, Eigen::Index cols, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

/// One layer's weights, as x W (the reference's W x transposed); vectors as 1 x C rows.
struct Layer {
  Mat mix;             // 6 x C: mr, mw, mk, mv, ma, mg
  Mat wr, wk, wv, wo;  // C x C
  Mat ww1, ww2, w0;    // C x L, L x C, 1 x C
  Mat wa1, wa2, a0;    // the in-context learning rate a
  Mat wv1, wv2, v0;    // the value residual (unused by layer 0)
  Mat wg1, wg2;        // the output gate
  Mat k_k, k_a, r_k;   // 1 x C each (r_k per head, flattened)
  Mat ln_w, ln_b;      // 1 x C: ln_x
  explicit Layer(std::mt19937& rng) {
    const float s = 1.0f / std::sqrt(float(kChannels));
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    mix = Mat(6, kChannels);
    for (Eigen::Index i = 0; i < mix.size(); ++i) mix.data()[i] = unit(rng);
    wr = random_matrix(kChannels, kChannels, s, rng);
    wk = random_matrix(kChannels, kChannels, s, rng);
    wv = random_matrix(kChannels, kChannels, s, rng);
    wo = random_matrix(kChannels, kChannels, s, rng);
    ww1 = random_matrix(kChannels, kLora, s, rng);
    ww2 = random_matrix(kLora, kChannels, 0.5f, rng);
    w0 = random_matrix(1, kChannels, 1.0f, rng);
    wa1 = random_matrix(kChannels, kLora, s, rng);
    wa2 = random_matrix(kLora, kChannels, 0.5f, rng);
    a0 = random_matrix(1, kChannels, 1.0f, rng);
    wv1 = random_matrix(kChannels, kLora, s, rng);
    wv2 = random_matrix(kLora, kChannels, 0.5f, rng);
    v0 = random_matrix(1, kChannels, 1.0f, rng);
    wg1 = random_matrix(kChannels, kLora, s, rng);
    wg2 = random_matrix(kLora, kChannels, 0.5f, rng);
    k_k = (random_matrix(1, kChannels, 0.2f, rng).array() + 1.0f).matrix();
    k_a = (random_matrix(1, kChannels, 0.2f, rng).array() + 1.0f).matrix();
    r_k = random_matrix(1, kChannels, 0.5f, rng);
    ln_w = (random_matrix(1, kChannels, 0.1f, rng).array() + 1.0f).matrix();
    ln_b = random_matrix(1, kChannels, 0.1f, rng);
  }
};

template <class M>
M sigmoid(const M& x) {
  return (1.0 / (1.0 + (-x.array().template cast<double>()).exp()))
      .template cast<typename M::Scalar>()
      .matrix();
}

/// The reference's time mixing in double, one token (x, last_x: 1 x C), its V x K states.
MatD reference_token(const Layer& p, Eigen::Index layer, const MatD& x, const MatD& last_x,
                     MatD& v_first, std::vector<MatD>& states) {
  const MatD mix = p.mix.cast<double>();
  const auto shifted = [&](int i) -> MatD {
    return (x.array() + mix.row(i).array() * (last_x - x).array()).matrix();
  };
  const MatD xr = shifted(0), xw = shifted(1), xk = shifted(2), xv = shifted(3);
  const MatD xa = shifted(4), xg = shifted(5);
  const MatD r = xr * p.wr.cast<double>();
  MatD k = xk * p.wk.cast<double>();
  MatD v = xv * p.wv.cast<double>();
  const MatD lw = (xw * p.ww1.cast<double>()).array().tanh().matrix() * p.ww2.cast<double>() +
                  p.w0.cast<double>();
  const MatD w = (-sigmoid(lw).array() / std::sqrt(std::exp(1.0))).exp().matrix();
  if (layer == 0) {
    v_first = v;
  } else {
    const MatD gate =
        sigmoid(MatD(xv * p.wv1.cast<double>() * p.wv2.cast<double>() + p.v0.cast<double>()));
    v = (v.array() + (v_first - v).array() * gate.array()).matrix();
  }
  const MatD a =
      sigmoid(MatD(xa * p.wa1.cast<double>() * p.wa2.cast<double>() + p.a0.cast<double>()));
  const MatD g = sigmoid(MatD(xg * p.wg1.cast<double>())) * p.wg2.cast<double>();
  MatD kk = k.cwiseProduct(p.k_k.cast<double>());
  k = (k.array() * (1.0 + (a.array() - 1.0) * p.k_a.cast<double>().array())).matrix();
  MatD y(1, kChannels);
  for (Eigen::Index h = 0; h < kHeads; ++h) {
    const Eigen::Index c = h * kHeadSize;
    Eigen::RowVectorXd kkh = kk.row(0).segment(c, kHeadSize);
    kkh /= std::max(kkh.norm(), 1e-12);
    const Eigen::RowVectorXd rh = r.row(0).segment(c, kHeadSize);
    const Eigen::RowVectorXd kh = k.row(0).segment(c, kHeadSize);
    const Eigen::RowVectorXd vh = v.row(0).segment(c, kHeadSize);
    const Eigen::RowVectorXd wh = w.row(0).segment(c, kHeadSize);
    const Eigen::RowVectorXd ah = a.row(0).segment(c, kHeadSize);
    MatD& s = states[static_cast<std::size_t>(h)];  // V x K
    const MatD s_kk = s * kkh.transpose();          // V x 1
    s = s * wh.asDiagonal();
    s -= s_kk * kkh.cwiseProduct(ah);
    s += vh.transpose() * kh;
    Eigen::RowVectorXd yh = (s * rh.transpose()).transpose();
    const double mean = yh.mean();
    const double var = (yh.array() - mean).square().mean();
    yh = ((yh.array() - mean) / std::sqrt(var + kGroupNormEps)).matrix();
    yh = yh.cwiseProduct(p.ln_w.cast<double>().row(0).segment(c, kHeadSize)) +
         p.ln_b.cast<double>().row(0).segment(c, kHeadSize);
    const double bonus =
        (rh.array() * kh.array() * p.r_k.cast<double>().row(0).segment(c, kHeadSize).array()).sum();
    y.row(0).segment(c, kHeadSize) = yh + bonus * vh;
  }
  return y.cwiseProduct(g) * p.wo.cast<double>();
}

/// One layer through linattn for `n` tokens x (n x C) after last_x (1 x C): the caller's GEMMs
/// and token shift, DplrDeltaRuleLayer's prefill (n > 1) or step (n = 1), OutputNorm::rwkv7,
/// the bonus and the gate. v_first (n x C) is written by layer 0 and read by the others.
Mat layer_tokens(const Layer& p, Eigen::Index layer, const Mat& x, const Mat& last_x, Mat& v_first,
                 const linattn::DplrDeltaRuleLayer<float>& recurrence,
                 linattn::DplrDeltaRuleStateBatch<float>& states) {
  const Eigen::Index n = x.rows();
  Mat previous(n, kChannels);  // x shifted down one token, last_x first
  previous.row(0) = last_x;
  previous.bottomRows(n - 1) = x.topRows(n - 1);
  const auto shifted = [&](int i) -> Mat {
    return (x.array() + (previous - x).array().rowwise() * p.mix.row(i).array()).matrix();
  };
  const Mat xr = shifted(0), xw = shifted(1), xk = shifted(2), xv = shifted(3);
  const Mat xa = shifted(4), xg = shifted(5);
  const Mat r = xr * p.wr;
  Mat k = xk * p.wk;
  Mat v = xv * p.wv;
  const Mat lw = ((xw * p.ww1).array().tanh().matrix() * p.ww2).rowwise() + p.w0.row(0);
  const Mat log_w = (-sigmoid(lw).array() / std::sqrt(std::exp(1.0f))).matrix();  // log w
  if (layer == 0) {
    v_first = v;
  } else {
    const Mat gate = sigmoid(Mat((xv * p.wv1 * p.wv2).rowwise() + p.v0.row(0)));
    v = (v.array() + (v_first - v).array() * gate.array()).matrix();
  }
  const Mat a = sigmoid(Mat((xa * p.wa1 * p.wa2).rowwise() + p.a0.row(0)));
  const Mat g = sigmoid(Mat(xg * p.wg1)) * p.wg2;
  Mat kk = (k.array().rowwise() * p.k_k.row(0).array()).matrix();
  k = (k.array() * (1.0f + (a.array() - 1.0f).rowwise() * p.k_a.row(0).array())).matrix();
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index h = 0; h < kHeads; ++h) {
      auto kkh = kk.row(t).segment(h * kHeadSize, kHeadSize);
      kkh /= std::max(kkh.norm(), 1e-12f);
    }
  }
  const Mat minus_kk = -kk;
  const Mat kk_a = kk.cwiseProduct(a);
  Mat y(n, kChannels);
  if (n == 1) {  // one token of every head: rows of [H, 64]
    const auto rows = [](const Mat& m) {
      return Eigen::Map<const Mat>(m.data(), kHeads, kHeadSize);
    };
    Eigen::Map<Mat> out(y.data(), kHeads, kHeadSize);
    Mat step_out(kHeads, kHeadSize);
    recurrence.step_into(states, rows(r), rows(k), rows(v), rows(minus_kk), rows(kk_a),
                         linattn::log_gates(rows(log_w)), step_out);
    out = step_out;
  } else {
    using View = HeadsView<const float>;
    const BnhdShape shape{1, n, kHeads, kHeadSize};
    recurrence.prefill_into(states, View::bnhd(r.data(), shape), View::bnhd(k.data(), shape),
                            View::bnhd(v.data(), shape), View::bnhd(minus_kk.data(), shape),
                            View::bnhd(kk_a.data(), shape),
                            linattn::log_gates(View::bnhd(log_w.data(), shape)),
                            HeadsView<float>::bnhd(y.data(), shape));
  }
  // ln_x per head, in place, then the bonus and the gate.
  const auto norm = linattn::OutputNorm<float>::rwkv7(p.ln_w.row(0), p.ln_b.row(0), kGroupNormEps);
  const auto y_view = HeadsView<float>::bnhd(y.data(), BnhdShape{1, n, kHeads, kHeadSize});
  norm.apply_into(y_view, y_view);
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index h = 0; h < kHeads; ++h) {
      const Eigen::Index c = h * kHeadSize;
      const float bonus =
          (r.row(t).segment(c, kHeadSize).array() * k.row(t).segment(c, kHeadSize).array() *
           p.r_k.row(0).segment(c, kHeadSize).array())
              .sum();
      y.row(t).segment(c, kHeadSize) += bonus * v.row(t).segment(c, kHeadSize);
    }
  }
  return y.cwiseProduct(g) * p.wo;
}

}  // namespace

int main() {
  try {
    std::mt19937 rng(7);
    std::vector<Layer> layers;
    for (Eigen::Index l = 0; l < kLayers; ++l) layers.emplace_back(rng);
    const Mat x = random_matrix(kTokens, kChannels, 1.0f, rng);  // the layers' input (after ln1)

    // The reference, token by token, each layer fed the previous layer's x + out.
    std::vector<std::vector<MatD>> ref_states(
        kLayers, std::vector<MatD>(kHeads, MatD::Zero(kHeadSize, kHeadSize)));
    std::vector<MatD> ref_last(kLayers, MatD::Zero(1, kChannels));
    MatD expected(kTokens, kChannels);
    for (Eigen::Index t = 0; t < kTokens; ++t) {
      MatD h = x.row(t).cast<double>();
      MatD v_first;
      for (Eigen::Index l = 0; l < kLayers; ++l) {
        const MatD out = reference_token(layers[static_cast<std::size_t>(l)], l, h,
                                         ref_last[static_cast<std::size_t>(l)], v_first,
                                         ref_states[static_cast<std::size_t>(l)]);
        ref_last[static_cast<std::size_t>(l)] = h;
        h += out;
      }
      expected.row(t) = h;
    }

    // linattn: the prompt through both layers at once, then one token at a time.
    linattn::DplrOptions options;
    options.scale = 1.0;  // RWKV-7's layer
    const linattn::DplrDeltaRuleLayer<float> recurrence(kHeads, kHeadSize, kHeadSize, options);
    std::vector<linattn::DplrDeltaRuleStateBatch<float>> states;
    std::vector<Mat> last(kLayers, Mat::Zero(1, kChannels));
    for (Eigen::Index l = 0; l < kLayers; ++l) states.push_back(recurrence.make_states(1));
    Mat got(kTokens, kChannels);
    const auto run = [&](Eigen::Index begin, Eigen::Index n) {
      Mat h = x.middleRows(begin, n);
      Mat v_first;
      for (Eigen::Index l = 0; l < kLayers; ++l) {
        const auto li = static_cast<std::size_t>(l);
        const Mat out = layer_tokens(layers[li], l, h, last[li], v_first, recurrence, states[li]);
        last[li] = h.bottomRows(1);
        h += out;
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
        (states.back()[1].s().cast<double>() - ref_states.back()[1].transpose())
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
