// A server for a hybrid model with speculative decoding: where a Qwen3.5 (or any hybrid)
// serving loop starts.
//
// The model is Qwen3.5's layout, small: three Gated DeltaNet layers, then one softmax attention
// layer, each layer's input the previous layer's output through fixed projections (one GEMM per
// layer, read in place). Every live session's states (the mixers' convolution windows and
// recurrent states, the attention layer's KV caches) sit in one linattn::SessionPool<>.
//
// The server prefills each session's prompt, then decodes in speculative rounds: a draft of 4
// tokens for every session goes through every layer (the verification, every session in one
// call per layer and token), the target accepts a number m (0 to 4, here drawn at random) per
// session, and every session goes back to its snapshot from before the round and steps its m
// accepted tokens again (replay: at Qwen3.5's sizes it costs less than keeping a copy per
// draft, docs/performance.md). The check: a reference that only ever decodes each session's
// accepted tokens, one session at a time in a pool of its own, gives the same outputs for
// every accepted token and the same session blob at the end, bit for bit. It fails otherwise.
//
// Usage: example_hybrid_server
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <exception>
#include <linattn/linattn.hpp>
#include <map>
#include <random>
#include <vector>

namespace {

using Mat = linattn::Matrix<float>;  // row-major: one row per token
using Pool = linattn::SessionPool<>;
using Key = Pool::Key;
using Caches = linattn::KVCacheBatch<float>;
using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::HeadStrides;
using linattn::HeadsView;

constexpr Eigen::Index kHeads = 4, kDim = 16, kWidth = kHeads * kDim;  // rows of 64
constexpr Eigen::Index kMixers = 3;                                    // then one attention layer
constexpr int kDrafts = 4;

/// Fixed numbers: a projection's weights or a token's embedding, from a seed.
Mat uniform(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = u(rng);
  return m;
}

/// The input of token `position` of session `key` (a draft and its accepted token alike).
Mat embedding(Key key, std::int64_t position) {
  return uniform(1, kWidth, static_cast<std::uint64_t>(key) << 32 ^ std::uint64_t(position), 1);
}

class Model {
 public:
  Model() {
    for (Eigen::Index l = 0; l < kMixers; ++l) {
      mixers_.emplace_back(shape(), weights(static_cast<std::uint64_t>(l)));
      in_proj_.push_back(uniform(kWidth, fused_width(), 100 + l, 0.25f));
    }
    attention_proj_ = uniform(kWidth, 3 * kWidth, 200, 0.25f);
  }

  /// Every layer's part of a session: three mixers' states, then the KV caches.
  Pool make_pool() const { return Pool(mixers_[0], mixers_[1], mixers_[2], attention_); }

  /// One token for each session named (rows: x for sessions[b] at row b), every layer; the
  /// pool's other sessions stay. Returns the attention layer's outputs, one row per session.
  Mat step(Pool& pool, const std::vector<Key>& sessions, const Mat& x) const {
    const auto b = static_cast<Eigen::Index>(sessions.size());
    Mat hidden = x;
    const linattn::GatedDeltaNetShape s = shape();
    const Eigen::Index c = s.conv_channels(), hv = s.value_heads, w = fused_width();
    for (Eigen::Index l = 0; l < kMixers; ++l) {
      const Mat fused = hidden * in_proj_[static_cast<std::size_t>(l)];  // [qkv | z | b | a]
      const auto view = [&](Eigen::Index column, Eigen::Index heads, Eigen::Index dim) {
        return ConstHeadsView<float>(fused.data() + column, b, heads, 1, dim,
                                     HeadStrides{w, dim, w, 1});
      };
      Mat out(b, kWidth);
      pool.prefill_into(l, sessions, mixers_[static_cast<std::size_t>(l)],
                        linattn::GatedDeltaNetInputs<float>{view(0, 1, c), view(c, hv, kDim),
                                                            view(c + kWidth, hv, 1),
                                                            view(c + kWidth + hv, hv, 1)},
                        HeadsView<float>::bnhd(out.data(), BnhdShape(b, 1, kHeads, kDim)));
      hidden = out;
    }
    const Mat qkv = hidden * attention_proj_;
    Mat out(b, kWidth);
    pool.lend<Caches>(kMixers, sessions, [&](Caches& caches) {
      linattn::Vector<float> head(kDim);
      for (Eigen::Index i = 0; i < b; ++i) {
        for (Eigen::Index h = 0; h < kHeads; ++h) {
          caches.cache(i, h).step_into(qkv.block(i, h * kDim, 1, kDim),
                                       qkv.block(i, kWidth + h * kDim, 1, kDim),
                                       qkv.block(i, 2 * kWidth + h * kDim, 1, kDim), head);
          out.block(i, h * kDim, 1, kDim) = head.transpose();
        }
      }
    });
    return out;
  }

