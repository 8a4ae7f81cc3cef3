// OutputNorm: each model's output norm against its formula written out in double (HF's
// Qwen3NextRMSNormGated, FLA's FusedRMSNormGated with sigmoid for Kimi, state-spaces/mamba's
// grouped RMSNormGated and HF's ungrouped one, RWKV-7's GroupNorm), strided and in-place views,
// 16-bit views rounded once, threads and every bad input.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <linattn/output_norm.hpp>
#include <string>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_output_norm {

namespace {

using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::HeadStrides;
using linattn::HeadsView;
using linattn::Matrix;
using linattn::NormGate;
using linattn::NormType;
using linattn::OutputNorm;
using linattn::OutputNormOptions;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }

/// One token's flat row of H * D channels (c = h * D + d) for every (sequence, token): rows
/// b * N + n, as a contiguous [B, N, H, D] tensor holds them.
struct Shape {
  Eigen::Index batch, tokens, heads, dim;
  Eigen::Index rows() const { return batch * tokens; }
  Eigen::Index channels() const { return heads * dim; }
  BnhdShape bnhd() const { return BnhdShape(batch, tokens, heads, dim); }
};

/// HF Qwen3NextRMSNormGated (w, not 1 + w) and, with `sigmoid_gate`, FLA's FusedRMSNormGated
/// with activation "sigmoid" (Kimi): per head, y = w * o * rsqrt(mean(o^2) + eps) * act(z).
Matrix<double> reference_gated_after(const Matrix<double>& o, const Matrix<double>& z,
                                     const Vector<double>& w, Eigen::Index dim, double eps,
                                     bool sigmoid_gate) {
  Matrix<double> y(o.rows(), o.cols());
  for (Eigen::Index r = 0; r < o.rows(); ++r) {
    for (Eigen::Index h = 0; h < o.cols() / dim; ++h) {
      double variance = 0.0;
      for (Eigen::Index d = 0; d < dim; ++d) variance += o(r, h * dim + d) * o(r, h * dim + d);
      variance /= static_cast<double>(dim);
      for (Eigen::Index d = 0; d < dim; ++d) {
        const double normed = o(r, h * dim + d) / std::sqrt(variance + eps);
        const double gate = z(r, h * dim + d);
        y(r, h * dim + d) = w(d) * normed * (sigmoid_gate ? sigmoid(gate) : silu(gate));
      }
    }
  }
  return y;
}

/// state-spaces/mamba's RMSNormGated with norm_before_gate=False: u = o * silu(z), then
/// per group of `group` flat channels y = w * u * rsqrt(mean(u^2) + eps), w per channel.
Matrix<double> reference_mamba2(const Matrix<double>& o, const Matrix<double>& z,
                                const Vector<double>& w, Eigen::Index group, double eps) {
  Matrix<double> y(o.rows(), o.cols());
  for (Eigen::Index r = 0; r < o.rows(); ++r) {
    std::vector<double> u(static_cast<std::size_t>(o.cols()));
    for (Eigen::Index c = 0; c < o.cols(); ++c) u[c] = o(r, c) * silu(z(r, c));
    for (Eigen::Index g = 0; g < o.cols() / group; ++g) {
      double variance = 0.0;
      for (Eigen::Index c = g * group; c < (g + 1) * group; ++c) variance += u[c] * u[c];
      variance /= static_cast<double>(group);
      for (Eigen::Index c = g * group; c < (g + 1) * group; ++c) {
        y(r, c) = w(c) * u[c] / std::sqrt(variance + eps);
      }
    }
  }
  return y;
}

/// PyTorch's GroupNorm(H, H * D) over one token (RWKV-7's ln_x): per head, biased variance,
/// y = (o - mean) / sqrt(var + eps) * w + b, w and b per channel.
Matrix<double> reference_group_norm(const Matrix<double>& o, const Vector<double>& w,
                                    const Vector<double>& b, Eigen::Index dim, double eps) {
  Matrix<double> y(o.rows(), o.cols());
  for (Eigen::Index r = 0; r < o.rows(); ++r) {
    for (Eigen::Index h = 0; h < o.cols() / dim; ++h) {
      double mean = 0.0, variance = 0.0;
      for (Eigen::Index d = 0; d < dim; ++d) mean += o(r, h * dim + d);
      mean /= static_cast<double>(dim);
      for (Eigen::Index d = 0; d < dim; ++d) {
        variance += (o(r, h * dim + d) - mean) * (o(r, h * dim + d) - mean);
      }
      variance /= static_cast<double>(dim);
      for (Eigen::Index d = 0; d < dim; ++d) {
        const Eigen::Index c = h * dim + d;
        y(r, c) = (o(r, c) - mean) / std::sqrt(variance + eps) * w(c) + b(c);
      }
    }
  }
  return y;
}

