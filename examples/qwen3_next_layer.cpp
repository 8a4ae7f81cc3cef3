// One Gated DeltaNet layer of Qwen3-Next on [B, N, H, D] buffers: where a port starts.
//
// From a hidden state x ([B, N, d_model]) the layer's projections give, as a model computes
// them (FLA / Hugging Face conventions):
//   q, k = x W_q, x W_k          Hk heads of Dk ([B, N, Hk, Dk]: the row-major product as is)
//   v    = x W_v                 Hv heads of Dv (Hv a multiple of Hk: grouped heads)
//   beta = sigmoid(x W_b)        [B, N, Hv, 1], the delta rule's learning rates
//   g    = -exp(A_log) * softplus(x W_a + dt_bias)   [B, N, Hv, 1], log gates (g <= 0)
// and the delta rule runs over them: v head h reads q/k head h / (Hv / Hk). A DeltaRuleLayer
// holds the heads and options: its prefill runs the prompt of every sequence and head in one
// call and leaves a state per (sequence, v head) in a DeltaRuleStateBatch; then its step
// decodes the next token of every sequence and head in one call, from the token's projections
// as a server holds them ([B, H, D]; teacher forcing: their inputs are fixed in advance).
//
// What a full port adds around this: a short causal depthwise conv1d (kernel 4, then SiLU)
// on the q, k, v projections before the delta rule (decoding keeps its last 3 inputs per
// sequence as a conv state beside its delta-rule states), and after it a per-head RMSNorm gated
// by SiLU(x W_z) and the output projection. linattn::GatedDeltaNet (gated_delta_net.hpp) is
// that whole layer between the projections, convolution and norm included, with its state.
// The checkpoint fuses the projections (in_proj_qkvz, in_proj_ba) with the heads interleaved
// per q/k group: split them into [B, N, H, D] buffers like the ones here.
//
// The program checks that the prefill and the decoded tokens give what the chunked form's
// forward over prompt + decoded tokens gives (1e-4 relative: two forms in float), and fails
// otherwise.
//
// Usage: example_qwen3_next_layer [--qwen3-next]
//   default: 4 q/k heads and 8 v heads of 64, d_model 512 (fast enough for the test suite)
//   --qwen3-next: Qwen3-Next-80B-A3B's 16 q/k heads and 32 v heads of 128, d_model 2048
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
using ConstView = linattn::HeadsView<const float>;
using OutView = linattn::HeadsView<float>;
using Clock = std::chrono::steady_clock;

struct LayerShape {
  Eigen::Index batch, prompt, decoded;       // B sequences, N prompt + decoded tokens each
  Eigen::Index model_dim;                    // d_model
  Eigen::Index qk_heads, v_heads, head_dim;  // Hk, Hv, Dk = Dv
  Eigen::Index total() const { return prompt + decoded; }
  Eigen::Index group() const { return v_heads / qk_heads; }  // v heads per q/k head
};

/// The layer's weights, drawn as Qwen3-Next initialises them (A = exp(A_log) uniform in
/// (0, 16), dt_bias = 1), the projections at unit output variance.
struct Weights {
  Mat w_q, w_k, w_v, w_a, w_b;  // d_model x (heads * dim), d_model x Hv for a and b
  Vec a_log, dt_bias;           // Hv each
};

/// Everything the delta rule reads, for every token of every sequence: row b * T + t holds
/// token t of sequence b and column h * D + d feature d of head h, i.e. [B, T, H, D].
struct LayerInputs {
  Mat q, k, v, g, beta;
};

