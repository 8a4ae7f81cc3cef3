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

}  // namespace linattn
