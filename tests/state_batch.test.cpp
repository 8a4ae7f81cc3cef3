// RecurrentStateBatch and DeltaRuleStateBatch: batch steps and prefill against per-session states,
// and errors that must leave every state as it was.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/feature_maps.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/layer.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/recurrent_state.hpp>
#include <linattn/state_batch.hpp>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_state_batch {

using linattn::HeadsView;
using linattn::Matrix;
using linattn::RecurrentState;
using linattn::RecurrentStateBatch;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::Kind;
using linattn_test::kind_name;

namespace {

constexpr Eigen::Index kDk = 8;
constexpr Eigen::Index kDv = 5;

const linattn::PositiveRandomFeatures& prf_map() {
  static const linattn::PositiveRandomFeatures map(kDk, 16, 3);
  return map;
}

Eigen::Index feature_dim(Kind kind) { return kind == Kind::prf ? 16 : kDk; }

/// rows x kDk inputs for a kind: elu + 1 of Gaussians when featurized, else raw Gaussians.
template <class T>
Matrix<T> inputs(Kind kind, Eigen::Index rows, std::uint64_t seed) {
  const Matrix<T> g = gaussian<T>(rows, kDk, seed);
  return kind == Kind::featurized ? linattn::EluPlusOne{}.queries(g) : g;
}

/// One batch step for a kind, into `out`.
template <class T, class DQ, class DK, class DV>
void batch_step(Kind kind, RecurrentStateBatch<T>& batch, const Eigen::MatrixBase<DQ>& q,
                const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                Eigen::Ref<Matrix<T>> out) {
  switch (kind) {
    case Kind::featurized:
      batch.step_into(q, k, v, linattn::Identity{}, out);
      return;
    case Kind::elu:
      batch.step_into(q, k, v, linattn::EluPlusOne{}, out);
      return;
    case Kind::prf:
      batch.step_into(q, k, v, prf_map(), out);
      return;
  }
}

/// One step of a single state for a kind.
template <class T, class DQ, class DK, class DV>
Vector<T> single_step(Kind kind, RecurrentState<T>& state, const Eigen::MatrixBase<DQ>& q,
                      const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v) {
  switch (kind) {
    case Kind::featurized:
      return state.step(q, k, v, linattn::Identity{});
    case Kind::elu:
      return state.step(q, k, v, linattn::EluPlusOne{});
    case Kind::prf:
      return state.step(q, k, v, prf_map());
  }
  return {};
}

/// True when the two states hold the same sums, bit for bit.
template <class T>
bool same_state(const RecurrentState<T>& a, const RecurrentState<T>& b) {
  // -infinity == -infinity, so fresh states compare equal too.
  const auto& held_a = linattn::detail::StateAccess::held(a);
  const auto& held_b = linattn::detail::StateAccess::held(b);
  return held_a.s == held_b.s && held_a.z == held_b.z && a.tokens() == b.tokens() &&
         held_a.log_scale == held_b.log_scale;
}

/// Steps `batch` and the per-session states `single` through `steps` random tokens; returns
/// the number of output rows that were not bit-identical.
template <class T>
int step_both(Kind kind, RecurrentStateBatch<T>& batch, std::vector<RecurrentState<T>>& single,
              Eigen::Index steps, std::uint64_t seed) {
  const Eigen::Index count = batch.size();
  int differing = 0;
  // Every other step writes into a block of a bigger matrix; its border must stay as it was.
  Matrix<T> big = Matrix<T>::Constant(count + 2, kDv + 3, T(-3));
  for (Eigen::Index t = 0; t < steps; ++t) {
    const std::uint64_t s = seed + 3 * static_cast<std::uint64_t>(t);
    const Matrix<T> q = inputs<T>(kind, count, s), k = inputs<T>(kind, count, s + 1);
    const Matrix<T> v = gaussian<T>(count, kDv, s + 2);
    Matrix<T> out(count, kDv);
    if (t % 2 == 0) {
      batch_step<T>(kind, batch, q, k, v, out);
    } else {
      batch_step<T>(kind, batch, q, k, v, big.block(1, 2, count, kDv));
      out = big.block(1, 2, count, kDv);
    }
    for (Eigen::Index i = 0; i < count; ++i) {
      const Vector<T> expected =
          single_step<T>(kind, single[static_cast<std::size_t>(i)], q.row(i), k.row(i), v.row(i));
      if (!(out.row(i).transpose() == expected)) ++differing;
    }
  }
  CHECK((big.topRows(1).array() == T(-3)).all());
  CHECK((big.bottomRows(1).array() == T(-3)).all());
  CHECK((big.leftCols(2).array() == T(-3)).all());
  CHECK((big.rightCols(1).array() == T(-3)).all());
  return differing;
}

/// A snapshot of every state of a batch.
template <class T>
std::vector<RecurrentState<T>> snapshot(const RecurrentStateBatch<T>& batch) {
  std::vector<RecurrentState<T>> states;
  for (Eigen::Index i = 0; i < batch.size(); ++i) states.push_back(batch[i]);
  return states;
}

template <class T>
int states_moved(const RecurrentStateBatch<T>& batch,
                 const std::vector<RecurrentState<T>>& before) {
  int moved = 0;
  for (Eigen::Index i = 0; i < batch.size(); ++i) {
    if (!same_state(batch[i], before[static_cast<std::size_t>(i)])) ++moved;
  }
  return moved;
}

}  // namespace

TEMPLATE_TEST_CASE("batch steps equal per-session RecurrentState steps bit for bit",
                   "[state_batch]", float) {
  using T = TestType;
  const Eigen::Index count = 6, steps = 40;
  int differing = 0, rows = 0;
  for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
    for (const double decay : {1.0, 0.97}) {
      for (const bool normalize : {true, false}) {
        for (const int threads : {1, 2, 4}) {
          linattn::Options options;
          options.decay = decay;
          options.normalize = normalize;
          options.threads = threads;
          RecurrentStateBatch<T> batch(count, feature_dim(kind), kDv, options);
          CHECK(batch.size() == count);
          CHECK(batch.feature_dim() == feature_dim(kind));
          CHECK(batch.value_dim() == kDv);
          CHECK(batch.options().decay == decay);
          std::vector<RecurrentState<T>> single(static_cast<std::size_t>(count),
                                                RecurrentState<T>(feature_dim(kind), kDv, options));
          INFO(kind_name(kind) << ", decay = " << decay << ", normalize = " << normalize
                               << ", threads = " << threads);
          const int d = step_both(kind, batch, single, steps, 1000);
          CHECK(d == 0);
          differing += d;
          rows += static_cast<int>(count * steps);
          for (Eigen::Index i = 0; i < count; ++i) {
            CHECK(same_state(batch[i], single[static_cast<std::size_t>(i)]));
            CHECK(batch[i].tokens() == steps);
          }
        }
      }
    }
  }
  WARN("batch vs per-session steps: " << differing << " of " << rows
                                      << " output rows not bit-identical");
}

TEMPLATE_TEST_CASE("a batch step that throws moves no state", "[state_batch][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  const Eigen::Index count = 6;
  for (const int threads : {1, 2}) {
    linattn::Options options;
    options.decay = 0.9;
    options.threads = threads;
    RecurrentStateBatch<T> batch(count, feature_dim(Kind::prf), kDv, options);
    std::vector<RecurrentState<T>> single(static_cast<std::size_t>(count),
                                          RecurrentState<T>(feature_dim(Kind::prf), kDv, options));
    REQUIRE(step_both(Kind::prf, batch, single, 5, 2000) == 0);
    const std::vector<RecurrentState<T>> before = snapshot(batch);

    const Matrix<T> q = gaussian<T>(count, kDk, 2100), k = gaussian<T>(count, kDk, 2101);
    const Matrix<T> v = gaussian<T>(count, kDv, 2102);
    const Matrix<T> phi_q = prf_map().queries(q), phi_k = prf_map().keys(k);
    Matrix<T> out = Matrix<T>::Constant(count, kDv, T(9));
    const Matrix<T> out_before = out;
    INFO("threads = " << threads);
    for (const T poison :
         {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity()}) {
      Matrix<T> bad_k = phi_k, bad_q = q, bad_v = v;
      bad_k(3, 2) = poison;
      bad_q(4, 0) = -poison;
      bad_v(count - 1, kDv - 1) = poison;
      CHECK_THROWS_WITH(batch.step_into(phi_q, bad_k, v, linattn::Identity{}, out),
                        Contains("RecurrentStateBatch::step") && Contains("phi_k") &&
                            Contains("row 3, column 2"));
      CHECK_THROWS_WITH(batch.step_into(phi_q, phi_k, bad_v, linattn::Identity{}, out),
                        Contains("v has a non-finite value") && Contains("row 5, column 4"));
      CHECK_THROWS_WITH(batch.step_into(bad_q, k, v, prf_map(), out),
                        Contains("q has a non-finite value") && Contains("row 4, column 0"));
      CHECK_THROWS_WITH(batch.step(q, k, bad_v, prf_map()), Contains("v has a non-finite value"));
    }
    // Wrong counts and widths.
    CHECK_THROWS_WITH(batch.step_into(phi_q.topRows(5), phi_k, v, linattn::Identity{}, out),
                      Contains("phi_q is 5 x 16 but the batch needs 6 x 16"));
    CHECK_THROWS_WITH(batch.step_into(phi_q, phi_k.leftCols(15), v, linattn::Identity{}, out),
                      Contains("phi_k is 6 x 15"));
    CHECK_THROWS_WITH(batch.step_into(phi_q, phi_k, v.leftCols(4), linattn::Identity{}, out),
                      Contains("v is 6 x 4"));
    Matrix<T> tall(count + 1, kDv);
    CHECK_THROWS_WITH(batch.step_into(phi_q, phi_k, v, linattn::Identity{}, tall),
                      Contains("out is 7 x 5"));
    CHECK_THROWS_WITH(batch.step(q, k.topRows(5), v, prf_map()), Contains("k is 5 x 8"));
    CHECK_THROWS_WITH(batch.step(q, k.leftCols(7), v, prf_map()), Contains("k is 6 x 7"));
    // A feature map whose width is not the states' C throws in every state, before any moves.
    const linattn::PositiveRandomFeatures narrow(kDk, 10, 3);
    CHECK_THROWS_AS(batch.step_into(q, k, v, narrow, out), linattn::Error);
    CHECK_THROWS_AS(batch.step_into(q, k, v, linattn::EluPlusOne{}, out), linattn::Error);

    CHECK(states_moved(batch, before) == 0);
    for (Eigen::Index i = 0; i < count; ++i) CHECK(batch[i].tokens() == 5);
    CHECK(out == out_before);
    // The batch goes on as if nothing had happened.
    CHECK(step_both(Kind::prf, batch, single, 3, 2200) == 0);
  }
}

TEMPLATE_TEST_CASE("prefill_into equals a per-head RecurrentState::prefill, then steps continue",
                   "[state_batch][prefill]", float) {
  using T = TestType;
  const Eigen::Index B = 2, H = 3, N = 300, steps = 25;
  int differing = 0, compared = 0;
  for (const bool bnhd : {false, true}) {
    for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
      // Heads in caller memory: [B, H, N, D] or [B, N, H, D].
      std::vector<T> qd(static_cast<std::size_t>(B * H * N * kDk));
      std::vector<T> kd(qd.size()), vd(static_cast<std::size_t>(B * H * N * kDv));
      auto view = [&](std::vector<T>& data, Eigen::Index dim) {
        return bnhd ? HeadsView<T>::bnhd(data.data(), linattn::BnhdShape{B, N, H, dim})
                    : HeadsView<T>::bhnd(data.data(), {B, H, N, dim});
      };
      std::vector<Matrix<T>> q, k, v;
      for (Eigen::Index i = 0; i < B * H; ++i) {
        const std::uint64_t seed = 3000 + 10 * static_cast<std::uint64_t>(i);
        q.push_back(inputs<T>(kind, N, seed));
        k.push_back(inputs<T>(kind, N, seed + 1));
        v.push_back(gaussian<T>(N, kDv, seed + 2));
        view(qd, kDk).head(i / H, i % H) = q.back();
        view(kd, kDk).head(i / H, i % H) = k.back();
        view(vd, kDv).head(i / H, i % H) = v.back();
      }
      for (const double decay : {1.0, 0.98}) {
        for (const int threads : {1, 2, 4}) {
          linattn::Options options;
          options.decay = decay;
          options.threads = threads;
          const Eigen::Index c = feature_dim(kind);
          RecurrentStateBatch<T> batch(B * H, c, kDv, options);
          std::vector<T> od(vd.size(), T(0));
          const HeadsView<const T> qv = view(qd, kDk), kv = view(kd, kDk), vv = view(vd, kDv);
          if (kind == Kind::featurized) {
            batch.prefill_into(qv, kv, vv, linattn::Identity{}, view(od, kDv));
          } else if (kind == Kind::elu) {
            batch.prefill_into(qv, kv, vv, linattn::EluPlusOne{}, view(od, kDv));
          } else {
            batch.prefill_into(qv, kv, vv, prf_map(), view(od, kDv));
          }
          INFO((bnhd ? "[B,N,H,D]" : "[B,H,N,D]")
               << ", " << kind_name(kind) << ", decay = " << decay << ", threads = " << threads);
          std::vector<RecurrentState<T>> single;
          for (Eigen::Index i = 0; i < B * H; ++i) {
            RecurrentState<T> state(c, kDv, options);
            const std::size_t si = static_cast<std::size_t>(i);
            Matrix<T> expected;
            if (kind == Kind::featurized) {
              expected = state.prefill(q[si], k[si], v[si], linattn::Identity{});
            } else if (kind == Kind::elu) {
              expected = state.prefill(q[si], k[si], v[si], linattn::EluPlusOne{});
            } else {
              expected = state.prefill(q[si], k[si], v[si], prf_map());
            }
            const Matrix<T> got = view(od, kDv).head(i / H, i % H);
            CHECK(got == expected);
            CHECK(same_state(batch[i], state));
            CHECK(batch[i].tokens() == N);
            differing += got == expected ? 0 : 1;
            ++compared;
            single.push_back(state);
          }
          // Decoding continues identically from the prefilled states.
          const int d = step_both(kind, batch, single, steps, 3500);
          CHECK(d == 0);
          differing += d;
          for (Eigen::Index i = 0; i < B * H; ++i) {
            CHECK(same_state(batch[i], single[static_cast<std::size_t>(i)]));
          }
        }
      }
    }
  }
  WARN("batch prefill vs per-head prefill (threads 1, 2, 4): "
       << differing << " differing of " << compared << " heads (and their steps)");
}

