// SPDX-License-Identifier: MIT
// Qwen3.5's Gated DeltaNet mixer as one object: from the outputs of the model's input
// projections to the input of its output projection, in the parallel form (training, prompts)
// and the per-token step, with its state (convolution windows and recurrent states).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/delta_rule.hpp>
#include <linattn/detail/mixer.hpp>
#include <linattn/detail/session_parts.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/gates.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/layer.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/output_norm.hpp>
#include <linattn/short_conv.hpp>
#include <linattn/state_batch.hpp>
#include <string>
#include <type_traits>
#include <vector>

namespace linattn {

/// Which model's layer a GatedDeltaNet computes: the two differ in their gates and their
/// output norm's activation, and each one's weights fit only its own formulas.
enum class GatedDeltaNetModel {
  /// Qwen3.5's Gated DeltaNet (HF Qwen3_5GatedDeltaNet): a log gate per value head,
  /// g = -exp(A_log_h) softplus(a + dt_bias_h), a = in_proj_a [B, N, Hv]; y = w rmsnorm(o) silu(z).
  qwen3_5,
  /// Kimi Linear's KDA (FLA's KimiDeltaAttention): a log gate per key channel,
  /// g = -exp(A_log_h) softplus(f + dt_bias_{h,d}), f = f_b_proj(f_a_proj(x)) [B, N, H, Dk];
  /// y = w rmsnorm(o) sigmoid(g_out) (FusedRMSNormGated with activation "sigmoid").
  kimi_linear,
};

/// The sizes of a Gated DeltaNet mixer, as Qwen3.5's and Kimi Linear's configs name them.
struct GatedDeltaNetShape {
  /// The layer's formulas (Qwen3.5 or Kimi Linear).
  GatedDeltaNetModel model = GatedDeltaNetModel::qwen3_5;
  Eigen::Index key_heads = 16;    ///< Hk, linear_num_key_heads
  Eigen::Index value_heads = 32;  ///< Hv, linear_num_value_heads (a multiple of Hk)
  Eigen::Index key_dim = 128;     ///< Dk, linear_key_head_dim
  Eigen::Index value_dim = 128;   ///< Dv, linear_value_head_dim
  Eigen::Index conv_kernel = 4;   ///< K, linear_conv_kernel_dim
  /// Hk * Dk, the q (and k) channels.
  Eigen::Index key_channels() const { return key_heads * key_dim; }
  /// Hv * Dv, the v (and z, and output) channels.
  Eigen::Index value_channels() const { return value_heads * value_dim; }
  /// C = 2 Hk Dk + Hv Dv, the channels of in_proj_qkv and of the convolution.
  Eigen::Index conv_channels() const { return 2 * key_channels() + value_channels(); }
  /// Log gates per value head and token: 1 (Qwen3.5) or Dk (Kimi Linear).
  Eigen::Index gate_dim() const { return model == GatedDeltaNetModel::kimi_linear ? key_dim : 1; }
};

/// The mixer's own parameters, as the checkpoint stores them (linear_attn.*).
template <class T>
struct GatedDeltaNetWeights {
  Matrix<T> conv_weight;  ///< C x K: conv1d.weight [C, 1, K] without its middle axis
  Vector<T> a_log;        ///< Hv: A_log (the decay rate's log, one per value head)
  Vector<T> dt_bias;      ///< Hv * gate_dim(): dt_bias (Qwen3.5: Hv; Kimi Linear: Hv * Dk)
  Vector<T> norm_weight;  ///< Dv: norm.weight / o_norm.weight (w, not 1 + w)
};

/// Settings of a GatedDeltaNet.
struct GatedDeltaNetOptions {
  /// The gated norm's eps (rms_norm_eps; 1e-6 in the released models).
  double norm_eps = 1e-6;
  /// The recurrence's form over many tokens (DeltaForm::automatic: the faster).
  DeltaForm form = DeltaForm::automatic;
  /// Tokens per chunk of the chunked form.
  Eigen::Index chunk = 64;
  /// Scan every input for NaN and Inf and throw on them, before anything moves.
  bool check_finite = true;
  /// Threads for one call when linattn is built with OpenMP: 0 takes OpenMP's default.
  int threads = 0;
};

/// The mixer's inputs: views of the outputs of the model's input projections for B sequences
/// of N tokens, any strides (features adjacent), e.g. columns of one fused GEMM's [B, N, W]
/// rows. The step takes the same with N = 1.
template <class T>
struct GatedDeltaNetInputs {
  /// B x 1 x N x C: q, then k, then v channels side by side (Qwen3.5's in_proj_qkv; Kimi's
  /// q_proj, k_proj and v_proj written into column blocks of one buffer)
  ConstHeadsView<T> qkv;
  ConstHeadsView<T> z;  ///< B x Hv x N x Dv: the output gate (in_proj_z; Kimi's g_proj)
  ConstHeadsView<T> b;  ///< B x Hv x N x 1: beta = sigmoid(b) (in_proj_b; Kimi's b_proj)
  /// B x Hv x N x gate_dim(): the log gates' input (Qwen3.5's in_proj_a; Kimi's f_proj)
  ConstHeadsView<T> a;
};

/// What a GatedDeltaNet carries from one call to the next for B sequences: the convolution's
/// windows (its last K - 1 inputs) and the recurrence's Hv states per sequence. A session's
/// whole state: a continuation from them equals the run over the whole sequence.
template <class T>
struct GatedDeltaNetStates {
  ConvWindows<T> conv;               ///< one window per sequence
  DeltaRuleStateBatch<T> recurrent;  ///< state b * Hv + h: value head h of sequence b
  detail::StepScratch<T> scratch;    ///< the step's buffers (not copied with the states)
  /// B, sequences.
  Eigen::Index batch() const { return conv.batch(); }
};

/// Qwen3.5's Gated DeltaNet mixer (HF's Qwen3_5GatedDeltaNet between its projections), or
/// Kimi Linear's KDA (GatedDeltaNetModel::kimi_linear: gates per key channel, sigmoid in the
/// norm): from the projections' outputs qkv, z, b and a,
///   x = silu(conv1d(qkv)) (causal, depthwise, K taps), split into q, k (Hk heads of Dk) and
///       v (Hv heads of Dv);
///   q, k = l2norm(q), l2norm(k) (x / sqrt(|x|^2 + 1e-6)), q scaled by Dk^-1/2;
///   beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) (a log gate per value head, or
///   per value head and key channel for Kimi);
///   o = the gated delta rule, value head h reading q/k head h / (Hv / Hk) (repeat_interleave);
///   y = w rmsnorm(o) silu(z) per head (OutputNorm::qwen3_next; sigmoid(z) for Kimi),
/// y being the output projection's input [B, N, Hv * Dv]. The projections stay the caller's
/// GEMMs. Qwen3-Next's fused in_proj_qkvz interleaves q, k, v and z per key head: gather its
/// q, k and v into one [B, N, C] buffer first (HF's fix_query_key_value_ordering).
/// beta below the smallest normal T counts as it (the delta rule needs beta > 0).
/// @tparam T  float or double: the inputs', states' and outputs' type
template <class T>
class GatedDeltaNet {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "GatedDeltaNet<T> needs T = float or double");