/// Recurrence outputs whose heads differ in scale by 10^3 both ways, so that eps (1e-6 under
/// the root) weighs on the smallest: a norm with eps outside the root would miss the bound.
template <class T>
Matrix<T> outputs(const Shape& shape, std::uint64_t seed) {
  Matrix<double> o = gaussian<double>(shape.rows(), shape.channels(), seed);
  for (Eigen::Index h = 0; h < shape.heads; ++h) {
    const double scale = h % 3 == 0 ? 1e-3 : (h % 3 == 1 ? 1.0 : 1e3);
    o.middleCols(h * shape.dim, shape.dim) *= scale;
  }
  return o.cast<T>();
}

template <class T>
HeadsView<T> view(Matrix<T>& m, const Shape& shape) {
  return HeadsView<T>::bnhd(m.data(), shape.bnhd());
}
template <class T>
ConstHeadsView<T> view(const Matrix<T>& m, const Shape& shape) {
  return ConstHeadsView<T>::bnhd(m.data(), shape.bnhd());
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 4e-6 : 1e-13;
}

}  // namespace

TEMPLATE_TEST_CASE("OutputNorm: each model's norm against its formula", "[output_norm]", float,
                   double) {
  using T = TestType;
  const Shape shape{2, 7, 6, 24};  // D = 24: a packet and a tail of 8 in float
  const Matrix<T> o = outputs<T>(shape, 1);
  const Matrix<T> z = gaussian<T>(shape.rows(), shape.channels(), 2, 2.0);
  const Matrix<double> od = o.template cast<double>(), zd = z.template cast<double>();
  const Vector<T> w_head = gaussian<T>(shape.dim, 1, 3, 0.5, 1.0);
  const Vector<T> w_channel = gaussian<T>(shape.channels(), 1, 4, 0.5, 1.0);
  const Vector<T> b_channel = gaussian<T>(shape.channels(), 1, 5, 0.5);
  const double eps = 1e-6;
  Matrix<T> y(shape.rows(), shape.channels());

  SECTION("Qwen3-Next / 3.5: w * rmsnorm(o) * silu(z) per head") {
    OutputNorm<T>::qwen3_next(w_head, eps)
        .apply_into(view(o, shape), view(z, shape), view(y, shape));
    const Matrix<double> expected =
        reference_gated_after(od, zd, w_head.template cast<double>(), shape.dim, eps, false);
    CHECK(relative_error(y, expected) < tolerance<T>());
    // Per head too: the small heads carry eps's weight and would hide in the large ones' scale.
    for (Eigen::Index h = 0; h < shape.heads; ++h) {
      CAPTURE(h);
      CHECK(relative_error(y.middleCols(h * shape.dim, shape.dim),
                           expected.middleCols(h * shape.dim, shape.dim)) < tolerance<T>());
    }
  }
  SECTION("Kimi: w * rmsnorm(o) * sigmoid(g) per head") {
    OutputNorm<T>::kimi(w_head, eps).apply_into(view(o, shape), view(z, shape), view(y, shape));
    const Matrix<double> expected =
        reference_gated_after(od, zd, w_head.template cast<double>(), shape.dim, eps, true);
    for (Eigen::Index h = 0; h < shape.heads; ++h) {
      CAPTURE(h);
      CHECK(relative_error(y.middleCols(h * shape.dim, shape.dim),
                           expected.middleCols(h * shape.dim, shape.dim)) < tolerance<T>());
    }
  }
  SECTION("Mamba-2: w * rmsnorm(o * silu(z)) over groups, within a head, across heads, all") {
    // d_inner / n_groups for n_groups = 12 (half a head), 3 (two heads), 1 (HF's Mamba2).
    for (const Eigen::Index group : {shape.dim / 2, 2 * shape.dim, shape.channels()}) {
      CAPTURE(group);
      OutputNorm<T>::mamba2(w_channel, group, 1e-5)
          .apply_into(view(o, shape), view(z, shape), view(y, shape));
      const Matrix<double> expected =
          reference_mamba2(od, zd, w_channel.template cast<double>(), group, 1e-5);
      for (Eigen::Index g = 0; g < shape.channels() / group; ++g) {
        CAPTURE(g);
        CHECK(relative_error(y.middleCols(g * group, group),
                             expected.middleCols(g * group, group)) < tolerance<T>());
      }
    }
    // The grouping is a named choice that changes the numbers (a port that normalised Nemotron-H
    // over all of d_inner, as HF's Mamba2 does, would be off by this much).
    const Matrix<double> grouped =
        reference_mamba2(od, zd, w_channel.template cast<double>(), 2 * shape.dim, 1e-5);
    const Matrix<double> whole =
        reference_mamba2(od, zd, w_channel.template cast<double>(), shape.channels(), 1e-5);
    CHECK(relative_error(grouped, whole) > 0.1);
  }
  SECTION("RWKV-7: GroupNorm per head with weight and bias per channel") {
    OutputNorm<T>::rwkv7(w_channel, b_channel, 64e-5).apply_into(view(o, shape), view(y, shape));
    const Matrix<double> expected = reference_group_norm(
        od, w_channel.template cast<double>(), b_channel.template cast<double>(), shape.dim, 64e-5);
    for (Eigen::Index h = 0; h < shape.heads; ++h) {
      CAPTURE(h);
      CHECK(relative_error(y.middleCols(h * shape.dim, shape.dim),
                           expected.middleCols(h * shape.dim, shape.dim)) < tolerance<T>());
    }
  }
  SECTION("A zero-centred weight multiplies as 1 + w") {
    OutputNormOptions options;
    options.weight_plus_one = true;
    options.gate = NormGate::silu_after_norm;
    const OutputNorm<T> norm(w_head, options);
    CHECK(norm.weight().isApprox(w_head + Vector<T>::Ones(shape.dim)));
    norm.apply_into(view(o, shape), view(z, shape), view(y, shape));
    const Vector<double> w_plus_one = w_head.template cast<double>().array() + 1.0;
    const Matrix<double> expected =
        reference_gated_after(od, zd, w_plus_one, shape.dim, eps, false);
    CHECK(relative_error(y, expected) < tolerance<T>());
  }
  SECTION("Zero outputs stay zero (eps under the root, no 0 / 0)") {
    const Matrix<T> zeros = Matrix<T>::Zero(shape.rows(), shape.channels());
    OutputNorm<T>::qwen3_next(w_head, eps)
        .apply_into(view(zeros, shape), view(z, shape), view(y, shape));
    CHECK(y.cwiseAbs().maxCoeff() == T(0));
  }
}

