// Eigen::half and Eigen::bfloat16 inputs: float accumulation, outputs in the input type.
//
// The 16-bit routines convert each chunk to the accumulation type and round only the output,
// so their result is the float routine's result on the same (already rounded) inputs, rounded
// once. Most checks compare against exactly that, with bounds in ulps of the 16-bit type:
// eps(T) = 2^-10 (half) or 2^-7 (bfloat16), the spacing of the numbers in [1, 2).
//  - Same float arithmetic on both sides: |round(b) - b| <= eps/2 |b| <= eps/2 max|b|, so the
//    measured max|a - b| / max|b| is at most eps/2; the bound is 1 eps.
//  - Different float arithmetic (step vs chunked): each side is within eps/2 of its float
//    result and the float results agree to 2e-5 (docs/design.md), so at most eps + 2e-5; the bound
//    is 2 eps.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/feature_maps.hpp>
#include <linattn/gated.hpp>
#include <linattn/layer.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/recurrent_state.hpp>
#include <linattn/state_batch.hpp>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_half {

using linattn::Matrix;
using linattn::RecurrentState;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

namespace {

constexpr Eigen::Index kDk = 12;  // Dk != Dv on purpose
constexpr Eigen::Index kDv = 7;

/// eps(T): the distance from 1 to the next representable number.
template <class T>
double eps() {
  return std::is_same_v<T, Eigen::half> ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
}

/// rows x cols of N(0, stddev^2), rounded to T (through float, as a model would hold them).
template <class T>
Matrix<T> rounded(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed, double stddev = 1.0) {
  return gaussian<float>(rows, cols, seed, stddev).template cast<T>();
}

/// The 16-bit inputs widened to float exactly, for the float reference path.
template <class T>
Matrix<float> widened(const Matrix<T>& m) {
  return m.template cast<float>();
}

/// q, k (N x Dk) and v (N x Dv) in T, and the same values in float.
template <class T>
struct Inputs {
  Matrix<T> q, k, v;
  Matrix<float> qf, kf, vf;
  Inputs(Eigen::Index n, std::uint64_t seed, double stddev)
      : q(rounded<T>(n, kDk, seed, stddev)),
        k(rounded<T>(n, kDk, seed + 1, stddev)),
        v(rounded<T>(n, kDv, seed + 2)),
        qf(widened(q)),
        kf(widened(k)),
        vf(widened(v)) {}
};

/// The causal or non-causal routine with a feature map.
template <class Acc = void, class DQ, class DK, class DV, class Map>
Matrix<typename DQ::Scalar> attend(bool causal, const Eigen::MatrixBase<DQ>& q,
                                   const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                                   const Map& map, const linattn::Options& options) {
  return causal ? linattn::causal_linear_attention<Acc>(q, k, v, map, options)
                : linattn::linear_attention<Acc>(q, k, v, map, options);
}

/// The causal or non-causal routine on featurized inputs.
template <class Acc = void, class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> attend(bool causal, const Eigen::MatrixBase<DQ>& phi_q,
                                   const Eigen::MatrixBase<DK>& phi_k,
                                   const Eigen::MatrixBase<DV>& v,
                                   const linattn::Options& options) {
  return causal
             ? linattn::causal_linear_attention<Acc>(phi_q, phi_k, v, linattn::Identity{}, options)
             : linattn::linear_attention<Acc>(phi_q, phi_k, v, linattn::Identity{}, options);
}

/// 16-bit path against the float path on the same inputs, featurized (map == nullptr: phi =
/// elu + 1 of the inputs, rounded to T) or through `map`, over N, chunk, decay and normalize.
/// Returns the worst max|a - b| / max|b|.
template <class T, class Map>
double worst_against_float(const Map* map, double stddev, bool causal) {
  double worst = 0.0;
  for (const Eigen::Index n : {1, 65, 300}) {
    const Inputs<T> in(n, 500 + static_cast<std::uint64_t>(n), stddev);
    const Matrix<T> phi_q = linattn::EluPlusOne{}.queries(in.q);
    const Matrix<T> phi_k = linattn::EluPlusOne{}.keys(in.k);
    const Matrix<float> phi_qf = widened(phi_q), phi_kf = widened(phi_k);
    for (const double decay : {1.0, 0.9}) {
      if (!causal && decay != 1.0) continue;  // non-causal ignores the decay
      for (const bool normalize : {true, false}) {
        for (const Eigen::Index chunk : {16, 64}) {
          linattn::Options options;
          options.decay = decay;
          options.normalize = normalize;
          options.chunk = chunk;
          Matrix<T> got;
          Matrix<float> want;
          if (map == nullptr) {
            got = attend(causal, phi_q, phi_k, in.v, options);
            want = attend(causal, phi_qf, phi_kf, in.vf, options);
          } else {
            got = attend(causal, in.q, in.k, in.v, *map, options);
            want = attend(causal, in.qf, in.kf, in.vf, *map, options);
          }
          const double error = relative_error(got, want);
          INFO("N = " << n << ", decay = " << decay << ", normalize = " << normalize
                      << ", chunk = " << chunk);
          CHECK(got.template cast<float>().allFinite());
          CHECK(error <= eps<T>());
          worst = std::max(worst, error);
        }
      }
    }
  }
  return worst;
}

/// Causal attention one token at a time through RecurrentState<T> (Acc defaults to float).
template <class T, class Acc = float, class Map>
Matrix<T> step_by_step(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v, const Map& map,
                       const linattn::Options& options) {
  RecurrentState<T, Acc> state(map.feature_dim(q.cols()), v.cols(), options);
  Matrix<T> out(q.rows(), v.cols());
  Vector<T> row(v.cols());
  for (Eigen::Index i = 0; i < q.rows(); ++i) {
    state.step_into(q.row(i), k.row(i), v.row(i), map, row);
    out.row(i) = row.transpose();
  }
  CHECK(state.tokens() == q.rows());
  return out;
}

/// A recurrence that keeps S and z in T itself, rounding after every addition: what a
/// 16-bit accumulator would give (products in float, as a fused 16-bit FMA would).
template <class T>
Matrix<float> accumulate_in_16_bits(const Matrix<float>& phi_q, const Matrix<float>& phi_k,
                                    const Matrix<float>& v, double eps_add) {
  const Eigen::Index c = phi_q.cols();
  Matrix<T> s = Matrix<T>::Zero(c, v.cols());
  Vector<T> z = Vector<T>::Zero(c);
  Matrix<float> out(phi_q.rows(), v.cols());
  for (Eigen::Index i = 0; i < phi_q.rows(); ++i) {
    for (Eigen::Index r = 0; r < c; ++r) {
      for (Eigen::Index col = 0; col < v.cols(); ++col) {
        s(r, col) = static_cast<T>(static_cast<float>(s(r, col)) + phi_k(i, r) * v(i, col));
      }
      z(r) = static_cast<T>(static_cast<float>(z(r)) + phi_k(i, r));
    }
    const Matrix<float> sf = s.template cast<float>();
    const Vector<float> zf = z.template cast<float>();
    const float den = phi_q.row(i).dot(zf) + static_cast<float>(eps_add);
    out.row(i) = (phi_q.row(i) * sf) / den;
  }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("16-bit inputs give the float result rounded once, for every feature map",
                   "[half]", Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  for (const bool causal : {true, false}) {
    const char* form = causal ? "causal" : "non-causal";
    SECTION(std::string(form) + ", featurized") {
      const double worst = worst_against_float<T, linattn::EluPlusOne>(nullptr, 1.0, causal);
      WARN(form << " featurized: worst |16-bit - float| / max = " << worst << " (bound " << eps<T>()
                << ")");
    }
    SECTION(std::string(form) + ", EluPlusOne") {
      const linattn::EluPlusOne map;
      const double worst = worst_against_float<T>(&map, 1.0, causal);
      WARN(form << " EluPlusOne: worst relative error " << worst);
    }
    SECTION(std::string(form) + ", Relu") {
      const linattn::Relu map;
      const double worst = worst_against_float<T>(&map, 1.0, causal);
      WARN(form << " Relu: worst relative error " << worst);
    }
    SECTION(std::string(form) + ", PositiveRandomFeatures") {
      const linattn::PositiveRandomFeatures map(kDk, 24, 7);
      const double worst = worst_against_float<T>(&map, 1.0, causal);
      WARN(form << " PositiveRandomFeatures: worst relative error " << worst);
    }
    SECTION(std::string(form) + ", RandomFourierFeatures") {
      const linattn::RandomFourierFeatures map(kDk, 10, 9);
      const double worst = worst_against_float<T>(&map, 0.5, causal);
      WARN(form << " RandomFourierFeatures: worst relative error " << worst);
    }
  }
}

TEMPLATE_TEST_CASE("accumulating in float keeps the error at the output rounding, N = 4096",
                   "[half]", Eigen::half, Eigen::bfloat16) {
  // Against a double computation on the same rounded inputs: the float-accumulated path is
  // within float rounding (~1e-6) plus half an ulp of T at any N, while a 16-bit accumulator
  // stalls once z's increments fall below its spacing (after a few hundred tokens in half).
  // Measured on the last quarter of the tokens, against their own largest output: the early
  // outputs (averages of few values of v) are larger and would hide the late errors.
  using T = TestType;
  const linattn::EluPlusOne map;
  double path_error[2] = {0, 0};
  double sixteen_bit_error[2] = {0, 0};
  const Eigen::Index sizes[2] = {256, 4096};
  for (int which = 0; which < 2; ++which) {
    const Inputs<T> in(sizes[which], 77, 1.0);
    const Matrix<T> got = linattn::causal_linear_attention(in.q, in.k, in.v, map);
    const Matrix<double> qd = in.qf.template cast<double>(), kd = in.kf.template cast<double>();
    const Matrix<double> vd = in.vf.template cast<double>();
    const Matrix<double> reference = linattn::causal_linear_attention(qd, kd, vd, map);
    const Eigen::Index tail = sizes[which] / 4;
    path_error[which] = relative_error(got.bottomRows(tail), reference.bottomRows(tail));
    const Matrix<float> phi_q = map.queries(in.qf), phi_k = map.keys(in.kf);
    const Matrix<float> sixteen_bit = accumulate_in_16_bits<T>(phi_q, phi_k, in.vf, 1e-6);
    sixteen_bit_error[which] =
        relative_error(sixteen_bit.bottomRows(tail), reference.bottomRows(tail));
  }
  WARN("last quarter of N = 256: float accumulation " << path_error[0] << ", 16-bit accumulation "
                                                      << sixteen_bit_error[0]);
  WARN("last quarter of N = 4096: float accumulation " << path_error[1] << ", 16-bit accumulation "
                                                       << sixteen_bit_error[1] << " (bound "
                                                       << eps<T>() << ")");
  CHECK(path_error[0] <= eps<T>());
  CHECK(path_error[1] <= eps<T>());  // no growth with N beyond the output rounding
  CHECK(sixteen_bit_error[1] >= 10 * path_error[1]);
  CHECK(sixteen_bit_error[1] >= 8 * eps<T>());
}

TEMPLATE_TEST_CASE("Acc = double: 16-bit inputs, double sums", "[half]", Eigen::half,
                   Eigen::bfloat16) {
  using T = TestType;
  const Inputs<T> in(300, 91, 1.0);
  const Matrix<double> qd = in.qf.template cast<double>(), kd = in.kf.template cast<double>();
  const Matrix<double> vd = in.vf.template cast<double>();
  const linattn::PositiveRandomFeatures prf(kDk, 24, 5);
  double worst = 0.0;
  for (const bool causal : {true, false}) {
    linattn::Options options;
    options.decay = causal ? 0.95 : 1.0;
    const double e1 = relative_error(attend<double>(causal, in.q, in.k, in.v, prf, options),
                                     attend(causal, qd, kd, vd, prf, options));
    const double e2 =
        relative_error(attend<double>(causal, in.q, in.k, in.v, linattn::EluPlusOne{}, options),
                       attend(causal, qd, kd, vd, linattn::EluPlusOne{}, options));
    INFO("causal = " << causal);
    CHECK(e1 <= eps<T>());
    CHECK(e2 <= eps<T>());
    worst = std::max({worst, e1, e2});
  }
  WARN("Acc = double vs the double routine: worst relative error " << worst);
}

TEMPLATE_TEST_CASE("FAVOR+ on inputs whose features leave the 16-bit range stays finite", "[half]",
                   Eigen::half, Eigen::bfloat16) {
  // |u|^2 / 2 near 250 puts exp(W u - |u|^2 / 2) near e^-200: zero in both 16-bit types (and
  // in float). The log-scale stabiliser keeps the output a finite weighted mean of v, equal to
  // the float path's. eps = 0: with the default eps the denominators (~e^-400) are far below
  // eps and every output is ~1e-200, zero in every type, which would test nothing.
  using T = TestType;
  const Eigen::Index n = 200;
  const Inputs<T> in(n, 31, 12.0);
  const linattn::PositiveRandomFeatures map(kDk, 24, 11);
  const Matrix<T> naive_features = map.queries(in.q);
  Eigen::Index zero_rows = 0;
  for (Eigen::Index r = 0; r < n; ++r) {
    zero_rows += naive_features.row(r).template cast<float>().cwiseAbs().maxCoeff() == 0.0f;
  }
  WARN("rows of 16-bit FAVOR+ features that underflow to zero: " << zero_rows << " of " << n);
  CHECK(zero_rows > n / 2);  // why the kernels never featurize in 16 bits
  const float v_max = in.vf.cwiseAbs().maxCoeff();
  double worst = 0.0;
  for (const bool causal : {true, false}) {
    for (const double decay : {1.0, 0.9}) {
      if (!causal && decay != 1.0) continue;
      linattn::Options options;
      options.decay = decay;
      options.eps = 0.0;
      const Matrix<T> got = attend(causal, in.q, in.k, in.v, map, options);
      const Matrix<float> want = attend(causal, in.qf, in.kf, in.vf, map, options);
      const Matrix<float> widened_got = widened(got);
      INFO("causal = " << causal << ", decay = " << decay);
      REQUIRE(widened_got.allFinite());
      // A weighted mean of the v rows: no entry past max|v| (one rounding of T above it).
      CHECK(widened_got.cwiseAbs().maxCoeff() <= v_max * (1 + eps<T>()));
      const double error = relative_error(got, want);
      CHECK(error <= eps<T>());
      worst = std::max(worst, error);
    }
  }
  WARN("FAVOR+ with large inputs: worst |16-bit - float| / max = " << worst);
}

TEMPLATE_TEST_CASE("_into forms take maps, column-major inputs, blocks and strided outputs",
                   "[half]", Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  using ColMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
  const Eigen::Index n = 130;
  const Inputs<T> in(n, 41, 1.0);
  const linattn::EluPlusOne map;
  const std::vector<T> buffer(in.q.data(), in.q.data() + in.q.size());
  const Eigen::Map<const Matrix<T>> q_map(buffer.data(), n, kDk);
  const ColMajor k_col = in.k;
  Matrix<T> v_wide(n + 10, kDv + 3);
  v_wide.setConstant(T(3.0f));
  v_wide.block(5, 2, n, kDv) = in.v;
  for (const bool causal : {true, false}) {
    const Matrix<T> expected = attend(causal, in.q, in.k, in.v, map, linattn::Options{});
    Matrix<T> big = Matrix<T>::Constant(n + 4, kDv + 5, T(-7.0f));
    Eigen::Ref<Matrix<T>> out = big.block(2, 3, n, kDv);
    if (causal) {
      linattn::causal_linear_attention_into(q_map, k_col, v_wide.block(5, 2, n, kDv), map, out);
    } else {
      linattn::linear_attention_into(q_map, k_col, v_wide.block(5, 2, n, kDv), map, out);
    }
    INFO("causal = " << causal);
    // The same converted chunks through the same float kernel: bit-for-bit the same.
    CHECK(relative_error(big.block(2, 3, n, kDv), expected) == 0.0);
    Matrix<T> untouched = big;
    untouched.block(2, 3, n, kDv).setConstant(T(-7.0f));
    CHECK((untouched.template cast<float>().array() == -7.0f).all());

    // Featurized, with an expression as input.
    const Matrix<T> phi_q = map.queries(in.q), phi_k = map.keys(in.k);
    const Matrix<T> expected_featurized = attend(causal, phi_q, phi_k, in.v, linattn::Options{});
    Matrix<T> out_featurized(n, kDv);
    if (causal) {
      linattn::causal_linear_attention_into(phi_q, phi_k.topRows(n), in.v, linattn::Identity{},
                                            out_featurized);
    } else {
      linattn::linear_attention_into(phi_q, phi_k.topRows(n), in.v, linattn::Identity{},
                                     out_featurized);
    }
    CHECK(relative_error(out_featurized, expected_featurized) == 0.0);
  }
}

TEMPLATE_TEST_CASE("NaN or Inf in a 16-bit input throws, naming the argument", "[half][errors]",
                   Eigen::half, Eigen::bfloat16) {
  using Catch::Matchers::Contains;
  using T = TestType;
  const Eigen::Index n = 70;
  const Inputs<T> in(n, 61, 1.0);
  const linattn::EluPlusOne map;
  const T inf = T(std::numeric_limits<float>::infinity());
  const T nan = T(std::numeric_limits<float>::quiet_NaN());
  Matrix<T> out = Matrix<T>::Constant(n, kDv, T(5.0f));
  const Matrix<T> out_before = out;
  for (const T bad_value : {inf, -inf, nan}) {
    Matrix<T> bad_q = in.q, bad_k = in.k, bad_v = in.v;
    bad_q(66, 2) = bad_value;
    bad_k(66, 2) = bad_value;
    bad_v(3, 1) = bad_value;
    INFO("bad value " << static_cast<float>(bad_value));
    CHECK_THROWS_WITH(
        linattn::causal_linear_attention_into(bad_q, in.k, in.v, linattn::Identity{}, out),
        Contains("phi_q has a non-finite value") && Contains("row 66, column 2"));
    CHECK_THROWS_WITH(linattn::linear_attention_into(in.q, bad_k, in.v, linattn::Identity{}, out),
                      Contains("phi_k has a non-finite value") && Contains("row 66, column 2"));
    CHECK_THROWS_WITH(linattn::causal_linear_attention_into(in.q, in.k, bad_v, map, out),
                      Contains("v has a non-finite value") && Contains("row 3, column 1"));
    CHECK_THROWS_WITH(linattn::linear_attention(bad_q, in.k, in.v, map),
                      Contains("q has a non-finite value"));
    // An expression, not memory: scanned coefficient by coefficient.
    CHECK_THROWS_WITH(linattn::causal_linear_attention(in.q, bad_k.array().abs().matrix(), in.v,
                                                       linattn::Identity{}),
                      Contains("phi_k has a non-finite value") && Contains("row 66, column 2"));
    CHECK(relative_error(out, out_before) == 0.0);  // nothing written before the throw

    RecurrentState<T> state(kDk, kDv);
    state.prefill(in.q.topRows(10), in.k.topRows(10), in.v.topRows(10), map);
    const Matrix<float> s_before = state.s();
    CHECK_THROWS_WITH(state.step(in.q.row(0), bad_k.row(66), in.v.row(0), linattn::Identity{}),
                      Contains("RecurrentState::step: phi_k has a non-finite value"));
    CHECK_THROWS_WITH(state.step(bad_q.row(66), in.k.row(0), in.v.row(0), map),
                      Contains("q has a non-finite value"));
    CHECK_THROWS_WITH(state.prefill(in.q, in.k, bad_v, map),
                      Contains("RecurrentState::prefill: v has a non-finite value"));
    CHECK(state.tokens() == 10);
    CHECK(relative_error(state.s(), s_before) == 0.0);
  }
  SECTION("the largest finite values and subnormals pass the scan") {
    Matrix<T> edge_k = in.k;
    edge_k(0, 0) = Eigen::NumTraits<T>::highest();
    edge_k(1, 1) = Eigen::NumTraits<T>::lowest();
    edge_k(2, 2) = Eigen::numext::bit_cast<T>(std::uint16_t{1});
    CHECK_NOTHROW(linattn::causal_linear_attention(in.q, edge_k, in.v, linattn::Relu{}));
  }
  SECTION("check_finite off skips the scan") {
    Matrix<T> bad_v = in.v;
    bad_v(3, 1) = nan;
    linattn::Options unchecked;
    unchecked.check_finite = false;
    CHECK_NOTHROW(linattn::causal_linear_attention(in.q, in.k, bad_v, map, unchecked));
  }
}

TEMPLATE_TEST_CASE("RecurrentState<T>: float state, steps agree with the parallel form",
                   "[half][recurrent_state]", Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  static_assert(std::is_same_v<RecurrentState<T>, RecurrentState<T, float>>,
                "16-bit states accumulate in float by default");
  static_assert(
      std::is_same_v<typename std::decay_t<decltype(RecurrentState<T>(1, 1).s())>, Matrix<float>>);
  const Eigen::Index n = 150;
  double worst_parallel = 0.0, worst_float_state = 0.0, worst_double_state = 0.0;
  auto run = [&](const auto& map, double stddev, double eps_add, const char* name) {
    const Inputs<T> in(n, 71, stddev);
    for (const double decay : {1.0, 0.9}) {
      for (const bool normalize : {true, false}) {
        // Unnormalised, the large inputs' outputs are the sums themselves, ~e^-400: zero in
        // float and both 16-bit types, nonzero only in the double reference.
        if (!normalize && stddev > 1.0) continue;
        linattn::Options options;
        options.decay = decay;
        options.normalize = normalize;
        options.chunk = 32;
        options.eps = eps_add;
        const Matrix<T> steps = step_by_step(in.q, in.k, in.v, map, options);
        const Matrix<T> parallel = linattn::causal_linear_attention(in.q, in.k, in.v, map, options);
        const Matrix<float> float_steps = step_by_step(in.qf, in.kf, in.vf, map, options);
        const Matrix<T> double_steps = step_by_step<T, double>(in.q, in.k, in.v, map, options);
        const Matrix<double> double_parallel = linattn::causal_linear_attention(
            in.qf.template cast<double>(), in.kf.template cast<double>(),
            in.vf.template cast<double>(), map, options);
        const double e1 = relative_error(steps, parallel);
        const double e2 = relative_error(steps, float_steps);
        const double e3 = relative_error(double_steps, double_parallel);
        INFO(name << ", decay = " << decay << ", normalize = " << normalize);
        CHECK(e1 <= 2 * eps<T>());
        CHECK(e2 <= eps<T>());  // the same float arithmetic, rounded
        CHECK(e3 <= eps<T>());
        worst_parallel = std::max(worst_parallel, e1);
        worst_float_state = std::max(worst_float_state, e2);
        worst_double_state = std::max(worst_double_state, e3);
      }
    }
  };
  run(linattn::EluPlusOne{}, 1.0, 1e-6, "EluPlusOne");
  run(linattn::PositiveRandomFeatures(kDk, 24, 13), 1.0, 1e-6, "PositiveRandomFeatures");
  // Features far below the 16-bit (and float) range; eps = 0 as in the FAVOR+ test above.
  run(linattn::PositiveRandomFeatures(kDk, 24, 13), 12.0, 0.0, "PositiveRandomFeatures, large");
  run(linattn::RandomFourierFeatures(kDk, 10, 14), 0.5, 1e-6, "RandomFourierFeatures");

  // Featurized steps (phi rounded to T) through step_into.
  const Inputs<T> in(n, 72, 1.0);
  const Matrix<T> phi_q = linattn::EluPlusOne{}.queries(in.q);
  const Matrix<T> phi_k = linattn::EluPlusOne{}.keys(in.k);
  RecurrentState<T> state(kDk, kDv);
  Matrix<T> steps(n, kDv);
  for (Eigen::Index i = 0; i < n; ++i) {
    steps.row(i) =
        state.step(phi_q.row(i), phi_k.row(i), in.v.row(i), linattn::Identity{}).transpose();
  }
  const double featurized = relative_error(
      steps, linattn::causal_linear_attention(phi_q, phi_k, in.v, linattn::Identity{}));
  CHECK(featurized <= 2 * eps<T>());
  worst_parallel = std::max(worst_parallel, featurized);
  WARN("steps vs parallel: worst " << worst_parallel << " (bound " << 2 * eps<T>()
                                   << "); vs float state on float inputs: " << worst_float_state
                                   << "; Acc = double vs double routine: " << worst_double_state);
}

TEMPLATE_TEST_CASE("RecurrentState<T>: prefill in pieces, then save and load",
                   "[half][persistence]", Eigen::half, Eigen::bfloat16) {
  using Catch::Matchers::Contains;
  using T = TestType;
  const Eigen::Index n = 300;
  const Inputs<T> in(n, 81, 1.0);
  const linattn::PositiveRandomFeatures map(kDk, 16, 17);
  linattn::Options options;
  options.decay = 0.97;
  options.chunk = 32;
  const Matrix<T> whole = linattn::causal_linear_attention(in.q, in.k, in.v, map, options);

  RecurrentState<T> state(map.feature_dim(kDk), kDv, options);
  Matrix<T> pieces(n, kDv);
  Eigen::Index begin = 0;
  for (const Eigen::Index len : {1, 17, 64, 100}) {
    pieces.middleRows(begin, len) = state.prefill(
        in.q.middleRows(begin, len), in.k.middleRows(begin, len), in.v.middleRows(begin, len), map);
    begin += len;
  }
  const Eigen::Index split = begin;
  std::stringstream stream;
  state.save(stream, map);
  const std::string bytes = stream.str();
  Eigen::Ref<Matrix<T>> rest = pieces.bottomRows(n - split);
  state.prefill_into(in.q.bottomRows(n - split), in.k.bottomRows(n - split),
                     in.v.bottomRows(n - split), map, rest);
  const double pieces_error = relative_error(pieces, whole);
  WARN("prefill in pieces vs one call: " << pieces_error);
  CHECK(pieces_error <= 2 * eps<T>());

  // Loaded, the state continues exactly as the saved one did.
  std::istringstream in_stream(bytes);
  RecurrentState<T> loaded = RecurrentState<T>::load(in_stream, map, options);
  CHECK(loaded.tokens() == split);
  Matrix<T> continued(n - split, kDv);
  loaded.prefill_into(in.q.bottomRows(n - split), in.k.bottomRows(n - split),
                      in.v.bottomRows(n - split), map, continued);
  CHECK(relative_error(continued, pieces.bottomRows(n - split)) == 0.0);
  CHECK(relative_error(loaded.s(), state.s()) == 0.0);
  CHECK(loaded.sums().log_scale == state.sums().log_scale);

  // The stream holds float sums: any state accumulating in float reads it, double refuses.
  std::istringstream as_float(bytes);
  const RecurrentState<float> float_state = RecurrentState<float>::load_unchecked(as_float);
  CHECK(float_state.tokens() == split);
  std::istringstream as_double(bytes);
  CHECK_THROWS_WITH((RecurrentState<T, double>::load_unchecked(as_double)),
                    Contains("4-byte scalars"));
  RecurrentState<T, double> wide(4, 3);
  std::stringstream wide_stream;
  wide.save(wide_stream);
  CHECK_THROWS_WITH(RecurrentState<T>::load_unchecked(wide_stream), Contains("8-byte scalars"));
}

TEMPLATE_TEST_CASE("multi-head views of 16-bit memory", "[half][multi_head]", Eigen::half,
                   Eigen::bfloat16) {
  using Catch::Matchers::Contains;
  using T = TestType;
  using linattn::ConstHeadsView;
  using linattn::HeadsView;
  const Eigen::Index batch = 2, heads = 3, tokens = 70;
  const Matrix<T> q = rounded<T>(batch * heads * tokens, kDk, 91);
  const Matrix<T> k = rounded<T>(batch * heads * tokens, kDk, 92);
  const Matrix<T> v = rounded<T>(batch * heads * tokens, kDv, 93);
  const linattn::EluPlusOne map;
  // [B, N, H, D]: rows of q are (b, n, h) in that order.
  const auto q_view =
      ConstHeadsView<T>::bnhd(q.data(), linattn::BnhdShape{batch, tokens, heads, kDk});
  const auto k_view =
      ConstHeadsView<T>::bnhd(k.data(), linattn::BnhdShape{batch, tokens, heads, kDk});
  const auto v_view =
      ConstHeadsView<T>::bnhd(v.data(), linattn::BnhdShape{batch, tokens, heads, kDv});
  for (const bool causal : {true, false}) {
    Matrix<T> out(batch * heads * tokens, kDv);
    const auto out_view =
        HeadsView<T>::bnhd(out.data(), linattn::BnhdShape{batch, tokens, heads, kDv});
    if (causal) {
      linattn::causal_linear_attention_into(q_view, k_view, v_view, map, out_view);
    } else {
      linattn::linear_attention_into(q_view, k_view, v_view, map, out_view);
    }
    double worst = 0.0;
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index h = 0; h < heads; ++h) {
        const Matrix<T> alone = attend(causal, q_view.head(b, h), k_view.head(b, h),
                                       v_view.head(b, h), map, linattn::Options{});
        worst = std::max(worst, relative_error(out_view.head(b, h), alone));
      }
    }
    INFO("causal = " << causal);
    CHECK(worst == 0.0);  // each head is the single-sequence call, bit for bit
  }
  Matrix<T> bad = q;
  bad(tokens * heads + 2 * heads + 1, 4) =
      T(std::numeric_limits<float>::infinity());  // b=1 n=2 h=1
  Matrix<T> out(batch * heads * tokens, kDv);
  CHECK_THROWS_WITH(
      linattn::causal_linear_attention_into(
          ConstHeadsView<T>::bnhd(bad.data(), linattn::BnhdShape{batch, tokens, heads, kDk}),
          k_view, v_view, map,
          HeadsView<T>::bnhd(out.data(), linattn::BnhdShape{batch, tokens, heads, kDv})),
      Contains("q[b=1, h=1] has a non-finite value") && Contains("row 2, column 4"));
}

