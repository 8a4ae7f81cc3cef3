// The delta rule's backward (DeltaNet, Gated DeltaNet, KDA): against central finite differences
// of the library's forward in double, and against an independent reverse mode written here that
// keeps every state in double.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/delta_rule.hpp>
#include <linattn/delta_rule_backward.hpp>
#include <type_traits>
#include <vector>

#include "heads_support.hpp"
#include "support.hpp"

// Every name of this file, apart from the other files of its bundle (LINATTN_TEST_BUNDLES).
namespace linattn_test_delta_rule_backward {

namespace {

using linattn::DeltaOptions;
using linattn::DeltaRuleGradients;
using linattn::Matrix;
using linattn::Vector;
using linattn_test::gaussian;
using linattn_test::relative_error;

constexpr double kMinusInf = -std::numeric_limits<double>::infinity();

/// One sequence's inputs in double: q, k, v Gaussian (keys of norm 0.9 unless raw_keys, then
/// N(0, 9) for the in-kernel norm), beta in [0.05, 0.95] and log gates in [-0.5, -0.01] (so a
/// finite-difference step keeps both in range); gate_cols 0 (DeltaNet), 1 or Dk.
struct Inputs {
  Matrix<double> q, k, v, log_gates;
  Vector<double> beta;
  Inputs(Eigen::Index n, Eigen::Index dk, Eigen::Index dv, Eigen::Index gate_cols, bool raw_keys,
         std::uint64_t seed)
      : q(gaussian<double>(n, dk, seed)),
        k(gaussian<double>(n, dk, seed + 1, raw_keys ? 3.0 : 1.0)),
        v(gaussian<double>(n, dv, seed + 2)),
        log_gates(
            -(0.01 + 0.49 * (gaussian<double>(n, gate_cols, seed + 3).array().abs().min(1.0)))),
        beta(0.05 + 0.9 * (gaussian<double>(n, 1, seed + 4).array().abs().min(1.0))) {
    if (!raw_keys) {
      for (Eigen::Index t = 0; t < n; ++t) k.row(t) *= 0.9 / k.row(t).norm();
    }
  }
  Eigen::Index gate_cols() const { return log_gates.cols(); }
};

const char* variant_name(Eigen::Index gate_cols) {
  return gate_cols == 0 ? "DeltaNet" : gate_cols == 1 ? "Gated DeltaNet" : "KDA";
}

/// The library's forward in double: DeltaNet without gates, else log_gates(g).
Matrix<double> forward(const Inputs& in, const DeltaOptions& options) {
  if (in.gate_cols() == 0) return linattn::causal_delta_rule(in.q, in.k, in.v, in.beta, options);
  return linattn::causal_gated_delta_rule(in.q, in.k, in.v, linattn::log_gates(in.log_gates),
                                          in.beta, options);
}

/// The library's backward in T (inputs, grad_out and gradients in T, accumulation Acc), the
/// gradients returned in double.
template <class T, class Acc = void>
DeltaRuleGradients<double> backward(const Inputs& in, const Matrix<double>& grad_out,
                                    const DeltaOptions& options) {
  const Matrix<T> q = in.q.cast<T>();
  const Matrix<T> k = in.k.cast<T>();
  const Matrix<T> v = in.v.cast<T>();
  const Vector<T> beta = in.beta.cast<T>();
  const Matrix<T> g = in.log_gates.cast<T>();
  const Matrix<T> d = grad_out.cast<T>();
  const DeltaRuleGradients<T> grads =
      in.gate_cols() == 0 ? linattn::causal_delta_rule_backward<Acc>(q, k, v, beta, d, options)
                          : linattn::causal_gated_delta_rule_backward<Acc>(
                                q, k, v, linattn::log_gates(g), beta, d, options);
  return {grads.q.template cast<double>(), grads.k.template cast<double>(),
          grads.v.template cast<double>(), grads.beta.template cast<double>(),
          grads.gates.template cast<double>()};
}

/// Reverse mode written out with every state kept, in double: the forward S'_t = diag(a_t)
/// S_{t-1}, e_t = v_t - S'_t^T k^_t, S_t = S'_t + beta_t k^_t e_t^T, o_t = S_t^T q^_t, then from
/// the last token dS += q^ do^T, dq^ = S_t do, dk^ = dS u, du = dS^T k^, dbeta = du . e,
/// dv = beta du, dS' = dS - beta k^ du^T, dk^ -= beta S' du, da_i = sum_j dS'_ij S_{t-1,ij},
/// dS = diag(a) dS', dg = da a (da itself with by_gate); the norm's Jacobian as an explicit
/// matrix.
DeltaRuleGradients<double> naive_backward(const Inputs& in, const Matrix<double>& grad_out,
                                          double scale, bool l2_normalize, bool by_gate = false) {
  const Eigen::Index n = in.q.rows(), dk = in.q.cols(), dv = in.v.cols();
  const Eigen::Index gate_cols = in.gate_cols();
  Matrix<double> qh(n, dk), kh(n, dk), a(n, dk), e(n, dv);
  std::vector<Matrix<double>> states(n + 1, Matrix<double>::Zero(dk, dv));  // S_{t-1} at t
  const auto normalised = [&](const Eigen::RowVectorXd& x) {
    return l2_normalize ? Eigen::RowVectorXd(x / std::sqrt(x.squaredNorm() + 1e-6)) : x;
  };
  for (Eigen::Index t = 0; t < n; ++t) {
    qh.row(t) = scale * normalised(in.q.row(t));
    kh.row(t) = normalised(in.k.row(t));
    for (Eigen::Index d = 0; d < dk; ++d) {
      a(t, d) = gate_cols == 0 ? 1.0 : std::exp(in.log_gates(t, gate_cols == 1 ? 0 : d));
    }
    const Matrix<double> decayed = a.row(t).transpose().asDiagonal() * states[t];
    e.row(t) = in.v.row(t) - kh.row(t) * decayed;
    states[t + 1] = decayed + in.beta(t) * kh.row(t).transpose() * e.row(t);
  }
  DeltaRuleGradients<double> grads{Matrix<double>(n, dk), Matrix<double>(n, dk),
                                   Matrix<double>(n, dv), Vector<double>(n),
                                   Matrix<double>::Zero(n, gate_cols)};
  Matrix<double> ds = Matrix<double>::Zero(dk, dv);
  for (Eigen::Index t = n - 1; t >= 0; --t) {
    const Eigen::VectorXd dout = grad_out.row(t).transpose();
    const Eigen::VectorXd k = kh.row(t).transpose();
    const Eigen::VectorXd u = in.beta(t) * e.row(t).transpose();
    ds += qh.row(t).transpose() * dout.transpose();
    const Eigen::VectorXd dq = states[t + 1] * dout;
    Eigen::VectorXd dkey = ds * u;
    const Eigen::VectorXd du = ds.transpose() * k;
    grads.beta(t) = du.dot(e.row(t).transpose());
    grads.v.row(t) = in.beta(t) * du.transpose();
    const Matrix<double> decayed = a.row(t).transpose().asDiagonal() * states[t];
    ds -= in.beta(t) * k * du.transpose();
    dkey -= in.beta(t) * decayed * du;
    const Eigen::VectorXd da = ds.cwiseProduct(states[t]).rowwise().sum();
    ds = a.row(t).transpose().asDiagonal() * ds;
    for (Eigen::Index c = 0; c < gate_cols; ++c) {
      // by_gate: d / d a_t itself, defined at a_t = 0 too.
      const double by_a = gate_cols == 1 ? da.sum() : da(c);
      grads.gates(t, c) = by_gate ? by_a : by_a * a(t, gate_cols == 1 ? 0 : c);
    }
    // Through q^ = s n(q) and k^ = n(k): n's Jacobian I / r - x x^T / r^3 (symmetric).
    const auto back = [&](const Eigen::RowVectorXd& x, const Eigen::VectorXd& y, double factor) {
      if (!l2_normalize) return Eigen::RowVectorXd(factor * y.transpose());
      const double r = std::sqrt(x.squaredNorm() + 1e-6);
      const Matrix<double> jacobian =
          Matrix<double>::Identity(x.size(), x.size()) / r - x.transpose() * x / (r * r * r);
      return Eigen::RowVectorXd(factor * (jacobian.transpose() * y).transpose());
    };
    grads.q.row(t) = back(in.q.row(t), dq, scale);
    grads.k.row(t) = back(in.k.row(t), dkey, 1.0);
  }
  return grads;
}

/// Central differences of L = sum(grad_out o forward) for every input entry, step h (1 + |x|)
/// (g = -inf, a reset, has no neighbourhood and gets 0).
DeltaRuleGradients<double> finite_differences(Inputs in, const Matrix<double>& grad_out,
                                              const DeltaOptions& options, double h) {
  const auto loss = [&] { return (forward(in, options).array() * grad_out.array()).sum(); };
  const auto differentiate = [&](auto& x) { return linattn_test::central_differences(x, loss, h); };
  DeltaRuleGradients<double> grads;
  grads.q = differentiate(in.q);
  grads.k = differentiate(in.k);
  grads.v = differentiate(in.v);
  grads.beta = differentiate(in.beta);
  grads.gates = differentiate(in.log_gates);
  return grads;
}

/// The largest of the five gradients' relative errors (max|a - b| / max|b| each), with each
/// one reported.
double gradient_error(const DeltaRuleGradients<double>& got,
                      const DeltaRuleGradients<double>& expected) {
  const double q = relative_error(got.q, expected.q);
  const double k = relative_error(got.k, expected.k);
  const double v = relative_error(got.v, expected.v);
  const double beta = relative_error(got.beta, expected.beta);
  const double gates = expected.gates.size() == 0 ? 0.0 : relative_error(got.gates, expected.gates);
  CAPTURE(q, k, v, beta, gates);
  CHECK(got.gates.rows() == expected.gates.rows());
  CHECK(got.gates.cols() == expected.gates.cols());
  return std::max({q, k, v, beta, gates});
}

/// Resets in the middle of the sequence: token `row` entirely, and for KDA also two features of
/// token row + 4.
void add_resets(Inputs& in, Eigen::Index row) {
  if (in.gate_cols() == 0) return;
  in.log_gates.row(row).setConstant(kMinusInf);
  if (in.gate_cols() > 1) {
    in.log_gates(row + 4, 1) = kMinusInf;
    in.log_gates(row + 4, in.gate_cols() - 1) = kMinusInf;
  }
}

/// docs/design.md's delta-rule bound, for the gradients against the naive reverse mode.
template <class T>
double bound() {
  return std::is_same_v<T, float> ? 1e-4 : 1e-10;
}

// --- the view backward ---

using linattn_test::Heads;
using linattn_test::Layout;

template <class T>
constexpr T kSentinel = T(-7.25);  // fills gradient views before a call

/// A view problem: B x H output heads, q and k grouped in pairs (H / 2 heads: output head h
/// reads h / 2 interleaved, h % (H / 2) tiled), v, beta and grad_out per output head, gates per
/// gate_heads heads (a_t for KDA, log gates otherwise), every head filled from its Inputs; the
/// gradient views full of the sentinel.
template <class T>
struct ViewProblem {
  Eigen::Index batch, heads, gate_cols;
  linattn::HeadGrouping grouping;
  std::vector<Inputs> inputs;  // per (b, h), b * H + h
  std::vector<Matrix<double>> grad_out;
  Heads<T> q, k, v, beta, gates, go;
  Heads<T> gq, gk, gv, gbeta, ggates;

