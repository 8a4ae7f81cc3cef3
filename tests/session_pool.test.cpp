// SessionPool: steps and prefills equal each session's states run on their own, bit for bit,
// across adds, drops and reorders; no other session's memory moves; errors change nothing.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <linattn/gated_delta_net.hpp>
#include <linattn/gated_short_conv.hpp>
#include <linattn/layer.hpp>
#include <linattn/mamba2.hpp>
#include <linattn/session_pool.hpp>
#include <linattn/softmax.hpp>
#include <map>
#include <random>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_session_pool {

namespace {

/// Where a state keeps its S (a pool moves handles, never this memory).
template <class State>
const void* memory_of(const State& state) {
  return linattn::detail::StateAccess::held_s(state).data();
}

using linattn::DeltaOptions;
using linattn::DeltaRuleState;
using linattn::DeltaRuleStateBatch;
using linattn::HeadsView;
using linattn::Matrix;
using linattn::RecurrentState;
using linattn::RecurrentStateBatch;
using linattn::SessionPool;
using linattn::Vector;
using linattn_test::gaussian;
using Key = std::int64_t;

constexpr Eigen::Index kDk = 6;
constexpr Eigen::Index kDv = 5;

/// Each session's states on their own: [layer][head].
template <class State>
using Sessions = std::map<Key, std::vector<std::vector<State>>>;

/// True when the two states hold the same S (and z), token count and transition, bit for bit.
template <class T>
bool same_state(const RecurrentState<T>& a, const RecurrentState<T>& b) {
  return a.s() == b.s() && a.z() == b.z() && a.tokens() == b.tokens() &&
         a.transition() == b.transition();
}
template <class T>
bool same_state(const DeltaRuleState<T>& a, const DeltaRuleState<T>& b) {
  return a.s() == b.s() && a.tokens() == b.tokens() && a.transition() == b.transition();
}

/// Where each live state's S lives, by (key, layer, head).
template <class Pool>
std::map<std::tuple<Key, Eigen::Index, Eigen::Index>, const void*> addresses(const Pool& pool) {
  std::map<std::tuple<Key, Eigen::Index, Eigen::Index>, const void*> at;
  for (Key key : pool.keys()) {
    for (Eigen::Index l = 0; l < pool.layers(); ++l) {
      for (Eigen::Index h = 0; h < pool.heads(l); ++h) {
        at[{key, l, h}] = memory_of(pool.state(key, l, h));
      }
    }
  }
  return at;
}

/// States of `pool` that differ from `sessions` or whose S moved from `before` (keys in both).
template <class Pool, class State>
int differing_states(
    const Pool& pool, const Sessions<State>& sessions,
    const std::map<std::tuple<Key, Eigen::Index, Eigen::Index>, const void*>& before) {
  int differing = 0;
  for (Key key : pool.keys()) {
    for (Eigen::Index l = 0; l < pool.layers(); ++l) {
      for (Eigen::Index h = 0; h < pool.heads(l); ++h) {
        const State& state = pool.state(key, l, h);
        if (!same_state(state, sessions.at(key)[l][h])) ++differing;
        const auto was = before.find({key, l, h});
        if (was != before.end() && was->second != memory_of(state)) ++differing;
      }
    }
  }
  return differing;
}

/// A pool's engine layer 0: H = 3 heads with RetNet's decays, normalised, 2 threads.
template <class T>
linattn::LinearAttentionLayer<T, linattn::Identity> decay_layer() {
  linattn::Options options;
  options.threads = 2;
  return linattn::LinearAttentionLayer<T, linattn::Identity>(
      linattn::Identity{}, 3, kDk, kDv, linattn::HeadDecays{{0.9, 0.97, 1.0}}, options);
}

/// Layer 1: H = 2 gated heads (q and k with `heads`' counts), unnormalised.
template <class T>
linattn::LinearAttentionLayer<T, linattn::Identity> gated_layer(linattn::LayerHeads heads = 2) {
  linattn::Options options;
  options.normalize = false;
  return linattn::LinearAttentionLayer<T, linattn::Identity>(linattn::Identity{}, heads, kDk, kDv,
                                                             options);
}

/// Layer 1 with one q/k head per sequence over its 2 heads.
template <class T>
linattn::LinearAttentionLayer<T, linattn::Identity> grouped_gated_layer() {
  return gated_layer<T>(linattn::LayerHeads::grouped_query_key(2, 1));
}

}  // namespace

TEMPLATE_TEST_CASE("pool steps equal each session stepped alone across adds, drops and reorders",
                   "[session_pool]", float, double) {
  using T = TestType;
  using Batch = RecurrentStateBatch<T>;
  using State = RecurrentState<T>;
  SessionPool<Batch> pool(decay_layer<T>(), grouped_gated_layer<T>());
  CHECK(pool.layers() == 2);
  CHECK(pool.heads(0) == 3);
  CHECK(pool.heads(1) == 2);
  CHECK(pool.size() == 0);
  const Batch fresh[2] = {decay_layer<T>().make_states(1), grouped_gated_layer<T>().make_states(1)};
  Sessions<State> alone;
  std::mt19937_64 random(77);
  Key next_key = 100;
  int differing = 0, moved = 0, rounds_with_drop = 0, rounds_with_reorder = 0;
  for (int round = 0; round < 40; ++round) {
    const auto before = addresses(pool);
    const int op = static_cast<int>(random() % 4);
    if (pool.size() < 2 || (op == 0 && pool.size() < 7)) {
      const Key key = next_key;
      next_key += 7;
      const Eigen::Index at = pool.add(key);
      CHECK(at == pool.size() - 1);
      for (int l = 0; l < 2; ++l) {
        std::vector<State> heads;
        for (Eigen::Index h = 0; h < fresh[l].size(); ++h) heads.push_back(fresh[l][h]);
        alone[key].push_back(heads);
      }
    } else if (op == 1) {
      const Key key = pool.keys()[random() % pool.keys().size()];
      pool.drop(key);
      alone.erase(key);
      CHECK_FALSE(pool.contains(key));
      ++rounds_with_drop;
    } else if (op == 2) {
      std::vector<Key> order = pool.keys();
      std::shuffle(order.begin(), order.end(), random);
      pool.reorder(order);
      CHECK(pool.keys() == order);
      ++rounds_with_reorder;
    }
    // No state of a session that stayed moved in memory or changed.
    moved += differing_states(pool, alone, before);
    // One token for every session: layer 0 through EluPlusOne, layer 1 gated per feature with
    // one q/k row per session (grouped over its 2 heads).
    const Eigen::Index n = pool.size();
    const std::uint64_t seed = 500 + 10 * static_cast<std::uint64_t>(round);
    const Matrix<T> q0 = gaussian<T>(3 * n, kDk, seed), k0 = gaussian<T>(3 * n, kDk, seed + 1);
    const Matrix<T> v0 = gaussian<T>(3 * n, kDv, seed + 2);
    Matrix<T> out0(3 * n, kDv);
    pool.step_into(0, q0, k0, v0, linattn::EluPlusOne{}, out0);
    const Matrix<T> q1 = gaussian<T>(n, kDk, seed + 3).cwiseAbs(),
                    k1 = gaussian<T>(n, kDk, seed + 4).cwiseAbs();
    const Matrix<T> v1 = gaussian<T>(2 * n, kDv, seed + 5);
    const Matrix<T> g1 = (-0.1 * gaussian<T>(2 * n, kDk, seed + 6).array().abs()).matrix();
    const Matrix<T> out1 = pool.step(1, q1, k1, v1, linattn::log_gates(g1), linattn::Identity{});
    REQUIRE(out1.rows() == 2 * n);
    for (Eigen::Index s = 0; s < n; ++s) {
      std::vector<std::vector<State>>& states = alone.at(pool.keys()[static_cast<std::size_t>(s)]);
      for (Eigen::Index h = 0; h < 3; ++h) {
        const Eigen::Index r = 3 * s + h;
        const Vector<T> want =
            states[0][h].step(q0.row(r), k0.row(r), v0.row(r), linattn::EluPlusOne{});
        differing += out0.row(r).transpose() == want ? 0 : 1;
      }
      for (Eigen::Index h = 0; h < 2; ++h) {
        const Eigen::Index r = 2 * s + h;
        const Vector<T> want = states[1][h].step(
            q1.row(s), k1.row(s), v1.row(r), linattn::log_gates(g1.row(r)), linattn::Identity{});
        differing += out1.row(r).transpose() == want ? 0 : 1;
      }
    }
    differing += differing_states(pool, alone, {});
  }
  CHECK(differing == 0);
  CHECK(moved == 0);
  // The random walk did exercise every operation.
  CHECK(rounds_with_drop > 0);
  CHECK(rounds_with_reorder > 0);
  // Layer 1 takes one q/k row per session: one row for several sessions (which divides the
  // states' count) is refused, and no state moves.
  while (pool.size() < 2) pool.add(next_key++);
  const Eigen::Index n = pool.size();
  const RecurrentState<T> first = pool.state(pool.keys().front(), 1, 0);
  const Matrix<T> one_row = gaussian<T>(1, kDk, 900).cwiseAbs();
  const Matrix<T> g = (-0.1 * gaussian<T>(2 * n, kDk, 901).array().abs()).matrix();
  CHECK_THROWS_WITH(pool.step(1, one_row, one_row, gaussian<T>(2 * n, kDv, 902),
                              linattn::log_gates(g), linattn::Identity{}),
                    Catch::Contains("q is 1 x") && Catch::Contains("LayerHeads"));
  CHECK(same_state(pool.state(pool.keys().front(), 1, 0), first));
}

