// Causal forward + backward: linear attention (elu+1) against the tiled softmax baseline
// (FlashAttention-2 style), float, d = C = Dv = 64, one thread, with the forward alone beside
// each so the report can give the backward's cost, and Eigen's GEMM rate in the same binary.
#include <linattn/backward.hpp>
#include <linattn/delta_rule.hpp>
#include <linattn/delta_rule_backward.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/dplr_delta_rule_backward.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/gated.hpp>
#include <linattn/gradients.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/softmax.hpp>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using linattn::Matrix;
using linattn_bench::random_matrix;
using linattn_bench::set_rates;

constexpr Eigen::Index kDim = 64;  // Dk = Dv = C = d

template <class T>
struct Inputs {
  Matrix<T> q, k, v, grad_out, out, grad_q, grad_k, grad_v;
  explicit Inputs(Eigen::Index n)
      : q(random_matrix<T>(n, kDim, 21)),
        k(random_matrix<T>(n, kDim, 22)),
        v(random_matrix<T>(n, kDim, 23)),
        grad_out(random_matrix<T>(n, kDim, 24)),
        out(n, kDim),
        grad_q(n, kDim),
        grad_k(n, kDim),
        grad_v(n, kDim) {}
};

/// Causal softmax forward FLOPs: N(N+1)/2 query-key pairs, 2d for q.k and 2d for p v each.
/// The backward's useful work is 5 such products against the forward's 2 (S, dP, dV, dQ, dK;
/// FlashAttention-2's count), so forward + backward is 3.5 forwards. Recomputing the softmax
/// statistics (the backward does not take them from the forward) is not counted as useful.
inline double causal_softmax_flops(Eigen::Index n) {
  return 2.0 * double(n) * double(n + 1) * double(kDim);
}

