// Gated causal linear attention on the one engine: scalar gates (Mamba-2, simple GLA) and
// per-feature gates (GLA, RWKV-6) beside the ungated kernel and two per-token loops
// (RecurrentState::step over every token, and the obvious Eigen loop of each transition, the
// form ggml's gated op runs), all on featurized inputs and one thread, with Eigen's GEMM rate
// measured in the same binary. Shapes: C = Dv = 64 at several N, GLA's 128-dim heads, and
// Mamba-2's head (head dim 64, state 128). And 8 heads of C = Dv = 64 on the multi-head views,
// head-contiguous ([B, H, N, D]) and token-major ([B, N, H, D], a QKV projection's layout), for
// every transition, with and without the scan.
#include <cmath>
#include <cstdint>
#include <linattn/gated.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/recurrent_state.hpp>
#include <linattn/state_batch.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_common.hpp"

namespace {

using linattn::HeadsView;
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

/// The obvious per-token loop of the same recurrence in Eigen, the baseline a kernel must beat:
/// per token S = S (no gates), a S (scalar) or diag(a) S (per feature), then S += k v^T and
/// out = S^T q; the gates given as a.
template <class T>
void BM_EigenLoop(benchmark::State& state, Eigen::Index c, Eigen::Index dv,
                  Eigen::Index gate_cols) {
  const Eigen::Index n = state.range(0);
  Head<T> in(n, c, dv, gate_cols);
  const Matrix<T> linear_gates = in.log_gates.array().exp().matrix();
  Matrix<T> s(c, dv);
  linattn_bench::measure(state, [&] {
    s.setZero();
    for (Eigen::Index t = 0; t < n; ++t) {
      if (gate_cols == 1) {
        s *= linear_gates(t, 0);
      } else if (gate_cols > 1) {
        s = linear_gates.row(t).transpose().asDiagonal() * s;
      }
      s.noalias() += in.phi_k.row(t).transpose() * in.v.row(t);
      in.out.row(t).noalias() = in.phi_q.row(t) * s;
    }
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, recurrence_flops(n, c, dv), double(n));
  state.counters["C"] = double(c);
}

/// The transitions of the multi-head rows.
enum class Transition { ungated, head_decays, scalar, feature };

/// 8 heads of range(0) tokens, C = Dv = 64, on views of one layout (token-major or not), one
/// thread; `check_finite` on or off, to read the scan's share.
template <class T>
void BM_Heads(benchmark::State& state, Transition transition, bool token_major, bool check_finite) {
  constexpr Eigen::Index kHeads = 8, kDim = 64;
  const Eigen::Index n = state.range(0);
  const Eigen::Index gate_cols = transition == Transition::feature ? kDim : 1;
  // Every layout holds the same element count; the views give them their meaning.
  Head<T> in(kHeads * n, kDim, kDim, gate_cols);
  const linattn::HeadShape shape{1, kHeads, n, kDim};
  const linattn::HeadShape gate_shape{1, kHeads, n, gate_cols};
  auto view = [&](auto* data, const linattn::HeadShape& s) {
    using V = HeadsView<std::remove_pointer_t<decltype(data)>>;
    return token_major ? V::bnhd(data, linattn::BnhdShape(s)) : V::bhnd(data, s);
  };
  const auto q = view(static_cast<const T*>(in.phi_q.data()), shape);
  const auto k = view(static_cast<const T*>(in.phi_k.data()), shape);
  const auto v = view(static_cast<const T*>(in.v.data()), shape);
  const auto g = view(static_cast<const T*>(in.log_gates.data()), gate_shape);
  const auto out = view(in.out.data(), shape);
  linattn::HeadDecays decays;
  for (Eigen::Index h = 0; h < kHeads; ++h) decays.values.push_back(1.0 - std::exp2(-5.0 - h));
  linattn::Options options;
  options.threads = 1;
  options.check_finite = check_finite;
  linattn_bench::measure(state, [&] {
    switch (transition) {
      case Transition::ungated:
        linattn::causal_linear_attention_into(q, k, v, linattn::Identity{}, out, options);
        break;
      case Transition::head_decays:
        linattn::causal_gated_linear_attention_into(q, k, v, decays, linattn::Identity{}, out,
                                                    options);
        break;
      case Transition::scalar:
      case Transition::feature:
        linattn::causal_gated_linear_attention_into(q, k, v, linattn::log_gates(g),
                                                    linattn::Identity{}, out, options);
        break;
    }
    benchmark::DoNotOptimize(in.out.data());
  });
  set_rates(state, kHeads * recurrence_flops(n, kDim, kDim), double(kHeads * n));
}

/// The transitions of the decoding-step rows.
enum class StepGate { ungated, scalar_log, feature_log, feature_linear };

/// One decoding step of 8 heads of C = Dv = 64 (a RecurrentStateBatch, one thread) at context
/// range(0): the states hold that many tokens of the same transition (prefilled outside the
/// timing), and each timed step takes one more token for every head.
void BM_Step(benchmark::State& state, StepGate gate) {
  constexpr Eigen::Index kHeads = 8, kDim = 64;
  const Eigen::Index context = state.range(0);
  const bool per_feature = gate == StepGate::feature_log || gate == StepGate::feature_linear;
  const Eigen::Index gate_cols = per_feature ? kDim : 1;
  linattn::Options options;
  options.threads = 1;
  linattn::RecurrentStateBatch<float> batch(kHeads, kDim, kDim, options);
  const Head<float> history(context, kDim, kDim, gate_cols);
  const linattn::HeadShape shape{1, kHeads, context, kDim};
  const linattn::HeadShape gate_shape{1, kHeads, context, gate_cols};
  // Every head prefills the same history: the state's contents do not change the step's work.
  Matrix<float> q(kHeads * context, kDim), k(kHeads * context, kDim), v(kHeads * context, kDim),
      g(kHeads * context, gate_cols), prefill_out(kHeads * context, kDim);
  for (Eigen::Index h = 0; h < kHeads; ++h) {
    q.middleRows(h * context, context) = history.phi_q;
    k.middleRows(h * context, context) = history.phi_k;
    v.middleRows(h * context, context) = history.v;
    g.middleRows(h * context, context) = history.log_gates;
  }
  const auto view = [](auto* data, const linattn::HeadShape& s) {
    return HeadsView<std::remove_pointer_t<decltype(data)>>::bhnd(data, s);
  };
  if (gate == StepGate::ungated) {
    batch.prefill_into(view(static_cast<const float*>(q.data()), shape),
                       view(static_cast<const float*>(k.data()), shape),
                       view(static_cast<const float*>(v.data()), shape), linattn::Identity{},
                       view(prefill_out.data(), shape));
  } else {
    batch.prefill_into(view(static_cast<const float*>(q.data()), shape),
                       view(static_cast<const float*>(k.data()), shape),
                       view(static_cast<const float*>(v.data()), shape),
                       linattn::log_gates(view(static_cast<const float*>(g.data()), gate_shape)),
                       linattn::Identity{}, view(prefill_out.data(), shape));
  }
  const Head<float> token(kHeads, kDim, kDim, gate_cols);
  const Matrix<float> linear_gates = token.log_gates.array().exp().matrix();
  Matrix<float> out(kHeads, kDim);
  linattn_bench::measure(state, [&] {
    switch (gate) {
      case StepGate::ungated:
        batch.step_into(token.phi_q, token.phi_k, token.v, linattn::Identity{}, out);
        break;
      case StepGate::scalar_log:
      case StepGate::feature_log:
        batch.step_into(token.phi_q, token.phi_k, token.v, linattn::log_gates(token.log_gates),
                        linattn::Identity{}, out);
        break;
      case StepGate::feature_linear:
        batch.step_into(token.phi_q, token.phi_k, token.v, linear_gates, linattn::Identity{}, out);
        break;
    }
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, kHeads * recurrence_flops(1, kDim, kDim), double(kHeads));
}

/// The obvious per-token loop of the same step in Eigen (ggml's gated op's form): per head,
/// S = diag(a) S + k v^T and out = S^T q, the gates given as a. The baseline a step must beat.
void BM_StepEigenLoop(benchmark::State& state) {
  constexpr Eigen::Index kHeads = 8, kDim = 64;
  const Head<float> token(kHeads, kDim, kDim, kDim);
  const Matrix<float> linear_gates = token.log_gates.array().exp().matrix();
  std::vector<Matrix<float>> s(kHeads, random_matrix<float>(kDim, kDim, 25));
  Matrix<float> out(kHeads, kDim);
  linattn_bench::measure(state, [&] {
    for (Eigen::Index h = 0; h < kHeads; ++h) {
      Matrix<float>& sh = s[static_cast<std::size_t>(h)];
      sh = linear_gates.row(h).transpose().asDiagonal() * sh;
      sh.noalias() += token.phi_k.row(h).transpose() * token.v.row(h);
      out.row(h).noalias() = token.phi_q.row(h) * sh;
    }
    benchmark::DoNotOptimize(out.data());
  });
  set_rates(state, kHeads * recurrence_flops(1, kDim, kDim), double(kHeads));
}

/// The step rows at contexts of 1 and 16,384 tokens.
void register_steps() {
  struct Kind {
    const char* name;
    StepGate gate;
  };
  for (const Eigen::Index context : {Eigen::Index(16), Eigen::Index(16384)}) {
    for (const Kind kind :
         {Kind{"Ungated", StepGate::ungated}, Kind{"ScalarLogGates", StepGate::scalar_log},
          Kind{"FeatureLogGates", StepGate::feature_log},
          Kind{"FeatureGates", StepGate::feature_linear}}) {
      benchmark::RegisterBenchmark(
          ("BM_GatedStep_Heads8_C64_" + std::string(kind.name) + "<float>").c_str(), BM_Step,
          kind.gate)
          ->Arg(context)
          ->Unit(benchmark::kMicrosecond);
    }
  }
  benchmark::RegisterBenchmark("BM_GatedStep_Heads8_C64_EigenLoop<float>", BM_StepEigenLoop)
      ->Unit(benchmark::kMicrosecond);
}

/// The multi-head rows: every transition in both layouts, the scan on and off.
void register_heads(const std::vector<Eigen::Index>& sizes) {
  struct Kind {
    const char* name;
    Transition transition;
  };
  for (const Eigen::Index n : sizes) {
    for (const Kind kind :
         {Kind{"Ungated", Transition::ungated}, Kind{"HeadDecays", Transition::head_decays},
          Kind{"ScalarGates", Transition::scalar}, Kind{"FeatureGates", Transition::feature}}) {
      for (const bool token_major : {false, true}) {
        for (const bool check_finite : {true, false}) {
          benchmark::RegisterBenchmark(
              ("BM_GatedHeads8_" + std::string(kind.name) + "_" + (token_major ? "BNHD" : "BHND") +
               (check_finite ? "" : "_NoScan") + "<float>")
                  .c_str(),
              BM_Heads<float>, kind.transition, token_major, check_finite)
              ->Arg(n)
              ->Unit(benchmark::kMillisecond);
        }
      }
    }
  }
}

/// Registers one shape's rows: ungated, scalar and per-feature chunked, and the loops.
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
      for (const Kind kind :
           {Kind{"Ungated", 0}, Kind{"ScalarGates", 1}, Kind{"FeatureGates", c}}) {
        benchmark::RegisterBenchmark(
            ("BM_Gated_EigenLoop_" + std::string(kind.name) + "_" + shape + "<" + t + ">").c_str(),
            BM_EigenLoop<T>, c, dv, kind.gate_cols)
            ->Arg(n)
            ->Unit(benchmark::kMillisecond);
      }
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
  register_steps();
  register_heads(quick ? std::vector<Eigen::Index>{4096}
                       : std::vector<Eigen::Index>{1024, 4096, 16384, 65536});
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
