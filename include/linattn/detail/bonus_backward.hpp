// SPDX-License-Identifier: MIT
// The backward of RWKV-6's bonus form (detail/bonus.hpp): the gated backward's passes on the
// shifted sequence (queries one row ahead of the keys, values and gates), plus the gradients
// of the bonus term s (phi(q_t) o u) . phi(k_t) v_t, all in the accumulation type.
#pragma once

#include <linattn/backward.hpp>
#include <linattn/config.hpp>
#include <linattn/detail/bonus.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/gates.hpp>
#include <linattn/gradients.hpp>
#include <type_traits>
#include <utility>

namespace linattn::detail {

/// Adds the bonus term's gradients to the feature gradients. With b_t = s (phi_q_t o u) .
/// phi_k_t (the term is b_t v_t) and db_t = grad_out_t . v_t:
///     d v_t += b_t grad_out_t,   d phi_q_t += s (u o phi_k_t) db_t,
///     d phi_k_t += s (u o phi_q_t) db_t,   d u = s sum_t (phi_q_t o phi_k_t) db_t.
/// @param phi_q, phi_k      N x C features in A
/// @param v, grad_out       N x Dv
/// @param u                 C bonus weights
/// @param grad_phi_q, grad_phi_k, grad_v  N x C, N x C, N x Dv: added to
/// @param grad_u            C: set
template <class A, class DV, class DO, class DU>
void add_bonus_gradients(const Matrix<A>& phi_q, const Matrix<A>& phi_k,
                         const Eigen::MatrixBase<DV>& v, const Eigen::MatrixBase<DO>& grad_out,
                         const Eigen::MatrixBase<DU>& u, double scale, Matrix<A>& grad_phi_q,
                         Matrix<A>& grad_phi_k, Matrix<A>& grad_v, Vector<A>& grad_u) {
  const A s = static_cast<A>(scale);
  const Eigen::Array<A, 1, Eigen::Dynamic> weights =
      s * u.reshaped().transpose().template cast<A>().array();
  const Matrix<A> grads = grad_out.template cast<A>();
  const Vector<A> db = (grads.array() * v.template cast<A>().array()).rowwise().sum();
  const Matrix<A> both = (phi_q.array() * phi_k.array()).matrix();
  Vector<A> b(phi_q.rows());
  b.noalias() = both * weights.matrix().transpose();
  grad_v.array() += grads.array().colwise() * b.array();
  grad_phi_q.array() += (phi_k.array().rowwise() * weights).colwise() * db.array();
  grad_phi_k.array() += (phi_q.array().rowwise() * weights).colwise() * db.array();
  grad_u.noalias() = both.transpose() * db;
  grad_u *= s;
}

/// The bonus form's backward: validates everything (as the forward, plus grad_out), then on
/// the features in A runs the gated backward's passes and gate gradients on the shifted
/// sequence (phi_q rows 1..N-1 against phi_k, v, gates rows 0..N-2, grad_out rows 1..N-1),
/// adds the bonus term's gradients, chains the map's backward once (it is linear in its
/// gradient) and writes `grads` only when all of it succeeded.
template <class Acc, class DQ, class DK, class DV, class Gates, class DU, class DO, class Map>
void bonus_backward(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                    const Eigen::MatrixBase<DV>& v, const BonusGates<Gates, DU>& gates,
                    const Eigen::MatrixBase<DO>& grad_out, const Map& map,
                    BonusAttentionGradients<typename DQ::Scalar>& grads, const Options& options,
                    const char* where) {
  using T = typename DQ::Scalar;
  using A = accumulator_t<Acc, T>;
  require_gated_backward_scalars<T, A, Gates, DO>();
  if constexpr (check_feature_map<Map, A>()) {
    require_plain_features<Map>();
    constexpr bool features = is_identity_map<Map>;
    if constexpr (!features) {
      static_assert(has_map_backward<Map, A>::value,
                    "this feature map has no backward(x, grad_phi) member, so gradients cannot "
                    "reach q and k; featurize yourself and pass linattn::Identity{}");
    }
    validate_backward(q, k, v, grad_out, options, where, features ? "phi_q" : "q",
                      features ? "phi_k" : "k");
    const Eigen::Index n = q.rows();
    const Eigen::Index c = features ? q.cols() : map.feature_dim(q.cols());
    validate_gates(gates.gates(), n, c, options, where);
    validate_bonus(gates.bonus(), c, options, where);

    const Matrix<A> raw_q = q.template cast<A>();
    const Matrix<A> raw_k = k.template cast<A>();
    BonusAttentionGradients<T> result;
    Matrix<A> dq = Matrix<A>::Zero(n, c);
    Matrix<A> dk = Matrix<A>::Zero(n, c);
    Matrix<A> dv = Matrix<A>::Zero(n, v.cols());
    Vector<A> du(c);
    auto run = [&](const Matrix<A>& phi_q, const Matrix<A>& phi_k) {
      // The last row stays 0: nothing reads the state after the last token.
      result.gates = Matrix<T>::Zero(n, gate_traits<Gates>::values(gates.gates()).cols());
      if (n > 1) {
        const Eigen::Index m = n - 1;
        with_gate_block(gates.gates(), 0, m, [&](const auto& ahead) {
          const SequenceGates forward(ahead);
          const auto ahead_q = phi_q.bottomRows(m);
          const auto behind_k = phi_k.topRows(m);
          const auto behind_v = v.topRows(m);
          const auto ahead_grad = grad_out.bottomRows(m);
          // Whole matrices: gate_gradients reads the feature gradients as Matrix<A>.
          Matrix<A> shifted_q(m, c);
          Matrix<A> shifted_k(m, c);
          Matrix<A> shifted_v(m, v.cols());
          causal_backward<A>(ahead_q, behind_k, behind_v, ahead_grad, shifted_q, shifted_k,
                             shifted_v, options, &forward);
          Matrix<T> shifted_gates;
          gate_gradients<gate_traits<Gates>::log_space>(ahead_q, behind_k, shifted_q, shifted_k,
                                                        forward.logs(), shifted_gates);
          result.gates.topRows(m) = shifted_gates;
          dq.bottomRows(m) = shifted_q;
          dk.topRows(m) = shifted_k;
          dv.topRows(m) = shifted_v;
        });
      }
      add_bonus_gradients<A>(phi_q, phi_k, v, grad_out, gates.bonus(), options.scale, dq, dk, dv,
                             du);
    };
    if constexpr (features) {
      run(raw_q, raw_k);
      result.q = dq.template cast<T>();
      result.k = dk.template cast<T>();
    } else {
      run(backward_features(map, raw_q, false, where), backward_features(map, raw_k, true, where));
      result.q = map.backward(raw_q, dq).template cast<T>();
      result.k = map.backward(raw_k, dk).template cast<T>();
    }
    result.v = dv.template cast<T>();
    // u's own shape (a row or a column); a vector's entries are contiguous either way.
    result.u.resize(gates.bonus().rows(), gates.bonus().cols());
    Eigen::Map<Vector<T>>(result.u.data(), c) = du.template cast<T>();
    grads = std::move(result);
  }
}

}  // namespace linattn::detail