template <class T>
void BM_SoftmaxForward(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  Inputs<T> in(n);
  linattn_bench::measure(state, [&] {
    linattn::softmax_attention_into(in.q, in.k, in.v, linattn::Mask::causal, in.out);
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, causal_softmax_flops(n), double(n));
}

template <class T>
void BM_SoftmaxForwardBackward(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  Inputs<T> in(n);
  linattn_bench::measure(state, [&] {
    linattn::softmax_attention_into(in.q, in.k, in.v, linattn::Mask::causal, in.out);
    benchmark::DoNotOptimize(in.out.data());
    linattn::softmax_attention_backward_into(in.q, in.k, in.v, in.grad_out, linattn::Mask::causal,
                                             in.grad_q, in.grad_k, in.grad_v);
    benchmark::DoNotOptimize(in.grad_q.data());
    benchmark::DoNotOptimize(in.grad_k.data());
    benchmark::DoNotOptimize(in.grad_v.data());
  });
  set_rates(state, 3.5 * causal_softmax_flops(n), double(n));
}

/// Linear attention with elu+1 features computed inside the timed region, as in a layer's
/// forward. Useful FLOPs 4 N C Dv (the recurrent minimum: phi_k v^T and phi_q^T S per token).
template <class T>
void BM_LinearForward(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  Inputs<T> in(n);
  const linattn::EluPlusOne map;
  linattn_bench::measure(state, [&] {
    linattn::causal_linear_attention_into(in.q, in.k, in.v, map, in.out);
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, 4.0 * double(n) * double(kDim) * double(kDim), double(n));
  state.counters["C"] = double(kDim);
}

/// The linear forward (as BM_LinearForward), then the backward through the feature map: it
/// featurizes q and k again, runs the featurized backward and chains elu+1's backward, as a
/// layer's backward would. Useful FLOPs 12 N C Dv: the backward's four C x Dv products per
/// token (dphi_q, the reverse state, dphi_k, dv) on top of the forward's two.
template <class T>
void BM_LinearForwardBackward(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  Inputs<T> in(n);
  const linattn::EluPlusOne map;
  linattn_bench::measure(state, [&] {
    linattn::causal_linear_attention_into(in.q, in.k, in.v, map, in.out);
    benchmark::DoNotOptimize(in.out.data());
    linattn::causal_linear_attention_backward_into(in.q, in.k, in.v, in.grad_out, map, in.grad_q,
                                                   in.grad_k, in.grad_v);
    benchmark::DoNotOptimize(in.grad_q.data());
    benchmark::DoNotOptimize(in.grad_k.data());
    benchmark::DoNotOptimize(in.grad_v.data());
  });
  set_rates(state, 12.0 * double(n) * double(kDim) * double(kDim), double(n));
  state.counters["C"] = double(kDim);
}

/// The linear forward + backward through the caller's BackwardWorkspace (kept across
/// iterations, as a training loop keeps it): no allocation in the timed region.
template <class T>
void BM_LinearForwardBackwardWorkspace(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  Inputs<T> in(n);
  const linattn::EluPlusOne map;
  const linattn::Options options;
  linattn::BackwardWorkspace<T> workspace;
  linattn_bench::measure(state, [&] {
    linattn::causal_linear_attention_into(in.q, in.k, in.v, map, in.out);
    benchmark::DoNotOptimize(in.out.data());
    linattn::causal_linear_attention_backward_into(in.q, in.k, in.v, in.grad_out, map, in.grad_q,
                                                   in.grad_k, in.grad_v, options, workspace);
    benchmark::DoNotOptimize(in.grad_q.data());
    benchmark::DoNotOptimize(in.grad_k.data());
    benchmark::DoNotOptimize(in.grad_v.data());
  });
  set_rates(state, 12.0 * double(n) * double(kDim) * double(kDim), double(n));
  state.counters["C"] = double(kDim);
}

/// The linear backward alone (elu+1, the forward's output not needed), through the allocating
/// call (`workspace` false: what a user who keeps no BackwardWorkspace runs, under the
/// allocator's defaults: this binary sets no mallopt) or the caller's workspace. Useful FLOPs
/// 8 N C Dv: the backward's four C x Dv products per token.
template <class T>
void BM_LinearBackward(benchmark::State& state, int form) {
  const Eigen::Index n = state.range(0);
  Inputs<T> in(n);
  const linattn::EluPlusOne map;
  const linattn::Options options;
  linattn::BackwardWorkspace<T> kept;
  linattn_bench::measure(state, [&] {
    if (form == 2) {
      const linattn::AttentionGradients<T> grads =
          linattn::causal_linear_attention_backward(in.q, in.k, in.v, in.grad_out, map, options);
      benchmark::DoNotOptimize(grads.q.data());
    } else if (form == 1) {
      linattn::causal_linear_attention_backward_into(in.q, in.k, in.v, in.grad_out, map, in.grad_q,
                                                     in.grad_k, in.grad_v, options, kept);
    } else {
      linattn::causal_linear_attention_backward_into(in.q, in.k, in.v, in.grad_out, map, in.grad_q,
                                                     in.grad_k, in.grad_v, options);
    }
    benchmark::DoNotOptimize(in.grad_q.data());
    benchmark::DoNotOptimize(in.grad_k.data());
    benchmark::DoNotOptimize(in.grad_v.data());
  });
  set_rates(state, 8.0 * double(n) * double(kDim) * double(kDim), double(n));
  state.counters["C"] = double(kDim);
}

/// GLA's gated kernel: featurized q and k, per-feature log gates (log a < 0, about -0.05),
/// normalize off as in FLA; the forward alone and forward + backward (which also gives
/// d loss / d g). FLOPs counted as for the plain kernel.
template <class T>
struct GatedInputs : Inputs<T> {
  Matrix<T> log_gates;
  explicit GatedInputs(Eigen::Index n)
      : Inputs<T>(n),
        log_gates((-T(0.05) * random_matrix<T>(n, kDim, 25).array().abs() - T(1e-3)).matrix()) {}
};

inline linattn::Options gla_options() {
  linattn::Options options;
  options.normalize = false;
  return options;
}

template <class T>
void BM_GatedForward(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  GatedInputs<T> in(n);
  const linattn::Options options = gla_options();
  linattn_bench::measure(state, [&] {
    linattn::causal_gated_linear_attention_into(in.q, in.k, in.v, linattn::log_gates(in.log_gates),
                                                linattn::Identity{}, in.out, options);
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, 4.0 * double(n) * double(kDim) * double(kDim), double(n));
}

template <class T>
void BM_GatedForwardBackward(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  GatedInputs<T> in(n);
  const linattn::Options options = gla_options();
  linattn::BackwardWorkspace<T> workspace;
  linattn::GatedAttentionGradients<T> grads;
  linattn_bench::measure(state, [&] {
    linattn::causal_gated_linear_attention_into(in.q, in.k, in.v, linattn::log_gates(in.log_gates),
                                                linattn::Identity{}, in.out, options);
    benchmark::DoNotOptimize(in.out.data());
    linattn::causal_gated_linear_attention_backward_into(
        in.q, in.k, in.v, linattn::log_gates(in.log_gates), in.grad_out, linattn::Identity{}, grads,
        options, workspace);
    benchmark::DoNotOptimize(grads.q.data());
  });
  set_rates(state, 12.0 * double(n) * double(kDim) * double(kDim), double(n));
}

/// DeltaNet and Gated DeltaNet at Dk = Dv = 128 (Qwen3.5's heads): q, k raw (normalised in
/// the kernel, FLA's use_qk_l2norm_in_kernel), beta = sigmoid(x), log gates -0.1 sigmoid(x).
constexpr Eigen::Index kDeltaDim = 128;

template <class T>
struct DeltaInputs {
  Matrix<T> q, k, v, log_gates, grad_out, out;
  linattn::Vector<T> beta;
  linattn::DeltaRuleGradients<T> grads;
  /// gates: 0 or 1 (one per token), or Dk (KDA, per key feature).
  DeltaInputs(Eigen::Index n, Eigen::Index gates)
      : q(random_matrix<T>(n, kDeltaDim, 31)),
        k(random_matrix<T>(n, kDeltaDim, 32)),
        v(random_matrix<T>(n, kDeltaDim, 33)),
        log_gates(T(-0.1) /
                  (T(1) + random_matrix<T>(n, std::max<Eigen::Index>(gates, 1), 34).array().exp())),
        grad_out(random_matrix<T>(n, kDeltaDim, 35)),
        out(n, kDeltaDim),
        beta(T(1) / (T(1) + random_matrix<T>(n, 1, 36).array().exp())),
        grads{Matrix<T>(n, kDeltaDim), Matrix<T>(n, kDeltaDim), Matrix<T>(n, kDeltaDim),
              linattn::Vector<T>(n), Matrix<T>(n, std::max<Eigen::Index>(gates, 1))} {}
};

/// Args: N, gates (0: DeltaNet, 1: Gated DeltaNet, 128: KDA), threads.
linattn::DeltaOptions delta_options(const benchmark::State& state) {
  linattn::DeltaOptions options;
  options.l2_normalize = true;
  options.threads = static_cast<int>(state.range(2));
  options.check_finite = false;
  return options;
}

/// The delta rule's forward, as the backward's unit: the chunked form (what training runs).
template <class T>
void BM_DeltaForward(benchmark::State& state) {
  const Eigen::Index n = state.range(0);
  DeltaInputs<T> in(n, state.range(1));
  linattn::DeltaOptions options = delta_options(state);
  options.form = linattn::DeltaForm::chunked;
  linattn_bench::measure(state, [&] {
    if (state.range(1) == 0) {
      linattn::causal_delta_rule_into(in.q, in.k, in.v, in.beta, in.out, options);
    } else {
      linattn::causal_gated_delta_rule_into(in.q, in.k, in.v, linattn::log_gates(in.log_gates),
                                            in.beta, in.out, options);
    }
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, 6.0 * double(n) * double(kDeltaDim) * double(kDeltaDim), double(n));
}

/// The delta rule's backward alone (the forward's outputs are not its input), with a kept
/// workspace; recurrent: 1 runs the recurrent form (DeltaForm::streamed), the reference.
template <class T>
void BM_DeltaBackward(benchmark::State& state, bool recurrent) {
  const Eigen::Index n = state.range(0);
  DeltaInputs<T> in(n, state.range(1));
  linattn::DeltaOptions options = delta_options(state);
  options.form = recurrent ? linattn::DeltaForm::streamed : linattn::DeltaForm::chunked;
  linattn::DeltaBackwardWorkspace<T> workspace;
  auto& g = in.grads;
  linattn_bench::measure(state, [&] {
    if (state.range(1) == 0) {
      linattn::causal_delta_rule_backward_into(in.q, in.k, in.v, in.beta, in.grad_out, g.q, g.k,
                                               g.v, g.beta, options, workspace);
    } else {
      linattn::causal_gated_delta_rule_backward_into(
          in.q, in.k, in.v, linattn::log_gates(in.log_gates), in.beta, in.grad_out, g.q, g.k, g.v,
          g.gates, g.beta, options, workspace);
    }
    benchmark::DoNotOptimize(g.q.data());
  });
  // Counted as the forward's 6 Dk Dv a token: the rate reads as forwards per second.
  set_rates(state, 6.0 * double(n) * double(kDeltaDim) * double(kDeltaDim), double(n));
}

/// RWKV-7's shape for the generalized delta rule: one head of Dk = Dv = D (RWKV-7: 64), a =
/// -kk, b = kk alpha, per-feature log decays in [-0.6, 0), scale 1. Args: N; the forward (0),
/// the backward in its chunked form (1, the default at D >= 64) or its recurrent one (2,
/// DeltaForm::streamed); D; threads (2: the backward splits the value columns, the forward
/// too).
template <class T>
void BM_DplrBackward(benchmark::State& state) {
  const Eigen::Index n = state.range(0), d = state.range(2);
  const Matrix<T> q = random_matrix<T>(n, d, 41), v = random_matrix<T>(n, d, 43);
  Matrix<T> k = random_matrix<T>(n, d, 42), kk = k;
  for (Eigen::Index t = 0; t < n; ++t) kk.row(t).normalize();
  const Matrix<T> a = -kk;
  const Matrix<T> b = kk * T(0.5);
  const Matrix<T> g = T(-0.6) / (T(1) + random_matrix<T>(n, d, 44).array().exp());
  const Matrix<T> grad_out = random_matrix<T>(n, d, 45);
  linattn::DplrOptions options;
  options.scale = 1.0;
  options.threads = static_cast<int>(state.range(3));
  options.check_finite = false;
  Matrix<T> out(n, d);
  linattn::DplrGradients<T> grads;
  const bool backward = state.range(1) != 0;
  // The forward in its automatic (faster) form; the backward in the form named.
  const linattn::DeltaForm forms[] = {linattn::DeltaForm::automatic, linattn::DeltaForm::chunked,
                                      linattn::DeltaForm::streamed};
  options.form = forms[state.range(1)];
  linattn_bench::measure(state, [&] {
    if (backward) {
      linattn::causal_dplr_delta_rule_backward_into(q, k, v, a, b, linattn::log_gates(g), grad_out,
                                                    grads, options);
      benchmark::DoNotOptimize(grads.q.data());
    } else {
      linattn::causal_dplr_delta_rule_into(q, k, v, a, b, linattn::log_gates(g), out, options);
      benchmark::DoNotOptimize(out.data());
    }
  });
  // Counted as the forward's 8 Dk Dv a token: the rate reads as forwards per second.
  set_rates(state, 8.0 * double(n) * double(d) * double(d), double(n));
}

template <class T>
void register_delta(const std::vector<Eigen::Index>& sizes) {
  const std::string t = linattn_bench::scalar_name(T{});
  for (const Eigen::Index n : sizes) {
    for (const int gates : {0, 1, static_cast<int>(kDeltaDim)}) {
      for (const int threads : {1, 2}) {
        benchmark::RegisterBenchmark(("BM_DeltaForward<" + t + ">").c_str(), BM_DeltaForward<T>)
            ->Args({n, gates, threads})
            ->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("BM_DeltaBackward<" + t + ">").c_str(), BM_DeltaBackward<T>,
                                     false)
            ->Args({n, gates, threads})
            ->Unit(benchmark::kMillisecond);
        if (threads > 1) continue;
        benchmark::RegisterBenchmark(("BM_DeltaBackwardRecurrent<" + t + ">").c_str(),
                                     BM_DeltaBackward<T>, true)
            ->Args({n, gates, threads})
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
}

template <class T>
void register_scalar(const std::vector<Eigen::Index>& sizes) {
  const std::string t = linattn_bench::scalar_name(T{});
  benchmark::RegisterBenchmark(("BM_EigenGemm<" + t + ">").c_str(), linattn_bench::BM_EigenGemm<T>)
      ->Arg(512)
      ->MinTime(0.5)  // the reference every rate is read against: measure it well
      ->Unit(benchmark::kMillisecond);
  for (const Eigen::Index n : sizes) {
    benchmark::RegisterBenchmark(("BM_LinearForwardBackward<" + t + ">").c_str(),
                                 BM_LinearForwardBackward<T>)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_LinearForwardBackwardWorkspace<" + t + ">").c_str(),
                                 BM_LinearForwardBackwardWorkspace<T>)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_LinearForward<" + t + ">").c_str(), BM_LinearForward<T>)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_LinearBackward<" + t + ">").c_str(), BM_LinearBackward<T>, 0)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_LinearBackwardWorkspace<" + t + ">").c_str(),
                                 BM_LinearBackward<T>, 1)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_LinearBackwardReturned<" + t + ">").c_str(),
                                 BM_LinearBackward<T>, 2)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_GatedForwardBackward<" + t + ">").c_str(),
                                 BM_GatedForwardBackward<T>)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_GatedForward<" + t + ">").c_str(), BM_GatedForward<T>)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    // The softmax baseline is quadratic: up to N = 16,384.
    if (n > 16384) continue;
    benchmark::RegisterBenchmark(("BM_SoftmaxForwardBackward<" + t + ">").c_str(),
                                 BM_SoftmaxForwardBackward<T>)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_SoftmaxForward<" + t + ">").c_str(), BM_SoftmaxForward<T>)
        ->Arg(n)
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = linattn_bench::quick();
  register_scalar<float>(quick ? std::vector<Eigen::Index>{256, 1024, 4096}
                               : std::vector<Eigen::Index>{256, 1024, 4096, 16384, 65536});
  register_delta<float>(quick ? std::vector<Eigen::Index>{4096}
                              : std::vector<Eigen::Index>{4096, 16384});
  for (const Eigen::Index n :
       quick ? std::vector<Eigen::Index>{4096} : std::vector<Eigen::Index>{4096, 16384}) {
    for (const Eigen::Index d : {32, 64, 128}) {
      for (const int form : {0, 1, 2}) {
        for (const int threads : {1, 2}) {
          if (threads == 2 && (d < 64 || form == 2)) continue;
          benchmark::RegisterBenchmark("BM_DplrBackward<float>", BM_DplrBackward<float>)
              ->Args({n, form, d, threads})
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