TEST_CASE("OutputNorm: strided views, in place, and threads give the same bits", "[output_norm]") {
  using T = float;
  const Shape shape{3, 600, 4, 32};
  const Matrix<T> o = outputs<T>(shape, 11);
  const Matrix<T> z = gaussian<T>(shape.rows(), shape.channels(), 12, 2.0);
  const Vector<T> w_head = gaussian<T>(shape.dim, 1, 13, 0.5, 1.0);
  const Vector<T> w_channel = gaussian<T>(shape.channels(), 1, 14, 0.5, 1.0);
  struct Case {
    const char* name;
    OutputNorm<T> norm;
  };
  const std::vector<Case> cases{{"qwen3_next", OutputNorm<T>::qwen3_next(w_head, 1e-6)},
                                {"kimi", OutputNorm<T>::kimi(w_head, 1e-6)},
                                {"mamba2", OutputNorm<T>::mamba2(w_channel, 64, 1e-5)}};
  for (const Case& c : cases) {
    CAPTURE(c.name);
    Matrix<T> expected(shape.rows(), shape.channels());
    c.norm.apply_into(view(o, shape), view(z, shape), view(expected, shape));

    // o as a [B, H, N, D] tensor, z inside a fused projection row (q, k, v, then z, then b),
    // y into the [B, N, H * D] buffer of the output projection.
    Matrix<T> o_bhnd(shape.batch * shape.heads * shape.tokens, shape.dim);
    for (Eigen::Index b = 0; b < shape.batch; ++b) {
      for (Eigen::Index h = 0; h < shape.heads; ++h) {
        for (Eigen::Index n = 0; n < shape.tokens; ++n) {
          o_bhnd.row((b * shape.heads + h) * shape.tokens + n) =
              o.row(b * shape.tokens + n).segment(h * shape.dim, shape.dim);
        }
      }
    }
    const Eigen::Index fused_width = 3 * shape.channels() + shape.channels() + 5;
    Matrix<T> fused = gaussian<T>(shape.rows(), fused_width, 15);
    fused.middleCols(3 * shape.channels(), shape.channels()) = z;
    const Matrix<T> fused_before = fused;
    const HeadStrides fused_strides{shape.tokens * fused_width, shape.dim, fused_width, 1};
    const ConstHeadsView<T> z_fused(fused.data() + 3 * shape.channels(), shape.batch, shape.heads,
                                    shape.tokens, shape.dim, fused_strides);
    Matrix<T> y(shape.rows(), shape.channels());
    c.norm.apply_into(
        ConstHeadsView<T>::bhnd(o_bhnd.data(), {shape.batch, shape.heads, shape.tokens, shape.dim}),
        z_fused, view(y, shape));
    CHECK(y == expected);

    // In place over o, and over z inside the fused row (the rest of the row untouched).
    Matrix<T> in_place = o;
    c.norm.apply_into(view(in_place, shape), view(z, shape), view(in_place, shape));
    CHECK(in_place == expected);
    const HeadsView<T> z_writable(fused.data() + 3 * shape.channels(), shape.batch, shape.heads,
                                  shape.tokens, shape.dim, fused_strides);
    c.norm.apply_into(view(o, shape), ConstHeadsView<T>(z_writable), z_writable);
    CHECK(fused.middleCols(3 * shape.channels(), shape.channels()) == expected);
    CHECK(fused.leftCols(3 * shape.channels()) == fused_before.leftCols(3 * shape.channels()));
    CHECK(fused.rightCols(5) == fused_before.rightCols(5));
    // One token in place, o seen as [B, N, H, D] and y as [B, H, N, D] of the same memory: the
    // token strides differ but N = 1 never uses them.
    Matrix<T> token = o.topRows(shape.batch);
    const Matrix<T> z_token = z.topRows(shape.batch);
    Matrix<T> token_expected(shape.batch, shape.channels());
    const Shape one{shape.batch, 1, shape.heads, shape.dim};
    c.norm.apply_into(view(token, one), view(z_token, one), view(token_expected, one));
    c.norm.apply_into(view(token, one), view(z_token, one),
                      HeadsView<T>::bhnd(token.data(), {shape.batch, shape.heads, 1, shape.dim}));
    CHECK(token == token_expected);

#ifdef _OPENMP
    // 1,800 token rows, 30 work items of 64: two threads share them; the same bits as one.
    OutputNormOptions options = c.norm.options();
    for (const int threads : {1, 2}) {
      options.threads = threads;
      const OutputNorm<T> threaded(c.norm.weight(), options);
      Matrix<T> y_threads(shape.rows(), shape.channels());
      threaded.apply_into(view(o, shape), view(z, shape), view(y_threads, shape));
      CHECK(y_threads == expected);
    }
#endif
  }
}

