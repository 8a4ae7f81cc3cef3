// Decoding: RecurrentState::step (constant state) against SoftmaxKVCache::step (a cache that
// grows with the context t) and SlidingWindowCache::step, C = Dk = Dv = 64, one thread.
#include <linattn/recurrent_state.hpp>
#include <linattn/softmax.hpp>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using linattn::Matrix;
using linattn::Vector;
using linattn_bench::random_matrix;
using linattn_bench::set_rates;

constexpr Eigen::Index kDim = 64;
constexpr Eigen::Index kWindow = 256;

/// One decoding step at context t: the state already holds t tokens (prefilled outside the timing).
template <class T>
void BM_RecurrentStep(benchmark::State& state) {
  const Eigen::Index t = state.range(0);
  linattn::RecurrentState<T> rnn(kDim, kDim);
  const Matrix<T> context = random_matrix<T>(t, kDim, 21).array().exp().matrix();  // positive
  rnn.prefill(context, context, random_matrix<T>(t, kDim, 22), linattn::Identity{});
  const Matrix<T> token = random_matrix<T>(3, kDim, 23);
  const Vector<T> phi_q = token.row(0).array().exp(), phi_k = token.row(1).array().exp();
  const Vector<T> v = token.row(2).transpose();
  Vector<T> out(kDim);
  linattn_bench::measure(state, [&] {
    rnn.step_into(phi_q, phi_k, v, linattn::Identity{}, out);
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, 4.0 * kDim * kDim, 1.0);
  state.counters["bytes"] = double((kDim * kDim + kDim) * sizeof(T));
}

/// One step with a KV cache of t tokens: append, attend over t + 1, then roll back to t.
template <class T>
void BM_KVCacheStep(benchmark::State& state) {
  const Eigen::Index t = state.range(0);
  linattn::SoftmaxKVCache<T> cache(kDim, kDim);
  cache.reserve(t + 1);
  cache.append(random_matrix<T>(t, kDim, 31), random_matrix<T>(t, kDim, 32));
  const Matrix<T> token = random_matrix<T>(3, kDim, 33);
  Vector<T> out(kDim);
  linattn_bench::measure(state, [&] {
    cache.step_into(token.row(0), token.row(1), token.row(2), out);
    cache.truncate(t);
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, 4.0 * double(t + 1) * kDim, 1.0);
  state.counters["bytes"] = double(t * 2 * kDim * Eigen::Index(sizeof(T)));
}

/// One step of the sliding-window cache after t tokens; the timed steps keep adding tokens, so
/// it measures the full-window (steady-state) step.
template <class T>
void BM_SlidingWindowStep(benchmark::State& state) {
  const Eigen::Index t = state.range(0);
  linattn::SlidingWindowCache<T> cache(kDim, kDim, kWindow);
  const Matrix<T> context = random_matrix<T>(std::min(t, 2 * kWindow), kDim, 41);
  for (Eigen::Index i = 0; i < context.rows(); ++i)
    cache.step(context.row(i), context.row(i), context.row(i));
  const Matrix<T> token = random_matrix<T>(3, kDim, 43);
  Vector<T> out(kDim);
  linattn_bench::measure(state, [&] {
    cache.step_into(token.row(0), token.row(1), token.row(2), out);
    benchmark::DoNotOptimize(out.data());
  });
  // Every timed step adds a token, so the window is full after warm-up whatever t was.
  set_rates(state, 4.0 * double(kWindow) * kDim, 1.0);
  state.counters["bytes"] = double(cache.bytes());
}

template <class T>
void register_scalar(const std::vector<Eigen::Index>& contexts) {
  const std::string t = linattn_bench::scalar_name(T{});
  for (const Eigen::Index context : contexts) {
    benchmark::RegisterBenchmark(("BM_RecurrentStep<" + t + ">").c_str(), BM_RecurrentStep<T>)
        ->Arg(context)
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("BM_KVCacheStep<" + t + ">").c_str(), BM_KVCacheStep<T>)
        ->Arg(context)
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark(("BM_SlidingWindowStep<" + t + ">").c_str(),
                                 BM_SlidingWindowStep<T>)
        ->Arg(context)
        ->Unit(benchmark::kMicrosecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<Eigen::Index> contexts = {1, 256, 4096, 16384, 65536};
  register_scalar<float>(contexts);
  register_scalar<double>(linattn_bench::quick() ? std::vector<Eigen::Index>{1, 16384} : contexts);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