TEMPLATE_TEST_CASE("prefill_into errors throw and move no state", "[state_batch][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  const Eigen::Index B = 2, H = 3, N = 20;
  std::vector<T> q(static_cast<std::size_t>(B * H * N * kDk)), k(q.size());
  std::vector<T> v(static_cast<std::size_t>(B * H * N * kDv)), o(v.size(), T(4));
  const Matrix<T> qm = gaussian<T>(B * H * N, kDk, 4000), km = gaussian<T>(B * H * N, kDk, 4001);
  const Matrix<T> vm = gaussian<T>(B * H * N, kDv, 4002);
  std::copy(qm.data(), qm.data() + qm.size(), q.begin());
  std::copy(km.data(), km.data() + km.size(), k.begin());
  std::copy(vm.data(), vm.data() + vm.size(), v.begin());
  auto cview = [&](const std::vector<T>& data, Eigen::Index b, Eigen::Index n, Eigen::Index dim) {
    return HeadsView<const T>::bhnd(data.data(), {b, H, n, dim});
  };
  const auto qv = cview(q, B, N, kDk), kv = cview(k, B, N, kDk), vv = cview(v, B, N, kDv);
  const auto ov = HeadsView<T>::bhnd(o.data(), {B, H, N, kDv});
  const linattn::PositiveRandomFeatures& map = prf_map();

  linattn::Options options;
  options.decay = 0.95;
  options.threads = 2;
  RecurrentStateBatch<T> batch(B * H, 16, kDv, options);
  batch.prefill_into(qv, kv, vv, map, ov);
  const std::vector<RecurrentState<T>> before = snapshot(batch);
  const std::vector<T> o_before = o;

  // B x H must be the number of states.
  CHECK_THROWS_WITH(
      batch.prefill_into(cview(q, 1, N, kDk), cview(k, 1, N, kDk), cview(v, 1, N, kDv), map,
                         HeadsView<T>::bhnd(o.data(), {1, H, N, kDv})),
      Contains("RecurrentStateBatch::prefill") &&
          Contains("B x H = 3 heads, but the batch holds 6 states"));
  // Mismatched views.
  CHECK_THROWS_WITH(batch.prefill_into(qv, cview(k, B, N - 1, kDk), vv, map, ov),
                    Contains("k is [2, 3, 19, 8]") && Contains("B, H and N must match"));
  CHECK_THROWS_WITH(batch.prefill_into(qv, kv, vv, map, HeadsView<T>::bhnd(o.data(), {B, H, N, 4})),
                    Contains("out is [2, 3, 20, 4]"));
  // Featurized inputs of the wrong width, and a map of the wrong width.
  CHECK_THROWS_WITH(batch.prefill_into(qv, kv, vv, linattn::Identity{}, ov),
                    Contains("phi_q gives 8 features per token but the states hold 16"));
  CHECK_THROWS_WITH(batch.prefill_into(qv, kv, vv, linattn::EluPlusOne{}, ov),
                    Contains("q gives 8 features per token but the states hold 16"));
  const bool unchanged = o == o_before;  // every error above is found before any work
  CHECK(unchanged);
  // NaN in one head: no state moves (out is covered by multi_head.test.cpp).
  std::vector<T> scratch(o.size());
  const auto sv = HeadsView<T>::bhnd(scratch.data(), {B, H, N, kDv});
  for (const T poison :
       {std::numeric_limits<T>::quiet_NaN(), -std::numeric_limits<T>::infinity()}) {
    std::vector<T> bad = v;
    HeadsView<T>::bhnd(bad.data(), {B, H, N, kDv}).head(1, 2)(N - 1, 0) = poison;
    CHECK_THROWS_WITH(batch.prefill_into(qv, kv, cview(bad, B, N, kDv), map, sv),
                      Contains("RecurrentStateBatch::prefill") && Contains("v[b=1, h=2]") &&
                          Contains("row 19, column 0"));
    std::vector<T> bad_k = k;
    HeadsView<T>::bhnd(bad_k.data(), {B, H, N, kDk}).head(0, 1)(2, 3) = poison;
    CHECK_THROWS_WITH(batch.prefill_into(qv, cview(bad_k, B, N, kDk), vv, map, sv),
                      Contains("k[b=0, h=1]") && Contains("row 2, column 3"));
  }
  CHECK(states_moved(batch, before) == 0);

  // Constructor and accessors.
  CHECK_THROWS_WITH(RecurrentStateBatch<T>(0, 4, 4), Contains("count must be >= 1"));
  CHECK_THROWS_WITH(RecurrentStateBatch<T>(3, 0, 4), Contains("feature_dim must be >= 1"));
  CHECK_THROWS_WITH(RecurrentStateBatch<T>(3, 4, 0), Contains("value_dim must be >= 1"));
  linattn::Options bad_options;
  bad_options.decay = 1.5;
  CHECK_THROWS_WITH(RecurrentStateBatch<T>(3, 4, 4, bad_options), Contains("Options::decay"));
  CHECK_THROWS_AS(batch[B * H], std::out_of_range);
  CHECK_THROWS_AS(batch[-1], std::out_of_range);
  batch.reset();
  for (Eigen::Index i = 0; i < B * H; ++i) {
    CHECK(batch[i].tokens() == 0);
    CHECK(batch[i].s().cwiseAbs().maxCoeff() == T(0));
  }
}

// Regression: prefill_into once checked out.dim() against value_dim() but not v.dim(), and read
// past each v head of width 2 for states of Dv = 3 instead of throwing.
TEMPLATE_TEST_CASE("prefill_into rejects v of the wrong width", "[state_batch][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  const Eigen::Index B = 1, H = 2, N = 5, C = 4, Dv = 3;
  std::vector<T> q(static_cast<std::size_t>(B * H * N * C), T(0.5)), k(q.size(), T(0.25));
  std::vector<T> v(static_cast<std::size_t>(B * H * N * 2), T(1));
  std::vector<T> o(static_cast<std::size_t>(B * H * N * Dv), T(0));
  RecurrentStateBatch<T> batch(B * H, C, Dv);
  CHECK_THROWS_WITH(
      batch.prefill_into(HeadsView<const T>::bhnd(q.data(), {B, H, N, C}),
                         HeadsView<const T>::bhnd(k.data(), {B, H, N, C}),
                         HeadsView<const T>::bhnd(v.data(), {B, H, N, 2}), linattn::Identity{},
                         HeadsView<T>::bhnd(o.data(), {B, H, N, Dv})),
      Contains("v is [1, 2, 5, 2]"));
  CHECK(batch[0].tokens() == 0);
}

namespace {
/// A user map whose features of a token with q[0] > 100 are NaN: a failure only the map can
/// see, after every input passed its checks.
struct NanAboveHundred {
  Eigen::Index feature_dim(Eigen::Index input_dim) const { return input_dim; }
  template <class D>
  Matrix<typename D::Scalar> queries(const Eigen::MatrixBase<D>& x) const {
    Matrix<typename D::Scalar> phi = x.cwiseAbs();
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
      if (x(r, 0) > 100) phi(r, 1) = std::numeric_limits<typename D::Scalar>::quiet_NaN();
    }
    return phi;
  }
  template <class D>
  Matrix<typename D::Scalar> keys(const Eigen::MatrixBase<D>& x) const {
    return x.cwiseAbs();
  }
};
}  // namespace

TEMPLATE_TEST_CASE("a batch step checks every state and every feature before any state moves",
                   "[state_batch][errors]", float) {
  using T = TestType;
  const Eigen::Index count = 4, c = 6, dv = 3;
  const Matrix<T> q = gaussian<T>(count, c, 501), k = gaussian<T>(count, c, 502);
  const Matrix<T> v = gaussian<T>(count, dv, 503);
  Matrix<T> out = Matrix<T>::Constant(count, dv, T(5));
  using Catch::Matchers::Contains;
  for (const int threads : {1, 2}) {
    linattn::Options options;
    options.threads = threads;
    RecurrentStateBatch<T> batch(count, c, dv, options);
    batch.step_into(q, k, v, linattn::EluPlusOne{}, out);  // one token everywhere
    // A state of other dimensions assigned into the batch: the step throws before state 0 moves.
    batch[2] = RecurrentState<T>(c + 1, dv, options);
    CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::EluPlusOne{}, out),
                      Contains("state 2 is 7 x 3 (C x Dv) but state 0 is 6 x 3"));
    CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::Identity{}, out), Contains("state 2"));
    // The same for a prefill over views.
    std::vector<T> qd(static_cast<std::size_t>(count * c), T(0.5)),
        vd(static_cast<std::size_t>(count * dv), T(0.5));
    const auto qv = HeadsView<const T>::bhnd(qd.data(), {1, count, 1, c});
    const auto vv = HeadsView<const T>::bhnd(vd.data(), {1, count, 1, dv});
    std::vector<T> od(vd.size(), T(0));
    CHECK_THROWS_WITH(batch.prefill_into(qv, qv, vv, linattn::EluPlusOne{},
                                         HeadsView<T>::bhnd(od.data(), {1, count, 1, dv})),
                      Contains("state 2"));
    CHECK(batch[0].tokens() == 1);
    CHECK(batch[1].tokens() == 1);
    CHECK(batch[3].tokens() == 1);
    CHECK((out.array() != T(5)).all());  // out still holds the first step's outputs

    // Non-finite features of the last row only: no state moves, out is not written.
    RecurrentStateBatch<T> fresh(count, c, dv, options);
    Matrix<T> q_bad = q;
    q_bad(count - 1, 0) = T(1000);
    Matrix<T> untouched = Matrix<T>::Constant(count, dv, T(9));
    CHECK_THROWS_WITH(fresh.step_into(q_bad, k, v, NanAboveHundred{}, untouched),
                      Contains("phi(q)") && Contains("non-finite"));
    for (Eigen::Index i = 0; i < count; ++i) {
      CHECK(fresh[i].tokens() == 0);
      CHECK(fresh[i].s().isZero(0));
    }
    CHECK((untouched.array() == T(9)).all());
  }
}

// ---------------------------------------------------------------------------------------------
// Gated batches: per-token gates in the batch step, gate views in the batch prefill.