Mat random_matrix(Eigen::Index rows, Eigen::Index cols, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

Weights random_weights(const LayerShape& shape, std::mt19937& rng) {
  // 1 / sqrt(d_model) keeps every projection of a unit-variance x at unit variance.
  const float stddev = 1.0f / std::sqrt(static_cast<float>(shape.model_dim));
  const Eigen::Index d = shape.model_dim;
  Weights w;
  w.w_q = random_matrix(d, shape.qk_heads * shape.head_dim, stddev, rng);
  w.w_k = random_matrix(d, shape.qk_heads * shape.head_dim, stddev, rng);
  w.w_v = random_matrix(d, shape.v_heads * shape.head_dim, stddev, rng);
  w.w_a = random_matrix(d, shape.v_heads, stddev, rng);
  w.w_b = random_matrix(d, shape.v_heads, stddev, rng);
  std::uniform_real_distribution<float> decay_rate(1e-3f, 16.0f);
  w.a_log.resize(shape.v_heads);
  for (Eigen::Index h = 0; h < shape.v_heads; ++h) w.a_log(h) = std::log(decay_rate(rng));
  w.dt_bias = Vec::Ones(shape.v_heads);
  return w;
}

/// log(1 + e^x), linear above 20 as torch's softplus.
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

/// q, k, v, the log gates and beta of the hidden states x ([B * T, d_model]). q and k are not
/// L2-normalised here: the kernel does it (DeltaOptions::l2_normalize).
LayerInputs project(const Mat& x, const Weights& w) {
  LayerInputs in;
  in.q.noalias() = x * w.w_q;
  in.k.noalias() = x * w.w_k;
  in.v.noalias() = x * w.w_v;
  Mat a, b;
  a.noalias() = x * w.w_a;
  b.noalias() = x * w.w_b;
  in.g.resize(a.rows(), a.cols());
  for (Eigen::Index r = 0; r < a.rows(); ++r) {
    for (Eigen::Index h = 0; h < a.cols(); ++h) {
      in.g(r, h) = -std::exp(w.a_log(h)) * softplus(a(r, h) + w.dt_bias(h));
    }
  }
  in.beta = (1.0f + (-b.array()).exp()).inverse().matrix();  // sigmoid
  return in;
}

/// All T tokens of a [B, T, H, D] buffer (B * T rows, H * D columns).
ConstView whole(const Mat& buffer, Eigen::Index batch, Eigen::Index heads) {
  return ConstView::bnhd(buffer.data(), linattn::BnhdShape{batch, buffer.rows() / batch, heads,
                                                           buffer.cols() / heads});
}

/// The first `tokens` tokens of every sequence of a [B, T, H, D] buffer: a prefix keeps the
/// whole buffer's strides, so it is a view with fewer tokens, no copy.
ConstView first_tokens(const Mat& buffer, Eigen::Index batch, Eigen::Index heads,
                       Eigen::Index tokens) {
  const Eigen::Index total = buffer.rows() / batch, dim = buffer.cols() / heads;
  return ConstView(buffer.data(), batch, heads, tokens, dim,
                   linattn::HeadStrides{total * heads * dim, dim, heads * dim, 1});
}

/// Token t of every sequence of a [B, T, H, D] buffer as a decoding step takes it: (B * H) x D,
/// row b * H + h for head h of sequence b (what x_t W gives for the B sequences' x_t).
Mat token_rows(const Mat& buffer, Eigen::Index batch, Eigen::Index heads, Eigen::Index t) {
  const Eigen::Index total = buffer.rows() / batch, dim = buffer.cols() / heads;
  Mat rows(batch * heads, dim);
  for (Eigen::Index b = 0; b < batch; ++b) {
    rows.middleRows(b * heads, heads) =
        Eigen::Map<const Mat>(buffer.row(b * total + t).data(), heads, dim);
  }
  return rows;
}

/// max|got - want| / max|want| over everything added.
struct RelativeError {
  float difference = 0.0f, largest = 0.0f;
  template <class A, class B>
  void add(const Eigen::MatrixBase<A>& got, const Eigen::MatrixBase<B>& want) {
    difference = std::max(difference, (got - want).cwiseAbs().maxCoeff());
    largest = std::max(largest, want.cwiseAbs().maxCoeff());
  }
  float value() const { return difference / largest; }
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const bool real_heads = argc > 1 && std::strcmp(argv[1], "--qwen3-next") == 0;
  if (argc > 2 || (argc == 2 && !real_heads)) {
    std::fprintf(stderr, "usage: %s [--qwen3-next]\n", argv[0]);
    return 2;
  }
  const LayerShape shape =
      real_heads ? LayerShape{2, 96, 16, 2048, 16, 32, 128} : LayerShape{2, 96, 16, 512, 4, 8, 64};
  const Eigen::Index batch = shape.batch, prompt = shape.prompt, total = shape.total();
  const Eigen::Index hk = shape.qk_heads, hv = shape.v_heads, dim = shape.head_dim;

  linattn::DeltaOptions options;
  // FLA's l2norm, x / sqrt(|x|^2 + 1e-6), which Qwen3-Next applies to q and k in the layer,
  // is this formula: the kernel does it. The scale is FLA's default, Dk^-1/2.
  options.l2_normalize = true;

  try {
    // The layer's inputs for prompt + decoded tokens (teacher forcing: x is known ahead).
    std::mt19937 rng(2025);
    const Weights weights = random_weights(shape, rng);
    const Mat x = random_matrix(batch * total, shape.model_dim, 1.0f, rng);  // [B, T, d_model]
    const LayerInputs in = project(x, weights);

    const linattn::DeltaRuleLayer<float> layer(linattn::LayerHeads::grouped_query_key(hv, hk), dim,
                                               dim, options);

    // The reference: the parallel form over prompt + decoded tokens, in the chunked (WY) form
    // (the layer itself picks the streamed recurrence, the faster one on CPU).
    linattn::DeltaOptions chunked_options = options;
    chunked_options.form = linattn::DeltaForm::chunked;
    const linattn::DeltaRuleLayer<float> chunked(linattn::LayerHeads::grouped_query_key(hv, hk),
                                                 dim, dim, chunked_options);
    Mat full_out(batch * total, hv * dim);  // [B, T, Hv, Dv]
    const OutView full_out_view =
        OutView::bnhd(full_out.data(), linattn::BnhdShape{batch, total, hv, dim});
    chunked.forward_into(whole(in.q, batch, hk), whole(in.k, batch, hk), whole(in.v, batch, hv),
                         linattn::log_gates(whole(in.g, batch, hv)), whole(in.beta, batch, hv),
                         full_out_view);

    // Prefill: the prompt of every sequence and every head in one call, leaving the states
    // (state b * Hv + h for v head h of sequence b) at the end of the prompt.
    linattn::DeltaRuleStateBatch<float> states = layer.make_states(batch);
    Mat prompt_out(batch * prompt, hv * dim);  // [B, N, Hv, Dv]
    const OutView prompt_out_view =
        OutView::bnhd(prompt_out.data(), linattn::BnhdShape{batch, prompt, hv, dim});
    const Clock::time_point prefill_start = Clock::now();
    layer.prefill_into(states, first_tokens(in.q, batch, hk, prompt),
                       first_tokens(in.k, batch, hk, prompt), first_tokens(in.v, batch, hv, prompt),
                       linattn::log_gates(first_tokens(in.g, batch, hv, prompt)),
                       first_tokens(in.beta, batch, hv, prompt), prompt_out_view);
    const double prefill_seconds = seconds_since(prefill_start);
    RelativeError prefill_error;
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index h = 0; h < hv; ++h) {
        prefill_error.add(prompt_out_view.head(b, h), full_out_view.head(b, h).topRows(prompt));
      }
    }

    // Token by token, every sequence and head in one step per token, as a server decodes:
    // (B * Hk) x Dk rows of q and k (grouped heads), (B * Hv) rows of v, g and beta.
    RelativeError decode_error;
    Mat token_out(batch * hv, dim);
    double step_seconds = 0.0;
    for (Eigen::Index t = prompt; t < total; ++t) {
      const Mat q_t = token_rows(in.q, batch, hk, t), k_t = token_rows(in.k, batch, hk, t);
      const Mat v_t = token_rows(in.v, batch, hv, t), g_t = token_rows(in.g, batch, hv, t);
      const Mat beta_t = token_rows(in.beta, batch, hv, t);
      const Clock::time_point step_start = Clock::now();
      layer.step_into(states, q_t, k_t, v_t, linattn::log_gates(g_t), beta_t, token_out);
      step_seconds += seconds_since(step_start);
      for (Eigen::Index b = 0; b < batch; ++b) {
        for (Eigen::Index h = 0; h < hv; ++h) {
          decode_error.add(token_out.row(b * hv + h), full_out_view.head(b, h).row(t));
        }
      }
    }

    const bool prefill_ok = prefill_error.value() <= 1e-4f;
    const bool decode_ok = decode_error.value() <= 1e-4f;
    std::printf(
        "Gated DeltaNet layer, float: B = %lld, %lld q/k heads and %lld v heads of %lld, "
        "d_model %lld, l2-normalised q and k\n",
        static_cast<long long>(batch), static_cast<long long>(hk), static_cast<long long>(hv),
        static_cast<long long>(dim), static_cast<long long>(shape.model_dim));
    std::printf("prefill: %lld prompt tokens per sequence, every head in one call, %.2f ms\n",
                static_cast<long long>(prompt), 1e3 * prefill_seconds);
    std::printf("decode:  %lld tokens per sequence, one step each, %.1f us per token per head\n",
                static_cast<long long>(shape.decoded),
                1e6 * step_seconds / static_cast<double>(shape.decoded * batch * hv));
    std::printf("prefill vs the chunked forward:          relative error %.3g (<= 1e-4) %s\n",
                prefill_error.value(), prefill_ok ? "ok" : "FAILED");
    std::printf("decoded steps vs the chunked forward:    relative error %.3g (<= 1e-4) %s\n",
                decode_error.value(), decode_ok ? "ok" : "FAILED");
    return prefill_ok && decode_ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
}
