// Cost of each feature map on 4096 x 64 inputs, float and double, taken 64 rows at a time as
// the kernels take them (one call on all rows would mostly time the allocation of the result).
#include <linattn/feature_maps.hpp>
#include <string>

#include "bench_common.hpp"

namespace {

using linattn::Matrix;
using linattn_bench::random_matrix;

constexpr Eigen::Index kDim = 64;
constexpr Eigen::Index kRows = 4096;
constexpr Eigen::Index kChunk = 64;

template <class T, class Map>
void BM_FeatureMap(benchmark::State& state, Map map) {
  const Matrix<T> x = random_matrix<T>(kRows, kDim, 51);
  linattn_bench::measure(state, [&] {
    for (Eigen::Index row = 0; row < kRows; row += kChunk) {
      const Matrix<T> phi = map.keys(x.middleRows(row, kChunk));
      benchmark::DoNotOptimize(phi.data());
    }
  });
  linattn_bench::set_rates(state, 0.0, double(kRows));
  state.counters["C"] = double(map.feature_dim(kDim));
}

/// The stabilised form the kernels use for exponential maps.
template <class T>
void BM_FeatureMapScaled(benchmark::State& state, linattn::PositiveRandomFeatures map) {
  const Matrix<T> x = random_matrix<T>(kRows, kDim, 52);
  linattn::Vector<double> log_scale;
  linattn_bench::measure(state, [&] {
    for (Eigen::Index row = 0; row < kRows; row += kChunk) {
      const Matrix<T> phi = map.scaled_features(x.middleRows(row, kChunk), log_scale);
      benchmark::DoNotOptimize(phi.data());
    }
  });
  linattn_bench::set_rates(state, 0.0, double(kRows));
  state.counters["C"] = double(map.feature_dim(kDim));
}

template <class T>
void register_scalar() {
  const std::string t = linattn_bench::scalar_name(T{});
  auto add = [](const std::string& name, auto fn, auto map) {
    benchmark::RegisterBenchmark(name.c_str(), fn, map)->Unit(benchmark::kMicrosecond);
  };
  add("BM_FeatureMap_Elu<" + t + ">", BM_FeatureMap<T, linattn::EluPlusOne>, linattn::EluPlusOne{});
  add("BM_FeatureMap_Relu<" + t + ">", BM_FeatureMap<T, linattn::Relu>, linattn::Relu{});
  add("BM_FeatureMap_Favor256<" + t + ">", BM_FeatureMap<T, linattn::PositiveRandomFeatures>,
      linattn::PositiveRandomFeatures(kDim, 256, 1));
  add("BM_FeatureMap_Favor256Scaled<" + t + ">", BM_FeatureMapScaled<T>,
      linattn::PositiveRandomFeatures(kDim, 256, 1));
  add("BM_FeatureMap_Fourier128<" + t + ">", BM_FeatureMap<T, linattn::RandomFourierFeatures>,
      linattn::RandomFourierFeatures(kDim, 128, 1));
}

}  // namespace

int main(int argc, char** argv) {
  register_scalar<float>();
  register_scalar<double>();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