  ViewProblem(Layout layout, Eigen::Index batch_, Eigen::Index heads_, Eigen::Index n,
              Eigen::Index dk, Eigen::Index dv, Eigen::Index gate_cols_, Eigen::Index gate_heads,
              std::uint64_t seed,
              linattn::HeadGrouping grouping_ = linattn::HeadGrouping::interleaved)
      : batch(batch_),
        heads(heads_),
        gate_cols(gate_cols_),
        grouping(grouping_),
        q(layout, batch, heads / 2, n, dk, T(0)),
        k(layout, batch, heads / 2, n, dk, T(0)),
        v(layout, batch, heads, n, dv, T(0)),
        beta(layout, batch, heads, n, 1, T(0)),
        gates(layout, batch, gate_heads, n, std::max<Eigen::Index>(gate_cols, 1), T(0)),
        go(layout, batch, heads, n, dv, T(0)),
        gq(layout, batch, heads / 2, n, dk, kSentinel<T>),
        gk(layout, batch, heads / 2, n, dk, kSentinel<T>),
        gv(layout, batch, heads, n, dv, kSentinel<T>),
        gbeta(layout, batch, heads, n, 1, kSentinel<T>),
        ggates(layout, batch, gate_heads, n, std::max<Eigen::Index>(gate_cols, 1), kSentinel<T>) {
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index h = 0; h < heads; ++h) {
        inputs.emplace_back(n, dk, dv, gate_cols, h % 3 == 0, seed + 10 * (b * heads + h));
        grad_out.push_back(gaussian<double>(n, dv, seed + 10 * (b * heads + h) + 5));
      }
    }
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index h = 0; h < heads; ++h) {
        // Each input head holds the Inputs of the first output head that reads it.
        const Inputs& in = at(b, h);
        if (first_reader(h)) {
          q.set_head(b, qk_head(h), in.q.cast<T>());
          k.set_head(b, qk_head(h), in.k.cast<T>());
        }
        v.set_head(b, h, in.v.cast<T>());
        beta.set_head(b, h, in.beta.cast<T>());
        go.set_head(b, h, grad_out[static_cast<std::size_t>(b * heads + h)].cast<T>());
        const Eigen::Index per_gate = heads / gate_heads;
        if (gate_cols > 0 && h % per_gate == 0) {
          const Matrix<double> g =
              gate_cols > 1 ? Matrix<double>(in.log_gates.array().exp()) : in.log_gates;
          gates.set_head(b, h / per_gate, g.cast<T>());
        }
      }
    }
  }
  const Inputs& at(Eigen::Index b, Eigen::Index h) const {
    return inputs[static_cast<std::size_t>(b * heads + h)];
  }
  /// The q/k head output head h reads, written out: FLA's h / 2, or ggml's h % (H / 2).
  Eigen::Index qk_head(Eigen::Index h) const {
    return grouping == linattn::HeadGrouping::tiled ? h % (heads / 2) : h / 2;
  }
  /// Whether h is the first (lowest) output head reading its q/k head.
  bool first_reader(Eigen::Index h) const {
    return grouping == linattn::HeadGrouping::tiled ? h < heads / 2 : h % 2 == 0;
  }
  /// The first output head reading q/k head qk_head(h): its Inputs fill that head.
  Eigen::Index lead(Eigen::Index h) const {
    return grouping == linattn::HeadGrouping::tiled ? h % (heads / 2) : h - h % 2;
  }
  /// The inputs output head h reads: its own v and beta, q and k of its pair's first head,
  /// the gates of its gate head's first reader.
  Inputs seen_by(Eigen::Index b, Eigen::Index h) const {
    Inputs in = at(b, h);
    in.q = at(b, lead(h)).q;
    in.k = at(b, lead(h)).k;
    const Eigen::Index per_gate = heads / gates.heads();
    in.log_gates = at(b, h - h % per_gate).log_gates;
    return in;
  }

  /// The view backward over the packed sequences of `offsets` (padded without).
  void run(const DeltaOptions& options, const std::vector<std::int64_t>* offsets = nullptr) {
    const auto log = linattn::log_gates(gates.cview());
    if (gate_cols == 0 && offsets) {
      linattn::causal_delta_rule_varlen_backward_into(q.cview(), k.cview(), v.cview(), beta.cview(),
                                                      go.cview(), *offsets, gq.view(), gk.view(),
                                                      gv.view(), gbeta.view(), options);
    } else if (gate_cols == 0) {
      linattn::causal_delta_rule_backward_into(q.cview(), k.cview(), v.cview(), beta.cview(),
                                               go.cview(), gq.view(), gk.view(), gv.view(),
                                               gbeta.view(), options);
    } else if (gate_cols == 1 && offsets) {
      linattn::causal_gated_delta_rule_varlen_backward_into(
          q.cview(), k.cview(), v.cview(), log, beta.cview(), go.cview(), *offsets, gq.view(),
          gk.view(), gv.view(), ggates.view(), gbeta.view(), options);
    } else if (gate_cols == 1) {
      linattn::causal_gated_delta_rule_backward_into(
          q.cview(), k.cview(), v.cview(), log, beta.cview(), go.cview(), gq.view(), gk.view(),
          gv.view(), ggates.view(), gbeta.view(), options);
    } else if (offsets) {
      linattn::causal_gated_delta_rule_varlen_backward_into(
          q.cview(), k.cview(), v.cview(), gates.cview(), beta.cview(), go.cview(), *offsets,
          gq.view(), gk.view(), gv.view(), ggates.view(), gbeta.view(), options);
    } else {
      linattn::causal_gated_delta_rule_backward_into(
          q.cview(), k.cview(), v.cview(), gates.cview(), beta.cview(), go.cview(), gq.view(),
          gk.view(), gv.view(), ggates.view(), gbeta.view(), options);
    }
  }

  /// What the view backward must write: the matrix backward on the rows [begin, begin + rows)
  /// of each output head's maps, input heads' gradients summed in increasing h, in T.
  struct Expected {
    std::vector<Matrix<T>> q, k, v, beta, gates;  // per (b, input head)
  };
  Expected expected(const std::vector<std::int64_t>& bounds, const DeltaOptions& options) const {
    const Eigen::Index per_gate = heads / gates.heads();
    Expected e;
    const auto slot = [](std::vector<Matrix<T>>& list, Eigen::Index index,
                         const Heads<T>& shape) -> Matrix<T>& {
      if (list.size() <= static_cast<std::size_t>(index)) {
        list.resize(static_cast<std::size_t>(index) + 1);
      }
      Matrix<T>& m = list[static_cast<std::size_t>(index)];
      if (m.size() == 0) m = Matrix<T>::Zero(shape.head(0, 0).rows(), shape.dim());
      return m;
    };
    for (Eigen::Index b = 0; b < batch; ++b) {
      for (Eigen::Index h = 0; h < heads; ++h) {
        const Eigen::Index hg = h / per_gate;
        for (std::size_t part = 0; part + 1 < bounds.size(); ++part) {
          const Eigen::Index begin = bounds[part], rows = bounds[part + 1] - begin;
          if (rows == 0) continue;
          const Matrix<T> qh = q.head(b, qk_head(h)).middleRows(begin, rows);
          const Matrix<T> kh = k.head(b, qk_head(h)).middleRows(begin, rows);
          const Matrix<T> vh = v.head(b, h).middleRows(begin, rows);
          const Vector<T> bh = beta.head(b, h).middleRows(begin, rows).col(0);
          const Matrix<T> gh = gates.head(b, hg).middleRows(begin, rows);
          const Matrix<T> oh = go.head(b, h).middleRows(begin, rows);
          DeltaRuleGradients<T> g;
          if (gate_cols == 0) {
            g = linattn::causal_delta_rule_backward(qh, kh, vh, bh, oh, options);
          } else if (gate_cols == 1) {
            g = linattn::causal_gated_delta_rule_backward(qh, kh, vh, linattn::log_gates(gh), bh,
                                                          oh, options);
          } else {
            g = linattn::causal_gated_delta_rule_backward(qh, kh, vh, gh, bh, oh, options);
          }
          const auto put = [&](std::vector<Matrix<T>>& list, Eigen::Index index,
                               const Heads<T>& shape, const Matrix<T>& grad, bool add) {
            auto rows_of = slot(list, index, shape).middleRows(begin, rows);
            if (add) {
              rows_of += grad;
            } else {
              rows_of = grad;
            }
          };
          put(e.q, b * q.heads() + qk_head(h), q, g.q, !first_reader(h));
          put(e.k, b * k.heads() + qk_head(h), k, g.k, !first_reader(h));
          put(e.v, b * heads + h, v, g.v, false);
          put(e.beta, b * heads + h, beta, Matrix<T>(g.beta), false);
          if (gate_cols > 0)
            put(e.gates, b * gates.heads() + hg, gates, g.gates, h % per_gate != 0);
        }
      }
    }
    return e;
  }

  /// Every gradient head equals the expected one bit for bit, and the gaps hold the sentinel.
  bool matches(const Expected& e) const {
    bool ok = true;
    const auto compare = [&](const Heads<T>& grad, const std::vector<Matrix<T>>& list) {
      for (Eigen::Index b = 0; b < batch; ++b) {
        for (Eigen::Index h = 0; h < grad.heads(); ++h) {
          const std::size_t index = static_cast<std::size_t>(b * grad.heads() + h);
          if (index >= list.size() || list[index].size() == 0) continue;
          const bool same = grad.head(b, h) == list[index];
          if (!same) {
            UNSCOPED_INFO("head (" << b << ", " << h << ") differs by "
                                   << relative_error(grad.head(b, h), list[index]));
          }
          ok = ok && same;
        }
      }
      ok = ok && grad.gaps_hold(kSentinel<T>);
    };
    compare(gq, e.q);
    compare(gk, e.k);
    compare(gv, e.v);
    compare(gbeta, e.beta);
    if (gate_cols > 0) compare(ggates, e.gates);
    return ok;
  }
};

}  // namespace

