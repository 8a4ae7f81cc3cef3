// DraftRing: rollback of speculative decoding. A GatedDeltaNet and a GatedShortConv decode K
// = 4 drafts through the ring; keeping the first m (every m from 0 to 4) and continuing is bit
// for bit decoding the m accepted tokens alone; misuse throws.
#include <catch2/catch.hpp>
#include <linattn/draft_ring.hpp>
#include <linattn/gated_delta_net.hpp>
#include <linattn/gated_short_conv.hpp>
#include <vector>

#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_draft_ring {

namespace {

using linattn::BnhdShape;
using linattn::ConstHeadsView;
using linattn::DraftRing;
using linattn::GatedDeltaNet;
using linattn::GatedDeltaNetInputs;
using linattn::GatedDeltaNetShape;
using linattn::HeadsView;
using linattn::Matrix;
using linattn::Vector;
using linattn_test::gaussian;

using T = float;

/// A small Qwen3.5 mixer and one token's projections for B sequences.
struct Mixer {
  GatedDeltaNetShape shape;
  GatedDeltaNet<T> mixer;
  explicit Mixer(const GatedDeltaNetShape& s)
      : shape(s),
        mixer(s, {gaussian<T>(s.conv_channels(), s.conv_kernel, 1, 0.5),
                  Vector<T>::Constant(s.value_heads, 0.5f), Vector<T>::Ones(s.value_heads),
                  Vector<T>::Ones(s.value_dim)}) {}
  /// Token t of every sequence (rows of [B, T, ...] buffers drawn once).
  Matrix<T> y(Eigen::Index batch) const { return Matrix<T>(batch, shape.value_channels()); }
  void step(GatedDeltaNet<T>::States& states, const Matrix<T>& qkv, const Matrix<T>& z,
            const Matrix<T>& b, const Matrix<T>& a, Matrix<T>& y) const {
    const Eigen::Index batch = qkv.rows(), hv = shape.value_heads;
    const GatedDeltaNetInputs<T> in{
        ConstHeadsView<T>::bnhd(qkv.data(), BnhdShape(batch, 1, 1, qkv.cols())),
        ConstHeadsView<T>::bnhd(z.data(), BnhdShape(batch, 1, hv, shape.value_dim)),
        ConstHeadsView<T>::bnhd(b.data(), BnhdShape(batch, 1, hv, 1)),
        ConstHeadsView<T>::bnhd(a.data(), BnhdShape(batch, 1, hv, 1))};
    mixer.step_into(states, in,
                    HeadsView<T>::bnhd(y.data(), BnhdShape(batch, 1, hv, shape.value_dim)));
  }
};

}  // namespace

