// A trained Performer's attention with linattn: FAVOR+ over the projection W from a checkpoint.
//
// A Performer keeps its random projection W (m x Dk) with the model: performer-pytorch stores
// it as the buffer `projection_matrix` of each attention layer. PositiveRandomFeatures built
// from that W computes the features of performer-pytorch's softmax_kernel, with the same
// defaults (u = x / Dk^(1/4), factor 1/sqrt(m)), except for its "+ 1e-4" on every feature; its
// max-stabilisers cancel in normalised attention, and linattn keeps a log-scale of its own.
//
// Here W stands in for a checkpoint's: drawn the way performer-pytorch draws it (orthogonal
// blocks, chi-distributed row norms) and stored as floats. The program runs causal attention
// over the map and checks it against exact causal softmax attention at scale 1/sqrt(Dk),
// written out below: FAVOR+ estimates softmax, so it must be clearly closer to it (by a
// quarter at least) than the running mean of v, attention with flat weights, is. It exits
// nonzero if not.
#include <cmath>
#include <cstdio>
#include <linattn/linattn.hpp>
#include <random>
#include <vector>

using Mat = linattn::Matrix<float>;

/// rows x cols of N(0, stddev^2) entries.
Mat random_matrix(Eigen::Index rows, Eigen::Index cols, float stddev, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

/// out_i = sum_{j <= i} exp(s q_i . k_j) v_j / sum_{j <= i} exp(s q_i . k_j), in double.
linattn::Matrix<double> causal_softmax(const Mat& q, const Mat& k, const Mat& v, double s) {
  linattn::Matrix<double> out = linattn::Matrix<double>::Zero(q.rows(), v.cols());
  for (Eigen::Index i = 0; i < q.rows(); ++i) {
    double total = 0.0;
    for (Eigen::Index j = 0; j <= i; ++j) {
      const double w = std::exp(s * q.row(i).cast<double>().dot(k.row(j).cast<double>()));
      out.row(i) += w * v.row(j).cast<double>();
      total += w;
    }
    out.row(i) /= total;
  }
  return out;
}

int main() {
  const Eigen::Index key_dim = 16, num_features = 1024, tokens = 200, value_dim = 8;
  try {
    // The checkpoint: W as m x Dk row-major floats (what projection_matrix.numpy() holds).
    const Mat drawn =
        linattn::PositiveRandomFeatures(key_dim, num_features, 7).projection().cast<float>();
    const std::vector<float> checkpoint(drawn.data(), drawn.data() + drawn.size());

    // View the loaded buffer in place; the map copies W and checks it (m x key_dim, finite).
    const Eigen::Map<const Mat> projection(checkpoint.data(), num_features, key_dim);
    const linattn::PositiveRandomFeatures map(key_dim, projection);

    // One head's queries, keys and values.
    const Mat q = random_matrix(tokens, key_dim, 0.5f, 1);
    const Mat k = random_matrix(tokens, key_dim, 0.5f, 2);
    const Mat v = random_matrix(tokens, value_dim, 1.0f, 3);

    const Mat out = linattn::causal_linear_attention(q, k, v, map);

    const linattn::Matrix<double> exact = causal_softmax(q, k, v, 1.0 / std::sqrt(double(key_dim)));
    const linattn::Matrix<double> flat = causal_softmax(q, k, v, 0.0);  // the running mean of v
    const double error = (out.cast<double>() - exact).norm() / exact.norm();
    const double flat_error = (flat - exact).norm() / exact.norm();
    std::printf("relative error against softmax attention: FAVOR+ (m = %lld) %.4f, flat %.4f\n",
                static_cast<long long>(num_features), error, flat_error);
    if (!(error < 0.75 * flat_error)) {
      std::printf("FAIL: FAVOR+ is not clearly closer to softmax attention than flat weights\n");
      return 1;
    }
  } catch (const linattn::Error& e) {
    std::printf("FAIL: %s\n", e.what());
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