 public:
  /// The state make_states returns.
  using States = GatedDeltaNetStates<T>;

  /// @param shape    Hk, Hv, Dk, Dv, K
  /// @param weights  conv_weight C x K, a_log Hv, dt_bias Hv * gate_dim(), norm_weight Dv
  /// @param options  norm_eps, form, chunk, check_finite, threads
  GatedDeltaNet(const GatedDeltaNetShape& shape, const GatedDeltaNetWeights<T>& weights,
                const GatedDeltaNetOptions& options = {})
      : shape_(checked_shape(shape)),
        options_(checked_options(options)),
        conv_(checked_conv_weight(shape, weights.conv_weight), conv_options(options)),
        delta_(LayerHeads::grouped_query_key(shape.value_heads, shape.key_heads), shape.key_dim,
               shape.value_dim, delta_options(options)),
        norm_(norm_options(weights.norm_weight, shape, options)) {
    constexpr const char* where = "GatedDeltaNet";
    detail::require_finite_vector(weights.a_log, shape.value_heads, where, "a_log");
    detail::require_finite_vector(weights.dt_bias, shape.value_heads * shape.gate_dim(), where,
                                  "dt_bias");
    // exp(A_log) must stay finite: an infinite rate times a zero softplus would be NaN.
    if ((weights.a_log.array() > std::log(std::numeric_limits<T>::max())).any()) {
      throw Error(std::string(where) + ": a_log has an entry whose exp overflows " +
                  (std::is_same_v<T, float> ? "float" : "double"));
    }
    decay_rates_ = weights.a_log.array().exp();
    dt_bias_ = weights.dt_bias;
  }