TEMPLATE_TEST_CASE("LinearAttentionLayer<T> and RecurrentStateBatch<T>: prompt, then steps",
                   "[half][layer]", Eigen::half, Eigen::bfloat16) {
  // The layer's prefill (parallel form) and per-token steps over a batch of float states give
  // what one causal call over the whole sequence gives, to the output rounding.
  using T = TestType;
  using Layer = linattn::LinearAttentionLayer<T, linattn::PositiveRandomFeatures>;
  static_assert(std::is_same_v<typename Layer::States, linattn::RecurrentStateBatch<T, float>>);
  const Eigen::Index batch = 2, heads = 2, prompt = 40, steps = 12, n = prompt + steps;
  linattn::Options options;
  options.decay = 0.98;
  const Layer layer(linattn::PositiveRandomFeatures(kDk, 16, 21), heads, kDk, kDv, options);
  // [B, H, N, D] rows: (b, h, n).
  const Matrix<T> q = rounded<T>(batch * heads * n, kDk, 101);
  const Matrix<T> k = rounded<T>(batch * heads * n, kDk, 102);
  const Matrix<T> v = rounded<T>(batch * heads * n, kDv, 103);
  auto view = [&](const Matrix<T>& m) {
    return linattn::ConstHeadsView<T>(
        m.data(), batch, heads, prompt, m.cols(),
        linattn::HeadStrides{heads * n * m.cols(), n * m.cols(), m.cols(), 1});
  };
  Matrix<T> out(batch * heads * n, kDv);
  const linattn::HeadsView<T> out_view(out.data(), batch, heads, prompt, kDv,
                                       linattn::HeadStrides{heads * n * kDv, n * kDv, kDv, 1});
  typename Layer::States states = layer.make_states(batch);
  layer.prefill_into(states, view(q), view(k), view(v), out_view);
  Matrix<T> q_t(batch * heads, kDk), k_t(batch * heads, kDk), v_t(batch * heads, kDv);
  Matrix<T> out_t(batch * heads, kDv);
  for (Eigen::Index t = prompt; t < n; ++t) {
    for (Eigen::Index i = 0; i < batch * heads; ++i) {
      q_t.row(i) = q.row(i * n + t);
      k_t.row(i) = k.row(i * n + t);
      v_t.row(i) = v.row(i * n + t);
    }
    layer.step_into(states, q_t, k_t, v_t, out_t);
    for (Eigen::Index i = 0; i < batch * heads; ++i) out.row(i * n + t) = out_t.row(i);
  }
  double worst = 0.0;
  for (Eigen::Index i = 0; i < batch * heads; ++i) {
    const Matrix<T> whole =
        linattn::causal_linear_attention(q.middleRows(i * n, n), k.middleRows(i * n, n),
                                         v.middleRows(i * n, n), layer.feature_map(), options);
    worst = std::max(worst, relative_error(out.middleRows(i * n, n), whole));
  }
  WARN("layer prefill + steps vs one call per head: worst relative error " << worst);
  CHECK(worst <= 2 * eps<T>());
  CHECK(states[0].tokens() == n);
}

