// Test helpers: seeded inputs and the naive O(N^2) reference, independent of the library's
// kernels (it uses only linattn's Matrix alias).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/config.hpp>
#include <random>

namespace linattn_test {

using linattn::Matrix;
using linattn::Vector;

/// rows x cols of N(mean, stddev^2) entries from a fixed seed.
template <class T>
Matrix<T> gaussian(Eigen::Index rows, Eigen::Index cols, std::uint64_t seed, double stddev = 1.0,
                   double mean = 0.0) {
  std::mt19937_64 engine(seed);
  std::normal_distribution<double> normal(mean, stddev);
  Matrix<T> m(rows, cols);
  for (Eigen::Index r = 0; r < rows; ++r) {
    for (Eigen::Index c = 0; c < cols; ++c) m(r, c) = static_cast<T>(normal(engine));
  }
  return m;
}

/// max|a - b| / max|b|, in double.
template <class DA, class DB>
double relative_error(const Eigen::MatrixBase<DA>& a, const Eigen::MatrixBase<DB>& b) {
  const double scale = b.template cast<double>().cwiseAbs().maxCoeff();
  const double diff = (a.template cast<double>() - b.template cast<double>()).cwiseAbs().maxCoeff();
  return scale > 0 ? diff / scale : diff;
}

/// Central differences of loss() in every entry of x, step h (1 + |x|), x restored after each;
/// an entry of -infinity (a reset gate: no neighbourhood) gets 0.
template <class X, class Loss>
X central_differences(X& x, const Loss& loss, double h) {
  X grad = X::Zero(x.rows(), x.cols());
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    for (Eigen::Index c = 0; c < x.cols(); ++c) {
      const double keep = x(r, c);
      if (keep == -std::numeric_limits<double>::infinity()) continue;
      const double step = h * (1.0 + std::abs(keep));
      x(r, c) = keep + step;
      const double up = loss();
      x(r, c) = keep - step;
      const double down = loss();
      x(r, c) = keep;
      grad(r, c) = (up - down) / (2.0 * step);
    }
  }
  return grad;
}

/// Naive causal (or full) linear attention straight from the formula, in double:
/// out_i = sum_j w_ij v_j / (sum_j w_ij + eps), w_ij = g^(i-j) phi_q_i . phi_k_j, j <= i.
/// The denominator guard mirrors the documented one: |d| < eps becomes sign(d) eps.
inline Matrix<double> naive_linear_attention(const Matrix<double>& phi_q,
                                             const Matrix<double>& phi_k, const Matrix<double>& v,
                                             bool causal, double decay, double eps,
                                             bool normalize) {
  const Eigen::Index n = phi_q.rows();
  Matrix<double> out(n, v.cols());
  for (Eigen::Index i = 0; i < n; ++i) {
    Eigen::RowVectorXd num = Eigen::RowVectorXd::Zero(v.cols());
    double den = 0.0;
    const Eigen::Index last = causal ? i : phi_k.rows() - 1;  // all N_k keys when not causal
    for (Eigen::Index j = 0; j <= last; ++j) {
      const double w =
          phi_q.row(i).dot(phi_k.row(j)) * (causal ? std::pow(decay, double(i - j)) : 1.0);
      num += w * v.row(j);
      den += w;
    }
    if (!normalize) {
      out.row(i) = num;
      continue;
    }
    double d = den + eps;
    if (std::abs(d) < eps) d = d < 0 ? -eps : eps;
    out.row(i) = d == 0.0 ? Eigen::RowVectorXd::Zero(v.cols()) : Eigen::RowVectorXd(num / d);
  }
  return out;
}

