// The generalized (diagonal-plus-low-rank) delta rule, RWKV-7's recurrence, on one thread: a
// prefill of H heads of size D over N tokens ([1, N, H, D] views, as a model's buffers) in each
// form (the streamed recurrence; the chunked
// WY form at chunk 16, 32 and 64), against a per-token loop of ggml_rwkv_wkv7's shape written
// with Eigen in this file (the state V x K, row-major; per value row i: sa = a . S_i,
// S_i = S_i o w + v_i k + sa b, out_i = S_i . r), and Eigen's GEMM rate in the same binary. The
// step: DplrDeltaRuleState::step_into against DeltaRuleState's Gated DeltaNet step of the same
// shape. Useful FLOPs are the recurrence's: 8 Dk Dv per token and head. RWKV-7-like inputs:
// kk unit rows, a = -kk, b = kk o alpha, log decays in [-0.6, 0], scale 1.
#include <cmath>
#include <linattn/delta_rule.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/state_batch.hpp>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using linattn::Matrix;
using linattn::Vector;
using linattn_bench::random_matrix;
using linattn_bench::set_rates;

/// H heads of size D, token-major as a model lays them out ([N, H * D]).
struct Heads {
  Eigen::Index heads, dim;
  Matrix<float> r, k, v, a, b, log_w, w, out;
  Heads(Eigen::Index n, Eigen::Index h, Eigen::Index d)
      : heads(h),
        dim(d),
        r(random_matrix<float>(n, h * d, 41)),
        k(random_matrix<float>(n, h * d, 42) / std::sqrt(float(d))),
        v(random_matrix<float>(n, h * d, 43)),
        a(random_matrix<float>(n, h * d, 44)),
        b(n, h * d),
        log_w((random_matrix<float>(n, h * d, 45).array().abs().min(2.0f) * -0.3f).matrix()),
        w(log_w.array().exp().matrix()),
        out(n, h * d) {
    const Matrix<float> alpha = random_matrix<float>(n, h * d, 46).array().tanh() * 0.45f + 0.5f;
    for (Eigen::Index t = 0; t < n; ++t) {
      for (Eigen::Index j = 0; j < h; ++j) {
        auto kk = a.row(t).segment(j * d, d);
        kk.normalize();
        b.row(t).segment(j * d, d) = kk.cwiseProduct(alpha.row(t).segment(j * d, d));
        kk = -kk;
      }
    }
  }
};

double useful_flops(Eigen::Index n, Eigen::Index heads, Eigen::Index d) {
  return 8.0 * double(n) * double(heads) * double(d) * double(d);
}