  /// The sizes.
  const GatedDeltaNetShape& shape() const { return shape_; }
  /// The settings.
  const GatedDeltaNetOptions& options() const { return options_; }
  /// The convolution (its weight, windows' rows).
  const ShortConv<T>& conv() const { return conv_; }
  /// The gated output norm.
  const OutputNorm<T>& norm() const { return norm_; }

  /// Zero states for `batch` sequences.
  /// @param batch  B >= 1
  States make_states(Eigen::Index batch) const {
    return States{conv_.make_windows(batch), delta_.make_states(batch), {}};
  }

  /// Whole sequences, each from zero states (training, or prompts whose state is not kept).
  /// @param in   the projections' views, B sequences of N tokens
  /// @param out  B x Hv x N x Dv result (the output projection's input; e.g.
  ///             HeadsView<T>::bnhd(y, BnhdShape{B, N, Hv, Dv})), clear of the inputs
  void forward_into(const GatedDeltaNetInputs<T>& in, const HeadsView<T>& out) const {
    constexpr const char* where = "GatedDeltaNet::forward";
    check(in, out, nullptr, where);
    const Gates gates = gate_values(in, where);
    States states = make_states(in.qkv.batch());
    run(states, in, gates, out, {}, nullptr);
  }

  /// Prompts, one per sequence, each continuing from its states, which then hold where the
  /// prompt leaves them. Checked whole before anything moves.
  /// @param states  from make_states(B)
  /// @param in      the projections' views, B sequences of N tokens
  /// @param out     B x Hv x N x Dv result, clear of the inputs
  void prefill_into(States& states, const GatedDeltaNetInputs<T>& in,
                    const HeadsView<T>& out) const {
    constexpr const char* where = "GatedDeltaNet::prefill";
    check(in, out, &states, where);
    const Gates gates = gate_values(in, where);
    run(states, in, gates, out, {}, nullptr);
  }

  /// A prefill that also writes the states after each of `positions` tokens into
  /// snapshots[i] (prefix caching: a later prompt sharing the first positions[i] tokens
  /// continues from snapshots[i]). The prefill splits its blocks there, so this costs the
  /// copies and little else.
  /// @param states     from make_states(B)
  /// @param in         the projections' views, B sequences of N tokens
  /// @param out        B x Hv x N x Dv result, clear of the inputs
  /// @param positions  token counts rising strictly within [1, N]
  /// @param snapshots  result: one States per position (filled in place when it already holds
  ///                   as many, e.g. from an earlier call)
  void prefill_into(States& states, const GatedDeltaNetInputs<T>& in, const HeadsView<T>& out,
                    const std::vector<Eigen::Index>& positions,
                    std::vector<States>& snapshots) const {
    constexpr const char* where = "GatedDeltaNet::prefill";
    check(in, out, &states, where);
    detail::require_checkpoints(positions, in.qkv.tokens(), where);
    const Gates gates = gate_values(in, where);
    run(states, in, gates, out, positions, &snapshots);
  }

