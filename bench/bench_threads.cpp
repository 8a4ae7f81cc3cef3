// Threads: many heads over B x H, and one long sequence split across threads (ungated, scalar
// and per-feature gates), at 1..max threads, with the single-thread Eigen GEMM rate in the
// same binary. Built with OpenMP.
#include <algorithm>
#include <linattn/delta_rule.hpp>
#include <linattn/gated.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/multi_head.hpp>
#include <string>
#include <vector>

#include "bench_common.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using linattn::HeadsView;
using linattn::Matrix;
using linattn_bench::random_matrix;
using linattn_bench::set_rates;

constexpr Eigen::Index kDim = 64;  // C = Dv = 64

/// Positive featurized inputs for `heads` heads of n tokens, laid out [heads, n, 64].
template <class T>
struct HeadInputs {
  Matrix<T> phi_q, phi_k, v, out;
  HeadInputs(Eigen::Index heads, Eigen::Index n)
      : phi_q(random_matrix<T>(heads * n, kDim, 21).array().exp().matrix()),
        phi_k(random_matrix<T>(heads * n, kDim, 22).array().exp().matrix()),
        v(random_matrix<T>(heads * n, kDim, 23)),
        out(heads * n, kDim) {}
};

/// Causal kernel over B x H heads ([B, H, N, 64], B = heads / 4, H = 4) on range(1) threads.
template <class T>
void BM_HeadsKernel(benchmark::State& state, Eigen::Index heads) {
  const Eigen::Index n = state.range(0);
  HeadInputs<T> in(heads, n);
  const Eigen::Index batch = heads / 4;
  const auto q = HeadsView<const T>::bhnd(in.phi_q.data(), {batch, 4, n, kDim});
  const auto k = HeadsView<const T>::bhnd(in.phi_k.data(), {batch, 4, n, kDim});
  const auto v = HeadsView<const T>::bhnd(in.v.data(), {batch, 4, n, kDim});
  const auto out = HeadsView<T>::bhnd(in.out.data(), {batch, 4, n, kDim});
  linattn::Options options;
  options.threads = static_cast<int>(state.range(1));
  linattn_bench::measure(state, [&] {
    linattn::causal_linear_attention_into(q, k, v, linattn::Identity{}, out, options);
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, 4.0 * double(heads) * double(n) * kDim * kDim, double(heads * n));
  state.counters["threads"] = double(options.threads);
}

/// Gated causal kernel over 16 heads ([B, N, H, D] views, B = 4, H = 4, log gates in
/// [-0.05, 0], `gate_cols` per token) on range(1) threads.
template <class T>
void BM_GatedHeads(benchmark::State& state, Eigen::Index gate_cols) {
  const Eigen::Index n = state.range(0);
  constexpr Eigen::Index kHeads = 16;
  HeadInputs<T> in(kHeads, n);
  const Matrix<T> g =
      (random_matrix<T>(kHeads * n, gate_cols, 24).array().abs() * T(-0.05)).matrix();
  const linattn::HeadShape shape{4, 4, n, kDim};
  const auto q = HeadsView<const T>::bnhd(in.phi_q.data(), linattn::BnhdShape(shape));
  const auto k = HeadsView<const T>::bnhd(in.phi_k.data(), linattn::BnhdShape(shape));
  const auto v = HeadsView<const T>::bnhd(in.v.data(), linattn::BnhdShape(shape));
  const auto gates = HeadsView<const T>::bnhd(g.data(), linattn::BnhdShape{4, n, 4, gate_cols});
  const auto out = HeadsView<T>::bnhd(in.out.data(), linattn::BnhdShape(shape));
  linattn::Options options;
  options.threads = static_cast<int>(state.range(1));
  linattn_bench::measure(state, [&] {
    linattn::causal_gated_linear_attention_into(q, k, v, linattn::log_gates(gates),
                                                linattn::Identity{}, out, options);
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, 4.0 * double(kHeads) * double(n) * kDim * kDim, double(kHeads * n));
  state.counters["threads"] = double(options.threads);
}

/// Causal kernel over one sequence of range(0) tokens on range(1) threads.
template <class T>
void BM_SequenceKernel(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  HeadInputs<T> in(1, n);
  linattn::Options options;
  options.threads = static_cast<int>(state.range(1));
  linattn_bench::measure(state, [&] {
    linattn::causal_linear_attention_into(in.phi_q, in.phi_k, in.v, linattn::Identity{}, in.out,
                                          options);
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, 4.0 * double(n) * kDim * kDim, double(n));
  state.counters["threads"] = double(options.threads);
}

/// Gated causal kernel over one sequence of range(0) tokens on range(1) threads, log gates in
/// [-0.05, 0], `gate_cols` per token (1: scalar, 64: per feature).
template <class T>
void BM_GatedSequence(benchmark::State& state, Eigen::Index gate_cols) {
  const Eigen::Index n = state.range(0);
  HeadInputs<T> in(1, n);
  const Matrix<T> g = (random_matrix<T>(n, gate_cols, 24).array().abs() * T(-0.05)).matrix();
  linattn::Options options;
  options.threads = static_cast<int>(state.range(1));
  linattn_bench::measure(state, [&] {
    linattn::causal_gated_linear_attention_into(in.phi_q, in.phi_k, in.v, linattn::log_gates(g),
                                                linattn::Identity{}, in.out, options);
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, 4.0 * double(n) * kDim * kDim, double(n));
  state.counters["threads"] = double(options.threads);
}

/// Gated DeltaNet (Dk = Dv = 128, Qwen3-Next's head; L2-normalised keys, beta in [0.05, 1],
/// log gates in [-0.05, 0]) over `heads` heads of range(0) tokens ([B, N, H, D] views, B =
/// heads / 4, H = 4; one head: the matrix call) on range(1) threads. Useful FLOPs: 6 Dk Dv per
/// token per head.
void BM_GatedDelta(benchmark::State& state, Eigen::Index heads) {
  constexpr Eigen::Index kDeltaDim = 128;
  const Eigen::Index n = state.range(0);
  const Eigen::Index rows = heads * n;
  Matrix<float> q = random_matrix<float>(rows, kDeltaDim, 41);
  Matrix<float> k = random_matrix<float>(rows, kDeltaDim, 42);
  for (Eigen::Index t = 0; t < rows; ++t) k.row(t).normalize();
  const Matrix<float> v = random_matrix<float>(rows, kDeltaDim, 43);
  const Matrix<float> g = (random_matrix<float>(rows, 1, 44).array().abs() * -0.05f).matrix();
  const Matrix<float> beta =
      (random_matrix<float>(rows, 1, 45).array().abs() * 0.95f + 0.05f).min(1.0f).matrix();
  Matrix<float> out(rows, kDeltaDim);
  linattn::DeltaOptions options;
  options.threads = static_cast<int>(state.range(1));
  const Eigen::Index batch = std::max<Eigen::Index>(1, heads / 4), per = heads / batch;
  const linattn::HeadShape shape{batch, per, n, kDeltaDim}, one{batch, per, n, 1};
  linattn_bench::measure(state, [&] {
    if (heads == 1) {
      linattn::causal_gated_delta_rule_into(q, k, v, linattn::log_gates(g), beta, out, options);
    } else {
      linattn::causal_gated_delta_rule_into(
          HeadsView<const float>::bnhd(q.data(), linattn::BnhdShape(shape)),
          HeadsView<const float>::bnhd(k.data(), linattn::BnhdShape(shape)),
          HeadsView<const float>::bnhd(v.data(), linattn::BnhdShape(shape)),
          linattn::log_gates(HeadsView<const float>::bnhd(g.data(), linattn::BnhdShape(one))),
          HeadsView<const float>::bnhd(beta.data(), linattn::BnhdShape(one)),
          HeadsView<float>::bnhd(out.data(), linattn::BnhdShape(shape)), options);
    }
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, 6.0 * double(rows) * kDeltaDim * kDeltaDim, double(rows));
  state.counters["threads"] = double(options.threads);
}

template <class T>
void register_scalar(int max_threads) {
  const std::string t = linattn_bench::scalar_name(T{});
  benchmark::RegisterBenchmark(("BM_EigenGemm<" + t + ">").c_str(), linattn_bench::BM_EigenGemm<T>)
      ->Arg(512)
      ->MinTime(0.5)
      ->Unit(benchmark::kMillisecond);
  for (int threads = 1; threads <= max_threads; threads *= 2) {
    benchmark::RegisterBenchmark(("BM_HeadsKernel16<" + t + ">").c_str(), BM_HeadsKernel<T>,
                                 Eigen::Index{16})
        ->Args({4096, threads})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_SequenceKernel<" + t + ">").c_str(), BM_SequenceKernel<T>)
        ->Args({65536, threads})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    for (const Eigen::Index cols : {Eigen::Index{1}, kDim}) {
      benchmark::RegisterBenchmark(
          (std::string(cols == 1 ? "BM_ScalarGatedHeads16<" : "BM_FeatureGatedHeads16<") + t + ">")
              .c_str(),
          BM_GatedHeads<T>, cols)
          ->Args({4096, threads})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
    for (const Eigen::Index cols : {Eigen::Index{1}, kDim}) {
      benchmark::RegisterBenchmark(
          (std::string(cols == 1 ? "BM_ScalarGatedSequence<" : "BM_FeatureGatedSequence<") + t +
           ">")
              .c_str(),
          BM_GatedSequence<T>, cols)
          ->Args({65536, threads})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int max_threads = 1;
#ifdef _OPENMP
  max_threads = omp_get_max_threads();
#endif
  // The GEMM reference is Eigen's single-thread rate; our threads come from Options::threads.
  Eigen::setNbThreads(1);
  register_scalar<float>(max_threads);
  if (!linattn_bench::quick()) register_scalar<double>(max_threads);
  for (int threads = 1; threads <= max_threads; threads *= 2) {
    benchmark::RegisterBenchmark("BM_GatedDeltaHeads16<float>", BM_GatedDelta, Eigen::Index{16})
        ->Args({2048, threads})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("BM_GatedDeltaSequence<float>", BM_GatedDelta, Eigen::Index{1})
        ->Args({65536, threads})
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
