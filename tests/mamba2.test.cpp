// Mamba2 (the Mamba-2 mixer between in_proj and out_proj) against the layer written out in
// double from state-spaces/mamba's Mamba2 and HF's NemotronHMamba2Mixer (conv1d with bias +
// SiLU over xBC, dt = softplus(dt + dt_bias), A = -exp(A_log), B and C shared by H / G
// consecutive heads, h_t = exp(dt A) h + B (dt x)^T, y = C^T h + D x, then w rmsnorm(y silu(z))
// per group of d_inner / G channels); HF Mamba2's one norm over d_inner; prefill and steps
// continuing the forward; every bad input.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <linattn/mamba2.hpp>
#include <string>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_mamba2 {

namespace {

using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::HeadsView;
using linattn::Mamba2;
using linattn::Mamba2Inputs;
using linattn::Mamba2Options;
using linattn::Mamba2Shape;
using linattn::Mamba2Weights;
using linattn::Matrix;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

/// 4 heads of 8 in 2 groups, states of 6 (P != N catches a transpose).
Mamba2Shape small_shape() {
  Mamba2Shape shape;
  shape.heads = 4;
  shape.head_dim = 8;
  shape.groups = 2;
  shape.state_dim = 6;
  shape.conv_kernel = 4;
  return shape;
}

/// Weights as Mamba-2 initialises them: A in [1, 16], dt_bias the inverse softplus of dt in
/// [1e-3, 0.1], D = 1, the norm's weight around 1.
Mamba2Weights<double> random_weights(const Mamba2Shape& shape, std::uint64_t seed) {
  Mamba2Weights<double> w;
  w.conv_weight = gaussian<double>(shape.conv_channels(), shape.conv_kernel, seed, 0.5);
  w.conv_bias = gaussian<double>(shape.conv_channels(), 1, seed + 1, 0.2);
  w.a_log.resize(shape.heads);
  w.dt_bias.resize(shape.heads);
  for (Eigen::Index h = 0; h < shape.heads; ++h) {
    w.a_log(h) = std::log(1.0 + 15.0 * static_cast<double>(h) / static_cast<double>(shape.heads));
    const double dt =
        1e-3 * std::pow(100.0, static_cast<double>(h) / static_cast<double>(shape.heads));
    w.dt_bias(h) = dt + std::log(-std::expm1(-dt));  // inverse softplus
  }
  w.d = gaussian<double>(shape.heads, 1, seed + 2, 0.3, 1.0);
  w.norm_weight = gaussian<double>(shape.inner(), 1, seed + 3, 0.2, 1.0);
  return w;
}

template <class T>
Mamba2Weights<T> cast_weights(const Mamba2Weights<double>& w) {
  return {w.conv_weight.cast<T>(), w.conv_bias.cast<T>(), w.a_log.cast<T>(),
          w.dt_bias.cast<T>(),     w.d.cast<T>(),         w.norm_weight.cast<T>()};
}

/// One sequence of in_proj's outputs: z N x d_inner, xBC N x C, dt N x H.
struct Sequence {
  Matrix<double> z, xbc, dt;
};

Sequence random_sequence(const Mamba2Shape& shape, Eigen::Index tokens, std::uint64_t seed) {
  return {gaussian<double>(tokens, shape.inner(), seed),
          gaussian<double>(tokens, shape.conv_channels(), seed + 1),
          gaussian<double>(tokens, shape.heads, seed + 2, 1.0)};
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

/// The Mamba-2 mixer in double from zero states, the norm over groups of `norm_group`
/// channels: N x d_inner.
Matrix<double> reference(const Mamba2Shape& shape, const Mamba2Weights<double>& w,
                         const Sequence& in, Eigen::Index norm_group, double eps) {
  const Eigen::Index tokens = in.xbc.rows(), c = shape.conv_channels(), taps = shape.conv_kernel;
  const Eigen::Index h = shape.heads, p = shape.head_dim, g = shape.groups, n = shape.state_dim;
  Matrix<double> xbc(tokens, c);
  for (Eigen::Index t = 0; t < tokens; ++t) {
    for (Eigen::Index ch = 0; ch < c; ++ch) {
      double sum = w.conv_bias(ch);
      for (Eigen::Index i = 0; i < taps; ++i) {
        const Eigen::Index src = t - (taps - 1 - i);
        if (src >= 0) sum += w.conv_weight(ch, i) * in.xbc(src, ch);
      }
      xbc(t, ch) = sum * sigmoid(sum);
    }
  }
  Matrix<double> y(tokens, h * p);
  for (Eigen::Index head = 0; head < h; ++head) {
    const Eigen::Index group = head / (h / g);  // consecutive heads share a group
    const double a = -std::exp(w.a_log(head));
    Matrix<double> s = Matrix<double>::Zero(n, p);
    for (Eigen::Index t = 0; t < tokens; ++t) {
      const double dt = std::log1p(std::exp(in.dt(t, head) + w.dt_bias(head)));
      const Vector<double> x = xbc.row(t).segment(head * p, p).transpose();
      const Vector<double> b = xbc.row(t).segment(h * p + group * n, n).transpose();
      const Vector<double> cc = xbc.row(t).segment(h * p + g * n + group * n, n).transpose();
      s = std::exp(dt * a) * s + b * (dt * x).transpose();
      y.row(t).segment(head * p, p) = (s.transpose() * cc + w.d(head) * x).transpose();
    }
  }
  Matrix<double> out(tokens, h * p);
  for (Eigen::Index t = 0; t < tokens; ++t) {
    Vector<double> u(h * p);
    for (Eigen::Index ch = 0; ch < h * p; ++ch) {
      u(ch) = y(t, ch) * in.z(t, ch) * sigmoid(in.z(t, ch));
    }
    for (Eigen::Index first = 0; first < h * p; first += norm_group) {
      const double ms =
          u.segment(first, norm_group).squaredNorm() / static_cast<double>(norm_group);
      for (Eigen::Index ch = first; ch < first + norm_group; ++ch) {
        out(t, ch) = w.norm_weight(ch) * u(ch) / std::sqrt(ms + eps);
      }
    }
  }
  return out;
}

/// B sequences' tokens [first, first + count) in contiguous buffers of T, and their views.
template <class T>
struct Batch {
  Matrix<T> z, xbc, dt;
  Eigen::Index batch, tokens;
  Batch(const std::vector<Sequence>& sequences, Eigen::Index first, Eigen::Index count)
      : batch(static_cast<Eigen::Index>(sequences.size())), tokens(count) {
    auto stack = [&](auto member) {
      Matrix<T> out(batch * count, (sequences.front().*member).cols());
      for (Eigen::Index s = 0; s < batch; ++s) {
        out.middleRows(s * count, count) = (sequences[static_cast<std::size_t>(s)].*member)
                                               .middleRows(first, count)
                                               .template cast<T>();
      }
      return out;
    };
    z = stack(&Sequence::z);
    xbc = stack(&Sequence::xbc);
    dt = stack(&Sequence::dt);
  }
  Mamba2Inputs<T> inputs(const Mamba2Shape& shape) const {
    return {
        ConstHeadsView<T>::bnhd(z.data(), BnhdShape(batch, tokens, shape.heads, shape.head_dim)),
        ConstHeadsView<T>::bnhd(xbc.data(), BnhdShape(batch, tokens, 1, xbc.cols())),
        ConstHeadsView<T>::bnhd(dt.data(), BnhdShape(batch, tokens, shape.heads, 1))};
  }
};

template <class T>
HeadsView<T> out_view(Matrix<T>& y, const Mamba2Shape& shape, Eigen::Index batch) {
  return HeadsView<T>::bnhd(y.data(),
                            BnhdShape(batch, y.rows() / batch, shape.heads, shape.head_dim));
}

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-10;
}

}  // namespace