 private:
  static linattn::GatedDeltaNetShape shape() {
    linattn::GatedDeltaNetShape s;  // Qwen3.5's layout: q/k heads shared by pairs of v heads
    s.key_heads = 2;
    s.value_heads = kHeads;
    s.key_dim = kDim;
    s.value_dim = kDim;
    s.conv_kernel = 4;
    return s;
  }
  static Eigen::Index fused_width() {
    const linattn::GatedDeltaNetShape s = shape();
    return s.conv_channels() + s.value_channels() + 2 * s.value_heads;
  }
  static linattn::GatedDeltaNetWeights<float> weights(std::uint64_t seed) {
    const linattn::GatedDeltaNetShape s = shape();
    return {uniform(s.conv_channels(), s.conv_kernel, 10 + seed, 0.5f),
            linattn::Vector<float>::Constant(s.value_heads, -0.5f),
            linattn::Vector<float>::Ones(s.value_heads), linattn::Vector<float>::Ones(s.value_dim)};
  }

  std::vector<linattn::GatedDeltaNet<float>> mixers_;
  std::vector<Mat> in_proj_;
  Caches attention_{1, kHeads, kDim, kDim};  // the attention layer's shape
  Mat attention_proj_;
};

/// Rows of the sessions' next tokens: session keys[b]'s token at positions[b] + offset.
Mat tokens(const std::vector<Key>& keys, const std::map<Key, std::int64_t>& positions,
           std::int64_t offset) {
  Mat x(static_cast<Eigen::Index>(keys.size()), kWidth);
  for (std::size_t b = 0; b < keys.size(); ++b)
    x.row(static_cast<Eigen::Index>(b)) = embedding(keys[b], positions.at(keys[b]) + offset);
  return x;
}

int run() {
  const Model model;
  Pool pool = model.make_pool();
  const std::vector<Key> keys{11, 22, 33};
  std::map<Key, std::int64_t> position;     // tokens accepted so far
  std::map<Key, std::vector<Mat>> outputs;  // every accepted token's output
  for (Key key : keys) {
    pool.add(key);
    position[key] = 0;
  }
  // The prompts: 5 tokens each, every session in one call per token.
  for (int t = 0; t < 5; ++t) {
    const Mat y = model.step(pool, keys, tokens(keys, position, 0));
    for (std::size_t b = 0; b < keys.size(); ++b) {
      outputs[keys[b]].push_back(y.row(static_cast<Eigen::Index>(b)));
      ++position[keys[b]];
    }
  }
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> accept(0, kDrafts);
  std::map<Key, int> accepted_total;
  for (int round = 0; round < 6; ++round) {
    std::map<Key, linattn::SessionSnapshot> before;
    for (Key key : keys) before.emplace(key, pool.snapshot(key));
    // Verification: the drafts through every layer, every session at once.
    std::vector<Mat> drafted;
    for (int d = 0; d < kDrafts; ++d)
      drafted.push_back(model.step(pool, keys, tokens(keys, position, d)));
    // The target accepts m of them per session; replay: back to the snapshot, m steps again
    // for the sessions that accepted at least that many.
    std::map<Key, int> m;
    for (Key key : keys) {
      m[key] = accept(rng);
      accepted_total[key] += m[key];
      pool.restore(key, before.at(key));
    }
    for (int d = 0; d < kDrafts; ++d) {
      std::vector<Key> going;
      for (Key key : keys)
        if (m[key] > d) going.push_back(key);
      if (going.empty()) break;
      const Mat y = model.step(pool, going, tokens(going, position, 0));
      for (std::size_t b = 0; b < going.size(); ++b) {
        // The replayed output is the drafted one: the same states, the same token.
        const Eigen::Index row =
            static_cast<Eigen::Index>(std::find(keys.begin(), keys.end(), going[b]) - keys.begin());
        if (y.row(static_cast<Eigen::Index>(b)) != drafted[static_cast<std::size_t>(d)].row(row)) {
          std::printf("FAIL: session %lld: a replayed draft's output differs\n",
                      static_cast<long long>(going[b]));
          return 1;
        }
        outputs[going[b]].push_back(y.row(static_cast<Eigen::Index>(b)));
        ++position[going[b]];
      }
    }
  }
  // The reference: each session alone, its accepted tokens only, one at a time.
  for (Key key : keys) {
    Pool alone = model.make_pool();
    alone.add(key);
    for (std::int64_t t = 0; t < position.at(key); ++t) {
      const Mat y = model.step(alone, {key}, embedding(key, t));
      if (y != outputs.at(key)[static_cast<std::size_t>(t)]) {
        std::printf("FAIL: session %lld: token %lld's output differs from decoding alone\n",
                    static_cast<long long>(key), static_cast<long long>(t));
        return 1;
      }
    }
    if (alone.save_bytes(key) != pool.save_bytes(key)) {
      std::printf("FAIL: session %lld: its states differ from decoding alone\n",
                  static_cast<long long>(key));
      return 1;
    }
    std::printf(
        "session %lld: 5 prompt tokens + %d accepted drafts of 24, every output and the "
        "whole state (%zu bytes) bit for bit those of decoding alone\n",
        static_cast<long long>(key), accepted_total[key], pool.save_bytes(key).size());
  }
  std::printf("OK\n");
  return 0;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
}
