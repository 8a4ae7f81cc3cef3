// Decoding many sessions: SessionPool::step_into for 1 to 256 sessions x 16 heads (C64 also 512
// and 1024, past the L3), one layer, against a STREAM-style copy of the same number of bytes in
// the same binary, and one state's step (in cache) for the per-head latency. Once the states pass
// the L3 a pool step is a pass over memory: its rate is read against the copy's.
//
// Shapes: C = Dv = 64 float (RecurrentState, featurized inputs through Identity{}, the default
// Options: normalize on, check_finite on) and Dk = Dv = 128 float (Gated DeltaNet: log gates in
// [-0.05, 0], beta in [0.05, 1], L2-normalised keys, the default DeltaOptions).
//
// State traffic (state_GBps) is the minimum a step must move: every state read once and written
// once, 2 x the states' bytes per step, counted in bytes (1000-based: "50G/s" is 50e9 B/s).
//   C64: the bytes of S (C x Dv) and z (C) of every head. z is updated on every step whether or
//        not Options::normalize is set (the stream kernel always adds k to z), so normalize off
//        would not make a pure S pass; the default is kept and z's 256 B a head counted.
//   Delta128: the bytes of S (Dk x Dv). The kernel reads each strip of S twice (prediction, then
//        update and readout, the second from cache); only the minimum 2 x S is counted.
// The copy (BM_StreamCopy) counts read + write bytes, 2 x its array, as STREAM's "Copy" does.
//
// Each pool case takes range(0) sessions and range(1) threads (Options::threads /
// DeltaOptions::threads; 1 up to OpenMP's maximum when built with OpenMP, as bench_threads; the
// copy splits its array over the same threads). Real time throughout.
#include <algorithm>
#include <cstdint>
#include <linattn/delta_rule.hpp>
#include <linattn/layer.hpp>
#include <linattn/recurrent_state.hpp>
#include <linattn/session_pool.hpp>
#include <linattn/state_batch.hpp>
#include <set>
#include <string>
#include <vector>

#include "bench_common.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using linattn::Matrix;
using linattn::Vector;
using linattn_bench::random_matrix;
using linattn_bench::set_rates;

constexpr Eigen::Index kHeads = 16;
constexpr Eigen::Index kC64 = 64;      // C = Dv = 64
constexpr Eigen::Index kDelta = 128;   // Dk = Dv = 128
constexpr std::size_t kTokenSets = 4;  // token rows cycled through the timed steps

/// Bytes of one head's state: S and z (C64), S (Delta128).
constexpr double kC64HeadBytes = double((kC64 * kC64 + kC64) * Eigen::Index(sizeof(float)));
constexpr double kDeltaHeadBytes = double(kDelta * kDelta * Eigen::Index(sizeof(float)));