TEST_CASE("the delta rule's backward matches central finite differences of the forward",
          "[delta_rule_backward]") {
  // N not a multiple of the chunk, Dk != Dv, resets mid-sequence; every input differentiated.
  const Eigen::Index n = 37, dk = 8, dv = 5;
  double worst = 0.0;
  for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
    for (const bool l2 : {false, true}) {
      for (const double scale : {-1.0, 0.7}) {
        CAPTURE(variant_name(gate_cols), l2, scale);
        Inputs in(n, dk, dv, gate_cols, l2, 100 + static_cast<std::uint64_t>(gate_cols));
        add_resets(in, 20);
        const Matrix<double> grad_out = gaussian<double>(n, dv, 7);
        DeltaOptions options;
        options.chunk = 16;
        options.l2_normalize = l2;
        options.scale = scale;
        // Step 1e-5 (1 + |x|): measured errors 3.5e-10 at most, 3.8e-9 at 1e-6 (rounding of the
        // loss over the step), 5e-9 at 1e-4 (the h^2 term); a wrong term errs by O(1).
        const DeltaRuleGradients<double> fd = finite_differences(in, grad_out, options, 1e-5);
        const DeltaRuleGradients<double> got = backward<double>(in, grad_out, options);
        const double error = gradient_error(got, fd);
        CHECK(error <= 1e-6);
        worst = std::max(worst, error);
        // No gradient reaches a reset's log gate: nothing depends on it near -inf.
        for (Eigen::Index r = 0; r < n; ++r) {
          for (Eigen::Index c = 0; c < gate_cols; ++c) {
            if (in.log_gates(r, c) == kMinusInf) CHECK(got.gates(r, c) == 0.0);
          }
        }
      }
    }
  }
  WARN("largest relative error against finite differences: " << worst);
}

