// SPDX-License-Identifier: MIT
// LFM2's gated short convolution block as one object: from the output of its in_proj to the
// input of its out_proj, in the parallel form and the per-token step, with its state (the
// convolution's windows).
#pragma once

#include <algorithm>
#include <linattn/config.hpp>
#include <linattn/detail/mixer.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/short_conv.hpp>
#include <string>
#include <type_traits>
#include <vector>

namespace linattn {

/// Settings of a GatedShortConv.
struct GatedShortConvOptions {
  /// Scan the input for NaN and Inf and throw on them, before anything moves.
  bool check_finite = true;
  /// Threads for one call when linattn is built with OpenMP: 0 takes OpenMP's default.
  int threads = 0;
};

/// LFM2's gated short convolution (HF's Lfm2ShortConv between in_proj and out_proj): in_proj's
/// output is [b | c | x], C channels each (BCx.chunk(3) in that order), and
///   y = c * conv1d(b * x),
/// the convolution depthwise and causal (K = L_cache = 3 taps in LFM2, no activation, bias as
/// conv_bias says), its state each sequence's last K - 1 values of b * x (ConvWindows).
/// @tparam T  float or double
template <class T>
class GatedShortConv {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "GatedShortConv<T> needs T = float or double");

 public:
  /// The state make_states returns: the convolution's windows over b * x.
  using States = ConvWindows<T>;

  /// @param conv_weight  C x K: conv.weight [C, 1, K] without its middle axis
  /// @param conv_bias    C entries, or empty for none (LFM2: conv_bias false)
  /// @param options      check_finite, threads
  GatedShortConv(const Matrix<T>& conv_weight, const Vector<T>& conv_bias = Vector<T>(),
                 const GatedShortConvOptions& options = {})
      : options_(options), conv_(conv_weight, conv_bias, conv_options(options)) {}

  /// C, the channels of each of b, c, x and of the output.
  Eigen::Index channels() const { return conv_.channels(); }
  /// The settings.
  const GatedShortConvOptions& options() const { return options_; }
  /// The convolution.
  const ShortConv<T>& conv() const { return conv_; }

  /// Zero windows for `batch` sequences.
  /// @param batch  B >= 1
  States make_states(Eigen::Index batch) const { return conv_.make_windows(batch); }

  /// Whole sequences, each from zeros.
  /// @param bcx  B x 1 x N x 3C: in_proj's output, b, c and x side by side
  /// @param out  B x 1 x N x C result (out_proj's input), clear of bcx
  void forward_into(const ConstHeadsView<T>& bcx, const HeadsView<T>& out) const {
    constexpr const char* where = "GatedShortConv::forward";
    check(bcx, out, nullptr, where);
    States windows = make_states(bcx.batch());
    run(windows, bcx, out, {}, nullptr);
  }

  /// Prompts, each continuing from its window. Checked whole before anything moves.
  /// @param windows  from make_states(B)
  /// @param bcx      B x 1 x N x 3C
  /// @param out      B x 1 x N x C result, clear of bcx
  void prefill_into(States& windows, const ConstHeadsView<T>& bcx, const HeadsView<T>& out) const {
    constexpr const char* where = "GatedShortConv::prefill";
    check(bcx, out, &windows, where);
    run(windows, bcx, out, {}, nullptr);
  }

  /// A prefill that also writes the windows after each of `positions` tokens into
  /// snapshots[i] (prefix caching), as GatedDeltaNet's.
  /// @param windows    from make_states(B)
  /// @param bcx        B x 1 x N x 3C
  /// @param out        B x 1 x N x C result, clear of bcx
  /// @param positions  token counts rising strictly within [1, N]
  /// @param snapshots  result: one States per position (filled in place when it already holds
  ///                   as many)
  void prefill_into(States& windows, const ConstHeadsView<T>& bcx, const HeadsView<T>& out,
                    const std::vector<Eigen::Index>& positions,
                    std::vector<States>& snapshots) const {
    constexpr const char* where = "GatedShortConv::prefill";
    check(bcx, out, &windows, where);
    detail::require_checkpoints(positions, bcx.tokens(), where);
    run(windows, bcx, out, positions, &snapshots);
  }