/// Counters of a step over `heads` states of `head_bytes` each for `tokens` tokens (sessions):
/// FLOPS and tokens_per_s, heads_per_s, state_GBps (2 x the states' bytes a step, in bytes/s),
/// per_head (seconds a head, printed as e.g. "25ns") and state_MiB (the states' size).
void set_state_counters(benchmark::State& state, double heads, double head_bytes,
                        double flops_per_head, double tokens) {
  const double iterations = static_cast<double>(state.iterations());
  set_rates(state, flops_per_head * heads, tokens);
  state.counters["heads_per_s"] =
      benchmark::Counter(heads * iterations, benchmark::Counter::kIsRate);
  state.counters["state_GBps"] =
      benchmark::Counter(2.0 * heads * head_bytes * iterations, benchmark::Counter::kIsRate);
  state.counters["per_head"] = benchmark::Counter(
      heads * iterations, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["state_MiB"] = heads * head_bytes / (1024.0 * 1024.0);
}

/// kTokenSets different token sets of `rows` rows: featurized (positive) q and k, or raw q,
/// L2-normalised k (delta); v; log gates in [-0.05, 0] and beta in [0.05, 1] (delta).
struct Tokens {
  std::vector<Matrix<float>> q, k, v, log_gates, beta;
  Tokens(Eigen::Index rows, Eigen::Index dk, Eigen::Index dv, bool delta) {
    for (std::size_t t = 0; t < kTokenSets; ++t) {
      const std::uint64_t seed = 100 * (t + 1);
      Matrix<float> qt = random_matrix<float>(rows, dk, seed + 1, 0.5);
      Matrix<float> kt = random_matrix<float>(rows, dk, seed + 2, 0.5);
      if (delta) {
        for (Eigen::Index r = 0; r < rows; ++r) kt.row(r).normalize();
        log_gates.push_back(
            (random_matrix<float>(rows, 1, seed + 4).array().abs() * -0.05f).matrix());
        beta.push_back((random_matrix<float>(rows, 1, seed + 5).array().abs() * 0.95f + 0.05f)
                           .min(1.0f)
                           .matrix());
      } else {
        qt = qt.array().exp().matrix();
        kt = kt.array().exp().matrix();
      }
      q.push_back(std::move(qt));
      k.push_back(std::move(kt));
      v.push_back(random_matrix<float>(rows, dv, seed + 3));
    }
  }
};

/// A pool of range(0) sessions, keys 0..sessions-1, of the one layer `layer`.
template <class Layer>
linattn::SessionPool<typename Layer::States> make_pool(Eigen::Index sessions, const Layer& layer) {
  linattn::SessionPool pool(1, layer);
  for (Eigen::Index s = 0; s < sessions; ++s) pool.add(s);
  return pool;
}

/// One pool step of every session's 16 heads, C = Dv = 64 (featurized inputs).
void BM_PoolStep_C64(benchmark::State& state) {
  const Eigen::Index sessions = state.range(0);
  const Eigen::Index rows = sessions * kHeads;
  linattn::Options options;
  options.threads = static_cast<int>(state.range(1));
  auto pool = make_pool(sessions, linattn::LinearAttentionLayer<float, linattn::Identity>(
                                      linattn::Identity{}, kHeads, kC64, kC64, options));
  const Tokens in(rows, kC64, kC64, false);
  Matrix<float> out(rows, kC64);
  std::size_t t = 0;
  linattn_bench::measure(state, [&] {
    pool.step_into(0, in.q[t], in.k[t], in.v[t], linattn::Identity{}, out);
    t = (t + 1) % kTokenSets;
    benchmark::DoNotOptimize(out.data());
  });
  set_state_counters(state, double(rows), kC64HeadBytes, 4.0 * kC64 * kC64, double(sessions));
  state.counters["threads"] = double(options.threads);
}

/// One pool step of every session's 16 Gated DeltaNet heads, Dk = Dv = 128.
void BM_PoolStep_Delta128(benchmark::State& state) {
  const Eigen::Index sessions = state.range(0);
  const Eigen::Index rows = sessions * kHeads;
  linattn::DeltaOptions options;
  options.threads = static_cast<int>(state.range(1));
  auto pool = make_pool(sessions, linattn::DeltaRuleLayer<float>(kHeads, kDelta, kDelta, options));
  const Tokens in(rows, kDelta, kDelta, true);
  Matrix<float> out(rows, kDelta);
  std::size_t t = 0;
  linattn_bench::measure(state, [&] {
    pool.step_into(0, in.q[t], in.k[t], in.v[t], linattn::log_gates(in.log_gates[t]), in.beta[t],
                   out);
    t = (t + 1) % kTokenSets;
    benchmark::DoNotOptimize(out.data());
  });
  set_state_counters(state, double(rows), kDeltaHeadBytes, 6.0 * kDelta * kDelta, double(sessions));
  state.counters["threads"] = double(options.threads);
}

/// One RecurrentState::step_into, C = Dv = 64, state in cache: the per-head latency a pool
/// step should match while its states fit in cache.
void BM_StateStep_C64(benchmark::State& state) {
  linattn::RecurrentState<float> head(kC64, kC64);
  const Tokens in(1, kC64, kC64, false);
  Vector<float> out(kC64);
  std::size_t t = 0;
  linattn_bench::measure(state, [&] {
    head.step_into(in.q[t].row(0), in.k[t].row(0), in.v[t].row(0), linattn::Identity{}, out);
    t = (t + 1) % kTokenSets;
    benchmark::DoNotOptimize(out.data());
  });
  set_state_counters(state, 1.0, kC64HeadBytes, 4.0 * kC64 * kC64, 1.0);
}

/// One DeltaRuleState::step_into (Gated DeltaNet), Dk = Dv = 128, state in cache.
void BM_StateStep_Delta128(benchmark::State& state) {
  linattn::DeltaRuleState<float> head(kDelta, kDelta);
  const Tokens in(1, kDelta, kDelta, true);
  Vector<float> out(kDelta);
  std::size_t t = 0;
  linattn_bench::measure(state, [&] {
    head.step_into(in.q[t].row(0), in.k[t].row(0), in.v[t].row(0),
                   linattn::log_gates(in.log_gates[t].row(0)), in.beta[t](0, 0), out);
    t = (t + 1) % kTokenSets;
    benchmark::DoNotOptimize(out.data());
  });
  set_state_counters(state, 1.0, kDeltaHeadBytes, 6.0 * kDelta * kDelta, 1.0);
}

/// STREAM's Copy, b = a over range(0) bytes of floats, split over range(1) threads (std::copy
/// on each thread's contiguous part); counted as read + write, 2 x range(0) bytes.
void BM_StreamCopy(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const int threads = static_cast<int>(state.range(1));
  const std::size_t n = bytes / sizeof(float);
  std::vector<float> a(n), b(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) a[i] = static_cast<float>(i % 1024);
  const auto copy_part = [&](int part) {
    const std::size_t begin =
        n * static_cast<std::size_t>(part) / static_cast<std::size_t>(threads);
    const std::size_t end =
        n * static_cast<std::size_t>(part + 1) / static_cast<std::size_t>(threads);
    std::copy(a.data() + begin, a.data() + end, b.data() + begin);
  };
  linattn_bench::measure(state, [&] {
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
      for (int part = 0; part < threads; ++part) copy_part(part);
    } else {
      copy_part(0);
    }
#else
    copy_part(0);
#endif
    benchmark::DoNotOptimize(b.data());
  });
  const double iterations = static_cast<double>(state.iterations());
  state.counters["copy_GBps"] =
      benchmark::Counter(2.0 * double(n * sizeof(float)) * iterations, benchmark::Counter::kIsRate);
  state.counters["state_MiB"] = double(n * sizeof(float)) / (1024.0 * 1024.0);
  state.counters["threads"] = double(threads);
}

}  // namespace