TEST_CASE("the delta rule's backward for gates a_t: finite differences and dg = da a",
          "[delta_rule_backward]") {
  const Eigen::Index n = 37, dk = 8, dv = 6;
  for (const Eigen::Index gate_cols : {Eigen::Index{1}, dk}) {
    CAPTURE(variant_name(gate_cols));
    const Inputs in(n, dk, dv, gate_cols, true, 300);
    const Matrix<double> a = in.log_gates.array().exp().matrix();
    const Matrix<double> grad_out = gaussian<double>(n, dv, 8);
    DeltaOptions options;
    options.chunk = 16;
    options.l2_normalize = true;
    const auto by_a =
        linattn::causal_gated_delta_rule_backward(in.q, in.k, in.v, a, in.beta, grad_out, options);
    const auto by_log = linattn::causal_gated_delta_rule_backward(
        in.q, in.k, in.v, linattn::log_gates(in.log_gates), in.beta, grad_out, options);
    // The chain rule through a = exp(g); the other gradients agree up to the rounding of a.
    CHECK(relative_error((by_a.gates.array() * a.array()).matrix(), by_log.gates) <= 1e-13);
    CHECK(relative_error(by_a.q, by_log.q) <= 1e-13);
    CHECK(relative_error(by_a.k, by_log.k) <= 1e-13);
    CHECK(relative_error(by_a.v, by_log.v) <= 1e-13);
    CHECK(relative_error(by_a.beta, by_log.beta) <= 1e-13);
    // d L / d a_t by central differences on a_t (a + h stays <= 1: a <= exp(-0.01)).
    Matrix<double> shifted = a;
    Matrix<double> fd(n, gate_cols);
    const double h = 1e-6;  // measured error 8e-9 at 1e-7
    for (Eigen::Index r = 0; r < n; ++r) {
      for (Eigen::Index c = 0; c < gate_cols; ++c) {
        const double keep = shifted(r, c);
        shifted(r, c) = keep + h;
        const double up =
            (linattn::causal_gated_delta_rule(in.q, in.k, in.v, shifted, in.beta, options).array() *
             grad_out.array())
                .sum();
        shifted(r, c) = keep - h;
        const double down =
            (linattn::causal_gated_delta_rule(in.q, in.k, in.v, shifted, in.beta, options).array() *
             grad_out.array())
                .sum();
        shifted(r, c) = keep;
        fd(r, c) = (up - down) / (2.0 * h);
      }
    }
    CHECK(relative_error(by_a.gates, fd) <= 1e-6);
  }
}

TEMPLATE_TEST_CASE("the delta rule's backward matches a naive reverse mode over every state",
                   "[delta_rule_backward]", float, double) {
  const Eigen::Index dk = 32, dv = 24;
  double worst = 0.0;
  for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
    for (const bool l2 : {false, true}) {
      for (const Eigen::Index chunk : {Eigen::Index{16}, Eigen::Index{64}}) {
        for (const Eigen::Index n : {Eigen::Index{1}, Eigen::Index{37}, Eigen::Index{200}}) {
          CAPTURE(variant_name(gate_cols), l2, chunk, n);
          Inputs in(n, dk, dv, gate_cols, l2, 40 + static_cast<std::uint64_t>(n));
          if (n > 30) add_resets(in, n / 2);
          // Inputs rounded to T first: the reference runs on what the library sees.
          in.q = in.q.cast<TestType>().template cast<double>();
          in.k = in.k.cast<TestType>().template cast<double>();
          in.v = in.v.cast<TestType>().template cast<double>();
          in.beta = in.beta.cast<TestType>().template cast<double>();
          in.log_gates = in.log_gates.cast<TestType>().template cast<double>();
          const Matrix<double> grad_out =
              gaussian<double>(n, dv, 9).cast<TestType>().template cast<double>();
          DeltaOptions options;
          options.chunk = chunk;
          options.l2_normalize = l2;
          const DeltaRuleGradients<double> expected =
              naive_backward(in, grad_out, 1.0 / std::sqrt(double(dk)), l2);
          const double error = gradient_error(backward<TestType>(in, grad_out, options), expected);
          CHECK(error <= bound<TestType>());
          worst = std::max(worst, error);
        }
      }
    }
  }
  WARN("largest relative error against the naive reverse mode: " << worst);
}

TEMPLATE_TEST_CASE("the delta rule's backward with beta at 1 and at 2 (negative eigenvalues)",
                   "[delta_rule_backward]", float, double) {
  const Eigen::Index dk = 16, dv = 12;
  for (const double beta : {1.0, 2.0}) {
    for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
      CAPTURE(beta, variant_name(gate_cols));
      Inputs in(130, dk, dv, gate_cols, true, 500);
      in.beta.setConstant(beta);
      in.q = in.q.cast<TestType>().template cast<double>();
      in.k = in.k.cast<TestType>().template cast<double>();
      in.v = in.v.cast<TestType>().template cast<double>();
      in.log_gates = in.log_gates.cast<TestType>().template cast<double>();
      const Matrix<double> grad_out =
          gaussian<double>(130, dv, 10).cast<TestType>().template cast<double>();
      DeltaOptions options;
      options.allow_negative_eigenvalues = beta > 1.0;
      options.l2_normalize = true;
      options.chunk = 32;
      const DeltaRuleGradients<double> expected = naive_backward(in, grad_out, 0.25, true);
      CHECK(gradient_error(backward<TestType>(in, grad_out, options), expected) <=
            bound<TestType>());
    }
  }
}

