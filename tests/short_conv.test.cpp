// ShortConv and ConvWindows: the depthwise causal convolution against a naive one in double,
// prefill and steps against one call over the concatenation, windows in and out, dilation,
// packed sequences, strided views, threads and every bad input.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/short_conv.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_short_conv {

namespace {

using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::ConvActivation;
using linattn::ConvWindows;
using linattn::HeadStrides;
using linattn::HeadsView;
using linattn::Matrix;
using linattn::ShortConv;
using linattn::ShortConvOptions;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

/// The convolution straight from its formula, in double: `history` (W x C, oldest first)
/// precedes x (N x C); y[t, c] = act(bias[c] + sum_i w(c, i) x[t - (K - 1 - i) d, c]).
Matrix<double> naive_conv(const Matrix<double>& x, const Matrix<double>& history,
                          const Matrix<double>& weight, const Vector<double>& bias,
                          Eigen::Index dilation, bool silu) {
  const Eigen::Index n = x.rows(), c = x.cols(), k = weight.cols(), w = history.rows();
  Matrix<double> y(n, c);
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index ch = 0; ch < c; ++ch) {
      double sum = bias.size() ? bias(ch) : 0.0;
      for (Eigen::Index i = 0; i < k; ++i) {
        const Eigen::Index src = t - (k - 1 - i) * dilation;
        const double in = src >= 0 ? x(src, ch) : (w + src >= 0 ? history(w + src, ch) : 0.0);
        sum += weight(ch, i) * in;
      }
      y(t, ch) = silu ? sum / (1.0 + std::exp(-sum)) : sum;
    }
  }
  return y;
}

/// A [1, N, C] view of a matrix's rows.
template <class T>
HeadsView<T> rows_view(Matrix<T>& m) {
  return HeadsView<T>::bnhd(m.data(), BnhdShape(1, m.rows(), 1, m.cols()));
}
template <class T>
ConstHeadsView<T> rows_view(const Matrix<T>& m) {
  return ConstHeadsView<T>::bnhd(m.data(), BnhdShape(1, m.rows(), 1, m.cols()));
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-6 : 1e-14;
}

}  // namespace

