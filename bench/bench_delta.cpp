// The delta rule (DeltaNet, Gated DeltaNet, KDA) on one head and one thread: the chunked WY
// form at chunk 16, 32 and 64, the streamed recurrence (strips of S in L1 across tokens),
// DeltaRuleState::step over every token, and the obvious per-token Eigen loop (row-major S; pred =
// k^T S, S += k (beta (v - pred))^T, out = s q^T S), the form ggml, ONNX Runtime and MNN run, with
// Eigen's GEMM rate measured in the same binary. Useful FLOPs are the recurrence's: 6 Dk Dv per
// token (readout of k, rank-1 update, output). L2-normalised keys, beta in [0.05, 1], log gates in
// [-0.05, 0].
#include <cmath>
#include <linattn/delta_rule.hpp>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using linattn::Matrix;
using linattn::Vector;
using linattn_bench::random_matrix;
using linattn_bench::set_rates;

/// One head's inputs: q, k (N x Dk, keys normalised), v (N x Dv), beta (N), log gates
/// (N x gate_cols), and the output.
struct Head {
  Matrix<float> q, k, v, log_gates, out;
  Vector<float> beta;
  Head(Eigen::Index n, Eigen::Index dk, Eigen::Index dv, Eigen::Index gate_cols)
      : q(random_matrix<float>(n, dk, 31)),
        k(random_matrix<float>(n, dk, 32)),
        v(random_matrix<float>(n, dv, 33)),
        log_gates((random_matrix<float>(n, gate_cols, 34).array().abs() * -0.05f).matrix()),
        out(n, dv),
        beta((random_matrix<float>(n, 1, 35).array().abs() * 0.95f + 0.05f).min(1.0f).matrix()) {
    for (Eigen::Index t = 0; t < n; ++t) k.row(t).normalize();
  }
};

double useful_flops(Eigen::Index n, Eigen::Index dk, Eigen::Index dv) {
  return 6.0 * double(n) * double(dk) * double(dv);
}

/// One call over the sequence in `form` (chunk: the chunked form's L): DeltaNet (gate_cols 0),
/// Gated DeltaNet (1) or KDA (Dk).
void BM_DeltaCall(benchmark::State& state, Eigen::Index dk, Eigen::Index dv, Eigen::Index gate_cols,
                  linattn::DeltaForm form, Eigen::Index chunk) {
  const Eigen::Index n = state.range(0);
  Head in(n, dk, dv, gate_cols);
  linattn::DeltaOptions options;
  options.chunk = chunk;
  options.form = form;
  options.threads = 1;  // bench_threads measures the split over threads
  linattn_bench::measure(state, [&] {
    if (gate_cols == 0) {
      linattn::causal_delta_rule_into(in.q, in.k, in.v, in.beta, in.out, options);
    } else {
      linattn::causal_gated_delta_rule_into(in.q, in.k, in.v, linattn::log_gates(in.log_gates),
                                            in.beta, in.out, options);
    }
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, useful_flops(n, dk, dv), double(n));
}

/// DeltaRuleState::step_into over every token: Gated DeltaNet's scalar gates (gate_cols 1) or
/// KDA's per-feature gates (Dk).
void BM_DeltaStep(benchmark::State& state, Eigen::Index dk, Eigen::Index dv,
                  Eigen::Index gate_cols) {
  const Eigen::Index n = state.range(0);
  Head in(n, dk, dv, gate_cols);
  Vector<float> out(dv);
  linattn::DeltaRuleState<float> recurrent(dk, dv);
  linattn_bench::measure(state, [&] {
    recurrent.reset();
    for (Eigen::Index t = 0; t < n; ++t) {
      recurrent.step_into(in.q.row(t), in.k.row(t), in.v.row(t),
                          linattn::log_gates(in.log_gates.row(t)), in.beta(t), out);
    }
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, useful_flops(n, dk, dv), double(n));
}

/// The per-token Eigen loop the issue names as the baseline: three passes over a row-major S.
/// Gated DeltaNet's scalar gate (gate_cols 1) or KDA's per-feature gates (Dk: S = diag(a) S).
void BM_DeltaEigenLoop(benchmark::State& state, Eigen::Index dk, Eigen::Index dv,
                       Eigen::Index gate_cols) {
  const Eigen::Index n = state.range(0);
  Head in(n, dk, dv, gate_cols);
  Matrix<float> s(dk, dv);
  Eigen::RowVectorXf pred(dv);
  Eigen::ArrayXf gate(dk);
  const float scale = 1.0f / std::sqrt(float(dk));
  linattn_bench::measure(state, [&] {
    s.setZero();
    for (Eigen::Index t = 0; t < n; ++t) {
      if (gate_cols == 1) {
        s *= std::exp(in.log_gates(t, 0));
      } else {
        gate = in.log_gates.row(t).transpose().array().exp();
        s.array().colwise() *= gate;
      }
      pred.noalias() = in.k.row(t) * s;
      pred = in.beta(t) * (in.v.row(t) - pred);
      s.noalias() += in.k.row(t).transpose() * pred;
      in.out.row(t).noalias() = scale * (in.q.row(t) * s);
    }
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, useful_flops(n, dk, dv), double(n));
}

void register_shape(Eigen::Index d, const std::vector<Eigen::Index>& sizes) {
  const std::string shape = "D" + std::to_string(d);
  struct Variant {
    const char* name;
    Eigen::Index gate_cols;
  };
  for (const Eigen::Index n : sizes) {
    for (const Variant variant :
         {Variant{"DeltaNet", 0}, Variant{"GatedDeltaNet", 1}, Variant{"KDA", d}}) {
      for (const Eigen::Index chunk : {Eigen::Index{16}, Eigen::Index{32}, Eigen::Index{64}}) {
        benchmark::RegisterBenchmark(("BM_DeltaChunked_" + std::string(variant.name) + "_" + shape +
                                      "_L" + std::to_string(chunk) + "<float>")
                                         .c_str(),
                                     BM_DeltaCall, d, d, variant.gate_cols,
                                     linattn::DeltaForm::chunked, chunk)
            ->Arg(n)
            ->Unit(benchmark::kMillisecond);
      }
      benchmark::RegisterBenchmark(
          ("BM_DeltaStreamed_" + std::string(variant.name) + "_" + shape + "<float>").c_str(),
          BM_DeltaCall, d, d, variant.gate_cols, linattn::DeltaForm::streamed, Eigen::Index{64})
          ->Arg(n)
          ->Unit(benchmark::kMillisecond);
    }
    benchmark::RegisterBenchmark(("BM_DeltaStep_" + shape + "<float>").c_str(), BM_DeltaStep, d, d,
                                 Eigen::Index{1})
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_DeltaStep_KDA_" + shape + "<float>").c_str(), BM_DeltaStep, d,
                                 d, d)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_DeltaEigenLoop_" + shape + "<float>").c_str(),
                                 BM_DeltaEigenLoop, d, d, Eigen::Index{1})
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_DeltaEigenLoop_KDA_" + shape + "<float>").c_str(),
                                 BM_DeltaEigenLoop, d, d, d)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
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
      quick ? std::vector<Eigen::Index>{4096} : std::vector<Eigen::Index>{1024, 4096, 16384};
  register_shape(64, sizes);
  register_shape(128, sizes);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
