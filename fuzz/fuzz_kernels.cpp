// SPDX-License-Identifier: MIT
// libFuzzer target: every kernel on small fuzzed shapes, options and values (the byte layout is
// in kernel_input.hpp). Only linattn::Error may escape a call; besides that, these must hold:
//
//   * finite inputs with |x| <= 10 and valid options/arguments never throw;
//   * and with a positive map (EluPlusOne, Relu, PositiveRandomFeatures) under those conditions:
//       - every output of the linear kernels is finite;
//       - the parallel form (causal_linear_attention), the step-by-step RecurrentState and
//         prefill-then-step agree, on featurized inputs and through the map, in float also with
//         double accumulation (Acc = double), and the two entry points agree with each other
//         (unless eps is below 1e-12 with normalize on: then d = phi(q) . z + eps can be a denormal
//         and the output is ill-conditioned);
//       - the last row of linear_attention equals the last row of the causal form (decay 1);
//   * a RecurrentState with finite S and z saves and loads back to the same bytes, and the
//     loaded copy steps to bit-identical outputs;
//   * the delta rule (DeltaNet, Gated DeltaNet, KDA) with valid options, beta and bounded input
//     never throws; with L2-normalised q and k its outputs are finite, the streamed and the
//     chunked forms, the steps, prefill-then-step and the view agree, a session pool (beside a
//     second session it drops) gives the batch's outputs bit for bit, and a saved state continues
//     bit for bit; its backward (grad_out v reversed) never throws either, its gradients are
//     finite where the outputs must be, and the 1 x 1 x N view backward and the workspace form
//     (one DeltaBackwardWorkspace per scalar type, shared by every input) give the allocating
//     call's gradients bit for bit;
//   * the short convolution (on v, C = Dv) with bounded input never throws and is finite;
//     prefill then steps give forward() bit for bit, windows included; its backward is finite,
//     from zeros the same as from zero windows;
//   * the Gated DeltaNet mixer (Qwen3.5's or Kimi's, its projections made of q, k and v) with
//     bounded input never throws and is finite; prefill then steps stay within the
//     recurrence's bound of the forward, and a copy of its states steps to the same bits;
//   * the Mamba-2 mixer (in_proj's outputs made of q, k and v) likewise;
//   * softmax baselines on such inputs: finite, inside the range of v, and the tiled, the
//     materialised, the sliding-window and both caches agree; truncate() rolls back exactly;
//   * the causal backward (plain with Options::decay, or gated with scalar or per-feature
//     gates, as a_t or log_gates; on the map's features with Identity or through the map where
//     it has a backward: one of these per input, by bits of the header's hash), with grad_out
//     drawn after v and Options::scale from the scale byte:
//       - finite |x| <= 10 inputs and valid options never throw (the map's features finite);
//       - with a positive map and normalize off or eps >= 1e-12 (below it 1 / d can reach
//         1e300) every gradient is finite (d loss / d a_t = (d loss / d g_t) / a_t of gates
//         a_t in float only while every a_t >= 1e-6);
//       - for N <= 24 the gradients match a naive reverse-mode reference in double over the
//         explicit recurrence, within kRelTol of the largest term each gradient sums (times
//         the denominators' conditioning), unless a denominator is ill-conditioned (far below
//         its terms, or too near eps for the guard's choice to be sure);
//       - one BackwardWorkspace per scalar type, shared by every input, gives the allocating
//         call's gradients bit for bit (or the same Error); a gated call with decay != 1 throws.
//
// A violation prints what failed and the decoded input, then aborts (libFuzzer saves the input).
//
// The checks live in three units compiled side by side: this one decodes and dispatches,
// fuzz_kernels_engine.cpp checks the linear engine and fuzz_kernels_delta.cpp the softmax
// baselines, the delta rule and the short convolution.

#include "kernel_checks.hpp"

