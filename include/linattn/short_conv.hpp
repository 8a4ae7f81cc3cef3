// SPDX-License-Identifier: MIT
// The short causal convolution that Qwen3-Next / 3.5, Kimi, Mamba-2 and LFM2 run on their
// projections before the recurrence: depthwise, a few taps, with a rolling window as state.
#pragma once

#include <algorithm>
#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/sequence_rows.hpp>
#include <linattn/detail/short_conv.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/gradients.hpp>
#include <linattn/heads_view.hpp>
#include <string>
#include <type_traits>
#include <vector>

namespace linattn {

template <class T>
class ConvWindows;

/// What a ShortConv applies to each sum.
enum class ConvActivation {
  none,  ///< y = the sum (LFM2's convolution; Mamba-2's with its activation off)
  silu,  ///< y = sum * sigmoid(sum) (Qwen3-Next / 3.5, Kimi, Mamba-2: causal_conv1d's "silu")
};

/// Settings of a ShortConv.
struct ShortConvOptions {
  /// Tokens between neighbouring taps (PyTorch's Conv1d dilation); >= 1.
  Eigen::Index dilation = 1;
  /// Applied to every output.
  ConvActivation activation = ConvActivation::none;
  /// Scan inputs and windows for NaN and Inf and throw on them.
  bool check_finite = true;
  /// Threads for one call when linattn is built with OpenMP: 0 takes OpenMP's default, n > 0
  /// at most n. Results do not depend on it.
  int threads = 0;
};

/// A depthwise causal ("short") convolution over tokens, as the models above run it (PyTorch's
/// Conv1d(C, C, K, groups=C, padding=(K-1)d, dilation=d) cut to the first N outputs, FLA's
/// ShortConvolution, causal_conv1d_fn): for every channel c and token t,
///   y[t, c] = act(bias[c] + sum_{i<K} weight(c, i) x[t - (K - 1 - i) d, c]),
/// weight(c, K - 1) multiplying the current token. Inputs before a sequence's first token are
/// zero (forward_into) or its window (prefill_into and step_into on the ConvWindows that
/// make_windows gives: the convolution's state).
/// Inputs are [B, N, C] buffers seen as views with one head (HeadsView<T>::bnhd(data,
/// BnhdShape{B, N, 1, C}), or any token and batch strides: C channels of a wider fused row).
/// @tparam T  float or double
template <class T>
class ShortConv {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "ShortConv<T> needs T = float or double: convert 16-bit activations to float");

 public:
  /// The largest dilation: (K - 1) * dilation tokens of history stay far inside Eigen::Index.
  static constexpr Eigen::Index kMaxDilation = Eigen::Index(1) << 20;

  /// Without bias.
  /// @param weight   C x K taps, K in [1, 8]: the model's depthwise weight [C, 1, K] without
  ///                 its middle axis (HF's conv1d.weight[:, 0, :]; ggml's conv weights, ne =
  ///                 [K, C], are the same memory: no transpose)
  /// @param options  dilation, activation, check_finite, threads
  template <class DW>
  explicit ShortConv(const Eigen::MatrixBase<DW>& weight, const ShortConvOptions& options = {})
      : ShortConv(weight, Vector<T>(), options) {}

