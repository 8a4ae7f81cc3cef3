// Quickstart: the same causal linear-attention layer in its two forms.
//   parallel  - one call over the whole sequence (training, prompt prefill)
//   recurrent - one token at a time with a constant-size state (decoding)
// They give the same outputs; this program prints the largest difference and fails if the
// two disagree by more than the tolerance the test suite proves (1e-12 relative in double).
#include <algorithm>
#include <cstdio>
#include <linattn/linattn.hpp>
#include <random>

int main() {
  const Eigen::Index tokens = 1024, key_dim = 64, value_dim = 64;

  // Q, K, V as a model would produce them: one row per token.
  std::mt19937_64 rng(42);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto random_matrix = [&](Eigen::Index rows, Eigen::Index cols) {
    linattn::Matrix<double> m(rows, cols);
    for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
    return m;
  };
  const linattn::Matrix<double> q = random_matrix(tokens, key_dim);
  const linattn::Matrix<double> k = random_matrix(tokens, key_dim);
  const linattn::Matrix<double> v = random_matrix(tokens, value_dim);

  const linattn::EluPlusOne phi;  // the feature map of "Transformers are RNNs"
  linattn::Options options;
  options.decay = 0.99;  // retention-style decay; 1.0 is plain linear attention

  // Parallel form: chunked, matrix-multiply speed.
  const linattn::Matrix<double> parallel = linattn::causal_linear_attention(q, k, v, phi, options);

  // Recurrent form: S (C x Dv) and z (C) updated once per token.
  linattn::RecurrentState<double> state(phi.feature_dim(key_dim), value_dim, options);
  double max_diff = 0.0;
  for (Eigen::Index i = 0; i < tokens; ++i) {
    const linattn::Vector<double> out = state.step(q.row(i), k.row(i), v.row(i), phi);
    max_diff = std::max(max_diff, (out.transpose() - parallel.row(i)).cwiseAbs().maxCoeff());
  }

  const double scale = parallel.cwiseAbs().maxCoeff();
  std::printf("tokens: %lld, state: %lld x %lld\n", static_cast<long long>(state.tokens()),
              static_cast<long long>(state.feature_dim()),
              static_cast<long long>(state.value_dim()));
  std::printf("largest |parallel - recurrent|: %.3g (relative %.3g)\n", max_diff, max_diff / scale);
  return max_diff / scale <= 1e-12 ? 0 : 1;
}
