// RecurrentState: step-by-step and prefill against the parallel routine, save/load, errors.
// EIGEN_RUNTIME_NO_MALLOC lets a test forbid heap allocation inside Eigen.
#ifndef EIGEN_RUNTIME_NO_MALLOC  // a test bundle defines it for all its files
#define EIGEN_RUNTIME_NO_MALLOC
#endif
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <linattn/feature_maps.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/recurrent_state.hpp>
#include <linattn/state_io.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_recurrent_state {

using linattn::Matrix;
using linattn::RecurrentState;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

namespace {

template <class T>
double agreement_tolerance() {  // docs/design.md: parallel and recurrent forms agree to this
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

/// Runs the sequence one token at a time through a state, returns N x Dv.
template <class T, class Map>
Matrix<T> step_by_step(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v, const Map& map,
                       const linattn::Options& options) {
  RecurrentState<T> state(map.feature_dim(q.cols()), v.cols(), options);
  Matrix<T> out(q.rows(), v.cols());
  for (Eigen::Index i = 0; i < q.rows(); ++i) {
    out.row(i) = state.step(q.row(i), k.row(i), v.row(i), map).transpose();
  }
  CHECK(state.tokens() == q.rows());
  return out;
}

/// Parallel vs recurrent for one map at length n, decay on and off; returns the worst error.
template <class T, class Map>
double worst_agreement(const Map& map, Eigen::Index n, Eigen::Index dk, Eigen::Index dv,
                       double stddev, std::uint64_t seed) {
  const Matrix<T> q = gaussian<T>(n, dk, seed, stddev), k = gaussian<T>(n, dk, seed + 1, stddev);
  const Matrix<T> v = gaussian<T>(n, dv, seed + 2);
  double worst = 0.0;
  for (const double decay : {1.0, 0.995}) {
    linattn::Options options;
    options.decay = decay;
    const Matrix<T> parallel = linattn::causal_linear_attention(q, k, v, map, options);
    const Matrix<T> recurrent = step_by_step(q, k, v, map, options);
    const double error = relative_error(recurrent, parallel);
    INFO("N = " << n << ", decay = " << decay);
    CHECK(error <= agreement_tolerance<T>());
    worst = std::max(worst, error);
  }
  return worst;
}

}  // namespace

TEMPLATE_TEST_CASE("step by step equals the parallel form, N = 65,536", "[recurrent_state]", float,
                   double) {
  using T = TestType;
  const Eigen::Index n = 65536;
  SECTION("EluPlusOne") {
    WARN("EluPlusOne, N = 65536: worst |recurrent - parallel| / max = " << worst_agreement<T>(
             linattn::EluPlusOne{}, n, 32, 24, 1.0, 101));
  }
  SECTION("PositiveRandomFeatures (stabilised)") {
    WARN("PositiveRandomFeatures, N = 65536: worst relative error "
         << worst_agreement<T>(linattn::PositiveRandomFeatures(16, 32, 3), n, 16, 16, 1.0, 102));
  }
  SECTION("Relu") {
    WARN("Relu, N = 65536: worst relative error "
         << worst_agreement<T>(linattn::Relu{}, n, 16, 16, 1.0, 103));
  }
  SECTION("RandomFourierFeatures") {
    WARN("RandomFourierFeatures, N = 65536: worst relative error "
         << worst_agreement<T>(linattn::RandomFourierFeatures(16, 8, 4), n, 16, 16, 0.3, 104));
  }
}

TEMPLATE_TEST_CASE("featurized steps equal the featurized parallel form", "[recurrent_state]",
                   float, double) {
  using T = TestType;
  const Eigen::Index n = 3000, c = 20, dv = 9;
  const linattn::EluPlusOne map;
  const Matrix<T> phi_q = map.queries(gaussian<T>(n, c, 111)),
                  phi_k = map.keys(gaussian<T>(n, c, 112));
  const Matrix<T> v = gaussian<T>(n, dv, 113);
  for (const bool normalize : {true, false}) {
    linattn::Options options;
    options.decay = 0.9;
    options.normalize = normalize;
    const Matrix<T> parallel =
        linattn::causal_linear_attention(phi_q, phi_k, v, linattn::Identity{}, options);
    RecurrentState<T> state(c, dv, options);
    Matrix<T> recurrent(n, dv);
    for (Eigen::Index i = 0; i < n; ++i) {
      // Column-vector inputs work as well as rows.
      const Vector<T> qi = phi_q.row(i).transpose();
      recurrent.row(i) = state.step(qi, phi_k.row(i), v.row(i), linattn::Identity{}).transpose();
    }
    INFO("normalize = " << normalize);
    CHECK(relative_error(recurrent, parallel) <= agreement_tolerance<T>());
  }
}

TEMPLATE_TEST_CASE("prefill then step equals one parallel call", "[recurrent_state]", float,
                   double) {
  using T = TestType;
  const Eigen::Index n = 1500, dk = 16, dv = 12;
  const Matrix<T> q = gaussian<T>(n, dk, 121), k = gaussian<T>(n, dk, 122);
  const Matrix<T> v = gaussian<T>(n, dv, 123);
  const linattn::PositiveRandomFeatures prf(dk, 48, 9);
  const linattn::EluPlusOne elu;
  for (const double decay : {1.0, 0.98}) {
    linattn::Options options;
    options.decay = decay;
    options.chunk = 64;
    const Matrix<T> whole_prf = linattn::causal_linear_attention(q, k, v, prf, options);
    const Matrix<T> whole_elu = linattn::causal_linear_attention(q, k, v, elu, options);
    for (const Eigen::Index split :
         {Eigen::Index(1), Eigen::Index(100), Eigen::Index(128), Eigen::Index(1000), n - 1, n}) {
      INFO("decay = " << decay << ", prefill " << split << " tokens");
      RecurrentState<T> with_prf(prf.feature_dim(dk), dv, options);
      RecurrentState<T> with_elu(dk, dv, options);
      Matrix<T> out_prf(n, dv), out_elu(n, dv);
      out_prf.topRows(split) =
          with_prf.prefill(q.topRows(split), k.topRows(split), v.topRows(split), prf);
      // The featurized prefill for elu+1, to cover that overload.
      out_elu.topRows(split) =
          with_elu.prefill(elu.queries(q.topRows(split)), elu.keys(k.topRows(split)),
                           v.topRows(split), linattn::Identity{});
      for (Eigen::Index i = split; i < n; ++i) {
        out_prf.row(i) = with_prf.step(q.row(i), k.row(i), v.row(i), prf).transpose();
        out_elu.row(i) = with_elu.step(q.row(i), k.row(i), v.row(i), elu).transpose();
      }
      CHECK(relative_error(out_prf, whole_prf) <= agreement_tolerance<T>());
      CHECK(relative_error(out_elu, whole_elu) <= agreement_tolerance<T>());
      CHECK(with_prf.tokens() == n);
    }
    // Two prefills in a row are one prefill.
    RecurrentState<T> twice(prf.feature_dim(dk), dv, options);
    Matrix<T> out(n, dv);
    out.topRows(700) = twice.prefill(q.topRows(700), k.topRows(700), v.topRows(700), prf);
    out.bottomRows(n - 700) =
        twice.prefill(q.bottomRows(n - 700), k.bottomRows(n - 700), v.bottomRows(n - 700), prf);
    CHECK(relative_error(out, whole_prf) <= agreement_tolerance<T>());
  }
}

TEMPLATE_TEST_CASE("the state holds the documented sums", "[recurrent_state]", float, double) {
  using T = TestType;
  const Eigen::Index n = 40, c = 6, dv = 4;
  const double decay = 0.8;
  const linattn::EluPlusOne map;
  const Matrix<T> phi_k = map.keys(gaussian<T>(n, c, 131));
  const Matrix<T> phi_q = map.queries(gaussian<T>(n, c, 132));
  const Matrix<T> v = gaussian<T>(n, dv, 133);
  linattn::Options options;
  options.decay = decay;
  RecurrentState<T> state(c, dv, options);
  CHECK(state.tokens() == 0);
  CHECK(state.sums().log_scale == -std::numeric_limits<double>::infinity());
  state.prefill(phi_q, phi_k, v, linattn::Identity{});
  Matrix<double> s = Matrix<double>::Zero(c, dv);
  Eigen::VectorXd z = Eigen::VectorXd::Zero(c);
  for (Eigen::Index j = 0; j < n; ++j) {
    const double w = std::pow(decay, double(n - 1 - j));
    s += w * phi_k.row(j).transpose().template cast<double>() * v.row(j).template cast<double>();
    z += w * phi_k.row(j).transpose().template cast<double>();
  }
  CHECK(state.sums().log_scale == 0.0);
  CHECK(relative_error(state.s(), s) <= agreement_tolerance<T>());
  CHECK(relative_error(state.z(), z) <= agreement_tolerance<T>());
  CHECK(state.tokens() == n);
  CHECK(state.feature_dim() == c);
  CHECK(state.value_dim() == dv);
  CHECK(state.options().decay == decay);
  state.reset();
  CHECK(state.tokens() == 0);
  CHECK(state.s().cwiseAbs().maxCoeff() == T(0));
  CHECK(state.z().cwiseAbs().maxCoeff() == T(0));
  // After reset it behaves as new.
  RecurrentState<T> fresh(c, dv, options);
  const Vector<T> a = state.step(phi_q.row(0), phi_k.row(0), v.row(0), linattn::Identity{});
  const Vector<T> b = fresh.step(phi_q.row(0), phi_k.row(0), v.row(0), linattn::Identity{});
  CHECK(a == b);
}

TEMPLATE_TEST_CASE("step_into allocates nothing", "[recurrent_state]", float, double) {
  using T = TestType;
  const Eigen::Index c = 64, dv = 64, n = 50;
  const linattn::EluPlusOne map;
  const Matrix<T> phi_q = map.queries(gaussian<T>(n, c, 141)),
                  phi_k = map.keys(gaussian<T>(n, c, 142));
  const Matrix<T> v = gaussian<T>(n, dv, 143);
  for (const double decay : {1.0, 0.9}) {
    linattn::Options options;
    options.decay = decay;
    RecurrentState<T> state(c, dv, options);
    Vector<T> out(dv);
    Eigen::internal::set_is_malloc_allowed(false);
    for (Eigen::Index i = 0; i < n; ++i)
      state.step_into(phi_q.row(i), phi_k.row(i), v.row(i), linattn::Identity{}, out);
    Eigen::internal::set_is_malloc_allowed(true);
    CHECK(out.allFinite());
    CHECK(state.tokens() == n);
  }
}

TEMPLATE_TEST_CASE("step_into with a feature map allocates nothing after the first token",
                   "[recurrent_state]", float, double) {
  using T = TestType;
  const Eigen::Index dk = 16, dv = 32, n = 40;
  const Matrix<T> q = gaussian<T>(n, dk, 144), k = gaussian<T>(n, dk, 145);
  const Matrix<T> v = gaussian<T>(n, dv, 146);
  const auto run = [&](const auto& map) {
    linattn::Options options;
    options.decay = 0.95;
    RecurrentState<T> state(map.feature_dim(dk), dv, options);
    RecurrentState<T> reference(map.feature_dim(dk), dv, options);
    Vector<T> out(dv);
    state.step_into(q.row(0), k.row(0), v.row(0), map, out);  // sizes the workspace
    Eigen::internal::set_is_malloc_allowed(false);
    for (Eigen::Index i = 1; i < n; ++i) state.step_into(q.row(i), k.row(i), v.row(i), map, out);
    Eigen::internal::set_is_malloc_allowed(true);
    // The last output is the chunked form's.
    const Matrix<T> expected = reference.prefill(q, k, v, map);
    CHECK(state.tokens() == n);
    CHECK(relative_error(out.transpose(), expected.bottomRows(1)) <=
          (std::is_same_v<T, float> ? 2e-5 : 1e-12));
  };
  run(linattn::EluPlusOne{});
  run(linattn::Relu{});
  run(linattn::PositiveRandomFeatures(dk, 32, 3));
  run(linattn::RandomFourierFeatures(dk, 16, 4));
}

TEMPLATE_TEST_CASE("save and load round-trip bit for bit and continue the sequence",
                   "[recurrent_state][persistence]", float, double) {
  using T = TestType;
  const Eigen::Index n = 300, dk = 8, dv = 5;
  const Matrix<T> q = gaussian<T>(n, dk, 151), k = gaussian<T>(n, dk, 152);
  const Matrix<T> v = gaussian<T>(n, dv, 153);
  const linattn::PositiveRandomFeatures map(dk, 16, 2);
  linattn::Options options;
  options.decay = 0.97;
  options.eps = 1e-5;
  options.chunk = 32;
  RecurrentState<T> original(map.feature_dim(dk), dv, options);
  original.prefill(q.topRows(200), k.topRows(200), v.topRows(200), map);

  std::stringstream stream;
  original.save(stream, map);
  RecurrentState<T> loaded = RecurrentState<T>::load(stream, map, options);
  CHECK(loaded.s() == original.s());
  CHECK(loaded.z() == original.z());
  CHECK(loaded.sums().log_scale == original.sums().log_scale);
  CHECK(loaded.tokens() == original.tokens());
  CHECK(loaded.options().decay == options.decay);
  CHECK(loaded.options().eps == options.eps);
  CHECK(loaded.options().chunk == options.chunk);
  for (Eigen::Index i = 200; i < n; ++i) {
    const Vector<T> a = original.step(q.row(i), k.row(i), v.row(i), map);
    const Vector<T> b = loaded.step(q.row(i), k.row(i), v.row(i), map);
    REQUIRE(a == b);
  }
}

TEMPLATE_TEST_CASE("load rejects every truncation and every flipped byte",
                   "[recurrent_state][persistence][errors]", float) {
  using T = TestType;
  RecurrentState<T> state(3, 2);
  const linattn::EluPlusOne map;
  state.step(map.queries(gaussian<T>(1, 3, 161)), map.keys(gaussian<T>(1, 3, 162)),
             gaussian<T>(1, 2, 163), linattn::Identity{});
  std::stringstream stream;
  state.save(stream);
  const std::string bytes = stream.str();
  REQUIRE(bytes.size() > 60);
  for (std::size_t len = 0; len < bytes.size(); ++len) {
    std::istringstream truncated(bytes.substr(0, len));
    INFO("truncated to " << len << " bytes");
    CHECK_THROWS_AS(RecurrentState<T>::load_unchecked(truncated), linattn::Error);
  }
  for (std::size_t pos = 0; pos < bytes.size(); ++pos) {
    std::string corrupt = bytes;
    corrupt[pos] = static_cast<char>(corrupt[pos] ^ 0x10);
    std::istringstream in(corrupt);
    INFO("byte " << pos << " flipped");
    CHECK_THROWS_AS(RecurrentState<T>::load_unchecked(in), linattn::Error);
  }
  std::istringstream intact(bytes);
  CHECK_NOTHROW(RecurrentState<T>::load_unchecked(intact));
}

TEST_CASE("load names what is wrong with the stream", "[recurrent_state][persistence][errors]") {
  using Catch::Matchers::Contains;
  RecurrentState<double> state(3, 2);
  std::stringstream stream;
  state.save(stream);
  const std::string bytes = stream.str();
  {
    std::string other = bytes;
    other[0] = 'X';
    std::istringstream in(other);
    CHECK_THROWS_WITH(RecurrentState<double>::load_unchecked(in), Contains("magic"));
  }
  {
    std::string future = bytes;
    future[8] = 5;  // the format version follows the 8 magic bytes
    std::istringstream in(future);
    CHECK_THROWS_WITH(RecurrentState<double>::load_unchecked(in),
                      Contains("format version 5, this build reads versions 1 to 4"));
  }
  {
    std::istringstream in(bytes);
    CHECK_THROWS_WITH(RecurrentState<float>::load_unchecked(in), Contains("8-byte scalars"));
  }
  {
    std::string huge = bytes;
    for (int i = 16; i < 24; ++i) huge[i] = static_cast<char>(0xFF);  // feature_dim
    std::istringstream in(huge);
    CHECK_THROWS_WITH(RecurrentState<double>::load_unchecked(in), Contains("over the limit"));
  }
  {
    std::istringstream in(bytes.substr(0, 30));
    CHECK_THROWS_WITH(RecurrentState<double>::load_unchecked(in), Contains("truncated"));
  }
  {
    // A header within the limits (2^20 x 64) over a short payload: read as far as the stream
    // goes, then rejected, without first allocating the 512 MiB the header claims.
    std::string claims_big = bytes;
    for (int i = 16; i < 32; ++i) claims_big[i] = 0;
    claims_big[18] = 0x10;  // feature_dim = 2^20, little-endian
    claims_big[24] = 64;    // value_dim = 64
    std::istringstream in(claims_big);
    CHECK_THROWS_WITH(RecurrentState<double>::load_unchecked(in), Contains("truncated"));
  }
  {
    // A token count near INT64_MAX (with a valid checksum) would overflow on the next step.
    std::string huge_count = bytes;
    for (int i = 34; i < 42; ++i) huge_count[i] = static_cast<char>(0xFF);  // format 4
    huge_count[41] = 0x7F;
    linattn::detail::Crc32 crc;
    crc.update(reinterpret_cast<const unsigned char*>(huge_count.data()), huge_count.size() - 4);
    for (int i = 0; i < 4; ++i) {
      huge_count[huge_count.size() - 4 + i] = static_cast<char>((crc.value() >> (8 * i)) & 0xFF);
    }
    std::istringstream in(huge_count);
    CHECK_THROWS_WITH(RecurrentState<double>::load_unchecked(in), Contains("token count"));
  }
  {
    std::string flipped = bytes;
    flipped[bytes.size() - 10] ^= 1;  // inside z
    std::istringstream in(flipped);
    CHECK_THROWS_WITH(RecurrentState<double>::load_unchecked(in), Contains("checksum"));
  }
}

TEMPLATE_TEST_CASE("bad input throws and leaves the state as it was", "[recurrent_state][errors]",
                   float) {
  using T = TestType;
  using Catch::Matchers::Contains;
  const Eigen::Index c = 4, dv = 3;
  linattn::Options options;
  options.decay = 0.9;
  RecurrentState<T> state(c, dv, options);
  const linattn::EluPlusOne map;
  const Matrix<T> q = gaussian<T>(5, c, 171), k = gaussian<T>(5, c, 172),
                  v = gaussian<T>(5, dv, 173);
  state.prefill(map.queries(q), map.keys(k), v, linattn::Identity{});
  const Matrix<T> s = state.s();
  const Vector<T> z = state.z();
  const auto tokens = state.tokens();

  const Vector<T> good_q = map.queries(q.row(0)).transpose(),
                  good_k = map.keys(k.row(0)).transpose();
  const Vector<T> good_v = v.row(0).transpose();
  CHECK_THROWS_WITH(state.step(good_q.head(3), good_k, good_v, linattn::Identity{}),
                    Contains("phi_q is 3 x 1"));
  CHECK_THROWS_WITH(state.step(good_q, good_k.head(2), good_v, linattn::Identity{}),
                    Contains("phi_k is 2 x 1"));
  CHECK_THROWS_WITH(state.step(good_q, good_k, good_v.head(2), linattn::Identity{}),
                    Contains("v is 2 x 1"));
  const Matrix<T> block = Matrix<T>::Ones(2, 2);
  CHECK_THROWS_AS(state.step(block, good_k, good_v, linattn::Identity{}),
                  linattn::Error);  // 4 entries, not a vector
  Vector<T> short_out(2);
  CHECK_THROWS_WITH(state.step_into(good_q, good_k, good_v, linattn::Identity{}, short_out),
                    Contains("out has 2"));
  Vector<T> bad_k = good_k;
  bad_k(1) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH(state.step(good_q, bad_k, good_v, linattn::Identity{}),
                    Contains("phi_k") && Contains("column 0"));
  Vector<T> bad_v = good_v;
  bad_v(2) = std::numeric_limits<T>::infinity();
  CHECK_THROWS_AS(state.step(q.row(0), k.row(0), bad_v, map), linattn::Error);
  CHECK_THROWS_AS(state.step(q.row(0).head(3), k.row(0).head(3), good_v, map), linattn::Error);
  const linattn::PositiveRandomFeatures wrong_width(c, 8, 1);  // C = 8, state has 4
  CHECK_THROWS_WITH(state.step(q.row(0), k.row(0), good_v, wrong_width), Contains("8 features"));
  CHECK_THROWS_WITH(state.prefill(map.queries(q), map.keys(k), v.leftCols(2), linattn::Identity{}),
                    Contains("the state is 4 x 3"));
  CHECK_THROWS_WITH(state.prefill(map.queries(q), map.keys(k).topRows(4), v, linattn::Identity{}),
                    Contains("phi_k is 4 x 4"));
  CHECK_THROWS_AS(state.prefill(q, k, v, wrong_width), linattn::Error);
  Matrix<T> bad_q = q;
  bad_q(3, 1) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH(state.prefill(bad_q, k, v, map), Contains("row 3, column 1"));

  CHECK(state.s() == s);
  CHECK(state.z() == z);
  CHECK(state.tokens() == tokens);

  CHECK_THROWS_WITH(RecurrentState<T>(0, 3), Contains("feature_dim must be >= 1"));
  CHECK_THROWS_WITH(RecurrentState<T>(3, 0), Contains("value_dim must be >= 1"));
  linattn::Options bad;
  bad.decay = 1.5;
  CHECK_THROWS_WITH(RecurrentState<T>(3, 3, bad), Contains("Options::decay"));
}

TEST_CASE("a million float tokens: a double accumulator keeps the error at 1e-4",
          "[recurrent_state][numerics]") {
  // Positive features and values with a non-zero mean: S and z grow to ~1e6, where adding one
  // token in float rounds away ~1e-8 of the sum each time.
  const Eigen::Index n = 1000000, c = 8, dv = 4;
  const linattn::EluPlusOne map;
  const Matrix<float> q = gaussian<float>(n, c, 181), k = gaussian<float>(n, c, 182);
  const Matrix<float> v = gaussian<float>(n, dv, 183, 0.5, 1.0);
  const Matrix<double> phi_q = map.queries(q.cast<double>()), phi_k = map.keys(k.cast<double>());
  const Matrix<double> vd = v.cast<double>();

  // Reference: the recurrence in double, straight from the formula (every 997th row kept).
  std::vector<Eigen::Index> rows;
  Matrix<double> expected(n / 997 + 1, dv);
  Matrix<double> s = Matrix<double>::Zero(c, dv);
  Eigen::VectorXd z = Eigen::VectorXd::Zero(c);
  for (Eigen::Index i = 0; i < n; ++i) {
    s.noalias() += phi_k.row(i).transpose() * vd.row(i);
    z += phi_k.row(i).transpose();
    if (i % 997 == 0) {
      expected.row(static_cast<Eigen::Index>(rows.size())) =
          (phi_q.row(i) * s) / (phi_q.row(i).dot(z) + 1e-6);
      rows.push_back(i);
    }
  }
  auto sampled = [&](const Matrix<float>& out) {
    Matrix<double> picked(static_cast<Eigen::Index>(rows.size()), dv);
    for (std::size_t r = 0; r < rows.size(); ++r) {
      picked.row(static_cast<Eigen::Index>(r)) = out.row(rows[r]).cast<double>();
    }
    return picked;
  };
  const Matrix<double> ref = expected.topRows(static_cast<Eigen::Index>(rows.size()));

  const Matrix<float> narrow = linattn::causal_linear_attention(q, k, v, map);
  const Matrix<float> wide = linattn::causal_linear_attention<double>(q, k, v, map);
  RecurrentState<float, double> state(c, dv);
  const Matrix<float> wide_state = state.prefill(q, k, v, map);

  const double narrow_error = relative_error(sampled(narrow), ref);
  const double wide_error = relative_error(sampled(wide), ref);
  const double state_error = relative_error(sampled(wide_state), ref);
  WARN("N = 1e6, float inputs: error vs double reference "
       << narrow_error << " with a float state, " << wide_error << " with a double one ("
       << state_error << " via RecurrentState)");
  CHECK(wide_error <= 1e-4);
  CHECK(state_error <= 1e-4);
  CHECK(narrow_error > 2 * wide_error);          // the trade-off is real, not a formality
  CHECK(state.s().cwiseAbs().maxCoeff() > 1e5);  // the sums really are large
}

TEST_CASE("threads sharing one const feature map, each with its own states, match one thread",
          "[recurrent_state][threads]") {
  const Eigen::Index dk = 16, dv = 8, n = 400;
  const int sessions = 8;
  const linattn::PositiveRandomFeatures map(dk, 32, 77);  // shared, const
  linattn::Options options;
  options.decay = 0.99;
  std::vector<Matrix<float>> q, k, v, expected;
  for (int s = 0; s < sessions; ++s) {
    q.push_back(gaussian<float>(n, dk, 1000 + 3 * s));
    k.push_back(gaussian<float>(n, dk, 1001 + 3 * s));
    v.push_back(gaussian<float>(n, dv, 1002 + 3 * s));
  }
  // Single-threaded results first: half prefill, half steps, plus one parallel call.
  auto run_session = [&](int s) {
    RecurrentState<float> state(map.feature_dim(dk), dv, options);
    Matrix<float> out(2 * n, dv);
    out.topRows(n / 2) =
        state.prefill(q[s].topRows(n / 2), k[s].topRows(n / 2), v[s].topRows(n / 2), map);
    for (Eigen::Index i = n / 2; i < n; ++i) {
      out.row(i) = state.step(q[s].row(i), k[s].row(i), v[s].row(i), map).transpose();
    }
    out.bottomRows(n) = linattn::causal_linear_attention(q[s], k[s], v[s], map, options);
    return out;
  };
  for (int s = 0; s < sessions; ++s) expected.push_back(run_session(s));

  std::vector<Matrix<float>> got(sessions);
  std::vector<std::thread> threads;
  for (int s = 0; s < sessions; ++s) {
    threads.emplace_back([&, s] {
      for (int repeat = 0; repeat < 3; ++repeat) got[s] = run_session(s);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int s = 0; s < sessions; ++s) {
    INFO("session " << s);
    CHECK(got[s] == expected[s]);  // bit for bit: no shared mutable state
  }
}

// --- Checked save/load (format 2), the format-1 golden files, states from given sums. ---

namespace {

using Catch::Matchers::Contains;

/// A user map: phi(x) = factor * x, no fingerprint() (so a load cannot tell two apart).
struct ScaledFeatures {
  double factor = 2.0;
  Eigen::Index feature_dim(Eigen::Index input_dim) const { return input_dim; }
  template <class D>
  Matrix<typename D::Scalar> queries(const Eigen::MatrixBase<D>& x) const {
    return x * static_cast<typename D::Scalar>(factor);
  }
  template <class D>
  Matrix<typename D::Scalar> keys(const Eigen::MatrixBase<D>& x) const {
    return x * static_cast<typename D::Scalar>(factor);
  }
};

/// The same user map with the extension point: a hash of its one setting.
struct FingerprintedFeatures : ScaledFeatures {
  std::uint64_t fingerprint() const {
    std::uint64_t bits;
    std::memcpy(&bits, &factor, sizeof bits);
    return bits;
  }
};

template <class T>
std::string saved_bytes(const RecurrentState<T>& state) {
  std::ostringstream os;
  state.save(os);
  return os.str();
}

template <class T, class Map>
std::string saved_bytes(const RecurrentState<T>& state, const Map& map) {
  std::ostringstream os;
  state.save(os, map);
  return os.str();
}

/// `bytes` with the CRC-32 (the last 4 bytes) recomputed, after an edit.
std::string with_checksum(std::string bytes) {
  linattn::detail::Crc32 crc;
  crc.update(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size() - 4);
  for (int i = 0; i < 4; ++i) {
    bytes[bytes.size() - 4 + i] = static_cast<char>((crc.value() >> (8 * i)) & 0xFF);
  }
  return bytes;
}

/// The message load(bytes, map, options) throws ("" if it loads).
template <class T, class Map>
std::string load_error(const std::string& bytes, const Map& map, const linattn::Options& options) {
  std::istringstream in(bytes);
  try {
    (void)RecurrentState<T>::load(in, map, options);
  } catch (const linattn::Error& e) {
    return e.what();
  }
  return "";
}

/// A state of `map` after `n` tokens of seeded inputs.
template <class T, class Map>
RecurrentState<T> stepped(const Map& map, Eigen::Index dk, Eigen::Index dv, Eigen::Index n,
                          const linattn::Options& options, std::uint64_t seed) {
  RecurrentState<T> state(map.feature_dim(dk), dv, options);
  (void)state.prefill(gaussian<T>(n, dk, seed, 0.5), gaussian<T>(n, dk, seed + 1, 0.5),
                      gaussian<T>(n, dv, seed + 2), map);
  return state;
}

/// The sums the golden files of make_state_v1.cpp and make_state_v3.cpp hold (Identity, decay
/// 0.5, three dyadic tokens): S = sum_t 0.5^(2 - t) k_t v_t^T and z likewise, exact in binary.
struct GoldenSums {
  Matrix<double> s = Matrix<double>::Zero(3, 2);
  Vector<double> z = Vector<double>::Zero(3);
  GoldenSums() {
    Matrix<double> k(3, 3), v(3, 2);
    k << 1.0, 0.5, -2.0, 0.25, 3.0, 1.0, -1.5, 0.75, 2.0;
    v << 2.0, -1.0, 0.5, 4.0, -3.0, 0.125;
    for (int t = 0; t < 3; ++t) {
      s = 0.5 * s + k.row(t).transpose() * v.row(t);
      z = 0.5 * z + k.row(t).transpose();
    }
  }
};

std::string data_file(const char* name) {
  const std::string path = std::string(LINATTN_TEST_DATA_DIR) + "/" + name;
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  INFO("reading " << path);
  REQUIRE(bytes.str().size() > 100);
  return bytes.str();
}

/// The naive recurrence straight from docs/design.md, in double, from given sums (s, z):
/// S <- g S + phi(k) v^T, z <- g z + phi(k), out = phi(q)^T S / (phi(q) . z + eps).
struct NaiveRun {
  Matrix<double> out, s;
  Vector<double> z;
};
NaiveRun naive_recurrence(const Matrix<double>& phi_q, const Matrix<double>& phi_k,
                          const Matrix<double>& v, const linattn::Options& options,
                          Matrix<double> s, Vector<double> z) {
  NaiveRun run{Matrix<double>(phi_q.rows(), v.cols()), std::move(s), std::move(z)};
  for (Eigen::Index t = 0; t < phi_q.rows(); ++t) {
    run.s = options.decay * run.s + phi_k.row(t).transpose() * v.row(t);
    run.z = options.decay * run.z + phi_k.row(t).transpose();
    const Eigen::RowVectorXd num = phi_q.row(t) * run.s;
    const double den = phi_q.row(t).dot(run.z) + options.eps;
    run.out.row(t) = options.normalize ? Eigen::RowVectorXd(num / den) : num;
  }
  return run;
}

}  // namespace

TEMPLATE_TEST_CASE("save(os, map) and load(is, map, options) round-trip every kind of map",
                   "[recurrent_state][persistence]", float, double) {
  using T = TestType;
  const Eigen::Index dk = 4, dv = 3, n = 23;
  linattn::Options options;
  options.decay = 0.95;
  options.eps = 1e-5;
  options.normalize = false;
  linattn::RandomFeatureOptions hyperbolic;
  hyperbolic.hyperbolic = true;
  const auto check = [&](const auto& map, const char* name) {
    INFO("map " << name);
    RecurrentState<T> original = stepped<T>(map, dk, dv, n, options, 300);
    const std::string bytes = saved_bytes(original, map);
    CHECK(bytes.size() == 119 + (original.s().size() + original.z().size()) * sizeof(T) + 4);
    linattn::Options server = options;
    server.chunk = 7;  // not recorded: the loaded state takes the server's
    server.check_finite = false;
    std::istringstream in(bytes);
    RecurrentState<T> loaded = RecurrentState<T>::load(in, map, server);
    CHECK(in.peek() == std::char_traits<char>::eof());  // read to its last byte, no further
    CHECK(loaded.s() == original.s());
    CHECK(loaded.z() == original.z());
    CHECK(loaded.sums().log_scale == original.sums().log_scale);
    CHECK(loaded.tokens() == n);
    CHECK(loaded.options().chunk == 7);
    CHECK_FALSE(loaded.options().check_finite);
    CHECK(saved_bytes(loaded, map) == bytes);
    const Matrix<T> q = gaussian<T>(1, dk, 310, 0.5), k = gaussian<T>(1, dk, 311, 0.5);
    const Matrix<T> v = gaussian<T>(1, dv, 312);
    CHECK(loaded.step(q.row(0), k.row(0), v.row(0), map) ==
          original.step(q.row(0), k.row(0), v.row(0), map));
  };
  check(linattn::Identity{}, "Identity");
  check(linattn::EluPlusOne{}, "EluPlusOne");
  check(linattn::Relu{}, "Relu");
  check(linattn::PositiveRandomFeatures(dk, 6, 5), "PositiveRandomFeatures");
  check(linattn::PositiveRandomFeatures(dk, 3, 5, hyperbolic), "PositiveRandomFeatures hyp.");
  check(linattn::RandomFourierFeatures(dk, 5, 9), "RandomFourierFeatures");
  check(ScaledFeatures{}, "user map");
  check(FingerprintedFeatures{}, "user map with fingerprint()");
}

TEMPLATE_TEST_CASE("load(is, map, options) names the option that differs",
                   "[recurrent_state][persistence][errors]", float) {
  using T = TestType;
  linattn::Options saved;
  saved.decay = 0.5;
  saved.normalize = false;
  const linattn::EluPlusOne map;
  const std::string bytes = saved_bytes(stepped<T>(map, 3, 2, 5, saved, 320), map);
  CHECK(load_error<T>(bytes, map, saved).empty());
  linattn::Options other = saved;
  other.decay = 0.99;
  CHECK_THAT(load_error<T>(bytes, map, other),
             Contains("the state was saved with decay 0.5 but options.decay is 0.99"));
  other = saved;
  other.eps = 1e-5;
  CHECK_THAT(load_error<T>(bytes, map, other),
             Contains("saved with eps 1e-06 but options.eps is 1e-05"));
  other = saved;
  other.normalize = true;
  CHECK_THAT(load_error<T>(bytes, map, other),
             Contains("saved with normalize off but options.normalize is on"));
  other = saved;
  other.decay = std::nextafter(0.5, 1.0);  // compared bit for bit
  CHECK_THAT(load_error<T>(bytes, map, other), Contains("options.decay is 0.5000000000000001"));
  // Options that do not change results are the server's business.
  other = saved;
  other.chunk = 3;
  other.threads = 2;
  other.check_finite = false;
  CHECK(load_error<T>(bytes, map, other).empty());
  // The server's own options are validated first.
  other = saved;
  other.decay = 2.0;
  CHECK_THAT(load_error<T>(bytes, map, other), Contains("Options::decay"));
  // The scale (docs/design.md's Options::scale; recorded as 1 while Options has none).
  std::string scaled = bytes;
  const double two = 2.0;
  std::memcpy(&scaled[59], &two, 8);  // little-endian hosts only; checked just below
  REQUIRE(static_cast<unsigned char>(scaled[66]) == 0x40);
  scaled = with_checksum(scaled);
  CHECK_THAT(load_error<T>(scaled, map, saved), Contains("scale 2"));
}

TEMPLATE_TEST_CASE("load(is, map, options) names the map setting that differs",
                   "[recurrent_state][persistence][errors]", float) {
  using T = TestType;
  const linattn::Options options;
  const Eigen::Index dk = 4, dv = 2;
  const linattn::PositiveRandomFeatures seed5(dk, 8, 5), seed6(dk, 8, 6);
  const std::string favor = saved_bytes(stepped<T>(seed5, dk, dv, 9, options, 330), seed5);
  CHECK(load_error<T>(favor, seed5, options).empty());
  {
    const std::string error = load_error<T>(favor, seed6, options);
    INFO(error);
    CHECK_THAT(error, Contains("saved with PositiveRandomFeatures W hash 0x"));
    CHECK_THAT(error, Contains("(seed 5, orthogonal, chi rows) but the map's W differs"));
    CHECK_THAT(error, Contains("(seed 6, orthogonal, chi rows)"));
    const std::string hash =
        linattn::detail::hex64(linattn::detail::projection_hash(seed5.projection()));
    CHECK_THAT(error, Contains(hash));
  }
  linattn::PositiveRandomFeatures redrawn = seed6;
  redrawn.redraw(5);  // the same W again: loads
  CHECK(load_error<T>(favor, redrawn, options).empty());
  CHECK_THAT(load_error<T>(favor, linattn::EluPlusOne{}, options),
             Contains("saved with feature map PositiveRandomFeatures but the map given is "
                      "EluPlusOne"));
  CHECK_THAT(load_error<T>(favor, linattn::PositiveRandomFeatures(2, 8, 5), options),
             Contains("PositiveRandomFeatures input_dim 4 but the map's input_dim is 2"));
  linattn::RandomFeatureOptions hyperbolic;
  hyperbolic.hyperbolic = true;
  CHECK_THAT(load_error<T>(favor, linattn::PositiveRandomFeatures(dk, 4, 5, hyperbolic), options),
             Contains("PositiveRandomFeatures num_features 8 but the map's num_features is 4"));
  const linattn::PositiveRandomFeatures hyp(dk, 8, 5, hyperbolic);
  const std::string favor_hyp = saved_bytes(stepped<T>(hyp, dk, dv, 3, options, 331), hyp);
  CHECK_THAT(load_error<T>(favor_hyp, seed5, options),
             Contains("PositiveRandomFeatures hyperbolic on but the map's options().hyperbolic "
                      "is off"));
  linattn::RandomFeatureOptions hot;
  hot.temperature = 0.25;
  CHECK_THAT(load_error<T>(favor, linattn::PositiveRandomFeatures(dk, 8, 5, hot), options),
             Contains("PositiveRandomFeatures temperature 0.5 but the map's temperature is 0.25"));
  // An explicit temperature equal to the default 1/sqrt(Dk) is the same map.
  linattn::RandomFeatureOptions half;
  half.temperature = 0.5;
  CHECK(load_error<T>(favor, linattn::PositiveRandomFeatures(dk, 8, 5, half), options).empty());

  const linattn::RandomFourierFeatures fourier(dk, 3, 7);
  const std::string rff = saved_bytes(stepped<T>(fourier, dk, dv, 4, options, 332), fourier);
  linattn::RandomFeatureOptions iid;
  iid.projection = linattn::Projection::iid;
  iid.row_norm = linattn::RowNorm::fixed;
  {
    const std::string error =
        load_error<T>(rff, linattn::RandomFourierFeatures(dk, 3, 7, iid), options);
    CHECK_THAT(error, Contains("saved with RandomFourierFeatures W hash"));
    CHECK_THAT(error, Contains("(seed 7, orthogonal, chi rows) but the map's W differs"));
    CHECK_THAT(error, Contains("(seed 7, iid, fixed rows)"));
  }
  CHECK_THAT(load_error<T>(rff, seed5, options),
             Contains("saved with feature map RandomFourierFeatures but the map given is "
                      "PositiveRandomFeatures"));
  // RandomFourierFeatures ignores hyperbolic, so it is not part of its fingerprint.
  CHECK(load_error<T>(rff, linattn::RandomFourierFeatures(dk, 3, 7, hyperbolic), options).empty());
  {
    std::string edited = rff;
    edited[70] = 1;  // the record's hyperbolic byte
    std::istringstream in(with_checksum(edited));
    CHECK_THROWS_WITH(RecurrentState<T>::load_unchecked(in),
                      Contains("hyperbolic on RandomFourierFeatures, which has no such setting"));
  }

  const RecurrentState<T> plain = stepped<T>(linattn::Identity{}, 3, dv, 4, options, 333);
  const std::string identity = saved_bytes(plain, linattn::Identity{});
  CHECK_THAT(load_error<T>(identity, linattn::Relu{}, options),
             Contains("saved with feature map Identity but the map given is Relu"));
  CHECK_THAT(load_error<T>(identity, ScaledFeatures{}, options),
             Contains("saved with feature map Identity but the map given is a user map without "
                      "fingerprint()"));
  const std::string user = saved_bytes(plain, FingerprintedFeatures{});
  FingerprintedFeatures other;
  other.factor = 3.0;
  CHECK(load_error<T>(user, FingerprintedFeatures{}, options).empty());
  CHECK_THAT(load_error<T>(user, other, options),
             Contains("saved with a user map of fingerprint() 0x4000000000000000 but the map's "
                      "fingerprint() is 0x4008000000000000"));
  CHECK_THAT(load_error<T>(user, ScaledFeatures{}, options),
             Contains("saved with feature map a user map with fingerprint() but the map given is "
                      "a user map without fingerprint()"));
  // save(os) records no map: a checked load refuses it, load_unchecked reads it.
  const std::string no_map = saved_bytes(plain);
  CHECK_THAT(load_error<T>(no_map, linattn::Identity{}, options),
             Contains("saved without its feature map (save(os))"));
  std::istringstream in(no_map);
  CHECK(RecurrentState<T>::load_unchecked(in).s() == plain.s());
}

TEMPLATE_TEST_CASE("save(os, map) refuses a map that does not fit the state, writing nothing",
                   "[recurrent_state][persistence][errors]", float) {
  using T = TestType;
  const RecurrentState<T> state(5, 2);
  std::ostringstream os;
  CHECK_THROWS_WITH(state.save(os, linattn::PositiveRandomFeatures(3, 8)),
                    Contains("RecurrentState::save: the feature map (PositiveRandomFeatures) "
                             "gives 8 features but the state holds 5"));
  CHECK_THROWS_WITH(state.save(os, linattn::RandomFourierFeatures(3, 2)),
                    Contains("gives 4 features but the state holds 5"));
  CHECK(os.str().empty());
  CHECK_NOTHROW(state.save(os, ScaledFeatures{}));  // a user map's C is not known
}

TEMPLATE_TEST_CASE("format 4: the layout, and records save could not have written",
                   "[recurrent_state][persistence][errors]", float, double) {
  using T = TestType;
  const Eigen::Index dk = 3, c = 6, dv = 2;
  const linattn::PositiveRandomFeatures map(dk, c, 11);
  const RecurrentState<T> state = stepped<T>(map, dk, dv, 5, linattn::Options{}, 340);
  const std::string bytes = saved_bytes(state, map);
  REQUIRE(bytes.size() == 119 + (c * dv + c) * sizeof(T) + 4);
  const auto u64_at = [&](std::size_t at) {
    std::uint64_t value = 0;
    for (int i = 0; i < 8; ++i) {
      value |= std::uint64_t{static_cast<unsigned char>(bytes[at + i])} << (8 * i);
    }
    return value;
  };
  CHECK(bytes.substr(0, 8) == std::string("LNATTNS\0", 8));
  CHECK(bytes[8] == 4);
  CHECK(bytes[12] == static_cast<char>(sizeof(T)));
  CHECK(u64_at(16) == static_cast<std::uint64_t>(c));
  CHECK(u64_at(24) == static_cast<std::uint64_t>(dv));
  CHECK(bytes[32] == 0);   // StateFamily::linear
  CHECK(bytes[33] == 1);   // TransitionKind::decay
  CHECK(u64_at(34) == 5);  // tokens
  CHECK(bytes[58] == 1);   // normalize
  CHECK(bytes[67] == 4);   // PositiveRandomFeatures
  CHECK(u64_at(71) == static_cast<std::uint64_t>(dk));
  CHECK(u64_at(79) == static_cast<std::uint64_t>(c));
  CHECK(u64_at(95) == 11);  // seed
  CHECK(u64_at(103) == linattn::detail::projection_hash(map.projection()));

  // The hash: FNV-1a 64 of rows, cols and the entries' bits, all little-endian (known answers
  // computed independently).
  linattn::detail::Fnv1a64 empty;
  CHECK(empty.value() == 0xcbf29ce484222325ull);
  linattn::detail::Fnv1a64 a;
  a.update(reinterpret_cast<const unsigned char*>("a"), 1);
  CHECK(a.value() == 0xaf63dc4c8601ec8cull);
  Matrix<double> w(2, 2);
  w << 1.0, -0.5, 0.25, 2.0;
  CHECK(linattn::detail::projection_hash(w) == 0x05ea1d364ba3d0a8ull);
  CHECK(linattn::detail::projection_hash(Eigen::MatrixXd(w)) == 0x05ea1d364ba3d0a8ull);

  // Each edit keeps a valid checksum: only the field check can refuse it.
  const auto edited = [&](std::size_t at, unsigned char value) {
    std::string e = bytes;
    e[at] = static_cast<char>(value);
    std::istringstream in(with_checksum(e));
    try {
      (void)RecurrentState<T>::load_unchecked(in);
    } catch (const linattn::Error& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  CHECK_THAT(edited(67, 9), Contains("invalid feature map record (unknown kind)"));
  CHECK_THAT(edited(68, 2), Contains("invalid feature map record (a flag over 1)"));
  CHECK_THAT(edited(67, 2), Contains("random-map settings on EluPlusOne"));
  CHECK_THAT(edited(79, 7), Contains("PositiveRandomFeatures giving 7 features on a state of 6"));
  CHECK_THAT(edited(94, 0xFF), Contains("temperature that is not positive and finite"));
  CHECK_THAT(edited(58, 2), Contains("invalid normalize byte 2"));
  CHECK_THAT(edited(33, 4), Contains("invalid transition record: unknown kind 4"));
  CHECK_THAT(edited(32, 3), Contains("unknown state family 3"));
  CHECK_THAT(edited(32, 1), Contains("the stream holds a DeltaRuleState, not a RecurrentState"));
  CHECK(edited(33, 0).empty());  // none: not known (a format-2 state saved again), loads
  CHECK(edited(33, 2).empty());  // scalar gates: a state of that kind loads
  CHECK(edited(70, 0).empty());  // hyperbolic off as saved: the untouched record loads
  // Fields that Identity and user maps do not have.
  const RecurrentState<T> plain = stepped<T>(linattn::Identity{}, 2, dv, 2, {}, 341);
  for (const bool user : {false, true}) {
    std::string e =
        user ? saved_bytes(plain, ScaledFeatures{}) : saved_bytes(plain, linattn::Identity{});
    e[user ? 71 : 103] = 1;  // input_dim of the user map, hash of Identity
    std::istringstream in(with_checksum(e));
    CHECK_THROWS_WITH(
        RecurrentState<T>::load_unchecked(in),
        Contains(user ? "an input_dim on a user map without fingerprint()" : "a hash on Identity"));
  }
}

TEMPLATE_TEST_CASE("a state keeps the transition it is moved by, through save and load",
                   "[recurrent_state][persistence][errors]", float, double) {
  using T = TestType;
  using linattn::TransitionKind;
  const Eigen::Index c = 4, dv = 3, n = 6;
  const Matrix<T> q = gaussian<T>(n, c, 361, 0.5).cwiseAbs(),
                  k = gaussian<T>(n, c, 362, 0.5).cwiseAbs();
  const Matrix<T> v = gaussian<T>(n, dv, 363);
  const Matrix<T> scalar = Matrix<T>::Constant(n, 1, T(0.9));
  const Matrix<T> feature = Matrix<T>::Constant(n, c, T(0.8));
  const linattn::Identity id;
  // Every call of each kind on `state`: the one that continues it works, the others throw
  // naming both kinds and leave the saved bytes as they were.
  const auto only_kind = [&](RecurrentState<T>& state, TransitionKind kind) {
    const std::string before = saved_bytes(state, id);
    const auto refused = [&](const auto& call, const char* gives) {
      INFO("the state is moved by " << linattn::detail::transition_name(kind) << ", the call gives "
                                    << gives);
      CHECK_THROWS_WITH(call(), Contains(linattn::detail::transition_name(kind)) &&
                                    Contains(std::string("this call gives ") + gives));
      CHECK(saved_bytes(state, id) == before);
    };
    const auto step_decay = [&] { (void)state.step(q.row(0), k.row(0), v.row(0), id); };
    const auto prefill_decay = [&] { (void)state.prefill(q, k, v, id); };
    const auto step_scalar = [&] { (void)state.step(q.row(0), k.row(0), v.row(0), T(0.9), id); };
    const auto prefill_scalar = [&] { (void)state.prefill(q, k, v, scalar, id); };
    const auto step_feature = [&] {
      (void)state.step(q.row(0), k.row(0), v.row(0), feature.row(0), id);
    };
    const auto prefill_feature = [&] { (void)state.prefill(q, k, v, feature, id); };
    if (kind != TransitionKind::decay) {
      refused(step_decay, "Options::decay");
      refused(prefill_decay, "Options::decay");
    }
    if (kind != TransitionKind::scalar_gates) {
      refused(step_scalar, "scalar gates");
      refused(prefill_scalar, "scalar gates");
    }
    if (kind != TransitionKind::feature_gates) {
      refused(step_feature, "per-feature gates");
      refused(prefill_feature, "per-feature gates");
    }
    CHECK(state.transition() == kind);
  };
  for (const TransitionKind kind :
       {TransitionKind::decay, TransitionKind::scalar_gates, TransitionKind::feature_gates}) {
    INFO("kind " << static_cast<int>(kind));
    RecurrentState<T> state(c, dv);
    CHECK(state.transition() == TransitionKind::none);
    if (kind == TransitionKind::decay) (void)state.prefill(q, k, v, id);
    if (kind == TransitionKind::scalar_gates)
      (void)state.step(q.row(0), k.row(0), v.row(0), T(0.5), id);
    if (kind == TransitionKind::feature_gates) (void)state.prefill(q, k, v, feature, id);
    only_kind(state, kind);
    // Saved and loaded (checked and unchecked), it keeps its kind and still refuses the others.
    std::stringstream stream;
    state.save(stream, id);
    RecurrentState<T> loaded = RecurrentState<T>::load(stream, id, {});
    only_kind(loaded, kind);
    std::istringstream again(saved_bytes(state, id));
    RecurrentState<T> unchecked = RecurrentState<T>::load_unchecked(again);
    only_kind(unchecked, kind);
    // reset() forgets it.
    state.reset();
    CHECK(state.transition() == TransitionKind::none);
  }
  // from_sums starts with no kind (FLA's initial_state carries none): the first call sets it.
  RecurrentState<T> given =
      RecurrentState<T>::from_sums(Matrix<T>::Ones(c, dv), Vector<T>::Ones(c));
  CHECK(given.transition() == TransitionKind::none);
  (void)given.prefill(q, k, v, scalar, id);
  only_kind(given, TransitionKind::scalar_gates);
  // A decayed state is of kind decay: gates throw there for the decay itself.
  linattn::Options decayed;
  decayed.decay = 0.9;
  RecurrentState<T> retention(c, dv, decayed);
  (void)retention.step(q.row(0), k.row(0), v.row(0), id);
  CHECK(retention.transition() == TransitionKind::decay);
}

TEST_CASE("format-3 and format-2 files of earlier releases load with their exact sums",
          "[recurrent_state][persistence]") {
  using linattn::TransitionKind;
  // make_state_v3.cpp's state: eps 1e-5, decay 0.5, normalize, scale 0.5, saved with
  // Identity; S = sum_t 0.5^(2 - t) k_t v_t^T and z likewise, exact in binary.
  const std::string v3 = data_file("state_v3_double_identity.bin");
  REQUIRE(v3.size() == 118 + (3 * 2 + 3) * 8 + 4);
  const GoldenSums golden;
  const Matrix<double>& s = golden.s;
  const Vector<double>& z = golden.z;
  CHECK(s(0, 0) == 0x1.44p+2);  // as make_state_v3 printed it
  linattn::Options options;
  options.eps = 1e-5;
  options.decay = 0.5;
  options.scale = 0.5;
  // Format 2 (0.2.0 before the transition byte) is format 3 without the byte at offset 101.
  std::string v2 = v3;
  v2.erase(101, 1);
  v2[8] = 2;
  v2 = with_checksum(v2);
  const std::string* const formats[] = {&v3, &v2};
  for (const std::string* bytes : formats) {
    INFO("format " << int((*bytes)[8]));
    std::istringstream in(*bytes);
    RecurrentState<double> state = RecurrentState<double>::load(in, linattn::Identity{}, options);
    CHECK(static_cast<std::size_t>(in.tellg()) == bytes->size());
    CHECK(state.s() == s);
    CHECK(state.z() == z);
    CHECK(state.tokens() == 3);
    CHECK(state.transition() == TransitionKind::decay);
    const linattn::SavedStateInfo info = linattn::saved_state_info(bytes->data(), bytes->size());
    CHECK(info.family == linattn::StateFamily::linear);
    CHECK(info.format_version == static_cast<std::uint32_t>((*bytes)[8]));
    CHECK(info.scalar_bytes == 8);
    CHECK((info.rows == 3 && info.cols == 2 && info.tokens == 3));
    // It continues as the recurrence does (exactly: dyadic values), and saves in format 4.
    Vector<double> q(3), k4(3), v4(2);
    q << 0.5, -1.0, 2.0;
    k4 << 1.0, 1.0, -0.5;
    v4 << 0.25, -2.0;
    (void)state.step(q, k4, v4, linattn::Identity{});
    CHECK(state.s() == Matrix<double>(0.5 * s + k4 * v4.transpose()));
    CHECK(state.z() == Vector<double>(0.5 * z + k4));
    const std::string upgraded = saved_bytes(state, linattn::Identity{});
    CHECK(upgraded[8] == 4);
    CHECK(load_error<double>(upgraded, linattn::Identity{}, options).empty());
  }
  // Format 2 did not record gates: without a decay the kind is left to the next call, and
  // format 3 keeps what it recorded.
  const auto with_decay_one = [](std::string bytes) {
    const double one = 1.0;
    std::memcpy(&bytes[40], &one, 8);  // little-endian hosts only; checked just below
    REQUIRE(static_cast<unsigned char>(bytes[47]) == 0x3F);
    return with_checksum(bytes);
  };
  std::istringstream v2_plain(with_decay_one(v2));
  CHECK(RecurrentState<double>::load_unchecked(v2_plain).transition() == TransitionKind::none);
  std::istringstream v3_plain(with_decay_one(v3));
  CHECK(RecurrentState<double>::load_unchecked(v3_plain).transition() == TransitionKind::decay);
}

TEMPLATE_TEST_CASE("an empty or unreadable stream says so",
                   "[recurrent_state][persistence][errors]", float) {
  using T = TestType;
  std::istringstream empty;
  CHECK_THROWS_WITH(RecurrentState<T>::load_unchecked(empty),
                    Contains("RecurrentState::load_unchecked: the stream is empty"));
  std::istringstream empty_too;
  CHECK_THROWS_WITH(RecurrentState<T>::load(empty_too, linattn::Identity{}, linattn::Options{}),
                    Contains("RecurrentState::load: the stream is empty"));
  std::ifstream missing("/nonexistent/linattn-state-file", std::ios::binary);
  CHECK_THROWS_WITH(RecurrentState<T>::load_unchecked(missing),
                    Contains("the stream could not be read"));
  std::istringstream short_magic("LNAT");
  CHECK_THROWS_WITH(RecurrentState<T>::load_unchecked(short_magic),
                    Contains("stream ends inside the magic bytes (truncated state)"));
}

TEST_CASE("format-1 golden files of linattn 0.1.0 load with their exact sums",
          "[recurrent_state][persistence]") {
  {
    const std::string bytes = data_file("state_v1_double_identity.bin");
    REQUIRE(bytes.size() == 150);
    std::istringstream in(bytes);
    RecurrentState<double> state = RecurrentState<double>::load_unchecked(in);
    // What make_state_v1.cpp stepped: S = sum_t 0.5^(2 - t) k_t v_t^T, exact in binary.
    const GoldenSums golden;
    Matrix<double> s = golden.s;
    const Vector<double>& z = golden.z;
    CHECK(s(0, 0) == 5.0625);
    CHECK(state.s() == s);
    CHECK(state.z() == z);
    CHECK(state.tokens() == 3);
    CHECK(state.transition() == linattn::TransitionKind::decay);  // 0.1.0 had no gated state
    CHECK(state.sums().log_scale == 0.0);
    CHECK(state.options().eps == 1e-5);
    CHECK(state.options().decay == 0.5);
    CHECK_FALSE(state.options().normalize);
    CHECK(state.options().chunk == 16);
    CHECK(state.options().check_finite);
    // It continues as the recurrence does (exactly: dyadic values).
    Vector<double> q(3), k4(3), v4(2);
    q << 0.5, -1.0, 2.0;
    k4 << 1.0, 1.0, -0.5;
    v4 << 0.25, -2.0;
    const Vector<double> out = state.step(q, k4, v4, linattn::Identity{});
    s = 0.5 * s + k4 * v4.transpose();
    CHECK(out == Vector<double>(s.transpose() * q));
    // A checked load refuses it: format 1 records no map.
    std::istringstream again(bytes);
    linattn::Options options = state.options();
    CHECK_THROWS_WITH(RecurrentState<double>::load(again, linattn::Identity{}, options),
                      Contains("format version 1 (linattn 0.1.0), which records no feature map"));
    // ... but the options are compared first.
    std::istringstream third(bytes);
    options.decay = 0.25;
    CHECK_THROWS_WITH(RecurrentState<double>::load(third, linattn::Identity{}, options),
                      Contains("saved with decay 0.5 but options.decay is 0.25"));
    // Upgrading: load_unchecked, then save with the map the caller vouches for.
    std::istringstream fourth(bytes);
    const std::string upgraded =
        saved_bytes(RecurrentState<double>::load_unchecked(fourth), linattn::Identity{});
    CHECK(upgraded[8] == 4);
    CHECK(load_error<double>(upgraded, linattn::Identity{}, state.options()).empty());
  }
  {
    const std::string bytes = data_file("state_v1_float_favor.bin");
    REQUIRE(bytes.size() == 142);
    std::istringstream in(bytes);
    RecurrentState<float> state = RecurrentState<float>::load_unchecked(in);
    Matrix<float> s(4, 3);
    s << 0x1.8844fp+0f, 0x1.a4c1eap+0f, -0x1.122724p-1f, 0x1.c26c5cp+1f, 0x1.28046ep-1f,
        -0x1.710fp-5f, 0x1.a8547p+0f, 0x1.719e7p+0f, -0x1.96d91ap-2f, 0x1.1db53ap+2f,
        0x1.8776dap-2f, -0x1.c4bbp-3f;
    Vector<float> z(4);
    z << 0x1.4a72ccp+0f, 0x1.09aaecp+1f, 0x1.524426p+0f, 0x1.3ad22cp+1f;
    const linattn::ScaledSums<float> held = state.sums();  // the file's bits
    CHECK(held.s == s);
    CHECK(held.z == z);
    CHECK(state.tokens() == 4);
    CHECK(held.log_scale == -0x1.b78f4f7d1cf78p-4);
    CHECK(state.options().decay == 1.0);
    CHECK(state.options().eps == 1e-6);
    CHECK(state.options().normalize);
    // The file's sums are the sums of its four tokens (recomputed here in double).
    const linattn::PositiveRandomFeatures map(2, 4, 3);
    Matrix<double> x(4, 2), v(4, 3);
    x << 0.5, -1.0, 1.5, 0.25, -0.75, 2.0, 1.0, 1.0;
    v << 1.0, 2.0, -1.0, 0.5, -0.5, 3.0, -2.0, 1.0, 0.25, 4.0, 0.0, -3.0;
    const Matrix<double> phi = map.keys(x);
    const Matrix<double> true_s = phi.transpose() * v;
    CHECK(relative_error(state.s(), true_s) <= 2e-6);  // s() and z() are the true sums
    CHECK(relative_error(state.z(), Vector<double>(phi.colwise().sum().transpose())) <= 2e-6);
  }
}

TEMPLATE_TEST_CASE("from_sums: prefilling B after the sums of A is one call over A then B",
                   "[recurrent_state][from_sums]", float, double) {
  using T = TestType;
  const Eigen::Index dk = 4, dv = 3, n_a = 37, n_b = 45, n = n_a + n_b;
  const Matrix<T> x_q = gaussian<T>(n, dk, 350, 0.5), x_k = gaussian<T>(n, dk, 351, 0.5);
  const Matrix<T> v = gaussian<T>(n, dv, 352);
  // Positive features for Identity, so the normalised outputs are well conditioned.
  const Matrix<T> f_q = (x_q.array().abs() + T(0.1)).matrix();
  const Matrix<T> f_k = (x_k.array().abs() + T(0.1)).matrix();
  const double bound = agreement_tolerance<T>();
  double worst = 0.0;
  const auto check = [&](const auto& map, const Matrix<T>& q, const Matrix<T>& k,
                         bool through_log_scale, const char* name) {
    for (const double decay : {1.0, 0.9}) {
      for (const bool normalize : {true, false}) {
        linattn::Options options;
        options.decay = decay;
        options.normalize = normalize;
        INFO(name << ", decay " << decay << ", normalize " << normalize << ", log scale "
                  << through_log_scale);
        const Matrix<double> phi_q = map.queries(q.template cast<double>());
        const Matrix<double> phi_k = map.keys(k.template cast<double>());
        const Eigen::Index c = phi_q.cols();
        // The sums of A, by the naive recurrence, then B continued from them.
        const NaiveRun a = naive_recurrence(phi_q.topRows(n_a), phi_k.topRows(n_a),
                                            v.topRows(n_a).template cast<double>(), options,
                                            Matrix<double>::Zero(c, dv), Vector<double>::Zero(c));
        const NaiveRun b =
            naive_recurrence(phi_q.bottomRows(n_b), phi_k.bottomRows(n_b),
                             v.bottomRows(n_b).template cast<double>(), options, a.s, a.z);
        double log_scale = 0.0;
        if (through_log_scale) log_scale = std::log(a.s.cwiseAbs().maxCoeff()) + 3.0;
        const double shrink = std::exp(-log_scale);
        RecurrentState<T> state =
            RecurrentState<T>::from_sums((a.s * shrink).template cast<T>(),
                                         (a.z * shrink).template cast<T>(), options, log_scale);
        CHECK(state.tokens() == 0);
        CHECK(state.sums().log_scale == log_scale);
        const Matrix<T> out =
            state.prefill(q.bottomRows(n_b), k.bottomRows(n_b), v.bottomRows(n_b), map);
        const Matrix<T> whole = linattn::causal_linear_attention(q, k, v, map, options);
        const double vs_naive = relative_error(out, b.out);
        const double vs_call = relative_error(out, whole.bottomRows(n_b));
        const double s_error = relative_error(state.s(), b.s);
        CHECK(vs_naive <= bound);
        CHECK(vs_call <= bound);
        CHECK(s_error <= bound);
        worst = std::max({worst, vs_naive, vs_call, s_error});
      }
    }
  };
  check(linattn::Identity{}, f_q, f_k, false, "Identity");
  check(linattn::EluPlusOne{}, x_q, x_k, false, "EluPlusOne");
  const linattn::PositiveRandomFeatures favor(dk, 16, 21);
  check(favor, x_q, x_k, true, "PositiveRandomFeatures");
  check(favor, x_q, x_k, false, "PositiveRandomFeatures");
  WARN("from_sums, worst max|a - b| / max|b| over maps, decays and normalize: " << worst);
}

TEMPLATE_TEST_CASE("from_sums takes any expression and validates what it is given",
                   "[recurrent_state][from_sums][errors]", float) {
  using T = TestType;
  // Column-major S as a transposed expression, z as a row vector of another scalar type.
  const Eigen::MatrixXd s_t = Eigen::MatrixXd::Constant(2, 3, 0.5);
  const Eigen::RowVectorXf z_row = Eigen::RowVectorXf::Constant(3, 2.0f);
  const RecurrentState<T> state = RecurrentState<T>::from_sums(s_t.transpose(), z_row);
  CHECK(state.feature_dim() == 3);
  CHECK(state.value_dim() == 2);
  CHECK(state.s() == Matrix<T>::Constant(3, 2, T(0.5)));
  CHECK(state.z() == Vector<T>::Constant(3, T(2)));
  CHECK(state.sums().log_scale == 0.0);
  // A double accumulator keeps double sums exactly.
  const Matrix<double> fine = Matrix<double>::Constant(2, 2, 1.0 + 1e-12);
  const auto wide = RecurrentState<T, double>::from_sums(fine, Vector<double>::Ones(2));
  CHECK(wide.s() == fine);

  const Matrix<T> s = Matrix<T>::Ones(3, 2);
  const Vector<T> z = Vector<T>::Ones(3);
  using State = RecurrentState<T>;
  CHECK_THROWS_WITH(State::from_sums(Matrix<T>(0, 2), Vector<T>(0)),
                    Contains("RecurrentState::from_sums: s0 is empty (0 x 2)"));
  CHECK_THROWS_WITH(State::from_sums(s, Vector<T>::Ones(2)),
                    Contains("z0 is 2 x 1, expected a vector of 3 entries"));
  CHECK_THROWS_WITH(State::from_sums(s, Matrix<T>::Ones(3, 2)), Contains("z0 is 3 x 2"));
  Matrix<T> bad_s = s;
  bad_s(1, 1) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH(State::from_sums(bad_s, z), Contains("s0 has a non-finite value"));
  Vector<T> bad_z = z;
  bad_z(2) = std::numeric_limits<T>::infinity();
  CHECK_THROWS_WITH(State::from_sums(s, bad_z), Contains("z0 has a non-finite value"));
  if constexpr (std::is_same_v<T, float>) {
    // 1e300 does not fit the float state.
    CHECK_THROWS_WITH(State::from_sums(Matrix<double>::Constant(3, 2, 1e300), z),
                      Contains("s0 has a non-finite value"));
  }
  const double inf = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH(State::from_sums(s, z, {}, std::nan("")), Contains("log_scale must be finite"));
  CHECK_THROWS_WITH(State::from_sums(s, z, {}, inf), Contains("log_scale must be finite"));
  CHECK_THROWS_WITH(
      State::from_sums(s, z, {}, -inf),
      Contains("log_scale is -infinity (no token yet) but s0 or z0 holds a non-zero"));
  linattn::Options bad;
  bad.decay = 0.0;
  CHECK_THROWS_WITH(State::from_sums(s, z, bad), Contains("Options::decay"));
  // Without normalize there is no z to give; with it, z0 is required.
  linattn::Options numerator;
  numerator.normalize = false;
  const State plain = State::from_sums(s_t.transpose(), numerator, 0.5);
  CHECK(plain.sums().s == Matrix<T>::Constant(3, 2, T(0.5)));
  CHECK(plain.sums().log_scale == 0.5);
  CHECK(relative_error(plain.s(), Matrix<double>::Constant(3, 2, 0.5 * std::exp(0.5))) <=
        2 * std::numeric_limits<T>::epsilon());
  CHECK(plain.z() == Vector<T>::Zero(3));
  CHECK_THROWS_WITH(State::from_sums(s, linattn::Options{}),
                    Contains("Options::normalize is on, so the state needs z0"));
  CHECK_THROWS_WITH(State::from_sums(Matrix<T>(0, 2), numerator), Contains("s0 is empty"));
  // -infinity with zero sums is a fresh state, and steps like one.
  State from_zero = State::from_sums(Matrix<T>::Zero(3, 2), Vector<T>::Zero(3), {}, -inf);
  State fresh(3, 2);
  const Matrix<T> x = gaussian<T>(2, 3, 360), vals = gaussian<T>(2, 2, 361);
  const linattn::PositiveRandomFeatures map(3, 3, 1);
  CHECK(from_zero.prefill(x, x, vals, map) == fresh.prefill(x, x, vals, map));
  CHECK(from_zero.sums().log_scale == fresh.sums().log_scale);
}

TEST_CASE("a gated state's s() and z() are the true sums, as FLA's final state",
          "[recurrent_state][gates]") {
  // Per-feature gates near 1 leave factors pending inside the state: s() and z() apply them.
  // (Before 0.4.0 s() was the held, scaled S: 1.03 relative error read as FLA's final state.)
  using Catch::Matchers::Contains;
  using T = float;
  const Eigen::Index n = 48, c = 6, dv = 5;
  const Matrix<T> phi_q = gaussian<T>(n, c, 601).array().exp().matrix();
  const Matrix<T> phi_k = gaussian<T>(n, c, 602).array().exp().matrix();
  const Matrix<T> v = gaussian<T>(n, dv, 603);
  const Matrix<T> logs = (gaussian<T>(n, c, 604).array().abs() * T(-0.02)).matrix();
  RecurrentState<T> state(c, dv);
  Matrix<double> s = Matrix<double>::Zero(c, dv);
  Eigen::VectorXd z = Eigen::VectorXd::Zero(c);
  const Eigen::Index split = 40;
  for (Eigen::Index t = 0; t < split; ++t) {
    state.step(phi_q.row(t), phi_k.row(t), v.row(t), linattn::log_gates(logs.row(t)),
               linattn::Identity{});
    const Eigen::ArrayXd a = logs.row(t).transpose().cast<double>().array().exp();
    s = (a.matrix().asDiagonal() * s).eval() +
        phi_k.row(t).transpose().cast<double>() * v.row(t).cast<double>();
    z = (a * z.array()).matrix() + phi_k.row(t).transpose().cast<double>();
  }
  const auto& held = linattn::detail::StateAccess::held(state);
  REQUIRE((held.row_log < 0.0).any());        // factors are pending
  REQUIRE(relative_error(held.s, s) > 1e-2);  // so the held S is not the true one
  CHECK(relative_error(state.s(), s) <= 1e-5);
  CHECK(relative_error(state.z(), z) <= 1e-5);

  // A state made from s() and z() goes on as this one does; from sums() too, closer still.
  RecurrentState<T> handed = RecurrentState<T>::from_sums(state.s(), state.z());
  RecurrentState<T> exact = RecurrentState<T>::from_sums(state.sums());
  for (Eigen::Index t = split; t < n; ++t) {
    // log_gates wraps its argument for the call: passed straight in, never kept.
    const auto step = [&](RecurrentState<T>& s) -> Vector<T> {
      return s.step(phi_q.row(t), phi_k.row(t), v.row(t), linattn::log_gates(logs.row(t)),
                    linattn::Identity{});
    };
    const Vector<T> want = step(state);
    CHECK(relative_error(step(handed), want) <= 1e-6);
    CHECK(relative_error(step(exact), want) <= 1e-6);
  }

  // Sums that float cannot hold as they are say where to read them.
  const auto big =
      RecurrentState<T>::from_sums(Matrix<T>::Ones(2, 2), Vector<T>::Ones(2), {}, 200.0);
  CHECK_THROWS_WITH(big.s(), Contains("RecurrentState::s: the true sums overflow float") &&
                                 Contains("read sums()"));
  CHECK_THROWS_WITH(big.z(), Contains("RecurrentState::z"));
  CHECK(big.sums().log_scale == 200.0);
  CHECK(big.sums().s == Matrix<T>::Ones(2, 2));
}

}  // namespace linattn_test_recurrent_state
