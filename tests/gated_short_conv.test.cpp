// GatedShortConv (LFM2's gated short convolution block between in_proj and out_proj) against
// the block written out in double from HF's Lfm2ShortConv (B, C, x = BCx.chunk(3), y = C *
// conv1d(B * x), the conv causal and depthwise, no activation), prefill and steps continuing
// the forward bit for bit, a fused row, every bad input.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <linattn/gated_short_conv.hpp>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_gated_short_conv {

namespace {

using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::GatedShortConv;
using linattn::HeadStrides;
using linattn::HeadsView;
using linattn::Matrix;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

/// HF's Lfm2ShortConv between its projections, in double: bcx N x 3C, y N x C.
Matrix<double> reference(const Matrix<double>& bcx, const Matrix<double>& weight,
                         const Vector<double>& bias) {
  const Eigen::Index n = bcx.rows(), c = weight.rows(), taps = weight.cols();
  const Matrix<double> bx = bcx.leftCols(c).cwiseProduct(bcx.rightCols(c));
  Matrix<double> y(n, c);
  for (Eigen::Index t = 0; t < n; ++t) {
    for (Eigen::Index ch = 0; ch < c; ++ch) {
      double sum = bias.size() ? bias(ch) : 0.0;
      for (Eigen::Index i = 0; i < taps; ++i) {
        const Eigen::Index src = t - (taps - 1 - i);
        if (src >= 0) sum += weight(ch, i) * bx(src, ch);
      }
      y(t, ch) = bcx(t, c + ch) * sum;
    }
  }
  return y;
}

template <class T>
ConstHeadsView<T> rows_view(const Matrix<T>& m, Eigen::Index batch) {
  return ConstHeadsView<T>::bnhd(m.data(), BnhdShape(batch, m.rows() / batch, 1, m.cols()));
}
template <class T>
HeadsView<T> rows_view(Matrix<T>& m, Eigen::Index batch) {
  return HeadsView<T>::bnhd(m.data(), BnhdShape(batch, m.rows() / batch, 1, m.cols()));
}

}  // namespace

TEMPLATE_TEST_CASE("GatedShortConv: forward, prefill and steps against LFM2's block",
                   "[gated_short_conv]", float, double) {
  using T = TestType;
  const Eigen::Index c = 40, batch = 2, prompt = 300, decoded = 4, total = prompt + decoded;
  const Matrix<double> weight = gaussian<double>(c, 3, 1, 0.5);
  const bool with_bias = GENERATE(false, true);
  const Vector<double> bias =
      with_bias ? Vector<double>(gaussian<double>(c, 1, 2)) : Vector<double>();
  const GatedShortConv<T> block(weight.cast<T>(), bias.cast<T>());
  std::vector<Matrix<double>> sequences{gaussian<double>(total, 3 * c, 3),
                                        gaussian<double>(total, 3 * c, 4)};
  Matrix<T> bcx(batch * total, 3 * c);
  for (Eigen::Index s = 0; s < batch; ++s) {
    bcx.middleRows(s * total, total) = sequences[static_cast<std::size_t>(s)].cast<T>();
  }
  Matrix<T> forward(batch * total, c);
  block.forward_into(rows_view(bcx, batch), rows_view(forward, batch));
  for (Eigen::Index s = 0; s < batch; ++s) {
    const Matrix<double> expected =
        reference(bcx.middleRows(s * total, total).template cast<double>(), weight, bias);
    CHECK(relative_error(forward.middleRows(s * total, total), expected) <
          (std::is_same_v<T, float> ? 1e-5 : 1e-13));
  }
  // A prompt, then steps: the convolution's prefill and steps agree bit for bit.
  auto windows = block.make_states(batch);
  Matrix<T> head(batch * prompt, 3 * c), pieces(batch * total, c);
  for (Eigen::Index s = 0; s < batch; ++s) {
    head.middleRows(s * prompt, prompt) = bcx.middleRows(s * total, prompt);
  }
  Matrix<T> prefilled(batch * prompt, c);
  block.prefill_into(windows, rows_view(head, batch), rows_view(prefilled, batch));
  for (Eigen::Index s = 0; s < batch; ++s) {
    pieces.middleRows(s * total, prompt) = prefilled.middleRows(s * prompt, prompt);
  }
  for (Eigen::Index t = prompt; t < total; ++t) {
    Matrix<T> token(batch, 3 * c), y(batch, c);
    for (Eigen::Index s = 0; s < batch; ++s) token.row(s) = bcx.row(s * total + t);
    block.step_into(windows, rows_view(token, batch), rows_view(y, batch));
    for (Eigen::Index s = 0; s < batch; ++s) pieces.row(s * total + t) = y.row(s);
  }
  CHECK(pieces == forward);
}