TEMPLATE_TEST_CASE(
    "pool: a delta-rule prefill of some sessions equals a batch of them, others untouched",
    "[session_pool][delta_rule]", float, double) {
  using T = TestType;
  using Batch = DeltaRuleStateBatch<T>;
  using State = DeltaRuleState<T>;
  // One Gated DeltaNet layer of H = 4 value heads over 2 q/k heads.
  const Eigen::Index H = 4, Hqk = 2;
  DeltaOptions options;
  options.l2_normalize = true;
  options.threads = GENERATE(1, 2);
  SessionPool<Batch> pool(
      1, linattn::DeltaRuleLayer<T>(linattn::LayerHeads::grouped_query_key(H, Hqk), kDk, kDv,
                                    options));
  Sessions<State> alone;
  const State fresh(kDk, kDv, options);
  auto step_all = [&](std::uint64_t seed) {
    const Eigen::Index n = pool.size();
    const Matrix<T> q = gaussian<T>(n * Hqk, kDk, seed), k = gaussian<T>(n * Hqk, kDk, seed + 1);
    const Matrix<T> v = gaussian<T>(n * H, kDv, seed + 2);
    const Matrix<T> g = (-0.1 * gaussian<T>(n * H, 1, seed + 3).array().abs()).matrix();
    const Vector<T> beta =
        (0.1 + 0.8 * gaussian<T>(n * H, 1, seed + 4).array().abs().min(T(1))).matrix();
    Matrix<T> out(n * H, kDv);
    pool.step_into(0, q, k, v, linattn::log_gates(g), beta, out);
    int differing = 0;
    for (Eigen::Index s = 0; s < n; ++s) {
      std::vector<State>& heads = alone.at(pool.keys()[static_cast<std::size_t>(s)])[0];
      for (Eigen::Index h = 0; h < H; ++h) {
        const Eigen::Index r = s * H + h, qr = s * Hqk + h / (H / Hqk);
        const Vector<T> want =
            heads[h].step(q.row(qr), k.row(qr), v.row(r), linattn::log_gates(g.row(r)), beta(r));
        differing += out.row(r).transpose() == want ? 0 : 1;
      }
    }
    return differing;
  };
  int differing = 0;
  for (Key key : {1, 2, 3}) {
    pool.add(key);
    alone[key] = {std::vector<State>(H, fresh)};
  }
  for (std::uint64_t t = 0; t < 5; ++t) differing += step_all(100 + 10 * t);
  pool.add(4);
  pool.add(5);
  alone[4] = {std::vector<State>(H, fresh)};
  alone[5] = {std::vector<State>(H, fresh)};
  pool.drop(1);
  alone.erase(1);
  // Prompts of 7 and 0 tokens for sessions 5 and 4 and of 3 for session 2 (already stepped),
  // named out of position order, packed along N.
  const std::vector<Key> prompted = {5, 4, 2};
  const std::vector<std::int64_t> offsets = {0, 7, 7, 10};
  const Eigen::Index tokens = offsets.back();
  std::vector<T> qd(static_cast<std::size_t>(Hqk * tokens * kDk)), kd(qd.size()),
      vd(static_cast<std::size_t>(H * tokens * kDv)), gd(static_cast<std::size_t>(H * tokens)),
      bd(gd.size());
  std::mt19937_64 random(9);
  std::normal_distribution<double> normal;
  for (T& x : qd) x = static_cast<T>(normal(random));
  for (T& x : kd) x = static_cast<T>(normal(random));
  for (T& x : vd) x = static_cast<T>(normal(random));
  for (T& x : gd) x = static_cast<T>(-0.1 * std::abs(normal(random)));
  for (T& x : bd) x = static_cast<T>(0.2 + 0.5 * std::min(1.0, std::abs(normal(random))));
  const auto q = HeadsView<const T>::bnhd(qd.data(), linattn::BnhdShape{1, tokens, Hqk, kDk});
  const auto k = HeadsView<const T>::bnhd(kd.data(), linattn::BnhdShape{1, tokens, Hqk, kDk});
  const auto v = HeadsView<const T>::bnhd(vd.data(), linattn::BnhdShape{1, tokens, H, kDv});
  const auto g = HeadsView<const T>::bnhd(gd.data(), linattn::BnhdShape{1, tokens, H, 1});
  const auto beta = HeadsView<const T>::bnhd(bd.data(), linattn::BnhdShape{1, tokens, H, 1});
  std::vector<T> got(vd.size()), want(vd.size());
  // The reference: the same states in a batch of their own.
  Batch reference(static_cast<Eigen::Index>(prompted.size()) * H, kDk, kDv, options);
  for (std::size_t s = 0; s < prompted.size(); ++s) {
    for (Eigen::Index h = 0; h < H; ++h)
      reference[static_cast<Eigen::Index>(s) * H + h] = alone.at(prompted[s])[0][h];
  }
  reference.prefill_varlen_into(
      q, k, v, linattn::log_gates(g), beta, offsets,
      HeadsView<T>::bnhd(want.data(), linattn::BnhdShape{1, tokens, H, kDv}));
  const auto before = addresses(pool);
  pool.prefill_varlen_into(0, prompted, q, k, v, linattn::log_gates(g), beta, offsets,
                           HeadsView<T>::bnhd(got.data(), linattn::BnhdShape{1, tokens, H, kDv}));
  CHECK(got == want);
  for (std::size_t s = 0; s < prompted.size(); ++s) {
    for (Eigen::Index h = 0; h < H; ++h) {
      CHECK(same_state(pool.state(prompted[s], 0, h),
                       reference[static_cast<Eigen::Index>(s) * H + h]));
      alone.at(prompted[s])[0][h] = reference[static_cast<Eigen::Index>(s) * H + h];
    }
  }
  CHECK(pool.keys() == std::vector<Key>{2, 3, 4, 5});
  // Session 3, not named, is where and as it was.
  std::map<std::tuple<Key, Eigen::Index, Eigen::Index>, const void*> untouched;
  for (Eigen::Index h = 0; h < H; ++h) untouched[{3, 0, h}] = before.at({3, 0, h});
  CHECK(differing_states(pool, alone, untouched) == 0);
  // The states it prefilled decode on as the reference's.
  for (std::uint64_t t = 0; t < 4; ++t) differing += step_all(300 + 10 * t);
  CHECK(differing == 0);
}