TEMPLATE_TEST_CASE("OutputNorm: 16-bit views compute in float and round once", "[output_norm]",
                   Eigen::half, Eigen::bfloat16) {
  using H = TestType;
  const Shape shape{2, 9, 4, 64};
  // o from the recurrence in float, z from a 16-bit projection, y for a 16-bit output GEMM.
  const Matrix<float> o = outputs<float>(shape, 21);
  const Matrix<H> z = gaussian<H>(shape.rows(), shape.channels(), 22, 2.0);
  const Matrix<float> z_float = z.template cast<float>();
  const Vector<float> w = gaussian<float>(shape.dim, 1, 23, 0.5, 1.0);
  const OutputNorm<float> norm = OutputNorm<float>::qwen3_next(w, 1e-6);
  Matrix<float> y_float(shape.rows(), shape.channels());
  norm.apply_into(view(o, shape), view(z_float, shape), view(y_float, shape));
  Matrix<H> y(shape.rows(), shape.channels());
  norm.apply_into(view(o, shape), view(z, shape), view(y, shape));
  // The float result rounded once: bit for bit.
  const Matrix<H> rounded = y_float.template cast<H>();
  CHECK(std::memcmp(y.data(), rounded.data(), sizeof(H) * y.size()) == 0);
  // And within the type's rounding of the formula in double.
  const Matrix<double> expected = reference_gated_after(o.cast<double>(), z.template cast<double>(),
                                                        w.cast<double>(), shape.dim, 1e-6, false);
  const double unit = std::is_same_v<H, Eigen::half> ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
  const Matrix<double> yd = y.template cast<double>();
  for (Eigen::Index i = 0; i < y.size(); ++i) {
    CAPTURE(i);
    // Half's subnormals round to an absolute 2^-25.
    CHECK(std::abs(yd.data()[i] - expected.data()[i]) <=
          unit * std::abs(expected.data()[i]) + std::ldexp(1.0, -24));
  }
  // 16-bit o in, 16-bit y written in place over it.
  Matrix<H> o16 = o.template cast<H>();
  const Matrix<float> o16_float = o16.template cast<float>();
  norm.apply_into(view(o16_float, shape), view(z_float, shape), view(y_float, shape));
  norm.apply_into(view(o16, shape), view(z, shape), view(o16, shape));
  const Matrix<H> rounded16 = y_float.template cast<H>();
  CHECK(std::memcmp(o16.data(), rounded16.data(), sizeof(H) * o16.size()) == 0);
}

