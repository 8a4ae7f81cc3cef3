// A model's mixer and the pieces around its recurrence, against what bounds them in the same
// binary.
//
// The Gated DeltaNet mixer (GatedDeltaNet: convolution, SiLU, L2 norms, beta and gates, the
// recurrence, the gated norm) against the bare recurrence of its heads in the same binary
// (causal_gated_delta_rule_into over the same q, k, v, gates and beta, already convolved:
// issue 34's target, the mixer at >= 85% of its rate), and its decoding step against the bare
// recurrent steps of its heads (DeltaRuleStateBatch::step_into, target <= 1.25x). Shapes:
// Qwen3.5-9B's 16 q/k heads and 32 v heads of 128 (C = 8,192) at N = 4,096, and a small one
// (2 over 4 heads of 64) for quick runs; float, one thread.
//
// The output norms (OutputNorm) are a pass over memory: read o and the gate z, write y;
// their rate is read against a copy of o into y (two of the norm's three streams, so a norm
// at 1.5x the copy's time moves its bytes as fast as the copy does).
//
// Shapes: Qwen3.5-9B's 32 v heads of 128 (the gated RMSNorm with SiLU; Kimi's with sigmoid on
// the same shape), Mamba-2 at Nemotron-H's 128 heads of 64 in 8 groups of 1,024 channels (the
// gate before the norm), RWKV-7's 64 heads of 64 (GroupNorm, ungated); N = 4,096 tokens (DRAM)
// and 64 (in cache); float, one thread, real time. bytes_per_s counts the bytes each pass moves.
//
// RWKV-7's time mixing (Rwkv7TimeMix: the token shift, W_r, W_k, W_v, the four LoRAs, kk, the
// generalized delta rule, ln_x, the bonus, the gate) against its two floors in the same binary:
// the same GEMMs alone on ready inputs (Eigen's sgemm: every projection and LoRA of the
// layer) and the bare recurrence (DplrDeltaRuleLayer::forward_into on ready r, k, v, a, b and
// log w); the mixer's time over the two floors' sum says what its glue costs. Shapes: RWKV-7
// 1.5B (C = 2,048: 32 heads of 64, LoRA ranks 96, 96, 64, 256) at N = 4,096 and its step (the
// GEMMs at N = B then are matrix-vector products), and a small one (2 heads of 64, ranks 16).
//
// A session's blob (SessionPool<>::save_bytes, add_bytes): one Qwen3.5-9B Gated DeltaNet
// layer's save and load in each storage (exact, bf16, int8), with the blob's bytes and those
// of the model's 24 linear layers; and the drift of each storage against the states kept in
// float: 10,000 decoding steps (1,000 with LINATTN_BENCH_QUICK) with a store and load after
// every step, on Qwen3.5's heads of 128 (2 q/k over 4 v heads: every head runs alike); and
// a speculative round's rollback through the pool (restore from a snapshot) beside one step.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <linattn/draft_ring.hpp>
#include <linattn/gated_delta_net.hpp>
#include <linattn/output_norm.hpp>
#include <linattn/rwkv7_time_mix.hpp>
#include <linattn/session_pool.hpp>
#include <vector>

#include "bench_common.hpp"

