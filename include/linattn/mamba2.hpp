// SPDX-License-Identifier: MIT
// The Mamba-2 mixer (Nemotron-H, Granite 4, Mamba-2 itself) as one object: from the
// output of the model's in_proj to the input of its out_proj, in the parallel form and the
// per-token step, with its state (the convolution's windows and the SSM states).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/mixer.hpp>
#include <linattn/detail/session_parts.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
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

/// The sizes of a Mamba-2 mixer, as the configs name them.
struct Mamba2Shape {
  Eigen::Index heads = 128;      ///< H, mamba_num_heads (nheads)
  Eigen::Index head_dim = 64;    ///< P, mamba_head_dim (headdim); d_inner = H * P
  Eigen::Index groups = 8;       ///< G, n_groups: B and C have G heads, each shared by H / G
  Eigen::Index state_dim = 128;  ///< N, ssm_state_size (d_state)
  Eigen::Index conv_kernel = 4;  ///< K, conv_kernel (d_conv)
  /// d_inner = H * P, the channels of x, z and the output.
  Eigen::Index inner() const { return heads * head_dim; }
  /// C = d_inner + 2 G N, the channels of xBC and of the convolution.
  Eigen::Index conv_channels() const { return inner() + 2 * groups * state_dim; }
};

/// The mixer's own parameters, as the checkpoint stores them (mixer.*).
template <class T>
struct Mamba2Weights {
  Matrix<T> conv_weight;  ///< C x K: conv1d.weight [C, 1, K] without its middle axis
  Vector<T> conv_bias;    ///< C: conv1d.bias (empty for none: use_conv_bias false)
  Vector<T> a_log;        ///< H: A_log (A = -exp(A_log))
  Vector<T> dt_bias;      ///< H: dt_bias
  Vector<T> d;            ///< H: D, the skip
  Vector<T> norm_weight;  ///< d_inner: norm.weight
};

/// Settings of a Mamba2.
struct Mamba2Options {
  /// The gated norm's eps (layer_norm_epsilon; 1e-5 in the released models).
  double norm_eps = 1e-5;
  /// Channels the gated norm normalises together: 0 for d_inner / G (state-spaces/mamba's
  /// RMSNormGated and HF's Nemotron-H), d_inner for one norm over all of them (HF's Mamba2).
  Eigen::Index norm_group_size = 0;
  /// Tokens per chunk of the chunked form.
  Eigen::Index chunk = 64;
  /// Scan every input for NaN and Inf and throw on them, before anything moves.
  bool check_finite = true;
  /// Threads for one call when linattn is built with OpenMP: 0 takes OpenMP's default.
  int threads = 0;
};

/// The mixer's inputs: views of in_proj's output [B, N, 2 d_inner + 2 G N + H] = [z | xBC |
/// dt] for B sequences of N tokens, any strides (features adjacent). The step takes the same
/// with N = 1.
template <class T>
struct Mamba2Inputs {
  ConstHeadsView<T> z;    ///< B x H x N x P: the gate
  ConstHeadsView<T> xbc;  ///< B x 1 x N x C: x (d_inner), then B (G N), then C (G N)
  ConstHeadsView<T> dt;   ///< B x H x N x 1: dt before dt_bias and softplus
};

/// What a Mamba2 carries from one call to the next for B sequences: the convolution's windows
/// and the B * H SSM states (N x P each).
template <class T>
struct Mamba2States {
  ConvWindows<T> conv;               ///< one window per sequence
  RecurrentStateBatch<T> recurrent;  ///< state b * H + h: head h of sequence b
  detail::StepScratch<T> scratch;    ///< the step's buffers (not copied with the states)
  /// B, sequences.
  Eigen::Index batch() const { return conv.batch(); }
};