/// causal_dplr_delta_rule_into on [B = 1, N, H, D] views of the buffers, in `form`.
void BM_DplrPrefill(benchmark::State& state, Eigen::Index heads, Eigen::Index d,
                    linattn::DeltaForm form, Eigen::Index chunk) {
  const Eigen::Index n = state.range(0);
  Heads in(n, heads, d);
  linattn::DplrOptions options;
  options.scale = 1.0;
  options.chunk = chunk;
  options.form = form;
  options.threads = 1;
  using View = linattn::HeadsView<const float>;
  const linattn::BnhdShape shape{1, n, heads, d};
  linattn_bench::measure(state, [&] {
    linattn::causal_dplr_delta_rule_into(
        View::bnhd(in.r.data(), shape), View::bnhd(in.k.data(), shape),
        View::bnhd(in.v.data(), shape), View::bnhd(in.a.data(), shape),
        View::bnhd(in.b.data(), shape), linattn::log_gates(View::bnhd(in.log_w.data(), shape)),
        linattn::HeadsView<float>::bnhd(in.out.data(), shape), options);
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, useful_flops(n, heads, d), double(n));
}

/// ggml_rwkv_wkv7's loop (ggml-cpu/ops.cpp) in Eigen: per token and head, per value row of the
/// V x K state, one dot with a, the row's update, one dot with r.
void BM_DplrGgmlLoop(benchmark::State& state, Eigen::Index heads, Eigen::Index d) {
  const Eigen::Index n = state.range(0);
  Heads in(n, heads, d);
  Matrix<float> s(heads * d, d);  // head h's V x K state: rows [h d, (h + 1) d)
  linattn_bench::measure(state, [&] {
    s.setZero();
    for (Eigen::Index t = 0; t < n; ++t) {
      for (Eigen::Index h = 0; h < heads; ++h) {
        const Eigen::Index c = h * d;
        const auto r = in.r.row(t).segment(c, d);
        const auto k = in.k.row(t).segment(c, d);
        const auto a = in.a.row(t).segment(c, d);
        const auto b = in.b.row(t).segment(c, d);
        const auto w = in.w.row(t).segment(c, d);
        for (Eigen::Index i = 0; i < d; ++i) {
          auto row = s.row(c + i);
          const float sa = row.dot(a);
          row = row.cwiseProduct(w) + in.v(t, c + i) * k + sa * b;
          in.out(t, c + i) = row.dot(r);
        }
      }
    }
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, useful_flops(n, heads, d), double(n));
}

/// DplrDeltaRuleState::step_into over every token of one head.
void BM_DplrStep(benchmark::State& state, Eigen::Index d) {
  const Eigen::Index n = state.range(0);
  Heads in(n, 1, d);
  Vector<float> out(d);
  linattn::DplrOptions options;
  options.scale = 1.0;
  linattn::DplrDeltaRuleState<float> recurrent(d, d, options);
  linattn_bench::measure(state, [&] {
    recurrent.reset();
    for (Eigen::Index t = 0; t < n; ++t) {
      recurrent.step_into(in.r.row(t), in.k.row(t), in.v.row(t), in.a.row(t), in.b.row(t),
                          linattn::log_gates(in.log_w.row(t)), out);
    }
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, useful_flops(n, 1, d), double(n));
}

/// DeltaRuleState::step_into (Gated DeltaNet, a scalar gate) over the same tokens: the step
/// the generalized one is held to.
void BM_GatedDeltaStep(benchmark::State& state, Eigen::Index d) {
  const Eigen::Index n = state.range(0);
  Heads in(n, 1, d);
  Vector<float> out(d);
  linattn::DeltaRuleState<float> recurrent(d, d);
  linattn_bench::measure(state, [&] {
    recurrent.reset();
    for (Eigen::Index t = 0; t < n; ++t) {
      recurrent.step_into(in.r.row(t), in.b.row(t), in.v.row(t),
                          linattn::log_gates(in.log_w.row(t).head(1)), 0.5f, out);
    }
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, 6.0 * double(n) * double(d) * double(d), double(n));
}

/// One decoding step of H heads through their batches (the rows of one token, [H, D]):
/// DplrDeltaRuleStateBatch::step_into against DeltaRuleStateBatch's Gated DeltaNet step, over
/// `n` tokens.
void BM_DplrBatchStep(benchmark::State& state, Eigen::Index heads, Eigen::Index d) {
  const Eigen::Index n = state.range(0);
  Heads in(n, heads, d);
  linattn::DplrOptions options;
  options.scale = 1.0;
  options.threads = 1;
  linattn::DplrDeltaRuleStateBatch<float> batch(heads, d, d, options);
  Matrix<float> out(heads, d);
  const auto rows = [&](const Matrix<float>& x, Eigen::Index t) {
    return Eigen::Map<const Matrix<float>>(x.row(t).data(), heads, d);
  };
  linattn_bench::measure(state, [&] {
    batch.reset();
    for (Eigen::Index t = 0; t < n; ++t) {
      batch.step_into(rows(in.r, t), rows(in.k, t), rows(in.v, t), rows(in.a, t), rows(in.b, t),
                      linattn::log_gates(rows(in.log_w, t)), out);
    }
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, useful_flops(n, heads, d), double(n));
}

void BM_GatedDeltaBatchStep(benchmark::State& state, Eigen::Index heads, Eigen::Index d) {
  const Eigen::Index n = state.range(0);
  Heads in(n, heads, d);
  linattn::DeltaOptions options;
  options.threads = 1;
  linattn::DeltaRuleStateBatch<float> batch(heads, d, d, options);
  Matrix<float> out(heads, d);
  const Vector<float> beta = Vector<float>::Constant(heads, 0.5f);
  const auto rows = [&](const Matrix<float>& x, Eigen::Index t) {
    return Eigen::Map<const Matrix<float>>(x.row(t).data(), heads, d);
  };
  linattn_bench::measure(state, [&] {
    batch.reset();
    for (Eigen::Index t = 0; t < n; ++t) {
      batch.step_into(rows(in.r, t), rows(in.b, t), rows(in.v, t),
                      linattn::log_gates(rows(in.log_w, t).leftCols(1)), beta, out);
    }
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, 6.0 * double(n) * double(heads) * double(d) * double(d), double(n));
}

void register_shape(Eigen::Index heads, Eigen::Index d, Eigen::Index n) {
  const std::string shape = "H" + std::to_string(heads) + "_D" + std::to_string(d);
  benchmark::RegisterBenchmark(("BM_DplrStreamed_" + shape + "<float>").c_str(), BM_DplrPrefill,
                               heads, d, linattn::DeltaForm::streamed, Eigen::Index{64})
      ->Arg(n)
      ->Unit(benchmark::kMillisecond);
  for (const Eigen::Index chunk : {Eigen::Index{16}, Eigen::Index{32}, Eigen::Index{64}}) {
    benchmark::RegisterBenchmark(
        ("BM_DplrChunked_" + shape + "_L" + std::to_string(chunk) + "<float>").c_str(),
        BM_DplrPrefill, heads, d, linattn::DeltaForm::chunked, chunk)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark(("BM_DplrGgmlLoop_" + shape + "<float>").c_str(), BM_DplrGgmlLoop,
                               heads, d)
      ->Arg(n)
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = linattn_bench::quick();
  benchmark::RegisterBenchmark("BM_EigenGemm<float>", linattn_bench::BM_EigenGemm<float>)
      ->Arg(512)
      ->MinTime(0.5)
      ->Unit(benchmark::kMillisecond);
  // RWKV-7 2.9B: 2,560 / 64 = 40 heads; the H = 32 at N = 4,096; and one small head.
  register_shape(32, 64, quick ? 1024 : 4096);
  register_shape(1, 64, 4096);
  register_shape(1, 128, 4096);
  for (const Eigen::Index d : {Eigen::Index{64}, Eigen::Index{128}}) {
    benchmark::RegisterBenchmark(("BM_DplrStep_D" + std::to_string(d) + "<float>").c_str(),
                                 BM_DplrStep, d)
        ->Arg(4096)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_GatedDeltaStep_D" + std::to_string(d) + "<float>").c_str(),
                                 BM_GatedDeltaStep, d)
        ->Arg(4096)
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("BM_DplrBatchStep_H32_D64<float>", BM_DplrBatchStep, 32, 64)
      ->Arg(quick ? 256 : 1024)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_GatedDeltaBatchStep_H32_D64<float>", BM_GatedDeltaBatchStep, 32,
                               64)
      ->Arg(quick ? 256 : 1024)
      ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