  /// One token of every sequence (decoding): the views with N = 1, read where they lie.
  /// Checked whole before anything moves.
  /// @param states  from make_states(B)
  /// @param in      the projections' views, B sequences of 1 token
  /// @param out     B x Hv x 1 x Dv result, clear of the inputs
  void step_into(States& states, const GatedDeltaNetInputs<T>& in, const HeadsView<T>& out) const {
    constexpr const char* where = "GatedDeltaNet::step";
    check(in, out, &states, where);
    if (in.qkv.tokens() != 1) {
      throw Error(std::string(where) + ": the views hold N = " + std::to_string(in.qkv.tokens()) +
                  " tokens; a step takes one (prefill_into "
                  "takes more)");
    }
    const Eigen::Index batch = in.qkv.batch();
    const Eigen::Index hk = shape_.key_heads, hv = shape_.value_heads;
    const Eigen::Index dk = shape_.key_dim, dv = shape_.value_dim;
    const Eigen::Index channels = shape_.conv_channels();
    // [B, Hv] and [B, Hv * gate_dim] (N = 1): row b * Hv + h once reshaped, as the states.
    const Gates gates = gate_values(in, where);
    Matrix<T>& mixed = states.scratch.take(0, batch, channels);
    detail::with_step_rows(in.qkv,
                           [&](const auto& rows) { conv_.step_into(states.conv, rows, mixed); });
    // Row b * H + h of each: head h of sequence b, as the state batch's step reads them. One
    // sequence's row already is q's, k's and v's rows end to end; more are gathered.
    using HeadRows = Eigen::Map<const Matrix<T>>;
    const T* source = mixed.data();
    if (batch > 1) {
      Matrix<T>& gathered = states.scratch.take(1, batch, channels);
      for (Eigen::Index b = 0; b < batch; ++b) {
        const T* row = mixed.row(b).data();
        std::copy(row, row + hk * dk, gathered.data() + b * hk * dk);
        std::copy(row + hk * dk, row + 2 * hk * dk, gathered.data() + (batch + b) * hk * dk);
        std::copy(row + 2 * hk * dk, row + channels,
                  gathered.data() + 2 * batch * hk * dk + b * hv * dv);
      }
      source = gathered.data();
    }
    const HeadRows q(source, batch * hk, dk);
    const HeadRows k(source + batch * hk * dk, batch * hk, dk);
    const HeadRows v(source + 2 * batch * hk * dk, batch * hv, dv);
    Matrix<T>& o = states.scratch.take(2, batch * hv, dv);
    // The gates as B * Hv rows, one per state.
    const Eigen::Map<const Matrix<T>> log_gate(gates.log_gate.data(), batch * hv,
                                               shape_.gate_dim());
    const Eigen::Map<const Matrix<T>> beta(gates.beta.data(), batch * hv, 1);
    delta_.step_into(states.recurrent, q, k, v, log_gates(log_gate), beta, o);
    norm_.apply_into(ConstHeadsView<T>::bnhd(o.data(), BnhdShape(batch, 1, hv, dv)), in.z, out);
  }

 private:
  static GatedDeltaNetShape checked_shape(const GatedDeltaNetShape& shape) {
    constexpr const char* where = "GatedDeltaNet";
    if (shape.model != GatedDeltaNetModel::qwen3_5 &&
        shape.model != GatedDeltaNetModel::kimi_linear) {
      throw Error(std::string(where) + ": GatedDeltaNetShape::model is not a GatedDeltaNetModel");
    }
    if (shape.key_heads < 1 || shape.value_heads < 1 || shape.key_dim < 1 || shape.value_dim < 1 ||
        shape.value_heads % shape.key_heads != 0) {
      throw Error(std::string(where) + ": the shape needs Hk, Hv, Dk, Dv >= 1 and Hv a " +
                  "multiple of Hk, got Hk = " + std::to_string(shape.key_heads) + ", Hv = " +
                  std::to_string(shape.value_heads) + ", Dk = " + std::to_string(shape.key_dim) +
                  ", Dv = " + std::to_string(shape.value_dim));
    }
    return shape;
  }

