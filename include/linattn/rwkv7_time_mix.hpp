// SPDX-License-Identifier: MIT
// RWKV-7's time mixing as one object: from the block's normed input x to the input of its
// output projection, in the parallel form (training, prompts) and the per-token step, with its
// state (the token shift's last x and the generalized delta rule's states).
#pragma once

#include <algorithm>
#include <cmath>
#include <linattn/config.hpp>
#include <linattn/detail/mixer.hpp>
#include <linattn/detail/session_parts.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/gates.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/layer.hpp>
#include <linattn/output_norm.hpp>
#include <linattn/short_conv.hpp>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace linattn {

/// The sizes of an RWKV-7 time-mixing layer (RWKV-LM's x070, FLA's RWKV7Attention).
struct Rwkv7TimeMixShape {
  Eigen::Index heads = 32;     ///< H = C / D (a 1.5B G1: 2,048 / 64)
  Eigen::Index head_dim = 64;  ///< D, head_size (64 in every released RWKV-7)
  /// Layer 0: its values become v_first, read by every later layer's value residual; it has
  /// no value LoRA (v0, v1, v2 unused).
  bool first_layer = false;
  /// C = H D, the model's channels.
  Eigen::Index channels() const { return heads * head_dim; }
};

/// The layer's parameters as RWKV-LM's checkpoints store them (blocks.i.att.*). FLA's
/// checkpoints hold the same numbers: x_x's six rows are x_r ... x_g; a LoRA's
/// lora.0.weight is w1 transposed, lora.2.weight w2 transposed, lora.2.bias w0.
template <class T>
struct Rwkv7TimeMixWeights {
  /// C each: the token shift's mixes, x_i = x + mix_i (x_prev - x).
  Vector<T> x_r, x_w, x_k, x_v, x_a, x_g;
  /// C x C each, as torch.nn.Linear stores them ([out, in]: r = W_r x_r).
  Matrix<T> receptance, key, value;
  Matrix<T> w1;           ///< C x Lw: the decay's LoRA, w = -e^-1/2 sigmoid(w0 + tanh(x_w w1) w2)
  Matrix<T> w2;           ///< Lw x C
  Vector<T> w0;           ///< C
  Matrix<T> a1;           ///< C x La: the in-context learning rate's, a = sigmoid(a0 + x_a a1 a2)
  Matrix<T> a2;           ///< La x C
  Vector<T> a0;           ///< C
  Matrix<T> v1;           ///< C x Lv: the value residual's (empty for the first layer)
  Matrix<T> v2;           ///< Lv x C
  Vector<T> v0;           ///< C
  Matrix<T> g1;           ///< C x Lg: the output gate's, g = sigmoid(x_g g1) g2
  Matrix<T> g2;           ///< Lg x C
  Vector<T> k_k;          ///< C: kk = normalize(k o k_k) per head
  Vector<T> k_a;          ///< C: k o (1 + (a - 1) o k_a)
  Matrix<T> r_k;          ///< H x D: the bonus, (r . (k o r_k)) v per head
  Vector<T> ln_x_weight;  ///< C: the GroupNorm's (ln_x.weight)
  Vector<T> ln_x_bias;    ///< C: ln_x.bias
};

/// Settings of an Rwkv7TimeMix.
struct Rwkv7TimeMixOptions {
  /// ln_x's eps: RWKV-LM's 1e-5 head_size_divisor^2 (divisor 8), FLA's head_dim * 1e-5.
  double norm_eps = 64e-5;
  /// The recurrence's form over many tokens (DeltaForm::automatic: the faster).
  DeltaForm form = DeltaForm::automatic;
  /// Tokens per chunk of the chunked form.
  Eigen::Index chunk = 64;
  /// Scan every input for NaN and Inf and throw on them, before anything moves.
  bool check_finite = true;
  /// Threads for one call when linattn is built with OpenMP: 0 takes OpenMP's default.
  int threads = 0;
};

/// What an Rwkv7TimeMix carries from one call to the next for B sequences: the token shift's
/// window (each sequence's last x, the window of a two-tap convolution) and the recurrence's H
/// states per sequence. A continuation from them equals the run over the whole sequence.
template <class T>
struct Rwkv7TimeMixStates {
  ConvWindows<T> conv;                   ///< the last x of each sequence (1 x C)
  DplrDeltaRuleStateBatch<T> recurrent;  ///< state b * H + h: head h of sequence b
  detail::StepScratch<T> scratch;        ///< the step's buffers (not copied with the states)
  /// B, sequences.
  Eigen::Index batch() const { return conv.batch(); }
};

