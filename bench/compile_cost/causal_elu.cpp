// SPDX-License-Identifier: MIT
// Compile cost of the common call: one float causal_linear_attention with EluPlusOne.
#include <iostream>
#include <linattn/linattn.hpp>

int main() {
  const linattn::Matrix<float> q = linattn::Matrix<float>::Random(256, 64);
  const linattn::Matrix<float> k = linattn::Matrix<float>::Random(256, 64);
  const linattn::Matrix<float> v = linattn::Matrix<float>::Random(256, 64);
  const linattn::Matrix<float> out =
      linattn::causal_linear_attention(q, k, v, linattn::EluPlusOne{});
  std::cout << out.sum() << '\n';
}
