// SPDX-License-Identifier: MIT
// The norms the models apply to the recurrence's output before their output projection: per
// head or per group, RMS or mean-subtracted, gated by SiLU or sigmoid before or after.
#pragma once

#include <algorithm>
#include <cmath>
#include <linattn/config.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/detail/output_norm.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/detail/view_checks.hpp>
#include <linattn/heads_view.hpp>
#include <string>
#include <type_traits>
#include <vector>

namespace linattn {

/// What an OutputNorm divides by.
enum class NormType {
  /// u / sqrt(mean(u^2) + eps): RMSNorm (Qwen3-Next / 3.5, Kimi, Mamba-2).
  rms,
  /// (u - mean(u)) / sqrt(var(u) + eps), the variance biased (divided by the group size):
  /// LayerNorm over each group, i.e. PyTorch's GroupNorm with a group per head (RWKV-7's ln_x).
  layer,
};

/// Where an OutputNorm's gate z enters and through which function. Models differ in both, and a
/// port that swaps them runs without any error: name the model's own.
enum class NormGate {
  /// y = w norm(o) + b: no gate.
  none,
  /// y = w norm(o) silu(z): Qwen3-Next / 3.5's Gated DeltaNet (HF Qwen3NextRMSNormGated, FLA's
  /// FusedRMSNormGated with activation "swish").
  silu_after_norm,
  /// y = w norm(o) sigmoid(z): Kimi Linear's KDA (FLA's FusedRMSNormGated with activation
  /// "sigmoid").
  sigmoid_after_norm,
  /// y = w norm(o silu(z)): Mamba-2 (state-spaces/mamba's RMSNormGated with
  /// norm_before_gate=False, HF's MambaRMSNormGated).
  silu_before_norm,
};

/// Settings of an OutputNorm.
struct OutputNormOptions {
  /// RMS or mean-subtracted.
  NormType type = NormType::rms;
  /// Where the gate enters.
  NormGate gate = NormGate::none;
  /// Channels normalised together, counted along the flat row of H * D channels (c = h * D +
  /// d): 0 for each head's D (Qwen, Kimi, RWKV-7); d_inner / n_groups for Mamba-2's grouped
  /// norm (state-spaces/mamba, HF Nemotron-H; a group may span heads); H * D for one norm over
  /// all heads (HF's Mamba2). A divisor of H * D.
  Eigen::Index group_size = 0;
  /// Added under the root; > 0. Each model's config names its own (rms_norm_eps,
  /// layer_norm_epsilon; RWKV-7: 1e-5 * head_size_divisor^2 = head_dim * 1e-5 in FLA).
  double eps = 1e-6;
  /// The weight multiplies as 1 + w (a zero-centred norm: Qwen3-Next / 3.5's plain RMSNorm,
  /// Gemma), not w. Qwen's gated output norm is *not* one: it multiplies by w.
  bool weight_plus_one = false;
  /// Scan o and z for NaN and Inf and throw on them, before anything is written.
  bool check_finite = true;
  /// Threads for one call when linattn is built with OpenMP: 0 takes OpenMP's default, n > 0
  /// at most n. Results do not depend on it.
  int threads = 0;
};

/// The norm between a recurrence's output o and the model's output projection, over views of
/// B sequences, H heads, N tokens and D features (any strides, features adjacent): for every
/// token and group of channels,
///   y = w * norm(o) (+ b)   or gated as OutputNormOptions::gate says.
/// The arithmetic is in T: float norms take float, Eigen::half and Eigen::bfloat16 views (each
/// view its own type: o from the recurrence in float, z from a 16-bit projection, y for a
/// 16-bit output projection) and round once, on writing y; double norms take double views.
/// (HF rounds the normalised value to a 16-bit input's type before the weight multiplies it, and
/// computes in float32 even for float64: 16-bit outputs may differ from its by an ulp, double
/// ones are more accurate.)
/// @tparam T  float or double: the weights' type and the arithmetic's
template <class T>
class OutputNorm {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "OutputNorm<T> needs T = float or double (16-bit views go through "
                "OutputNorm<float>)");

 public:
  /// Without bias.
  /// @param weight   D entries shared by the heads (Qwen, Kimi), or H * D, one per channel
  ///                 (Mamba-2's d_inner, RWKV-7's C)
  /// @param options  type, gate, group_size, eps, weight_plus_one, check_finite, threads
  template <class DW>
  explicit OutputNorm(const Eigen::MatrixBase<DW>& weight, const OutputNormOptions& options = {})
      : OutputNorm(weight, Vector<T>(), options) {}