TEMPLATE_TEST_CASE("pool: equal-length engine prefill of new sessions equals a batch of them",
                   "[session_pool]", float) {
  using T = TestType;
  using Batch = RecurrentStateBatch<T>;
  SessionPool<Batch> pool(1, decay_layer<T>());
  for (Key key : {10, 20, 30}) pool.add(key);
  const Eigen::Index B = 2, H = 3, N = 70;
  std::vector<T> qd(static_cast<std::size_t>(B * H * N * kDk)), kd(qd.size()),
      vd(static_cast<std::size_t>(B * H * N * kDv));
  std::mt19937_64 random(5);
  std::normal_distribution<double> normal;
  for (T& x : qd) x = static_cast<T>(normal(random));
  for (T& x : kd) x = static_cast<T>(normal(random));
  for (T& x : vd) x = static_cast<T>(normal(random));
  const auto q = HeadsView<const T>::bhnd(qd.data(), {B, H, N, kDk});
  const auto k = HeadsView<const T>::bhnd(kd.data(), {B, H, N, kDk});
  const auto v = HeadsView<const T>::bhnd(vd.data(), {B, H, N, kDv});
  std::vector<T> got(vd.size()), want(vd.size());
  Batch reference(B * H, kDk, kDv, linattn::HeadDecays{{0.9, 0.97, 1.0}});
  reference.prefill_into(q, k, v, linattn::EluPlusOne{},
                         HeadsView<T>::bhnd(want.data(), {B, H, N, kDv}));
  const auto before = addresses(pool);
  pool.prefill_into(0, {30, 10}, q, k, v, linattn::EluPlusOne{},
                    HeadsView<T>::bhnd(got.data(), {B, H, N, kDv}));
  CHECK(got == want);
  int differing = 0;
  for (Eigen::Index h = 0; h < H; ++h) {
    differing += same_state(pool.state(30, 0, h), reference[h]) ? 0 : 1;
    differing += same_state(pool.state(10, 0, h), reference[H + h]) ? 0 : 1;
    differing += pool.state(20, 0, h).tokens() == 0 ? 0 : 1;
    differing += memory_of(pool.state(20, 0, h)) == before.at({20, 0, h}) ? 0 : 1;
  }
  CHECK(differing == 0);
}

TEMPLATE_TEST_CASE("pool: a session saved and loaded continues bit for bit", "[session_pool][io]",
                   float, double) {
  using T = TestType;
  using Batch = RecurrentStateBatch<T>;
  SessionPool<Batch> pool(decay_layer<T>(), gated_layer<T>());
  pool.add(1);
  pool.add(2);
  for (std::uint64_t t = 0; t < 6; ++t) {
    const Matrix<T> q = gaussian<T>(6, kDk, 40 + t), k = gaussian<T>(6, kDk, 50 + t);
    const Matrix<T> v = gaussian<T>(6, kDv, 60 + t);
    pool.step(0, q, k, v, linattn::EluPlusOne{});
  }
  std::stringstream saved;
  pool.save(1, 0, saved, linattn::EluPlusOne{});
  pool.save(1, 1, saved, linattn::Identity{});  // never stepped: its fresh states
  pool.add(3);
  pool.load(3, 0, saved, linattn::EluPlusOne{});
  pool.load(3, 1, saved, linattn::Identity{});
  int differing = 0;
  for (Eigen::Index h = 0; h < 3; ++h)
    differing += same_state(pool.state(1, 0, h), pool.state(3, 0, h)) ? 0 : 1;
  for (Eigen::Index h = 0; h < 2; ++h)
    differing += same_state(pool.state(1, 1, h), pool.state(3, 1, h)) ? 0 : 1;
  CHECK(differing == 0);
  // Sessions 1 and 3 take the same token and give the same outputs.
  const Matrix<T> q = gaussian<T>(3, kDk, 70), k = gaussian<T>(3, kDk, 71),
                  v = gaussian<T>(3, kDv, 72);
  Matrix<T> qs(9, kDk), ks(9, kDk), vs(9, kDv);
  qs << q, gaussian<T>(3, kDk, 73), q;
  ks << k, gaussian<T>(3, kDk, 74), k;
  vs << v, gaussian<T>(3, kDv, 75), v;
  const Matrix<T> out = pool.step(0, qs, ks, vs, linattn::EluPlusOne{});
  CHECK(out.topRows(3) == out.bottomRows(3));
  // A layer's stream loaded into another layer (other heads' options) is refused whole.
  std::stringstream layer0;
  pool.save(2, 0, layer0, linattn::EluPlusOne{});
  const auto before = pool.state(3, 1, 0).s();
  CHECK_THROWS_AS(pool.load(3, 1, layer0, linattn::Identity{}), linattn::Error);
  CHECK(pool.state(3, 1, 0).s() == before);
  // A truncated stream is refused and changes nothing.
  std::stringstream full;
  pool.save(2, 0, full, linattn::EluPlusOne{});
  std::stringstream cut(full.str().substr(0, full.str().size() - 3));
  const auto s3 = pool.state(3, 0, 2).s();
  CHECK_THROWS_AS(pool.load(3, 0, cut, linattn::EluPlusOne{}), linattn::Error);
  CHECK(pool.state(3, 0, 2).s() == s3);
}

TEMPLATE_TEST_CASE("pool errors name what was wrong and change nothing", "[session_pool][errors]",
                   float) {
  using T = TestType;
  using Batch = RecurrentStateBatch<T>;
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(
      SessionPool<Batch>(std::vector<linattn::LinearAttentionLayer<T, linattn::Identity>>{}),
      Contains("no layers"));
  CHECK_THROWS_WITH(SessionPool<Batch>(0, decay_layer<T>()), Contains("layers"));
  SessionPool<Batch> pool(1, decay_layer<T>());
  const Matrix<T> q = gaussian<T>(6, kDk, 1), k = gaussian<T>(6, kDk, 2),
                  v = gaussian<T>(6, kDv, 3);
  Matrix<T> out(6, kDv);
  CHECK_THROWS_WITH(pool.step_into(0, q, k, v, linattn::EluPlusOne{}, out),
                    Contains("no live session"));
  pool.add(7);
  pool.add(8);
  CHECK_THROWS_WITH(pool.add(7), Contains("session 7 is already live"));
  CHECK(pool.size() == 2);
  CHECK_THROWS_WITH(pool.drop(9), Contains("no live session 9"));
  CHECK_THROWS_WITH(pool.position(9), Contains("no live session 9"));
  CHECK_THROWS_WITH(pool.state(7, 1, 0), Contains("layer 1"));
  CHECK_THROWS_WITH(pool.state(7, 0, 3), Contains("head 3"));
  CHECK_THROWS_WITH(pool.step_into(2, q, k, v, linattn::EluPlusOne{}, out), Contains("layer 2"));
  CHECK_THROWS_WITH(pool.reorder({8, 8}), Contains("twice"));
  CHECK_THROWS_WITH(pool.reorder({8}), Contains("each live session once"));
  CHECK_THROWS_WITH(pool.reorder({8, 9}), Contains("no live session 9"));
  CHECK(pool.keys() == std::vector<Key>{7, 8});
  pool.step_into(0, q, k, v, linattn::EluPlusOne{}, out);
  const auto before = addresses(pool);
  std::vector<RecurrentState<T>> kept;
  for (Key key : {7, 8}) {
    for (Eigen::Index h = 0; h < 3; ++h) kept.push_back(pool.state(key, 0, h));
  }
  auto unchanged = [&] {
    int differing = 0;
    std::size_t i = 0;
    for (Key key : {7, 8}) {
      for (Eigen::Index h = 0; h < 3; ++h, ++i) {
        differing += same_state(pool.state(key, 0, h), kept[i]) ? 0 : 1;
        differing += memory_of(pool.state(key, 0, h)) == before.at({key, 0, h}) ? 0 : 1;
      }
    }
    return differing;
  };
  // A step whose last row holds a NaN, a step with too few rows: nothing moves.
  Matrix<T> bad = v;
  bad(5, 0) = std::numeric_limits<T>::quiet_NaN();
  CHECK_THROWS_AS(pool.step_into(0, q, k, bad, linattn::EluPlusOne{}, out), linattn::Error);
  CHECK_THROWS_WITH(
      pool.step_into(0, q.topRows(4), k.topRows(4), v.topRows(4), linattn::EluPlusOne{}, out),
      Contains("4 x 6"));
  CHECK(unchanged() == 0);
  // A prefill with a view of the wrong width, and one naming an unknown or repeated session.
  std::vector<T> data(static_cast<std::size_t>(3 * 4 * kDk)),
      vdata(static_cast<std::size_t>(3 * 4 * kDv));
  const auto qv = HeadsView<const T>::bhnd(data.data(), {1, 3, 4, kDk});
  const auto vv = HeadsView<const T>::bhnd(vdata.data(), {1, 3, 4, kDv});
  std::vector<T> od(vdata.size());
  const auto ov = HeadsView<T>::bhnd(od.data(), {1, 3, 4, kDv});
  CHECK_THROWS_AS(pool.prefill_into(0, {8}, qv, qv, qv, linattn::EluPlusOne{}, ov), linattn::Error);
  CHECK_THROWS_WITH(pool.prefill_into(0, {8, 8}, qv, qv, vv, linattn::EluPlusOne{}, ov),
                    Contains("twice"));
  CHECK_THROWS_WITH(pool.prefill_into(0, {9}, qv, qv, vv, linattn::EluPlusOne{}, ov),
                    Contains("no live session 9"));
  CHECK_THROWS_WITH(pool.prefill_into(0, {}, qv, qv, vv, linattn::EluPlusOne{}, ov),
                    Contains("empty"));
  CHECK(unchanged() == 0);
  CHECK(pool.keys() == std::vector<Key>{7, 8});
  // The pool still works after every refusal.
  pool.prefill_into(0, {8}, qv, qv, vv, linattn::EluPlusOne{}, ov);
  CHECK(pool.state(8, 0, 0).tokens() == 5);
  CHECK(pool.state(7, 0, 0).tokens() == 1);
  pool.reset(8);
  CHECK(pool.state(8, 0, 1).tokens() == 0);
}