  /// One token of every sequence: bcx and out with N = 1. Checked whole before anything moves.
  /// @param windows  from make_states(B)
  /// @param bcx      B x 1 x 1 x 3C
  /// @param out      B x 1 x 1 x C result, clear of bcx
  void step_into(States& windows, const ConstHeadsView<T>& bcx, const HeadsView<T>& out) const {
    constexpr const char* where = "GatedShortConv::step";
    check(bcx, out, &windows, where);
    if (bcx.tokens() != 1) {
      throw Error(std::string(where) + ": the views hold N = " + std::to_string(bcx.tokens()) +
                  " tokens; a step takes one (prefill_into takes more)");
    }
    // The convolution's step is its prefill of one token bit for bit: one path for both.
    run(windows, bcx, out, {}, nullptr);
  }

 private:
  static ShortConvOptions conv_options(const GatedShortConvOptions& options) {
    ShortConvOptions conv;
    conv.activation = ConvActivation::none;
    conv.check_finite = false;  // the block scans its input itself, before anything moves
    conv.threads = options.threads;
    return conv;
  }

  void check(const ConstHeadsView<T>& bcx, const HeadsView<T>& out, const States* windows,
             const char* where) const {
    const Eigen::Index batch = bcx.batch(), tokens = bcx.tokens();
    detail::require_mixer_view(bcx, batch, 1, tokens, 3 * channels(), where, "bcx",
                               "in_proj's b, c and x, C channels each, as one head (B and N set "
                               "by it)");
    detail::require_mixer_view(out, batch, 1, tokens, channels(), where, "out",
                               "C channels as one head");
    detail::require_mixer_output(out, where, std::pair("bcx", bcx));
    if (windows != nullptr && !detail::windows_fit(*windows, conv_, batch)) {
      throw Error(std::string(where) + ": the windows are not this block's for B = " +
                  std::to_string(batch) + " sequences: make them with make_states(B)");
    }
    if (options_.check_finite) detail::require_finite_view(bcx, where, "bcx");
  }

  /// Blocks of tokens: b * x into a buffer, its convolution into out, then out *= c.
  void run(States& windows, const ConstHeadsView<T>& bcx, const HeadsView<T>& out,
           const std::vector<Eigen::Index>& positions, std::vector<States>* snapshots) const {
    const Eigen::Index batch = bcx.batch(), tokens = bcx.tokens(), c = channels();
    const Eigen::Index block = std::min(tokens, detail::kMixerBlockTokens);
    Matrix<T> bx(batch * block, c);
    auto run_block = [&](Eigen::Index first, Eigen::Index count) {
      const ConstHeadsView<T> in = detail::token_rows(bcx, first, count);
      const HeadsView<T> y = detail::token_rows(out, first, count);
      for (Eigen::Index b = 0; b < batch; ++b) {
        for (Eigen::Index t = 0; t < count; ++t) {
          const T* row = in.data() + b * in.strides().batch + t * in.strides().token;
          bx.row(b * count + t) = Eigen::Map<const Vector<T>>(row, c).transpose().cwiseProduct(
              Eigen::Map<const Vector<T>>(row + 2 * c, c).transpose());
        }
      }
      conv_.prefill_into(windows, ConstHeadsView<T>::bnhd(bx.data(), BnhdShape(batch, count, 1, c)),
                         y);
      for (Eigen::Index b = 0; b < batch; ++b) {
        for (Eigen::Index t = 0; t < count; ++t) {
          const T* gate = in.data() + b * in.strides().batch + t * in.strides().token + c;
          Eigen::Map<Vector<T>> row(y.data() + b * y.strides().batch + t * y.strides().token, c);
          row = row.cwiseProduct(Eigen::Map<const Vector<T>>(gate, c));
        }
      }
    };
    detail::for_each_block(tokens, positions, run_block,
                           [&](std::size_t i) { detail::write_snapshot(*snapshots, i, windows); });
  }

  GatedShortConvOptions options_;
  ShortConv<T> conv_;
};

}  // namespace linattn