TEMPLATE_TEST_CASE(
    "the delta rule's chunked backward: resets anywhere in a chunk, gates a_t, threads, and "
    "the recurrent form it replaced",
    "[delta_rule_backward]", float, double) {
  using T = TestType;
  const Eigen::Index n = 70, dk = 16, dv = 64;  // two parts of 32 value columns on 2 threads
  // Resets (log gates only: a_t lies in (0, 1]) at the sequence's first token, a chunk's first
  // (16, 48), mid-chunk (21), twice in a row (40, 41) and the last token.
  const Eigen::Index resets[] = {0, 16, 21, 40, 41, 48, 69};
  for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
    for (const bool by_gate : {false, true}) {
      if (gate_cols == 0 && by_gate) continue;
      CAPTURE(variant_name(gate_cols), by_gate);
      Inputs in(n, dk, dv, gate_cols, true, 1300);
      if (gate_cols > 0 && !by_gate) {
        for (const Eigen::Index r : resets) in.log_gates.row(r).setConstant(kMinusInf);
      }
      if (gate_cols > 1) {
        // KDA: features that decay by e^-3 a token (a sub-block of 16 spreads past e^20 and
        // takes its pairs one by one) and partial resets (two features of tokens 5 and 30).
        in.log_gates.leftCols(4) = (in.log_gates.leftCols(4).array() == kMinusInf)
                                       .select(kMinusInf, in.log_gates.leftCols(4).array() - 3.0);
        if (!by_gate) {
          for (const Eigen::Index r : {Eigen::Index{5}, Eigen::Index{30}}) {
            in.log_gates(r, 2) = kMinusInf;
            in.log_gates(r, 9) = kMinusInf;
          }
        }
      }
      in.q = in.q.cast<T>().template cast<double>();
      in.k = in.k.cast<T>().template cast<double>();
      in.v = in.v.cast<T>().template cast<double>();
      in.beta = in.beta.cast<T>().template cast<double>();
      // a_t = exp(g) rounded to T, and g = log a_t, so that both runs see the same gates.
      const Matrix<T> a =
          in.log_gates.unaryExpr([](double x) { return std::exp(x); }).template cast<T>();
      in.log_gates = a.template cast<double>().unaryExpr([](double x) { return std::log(x); });
      const Matrix<double> grad_out = gaussian<double>(n, dv, 13).cast<T>().template cast<double>();
      DeltaOptions options;
      options.chunk = 16;
      options.l2_normalize = true;
      const DeltaRuleGradients<double> expected =
          naive_backward(in, grad_out, 1.0 / std::sqrt(double(dk)), true, by_gate);
      const auto run = [&](linattn::DeltaForm form, int threads) {
        DeltaOptions o = options;
        o.form = form;
        o.threads = threads;
        if (!by_gate) return backward<T>(in, grad_out, o);
        const DeltaRuleGradients<T> g = linattn::causal_gated_delta_rule_backward(
            in.q.cast<T>(), in.k.cast<T>(), in.v.cast<T>(), a, in.beta.cast<T>(),
            grad_out.cast<T>(), o);
        return DeltaRuleGradients<double>{
            g.q.template cast<double>(), g.k.template cast<double>(), g.v.template cast<double>(),
            g.beta.template cast<double>(), g.gates.template cast<double>()};
      };
      const auto chunked = run(linattn::DeltaForm::chunked, 1);
      const auto recurrent = run(linattn::DeltaForm::streamed, 1);
      CHECK(gradient_error(chunked, expected) <= bound<T>());
      CHECK(gradient_error(recurrent, expected) <= bound<T>());
      CHECK(gradient_error(chunked, recurrent) <= bound<T>());
      // A reset's gradient is 0 (it has no neighbourhood in log space).
      if (gate_cols > 0 && !by_gate) {
        CHECK(
            ((in.log_gates.array() == kMinusInf).select(chunked.gates.array(), 0.0) == 0.0).all());
      }
      // Two threads split the value columns: their key gradients add, to rounding.
      const auto threaded = run(linattn::DeltaForm::chunked, 2);
      CHECK(gradient_error(threaded, chunked) <= bound<T>() / 10);
    }
  }
}

TEST_CASE("the delta rule's backward over N = 2000 tokens matches the naive reverse mode",
          "[delta_rule_backward]") {
  const Eigen::Index n = 2000, dk = 32, dv = 16;
  for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
    CAPTURE(variant_name(gate_cols));
    Inputs in(n, dk, dv, gate_cols, true, 700);
    add_resets(in, 1234);
    const Matrix<double> grad_out = gaussian<double>(n, dv, 11);
    DeltaOptions options;
    options.l2_normalize = true;  // chunk 64: 32 checkpoints, the last block 16 tokens
    const DeltaRuleGradients<double> expected =
        naive_backward(in, grad_out, 1.0 / std::sqrt(double(dk)), true);
    CHECK(gradient_error(backward<double>(in, grad_out, options), expected) <= 1e-10);
  }
}

TEST_CASE("the delta rule's backward: chunk, layouts, _into and the accumulation type",
          "[delta_rule_backward]") {
  const Eigen::Index n = 45, dk = 12, dv = 10;
  const Inputs in(n, dk, dv, dk, true, 900);
  const Matrix<double> grad_out = gaussian<double>(n, dv, 12);
  DeltaOptions options;
  options.l2_normalize = true;
  const auto reference = backward<double>(in, grad_out, options);
  // The checkpoint interval changes the work, not the result (1: a state per token).
  for (const Eigen::Index chunk : {Eigen::Index{1}, Eigen::Index{7}, n, Eigen::Index{1000}}) {
    CAPTURE(chunk);
    DeltaOptions other = options;
    other.chunk = chunk;
    CHECK(gradient_error(backward<double>(in, grad_out, other), reference) <= 1e-12);
  }
  // Column-major inputs, a row vector of beta, transposed expressions and Maps.
  const Eigen::MatrixXd q_cols = in.q;
  const Eigen::MatrixXd k_transposed = in.k.transpose();
  const Eigen::RowVectorXd beta_row = in.beta.transpose();
  const Eigen::Map<const Matrix<double>> v_map(in.v.data(), n, dv);
  const Eigen::MatrixXd g_cols = in.log_gates;
  const auto mixed = linattn::causal_gated_delta_rule_backward(
      q_cols, k_transposed.transpose(), v_map, linattn::log_gates(g_cols), beta_row,
      grad_out.leftCols(dv), options);
  CHECK(gradient_error({mixed.q, mixed.k, mixed.v, mixed.beta, mixed.gates}, reference) <= 1e-13);
  // _into writes exactly what the returning form returns.
  Matrix<double> gq(n, dk), gk(n, dk), gv(n, dv), gg(n, dk);
  Vector<double> gb(n);
  linattn::causal_gated_delta_rule_backward_into(in.q, in.k, in.v, linattn::log_gates(in.log_gates),
                                                 in.beta, grad_out, gq, gk, gv, gg, gb, options);
  CHECK((gq.array() == reference.q.array()).all());
  CHECK((gk.array() == reference.k.array()).all());
  CHECK((gv.array() == reference.v.array()).all());
  CHECK((gg.array() == reference.gates.array()).all());
  CHECK((gb.array() == reference.beta.array()).all());
  // DeltaNet returns empty gates, N x 0.
  const Inputs plain(n, dk, dv, 0, true, 901);
  const auto net =
      linattn::causal_delta_rule_backward(plain.q, plain.k, plain.v, plain.beta, grad_out, options);
  CHECK(net.gates.rows() == n);
  CHECK(net.gates.cols() == 0);
  // Float inputs accumulated in double: the float rounding of the gradients only, far below
  // float accumulation's error.
  Inputs rounded = in;
  rounded.q = in.q.cast<float>().cast<double>();
  rounded.k = in.k.cast<float>().cast<double>();
  rounded.v = in.v.cast<float>().cast<double>();
  rounded.beta = in.beta.cast<float>().cast<double>();
  rounded.log_gates = in.log_gates.cast<float>().cast<double>();
  const Matrix<double> rounded_out = grad_out.cast<float>().cast<double>();
  const auto expected = naive_backward(rounded, rounded_out, 1.0 / std::sqrt(double(dk)), true);
  const double in_double =
      gradient_error(backward<float, double>(rounded, rounded_out, options), expected);
  const double in_float = gradient_error(backward<float>(rounded, rounded_out, options), expected);
  CAPTURE(in_double, in_float);
  CHECK(in_double <= 1e-6);
  CHECK(in_double < in_float);
}