namespace {

/// rows x cols log gates in [-0.4, 0], with -infinity (a reset) where `reset_row` says.
template <class T>
Matrix<T> log_gate_rows(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed,
                        Eigen::Index reset_row = -1) {
  Matrix<T> g = (-T(0.2) * gaussian<T>(rows, cols, seed).cwiseAbs()).cwiseMax(T(-0.4));
  if (reset_row >= 0) g.row(reset_row).setConstant(-std::numeric_limits<T>::infinity());
  return g;
}

/// One gated step of the batch and of every single state for a kind, a_t or log gates;
/// returns the output rows that differ.
template <class T>
int gated_step_both(Kind kind, RecurrentStateBatch<T>& batch,
                    std::vector<RecurrentState<T>>& single, const Matrix<T>& g, bool log_space,
                    std::uint64_t seed) {
  const Eigen::Index count = batch.size();
  const Matrix<T> q = inputs<T>(kind, count, seed), k = inputs<T>(kind, count, seed + 1);
  const Matrix<T> v = gaussian<T>(count, kDv, seed + 2);
  const Matrix<T> a = g.array().exp().matrix();
  Matrix<T> out(count, kDv);
  auto run = [&](const auto& map) {
    if (log_space) {
      batch.step_into(q, k, v, linattn::log_gates(g), map, out);
    } else {
      batch.step_into(q, k, v, a, map, out);
    }
    int differing = 0;
    for (Eigen::Index i = 0; i < count; ++i) {
      RecurrentState<T>& state = single[static_cast<std::size_t>(i)];
      const Vector<T> expected =
          log_space ? state.step(q.row(i), k.row(i), v.row(i), linattn::log_gates(g.row(i)), map)
                    : state.step(q.row(i), k.row(i), v.row(i), a.row(i), map);
      if (!(out.row(i).transpose() == expected)) ++differing;
    }
    return differing;
  };
  switch (kind) {
    case Kind::featurized:
      return run(linattn::Identity{});
    case Kind::elu:
      return run(linattn::EluPlusOne{});
    case Kind::prf:
      return run(prf_map());
  }
  return -1;
}

template <class T>
bool same_gated_state(const RecurrentState<T>& a, const RecurrentState<T>& b) {
  return same_state(a, b) && (linattn::detail::StateAccess::held(a).row_log ==
                              linattn::detail::StateAccess::held(b).row_log)
                                 .all();
}

}  // namespace

TEMPLATE_TEST_CASE("gated batch steps equal per-session gated steps bit for bit",
                   "[state_batch][gated]", float) {
  using T = TestType;
  const Eigen::Index count = 5, steps = 30;
  int differing = 0, rows = 0;
  for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
    for (const Eigen::Index gate_dim : {Eigen::Index(1), feature_dim(kind)}) {
      for (const bool log_space : {true, false}) {
        for (const int threads : {1, 3}) {
          linattn::Options options;
          options.threads = threads;
          options.normalize = gate_dim == 1;
          RecurrentStateBatch<T> batch(count, feature_dim(kind), kDv, options);
          std::vector<RecurrentState<T>> single(static_cast<std::size_t>(count),
                                                RecurrentState<T>(feature_dim(kind), kDv, options));
          INFO(kind_name(kind) << ", gate_dim = " << gate_dim << ", log_space = " << log_space
                               << ", threads = " << threads);
          for (Eigen::Index t = 0; t < steps; ++t) {
            // Step 17 resets state 2 (log gates only: a_t = 0 is out of range).
            const Matrix<T> g = log_gate_rows<T>(count, gate_dim, 4000 + 7 * std::uint64_t(t),
                                                 log_space && t == 17 ? 2 : -1);
            const int d = gated_step_both(kind, batch, single, g, log_space, 4100 + 3 * t);
            CHECK(d == 0);
            differing += d;
            rows += static_cast<int>(count);
          }
          for (Eigen::Index i = 0; i < count; ++i) {
            CHECK(same_gated_state(batch[i], single[static_cast<std::size_t>(i)]));
          }
        }
      }
    }
  }
  WARN("gated batch vs per-session gated steps: " << differing << " of " << rows
                                                  << " output rows not bit-identical");
}

TEMPLATE_TEST_CASE("gated prefill_into equals a per-head gated prefill, then gated steps continue",
                   "[state_batch][gated][prefill]", float) {
  using T = TestType;
  const Eigen::Index B = 2, H = 2, N = 200, steps = 10;
  for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
    const Eigen::Index c = feature_dim(kind);
    for (const Eigen::Index gate_dim : {Eigen::Index(1), c}) {
      // Token-major views, as a QKV projection writes them.
      std::vector<T> qd(static_cast<std::size_t>(B * H * N * kDk)), kd(qd.size());
      std::vector<T> vd(static_cast<std::size_t>(B * H * N * kDv));
      std::vector<T> gd(static_cast<std::size_t>(B * H * N * gate_dim));
      auto view = [&](std::vector<T>& data, Eigen::Index dim) {
        return HeadsView<T>::bnhd(data.data(), linattn::BnhdShape{B, N, H, dim});
      };
      std::vector<Matrix<T>> q, k, v, g;
      for (Eigen::Index i = 0; i < B * H; ++i) {
        const std::uint64_t seed = 5000 + 10 * static_cast<std::uint64_t>(i);
        q.push_back(inputs<T>(kind, N, seed));
        k.push_back(inputs<T>(kind, N, seed + 1));
        v.push_back(gaussian<T>(N, kDv, seed + 2));
        g.push_back(log_gate_rows<T>(N, gate_dim, seed + 3, i == 1 ? 100 : -1));
        view(qd, kDk).head(i / H, i % H) = q.back();
        view(kd, kDk).head(i / H, i % H) = k.back();
        view(vd, kDv).head(i / H, i % H) = v.back();
        view(gd, gate_dim).head(i / H, i % H) = g.back();
      }
      for (const int threads : {1, 2}) {
        linattn::Options options;
        options.threads = threads;
        RecurrentStateBatch<T> batch(B * H, c, kDv, options);
        std::vector<T> od(vd.size(), T(0));
        const HeadsView<const T> qv = view(qd, kDk), kv = view(kd, kDk), vv = view(vd, kDv),
                                 gv = view(gd, gate_dim);
        std::vector<RecurrentState<T>> single;
        int differing = 0;
        auto run = [&](const auto& map) {
          batch.prefill_into(qv, kv, vv, linattn::log_gates(gv), map, view(od, kDv));
          for (Eigen::Index i = 0; i < B * H; ++i) {
            RecurrentState<T> state(c, kDv, options);
            const std::size_t si = static_cast<std::size_t>(i);
            const Matrix<T> expected =
                state.prefill(q[si], k[si], v[si], linattn::log_gates(g[si]), map);
            const Matrix<T> got = view(od, kDv).head(i / H, i % H);
            differing += got == expected ? 0 : 1;
            CHECK(same_gated_state(batch[i], state));
            single.push_back(state);
          }
        };
        if (kind == Kind::featurized) run(linattn::Identity{});
        if (kind == Kind::elu) run(linattn::EluPlusOne{});
        if (kind == Kind::prf) run(prf_map());
        INFO(kind_name(kind) << ", gate_dim = " << gate_dim << ", threads = " << threads);
        CHECK(differing == 0);
        for (Eigen::Index t = 0; t < steps; ++t) {
          const Matrix<T> gs = log_gate_rows<T>(B * H, gate_dim, 5500 + std::uint64_t(t));
          CHECK(gated_step_both(kind, batch, single, gs, true, 5600 + 3 * t) == 0);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("a gated batch step or prefill that throws moves no state",
                   "[state_batch][gated][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  const Eigen::Index count = 4, c = kDk;
  RecurrentStateBatch<T> batch(count, c, kDv);
  const Matrix<T> q = inputs<T>(Kind::featurized, count, 1),
                  k = inputs<T>(Kind::featurized, count, 2);
  const Matrix<T> v = gaussian<T>(count, kDv, 3);
  Matrix<T> out(count, kDv);
  batch.step_into(q, k, v, linattn::log_gates(log_gate_rows<T>(count, 1, 4)), linattn::Identity{},
                  out);
  const std::vector<RecurrentState<T>> before = snapshot(batch);
  Matrix<T> bad = log_gate_rows<T>(count, c, 5);
  bad(3, 2) = T(0.25);  // log gate > 0 in the last state's row
  CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::log_gates(bad), linattn::Identity{}, out),
                    Contains("row 3"));
  CHECK_THROWS_WITH(
      batch.step_into(q, k, v, Matrix<T>::Constant(count, 2, T(0.5)), linattn::Identity{}, out),
      Contains("gates is 4 x 2"));
  CHECK_THROWS_WITH(
      batch.step_into(q, k, v, Matrix<T>::Constant(count - 1, 1, T(0.5)), linattn::Identity{}, out),
      Contains("gates is 3 x 1"));
  CHECK(states_moved(batch, before) == 0);
  // The prefill: the last head's gate view holds a NaN.
  const Eigen::Index N = 9;
  std::vector<T> qd(static_cast<std::size_t>(count * N * c), T(0.5)), kd(qd);
  std::vector<T> vd(static_cast<std::size_t>(count * N * kDv), T(1)), od(vd);
  std::vector<T> gd(static_cast<std::size_t>(count * N), T(-0.1));
  gd.back() = std::numeric_limits<T>::quiet_NaN();
  const linattn::HeadShape shape{1, count, N, c};
  CHECK_THROWS_WITH(
      batch.prefill_into(HeadsView<const T>::bhnd(qd.data(), shape),
                         HeadsView<const T>::bhnd(kd.data(), shape),
                         HeadsView<const T>::bhnd(vd.data(), {1, count, N, kDv}),
                         linattn::log_gates(HeadsView<const T>::bhnd(gd.data(), {1, count, N, 1})),
                         linattn::Identity{}, HeadsView<T>::bhnd(od.data(), {1, count, N, kDv})),
      Contains("gates[b=0, h=3]"));
  CHECK(states_moved(batch, before) == 0);
  linattn::Options decayed;
  decayed.decay = 0.9;
  RecurrentStateBatch<T> decaying(count, c, kDv, decayed);
  CHECK_THROWS_WITH(decaying.step_into(q, k, v, linattn::log_gates(log_gate_rows<T>(count, 1, 6)),
                                       linattn::Identity{}, out),
                    Contains("Options::decay must be 1"));
}

TEMPLATE_TEST_CASE("a batch step or prefill with another transition than a state's moves no state",
                   "[state_batch][gated][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  using linattn::TransitionKind;
  const Eigen::Index count = 4, c = kDk, n = 6;
  RecurrentStateBatch<T> batch(count, c, kDv);
  const Matrix<T> q = inputs<T>(Kind::featurized, count, 11),
                  k = inputs<T>(Kind::featurized, count, 12);
  const Matrix<T> v = gaussian<T>(count, kDv, 13);
  Matrix<T> out(count, kDv);
  // State 2 alone has seen per-feature gates (a session loaded from a GLA server, say).
  (void)batch[2].step(q.row(2), k.row(2), v.row(2), Vector<T>::Constant(c, T(0.7)),
                      linattn::Identity{});
  REQUIRE(batch[2].transition() == TransitionKind::feature_gates);
  const std::vector<RecurrentState<T>> before = snapshot(batch);
  CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::Identity{}, out),
                    Contains("state 2 is moved by per-feature gates but this call gives "
                             "Options::decay"));
  CHECK_THROWS_WITH(
      batch.step_into(q, k, v, Matrix<T>::Constant(count, 1, T(0.5)), linattn::Identity{}, out),
      Contains("state 2 is moved by per-feature gates but this call gives scalar"));
  CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::EluPlusOne{}, out), Contains("state 2"));
  std::vector<T> qd(static_cast<std::size_t>(count * n * c), T(0.5)), kd(qd);
  std::vector<T> vd(static_cast<std::size_t>(count * n * kDv), T(1)), od(vd);
  const linattn::HeadShape shape{1, count, n, c};
  CHECK_THROWS_WITH(
      batch.prefill_into(HeadsView<const T>::bhnd(qd.data(), shape),
                         HeadsView<const T>::bhnd(kd.data(), shape),
                         HeadsView<const T>::bhnd(vd.data(), {1, count, n, kDv}),
                         linattn::Identity{}, HeadsView<T>::bhnd(od.data(), {1, count, n, kDv})),
      Contains("state 2 is moved by per-feature gates"));
  CHECK(states_moved(batch, before) == 0);
  // Per-feature gates continue it, and set the kind of the other states.
  batch.step_into(q, k, v, Matrix<T>::Constant(count, c, T(0.9)), linattn::Identity{}, out);
  for (Eigen::Index i = 0; i < count; ++i) {
    CHECK(batch[i].transition() == TransitionKind::feature_gates);
  }
  batch.reset();
  batch.step_into(q, k, v, linattn::Identity{}, out);
  CHECK(batch[0].transition() == TransitionKind::decay);
}

