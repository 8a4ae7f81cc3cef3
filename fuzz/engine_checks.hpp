// SPDX-License-Identifier: MIT
// fuzz_kernels' checks of the linear engine (forward, gated, bonus, backward) on one map,
// instantiated per map by fuzz_kernels_engine.cpp.
#pragma once

#include "kernel_checks.hpp"

namespace linattn_fuzz {

/// Step-by-step RecurrentState<T, Acc> over all rows: through the map, or featurized (map is
/// nullptr).
template <class T, class Acc, class Map, class DQ, class DK>
std::optional<Matrix<T>> run_steps(const Input& in, const Eigen::MatrixBase<DQ>& q,
                                   const Eigen::MatrixBase<DK>& k, const Matrix<T>& v,
                                   const Map* map, Index feature_dim, const Regime& regime,
                                   const char* what) {
  std::optional<linattn::RecurrentState<T, Acc>> state;
  if (!attempt(what, regime.must_succeed, [&] { state.emplace(feature_dim, in.dv, in.options); })) {
    return std::nullopt;
  }
  Matrix<T> out(in.n, in.dv);
  std::optional<linattn::RecurrentState<T, Acc>> loaded;
  for (Index i = 0; i < in.n; ++i) {
    if (i == in.split && i > 0) {
      // Round trip through save/load halfway; the copy must then step identically.
      // Featurized steps save and load with linattn::Identity, the map of features.
      const auto with_map = [&](const auto& f) {
        if constexpr (std::is_same_v<Map, std::nullptr_t>) {
          return f(linattn::Identity{});
        } else {
          return f(*map);
        }
      };
      std::ostringstream os;
      with_map([&](const auto& m) { state->save(os, m); });
      const std::string bytes = os.str();
      std::istringstream is(bytes);
      const auto& held = linattn::detail::StateAccess::held(*state);
      const bool loadable = held.s.allFinite() && held.z.allFinite() &&
                            !std::isnan(held.log_scale) &&
                            held.log_scale != std::numeric_limits<double>::infinity();
      if (attempt("RecurrentState::load of a saved state", loadable, [&] {
            with_map([&](const auto& m) {
              loaded.emplace(linattn::RecurrentState<T, Acc>::load(is, m, in.options));
            });
          })) {
        std::ostringstream again;
        with_map([&](const auto& m) { loaded->save(again, m); });
        if (again.str() != bytes) fail("save -> load -> save changed the bytes");
      }
    }
    bool ok;
    Vector<T> y, y_loaded;
    if constexpr (std::is_same_v<Map, std::nullptr_t>) {
      ok = attempt(what, regime.must_succeed,
                   [&] { y = state->step(q.row(i), k.row(i), v.row(i), linattn::Identity{}); });
      if (ok && loaded) y_loaded = loaded->step(q.row(i), k.row(i), v.row(i), linattn::Identity{});
    } else {
      ok = attempt(what, regime.must_succeed,
                   [&] { y = state->step(q.row(i), k.row(i), v.row(i), *map); });
      if (ok && loaded) y_loaded = loaded->step(q.row(i), k.row(i), v.row(i), *map);
    }
    if (!ok) return std::nullopt;
    if (loaded && !bit_equal(y, y_loaded)) fail("a loaded state steps differently");
    out.row(i) = y.transpose();
  }
  return out;
}

/// Prefill the first `split` rows, then step the rest.
template <class T, class Map, class DQ, class DK>
std::optional<Matrix<T>> run_prefill(const Input& in, const Eigen::MatrixBase<DQ>& q,
                                     const Eigen::MatrixBase<DK>& k, const Matrix<T>& v,
                                     const Map* map, Index feature_dim, const Regime& regime,
                                     const char* what) {
  std::optional<linattn::RecurrentState<T>> state;
  if (!attempt(what, regime.must_succeed, [&] { state.emplace(feature_dim, in.dv, in.options); })) {
    return std::nullopt;
  }
  Matrix<T> out(in.n, in.dv);
  const bool ok = attempt(what, regime.must_succeed, [&] {
    const Index s = in.split;
    if (s > 0) {
      if constexpr (std::is_same_v<Map, std::nullptr_t>) {
        out.topRows(s) =
            state->prefill(q.topRows(s), k.topRows(s), v.topRows(s), linattn::Identity{});
      } else {
        out.topRows(s) = state->prefill(q.topRows(s), k.topRows(s), v.topRows(s), *map);
      }
    }
    for (Index i = s; i < in.n; ++i) {
      if constexpr (std::is_same_v<Map, std::nullptr_t>) {
        out.row(i) = state->step(q.row(i), k.row(i), v.row(i), linattn::Identity{}).transpose();
      } else {
        out.row(i) = state->step(q.row(i), k.row(i), v.row(i), *map).transpose();
      }
    }
    if (state->tokens() != in.n) fail("RecurrentState::tokens() is not the number of tokens");
  });
  if (!ok) return std::nullopt;
  return out;
}

/// The gated kernels on the same inputs: the chunked form against stepping every token and
/// against prefill-then-step, with Options::decay 1 (a decayed call must throw).
template <class T, class Map>
void run_gated(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
               const Map& map, bool positive, bool bounded) {
  const Index c = map.feature_dim(in.dk);
  const Matrix<T> g = draw_log_gates<T>(in, c);
  linattn::Options opt = in.options;
  opt.decay = 1.0;
  // Per-feature gates take plain features, which overflow for FAVOR+ on large inputs.
  constexpr bool exponential = linattn::detail::is_log_scaled<Map>::value;
  const bool must = bounded && in.options_valid && !(exponential && g.cols() > 1);
  const bool check = must && positive;
  const bool agree = check && (!opt.normalize || opt.eps >= 1e-12);
  if (in.options_valid && in.options.decay != 1.0) {
    bool threw = false;
    try {
      linattn::causal_gated_linear_attention(q, k, v, linattn::log_gates(g), map, in.options);
    } catch (const linattn::Error&) {
      threw = true;
    }
    if (!threw) fail("a gated call with Options::decay != 1 did not throw");
  }
  Matrix<T> par, par_abs;
  const bool par_ok = attempt("causal_gated_linear_attention", must, [&] {
    par = linattn::causal_gated_linear_attention(q, k, v, linattn::log_gates(g), map, opt);
  });
  attempt("causal_gated_linear_attention(|v|)", must, [&] {
    par_abs =
        linattn::causal_gated_linear_attention(q, k, v.cwiseAbs(), linattn::log_gates(g), map, opt);
  });
  std::optional<linattn::RecurrentState<T>> state, pieces;
  Matrix<T> steps(in.n, in.dv), split(in.n, in.dv);
  const bool steps_ok = attempt("RecurrentState::step(gate)", must, [&] {
    state.emplace(c, in.dv, opt);
    for (Index i = 0; i < in.n; ++i) {
      steps.row(i) =
          state->step(q.row(i), k.row(i), v.row(i), linattn::log_gates(g.row(i)), map).transpose();
    }
  });
  const bool split_ok = attempt("RecurrentState::prefill(gates)", must, [&] {
    pieces.emplace(c, in.dv, opt);
    const Index s = in.split;
    if (s > 0) {
      split.topRows(s) = pieces->prefill(q.topRows(s), k.topRows(s), v.topRows(s),
                                         linattn::log_gates(g.topRows(s)), map);
    }
    for (Index i = s; i < in.n; ++i) {
      split.row(i) =
          pieces->step(q.row(i), k.row(i), v.row(i), linattn::log_gates(g.row(i)), map).transpose();
    }
  });
  // The same head on the multi-head surfaces: a 1 x 1 x N view (bit for bit the matrix
  // call) and a batch of one state prefilled from it.
  Matrix<T> viewed(in.n, in.dv), batched(in.n, in.dv);
  const linattn::HeadShape qk_shape{1, 1, in.n, in.dk}, v_shape{1, 1, in.n, in.dv};
  const auto qv = linattn::HeadsView<const T>::bhnd(q.data(), qk_shape);
  const auto kv = linattn::HeadsView<const T>::bhnd(k.data(), qk_shape);
  const auto vv = linattn::HeadsView<const T>::bhnd(v.data(), v_shape);
  const auto gv = linattn::HeadsView<const T>::bhnd(g.data(), {1, 1, in.n, g.cols()});
  const bool viewed_ok = attempt("causal_gated_linear_attention_into(views)", must, [&] {
    linattn::causal_gated_linear_attention_into(qv, kv, vv, linattn::log_gates(gv), map,
                                                linattn::HeadsView<T>::bhnd(viewed.data(), v_shape),
                                                opt);
  });
  const bool batched_ok = attempt("RecurrentStateBatch::prefill(gates)", must, [&] {
    linattn::RecurrentStateBatch<T> batch(1, c, in.dv, opt);
    batch.prefill_into(qv, kv, vv, linattn::log_gates(gv), map,
                       linattn::HeadsView<T>::bhnd(batched.data(), v_shape));
  });
  if (par_ok && viewed_ok && !bit_equal(par, viewed)) {
    fail("gated views differ from the gated matrix call");
  }
  if (!check || !par_ok || !steps_ok || !split_ok || !batched_ok) return;
  require_finite("causal_gated_linear_attention", par);
  require_finite("RecurrentState::step(gate)", steps);
  require_finite("RecurrentState::prefill(gates)", split);
  if (!agree) return;
  const double tol = kRelTol<T> * std::max(max_abs(par), max_abs(par_abs)) + 1e-6;
  require_close("gated parallel vs step", par, steps, tol);
  require_close("gated parallel vs prefill+step", par, split, tol);
  require_close("gated parallel vs batch prefill", par, batched, tol);
}

/// RWKV-6's bonus on the same inputs (plain maps only, no normaliser): the chunked form against
/// stepping every token, prefill-then-step, a 1 x 1 view (bit for bit) and a batch prefill.
template <class T, class Map>
void run_bonus(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
               const Map& map, bool positive, bool bounded) {
  if constexpr (!linattn::detail::is_log_scaled<Map>::value) {
    const Index c = map.feature_dim(in.dk);
    const Matrix<T> g = draw_log_gates<T>(in, c);
    Matrix<T> u(1, c);
    for (Index j = 0; j < c; ++j) u(0, j) = static_cast<T>(std::cos(double(j + in.n)));
    linattn::Options opt = in.options;
    opt.decay = 1.0;
    opt.normalize = false;
    const bool must = bounded && in.options_valid;
    Matrix<T> par, steps(in.n, in.dv), split(in.n, in.dv), viewed(in.n, in.dv),
        batched(in.n, in.dv);
    const bool par_ok = attempt("causal_gated_linear_attention(bonus)", must, [&] {
      par = linattn::causal_gated_linear_attention(
          q, k, v, linattn::with_bonus(linattn::log_gates(g), u), map, opt);
    });
    const bool steps_ok = attempt("RecurrentState::step(bonus)", must, [&] {
      linattn::RecurrentState<T> state(c, in.dv, opt);
      for (Index i = 0; i < in.n; ++i) {
        steps.row(i) = state
                           .step(q.row(i), k.row(i), v.row(i),
                                 linattn::with_bonus(linattn::log_gates(g.row(i)), u), map)
                           .transpose();
      }
    });
    const bool split_ok = attempt("RecurrentState::prefill(bonus)", must, [&] {
      linattn::RecurrentState<T> pieces(c, in.dv, opt);
      const Index s = in.split;
      if (s > 0) {
        split.topRows(s) =
            pieces.prefill(q.topRows(s), k.topRows(s), v.topRows(s),
                           linattn::with_bonus(linattn::log_gates(g.topRows(s)), u), map);
      }
      for (Index i = s; i < in.n; ++i) {
        split.row(i) = pieces
                           .step(q.row(i), k.row(i), v.row(i),
                                 linattn::with_bonus(linattn::log_gates(g.row(i)), u), map)
                           .transpose();
      }
    });
    const linattn::HeadShape qk_shape{1, 1, in.n, in.dk}, v_shape{1, 1, in.n, in.dv};
    const auto qv = linattn::HeadsView<const T>::bhnd(q.data(), qk_shape);
    const auto kv = linattn::HeadsView<const T>::bhnd(k.data(), qk_shape);
    const auto vv = linattn::HeadsView<const T>::bhnd(v.data(), v_shape);
    const auto gv = linattn::HeadsView<const T>::bhnd(g.data(), {1, 1, in.n, g.cols()});
    const auto bonus = linattn::with_bonus(linattn::log_gates(gv), u);
    const bool viewed_ok = attempt("causal_gated_linear_attention_into(views, bonus)", must, [&] {
      linattn::causal_gated_linear_attention_into(
          qv, kv, vv, bonus, map, linattn::HeadsView<T>::bhnd(viewed.data(), v_shape), opt);
    });
    const bool batched_ok = attempt("RecurrentStateBatch::prefill(bonus)", must, [&] {
      linattn::RecurrentStateBatch<T> batch(1, c, in.dv, opt);
      batch.prefill_into(qv, kv, vv, bonus, map,
                         linattn::HeadsView<T>::bhnd(batched.data(), v_shape));
    });
    if (par_ok && viewed_ok && !bit_equal(par, viewed)) {
      fail("bonus views differ from the bonus matrix call");
    }
    if (!(must && positive) || !par_ok || !steps_ok || !split_ok || !batched_ok) return;
    require_finite("causal_gated_linear_attention(bonus)", par);
    const double tol = kRelTol<T> * std::max(max_abs(par), max_abs(steps)) + 1e-6;
    require_close("bonus parallel vs step", par, steps, tol);
    require_close("bonus parallel vs prefill+step", par, split, tol);
    require_close("bonus parallel vs batch prefill", par, batched, tol);
  }
}

/// The linear kernels with one map: through the map, and on the features it computes.
template <class T, class Map>
void run_linear(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                const Map& map, bool positive, bool bounded) {
  Regime regime;
  regime.must_succeed = bounded && in.options_valid;
  regime.check = regime.must_succeed && positive;
  regime.agree = regime.check && (!in.options.normalize || in.options.eps >= 1e-12);
  const linattn::Options& opt = in.options;
  const Index c = map.feature_dim(in.dk);

  // The scale the agreement bound is relative to: the same attention over |v| bounds every
  // term of every output (all weights are positive).
  const Matrix<T> v_abs = v.cwiseAbs();

  Matrix<T> par, par_abs, non_causal;
  const bool par_ok = attempt("causal_linear_attention(map)", regime.must_succeed,
                              [&] { par = linattn::causal_linear_attention(q, k, v, map, opt); });
  attempt("causal_linear_attention(map, |v|)", regime.must_succeed,
          [&] { par_abs = linattn::causal_linear_attention(q, k, v_abs, map, opt); });
  const bool nc_ok = attempt("linear_attention(map)", regime.must_succeed,
                             [&] { non_causal = linattn::linear_attention(q, k, v, map, opt); });
  const auto steps = run_steps<T, T>(in, q, k, v, &map, c, regime, "RecurrentState::step(map)");
  // Float inputs with double sums (the Acc template argument): same results, float tolerance.
  constexpr bool widen = std::is_same_v<T, float>;
  Matrix<T> wide_par;
  std::optional<Matrix<T>> wide_steps;
  if constexpr (widen) {
    attempt("causal_linear_attention<double>(map)", regime.must_succeed,
            [&] { wide_par = linattn::causal_linear_attention<double>(q, k, v, map, opt); });
    wide_steps = run_steps<T, double>(in, q, k, v, &map, c, regime,
                                      "RecurrentState<float, double>::step(map)");
  }
  const auto prefill = run_prefill<T>(in, q, k, v, &map, c, regime, "RecurrentState::prefill(map)");

  // Featurized entry points on the map's own features (unscaled for FAVOR+).
  Matrix<T> phi_q, phi_k;
  bool phi_ok = attempt("feature map", regime.must_succeed, [&] {
    phi_q = map.queries(q);
    phi_k = map.keys(k);
  });
  // Unscaled FAVOR+ features overflow float beyond the bounded regime; not a bug.
  phi_ok = phi_ok && (!regime.check || (phi_q.allFinite() && phi_k.allFinite()));
  Matrix<T> fpar, fnon_causal;
  std::optional<Matrix<T>> fsteps, fprefill;
  bool fpar_ok = false;
  if (phi_ok) {
    fpar_ok = attempt("causal_linear_attention(phi)", regime.must_succeed, [&] {
      fpar = linattn::causal_linear_attention(phi_q, phi_k, v, linattn::Identity{}, opt);
    });
    attempt("linear_attention(phi)", regime.must_succeed, [&] {
      fnon_causal = linattn::linear_attention(phi_q, phi_k, v, linattn::Identity{}, opt);
    });
    fsteps = run_steps<T, T, std::nullptr_t>(in, phi_q, phi_k, v, nullptr, c, regime,
                                             "RecurrentState::step(phi)");
    fprefill = run_prefill<T, std::nullptr_t>(in, phi_q, phi_k, v, nullptr, c, regime,
                                              "RecurrentState::prefill(phi)");
  }

  run_gated(in, q, k, v, map, positive, bounded);
  run_bonus(in, q, k, v, map, positive, bounded);

  if (!regime.check) return;
  require_finite("causal_linear_attention(map)", par);
  require_finite("linear_attention(map)", non_causal);
  require_finite("RecurrentState::step(map)", *steps);
  require_finite("RecurrentState::prefill(map)", *prefill);
  if constexpr (widen) {
    require_finite("causal_linear_attention<double>(map)", wide_par);
    require_finite("RecurrentState<float, double>::step(map)", *wide_steps);
  }
  if (phi_ok) {
    require_finite("causal_linear_attention(phi)", fpar);
    require_finite("linear_attention(phi)", fnon_causal);
    require_finite("RecurrentState::step(phi)", *fsteps);
    require_finite("RecurrentState::prefill(phi)", *fprefill);
  }
  if (!regime.agree || !par_ok) return;
  const double tol = kRelTol<T> * std::max(max_abs(par), max_abs(par_abs)) + 1e-6;
  require_close("parallel vs step(map)", par, *steps, tol);
  require_close("parallel vs prefill+step(map)", par, *prefill, tol);
  if constexpr (widen) {
    require_close("parallel vs parallel<double>(map)", par, wide_par, tol);
    require_close("parallel vs RecurrentState<float, double>::step(map)", par, *wide_steps, tol);
  }
  if (fpar_ok) {
    require_close("parallel(map) vs parallel(phi)", par, fpar, tol);
    require_close("parallel vs step(phi)", fpar, *fsteps, tol);
    require_close("parallel vs prefill+step(phi)", fpar, *fprefill, tol);
  }
  if (opt.decay == 1.0 && nc_ok) {
    require_close("linear_attention vs causal, last row", non_causal.bottomRows(1),
                  par.bottomRows(1), tol);
    if (fpar_ok) {
      require_close("linear_attention(phi) vs causal, last row", fnon_causal.bottomRows(1),
                    fpar.bottomRows(1), tol);
    }
  }
}

/// The naive reference of the causal backward and what a comparison with it is relative to:
/// each gradient and the largest term of the sums it is made of (the same recurrence over the
/// inputs' absolute values with every term added), entry by entry where the map's backward
/// needs them.
struct Reference {
  Matrix<double> q, k, v;           ///< d loss / d phi_q, d phi_k (N x C), d loss / d v (N x Dv)
  Matrix<double> q_terms, k_terms;  ///< N x C: the terms d phi_q and d phi_k are sums of
  Matrix<double> gates;             ///< N x G: d loss / d a_t
  Matrix<double> log_gates;         ///< N x G: d loss / d g_t, g_t = log a_t
  double v_terms = 0;               ///< the largest term of d v
  double gate_terms = 0;      ///< the largest term of d a_t as the library sums it (d g_t / a_t)
  double log_gate_terms = 0;  ///< and of d g_t: sum_{s>=t} phi_q o d phi_q - phi_k o d phi_k
  double kappa = 1;        ///< max over rows of (the terms of d_t) / |d_t|: 1 without cancellation
  bool ambiguous = false;  ///< some |d_t| is too near eps for the guard's decision to be sure
};

/// Reverse mode in double over the explicit recurrence, token by token:
///   S_t = diag(a_t) S_{t-1} + phi_k_t^T v_t,  z_t = a_t o z_{t-1} + phi_k_t,
///   out_t = s phi_q_t S_t / guard(s phi_q_t . z_t + eps)  (s phi_q_t S_t without normalize),
/// guard(d) = d for |d| >= eps, else +-eps (then no gradient flows through d). a_t is
/// exp(logs row t) (N x 1 or N x C), or Options::decay where logs is null. `margin`: the
/// relative distance of |d_t| from eps below which the guard's decision is ambiguous (signed
/// features; positive ones keep d_t >= eps in any rounding).
inline Reference naive_backward(const Matrix<double>& p, const Matrix<double>& k,
                                const Matrix<double>& v, const Matrix<double>& grad,
                                const Matrix<double>* logs, const linattn::Options& opt,
                                double margin) {
  using Row = Eigen::RowVectorXd;
  const Index n = p.rows(), c = p.cols(), dv = v.cols();
  const double s = opt.scale, eps = opt.eps;
  const bool signed_features = p.minCoeff() < 0.0 || k.minCoeff() < 0.0;
  Matrix<double> a(n, c);
  for (Index t = 0; t < n; ++t) {
    for (Index j = 0; j < c; ++j) {
      a(t, j) = logs == nullptr ? opt.decay : std::exp((*logs)(t, logs->cols() == 1 ? 0 : j));
    }
  }
  const Matrix<double> pa = p.cwiseAbs(), ka = k.cwiseAbs(), va = v.cwiseAbs();
  const Matrix<double> ga = grad.cwiseAbs();
  // The forward, every S_t and z_t kept (and their absolute counterparts).
  std::vector<Matrix<double>> S(static_cast<std::size_t>(n)), Sa(S.size());
  std::vector<Vector<double>> z(S.size()), za(S.size());
  for (Index t = 0; t < n; ++t) {
    const auto i = static_cast<std::size_t>(t);
    S[i] = k.row(t).transpose() * v.row(t);
    Sa[i] = ka.row(t).transpose() * va.row(t);
    z[i] = k.row(t).transpose();
    za[i] = ka.row(t).transpose();
    if (t > 0) {
      const Vector<double> at = a.row(t).transpose();
      S[i] += at.asDiagonal() * S[i - 1];
      Sa[i] += at.asDiagonal() * Sa[i - 1];
      z[i] += at.cwiseProduct(z[i - 1]);
      za[i] += at.cwiseProduct(za[i - 1]);
    }
  }
  Reference r;
  r.q.resize(n, c);
  r.k.resize(n, c);
  r.v.resize(n, dv);
  r.q_terms.resize(n, c);
  r.k_terms.resize(n, c);
  Matrix<double> v_terms(n, dv), da(n, c), da_terms(n, c);
  Matrix<double> dS = Matrix<double>::Zero(c, dv), dSa = dS;
  Vector<double> dz = Vector<double>::Zero(c), dza = dz;
  for (Index t = n - 1; t >= 0; --t) {
    const auto i = static_cast<std::size_t>(t);
    Row dnum = grad.row(t), dnuma = ga.row(t);
    double dden = 0.0, ddena = 0.0;
    if (opt.normalize) {
      const Row num = s * p.row(t) * S[i];
      const Row numa = s * pa.row(t) * Sa[i];
      const double den = s * p.row(t).dot(z[i].transpose()) + eps;
      const double terms = s * pa.row(t).dot(za[i].transpose()) + eps;
      const bool clamped = !(std::abs(den) >= eps);
      const double d = clamped ? (den < 0.0 ? -eps : eps) : den;
      if (signed_features && std::abs(std::abs(den) - eps) <= margin * terms) r.ambiguous = true;
      if (d == 0.0) {
        dnum.setZero();
        dnuma.setZero();
      } else {
        if (!clamped) r.kappa = std::max(r.kappa, terms / std::abs(d));
        dnum = grad.row(t) / d;
        dnuma = ga.row(t) / std::abs(d);
        if (!clamped) {
          dden = -grad.row(t).dot(num) / (d * d);
          ddena = ga.row(t).dot(numa) / (d * d);
        }
      }
    }
    r.q.row(t) = s * (S[i] * dnum.transpose() + z[i] * dden).transpose();
    r.q_terms.row(t) = s * (Sa[i] * dnuma.transpose() + za[i] * ddena).transpose();
    dS.noalias() += s * p.row(t).transpose() * dnum;
    dSa.noalias() += s * pa.row(t).transpose() * dnuma;
    dz += (s * dden) * p.row(t).transpose();
    dza += (s * ddena) * pa.row(t).transpose();
    r.k.row(t) = (dS * v.row(t).transpose() + dz).transpose();
    r.k_terms.row(t) = (dSa * va.row(t).transpose() + dza).transpose();
    r.v.row(t) = k.row(t) * dS;
    v_terms.row(t) = ka.row(t) * dSa;
    for (Index j = 0; j < c; ++j) {
      da(t, j) = t == 0 ? 0.0 : dS.row(j).dot(S[i - 1].row(j)) + dz(j) * z[i - 1](j);
      da_terms(t, j) = t == 0 ? 0.0 : dSa.row(j).dot(Sa[i - 1].row(j)) + dza(j) * za[i - 1](j);
    }
    const Vector<double> at = a.row(t).transpose();
    dS = at.asDiagonal() * dS;
    dSa = at.asDiagonal() * dSa;
    dz = dz.cwiseProduct(at);
    dza = dza.cwiseProduct(at);
  }
  r.v_terms = max_abs(v_terms);
  // The gates' gradients, and the terms of the library's running sums over s >= t (they
  // cancel: the sum over a whole sequence is 0).
  const Index width = logs == nullptr ? 1 : logs->cols();
  r.gates.resize(n, width);
  r.log_gates.resize(n, width);
  Eigen::ArrayXd cancel = Eigen::ArrayXd::Zero(c);
  for (Index t = n - 1; t >= 0; --t) {
    cancel += (pa.row(t).array() * r.q_terms.row(t).array() +
               ka.row(t).array() * r.k_terms.row(t).array())
                  .transpose();
    for (Index j = 0; j < width; ++j) {
      const double dg = width == 1 ? da.row(t).sum() : da(t, j);
      const double terms = width == 1 ? da_terms.row(t).sum() : da_terms(t, j);
      const double sum_terms = width == 1 ? cancel.sum() : cancel(j);
      const double at = a(t, j);
      r.gates(t, j) = dg;
      r.log_gates(t, j) = at * dg;
      r.log_gate_terms = std::max({r.log_gate_terms, sum_terms, at * terms});
      if (at > 0.0) r.gate_terms = std::max({r.gate_terms, sum_terms / at, terms});
    }
  }
  return r;
}

/// The largest term the map's backward sums for d loss / d x from feature gradients whose
/// terms are `grad_terms` (N x C), as each map forms it.
template <class Map>
double map_terms(const Map& map, const Matrix<double>& x, const Matrix<double>& grad_terms) {
  if constexpr (std::is_same_v<Map, linattn::PositiveRandomFeatures>) {
    // (grad o phi) (sqrt(tau) W) - tau x sum(grad o phi): the two cancel where sqrt(tau) W_c
    // is near tau x; hyperbolic features' second half enters with -W.
    const double tau = map.temperature();
    const Matrix<double> w = (map.projection() * std::sqrt(tau)).cwiseAbs();
    const Matrix<double> weighted = grad_terms.cwiseProduct(map.queries(x));  // keys: the same
    Matrix<double> terms = weighted.leftCols(w.rows()) * w;
    if (weighted.cols() > w.rows()) terms += weighted.rightCols(w.rows()) * w;
    terms += tau * (x.cwiseAbs().array().colwise() * weighted.rowwise().sum().array()).matrix();
    return max_abs(terms);
  } else if constexpr (std::is_same_v<Map, linattn::RandomFourierFeatures>) {
    // (grad_sin o cos - grad_cos o sin) (sqrt(tau) W) / sqrt(m): the halves cancel.
    const Matrix<double> w = map.projection() * std::sqrt(map.temperature());
    const Index m = w.rows();
    const Matrix<double> logits = x * w.transpose();
    const Matrix<double> weighted =
        grad_terms.leftCols(m).cwiseProduct(logits.array().cos().abs().matrix()) +
        grad_terms.rightCols(m).cwiseProduct(logits.array().sin().abs().matrix());
    return max_abs(weighted * w.cwiseAbs()) / std::sqrt(static_cast<double>(m));
  } else {
    static_assert(std::is_same_v<Map, linattn::EluPlusOne> || std::is_same_v<Map, linattn::Relu>,
                  "map_terms: add the terms of this map's backward");
    return max_abs(map.backward(x, grad_terms));  // d phi / d x: diagonal, in [0, 1]
  }
}

/// One workspace per accumulation type, serving every backward call of every input.
template <class Acc>
linattn::BackwardWorkspace<Acc>& shared_workspace() {
  static linattn::BackwardWorkspace<Acc> workspace;
  return workspace;
}

/// The tolerances of a backward's comparison with the reference: kRelTol of the largest term
/// times kappa (the denominators' conditioning), plus a floor for what underflows in T.
template <class T>
struct BackwardTolerance {
  double kappa = 1;
  double floor = 0;