TEMPLATE_TEST_CASE("pool: a packed engine prefill of some sessions equals a batch of them",
                   "[session_pool][varlen]", float, double) {
  using T = TestType;
  using Batch = RecurrentStateBatch<T>;
  SessionPool<Batch> pool(gated_layer<T>());
  for (Key key : {10, 20, 30}) pool.add(key);
  // Every session steps once; then prompts of 4 tokens for 20 and 9 for 10, in that order.
  const Matrix<T> q0 = gaussian<T>(6, kDk, 11).cwiseAbs(), k0 = gaussian<T>(6, kDk, 12).cwiseAbs();
  const Matrix<T> g0 = (-0.2 * gaussian<T>(6, 1, 13).array().abs()).matrix();
  pool.step(0, q0, k0, gaussian<T>(6, kDv, 14), linattn::log_gates(g0), linattn::Identity{});
  const std::vector<std::int64_t> offsets = {0, 4, 13};
  const Eigen::Index H = 2, tokens = offsets.back();
  std::vector<T> qd(static_cast<std::size_t>(H * tokens * kDk)), kd(qd.size()),
      vd(static_cast<std::size_t>(H * tokens * kDv)), gd(static_cast<std::size_t>(H * tokens));
  std::mt19937_64 random(15);
  std::normal_distribution<double> normal;
  for (T& x : qd) x = static_cast<T>(std::abs(normal(random)));
  for (T& x : kd) x = static_cast<T>(std::abs(normal(random)));
  for (T& x : vd) x = static_cast<T>(normal(random));
  for (T& x : gd) x = static_cast<T>(-0.2 * std::abs(normal(random)));
  const auto q = HeadsView<const T>::bnhd(qd.data(), linattn::BnhdShape{1, tokens, H, kDk});
  const auto k = HeadsView<const T>::bnhd(kd.data(), linattn::BnhdShape{1, tokens, H, kDk});
  const auto v = HeadsView<const T>::bnhd(vd.data(), linattn::BnhdShape{1, tokens, H, kDv});
  const auto g = HeadsView<const T>::bnhd(gd.data(), linattn::BnhdShape{1, tokens, H, 1});
  Batch reference(2 * H, kDk, kDv, gated_layer<T>().options());
  for (Eigen::Index h = 0; h < H; ++h) {
    reference[h] = pool.state(20, 0, h);
    reference[H + h] = pool.state(10, 0, h);
  }
  std::vector<T> got(vd.size()), want(vd.size());
  reference.prefill_varlen_into(
      q, k, v, linattn::log_gates(g), linattn::Identity{}, offsets,
      HeadsView<T>::bnhd(want.data(), linattn::BnhdShape{1, tokens, H, kDv}));
  const auto before = addresses(pool);
  const RecurrentState<T> untouched = pool.state(30, 0, 1);
  pool.prefill_varlen_into(0, {20, 10}, q, k, v, linattn::log_gates(g), linattn::Identity{},
                           offsets,
                           HeadsView<T>::bnhd(got.data(), linattn::BnhdShape{1, tokens, H, kDv}));
  CHECK(got == want);
  int differing = 0;
  for (Eigen::Index h = 0; h < H; ++h) {
    differing += same_state(pool.state(20, 0, h), reference[h]) ? 0 : 1;
    differing += same_state(pool.state(10, 0, h), reference[H + h]) ? 0 : 1;
    differing += memory_of(pool.state(30, 0, h)) == before.at({30, 0, h}) ? 0 : 1;
  }
  CHECK(differing == 0);
  CHECK(same_state(pool.state(30, 0, 1), untouched));
  CHECK(pool.state(10, 0, 0).tokens() == 10);
  CHECK(pool.state(20, 0, 0).tokens() == 5);
  CHECK(pool.state(30, 0, 0).tokens() == 1);
}

TEMPLATE_TEST_CASE("pool: a whole session as one blob, added back in place or refused whole",
                   "[session_pool][io]", float, double) {
  using T = TestType;
  using Batch = RecurrentStateBatch<T>;
  using Catch::Matchers::Contains;
  SessionPool<Batch> pool(2, decay_layer<T>());
  pool.add(1);
  for (std::uint64_t t = 0; t < 4; ++t) {
    for (Eigen::Index l = 0; l < 2; ++l) {
      pool.step(l, gaussian<T>(3, kDk, 80 + t), gaussian<T>(3, kDk, 90 + t),
                gaussian<T>(3, kDv, 100 + t), linattn::EluPlusOne{});
    }
  }
  const std::vector<std::uint8_t> blob = pool.save_bytes(1, linattn::EluPlusOne{});
  std::stringstream stream;
  pool.save(1, stream, linattn::EluPlusOne{});
  CHECK(stream.str() == std::string(blob.begin(), blob.end()));
  // Another server (a fresh pool of the same model) takes the session from the blob.
  SessionPool<Batch> other(2, decay_layer<T>());
  other.add(5);
  CHECK(other.add_bytes(1, blob.data(), blob.size(), linattn::EluPlusOne{}) == 1);
  SessionPool<Batch> third(2, decay_layer<T>());
  CHECK(third.add(1, stream, linattn::EluPlusOne{}) == 0);
  int differing = 0;
  for (Eigen::Index l = 0; l < 2; ++l) {
    for (Eigen::Index h = 0; h < 3; ++h) {
      differing += same_state(other.state(1, l, h), pool.state(1, l, h)) ? 0 : 1;
      differing += same_state(third.state(1, l, h), pool.state(1, l, h)) ? 0 : 1;
    }
  }
  CHECK(differing == 0);
  // It steps on as the original, bit for bit, through the named-session step.
  const Matrix<T> q = gaussian<T>(3, kDk, 110), k = gaussian<T>(3, kDk, 111);
  const Matrix<T> v = gaussian<T>(3, kDv, 112);
  Matrix<T> a(3, kDv), b(3, kDv);
  pool.step_into(0, q, k, v, linattn::EluPlusOne{}, a);
  other.step_sessions_into(0, {1}, q, k, v, linattn::EluPlusOne{}, b);
  CHECK(a == b);
  CHECK(other.state(5, 0, 0).tokens() == 0);  // the session not named did not move
  // Refused whole, nothing added: a byte more, a byte less, a flipped byte, another model.
  std::vector<std::uint8_t> longer = blob;
  longer.push_back(0);
  CHECK_THROWS_WITH(third.add_bytes(2, longer.data(), longer.size(), linattn::EluPlusOne{}),
                    Contains("1 bytes after"));
  CHECK_THROWS_AS(third.add_bytes(2, blob.data(), blob.size() - 1, linattn::EluPlusOne{}),
                  linattn::Error);
  std::vector<std::uint8_t> flipped = blob;
  flipped[blob.size() / 2] ^= 0x10;
  CHECK_THROWS_AS(third.add_bytes(2, flipped.data(), flipped.size(), linattn::EluPlusOne{}),
                  linattn::Error);
  SessionPool<Batch> gated(decay_layer<T>(), gated_layer<T>());
  CHECK_THROWS_AS(gated.add_bytes(2, blob.data(), blob.size(), linattn::EluPlusOne{}),
                  linattn::Error);
  CHECK_THROWS_WITH(third.add_bytes(1, blob.data(), blob.size(), linattn::EluPlusOne{}),
                    Contains("already live"));
  CHECK(third.keys() == std::vector<Key>{1});
  CHECK(gated.size() == 0);
  CHECK_FALSE(third.contains(2));
}