  /// With bias (RWKV-7's GroupNorm).
  /// @param weight   D or H * D entries, as above
  /// @param bias     as many entries as weight, or empty for none
  /// @param options  type, gate, group_size, eps, weight_plus_one, check_finite, threads
  template <class DW, class DB>
  OutputNorm(const Eigen::MatrixBase<DW>& weight, const Eigen::MatrixBase<DB>& bias,
             const OutputNormOptions& options = {})
      : options_(options) {
    static_assert(std::is_same_v<typename DW::Scalar, T> && std::is_same_v<typename DB::Scalar, T>,
                  "OutputNorm<T>: weight and bias must have scalar type T");
    constexpr const char* where = "OutputNorm";
    if (weight.size() < 1 || (weight.rows() != 1 && weight.cols() != 1)) {
      throw Error(std::string(where) + ": weight is " + detail::shape_string(weight) +
                  " but must be a vector of D (shared by the heads) or H * D entries");
    }
    if (bias.size() != 0 && bias.size() != weight.size()) {
      throw Error(std::string(where) + ": bias has " + std::to_string(bias.size()) +
                  " entries but weight " + std::to_string(weight.size()) +
                  "; give as many, or none");
    }
    if (!(static_cast<T>(options.eps) > T(0)) || !std::isfinite(static_cast<T>(options.eps))) {
      throw Error(std::string(where) + ": OutputNormOptions::eps must be finite and > 0 in T, " +
                  "got " + std::to_string(options.eps));
    }
    if (options.threads < 0) {
      throw Error(std::string(where) + ": OutputNormOptions::threads must be >= 0 (0 = OpenMP's " +
                  "default), got " + std::to_string(options.threads));
    }
    if (options.group_size < 0) {
      throw Error(std::string(where) + ": OutputNormOptions::group_size must be >= 0 (0: each " +
                  "head), got " + std::to_string(options.group_size));
    }
    if (options.type != NormType::rms && options.type != NormType::layer) {
      throw Error(std::string(where) + ": OutputNormOptions::type is not a NormType");
    }
    if (options.gate != NormGate::none && options.gate != NormGate::silu_after_norm &&
        options.gate != NormGate::sigmoid_after_norm &&
        options.gate != NormGate::silu_before_norm) {
      throw Error(std::string(where) + ": OutputNormOptions::gate is not a NormGate");
    }
    detail::require_finite(weight.reshaped().transpose(), where, "weight");
    if (bias.size() != 0) detail::require_finite(bias.reshaped().transpose(), where, "bias");
    weight_ = weight.reshaped();
    if (options.weight_plus_one) weight_.array() += T(1);
    bias_ = bias.reshaped();
  }

  /// Qwen3-Next / 3.5's Gated DeltaNet output norm: w * rmsnorm(o) * silu(z) per head (HF
  /// Qwen3NextRMSNormGated: w, not the 1 + w of Qwen's plain RMSNorm).
  /// @param weight  Dv entries (the checkpoint's linear_attn.norm.weight)
  /// @param eps     the config's rms_norm_eps (1e-6 in the released models)
  template <class DW>
  static OutputNorm qwen3_next(const Eigen::MatrixBase<DW>& weight, double eps) {
    return OutputNorm(weight, preset(NormType::rms, NormGate::silu_after_norm, 0, eps));
  }

  /// Kimi Linear's KDA output norm: w * rmsnorm(o) * sigmoid(g) per head (FLA's
  /// FusedRMSNormGated, activation "sigmoid"; g the output gate projection's heads).
  /// @param weight  D entries (the checkpoint's o_norm.weight)
  /// @param eps     the config's rms_norm_eps
  template <class DW>
  static OutputNorm kimi(const Eigen::MatrixBase<DW>& weight, double eps) {
    return OutputNorm(weight, preset(NormType::rms, NormGate::sigmoid_after_norm, 0, eps));
  }

  /// Mamba-2's output norm: w * rmsnorm(y * silu(z)) over groups of d_inner / n_groups
  /// channels (the gate before the norm; state-spaces/mamba's RMSNormGated with
  /// norm_before_gate=False and HF Nemotron-H; HF's Mamba2 normalises over all d_inner at once:
  /// group_size = d_inner).
  /// @param weight      d_inner = H * P entries (the checkpoint's mixer.norm.weight)
  /// @param group_size  d_inner / n_groups
  /// @param eps         the config's layer_norm_epsilon (1e-5 in the released models)
  template <class DW>
  static OutputNorm mamba2(const Eigen::MatrixBase<DW>& weight, Eigen::Index group_size,
                           double eps) {
    return OutputNorm(weight, preset(NormType::rms, NormGate::silu_before_norm, group_size, eps));
  }

