// A drop-in multi-head causal attention layer for an existing Eigen model.
//
// The model owns the projections W_q, W_k, W_v, W_o (d_model x d_model); linattn does the
// attention between them through LinearAttentionLayer, which owns the feature map, so the
// same weights serve both forms:
//   forward   - the whole sequence at once (training, prompt prefill): the projected
//               [B*N, H*D] matrices are already [B, N, H, D] tensors, viewed with
//               HeadsView::bnhd, no copies;
//   step      - one token per sequence (decoding), one recurrent state per head
//               (make_states / step_into); `generate` runs it over a whole input.
// The program checks that forward and generate agree to 1e-12 relative (double), for
// elu(x) + 1 and for FAVOR+ random features, then runs a toy language model greedily: an
// embedding table, the layer with a residual, logits against the (tied) embedding, argmax,
// the chosen token fed back. It re-checks the generated ids with one forward pass.
//
// Usage: example_attention_layer [tokens]   (default 256 tokens per sequence)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <linattn/linattn.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

using Mat = linattn::Matrix<double>;  // row-major: one row per token
using ConstHeads = linattn::HeadsView<const double>;
using Heads = linattn::HeadsView<double>;

/// rows x cols entries of N(0, stddev^2).
Mat random_matrix(Eigen::Index rows, Eigen::Index cols, double stddev, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, stddev);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

/// max|a - b| / max|b|, the measure the library's tests use.
double relative_error(const Mat& a, const Mat& b) {
  return (a - b).cwiseAbs().maxCoeff() / b.cwiseAbs().maxCoeff();
}

/// Multi-head causal self-attention with linear attention inside. Map is the feature map,
/// chosen at construction: linattn::EluPlusOne (below), linattn::Relu, or
/// linattn::PositiveRandomFeatures(head_dim, num_features, seed) for FAVOR+, which
/// approximates softmax attention (see performer_vs_softmax.cpp).
template <class Map>
class CausalSelfAttention {
 public:
  using Layer = linattn::LinearAttentionLayer<double, Map>;
  /// B x H recurrent states (state b * H + h is head h of sequence b).
  using States = typename Layer::States;

  /// @param model_dim  d_model, the width of the residual stream
  /// @param heads      H; each head gets d_model / H dimensions
  /// @param map        feature map for every head's queries and keys
  /// @param seed       the projections are drawn from it (std::mt19937_64)
  /// @param options    eps, decay (retention), chunk, threads, ...
  CausalSelfAttention(Eigen::Index model_dim, Eigen::Index heads, Map map, std::uint64_t seed,
                      const linattn::Options& options = {})
      : model_dim_(model_dim),
        heads_(heads),
        head_dim_(model_dim / heads),
        attention_(std::move(map), heads, model_dim / heads, model_dim / heads, options) {
    std::mt19937_64 rng(seed);
    const double scale = 1.0 / std::sqrt(static_cast<double>(model_dim));  // keeps unit variance
    w_q_ = random_matrix(model_dim, model_dim, scale, rng);
    w_k_ = random_matrix(model_dim, model_dim, scale, rng);
    w_v_ = random_matrix(model_dim, model_dim, scale, rng);
    w_o_ = random_matrix(model_dim, model_dim, scale, rng);
  }

  /// The parallel form over B sequences of N tokens.
  /// @param x      (B * N) x d_model, sequence b in rows [b N, (b + 1) N)
  /// @param batch  B
  /// @return       (B * N) x d_model
  Mat forward(const Mat& x, Eigen::Index batch) const {
    const Eigen::Index tokens = x.rows() / batch;
    // Each projection is (B * N) x (H * D) row-major, i.e. a [B, N, H, D] tensor.
    const Mat q = x * w_q_, k = x * w_k_, v = x * w_v_;
    Mat heads_out(x.rows(), model_dim_);  // [B, N, H, D] again: the heads concatenated
    attention_.forward_into(
        view(q, batch, tokens), view(k, batch, tokens), view(v, batch, tokens),
        Heads::bnhd(heads_out.data(), linattn::BnhdShape{batch, tokens, heads_, head_dim_}));
    return heads_out * w_o_;
  }

  /// Fresh (empty) states for B sequences.
  States make_states(Eigen::Index batch) const { return attention_.make_states(batch); }