  /// With bias (Mamba-2 and LFM2 keep one; Qwen and Kimi do not).
  /// @param weight   C x K taps, as above
  /// @param bias     C biases, or an empty vector for none
  /// @param options  dilation, activation, check_finite, threads
  template <class DW, class DB>
  ShortConv(const Eigen::MatrixBase<DW>& weight, const Eigen::MatrixBase<DB>& bias,
            const ShortConvOptions& options = {})
      : options_(options) {
    static_assert(std::is_same_v<typename DW::Scalar, T> && std::is_same_v<typename DB::Scalar, T>,
                  "ShortConv<T>: weight and bias must have scalar type T");
    constexpr const char* where = "ShortConv";
    const Eigen::Index k = weight.cols();
    if (weight.rows() < 1 || k < 1 || k > detail::kMaxConvTaps) {
      throw Error(
          std::string(where) + ": weight is " + detail::shape_string(weight) +
          " but must be C x K with C >= 1 and 1 <= K <= " + std::to_string(detail::kMaxConvTaps) +
          " (the model's [C, 1, K] weight without its middle axis)");
    }
    if (bias.size() != 0 && (bias.size() != weight.rows() || bias.cols() != 1)) {
      throw Error(std::string(where) + ": bias is " + detail::shape_string(bias) +
                  " but must be a vector of C = " + std::to_string(weight.rows()) +
                  " entries, or empty for none");
    }
    if (options.dilation < 1 || options.dilation > kMaxDilation) {
      throw Error(std::string(where) + ": ShortConvOptions::dilation must be in [1, " +
                  std::to_string(kMaxDilation) + "], got " + std::to_string(options.dilation));
    }
    if (options.activation != ConvActivation::none && options.activation != ConvActivation::silu) {
      throw Error(std::string(where) + ": ShortConvOptions::activation is not a ConvActivation");
    }
    detail::require_finite(weight, where, "weight");
    if (bias.size() != 0) detail::require_finite(bias.transpose(), where, "bias");
    taps_ = weight.transpose();
    bias_ = bias;
  }

  /// C, channels.
  Eigen::Index channels() const { return taps_.cols(); }
  /// K, taps per channel.
  Eigen::Index kernel_size() const { return taps_.rows(); }
  /// (K - 1) * dilation: the past inputs an output reads, the rows of a sequence's window.
  Eigen::Index window_rows() const { return (kernel_size() - 1) * options_.dilation; }
  /// The C x K weight, as given.
  Matrix<T> weight() const { return taps_.transpose(); }
  /// The C biases, empty without.
  const Vector<T>& bias() const { return bias_; }
  /// The settings.
  const ShortConvOptions& options() const { return options_; }

  /// Every sequence from zeros before its first token.
  /// @param x  B x 1 x N x C inputs (features adjacent: strides().dim == 1)
  /// @param y  B x 1 x N x C outputs; may not overlap x (outputs are written while later
  ///           tokens still read earlier inputs) or itself
  template <class X, class Y>
  void forward_into(const HeadsView<X>& x, const HeadsView<Y>& y) const {
    run(x, y, nullptr, nullptr, "ShortConv::forward");
  }

  /// Packed sequences of different lengths, each from zeros: sequence s is tokens
  /// [offsets[s], offsets[s+1]) of the views (FLA's cu_seqlens).
  /// @param x        1 x 1 x total x C inputs
  /// @param offsets  S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
  /// @param y        1 x 1 x total x C outputs; may not overlap x or itself
  template <class X, class Y>
  void forward_varlen_into(const HeadsView<X>& x, const std::vector<std::int64_t>& offsets,
                           const HeadsView<Y>& y) const {
    run(x, y, &offsets, nullptr, "ShortConv::forward_varlen");
  }

  /// One sequence's N x C inputs from zeros: N x C outputs.
  template <class DX>
  Matrix<T> forward(const Eigen::MatrixBase<DX>& x) const {
    static_assert(std::is_same_v<typename DX::Scalar, T>, "ShortConv<T>: x must have scalar T");
    const Matrix<T> input = x;  // contiguous rows for the view
    if (input.rows() < 1) {
      throw Error("ShortConv::forward: x is " + detail::shape_string(x) + "; it needs a token");
    }
    Matrix<T> out(input.rows(), input.cols());
    forward_into(ConstHeadsView<T>::bnhd(input.data(), BnhdShape(1, input.rows(), 1, input.cols())),
                 HeadsView<T>::bnhd(out.data(), BnhdShape(1, out.rows(), 1, out.cols())));
    return out;
  }

  /// Zero windows for `batch` sequences, the state prefill_into and step_into move.
  /// @param batch  B >= 1, sequences
  ConvWindows<T> make_windows(Eigen::Index batch) const { return ConvWindows<T>(*this, batch); }

  /// Prompts, one per sequence, each continuing from its window, which then holds the
  /// prompt's last inputs. Checked whole before anything moves.
  /// @param windows  B windows of this convolution
  /// @param x        B x 1 x N x C inputs
  /// @param y        B x 1 x N x C outputs; may not overlap x or itself
  template <class X, class Y>
  void prefill_into(ConvWindows<T>& windows, const HeadsView<X>& x, const HeadsView<Y>& y) const {
    run(x, y, nullptr, &windows, "ShortConv::prefill");
  }

