// SPDX-License-Identifier: MIT
// The small hybrid model whose session blobs fuzz_load reads and make_corpus writes: one layer
// of every kind a SessionPool<> holds, and a few tokens through each of a session's layers.
#pragma once

#include <cstdint>
#include <linattn/linattn.hpp>

namespace linattn_fuzz {

using linattn::Matrix;

/// Deterministic numbers in [-1, 1) from `seed`.
inline Matrix<float> numbers(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed) {
  Matrix<float> m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    m.data()[i] = static_cast<float>(seed >> 40) * 0x1p-23f - 1.0f;
  }
  return m;
}

/// Layers: 0 Gated DeltaNet (2 over 4 heads of 4, K = 4), 1 softmax KV caches (2 heads of 4),
/// 2 Mamba-2 (4 heads of 2, 2 groups, N = 3), 3 LFM2's gated conv (C = 4, K = 3), 4 linear
/// attention (elu + 1, 2 heads of 4), 5 DeltaNet (2 heads of 4), 6 the generalized delta rule
/// (RWKV-7's, 2 heads of 4).
struct SessionModel {
  static linattn::GatedDeltaNetShape gdn_shape() {
    linattn::GatedDeltaNetShape shape;
    shape.key_heads = 2;
    shape.value_heads = 4;
    shape.key_dim = 4;
    shape.value_dim = 4;
    shape.conv_kernel = 4;
    return shape;
  }
  static linattn::GatedDeltaNetWeights<float> gdn_weights() {
    const linattn::GatedDeltaNetShape shape = gdn_shape();
    return {numbers(shape.conv_channels(), shape.conv_kernel, 1),
            linattn::Vector<float>::Constant(shape.value_heads, 0.5f),
            linattn::Vector<float>::Ones(shape.value_heads),
            linattn::Vector<float>::Ones(shape.value_dim)};
  }
  static linattn::Mamba2Shape mamba_shape() {
    linattn::Mamba2Shape shape;
    shape.heads = 4;
    shape.head_dim = 2;
    shape.groups = 2;
    shape.state_dim = 3;
    shape.conv_kernel = 4;
    return shape;
  }
  static linattn::Mamba2Weights<float> mamba_weights() {
    const linattn::Mamba2Shape shape = mamba_shape();
    return {numbers(shape.conv_channels(), shape.conv_kernel, 2),
            numbers(shape.conv_channels(), 1, 3),
            linattn::Vector<float>::Constant(shape.heads, 0.5f),
            linattn::Vector<float>::Constant(shape.heads, -1.0f),
            linattn::Vector<float>::Ones(shape.heads),
            linattn::Vector<float>::Ones(shape.inner())};
  }

  linattn::GatedDeltaNet<float> gdn{gdn_shape(), gdn_weights()};
  linattn::KVCacheBatch<float> attention{1, 2, 4, 4};
  linattn::Mamba2<float> mamba{mamba_shape(), mamba_weights()};
  linattn::GatedShortConv<float> conv{numbers(4, 3, 4), numbers(4, 1, 5)};
  linattn::LinearAttentionLayer<float, linattn::EluPlusOne> linear{linattn::EluPlusOne{}, 2, 4, 4};
  linattn::DeltaRuleLayer<float> delta{2, 4, 4};
  linattn::DplrDeltaRuleLayer<float> dplr{2, 4, 4};

  linattn::SessionPool<> pool() const {
    return linattn::SessionPool<>(gdn, attention, mamba, conv, linear, delta, dplr);
  }

  /// `tokens` tokens through every layer of session `key` (the only live one), from `seed`.
  void advance(linattn::SessionPool<>& pool, std::int64_t key, Eigen::Index tokens,
               std::uint64_t seed) const {
    using View = linattn::ConstHeadsView<float>;
    using Out = linattn::HeadsView<float>;
    using linattn::BnhdShape;
    const Eigen::Index n = tokens;
    {
      const linattn::GatedDeltaNetShape s = gdn_shape();
      const Matrix<float> qkv = numbers(n, s.conv_channels(), seed);
      const Matrix<float> z = numbers(n, s.value_channels(), seed + 1);
      const Matrix<float> b = numbers(n, s.value_heads, seed + 2);
      const Matrix<float> a = numbers(n, s.value_heads, seed + 3);
      Matrix<float> y(n, s.value_channels());
      pool.prefill_into(0, {key}, gdn,
                        linattn::GatedDeltaNetInputs<float>{
                            View::bnhd(qkv.data(), BnhdShape(1, n, 1, s.conv_channels())),
                            View::bnhd(z.data(), BnhdShape(1, n, s.value_heads, s.value_dim)),
                            View::bnhd(b.data(), BnhdShape(1, n, s.value_heads, 1)),
                            View::bnhd(a.data(), BnhdShape(1, n, s.value_heads, 1))},
                        Out::bnhd(y.data(), BnhdShape(1, n, s.value_heads, s.value_dim)));
    }
    pool.lend<linattn::KVCacheBatch<float>>(1, {key}, [&](linattn::KVCacheBatch<float>& caches) {
      for (Eigen::Index h = 0; h < 2; ++h)
        caches.cache(0, h).append(numbers(n, 4, seed + 4 + h), numbers(n, 4, seed + 6 + h));
    });
    {
      const linattn::Mamba2Shape s = mamba_shape();
      const Matrix<float> z = numbers(n, s.inner(), seed + 8);
      const Matrix<float> xbc = numbers(n, s.conv_channels(), seed + 9);
      const Matrix<float> dt = numbers(n, s.heads, seed + 10);
      Matrix<float> y(n, s.inner());
      pool.prefill_into(2, {key}, mamba,
                        linattn::Mamba2Inputs<float>{
                            View::bnhd(z.data(), BnhdShape(1, n, s.heads, s.head_dim)),
                            View::bnhd(xbc.data(), BnhdShape(1, n, 1, s.conv_channels())),
                            View::bnhd(dt.data(), BnhdShape(1, n, s.heads, 1))},
                        Out::bnhd(y.data(), BnhdShape(1, n, s.heads, s.head_dim)));
    }
    {
      const Matrix<float> bcx = numbers(n, 12, seed + 11);
      Matrix<float> y(n, 4);
      pool.prefill_into(3, {key}, conv, View::bnhd(bcx.data(), BnhdShape(1, n, 1, 12)),
                        Out::bnhd(y.data(), BnhdShape(1, n, 1, 4)));
    }
    for (Eigen::Index t = 0; t < n; ++t) {
      const Matrix<float> q = numbers(2, 4, seed + 12 + t), k = numbers(2, 4, seed + 13 + t);
      const Matrix<float> v = numbers(2, 4, seed + 14 + t);
      Matrix<float> out(2, 4);
      pool.step_into(4, linear, q, k, v, out);
      const linattn::Vector<float> beta = linattn::Vector<float>::Constant(2, 0.5f);
      pool.step_into(5, delta, q, k, v, beta, out);
      // RWKV-7's pairs: a = -kk, b = kk / 2 with kk = k's rows normalised; decays in (0.5, 1].
      Matrix<float> kk = k;
      kk.rowwise().normalize();
      const Matrix<float> minus_kk = -kk, half_kk = 0.5f * kk;
      const Matrix<float> log_w = -0.35f * (numbers(2, 4, seed + 15 + t).array() + 1.0f).matrix();
      pool.step_into(6, dplr, q, k, v, minus_kk, half_kk, linattn::log_gates(log_w), out);
    }
  }
};

}  // namespace linattn_fuzz