TEMPLATE_TEST_CASE("16-bit conversions and the NaN/Inf scan match the scalar definitions", "[half]",
                   Eigen::half, Eigen::bfloat16) {
  // Every 16-bit pattern, through the converters the kernels use (F16C where the target has it,
  // branch-free bit arithmetic otherwise) and the bit scan of check_finite.
  using T = TestType;
  std::vector<T> all(65536);
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    all[bits] = Eigen::numext::bit_cast<T>(static_cast<std::uint16_t>(bits));
  }
  std::vector<float> widened_all(all.size());
  linattn::detail::convert(all.data(), widened_all.data(), static_cast<Eigen::Index>(all.size()));
  std::vector<T> back(all.size());
  linattn::detail::convert(widened_all.data(), back.data(), static_cast<Eigen::Index>(all.size()));
  std::uint32_t mismatches = 0, round_trip = 0, scan_errors = 0;
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    const float expected = static_cast<float>(all[bits]);
    const bool nan = std::isnan(expected);
    mismatches += nan ? !std::isnan(widened_all[bits])
                      : Eigen::numext::bit_cast<std::uint32_t>(widened_all[bits]) !=
                            Eigen::numext::bit_cast<std::uint32_t>(expected);
    round_trip += nan ? !(Eigen::numext::isnan)(back[bits])
                      : Eigen::numext::bit_cast<std::uint16_t>(back[bits]) != bits;
    // The scan of a run of 7 (odd, so both the 4-wide words and the tail see it) holding it.
    std::vector<T> run(7, T(1.0f));
    run[bits % 7] = all[bits];
    scan_errors += linattn::detail::has_nonfinite_bits(run.data(), 7) != !std::isfinite(expected);
  }
  // Rounding float to T: ties to even, overflow to Inf, underflow to subnormals and zero.
  const std::vector<float> samples = {1.0f + std::ldexp(1.0f, -11),
                                      1.0f + 3 * std::ldexp(1.0f, -11),
                                      65519.0f,
                                      65520.0f,
                                      3.4e38f,
                                      1e-8f,
                                      3e-8f,
                                      -2.5e-8f,
                                      std::ldexp(1.0f, -126),
                                      -0.0f,
                                      1.0f + std::ldexp(1.0f, -8),
                                      1.0f + 3 * std::ldexp(1.0f, -8),
                                      0.1f,
                                      -123.456f};
  std::vector<float> padded(samples);
  while (padded.size() % 8 != 0 || padded.size() < 16) padded.push_back(0.3f);
  std::vector<T> rounded_samples(padded.size());
  linattn::detail::convert(padded.data(), rounded_samples.data(),
                           static_cast<Eigen::Index>(padded.size()));
  std::uint32_t rounding_errors = 0;
  for (std::size_t i = 0; i < padded.size(); ++i) {
    rounding_errors += Eigen::numext::bit_cast<std::uint16_t>(rounded_samples[i]) !=
                       Eigen::numext::bit_cast<std::uint16_t>(static_cast<T>(padded[i]));
  }
  CHECK(mismatches == 0);
  CHECK(round_trip == 0);
  CHECK(scan_errors == 0);
  CHECK(rounding_errors == 0);
}