TEMPLATE_TEST_CASE("Mamba2: forward, prefill and steps against the Mamba-2 layer", "[mamba2]",
                   float, double) {
  using T = TestType;
  const Mamba2Shape shape = small_shape();
  const Mamba2Weights<double> weights = random_weights(shape, 1);
  // Nemotron-H's norm per group of d_inner / G, and HF Mamba2's over all of d_inner.
  const Eigen::Index norm_group = GENERATE(Eigen::Index(0), Eigen::Index(32));
  CAPTURE(norm_group);
  Mamba2Options options;
  options.norm_group_size = norm_group;
  const Mamba2<T> mixer(shape, cast_weights<T>(weights), options);
  const Eigen::Index group = norm_group == 0 ? shape.inner() / shape.groups : norm_group;
  const Eigen::Index prompt = 300, decoded = 5, total = prompt + decoded, batch = 2;
  std::vector<Sequence> sequences{random_sequence(shape, total, 10),
                                  random_sequence(shape, total, 20)};
  std::vector<Matrix<double>> expected;
  for (const Sequence& s : sequences) {
    expected.push_back(reference(shape, weights, s, group, options.norm_eps));
  }
  const Batch<T> whole(sequences, 0, total);
  Matrix<T> forward(batch * total, shape.inner());
  mixer.forward_into(whole.inputs(shape), out_view(forward, shape, batch));
  for (Eigen::Index s = 0; s < batch; ++s) {
    CAPTURE(s);
    CHECK(relative_error(forward.middleRows(s * total, total), expected[s]) < tolerance<T>());
  }
  auto states = mixer.make_states(batch);
  const Batch<T> head(sequences, 0, prompt);
  Matrix<T> prefilled(batch * prompt, shape.inner());
  mixer.prefill_into(states, head.inputs(shape), out_view(prefilled, shape, batch));
  for (Eigen::Index s = 0; s < batch; ++s) {
    CHECK(relative_error(prefilled.middleRows(s * prompt, prompt), expected[s].topRows(prompt)) <
          tolerance<T>());
  }
  for (Eigen::Index t = prompt; t < total; ++t) {
    CAPTURE(t);
    const Batch<T> token(sequences, t, 1);
    Matrix<T> y(batch, shape.inner());
    mixer.step_into(states, token.inputs(shape), out_view(y, shape, batch));
    for (Eigen::Index s = 0; s < batch; ++s) {
      CAPTURE(s);
      CHECK(relative_error(y.row(s), expected[s].row(t)) < tolerance<T>());
    }
  }
  // The grouping is a named choice: normalising over d_inner would be this far off.
  if (norm_group == 0) {
    const Matrix<double> ungrouped =
        reference(shape, weights, sequences.front(), shape.inner(), options.norm_eps);
    CHECK(relative_error(ungrouped, expected.front()) > 1e-2);
  }
}