TEMPLATE_TEST_CASE("pool: a step of named sessions moves only them", "[session_pool]", float) {
  using T = TestType;
  using Batch = DeltaRuleStateBatch<T>;
  using State = DeltaRuleState<T>;
  DeltaOptions options;
  options.l2_normalize = true;
  SessionPool<Batch> pool(1, linattn::DeltaRuleLayer<T>(2, kDk, kDv, options));
  for (Key key : {4, 5, 6}) pool.add(key);
  const State fresh(kDk, kDv, options);
  std::map<Key, std::vector<State>> alone;
  for (Key key : {4, 5, 6}) alone[key] = std::vector<State>(2, fresh);
  int differing = 0;
  for (std::uint64_t t = 0; t < 5; ++t) {
    // Sessions 6 and 4 (in that order) take a token; session 5 waits.
    const Matrix<T> q = gaussian<T>(4, kDk, 120 + t), k = gaussian<T>(4, kDk, 130 + t);
    const Matrix<T> v = gaussian<T>(4, kDv, 140 + t);
    const Vector<T> beta = Vector<T>::Constant(4, T(0.5));
    Matrix<T> out(4, kDv);
    pool.step_sessions_into(0, {6, 4}, q, k, v, beta, out);
    const Key order[2] = {6, 4};
    for (Eigen::Index r = 0; r < 4; ++r) {
      const Vector<T> want = alone[order[r / 2]][static_cast<std::size_t>(r % 2)].step(
          q.row(r), k.row(r), v.row(r), T(0.5));
      differing += out.row(r).transpose() == want ? 0 : 1;
    }
  }
  CHECK(differing == 0);
  for (Key key : {4, 5, 6}) {
    for (Eigen::Index h = 0; h < 2; ++h) {
      CHECK(same_state(pool.state(key, 0, h), alone[key][static_cast<std::size_t>(h)]));
    }
  }
  CHECK(pool.state(5, 0, 1).tokens() == 0);
  CHECK(pool.state(4, 0, 1).tokens() == 5);
}

TEST_CASE("a pool is made from its layers: every session runs with its layer's options",
          "[session_pool]") {
  // A pool of hand-made batches could hold states without the layer's l2_normalize and ran
  // them silently (3e7 relative error); it no longer compiles (compile_fail
  // session_pool_from_batches), and a pool from the layers holds what they would make.
  using T = float;
  DeltaOptions options;
  options.l2_normalize = true;
  options.scale = 0.5;
  const linattn::DeltaRuleLayer<T> layer(2, kDk, kDv, options);
  SessionPool pool(layer, layer);
  static_assert(std::is_same_v<decltype(pool), SessionPool<DeltaRuleStateBatch<T>>>);
  pool.add(7);
  for (Eigen::Index l = 0; l < 2; ++l) {
    for (Eigen::Index h = 0; h < 2; ++h) {
      CHECK(pool.state(7, l, h).options().l2_normalize);
      CHECK(pool.state(7, l, h).options().scale == 0.5);
    }
  }
  // Its steps are the layer's own steps on the states it makes, bit for bit.
  const Matrix<T> q = gaussian<T>(2, kDk, 90), k = gaussian<T>(2, kDk, 91);
  const Matrix<T> v = gaussian<T>(2, kDv, 92);
  const Vector<T> beta = Vector<T>::Constant(2, T(0.5));
  auto states = layer.make_states(1);
  Matrix<T> want(2, kDv);
  layer.step_into(states, q, k, v, beta, want);
  CHECK(pool.step(0, q, k, v, beta) == want);
}

// --- SessionPool<>: a hybrid model's layers of every kind ---

namespace {

using linattn::ConstHeadsView;
using linattn::HeadStrides;
using linattn::SessionStorage;
using HybridPool = SessionPool<>;
using F = float;

/// A small model with one layer of every kind a pool holds, and each layer's token rows:
///   0 Qwen3.5 Gated DeltaNet  [qkv | z | b | a]      1 softmax KV caches  [q | k | v]
///   2 Mamba-2                 [z | xBC | dt]         3 LFM2 gated conv    [b | c | x]
///   4 linear attention, elu   [q | k | v]            5 DeltaNet           [q | k | v | b]
struct Hybrid {
  static constexpr Eigen::Index kLayers = 6, kH = 2, kD = 4;

  static linattn::GatedDeltaNetShape gdn_shape() {
    linattn::GatedDeltaNetShape shape;
    shape.key_heads = 2;
    shape.value_heads = 4;
    shape.key_dim = 8;
    shape.value_dim = 8;
    shape.conv_kernel = 4;
    return shape;
  }
  static linattn::GatedDeltaNetWeights<F> gdn_weights() {
    const auto shape = gdn_shape();
    linattn::GatedDeltaNetWeights<F> w;
    w.conv_weight = gaussian<F>(shape.conv_channels(), shape.conv_kernel, 1, 0.5);
    w.a_log = gaussian<F>(shape.value_heads, 1, 2, 0.5, 0.5);
    w.dt_bias = gaussian<F>(shape.value_heads, 1, 3, 0.5, 1.0);
    w.norm_weight = gaussian<F>(shape.value_dim, 1, 4, 0.2, 1.0);
    return w;
  }
  static linattn::Mamba2Shape mamba_shape() {
    linattn::Mamba2Shape shape;
    shape.heads = 4;
    shape.head_dim = 4;
    shape.groups = 2;
    shape.state_dim = 6;
    shape.conv_kernel = 4;
    return shape;
  }
  static linattn::Mamba2Weights<F> mamba_weights() {
    const auto shape = mamba_shape();
    linattn::Mamba2Weights<F> w;
    w.conv_weight = gaussian<F>(shape.conv_channels(), shape.conv_kernel, 5, 0.5);
    w.conv_bias = gaussian<F>(shape.conv_channels(), 1, 6, 0.2);
    w.a_log = gaussian<F>(shape.heads, 1, 7, 0.5, 1.0);
    w.dt_bias = gaussian<F>(shape.heads, 1, 8, 0.5, -2.0);
    w.d = gaussian<F>(shape.heads, 1, 9, 0.3, 1.0);
    w.norm_weight = gaussian<F>(shape.inner(), 1, 10, 0.2, 1.0);
    return w;
  }
  static linattn::HeadDecays decays() {
    linattn::HeadDecays d;
    d.values = {0.9, 0.99};
    return d;
  }
  static DeltaOptions delta_options() {
    DeltaOptions options;
    options.l2_normalize = true;
    return options;
  }

