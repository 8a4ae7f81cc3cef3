// Causal forward: chunked linear attention (elu+1 and FAVOR+) against softmax baselines,
// d = 64, one thread, with Eigen's GEMM rate measured in the same binary; and linear
// attention on Eigen::half and Eigen::bfloat16 inputs (float accumulation).
#include <cstdint>
#include <linattn/feature_maps.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/softmax.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_common.hpp"

namespace {

using linattn::Matrix;
using linattn_bench::random_matrix;
using linattn_bench::set_rates;

constexpr Eigen::Index kDim = 64;  // Dk = Dv = d
constexpr Eigen::Index kFavorFeatures = 256;
constexpr Eigen::Index kWindow = 256;

template <class T>
struct Inputs {
  Matrix<T> q, k, v, out;
  explicit Inputs(Eigen::Index n)
      : q(random_matrix<T>(n, kDim, 11)),
        k(random_matrix<T>(n, kDim, 12)),
        v(random_matrix<T>(n, kDim, 13)),
        out(n, kDim) {}
};

/// Linear attention with a feature map; useful FLOPs 4 N C Dv (the recurrent minimum).
template <class T, class Map>
void BM_CausalLinear(benchmark::State& state, Map map) {
  const Eigen::Index n = state.range(0);
  Inputs<T> in(n);
  const Eigen::Index c = map.feature_dim(kDim);
  linattn_bench::measure(state, [&] {
    linattn::causal_linear_attention_into(in.q, in.k, in.v, map, in.out);
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, 4.0 * double(n) * double(c) * double(kDim), double(n));
  state.counters["C"] = double(c);
}

/// exp of N(0, 1) entries; 16-bit types get float's values, rounded once (their exp is emulated).
template <class T>
Matrix<T> positive_features(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed) {
  using Wide = std::conditional_t<std::is_same_v<T, double>, double, float>;
  return random_matrix<Wide>(rows, cols, seed).array().exp().matrix().template cast<T>();
}

/// The kernel alone on featurized inputs (positive features, N x C), Dv = 64: the rate
/// issue #4 reads against GEMM, without the cost of computing the features.
template <class T>
void BM_CausalKernel(benchmark::State& state, Eigen::Index feature_dim) {
  const Eigen::Index n = state.range(0);
  const Matrix<T> phi_q = positive_features<T>(n, feature_dim, 14);
  const Matrix<T> phi_k = positive_features<T>(n, feature_dim, 15);
  const Matrix<T> v = random_matrix<T>(n, kDim, 16);
  Matrix<T> out(n, kDim);
  linattn_bench::measure(state, [&] {
    linattn::causal_linear_attention_into(phi_q, phi_k, v, linattn::Identity{}, out);
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, 4.0 * double(n) * double(feature_dim) * double(kDim), double(n));
  state.counters["C"] = double(feature_dim);
}

/// Causal softmax FLOPs: N(N+1)/2 query-key pairs, 2d for q.k and 2d for p v each.
inline double causal_softmax_flops(Eigen::Index n) {
  return 2.0 * double(n) * double(n + 1) * double(kDim);
}

template <class T>
void BM_SoftmaxTiled(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  Inputs<T> in(n);
  linattn_bench::measure(state, [&] {
    linattn::softmax_attention_into(in.q, in.k, in.v, linattn::Mask::causal, in.out);
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, causal_softmax_flops(n), double(n));
}

template <class T>
void BM_SoftmaxMaterialized(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  Inputs<T> in(n);
  linattn_bench::measure(state, [&] {
    in.out = linattn::materialized_softmax_attention(in.q, in.k, in.v, linattn::Mask::causal);
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, causal_softmax_flops(n), double(n));  // useful FLOPs, not the 2x it does
}

template <class T>
void BM_SlidingWindow(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  Inputs<T> in(n);
  linattn_bench::measure(state, [&] {
    linattn::sliding_window_attention_into(in.q, in.k, in.v, kWindow, in.out);
    benchmark::DoNotOptimize(in.out.data());
  });
  // Pairs: each query sees min(i + 1, window) keys.
  const double w = double(kWindow);
  const double pairs =
      n <= kWindow ? double(n) * double(n + 1) / 2 : w * (w + 1) / 2 + double(n - kWindow) * w;
  set_rates(state, 4.0 * pairs * double(kDim), double(n));
}

template <class T>
void register_scalar(const std::vector<Eigen::Index>& sizes, Eigen::Index materialized_max) {
  const std::string t = linattn_bench::scalar_name(T{});
  benchmark::RegisterBenchmark(("BM_EigenGemm<" + t + ">").c_str(), linattn_bench::BM_EigenGemm<T>)
      ->Arg(512)
      ->MinTime(0.5)  // the reference every rate is read against: measure it well
      ->Unit(benchmark::kMillisecond);
  for (const Eigen::Index n : sizes) {
    benchmark::RegisterBenchmark(("BM_CausalLinear_Elu<" + t + ">").c_str(),
                                 BM_CausalLinear<T, linattn::EluPlusOne>, linattn::EluPlusOne{})
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_CausalLinear_Favor<" + t + ">").c_str(),
                                 BM_CausalLinear<T, linattn::PositiveRandomFeatures>,
                                 linattn::PositiveRandomFeatures(kDim, kFavorFeatures, 1))
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    for (const Eigen::Index c : {64, 256}) {
      benchmark::RegisterBenchmark(("BM_CausalKernel" + std::to_string(c) + "<" + t + ">").c_str(),
                                   BM_CausalKernel<T>, c)
          ->Arg(n)
          ->Unit(benchmark::kMillisecond);
    }
    benchmark::RegisterBenchmark(("BM_SoftmaxTiled<" + t + ">").c_str(), BM_SoftmaxTiled<T>)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_SlidingWindow<" + t + ">").c_str(), BM_SlidingWindow<T>)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    if (n <= materialized_max) {
      benchmark::RegisterBenchmark(("BM_SoftmaxMaterialized<" + t + ">").c_str(),
                                   BM_SoftmaxMaterialized<T>)
          ->Arg(n)
          ->Unit(benchmark::kMillisecond);
    }
  }
}

/// 16-bit inputs with float accumulation (the default for them): elu+1 from raw q, k and the
/// kernel alone on featurized inputs, C = Dv = 64, read against the float rows above.
template <class T>
void register_half(const std::vector<Eigen::Index>& sizes) {
  const std::string t = linattn_bench::scalar_name(T{});
  for (const Eigen::Index n : sizes) {
    benchmark::RegisterBenchmark(("BM_CausalLinear_Elu<" + t + ">").c_str(),
                                 BM_CausalLinear<T, linattn::EluPlusOne>, linattn::EluPlusOne{})
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_CausalKernel64<" + t + ">").c_str(), BM_CausalKernel<T>,
                                 Eigen::Index{64})
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = linattn_bench::quick();
  std::vector<Eigen::Index> sizes = {128, 256, 512, 1024, 4096, 16384};
  if (!quick) sizes = {128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536};
  register_scalar<float>(sizes, quick ? 4096 : 8192);
  register_scalar<double>(quick ? std::vector<Eigen::Index>{128, 1024, 8192} : sizes,
                          quick ? 1024 : 8192);
  register_half<Eigen::half>(sizes);
  register_half<Eigen::bfloat16>(sizes);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
