// Writing one's own feature map: the second-order Taylor map of exp(q . k / sqrt(d)),
//   phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) d^(1/2))],   C = 1 + d + d^2,
// so that phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(d): a positive kernel
// (1 + s + s^2/2 > 0 for every s) that linear attention computes exactly.
//
// A feature map is a small copyable object with three const members (linattn/feature_map.hpp):
//   feature_dim(input_dim)  -> C
//   queries(x), keys(x)     -> the N x C features of an N x Dk matrix (rows are tokens)
// and optionally queries_into(x, out) / keys_into(x, out), which let RecurrentState::step_into
// run without allocating. Every kernel and state then takes it like a built-in map.
//
// The program checks the parallel and the recurrent form against the kernel written out
// (O(N^2), double) and fails beyond 1e-12 relative.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <linattn/linattn.hpp>
#include <random>

struct TaylorFeatures {
  Eigen::Index feature_dim(Eigen::Index input_dim) const {
    return 1 + input_dim + input_dim * input_dim;
  }

  template <class Derived>
  void queries_into(const Eigen::MatrixBase<Derived>& x,
                    Eigen::Ref<linattn::Matrix<typename Derived::Scalar>> out) const {
    using T = typename Derived::Scalar;
    const Eigen::Index d = x.cols();
    const T first = T(1) / std::pow(T(d), T(0.25));
    const T second = T(1) / (std::sqrt(T(2)) * std::sqrt(T(d)));
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
      out(r, 0) = T(1);
      out.row(r).segment(1, d) = x.row(r) * first;
      for (Eigen::Index i = 0; i < d; ++i) {
        out.row(r).segment(1 + d + i * d, d) = x.row(r) * (x(r, i) * second);
      }
    }
  }
  template <class Derived>
  void keys_into(const Eigen::MatrixBase<Derived>& x,
                 Eigen::Ref<linattn::Matrix<typename Derived::Scalar>> out) const {
    queries_into(x, out);  // the same map for queries and keys
  }

  template <class Derived>
  linattn::Matrix<typename Derived::Scalar> queries(const Eigen::MatrixBase<Derived>& x) const {
    linattn::Matrix<typename Derived::Scalar> out(x.rows(), feature_dim(x.cols()));
    queries_into(x, out);
    return out;
  }
  template <class Derived>
  linattn::Matrix<typename Derived::Scalar> keys(const Eigen::MatrixBase<Derived>& x) const {
    return queries(x);
  }
};

int main() {
  const Eigen::Index tokens = 300, key_dim = 8, value_dim = 16;
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  linattn::Matrix<double> q(tokens, key_dim), k(tokens, key_dim), v(tokens, value_dim);
  for (auto* m : {&q, &k, &v}) {
    for (Eigen::Index i = 0; i < m->size(); ++i) m->data()[i] = normal(rng);
  }

  const TaylorFeatures phi;
  const linattn::Matrix<double> parallel = linattn::causal_linear_attention(q, k, v, phi);

  linattn::RecurrentState<double> state(phi.feature_dim(key_dim), value_dim);
  linattn::Matrix<double> recurrent(tokens, value_dim);
  linattn::Vector<double> out(value_dim);
  for (Eigen::Index i = 0; i < tokens; ++i) {
    state.step_into(q.row(i), k.row(i), v.row(i), phi, out);
    recurrent.row(i) = out.transpose();
  }

  // The kernel written out: out_i = sum_j<=i w_ij v_j / (sum_j<=i w_ij + eps).
  linattn::Matrix<double> expected(tokens, value_dim);
  for (Eigen::Index i = 0; i < tokens; ++i) {
    linattn::Vector<double> num = linattn::Vector<double>::Zero(value_dim);
    double den = 0.0;
    for (Eigen::Index j = 0; j <= i; ++j) {
      const double s = q.row(i).dot(k.row(j)) / std::sqrt(double(key_dim));
      const double w = 1.0 + s + 0.5 * s * s;
      num += w * v.row(j).transpose();
      den += w;
    }
    expected.row(i) = (num / (den + linattn::Options{}.eps)).transpose();
  }

  const double scale = expected.cwiseAbs().maxCoeff();
  const double parallel_error = (parallel - expected).cwiseAbs().maxCoeff() / scale;
  const double recurrent_error = (recurrent - expected).cwiseAbs().maxCoeff() / scale;
  std::printf("Taylor map, C = %lld: parallel error %.3g, recurrent error %.3g (relative)\n",
              static_cast<long long>(phi.feature_dim(key_dim)), parallel_error, recurrent_error);
  return std::max(parallel_error, recurrent_error) <= 1e-12 ? 0 : 1;
}
