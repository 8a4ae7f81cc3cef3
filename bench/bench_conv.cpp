// The short causal convolution (ShortConv and its ConvWindows) against a plain copy of the same
// buffers in the same binary: a prefill is one pass over its input and output, so its rate is read
// against the copy's (issue 34's target: within 1.5x of the copy at Qwen3.5's 8,192 conv
// channels, N = 4,096, one thread). The decoding step is read against a per-token loop written
// here the way ggml's ssm_conv computes it (shift the window, one dot product per channel).
//
// Shapes: C = 8,192 (Qwen3.5-9B: 16 q/k heads x 128 x 2 + 32 v heads x 128), K = 4, SiLU, no
// bias (Qwen and Kimi's), and a small C = 1,024; float, one thread, real time. bytes_per_s
// counts what a pass must move: the input read and the output written (the copy's too).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <linattn/short_conv.hpp>
#include <vector>

#include "bench_common.hpp"

namespace {

using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::HeadsView;
using linattn::Matrix;
using linattn_bench::measure;
using linattn_bench::random_matrix;

constexpr Eigen::Index kTaps = 4;

linattn::ShortConvOptions conv_options() {
  linattn::ShortConvOptions options;
  options.activation = linattn::ConvActivation::silu;
  options.threads = 1;
  return options;
}

void set_pass_counters(benchmark::State& state, double elements, double flops) {
  const double iterations = static_cast<double>(state.iterations());
  state.counters["bytes_per_s"] = benchmark::Counter(
      2.0 * elements * double(sizeof(float)) * iterations, benchmark::Counter::kIsRate);
  state.counters["FLOPS"] = benchmark::Counter(flops * iterations, benchmark::Counter::kIsRate);
}

/// One prefill: N tokens of C channels through the convolution (ShortConv::forward_into).
void BM_ShortConv(benchmark::State& state) {
  const Eigen::Index channels = state.range(0), tokens = state.range(1);
  const linattn::ShortConv<float> conv(random_matrix<float>(channels, kTaps, 1, 0.5),
                                       conv_options());
  const Matrix<float> x = random_matrix<float>(tokens, channels, 2);
  Matrix<float> y(tokens, channels);
  const BnhdShape shape(1, tokens, 1, channels);
  measure(state, [&] {
    conv.forward_into(ConstHeadsView<float>::bnhd(x.data(), shape),
                      HeadsView<float>::bnhd(y.data(), shape));
    benchmark::DoNotOptimize(y.data());
  });
  const double elements = double(tokens) * double(channels);
  set_pass_counters(state, elements, 2.0 * double(kTaps) * elements);
}

/// The same buffers copied (std::copy of x into y): the pass a prefill cannot beat.
void BM_ConvCopy(benchmark::State& state) {
  const Eigen::Index channels = state.range(0), tokens = state.range(1);
  const Matrix<float> x = random_matrix<float>(tokens, channels, 2);
  Matrix<float> y(tokens, channels);
  measure(state, [&] {
    std::copy(x.data(), x.data() + x.size(), y.data());
    benchmark::DoNotOptimize(y.data());
  });
  set_pass_counters(state, double(tokens) * double(channels), 0.0);
}

/// One decoding step of B sequences (ShortConv::step_into on its windows).
void BM_ConvStep(benchmark::State& state) {
  const Eigen::Index channels = state.range(0), batch = state.range(1);
  const linattn::ShortConv<float> conv(random_matrix<float>(channels, kTaps, 1, 0.5),
                                       conv_options());
  linattn::ConvWindows<float> windows = conv.make_windows(batch);
  const Matrix<float> x = random_matrix<float>(batch, channels, 3, 0.1);
  Matrix<float> y(batch, channels);
  measure(state, [&] {
    conv.step_into(windows, x, y);
    benchmark::DoNotOptimize(y.data());
  });
  const double elements = double(batch) * double(channels);
  set_pass_counters(state, elements, 2.0 * double(kTaps) * elements);
}

/// The same step as a per-token loop, the way ggml's ssm_conv runs it: per sequence, shift
/// the K - 1 rows of the window, then one dot product over the taps per channel, then SiLU.
void BM_ConvStepLoop(benchmark::State& state) {
  const Eigen::Index channels = state.range(0), batch = state.range(1);
  const Matrix<float> weight = random_matrix<float>(channels, kTaps, 1, 0.5);  // C x K
  // Per sequence: C x K, row c the last K inputs of channel c (the oldest first), as ggml keeps
  // its conv states.
  std::vector<float> window(static_cast<std::size_t>(batch * channels * kTaps), 0.0f);
  const Matrix<float> x = random_matrix<float>(batch, channels, 3, 0.1);
  Matrix<float> y(batch, channels);
  measure(state, [&] {
    for (Eigen::Index b = 0; b < batch; ++b) {
      float* w = window.data() + b * channels * kTaps;
      for (Eigen::Index c = 0; c < channels; ++c) {
        float* row = w + c * kTaps;
        for (Eigen::Index i = 0; i + 1 < kTaps; ++i) row[i] = row[i + 1];
        row[kTaps - 1] = x(b, c);
        float sum = 0.0f;
        for (Eigen::Index i = 0; i < kTaps; ++i) sum += row[i] * weight(c, i);
        y(b, c) = sum / (1.0f + std::exp(-sum));
      }
    }
    benchmark::DoNotOptimize(y.data());
  });
  const double elements = double(batch) * double(channels);
  set_pass_counters(state, elements, 2.0 * double(kTaps) * elements);
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = linattn_bench::quick();
  // (C, N): Qwen3.5-9B's channels at the N, and a small layer.
  std::vector<std::pair<std::int64_t, std::int64_t>> prefill{{1024, 1024}};
  if (!quick) prefill.push_back({8192, 4096});
  for (const auto& [channels, tokens] : prefill) {
    benchmark::RegisterBenchmark("BM_ShortConv<float>", BM_ShortConv)
        ->Args({channels, tokens})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("BM_ConvCopy<float>", BM_ConvCopy)
        ->Args({channels, tokens})
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  }
  for (const std::int64_t batch : {1, 16}) {
    for (const std::int64_t channels : {1024, 8192}) {
      benchmark::RegisterBenchmark("BM_ConvStep<float>", BM_ConvStep)
          ->Args({channels, batch})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark("BM_ConvStepLoop<float>", BM_ConvStepLoop)
          ->Args({channels, batch})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