  /// Prompts of different lengths packed along N: sequence s (tokens [offsets[s],
  /// offsets[s+1])) continues window s; an empty one leaves its window as it is.
  /// @param windows  B windows of this convolution
  /// @param x        1 x 1 x total x C inputs
  /// @param offsets  B + 1 nondecreasing token offsets, offsets[0] = 0, offsets[B] = total
  /// @param y        1 x 1 x total x C outputs; may not overlap x or itself
  template <class X, class Y>
  void prefill_varlen_into(ConvWindows<T>& windows, const HeadsView<X>& x,
                           const std::vector<std::int64_t>& offsets, const HeadsView<Y>& y) const {
    run(x, y, &offsets, &windows, "ShortConv::prefill_varlen");
  }

  /// One token for every sequence: row b of x continues window b. Equal, bit for bit, to the
  /// prefill of the same tokens.
  /// @param windows  B windows of this convolution
  /// @param x        B x C inputs, row b for sequence b (any row stride: a fused projection)
  /// @param y        B x C outputs; not x's memory
  template <class DX>
  void step_into(ConvWindows<T>& windows, const Eigen::MatrixBase<DX>& x,
                 Eigen::Ref<Matrix<T>> y) const {
    static_assert(std::is_same_v<typename DX::Scalar, T>, "ShortConv<T>: x must have scalar T");
    constexpr const char* where = "ShortConv::step";
    // Bound in place when x is row-major with adjacent channels, copied otherwise.
    const Eigen::Ref<const Matrix<T>> rows(x);
    const Eigen::Index batch = windows.batch();
    if (rows.rows() != batch || rows.cols() != channels() || y.rows() != batch ||
        y.cols() != channels()) {
      throw Error(std::string(where) + ": x is " + detail::shape_string(x) + " and y " +
                  detail::shape_string(y.rows(), y.cols()) +
                  " but both must be B x C = " + detail::shape_string(batch, channels()) +
                  " (one token per sequence of the windows)");
    }
    const ConstHeadsView<T> x_view(rows.data(), batch, 1, 1, channels(),
                                   HeadStrides{rows.outerStride(), 0, 0, 1});
    const HeadsView<T> y_view(y.data(), batch, 1, 1, channels(),
                              HeadStrides{y.outerStride(), 0, 0, 1});
    run(x_view, y_view, nullptr, &windows, where);
  }

  /// The backward of forward_into: d loss / d x into grad_x, and the gradients of the weight
  /// and bias summed over every sequence.
  /// @param x       B x 1 x N x C inputs of the forward
  /// @param grad_y  B x 1 x N x C: d loss / d y
  /// @param grad_x  B x 1 x N x C result: d loss / d x; not x's or grad_y's memory
  /// @return        weight (C x K) and bias (C, empty without) gradients
  template <class X, class G, class O>
  ShortConvGradients<T> backward_into(const HeadsView<X>& x, const HeadsView<G>& grad_y,
                                      const HeadsView<O>& grad_x) const {
    return run_backward(x, grad_y, grad_x, nullptr, nullptr, nullptr, "ShortConv::backward");
  }

  /// The backward of forward_varlen_into (packed sequences, each from zeros).
  /// @param x        1 x 1 x total x C inputs of the forward
  /// @param offsets  S + 1 nondecreasing token offsets, offsets[0] = 0, offsets[S] = total
  /// @param grad_y   1 x 1 x total x C: d loss / d y
  /// @param grad_x   1 x 1 x total x C result: d loss / d x
  /// @return         weight and bias gradients
  template <class X, class G, class O>
  ShortConvGradients<T> backward_varlen_into(const HeadsView<X>& x,
                                             const std::vector<std::int64_t>& offsets,
                                             const HeadsView<G>& grad_y,
                                             const HeadsView<O>& grad_x) const {
    return run_backward(x, grad_y, grad_x, &offsets, nullptr, nullptr,
                        "ShortConv::backward_varlen");
  }