  linattn::GatedDeltaNet<F> gdn{gdn_shape(), gdn_weights()};
  linattn::KVCacheBatch<F> attention{1, kH, kD, kD};
  linattn::Mamba2<F> mamba{mamba_shape(), mamba_weights()};
  linattn::GatedShortConv<F> conv{gaussian<F>(8, 3, 11, 0.5), gaussian<F>(8, 1, 12, 0.2)};
  linattn::LinearAttentionLayer<F, linattn::EluPlusOne> linear{linattn::EluPlusOne{}, kH, kD, kD,
                                                               decays()};
  linattn::DeltaRuleLayer<F> delta{kH, kD, kD, delta_options()};

  HybridPool make_pool() const { return HybridPool(gdn, attention, mamba, conv, linear, delta); }

  /// The width of layer l's token row.
  Eigen::Index width(Eigen::Index l) const {
    const auto g = gdn_shape();
    const auto m = mamba_shape();
    const Eigen::Index widths[kLayers] = {
        g.conv_channels() + g.value_channels() + 2 * g.value_heads,
        3 * kH * kD,
        m.inner() + m.conv_channels() + m.heads,
        3 * 8,
        3 * kH * kD,
        3 * kH * kD + kH};
    return widths[l];
  }
  /// Session `key`'s row for layer l at token t: anyone can replay it.
  Matrix<F> row(Key key, Eigen::Index l, std::int64_t t) const {
    return gaussian<F>(1, width(l), static_cast<std::uint64_t>(key * 100000 + t * 10 + l));
  }

  /// One token of B sequences through the layer of `states`' kind (rows: B x its width).
  template <class States>
  Matrix<F> step(States& states, const Matrix<F>& rows) const {
    const Eigen::Index b = rows.rows(), w = rows.cols();
    const auto view = [&](Eigen::Index column, Eigen::Index heads, Eigen::Index dim) {
      return ConstHeadsView<F>(rows.data() + column, b, heads, 1, dim, HeadStrides{w, dim, w, 1});
    };
    const auto out_view = [&](Matrix<F>& out, Eigen::Index heads, Eigen::Index dim) {
      return HeadsView<F>(out.data(), b, heads, 1, dim,
                          HeadStrides{heads * dim, dim, heads * dim, 1});
    };
    /// Rows b * H + h of head h's D columns starting at `column`.
    const auto heads_of = [&](Eigen::Index column) {
      Matrix<F> m(b * kH, kD);
      for (Eigen::Index s = 0; s < b; ++s)
        for (Eigen::Index h = 0; h < kH; ++h)
          m.row(s * kH + h) = rows.block(s, column + h * kD, 1, kD);
      return m;
    };
    if constexpr (std::is_same_v<States, linattn::GatedDeltaNetStates<F>>) {
      const auto g = gdn_shape();
      const Eigen::Index c = g.conv_channels(), hv = g.value_heads;
      Matrix<F> out(b, g.value_channels());
      gdn.step_into(states,
                    {view(0, 1, c), view(c, hv, g.value_dim), view(c + g.value_channels(), hv, 1),
                     view(c + g.value_channels() + hv, hv, 1)},
                    out_view(out, hv, g.value_dim));
      return out;
    } else if constexpr (std::is_same_v<States, linattn::KVCacheBatch<F>>) {
      Matrix<F> out(b, kH * kD);
      for (Eigen::Index s = 0; s < b; ++s) {
        for (Eigen::Index h = 0; h < kH; ++h) {
          linattn::Vector<F> o(kD);
          states.cache(s, h).step_into(rows.block(s, h * kD, 1, kD),
                                       rows.block(s, kH * kD + h * kD, 1, kD),
                                       rows.block(s, 2 * kH * kD + h * kD, 1, kD), o);
          out.block(s, h * kD, 1, kD) = o.transpose();
        }
      }
      return out;
    } else if constexpr (std::is_same_v<States, linattn::Mamba2States<F>>) {
      const auto m = mamba_shape();
      Matrix<F> out(b, m.inner());
      mamba.step_into(states,
                      {view(0, m.heads, m.head_dim), view(m.inner(), 1, m.conv_channels()),
                       view(m.inner() + m.conv_channels(), m.heads, 1)},
                      out_view(out, m.heads, m.head_dim));
      return out;
    } else if constexpr (std::is_same_v<States, linattn::ConvWindows<F>>) {
      Matrix<F> out(b, 8);
      conv.step_into(states, view(0, 1, 24), out_view(out, 1, 8));
      return out;
    } else if constexpr (std::is_same_v<States, RecurrentStateBatch<F>>) {
      Matrix<F> out(b * kH, kD);
      linear.step_into(states, heads_of(0), heads_of(kH * kD), heads_of(2 * kH * kD), out);
      return out;
    } else {
      Matrix<F> out(b * kH, kD);
      Vector<F> beta(b * kH);
      for (Eigen::Index s = 0; s < b; ++s)
        for (Eigen::Index h = 0; h < kH; ++h)
          beta(s * kH + h) = F(1) / (F(1) + std::exp(-rows(s, 3 * kH * kD + h)));
      delta.step_into(states, heads_of(0), heads_of(kH * kD), heads_of(2 * kH * kD), beta, out);
      return out;
    }
  }

  /// Calls f(l, States-typed tag) for each layer with its kind.
  template <class F2>
  void for_each_layer(const F2& f) const {
    f(0, gdn.make_states(1));
    f(1, attention.make_states(1));
    f(2, mamba.make_states(1));
    f(3, conv.make_states(1));
    f(4, linear.make_states(1));
    f(5, delta.make_states(1));
  }
};

/// A session run alone: its own states of every layer and its token count.
struct Alone {
  linattn::GatedDeltaNetStates<F> gdn;
  linattn::KVCacheBatch<F> attention;
  linattn::Mamba2States<F> mamba;
  linattn::ConvWindows<F> conv;
  RecurrentStateBatch<F> linear;
  DeltaRuleStateBatch<F> delta;
  std::int64_t tokens = 0;

  explicit Alone(const Hybrid& m)
      : gdn(m.gdn.make_states(1)),
        attention(m.attention.make_states(1)),
        mamba(m.mamba.make_states(1)),
        conv(m.conv.make_states(1)),
        linear(m.linear.make_states(1)),
        delta(m.delta.make_states(1)) {}

  template <class G>
  void each(const G& g) {
    g(0, gdn);
    g(1, attention);
    g(2, mamba);
    g(3, conv);
    g(4, linear);
    g(5, delta);
  }
};

/// One decoding step of every live session of the pool, every layer, checked bit for bit
/// against each session stepped alone.
void step_all(const Hybrid& model, HybridPool& pool, std::map<Key, Alone>& alone) {
  const std::vector<Key> keys = pool.keys();
  const auto b = static_cast<Eigen::Index>(keys.size());
  Alone& any = alone.at(keys.front());
  any.each([&](Eigen::Index l, auto& tag) {
    using States = std::decay_t<decltype(tag)>;
    Matrix<F> rows(b, model.width(l));
    for (Eigen::Index s = 0; s < b; ++s)
      rows.row(s) = model.row(keys[s], l, alone.at(keys[s]).tokens);
    Matrix<F> pooled;
    pool.lend_live<States>(l, [&](States& states) { pooled = model.step(states, rows); });
    const Eigen::Index per = pooled.rows() / b;
    for (Eigen::Index s = 0; s < b; ++s) {
      Alone& mine = alone.at(keys[s]);
      States* own = nullptr;
      mine.each([&](Eigen::Index ll, auto& st) {
        if constexpr (std::is_same_v<std::decay_t<decltype(st)>, States>) {
          if (ll == l) own = &st;
        }
      });
      const Matrix<F> want = model.step(*own, Matrix<F>(rows.row(s)));
      CAPTURE(l, keys[s]);
      CHECK(pooled.middleRows(s * per, per) == want);
    }
  });
  for (Key key : keys) ++alone.at(key).tokens;
}

}  // namespace

