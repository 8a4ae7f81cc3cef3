// RecurrentState: step-by-step and prefill against the parallel routine, save/load, errors.
// EIGEN_RUNTIME_NO_MALLOC lets a test forbid heap allocation inside Eigen.
#define EIGEN_RUNTIME_NO_MALLOC
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <linattn/feature_maps.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/recurrent_state.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

using linattn::Matrix;
using linattn::RecurrentState;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

namespace {

template <class T>
double agreement_tolerance() {  // DESIGN.md: parallel and recurrent forms agree to this
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
  CHECK(state.log_scale() == -std::numeric_limits<double>::infinity());
  state.prefill(phi_q, phi_k, v, linattn::Identity{});
  Matrix<double> s = Matrix<double>::Zero(c, dv);
  Eigen::VectorXd z = Eigen::VectorXd::Zero(c);
  for (Eigen::Index j = 0; j < n; ++j) {
    const double w = std::pow(decay, double(n - 1 - j));
    s += w * phi_k.row(j).transpose().template cast<double>() * v.row(j).template cast<double>();
    z += w * phi_k.row(j).transpose().template cast<double>();
  }
  CHECK(state.log_scale() == 0.0);
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
  original.save(stream);
  RecurrentState<T> loaded = RecurrentState<T>::load(stream);
  CHECK(loaded.s() == original.s());
  CHECK(loaded.z() == original.z());
  CHECK(loaded.log_scale() == original.log_scale());
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
                   "[recurrent_state][persistence][errors]", float, double) {
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
    CHECK_THROWS_AS(RecurrentState<T>::load(truncated), linattn::Error);
  }
  for (std::size_t pos = 0; pos < bytes.size(); ++pos) {
    std::string corrupt = bytes;
    corrupt[pos] = static_cast<char>(corrupt[pos] ^ 0x10);
    std::istringstream in(corrupt);
    INFO("byte " << pos << " flipped");
    CHECK_THROWS_AS(RecurrentState<T>::load(in), linattn::Error);
  }
  std::istringstream intact(bytes);
  CHECK_NOTHROW(RecurrentState<T>::load(intact));
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
    CHECK_THROWS_WITH(RecurrentState<double>::load(in), Contains("magic"));
  }
  {
    std::string future = bytes;
    future[8] = 2;  // the format version follows the 8 magic bytes
    std::istringstream in(future);
    CHECK_THROWS_WITH(RecurrentState<double>::load(in), Contains("format version 2"));
  }
  {
    std::istringstream in(bytes);
    CHECK_THROWS_WITH(RecurrentState<float>::load(in), Contains("8-byte scalars"));
  }
  {
    std::string huge = bytes;
    for (int i = 16; i < 24; ++i) huge[i] = static_cast<char>(0xFF);  // feature_dim
    std::istringstream in(huge);
    CHECK_THROWS_WITH(RecurrentState<double>::load(in), Contains("over the limit"));
  }
  {
    std::istringstream in(bytes.substr(0, 30));
    CHECK_THROWS_WITH(RecurrentState<double>::load(in), Contains("truncated"));
  }
  {
    // A header within the limits (2^20 x 64) over a short payload: read as far as the stream
    // goes, then rejected, without first allocating the 512 MiB the header claims.
    std::string claims_big = bytes;
    for (int i = 16; i < 32; ++i) claims_big[i] = 0;
    claims_big[18] = 0x10;  // feature_dim = 2^20, little-endian
    claims_big[24] = 64;    // value_dim = 64
    std::istringstream in(claims_big);
    CHECK_THROWS_WITH(RecurrentState<double>::load(in), Contains("truncated"));
  }
  {
    // A token count near INT64_MAX (with a valid checksum) would overflow on the next step.
    std::string huge_count = bytes;
    for (int i = 58; i < 66; ++i) huge_count[i] = static_cast<char>(0xFF);
    huge_count[65] = 0x7F;
    linattn::detail::Crc32 crc;
    crc.update(reinterpret_cast<const unsigned char*>(huge_count.data()), huge_count.size() - 4);
    for (int i = 0; i < 4; ++i) {
      huge_count[huge_count.size() - 4 + i] = static_cast<char>((crc.value() >> (8 * i)) & 0xFF);
    }
    std::istringstream in(huge_count);
    CHECK_THROWS_WITH(RecurrentState<double>::load(in), Contains("token count"));
  }
  {
    std::string flipped = bytes;
    flipped[bytes.size() - 10] ^= 1;  // inside z
    std::istringstream in(flipped);
    CHECK_THROWS_WITH(RecurrentState<double>::load(in), Contains("checksum"));
  }
}

TEMPLATE_TEST_CASE("bad input throws and leaves the state as it was", "[recurrent_state][errors]",
                   float, double) {
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