  static const GatedDeltaNetOptions& checked_options(const GatedDeltaNetOptions& options) {
    detail::require_mixer_options(options, "GatedDeltaNet", "GatedDeltaNetOptions",
                                  "the config's rms_norm_eps");
    return options;
  }

  static const Matrix<T>& checked_conv_weight(const GatedDeltaNetShape& shape,
                                              const Matrix<T>& weight) {
    if (weight.rows() != shape.conv_channels() || weight.cols() != shape.conv_kernel) {
      throw Error(
          "GatedDeltaNet: conv_weight is " + detail::shape_string(weight) +
          " but must be C x K = " + detail::shape_string(shape.conv_channels(), shape.conv_kernel) +
          " (C = 2 Hk Dk + Hv Dv: conv1d.weight[:, 0, :])");
    }
    return weight;
  }

  static ShortConvOptions conv_options(const GatedDeltaNetOptions& options) {
    ShortConvOptions conv;
    conv.activation = ConvActivation::silu;
    conv.check_finite = false;  // the mixer scans its inputs itself, before anything moves
    conv.threads = options.threads;
    return conv;
  }

  static DeltaOptions delta_options(const GatedDeltaNetOptions& options) {
    DeltaOptions delta;
    delta.l2_normalize = true;  // use_qk_l2norm_in_kernel
    delta.scale = -1.0;         // Dk^-1/2
    delta.form = options.form;
    delta.chunk = options.chunk;
    delta.check_finite = false;
    delta.threads = options.threads;
    delta.head_grouping = HeadGrouping::interleaved;  // repeat_interleave
    return delta;
  }

  static OutputNorm<T> norm_options(const Vector<T>& weight, const GatedDeltaNetShape& shape,
                                    const GatedDeltaNetOptions& options) {
    if (weight.size() != shape.value_dim) {
      throw Error("GatedDeltaNet: norm_weight has " + std::to_string(weight.size()) +
                  " entries but must have Dv = " + std::to_string(shape.value_dim));
    }
    const OutputNorm<T> preset = shape.model == GatedDeltaNetModel::kimi_linear
                                     ? OutputNorm<T>::kimi(weight, options.norm_eps)
                                     : OutputNorm<T>::qwen3_next(weight, options.norm_eps);
    OutputNormOptions norm = preset.options();
    norm.check_finite = false;
    norm.threads = options.threads;
    return OutputNorm<T>(weight, norm);
  }

  /// Every check of a call, before anything moves: the views' shapes and memory, the states,
  /// and (check_finite) the inputs' values.
  void check(const GatedDeltaNetInputs<T>& in, const HeadsView<T>& out, const States* states,
             const char* where) const {
    const Eigen::Index batch = in.qkv.batch(), tokens = in.qkv.tokens();
    const Eigen::Index hv = shape_.value_heads;
    auto require = [&](const auto& view, Eigen::Index heads, Eigen::Index dim, const char* name,
                       const char* meaning) {
      detail::require_mixer_view(view, batch, heads, tokens, dim, where, name, meaning);
    };
    require(in.qkv, 1, shape_.conv_channels(), "qkv",
            "in_proj_qkv's C = 2 Hk Dk + Hv Dv channels as one head (B and N set by it)");
    require(in.z, hv, shape_.value_dim, "z", "the output gate's Hv heads of Dv");
    require(in.b, hv, 1, "b", "one beta logit per value head");
    require(in.a, hv, shape_.gate_dim(), "a",
            shape_.model == GatedDeltaNetModel::kimi_linear
                ? "f_proj's Dk values per value head (a log gate per key channel)"
                : "in_proj_a's one value per value head");
    require(out, hv, shape_.value_dim, "out", "Hv heads of Dv");
    detail::require_mixer_output(out, where, std::pair("qkv", in.qkv), std::pair("z", in.z),
                                 std::pair("b", in.b), std::pair("a", in.a));
    if (states != nullptr) require_states(*states, batch, where);
    if (options_.check_finite) {
      detail::require_finite_view(in.qkv, where, "qkv");
      detail::require_finite_view(in.z, where, "z");
      detail::require_finite_view(in.b, where, "b");
      detail::require_finite_view(in.a, where, "a");
    }
  }