int main(int argc, char** argv) {
  int max_threads = 1;
#ifdef _OPENMP
  max_threads = omp_get_max_threads();
#endif
  const std::vector<Eigen::Index> sessions =
      linattn_bench::quick() ? std::vector<Eigen::Index>{1, 16, 256}
                             : std::vector<Eigen::Index>{1, 2, 4, 8, 16, 32, 64, 128, 256};
  benchmark::RegisterBenchmark("BM_StateStep_C64<float>", BM_StateStep_C64)
      ->UseRealTime()
      ->Unit(benchmark::kNanosecond);
  benchmark::RegisterBenchmark("BM_StateStep_Delta128<float>", BM_StateStep_Delta128)
      ->UseRealTime()
      ->Unit(benchmark::kNanosecond);
  for (int threads = 1; threads <= max_threads; threads *= 2) {
    std::set<std::int64_t> copy_bytes;
    for (const Eigen::Index count : sessions) {
      // 16 KiB heads pass the 32 MiB L3 only at 256 sessions: two sizes more for C64.
      for (const Eigen::Index c64_count : count == 256 ? std::vector<Eigen::Index>{256, 512, 1024}
                                                       : std::vector<Eigen::Index>{count}) {
        benchmark::RegisterBenchmark("BM_PoolStep_C64<float>", BM_PoolStep_C64)
            ->Args({c64_count, threads})
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
        copy_bytes.insert(static_cast<std::int64_t>(double(c64_count * kHeads) * kC64HeadBytes));
      }
      benchmark::RegisterBenchmark("BM_PoolStep_Delta128<float>", BM_PoolStep_Delta128)
          ->Args({count, threads})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
      copy_bytes.insert(static_cast<std::int64_t>(double(count * kHeads) * kDeltaHeadBytes));
    }
    for (const std::int64_t bytes : copy_bytes) {
      benchmark::RegisterBenchmark("BM_StreamCopy<float>", BM_StreamCopy)
          ->Args({bytes, threads})
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