TEMPLATE_TEST_CASE(
    "the delta rule's backward with a workspace gives the allocating call's "
    "gradients, bit for bit, and holds the size it documents",
    "[delta_rule_backward][workspace]", float, double) {
  using T = TestType;
  constexpr Eigen::Index dk = 12, dv = 10;
  linattn::DeltaBackwardWorkspace<T> workspace;
  // Lengths that grow, shrink and grow again, every variant, with and without the norm: one
  // workspace serves each call.
  for (const Eigen::Index n : {300, 20, 1, 700}) {
    for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
      for (const bool l2 : {false, true}) {
        const auto seed = static_cast<std::uint64_t>(1000 + n + 10 * gate_cols);
        const Inputs in(n, dk, dv, gate_cols, l2, seed);
        const Matrix<T> q = in.q.cast<T>(), k = in.k.cast<T>(), v = in.v.cast<T>();
        const Matrix<T> g = in.log_gates.cast<T>();
        const Vector<T> beta = in.beta.cast<T>();
        const Matrix<T> grad_out = gaussian<double>(n, dv, seed + 9).cast<T>();
        DeltaOptions options;
        options.l2_normalize = l2;
        options.threads = 1;
        Matrix<T> gq(n, dk), gk(n, dk), gv(n, dv), gg(n, std::max<Eigen::Index>(gate_cols, 1));
        Vector<T> gb(n);
        DeltaRuleGradients<T> want;
        if (gate_cols == 0) {
          want = linattn::causal_delta_rule_backward(q, k, v, beta, grad_out, options);
          linattn::causal_delta_rule_backward_into(q, k, v, beta, grad_out, gq, gk, gv, gb, options,
                                                   workspace);
        } else {
          want = linattn::causal_gated_delta_rule_backward(q, k, v, linattn::log_gates(g), beta,
                                                           grad_out, options);
          linattn::causal_gated_delta_rule_backward_into(q, k, v, linattn::log_gates(g), beta,
                                                         grad_out, gq, gk, gv, gg, gb, options,
                                                         workspace);
          CHECK((gg.array() == want.gates.array()).all());
        }
        INFO("N = " << n << ", " << variant_name(gate_cols) << ", l2_normalize " << l2);
        CHECK((gq.array() == want.q.array()).all());
        CHECK((gk.array() == want.k.array()).all());
        CHECK((gv.array() == want.v.array()).all());
        CHECK((gb.array() == want.beta.array()).all());
        // What it holds is the documented size of this call's shape, to the byte.
        CHECK(workspace.held_bytes() ==
              linattn::DeltaBackwardWorkspace<T>::bytes(n, dk, dv, gate_cols, options));
      }
    }
  }
  // The chunked form (one thread, chunk 64): the chunks' starting states and N rows of U and
  // of the in-chunk pairs, (N / 64 + N / 128 + N / 256) Dk Dv, dominate; one chunk's rows and
  // products (about 64 x 27 D) and three states more are the rest.
  DeltaOptions one;
  one.threads = 1;
  const std::size_t big = linattn::DeltaBackwardWorkspace<T>::bytes(65536, 128, 128, 1, one);
  CHECK(big >= sizeof(T) * (1024 + 512 + 256) * 128 * 128);
  CHECK(big <= sizeof(T) * (1024 + 512 + 256 + 3 + 14) * 128 * 128);
  // The recurrent form (DeltaForm::streamed): the checkpoints and one block's states,
  // 2 sqrt(N) Dk Dv, dominate; one block's rows (L x about 8 D) and two states more are the
  // rest.
  DeltaOptions recurrent = one;
  recurrent.form = linattn::DeltaForm::streamed;
  const std::size_t small =
      linattn::DeltaBackwardWorkspace<T>::bytes(65536, 128, 128, 1, recurrent);
  CHECK(small >= sizeof(T) * 2 * 256 * 128 * 128);
  CHECK(small <= sizeof(T) * (2 * 256 + 2 + 17) * 128 * 128);
}

TEST_CASE("the delta rule's backward takes 16-bit inputs and accumulates in float",
          "[delta_rule_backward]") {
  const Eigen::Index n = 60, dk = 16, dv = 16;
  Inputs in(n, dk, dv, 1, true, 1100);
  using Half = Eigen::half;
  using Brain = Eigen::bfloat16;
  const Matrix<double> grad_out = gaussian<double>(n, dv, 13);
  DeltaOptions options;
  options.l2_normalize = true;
  options.chunk = 16;
  // Against the float backward on the same (rounded) inputs: the difference is the rounding of
  // the gradients to 16 bits (2^-11 for half, 2^-8 for bfloat16, relative).
  const auto check = [&](auto zero, double limit) {
    using H = decltype(zero);
    Inputs rounded = in;
    rounded.q = in.q.cast<H>().template cast<double>();
    rounded.k = in.k.cast<H>().template cast<double>();
    rounded.v = in.v.cast<H>().template cast<double>();
    rounded.beta = in.beta.cast<H>().template cast<double>();
    rounded.log_gates = in.log_gates.cast<H>().template cast<double>();
    const Matrix<double> rounded_out = grad_out.cast<H>().template cast<double>();
    const auto reference = backward<float>(rounded, rounded_out, options);
    const double error = gradient_error(backward<H>(rounded, rounded_out, options), reference);
    CHECK(error <= limit);
  };
  check(Half(0), 1e-3);
  check(Brain(0), 8e-3);
}