  /// The backward of prefill_into from the windows `initial` (as they were before
  /// the prefill): also d loss / d each initial window, into grad_initial. The windows after
  /// the prefill carry no gradient here.
  /// @param x             B x 1 x N x C inputs of the prefill
  /// @param initial       the B windows the prefill started from
  /// @param grad_y        B x 1 x N x C: d loss / d y
  /// @param grad_x        B x 1 x N x C result: d loss / d x
  /// @param grad_initial  B windows of this convolution, overwritten: d loss / d initial
  /// @return              weight and bias gradients
  template <class X, class G, class O>
  ShortConvGradients<T> backward_into(const HeadsView<X>& x, const ConvWindows<T>& initial,
                                      const HeadsView<G>& grad_y, const HeadsView<O>& grad_x,
                                      ConvWindows<T>& grad_initial) const {
    return run_backward(x, grad_y, grad_x, nullptr, &initial, &grad_initial, "ShortConv::backward");
  }

 private:
  template <class>
  friend class ConvWindows;

  /// Checks x and y (named y_name) against this convolution: one head of C adjacent features,
  /// the same B and N, y not x's memory.
  template <class X, class Y>
  void check_views(const HeadsView<X>& x, const HeadsView<Y>& y, const char* where,
                   const char* y_name = "y") const {
    static_assert(
        std::is_same_v<std::remove_const_t<X>, T> && std::is_same_v<std::remove_const_t<Y>, T>,
        "ShortConv<T>: every view must be of T (const for inputs)");
    auto check_one = [&](const auto& view, const char* name) {
      if (view.heads() != 1 || view.dim() != channels()) {
        throw Error(std::string(where) + ": " + name + " is [B, H, N, D] = " + view.sizes_string() +
                    " but must hold one head of C = " + std::to_string(channels()) +
                    " channels: a [B, N, C] buffer is " +
                    "HeadsView<T>::bnhd(data, BnhdShape{B, N, 1, C})");
      }
      if (view.strides().dim != 1) {
        throw Error(std::string(where) + ": " + name + "'s channels must be adjacent " +
                    "(strides().dim == 1), got " + std::to_string(view.strides().dim));
      }
    };
    check_one(x, "x");
    check_one(y, y_name);
    // Output rows that share memory would be written by two threads (and read back wrong).
    const HeadStrides& ys = y.strides();
    const bool shared_rows =
        (y.tokens() > 1 && ys.token < channels()) || (y.batch() > 1 && ys.batch < channels());
    if (HeadsView<Y>::is_writable && shared_rows) {
      throw Error(std::string(where) + ": " + y_name + "'s rows overlap (strides " +
                  std::to_string(ys.token) + " between tokens and " + std::to_string(ys.batch) +
                  " between sequences, each row C = " + std::to_string(channels()) +
                  " wide): give it rows of its own");
    }
    if (y.batch() != x.batch() || y.tokens() != x.tokens()) {
      throw Error(std::string(where) + ": " + y_name + " is " + y.sizes_string() + " but x is " +
                  x.sizes_string() + "; B and N must match");
    }
    require_own_memory(x, y, "x", y_name, where);
  }

  /// Throws when `out` starts where `in` does (one buffer for both).
  template <class In, class Out>
  void require_own_memory(const HeadsView<In>& in, const HeadsView<Out>& out, const char* in_name,
                          const char* out_name, const char* where) const {
    if (static_cast<const void*>(out.data()) == static_cast<const void*>(in.data())) {
      throw Error(std::string(where) + ": " + out_name + " is " + in_name + "'s memory; the " +
                  "convolution reads " + std::to_string(window_rows()) +
                  " neighbouring tokens of every token it writes, so give " + out_name +
                  " its own buffer");
    }
  }