TEMPLATE_TEST_CASE("bonus batch: steps and a prefill from views equal per-state bonus calls",
                   "[state_batch][gated][bonus]", float) {
  using T = TestType;
  using Catch::Contains;
  // H = 2 heads of B = 3 sequences: state b * H + h reads row h of u (R = H rows).
  const Eigen::Index B = 3, H = 2, count = B * H, N = 90, steps = 12;
  const Matrix<T> u = gaussian<T>(H, kDk, 6000);
  for (const Kind kind : {Kind::featurized, Kind::elu}) {
    for (const Eigen::Index gate_dim : {Eigen::Index(1), kDk}) {
      for (const int threads : {1, 2}) {
        linattn::Options options;
        options.threads = threads;
        options.normalize = false;
        options.scale = 0.5;
        INFO(kind_name(kind) << ", gate_dim = " << gate_dim << ", threads = " << threads);
        std::vector<T> qd(static_cast<std::size_t>(count * N * kDk)), kd(qd.size());
        std::vector<T> vd(static_cast<std::size_t>(count * N * kDv)), od(vd.size());
        std::vector<T> gd(static_cast<std::size_t>(count * N * gate_dim));
        auto view = [&](std::vector<T>& data, Eigen::Index dim) {
          return HeadsView<T>::bnhd(data.data(), linattn::BnhdShape{B, N, H, dim});
        };
        std::vector<Matrix<T>> q, k, v, g;
        for (Eigen::Index i = 0; i < count; ++i) {
          const std::uint64_t seed = 6100 + 10 * static_cast<std::uint64_t>(i);
          q.push_back(inputs<T>(kind, N, seed));
          k.push_back(inputs<T>(kind, N, seed + 1));
          v.push_back(gaussian<T>(N, kDv, seed + 2));
          g.push_back(log_gate_rows<T>(N, gate_dim, seed + 3, i == 1 ? 40 : -1));
          view(qd, kDk).head(i / H, i % H) = q.back();
          view(kd, kDk).head(i / H, i % H) = k.back();
          view(vd, kDv).head(i / H, i % H) = v.back();
          view(gd, gate_dim).head(i / H, i % H) = g.back();
        }
        RecurrentStateBatch<T> batch(count, kDk, kDv, options);
        std::vector<RecurrentState<T>> single;
        int differing = 0;
        auto run = [&](const auto& map) {
          const HeadsView<const T> gv = view(gd, gate_dim);
          batch.prefill_into(view(qd, kDk), view(kd, kDk), view(vd, kDv),
                             linattn::with_bonus(linattn::log_gates(gv), u), map, view(od, kDv));
          for (Eigen::Index i = 0; i < count; ++i) {
            const std::size_t si = static_cast<std::size_t>(i);
            const Matrix<T> uh = u.row(i % H);
            RecurrentState<T> state(kDk, kDv, options);
            const Matrix<T> expected = state.prefill(
                q[si], k[si], v[si], linattn::with_bonus(linattn::log_gates(g[si]), uh), map);
            differing += Matrix<T>(view(od, kDv).head(i / H, i % H)) == expected ? 0 : 1;
            CHECK(same_gated_state(batch[i], state));
            single.push_back(state);
          }
          // Then bonus steps, every state against its own bonus step, bit for bit.
          for (Eigen::Index t = 0; t < steps; ++t) {
            const std::uint64_t seed = 6500 + 5 * static_cast<std::uint64_t>(t);
            const Matrix<T> qt = inputs<T>(kind, count, seed),
                            kt = inputs<T>(kind, count, seed + 1);
            const Matrix<T> vt = gaussian<T>(count, kDv, seed + 2);
            const Matrix<T> gt = log_gate_rows<T>(count, gate_dim, seed + 3, t == 5 ? 4 : -1);
            Matrix<T> out(count, kDv);
            batch.step_into(qt, kt, vt, linattn::with_bonus(linattn::log_gates(gt), u), map, out);
            for (Eigen::Index i = 0; i < count; ++i) {
              const Matrix<T> uh = u.row(i % H);
              const Vector<T> expected = single[static_cast<std::size_t>(i)].step(
                  qt.row(i), kt.row(i), vt.row(i),
                  linattn::with_bonus(linattn::log_gates(gt.row(i)), uh), map);
              differing += out.row(i).transpose() == expected ? 0 : 1;
            }
          }
          for (Eigen::Index i = 0; i < count; ++i) {
            CHECK(same_gated_state(batch[i], single[static_cast<std::size_t>(i)]));
          }
        };
        if (kind == Kind::featurized) run(linattn::Identity{});
        if (kind == Kind::elu) run(linattn::EluPlusOne{});
        CHECK(differing == 0);
        CHECK(batch[0].tokens() == N + steps);
        // The featurized prefill + steps of state 1 (reset at token 40) against FLA's recurrence.
        if (kind == Kind::featurized) {
          Matrix<double> h = Matrix<double>::Zero(kDk, kDv);
          const Matrix<double> expected = linattn_test::naive_rwkv6(
              q[1].template cast<double>(), k[1].template cast<double>(),
              v[1].template cast<double>(), g[1].template cast<double>(),
              u.row(1).transpose().template cast<double>(), options.scale, h);
          const Matrix<T> got = view(od, kDv).head(0, 1);
          CHECK(linattn_test::relative_error(got, expected) <= 2e-5);
        }
      }
    }
  }
  // Errors: nothing moves.
  linattn::Options options;
  options.normalize = false;
  RecurrentStateBatch<T> batch(count, kDk, kDv, options);
  const Matrix<T> q = inputs<T>(Kind::featurized, count, 1),
                  k = inputs<T>(Kind::featurized, count, 2);
  const Matrix<T> v = gaussian<T>(count, kDv, 3);
  const Matrix<T> g = log_gate_rows<T>(count, kDk, 4);
  Matrix<T> out(count, kDv);
  batch.step_into(q, k, v, linattn::with_bonus(linattn::log_gates(g), u), linattn::Identity{}, out);
  const std::vector<RecurrentState<T>> before = snapshot(batch);
  const Matrix<T> u4 = gaussian<T>(4, kDk, 5);
  CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::with_bonus(linattn::log_gates(g), u4),
                                    linattn::Identity{}, out),
                    Contains("R dividing"));
  Matrix<T> bad_u = u;
  bad_u(1, 2) = std::numeric_limits<T>::infinity();
  CHECK_THROWS_AS(batch.step_into(q, k, v, linattn::with_bonus(linattn::log_gates(g), bad_u),
                                  linattn::Identity{}, out),
                  linattn::Error);
  Matrix<T> bad_g = g;
  bad_g(5, 0) = T(0.1);
  CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::with_bonus(linattn::log_gates(bad_g), u),
                                    linattn::Identity{}, out),
                    Contains("row 5"));
  CHECK_THROWS_WITH(
      batch.step_into(q, k, v, linattn::log_gates(g.col(0)), linattn::Identity{}, out),
      Contains("per-feature gates"));
  CHECK(states_moved(batch, before) == 0);
  linattn::Options normalized;
  RecurrentStateBatch<T> plain(count, kDk, kDv, normalized);
  CHECK_THROWS_WITH(plain.step_into(q, k, v, linattn::with_bonus(linattn::log_gates(g), u),
                                    linattn::Identity{}, out),
                    Contains("normalize = false"));
  CHECK(plain[0].tokens() == 0);
}

// ---------------------------------------------------------------------------------------------
// RecurrentStateBatch::prefill_varlen_into: packed prompts of different lengths.

namespace {

/// Four prompts of 5, 0, 17 and 1 tokens packed along N (FLA's cu_seqlens).
const std::vector<std::int64_t> kVarlenOffsets{0, 5, 5, 22, 23};
constexpr Eigen::Index kVarlenSequences = 4, kVarlenTokens = 23;

/// kVarlenTokens x (heads * dim) packed rows: head h in columns h * dim.., so that
/// varlen_view gives the [1, T, H, D] view over it; each head from its own seed.
template <class T, class Make>
Matrix<T> varlen_rows(Eigen::Index heads, Eigen::Index dim, std::uint64_t seed, const Make& make) {
  Matrix<T> rows(kVarlenTokens, heads * dim);
  for (Eigen::Index h = 0; h < heads; ++h) {
    rows.middleCols(h * dim, dim) = make(seed + 17 * static_cast<std::uint64_t>(h));
  }
  return rows;
}

/// The 1 x H x T x D view over packed rows of H heads.
template <class T>
HeadsView<const T> varlen_view(const Matrix<T>& rows, Eigen::Index heads) {
  return HeadsView<const T>::bnhd(rows.data(),
                                  linattn::BnhdShape{1, rows.rows(), heads, rows.cols() / heads});
}

/// Sequence s's rows of head h of packed rows.
template <class T>
Matrix<T> varlen_head(const Matrix<T>& rows, Eigen::Index heads, Eigen::Index s, Eigen::Index h) {
  const Eigen::Index dim = rows.cols() / heads;
  const Eigen::Index begin = kVarlenOffsets[static_cast<std::size_t>(s)];
  const Eigen::Index len = kVarlenOffsets[static_cast<std::size_t>(s) + 1] - begin;
  return rows.block(begin, h * dim, len, dim);
}

/// Features of rows in double for the naive references: featurized rows are their own.
Matrix<double> naive_features(Kind kind, const Matrix<double>& x) {
  return kind == Kind::elu ? linattn::EluPlusOne{}.queries(x) : x;
}

/// The engine's gated recurrence token by token in double, from log gates g (N x 1 or N x C):
/// S <- diag(exp g_t) S + phi_k_t v_t^T, z alike, out_t = phi_q_t S / (phi_q_t . z + eps).
Matrix<double> naive_gated_recurrence(const Matrix<double>& phi_q, const Matrix<double>& phi_k,
                                      const Matrix<double>& v, const Matrix<double>& g,
                                      double eps) {
  Matrix<double> s = Matrix<double>::Zero(phi_k.cols(), v.cols());
  Eigen::VectorXd z = Eigen::VectorXd::Zero(phi_k.cols());
  Matrix<double> out(phi_q.rows(), v.cols());
  for (Eigen::Index t = 0; t < phi_q.rows(); ++t) {
    for (Eigen::Index c = 0; c < s.rows(); ++c) {
      const double a = std::exp(g(t, g.cols() == 1 ? 0 : c));
      s.row(c) *= a;
      z(c) *= a;
    }
    s += phi_k.row(t).transpose() * v.row(t);
    z += phi_k.row(t).transpose();
    out.row(t) = phi_q.row(t) * s / (phi_q.row(t).dot(z) + eps);
  }
  return out;
}

/// Rows `a` over rows `b`.
Matrix<double> stacked(const Matrix<double>& a, const Matrix<double>& b) {
  Matrix<double> m(a.rows() + b.rows(), a.cols());
  m << a, b;
  return m;
}

/// docs/design.md's bound for the parallel against the recurrent form.
template <class T>
double engine_bound() {
  return std::is_same_v<T, float> ? 2e-5 : 1e-12;
}

}  // namespace

