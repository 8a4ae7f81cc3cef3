// SPDX-License-Identifier: MIT
// fuzz_kernels: the checks of the softmax baselines, the delta rules, the short convolution and
// the mixers.
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/dplr_delta_rule_backward.hpp>
#include <linattn/gated_delta_net.hpp>
#include <linattn/layer.hpp>
#include <linattn/mamba2.hpp>
#include <linattn/rwkv7_time_mix.hpp>
#include <linattn/session_pool.hpp>
#include <linattn/short_conv.hpp>
#include <utility>

#include "kernel_checks.hpp"

namespace linattn_fuzz {

/// Every entry of out inside [min, max] of v's column (softmax weights are a convex combination).
template <class T>
void require_in_hull(const char* what, const Matrix<T>& out, const Matrix<T>& v, double tol) {
  require_finite(what, out);
  for (Index c = 0; c < v.cols(); ++c) {
    const double lo = static_cast<double>(v.col(c).minCoeff()) - tol;
    const double hi = static_cast<double>(v.col(c).maxCoeff()) + tol;
    for (Index r = 0; r < out.rows(); ++r) {
      const double x = static_cast<double>(out(r, c));
      if (!(x >= lo && x <= hi)) fail(std::string(what) + ": output outside the range of v");
    }
  }
}

template <class T>
void run_softmax(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                 bool bounded) {
  const bool ok_scale = bounded && in.scale_valid;
  const bool ok_window = ok_scale && in.window_valid;
  const bool causal = in.softmax_causal;
  // Rounding of a score s moves its weight by ~ |s| u relative; bound the scores to size it.
  const double scale = in.scale < 0 ? 1.0 / std::sqrt(static_cast<double>(in.dk)) : in.scale;
  const double max_score = std::abs(scale) * static_cast<double>(in.dk) * max_abs(q) * max_abs(k);
  const double unit = std::numeric_limits<T>::epsilon();
  const double tol =
      (8.0 * unit * (max_score + 1.0) * static_cast<double>(in.dk + 2) + 1e-5) * max_abs(v) + 1e-6;

  Matrix<T> tiled, tiled_causal, materialized, window;
  const bool tiled_ok = attempt("softmax_attention", ok_scale, [&] {
    tiled = linattn::softmax_attention(
        q, k, v, causal ? linattn::Mask::causal : linattn::Mask::none, in.scale);
  });
  attempt("softmax_attention(causal)", ok_scale, [&] {
    tiled_causal = linattn::softmax_attention(q, k, v, linattn::Mask::causal, in.scale);
  });
  attempt("materialized_softmax_attention", ok_scale, [&] {
    materialized = linattn::materialized_softmax_attention(
        q, k, v, causal ? linattn::Mask::causal : linattn::Mask::none, in.scale);
  });
  attempt("sliding_window_attention", ok_window,
          [&] { window = linattn::sliding_window_attention(q, k, v, in.window, in.scale); });

  // KV cache: append the first `split` tokens, step the rest, then roll back and step again.
  Matrix<T> cached(in.n - in.split, in.dv);
  std::optional<Vector<T>> first, replay;
  attempt("SoftmaxKVCache", ok_scale, [&] {
    linattn::SoftmaxKVCache<T> cache(in.dk, in.dv, in.scale);
    cache.append(k.topRows(in.split), v.topRows(in.split));  // split may be 0: a no-op
    for (Index i = in.split; i < in.n; ++i) {
      cached.row(i - in.split) = cache.step(q.row(i), k.row(i), v.row(i)).transpose();
    }
    if (cache.tokens() != in.n) fail("SoftmaxKVCache::tokens() is not the number of tokens");
    if (in.split < in.n) {
      cache.truncate(in.split);
      replay = cache.step(q.row(in.split), k.row(in.split), v.row(in.split));
      first = cached.row(0).transpose();
    }
  });
  Matrix<T> ring(in.n, in.dv);
  attempt("SlidingWindowCache", ok_window, [&] {
    linattn::SlidingWindowCache<T> cache(in.dk, in.dv, in.window, in.scale);
    for (Index i = 0; i < in.n; ++i) {
      ring.row(i) = cache.step(q.row(i), k.row(i), v.row(i)).transpose();
    }
  });

  if (!ok_scale || !tiled_ok) return;
  require_in_hull("softmax_attention", tiled, v, tol);
  require_in_hull("softmax_attention(causal)", tiled_causal, v, tol);
  require_in_hull("materialized_softmax_attention", materialized, v, tol);
  require_in_hull("SoftmaxKVCache::step", cached, v, tol);
  require_close("softmax_attention vs materialized", tiled, materialized, tol);
  require_close("softmax_attention(causal) vs SoftmaxKVCache",
                tiled_causal.bottomRows(in.n - in.split), cached, tol);
  if (first && !bit_equal(*first, *replay)) fail("SoftmaxKVCache::truncate did not roll back");
  if (!ok_window) return;
  require_in_hull("sliding_window_attention", window, v, tol);
  require_in_hull("SlidingWindowCache::step", ring, v, tol);
  require_close("sliding_window_attention vs SlidingWindowCache", window, ring, tol);
  if (in.window >= in.n) {
    require_close("sliding_window_attention (window >= N) vs causal softmax", window, tiled_causal,
                  tol);
  }
}

/// The delta rule's backward on run_delta's inputs, grad_out = v with its rows reversed: the
/// allocating call, the workspace form and the 1 x 1 x N view call give the same gradients
/// bit for bit (or all throw), finite where the forward's outputs must be; the recurrent form
/// throws exactly when they do and is finite there too.
template <class T>
void run_delta_backward(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                        const Matrix<T>& g, const Vector<T>& beta, bool gated,
                        const linattn::DeltaOptions& opt, bool must, bool check) {
  const Matrix<T> grad_out = v.colwise().reverse();
  static linattn::DeltaBackwardWorkspace<T> workspace;  // reused by every input of this type
  linattn::DeltaRuleGradients<T> alloc, held, viewed;
  const auto shape = [&](linattn::DeltaRuleGradients<T>& d) {
    d.q.resize(in.n, in.dk);
    d.k.resize(in.n, in.dk);
    d.v.resize(in.n, in.dv);
    d.beta.resize(in.n);
    d.gates.resize(in.n, gated ? g.cols() : 0);
  };
  shape(held);
  shape(viewed);
  const bool alloc_ok = attempt("causal_(gated_)delta_rule_backward", must, [&] {
    alloc = gated ? linattn::causal_gated_delta_rule_backward(q, k, v, linattn::log_gates(g), beta,
                                                              grad_out, opt)
                  : linattn::causal_delta_rule_backward(q, k, v, beta, grad_out, opt);
  });
  const bool held_ok = attempt("causal_(gated_)delta_rule_backward(workspace)", must, [&] {
    if (gated) {
      linattn::causal_gated_delta_rule_backward_into(q, k, v, linattn::log_gates(g), beta, grad_out,
                                                     held.q, held.k, held.v, held.gates, held.beta,
                                                     opt, workspace);
    } else {
      linattn::causal_delta_rule_backward_into(q, k, v, beta, grad_out, held.q, held.k, held.v,
                                               held.beta, opt, workspace);
    }
  });
  const auto view = [&](auto* data, Index dim) {
    return linattn::HeadsView<std::remove_pointer_t<decltype(data)>>::bhnd(data, {1, 1, in.n, dim});
  };
  const bool viewed_ok = attempt("causal_(gated_)delta_rule_backward(views)", must, [&] {
    if (gated) {
      linattn::causal_gated_delta_rule_backward_into(
          view(q.data(), in.dk), view(k.data(), in.dk), view(v.data(), in.dv),
          linattn::log_gates(view(g.data(), g.cols())), view(beta.data(), 1),
          view(grad_out.data(), in.dv), view(viewed.q.data(), in.dk), view(viewed.k.data(), in.dk),
          view(viewed.v.data(), in.dv), view(viewed.gates.data(), g.cols()),
          view(viewed.beta.data(), 1), opt);
    } else {
      linattn::causal_delta_rule_backward_into(
          view(q.data(), in.dk), view(k.data(), in.dk), view(v.data(), in.dv), view(beta.data(), 1),
          view(grad_out.data(), in.dv), view(viewed.q.data(), in.dk), view(viewed.k.data(), in.dk),
          view(viewed.v.data(), in.dv), view(viewed.beta.data(), 1), opt);
    }
  });
  // The recurrent form (DeltaForm::streamed), the chunked one's reference.
  linattn::DeltaOptions recurrent_opt = opt;
  recurrent_opt.form = linattn::DeltaForm::streamed;
  linattn::DeltaRuleGradients<T> recurrent;
  const bool recurrent_ok = attempt("causal_(gated_)delta_rule_backward(recurrent)", must, [&] {
    recurrent = gated ? linattn::causal_gated_delta_rule_backward(q, k, v, linattn::log_gates(g),
                                                                  beta, grad_out, recurrent_opt)
                      : linattn::causal_delta_rule_backward(q, k, v, beta, grad_out, recurrent_opt);
  });
  if (alloc_ok != held_ok || alloc_ok != viewed_ok || alloc_ok != recurrent_ok) {
    fail("the delta rule's backward forms disagree on whether the input is valid");
  }
  if (!alloc_ok) return;
  const auto same = [](const linattn::DeltaRuleGradients<T>& a,
                       const linattn::DeltaRuleGradients<T>& b) {
    return bit_equal(a.q, b.q) && bit_equal(a.k, b.k) && bit_equal(a.v, b.v) &&
           bit_equal(a.beta, b.beta) && bit_equal(a.gates, b.gates);
  };
  if (!same(alloc, held)) fail("the delta rule's backward with a workspace differs");
  if (!same(alloc, viewed)) fail("the delta rule's view backward differs from the matrix one");
  if (!check) return;
  require_finite("delta rule backward: grad_q", alloc.q);
  require_finite("delta rule backward: grad_k", alloc.k);
  require_finite("delta rule backward: grad_v", alloc.v);
  require_finite("delta rule backward: grad_beta", alloc.beta);
  if (gated) require_finite("delta rule backward: grad_gates", alloc.gates);
  require_finite("delta rule backward (recurrent): grad_q", recurrent.q);
  require_finite("delta rule backward (recurrent): grad_k", recurrent.k);
}

/// The delta rule on the same inputs: DeltaNet, Gated DeltaNet or KDA by the seed (gates from
/// draw_log_gates, resets included), beta in (0, 1] or (0, 2] drawn from the seed. With L2
/// normalisation (Options::normalize stands for DeltaOptions::l2_normalize) and bounded input
/// every S_t stays bounded: then the outputs are finite and both forms, the steps,
/// prefill-then-step, the 1 x 1 x N view and a batch of one state (prefill from views, then
/// batch steps) agree, and a saved state continues bit for bit.
template <class T>
void run_delta(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
               bool bounded) {
  const bool gated = (in.seed & 4u) == 0;
  const Matrix<T> g = draw_log_gates<T>(in, in.dk);
  linattn::DeltaOptions opt;
  opt.scale = in.scale;
  opt.l2_normalize = in.options.normalize;
  opt.chunk = in.options.chunk;
  opt.check_finite = in.options.check_finite;
  opt.allow_negative_eigenvalues = (in.seed & 8u) != 0;
  Vector<T> beta(in.n);
  for (Index t = 0; t < in.n; ++t) {
    const double u = static_cast<double>((in.seed * 31 + static_cast<std::uint64_t>(t) * 17) % 20);
    beta(t) = static_cast<T>((opt.allow_negative_eigenvalues ? 0.1 : 0.05) * (u + 1.0));
  }
  // Keys the kernel does not normalise must give stable steps (beta |k|^2 <= 2), or it throws.
  bool stable = true;
  for (Index t = 0; t < in.n && !opt.l2_normalize; ++t) {
    const double gain =
        static_cast<double>(beta(t)) * k.row(t).template cast<double>().squaredNorm();
    if (gain > linattn::detail::kMaxStepGain) stable = false;
  }
  const bool valid = opt.chunk >= 1 && std::isfinite(in.scale) && in.scale != 0.0 && stable;
  const bool must = bounded && valid;
  const bool check = must && opt.l2_normalize;
  Matrix<T> par(in.n, in.dv), steps(in.n, in.dv), split(in.n, in.dv), viewed(in.n, in.dv);
  const bool par_ok = attempt("causal_(gated_)delta_rule", must, [&] {
    if (gated) {
      par = linattn::causal_gated_delta_rule(q, k, v, linattn::log_gates(g), beta, opt);
    } else {
      par = linattn::causal_delta_rule(q, k, v, beta, opt);
    }
  });
  Matrix<T> chunked(in.n, in.dv);
  linattn::DeltaOptions chunked_opt = opt;
  chunked_opt.form = linattn::DeltaForm::chunked;
  const bool chunked_ok = attempt("causal_(gated_)delta_rule(chunked)", must, [&] {
    if (gated) {
      chunked = linattn::causal_gated_delta_rule(q, k, v, linattn::log_gates(g), beta, chunked_opt);
    } else {
      chunked = linattn::causal_delta_rule(q, k, v, beta, chunked_opt);
    }
  });
  using State = linattn::DeltaRuleState<T>;
  const auto step = [&](State& state, Index i) {
    if (gated) {
      return state.step(q.row(i), k.row(i), v.row(i), linattn::log_gates(g.row(i)), beta(i));
    }
    return state.step(q.row(i), k.row(i), v.row(i), beta(i));
  };
  std::optional<State> stepped, pieces;
  const bool steps_ok = attempt("DeltaRuleState::step", must, [&] {
    stepped.emplace(in.dk, in.dv, opt);
    for (Index i = 0; i < in.n; ++i) steps.row(i) = step(*stepped, i).transpose();
  });
  const bool split_ok = attempt("DeltaRuleState::prefill", must, [&] {
    pieces.emplace(in.dk, in.dv, opt);
    const Index s = in.split;
    if (s > 0) {
      if (gated) {
        split.topRows(s) = pieces->prefill(q.topRows(s), k.topRows(s), v.topRows(s),
                                           linattn::log_gates(g.topRows(s)), beta.head(s));
      } else {
        split.topRows(s) = pieces->prefill(q.topRows(s), k.topRows(s), v.topRows(s), beta.head(s));
      }
    }
    for (Index i = s; i < in.n; ++i) split.row(i) = step(*pieces, i).transpose();
  });
  const linattn::HeadShape qk_shape{1, 1, in.n, in.dk}, v_shape{1, 1, in.n, in.dv};
  const auto qv = linattn::HeadsView<const T>::bhnd(q.data(), qk_shape);
  const auto kv = linattn::HeadsView<const T>::bhnd(k.data(), qk_shape);
  const auto vv = linattn::HeadsView<const T>::bhnd(v.data(), v_shape);
  const auto bv = linattn::HeadsView<const T>::bhnd(beta.data(), {1, 1, in.n, 1});
  const auto gv = linattn::HeadsView<const T>::bhnd(g.data(), {1, 1, in.n, g.cols()});
  const auto ov = linattn::HeadsView<T>::bhnd(viewed.data(), v_shape);
  const bool viewed_ok = attempt("causal_(gated_)delta_rule_into(views)", must, [&] {
    if (gated) {
      linattn::causal_gated_delta_rule_into(qv, kv, vv, linattn::log_gates(gv), bv, ov, opt);
    } else {
      linattn::causal_delta_rule_into(qv, kv, vv, bv, ov, opt);
    }
  });
  // A batch of one state: a prefill from views of the first tokens, then batch steps.
  Matrix<T> batched(in.n, in.dv);
  const bool batched_ok = attempt("DeltaRuleStateBatch", must, [&] {
    linattn::DeltaRuleStateBatch<T> batch(1, in.dk, in.dv, opt);
    const Index s = in.split;
    if (s > 0) {
      const auto prefix = [&](const auto& view, Index dim) {
        return std::decay_t<decltype(view)>::bhnd(view.data(), {1, 1, s, dim});
      };
      const auto out = linattn::HeadsView<T>::bhnd(batched.data(), {1, 1, s, in.dv});
      if (gated) {
        batch.prefill_into(prefix(qv, in.dk), prefix(kv, in.dk), prefix(vv, in.dv),
                           linattn::log_gates(prefix(gv, g.cols())), prefix(bv, 1), out);
      } else {
        batch.prefill_into(prefix(qv, in.dk), prefix(kv, in.dk), prefix(vv, in.dv), prefix(bv, 1),
                           out);
      }
    }
    for (Index i = s; i < in.n; ++i) {
      if (gated) {
        batch.step_into(q.row(i), k.row(i), v.row(i), linattn::log_gates(g.row(i)),
                        beta.segment(i, 1), batched.row(i));
      } else {
        batch.step_into(q.row(i), k.row(i), v.row(i), beta.segment(i, 1), batched.row(i));
      }
    }
  });
  // The same through a session pool, beside a second session dropped half way through the
  // steps (its states' handles move): bit for bit the batch of one.
  Matrix<T> pooled(in.n, in.dv);
  const bool pooled_ok = attempt("SessionPool<DeltaRuleStateBatch>", must, [&] {
    linattn::SessionPool pool(1, linattn::DeltaRuleLayer<T>(1, in.dk, in.dv, opt));
    pool.add(7);
    pool.add(3);
    const Index s = in.split;
    if (s > 0) {
      const auto prefix = [&](const auto& view, Index dim) {
        return std::decay_t<decltype(view)>::bhnd(view.data(), {1, 1, s, dim});
      };
      const auto out = linattn::HeadsView<T>::bhnd(pooled.data(), {1, 1, s, in.dv});
      if (gated) {
        pool.prefill_into(0, {3}, prefix(qv, in.dk), prefix(kv, in.dk), prefix(vv, in.dv),
                          linattn::log_gates(prefix(gv, g.cols())), prefix(bv, 1), out);
      } else {
        pool.prefill_into(0, {3}, prefix(qv, in.dk), prefix(kv, in.dk), prefix(vv, in.dv),
                          prefix(bv, 1), out);
      }
    }
    for (Index i = s; i < in.n; ++i) {
      if (i == (s + in.n) / 2) pool.drop(7);
      const Index rows = pool.size();  // every live session takes token i
      const Matrix<T> qi = q.row(i).replicate(rows, 1), ki = k.row(i).replicate(rows, 1),
                      vi = v.row(i).replicate(rows, 1), gi = g.row(i).replicate(rows, 1);
      const Vector<T> bi = beta.segment(i, 1).replicate(rows, 1);
      Matrix<T> oi(rows, in.dv);
      if (gated) {
        pool.step_into(0, qi, ki, vi, linattn::log_gates(gi), bi, oi);
      } else {
        pool.step_into(0, qi, ki, vi, bi, oi);
      }
      pooled.row(i) = oi.row(pool.position(3));
    }
  });
  if (batched_ok && pooled_ok && !bit_equal(batched, pooled)) {
    fail("a session pool differs from a batch of one delta-rule state");
  }
  // beta = 0 is never a learning rate: every form refuses it.
  Vector<T> zero_beta = beta;
  zero_beta(in.n - 1) = T(0);
  if (attempt("causal_delta_rule(beta = 0)", false,
              [&] { (void)linattn::causal_delta_rule(q, k, v, zero_beta, opt); })) {
    fail("the delta rule took beta = 0");
  }
  run_delta_backward(in, q, k, v, g, beta, gated, opt, must, check);
  if (!check || !par_ok) return;
  require_finite("causal_(gated_)delta_rule", par);
  // Normalised keys and beta <= 2 keep |S| within the sum of beta |v|: size the bound by it.
  const double tol = kRelTol<T> * (1.0 + 2.0 * static_cast<double>(in.n) * max_abs(v));
  if (chunked_ok) require_close("delta rule: streamed vs chunked", par, chunked, tol);
  if (steps_ok) require_close("delta rule: streamed vs steps", par, steps, tol);
  if (split_ok) require_close("delta rule: chunked vs prefill then steps", par, split, tol);
  if (viewed_ok) require_close("delta rule: matrix vs 1 x 1 x N view", par, viewed, tol);
  if (batched_ok) require_close("delta rule: batch prefill then batch steps", par, batched, tol);
  if (!steps_ok || !stepped->s().allFinite()) return;
  std::stringstream saved;
  stepped->save(saved);
  std::optional<State> loaded;
  attempt("DeltaRuleState::load", true, [&] { loaded.emplace(State::load(saved, opt)); });
  if (!bit_equal(loaded->s(), stepped->s())) fail("a loaded delta-rule state differs");
  const Vector<T> a = step(*stepped, in.n - 1);
  const Vector<T> b = step(*loaded, in.n - 1);
  if (!bit_equal(a, b)) fail("a loaded delta-rule state steps to other outputs");
}

/// The generalized delta rule on RWKV-7's pairs made from k: kk = k's rows normalised (zero
/// rows stay zero), a = -kk, b = kk * alpha (alpha in [0.1, 1] by the seed), the keys k, the
/// fuzzer's log gates (resets included), scale as the input says. With bounded input and valid
/// options every form runs without throwing (a scale of 0 or a chunk of 0 throws in all of
/// them): the streamed and chunked forms, steps, a prefill then steps, a 1 x 1 x N view, a
/// batch and a session pool of one (bit for bit the batch) agree within a bound sized by
/// sum |v| |k|; a saved state loads bit for bit and steps to the same output.
template <class T>
void run_dplr(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
              bool bounded) {
  const Matrix<T> g = draw_log_gates<T>(in, in.dk);
  const double alpha = 0.1 + 0.9 * static_cast<double>(in.seed % 10) / 9.0;
  Matrix<T> a(in.n, in.dk), b(in.n, in.dk);
  for (Index t = 0; t < in.n; ++t) {
    const double norm = k.row(t).template cast<double>().norm();
    const Matrix<double> kk = norm > 0 && std::isfinite(norm)
                                  ? Matrix<double>(k.row(t).template cast<double>() / norm)
                                  : Matrix<double>::Zero(1, in.dk);
    a.row(t) = (-kk).template cast<T>();
    b.row(t) = (alpha * kk).template cast<T>();
  }
  linattn::DplrOptions opt;
  opt.scale = in.scale;
  opt.chunk = in.options.chunk;
  opt.check_finite = in.options.check_finite;
  const bool valid = opt.chunk >= 1 && std::isfinite(in.scale) && in.scale != 0.0;
  const bool must = bounded && valid;
  const auto call = [&](linattn::DeltaForm form) {
    linattn::DplrOptions o = opt;
    o.form = form;
    return linattn::causal_dplr_delta_rule(q, k, v, a, b, linattn::log_gates(g), o);
  };
  Matrix<T> streamed, chunked, steps(in.n, in.dv), split(in.n, in.dv), viewed(in.n, in.dv);
  const bool streamed_ok = attempt("causal_dplr_delta_rule(streamed)", must,
                                   [&] { streamed = call(linattn::DeltaForm::streamed); });
  const bool chunked_ok = attempt("causal_dplr_delta_rule(chunked)", must,
                                  [&] { chunked = call(linattn::DeltaForm::chunked); });
  using State = linattn::DplrDeltaRuleState<T>;
  const auto step = [&](State& state, Index i) {
    return state.step(q.row(i), k.row(i), v.row(i), a.row(i), b.row(i),
                      linattn::log_gates(g.row(i)));
  };
  std::optional<State> stepped;
  const bool steps_ok = attempt("DplrDeltaRuleState::step", must, [&] {
    stepped.emplace(in.dk, in.dv, opt);
    for (Index i = 0; i < in.n; ++i) steps.row(i) = step(*stepped, i).transpose();
  });
  const Index s = in.split;
  const bool split_ok = attempt("DplrDeltaRuleState::prefill", must, [&] {
    State pieces(in.dk, in.dv, opt);
    if (s > 0) {
      split.topRows(s) = pieces.prefill(q.topRows(s), k.topRows(s), v.topRows(s), a.topRows(s),
                                        b.topRows(s), linattn::log_gates(g.topRows(s)));
    }
    for (Index i = s; i < in.n; ++i) split.row(i) = step(pieces, i).transpose();
  });
  const linattn::HeadShape qk_shape{1, 1, in.n, in.dk}, v_shape{1, 1, in.n, in.dv};
  using View = linattn::HeadsView<const T>;
  const auto qv = View::bhnd(q.data(), qk_shape), kv = View::bhnd(k.data(), qk_shape);
  const auto av = View::bhnd(a.data(), qk_shape), bv = View::bhnd(b.data(), qk_shape);
  const auto vv = View::bhnd(v.data(), v_shape);
  const auto gv = View::bhnd(g.data(), {1, 1, in.n, g.cols()});
  const bool viewed_ok = attempt("causal_dplr_delta_rule_into(views)", must, [&] {
    linattn::causal_dplr_delta_rule_into(qv, kv, vv, av, bv, linattn::log_gates(gv),
                                         linattn::HeadsView<T>::bhnd(viewed.data(), v_shape), opt);
  });
  // A batch of one and a session pool of one beside a second session: prefill, then steps.
  const auto prefix = [&](const View& view, Index dim) {
    return View::bhnd(view.data(), {1, 1, s, dim});
  };
  Matrix<T> batched(in.n, in.dv), pooled(in.n, in.dv);
  const bool batched_ok = attempt("DplrDeltaRuleStateBatch", must, [&] {
    linattn::DplrDeltaRuleStateBatch<T> batch(1, in.dk, in.dv, opt);
    if (s > 0) {
      batch.prefill_into(prefix(qv, in.dk), prefix(kv, in.dk), prefix(vv, in.dv), prefix(av, in.dk),
                         prefix(bv, in.dk), linattn::log_gates(prefix(gv, g.cols())),
                         linattn::HeadsView<T>::bhnd(batched.data(), {1, 1, s, in.dv}));
    }
    for (Index i = s; i < in.n; ++i) {
      batch.step_into(q.row(i), k.row(i), v.row(i), a.row(i), b.row(i),
                      linattn::log_gates(g.row(i)), batched.row(i));
    }
  });
  const bool pooled_ok = attempt("SessionPool<DplrDeltaRuleStateBatch>", must, [&] {
    linattn::SessionPool pool(linattn::DplrDeltaRuleLayer<T>(1, in.dk, in.dv, opt));
    pool.add(7);
    pool.add(3);
    if (s > 0) {
      pool.prefill_into(0, {3}, prefix(qv, in.dk), prefix(kv, in.dk), prefix(vv, in.dv),
                        prefix(av, in.dk), prefix(bv, in.dk),
                        linattn::log_gates(prefix(gv, g.cols())),
                        linattn::HeadsView<T>::bhnd(pooled.data(), {1, 1, s, in.dv}));
    }
    for (Index i = s; i < in.n; ++i) {
      if (i == (s + in.n) / 2) pool.drop(7);
      const Index rows = pool.size();
      const auto rep = [&](const Matrix<T>& x) { return Matrix<T>(x.row(i).replicate(rows, 1)); };
      Matrix<T> oi(rows, in.dv);
      pool.step_into(0, rep(q), rep(k), rep(v), rep(a), rep(b), linattn::log_gates(rep(g)), oi);
      pooled.row(i) = oi.row(pool.position(3));
    }
  });
  if (batched_ok && pooled_ok && !bit_equal(batched, pooled)) {
    fail("a session pool differs from a batch of one generalized delta-rule state");
  }
  // The backward (grad_out = v with its rows reversed): it throws exactly when the forward
  // does, and its gradients are finite where the forward's outputs must be.
  linattn::DplrGradients<T> grads;
  const bool backward_ok = attempt("causal_dplr_delta_rule_backward", must, [&] {
    grads = linattn::causal_dplr_delta_rule_backward(q, k, v, a, b, linattn::log_gates(g),
                                                     Matrix<T>(v.colwise().reverse()), opt);
  });
  if (backward_ok != streamed_ok) {
    fail(
        "the generalized delta rule's backward and forward disagree on whether the input is "
        "valid");
  }
  if (!must || !streamed_ok) return;
  require_finite("causal_dplr_delta_rule", streamed);
  for (const Matrix<T>* grad : {&grads.q, &grads.k, &grads.v, &grads.a, &grads.b, &grads.gates}) {
    require_finite("causal_dplr_delta_rule_backward", *grad);
  }
  // The backward's two forms (chunked, WY; recurrent, the reference) agree within rounding
  // grown over the sequence, relative to the largest gradient.
  {
    linattn::DplrOptions forms = opt;
    forms.form = linattn::DeltaForm::chunked;
    linattn::DplrGradients<T> chunked_grads, recurrent_grads;
    attempt("causal_dplr_delta_rule_backward, both forms", true, [&] {
      const Matrix<T> dout = v.colwise().reverse();
      chunked_grads = linattn::causal_dplr_delta_rule_backward(q, k, v, a, b, linattn::log_gates(g),
                                                               dout, forms);
      forms.form = linattn::DeltaForm::streamed;
      recurrent_grads = linattn::causal_dplr_delta_rule_backward(
          q, k, v, a, b, linattn::log_gates(g), dout, forms);
    });
    const auto pairs = {std::pair(&chunked_grads.q, &recurrent_grads.q),
                        std::pair(&chunked_grads.k, &recurrent_grads.k),
                        std::pair(&chunked_grads.v, &recurrent_grads.v),
                        std::pair(&chunked_grads.a, &recurrent_grads.a),
                        std::pair(&chunked_grads.b, &recurrent_grads.b),
                        std::pair(&chunked_grads.gates, &recurrent_grads.gates)};
    double scale = 1.0;
    for (const auto& [c, r] : pairs) scale = std::max(scale, max_abs(*r));
    const double grad_tol =
        kRelTol<T> * 10.0 * static_cast<double>(in.n) * static_cast<double>(in.dk) * scale;
    for (const auto& [c, r] : pairs) {
      require_close("dplr backward: chunked vs recurrent", *c, *r, grad_tol);
    }
  }
  // |a| <= 1 and |b| <= 1 with a = -kk keep the transition's norm at most 1 with the decays:
  // |S| stays within sum_t |k_t| |v_t|; q reads it with |s q|.
  const double tol =
      kRelTol<T> * (1.0 + 4.0 * static_cast<double>(in.n) * max_abs(v) * std::max(max_abs(k), 1.0) *
                              std::max(max_abs(q), 1.0) * std::abs(in.scale < 0 ? 1.0 : in.scale) *
                              static_cast<double>(in.dk));
  if (chunked_ok) require_close("dplr: streamed vs chunked", streamed, chunked, tol);
  if (steps_ok) require_close("dplr: streamed vs steps", streamed, steps, tol);
  if (split_ok) require_close("dplr: streamed vs prefill then steps", streamed, split, tol);
  if (viewed_ok) require_close("dplr: matrix vs 1 x 1 x N view", streamed, viewed, tol);
  if (batched_ok) require_close("dplr: batch prefill then batch steps", streamed, batched, tol);
  if (!steps_ok || !stepped->s().allFinite()) return;
  std::stringstream saved;
  stepped->save(saved);
  std::optional<State> loaded;
  attempt("DplrDeltaRuleState::load", true, [&] { loaded.emplace(State::load(saved, opt)); });
  if (!bit_equal(loaded->s(), stepped->s())) fail("a loaded generalized delta-rule state differs");
  if (!bit_equal(step(*stepped, in.n - 1), step(*loaded, in.n - 1))) {
    fail("a loaded generalized delta-rule state steps to other outputs");
  }
}

/// The short convolution over v (C = Dv channels, N tokens): K = 1 + (Dk - 1) % 8 taps from
/// k's rows, a bias from q's first row when the seed says, SiLU or none, dilation 1 to 3. With
/// bounded input it never throws and its outputs are finite; prefill of the first `split`
/// tokens then steps give forward() bit for bit, windows included; its backward (grad_y = v
/// reversed) never throws and is finite, from zeros the same as from zero windows.
template <class T>
void run_conv(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
              bool bounded) {
  const Index taps = 1 + (in.dk - 1) % linattn::detail::kMaxConvTaps, c = in.dv;
  Matrix<T> weight(c, taps);
  for (Index ch = 0; ch < c; ++ch) {
    for (Index i = 0; i < taps; ++i) weight(ch, i) = k(i % in.n, ch % in.dk) / T(4);
  }
  Vector<T> bias;
  if ((in.seed & 16u) != 0) {
    bias.resize(c);
    for (Index ch = 0; ch < c; ++ch) bias(ch) = q(0, ch % in.dk);
  }
  linattn::ShortConvOptions options;
  options.dilation = 1 + static_cast<Index>((in.seed >> 5) % 3);
  options.activation =
      (in.seed & 2u) != 0 ? linattn::ConvActivation::silu : linattn::ConvActivation::none;
  options.check_finite = in.options.check_finite;
  std::optional<linattn::ShortConv<T>> conv;
  if (!attempt("ShortConv", bounded, [&] { conv.emplace(weight, bias, options); })) return;
  Matrix<T> y;
  if (!attempt("ShortConv::forward", bounded, [&] { y = conv->forward(v); })) return;
  if (!bounded) return;
  if (!y.allFinite()) fail("a short convolution of bounded input is not finite");
  linattn::ConvWindows<T> windows(*conv, 1);
  Matrix<T> pieces(in.n, c);
  attempt("ShortConv::prefill", true, [&] {
    if (in.split > 0) {
      const Matrix<T> head = v.topRows(in.split);
      Matrix<T> out(in.split, c);
      conv->prefill_into(
          windows,
          linattn::ConstHeadsView<T>::bnhd(head.data(), linattn::BnhdShape(1, in.split, 1, c)),
          linattn::HeadsView<T>::bnhd(out.data(), linattn::BnhdShape(1, in.split, 1, c)));
      pieces.topRows(in.split) = out;
    }
    Matrix<T> out(1, c);
    for (Index t = in.split; t < in.n; ++t) {
      conv->step_into(windows, v.row(t), out);
      pieces.row(t) = out.row(0);
    }
  });
  if (!bit_equal(pieces, y)) fail("short convolution: prefill then steps differ from forward()");
  const Index w = conv->window_rows();
  for (Index r = 0; r < w; ++r) {
    const Index src = in.n - w + r;
    const bool same =
        src >= 0 ? windows.window(0).row(r) == v.row(src) : windows.window(0).row(r).isZero(0);
    if (!same) fail("short convolution: the window is not the last inputs");
  }
  const Matrix<T> grad_y = v.colwise().reverse();
  Matrix<T> grad_x(in.n, c), grad_x_windows(in.n, c);
  const auto view = [&](const Matrix<T>& m) {
    return linattn::ConstHeadsView<T>::bnhd(m.data(), linattn::BnhdShape(1, m.rows(), 1, c));
  };
  const auto out_view = [&](Matrix<T>& m) {
    return linattn::HeadsView<T>::bnhd(m.data(), linattn::BnhdShape(1, m.rows(), 1, c));
  };
  linattn::ShortConvGradients<T> grads, grads_windows;
  linattn::ConvWindows<T> zeros(*conv, 1), grad_zeros(*conv, 1);
  attempt("ShortConv::backward", true, [&] {
    grads = conv->backward_into(view(v), view(grad_y), out_view(grad_x));
    grads_windows =
        conv->backward_into(view(v), zeros, view(grad_y), out_view(grad_x_windows), grad_zeros);
  });
  if (!grad_x.allFinite() || !grads.weight.allFinite() || !grads.bias.allFinite() ||
      !grad_zeros.window(0).allFinite()) {
    fail("short convolution: a gradient of bounded input is not finite");
  }
  if (!bit_equal(grad_x, grad_x_windows) || !bit_equal(grads.weight, grads_windows.weight) ||
      !bit_equal(grads.bias, grads_windows.bias)) {
    fail("short convolution: the backward from zero windows differs from the one from zeros");
  }
}

/// The Gated DeltaNet mixer (Qwen3.5's, or Kimi Linear's KDA by a seed bit) over one sequence:
/// Hk = 1 head of Dk over Hv = 1 or 2 value heads of Dv, K = 1 + seed % 4 taps, its projections
/// built from q, k and v (qkv = [q | k | v per value head], z = v, b from q's first column, a
/// from k's first column or, per key channel for Kimi, from k). With bounded input it never
/// throws and is finite; prefill of the first `split` tokens then steps stay close to the
/// forward (the norm divides the recurrence's rounding by at least sqrt(eps): the bound says
/// so); a copy of the states steps to the same bits as the states themselves.
template <class T>
void run_gated_delta_net(const Input& in, const Matrix<T>& q, const Matrix<T>& k,
                         const Matrix<T>& v, bool bounded) {
  linattn::GatedDeltaNetShape shape;
  shape.model = (in.seed & 64u) != 0 ? linattn::GatedDeltaNetModel::kimi_linear
                                     : linattn::GatedDeltaNetModel::qwen3_5;
  shape.key_heads = 1;
  shape.value_heads = 1 + static_cast<Index>((in.seed >> 3) % 2);
  shape.key_dim = in.dk;
  shape.value_dim = in.dv;
  shape.conv_kernel = 1 + static_cast<Index>(in.seed % 4);
  const Index c = shape.conv_channels(), hv = shape.value_heads, n = in.n;
  const Index gate_dim = shape.gate_dim();
  linattn::GatedDeltaNetWeights<T> w;
  w.conv_weight.resize(c, shape.conv_kernel);
  for (Index ch = 0; ch < c; ++ch) {
    for (Index i = 0; i < shape.conv_kernel; ++i) {
      w.conv_weight(ch, i) = T(1) / T(1 + ((ch + 3 * i) % 5));
    }
  }
  w.a_log = Vector<T>::LinSpaced(hv, T(-1), T(1));
  w.dt_bias = Vector<T>::Constant(hv * gate_dim, T(0.5));
  w.norm_weight = Vector<T>::LinSpaced(in.dv, T(0.5), T(1.5));
  linattn::GatedDeltaNetOptions options;
  options.check_finite = in.options.check_finite;
  options.chunk = in.options.chunk;
  std::optional<linattn::GatedDeltaNet<T>> mixer;
  // The fuzzed chunk may be invalid: then the mixer refuses it, with an Error.
  if (!attempt("GatedDeltaNet", options.chunk >= 1, [&] { mixer.emplace(shape, w, options); })) {
    return;
  }
  Matrix<T> qkv(n, c), z(n, hv * in.dv), b(n, hv), a(n, hv * gate_dim);
  qkv.leftCols(in.dk) = q;
  qkv.middleCols(in.dk, in.dk) = k;
  for (Index h = 0; h < hv; ++h) {
    qkv.middleCols(2 * in.dk + h * in.dv, in.dv) = v;
    z.middleCols(h * in.dv, in.dv) = v;
    b.col(h) = q.col(0);
    a.middleCols(h * gate_dim, gate_dim) = k.leftCols(gate_dim);
  }
  const auto inputs = [&](Index first, Index count) {
    const auto view = [&](const Matrix<T>& m, Index heads, Index dim) {
      return linattn::ConstHeadsView<T>(m.data() + first * m.cols(), 1, heads, count, dim,
                                        linattn::HeadStrides{0, dim, m.cols(), 1});
    };
    return linattn::GatedDeltaNetInputs<T>{view(qkv, 1, c), view(z, hv, in.dv), view(b, hv, 1),
                                           view(a, hv, gate_dim)};
  };
  const auto out_view = [&](Matrix<T>& m, Index first, Index count) {
    return linattn::HeadsView<T>(m.data() + first * m.cols(), 1, hv, count, in.dv,
                                 linattn::HeadStrides{0, in.dv, m.cols(), 1});
  };
  Matrix<T> forward(n, hv * in.dv), pieces(n, hv * in.dv);
  if (!attempt("GatedDeltaNet::forward", bounded,
               [&] { mixer->forward_into(inputs(0, n), out_view(forward, 0, n)); })) {
    return;
  }
  if (!bounded) return;
  require_finite("GatedDeltaNet::forward", forward);
  auto states = mixer->make_states(1);
  std::optional<linattn::GatedDeltaNetStates<T>> copy;
  Matrix<T> from_copy(1, hv * in.dv);
  attempt("GatedDeltaNet::prefill and step", true, [&] {
    if (in.split > 0)
      mixer->prefill_into(states, inputs(0, in.split), out_view(pieces, 0, in.split));
    for (Index t = in.split; t < n; ++t) {
      if (t == n - 1) copy.emplace(states);
      mixer->step_into(states, inputs(t, 1), out_view(pieces, t, 1));
    }
    if (copy) mixer->step_into(*copy, inputs(n - 1, 1), out_view(from_copy, 0, 1));
  });
  const Matrix<T> last = pieces.bottomRows(1);
  if (copy && !bit_equal(from_copy, last)) {
    fail("GatedDeltaNet: a copy of the states steps to other bits");
  }
  // The recurrence's error (as the delta rule's bound) through the norm: divided by the rms
  // of o plus eps (at least sqrt(eps) = 1e-3), times w and silu(z).
  double conv_scale = 0.0;
  for (Index ch = 0; ch < c; ++ch)
    conv_scale = std::max(conv_scale, max_abs(w.conv_weight.row(ch)));
  const double values =
      static_cast<double>(shape.conv_kernel) * conv_scale * std::max(max_abs(v), 1.0);
  const double tol = kRelTol<T> * (1.0 + 2.0 * static_cast<double>(n) * values) * 1e3 * 1.5 *
                     std::max(max_abs(v), 1.0) * std::sqrt(static_cast<double>(in.dv));
  require_close("GatedDeltaNet: prefill then steps vs forward", pieces, forward, tol);
}

/// The Mamba-2 mixer over one sequence: H = 1 or 2 heads of P = Dv in one group, states of
/// N = Dk, K = 1 + seed % 4 taps with a bias, in_proj's outputs built from q, k and v (xBC =
/// [v per head | k | q], z = v per head, dt from q's first column). With bounded input it
/// never throws and is finite; prefill of the first `split` tokens then steps stay close to
/// the forward; a copy of the states steps to the same bits.
template <class T>
void run_mamba2(const Input& in, const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v,
                bool bounded) {
  linattn::Mamba2Shape shape;
  shape.heads = 1 + static_cast<Index>((in.seed >> 3) % 2);
  shape.head_dim = in.dv;
  shape.groups = 1;
  shape.state_dim = in.dk;
  shape.conv_kernel = 1 + static_cast<Index>(in.seed % 4);
  const Index c = shape.conv_channels(), h = shape.heads, n = in.n, inner = shape.inner();
  linattn::Mamba2Weights<T> w;
  w.conv_weight.resize(c, shape.conv_kernel);
  for (Index ch = 0; ch < c; ++ch) {
    for (Index i = 0; i < shape.conv_kernel; ++i) {
      w.conv_weight(ch, i) = T(1) / T(1 + ((2 * ch + i) % 5));
    }
  }
  w.conv_bias = Vector<T>::Constant(c, T(0.1));
  w.a_log = Vector<T>::LinSpaced(h, T(0), T(2));
  w.dt_bias = Vector<T>::Constant(h, T(-2));
  w.d = Vector<T>::Ones(h);
  w.norm_weight = Vector<T>::LinSpaced(inner, T(0.5), T(1.5));
  linattn::Mamba2Options options;
  options.check_finite = in.options.check_finite;
  options.chunk = in.options.chunk;
  std::optional<linattn::Mamba2<T>> mixer;
  if (!attempt("Mamba2", options.chunk >= 1, [&] { mixer.emplace(shape, w, options); })) return;
  Matrix<T> xbc(n, c), z(n, inner), dt(n, h);
  for (Index head = 0; head < h; ++head) {
    xbc.middleCols(head * in.dv, in.dv) = v;
    z.middleCols(head * in.dv, in.dv) = v;
    dt.col(head) = q.col(0);
  }
  xbc.middleCols(inner, in.dk) = k;
  xbc.middleCols(inner + in.dk, in.dk) = q;
  const auto inputs = [&](Index first, Index count) {
    const auto view = [&](const Matrix<T>& m, Index heads, Index dim) {
      return linattn::ConstHeadsView<T>(m.data() + first * m.cols(), 1, heads, count, dim,
                                        linattn::HeadStrides{0, dim, m.cols(), 1});
    };
    return linattn::Mamba2Inputs<T>{view(z, h, in.dv), view(xbc, 1, c), view(dt, h, 1)};
  };
  const auto out_view = [&](Matrix<T>& m, Index first, Index count) {
    return linattn::HeadsView<T>(m.data() + first * m.cols(), 1, h, count, in.dv,
                                 linattn::HeadStrides{0, in.dv, m.cols(), 1});
  };
  Matrix<T> forward(n, inner), pieces(n, inner);
  if (!attempt("Mamba2::forward", bounded,
               [&] { mixer->forward_into(inputs(0, n), out_view(forward, 0, n)); })) {
    return;
  }
  if (!bounded) return;
  require_finite("Mamba2::forward", forward);
  auto states = mixer->make_states(1);
  std::optional<linattn::Mamba2States<T>> copy;
  Matrix<T> from_copy(1, inner);
  attempt("Mamba2::prefill and step", true, [&] {
    if (in.split > 0) {
      mixer->prefill_into(states, inputs(0, in.split), out_view(pieces, 0, in.split));
    }
    for (Index t = in.split; t < n; ++t) {
      if (t == n - 1) copy.emplace(states);
      mixer->step_into(states, inputs(t, 1), out_view(pieces, t, 1));
    }
    if (copy) mixer->step_into(*copy, inputs(n - 1, 1), out_view(from_copy, 0, 1));
  });
  const Matrix<T> last = pieces.bottomRows(1);
  if (copy && !bit_equal(from_copy, last)) fail("Mamba2: a copy of the states steps to other bits");
  // The SSM's state sums at most n terms of |B| |dt x| (dt <= softplus of the inputs' range);
  // the norm divides the error by sqrt(eps) at worst (1/sqrt(1e-5) < 400), times w and silu(z).
  const double conv_scale = static_cast<double>(shape.conv_kernel) *
                            (std::max({max_abs(v), max_abs(k), max_abs(q), 1.0}) + 0.1);
  const double step_scale = std::max(max_abs(q), 1.0) + 2.0;
  const double tol = kRelTol<T> *
                     (1.0 + static_cast<double>(n) * conv_scale * conv_scale * step_scale *
                                static_cast<double>(in.dk)) *
                     400.0 * 1.5 * std::max(max_abs(v), 1.0) *
                     std::sqrt(static_cast<double>(inner));
  require_close("Mamba2: prefill then steps vs forward", pieces, forward, tol);
}

/// RWKV-7's time mixing over one sequence: H = 1 head of D = Dk, its x from q, every weight a
/// fixed pattern scaled by 1 / D (LoRA ranks 1 + seed % 3), the first layer or not by a seed bit
/// (v_first from k). With bounded input it never throws and is finite; prefill of the first
/// `split` tokens then steps stay close to the forward (the GroupNorm divides the recurrence's
/// rounding by at most sqrt(64e-5)); a copy of the states steps to the same bits.
template <class T>
void run_rwkv7_time_mix(const Input& in, const Matrix<T>& q, const Matrix<T>& k, bool bounded) {
  linattn::Rwkv7TimeMixShape shape;
  shape.heads = 1;
  shape.head_dim = in.dk;
  shape.first_layer = (in.seed & 128u) != 0;
  const Index c = in.dk, n = in.n, rank = 1 + static_cast<Index>(in.seed % 3);
  const auto pattern = [&](Index rows, Index cols, int salt) {
    Matrix<T> m(rows, cols);
    for (Index r = 0; r < rows; ++r) {
      for (Index j = 0; j < cols; ++j) {
        m(r, j) = T(((r * 7 + j * 3 + salt) % 11) - 5) / T(5 * c);
      }
    }
    return m;
  };
  const auto vector = [&](double low, double high) {
    return Vector<T>::LinSpaced(c, static_cast<T>(low), static_cast<T>(high));
  };
  linattn::Rwkv7TimeMixWeights<T> w;
  w.x_r = vector(0, 1), w.x_w = vector(1, 0), w.x_k = vector(0.2, 0.8);
  w.x_v = vector(0.5, 0.5), w.x_a = vector(0.9, 0.1), w.x_g = vector(0.3, 0.6);
  w.receptance = pattern(c, c, 1), w.key = pattern(c, c, 2), w.value = pattern(c, c, 3);
  w.w1 = pattern(c, rank, 4), w.w2 = pattern(rank, c, 5), w.w0 = vector(-1, 1);
  w.a1 = pattern(c, rank, 6), w.a2 = pattern(rank, c, 7), w.a0 = vector(1, -1);
  w.v1 = pattern(c, rank, 8), w.v2 = pattern(rank, c, 9), w.v0 = vector(0, 0.5);
  w.g1 = pattern(c, rank, 10), w.g2 = pattern(rank, c, 11);
  w.k_k = vector(0.8, 1.2), w.k_a = vector(0.5, 1), w.r_k = pattern(1, c, 12);
  w.ln_x_weight = vector(0.5, 1.5), w.ln_x_bias = vector(-0.1, 0.1);
  linattn::Rwkv7TimeMixOptions options;
  options.check_finite = in.options.check_finite;
  options.chunk = in.options.chunk;
  std::optional<linattn::Rwkv7TimeMix<T>> mixer;
  if (!attempt("Rwkv7TimeMix", options.chunk >= 1, [&] { mixer.emplace(shape, w, options); })) {
    return;
  }
  const auto x_view = [&](Index first, Index count) {
    return linattn::ConstHeadsView<T>(q.data() + first * c, 1, 1, count, c,
                                      linattn::HeadStrides{0, c, c, 1});
  };
  const auto heads = [&](Matrix<T>& m, Index first, Index count) {
    return linattn::HeadsView<T>(m.data() + first * c, 1, 1, count, c,
                                 linattn::HeadStrides{0, c, c, 1});
  };
  Matrix<T> v_first = k.leftCols(c), forward(n, c), pieces(n, c);
  if (!attempt("Rwkv7TimeMix::forward", bounded, [&] {
        mixer->forward_into(x_view(0, n), heads(v_first, 0, n), heads(forward, 0, n));
      })) {
    return;
  }
  if (!bounded) return;
  require_finite("Rwkv7TimeMix::forward", forward);
  auto states = mixer->make_states(1);
  std::optional<linattn::Rwkv7TimeMixStates<T>> copy;
  Matrix<T> from_copy(1, c), first_copy = v_first.bottomRows(1);
  attempt("Rwkv7TimeMix::prefill and step", true, [&] {
    if (in.split > 0) {
      mixer->prefill_into(states, x_view(0, in.split), heads(v_first, 0, in.split),
                          heads(pieces, 0, in.split));
    }
    for (Index t = in.split; t < n; ++t) {
      if (t == n - 1) copy.emplace(states);
      mixer->step_into(states, x_view(t, 1), heads(v_first, t, 1), heads(pieces, t, 1));
    }
    if (copy)
      mixer->step_into(*copy, x_view(n - 1, 1), heads(first_copy, 0, 1), heads(from_copy, 0, 1));
  });
  const Matrix<T> last = pieces.bottomRows(1);
  if (copy && !bit_equal(from_copy, last)) {
    fail("Rwkv7TimeMix: a copy of the states steps to other bits");
  }
  // |r|, |k|, |v| <= |x| (each weight row sums to at most 1 in absolute value); S's entries
  // stay below n |k| |v|; the GroupNorm multiplies errors by 1 / sqrt(64e-5) = 40 at most.
  const double x = std::max(max_abs(q), 1.0), values = std::max(max_abs(k), x);
  const double tol = kRelTol<T> * (1.0 + 2.0 * static_cast<double>(n)) * 40.0 * 1.5 * x * values *
                     x * std::sqrt(static_cast<double>(c)) * 10.0;
  require_close("Rwkv7TimeMix: prefill then steps vs forward", pieces, forward, tol);
}

template void run_softmax<float>(const Input&, const Matrix<float>&, const Matrix<float>&,
                                 const Matrix<float>&, bool);
template void run_softmax<double>(const Input&, const Matrix<double>&, const Matrix<double>&,
                                  const Matrix<double>&, bool);
template void run_delta<float>(const Input&, const Matrix<float>&, const Matrix<float>&,
                               const Matrix<float>&, bool);
template void run_delta<double>(const Input&, const Matrix<double>&, const Matrix<double>&,
                                const Matrix<double>&, bool);
template void run_dplr<float>(const Input&, const Matrix<float>&, const Matrix<float>&,
                              const Matrix<float>&, bool);
template void run_dplr<double>(const Input&, const Matrix<double>&, const Matrix<double>&,
                               const Matrix<double>&, bool);
template void run_conv<float>(const Input&, const Matrix<float>&, const Matrix<float>&,
                              const Matrix<float>&, bool);
template void run_conv<double>(const Input&, const Matrix<double>&, const Matrix<double>&,
                               const Matrix<double>&, bool);

template void run_gated_delta_net<float>(const Input&, const Matrix<float>&, const Matrix<float>&,
                                         const Matrix<float>&, bool);
template void run_gated_delta_net<double>(const Input&, const Matrix<double>&,
                                          const Matrix<double>&, const Matrix<double>&, bool);
template void run_mamba2<float>(const Input&, const Matrix<float>&, const Matrix<float>&,
                                const Matrix<float>&, bool);
template void run_mamba2<double>(const Input&, const Matrix<double>&, const Matrix<double>&,
                                 const Matrix<double>&, bool);
template void run_rwkv7_time_mix<float>(const Input&, const Matrix<float>&, const Matrix<float>&,
                                        bool);
template void run_rwkv7_time_mix<double>(const Input&, const Matrix<double>&, const Matrix<double>&,
                                         bool);

}  // namespace linattn_fuzz