  /// Scans sequence s's inputs when check_finite is on.
  template <class X>
  void scan(const HeadsView<X>& x, const detail::SequenceRows& sequences, const char* where,
            const char* name = "x") const {
    if (!options_.check_finite) return;
    const int threads = detail::resolve_threads(options_.threads);
    for (Eigen::Index s = 0; s < sequences.count; ++s) {
      const Eigen::Index rows = sequences.rows(s);
      if (rows == 0) continue;
      // Rows are counted from the sequence's first token; with several, the message names it.
      const std::string label =
          sequences.count > 1 ? std::string(name) + " (sequence " + std::to_string(s) + ")" : name;
      detail::require_finite_parallel(
          x.head_rows(sequences.batch_of(s), 0).middleRows(sequences.begin(s), rows), where,
          label.c_str(), threads);
    }
  }

  /// The kernel over every (sequence, band of channels); history(s) is sequence s's window
  /// (W x C, row stride C) or null for zeros.
  template <class X, class Y, class History>
  void convolve(const HeadsView<X>& x, const HeadsView<Y>& y, const detail::SequenceRows& sequences,
                const History& history) const {
    const Eigen::Index bands = (channels() + detail::kConvBand - 1) / detail::kConvBand;
    const Eigen::Index items = sequences.count * bands;
    detail::parallel_for(items, detail::resolve_threads(options_.threads), [&](Eigen::Index item) {
      const Eigen::Index s = item / bands, band = item % bands;
      const Eigen::Index rows = sequences.rows(s);
      if (rows == 0) return;
      const Eigen::Index b = sequences.batch_of(s), begin = sequences.begin(s);
      const HeadStrides& xs = x.strides();
      const HeadStrides& ys = y.strides();
      const detail::ConvOperands<T> operands{x.data() + b * xs.batch + begin * xs.token,
                                             xs.token,
                                             history(s),
                                             channels(),
                                             y.data() + b * ys.batch + begin * ys.token,
                                             ys.token,
                                             taps_.data(),
                                             bias_.size() ? bias_.data() : nullptr,
                                             rows,
                                             channels(),
                                             kernel_size(),
                                             options_.dilation,
                                             options_.activation == ConvActivation::silu};
      const Eigen::Index first = band * detail::kConvBand;
      detail::conv_band(operands, first, std::min(detail::kConvBand, channels() - first));
    });
  }

  /// Checks, then the convolution from zeros or (windows) from each sequence's window, which
  /// then moves on past the sequence's tokens.
  template <class X, class Y>
  void run(const HeadsView<X>& x, const HeadsView<Y>& y, const std::vector<std::int64_t>* offsets,
           ConvWindows<T>* windows, const char* where) const {
    static_assert(!std::is_const_v<Y>, "ShortConv<T>: y must be a writable view");
    check_views(x, y, where);
    const detail::SequenceRows sequences = detail::sequence_rows(x, offsets, where, "x");
    if (windows != nullptr) windows->check(*this, sequences.count, where);
    scan(x, sequences, where);
    if (windows == nullptr) {
      convolve(x, y, sequences, [](Eigen::Index) { return static_cast<const T*>(nullptr); });
      return;
    }
    convolve(x, y, sequences, [&](Eigen::Index s) { return windows->history(s); });
    for (Eigen::Index s = 0; s < sequences.count; ++s) {
      const Eigen::Index rows = sequences.rows(s);
      if (rows == 0) continue;
      windows->advance(s,
                       x.head_rows(sequences.batch_of(s), 0).middleRows(sequences.begin(s), rows));
    }
  }