/// The same attention by the recurrence, in double and O(N C Dv) instead of O(N^2 (C + Dv)):
/// S_i = g S_{i-1} + phi_k_i v_i^T, z_i = g z_{i-1} + phi_k_i, out_i = phi_q_i S_i over
/// guard(phi_q_i . z_i + eps) (S, z over all rows when not causal). A second reference, for the
/// long sequences where the quadratic formula is too slow (under the sanitizers above all);
/// the tests check that the two agree where both run.
inline Matrix<double> recurrent_linear_attention(const Matrix<double>& phi_q,
                                                 const Matrix<double>& phi_k,
                                                 const Matrix<double>& v, bool causal, double decay,
                                                 double eps, bool normalize) {
  const Eigen::Index n = phi_q.rows();
  Matrix<double> s = Matrix<double>::Zero(phi_k.cols(), v.cols());
  Eigen::VectorXd z = Eigen::VectorXd::Zero(phi_k.cols());
  auto absorb = [&](Eigen::Index j) {
    s.noalias() += phi_k.row(j).transpose() * v.row(j);
    z += phi_k.row(j).transpose();
  };
  if (!causal) {
    for (Eigen::Index j = 0; j < n; ++j) absorb(j);
  }
  Matrix<double> out(n, v.cols());
  for (Eigen::Index i = 0; i < n; ++i) {
    if (causal) {
      s *= decay;
      z *= decay;
      absorb(i);
    }
    const Eigen::RowVectorXd num = phi_q.row(i) * s;
    if (!normalize) {
      out.row(i) = num;
      continue;
    }
    double d = phi_q.row(i).dot(z) + eps;
    if (std::abs(d) < eps) d = d < 0 ? -eps : eps;
    out.row(i) = d == 0.0 ? Eigen::RowVectorXd::Zero(v.cols()) : Eigen::RowVectorXd(num / d);
  }
  return out;
}

/// The inputs a multi-head test feeds: featurized rows, or raw rows through a feature map.
enum class Kind { featurized, elu, prf };

inline const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::featurized:
      return "featurized";
    case Kind::elu:
      return "EluPlusOne";
    case Kind::prf:
      return "PositiveRandomFeatures";
  }
  return "?";
}

/// FLA's naive recurrence in double: q scaled by s (after the optional L2 normalisation,
/// x / sqrt(|x|^2 + 1e-6)), then per token S <- diag(exp(g_t)) S, S <- S + k (beta (v - S^T k))^T,
/// o = S^T q. `log_gates` has 0 columns (DeltaNet), 1 or Dk; `state` enters as the initial
/// state and leaves as the final one.
inline Matrix<double> naive_delta_rule(Matrix<double> q, Matrix<double> k, const Matrix<double>& v,
                                       const Vector<double>& beta, const Matrix<double>& log_gates,
                                       double scale, bool l2_normalize, Matrix<double>& state) {
  const Eigen::Index n = q.rows();
  Matrix<double> out(n, v.cols());
  for (Eigen::Index t = 0; t < n; ++t) {
    Eigen::RowVectorXd qt = q.row(t);
    Eigen::RowVectorXd kt = k.row(t);
    if (l2_normalize) {
      qt /= std::sqrt(qt.squaredNorm() + 1e-6);
      kt /= std::sqrt(kt.squaredNorm() + 1e-6);
    }
    qt *= scale;
    for (Eigen::Index d = 0; d < state.rows(); ++d) {
      if (log_gates.cols() == 0) break;
      const double g = log_gates(t, log_gates.cols() == 1 ? 0 : d);
      state.row(d) *= std::exp(g);
    }
    const Eigen::RowVectorXd pred = kt * state;
    const Eigen::RowVectorXd u = beta(t) * (v.row(t) - pred);
    state += kt.transpose() * u;
    out.row(t) = qt * state;
  }
  return out;
}

inline Matrix<double> naive_delta_rule(const Matrix<double>& q, const Matrix<double>& k,
                                       const Matrix<double>& v, const Vector<double>& beta,
                                       const Matrix<double>& log_gates, double scale,
                                       bool l2_normalize) {
  Matrix<double> state = Matrix<double>::Zero(q.cols(), v.cols());
  return naive_delta_rule(q, k, v, beta, log_gates, scale, l2_normalize, state);
}

/// FLA's naive_recurrent_rwkv6 in double, token by token in its own order: the output reads
/// the state before the token plus the token through u, then the state decays and takes it:
/// o_t = (s r_t)^T (h + diag(u) k_t v_t^T), h <- diag(exp(w_t)) h + k_t v_t^T. Returns the
/// outputs; `h` enters as the initial state and leaves as the final one.
inline Matrix<double> naive_rwkv6(const Matrix<double>& r, const Matrix<double>& k,
                                  const Matrix<double>& v, const Matrix<double>& w,
                                  const Eigen::VectorXd& u, double scale, Matrix<double>& h) {
  Matrix<double> out(r.rows(), v.cols());
  for (Eigen::Index t = 0; t < r.rows(); ++t) {
    const Matrix<double> kv = k.row(t).transpose() * v.row(t);
    out.row(t) = (scale * r.row(t)) * (h + u.asDiagonal() * kv);
    for (Eigen::Index i = 0; i < h.rows(); ++i) h.row(i) *= std::exp(w(t, w.cols() == 1 ? 0 : i));
    h += kv;
  }
  return out;
}

}  // namespace linattn_test