TEST_CASE("DraftRing: keeping m of K drafts is decoding the m tokens alone, bit for bit",
          "[draft_ring]") {
  GatedDeltaNetShape shape;
  shape.key_heads = 1;
  shape.value_heads = 2;
  shape.key_dim = 16;
  shape.value_dim = 16;
  const Mixer m(shape);
  const Eigen::Index batch = 2, drafts = 4, after = 2, total = 3 + drafts + after;
  // Tokens 0..2 accepted before the round, 3..6 the drafts, then 2 more.
  std::vector<Matrix<T>> qkv, z, b, a;
  for (Eigen::Index t = 0; t < total; ++t) {
    qkv.push_back(gaussian<T>(batch, shape.conv_channels(), 10 + t));
    z.push_back(gaussian<T>(batch, shape.value_channels(), 100 + t));
    b.push_back(gaussian<T>(batch, shape.value_heads, 200 + t));
    a.push_back(gaussian<T>(batch, shape.value_heads, 300 + t));
  }
  // The LFM2 block beside it: its state is convolution windows alone.
  const linattn::GatedShortConv<T> conv_block(gaussian<T>(8, 3, 2));
  std::vector<Matrix<T>> bcx;
  for (Eigen::Index t = 0; t < total; ++t) bcx.push_back(gaussian<T>(batch, 24, 400 + t));
  auto conv_step = [&](linattn::ConvWindows<T>& w, Eigen::Index t, Matrix<T>& y) {
    conv_block.step_into(w, ConstHeadsView<T>::bnhd(bcx[t].data(), BnhdShape(batch, 1, 1, 24)),
                         HeadsView<T>::bnhd(y.data(), BnhdShape(batch, 1, 1, 8)));
  };

  auto states = m.mixer.make_states(batch);
  auto windows = conv_block.make_states(batch);
  Matrix<T> y = m.y(batch), yc(batch, 8);
  for (Eigen::Index t = 0; t < 3; ++t) {
    m.step(states, qkv[t], z[t], b[t], a[t], y);
    conv_step(windows, t, yc);
  }
  DraftRing<GatedDeltaNet<T>::States> ring(drafts);
  DraftRing<linattn::ConvWindows<T>> conv_ring(drafts);
  for (Eigen::Index round = 0; round < 2; ++round) {  // the second round reuses the storage
    for (Eigen::Index accepted = 0; accepted <= drafts; ++accepted) {
      CAPTURE(round, accepted);
      auto s = states;
      auto w = windows;
      ring.begin(s);
      conv_ring.begin(w);
      for (Eigen::Index t = 3; t < 3 + drafts; ++t) {
        m.step(s, qkv[t], z[t], b[t], a[t], y);
        ring.record(s);
        conv_step(w, t, yc);
        conv_ring.record(w);
      }
      ring.rollback(s, accepted);
      conv_ring.rollback(w, accepted);
      // The reference: the accepted tokens alone, then the same continuation.
      auto alone = states;
      auto alone_w = windows;
      Matrix<T> y_alone = m.y(batch), yc_alone(batch, 8);
      for (Eigen::Index t = 3; t < 3 + accepted; ++t) {
        m.step(alone, qkv[t], z[t], b[t], a[t], y_alone);
        conv_step(alone_w, t, yc_alone);
      }
      for (Eigen::Index t = 3 + drafts; t < total; ++t) {
        m.step(s, qkv[t], z[t], b[t], a[t], y);
        m.step(alone, qkv[t], z[t], b[t], a[t], y_alone);
        CHECK(y == y_alone);
        conv_step(w, t, yc);
        conv_step(alone_w, t, yc_alone);
        CHECK(yc == yc_alone);
      }
      for (Eigen::Index i = 0; i < alone.recurrent.size(); ++i) {
        CHECK(s.recurrent[i].s() == alone.recurrent[i].s());
      }
      for (Eigen::Index bb = 0; bb < batch; ++bb) {
        CHECK(s.conv.window(bb) == alone.conv.window(bb));
        CHECK(w.window(bb) == alone_w.window(bb));
      }
    }
  }
}

TEST_CASE("DraftRing: misuse throws", "[draft_ring]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(DraftRing<Matrix<T>>(0), Contains("capacity must be >= 1"));
  DraftRing<Matrix<T>> ring(2);
  Matrix<T> s = Matrix<T>::Ones(2, 2);
  CHECK_THROWS_WITH(ring.record(s), Contains("call begin(states) first"));
  CHECK_THROWS_WITH(ring.rollback(s, 0), Contains("no round begun"));
  ring.begin(s);
  ring.record(s);
  ring.record(s);
  CHECK_THROWS_WITH(ring.record(s), Contains("the ring holds 2 drafts"));
  CHECK_THROWS_WITH(ring.rollback(s, 3), Contains("m = 3 but the round recorded 2"));
  CHECK_THROWS_WITH(ring.at(-1), Contains("not a recorded position"));
  CHECK(ring.recorded() == 2);
  // After a rollback to m the round goes on from the m kept drafts.
  Matrix<T> state = Matrix<T>::Zero(2, 2);
  ring.begin(state);
  for (int t = 1; t <= 2; ++t) {
    state.setConstant(T(t));
    ring.record(state);
  }
  ring.rollback(state, 1);
  CHECK(ring.recorded() == 1);
  CHECK(state == Matrix<T>::Constant(2, 2, T(1)));
  state.setConstant(T(7));
  ring.record(state);
  CHECK(ring.at(2) == Matrix<T>::Constant(2, 2, T(7)));
  CHECK(ring.at(1) == Matrix<T>::Constant(2, 2, T(1)));
}

}  // namespace linattn_test_draft_ring