TEST_CASE("the delta rule's backward rejects bad input and writes nothing",
          "[delta_rule_backward]") {
  const Eigen::Index n = 20, dk = 8, dv = 4;
  const Inputs in(n, dk, dv, 1, false, 3);
  const Matrix<double>& q = in.q;
  const Matrix<double>& k = in.k;
  const Matrix<double>& v = in.v;
  const Vector<double>& beta = in.beta;
  const Matrix<double>& g = in.log_gates;
  const Matrix<double> grad_out = gaussian<double>(n, dv, 14);
  Matrix<double> gq = Matrix<double>::Constant(n, dk, 7.0);
  Matrix<double> gk = gq, gv = Matrix<double>::Constant(n, dv, 7.0);
  Matrix<double> gg = Matrix<double>::Constant(n, 1, 7.0);
  Vector<double> gb = Vector<double>::Constant(n, 7.0);
  const auto unchanged = [&] {
    return (gq.array() == 7.0).all() && (gk.array() == 7.0).all() && (gv.array() == 7.0).all() &&
           (gg.array() == 7.0).all() && (gb.array() == 7.0).all();
  };
  using Catch::Matchers::Contains;
  // Each call of the two entry points with one argument replaced.
  const auto delta = [&](const auto& q_, const auto& k_, const auto& v_, const auto& beta_,
                         const auto& grad_out_, const DeltaOptions& options = {}) {
    linattn::causal_delta_rule_backward_into(q_, k_, v_, beta_, grad_out_, gq, gk, gv, gb, options);
  };
  const auto gated = [&](const auto& gates, const auto& beta_, const auto& grad_out_,
                         const DeltaOptions& options = {}) {
    linattn::causal_gated_delta_rule_backward_into(q, k, v, gates, beta_, grad_out_, gq, gk, gv, gg,
                                                   gb, options);
  };
  // grad_out: the wrong shape, a NaN (only scanned under check_finite).
  CHECK_THROWS_WITH(
      delta(q, k, v, beta, grad_out.topRows(19)),
      Contains("causal_delta_rule_backward") && Contains("grad_out is 19 x 4 but v is 20 x 4"));
  CHECK_THROWS_WITH(gated(linattn::log_gates(g), beta, grad_out.leftCols(3)),
                    Contains("causal_gated_delta_rule_backward") && Contains("grad_out is 20 x 3"));
  Matrix<double> bad_out = grad_out;
  bad_out(11, 2) = std::nan("");
  CHECK_THROWS_WITH(delta(q, k, v, beta, bad_out),
                    Contains("grad_out has a non-finite value") && Contains("row 11, column 2"));
  CHECK_THROWS_WITH(gated(linattn::log_gates(g), beta, bad_out), Contains("grad_out"));
  CHECK(unchanged());
  // beta out of range (1.5 is in range with negative eigenvalues), NaN, the wrong size.
  Vector<double> bad_beta = beta;
  bad_beta(5) = 1.5;
  CHECK_THROWS_WITH(delta(q, k, v, bad_beta, grad_out),
                    Contains("beta must lie in (0, 1]") && Contains("token 5"));
  CHECK_THROWS_WITH(gated(linattn::log_gates(g), bad_beta, grad_out), Contains("token 5"));
  bad_beta(5) = std::nan("");
  DeltaOptions negative;
  negative.allow_negative_eigenvalues = true;
  CHECK_THROWS_WITH(delta(q, k, v, bad_beta, grad_out, negative),
                    Contains("beta must lie in (0, 2]"));
  CHECK_THROWS_WITH(delta(q, k, v, beta.head(19), grad_out), Contains("beta is 19 x 1"));
  CHECK(unchanged());
  // Gates: > 0 in log space, > 1 as a_t, the wrong width.
  Matrix<double> bad_g = g;
  bad_g(3, 0) = 0.1;
  CHECK_THROWS_WITH(gated(linattn::log_gates(bad_g), beta, grad_out),
                    Contains("gates (log gates) must be <= 0") && Contains("row 3"));
  CHECK_THROWS_WITH(gated((g.array().exp() + 0.5).matrix(), beta, grad_out),
                    Contains("gates must lie in (0, 1]"));
  CHECK_THROWS_WITH(gated(linattn::log_gates(Matrix<double>::Zero(n, 3)), beta, grad_out),
                    Contains("gates is 20 x 3 but q is 20 x 8"));
  CHECK(unchanged());
  // Inputs: NaN in q (not with check_finite off), shapes, options.
  Matrix<double> bad_q = q;
  bad_q(2, 1) = std::nan("");
  CHECK_THROWS_WITH(delta(bad_q, k, v, beta, grad_out), Contains("q has a non-finite value"));
  CHECK_THROWS_WITH(delta(q, k.topRows(19), v, beta, grad_out), Contains("k is 19 x 8"));
  CHECK_THROWS_WITH(delta(q, k, v.topRows(19), beta, grad_out), Contains("v is 19 x 4"));
  DeltaOptions bad_chunk;
  bad_chunk.chunk = 0;
  CHECK_THROWS_WITH(delta(q, k, v, beta, grad_out, bad_chunk), Contains("DeltaOptions::chunk"));
  DeltaOptions bad_scale;
  bad_scale.scale = 0.0;
  CHECK_THROWS_WITH(delta(q, k, v, beta, grad_out, bad_scale), Contains("scale"));
  CHECK(unchanged());
  // The gradients' shapes, each named.
  Matrix<double> small(n, dk - 1);
  Vector<double> short_beta(n - 1);
  Matrix<double> wide_gates(n, dk);
  CHECK_THROWS_WITH(
      linattn::causal_delta_rule_backward_into(q, k, v, beta, grad_out, small, gk, gv, gb),
      Contains("grad_q is 20 x 7 but the gradient is 20 x 8"));
  CHECK_THROWS_WITH(
      linattn::causal_delta_rule_backward_into(q, k, v, beta, grad_out, gq, small, gv, gb),
      Contains("grad_k is 20 x 7"));
  CHECK_THROWS_WITH(
      linattn::causal_delta_rule_backward_into(q, k, v, beta, grad_out, gq, gk, small, gb),
      Contains("grad_v is 20 x 7 but the gradient is 20 x 4"));
  CHECK_THROWS_WITH(
      linattn::causal_delta_rule_backward_into(q, k, v, beta, grad_out, gq, gk, gv, short_beta),
      Contains("grad_beta is 19 x 1 but the gradient is 20 x 1"));
  CHECK_THROWS_WITH(linattn::causal_gated_delta_rule_backward_into(
                        q, k, v, linattn::log_gates(g), beta, grad_out, gq, gk, gv, wide_gates, gb),
                    Contains("grad_gates is 20 x 8 but the gradient is 20 x 1"));
  CHECK(unchanged());
  // The same inputs are accepted: the checks above reject the one bad argument, nothing else.
  DeltaOptions unchecked;
  unchecked.check_finite = false;
  CHECK_NOTHROW(delta(q, k, v, beta, bad_out, unchecked));
  CHECK_NOTHROW(gated(linattn::log_gates(g), beta, grad_out));
  CHECK_FALSE(unchanged());
}

TEMPLATE_TEST_CASE(
    "the delta rule's backward on heads: the matrix backward per head, grouped "
    "heads summed, the same on two threads",
    "[delta_rule_backward][heads]", float, double) {
  using T = TestType;
  const Eigen::Index batch = 2, heads = 4, n = 29, dk = 8, dv = 6;
  for (const Layout layout : {Layout::bhnd, Layout::bnhd, Layout::padded}) {
    for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
      // Gates per value head (FLA's [B, T, HV]): sharing them between heads is refused.
      const Eigen::Index gate_heads = heads;
      CAPTURE(linattn_test::layout_name(layout), variant_name(gate_cols));
      ViewProblem<T> p(layout, batch, heads, n, dk, dv, gate_cols, gate_heads, 500);
      DeltaOptions options;
      options.chunk = 8;
      options.l2_normalize = true;
      options.threads = 1;
      p.run(options);
      CHECK(p.matches(p.expected({0, n}, options)));
      // Two threads split the (sequence, group) items, never a head or a sum: the same bits.
      const std::vector<T> one = p.gq.data(), one_gates = p.ggates.data();
      options.threads = 2;
      p.run(options);
      CHECK(p.gq.data() == one);
      CHECK(p.ggates.data() == one_gates);
      // Against the naive reverse mode in double, for a head of v, beta and (unshared) gates.
      const Eigen::Index b = 1, h = 3;
      const DeltaRuleGradients<double> naive =
          naive_backward(p.seen_by(b, h), p.grad_out[static_cast<std::size_t>(b * heads + h)],
                         1.0 / std::sqrt(static_cast<double>(dk)), true);
      CHECK(relative_error(p.gv.head(b, h).template cast<double>(), naive.v) <= bound<T>());
      CHECK(relative_error(p.gbeta.head(b, h).col(0).template cast<double>(), naive.beta) <=
            bound<T>());
      if (gate_cols == 1) {
        CHECK(relative_error(p.ggates.head(b, h).template cast<double>(), naive.gates) <=
              bound<T>());
      }
    }
  }
}

TEST_CASE("the delta rule's backward on heads with ggml's tiled grouping sums h % H_k's readers",
          "[delta_rule_backward][heads][grouped]") {
  // Value head h reads q/k head h % (H / 2) (ggml_repeat); the readers of one q/k head are
  // h, h + H / 2, ..., and their gradients are summed in increasing h.
  const Eigen::Index batch = 2, heads = 8, n = 21, dk = 8, dv = 6;
  for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
    CAPTURE(variant_name(gate_cols));
    ViewProblem<double> p(Layout::bnhd, batch, heads, n, dk, dv, gate_cols, heads, 650,
                          linattn::HeadGrouping::tiled);
    DeltaOptions options;
    options.chunk = 8;
    options.l2_normalize = true;
    options.head_grouping = linattn::HeadGrouping::tiled;
    for (const int threads : {1, 2}) {
      options.threads = threads;
      p.run(options);
      CHECK(p.matches(p.expected({0, n}, options)));
    }
    // The same inputs read interleaved give other gradients: the grouping is honoured.
    const std::vector<double> tiled_q = p.gq.data();
    options.head_grouping = linattn::HeadGrouping::interleaved;
    p.run(options);
    CHECK(relative_error(
              Eigen::Map<const Eigen::VectorXd>(p.gq.data().data(), Eigen::Index(tiled_q.size())),
              Eigen::Map<const Eigen::VectorXd>(tiled_q.data(), Eigen::Index(tiled_q.size()))) >
          0.1);
    // Head 5 reads q/k head 1 (5 % 4): its v gradient against the naive reverse mode.
    const DeltaRuleGradients<double> naive =
        naive_backward(p.seen_by(1, 5), p.grad_out[static_cast<std::size_t>(heads + 5)],
                       1.0 / std::sqrt(static_cast<double>(dk)), true);
    options.head_grouping = linattn::HeadGrouping::tiled;
    p.run(options);
    CHECK(relative_error(p.gv.head(1, 5), naive.v) <= 1e-10);
  }
}