/// The Mamba-2 mixer between in_proj and out_proj (state-spaces/mamba's Mamba2, HF's
/// Mamba2Mixer and NemotronHMamba2Mixer): from in_proj's z, xBC and dt,
///   xBC = silu(conv1d(xBC) + conv_bias), split into x (H heads of P), B and C (G heads of N);
///   dt = softplus(dt + dt_bias), A = -exp(A_log);
///   per head h, with group g = h / (H / G) (B and C shared by H / G consecutive heads, as
///   repeat_interleave / einops' "(g h)"):
///     S_t = exp(dt_t A_h) S_{t-1} + B_t (dt_t x_t)^T,  y_t = S_t^T C_t + D_h x_t;
///   out = w rmsnorm(y silu(z)) over groups of d_inner / G channels (the gate before the norm;
///   OutputNorm::mamba2),
/// out being out_proj's input [B, N, d_inner]. The recurrence is the linear/gated engine's:
/// q = C, k = B, v = dt x, log gates dt A, no normaliser. dt_limit is taken as the default
/// (0, inf): no clamp.
/// @tparam T  float or double: the inputs', states' and outputs' type
template <class T>
class Mamba2 {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "Mamba2<T> needs T = float or double");

 public:
  /// The state make_states returns.
  using States = Mamba2States<T>;

  /// @param shape    H, P, G, N, K
  /// @param weights  conv_weight C x K, conv_bias C (or empty), a_log H, dt_bias H, d H,
  ///                 norm_weight d_inner
  /// @param options  norm_eps, norm_group_size, chunk, check_finite, threads
  Mamba2(const Mamba2Shape& shape, const Mamba2Weights<T>& weights,
         const Mamba2Options& options = {})
      : shape_(checked_shape(shape)),
        options_(checked_options(options, shape)),
        conv_(checked_conv_weight(shape, weights.conv_weight), weights.conv_bias,
              conv_options(options)),
        ssm_(Identity{}, LayerHeads::grouped_query_key(shape.heads, shape.groups), shape.state_dim,
             shape.head_dim, engine_options(options)),
        norm_(make_norm(weights.norm_weight, shape, options)) {
    constexpr const char* where = "Mamba2";
    detail::require_finite_vector(weights.a_log, shape.heads, where, "a_log");
    detail::require_finite_vector(weights.dt_bias, shape.heads, where, "dt_bias");
    detail::require_finite_vector(weights.d, shape.heads, where, "d");
    if ((weights.a_log.array() > std::log(std::numeric_limits<T>::max())).any()) {
      throw Error(std::string(where) + ": a_log has an entry whose exp overflows " +
                  (std::is_same_v<T, float> ? "float" : "double"));
    }
    rates_ = -weights.a_log.array().exp();
    dt_bias_ = weights.dt_bias;
    d_ = weights.d;
  }

  /// The sizes.
  const Mamba2Shape& shape() const { return shape_; }
  /// The settings.
  const Mamba2Options& options() const { return options_; }
  /// The convolution.
  const ShortConv<T>& conv() const { return conv_; }
  /// The gated output norm.
  const OutputNorm<T>& norm() const { return norm_; }

  /// Zero states for `batch` sequences.
  /// @param batch  B >= 1
  States make_states(Eigen::Index batch) const {
    return States{conv_.make_windows(batch), ssm_.make_states(batch), {}};
  }

  /// Whole sequences, each from zero states.
  /// @param in   in_proj's views, B sequences of N tokens
  /// @param out  B x H x N x P result (out_proj's input, HeadsView<T>::bnhd(y, BnhdShape{B, N,
  ///             H, P})), clear of the inputs
  void forward_into(const Mamba2Inputs<T>& in, const HeadsView<T>& out) const {
    constexpr const char* where = "Mamba2::forward";
    check(in, out, nullptr, where);
    const Matrix<T> dt = step_sizes(in, where);
    States states = make_states(in.xbc.batch());
    run(states, in, dt, out, {}, nullptr);
  }

  /// Prompts, each continuing from its states. Checked whole before anything moves.
  /// @param states  from make_states(B)
  /// @param in      in_proj's views, B sequences of N tokens
  /// @param out     B x H x N x P result, clear of the inputs
  void prefill_into(States& states, const Mamba2Inputs<T>& in, const HeadsView<T>& out) const {
    constexpr const char* where = "Mamba2::prefill";
    check(in, out, &states, where);
    const Matrix<T> dt = step_sizes(in, where);
    run(states, in, dt, out, {}, nullptr);
  }

  /// A prefill that also writes the states after each of `positions` tokens into
  /// snapshots[i] (prefix caching), as GatedDeltaNet's.
  /// @param states     from make_states(B)
  /// @param in         in_proj's views, B sequences of N tokens
  /// @param out        B x H x N x P result, clear of the inputs
  /// @param positions  token counts rising strictly within [1, N]
  /// @param snapshots  result: one States per position (filled in place when it already holds
  ///                   as many)
  void prefill_into(States& states, const Mamba2Inputs<T>& in, const HeadsView<T>& out,
                    const std::vector<Eigen::Index>& positions,
                    std::vector<States>& snapshots) const {
    constexpr const char* where = "Mamba2::prefill";
    check(in, out, &states, where);
    detail::require_checkpoints(positions, in.xbc.tokens(), where);
    const Matrix<T> dt = step_sizes(in, where);
    run(states, in, dt, out, positions, &snapshots);
  }

  /// One token of every sequence: the views with N = 1. Checked whole before anything moves.
  /// @param states  from make_states(B)
  /// @param in      in_proj's views, B sequences of 1 token
  /// @param out     B x H x 1 x P result, clear of the inputs
  void step_into(States& states, const Mamba2Inputs<T>& in, const HeadsView<T>& out) const {
    constexpr const char* where = "Mamba2::step";
    check(in, out, &states, where);
    if (in.xbc.tokens() != 1) {
      throw Error(std::string(where) + ": the views hold N = " + std::to_string(in.xbc.tokens()) +
                  " tokens; a step takes one (prefill_into takes more)");
    }
    const Eigen::Index batch = in.xbc.batch(), h = shape_.heads, p = shape_.head_dim;
    const Eigen::Index g = shape_.groups, n = shape_.state_dim, c = shape_.conv_channels();
    const Matrix<T> dt = step_sizes(in, where);  // [B, H]
    detail::StepScratch<T>& scratch = states.scratch;
    Matrix<T>& mixed = scratch.take(0, batch, c);
    detail::with_step_rows(in.xbc,
                           [&](const auto& rows) { conv_.step_into(states.conv, rows, mixed); });
    // Rows b * heads + head, as the state batch reads them.
    Matrix<T>& k = scratch.take(1, batch * g, n);
    Matrix<T>& q = scratch.take(2, batch * g, n);
    Matrix<T>& v = scratch.take(3, batch * h, p);
    Matrix<T>& log_gate = scratch.take(4, batch * h, 1);
    for (Eigen::Index b = 0; b < batch; ++b) {
      const T* row = mixed.row(b).data();
      k.middleRows(b * g, g) = Eigen::Map<const Matrix<T>>(row + h * p, g, n);
      q.middleRows(b * g, g) = Eigen::Map<const Matrix<T>>(row + h * p + g * n, g, n);
      for (Eigen::Index head = 0; head < h; ++head) {
        v.row(b * h + head) =
            dt(b, head) * Eigen::Map<const Vector<T>>(row + head * p, p).transpose();
        log_gate(b * h + head, 0) = dt(b, head) * rates_(head);
      }
    }
    Matrix<T>& y = scratch.take(5, batch * h, p);
    ssm_.step_into(states.recurrent, q, k, v, log_gates(log_gate), y);
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index head = 0; head < h; ++head) {
        y.row(b * h + head) +=
            d_(head) * Eigen::Map<const Vector<T>>(mixed.row(b).data() + head * p, p).transpose();
      }
    }
    norm_.apply_into(ConstHeadsView<T>::bnhd(y.data(), BnhdShape(batch, 1, h, p)), in.z, out);
  }

 private:
  static Mamba2Shape checked_shape(const Mamba2Shape& shape) {
    if (shape.heads < 1 || shape.head_dim < 1 || shape.groups < 1 || shape.state_dim < 1 ||
        shape.heads % shape.groups != 0) {
      throw Error("Mamba2: the shape needs H, P, G, N >= 1 and H a multiple of G, got H = " +
                  std::to_string(shape.heads) + ", P = " + std::to_string(shape.head_dim) +
                  ", G = " + std::to_string(shape.groups) +
                  ", N = " + std::to_string(shape.state_dim));
    }
    return shape;
  }

  static const Mamba2Options& checked_options(const Mamba2Options& options,
                                              const Mamba2Shape& shape) {
    constexpr const char* where = "Mamba2";
    if (!(options.norm_eps > 0.0) || !std::isfinite(options.norm_eps)) {
      throw Error(std::string(where) + ": Mamba2Options::norm_eps must be finite and > 0 (the " +
                  "config's layer_norm_epsilon), got " + std::to_string(options.norm_eps));
    }
    const Eigen::Index group = options.norm_group_size;
    if (group < 0 || (group > 0 && shape.inner() % group != 0)) {
      throw Error(std::string(where) + ": Mamba2Options::norm_group_size must be 0 (d_inner / " +
                  "G) or divide d_inner = " + std::to_string(shape.inner()) + ", got " +
                  std::to_string(group));
    }
    if (options.chunk < 1) {
      throw Error(std::string(where) + ": Mamba2Options::chunk must be >= 1, got " +
                  std::to_string(options.chunk));
    }
    if (options.threads < 0) {
      throw Error(std::string(where) + ": Mamba2Options::threads must be >= 0, got " +
                  std::to_string(options.threads));
    }
    return options;
  }

  static const Matrix<T>& checked_conv_weight(const Mamba2Shape& shape, const Matrix<T>& weight) {
    if (weight.rows() != shape.conv_channels() || weight.cols() != shape.conv_kernel) {
      throw Error(
          "Mamba2: conv_weight is " + detail::shape_string(weight) +
          " but must be C x K = " + detail::shape_string(shape.conv_channels(), shape.conv_kernel) +
          " (C = d_inner + 2 G N: conv1d.weight[:, 0, :])");
    }
    return weight;
  }

  static ShortConvOptions conv_options(const Mamba2Options& options) {
    ShortConvOptions conv;
    conv.activation = ConvActivation::silu;
    conv.check_finite = false;  // the mixer scans its inputs itself, before anything moves
    conv.threads = options.threads;
    return conv;
  }

  static Options engine_options(const Mamba2Options& options) {
    Options engine;
    engine.normalize = false;
    engine.scale = 1.0;
    engine.chunk = options.chunk;
    engine.check_finite = false;
    engine.threads = options.threads;
    engine.head_grouping = HeadGrouping::interleaved;
    return engine;
  }

  static OutputNorm<T> make_norm(const Vector<T>& weight, const Mamba2Shape& shape,
                                 const Mamba2Options& options) {
    if (weight.size() != shape.inner()) {
      throw Error("Mamba2: norm_weight has " + std::to_string(weight.size()) +
                  " entries but must have d_inner = H * P = " + std::to_string(shape.inner()));
    }
    const Eigen::Index group =
        options.norm_group_size > 0 ? options.norm_group_size : shape.inner() / shape.groups;
    OutputNormOptions norm = OutputNorm<T>::mamba2(weight, group, options.norm_eps).options();
    norm.check_finite = false;
    norm.threads = options.threads;
    return OutputNorm<T>(weight, norm);
  }

  /// Every check of a call, before anything moves.
  void check(const Mamba2Inputs<T>& in, const HeadsView<T>& out, const States* states,
             const char* where) const {
    const Eigen::Index batch = in.xbc.batch(), tokens = in.xbc.tokens(), h = shape_.heads;
    detail::require_mixer_view(in.xbc, batch, 1, tokens, shape_.conv_channels(), where, "xbc",
                               "in_proj's C = d_inner + 2 G N channels of x, B and C as one head "
                               "(B and N set by it)");
    detail::require_mixer_view(in.z, batch, h, tokens, shape_.head_dim, where, "z",
                               "in_proj's gate, H heads of P");
    detail::require_mixer_view(in.dt, batch, h, tokens, 1, where, "dt", "one dt per head");
    detail::require_mixer_view(out, batch, h, tokens, shape_.head_dim, where, "out",
                               "H heads of P");
    detail::require_mixer_output(out, where, std::pair("z", in.z), std::pair("xbc", in.xbc),
                                 std::pair("dt", in.dt));
    if (states != nullptr) {
      // Every state's shape, the options its sums run with and its transition: the SSM would
      // check the transition only after the convolution moved, and computes with each state's
      // own options.
      const RecurrentStateBatch<T>& recurrent = states->recurrent;
      const Options& own = ssm_.options();
      bool fits = detail::windows_fit(states->conv, conv_, batch) && recurrent.size() == batch * h;
      for (Eigen::Index i = 0; fits && i < recurrent.size(); ++i) {
        const RecurrentState<T>& state = recurrent[i];
        const Options& o = state.options();
        fits = state.feature_dim() == shape_.state_dim && state.value_dim() == shape_.head_dim &&
               o.normalize == own.normalize && o.scale == own.scale && o.decay == own.decay &&
               detail::continues_transition(state.transition(), detail::transition_of_gate_dim(1));
      }
      if (!fits) {
        throw Error(std::string(where) +
                    ": the states are not this mixer's for B = " + std::to_string(batch) +
                    " sequences: make them with make_states(B) of this "
                    "mixer");
      }
      detail::require_layer_states(recurrent, ssm_.layer_heads(), HeadGrouping::interleaved, where);
    }
    if (options_.check_finite) {
      detail::require_finite_view(in.xbc, where, "xbc");
      detail::require_finite_view(in.z, where, "z");
      detail::require_finite_view(in.dt, where, "dt");
    }
  }

  /// dt = softplus(dt + dt_bias) of every token, [B * N, H] (row b * N + t), before anything
  /// moves; NaN (check_finite off) throws here.
  Matrix<T> step_sizes(const Mamba2Inputs<T>& in, const char* where) const {
    const Eigen::Index batch = in.dt.batch(), tokens = in.dt.tokens(), h = shape_.heads;
    const HeadStrides& s = in.dt.strides();
    Matrix<T> dt(batch * tokens, h);
    bool finite = true;
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index t = 0; t < tokens; ++t) {
        const T* row = in.dt.data() + b * s.batch + t * s.token;
        for (Eigen::Index head = 0; head < h; ++head) {
          const T x = row[head * s.head] + dt_bias_(head);
          dt(b * tokens + t, head) = detail::softplus(x);
          finite = finite && std::isfinite(x);
        }
      }
    }
    if (!finite) {
      throw Error(std::string(where) + ": dt holds NaN or Inf (check_finite is off, but the " +
                  "step sizes cannot be formed from it)");
    }
    return dt;
  }

  /// The checked call: blocks of tokens through the convolution, v = dt x and the log gates,
  /// the SSM, the D skip and the norm in turn, the states carrying each block into the next.
  void run(States& states, const Mamba2Inputs<T>& in, const Matrix<T>& dt, const HeadsView<T>& out,
           const std::vector<Eigen::Index>& positions, std::vector<States>* snapshots) const {
    const Eigen::Index batch = in.xbc.batch(), tokens = in.xbc.tokens();
    const Eigen::Index h = shape_.heads, p = shape_.head_dim, g = shape_.groups;
    const Eigen::Index n = shape_.state_dim, c = shape_.conv_channels();
    const Eigen::Index block = std::min(tokens, detail::kMixerBlockTokens);
    Matrix<T> mixed(batch * block, c), v(batch * block, h * p), log_gate(batch * block, h);
    auto run_block = [&](Eigen::Index first, Eigen::Index count) {
      conv_.prefill_into(states.conv, detail::token_rows(in.xbc, first, count),
                         HeadsView<T>::bnhd(mixed.data(), BnhdShape(batch, count, 1, c)));
      // v = dt x and the log gates dt A, [B, count, H, P] and [B, count, H, 1].
      for (Eigen::Index b = 0; b < batch; ++b) {
        for (Eigen::Index t = 0; t < count; ++t) {
          const Eigen::Index row = b * count + t;
          const T* step = dt.row(b * tokens + first + t).data();
          for (Eigen::Index head = 0; head < h; ++head) {
            v.row(row).segment(head * p, p) = step[head] * mixed.row(row).segment(head * p, p);
            log_gate(row, head) = step[head] * rates_(head);
          }
        }
      }
      const HeadStrides groups{count * c, n, c, 1};
      const ConstHeadsView<T> k(mixed.data() + h * p, batch, g, count, n, groups);
      const ConstHeadsView<T> q(mixed.data() + h * p + g * n, batch, g, count, n, groups);
      const auto v_view = ConstHeadsView<T>::bnhd(v.data(), BnhdShape(batch, count, h, p));
      const auto gate_view =
          ConstHeadsView<T>::bnhd(log_gate.data(), BnhdShape(batch, count, h, 1));
      const HeadsView<T> y = detail::token_rows(out, first, count);
      ssm_.prefill_into(states.recurrent, q, k, v_view, log_gates(gate_view), y);
      // y += D x, then the gated norm in place.
      for (Eigen::Index b = 0; b < batch; ++b) {
        for (Eigen::Index head = 0; head < h; ++head) {
          typename HeadsView<T>::RowsMap y_head = y.head_rows(b, head);
          const Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>> x(
              mixed.data() + b * count * c + head * p, count, p, Eigen::OuterStride<>(c));
          y_head += d_(head) * x;
        }
      }
      norm_.apply_into(ConstHeadsView<T>(y), detail::token_rows(in.z, first, count), y);
    };
    detail::for_each_block(tokens, positions, run_block,
                           [&](std::size_t i) { detail::write_snapshot(*snapshots, i, states); });
  }

  Mamba2Shape shape_;
  Mamba2Options options_;
  ShortConv<T> conv_;
  LinearAttentionLayer<T, Identity> ssm_;
  OutputNorm<T> norm_;
  Vector<T> rates_;    ///< A = -exp(A_log), H
  Vector<T> dt_bias_;  ///< H
  Vector<T> d_;        ///< H
};

}  // namespace linattn

namespace linattn::detail {

/// A SessionPool<> keeps a Mamba2's session as its window and its states.
template <class T>
struct SessionParts<Mamba2States<T>> : MixerParts<Mamba2States<T>> {
  static constexpr PartKind kind = PartKind::mamba2;
  static constexpr const char* name = "Mamba2States (conv windows + SSM states)";
};

/// Mamba2's SSM runs on the Identity map over B and C: the map its saved states record.
template <class T>
struct LayerMapPrint<Mamba2<T>> {
  static MapFingerprint of(const Mamba2<T>& mixer) {
    return fingerprint_of(Identity{}, mixer.shape().state_dim);
  }
};

}  // namespace linattn::detail