TEMPLATE_TEST_CASE("ShortConv: forward against the naive convolution", "[short_conv]", float,
                   double) {
  using T = TestType;
  // C = 1,101: a band of 1,024 channels and one of 77, whose last channels take the scalar
  // tail whatever the packet size.
  for (const Eigen::Index k : {1, 2, 3, 4, 5, 6, 7, 8}) {
    for (const Eigen::Index dilation : {1, 3}) {
      for (const bool silu : {false, true}) {
        for (const bool with_bias : {false, true}) {
          const Eigen::Index c = 1101, n = 29;
          const std::uint64_t seed = 100 + 10 * k + dilation;
          const Matrix<T> weight = gaussian<T>(c, k, seed, 0.5);
          const Vector<T> bias = with_bias ? Vector<T>(gaussian<T>(c, 1, seed + 1)) : Vector<T>();
          ShortConvOptions options;
          options.dilation = dilation;
          options.activation = silu ? ConvActivation::silu : ConvActivation::none;
          const ShortConv<T> conv(weight, bias, options);
          CHECK(conv.window_rows() == (k - 1) * dilation);
          CHECK(conv.weight() == weight);
          const Matrix<T> x = gaussian<T>(n, c, seed + 2);
          const Matrix<double> expected = naive_conv(
              x.template cast<double>(), Matrix<double>(0, c), weight.template cast<double>(),
              bias.template cast<double>(), dilation, silu);
          INFO("K = " << k << ", dilation " << dilation << ", silu " << silu << ", bias "
                      << with_bias);
          CHECK(relative_error(conv.forward(x), expected) < tolerance<T>());
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("ConvWindows: prefill in pieces and steps equal one forward, bit for bit",
                   "[short_conv]", float, double) {
  using T = TestType;
  const Eigen::Index batch = 2, c = 37, k = 4, n = 23;
  for (const Eigen::Index dilation : {1, 2}) {
    ShortConvOptions options;
    options.dilation = dilation;
    options.activation = ConvActivation::silu;
    const ShortConv<T> conv(gaussian<T>(c, k, 7), Vector<T>(gaussian<T>(c, 1, 8)), options);
    // B = 2 sequences in one [B, N, C] buffer.
    const Matrix<T> x = gaussian<T>(batch * n, c, 9);
    Matrix<T> whole(batch * n, c);
    conv.forward_into(ConstHeadsView<T>::bnhd(x.data(), BnhdShape(batch, n, 1, c)),
                      HeadsView<T>::bnhd(whole.data(), BnhdShape(batch, n, 1, c)));
    // Pieces: 2 tokens (fewer than W when dilation is 2), then 9, then steps.
    ConvWindows<T> windows(conv, batch);
    const HeadStrides strides{n * c, 0, c, 1};
    Matrix<T> pieces(batch * n, c);
    Eigen::Index done = 0;
    for (const Eigen::Index len : {2, 9}) {
      conv.prefill_into(windows, ConstHeadsView<T>(x.data() + done * c, batch, 1, len, c, strides),
                        HeadsView<T>(pieces.data() + done * c, batch, 1, len, c, strides));
      done += len;
    }
    for (; done < n; ++done) {
      Matrix<T> token(batch, c), out(batch, c);
      for (Eigen::Index b = 0; b < batch; ++b) token.row(b) = x.row(b * n + done);
      conv.step_into(windows, token, out);
      for (Eigen::Index b = 0; b < batch; ++b) pieces.row(b * n + done) = out.row(b);
    }
    CHECK(pieces == whole);
    // The windows hold each sequence's last W inputs, oldest first.
    for (Eigen::Index b = 0; b < batch; ++b) {
      CHECK(windows.window(b) == x.middleRows(b * n + n - conv.window_rows(), conv.window_rows()));
    }
    CHECK(relative_error(whole.topRows(n),
                         naive_conv(x.topRows(n).template cast<double>(), Matrix<double>(0, c),
                                    conv.weight().template cast<double>(),
                                    conv.bias().template cast<double>(), dilation, true)) <
          tolerance<T>());
  }
}

TEST_CASE("ConvWindows: a window in continues a sequence, a window out is its last inputs",
          "[short_conv]") {
  using T = double;
  const Eigen::Index c = 20, k = 3, n = 6;
  const ShortConv<T> conv(gaussian<T>(c, k, 11));
  ConvWindows<T> windows(conv, 1);
  const Matrix<T> history = gaussian<T>(conv.window_rows(), c, 12);
  windows.set_window(0, history);
  const Matrix<T> x = gaussian<T>(n, c, 13);
  Matrix<T> y(n, c);
  conv.prefill_into(windows, rows_view(x), rows_view(y));
  CHECK(relative_error(y, naive_conv(x, history, conv.weight(), Vector<T>(), 1, false)) < 1e-14);
  // The same as one call over history and x from zeros, past the history's outputs.
  Matrix<T> joined(conv.window_rows() + n, c);
  joined << history, x;
  CHECK(relative_error(y, conv.forward(joined).bottomRows(n)) < 1e-14);
  CHECK(windows.window(0) == x.bottomRows(conv.window_rows()));
  windows.reset();
  CHECK(windows.window(0).isZero(0));
}

TEST_CASE("ShortConv: packed sequences equal each sequence alone", "[short_conv]") {
  using T = float;
  const Eigen::Index c = 48, k = 4;
  ShortConvOptions options;
  options.activation = ConvActivation::silu;
  const ShortConv<T> conv(gaussian<T>(c, k, 21), options);
  // Lengths 5, 0 (empty), 2 (shorter than W = 3) and 7.
  const std::vector<std::int64_t> offsets{0, 5, 5, 7, 14};
  const Matrix<T> x = gaussian<T>(14, c, 22);
  Matrix<T> packed(14, c);
  conv.forward_varlen_into(rows_view(x), offsets, rows_view(packed));
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
    const Eigen::Index begin = offsets[s], len = offsets[s + 1] - offsets[s];
    if (len == 0) continue;
    CHECK(packed.middleRows(begin, len) == conv.forward(x.middleRows(begin, len)));
  }
  // Through windows, every one different: sequence s continues window s, the empty one keeps
  // its window, the short one keeps the window's last row before its two inputs.
  ConvWindows<T> windows = conv.make_windows(4);
  std::vector<Matrix<T>> saved;
  for (Eigen::Index s = 0; s < 4; ++s) {
    saved.push_back(gaussian<T>(3, c, 23 + s));
    windows.set_window(s, saved.back());
  }
  Matrix<T> again(14, c);
  conv.prefill_varlen_into(windows, rows_view(x), offsets, rows_view(again));
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
    const Eigen::Index begin = offsets[s], len = offsets[s + 1] - offsets[s];
    if (len == 0) continue;
    INFO("sequence " << s);
    CHECK(relative_error(
              again.middleRows(begin, len),
              naive_conv(x.middleRows(begin, len).template cast<double>(),
                         saved[s].template cast<double>(), conv.weight().template cast<double>(),
                         Vector<double>(), 1, true)) < 2e-6);
  }
  CHECK(windows.window(0) == x.middleRows(2, 3));
  CHECK(windows.window(1) == saved[1]);
  CHECK(windows.window(2).topRows(1) == saved[2].bottomRows(1));
  CHECK(windows.window(2).bottomRows(2) == x.middleRows(5, 2));
  CHECK(windows.window(3) == x.middleRows(11, 3));
  windows.reset(3);
  CHECK(windows.window(3).isZero(0));
  CHECK(windows.window(2).bottomRows(2) == x.middleRows(5, 2));
}

TEST_CASE("ShortConv: C channels of a wider fused row, read and written in place", "[short_conv]") {
  using T = float;
  // A fused projection [B, N, 3C]: the convolution reads the middle C columns and writes the
  // last C, with token stride 3C.
  const Eigen::Index batch = 2, n = 9, c = 40, width = 3 * c;
  const ShortConv<T> conv(gaussian<T>(c, 4, 31), Vector<T>(gaussian<T>(c, 1, 32)));
  Matrix<T> fused = gaussian<T>(batch * n, width, 33);
  const HeadStrides strides{n * width, 0, width, 1};
  conv.forward_into(ConstHeadsView<T>(fused.data() + c, batch, 1, n, c, strides),
                    HeadsView<T>(fused.data() + 2 * c, batch, 1, n, c, strides));
  for (Eigen::Index b = 0; b < batch; ++b) {
    const Matrix<T> input = fused.block(b * n, c, n, c);
    CHECK(fused.block(b * n, 2 * c, n, c) == conv.forward(input));
  }
  // A step reads B rows of the fused buffer in place (row stride 3C) and writes into another.
  ConvWindows<T> windows(conv, batch);
  Matrix<T> out(batch, c);
  const Eigen::Map<const Matrix<T>, 0, Eigen::OuterStride<>> step_rows(
      fused.data() + c, batch, c, Eigen::OuterStride<>(n * width));
  conv.step_into(windows, step_rows, out);
  for (Eigen::Index b = 0; b < batch; ++b) {
    CHECK(out.row(b) == fused.block(b * n, 2 * c, 1, c));
  }
}

TEST_CASE("ShortConv: backward against finite differences of the naive convolution",
          "[short_conv]") {
  using T = double;
  const Eigen::Index c = 19;
  // K = 1 (no window), N = 3 below W = 6 (K = 4, dilation 2): a token's window reaches past
  // the history's start and the history's rows are read by only some taps.
  using Case = std::tuple<Eigen::Index, Eigen::Index, Eigen::Index>;  // K, N, dilation
  for (const Case& shape : std::vector<Case>{{4, 7, 1}, {4, 7, 2}, {4, 3, 2}, {1, 5, 1}}) {
    const Eigen::Index k = std::get<0>(shape), n = std::get<1>(shape),
                       dilation = std::get<2>(shape);
    for (const bool silu : {false, true}) {
      ShortConvOptions options;
      options.dilation = dilation;
      options.activation = silu ? ConvActivation::silu : ConvActivation::none;
      const Matrix<T> weight = gaussian<T>(c, k, 61, 0.5);
      const Vector<T> bias = gaussian<T>(c, 1, 62);
      const ShortConv<T> conv(weight, bias, options);
      const Eigen::Index w = conv.window_rows();
      const Matrix<T> x = gaussian<T>(n, c, 63), history = gaussian<T>(w, c, 64);
      const Matrix<T> grad_y = gaussian<T>(n, c, 65);
      // loss = sum(grad_y .* y), y from the history.
      auto loss = [&](const Matrix<T>& xx, const Matrix<T>& hh, const Matrix<T>& ww,
                      const Vector<T>& bb) {
        return (naive_conv(xx, hh, ww, bb, dilation, silu).array() * grad_y.array()).sum();
      };
      const double h = 1e-6;
      auto numeric = [&](auto perturb) { return (perturb(h) - perturb(-h)) / (2 * h); };
      ConvWindows<T> initial(conv, 1), grad_initial(conv, 1);
      initial.set_window(0, history);
      Matrix<T> grad_x(n, c);
      const auto grads = conv.backward_into(rows_view(x), initial, rows_view(grad_y),
                                            rows_view(grad_x), grad_initial);
      double worst = 0.0;
      for (Eigen::Index ch = 0; ch < c; ++ch) {
        for (Eigen::Index i = 0; i < k; ++i) {
          const double expected = numeric([&](double e) {
            Matrix<T> ww = weight;
            ww(ch, i) += e;
            return loss(x, history, ww, bias);
          });
          worst = std::max(worst, std::abs(grads.weight(ch, i) - expected));
        }
        const double expected_bias = numeric([&](double e) {
          Vector<T> bb = bias;
          bb(ch) += e;
          return loss(x, history, weight, bb);
        });
        worst = std::max(worst, std::abs(grads.bias(ch) - expected_bias));
        for (Eigen::Index t = 0; t < n; ++t) {
          const double expected = numeric([&](double e) {
            Matrix<T> xx = x;
            xx(t, ch) += e;
            return loss(xx, history, weight, bias);
          });
          worst = std::max(worst, std::abs(grad_x(t, ch) - expected));
        }
        for (Eigen::Index r = 0; r < w; ++r) {
          const double expected = numeric([&](double e) {
            Matrix<T> hh = history;
            hh(r, ch) += e;
            return loss(x, hh, weight, bias);
          });
          worst = std::max(worst, std::abs(grad_initial.window(0)(r, ch) - expected));
        }
      }
      INFO("K = " << k << ", N = " << n << ", dilation " << dilation << ", silu " << silu);
      CHECK(worst < 1e-7);
      // From zeros: the same as from a zero window.
      Matrix<T> grad_x0(n, c);
      ConvWindows<T> zeros(conv, 1), grad_zeros(conv, 1);
      const auto from_zeros =
          conv.backward_into(rows_view(x), rows_view(grad_y), rows_view(grad_x0));
      const auto from_window =
          conv.backward_into(rows_view(x), zeros, rows_view(grad_y), rows_view(grad_x), grad_zeros);
      CHECK(grad_x0 == grad_x);
      CHECK(from_zeros.weight == from_window.weight);
      CHECK(from_zeros.bias == from_window.bias);
    }
  }
}

TEST_CASE("ShortConv: the backward of a batch from windows equals each sequence's",
          "[short_conv]") {
  using T = float;
  const Eigen::Index batch = 3, n = 5, c = 33;
  ShortConvOptions options;
  options.dilation = 2;
  options.activation = ConvActivation::silu;
  const ShortConv<T> conv(gaussian<T>(c, 3, 81), Vector<T>(gaussian<T>(c, 1, 82)), options);
  const Matrix<T> x = gaussian<T>(batch * n, c, 83), grad_y = gaussian<T>(batch * n, c, 84);
  ConvWindows<T> initial = conv.make_windows(batch), grad_initial = conv.make_windows(batch);
  for (Eigen::Index b = 0; b < batch; ++b) {
    initial.set_window(b, gaussian<T>(conv.window_rows(), c, 85 + b));
  }
  Matrix<T> grad_x(batch * n, c);
  const BnhdShape shape(batch, n, 1, c);
  const auto grads = conv.backward_into(ConstHeadsView<T>::bnhd(x.data(), shape), initial,
                                        ConstHeadsView<T>::bnhd(grad_y.data(), shape),
                                        HeadsView<T>::bnhd(grad_x.data(), shape), grad_initial);
  Matrix<double> weight_sum = Matrix<double>::Zero(c, 3);
  for (Eigen::Index b = 0; b < batch; ++b) {
    const Matrix<T> xs = x.middleRows(b * n, n), gs = grad_y.middleRows(b * n, n);
    ConvWindows<T> one = conv.make_windows(1), grad_one = conv.make_windows(1);
    one.set_window(0, initial.window(b));
    Matrix<T> alone(n, c);
    const auto each =
        conv.backward_into(rows_view(xs), one, rows_view(gs), rows_view(alone), grad_one);
    CHECK(grad_x.middleRows(b * n, n) == alone);
    CHECK(grad_initial.window(b) == grad_one.window(0));
    weight_sum += each.weight.template cast<double>();
  }
  CHECK(relative_error(grads.weight, weight_sum) < 1e-6);
}

TEST_CASE("ShortConv: the packed backward equals each sequence's", "[short_conv]") {
  using T = float;
  const Eigen::Index c = 1050, k = 3;  // two bands of channels
  ShortConvOptions options;
  options.activation = ConvActivation::silu;
  const ShortConv<T> conv(gaussian<T>(c, k, 71), Vector<T>(gaussian<T>(c, 1, 72)), options);
  const std::vector<std::int64_t> offsets{0, 6, 6, 7, 15};
  const Matrix<T> x = gaussian<T>(15, c, 73), grad_y = gaussian<T>(15, c, 74);
  Matrix<T> grad_x(15, c);
  const auto packed =
      conv.backward_varlen_into(rows_view(x), offsets, rows_view(grad_y), rows_view(grad_x));
  Matrix<double> weight_sum = Matrix<double>::Zero(c, k);
  Vector<double> bias_sum = Vector<double>::Zero(c);
  for (std::size_t s = 0; s + 1 < offsets.size(); ++s) {
    const Eigen::Index begin = offsets[s], len = offsets[s + 1] - offsets[s];
    if (len == 0) continue;
    const Matrix<T> xs = x.middleRows(begin, len), gs = grad_y.middleRows(begin, len);
    Matrix<T> alone(len, c);
    const auto grads = conv.backward_into(rows_view(xs), rows_view(gs), rows_view(alone));
    CHECK(grad_x.middleRows(begin, len) == alone);
    weight_sum += grads.weight.template cast<double>();
    bias_sum += grads.bias.template cast<double>();
  }
  CHECK(relative_error(packed.weight, weight_sum) < 1e-6);
  CHECK(relative_error(packed.bias, bias_sum) < 1e-6);
}

#ifdef _OPENMP
TEST_CASE("ShortConv: threads give the same bits", "[short_conv]") {
  using T = float;
  const Eigen::Index batch = 3, n = 17, c = 2100;  // three bands of channels
  ShortConvOptions one, four;
  one.threads = 1;
  four.threads = 4;
  const Matrix<T> weight = gaussian<T>(c, 4, 41);
  const Matrix<T> x = gaussian<T>(batch * n, c, 42);
  Matrix<T> serial(batch * n, c), threaded(batch * n, c);
  const BnhdShape shape(batch, n, 1, c);
  ShortConv<T>(weight, one)
      .forward_into(ConstHeadsView<T>::bnhd(x.data(), shape),
                    HeadsView<T>::bnhd(serial.data(), shape));
  ShortConv<T>(weight, four)
      .forward_into(ConstHeadsView<T>::bnhd(x.data(), shape),
                    HeadsView<T>::bnhd(threaded.data(), shape));
  CHECK(serial == threaded);
  // The backward sums every sequence of a band in order, whatever the threads.
  const Matrix<T> grad_y = gaussian<T>(batch * n, c, 43);
  Matrix<T> gx_serial(batch * n, c), gx_threaded(batch * n, c);
  const auto g_serial = ShortConv<T>(weight, one)
                            .backward_into(ConstHeadsView<T>::bnhd(x.data(), shape),
                                           ConstHeadsView<T>::bnhd(grad_y.data(), shape),
                                           HeadsView<T>::bnhd(gx_serial.data(), shape));
  const auto g_threaded = ShortConv<T>(weight, four)
                              .backward_into(ConstHeadsView<T>::bnhd(x.data(), shape),
                                             ConstHeadsView<T>::bnhd(grad_y.data(), shape),
                                             HeadsView<T>::bnhd(gx_threaded.data(), shape));
  CHECK(gx_serial == gx_threaded);
  CHECK(g_serial.weight == g_threaded.weight);
}
#endif

TEST_CASE("ShortConv: bad input throws before anything moves", "[short_conv]") {
  using T = float;
  using Catch::Matchers::Contains;
  const Eigen::Index c = 8;
  const Matrix<T> weight = gaussian<T>(c, 4, 51);
  CHECK_THROWS_WITH(ShortConv<T>(Matrix<T>(c, 9)), Contains("1 <= K <= 8"));
  CHECK_THROWS_WITH(ShortConv<T>(Matrix<T>(c, 0)), Contains("1 <= K <= 8"));
  CHECK_THROWS_WITH(ShortConv<T>(weight, Vector<T>::Zero(c + 1)), Contains("bias"));
  ShortConvOptions bad;
  bad.dilation = 0;
  CHECK_THROWS_WITH(ShortConv<T>(weight, bad), Contains("dilation must be in [1, 1048576]"));
  bad.dilation = ShortConv<T>::kMaxDilation + 1;
  CHECK_THROWS_WITH(ShortConv<T>(weight, bad), Contains("dilation must be in [1, 1048576]"));
  Matrix<T> nan_weight = weight;
  nan_weight(2, 1) = std::nanf("");
  CHECK_THROWS_WITH(ShortConv<T>(nan_weight), Contains("weight has a non-finite value"));

  const ShortConv<T> conv(weight);
  Matrix<T> x = gaussian<T>(5, c, 52), y = Matrix<T>::Constant(5, c, 7.0f);
  const Matrix<T> y_before = y;
  // Two heads of C / 2 instead of one of C.
  CHECK_THROWS_WITH(
      conv.forward_into(ConstHeadsView<T>::bnhd(x.data(), BnhdShape(1, 5, 2, c / 2)), rows_view(y)),
      Contains("BnhdShape{B, N, 1, C}"));
  CHECK_THROWS_WITH(
      conv.forward_into(ConstHeadsView<T>(x.data(), 1, 1, 5, c, {0, 0, c, 2}), rows_view(y)),
      Contains("adjacent"));
  CHECK_THROWS_WITH(conv.forward_into(rows_view(x), rows_view(x)), Contains("own buffer"));
  CHECK_THROWS_WITH(
      conv.forward_into(rows_view(x), HeadsView<T>(y.data(), 1, 1, 5, c, {0, 0, c / 2, 1})),
      Contains("y's rows overlap"));
  Matrix<T> short_y(4, c);
  CHECK_THROWS_WITH(conv.forward_into(rows_view(x), rows_view(short_y)), Contains("N must match"));
  CHECK_THROWS_WITH(conv.forward_varlen_into(rows_view(x), {0, 2, 4}, rows_view(y)),
                    Contains("offsets.back()"));
  x(3, 5) = std::nanf("");
  CHECK_THROWS_WITH(conv.forward_into(rows_view(x), rows_view(y)),
                    Contains("x has a non-finite value") && Contains("row 3, column 5"));
  CHECK(y == y_before);

  // Windows: another convolution's, another batch, a non-finite window, a bad step.
  ConvWindows<T> windows(conv, 2);
  const Matrix<T> saved = gaussian<T>(3, c, 53);
  windows.set_window(0, saved);
  ShortConvOptions dilated;
  dilated.dilation = 2;
  x(3, 5) = 1.0f;
  CHECK_THROWS_WITH(conv.prefill_into(windows, rows_view(x), rows_view(y)),
                    Contains("1 sequences but the windows 2"));
  CHECK_THROWS_WITH(ShortConv<T>(weight, dilated)
                        .prefill_varlen_into(windows, rows_view(x), {0, 2, 5}, rows_view(y)),
                    Contains("the convolution needs 6 x 8"));
  Matrix<T> token = gaussian<T>(2, c, 54), out = Matrix<T>::Constant(2, c, 3.0f);
  const Matrix<T> out_before = out;
  CHECK_THROWS_WITH(conv.step_into(windows, token.topRows(1), out), Contains("B x C = 2 x 8"));
  CHECK_THROWS_WITH(conv.step_into(windows, token, token), Contains("own buffer"));
  token(1, 0) = std::numeric_limits<T>::infinity();
  CHECK_THROWS_WITH(conv.step_into(windows, token, out),
                    Contains("x (sequence 1) has a non-finite value"));
  token(1, 0) = 0.0f;
  Matrix<T> nan_window = gaussian<T>(3, c, 57);
  nan_window(2, 3) = std::nanf("");
  CHECK_THROWS_WITH(windows.set_window(1, nan_window),
                    Contains("window has a non-finite value") && Contains("row 2, column 3"));
  CHECK_THROWS_WITH(windows.set_window(1, Matrix<T>(c, 4)), Contains("must be W x C = 3 x 8"));
  CHECK_THROWS_WITH(windows.window(2), Contains("sequence 2 is out of range"));
  CHECK_THROWS_WITH(windows.set_window(-1, saved), Contains("out of range"));
  CHECK(out == out_before);
  CHECK(windows.window(0) == saved);
  CHECK_THROWS_WITH(ConvWindows<T>(conv, 0), Contains("batch must be >= 1"));
  // The backward: grad_x on grad_y's memory, windows of another convolution.
  Matrix<T> x1 = gaussian<T>(5, c, 55), grad_y = gaussian<T>(5, c, 56);
  CHECK_THROWS_WITH(conv.backward_into(rows_view(x1), rows_view(grad_y), rows_view(grad_y)),
                    Contains("grad_x is grad_y's memory"));
  ConvWindows<T> one_window(conv, 1), dilated_window(ShortConv<T>(weight, dilated), 1);
  Matrix<T> grad_x(5, c);
  CHECK_THROWS_WITH(conv.backward_into(rows_view(x1), one_window, rows_view(grad_y),
                                       rows_view(grad_x), dilated_window),
                    Contains("grad_initial are 1 windows of 6 x 8"));
}

}  // namespace linattn_test_short_conv