TEST_CASE("Mamba2: checkpoints are the states of the prefixes run alone", "[mamba2]") {
  using T = double;
  const Mamba2Shape shape = small_shape();
  const Mamba2<T> mixer(shape, cast_weights<T>(random_weights(shape, 3)));
  const Eigen::Index batch = 2, tokens = 270;
  std::vector<Sequence> sequences{random_sequence(shape, tokens, 50),
                                  random_sequence(shape, tokens, 60)};
  const Batch<T> data(sequences, 0, tokens);
  const std::vector<Eigen::Index> positions{3, 256, 257};
  std::vector<Mamba2<T>::States> snapshots;
  auto states = mixer.make_states(batch);
  Matrix<T> y(batch * tokens, shape.inner());
  mixer.prefill_into(states, data.inputs(shape), out_view(y, shape, batch), positions, snapshots);
  REQUIRE(snapshots.size() == positions.size());
  for (std::size_t i = 0; i < positions.size(); ++i) {
    CAPTURE(i);
    const Batch<T> prefix(sequences, 0, positions[i]);
    auto alone = mixer.make_states(batch);
    Matrix<T> out(batch * positions[i], shape.inner());
    mixer.prefill_into(alone, prefix.inputs(shape), out_view(out, shape, batch));
    for (Eigen::Index b = 0; b < batch; ++b)
      CHECK(snapshots[i].conv.window(b) == alone.conv.window(b));
    for (Eigen::Index j = 0; j < alone.recurrent.size(); ++j) {
      CHECK(relative_error(snapshots[i].recurrent[j].s(), alone.recurrent[j].s()) < 1e-12);
    }
  }
}

