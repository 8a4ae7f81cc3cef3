// SPDX-License-Identifier: MIT
// Compile-cost baseline: one float Eigen GEMM, the yardstick of scripts/compile_cost.
#include <Eigen/Dense>
#include <iostream>

int main() {
  const Eigen::MatrixXf a = Eigen::MatrixXf::Random(256, 64);
  const Eigen::MatrixXf b = Eigen::MatrixXf::Random(64, 128);
  Eigen::MatrixXf c(256, 128);
  c.noalias() = a * b;
  std::cout << c.sum() << '\n';
}