TEMPLATE_TEST_CASE("varlen prefill continues each packed prompt's states as per-head prefills",
                   "[state_batch][prefill][varlen]", float, double) {
  using T = TestType;
  // Prompts of 5, 0, 17 and 1 tokens, H = 3 heads each: state s * H + h. Every state first takes
  // `pre` steps of its own, so that each prompt continues from a state of its own.
  const Eigen::Index H = 3, count = kVarlenSequences * H, pre = 3;
  const std::uint64_t step_seed = 7000;
  int differing = 0, compared = 0;
  double worst = 0.0;
  for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
    const Eigen::Index c = feature_dim(kind);
    const Matrix<T> q = varlen_rows<T>(
        H, kDk, 7100, [&](std::uint64_t s) { return inputs<T>(kind, kVarlenTokens, s); });
    const Matrix<T> k = varlen_rows<T>(
        H, kDk, 7200, [&](std::uint64_t s) { return inputs<T>(kind, kVarlenTokens, s); });
    const Matrix<T> v = varlen_rows<T>(
        H, kDv, 7300, [&](std::uint64_t s) { return gaussian<T>(kVarlenTokens, kDv, s); });
    for (const double decay : {1.0, 0.95}) {
      for (const int threads : {1, 2}) {
        INFO(kind_name(kind) << ", decay = " << decay << ", threads = " << threads);
        linattn::Options options;
        options.decay = decay;
        options.chunk = 4;  // the 17-token prompt spans several chunks
        options.threads = threads;
        RecurrentStateBatch<T> batch(count, c, kDv, options);
        std::vector<RecurrentState<T>> single(static_cast<std::size_t>(count),
                                              RecurrentState<T>(c, kDv, options));
        REQUIRE(step_both(kind, batch, single, pre, step_seed) == 0);
        const std::vector<RecurrentState<T>> before = snapshot(batch);
        Matrix<T> out = Matrix<T>::Constant(kVarlenTokens, H * kDv, T(-7));
        const auto ov =
            HeadsView<T>::bnhd(out.data(), linattn::BnhdShape{1, kVarlenTokens, H, kDv});
        if (kind == Kind::featurized) {
          batch.prefill_varlen_into(varlen_view(q, H), varlen_view(k, H), varlen_view(v, H),
                                    linattn::Identity{}, kVarlenOffsets, ov);
        } else if (kind == Kind::elu) {
          batch.prefill_varlen_into(varlen_view(q, H), varlen_view(k, H), varlen_view(v, H),
                                    linattn::EluPlusOne{}, kVarlenOffsets, ov);
        } else {
          batch.prefill_varlen_into(varlen_view(q, H), varlen_view(k, H), varlen_view(v, H),
                                    prf_map(), kVarlenOffsets, ov);
        }
        CHECK(out.allFinite());  // every row is some prompt's
        for (Eigen::Index s = 0; s < kVarlenSequences; ++s) {
          const Eigen::Index len =
              kVarlenOffsets[std::size_t(s) + 1] - kVarlenOffsets[std::size_t(s)];
          for (Eigen::Index h = 0; h < H; ++h) {
            const Eigen::Index i = s * H + h;
            const std::size_t si = static_cast<std::size_t>(i);
            INFO("sequence " << s << ", head " << h);
            CHECK(batch[i].tokens() == pre + len);
            if (len == 0) {
              // The empty prompt leaves its states as the steps left them.
              CHECK(same_state(batch[i], before[si]));
              continue;
            }
            // The head's prompt through its own state's chunked prefill: bit for bit.
            RecurrentState<T> state = before[si];
            const Matrix<T> qs = varlen_head(q, H, s, h), ks = varlen_head(k, H, s, h);
            const Matrix<T> vs = varlen_head(v, H, s, h);
            Matrix<T> expected;
            if (kind == Kind::featurized) {
              expected = state.prefill(qs, ks, vs, linattn::Identity{});
            } else if (kind == Kind::elu) {
              expected = state.prefill(qs, ks, vs, linattn::EluPlusOne{});
            } else {
              expected = state.prefill(qs, ks, vs, prf_map());
            }
            const Matrix<T> got = varlen_head(out, H, s, h);
            CHECK(got == expected);
            CHECK(same_state(batch[i], state));
            differing += got == expected ? 0 : 1;
            ++compared;
            if (kind == Kind::prf) continue;
            // The naive recurrence over the state's steps and its prompt, in double.
            Matrix<double> q0(pre, kDk), k0(pre, kDk), v0(pre, kDv);
            for (Eigen::Index t = 0; t < pre; ++t) {
              const std::uint64_t seed = step_seed + 3 * static_cast<std::uint64_t>(t);
              q0.row(t) = inputs<T>(kind, count, seed).row(i).template cast<double>();
              k0.row(t) = inputs<T>(kind, count, seed + 1).row(i).template cast<double>();
              v0.row(t) = gaussian<T>(count, kDv, seed + 2).row(i).template cast<double>();
            }
            const Matrix<double> naive = linattn_test::recurrent_linear_attention(
                naive_features(kind, stacked(q0, qs.template cast<double>())),
                naive_features(kind, stacked(k0, ks.template cast<double>())),
                stacked(v0, vs.template cast<double>()), true, decay, options.eps, true);
            const double error = linattn_test::relative_error(got, naive.bottomRows(len));
            CHECK(error <= engine_bound<T>());
            worst = std::max(worst, error);
          }
        }
        // Decoding continues from the prefilled states as from the per-head ones.
        std::vector<RecurrentState<T>> prefilled = snapshot(batch);
        CHECK(step_both(kind, batch, prefilled, 2, 7500) == 0);
      }
    }
  }
  CHECK(differing == 0);
  CHECK(compared == 3 * 2 * 2 * 3 * H);  // kinds x decays x threads x non-empty prompts x heads
  WARN("varlen prefill vs per-head prefill: "
       << differing << " of " << compared << " heads differ; vs the naive recurrence " << worst);
}

TEMPLATE_TEST_CASE("gated varlen prefill continues each packed prompt's states",
                   "[state_batch][gated][prefill][varlen]", float, double) {
  using T = TestType;
  const Eigen::Index H = 2, count = kVarlenSequences * H, pre = 2;
  const std::uint64_t step_seed = 7600;
  int differing = 0, compared = 0;
  double worst = 0.0;
  for (const Kind kind : {Kind::featurized, Kind::elu, Kind::prf}) {
    const Eigen::Index c = feature_dim(kind);
    const Matrix<T> q = varlen_rows<T>(
        H, kDk, 7700, [&](std::uint64_t s) { return inputs<T>(kind, kVarlenTokens, s); });
    const Matrix<T> k = varlen_rows<T>(
        H, kDk, 7800, [&](std::uint64_t s) { return inputs<T>(kind, kVarlenTokens, s); });
    const Matrix<T> v = varlen_rows<T>(
        H, kDv, 7900, [&](std::uint64_t s) { return gaussian<T>(kVarlenTokens, kDv, s); });
    for (const Eigen::Index gate_dim : {Eigen::Index(1), c}) {
      for (const bool log_space : {true, false}) {
        for (const int threads : {1, 2}) {
          INFO(kind_name(kind) << ", gate_dim = " << gate_dim << ", log_space = " << log_space
                               << ", threads = " << threads);
          // Log gates in [-0.4, 0]; in log space, token 10 (sequence 2) of head 1 resets.
          Matrix<T> g = varlen_rows<T>(H, gate_dim, 8000, [&](std::uint64_t s) {
            return log_gate_rows<T>(kVarlenTokens, gate_dim, s);
          });
          if (log_space) {
            g.block(10, gate_dim, 1, gate_dim).setConstant(-std::numeric_limits<T>::infinity());
          }
          const Matrix<T> a = g.array().exp().matrix();
          linattn::Options options;
          options.chunk = 4;
          options.threads = threads;
          RecurrentStateBatch<T> batch(count, c, kDv, options);
          std::vector<RecurrentState<T>> single(static_cast<std::size_t>(count),
                                                RecurrentState<T>(c, kDv, options));
          std::vector<Matrix<T>> step_gates;
          for (Eigen::Index t = 0; t < pre; ++t) {
            step_gates.push_back(log_gate_rows<T>(count, gate_dim, 8100 + std::uint64_t(t)));
            REQUIRE(gated_step_both(kind, batch, single, step_gates.back(), log_space,
                                    step_seed + 3 * std::uint64_t(t)) == 0);
          }
          const std::vector<RecurrentState<T>> before = snapshot(batch);
          Matrix<T> out = Matrix<T>::Constant(kVarlenTokens, H * kDv, T(-7));
          const auto ov =
              HeadsView<T>::bnhd(out.data(), linattn::BnhdShape{1, kVarlenTokens, H, kDv});
          const HeadsView<const T> qv = varlen_view(q, H), kv = varlen_view(k, H),
                                   vv = varlen_view(v, H);
          auto run = [&](const auto& map) {
            if (log_space) {
              batch.prefill_varlen_into(qv, kv, vv, linattn::log_gates(varlen_view(g, H)), map,
                                        kVarlenOffsets, ov);
            } else {
              batch.prefill_varlen_into(qv, kv, vv, varlen_view(a, H), map, kVarlenOffsets, ov);
            }
            for (Eigen::Index s = 0; s < kVarlenSequences; ++s) {
              const Eigen::Index len =
                  kVarlenOffsets[std::size_t(s) + 1] - kVarlenOffsets[std::size_t(s)];
              for (Eigen::Index h = 0; h < H; ++h) {
                const Eigen::Index i = s * H + h;
                const std::size_t si = static_cast<std::size_t>(i);
                INFO("sequence " << s << ", head " << h);
                CHECK(batch[i].tokens() == pre + len);
                if (len == 0) {
                  CHECK(same_gated_state(batch[i], before[si]));
                  continue;
                }
                RecurrentState<T> state = before[si];
                const Matrix<T> qs = varlen_head(q, H, s, h), ks = varlen_head(k, H, s, h);
                const Matrix<T> vs = varlen_head(v, H, s, h);
                const Matrix<T> gs = varlen_head(g, H, s, h), as = varlen_head(a, H, s, h);
                const Matrix<T> expected =
                    log_space ? state.prefill(qs, ks, vs, linattn::log_gates(gs), map)
                              : state.prefill(qs, ks, vs, as, map);
                const Matrix<T> got = varlen_head(out, H, s, h);
                CHECK(got == expected);
                CHECK(same_gated_state(batch[i], state));
                differing += got == expected ? 0 : 1;
                ++compared;
                if (kind == Kind::prf) continue;
                // The naive recurrence over the steps and the prompt; a_t as the kernel saw it.
                Matrix<double> q0(pre, kDk), k0(pre, kDk), v0(pre, kDv), g0(pre, gate_dim);
                for (Eigen::Index t = 0; t < pre; ++t) {
                  const std::uint64_t seed = step_seed + 3 * static_cast<std::uint64_t>(t);
                  q0.row(t) = inputs<T>(kind, count, seed).row(i).template cast<double>();
                  k0.row(t) = inputs<T>(kind, count, seed + 1).row(i).template cast<double>();
                  v0.row(t) = gaussian<T>(count, kDv, seed + 2).row(i).template cast<double>();
                  const Matrix<T> gt = step_gates[std::size_t(t)].row(i);
                  g0.row(t) = log_space ? gt.template cast<double>()
                                        : Matrix<double>(Matrix<T>(gt.array().exp().matrix())
                                                             .template cast<double>()
                                                             .array()
                                                             .log()
                                                             .matrix());
                }
                const Matrix<double> gn =
                    log_space ? Matrix<double>(gs.template cast<double>())
                              : Matrix<double>(as.template cast<double>().array().log().matrix());
                const Matrix<double> naive = naive_gated_recurrence(
                    naive_features(kind, stacked(q0, qs.template cast<double>())),
                    naive_features(kind, stacked(k0, ks.template cast<double>())),
                    stacked(v0, vs.template cast<double>()), stacked(g0, gn), options.eps);
                const double error = linattn_test::relative_error(got, naive.bottomRows(len));
                CHECK(error <= engine_bound<T>());
                worst = std::max(worst, error);
              }
            }
          };
          if (kind == Kind::featurized) run(linattn::Identity{});
          if (kind == Kind::elu) run(linattn::EluPlusOne{});
          if (kind == Kind::prf) run(prf_map());
          // Gated decoding continues from the prefilled states as from the per-head ones.
          std::vector<RecurrentState<T>> prefilled = snapshot(batch);
          CHECK(gated_step_both(kind, batch, prefilled, log_gate_rows<T>(count, gate_dim, 8200),
                                log_space, 8300) == 0);
        }
      }
    }
  }
  CHECK(differing == 0);
  CHECK(compared == 3 * 2 * 2 * 2 * 3 * H);  // kinds x gate widths x spaces x threads x prompts
  WARN("gated varlen prefill vs per-head prefill: "
       << differing << " of " << compared << " heads differ; vs the naive recurrence " << worst);
}

