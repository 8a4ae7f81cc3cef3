// A float multi-head block on the buffers a fused QKV projection produces: [B, N, H, D]
// (token-major, what FLA, ggml and fast-transformers use), viewed in place with
// HeadsView::bnhd. The prompt goes through the parallel form once (prefill), which also
// leaves one recurrent state per (sequence, head); then tokens are decoded one at a time.
//
// The program checks that prompt + decoded tokens give what one parallel call over the
// whole sequence gives (float: within 2e-5 of the largest output) and fails otherwise.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <linattn/linattn.hpp>
#include <random>
#include <vector>

int main() {
  const Eigen::Index batch = 2, heads = 4, head_dim = 64, prompt = 200, decoded = 16;
  const Eigen::Index total = prompt + decoded;

  // q, k, v for the whole sequence, [B, N, H, D] contiguous, as a projection writes them.
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t size = static_cast<std::size_t>(batch * total * heads * head_dim);
  std::vector<float> q(size), k(size), v(size);
  for (auto* x : {&q, &k, &v}) {
    for (float& e : *x) e = normal(rng);
  }

  using View = linattn::HeadsView<const float>;
  const linattn::HeadShape whole{batch, heads, total, head_dim};  // logical {B, H, N, D}
  const linattn::LinearAttentionLayer<float, linattn::EluPlusOne> layer(linattn::EluPlusOne{},
                                                                        heads, head_dim, head_dim);

  // Reference: the parallel form over all tokens at once.
  std::vector<float> reference(size);
  layer.forward_into(View::bnhd(q.data(), linattn::BnhdShape(whole)),
                     View::bnhd(k.data(), linattn::BnhdShape(whole)),
                     View::bnhd(v.data(), linattn::BnhdShape(whole)),
                     linattn::HeadsView<float>::bnhd(reference.data(), linattn::BnhdShape(whole)));

  // Prefill: the first `prompt` tokens of each sequence. A [B, N, H, D] buffer cut after
  // `prompt` tokens keeps its strides, so the prompt is a view with N = prompt and the
  // batch stride of the whole buffer.
  const linattn::HeadStrides strides{total * heads * head_dim, head_dim, heads * head_dim, 1};
  auto prompt_view = [&](const std::vector<float>& x) {
    return View(x.data(), batch, heads, prompt, head_dim, strides);
  };
  std::vector<float> out(size);
  auto states = layer.make_states(batch);  // B * H states, state b * H + h for head h of b
  layer.prefill_into(
      states, prompt_view(q), prompt_view(k), prompt_view(v),
      linattn::HeadsView<float>(out.data(), batch, heads, prompt, head_dim, strides));

  // Decode: one token per sequence per step; row b * H + h holds head h of sequence b.
  linattn::Matrix<float> q_t(batch * heads, head_dim), k_t(batch * heads, head_dim),
      v_t(batch * heads, head_dim), out_t(batch * heads, head_dim);
  for (Eigen::Index n = prompt; n < total; ++n) {
    for (Eigen::Index b = 0; b < batch; ++b) {
      const std::size_t at = static_cast<std::size_t>((b * total + n) * heads * head_dim);
      q_t.middleRows(b * heads, heads) =
          Eigen::Map<const linattn::Matrix<float>>(q.data() + at, heads, head_dim);
      k_t.middleRows(b * heads, heads) =
          Eigen::Map<const linattn::Matrix<float>>(k.data() + at, heads, head_dim);
      v_t.middleRows(b * heads, heads) =
          Eigen::Map<const linattn::Matrix<float>>(v.data() + at, heads, head_dim);
    }
    layer.step_into(states, q_t, k_t, v_t, out_t);
    for (Eigen::Index b = 0; b < batch; ++b) {
      const std::size_t at = static_cast<std::size_t>((b * total + n) * heads * head_dim);
      Eigen::Map<linattn::Matrix<float>>(out.data() + at, heads, head_dim) =
          out_t.middleRows(b * heads, heads);
    }
  }

  float largest = 0.0f, difference = 0.0f;
  for (std::size_t i = 0; i < size; ++i) {
    largest = std::max(largest, std::abs(reference[i]));
    difference = std::max(difference, std::abs(out[i] - reference[i]));
  }
  std::printf(
      "B = %lld, H = %lld, D = %lld: %lld prompt tokens, %lld decoded; "
      "largest difference from one parallel call %.3g (relative %.3g)\n",
      static_cast<long long>(batch), static_cast<long long>(heads),
      static_cast<long long>(head_dim), static_cast<long long>(prompt),
      static_cast<long long>(decoded), difference, difference / largest);
  return difference <= 2e-5f * largest ? 0 : 1;
}