  double operator()(double terms, const Matrix<double>& ref) const {
    return kRelTol<T> * kappa * std::max(terms, max_abs(ref)) + floor;
  }
};

/// |lib - ref| within tol(terms, ref), unless the terms are near T's range (an overflow there
/// is T's, not the kernel's).
template <class T, class D>
void require_matches(const std::string& what, const Eigen::MatrixBase<D>& lib,
                     const Matrix<double>& ref, double terms, const BackwardTolerance<T>& tol) {
  if (!(std::max(terms, max_abs(ref)) <= 1e-3 * static_cast<double>(std::numeric_limits<T>::max())))
    return;
  require_close(what.c_str(), lib, ref, tol(terms, ref));
}

/// The causal backward on the same inputs, with grad_out drawn after v: plain (Options::decay)
/// or gated (the gates of draw_log_gates, as log_gates(g) or a_t = exp(g)), on featurized
/// inputs (Identity: the map's features, or q and k themselves for raw features) or through the
/// map where it has a backward; bits of the header's hash choose. The call also runs with the
/// shared workspace: the same gradients bit for bit, or the same Error. With bounded input and
/// valid options nothing throws (the map's features finite); with a positive map and a
/// well-conditioned denominator (normalize off, or eps >= 1e-12: below it 1 / d_t can be
/// ~1e300) the gradients are finite; and for N <= 24 they match naive_backward.
template <class T, class Map>
void run_backward(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                  const Matrix<T>& grad_out, const Map& map, bool positive, bool bounded) {
  constexpr Index kMaxReferenceTokens = 24;
  const Index n = in.n, dv = in.dv;
  const Index c = map.feature_dim(in.dk);
  linattn::Options opt = in.options;
  // The softmax scale byte also gives Options::scale: Dk^-1/2 for the default, 1 for 0.
  opt.scale = !in.scale_valid || in.scale == 0.0 ? 1.0
              : in.scale < 0.0                   ? 1.0 / std::sqrt(static_cast<double>(in.dk))
                                                 : in.scale;
  const bool must = bounded && in.options_valid;
  Matrix<T> phi_q, phi_k;
  bool phi_ok = attempt("feature map (backward)", must, [&] {
    phi_q = map.queries(q);
    phi_k = map.keys(k);
  });
  // Features far inside T's range: the mapped backward, which needs them finite, may not
  // throw (a chunk's features may round differently from the whole matrix's).
  const double feature_limit = static_cast<double>(std::numeric_limits<T>::max()) / 16;
  phi_ok = phi_ok && phi_q.allFinite() && phi_k.allFinite() && max_abs(phi_q) <= feature_limit &&
           max_abs(phi_k) <= feature_limit;
  const bool must_phi = must && phi_ok;
  const bool conditioned = !opt.normalize || opt.eps >= 1e-12;
  const bool check = must_phi && positive && conditioned;
  const bool compare = must_phi && conditioned && n <= kMaxReferenceTokens;
  constexpr bool has_backward = linattn::detail::has_map_backward<Map, T>::value;
  // One of the four backwards an input: plain or gated, on the features or through the map, by
  // two bits of the header's hash (libFuzzer's per-input cost grows with the code it covers).
  const bool gated_backward = ((in.stream_seed >> 10) & 1u) != 0;
  const bool through_map = has_backward && ((in.stream_seed >> 11) & 1u) != 0;
  char context[128];
  std::snprintf(context, sizeof(context), " [backward scale=%g]", opt.scale);

  auto& workspace = shared_workspace<T>();
  // The allocating call and the workspace one: the same Error, or bit-identical gradients.
  const auto plain = [&](const auto& m, const Matrix<T>& a, const Matrix<T>& b, bool must_succeed,
                         const char* what) {
    std::optional<linattn::AttentionGradients<T>> want;
    const bool ok = attempt(what, must_succeed, [&] {
      want = linattn::causal_linear_attention_backward(a, b, v, grad_out, m, opt);
    });
    Matrix<T> gq(n, a.cols()), gk(n, b.cols()), gv(n, dv);
    const bool ws_ok = attempt(what, must_succeed, [&] {
      linattn::causal_linear_attention_backward_into(a, b, v, grad_out, m, gq, gk, gv, opt,
                                                     workspace);
    });
    if (ok != ws_ok)
      fail(std::string(what) + ": only one of the calls with and without a workspace threw");
    if (ok && !(bit_equal(want->q, gq) && bit_equal(want->k, gk) && bit_equal(want->v, gv))) {
      fail(std::string(what) + ": a BackwardWorkspace changed the gradients" + context);
    }
    return want;
  };
  const auto plain_checks = [&](const linattn::AttentionGradients<T>& g, const char* what) {
    if (!check) return;
    require_finite(what, g.q);
    require_finite(what, g.k);
    require_finite(what, g.v);
  };

  // --- plain: Options::decay ---
  std::optional<Reference> ref;
  BackwardTolerance<T> tol;
  const auto reference = [&](const Matrix<double>* logs, const linattn::Options& o) {
    ref = naive_backward(phi_q.template cast<double>(), phi_k.template cast<double>(),
                         v.template cast<double>(), grad_out.template cast<double>(), logs, o,
                         kRelTol<T>);
    // Skip ill-conditioned denominators (the forward's agreement skips them too).
    const double kappa_limit = std::is_same_v<T, float> ? 1e2 : 1e6;
    if (ref->ambiguous || !(ref->kappa <= kappa_limit)) ref.reset();
    if (!ref) return;
    tol.kappa = ref->kappa;
    const double amp = o.scale * std::max(1.0, max_abs(grad_out)) *
                       (o.normalize ? 1.0 / o.eps : 1.0) * static_cast<double>(n * c);
    tol.floor = 1e6 * static_cast<double>(std::numeric_limits<T>::min()) * amp;
  };
  // d loss / d x from the reference's feature gradient through the map's backward, in double.
  const auto chained = [&](const auto& m, const Matrix<T>& x, const Matrix<double>& grad_phi,
                           const Matrix<double>& terms, const std::string& what, const auto& lib) {
    const Matrix<double> xd = x.template cast<double>();
    const Matrix<double> want = m.backward(xd, grad_phi);
    require_matches<T>(what, lib, want, map_terms(m, xd, terms), tol);
  };

  if (!gated_backward) {
    if (compare) reference(nullptr, opt);
    if (!through_map) {
      const auto featurized = plain(linattn::Identity{}, phi_q, phi_k, must_phi,
                                    "causal_linear_attention_backward(phi)");
      if (featurized) {
        plain_checks(*featurized, "causal_linear_attention_backward(phi)");
        if (ref) {
          const std::string what = std::string("backward(phi) vs reference") + context + ": d ";
          require_matches<T>(what + "phi_q", featurized->q, ref->q, max_abs(ref->q_terms), tol);
          require_matches<T>(what + "phi_k", featurized->k, ref->k, max_abs(ref->k_terms), tol);
          require_matches<T>(what + "v", featurized->v, ref->v, ref->v_terms, tol);
        }
      }
    } else if constexpr (has_backward) {
      const auto mapped = plain(map, q, k, must_phi, "causal_linear_attention_backward(map)");
      if (mapped) {
        plain_checks(*mapped, "causal_linear_attention_backward(map)");
        if (ref) {
          const std::string what = std::string("backward(map) vs reference") + context + ": d ";
          chained(map, q, ref->q, ref->q_terms, what + "q", mapped->q);
          chained(map, k, ref->k, ref->k_terms, what + "k", mapped->k);
          require_matches<T>(what + "v", mapped->v, ref->v, ref->v_terms, tol);
        }
      }
    }
    return;
  }

  // --- gated: Options::decay must be 1 ---
  const Matrix<T> g = draw_log_gates<T>(in, c);
  linattn::Options gopt = opt;
  gopt.decay = 1.0;
  if (in.options_valid && in.options.decay != 1.0) {
    linattn::Options decayed = opt;
    decayed.decay = in.options.decay;
    if (attempt("causal_gated_linear_attention_backward(decay != 1)", false, [&] {
          (void)linattn::causal_gated_linear_attention_backward(
              phi_q, phi_k, v, linattn::log_gates(g), grad_out, linattn::Identity{}, decayed);
        })) {
      fail("a gated backward with Options::decay != 1 did not throw");
    }
  }
  const bool plain_form = ((in.stream_seed >> 9) & 1u) != 0;
  Matrix<T> a(n, g.cols());
  for (Index i = 0; i < a.size(); ++i) {
    a.data()[i] = to_scalar<T>(std::exp(static_cast<double>(g.data()[i])));
  }
  // a_t = exp(g) must lie in (0, 1]: not with a reset, nor once it underflows T.
  const bool gates_ok = !plain_form || a.minCoeff() > T(0);
  const bool must_gated = must_phi && gates_ok;
  // d a_t = d g_t / a_t: finite for gates that are not tiny (d g_t stays below ~1e25).
  const bool gate_grad_finite =
      !plain_form || std::is_same_v<T, double> || static_cast<double>(a.minCoeff()) >= 1e-6;
  std::snprintf(context, sizeof(context), " [backward scale=%g, gates %s, %s]", opt.scale,
                g.cols() == 1 ? "N x 1" : "N x C", plain_form ? "a_t" : "log_gates");
  const auto gated = [&](const auto& m, const Matrix<T>& x, const Matrix<T>& y, bool must_succeed,
                         const char* what) {
    std::optional<linattn::GatedAttentionGradients<T>> want;
    linattn::GatedAttentionGradients<T> got;
    bool ok = false, ws_ok = false;
    const auto calls = [&](const auto& gates) {
      ok = attempt(what, must_succeed, [&] {
        want = linattn::causal_gated_linear_attention_backward(x, y, v, gates, grad_out, m, gopt);
      });
      ws_ok = attempt(what, must_succeed, [&] {
        linattn::causal_gated_linear_attention_backward_into(x, y, v, gates, grad_out, m, got, gopt,
                                                             workspace);
      });
    };
    if (plain_form) {
      calls(a);
    } else {
      calls(linattn::log_gates(g));
    }
    if (ok != ws_ok)
      fail(std::string(what) + ": only one of the calls with and without a workspace threw");
    if (ok && !(bit_equal(want->q, got.q) && bit_equal(want->k, got.k) &&
                bit_equal(want->v, got.v) && bit_equal(want->gates, got.gates))) {
      fail(std::string(what) + ": a BackwardWorkspace changed the gradients" + context);
    }
    if (!ok) return want;
    if (check && gates_ok) {
      require_finite(what, want->q);
      require_finite(what, want->k);
      require_finite(what, want->v);
      if (gate_grad_finite) require_finite(what, want->gates);
    }
    return want;
  };

  ref.reset();
  Matrix<double> logs(n, g.cols());
  for (Index i = 0; i < logs.size(); ++i) {
    logs.data()[i] =
        plain_form ? std::log(static_cast<double>(a.data()[i])) : static_cast<double>(g.data()[i]);
  }
  if (compare && gates_ok) reference(&logs, gopt);
  const auto compare_gates = [&](const linattn::GatedAttentionGradients<T>& lib,
                                 const std::string& what) {
    if (plain_form) {
      BackwardTolerance<T> gate_tol = tol;
      gate_tol.floor /= static_cast<double>(a.minCoeff());
      require_matches<T>(what + "a", lib.gates, ref->gates, ref->gate_terms, gate_tol);
    } else {
      require_matches<T>(what + "g", lib.gates, ref->log_gates, ref->log_gate_terms, tol);
    }
  };
  if (!through_map) {
    const auto featurized = gated(linattn::Identity{}, phi_q, phi_k, must_gated,
                                  "causal_gated_linear_attention_backward(phi)");
    if (featurized && ref) {
      const std::string what = std::string("gated backward(phi) vs reference") + context + ": d ";
      require_matches<T>(what + "phi_q", featurized->q, ref->q, max_abs(ref->q_terms), tol);
      require_matches<T>(what + "phi_k", featurized->k, ref->k, max_abs(ref->k_terms), tol);
      require_matches<T>(what + "v", featurized->v, ref->v, ref->v_terms, tol);
      compare_gates(*featurized, what);
    }
  } else if constexpr (has_backward) {
    const auto mapped = gated(map, q, k, must_gated, "causal_gated_linear_attention_backward(map)");
    if (mapped && ref) {
      const std::string what = std::string("gated backward(map) vs reference") + context + ": d ";
      chained(map, q, ref->q, ref->q_terms, what + "q", mapped->q);
      chained(map, k, ref->k, ref->k_terms, what + "k", mapped->k);
      require_matches<T>(what + "v", mapped->v, ref->v, ref->v_terms, tol);
      compare_gates(*mapped, what);
    }
  }
}

template <class T, class Map>
void run_engine(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                const Matrix<T>& grad_out, const Map& map, bool positive, bool bounded,
                bool backward_bounded) {
  run_linear<T>(in, q, k, v, map, positive, bounded);
  run_backward<T>(in, q, k, v, grad_out, map, positive, backward_bounded);
}

}  // namespace linattn_fuzz