TEMPLATE_TEST_CASE("bonus varlen prefill continues each packed prompt's states",
                   "[state_batch][gated][bonus][varlen]", float, double) {
  using T = TestType;
  // RWKV-6: state s * H + h reads row h of u; two bonus steps first, then the packed prompts.
  const Eigen::Index H = 2, count = kVarlenSequences * H, pre = 2;
  const Matrix<T> u = gaussian<T>(H, kDk, 8400);
  int differing = 0, compared = 0;
  double worst = 0.0;
  for (const Kind kind : {Kind::featurized, Kind::elu}) {
    const Matrix<T> q = varlen_rows<T>(
        H, kDk, 8500, [&](std::uint64_t s) { return inputs<T>(kind, kVarlenTokens, s); });
    const Matrix<T> k = varlen_rows<T>(
        H, kDk, 8600, [&](std::uint64_t s) { return inputs<T>(kind, kVarlenTokens, s); });
    const Matrix<T> v = varlen_rows<T>(
        H, kDv, 8700, [&](std::uint64_t s) { return gaussian<T>(kVarlenTokens, kDv, s); });
    for (const Eigen::Index gate_dim : {Eigen::Index(1), kDk}) {
      INFO(kind_name(kind) << ", gate_dim = " << gate_dim);
      Matrix<T> g = varlen_rows<T>(H, gate_dim, 8800, [&](std::uint64_t s) {
        return log_gate_rows<T>(kVarlenTokens, gate_dim, s);
      });
      g.block(12, 0, 1, gate_dim).setConstant(-std::numeric_limits<T>::infinity());  // a reset
      linattn::Options options;
      options.normalize = false;
      options.scale = 0.5;
      options.chunk = 4;
      options.threads = 2;
      RecurrentStateBatch<T> batch(count, kDk, kDv, options);
      std::vector<RecurrentState<T>> single(static_cast<std::size_t>(count),
                                            RecurrentState<T>(kDk, kDv, options));
      auto run = [&](const auto& map) {
        // The steps' inputs, kept for the naive recurrence.
        std::vector<Matrix<T>> q0, k0, v0, g0;
        for (Eigen::Index t = 0; t < pre; ++t) {
          const std::uint64_t seed = 8900 + 5 * static_cast<std::uint64_t>(t);
          q0.push_back(inputs<T>(kind, count, seed));
          k0.push_back(inputs<T>(kind, count, seed + 1));
          v0.push_back(gaussian<T>(count, kDv, seed + 2));
          g0.push_back(log_gate_rows<T>(count, gate_dim, seed + 3));
          Matrix<T> out0(count, kDv);
          batch.step_into(q0.back(), k0.back(), v0.back(),
                          linattn::with_bonus(linattn::log_gates(g0.back()), u), map, out0);
          for (Eigen::Index i = 0; i < count; ++i) {
            const Matrix<T> uh = u.row(i % H);
            const Vector<T> expected = single[static_cast<std::size_t>(i)].step(
                q0.back().row(i), k0.back().row(i), v0.back().row(i),
                linattn::with_bonus(linattn::log_gates(g0.back().row(i)), uh), map);
            differing += out0.row(i).transpose() == expected ? 0 : 1;
          }
        }
        const std::vector<RecurrentState<T>> before = snapshot(batch);
        Matrix<T> out = Matrix<T>::Constant(kVarlenTokens, H * kDv, T(-7));
        batch.prefill_varlen_into(
            varlen_view(q, H), varlen_view(k, H), varlen_view(v, H),
            linattn::with_bonus(linattn::log_gates(varlen_view(g, H)), u), map, kVarlenOffsets,
            HeadsView<T>::bnhd(out.data(), linattn::BnhdShape{1, kVarlenTokens, H, kDv}));
        for (Eigen::Index s = 0; s < kVarlenSequences; ++s) {
          const Eigen::Index len =
              kVarlenOffsets[std::size_t(s) + 1] - kVarlenOffsets[std::size_t(s)];
          for (Eigen::Index h = 0; h < H; ++h) {
            const Eigen::Index i = s * H + h;
            const std::size_t si = static_cast<std::size_t>(i);
            INFO("sequence " << s << ", head " << h);
            CHECK(batch[i].tokens() == pre + len);
            if (len == 0) {
              CHECK(same_gated_state(batch[i], before[si]));
              continue;
            }
            RecurrentState<T> state = before[si];
            const Matrix<T> qs = varlen_head(q, H, s, h), ks = varlen_head(k, H, s, h);
            const Matrix<T> vs = varlen_head(v, H, s, h), gs = varlen_head(g, H, s, h);
            const Matrix<T> uh = u.row(h);
            const Matrix<T> expected =
                state.prefill(qs, ks, vs, linattn::with_bonus(linattn::log_gates(gs), uh), map);
            const Matrix<T> got = varlen_head(out, H, s, h);
            CHECK(got == expected);
            CHECK(same_gated_state(batch[i], state));
            differing += got == expected ? 0 : 1;
            ++compared;
            // FLA's naive_recurrent_rwkv6 over the steps and the prompt, from a zero state.
            Matrix<double> qn(pre, kDk), kn(pre, kDk), vn(pre, kDv), gn(pre, gate_dim);
            for (Eigen::Index t = 0; t < pre; ++t) {
              const std::size_t ti = static_cast<std::size_t>(t);
              qn.row(t) = q0[ti].row(i).template cast<double>();
              kn.row(t) = k0[ti].row(i).template cast<double>();
              vn.row(t) = v0[ti].row(i).template cast<double>();
              gn.row(t) = g0[ti].row(i).template cast<double>();
            }
            Matrix<double> state_h = Matrix<double>::Zero(kDk, kDv);
            const Matrix<double> naive = linattn_test::naive_rwkv6(
                naive_features(kind, stacked(qn, qs.template cast<double>())),
                naive_features(kind, stacked(kn, ks.template cast<double>())),
                stacked(vn, vs.template cast<double>()), stacked(gn, gs.template cast<double>()),
                u.row(h).transpose().template cast<double>(), options.scale, state_h);
            const double error = linattn_test::relative_error(got, naive.bottomRows(len));
            CHECK(error <= engine_bound<T>());
            worst = std::max(worst, error);
          }
        }
      };
      if (kind == Kind::featurized) run(linattn::Identity{});
      if (kind == Kind::elu) run(linattn::EluPlusOne{});
    }
  }
  CHECK(differing == 0);
  CHECK(compared == 2 * 2 * 3 * H);  // kinds x gate widths x non-empty prompts x heads
  WARN("bonus varlen prefill: worst relative error against the naive recurrence " << worst);
}

TEMPLATE_TEST_CASE("a varlen prefill that throws moves no state", "[state_batch][varlen][errors]",
                   float) {
  using T = TestType;
  using Catch::Contains;
  const Eigen::Index H = 2, count = kVarlenSequences * H, c = kDk;
  linattn::Options options;
  options.threads = 2;
  RecurrentStateBatch<T> batch(count, c, kDv, options);
  std::vector<RecurrentState<T>> single(static_cast<std::size_t>(count),
                                        RecurrentState<T>(c, kDv, options));
  REQUIRE(step_both(Kind::featurized, batch, single, 2, 8950) == 0);
  const std::vector<RecurrentState<T>> before = snapshot(batch);
  const auto make_inputs = [](std::uint64_t s) {
    return inputs<T>(Kind::featurized, kVarlenTokens, s);
  };
  const Matrix<T> q = varlen_rows<T>(H, kDk, 9000, make_inputs);
  const Matrix<T> k = varlen_rows<T>(H, kDk, 9010, make_inputs);
  const Matrix<T> v = varlen_rows<T>(
      H, kDv, 9020, [](std::uint64_t s) { return gaussian<T>(kVarlenTokens, kDv, s); });
  const Matrix<T> g = varlen_rows<T>(
      H, 1, 9030, [](std::uint64_t s) { return log_gate_rows<T>(kVarlenTokens, 1, s); });
  Matrix<T> out = Matrix<T>::Constant(kVarlenTokens, H * kDv, T(4));
  const Matrix<T> out_before = out;
  const auto qv = varlen_view(q, H), kv = varlen_view(k, H), vv = varlen_view(v, H);
  const auto ov = HeadsView<T>::bnhd(out.data(), linattn::BnhdShape{1, kVarlenTokens, H, kDv});
  const linattn::Identity id;
  using Offsets = std::vector<std::int64_t>;
  const std::string where = "RecurrentStateBatch::prefill_varlen";

  // Offsets that do not split the T = 23 tokens into S = size() / H sequences.
  CHECK_THROWS_WITH(batch.prefill_varlen_into(qv, kv, vv, id, Offsets{1, 5, 5, 22, 23}, ov),
                    Contains(where) && Contains("offsets[0] must be 0, got 1"));
  CHECK_THROWS_WITH(batch.prefill_varlen_into(qv, kv, vv, id, Offsets{0, 5, 4, 22, 23}, ov),
                    Contains("offsets must not decrease, but offsets[2] = 4 < offsets[1] = 5"));
  CHECK_THROWS_WITH(batch.prefill_varlen_into(qv, kv, vv, id, Offsets{0, 5, 5, 22, 22}, ov),
                    Contains("offsets.back() = 22 but the views hold 23 tokens"));
  CHECK_THROWS_WITH(batch.prefill_varlen_into(qv, kv, vv, id, Offsets{0, 5, 5, 22, 24}, ov),
                    Contains("offsets.back() = 24"));
  CHECK_THROWS_WITH(batch.prefill_varlen_into(qv, kv, vv, id, Offsets{0}, ov),
                    Contains("offsets needs at least 2 entries"));
  CHECK_THROWS_WITH(batch.prefill_varlen_into(qv, kv, vv, id, Offsets{0, 5, 22, 23}, ov),
                    Contains(where) &&
                        Contains("S = 3 sequences, S x H = 6 heads, but the batch holds 8 states"));
  CHECK_THROWS_WITH(batch.prefill_varlen_into(qv, kv, vv, id, Offsets{0, 1, 2, 5, 5, 22, 23}, ov),
                    Contains("S x H = 12 heads, but the batch holds 8 states"));
  // Mismatched views: tokens, widths, features, and a padded batch with offsets.
  const auto short_k =
      HeadsView<const T>::bnhd(k.data(), linattn::BnhdShape{1, kVarlenTokens - 1, H, kDk});
  CHECK_THROWS_WITH(
      batch.prefill_varlen_into(qv, short_k, vv, id, kVarlenOffsets, ov),
      Contains(where) && Contains("phi_k is [1, 2, 22, 8]") && Contains("B, H and N must match"));
  const Matrix<T> narrow_v = v.leftCols(H * (kDv - 1));
  CHECK_THROWS_WITH(
      batch.prefill_varlen_into(qv, kv, varlen_view(narrow_v, H), id, kVarlenOffsets, ov),
      Contains("v is [1, 2, 23, 4]"));
  CHECK_THROWS_WITH(
      batch.prefill_varlen_into(
          qv, kv, vv, id, kVarlenOffsets,
          HeadsView<T>::bnhd(out.data(), linattn::BnhdShape{1, kVarlenTokens, H, kDv - 1})),
      Contains("out is [1, 2, 23, 4]"));
  const Matrix<T> narrow_q = q.leftCols(H * (kDk - 1)), narrow_k = k.leftCols(H * (kDk - 1));
  CHECK_THROWS_WITH(batch.prefill_varlen_into(varlen_view(narrow_q, H), varlen_view(narrow_k, H),
                                              vv, id, kVarlenOffsets, ov),
                    Contains("phi_q gives 7 features per token but the states hold 8"));
  CHECK_THROWS_WITH(batch.prefill_varlen_into(qv, kv, vv, prf_map(), kVarlenOffsets, ov),
                    Contains("q gives 16 features per token but the states hold 8"));
  const Eigen::Index half = kVarlenTokens / 2;  // [2, 2, 11, D] views over the same memory
  CHECK_THROWS_WITH(batch.prefill_varlen_into(HeadsView<const T>::bhnd(q.data(), {2, H, half, kDk}),
                                              HeadsView<const T>::bhnd(k.data(), {2, H, half, kDk}),
                                              HeadsView<const T>::bhnd(v.data(), {2, H, half, kDv}),
                                              id, Offsets{0, 5, 5, 20, 22},
                                              HeadsView<T>::bhnd(out.data(), {2, H, half, kDv})),
                    Contains("B must be 1"));
  // Gates: of the wrong shape, out of range, or on states moved by Options::decay.
  const Matrix<T> wide_g = Matrix<T>::Constant(kVarlenTokens, H * 3, T(-0.1));
  CHECK_THROWS_WITH(
      batch.prefill_varlen_into(qv, kv, vv, linattn::log_gates(varlen_view(wide_g, H)), id,
                                kVarlenOffsets, ov),
      Contains(where) && Contains("gates is [1, 2, 23, 3]"));
  CHECK_THROWS_WITH(batch.prefill_varlen_into(qv, kv, vv, linattn::log_gates(varlen_view(g, H)), id,
                                              kVarlenOffsets, ov),
                    Contains("state 0 is moved by Options::decay"));
  Matrix<T> bad_g = g;
  bad_g(20, 1) = T(0.5);  // log gate > 0: sequence 2, head 1
  RecurrentStateBatch<T> fresh(count, c, kDv, options);
  CHECK_THROWS_WITH(fresh.prefill_varlen_into(qv, kv, vv, linattn::log_gates(varlen_view(bad_g, H)),
                                              id, kVarlenOffsets, ov),
                    Contains("gates[b=0, h=1]"));
  CHECK_THROWS_WITH(
      fresh.prefill_varlen_into(
          qv, kv, vv,
          linattn::with_bonus(linattn::log_gates(varlen_view(g, H)), gaussian<T>(H, c, 9040)), id,
          kVarlenOffsets, ov),
      Contains("normalize = false"));
  linattn::HeadDecays decays{{0.9, 0.8}};
  RecurrentStateBatch<T> decaying(count, c, kDv, decays);
  CHECK_THROWS_WITH(decaying.prefill_varlen_into(qv, kv, vv, linattn::log_gates(varlen_view(g, H)),
                                                 id, kVarlenOffsets, ov),
                    Contains("Options::decay"));
  // A NaN in the last token (sequence 3, head 1) and one in the first: found before any work.
  for (const T poison : {std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::infinity()}) {
    Matrix<T> bad_v = v;
    bad_v(kVarlenTokens - 1, H * kDv - 1) = poison;
    CHECK_THROWS_WITH(
        batch.prefill_varlen_into(qv, kv, varlen_view(bad_v, H), id, kVarlenOffsets, ov),
        Contains("v[b=0, h=1]") && Contains("row 22, column 4"));
    Matrix<T> bad_k = k;
    bad_k(0, 2) = -poison;
    CHECK_THROWS_WITH(
        batch.prefill_varlen_into(qv, varlen_view(bad_k, H), vv, id, kVarlenOffsets, ov),
        Contains("phi_k[b=0, h=0]") && Contains("row 0, column 2"));
  }
  // A state of other dimensions, assigned through operator[], stops the whole batch.
  RecurrentStateBatch<T> odd = batch;
  odd[5] = RecurrentState<T>(c, kDv + 1, options);
  CHECK_THROWS_WITH(odd.prefill_varlen_into(qv, kv, vv, id, kVarlenOffsets, ov),
                    Contains("state 5 is 8 x 6 (C x Dv) but state 0 is 8 x 5"));
  CHECK(same_state(odd[0], before[0]));
  CHECK(same_state(odd[7], before[7]));

  CHECK(states_moved(batch, before) == 0);
  CHECK(fresh[0].tokens() == 0);
  CHECK(fresh[count - 1].tokens() == 0);
  CHECK(decaying[0].tokens() == 0);
  CHECK(out == out_before);
  // The batch goes on as if nothing had happened.
  batch.prefill_varlen_into(qv, kv, vv, id, kVarlenOffsets, ov);
  CHECK(batch[2].tokens() == 2);  // sequence 1 is empty
  CHECK(batch[4].tokens() == 2 + 17);
}

