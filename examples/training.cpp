// Training: fit a causal linear-attention layer by gradient descent with the backward pass.
//
// A "student" layer out = attention(X W_q, X W_k, X W_v) with the elu+1 feature map learns to
// imitate a "teacher" layer of the same shape with other weights. Each step runs the forward,
// the squared-error loss, causal_linear_attention_backward (gradients reach q, k, v through the
// feature map), and the chain rule through the three projections; Adam updates the weights.
// The program first checks one gradient against a central finite difference, then fails unless
// the loss falls at least 10x.
//
// usage: example_training [steps]    (default 300)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <linattn/linattn.hpp>
#include <random>

namespace {

using linattn::Matrix;

Matrix<double> random_matrix(Eigen::Index rows, Eigen::Index cols, double stddev,
                             std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, stddev);
  Matrix<double> m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

/// A single-head causal linear-attention layer: three projections around the kernel.
struct Layer {
  Matrix<double> w_q, w_k, w_v;  // D x Dk, D x Dk, D x Dv

  Matrix<double> forward(const Matrix<double>& x, const linattn::Options& options) const {
    const Matrix<double> q = x * w_q, k = x * w_k, v = x * w_v;
    return linattn::causal_linear_attention(q, k, v, linattn::EluPlusOne{}, options);
  }
};

/// Mean squared error and its gradients with respect to the three weight matrices.
double loss_and_gradients(const Layer& layer, const Matrix<double>& x, const Matrix<double>& target,
                          const linattn::Options& options, Layer& grads) {
  const Matrix<double> q = x * layer.w_q, k = x * layer.w_k, v = x * layer.w_v;
  const Matrix<double> out =
      linattn::causal_linear_attention(q, k, v, linattn::EluPlusOne{}, options);
  const Matrix<double> diff = out - target;
  const double scale = 1.0 / static_cast<double>(diff.size());
  const Matrix<double> grad_out = 2.0 * scale * diff;
  const linattn::AttentionGradients<double> g =
      linattn::causal_linear_attention_backward(q, k, v, grad_out, linattn::EluPlusOne{}, options);
  grads.w_q.noalias() = x.transpose() * g.q;
  grads.w_k.noalias() = x.transpose() * g.k;
  grads.w_v.noalias() = x.transpose() * g.v;
  return scale * diff.squaredNorm();
}

/// Adam on the three weight matrices.
struct Adam {
  double rate = 0.02, beta1 = 0.9, beta2 = 0.999;
  Layer m, s;
  int t = 0;

  void update(Layer& layer, const Layer& grads) {
    ++t;
    const double c1 = 1.0 - std::pow(beta1, t), c2 = 1.0 - std::pow(beta2, t);
    Matrix<double>* params[] = {&layer.w_q, &layer.w_k, &layer.w_v};
    const Matrix<double>* gs[] = {&grads.w_q, &grads.w_k, &grads.w_v};
    Matrix<double>* ms[] = {&m.w_q, &m.w_k, &m.w_v};
    Matrix<double>* ss[] = {&s.w_q, &s.w_k, &s.w_v};
    for (int i = 0; i < 3; ++i) {
      *ms[i] = beta1 * *ms[i] + (1 - beta1) * *gs[i];
      *ss[i] = beta2 * *ss[i] + (1 - beta2) * gs[i]->cwiseAbs2();
      params[i]->array() -= rate * (ms[i]->array() / c1) / ((ss[i]->array() / c2).sqrt() + 1e-8);
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 300;
  const Eigen::Index tokens = 256, model_dim = 16, key_dim = 8, value_dim = 8;
  std::mt19937_64 rng(7);
  linattn::Options options;
  options.decay = 0.98;  // retention-style decay: the backward honours it like the forward

  const Matrix<double> x = random_matrix(tokens, model_dim, 1.0, rng);
  const Layer teacher{random_matrix(model_dim, key_dim, 0.5, rng),
                      random_matrix(model_dim, key_dim, 0.5, rng),
                      random_matrix(model_dim, value_dim, 0.5, rng)};
  const Matrix<double> target = teacher.forward(x, options);
  Layer student{random_matrix(model_dim, key_dim, 0.5, rng),
                random_matrix(model_dim, key_dim, 0.5, rng),
                random_matrix(model_dim, value_dim, 0.5, rng)};

  // One entry of dL/dW_q against a central finite difference.
  Layer grads = student;
  loss_and_gradients(student, x, target, options, grads);
  Layer probe = student;
  const double h = 1e-6;
  Layer unused = student;
  probe.w_q(3, 2) += h;
  const double up = loss_and_gradients(probe, x, target, options, unused);
  probe.w_q(3, 2) -= 2 * h;
  const double down = loss_and_gradients(probe, x, target, options, unused);
  const double numeric = (up - down) / (2 * h);
  const double check = std::abs(numeric - grads.w_q(3, 2)) / std::abs(numeric);
  std::printf("dL/dW_q(3, 2): backward %.10e, finite difference %.10e (relative %.1e)\n",
              grads.w_q(3, 2), numeric, check);

  Adam adam;
  adam.m = Layer{Matrix<double>::Zero(model_dim, key_dim), Matrix<double>::Zero(model_dim, key_dim),
                 Matrix<double>::Zero(model_dim, value_dim)};
  adam.s = adam.m;
  double first = 0.0, last = 0.0;
  for (int step = 0; step < steps; ++step) {
    last = loss_and_gradients(student, x, target, options, grads);
    if (step == 0) first = last;
    if (step % 50 == 0) std::printf("step %4d  loss %.6f\n", step, last);
    adam.update(student, grads);
  }
  std::printf("loss %.6f -> %.6f after %d steps (%.1fx lower)\n", first, last, steps, first / last);
  const bool ok = check < 1e-5 && first / last >= 10.0;
  std::printf("%s\n", ok ? "OK" : "FAILED: the gradient check or the loss decrease");
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}