TEST_CASE("GatedShortConv: checkpoints are the windows of the prefixes run alone",
          "[gated_short_conv]") {
  using T = float;
  const Eigen::Index c = 12, batch = 2, tokens = 260;
  const GatedShortConv<T> block(gaussian<T>(c, 3, 7));
  std::vector<Matrix<T>> sequences{gaussian<T>(tokens, 3 * c, 8), gaussian<T>(tokens, 3 * c, 9)};
  Matrix<T> bcx(batch * tokens, 3 * c);
  for (Eigen::Index s = 0; s < batch; ++s) {
    bcx.middleRows(s * tokens, tokens) = sequences[static_cast<std::size_t>(s)];
  }
  const std::vector<Eigen::Index> positions{1, 2, 100, 260};
  std::vector<GatedShortConv<T>::States> snapshots;
  auto windows = block.make_states(batch);
  Matrix<T> y(batch * tokens, c);
  block.prefill_into(windows, rows_view(bcx, batch), rows_view(y, batch), positions, snapshots);
  REQUIRE(snapshots.size() == positions.size());
  for (std::size_t i = 0; i < positions.size(); ++i) {
    CAPTURE(i);
    Matrix<T> prefix(batch * positions[i], 3 * c), out(batch * positions[i], c);
    for (Eigen::Index s = 0; s < batch; ++s) {
      prefix.middleRows(s * positions[i], positions[i]) =
          sequences[static_cast<std::size_t>(s)].topRows(positions[i]);
    }
    auto alone = block.make_states(batch);
    block.prefill_into(alone, rows_view(prefix, batch), rows_view(out, batch));
    for (Eigen::Index b = 0; b < batch; ++b) CHECK(snapshots[i].window(b) == alone.window(b));
  }
}

TEST_CASE("GatedShortConv: a fused row, and bad input throws before anything moves",
          "[gated_short_conv]") {
  using T = float;
  using Catch::Matchers::Contains;
  const Eigen::Index c = 16, batch = 2, tokens = 9;
  const GatedShortConv<T> block(gaussian<T>(c, 3, 5));
  const Matrix<T> bcx = gaussian<T>(batch * tokens, 3 * c, 6);
  Matrix<T> expected(batch * tokens, c);
  block.forward_into(rows_view(bcx, batch), rows_view(expected, batch));
  // in_proj's output as columns 2.. of a wider row.
  Matrix<T> fused = Matrix<T>::Zero(batch * tokens, 3 * c + 5);
  fused.middleCols(2, 3 * c) = bcx;
  const ConstHeadsView<T> in(fused.data() + 2, batch, 1, tokens, 3 * c,
                             HeadStrides{tokens * fused.cols(), 0, fused.cols(), 1});
  Matrix<T> y(batch * tokens, c);
  block.forward_into(in, rows_view(y, batch));
  CHECK(y == expected);

  auto windows = block.make_states(batch);
  block.prefill_into(windows, rows_view(bcx, batch), rows_view(y, batch));
  const auto before = windows;
  CHECK_THROWS_WITH(
      block.prefill_into(windows, rows_view(bcx, batch),
                         HeadsView<T>::bnhd(y.data(), BnhdShape(batch, tokens, 1, 8))),
      Contains("out is [B, H, N, D]"));
  Matrix<T> shared = bcx;
  CHECK_THROWS_WITH(
      block.prefill_into(windows, rows_view(shared, batch),
                         HeadsView<T>::bnhd(shared.data(), BnhdShape(batch, tokens, 1, c))),
      Contains("out overlaps bcx's memory"));
  auto three = block.make_states(3);
  CHECK_THROWS_WITH(block.prefill_into(three, rows_view(bcx, batch), rows_view(y, batch)),
                    Contains("make_states(B)"));
  Matrix<T> poisoned = bcx;
  poisoned(tokens + 2, 2 * c + 1) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH(block.prefill_into(windows, rows_view(poisoned, batch), rows_view(y, batch)),
                    Contains("bcx (sequence 1, head 0; rows are tokens) has a non-finite value"));
  CHECK_THROWS_WITH(block.step_into(windows, rows_view(bcx, batch), rows_view(y, batch)),
                    Contains("a step takes one"));
  for (Eigen::Index b = 0; b < batch; ++b) CHECK(windows.window(b) == before.window(b));
}

}  // namespace linattn_test_gated_short_conv