// ---------------------------------------------------------------------------------------------
// DeltaRuleStateBatch: the delta rule's batch of states.

namespace {

using linattn::DeltaOptions;
using linattn::DeltaRuleState;
using linattn::DeltaRuleStateBatch;

/// Gate columns of the three delta-rule variants: DeltaNet, Gated DeltaNet, KDA.
const char* delta_variant(Eigen::Index gate_cols) {
  return gate_cols == 0 ? "DeltaNet" : gate_cols == 1 ? "Gated DeltaNet" : "KDA";
}

/// rows learning rates in [0.05, 1] from a seed.
template <class T>
Vector<T> delta_betas(Eigen::Index rows, std::uint64_t seed) {
  return (0.05 + 0.95 * gaussian<double>(rows, 1, seed).array().abs().min(1.0)).matrix().cast<T>();
}

/// rows x cols log gates in [-0.2, 0] from a seed.
template <class T>
Matrix<T> delta_log_gates(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed) {
  return (-0.1 * gaussian<double>(rows, cols, seed).array().abs()).matrix().cast<T>();
}

/// One step of a batch: DeltaNet without gates, else log_gates(g).
template <class T>
void delta_batch_step(DeltaRuleStateBatch<T>& batch, const Matrix<T>& q, const Matrix<T>& k,
                      const Matrix<T>& v, const Matrix<T>& g, const Vector<T>& beta,
                      Eigen::Ref<Matrix<T>> out) {
  if (g.cols() == 0) {
    batch.step_into(q, k, v, beta, out);
  } else {
    batch.step_into(q, k, v, linattn::log_gates(g), beta, out);
  }
}

/// True when the two states hold the same S, token count and transition, bit for bit.
template <class T>
bool same_delta_state(const DeltaRuleState<T>& a, const DeltaRuleState<T>& b) {
  return a.s() == b.s() && a.tokens() == b.tokens() && a.transition() == b.transition();
}

template <class T>
std::vector<DeltaRuleState<T>> delta_snapshot(const DeltaRuleStateBatch<T>& batch) {
  std::vector<DeltaRuleState<T>> states;
  for (Eigen::Index i = 0; i < batch.size(); ++i) states.push_back(batch[i]);
  return states;
}

template <class T>
int delta_states_moved(const DeltaRuleStateBatch<T>& batch,
                       const std::vector<DeltaRuleState<T>>& before) {
  int moved = 0;
  for (Eigen::Index i = 0; i < batch.size(); ++i) {
    if (!same_delta_state(batch[i], before[static_cast<std::size_t>(i)])) ++moved;
  }
  return moved;
}

/// The delta rule's bound against the naive recurrence (docs/design.md).
template <class T>
double delta_bound() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-10;
}

}  // namespace

TEMPLATE_TEST_CASE("delta batch: steps equal per-state steps bit for bit and the naive recurrence",
                   "[state_batch][delta_rule]", float, double) {
  using T = TestType;
  // B = 2 sequences of H = 4 value heads; q and k have 2 heads (grouped, Qwen3-Next's layout).
  const Eigen::Index B = 2, H = 4, Hqk = 2, count = B * H, steps = 12;
  const Eigen::Index gate_cols = GENERATE(Eigen::Index(0), Eigen::Index(1), kDk);
  const int threads = GENERATE(1, 2);
  INFO(delta_variant(gate_cols) << ", threads = " << threads);
  DeltaOptions options;
  options.l2_normalize = true;
  options.threads = threads;
  // Grouped rows need the sequences' head counts: the batch comes from a layer's make_states.
  const linattn::DeltaRuleLayer<T> layer(linattn::LayerHeads::grouped_query_key(H, Hqk), kDk, kDv,
                                         options);
  DeltaRuleStateBatch<T> batch = layer.make_states(B);
  CHECK(batch.size() == count);
  CHECK(batch.key_dim() == kDk);
  CHECK(batch.value_dim() == kDv);
  CHECK(batch.options().l2_normalize);
  std::vector<DeltaRuleState<T>> single(static_cast<std::size_t>(count),
                                        DeltaRuleState<T>(kDk, kDv, options));
  // Each state's inputs, kept for the naive recurrence.
  std::vector<Matrix<double>> qs(count, Matrix<double>(steps, kDk)), ks(qs),
      vs(count, Matrix<double>(steps, kDv)), gs(count, Matrix<double>(steps, gate_cols)), outs(vs);
  std::vector<Vector<double>> betas(count, Vector<double>(steps));
  int differing = 0;
  for (Eigen::Index t = 0; t < steps; ++t) {
    const std::uint64_t seed = 9000 + 10 * static_cast<std::uint64_t>(t);
    const Matrix<T> q = gaussian<T>(B * Hqk, kDk, seed), k = gaussian<T>(B * Hqk, kDk, seed + 1);
    const Matrix<T> v = gaussian<T>(count, kDv, seed + 2);
    const Matrix<T> g = delta_log_gates<T>(count, gate_cols, seed + 3);
    const Vector<T> beta = delta_betas<T>(count, seed + 4);
    Matrix<T> out(count, kDv);
    if (t == 0) {  // a batch made by hand does not know its sequences: a row per state
      DeltaRuleStateBatch<T> by_hand(count, kDk, kDv, options);
      CHECK_THROWS_WITH(delta_batch_step<T>(by_hand, q, k, v, g, beta, out),
                        Catch::Contains("make_states(B)"));
    }
    delta_batch_step<T>(batch, q, k, v, g, beta, out);
    for (Eigen::Index i = 0; i < count; ++i) {
      const std::size_t si = static_cast<std::size_t>(i);
      const Eigen::Index row = (i / H) * Hqk + (i % H) / (H / Hqk);  // FLA's grouping
      const Vector<T> expected =
          gate_cols == 0 ? single[si].step(q.row(row), k.row(row), v.row(i), beta(i))
                         : single[si].step(q.row(row), k.row(row), v.row(i),
                                           linattn::log_gates(Matrix<T>(g.row(i))), beta(i));
      differing += out.row(i).transpose() == expected ? 0 : 1;
      qs[si].row(t) = q.row(row).template cast<double>();
      ks[si].row(t) = k.row(row).template cast<double>();
      vs[si].row(t) = v.row(i).template cast<double>();
      gs[si].row(t) = g.row(i).template cast<double>();
      betas[si](t) = static_cast<double>(beta(i));
      outs[si].row(t) = out.row(i).template cast<double>();
    }
  }
  CHECK(differing == 0);
  for (Eigen::Index i = 0; i < count; ++i) {
    const std::size_t si = static_cast<std::size_t>(i);
    CHECK(same_delta_state(batch[i], single[si]));
    CHECK(batch[i].tokens() == steps);
    const Matrix<double> expected = linattn_test::naive_delta_rule(
        qs[si], ks[si], vs[si], betas[si], gs[si], 1.0 / std::sqrt(double(kDk)), true);
    CHECK(linattn_test::relative_error(outs[si], expected) <= delta_bound<T>());
  }
}

TEMPLATE_TEST_CASE("delta batch: prefill from views continues each state as its own prefill",
                   "[state_batch][delta_rule]", float) {
  using T = TestType;
  const Eigen::Index B = 2, H = 4, Hqk = 2, count = B * H, N = 45;
  const Eigen::Index gate_cols = GENERATE(Eigen::Index(0), Eigen::Index(1), kDk);
  const linattn::DeltaForm form =
      GENERATE(linattn::DeltaForm::chunked, linattn::DeltaForm::streamed);
  const int threads = GENERATE(1, 2);
  INFO(delta_variant(gate_cols) << ", streamed = " << (form == linattn::DeltaForm::streamed)
                                << ", threads = " << threads);
  DeltaOptions options;
  options.l2_normalize = true;
  options.chunk = 16;
  options.form = form;
  options.threads = threads;
  // [B, N, H, D] buffers: q and k with Hqk heads, v, beta, the gates and out with H.
  std::vector<T> qd(static_cast<std::size_t>(B * N * Hqk * kDk)), kd(qd.size());
  std::vector<T> vd(static_cast<std::size_t>(B * N * H * kDv)), od(vd.size());
  std::vector<T> bd(static_cast<std::size_t>(B * N * H)),
      gd(static_cast<std::size_t>(B * N * H * std::max<Eigen::Index>(gate_cols, 1)));
  auto view = [&](std::vector<T>& data, Eigen::Index heads, Eigen::Index dim) {
    return HeadsView<T>::bnhd(data.data(), linattn::BnhdShape{B, N, heads, dim});
  };
  for (Eigen::Index b = 0; b < B; ++b) {
    for (Eigen::Index h = 0; h < Hqk; ++h) {
      const std::uint64_t seed = 9500 + 10 * static_cast<std::uint64_t>(b * Hqk + h);
      view(qd, Hqk, kDk).head(b, h) = gaussian<T>(N, kDk, seed);
      view(kd, Hqk, kDk).head(b, h) = gaussian<T>(N, kDk, seed + 1);
    }
    for (Eigen::Index h = 0; h < H; ++h) {
      const std::uint64_t seed = 9700 + 10 * static_cast<std::uint64_t>(b * H + h);
      view(vd, H, kDv).head(b, h) = gaussian<T>(N, kDv, seed);
      view(bd, H, 1).head(b, h) = delta_betas<T>(N, seed + 1);
      if (gate_cols > 0)
        view(gd, H, gate_cols).head(b, h) = delta_log_gates<T>(N, gate_cols, seed + 2);
    }
  }
  // Every state first takes one step, so that the prefill starts from a state of its own.
  DeltaRuleStateBatch<T> batch(count, kDk, kDv, options);
  const Matrix<T> q0 = gaussian<T>(count, kDk, 9900), k0 = gaussian<T>(count, kDk, 9901);
  const Matrix<T> v0 = gaussian<T>(count, kDv, 9902),
                  g0 = delta_log_gates<T>(count, gate_cols, 9903);
  const Vector<T> beta0 = delta_betas<T>(count, 9904);
  Matrix<T> out0(count, kDv);
  delta_batch_step<T>(batch, q0, k0, v0, g0, beta0, out0);
  std::vector<DeltaRuleState<T>> single = delta_snapshot(batch);
  if (gate_cols == 0) {
    batch.prefill_into(view(qd, Hqk, kDk), view(kd, Hqk, kDk), view(vd, H, kDv), view(bd, H, 1),
                       view(od, H, kDv));
  } else {
    const HeadsView<const T> gv = view(gd, H, gate_cols);
    batch.prefill_into(view(qd, Hqk, kDk), view(kd, Hqk, kDk), view(vd, H, kDv),
                       linattn::log_gates(gv), view(bd, H, 1), view(od, H, kDv));
  }
  int differing = 0;
  for (Eigen::Index i = 0; i < count; ++i) {
    const Eigen::Index b = i / H, h = i % H, hq = h / (H / Hqk);
    const std::size_t si = static_cast<std::size_t>(i);
    const Matrix<T> q = view(qd, Hqk, kDk).head(b, hq), k = view(kd, Hqk, kDk).head(b, hq);
    const Matrix<T> v = view(vd, H, kDv).head(b, h);
    const Vector<T> beta = view(bd, H, 1).head(b, h);
    const Matrix<T> expected =
        gate_cols == 0
            ? single[si].prefill(q, k, v, beta)
            : single[si].prefill(
                  q, k, v, linattn::log_gates(Matrix<T>(view(gd, H, gate_cols).head(b, h))), beta);
    const Matrix<T> got = view(od, H, kDv).head(b, h);
    differing += got == expected ? 0 : 1;
    CHECK(same_delta_state(batch[i], single[si]));
    CHECK(batch[i].tokens() == N + 1);
    // And the naive recurrence over the step's token and the prompt.
    Matrix<double> qn(N + 1, kDk), kn(N + 1, kDk), vn(N + 1, kDv), gn(N + 1, gate_cols);
    Vector<double> bn(N + 1);
    qn << q0.row(i).template cast<double>(), q.template cast<double>();
    kn << k0.row(i).template cast<double>(), k.template cast<double>();
    vn << v0.row(i).template cast<double>(), v.template cast<double>();
    bn << static_cast<double>(beta0(i)), beta.template cast<double>();
    if (gate_cols > 0) {
      gn << g0.row(i).template cast<double>(),
          Matrix<T>(view(gd, H, gate_cols).head(b, h)).template cast<double>();
    }
    const Matrix<double> naive =
        linattn_test::naive_delta_rule(qn, kn, vn, bn, gn, 1.0 / std::sqrt(double(kDk)), true);
    CHECK(linattn_test::relative_error(got, naive.bottomRows(N)) <= delta_bound<T>());
  }
  CHECK(differing == 0);
}