  /// Checks, then the backward band by band (each band over every sequence in order, so the
  /// sums do not depend on the threads).
  template <class X, class G, class O>
  ShortConvGradients<T> run_backward(const HeadsView<X>& x, const HeadsView<G>& grad_y,
                                     const HeadsView<O>& grad_x,
                                     const std::vector<std::int64_t>* offsets,
                                     const ConvWindows<T>* initial, ConvWindows<T>* grad_initial,
                                     const char* where) const {
    static_assert(!std::is_const_v<O>, "ShortConv<T>: grad_x must be a writable view");
    check_views(x, grad_y, where, "grad_y");
    check_views(x, grad_x, where, "grad_x");
    require_own_memory(grad_y, grad_x, "grad_y", "grad_x", where);
    const detail::SequenceRows sequences = detail::sequence_rows(x, offsets, where, "x");
    if (initial != nullptr) {
      initial->check(*this, sequences.count, where, "initial");
      grad_initial->check(*this, sequences.count, where, "grad_initial");
    }
    scan(x, sequences, where);
    scan(grad_y, sequences, where, "grad_y");
    Matrix<T> grad_taps = Matrix<T>::Zero(kernel_size(), channels());
    Vector<T> grad_bias = Vector<T>::Zero(bias_.size());
    const Eigen::Index bands = (channels() + detail::kConvBand - 1) / detail::kConvBand;
    const HeadStrides &xs = x.strides(), &gs = grad_y.strides(), &os = grad_x.strides();
    detail::parallel_for(bands, detail::resolve_threads(options_.threads), [&](Eigen::Index band) {
      const Eigen::Index first = band * detail::kConvBand;
      const Eigen::Index count = std::min(detail::kConvBand, channels() - first);
      for (Eigen::Index s = 0; s < sequences.count; ++s) {
        const Eigen::Index rows = sequences.rows(s);
        // Windows come with padded batches only, whose sequences are never empty.
        T* const grad_history = grad_initial != nullptr ? grad_initial->history(s) : nullptr;
        if (rows == 0) continue;
        const Eigen::Index b = sequences.batch_of(s), begin = sequences.begin(s);
        const detail::ConvBackwardOperands<T> operands{
            {x.data() + b * xs.batch + begin * xs.token, xs.token,
             initial != nullptr ? initial->history(s) : nullptr, channels(), nullptr, 0,
             taps_.data(), bias_.size() ? bias_.data() : nullptr, rows, channels(), kernel_size(),
             options_.dilation, options_.activation == ConvActivation::silu},
            grad_y.data() + b * gs.batch + begin * gs.token,
            gs.token,
            grad_x.data() + b * os.batch + begin * os.token,
            os.token,
            grad_history,
            grad_taps.data(),
            bias_.size() ? grad_bias.data() : nullptr};
        detail::conv_backward_band(operands, first, count);
      }
    });
    return ShortConvGradients<T>{grad_taps.transpose(), grad_bias};
  }

  Matrix<T> taps_;  // K x C: tap i of every channel in one row, read a packet at a time
  Vector<T> bias_;
  ShortConvOptions options_;
};

/// The rolling windows of B sequences through one ShortConv: each the sequence's last
/// window_rows() = (K - 1) * dilation inputs, oldest first, zeros before its first token: the
/// convolution's whole state, as a RecurrentStateBatch is a layer's. ShortConv's prefill_into,
/// prefill_varlen_into and step_into move it; window(b) reads it, set_window(b, w) writes it.
/// HF's conv_states[b] (C x K, the latest input last) holds window(b) transposed in its last
/// K - 1 columns (dilation 1); ggml keeps the same K - 1 inputs per channel.
/// @tparam T  float or double, as the ShortConv's
template <class T>
class ConvWindows {
 public:
  /// Read-only, W x C.
  using ConstWindowMap = Eigen::Map<const Matrix<T>>;

  /// Zero windows for `batch` sequences of `conv` (or conv.make_windows(batch)).
  /// @param conv   the convolution these windows feed (its C, K and dilation)
  /// @param batch  B >= 1, sequences
  ConvWindows(const ShortConv<T>& conv, Eigen::Index batch)
      : rows_(conv.window_rows()), channels_(conv.channels()) {
    if (batch < 1) {
      throw Error("ConvWindows: batch must be >= 1, got " + std::to_string(batch));
    }
    windows_.assign(static_cast<std::size_t>(batch), Matrix<T>::Zero(rows_, channels_));
  }

  /// B, sequences.
  Eigen::Index batch() const { return static_cast<Eigen::Index>(windows_.size()); }
  /// W = (K - 1) * dilation, rows per window.
  Eigen::Index rows() const { return rows_; }
  /// C, channels.
  Eigen::Index channels() const { return channels_; }

  /// Sequence b's window, W x C, the oldest input first: what a saved state keeps.
  ConstWindowMap window(Eigen::Index b) const {
    return ConstWindowMap(history_data(b, "ConvWindows::window"), rows_, channels_);
  }

