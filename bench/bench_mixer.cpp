// The pieces of a model's mixer around its recurrence, against what bounds them in the same
// binary. The output norms (OutputNorm) are a pass over memory: read o and the gate z, write y;
// their rate is read against a copy of o into y (two of the norm's three streams, so a norm
// at 1.5x the copy's time moves its bytes as fast as the copy does).
//
// Shapes: Qwen3.5-9B's 32 v heads of 128 (the gated RMSNorm with SiLU; Kimi's with sigmoid on
// the same shape), Mamba-2 at Nemotron-H's 128 heads of 64 in 8 groups of 1,024 channels (the
// gate before the norm), RWKV-7's 64 heads of 64 (GroupNorm, ungated); N = 4,096 tokens (DRAM)
// and 64 (in cache); float, one thread, real time. bytes_per_s counts the bytes each pass moves.
#include <algorithm>
#include <cstdint>
#include <linattn/output_norm.hpp>
#include <vector>

#include "bench_common.hpp"

namespace {

using linattn::BnhdShape;
using linattn::ConstHeadsView;
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

}  // namespace

int main(int argc, char** argv) {
  const bool quick = linattn_bench::quick();
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
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