  /// Throws unless `states` could come from make_states(batch): the windows' shape, and every
  /// recurrent state's shape, options and transition (a Qwen3.5 state does not continue as a
  /// Kimi one), as the recurrence would check them only after the convolution moved.
  void require_states(const States& states, Eigen::Index batch, const char* where) const {
    const DeltaRuleStateBatch<T>& recurrent = states.recurrent;
    const DeltaOptions& own = delta_.options();
    const TransitionKind kind = detail::transition_of_gate_dim(shape_.gate_dim());
    bool fits = detail::windows_fit(states.conv, conv_, batch) &&
                recurrent.size() == batch * shape_.value_heads;
    for (Eigen::Index i = 0; fits && i < recurrent.size(); ++i) {
      const DeltaRuleState<T>& state = recurrent[i];
      fits = state.key_dim() == shape_.key_dim && state.value_dim() == shape_.value_dim &&
             detail::same_delta_results(state.options(), own, shape_.key_dim) &&
             state.options().check_finite == own.check_finite &&
             detail::continues_transition(state.transition(), kind);
    }
    if (!fits) {
      throw Error(std::string(where) +
                  ": the states are not this mixer's for B = " + std::to_string(batch) +
                  " sequences (windows " + std::to_string(states.conv.batch()) + " x " +
                  detail::shape_string(states.conv.rows(), states.conv.channels()) + ", " +
                  std::to_string(recurrent.size()) + " recurrent states): make them with " +
                  "make_states(B) of this mixer");
    }
    detail::require_layer_states(recurrent, delta_.layer_heads(), HeadGrouping::interleaved, where);
  }

  /// beta and the log gates of every token: [B, N, Hv] and [B, N, Hv, gate_dim()] (row
  /// b * N + t).
  struct Gates {
    Matrix<T> beta, log_gate;
  };