/// RWKV-7's time mixing (RWKV-LM's RWKV_Tmix_x070, FLA's RWKV7Attention) between the block's
/// ln1 and its output projection: for x, the normed input of B sequences of N tokens,
///   x_i = x + mix_i (x_{t-1} - x) for i in r, w, k, v, a, g (x_{-1}: the states' last x);
///   r, k, v = W_r x_r, W_k x_k, W_v x_v;
///   log w = -e^-1/2 sigmoid(w0 + tanh(x_w w1) w2)  (decays in (0.545, 1));
///   v = v + (v_first - v) sigmoid(v0 + x_v v1 v2)  (all but the first layer, which writes
///       its v to v_first);
///   a = sigmoid(a0 + x_a a1 a2), g = sigmoid(x_g g1) g2;
///   kk = k o k_k normalized per head (x / max(|x|, 1e-12)), k = k o (1 + (a - 1) o k_a);
///   o = the generalized delta rule per head with q = r, a = -kk, b = kk o a, log gates log w
///       and scale 1 (S_t = (diag(w_t) - kk_t (kk_t o a_t)^T) S_{t-1} + k_t v_t^T, its S the
///       reference's V x K state transposed);
///   y = (GroupNorm_H(o) (ln_x, eps) + ((r o k o r_k) . 1) v per head) o g,
/// y being the output projection's input [B, N, C]. The token shift sits before the
/// projections, so unlike the other mixers this one runs W_r, W_k, W_v and the LoRAs itself
/// (Eigen GEMMs over blocks of tokens); W_o stays the caller's.
/// @tparam T  float or double: the inputs', states' and outputs' type
template <class T>
class Rwkv7TimeMix {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "Rwkv7TimeMix<T> needs T = float or double");

 public:
  /// The state make_states returns.
  using States = Rwkv7TimeMixStates<T>;

  /// @param shape    H, D, first_layer
  /// @param weights  the layer's parameters (shapes in Rwkv7TimeMixWeights)
  /// @param options  norm_eps, form, chunk, check_finite, threads
  Rwkv7TimeMix(const Rwkv7TimeMixShape& shape, const Rwkv7TimeMixWeights<T>& weights,
               const Rwkv7TimeMixOptions& options = {})
      : shape_(checked_shape(shape)),
        options_(checked_options(options)),
        weights_(checked_weights(shape, weights)),
        shift_(shift_taps(shape.channels()), shift_options(options)),
        dplr_(shape.heads, shape.head_dim, shape.head_dim, dplr_options(options)),
        norm_(norm_of(weights, options)) {
    mixes_.resize(6, shape.channels());
    mixes_ << weights.x_r.transpose(), weights.x_w.transpose(), weights.x_k.transpose(),
        weights.x_v.transpose(), weights.x_a.transpose(), weights.x_g.transpose();
    max_rank_ = std::max({weights.w1.cols(), weights.a1.cols(), weights.g1.cols(),
                          shape.first_layer ? Eigen::Index(0) : weights.v1.cols()});
  }

  /// The sizes.
  const Rwkv7TimeMixShape& shape() const { return shape_; }
  /// The settings.
  const Rwkv7TimeMixOptions& options() const { return options_; }
  /// The parameters.
  const Rwkv7TimeMixWeights<T>& weights() const { return weights_; }
  /// The GroupNorm (OutputNorm::rwkv7 with ln_x).
  const OutputNorm<T>& norm() const { return norm_; }

  /// Zero states for `batch` sequences (no previous token: x_{-1} = 0, S = 0).
  /// @param batch  B >= 1
  States make_states(Eigen::Index batch) const {
    return States{shift_.make_windows(batch), dplr_.make_states(batch), {}};
  }

  /// Whole sequences, each from zero states (training, or prompts whose state is not kept).
  /// @param x        B x 1 x N x C: the block's ln1 output, any token and batch strides
  /// @param v_first  B x H x N x D: the first layer writes its values here; every other
  ///                 layer reads them (the same tokens' v_first)
  /// @param out      B x H x N x D result (the output projection's input; e.g.
  ///                 HeadsView<T>::bnhd(y, BnhdShape{B, N, H, D})), clear of x and v_first
  void forward_into(const ConstHeadsView<T>& x, const HeadsView<T>& v_first,
                    const HeadsView<T>& out) const {
    constexpr const char* where = "Rwkv7TimeMix::forward";
    check(x, v_first, out, nullptr, where);
    States states = make_states(x.batch());
    run(states, x, v_first, out, {}, nullptr);
  }

  /// Prompts, one per sequence, each continuing from its states, which then hold where the
  /// prompt leaves them. Checked whole before anything moves.
  /// @param states   from make_states(B)
  /// @param x        B x 1 x N x C: the block's ln1 output
  /// @param v_first  B x H x N x D: written by the first layer, read by the others
  /// @param out      B x H x N x D result, clear of x and v_first
  void prefill_into(States& states, const ConstHeadsView<T>& x, const HeadsView<T>& v_first,
                    const HeadsView<T>& out) const {
    constexpr const char* where = "Rwkv7TimeMix::prefill";
    check(x, v_first, out, &states, where);
    run(states, x, v_first, out, {}, nullptr);
  }

  /// A prefill that also writes the states after each of `positions` tokens into
  /// snapshots[i] (prefix caching), as GatedDeltaNet's.
  /// @param states     from make_states(B)
  /// @param x          B x 1 x N x C
  /// @param v_first    B x H x N x D
  /// @param out        B x H x N x D result
  /// @param positions  token counts rising strictly within [1, N]
  /// @param snapshots  result: one States per position (filled in place when it already holds
  ///                   as many)
  void prefill_into(States& states, const ConstHeadsView<T>& x, const HeadsView<T>& v_first,
                    const HeadsView<T>& out, const std::vector<Eigen::Index>& positions,
                    std::vector<States>& snapshots) const {
    constexpr const char* where = "Rwkv7TimeMix::prefill";
    check(x, v_first, out, &states, where);
    detail::require_checkpoints(positions, x.tokens(), where);
    run(states, x, v_first, out, positions, &snapshots);
  }

  /// One token of every sequence (decoding): the views with N = 1. Allocates nothing once the
  /// states have stepped before. Checked whole before anything moves.
  /// @param states   from make_states(B)
  /// @param x        B x 1 x 1 x C
  /// @param v_first  B x H x 1 x D: written by the first layer, read by the others
  /// @param out      B x H x 1 x D result, clear of x and v_first
  void step_into(States& states, const ConstHeadsView<T>& x, const HeadsView<T>& v_first,
                 const HeadsView<T>& out) const {
    constexpr const char* where = "Rwkv7TimeMix::step";
    check(x, v_first, out, &states, where);
    if (x.tokens() != 1) {
      throw Error(std::string(where) + ": the views hold N = " + std::to_string(x.tokens()) +
                  " tokens; a step takes one (prefill_into takes more)");
    }
    const Eigen::Index batch = x.batch(), h = shape_.heads, d = shape_.head_dim;
    Matrix<T>& previous = states.scratch.take(0, batch, shape_.channels());
    detail::with_step_rows(
        x, [&](const auto& rows) { shift_.step_into(states.conv, rows, previous); });
    const Inputs in = inputs(x, v_first, previous, states.scratch, 1);
    // Component j of the recurrence's inputs as B * H rows of D, row b * H + h as the states.
    const auto rows = [&](int j) {
      return Eigen::Map<const Matrix<T>>(in.projected.data() + j * batch * h * d, batch * h, d);
    };
    Eigen::Map<Matrix<T>> o(previous.data(), batch * h, d);  // x_{t-1} is read by now
    dplr_.step_into(states.recurrent, rows(kR), rows(kK), rows(kV), rows(kMinusKk), rows(kKkA),
                    log_gates(rows(kLogW)), o);
    norm_.apply_into(ConstHeadsView<T>::bnhd(o.data(), BnhdShape(batch, 1, h, d)), out);
    finish(in, out);
  }

 private:
  // The rows of the projected inputs' components (each R x C, R = B * tokens).
  static constexpr int kR = 0, kK = 1, kV = 2, kLogW = 3, kA = 4, kG = 5, kMinusKk = 6, kKkA = 7;
  static constexpr int kComponents = 8;
  using Row = Eigen::Matrix<T, 1, Eigen::Dynamic>;

  /// The projected inputs of R = B * count tokens (row b * count + t), component-major in one
  /// buffer: rows [j R, (j + 1) R) hold component j.
  struct Inputs {
    const Matrix<T>& projected;
    Eigen::Index batch, count;
  };

  static Rwkv7TimeMixShape checked_shape(const Rwkv7TimeMixShape& shape) {
    if (shape.heads < 1 || shape.head_dim < 1) {
      throw Error("Rwkv7TimeMix: the shape needs H, D >= 1, got H = " +
                  std::to_string(shape.heads) + ", D = " + std::to_string(shape.head_dim));
    }
    return shape;
  }

  static const Rwkv7TimeMixOptions& checked_options(const Rwkv7TimeMixOptions& options) {
    detail::require_mixer_options(options, "Rwkv7TimeMix", "Rwkv7TimeMixOptions",
                                  "ln_x's eps, 64e-5 in the released models");
    return options;
  }

  /// Throws unless m is rows x cols and finite; `meaning` says what it is.
  static void require_matrix(const Matrix<T>& m, Eigen::Index rows, Eigen::Index cols,
                             const char* name, const char* meaning) {
    if (m.rows() != rows || m.cols() != cols || m.size() == 0) {
      throw Error(std::string("Rwkv7TimeMix: ") + name + " is " + detail::shape_string(m) +
                  " but must be " + detail::shape_string(rows, cols) + " (" + meaning + ")");
    }
    detail::require_finite(m, "Rwkv7TimeMix", name);
  }

  static const Rwkv7TimeMixWeights<T>& checked_weights(const Rwkv7TimeMixShape& shape,
                                                       const Rwkv7TimeMixWeights<T>& w) {
    constexpr const char* where = "Rwkv7TimeMix";
    const Eigen::Index c = shape.channels();
    const std::pair<const Vector<T>*, const char*> vectors[] = {{&w.x_r, "x_r"},
                                                                {&w.x_w, "x_w"},
                                                                {&w.x_k, "x_k"},
                                                                {&w.x_v, "x_v"},
                                                                {&w.x_a, "x_a"},
                                                                {&w.x_g, "x_g"},
                                                                {&w.w0, "w0"},
                                                                {&w.a0, "a0"},
                                                                {&w.k_k, "k_k"},
                                                                {&w.k_a, "k_a"},
                                                                {&w.ln_x_weight, "ln_x_weight"},
                                                                {&w.ln_x_bias, "ln_x_bias"}};
    for (const auto& [vector, name] : vectors)
      detail::require_finite_vector(*vector, c, where, name);
    require_matrix(w.receptance, c, c, "receptance", "C x C, receptance.weight");
    require_matrix(w.key, c, c, "key", "C x C, key.weight");
    require_matrix(w.value, c, c, "value", "C x C, value.weight");
    // A LoRA: C x L then L x C, its rank L read from the first.
    const auto lora = [&](const Matrix<T>& down, const Matrix<T>& up, const char* down_name,
                          const char* up_name) {
      require_matrix(down, c, std::max<Eigen::Index>(down.cols(), 1), down_name,
                     "C x L with L >= 1, the LoRA's first matrix");
      require_matrix(up, down.cols(), c, up_name, "L x C, L the columns of the first");
    };
    lora(w.w1, w.w2, "w1", "w2");
    lora(w.a1, w.a2, "a1", "a2");
    lora(w.g1, w.g2, "g1", "g2");
    if (!shape.first_layer) {
      detail::require_finite_vector(w.v0, c, where, "v0 (every layer but the first has one)");
      lora(w.v1, w.v2, "v1", "v2");
    }
    require_matrix(w.r_k, shape.heads, shape.head_dim, "r_k", "H x D, the bonus's weights");
    return w;
  }

  /// C x 2 taps (1, 0): y_t = x_{t-1}, the window carrying each sequence's last x.
  static Matrix<T> shift_taps(Eigen::Index channels) {
    Matrix<T> taps = Matrix<T>::Zero(channels, 2);
    taps.col(0).setOnes();
    return taps;
  }

  static ShortConvOptions shift_options(const Rwkv7TimeMixOptions& options) {
    ShortConvOptions conv;
    conv.check_finite = false;
    conv.threads = options.threads;
    return conv;
  }

  static DplrOptions dplr_options(const Rwkv7TimeMixOptions& options) {
    DplrOptions dplr;
    dplr.scale = 1.0;  // RWKV-7's layer
    dplr.form = options.form;
    dplr.chunk = options.chunk;
    dplr.check_finite = false;
    dplr.threads = options.threads;
    return dplr;
  }

  static OutputNorm<T> norm_of(const Rwkv7TimeMixWeights<T>& weights,
                               const Rwkv7TimeMixOptions& options) {
    OutputNormOptions norm =
        OutputNorm<T>::rwkv7(weights.ln_x_weight, weights.ln_x_bias, options.norm_eps).options();
    norm.check_finite = false;
    norm.threads = options.threads;
    return OutputNorm<T>(weights.ln_x_weight, weights.ln_x_bias, norm);
  }

  /// Every check of a call, before anything moves.
  void check(const ConstHeadsView<T>& x, const HeadsView<T>& v_first, const HeadsView<T>& out,
             const States* states, const char* where) const {
    const Eigen::Index batch = x.batch(), tokens = x.tokens();
    const Eigen::Index h = shape_.heads, d = shape_.head_dim;
    detail::require_mixer_view(x, batch, 1, tokens, shape_.channels(), where, "x",
                               "the block's ln1 output, C channels as one head (B and N set by "
                               "it)");
    detail::require_mixer_view(v_first, batch, h, tokens, d, where, "v_first",
                               "the first layer's values, H heads of D");
    detail::require_mixer_view(out, batch, h, tokens, d, where, "out", "H heads of D");
    detail::require_mixer_output(out, where, std::pair("x", x), std::pair("v_first", v_first));
    if (shape_.first_layer) {
      if (!detail::rows_distinct(v_first) || detail::views_meet(x, v_first)) {
        throw Error(std::string(where) + ": the first layer writes v_first: give it rows of " +
                    "its own, clear of x");
      }
    }
    if (states != nullptr) require_states(*states, batch, where);
    if (options_.check_finite) {
      detail::require_finite_view(x, where, "x");
      if (!shape_.first_layer) detail::require_finite_view(v_first, where, "v_first");
    }
  }

  /// Throws unless `states` could come from make_states(batch).
  void require_states(const States& states, Eigen::Index batch, const char* where) const {
    const DplrDeltaRuleStateBatch<T>& recurrent = states.recurrent;
    const bool fits =
        detail::windows_fit(states.conv, shift_, batch) &&
        recurrent.size() == batch * shape_.heads && recurrent.key_dim() == shape_.head_dim &&
        recurrent.value_dim() == shape_.head_dim &&
        detail::same_dplr_results(recurrent.options(), dplr_.options(), shape_.head_dim) &&
        recurrent.options().check_finite == dplr_.options().check_finite;
    if (!fits) {
      throw Error(std::string(where) +
                  ": the states are not this mixer's for B = " + std::to_string(batch) +
                  " sequences (windows " + std::to_string(states.conv.batch()) + " x " +
                  detail::shape_string(states.conv.rows(), states.conv.channels()) + ", " +
                  std::to_string(recurrent.size()) + " recurrent states): make them with " +
                  "make_states(B) of this mixer");
    }
    detail::require_layer_states(recurrent, dplr_.layer_heads(), HeadGrouping::interleaved, where);
  }

  /// row <- sigmoid(row), in place.
  template <class M>
  static void sigmoid_in_place(M&& m) {
    m.array() = T(1) / (T(1) + (-m.array()).exp());
  }

  /// The token shift's mixes, the projections, the LoRAs, the value residual (or v_first
  /// written) and kk for `count` tokens of B sequences; previous holds x_{t-1} for each
  /// (row b * count + t). Buffers 1 to 3 of `scratch`.
  Inputs inputs(const ConstHeadsView<T>& x, const HeadsView<T>& v_first, const Matrix<T>& previous,
                detail::StepScratch<T>& scratch, Eigen::Index count) const {
    const Eigen::Index batch = x.batch(), rows = batch * count, c = shape_.channels();
    const Eigen::Index h = shape_.heads, d = shape_.head_dim;
    const Rwkv7TimeMixWeights<T>& w = weights_;
    Matrix<T>& mixed = scratch.take(1, 6 * rows, c);  // x_r, x_w, x_k, x_v, x_a, x_g
    const HeadStrides& xs = x.strides();
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index t = 0; t < count; ++t) {
        const Eigen::Index row = b * count + t;
        const Eigen::Map<const Row> now(x.data() + b * xs.batch + t * xs.token, c);
        for (Eigen::Index i = 0; i < 6; ++i) {
          mixed.row(i * rows + row).array() =
              now.array() + mixes_.row(i).array() * (previous.row(row).array() - now.array());
        }
      }
    }
    const auto mix = [&](Eigen::Index i) { return mixed.middleRows(i * rows, rows); };
    Matrix<T>& projected = scratch.take(2, kComponents * rows, c);
    const auto part = [&](int j) { return projected.middleRows(j * rows, rows); };
    Matrix<T>& hidden = scratch.take(3, rows, max_rank_);
    part(kR).noalias() = mix(0) * w.receptance.transpose();
    part(kK).noalias() = mix(2) * w.key.transpose();
    part(kV).noalias() = mix(3) * w.value.transpose();
    // log w = -e^-1/2 sigmoid(w0 + tanh(x_w w1) w2).
    hidden.leftCols(w.w1.cols()).noalias() = mix(1) * w.w1;
    hidden.leftCols(w.w1.cols()) = hidden.leftCols(w.w1.cols()).array().tanh().matrix();
    part(kLogW).noalias() = hidden.leftCols(w.w1.cols()) * w.w2;
    part(kLogW).rowwise() += w.w0.transpose();
    sigmoid_in_place(part(kLogW));
    part(kLogW) *= T(-0.60653065971263342);  // -e^-1/2
    // a = sigmoid(a0 + x_a a1 a2).
    hidden.leftCols(w.a1.cols()).noalias() = mix(4) * w.a1;
    part(kA).noalias() = hidden.leftCols(w.a1.cols()) * w.a2;
    part(kA).rowwise() += w.a0.transpose();
    sigmoid_in_place(part(kA));
    // The value residual: v += (v_first - v) sigmoid(v0 + x_v v1 v2), its gate held in g's rows
    // until g is formed; the first layer's v is v_first.
    const HeadStrides& fs = v_first.strides();
    if (shape_.first_layer) {
      for (Eigen::Index b = 0; b < batch; ++b) {
        for (Eigen::Index t = 0; t < count; ++t) {
          for (Eigen::Index i = 0; i < h; ++i) {
            Eigen::Map<Row>(v_first.data() + b * fs.batch + i * fs.head + t * fs.token, d) =
                part(kV).row(b * count + t).segment(i * d, d);
          }
        }
      }
    } else {
      hidden.leftCols(w.v1.cols()).noalias() = mix(3) * w.v1;
      part(kG).noalias() = hidden.leftCols(w.v1.cols()) * w.v2;
      part(kG).rowwise() += w.v0.transpose();
      sigmoid_in_place(part(kG));
      for (Eigen::Index b = 0; b < batch; ++b) {
        for (Eigen::Index t = 0; t < count; ++t) {
          const Eigen::Index row = b * count + t;
          for (Eigen::Index i = 0; i < h; ++i) {
            const Eigen::Map<const Row> first(
                v_first.data() + b * fs.batch + i * fs.head + t * fs.token, d);
            auto v = part(kV).row(row).segment(i * d, d);
            v.array() += (first.array() - v.array()) * part(kG).row(row).segment(i * d, d).array();
          }
        }
      }
    }
    // g = sigmoid(x_g g1) g2.
    hidden.leftCols(w.g1.cols()).noalias() = mix(5) * w.g1;
    sigmoid_in_place(hidden.leftCols(w.g1.cols()));
    part(kG).noalias() = hidden.leftCols(w.g1.cols()) * w.g2;
    // kk = normalize(k o k_k) per head; a = -kk, b = kk o a; then k o (1 + (a - 1) o k_a).
    part(kMinusKk) = (part(kK).array().rowwise() * w.k_k.transpose().array()).matrix();
    for (Eigen::Index row = 0; row < rows; ++row) {
      for (Eigen::Index i = 0; i < h; ++i) {
        auto kk = part(kMinusKk).row(row).segment(i * d, d);
        kk /= -std::max(kk.norm(), T(1e-12));
      }
    }
    part(kKkA) = -part(kMinusKk).cwiseProduct(part(kA));
    part(kK).array() *= (T(1) + (part(kA).array() - T(1)).rowwise() * w.k_a.transpose().array());
    return Inputs{projected, batch, count};
  }

  /// out <- (out + (r . (k o r_k)) v per head) o g, out holding the normed recurrence.
  void finish(const Inputs& in, const HeadsView<T>& out) const {
    const Eigen::Index rows = in.batch * in.count, h = shape_.heads, d = shape_.head_dim;
    const auto part = [&](int j) { return in.projected.middleRows(j * rows, rows); };
    const HeadStrides& os = out.strides();
    for (Eigen::Index b = 0; b < in.batch; ++b) {
      for (Eigen::Index t = 0; t < in.count; ++t) {
        const Eigen::Index row = b * in.count + t;
        for (Eigen::Index i = 0; i < h; ++i) {
          const T bonus =
              (part(kR).row(row).segment(i * d, d).array() *
               part(kK).row(row).segment(i * d, d).array() * weights_.r_k.row(i).array())
                  .sum();
          Eigen::Map<Row> y(out.data() + b * os.batch + i * os.head + t * os.token, d);
          y.array() = (y.array() + bonus * part(kV).row(row).segment(i * d, d).array()) *
                      part(kG).row(row).segment(i * d, d).array();
        }
      }
    }
  }

  /// The checked call: blocks of tokens through the shift, the projections, the recurrence,
  /// the norm and the bonus in turn, the states carrying each block into the next.
  void run(States& states, const ConstHeadsView<T>& x, const HeadsView<T>& v_first,
           const HeadsView<T>& out, const std::vector<Eigen::Index>& positions,
           std::vector<States>* snapshots) const {
    const Eigen::Index batch = x.batch(), c = shape_.channels();
    const Eigen::Index h = shape_.heads, d = shape_.head_dim;
    detail::StepScratch<T> scratch;
    auto run_block = [&](Eigen::Index first, Eigen::Index count) {
      auto rows = [&](const auto& view) { return detail::token_rows(view, first, count); };
      Matrix<T>& previous = scratch.take(0, batch * count, c);
      shift_.prefill_into(states.conv, rows(x),
                          HeadsView<T>::bnhd(previous.data(), BnhdShape(batch, count, 1, c)));
      const Inputs in = inputs(rows(x), rows(v_first), previous, scratch, count);
      const auto view = [&](int j) {
        return ConstHeadsView<T>(in.projected.data() + j * batch * count * c, batch, h, count, d,
                                 HeadStrides{count * c, d, c, 1});
      };
      const HeadsView<T> o = rows(out);
      dplr_.prefill_into(states.recurrent, view(kR), view(kK), view(kV), view(kMinusKk), view(kKkA),
                         log_gates(view(kLogW)), o);
      norm_.apply_into(o, o);
      finish(in, o);
    };
    detail::for_each_block(x.tokens(), positions, run_block,
                           [&](std::size_t i) { detail::write_snapshot(*snapshots, i, states); });
  }

  Rwkv7TimeMixShape shape_;
  Rwkv7TimeMixOptions options_;
  Rwkv7TimeMixWeights<T> weights_;
  ShortConv<T> shift_;
  DplrDeltaRuleLayer<T> dplr_;
  OutputNorm<T> norm_;
  Matrix<T> mixes_;  ///< 6 x C: x_r, x_w, x_k, x_v, x_a, x_g as rows
  Eigen::Index max_rank_ = 0;
};

}  // namespace linattn

namespace linattn::detail {

/// A SessionPool<> keeps an Rwkv7TimeMix's session as its last x and its states.
template <class T>
struct SessionParts<Rwkv7TimeMixStates<T>> : MixerParts<Rwkv7TimeMixStates<T>> {
  static constexpr PartKind kind = PartKind::rwkv7_time_mix;
  static constexpr const char* name = "Rwkv7TimeMixStates (last x + generalized delta-rule states)";
};

}  // namespace linattn::detail