TEST_CASE("Mamba2: bad input throws before anything moves", "[mamba2]") {
  using T = float;
  using Catch::Matchers::Contains;
  const Mamba2Shape shape = small_shape();
  const Mamba2Weights<T> weights = cast_weights<T>(random_weights(shape, 2));
  Mamba2Shape odd = shape;
  odd.groups = 3;
  CHECK_THROWS_WITH(Mamba2<T>(odd, weights), Contains("H a multiple of G"));
  Mamba2Weights<T> bad = weights;
  bad.conv_weight = Matrix<T>::Zero(10, 4);
  CHECK_THROWS_WITH(Mamba2<T>(shape, bad),
                    Contains("conv_weight is 10 x 4 but must be C x K = 56 x 4"));
  bad = weights;
  bad.conv_bias = Vector<T>::Zero(3);
  CHECK_THROWS_WITH(Mamba2<T>(shape, bad), Contains("bias"));
  bad = weights;
  bad.d = Vector<T>::Zero(3);
  CHECK_THROWS_WITH(Mamba2<T>(shape, bad),
                    Contains("Mamba2: d is 3 x 1, expected a vector of 4 entries"));
  bad = weights;
  bad.norm_weight = Vector<T>::Ones(8);
  CHECK_THROWS_WITH(Mamba2<T>(shape, bad), Contains("norm_weight has 8 entries"));
  Mamba2Options options;
  options.norm_group_size = 5;
  CHECK_THROWS_WITH(Mamba2<T>(shape, weights, options), Contains("norm_group_size"));

  const Mamba2<T> mixer(shape, weights);
  const Eigen::Index batch = 2, tokens = 7;
  std::vector<Sequence> sequences{random_sequence(shape, tokens, 30),
                                  random_sequence(shape, tokens, 40)};
  const Batch<T> data(sequences, 0, tokens);
  auto states = mixer.make_states(batch);
  Matrix<T> y(batch * tokens, shape.inner());
  const auto out = out_view(y, shape, batch);
  mixer.prefill_into(states, data.inputs(shape), out);
  const auto before = states;
  auto unchanged = [&] {
    for (Eigen::Index b = 0; b < batch; ++b) {
      if (states.conv.window(b) != before.conv.window(b)) return false;
    }
    for (Eigen::Index i = 0; i < states.recurrent.size(); ++i) {
      if (states.recurrent[i].s() != before.recurrent[i].s()) return false;
    }
    return true;
  };
  Mamba2Inputs<T> wrong = data.inputs(shape);
  wrong.dt = ConstHeadsView<T>::bnhd(data.dt.data(), BnhdShape(batch, tokens, 2, 2));
  CHECK_THROWS_WITH(mixer.prefill_into(states, wrong, out), Contains("dt is [B, H, N, D]"));
  Matrix<T> z_copy = data.z;
  Mamba2Inputs<T> aliased = data.inputs(shape);
  aliased.z = ConstHeadsView<T>::bnhd(z_copy.data(), BnhdShape(batch, tokens, 4, 8));
  CHECK_THROWS_WITH(mixer.prefill_into(states, aliased, out_view(z_copy, shape, batch)),
                    Contains("out overlaps z's memory"));
  // States of the same sizes whose sums run otherwise (a normalised engine): refused.
  auto normalised = before;
  linattn::Options other;
  other.normalize = true;
  normalised.recurrent[1] = linattn::RecurrentState<T>(shape.state_dim, shape.head_dim, other);
  CHECK_THROWS_WITH(mixer.prefill_into(normalised, data.inputs(shape), out),
                    Contains("not this mixer's"));
  auto three = mixer.make_states(3);
  CHECK_THROWS_WITH(mixer.prefill_into(three, data.inputs(shape), out), Contains("make_states(B)"));
  for (const auto member : {&Batch<T>::z, &Batch<T>::xbc, &Batch<T>::dt}) {
    Batch<T> poisoned = data;
    (poisoned.*member)(tokens + 1, 1) = std::numeric_limits<T>::infinity();
    CHECK_THROWS_WITH(mixer.prefill_into(states, poisoned.inputs(shape), out),
                      Contains("(sequence 1, head "));
  }
  CHECK_THROWS_WITH(mixer.step_into(states, data.inputs(shape), out), Contains("a step takes one"));
  CHECK(unchanged());
}

}  // namespace linattn_test_mamba2