TEST_CASE("OutputNorm: bad input throws before anything moves", "[output_norm]") {
  using T = float;
  using Catch::Matchers::Contains;
  const Shape shape{2, 3, 4, 8};
  const Vector<T> w = Vector<T>::Ones(shape.dim);
  CHECK_THROWS_WITH(OutputNorm<T>(Vector<T>()), Contains("weight is 0 x 1"));
  CHECK_THROWS_WITH(OutputNorm<T>(Matrix<T>::Ones(2, 3)), Contains("must be a vector"));
  CHECK_THROWS_WITH(OutputNorm<T>(w, Vector<T>::Zero(3)), Contains("bias has 3 entries"));
  for (const double eps : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN()}) {
    CHECK_THROWS_WITH(OutputNorm<T>::qwen3_next(w, eps), Contains("eps must be finite and > 0"));
  }
  OutputNormOptions bad;
  bad.group_size = -1;
  CHECK_THROWS_WITH(OutputNorm<T>(w, bad), Contains("group_size must be >= 0"));
  bad = {};
  bad.gate = static_cast<NormGate>(7);
  CHECK_THROWS_WITH(OutputNorm<T>(w, bad), Contains("not a NormGate"));
  bad = {};
  bad.type = static_cast<NormType>(7);
  CHECK_THROWS_WITH(OutputNorm<T>(w, bad), Contains("not a NormType"));
  Vector<T> nan_weight = w;
  nan_weight(3) = std::nanf("");
  CHECK_THROWS_WITH(OutputNorm<T>(nan_weight), Contains("weight has a non-finite value"));

  const Matrix<T> o = gaussian<T>(shape.rows(), shape.channels(), 31);
  const Matrix<T> z = gaussian<T>(shape.rows(), shape.channels(), 32);
  Matrix<T> y = Matrix<T>::Constant(shape.rows(), shape.channels(), T(7));
  const Matrix<T> y_before = y;
  const OutputNorm<T> gated = OutputNorm<T>::qwen3_next(w, 1e-6);
  const OutputNorm<T> ungated(w);
  const auto ov = view(o, shape), zv = view(z, shape);
  const auto yv = view(y, shape);
  CHECK_THROWS_WITH(gated.apply_into(ov, yv), Contains("call apply_into(o, z, y)"));
  CHECK_THROWS_WITH(ungated.apply_into(ov, zv, yv), Contains("call apply_into(o, y)"));
  const ConstHeadsView<T> three_heads =
      ConstHeadsView<T>::bnhd(z.data(), BnhdShape(shape.batch, shape.tokens, 3, shape.dim));
  CHECK_THROWS_WITH(gated.apply_into(ov, three_heads, yv),
                    Contains("z is [B, H, N, D] = [2, 3, 3, 8] but o is [2, 4, 3, 8]"));
  const ConstHeadsView<T> spread(
      o.data(), shape.batch, shape.heads, shape.tokens, shape.dim / 2,
      HeadStrides{shape.tokens * shape.channels(), shape.dim, shape.channels(), 2});
  const HeadsView<T> y_half(
      y.data(), shape.batch, shape.heads, shape.tokens, shape.dim / 2,
      HeadStrides{shape.tokens * shape.channels(), shape.dim, shape.channels(), 1});
  CHECK_THROWS_WITH(OutputNorm<T>(Vector<T>::Ones(4)).apply_into(spread, y_half),
                    Contains("o's features must be adjacent"));
  CHECK_THROWS_WITH(OutputNorm<T>(Vector<T>::Ones(5)).apply_into(ov, yv),
                    Contains("give D (shared by the heads) or H * D = 32"));
  OutputNormOptions grouped;
  grouped.group_size = 12;
  CHECK_THROWS_WITH(OutputNorm<T>(w, grouped).apply_into(ov, yv),
                    Contains("group_size = 12 does not divide the H * D = 32"));
  const HeadsView<T> shared_rows(y.data(), shape.batch, shape.heads, shape.tokens, shape.dim,
                                 HeadStrides{shape.tokens * shape.channels(), shape.dim, 4, 1});
  CHECK_THROWS_WITH(gated.apply_into(ov, zv, shared_rows), Contains("y's rows overlap"));
  // y one element past o: the same buffer, neither in place nor apart.
  Matrix<T> shared = Matrix<T>::Zero(shape.rows() + 1, shape.channels());
  shared.topRows(shape.rows()) = o;
  const Matrix<T> shared_before = shared;
  const HeadsView<T> o_shared = HeadsView<T>::bnhd(shared.data(), shape.bnhd());
  const HeadsView<T> y_shifted = HeadsView<T>::bnhd(shared.data() + 1, shape.bnhd());
  CHECK_THROWS_WITH(gated.apply_into(ConstHeadsView<T>(o_shared), zv, y_shifted),
                    Contains("y overlaps o's memory without being it"));
  CHECK_THROWS_WITH(gated.apply_into(ov, ConstHeadsView<T>(o_shared), y_shifted),
                    Contains("y overlaps z's memory without being it"));
  CHECK(shared == shared_before);
  Matrix<T> o_nan = o;
  o_nan(shape.tokens + 2, 2 * shape.dim + 1) = std::numeric_limits<T>::infinity();
  CHECK_THROWS_WITH(gated.apply_into(view(o_nan, shape), zv, yv),
                    Contains("o (sequence 1, head 2; rows are tokens) has a non-finite value (inf) "
                             "at row 2, column 1"));
  Matrix<T> z_nan = z;
  z_nan(1, 3) = std::nanf("");
  CHECK_THROWS_WITH(gated.apply_into(ov, view(z_nan, shape), yv),
                    Contains("z (sequence 0, head 0; rows are tokens) has a non-finite value"));
  // In place over o: the bad z leaves o as it was.
  Matrix<T> o_in_place = o;
  CHECK_THROWS(
      gated.apply_into(view(o_in_place, shape), view(z_nan, shape), view(o_in_place, shape)));
  CHECK(o_in_place == o);
  CHECK(y == y_before);
  // Unchecked, the values pass through: NaN in, NaN out where it lands.
  OutputNormOptions unchecked = gated.options();
  unchecked.check_finite = false;
  OutputNorm<T>(w, unchecked).apply_into(ov, view(z_nan, shape), yv);
  CHECK(std::isnan(y(1, 3)));
  CHECK(std::isfinite(y(1, 3 + shape.dim)));
}

}  // namespace linattn_test_output_norm
