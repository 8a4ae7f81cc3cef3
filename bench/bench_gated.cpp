// Gated causal linear attention on the one engine: scalar gates (Mamba-2, simple GLA) and
// per-feature gates (GLA, RWKV-6) beside the ungated kernel and a per-token recurrent loop
// (RecurrentState::step over every token, the form ggml's gated op runs), all on featurized
// inputs and one thread, with Eigen's GEMM rate measured in the same binary. Shapes: C = Dv = 64
// at several N, GLA's 128-dim heads, and Mamba-2's head (head dim 64, state 128).
#include <cmath>
#include <cstdint>
#include <linattn/gated.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/recurrent_state.hpp>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using linattn::Matrix;
using linattn_bench::random_matrix;
using linattn_bench::set_rates;

/// One head's inputs: positive features (N x C), values (N x Dv), log gates in [-0.1, 0]
/// (N x gate_cols; 0 columns for none), and the output.
template <class T>
struct Head {
  Matrix<T> phi_q, phi_k, v, log_gates, out;
  Head(Eigen::Index n, Eigen::Index c, Eigen::Index dv, Eigen::Index gate_cols)
      : phi_q(random_matrix<T>(n, c, 21).array().exp().matrix()),
        phi_k(random_matrix<T>(n, c, 22).array().exp().matrix()),
        v(random_matrix<T>(n, dv, 23)),
        log_gates((random_matrix<T>(n, gate_cols, 24).array().abs() * T(-0.05)).matrix()),
        out(n, dv) {}
};

/// Useful FLOPs of the recurrence: 4 N C Dv (update and read of S), as for the ungated kernel.
double recurrence_flops(Eigen::Index n, Eigen::Index c, Eigen::Index dv) {
  return 4.0 * double(n) * double(c) * double(dv);
}

/// The chunked kernel: no gates (gate_cols 0), scalar gates (1) or per-feature gates (C).
template <class T>
void BM_Chunked(benchmark::State& state, Eigen::Index c, Eigen::Index dv, Eigen::Index gate_cols) {
  const Eigen::Index n = state.range(0);
  Head<T> in(n, c, dv, gate_cols);
  linattn_bench::measure(state, [&] {
    if (gate_cols == 0) {
      linattn::causal_linear_attention_into(in.phi_q, in.phi_k, in.v, linattn::Identity{}, in.out);
    } else {
      linattn::causal_gated_linear_attention_into(
          in.phi_q, in.phi_k, in.v, linattn::log_gates(in.log_gates), linattn::Identity{}, in.out);
    }
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, recurrence_flops(n, c, dv), double(n));
  state.counters["C"] = double(c);
}

/// The per-token loop: RecurrentState::step_into over every token, per-feature gates.
template <class T>
void BM_StepLoop(benchmark::State& state, Eigen::Index c, Eigen::Index dv, Eigen::Index gate_cols) {
  const Eigen::Index n = state.range(0);
  Head<T> in(n, c, dv, gate_cols);
  linattn::Vector<T> out(dv);
  linattn_bench::measure(state, [&] {
    linattn::RecurrentState<T> recurrent(c, dv);
    for (Eigen::Index t = 0; t < n; ++t) {
      recurrent.step_into(in.phi_q.row(t), in.phi_k.row(t), in.v.row(t),
                          linattn::log_gates(in.log_gates.row(t)), linattn::Identity{}, out);
    }
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, recurrence_flops(n, c, dv), double(n));
  state.counters["C"] = double(c);
}

/// Registers one shape's rows: ungated, scalar and per-feature chunked, and the step loop.
template <class T>
void register_shape(const std::string& shape, Eigen::Index c, Eigen::Index dv,
                    const std::vector<Eigen::Index>& sizes, bool step_loop) {
  const std::string t = linattn_bench::scalar_name(T{});
  struct Kind {
    const char* name;
    Eigen::Index gate_cols;
  };
  for (const Eigen::Index n : sizes) {
    for (const Kind kind : {Kind{"Ungated", 0}, Kind{"ScalarGates", 1}, Kind{"FeatureGates", c}}) {
      benchmark::RegisterBenchmark(
          ("BM_Gated_" + std::string(kind.name) + "_" + shape + "<" + t + ">").c_str(),
          BM_Chunked<T>, c, dv, kind.gate_cols)
          ->Arg(n)
          ->Unit(benchmark::kMillisecond);
    }
    if (step_loop) {
      benchmark::RegisterBenchmark(("BM_Gated_StepLoop_" + shape + "<" + t + ">").c_str(),
                                   BM_StepLoop<T>, c, dv, c)
          ->Arg(n)
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = linattn_bench::quick();
  benchmark::RegisterBenchmark("BM_EigenGemm<float>", linattn_bench::BM_EigenGemm<float>)
      ->Arg(512)
      ->MinTime(0.5)
      ->Unit(benchmark::kMillisecond);
  const std::vector<Eigen::Index> sizes =
      quick ? std::vector<Eigen::Index>{1024, 4096, 16384}
            : std::vector<Eigen::Index>{256, 1024, 4096, 16384, 65536};
  register_shape<float>("C64", 64, 64, sizes, true);
  register_shape<float>("GLA128", 128, 128, {4096}, true);
  register_shape<float>("Mamba2", 128, 64, {4096}, false);
  register_shape<double>("C64", 64, 64, {4096}, false);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
