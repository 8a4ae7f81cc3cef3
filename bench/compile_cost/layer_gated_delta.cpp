// SPDX-License-Identifier: MIT
// Compile cost of the delta rule's layer as a model uses it: DeltaRuleLayer with scalar gates
// (Gated DeltaNet, Qwen3.5), forward, prefill and step, and the backward of the views.
#include <iostream>
#include <linattn/linattn.hpp>

int main() {
  using Layer = linattn::DeltaRuleLayer<float>;
  using View = linattn::HeadsView<const float>;
  const Eigen::Index batch = 2, heads = 4, tokens = 64, dim = 32;
  linattn::DeltaOptions options;
  options.l2_normalize = true;
  const Layer layer(heads, dim, dim, options);
  const linattn::BnhdShape shape{batch, tokens, heads, dim};
  const linattn::BnhdShape one{batch, tokens, heads, 1};
  const linattn::Matrix<float> x = linattn::Matrix<float>::Random(batch * tokens, heads * dim);
  const linattn::Matrix<float> g =
      -linattn::Matrix<float>::Random(batch * tokens, heads).cwiseAbs();
  const linattn::Matrix<float> beta = linattn::Matrix<float>::Constant(batch * tokens, heads, 0.5f);
  linattn::Matrix<float> out(batch * tokens, heads * dim);
  const auto in = View::bnhd(x.data(), shape);
  const auto gates = linattn::log_gates(View::bnhd(g.data(), one));
  const auto b = View::bnhd(beta.data(), one);
  const auto o = linattn::HeadsView<float>::bnhd(out.data(), shape);
  layer.forward_into(in, in, in, gates, b, o);
  auto states = layer.make_states(batch);
  layer.prefill_into(states, in, in, in, gates, b, o);
  const linattn::Matrix<float> token = linattn::Matrix<float>::Random(batch * heads, dim);
  const linattn::Matrix<float> token_gates =
      -linattn::Matrix<float>::Random(batch * heads, 1).cwiseAbs();
  const linattn::Vector<float> token_beta = linattn::Vector<float>::Constant(batch * heads, 0.5f);
  linattn::Matrix<float> next(batch * heads, dim);
  layer.step_into(states, token, token, token, linattn::log_gates(token_gates), token_beta, next);
  linattn::Matrix<float> dq(batch * tokens, heads * dim), dk = dq, dv = dq;
  linattn::Matrix<float> dg(batch * tokens, heads), dbeta = dg;
  linattn::causal_gated_delta_rule_backward_into(
      in, in, in, gates, b, View::bnhd(out.data(), shape),
      linattn::HeadsView<float>::bnhd(dq.data(), shape),
      linattn::HeadsView<float>::bnhd(dk.data(), shape),
      linattn::HeadsView<float>::bnhd(dv.data(), shape),
      linattn::HeadsView<float>::bnhd(dg.data(), one),
      linattn::HeadsView<float>::bnhd(dbeta.data(), one), options);
  std::cout << out.sum() + next.sum() + dq.sum() + dbeta.sum() << '\n';
}