namespace linattn_fuzz {
namespace {

Input decode(const std::uint8_t* data, std::size_t size) {
  std::uint8_t h[lf::kHeaderBytes] = {};
  std::memcpy(h, data, std::min(size, lf::kHeaderBytes));
  Input in;
  in.is_double = (h[0] & lf::kFlagDouble) != 0;
  in.map = static_cast<lf::MapKind>((h[0] & lf::kMapMask) >> lf::kMapShift);
  in.options.normalize = (h[0] & lf::kFlagNoNormalize) == 0;
  in.options.check_finite = (h[0] & lf::kFlagNoCheckFinite) == 0;
  in.specials = (h[0] & lf::kFlagSpecials) != 0;
  in.softmax_causal = (h[0] & lf::kFlagNonCausalSoftmax) == 0;
  in.n = 1 + h[1] % 64;
  in.dk = 1 + (h[2] & 0xF);
  in.dv = 1 + (h[2] >> 4);
  in.m = 1 + (h[3] & 0xF);
  in.seed = h[3] >> 4;
  const std::size_t eps = h[4] % lf::size_of(lf::kEps);
  const std::size_t decay = h[5] % lf::size_of(lf::kDecay);
  const std::size_t chunk = h[6] % lf::size_of(lf::kChunk);
  in.options.eps = lf::kEps[eps];
  in.options.decay = lf::kDecay[decay];
  in.options.chunk = static_cast<Index>(lf::kChunk[chunk]);
  in.options_valid = eps < lf::kValidEps && decay < lf::kValidDecay && chunk < lf::kValidChunk;
  const std::size_t scale = (h[7] & 0xF) % lf::size_of(lf::kScale);
  const std::size_t window = (h[7] >> 4) % lf::size_of(lf::kWindow);
  in.scale = lf::kScale[scale];
  in.scale_valid = scale < lf::kValidScale;
  in.window = static_cast<Index>(lf::kWindow[window]);
  in.window_valid = window < lf::kValidWindow;
  in.split = h[8] % (in.n + 1);
  const std::size_t magnitude = (h[9] & 0xF) % lf::size_of(lf::kMagnitude);
  in.magnitude = lf::kMagnitude[magnitude];
  in.bounded_magnitude = magnitude < lf::kBoundedMagnitudes;
  const std::size_t temperature = (h[9] >> 4) % lf::size_of(lf::kTemperature);
  in.temperature = lf::kTemperature[temperature];
  in.temperature_valid = temperature < lf::kValidTemperature;
  if (size > lf::kHeaderBytes) {
    in.values = data + lf::kHeaderBytes;
    in.value_bytes = size - lf::kHeaderBytes;
  }
  std::uint64_t hash = 1469598103934665603ull ^ size;  // FNV-1a over the header
  for (std::uint8_t b : h) hash = (hash ^ b) * 1099511628211ull;
  in.stream_seed = hash | 1;
  return in;
}

template <class T>
void run(const Input& in) {
  ValueStream stream(in);
  const Matrix<T> q = fill<T>(in.n, in.dk, stream, in);
  const Matrix<T> k = fill<T>(in.n, in.dk, stream, in);
  const Matrix<T> v = fill<T>(in.n, in.dv, stream, in);
  const Matrix<T> grad_out = fill<T>(in.n, in.dv, stream, in);  // the backward's, after v
  const bool finite = q.allFinite() && k.allFinite() && v.allFinite();
  const bool bounded = finite && in.bounded_magnitude;
  const bool backward_bounded = bounded && grad_out.allFinite();
  // The forward kernels with one map, then the backward with it.
  const auto linear = [&](const auto& map, bool positive) {
    run_engine<T>(in, q, k, v, grad_out, map, positive, bounded, backward_bounded);
  };

  linattn::RandomFeatureOptions rf;
  rf.temperature = in.temperature;
  const bool rf_ok = in.temperature_valid;
  using lf::MapKind;
  switch (in.map) {
    case MapKind::elu_plus_one:
      linear(linattn::EluPlusOne{}, true);
      break;
    case MapKind::relu:
      linear(linattn::Relu{}, true);
      break;
    case MapKind::favor:
    case MapKind::favor_hyperbolic:
    case MapKind::favor_iid_fixed: {
      if (in.map == MapKind::favor_hyperbolic) rf.hyperbolic = true;
      if (in.map == MapKind::favor_iid_fixed) {
        rf.projection = linattn::Projection::iid;
        rf.row_norm = linattn::RowNorm::fixed;
      }
      std::optional<linattn::PositiveRandomFeatures> map;
      if (attempt("PositiveRandomFeatures", rf_ok,
                  [&] { map.emplace(in.dk, in.m, in.seed, rf); })) {
        linear(*map, true);
      }
      break;
    }
    case MapKind::fourier:
    case MapKind::fourier_iid: {
      if (in.map == MapKind::fourier_iid) rf.projection = linattn::Projection::iid;
      std::optional<linattn::RandomFourierFeatures> map;
      if (attempt("RandomFourierFeatures", rf_ok, [&] { map.emplace(in.dk, in.m, in.seed, rf); })) {
        linear(*map, false);
      }
      break;
    }
    case MapKind::raw:
      // q and k are the features themselves (signed): for the forward only "no crash, only
      // Error"; the backward (on q and k with Identity) also matches its reference.
      linear(PassThrough{}, false);
      break;
  }
  run_softmax<T>(in, q, k, v, bounded);
  run_delta<T>(in, q, k, v, bounded);
  run_dplr<T>(in, q, k, v, bounded);
  run_conv<T>(in, q, k, v, bounded);
  run_gated_delta_net<T>(in, q, k, v, bounded);
  run_mamba2<T>(in, q, k, v, bounded);
  run_rwkv7_time_mix<T>(in, q, k, bounded);
}

}  // namespace
}  // namespace linattn_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace linattn_fuzz;
  const Input in = decode(data, size);
  g_input = &in;
  if (in.is_double) {
    run<double>(in);
  } else {
    run<float>(in);
  }
  g_input = nullptr;
  return 0;
}
