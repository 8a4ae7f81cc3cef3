// SPDX-License-Identifier: MIT
// The result type of every backward routine.
#pragma once

#include <linattn/config.hpp>

namespace linattn {

/// Gradients of a scalar loss with respect to an attention call's three inputs, each the shape
/// of the input it belongs to. For the featurized routines `q` and `k` are the gradients with
/// respect to phi_q and phi_k; for the routines that take a feature map, with respect to q and k.
template <class T>
struct AttentionGradients {
  /// N x Dk (or N x C): d loss / d q (or d phi_q)
  Matrix<T> q;
  /// N x Dk (or N x C): d loss / d k (or d phi_k)
  Matrix<T> k;
  /// N x Dv: d loss / d v
  Matrix<T> v;
};

/// Gradients of a scalar loss with respect to the inputs of causal_gated_linear_attention.
template <class T>
struct GatedAttentionGradients {
  /// N x Dk (or N x C): d loss / d q (or d phi_q)
  Matrix<T> q;
  /// N x Dk (or N x C): d loss / d k (or d phi_k)
  Matrix<T> k;
  /// N x Dv: d loss / d v
  Matrix<T> v;
  /// N x 1 or N x C, the shape of the gates: d loss / d a_t for gates a_t, d loss / d g_t for
  /// log_gates(g) (0 at a reset, g_t = -infinity: nothing depends on it)
  Matrix<T> gates;
};

/// Gradients of a scalar loss with respect to the inputs of causal_gated_linear_attention with
/// RWKV-6's bonus (with_bonus(gates, u)).
template <class T>
struct BonusAttentionGradients {
  /// N x Dk (or N x C): d loss / d q (or d phi_q)
  Matrix<T> q;
  /// N x Dk (or N x C): d loss / d k (or d phi_k)
  Matrix<T> k;
  /// N x Dv: d loss / d v
  Matrix<T> v;
  /// N x 1 or N x C, the shape of the gates: d loss / d a_t, or d loss / d g_t for
  /// log_gates(g); 0 at a reset and in the last row (nothing reads the state after it)
  Matrix<T> gates;
  /// C x 1 or 1 x C, the shape of u: d loss / d u
  Matrix<T> u;
};

/// Gradients of a scalar loss with respect to the inputs of causal_dplr_delta_rule (the
/// generalized delta rule, RWKV-7), each the shape of its input.
template <class T>
struct DplrGradients {
  Matrix<T> q;  ///< N x Dk: d loss / d q (before the scale)
  Matrix<T> k;  ///< N x Dk: d loss / d k
  Matrix<T> v;  ///< N x Dv: d loss / d v
  Matrix<T> a;  ///< N x Dk: d loss / d a (FLA's alpha; RWKV-7's -kk)
  Matrix<T> b;  ///< N x Dk: d loss / d b (FLA's beta; RWKV-7's kk * a)
  /// N x Dk or N x 1, the gates' shape: d loss / d g_t for log_gates(g) (0 where g_t is
  /// -infinity), d loss / d w_t for decays w_t
  Matrix<T> gates;
};

/// Gradients of a scalar loss with respect to the inputs of causal_delta_rule and
/// causal_gated_delta_rule (DeltaNet, Gated DeltaNet, KDA), each the shape of its input.
template <class T>
struct DeltaRuleGradients {
  /// N x Dk: d loss / d q (the raw queries, before the in-kernel L2 norm and the scale)
  Matrix<T> q;
  /// N x Dk: d loss / d k (the raw keys, before the in-kernel L2 norm)
  Matrix<T> k;
  /// N x Dv: d loss / d v
  Matrix<T> v;
  /// N: d loss / d beta
  Vector<T> beta;
  /// N x 1 or N x Dk, the shape of the gates: d loss / d g_t for log_gates(g) (0 at a reset,
  /// g_t = -infinity), d loss / d a_t for gates a_t; N x 0 for DeltaNet (no gates)
  Matrix<T> gates;
};

/// Gradients of a scalar loss with respect to a ShortConv's parameters, summed over every
/// sequence of the call (the gradient with respect to its input goes into a view).
template <class T>
struct ShortConvGradients {
  /// C x K: d loss / d weight
  Matrix<T> weight;
  /// C: d loss / d bias; empty for a convolution without bias
  Vector<T> bias;
};

}  // namespace linattn