TEMPLATE_TEST_CASE("gated views of 16-bit memory: every transition, as the float call rounded",
                   "[half][multi_head][gated]", Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  using linattn::ConstHeadsView;
  using linattn::HeadsView;
  const Eigen::Index batch = 2, heads = 3, tokens = 150;
  const Matrix<T> q = rounded<T>(batch * heads * tokens, kDk, 101);
  const Matrix<T> k = rounded<T>(batch * heads * tokens, kDk, 102);
  const Matrix<T> v = rounded<T>(batch * heads * tokens, kDv, 103);
  const linattn::EluPlusOne map;
  const Matrix<float> u = gaussian<float>(heads, kDk, 104);
  const Matrix<T> u_t = u.template cast<T>();
  // [B, N, H, D] memory, as a projection writes it; the gates laid out alike.
  const linattn::HeadShape qk{batch, heads, tokens, kDk}, vo{batch, heads, tokens, kDv};
  const auto q_view = ConstHeadsView<T>::bnhd(q.data(), linattn::BnhdShape(qk));
  const auto k_view = ConstHeadsView<T>::bnhd(k.data(), linattn::BnhdShape(qk));
  const auto v_view = ConstHeadsView<T>::bnhd(v.data(), linattn::BnhdShape(vo));
  for (const int kind : {0, 1, 2, 3}) {  // HeadDecays, scalar, per-feature, per-feature + bonus
    const Eigen::Index gate_dim = kind == 1 ? 1 : kDk;
    const Matrix<T> g =
        (-0.2f * gaussian<float>(batch * heads * tokens, gate_dim, 105).cwiseAbs()).cast<T>();
    const auto g_view =
        ConstHeadsView<T>::bnhd(g.data(), linattn::BnhdShape{batch, tokens, heads, gate_dim});
    const linattn::HeadDecays decays{{0.9, 0.97, 0.99}};
    linattn::Options options;
    options.normalize = kind < 2;
    Matrix<T> out(batch * heads * tokens, kDv);
    const auto out_view = HeadsView<T>::bnhd(out.data(), linattn::BnhdShape(vo));
    if (kind == 0) {
      linattn::causal_gated_linear_attention_into(q_view, k_view, v_view, decays, map, out_view,
                                                  options);
    } else if (kind < 3) {
      linattn::causal_gated_linear_attention_into(
          q_view, k_view, v_view, linattn::log_gates(g_view), map, out_view, options);
    } else {
      linattn::causal_gated_linear_attention_into(
          q_view, k_view, v_view, linattn::with_bonus(linattn::log_gates(g_view), u_t), map,
          out_view, options);
    }
    double worst = 0.0;
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index h = 0; h < heads; ++h) {
        // The float call on the same (widened) values.
        const Matrix<float> qf = q_view.head(b, h).template cast<float>(),
                            kf = k_view.head(b, h).template cast<float>(),
                            vf = v_view.head(b, h).template cast<float>(),
                            gf = g_view.head(b, h).template cast<float>();
        linattn::Options head = options;
        Matrix<float> expected;
        if (kind == 0) {
          head.decay = decays.values[static_cast<std::size_t>(h)];
          expected = linattn::causal_linear_attention(qf, kf, vf, map, head);
        } else if (kind < 3) {
          expected =
              linattn::causal_gated_linear_attention(qf, kf, vf, linattn::log_gates(gf), map, head);
        } else {
          const Matrix<float> uh = u_t.row(h).template cast<float>();
          expected = linattn::causal_gated_linear_attention(
              qf, kf, vf, linattn::with_bonus(linattn::log_gates(gf), uh), map, head);
        }
        const Matrix<float> got = out_view.head(b, h).template cast<float>();
        REQUIRE(got.allFinite());
        worst = std::max(worst, relative_error(got, expected));
      }
    }
    INFO("transition " << kind << ": worst " << worst);
    CHECK(worst <= 2 * eps<T>());
  }
}