  /// beta = max(sigmoid(b), the smallest normal T) and g = -exp(A_log) softplus(a + dt_bias)
  /// (PyTorch's softplus: x itself past 20) for every token, before anything moves; NaN in b
  /// or a (check_finite off) throws here rather than in the recurrence after the convolution
  /// moved.
  Gates gate_values(const GatedDeltaNetInputs<T>& in, const char* where) const {
    const Eigen::Index batch = in.b.batch(), tokens = in.b.tokens(), hv = shape_.value_heads;
    const Eigen::Index gd = shape_.gate_dim();
    const HeadStrides &bs = in.b.strides(), &as = in.a.strides();
    Gates gates{Matrix<T>(batch * tokens, hv), Matrix<T>(batch * tokens, hv * gd)};
    bool finite = true;
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index t = 0; t < tokens; ++t) {
        const T* b_row = in.b.data() + b * bs.batch + t * bs.token;
        const T* a_row = in.a.data() + b * as.batch + t * as.token;
        T* gate_row = gates.log_gate.row(b * tokens + t).data();
        for (Eigen::Index h = 0; h < hv; ++h) {
          const T logit = b_row[h * bs.head];
          const T sigmoid = T(1) / (T(1) + std::exp(-logit));
          gates.beta(b * tokens + t, h) = std::max(sigmoid, std::numeric_limits<T>::min());
          finite = finite && std::isfinite(logit);
          for (Eigen::Index d = 0; d < gd; ++d) {
            const T x = a_row[h * as.head + d] + dt_bias_(h * gd + d);
            gate_row[h * gd + d] = -decay_rates_(h) * detail::softplus(x);
            finite = finite && std::isfinite(x);
          }
        }
      }
    }
    if (!finite) {
      throw Error(std::string(where) + ": b or a holds NaN or Inf (check_finite is off, but " +
                  "the gates cannot be formed from them)");
    }
    return gates;
  }

  /// The checked call: blocks of tokens through the convolution, the gates, the recurrence
  /// and the norm in turn, the states carrying each block into the next.
  void run(States& states, const GatedDeltaNetInputs<T>& in, const Gates& gates,
           const HeadsView<T>& out, const std::vector<Eigen::Index>& positions,
           std::vector<States>* snapshots) const {
    const Eigen::Index batch = in.qkv.batch(), tokens = in.qkv.tokens();
    const Eigen::Index hk = shape_.key_heads, hv = shape_.value_heads;
    const Eigen::Index dk = shape_.key_dim, dv = shape_.value_dim;
    const Eigen::Index channels = shape_.conv_channels();
    const Eigen::Index block = std::min(tokens, detail::kMixerBlockTokens);
    Matrix<T> mixed(batch * block, channels);
    auto run_block = [&](Eigen::Index first, Eigen::Index count) {
      auto rows = [&](const auto& view) { return detail::token_rows(view, first, count); };
      const HeadsView<T> mixed_view =
          HeadsView<T>::bnhd(mixed.data(), BnhdShape(batch, count, 1, channels));
      conv_.prefill_into(states.conv, rows(in.qkv), mixed_view);
      // Tokens [first, first + count) of the [B, N, Hv, 1] and [B, N, Hv, gate_dim] gates.
      const Eigen::Index gd = shape_.gate_dim();
      const ConstHeadsView<T> beta_view(gates.beta.data() + first * hv, batch, hv, count, 1,
                                        HeadStrides{tokens * hv, 1, hv, 1});
      const ConstHeadsView<T> gate_view(gates.log_gate.data() + first * hv * gd, batch, hv, count,
                                        gd, HeadStrides{tokens * hv * gd, gd, hv * gd, 1});
      // q, k and v: Hk, Hk and Hv heads side by side in each row of the convolution's output.
      const HeadStrides split{count * channels, dk, channels, 1};
      const ConstHeadsView<T> q(mixed.data(), batch, hk, count, dk, split);
      const ConstHeadsView<T> k(mixed.data() + hk * dk, batch, hk, count, dk, split);
      const ConstHeadsView<T> v(mixed.data() + 2 * hk * dk, batch, hv, count, dv,
                                HeadStrides{count * channels, dv, channels, 1});
      const HeadsView<T> o = rows(out);
      delta_.prefill_into(states.recurrent, q, k, v, log_gates(gate_view), beta_view, o);
      norm_.apply_into(ConstHeadsView<T>(o), rows(in.z), o);
    };
    detail::for_each_block(tokens, positions, run_block,
                           [&](std::size_t i) { detail::write_snapshot(*snapshots, i, states); });
  }

  GatedDeltaNetShape shape_;
  GatedDeltaNetOptions options_;
  ShortConv<T> conv_;
  DeltaRuleLayer<T> delta_;
  OutputNorm<T> norm_;
  Vector<T> decay_rates_;  ///< exp(A_log), Hv
  Vector<T> dt_bias_;      ///< Hv * gate_dim()
};

}  // namespace linattn

namespace linattn::detail {

/// A SessionPool<> keeps a GatedDeltaNet's session as its window and its states.
template <class T>
struct SessionParts<GatedDeltaNetStates<T>> : MixerParts<GatedDeltaNetStates<T>> {
  static constexpr PartKind kind = PartKind::gated_delta_net;
  static constexpr const char* name = "GatedDeltaNetStates (conv windows + delta-rule states)";
};

}  // namespace linattn::detail