namespace {

using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::HeadStrides;
using linattn::HeadsView;
using linattn::Matrix;
using linattn::OutputNorm;
using linattn::Vector;
using linattn_bench::measure;
using linattn_bench::random_matrix;

/// Which model's norm: Qwen3.5 (0), Kimi (1), Mamba-2 (2), RWKV-7 (3).
struct NormCase {
  const char* model;
  Eigen::Index heads, dim;
};
constexpr NormCase kNormCases[] = {
    {"qwen3_next", 32, 128}, {"kimi", 32, 128}, {"mamba2", 128, 64}, {"rwkv7", 64, 64}};

OutputNorm<float> make_norm(int which, Eigen::Index heads, Eigen::Index dim, bool checked) {
  const Vector<float> w_head = random_matrix<float>(dim, 1, 5, 0.1);
  const Vector<float> w_channel = random_matrix<float>(heads * dim, 1, 6, 0.1);
  OutputNorm<float> norm = [&] {
    switch (which) {
      case 0:
        return OutputNorm<float>::qwen3_next(w_head, 1e-6);
      case 1:
        return OutputNorm<float>::kimi(w_head, 1e-6);
      case 2:
        return OutputNorm<float>::mamba2(w_channel, heads * dim / 8, 1e-5);
      default:
        return OutputNorm<float>::rwkv7(w_channel, w_channel, 64e-5);
    }
  }();
  linattn::OutputNormOptions options = norm.options();
  options.threads = 1;
  options.check_finite = checked;
  return OutputNorm<float>(norm.weight(), norm.bias(), options);
}

void set_pass_counters(benchmark::State& state, double elements, double streams) {
  state.counters["bytes_per_s"] =
      benchmark::Counter(streams * elements * double(sizeof(float)) * double(state.iterations()),
                         benchmark::Counter::kIsRate);
}

/// One norm over N tokens of every head: OutputNorm::apply_into, o and z to y; the third
/// argument 1 for the default scan of o and z for NaN and Inf first (a pass of its own), 0
/// without (check_finite off).
void BM_OutputNorm(benchmark::State& state) {
  const int which = static_cast<int>(state.range(0));
  const Eigen::Index tokens = state.range(1);
  const NormCase& c = kNormCases[which];
  const OutputNorm<float> norm = make_norm(which, c.heads, c.dim, state.range(2) != 0);
  const Matrix<float> o = random_matrix<float>(tokens, c.heads * c.dim, 1);
  const Matrix<float> z = random_matrix<float>(tokens, c.heads * c.dim, 2);
  Matrix<float> y(tokens, c.heads * c.dim);
  const BnhdShape shape(1, tokens, c.heads, c.dim);
  const bool gated = norm.options().gate != linattn::NormGate::none;
  measure(state, [&] {
    if (gated) {
      norm.apply_into(ConstHeadsView<float>::bnhd(o.data(), shape),
                      ConstHeadsView<float>::bnhd(z.data(), shape),
                      HeadsView<float>::bnhd(y.data(), shape));
    } else {
      norm.apply_into(ConstHeadsView<float>::bnhd(o.data(), shape),
                      HeadsView<float>::bnhd(y.data(), shape));
    }
    benchmark::DoNotOptimize(y.data());
  });
  state.SetLabel(c.model);
  set_pass_counters(state, double(o.size()), gated ? 3.0 : 2.0);
}

/// o copied into y (std::copy): the passes over memory a norm cannot beat.
void BM_NormCopy(benchmark::State& state) {
  const int which = static_cast<int>(state.range(0));
  const Eigen::Index tokens = state.range(1);
  const NormCase& c = kNormCases[which];
  const Matrix<float> o = random_matrix<float>(tokens, c.heads * c.dim, 1);
  Matrix<float> y(tokens, c.heads * c.dim);
  measure(state, [&] {
    std::copy(o.data(), o.data() + o.size(), y.data());
    benchmark::DoNotOptimize(y.data());
  });
  state.SetLabel(c.model);
  set_pass_counters(state, double(o.size()), 2.0);
}

/// Qwen3.5-9B's mixer (the shape) or a small one.
linattn::GatedDeltaNetShape mixer_shape(bool qwen) {
  linattn::GatedDeltaNetShape shape;
  if (!qwen) {
    shape.key_heads = 2;
    shape.value_heads = 4;
    shape.key_dim = 64;
    shape.value_dim = 64;
  }
  return shape;
}

linattn::GatedDeltaNet<float> make_mixer(const linattn::GatedDeltaNetShape& shape) {
  linattn::GatedDeltaNetWeights<float> w;
  w.conv_weight = random_matrix<float>(shape.conv_channels(), shape.conv_kernel, 7, 0.5);
  w.a_log = Vector<float>::Constant(shape.value_heads, 1.0f);
  w.dt_bias = Vector<float>::Ones(shape.value_heads);
  w.norm_weight = Vector<float>::Ones(shape.value_dim);
  linattn::GatedDeltaNetOptions options;
  options.threads = 1;
  return linattn::GatedDeltaNet<float>(shape, w, options);
}

/// The projections' outputs of one sequence of N tokens, contiguous.
struct MixerInputs {
  Matrix<float> qkv, z, b, a;
  MixerInputs(const linattn::GatedDeltaNetShape& shape, Eigen::Index tokens)
      : qkv(random_matrix<float>(tokens, shape.conv_channels(), 11)),
        z(random_matrix<float>(tokens, shape.value_channels(), 12)),
        b(random_matrix<float>(tokens, shape.value_heads, 13)),
        a(random_matrix<float>(tokens, shape.value_heads, 14)) {}
  linattn::GatedDeltaNetInputs<float> views(const linattn::GatedDeltaNetShape& shape) const {
    const Eigen::Index n = qkv.rows(), hv = shape.value_heads;
    return {ConstHeadsView<float>::bnhd(qkv.data(), BnhdShape(1, n, 1, qkv.cols())),
            ConstHeadsView<float>::bnhd(z.data(), BnhdShape(1, n, hv, shape.value_dim)),
            ConstHeadsView<float>::bnhd(b.data(), BnhdShape(1, n, hv, 1)),
            ConstHeadsView<float>::bnhd(a.data(), BnhdShape(1, n, hv, 1))};
  }
};

/// Useful FLOPs of the recurrence over N tokens of every value head (6 Dk Dv a token), the
/// rate both benchmarks report.
double mixer_flops(const linattn::GatedDeltaNetShape& shape, Eigen::Index tokens) {
  return 6.0 * double(shape.key_dim) * double(shape.value_dim) * double(shape.value_heads) *
         double(tokens);
}

/// The whole mixer over one sequence of N tokens: GatedDeltaNet::forward_into (third argument
/// 0), or a prefill from fresh states that also writes the states every 256 tokens (1: prefix
/// caching's checkpoints, issue 34's target at most 5% over the same prefill without them).
void BM_GatedDeltaNet(benchmark::State& state) {
  const linattn::GatedDeltaNetShape shape = mixer_shape(state.range(0) != 0);
  const Eigen::Index tokens = state.range(1);
  const bool checkpoints = state.range(2) != 0;
  const linattn::GatedDeltaNet<float> mixer = make_mixer(shape);
  const MixerInputs in(shape, tokens);
  Matrix<float> y(tokens, shape.value_channels());
  const auto out =
      HeadsView<float>::bnhd(y.data(), BnhdShape(1, tokens, shape.value_heads, shape.value_dim));
  std::vector<Eigen::Index> positions;
  for (Eigen::Index p = 256; p <= tokens; p += 256) positions.push_back(p);
  std::vector<linattn::GatedDeltaNetStates<float>> snapshots;
  measure(state, [&] {
    if (checkpoints) {
      auto states = mixer.make_states(1);
      mixer.prefill_into(states, in.views(shape), out, positions, snapshots);
    } else {
      mixer.forward_into(in.views(shape), out);
    }
    benchmark::DoNotOptimize(y.data());
  });
  linattn_bench::set_rates(state, mixer_flops(shape, tokens), double(tokens));
}

/// The recurrence alone over the same heads: causal_gated_delta_rule_into on the convolved
/// q, k, v (views of one [N, C] buffer, as the mixer reads them), log gates and beta.
void BM_GatedDeltaRuleBare(benchmark::State& state) {
  const linattn::GatedDeltaNetShape shape = mixer_shape(state.range(0) != 0);
  const Eigen::Index tokens = state.range(1);
  const Eigen::Index c = shape.conv_channels(), hk = shape.key_heads, hv = shape.value_heads;
  const Eigen::Index dk = shape.key_dim, dv = shape.value_dim;
  const Matrix<float> mixed = random_matrix<float>(tokens, c, 21);
  const Matrix<float> log_gate = Matrix<float>::Constant(tokens, hv, -0.05f);
  const Matrix<float> beta = Matrix<float>::Constant(tokens, hv, 0.5f);
  Matrix<float> y(tokens, shape.value_channels());
  linattn::DeltaOptions options;
  options.l2_normalize = true;
  options.threads = 1;
  // Layout 0: views of one [N, C] buffer, as the mixer reads its convolution's output; 1:
  // each head's rows contiguous ([H, N, D] tensors), the layout the kernels stream fastest.
  const bool per_head = state.range(2) != 0;
  const Matrix<float> heads_q = random_matrix<float>(hk * tokens, dk, 22);
  const Matrix<float> heads_k = random_matrix<float>(hk * tokens, dk, 23);
  const Matrix<float> heads_v = random_matrix<float>(hv * tokens, dv, 24);
  const HeadStrides split{tokens * c, dk, c, 1};
  const ConstHeadsView<float> q =
      per_head ? ConstHeadsView<float>::bhnd(heads_q.data(), {1, hk, tokens, dk})
               : ConstHeadsView<float>(mixed.data(), 1, hk, tokens, dk, split);
  const ConstHeadsView<float> k =
      per_head ? ConstHeadsView<float>::bhnd(heads_k.data(), {1, hk, tokens, dk})
               : ConstHeadsView<float>(mixed.data() + hk * dk, 1, hk, tokens, dk, split);
  const ConstHeadsView<float> v =
      per_head ? ConstHeadsView<float>::bhnd(heads_v.data(), {1, hv, tokens, dv})
               : ConstHeadsView<float>(mixed.data() + 2 * hk * dk, 1, hv, tokens, dv,
                                       HeadStrides{tokens * c, dv, c, 1});
  const auto g = ConstHeadsView<float>::bnhd(log_gate.data(), BnhdShape(1, tokens, hv, 1));
  const auto b = ConstHeadsView<float>::bnhd(beta.data(), BnhdShape(1, tokens, hv, 1));
  const auto out = HeadsView<float>::bnhd(y.data(), BnhdShape(1, tokens, hv, dv));
  measure(state, [&] {
    linattn::causal_gated_delta_rule_into(q, k, v, linattn::log_gates(g), b, out, options);
    benchmark::DoNotOptimize(y.data());
  });
  linattn_bench::set_rates(state, mixer_flops(shape, tokens), double(tokens));
}

/// One decoding step of B sequences through the whole mixer (GatedDeltaNet::step_into).
void BM_GatedDeltaNetStep(benchmark::State& state) {
  const linattn::GatedDeltaNetShape shape = mixer_shape(state.range(0) != 0);
  const Eigen::Index batch = state.range(1);
  const linattn::GatedDeltaNet<float> mixer = make_mixer(shape);
  auto states = mixer.make_states(batch);
  const MixerInputs token(shape, batch);  // row b: sequence b's token ([B, 1, ...])
  const Eigen::Index hv = shape.value_heads;
  const linattn::GatedDeltaNetInputs<float> in{
      ConstHeadsView<float>::bnhd(token.qkv.data(), BnhdShape(batch, 1, 1, token.qkv.cols())),
      ConstHeadsView<float>::bnhd(token.z.data(), BnhdShape(batch, 1, hv, shape.value_dim)),
      ConstHeadsView<float>::bnhd(token.b.data(), BnhdShape(batch, 1, hv, 1)),
      ConstHeadsView<float>::bnhd(token.a.data(), BnhdShape(batch, 1, hv, 1))};
  Matrix<float> y(batch, shape.value_channels());
  const auto out = HeadsView<float>::bnhd(y.data(), BnhdShape(batch, 1, hv, shape.value_dim));
  measure(state, [&] {
    mixer.step_into(states, in, out);
    benchmark::DoNotOptimize(y.data());
  });
  linattn_bench::set_rates(state, mixer_flops(shape, batch), double(batch));
}

/// The recurrent steps alone: DeltaRuleStateBatch::step_into of the same B * Hv states on
/// ready q, k, v, log gates and beta.
void BM_GatedDeltaStepBare(benchmark::State& state) {
  const linattn::GatedDeltaNetShape shape = mixer_shape(state.range(0) != 0);
  const Eigen::Index batch = state.range(1);
  const Eigen::Index hk = shape.key_heads, hv = shape.value_heads;
  linattn::DeltaOptions options;
  options.l2_normalize = true;
  options.threads = 1;
  const linattn::DeltaRuleLayer<float> layer(linattn::LayerHeads::grouped_query_key(hv, hk),
                                             shape.key_dim, shape.value_dim, options);
  auto states = layer.make_states(batch);
  const Matrix<float> q = random_matrix<float>(batch * hk, shape.key_dim, 31);
  const Matrix<float> k = random_matrix<float>(batch * hk, shape.key_dim, 32);
  const Matrix<float> v = random_matrix<float>(batch * hv, shape.value_dim, 33);
  const Matrix<float> log_gate = Matrix<float>::Constant(batch * hv, 1, -0.05f);
  const Matrix<float> beta = Matrix<float>::Constant(batch * hv, 1, 0.5f);
  Matrix<float> o(batch * hv, shape.value_dim);
  measure(state, [&] {
    layer.step_into(states, q, k, v, linattn::log_gates(log_gate), beta, o);
    benchmark::DoNotOptimize(o.data());
  });
  linattn_bench::set_rates(state, mixer_flops(shape, batch), double(batch));
}

/// RWKV-7 1.5B's layer (32 heads of 64, LoRA ranks w 96, a 96, v 64, g 256), or a small one.
struct Rwkv7Case {
  Eigen::Index heads, w_rank, a_rank, v_rank, g_rank;
  Eigen::Index channels() const { return heads * 64; }
};
Rwkv7Case rwkv7_case(bool big) {
  return big ? Rwkv7Case{32, 96, 96, 64, 256} : Rwkv7Case{2, 16, 16, 16, 16};
}

/// Useful FLOPs per token: the GEMMs (2 C^2 each of W_r, W_k, W_v; 4 C L per LoRA) and the
/// recurrence (8 Dk Dv per head, the count).
double rwkv7_flops(const Rwkv7Case& c, Eigen::Index tokens) {
  const double ch = double(c.channels());
  const double ranks = double(c.w_rank + c.a_rank + c.v_rank + c.g_rank);
  return double(tokens) * (6.0 * ch * ch + 4.0 * ch * ranks + 8.0 * 64.0 * 64.0 * double(c.heads));
}

linattn::Rwkv7TimeMix<float> make_rwkv7(const Rwkv7Case& c) {
  const Eigen::Index ch = c.channels();
  const float s = 1.0f / std::sqrt(float(ch));
  linattn::Rwkv7TimeMixWeights<float> w;
  std::uint64_t seed = 40;
  const auto vec = [&](double stddev, double mean) {
    return Vector<float>(
        (random_matrix<float>(ch, 1, seed++, stddev).array() + float(mean)).matrix());
  };
  const auto mat = [&](Eigen::Index rows, Eigen::Index cols, double stddev) {
    return random_matrix<float>(rows, cols, seed++, stddev);
  };
  for (auto* mix : {&w.x_r, &w.x_w, &w.x_k, &w.x_v, &w.x_a, &w.x_g}) {
    *mix = vec(0.2, 0.5).cwiseMax(0.0f).cwiseMin(1.0f);
  }
  w.receptance = mat(ch, ch, s), w.key = mat(ch, ch, s), w.value = mat(ch, ch, s);
  w.w1 = mat(ch, c.w_rank, s), w.w2 = mat(c.w_rank, ch, 0.1), w.w0 = vec(0.5, -0.5);
  w.a1 = mat(ch, c.a_rank, s), w.a2 = mat(c.a_rank, ch, 0.1), w.a0 = vec(0.5, 0);
  w.v1 = mat(ch, c.v_rank, s), w.v2 = mat(c.v_rank, ch, 0.1), w.v0 = vec(0.5, 0);
  w.g1 = mat(ch, c.g_rank, s), w.g2 = mat(c.g_rank, ch, 0.1);
  w.k_k = vec(0.1, 1), w.k_a = vec(0.1, 1), w.r_k = mat(c.heads, 64, 0.5);
  w.ln_x_weight = vec(0.1, 1), w.ln_x_bias = vec(0.1, 0);
  linattn::Rwkv7TimeMixShape shape;
  shape.heads = c.heads;
  shape.head_dim = 64;
  linattn::Rwkv7TimeMixOptions options;
  options.threads = 1;
  return linattn::Rwkv7TimeMix<float>(shape, w, options);
}

/// The whole time mixing over one sequence of N tokens (forward_into), or, with N = B, one
/// decoding step of B sequences (step_into).
void BM_Rwkv7TimeMix(benchmark::State& state) {
  const Rwkv7Case c = rwkv7_case(state.range(0) != 0);
  const Eigen::Index tokens = state.range(1);
  const bool step = state.range(2) != 0;
  const linattn::Rwkv7TimeMix<float> mix = make_rwkv7(c);
  const Eigen::Index ch = c.channels();
  const Matrix<float> x = random_matrix<float>(tokens, ch, 50);
  Matrix<float> v_first = random_matrix<float>(tokens, ch, 51), y(tokens, ch);
  const BnhdShape heads =
      step ? BnhdShape(tokens, 1, c.heads, 64) : BnhdShape(1, tokens, c.heads, 64);
  const BnhdShape rows = step ? BnhdShape(tokens, 1, 1, ch) : BnhdShape(1, tokens, 1, ch);
  const auto xv = ConstHeadsView<float>::bnhd(x.data(), rows);
  const auto fv = HeadsView<float>::bnhd(v_first.data(), heads);
  const auto out = HeadsView<float>::bnhd(y.data(), heads);
  auto states = mix.make_states(step ? tokens : 1);
  measure(state, [&] {
    if (step) {
      mix.step_into(states, xv, fv, out);
    } else {
      mix.forward_into(xv, fv, out);
    }
    benchmark::DoNotOptimize(y.data());
  });
  linattn_bench::set_rates(state, rwkv7_flops(c, tokens), double(tokens));
}

/// The layer's GEMMs alone (Eigen's sgemm) on N ready rows: r, k, v from three shifted inputs,
/// and each LoRA's two products.
void BM_Rwkv7Gemms(benchmark::State& state) {
  const Rwkv7Case c = rwkv7_case(state.range(0) != 0);
  const Eigen::Index tokens = state.range(1), ch = c.channels();
  const Matrix<float> in = random_matrix<float>(6 * tokens, ch, 60);
  // Three matrices, as the layer's: at one token their 3 C^2 floats stream from memory.
  const Matrix<float> w[] = {random_matrix<float>(ch, ch, 61, 0.02),
                             random_matrix<float>(ch, ch, 64, 0.02),
                             random_matrix<float>(ch, ch, 65, 0.02)};
  const Eigen::Index ranks[] = {c.w_rank, c.a_rank, c.v_rank, c.g_rank};
  std::vector<Matrix<float>> down, up;
  for (const Eigen::Index r : ranks) {
    down.push_back(random_matrix<float>(ch, r, 62 + 10 * std::uint64_t(r), 0.02));
    up.push_back(random_matrix<float>(r, ch, 63 + 10 * std::uint64_t(r), 0.1));
  }
  Matrix<float> out(3 * tokens, ch), lora(tokens, ch), hidden(tokens, 256);
  measure(state, [&] {
    for (Eigen::Index i = 0; i < 3; ++i) {
      out.middleRows(i * tokens, tokens).noalias() =
          in.middleRows(i * tokens, tokens) * w[i].transpose();
    }
    for (std::size_t i = 0; i < 4; ++i) {
      const Eigen::Index r = ranks[i];
      hidden.leftCols(r).noalias() =
          in.middleRows((3 + Eigen::Index(i) % 3) * tokens, tokens) * down[i];
      lora.noalias() = hidden.leftCols(r) * up[i];
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(lora.data());
  });
  // The GEMMs' own FLOPs: the layer's but the recurrence's.
  linattn_bench::set_rates(
      state, rwkv7_flops(c, tokens) - 8.0 * 64.0 * 64.0 * double(c.heads) * double(tokens),
      double(tokens));
}

/// The recurrence alone: DplrDeltaRuleLayer::forward_into on ready [1, N, H, 64] views.
void BM_Rwkv7Recurrence(benchmark::State& state) {
  const Rwkv7Case c = rwkv7_case(state.range(0) != 0);
  const Eigen::Index tokens = state.range(1), ch = c.channels();
  linattn::DplrOptions options;
  options.scale = 1.0;
  options.threads = 1;
  const linattn::DplrDeltaRuleLayer<float> layer(c.heads, 64, 64, options);
  const Matrix<float> r = random_matrix<float>(tokens, ch, 70),
                      k = random_matrix<float>(tokens, ch, 71);
  const Matrix<float> v = random_matrix<float>(tokens, ch, 72);
  Matrix<float> kk = random_matrix<float>(tokens, ch, 73);
  for (Eigen::Index t = 0; t < tokens; ++t) {
    for (Eigen::Index h = 0; h < c.heads; ++h) kk.row(t).segment(h * 64, 64).normalize();
  }
  const Matrix<float> a = -kk, b = 0.5f * kk;
  const Matrix<float> log_w = Matrix<float>::Constant(tokens, ch, -0.3f);
  Matrix<float> y(tokens, ch);
  const BnhdShape shape(1, tokens, c.heads, 64);
  const auto view = [&](const Matrix<float>& m) {
    return ConstHeadsView<float>::bnhd(m.data(), shape);
  };
  const auto out = HeadsView<float>::bnhd(y.data(), shape);
  measure(state, [&] {
    layer.forward_into(view(r), view(k), view(v), view(a), view(b), linattn::log_gates(view(log_w)),
                       out);
    benchmark::DoNotOptimize(y.data());
  });
  // The recurrence's own FLOPs (8 Dk Dv a head and token), not the layer's.
  linattn_bench::set_rates(state, 8.0 * 64.0 * 64.0 * double(c.heads) * double(tokens),
                           double(tokens));
}

/// One round of speculative decoding through the mixer, K = 4 drafts of which m = 2 are kept,
/// B sequences: mode 0 plain (4 steps, no rollback: the cost to compare with), 1 the DraftRing
/// (begin, 4 steps each recorded, rollback to 2), 2 replay (a copy of the accepted states, 4
/// steps, the copy put back, 2 steps again).
void BM_DraftRound(benchmark::State& state) {
  const linattn::GatedDeltaNetShape shape = mixer_shape(state.range(0) != 0);
  const Eigen::Index batch = state.range(1);
  const int mode = static_cast<int>(state.range(2));
  constexpr Eigen::Index kDrafts = 4, kKept = 2;
  const linattn::GatedDeltaNet<float> mixer = make_mixer(shape);
  auto states = mixer.make_states(batch);
  const MixerInputs token(shape, batch);
  const Eigen::Index hv = shape.value_heads;
  const linattn::GatedDeltaNetInputs<float> in{
      ConstHeadsView<float>::bnhd(token.qkv.data(), BnhdShape(batch, 1, 1, token.qkv.cols())),
      ConstHeadsView<float>::bnhd(token.z.data(), BnhdShape(batch, 1, hv, shape.value_dim)),
      ConstHeadsView<float>::bnhd(token.b.data(), BnhdShape(batch, 1, hv, 1)),
      ConstHeadsView<float>::bnhd(token.a.data(), BnhdShape(batch, 1, hv, 1))};
  Matrix<float> y(batch, shape.value_channels());
  const auto out = HeadsView<float>::bnhd(y.data(), BnhdShape(batch, 1, hv, shape.value_dim));
  linattn::DraftRing<linattn::GatedDeltaNetStates<float>> ring(kDrafts);
  linattn::GatedDeltaNetStates<float> saved = states;
  measure(state, [&] {
    if (mode == 1) ring.begin(states);
    if (mode == 2) saved = states;
    for (Eigen::Index t = 0; t < kDrafts; ++t) {
      mixer.step_into(states, in, out);
      if (mode == 1) ring.record(states);
    }
    if (mode == 1) ring.rollback(states, kKept);
    if (mode == 2) {
      states = saved;
      for (Eigen::Index t = 0; t < kKept; ++t) mixer.step_into(states, in, out);
    }
    benchmark::DoNotOptimize(y.data());
  });
  linattn_bench::set_rates(state, mixer_flops(shape, batch * kDrafts), double(batch * kDrafts));
}

/// The rollback alone: DraftRing::rollback of B sequences' states to m = 2 of 4 recorded.
void BM_DraftRollback(benchmark::State& state) {
  const linattn::GatedDeltaNetShape shape = mixer_shape(state.range(0) != 0);
  const Eigen::Index batch = state.range(1);
  const linattn::GatedDeltaNet<float> mixer = make_mixer(shape);
  auto states = mixer.make_states(batch);
  linattn::DraftRing<linattn::GatedDeltaNetStates<float>> ring(4);
  ring.begin(states);
  for (int t = 0; t < 4; ++t) ring.record(states);
  measure(state, [&] {
    ring.rollback(states, 2);
    benchmark::DoNotOptimize(&states);
  });
}

/// A pool of one Gated DeltaNet layer and the session it holds after `tokens` steps.
linattn::SessionPool<> pool_after(const linattn::GatedDeltaNet<float>& mixer,
                                  const linattn::GatedDeltaNetShape& shape, Eigen::Index tokens) {
  linattn::SessionPool<> pool(mixer);
  pool.add(0);
  const MixerInputs prompt(shape, tokens);
  Matrix<float> y(tokens, shape.value_channels());
  pool.prefill_into(
      0, {0}, mixer, prompt.views(shape),
      HeadsView<float>::bnhd(y.data(), BnhdShape(1, tokens, shape.value_heads, shape.value_dim)));
  return pool;
}

/// One Qwen3.5-9B linear layer's session saved as a blob in storage range(0).
void BM_SessionSave(benchmark::State& state) {
  const auto storage = static_cast<linattn::SessionStorage>(state.range(0));
  const linattn::GatedDeltaNetShape shape = mixer_shape(true);
  const linattn::GatedDeltaNet<float> mixer = make_mixer(shape);
  const linattn::SessionPool<> pool = pool_after(mixer, shape, 64);
  std::size_t bytes = 0;
  measure(state, [&] {
    const std::vector<std::uint8_t> blob = pool.save_bytes(0, storage);
    bytes = blob.size();
    benchmark::DoNotOptimize(blob.data());
  });
  state.counters["blob_bytes"] = double(bytes);
  state.counters["qwen35_9b_MiB"] = 24.0 * double(bytes) / (1 << 20);  // its 24 linear layers
  state.counters["bytes_per_s"] =
      benchmark::Counter(double(bytes) * double(state.iterations()), benchmark::Counter::kIsRate,
                         benchmark::Counter::OneK::kIs1000);
}

/// The same blob added back (read, checked) and the session dropped again.
void BM_SessionLoad(benchmark::State& state) {
  const auto storage = static_cast<linattn::SessionStorage>(state.range(0));
  const linattn::GatedDeltaNetShape shape = mixer_shape(true);
  const linattn::GatedDeltaNet<float> mixer = make_mixer(shape);
  linattn::SessionPool<> pool = pool_after(mixer, shape, 64);
  const std::vector<std::uint8_t> blob = pool.save_bytes(0, storage);
  measure(state, [&] {
    pool.add_bytes(1, blob);
    pool.drop(1);
  });
  state.counters["bytes_per_s"] =
      benchmark::Counter(double(blob.size()) * double(state.iterations()),
                         benchmark::Counter::kIsRate, benchmark::Counter::OneK::kIs1000);
}

/// A speculative round's rollback through the pool: restore(key, snapshot) of one Qwen3.5-9B
/// linear layer's session (mode 0), against one decoding step of it (mode 1): issue 34's
/// target, the rollback at most one step.
void BM_PoolRollback(benchmark::State& state) {
  const linattn::GatedDeltaNetShape shape = mixer_shape(state.range(0) != 0);
  const bool rollback = state.range(1) == 0;
  const linattn::GatedDeltaNet<float> mixer = make_mixer(shape);
  linattn::SessionPool<> pool = pool_after(mixer, shape, 64);
  const linattn::SessionSnapshot snapshot = pool.snapshot(0);
  const MixerInputs token(shape, 1);
  const auto in = token.views(shape);
  Matrix<float> y(1, shape.value_channels());
  const auto out =
      HeadsView<float>::bnhd(y.data(), BnhdShape(1, 1, shape.value_heads, shape.value_dim));
  measure(state, [&] {
    if (rollback) {
      pool.restore(0, snapshot);
    } else {
      pool.step_into(0, mixer, in, out);
    }
    benchmark::DoNotOptimize(y.data());
  });
}

/// Steps of one session in storage range(0), stored and loaded after every step, against the
/// same steps kept in float: drift_y, the outputs' max |y - y_float| / max |y_float| over the
/// last 100 steps; drift_S, the states' at the end, relative to max |S|.
void BM_StorageDrift(benchmark::State& state) {
  const auto storage = static_cast<linattn::SessionStorage>(state.range(0));
  const Eigen::Index steps = linattn_bench::quick() ? 1000 : 10000;
  linattn::GatedDeltaNetShape shape = mixer_shape(true);
  shape.key_heads = 2;
  shape.value_heads = 4;
  const linattn::GatedDeltaNet<float> mixer = make_mixer(shape);
  const MixerInputs tokens(shape, steps);
  const Eigen::Index hv = shape.value_heads, dv = shape.value_dim;
  const auto token = [&](const Matrix<float>& m, Eigen::Index t, Eigen::Index heads,
                         Eigen::Index dim) {
    return ConstHeadsView<float>::bnhd(m.data() + t * m.cols(), BnhdShape(1, 1, heads, dim));
  };
  double drift_y = 0, drift_s = 0;
  for (auto _ : state) {
    linattn::SessionPool<> kept(mixer), stored(mixer);
    kept.add(0);
    stored.add(0);
    Matrix<float> y_kept(1, hv * dv), y_stored(1, hv * dv);
    const auto out = [&](Matrix<float>& y) {
      return HeadsView<float>::bnhd(y.data(), BnhdShape(1, 1, hv, dv));
    };
    double top_y = 0, error_y = 0;
    for (Eigen::Index t = 0; t < steps; ++t) {
      const linattn::GatedDeltaNetInputs<float> in{
          token(tokens.qkv, t, 1, tokens.qkv.cols()), token(tokens.z, t, hv, dv),
          token(tokens.b, t, hv, 1), token(tokens.a, t, hv, 1)};
      kept.step_into(0, mixer, in, out(y_kept));
      stored.step_into(0, mixer, in, out(y_stored));
      const std::vector<std::uint8_t> blob = stored.save_bytes(0, storage);
      stored.drop(0);
      stored.add_bytes(0, blob);
      if (t >= steps - 100) {
        top_y = std::max(top_y, double(y_kept.cwiseAbs().maxCoeff()));
        error_y = std::max(error_y, double((y_stored - y_kept).cwiseAbs().maxCoeff()));
      }
    }
    drift_y = error_y / top_y;
    const auto& a = kept.states<linattn::GatedDeltaNetStates<float>>(0, 0).recurrent;
    const auto& b = stored.states<linattn::GatedDeltaNetStates<float>>(0, 0).recurrent;
    double top_s = 0, error_s = 0;
    for (Eigen::Index h = 0; h < a.size(); ++h) {
      top_s = std::max(top_s, double(a[h].s().cwiseAbs().maxCoeff()));
      error_s = std::max(error_s, double((b[h].s() - a[h].s()).cwiseAbs().maxCoeff()));
    }
    drift_s = error_s / top_s;
  }
  state.counters["steps"] = double(steps);
  state.counters["drift_y"] = drift_y;
  state.counters["drift_S"] = drift_s;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = linattn_bench::quick();
  // Eigen's float GEMM in the same binary, to read the recurrence rows as a share of it.
  benchmark::RegisterBenchmark("BM_EigenGemm<float>", linattn_bench::BM_EigenGemm<float>)
      ->Arg(512)
      ->MinTime(0.5)
      ->Unit(benchmark::kMillisecond);
  std::vector<std::int64_t> token_counts{64};
  if (!quick) token_counts.push_back(4096);
  for (const std::int64_t tokens : token_counts) {
    for (std::int64_t which = 0; which < 4; ++which) {
      for (const std::int64_t checked : {1, 0}) {
        benchmark::RegisterBenchmark("BM_OutputNorm<float>", BM_OutputNorm)
            ->Args({which, tokens, checked})
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      }
      benchmark::RegisterBenchmark("BM_NormCopy<float>", BM_NormCopy)
          ->Args({which, tokens})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  // (Qwen3.5-9B or small, N): the whole mixer and its bare recurrence side by side.
  std::vector<std::pair<std::int64_t, std::int64_t>> mixers{{0, 1024}};
  if (!quick) mixers.push_back({1, 4096});
  for (const auto& [qwen, tokens] : mixers) {
    for (const std::int64_t checkpoints : {0, 1}) {
      benchmark::RegisterBenchmark("BM_GatedDeltaNet<float>", BM_GatedDeltaNet)
          ->Args({qwen, tokens, checkpoints})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
    for (const std::int64_t per_head : {0, 1}) {
      benchmark::RegisterBenchmark("BM_GatedDeltaRuleBare<float>", BM_GatedDeltaRuleBare)
          ->Args({qwen, tokens, per_head})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  // (RWKV-7 1.5B or small, N): the whole time mixing and its two floors side by side, then
  // its step at B = 1 beside the GEMMs of one row.
  std::vector<std::pair<std::int64_t, std::int64_t>> rwkv7{{0, 1024}};
  if (!quick) rwkv7.push_back({1, 4096});
  for (const auto& [big, tokens] : rwkv7) {
    benchmark::RegisterBenchmark("BM_Rwkv7TimeMix<float>", BM_Rwkv7TimeMix)
        ->Args({big, tokens, 0})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_Rwkv7Gemms<float>", BM_Rwkv7Gemms)
        ->Args({big, tokens})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_Rwkv7Recurrence<float>", BM_Rwkv7Recurrence)
        ->Args({big, tokens})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (const std::int64_t big : {0, 1}) {
    benchmark::RegisterBenchmark("BM_Rwkv7TimeMix<float>", BM_Rwkv7TimeMix)
        ->Args({big, 1, 1})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("BM_Rwkv7Gemms<float>", BM_Rwkv7Gemms)
        ->Args({big, 1})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  for (const std::int64_t qwen : {0, 1}) {
    for (const std::int64_t batch : {1, 8}) {
      benchmark::RegisterBenchmark("BM_GatedDeltaNetStep<float>", BM_GatedDeltaNetStep)
          ->Args({qwen, batch})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("BM_GatedDeltaStepBare<float>", BM_GatedDeltaStepBare)
          ->Args({qwen, batch})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  for (const std::int64_t qwen : {0, 1}) {
    for (const std::int64_t mode : {0, 1, 2}) {
      benchmark::RegisterBenchmark("BM_DraftRound<float>", BM_DraftRound)
          ->Args({qwen, 1, mode})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
    benchmark::RegisterBenchmark("BM_DraftRollback<float>", BM_DraftRollback)
        ->Args({qwen, 1})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  for (const std::int64_t storage : {0, 1, 2}) {
    benchmark::RegisterBenchmark("BM_SessionSave", BM_SessionSave)
        ->Arg(storage)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_SessionLoad", BM_SessionLoad)
        ->Arg(storage)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (const std::int64_t qwen : {0, 1}) {
    for (const std::int64_t mode : {0, 1}) {
      benchmark::RegisterBenchmark("BM_PoolRollback<float>", BM_PoolRollback)
          ->Args({qwen, mode})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  for (const std::int64_t storage : {0, 1, 2}) {
    benchmark::RegisterBenchmark("BM_StorageDrift", BM_StorageDrift)
        ->Arg(storage)
        ->Iterations(1)
        ->UseRealTime()
        ->Unit(benchmark::kSecond);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