  /// RWKV-7's ln_x: GroupNorm with a group per head, w * (o - mean) / sqrt(var + eps) + b,
  /// ungated (the gate multiplies after the bonus term is added, outside the norm).
  /// @param weight  C = H * D entries (ln_x.weight)
  /// @param bias    C entries (ln_x.bias)
  /// @param eps     1e-5 * head_size_divisor^2 in RWKV-LM (64e-5 for heads of 64), head_dim *
  ///                1e-5 in FLA
  template <class DW, class DB>
  static OutputNorm rwkv7(const Eigen::MatrixBase<DW>& weight, const Eigen::MatrixBase<DB>& bias,
                          double eps) {
    return OutputNorm(weight, bias, preset(NormType::layer, NormGate::none, 0, eps));
  }

  /// The weight as the norm multiplies by it (1 + w with weight_plus_one).
  const Vector<T>& weight() const { return weight_; }
  /// The bias, empty without.
  const Vector<T>& bias() const { return bias_; }
  /// The settings.
  const OutputNormOptions& options() const { return options_; }

  /// The gated norm of o by z into y. Checked whole before anything is written.
  /// @param o  B x H x N x D: the recurrence's output
  /// @param z  B x H x N x D: the gate (the model's gate projection, as a view of it)
  /// @param y  B x H x N x D result: o's or z's memory with its layout (in place), or memory of
  ///           its own
  template <class O, class Z, class Y>
  void apply_into(const HeadsView<O>& o, const HeadsView<Z>& z, const HeadsView<Y>& y) const {
    constexpr const char* where = "OutputNorm::apply";
    if (options_.gate == NormGate::none) {
      throw Error(std::string(where) + ": this norm has no gate (NormGate::none) but a z was " +
                  "given: call apply_into(o, y), or set OutputNormOptions::gate");
    }
    run(o, &z, y, where);
  }

  /// The ungated norm of o into y.
  /// @param o  B x H x N x D: the recurrence's output
  /// @param y  B x H x N x D result: o's memory with its layout (in place), or memory of its own
  template <class O, class Y>
  void apply_into(const HeadsView<O>& o, const HeadsView<Y>& y) const {
    constexpr const char* where = "OutputNorm::apply";
    if (options_.gate != NormGate::none) {
      throw Error(std::string(where) + ": this norm is gated (OutputNormOptions::gate is not " +
                  "NormGate::none): call apply_into(o, z, y) with the gate's view z");
    }
    run(o, static_cast<const HeadsView<const O>*>(nullptr), y, where);
  }

 private:
  /// Token rows per work item of the threaded loop.
  static constexpr Eigen::Index kRowsPerItem = 64;

  static OutputNormOptions preset(NormType type, NormGate gate, Eigen::Index group_size,
                                  double eps) {
    OutputNormOptions options;
    options.type = type;
    options.gate = gate;
    options.group_size = group_size;
    options.eps = eps;
    return options;
  }

  template <class S>
  static constexpr bool is_view_scalar =
      std::is_same_v<T, double> ? std::is_same_v<S, double>
                                : std::is_same_v<S, float> || std::is_same_v<S, Eigen::half> ||
                                      std::is_same_v<S, Eigen::bfloat16>;