TEST_CASE(
    "hybrid pool: every layer kind steps as each session alone, across adds, drops, "
    "reorders and blobs",
    "[session_pool][hybrid]") {
  const Hybrid model;
  HybridPool pool = model.make_pool();
  SessionPool deduced(model.gdn, model.attention, model.mamba);
  static_assert(std::is_same_v<decltype(deduced), HybridPool>);
  // Layer by layer (a model held in vectors): the same pool.
  HybridPool built;
  CHECK_THROWS_WITH(built.add(1), Catch::Matchers::Contains("no layers"));
  built.add_layer(model.gdn);
  built.add_layer(model.attention);
  built.add_layer(model.mamba);
  built.add_layer(model.conv);
  built.add_layer(model.linear);
  CHECK(built.add_layer(model.delta) == 5);
  built.add(1);
  CHECK_THROWS_WITH(built.add_layer(model.conv), Catch::Matchers::Contains("1 sessions are live"));
  REQUIRE(pool.layers() == Hybrid::kLayers);
  std::map<Key, Alone> alone;
  for (Key key : {5, 9, 2}) {
    pool.add(key);
    alone.emplace(key, Alone(model));
  }
  for (int t = 0; t < 3; ++t) step_all(model, pool, alone);
  pool.reorder({9, 2, 5});  // a 3-cycle: every part moves in place
  step_all(model, pool, alone);
  pool.drop(9);
  alone.erase(9);
  pool.reorder({2, 5});
  pool.add(11);
  alone.emplace(11, Alone(model));
  for (int t = 0; t < 2; ++t) step_all(model, pool, alone);

  // Session 5 as one blob: added back under a new key it continues bit for bit, in place.
  const std::vector<std::uint8_t> blob = pool.save_bytes(5);
  built.add_bytes(5, blob);
  CHECK(built.save_bytes(5) == blob);
  pool.add_bytes(40, blob);
  alone.emplace(40, alone.at(5));  // session 40 starts where 5 is: from its copy
  for (int t = 0; t < 3; ++t) step_all(model, pool, alone);
  // The blob saved again holds what the pool holds: bit for bit the same bytes.
  CHECK(pool.save_bytes(40) != blob);
  HybridPool other = model.make_pool();
  other.add_bytes(40, pool.save_bytes(40));
  CHECK(other.save_bytes(40) == pool.save_bytes(40));
}

TEST_CASE("hybrid pool: a blob truncated, flipped or of another model is refused whole",
          "[session_pool][hybrid][errors]") {
  using Catch::Matchers::Contains;
  const Hybrid model;
  HybridPool pool = model.make_pool();
  std::map<Key, Alone> alone;
  pool.add(1);
  alone.emplace(1, Alone(model));
  for (int t = 0; t < 4; ++t) step_all(model, pool, alone);
  for (SessionStorage storage :
       {SessionStorage::exact, SessionStorage::bf16, SessionStorage::int8}) {
    CAPTURE(linattn::session_storage_name(storage));
    const std::vector<std::uint8_t> blob = pool.save_bytes(1, storage);
    HybridPool target = model.make_pool();
    // Every cut and 200 single-bit flips: an Error each, and the pool as it was.
    for (std::size_t cut = 0; cut < blob.size(); cut += 1 + cut / 16) {
      CHECK_THROWS_AS(target.add_bytes(2, blob.data(), cut), linattn::Error);
    }
    std::mt19937_64 engine(7);
    for (int flip = 0; flip < 200; ++flip) {
      std::vector<std::uint8_t> bad = blob;
      bad[engine() % bad.size()] ^= static_cast<std::uint8_t>(1u << (engine() % 8));
      CHECK_THROWS_AS(target.add_bytes(2, bad), linattn::Error);
    }
    std::vector<std::uint8_t> longer = blob;
    longer.push_back(0);
    CHECK_THROWS_WITH(target.add_bytes(2, longer), Contains("1 bytes after the session"));
    CHECK(target.size() == 0);
    target.add_bytes(2, blob);
    CHECK(target.size() == 1);
  }
  const std::vector<std::uint8_t> blob = pool.save_bytes(1);
  // Another model shape: a pool whose Gated DeltaNet has more value heads, or layers in
  // another order, or fewer of them.
  linattn::GatedDeltaNetShape wider = Hybrid::gdn_shape();
  wider.value_heads = 8;
  linattn::GatedDeltaNetWeights<F> wider_weights = Hybrid::gdn_weights();
  wider_weights.conv_weight = gaussian<F>(wider.conv_channels(), 4, 1, 0.5);
  wider_weights.a_log = gaussian<F>(8, 1, 2, 0.5, 0.5);
  wider_weights.dt_bias = gaussian<F>(8, 1, 3, 0.5, 1.0);
  const linattn::GatedDeltaNet<F> wider_gdn(wider, wider_weights);
  HybridPool other(wider_gdn, model.attention, model.mamba, model.conv, model.linear, model.delta);
  CHECK_THROWS_WITH(other.add_bytes(1, blob), Contains("another model shape"));
  HybridPool swapped(model.attention, model.gdn, model.mamba, model.conv, model.linear,
                     model.delta);
  CHECK_THROWS_WITH(swapped.add_bytes(1, blob), Contains("a session of another model"));
  HybridPool shorter(model.gdn, model.attention);
  CHECK_THROWS_WITH(shorter.add_bytes(1, blob), Contains("layer count is 6"));
  // Another feature map's linear states: the map is recorded and checked.
  const linattn::LinearAttentionLayer<F, linattn::Identity> identity(linattn::Identity{}, 2, 4, 4,
                                                                     Hybrid::decays());
  HybridPool mapped(model.gdn, model.attention, model.mamba, model.conv, identity, model.delta);
  CHECK_THROWS_WITH(mapped.add_bytes(1, blob), Contains("map"));
  // A single state's bytes, a live key, a layer of another kind.
  CHECK_THROWS_WITH(
      pool.add_bytes(3, linattn::save_bytes(pool.states<RecurrentStateBatch<F>>(1, 4)[0],
                                            linattn::EluPlusOne{})),
      Contains("one state, not a session blob"));
  CHECK_THROWS_WITH(pool.add_bytes(1, blob), Contains("session 1 is already live"));
  CHECK_THROWS_WITH(pool.lend_live<RecurrentStateBatch<F>>(0, [](auto&) {}),
                    Contains("layer 0 holds GatedDeltaNetStates"));
  CHECK_THROWS_WITH(pool.states<linattn::ConvWindows<F>>(1, 7), Contains("layer 7"));
  CHECK_THROWS_WITH(pool.lend<linattn::ConvWindows<F>>(3, {1, 1}, [](auto&) {}),
                    Contains("names session 1 twice"));
  CHECK(pool.size() == 1);
}