TEMPLATE_TEST_CASE("DeltaRuleLayer<T> on 16-bit views: the float call rounded once, then steps",
                   "[half][layer][delta_rule]", Eigen::half, Eigen::bfloat16) {
  // Gated DeltaNet (scalar gates) and KDA (per-feature gates) on [B, H, N, D] 16-bit memory with
  // beta and the gates as views: each head is the float matrix call on the widened inputs,
  // rounded once (1 eps); a prompt through prefill and steps over a batch of float states give
  // the forward's outputs to 2 eps plus the delta rule's float bound.
  using T = TestType;
  using Layer = linattn::DeltaRuleLayer<T>;
  static_assert(std::is_same_v<typename Layer::States, linattn::DeltaRuleStateBatch<T, float>>);
  const Eigen::Index batch = 2, heads = 2, prompt = 40, steps = 12, n = prompt + steps;
  for (const Eigen::Index gate_cols : {Eigen::Index(1), kDk}) {
    INFO((gate_cols == 1 ? "Gated DeltaNet" : "KDA"));
    linattn::DeltaOptions options;
    options.l2_normalize = true;
    options.chunk = 16;
    const Layer layer(heads, kDk, kDv, options);
    // [B, H, N, D] rows: (b, h, n).
    const Matrix<T> q = rounded<T>(batch * heads * n, kDk, 111);
    const Matrix<T> k = rounded<T>(batch * heads * n, kDk, 112);
    const Matrix<T> v = rounded<T>(batch * heads * n, kDv, 113);
    const Matrix<T> beta =
        (0.1f + 0.8f * gaussian<float>(batch * heads * n, 1, 114).array().abs().min(1.0f))
            .matrix()
            .template cast<T>();
    const Matrix<T> g = (-0.1f * gaussian<float>(batch * heads * n, gate_cols, 115).array().abs())
                            .matrix()
                            .template cast<T>();
    auto view = [&](const Matrix<T>& m, Eigen::Index tokens) {
      return linattn::ConstHeadsView<T>(
          m.data(), batch, heads, tokens, m.cols(),
          linattn::HeadStrides{heads * n * m.cols(), n * m.cols(), m.cols(), 1});
    };
    auto out_view = [&](Matrix<T>& m, Eigen::Index tokens) {
      return linattn::HeadsView<T>(m.data(), batch, heads, tokens, kDv,
                                   linattn::HeadStrides{heads * n * kDv, n * kDv, kDv, 1});
    };
    Matrix<T> forward(batch * heads * n, kDv);
    layer.forward_into(view(q, n), view(k, n), view(v, n), linattn::log_gates(view(g, n)),
                       view(beta, n), out_view(forward, n));
    double worst_forward = 0.0;
    for (Eigen::Index i = 0; i < batch * heads; ++i) {
      const Matrix<float> gf = widened<T>(g.middleRows(i * n, n));
      const Matrix<float> alone = linattn::causal_gated_delta_rule(
          widened<T>(q.middleRows(i * n, n)), widened<T>(k.middleRows(i * n, n)),
          widened<T>(v.middleRows(i * n, n)), linattn::log_gates(gf),
          Vector<float>(widened<T>(beta.middleRows(i * n, n))), options);
      worst_forward = std::max(worst_forward, relative_error(forward.middleRows(i * n, n), alone));
    }
    CHECK(worst_forward <= eps<T>());
    // The prompt through prefill, the rest by steps of every state.
    Matrix<T> out(batch * heads * n, kDv);
    typename Layer::States states = layer.make_states(batch);
    layer.prefill_into(states, view(q, prompt), view(k, prompt), view(v, prompt),
                       linattn::log_gates(view(g, prompt)), view(beta, prompt),
                       out_view(out, prompt));
    Matrix<T> q_t(batch * heads, kDk), k_t(batch * heads, kDk), v_t(batch * heads, kDv);
    Matrix<T> g_t(batch * heads, gate_cols), out_t(batch * heads, kDv);
    Vector<T> beta_t(batch * heads);
    for (Eigen::Index t = prompt; t < n; ++t) {
      for (Eigen::Index i = 0; i < batch * heads; ++i) {
        q_t.row(i) = q.row(i * n + t);
        k_t.row(i) = k.row(i * n + t);
        v_t.row(i) = v.row(i * n + t);
        g_t.row(i) = g.row(i * n + t);
        beta_t(i) = beta(i * n + t, 0);
      }
      layer.step_into(states, q_t, k_t, v_t, linattn::log_gates(g_t), beta_t, out_t);
      for (Eigen::Index i = 0; i < batch * heads; ++i) out.row(i * n + t) = out_t.row(i);
    }
    const double worst = relative_error(out, forward);
    WARN("delta layer prefill + steps vs its forward: worst relative error " << worst);
    CHECK(worst <= 2 * eps<T>() + 1e-4);
    CHECK(states[0].tokens() == n);
  }
}

}  // namespace linattn_test_half