TEMPLATE_TEST_CASE(
    "the delta rule's varlen backward: packed sequences, an empty and a "
    "one-token one among them",
    "[delta_rule_backward][heads]", float, double) {
  using T = TestType;
  const Eigen::Index heads = 4, n = 40, dk = 8, dv = 6;
  const std::vector<std::int64_t> offsets = {0, 13, 13, 14, n};
  for (const Eigen::Index gate_cols : {Eigen::Index{0}, Eigen::Index{1}, dk}) {
    CAPTURE(variant_name(gate_cols));
    ViewProblem<T> p(Layout::bnhd, 1, heads, n, dk, dv, gate_cols, heads, 900);
    DeltaOptions options;
    options.chunk = 4;
    options.threads = 2;
    options.l2_normalize = true;  // head 0's keys are raw
    p.run(options, &offsets);
    CHECK(p.matches(p.expected(offsets, options)));
    // The last sequence of head 1 against the naive reverse mode, from its own zero state.
    Inputs last = p.seen_by(0, 1);
    const Eigen::Index begin = 14, rows = n - 14;
    last.q = Matrix<double>(last.q.middleRows(begin, rows));
    last.k = Matrix<double>(last.k.middleRows(begin, rows));
    last.v = Matrix<double>(last.v.middleRows(begin, rows));
    last.beta = Vector<double>(last.beta.segment(begin, rows));
    last.log_gates = Matrix<double>(last.log_gates.middleRows(begin, rows));
    const DeltaRuleGradients<double> naive =
        naive_backward(last, Matrix<double>(p.grad_out[1].middleRows(begin, rows)),
                       1.0 / std::sqrt(static_cast<double>(dk)), true);
    CHECK(relative_error(p.gv.head(0, 1).middleRows(begin, rows).template cast<double>(),
                         naive.v) <= bound<T>());
  }
}

TEST_CASE("the delta rule's backward on heads rejects bad input and writes nothing",
          "[delta_rule_backward][heads]") {
  using Catch::Matchers::Contains;
  using linattn::HeadsView;
  const Eigen::Index heads = 4, n = 12, dk = 8, dv = 6;
  ViewProblem<double> p(Layout::bhnd, 2, heads, n, dk, dv, 1, heads, 70);
  const auto unchanged = [&] {
    for (const Heads<double>* g : {&p.gq, &p.gk, &p.gv, &p.gbeta, &p.ggates}) {
      for (const double x : g->data()) {
        if (x != kSentinel<double>) return false;
      }
    }
    return true;
  };
  const auto log = linattn::log_gates(p.gates.cview());
  // Some heads' keys are raw (|k|^2 ~ 72): the kernel normalises them, so every step is stable.
  const auto gated = [&](const auto& q, const auto& go, const HeadsView<double>& gbeta,
                         const HeadsView<double>& ggates, DeltaOptions options = {}) {
    options.l2_normalize = true;
    linattn::causal_gated_delta_rule_backward_into(q, p.k.cview(), p.v.cview(), log, p.beta.cview(),
                                                   go, p.gq.view(), p.gk.view(), p.gv.view(),
                                                   ggates, gbeta, options);
  };
  // Gradient views of the wrong shape, each named.
  std::vector<double> spare(2 * heads * n * dk, 0.0);
  const auto wide = HeadsView<double>::bhnd(spare.data(), {2, heads, n, 2});
  CHECK_THROWS_WITH(gated(p.q.cview(), p.go.cview(), wide, p.ggates.view()),
                    Contains("causal_gated_delta_rule_backward: grad_beta is [2, 4, 12, 2] but "
                             "beta is [2, 4, 12, 1]"));
  CHECK_THROWS_WITH(gated(p.q.cview(), p.go.cview(), p.gbeta.view(), wide),
                    Contains("grad_gates is [2, 4, 12, 2] but gates is [2, 4, 12, 1]"));
  CHECK_THROWS_WITH(linattn::causal_delta_rule_backward_into(
                        p.q.cview(), p.k.cview(), p.v.cview(), p.beta.cview(), p.go.cview(),
                        p.gk.view(), p.gk.view(), wide, p.gbeta.view()),
                    Contains("grad_v is [2, 4, 12, 2] but v is [2, 4, 12, 6]"));
  // grad_out: heads that q's do not divide, a NaN in one head (named), unless unchecked.
  std::vector<double> odd(2 * 3 * n * dv, 0.0);
  CHECK_THROWS_WITH(gated(p.q.cview(), HeadsView<const double>::bhnd(odd.data(), {2, 3, n, dv}),
                          p.gbeta.view(), p.ggates.view()),
                    Contains("but grad_out is [2, 3, 12, 6]"));
  Heads<double> bad_go = p.go;
  bad_go.view().head(1, 2)(5, 1) = std::nan("");
  CHECK_THROWS_WITH(gated(p.q.cview(), bad_go.cview(), p.gbeta.view(), p.ggates.view()),
                    Contains("grad_out[b=1, h=2]") && Contains("non-finite"));
  // beta out of range in one head, a gate above 0 in log space.
  Heads<double> bad_beta = p.beta;
  bad_beta.view().head(0, 3)(4, 0) = 1.5;
  CHECK_THROWS_WITH(linattn::causal_delta_rule_backward_into(
                        p.q.cview(), p.k.cview(), p.v.cview(), bad_beta.cview(), p.go.cview(),
                        p.gq.view(), p.gk.view(), p.gv.view(), p.gbeta.view()),
                    Contains("beta[b=0, h=3] must lie in (0, 1]"));
  Heads<double> bad_gates = p.gates;
  bad_gates.view().head(1, 0)(2, 0) = 0.25;
  CHECK_THROWS_WITH(linattn::causal_gated_delta_rule_backward_into(
                        p.q.cview(), p.k.cview(), p.v.cview(),
                        linattn::log_gates(bad_gates.cview()), p.beta.cview(), p.go.cview(),
                        p.gq.view(), p.gk.view(), p.gv.view(), p.ggates.view(), p.gbeta.view()),
                    Contains("must be <= 0"));
  // Varlen needs B = 1.
  const std::vector<std::int64_t> offsets = {0, 5, n};
  CHECK_THROWS_WITH(linattn::causal_delta_rule_varlen_backward_into(
                        p.q.cview(), p.k.cview(), p.v.cview(), p.beta.cview(), p.go.cview(),
                        offsets, p.gq.view(), p.gk.view(), p.gv.view(), p.gbeta.view()),
                    Contains("causal_delta_rule_varlen_backward") && Contains("B must be 1"));
  CHECK(unchanged());
  // The same call with the good arguments writes every gradient.
  DeltaOptions unchecked;
  unchecked.check_finite = false;
  CHECK_NOTHROW(gated(p.q.cview(), bad_go.cview(), p.gbeta.view(), p.ggates.view(), unchecked));
  CHECK_FALSE(unchanged());
}

}  // namespace linattn_test_delta_rule_backward