  /// A prompt through the parallel form that also leaves `states` ready for step.
  /// @param x  (B * N) x d_model; @return (B * N) x d_model, the same as forward(x, B)
  Mat prefill(States& states, const Mat& x, Eigen::Index batch) const {
    const Eigen::Index tokens = x.rows() / batch;
    const Mat q = x * w_q_, k = x * w_k_, v = x * w_v_;
    Mat heads_out(x.rows(), model_dim_);
    attention_.prefill_into(
        states, view(q, batch, tokens), view(k, batch, tokens), view(v, batch, tokens),
        Heads::bnhd(heads_out.data(), linattn::BnhdShape{batch, tokens, heads_, head_dim_}));
    return heads_out * w_o_;
  }

  /// One token for each of B sequences, in O(H * D^2) per sequence whatever the context.
  /// @param x  B x d_model, row b the next token of sequence b
  /// @return   B x d_model
  Mat step(States& states, const Mat& x) const {
    // A B x (H * D) row-major matrix is (B * H) x D rows: row b * H + h is head h of
    // sequence b, the order of the states. Eigen::Map reinterprets it without a copy.
    const Mat q = x * w_q_, k = x * w_k_, v = x * w_v_;
    Mat heads_out(x.rows(), model_dim_);
    Eigen::Map<Mat> out_rows(heads_out.data(), x.rows() * heads_, head_dim_);
    attention_.step_into(states, rows(q), rows(k), rows(v), out_rows);
    return heads_out * w_o_;
  }

  /// The recurrent form over a whole input, one token at a time: what decoding computes.
  /// @param x  (B * N) x d_model as for forward; @return (B * N) x d_model
  Mat generate(const Mat& x, Eigen::Index batch) const {
    const Eigen::Index tokens = x.rows() / batch;
    States states = make_states(batch);
    Mat token(batch, model_dim_);
    Mat out(x.rows(), model_dim_);
    for (Eigen::Index t = 0; t < tokens; ++t) {
      for (Eigen::Index b = 0; b < batch; ++b) token.row(b) = x.row(b * tokens + t);
      const Mat y = step(states, token);
      for (Eigen::Index b = 0; b < batch; ++b) out.row(b * tokens + t) = y.row(b);
    }
    return out;
  }

  Eigen::Index model_dim() const { return model_dim_; }

 private:
  ConstHeads view(const Mat& m, Eigen::Index batch, Eigen::Index tokens) const {
    return ConstHeads::bnhd(m.data(), linattn::BnhdShape{batch, tokens, heads_, head_dim_});
  }
  Eigen::Map<const Mat> rows(const Mat& m) const {
    return Eigen::Map<const Mat>(m.data(), m.rows() * heads_, head_dim_);
  }

  Eigen::Index model_dim_, heads_, head_dim_;
  Mat w_q_, w_k_, w_v_, w_o_;
  Layer attention_;
};

/// forward vs generate on random inputs; returns the relative difference.
template <class Map>
double compare_forms(const CausalSelfAttention<Map>& layer, Eigen::Index batch, Eigen::Index tokens,
                     std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Mat x = random_matrix(batch * tokens, layer.model_dim(), 1.0, rng);
  return relative_error(layer.generate(x, batch), layer.forward(x, batch));
}

/// The rest of a one-layer toy language model around the attention layer: an embedding
/// table, the residual connection and an unembedding to vocabulary scores.
class ToyModel {
 public:
  ToyModel(Eigen::Index vocab, Eigen::Index model_dim, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    embedding_ = random_matrix(vocab, model_dim, 1.0, rng);
    unembedding_ = random_matrix(model_dim, vocab, 1.0, rng);
  }

  /// Embeddings of token ids, one row each.
  Mat embed(const std::vector<int>& ids) const {
    Mat x(static_cast<Eigen::Index>(ids.size()), embedding_.cols());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      x.row(static_cast<Eigen::Index>(i)) = embedding_.row(ids[i]);
    }
    return x;
  }
  /// Logits of hidden rows h = x + attention(x): one row of vocabulary scores per token.
  Mat logits(const Mat& x, const Mat& attended) const { return (x + attended) * unembedding_; }

 private:
  Mat embedding_;    // vocab x d_model
  Mat unembedding_;  // d_model x vocab
};

int argmax(const Eigen::Ref<const Eigen::RowVectorXd>& row) {
  Eigen::Index best = 0;
  row.maxCoeff(&best);
  return static_cast<int>(best);
}