  /// Checks, then the norm.
  template <class O, class Z, class Y>
  void run(const HeadsView<O>& o, const HeadsView<Z>* z, const HeadsView<Y>& y,
           const char* where) const {
    using OS = std::remove_const_t<O>;
    using ZS = std::remove_const_t<Z>;
    using YS = std::remove_const_t<Y>;
    static_assert(!std::is_const_v<Y>, "OutputNorm<T>: y must be a writable view");
    static_assert(is_view_scalar<OS> && is_view_scalar<ZS> && is_view_scalar<YS>,
                  "OutputNorm<T>: views of float, Eigen::half or Eigen::bfloat16 for "
                  "OutputNorm<float>, of double for OutputNorm<double>");
    const Eigen::Index heads = o.heads(), dim = o.dim();
    auto same_shape = [&](const auto& view, const char* name) {
      if (view.batch() != o.batch() || view.heads() != heads || view.tokens() != o.tokens() ||
          view.dim() != dim) {
        throw Error(std::string(where) + ": " + name + " is [B, H, N, D] = " + view.sizes_string() +
                    " but o is " + o.sizes_string() + "; they must match");
      }
      if (view.strides().dim != 1) {
        throw Error(std::string(where) + ": " + name + "'s features must be adjacent " +
                    "(strides().dim == 1), got " + std::to_string(view.strides().dim));
      }
    };
    same_shape(o, "o");
    if (z != nullptr) same_shape(*z, "z");
    same_shape(y, "y");
    const Eigen::Index channels = heads * dim;
    if (weight_.size() != dim && weight_.size() != channels) {
      throw Error(std::string(where) + ": the weight has " + std::to_string(weight_.size()) +
                  " entries but the views hold H = " + std::to_string(heads) +
                  " heads of D = " + std::to_string(dim) +
                  ": give D (shared by the heads) or H * D = " + std::to_string(channels));
    }
    const Eigen::Index group = options_.group_size == 0 ? dim : options_.group_size;
    if (group > channels || channels % group != 0) {
      throw Error(std::string(where) +
                  ": OutputNormOptions::group_size = " + std::to_string(group) +
                  " does not divide the H * D = " + std::to_string(channels) +
                  " channels of a token (Mamba-2: d_inner / n_groups)");
    }
    if (!detail::rows_distinct(y)) {
      throw Error(std::string(where) + ": y's rows overlap (strides {batch " +
                  std::to_string(y.strides().batch) + ", head " + std::to_string(y.strides().head) +
                  ", token " + std::to_string(y.strides().token) + "} for " + y.sizes_string() +
                  "): give every (sequence, head, token) its D features of its own");
    }
    auto require_apart = [&](const auto& input, const char* name) {
      using IS = std::remove_const_t<typename std::decay_t<decltype(input)>::Scalar>;
      // The same elements: the same start, and the same stride along every axis longer than 1
      // (a decoding step's [B, H, 1, D] views may differ in the token stride they never use).
      const HeadStrides &is = input.strides(), &ys = y.strides();
      const bool same_layout =
          std::is_same_v<IS, YS> &&
          static_cast<const void*>(input.data()) == static_cast<const void*>(y.data()) &&
          (y.batch() == 1 || is.batch == ys.batch) && (y.heads() == 1 || is.head == ys.head) &&
          (y.tokens() == 1 || is.token == ys.token);
      if (!same_layout && detail::views_meet(input, y)) {
        throw Error(std::string(where) + ": y overlaps " + name + "'s memory without being it " +
                    "(the same data, type and strides): write in place or to memory of its own");
      }
    };
    require_apart(o, "o");
    if (z != nullptr) require_apart(*z, "z");
    const int threads = detail::resolve_threads(options_.threads);
    if (options_.check_finite) {
      detail::require_finite_view(o, where, "o");
      if (z != nullptr) detail::require_finite_view(*z, where, "z");
    }

    std::vector<detail::NormRun> runs;
    std::vector<Eigen::Index> group_runs;
    detail::plan_norm_runs(heads, dim, group, runs, group_runs);
    const detail::NormRowPlan<T> plan{
        runs.data(),
        group_runs.data(),
        channels / group,
        channels,
        group,
        weight_.data(),
        bias_.size() ? bias_.data() : nullptr,
        weight_.size() != dim,
        options_.type == NormType::layer,
        static_cast<detail::NormGateKind>(static_cast<int>(options_.gate)),
        static_cast<T>(options_.eps)};
    const Eigen::Index tokens = o.tokens();
    const Eigen::Index blocks = (tokens + kRowsPerItem - 1) / kRowsPerItem;
    const Eigen::Index items = o.batch() * blocks;
    // One thread below a few thousand rows of work: the norm is a pass over memory.
    const int team =
        static_cast<int>(std::min<Eigen::Index>(threads, o.batch() * tokens / kRowsPerItem / 4));
    const HeadStrides &os = o.strides(), &ys = y.strides();
    detail::parallel_for(items, std::max(team, 1), [&](Eigen::Index item) {
      const Eigen::Index b = item / blocks;
      const Eigen::Index first = (item % blocks) * kRowsPerItem;
      const Eigen::Index last = std::min(tokens, first + kRowsPerItem);
      detail::NormScratch<T> scratch(channels);
      for (Eigen::Index n = first; n < last; ++n) {
        const ZS* z_row = nullptr;
        Eigen::Index z_head = 0;
        if (z != nullptr) {
          const HeadStrides& zs = z->strides();
          z_row = z->data() + b * zs.batch + n * zs.token;
          z_head = zs.head;
        }
        detail::norm_token(plan, o.data() + b * os.batch + n * os.token, os.head, z_row, z_head,
                           y.data() + b * ys.batch + n * ys.token, ys.head, scratch);
      }
    });
  }

  OutputNormOptions options_;
  Vector<T> weight_, bias_;
};

}  // namespace linattn