TEST_CASE("hybrid pool: bf16 and int8 storage round each number once, within their bounds",
          "[session_pool][hybrid][storage]") {
  const Hybrid model;
  HybridPool pool = model.make_pool();
  std::map<Key, Alone> alone;
  pool.add(1);
  alone.emplace(1, Alone(model));
  for (int t = 0; t < 6; ++t) step_all(model, pool, alone);
  const std::size_t exact = pool.save_bytes(1).size();
  // Rows of S: each number of a bf16 row within 2^-8 of it relative; of an int8 row within half
  // a step, max |row| / 254.
  const auto check_rows = [](const Matrix<F>& saved, const Matrix<F>& loaded, bool int8) {
    for (Eigen::Index r = 0; r < saved.rows(); ++r) {
      const double top = saved.row(r).cwiseAbs().maxCoeff();
      for (Eigen::Index c = 0; c < saved.cols(); ++c) {
        const double error = std::abs(double(loaded(r, c)) - double(saved(r, c)));
        const double bound = int8 ? top / 254.0 * (1 + 1e-6) : std::abs(saved(r, c)) * 0x1p-8;
        CHECK(error <= bound);
      }
    }
  };
  for (SessionStorage storage : {SessionStorage::bf16, SessionStorage::int8}) {
    const bool int8 = storage == SessionStorage::int8;
    const std::vector<std::uint8_t> blob = pool.save_bytes(1, storage);
    // The numbers take 2 or 1 bytes in place of 4 (int8: plus a scale per row); this small
    // model's settings and counts are a third of its exact blob.
    CHECK(blob.size() < (int8 ? exact * 6 / 10 : exact * 7 / 10));
    HybridPool loaded = model.make_pool();
    loaded.add_bytes(1, blob);
    const auto& gdn = pool.states<linattn::GatedDeltaNetStates<F>>(1, 0);
    const auto& gdn_loaded = loaded.states<linattn::GatedDeltaNetStates<F>>(1, 0);
    check_rows(gdn.conv.window(0), gdn_loaded.conv.window(0), int8);
    for (Eigen::Index h = 0; h < gdn.recurrent.size(); ++h) {
      check_rows(gdn.recurrent[h].s(), gdn_loaded.recurrent[h].s(), int8);
      CHECK(gdn.recurrent[h].tokens() == gdn_loaded.recurrent[h].tokens());
    }
    const auto& kv = pool.states<linattn::KVCacheBatch<F>>(1, 1);
    const auto& kv_loaded = loaded.states<linattn::KVCacheBatch<F>>(1, 1);
    check_rows(kv.cache(0, 1).keys(), kv_loaded.cache(0, 1).keys(), int8);
    check_rows(kv.cache(0, 1).values(), kv_loaded.cache(0, 1).values(), int8);
    const auto& lin = pool.states<RecurrentStateBatch<F>>(1, 4);
    const auto& lin_loaded = loaded.states<RecurrentStateBatch<F>>(1, 4);
    check_rows(lin[1].s(), lin_loaded[1].s(), int8);
    check_rows(lin[1].z().transpose(), lin_loaded[1].z().transpose(), int8);
    // Saved again in the same storage: the rounded numbers are on the grid, the bytes equal.
    CHECK(loaded.save_bytes(1, storage) == blob);
  }
}

TEST_CASE(
    "hybrid pool: snapshots roll every layer back to m accepted drafts and start new "
    "sessions, bit for bit",
    "[session_pool][hybrid]") {
  using Catch::Matchers::Contains;
  const Hybrid model;
  HybridPool pool = model.make_pool();
  std::map<Key, Alone> alone;
  for (Key key : {1, 2}) {
    pool.add(key);
    alone.emplace(key, Alone(model));
  }
  for (int t = 0; t < 3; ++t) step_all(model, pool, alone);
  for (int m : {0, 2, 4}) {
    CAPTURE(m);
    // A speculative round: snapshot, 4 drafts, back to the snapshot, the m accepted tokens
    // again: every layer (KV caches and windows too) as decoding the m tokens alone.
    const linattn::SessionSnapshot one = pool.snapshot(1), two = pool.snapshot(2);
    const std::map<Key, Alone> before = alone;
    for (int t = 0; t < 4; ++t) step_all(model, pool, alone);
    pool.restore(1, one);
    pool.restore(2, two);
    alone = before;
    for (int t = 0; t < m; ++t) step_all(model, pool, alone);
    CHECK(pool.save_bytes(1) != pool.save_bytes(2));
  }
  // A checkpoint starts a new session: session 3 from session 1's state.
  const linattn::SessionSnapshot checkpoint = pool.snapshot(1);
  pool.add(3, checkpoint);
  alone.emplace(3, alone.at(1));
  CHECK(pool.save_bytes(3) == pool.save_bytes(1));
  step_all(model, pool, alone);
  // Only the pool that took a snapshot restores it, whole or not at all.
  HybridPool other = model.make_pool();
  other.add(1);
  const std::vector<std::uint8_t> other_before = other.save_bytes(1);
  CHECK_THROWS_WITH(other.restore(1, checkpoint), Contains("taken by another pool"));
  CHECK_THROWS_WITH(other.add(2, checkpoint), Contains("taken by another pool"));
  CHECK_THROWS_WITH(other.restore(1, linattn::SessionSnapshot{}), Contains("never taken"));
  CHECK(other.save_bytes(1) == other_before);
  CHECK(other.size() == 1);
  CHECK_THROWS_WITH(pool.restore(9, checkpoint), Contains("no live session 9"));
}

TEST_CASE("hybrid pool: canonical blobs, calls from inside a lend, replaced batches",
          "[session_pool][hybrid][errors]") {
  using Catch::Matchers::Contains;
  // An int8 scale survives a load and a save: 127 * scale in float, over 127, is itself (one
  // row in about 128 needs an ulp more than top / 127).
  std::mt19937_64 engine(11);
  std::uniform_real_distribution<double> exponent(-30.0, 30.0);
  int nudged = 0, moved = 0, off = 0;
  for (int i = 0; i < 20000; ++i) {
    const double top = std::exp2(exponent(engine));
    const float scale = linattn::detail::int8_scale(top);
    moved += linattn::detail::int8_rescale(scale) != scale;
    off += !(std::abs(double(scale) * 127.0 - top) <= top * 1e-6);
    nudged += scale != static_cast<float>(top / 127.0);
  }
  CHECK(moved == 0);
  CHECK(off == 0);
  CHECK(nudged > 20);  // the ties exist: without the nudge these rows would not round-trip

  const Hybrid model;
  HybridPool pool = model.make_pool();
  std::map<Key, Alone> alone;
  pool.add(1);
  alone.emplace(1, Alone(model));
  step_all(model, pool, alone);
  const std::vector<std::uint8_t> blob = pool.save_bytes(1);
  // Settings that load would take as equal but this pool does not write: DeltaNet's scale
  // 0.5 is Dk^-1/2 for Dk = 4, as the pool's -1 resolves.
  DeltaOptions explicit_scale = Hybrid::delta_options();
  explicit_scale.scale = 0.5;
  const linattn::DeltaRuleLayer<F> scaled(Hybrid::kH, Hybrid::kD, Hybrid::kD, explicit_scale);
  HybridPool other(model.gdn, model.attention, model.mamba, model.conv, model.linear, scaled);
  CHECK_THROWS_WITH(other.add_bytes(1, blob), Contains("not written as this pool's layer"));

  // Inside a lend's body the pool refuses every call that reads or moves parts.
  pool.lend<linattn::ConvWindows<F>>(3, {1}, [&](linattn::ConvWindows<F>&) {
    CHECK_THROWS_WITH(pool.save_bytes(1), Contains("inside a lend's body"));
    CHECK_THROWS_WITH(pool.snapshot(1), Contains("inside a lend's body"));
    CHECK_THROWS_WITH(pool.add(2), Contains("inside a lend's body"));
    CHECK_THROWS_WITH(pool.drop(1), Contains("inside a lend's body"));
    CHECK_THROWS_WITH(pool.lend<linattn::ConvWindows<F>>(3, {1}, [](auto&) {}),
                      Contains("inside a lend's body"));
  });
  CHECK(pool.save_bytes(1) == blob);
  // A body that throws gives the parts back.
  CHECK_THROWS_AS(
      pool.lend<linattn::ConvWindows<F>>(3, {1}, [](auto&) { throw std::runtime_error("x"); }),
      std::runtime_error);
  CHECK(pool.save_bytes(1) == blob);
  // A body that assigns another batch of the same size gives its parts to the sessions; one of
  // another size leaves the sessions fresh (their parts went with the old batch).
  const linattn::ConvWindows<F> window = pool.states<linattn::ConvWindows<F>>(1, 3);
  pool.lend<linattn::ConvWindows<F>>(
      3, {1}, [&](linattn::ConvWindows<F>& w) { w = model.conv.make_states(2); });
  CHECK(pool.states<linattn::ConvWindows<F>>(1, 3).window(0).isZero());
  pool.lend<linattn::ConvWindows<F>>(3, {1}, [&](linattn::ConvWindows<F>& w) { w = window; });
  CHECK(pool.save_bytes(1) == blob);

  // A snapshot taken before add_layer belongs to another pool.
  HybridPool growing(model.gdn);
  growing.add(1);
  const linattn::SessionSnapshot before = growing.snapshot(1);
  growing.drop(1);
  growing.add_layer(model.conv);
  CHECK_THROWS_WITH(growing.add(2, before), Contains("another pool"));
  CHECK(growing.size() == 0);
}

}  // namespace linattn_test_session_pool
