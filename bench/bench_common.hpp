// Shared by the benchmark binaries: seeded inputs, counters, quick mode, Eigen's GEMM baseline.
#pragma once

#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>
#include <linattn/config.hpp>
#include <random>
#include <string>

namespace linattn_bench {

/// scripts/bench --quick sets LINATTN_BENCH_QUICK=1: fewer and smaller sizes.
inline bool quick() {
  const char* value = std::getenv("LINATTN_BENCH_QUICK");
  return value != nullptr && std::string(value) == "1";
}

template <class T>
linattn::Matrix<T> random_matrix(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed,
                                 double stddev = 1.0) {
  std::mt19937_64 engine(seed);
  std::normal_distribution<double> normal(0.0, stddev);
  linattn::Matrix<T> m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(normal(engine));
  return m;
}

/// FLOP and token rates (per second of measured time) on a benchmark's counters.
inline void set_rates(benchmark::State& state, double flops_per_iteration,
                      double tokens_per_iteration) {
  const double iterations = static_cast<double>(state.iterations());
  state.counters["FLOPS"] =
      benchmark::Counter(flops_per_iteration * iterations, benchmark::Counter::kIsRate);
  state.counters["tokens_per_s"] =
      benchmark::Counter(tokens_per_iteration * iterations, benchmark::Counter::kIsRate);
}

/// Times `run` after one untimed call, so first-touch page faults of fresh buffers (costly on
/// virtual machines) do not land in a benchmark that runs only a few iterations.
template <class Run>
void measure(benchmark::State& state, Run&& run) {
  run();
  for (auto _ : state) {
    run();
    benchmark::ClobberMemory();
  }
}

/// Eigen's own single-thread matrix multiply, n x n x n: the peak the kernels are read against.
template <class T>
void BM_EigenGemm(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  const linattn::Matrix<T> a = random_matrix<T>(n, n, 1), b = random_matrix<T>(n, n, 2);
  linattn::Matrix<T> c(n, n);
  measure(state, [&] {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  });
  set_rates(state, 2.0 * double(n) * double(n) * double(n), 0.0);
}

inline const char* scalar_name(float) { return "float"; }
inline const char* scalar_name(double) { return "double"; }
inline const char* scalar_name(Eigen::half) { return "half"; }
inline const char* scalar_name(Eigen::bfloat16) { return "bfloat16"; }

}  // namespace linattn_bench