TEMPLATE_TEST_CASE("delta batch: varlen prefill continues each packed prompt's states",
                   "[state_batch][delta_rule]", float, double) {
  using T = TestType;
  // Three prompts of 7, 0 and 30 tokens packed along N; H = 2 value heads over one q/k head
  // (grouped); states s * H + h. Every state first takes a step of its own.
  const std::vector<std::int64_t> offsets{0, 7, 7, 37};
  const Eigen::Index H = 2, S = 3, total = 37, count = S * H;
  const Eigen::Index gate_cols = GENERATE(Eigen::Index(0), Eigen::Index(1), kDk);
  INFO(delta_variant(gate_cols));
  DeltaOptions options;
  options.chunk = 8;
  options.l2_normalize = true;
  const Eigen::Index gate_dim = std::max<Eigen::Index>(gate_cols, 1);
  const Matrix<T> q = gaussian<T>(total, kDk, 9950), k = gaussian<T>(total, kDk, 9951);
  const Matrix<T> v = gaussian<T>(total, H * kDv, 9952);
  const Matrix<T> g = delta_log_gates<T>(total, H * gate_dim, 9955);
  Matrix<T> beta(total, H);
  for (Eigen::Index h = 0; h < H; ++h) beta.col(h) = delta_betas<T>(total, 9953 + h);
  Matrix<T> out(total, H * kDv);
  auto qv = HeadsView<const T>::bnhd(q.data(), linattn::BnhdShape{1, total, 1, kDk});
  auto kv = HeadsView<const T>::bnhd(k.data(), linattn::BnhdShape{1, total, 1, kDk});
  auto vv = HeadsView<const T>::bnhd(v.data(), linattn::BnhdShape{1, total, H, kDv});
  auto bv = HeadsView<const T>::bnhd(beta.data(), linattn::BnhdShape{1, total, H, 1});
  auto gv = HeadsView<const T>::bnhd(g.data(), linattn::BnhdShape{1, total, H, gate_dim});
  auto ov = HeadsView<T>::bnhd(out.data(), linattn::BnhdShape{1, total, H, kDv});
  DeltaRuleStateBatch<T> batch(count, kDk, kDv, options);
  const Matrix<T> q0 = gaussian<T>(count, kDk, 9960), k0 = gaussian<T>(count, kDk, 9961);
  const Matrix<T> v0 = gaussian<T>(count, kDv, 9962);
  const Matrix<T> g0 = delta_log_gates<T>(count, gate_cols, 9963);
  const Vector<T> beta0 = delta_betas<T>(count, 9964);
  Matrix<T> out0(count, kDv);
  delta_batch_step<T>(batch, q0, k0, v0, g0, beta0, out0);
  const std::vector<DeltaRuleState<T>> before = delta_snapshot(batch);
  if (gate_cols == 0) {
    batch.prefill_varlen_into(qv, kv, vv, bv, offsets, ov);
  } else {
    batch.prefill_varlen_into(qv, kv, vv, linattn::log_gates(gv), bv, offsets, ov);
  }
  int differing = 0;
  for (Eigen::Index s = 0; s < S; ++s) {
    const Eigen::Index begin = offsets[s], len = offsets[s + 1] - offsets[s];
    for (Eigen::Index h = 0; h < H; ++h) {
      const Eigen::Index i = s * H + h;
      INFO("sequence " << s << ", head " << h);
      CHECK(batch[i].tokens() == len + 1);
      if (len == 0) {
        // The empty prompt leaves its states as the step left them.
        CHECK(same_delta_state(batch[i], before[static_cast<std::size_t>(i)]));
        continue;
      }
      DeltaRuleState<T> state = before[static_cast<std::size_t>(i)];
      const Matrix<T> qs = q.middleRows(begin, len), ks = k.middleRows(begin, len);
      const Matrix<T> vs = v.block(begin, h * kDv, len, kDv);
      const Vector<T> bs = beta.col(h).segment(begin, len);
      const Matrix<T> expected =
          gate_cols == 0
              ? state.prefill(qs, ks, vs, bs)
              : state.prefill(
                    qs, ks, vs,
                    linattn::log_gates(Matrix<T>(g.block(begin, h * gate_dim, len, gate_dim))), bs);
      differing += Matrix<T>(out.block(begin, h * kDv, len, kDv)) == expected ? 0 : 1;
      CHECK(same_delta_state(batch[i], state));
    }
  }
  CHECK(differing == 0);
}

TEMPLATE_TEST_CASE("delta batch: every bad step or prefill throws and moves no state",
                   "[state_batch][delta_rule][errors]", float) {
  using T = TestType;
  using Catch::Contains;
  const Eigen::Index count = 4, N = 6;
  DeltaOptions options;
  options.l2_normalize = true;
  DeltaRuleStateBatch<T> batch(count, kDk, kDv, options);
  const Matrix<T> q = gaussian<T>(count, kDk, 9960), k = gaussian<T>(count, kDk, 9961);
  const Matrix<T> v = gaussian<T>(count, kDv, 9962);
  const Vector<T> beta = delta_betas<T>(count, 9963);
  const Matrix<T> g = delta_log_gates<T>(count, 1, 9964);
  Matrix<T> out(count, kDv);
  batch.step_into(q, k, v, linattn::log_gates(g), beta, out);
  const std::vector<DeltaRuleState<T>> before = delta_snapshot(batch);
  const auto expect_still = [&] { CHECK(delta_states_moved(batch, before) == 0); };

  Vector<T> bad_beta = beta;
  bad_beta(3) = T(0);
  CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::log_gates(g), bad_beta, out),
                    Contains("beta must lie in (0, 1]") && Contains("at state 3"));
  bad_beta(3) = T(1.5);
  CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::log_gates(g), bad_beta, out),
                    Contains("beta"));
  CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::log_gates(g), Vector<T>(beta.head(3)), out),
                    Contains("beta"));
  Matrix<T> nan_v = v;
  nan_v(2, 1) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_WITH(batch.step_into(q, k, nan_v, linattn::log_gates(g), beta, out), Contains("v"));
  CHECK_THROWS_WITH(
      batch.step_into(Matrix<T>(q.topRows(3)), k, v, linattn::log_gates(g), beta, out),
      Contains("q is 3 x 8 but the batch needs 4 x 8"));
  Matrix<T> short_out(2, kDv);
  CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::log_gates(g), beta, short_out),
                    Contains("out is 2 x 5"));
  Matrix<T> positive = g;
  positive(1, 0) = T(0.5);
  CHECK_THROWS_WITH(batch.step_into(q, k, v, linattn::log_gates(positive), beta, out),
                    Contains("gates"));
  CHECK_THROWS(batch.step_into(q, k, v, linattn::log_gates(Matrix<T>(Matrix<T>::Zero(count, 3))),
                               beta, out));
  CHECK_THROWS_WITH(batch.step_into(q, k, v, beta, out),
                    Contains("state 0 is moved by scalar gates (Gated DeltaNet) but this call "
                             "gives no gates (DeltaNet)"));
  CHECK_THROWS_WITH(
      batch.step_into(q, k, v, linattn::log_gates(Matrix<T>(Matrix<T>::Zero(count, kDk))), beta,
                      out),
      Contains("per-feature gates (KDA)"));
  expect_still();

  // A state of other dimensions or options, assigned through operator[], stops the batch.
  DeltaRuleStateBatch<T> odd = batch;
  odd[2] = DeltaRuleState<T>(kDk, kDv + 1, options);
  const std::vector<DeltaRuleState<T>> odd_before = delta_snapshot(odd);
  CHECK_THROWS_WITH(odd.step_into(q, k, v, linattn::log_gates(g), beta, out),
                    Contains("state 2 is 8 x 6 (Dk x Dv) but state 0 is 8 x 5"));
  DeltaOptions other = options;
  other.l2_normalize = false;
  odd[2] = DeltaRuleState<T>(kDk, kDv, other);
  CHECK_THROWS_WITH(odd.step_into(q, k, v, linattn::log_gates(g), beta, out),
                    Contains("state 2 has other scale, l2_normalize"));
  CHECK(same_delta_state(odd[0], odd_before[0]));
  CHECK(same_delta_state(odd[3], odd_before[3]));

  // Only the last state is moved by another transition: the states before it stay too.
  DeltaRuleStateBatch<T> mixed(count, kDk, kDv, options);
  const Matrix<T> kda = delta_log_gates<T>(1, kDk, 9965);
  (void)mixed[3].step(q.row(3), k.row(3), v.row(3), linattn::log_gates(kda), beta(3));
  const std::vector<DeltaRuleState<T>> mixed_before = delta_snapshot(mixed);
  CHECK_THROWS_WITH(mixed.step_into(q, k, v, beta, out),
                    Contains("state 3 is moved by per-feature gates (KDA)"));
  CHECK_THROWS_WITH(mixed.step_into(q, k, v, linattn::log_gates(g), beta, out),
                    Contains("state 3 is moved by per-feature gates (KDA)"));
  CHECK(delta_states_moved(mixed, mixed_before) == 0);

  // Prefill: the views must hold size() heads of the states' widths.
  std::vector<T> qd(static_cast<std::size_t>(count * N * kDk), T(0.5)), kd(qd);
  std::vector<T> vd(static_cast<std::size_t>(count * N * kDv), T(1)), od(vd);
  std::vector<T> bd(static_cast<std::size_t>(count * N), T(0.5)),
      gd(static_cast<std::size_t>(count * N), T(-0.1));
  auto view = [&](std::vector<T>& data, Eigen::Index b, Eigen::Index h, Eigen::Index dim) {
    return HeadsView<T>::bhnd(data.data(), {b, h, N, dim});
  };
  CHECK_THROWS_WITH(batch.prefill_into(view(qd, 1, 2, kDk), view(kd, 1, 2, kDk),
                                       view(vd, 1, 2, kDv), linattn::log_gates(view(gd, 1, 2, 1)),
                                       view(bd, 1, 2, 1), view(od, 1, 2, kDv)),
                    Contains("1 sequences x 2 heads, but the batch holds 4 states"));
  CHECK_THROWS_WITH(batch.prefill_into(view(qd, 1, 4, kDv), view(kd, 1, 4, kDv),
                                       view(vd, 1, 4, kDv), linattn::log_gates(view(gd, 1, 4, 1)),
                                       view(bd, 1, 4, 1), view(od, 1, 4, kDv)),
                    Contains("but the states are Dk x Dv = 8 x 5"));
  CHECK_THROWS_WITH(batch.prefill_into(view(qd, 2, 2, kDk), view(kd, 2, 2, kDk),
                                       view(vd, 2, 2, kDv), view(bd, 2, 2, 1), view(od, 2, 2, kDv)),
                    Contains("state 0 is moved by scalar gates"));
  CHECK_THROWS_WITH(mixed.prefill_into(view(qd, 2, 2, kDk), view(kd, 2, 2, kDk),
                                       view(vd, 2, 2, kDv), linattn::log_gates(view(gd, 2, 2, 1)),
                                       view(bd, 2, 2, 1), view(od, 2, 2, kDv)),
                    Contains("state 3 is moved by per-feature gates (KDA)"));
  CHECK(delta_states_moved(mixed, mixed_before) == 0);
  odd[2] = DeltaRuleState<T>(kDk, kDv + 1, options);
  CHECK_THROWS_WITH(odd.prefill_into(view(qd, 2, 2, kDk), view(kd, 2, 2, kDk), view(vd, 2, 2, kDv),
                                     linattn::log_gates(view(gd, 2, 2, 1)), view(bd, 2, 2, 1),
                                     view(od, 2, 2, kDv)),
                    Contains("state 2 is 8 x 6 (Dk x Dv) but state 0 is 8 x 5"));
  CHECK(same_delta_state(odd[0], odd_before[0]));
  bd[5] = T(2);
  CHECK_THROWS_WITH(batch.prefill_into(view(qd, 2, 2, kDk), view(kd, 2, 2, kDk),
                                       view(vd, 2, 2, kDv), linattn::log_gates(view(gd, 2, 2, 1)),
                                       view(bd, 2, 2, 1), view(od, 2, 2, kDv)),
                    Contains("beta"));
  expect_still();
  CHECK_THROWS_WITH(DeltaRuleStateBatch<T>(0, kDk, kDv), Contains("count"));
  CHECK_THROWS_WITH(DeltaRuleStateBatch<T>(2, 0, kDv), Contains("key_dim"));

  // reset() clears every state; a cleared batch takes any transition.
  batch.reset();
  for (Eigen::Index i = 0; i < count; ++i) {
    CHECK(batch[i].tokens() == 0);
    CHECK(batch[i].s().isZero(0));
  }
  batch.step_into(q, k, v, beta, out);
  CHECK(batch[1].transition() == linattn::TransitionKind::decay);
}

}  // namespace linattn_test_state_batch