  /// Starts sequence b from a window (a saved state, a prefix's), checked whole first.
  /// @param b       sequence, in [0, B)
  /// @param window  W x C finite inputs, the oldest first (HF's conv_states[b], C x K with the
  ///                latest input last: its last W columns, transposed)
  template <class DW>
  void set_window(Eigen::Index b, const Eigen::MatrixBase<DW>& window) {
    static_assert(std::is_same_v<typename DW::Scalar, T>,
                  "ConvWindows<T>::set_window: the window must have scalar T");
    constexpr const char* where = "ConvWindows::set_window";
    T* const data = history_data(b, where);
    if (window.rows() != rows_ || window.cols() != channels_) {
      throw Error(std::string(where) + ": the window is " + detail::shape_string(window) +
                  " but must be W x C = " + detail::shape_string(rows_, channels_) +
                  " ((K - 1) * dilation rows, the oldest input first)");
    }
    detail::require_finite(window, where, "window");
    WindowMap(data, rows_, channels_) = window;
  }

  /// Every window back to zeros (fresh sequences).
  void reset() {
    for (Matrix<T>& window : windows_) window.setZero();
  }
  /// Sequence b's window back to zeros (a new sequence in its slot).
  void reset(Eigen::Index b) {
    WindowMap(history_data(b, "ConvWindows::reset"), rows_, channels_).setZero();
  }

 private:
  template <class>
  friend class ShortConv;
  // A SessionPool moves each session's window in and out of the windows it lends.
  friend struct detail::PoolAccess;
  using WindowMap = Eigen::Map<Matrix<T>>;

  T* history_data(Eigen::Index b, const char* where) {
    check_index(b, where);
    return windows_[static_cast<std::size_t>(b)].data();
  }
  const T* history_data(Eigen::Index b, const char* where) const {
    check_index(b, where);
    return windows_[static_cast<std::size_t>(b)].data();
  }
  void check_index(Eigen::Index b, const char* where) const {
    if (b < 0 || b >= batch()) {
      throw Error(std::string(where) + ": sequence " + std::to_string(b) + " is out of range [0, " +
                  std::to_string(batch()) + ")");
    }
  }

  /// The kernel's history for sequence s: its window, or null when there is none (W = 0).
  const T* history(Eigen::Index s) const {
    return rows_ > 0 ? history_data(s, "ConvWindows") : nullptr;
  }
  /// Its gradient's counterpart, writable.
  T* history(Eigen::Index s) { return rows_ > 0 ? history_data(s, "ConvWindows") : nullptr; }

  /// Throws unless `conv` and `sequences` fit these windows (called `name` in messages). The
  /// windows need no scan: they hold scanned inputs or windows set_window checked.
  void check(const ShortConv<T>& conv, Eigen::Index sequences, const char* where,
             const char* name = "the windows") const {
    if (conv.channels() != channels_ || conv.window_rows() != rows_) {
      throw Error(std::string(where) + ": " + name + " are " + std::to_string(batch()) +
                  " windows of " + std::to_string(rows_) + " x " + std::to_string(channels_) +
                  " but the convolution needs " + std::to_string(conv.window_rows()) + " x " +
                  std::to_string(conv.channels()) +
                  " ((K - 1) * dilation x C): use windows made for this convolution");
    }
    if (sequences != batch()) {
      throw Error(std::string(where) + ": the inputs hold " + std::to_string(sequences) +
                  " sequences but " + name + " " + std::to_string(batch()) +
                  " (one window per sequence)");
    }
  }

  /// Window s after `tokens` (n x C): the last W rows of [window; tokens].
  template <class Rows>
  void advance(Eigen::Index s, const Rows& tokens) {
    if (rows_ == 0) return;
    WindowMap w(history_data(s, "ConvWindows"), rows_, channels_);
    const Eigen::Index n = tokens.rows();
    if (n >= rows_) {
      w = tokens.bottomRows(rows_);
    } else {
      // Rows move up by n: front to back, each source is below its destination.
      for (Eigen::Index r = 0; r + n < rows_; ++r) w.row(r) = w.row(r + n);
      w.bottomRows(n) = tokens;
    }
  }

  Eigen::Index rows_, channels_;
  std::vector<Matrix<T>> windows_;  // B windows of W x C, one allocation each (movable)
};

}  // namespace linattn
