// SPDX-License-Identifier: MIT
// Compile cost of a model's layer: LinearAttentionLayer with FAVOR+, forward, prefill and step.
#include <iostream>
#include <linattn/linattn.hpp>

int main() {
  using Layer = linattn::LinearAttentionLayer<float, linattn::PositiveRandomFeatures>;
  const Eigen::Index batch = 2, heads = 4, tokens = 64, dim = 32;
  const Layer layer(linattn::PositiveRandomFeatures(dim, 64, 7), heads, dim, dim);
  const linattn::HeadShape shape{batch, heads, tokens, dim};
  const linattn::Matrix<float> x = linattn::Matrix<float>::Random(batch * tokens, heads * dim);
  linattn::Matrix<float> out(batch * tokens, heads * dim);
  const auto in = linattn::HeadsView<const float>::bnhd(x.data(), linattn::BnhdShape(shape));
  const auto o = linattn::HeadsView<float>::bnhd(out.data(), linattn::BnhdShape(shape));
  layer.forward_into(in, in, in, o);
  auto states = layer.make_states(batch);
  layer.prefill_into(states, in, in, in, o);
  const linattn::Matrix<float> token = linattn::Matrix<float>::Random(batch * heads, dim);
  linattn::Matrix<float> next(batch * heads, dim);
  layer.step_into(states, token, token, token, next);
  std::cout << out.sum() + next.sum() << '\n';
}