/// "3 21 14": ids[begin, end) separated by spaces.
std::string ids_string(const std::vector<int>& ids, Eigen::Index begin, Eigen::Index end) {
  std::string s;
  for (Eigen::Index i = begin; i < end; ++i) {
    s += (i == begin ? "" : " ") + std::to_string(ids[static_cast<std::size_t>(i)]);
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const Eigen::Index tokens = argc > 1 ? std::atol(argv[1]) : 256;
  if (tokens < 1) {
    std::fprintf(stderr, "usage: %s [tokens >= 1]\n", argv[0]);
    return 2;
  }
  const Eigen::Index model_dim = 64, heads = 4, batch = 2;
  constexpr double kTolerance = 1e-12;  // parallel vs recurrent in double, as the tests prove
  bool ok = true;

  try {
    // 1. The layer with elu(x) + 1, and the same class with FAVOR+ features instead.
    const CausalSelfAttention<linattn::EluPlusOne> layer(model_dim, heads, linattn::EluPlusOne{},
                                                         /*seed=*/1);
    const CausalSelfAttention<linattn::PositiveRandomFeatures> favor(
        model_dim, heads, linattn::PositiveRandomFeatures(model_dim / heads, 64, /*seed=*/7),
        /*seed=*/1);
    const double elu_error = compare_forms(layer, batch, tokens, 11);
    const double favor_error = compare_forms(favor, batch, tokens, 12);
    std::printf("layer: d_model %lld, %lld heads of %lld, batch %lld x %lld tokens\n",
                static_cast<long long>(model_dim), static_cast<long long>(heads),
                static_cast<long long>(model_dim / heads), static_cast<long long>(batch),
                static_cast<long long>(tokens));
    std::printf("forward vs generate, elu+1:     relative %.3g\n", elu_error);
    std::printf("forward vs generate, FAVOR+ 64: relative %.3g\n", favor_error);
    if (!(elu_error <= kTolerance) || !(favor_error <= kTolerance)) {
      std::printf("FAIL: the two forms differ by more than %.0e\n", kTolerance);
      ok = false;
    }

    // 2. Greedy decoding with a toy vocabulary: the prompt through prefill (parallel form),
    //    then one step per new token, each sequence feeding back its own argmax.
    const Eigen::Index vocab = 32;
    const ToyModel model(vocab, model_dim, /*seed=*/3);
    const std::vector<std::vector<int>> prompts = {{1, 5, 9, 2}, {7, 7, 3, 30}};
    const Eigen::Index prompt_len = static_cast<Eigen::Index>(prompts[0].size());
    const std::size_t new_tokens = static_cast<std::size_t>(std::min<Eigen::Index>(tokens, 24));

    auto states = layer.make_states(batch);
    std::vector<int> prompt_ids;  // [B, P] flattened, sequence by sequence
    for (const auto& p : prompts) prompt_ids.insert(prompt_ids.end(), p.begin(), p.end());
    const Mat prompt_x = model.embed(prompt_ids);
    const Mat prompt_logits = model.logits(prompt_x, layer.prefill(states, prompt_x, batch));

    std::vector<std::vector<int>> sequences = prompts;
    std::vector<int> next(batch);
    for (Eigen::Index b = 0; b < batch; ++b) {
      next[b] = argmax(prompt_logits.row((b + 1) * prompt_len - 1));  // last prompt token
    }
    for (std::size_t t = 0; t < new_tokens; ++t) {
      for (Eigen::Index b = 0; b < batch; ++b) sequences[b].push_back(next[b]);
      if (t + 1 == new_tokens) break;
      const Mat x = model.embed(next);  // B x d_model: the token each sequence just chose
      const Mat logits = model.logits(x, layer.step(states, x));
      for (Eigen::Index b = 0; b < batch; ++b) next[b] = argmax(logits.row(b));
    }
    for (Eigen::Index b = 0; b < batch; ++b) {
      std::printf(
          "sequence %lld: prompt [%s] -> %s\n", static_cast<long long>(b),
          ids_string(sequences[b], 0, prompt_len).c_str(),
          ids_string(sequences[b], prompt_len, static_cast<Eigen::Index>(sequences[b].size()))
              .c_str());
    }

    // 3. Teacher forcing: one forward pass over prompt + generated tokens (minus the last)
    //    must pick the same token at every generated position.
    std::vector<int> all_ids;
    for (const auto& s : sequences) all_ids.insert(all_ids.end(), s.begin(), s.end() - 1);
    const Eigen::Index length = static_cast<Eigen::Index>(sequences[0].size()) - 1;
    const Mat all_x = model.embed(all_ids);
    const Mat all_logits = model.logits(all_x, layer.forward(all_x, batch));
    int mismatches = 0;
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index t = prompt_len - 1; t < length; ++t) {
        if (argmax(all_logits.row(b * length + t)) != sequences[b][t + 1]) ++mismatches;
      }
    }
    std::printf("teacher-forced forward picks the same %zu tokens per sequence: %s\n", new_tokens,
                mismatches == 0 ? "yes" : "NO");
    if (mismatches != 0) ok = false;
  } catch (const linattn::Error& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  std::printf("%s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
