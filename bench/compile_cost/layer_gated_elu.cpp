// SPDX-License-Identifier: MIT
// Compile cost of the linear/gated engine's layer as a model uses it: LinearAttentionLayer with
// EluPlusOne and scalar gates (Mamba-2 style), forward, prefill and step, and the backward of
// the views.
#include <iostream>
#include <linattn/linattn.hpp>

int main() {
  using Layer = linattn::LinearAttentionLayer<float, linattn::EluPlusOne>;
  using View = linattn::HeadsView<const float>;
  const Eigen::Index batch = 2, heads = 4, tokens = 64, dim = 32;
  const Layer layer(linattn::EluPlusOne{}, heads, dim, dim);
  const linattn::BnhdShape shape{batch, tokens, heads, dim};
  const linattn::BnhdShape gate_shape{batch, tokens, heads, 1};
  const linattn::Matrix<float> x = linattn::Matrix<float>::Random(batch * tokens, heads * dim);
  const linattn::Matrix<float> g =
      -linattn::Matrix<float>::Random(batch * tokens, heads).cwiseAbs();
  linattn::Matrix<float> out(batch * tokens, heads * dim);
  const auto in = View::bnhd(x.data(), shape);
  const auto gates = linattn::log_gates(View::bnhd(g.data(), gate_shape));
  const auto o = linattn::HeadsView<float>::bnhd(out.data(), shape);
  layer.forward_into(in, in, in, gates, o);
  auto states = layer.make_states(batch);
  layer.prefill_into(states, in, in, in, gates, o);
  const linattn::Matrix<float> token = linattn::Matrix<float>::Random(batch * heads, dim);
  const linattn::Matrix<float> token_gates =
      -linattn::Matrix<float>::Random(batch * heads, 1).cwiseAbs();
  linattn::Matrix<float> next(batch * heads, dim);
  layer.step_into(states, token, token, token, linattn::log_gates(token_gates), next);
  linattn::Matrix<float> dq(batch * tokens, heads * dim), dk = dq, dv = dq;
  linattn::Matrix<float> dg(batch * tokens, heads);
  linattn::causal_gated_linear_attention_backward_into(
      in, in, in, gates, View::bnhd(out.data(), shape), linattn::EluPlusOne{},
      linattn::HeadsView<float>::bnhd(dq.data(), shape),
      linattn::HeadsView<float>::bnhd(dk.data(), shape),
      linattn::HeadsView<float>::bnhd(dv.data(), shape),
      linattn::HeadsView<float>::bnhd(dg.data(), gate_shape));
  std::cout << out.sum() + next.sum() + dq.sum() + dg.sum() << '\n';
}
