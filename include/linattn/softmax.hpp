// SPDX-License-Identifier: MIT
// Softmax attention baselines: tiled (online softmax), materialised, sliding window, the
// decoding caches, and the tiled backward. The same rows-are-tokens convention as the linear
// routines.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <linattn/config.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/gradients.hpp>
#include <string>
#include <type_traits>
#include <vector>

namespace linattn {

/// Which keys a softmax query sees: all of them, or j <= i (causal). An enum, not a bool, so
/// that a scale cannot be passed where the mask goes.
enum class Mask {
  none,   ///< every query sees every key
  causal  ///< query i sees keys j <= i
};

namespace detail {

/// 1/sqrt(Dk) for a negative scale; throws for NaN or infinity.
inline double resolve_scale(double scale, Eigen::Index key_dim, const char* where) {
  if (std::isnan(scale) || std::isinf(scale)) {
    throw Error(std::string(where) + ": scale must be finite, got " + std::to_string(scale));
  }
  return scale < 0.0 ? 1.0 / std::sqrt(static_cast<double>(key_dim)) : scale;
}

/// Shape and finiteness checks for q, k (N x Dk) and v (N x Dv).
template <class DQ, class DK, class DV>
void validate_softmax_inputs(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                             const Eigen::MatrixBase<DV>& v, const char* where) {
  Options options;  // default checks: shapes, non-empty, finite
  validate_sequence(q, k, v, options, where, "q", "k");
}

/// Rows the softmax tiles read: row-major, rows anywhere in memory (a matrix, a block of one, a
/// head of a [B, H, N, D] view). Other inputs (column-major, strided entries, expressions) are
/// copied once into such rows when the call binds them.
template <class T>
using SoftmaxRows = Eigen::Ref<const Matrix<T>, 0, Eigen::OuterStride<>>;
/// x as the tiles read it: in place where its rows are in memory, else (or where a Ref would
/// misread it: Eigen takes an outer stride of 0, one row repeated, as unset) copied into `copy`.
template <class T, class Derived>
SoftmaxRows<T> softmax_rows(const Eigen::MatrixBase<Derived>& x, Matrix<T>& copy) {
  if constexpr ((int(Derived::Flags) & Eigen::DirectAccessBit) != 0) {
    if (x.rows() > 1 && x.derived().outerStride() == 0) {
      copy = x;
      return SoftmaxRows<T>(copy);
    }
  }
  return SoftmaxRows<T>(x.derived());
}

/// Rows the softmax forward writes: any row-major rows, entries at any stride (a view's head).
template <class T>
using SoftmaxOut = Eigen::Ref<Matrix<T>, 0, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>>;

/// Online-softmax attention over tiles of queries and keys. Only key tiles that a query tile
/// can see are visited: [window_begin(i), i] for every query i. Memory O(tile * (tile + Dv)),
/// and the callers' copies of inputs whose rows are not in memory (softmax_rows).
template <class T>
class TiledSoftmax {
 public:
  static constexpr Eigen::Index kQueryTile = 64;
  static constexpr Eigen::Index kKeyTile = 256;

  TiledSoftmax(Eigen::Index key_dim, Eigen::Index value_dim)
      : q_(kQueryTile, key_dim),
        k_(kKeyTile, key_dim),
        v_(kKeyTile, value_dim),
        scores_(kQueryTile, kKeyTile),
        acc_(kQueryTile, value_dim),
        row_max_(kQueryTile),
        row_sum_(kQueryTile) {}

  /// @param window  keys j with i - window < j <= i are seen (causal), or all keys when
  ///                window <= 0 and causal is false.
  void run(const SoftmaxRows<T>& q, const SoftmaxRows<T>& k, const SoftmaxRows<T>& v, T scale,
           bool causal, Eigen::Index window, SoftmaxOut<T> out);

  /// Query rows [qb, qb + qlen), qlen <= kQueryTile, against every key they see. Leaves, in
  /// the first qlen rows, the unnormalised output in acc(), the running maximum of the scaled
  /// logits in row_max() and the sum of exp(logit - row_max) in row_sum(); the output is
  /// acc / row_sum and the logsumexp row_max + log(row_sum).
  void attend(const SoftmaxRows<T>& q, const SoftmaxRows<T>& k, const SoftmaxRows<T>& v, T scale,
              bool causal, Eigen::Index window, Eigen::Index qb, Eigen::Index qlen);

  /// kQueryTile x Dv; see attend.
  const Matrix<T>& acc() const { return acc_; }
  /// kQueryTile; see attend.
  const Vector<T>& row_max() const { return row_max_; }
  /// kQueryTile; see attend.
  const Vector<T>& row_sum() const { return row_sum_; }

 private:
  Matrix<T> q_, k_, v_, scores_, acc_;
  Vector<T> row_max_, row_sum_;
};

/// The FlashAttention-2 backward on the CPU: the same tiles, never an N x N buffer. A first
/// sweep recomputes each row's logsumexp L_i and D_i = dO_i . O_i (O itself is not kept: O(N)
/// extra memory); then every visible (key tile, query tile) pair rebuilds P = exp(S - L) and
/// adds its share to all three gradients with five tile GEMMs.
template <class T>
class TiledSoftmaxBackward {
 public:
  static constexpr Eigen::Index kQueryTile = 64;
  static constexpr Eigen::Index kKeyTile = 256;

  TiledSoftmaxBackward(Eigen::Index n, Eigen::Index key_dim, Eigen::Index value_dim)
      : forward_(key_dim, value_dim),
        lse_(n),
        delta_(n),
        q_(kQueryTile, key_dim),
        dout_(kQueryTile, value_dim),
        k_(kKeyTile, key_dim),
        v_(kKeyTile, value_dim),
        p_(kQueryTile, kKeyTile),
        ds_(kQueryTile, kKeyTile),
        dk_(kKeyTile, key_dim),
        dv_(kKeyTile, value_dim) {}

  /// Writes every row of grad_q, grad_k (N x Dk) and grad_v (N x Dv); they may not alias the
  /// inputs.
  void run(const SoftmaxRows<T>& q, const SoftmaxRows<T>& k, const SoftmaxRows<T>& v,
           const SoftmaxRows<T>& dout, T scale, bool causal, Eigen::Ref<Matrix<T>> grad_q,
           Eigen::Ref<Matrix<T>> grad_k, Eigen::Ref<Matrix<T>> grad_v);

 private:
  /// L_i = log sum_j exp(S_ij) and D_i = dO_i . O_i for every row, one query tile at a time.
  void statistics(const SoftmaxRows<T>& q, const SoftmaxRows<T>& k, const SoftmaxRows<T>& v,
                  const SoftmaxRows<T>& dout, T scale, bool causal);

  TiledSoftmax<T> forward_;
  Vector<T> lse_, delta_;                          // N
  Matrix<T> q_, dout_, k_, v_, p_, ds_, dk_, dv_;  // tiles
};

template <class T>
void TiledSoftmax<T>::run(const SoftmaxRows<T>& q, const SoftmaxRows<T>& k, const SoftmaxRows<T>& v,
                          T scale, bool causal, Eigen::Index window, SoftmaxOut<T> out) {
  const Eigen::Index n = q.rows();
  for (Eigen::Index qb = 0; qb < n; qb += kQueryTile) {
    const Eigen::Index qlen = std::min(kQueryTile, n - qb);
    attend(q, k, v, scale, causal, window, qb, qlen);
    for (Eigen::Index r = 0; r < qlen; ++r) {
      if (out.innerStride() == 1) {  // adjacent entries: vectorised stores
        Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(&out.coeffRef(qb + r, 0), out.cols()) =
            acc_.row(r) / row_sum_(r);
      } else {
        out.row(qb + r) = acc_.row(r) / row_sum_(r);
      }
    }
  }
}

template <class T>
void TiledSoftmax<T>::attend(const SoftmaxRows<T>& q, const SoftmaxRows<T>& k,
                             const SoftmaxRows<T>& v, T scale, bool causal, Eigen::Index window,
                             Eigen::Index qb, Eigen::Index qlen) {
  const Eigen::Index n = q.rows();
  const T minus_inf = -std::numeric_limits<T>::infinity();
  Eigen::Ref<Matrix<T>> queries = q_.topRows(qlen);
  queries = q.middleRows(qb, qlen) * scale;  // fold the scale into q once
  Eigen::Ref<Matrix<T>> acc = acc_.topRows(qlen);
  acc.setZero();
  row_max_.head(qlen).setConstant(minus_inf);
  row_sum_.head(qlen).setZero();
  // Keys visible to this tile: [first, last).
  const Eigen::Index last = causal ? qb + qlen : n;
  const Eigen::Index first =
      (causal && window > 0) ? std::max<Eigen::Index>(0, qb - window + 1) : 0;
  for (Eigen::Index kb = first; kb < last; kb += kKeyTile) {
    const Eigen::Index klen = std::min(kKeyTile, last - kb);
    k_.topRows(klen) = k.middleRows(kb, klen);
    v_.topRows(klen) = v.middleRows(kb, klen);
    Eigen::Ref<Matrix<T>> scores = scores_.topLeftCorner(qlen, klen);
    scores.noalias() = queries * k_.topRows(klen).transpose();
    // Mask keys outside [i - window + 1, i] where the tile straddles an edge.
    if (causal) {
      const bool crosses_diagonal = kb + klen > qb;
      const bool crosses_window = window > 0 && kb < qb + qlen - window;
      if (crosses_diagonal || crosses_window) {
        for (Eigen::Index r = 0; r < qlen; ++r) {
          const Eigen::Index i = qb + r;
          for (Eigen::Index c = 0; c < klen; ++c) {
            const Eigen::Index j = kb + c;
            if (j > i || (window > 0 && j <= i - window)) scores(r, c) = minus_inf;
          }
        }
      }
    }
    for (Eigen::Index r = 0; r < qlen; ++r) {
      const T tile_max = scores.row(r).maxCoeff();
      const T new_max = std::max(row_max_(r), tile_max);
      if (new_max == minus_inf) {  // nothing visible to this query yet
        scores.row(r).setZero();
        continue;
      }
      const T rescale = std::exp(row_max_(r) - new_max);
      scores.row(r) = (scores.row(r).array() - new_max).exp().matrix();
      row_sum_(r) = row_sum_(r) * rescale + scores.row(r).sum();
      acc.row(r) *= rescale;
      row_max_(r) = new_max;
    }
    acc.noalias() += scores * v_.topRows(klen);
  }
}

template <class T>
void TiledSoftmaxBackward<T>::run(const SoftmaxRows<T>& q, const SoftmaxRows<T>& k,
                                  const SoftmaxRows<T>& v, const SoftmaxRows<T>& dout, T scale,
                                  bool causal, Eigen::Ref<Matrix<T>> grad_q,
                                  Eigen::Ref<Matrix<T>> grad_k, Eigen::Ref<Matrix<T>> grad_v) {
  const Eigen::Index n = q.rows();
  const T minus_inf = -std::numeric_limits<T>::infinity();
  statistics(q, k, v, dout, scale, causal);
  grad_q.setZero();
  // Key tiles outside, so dK_j and dV_j stay in a tile buffer; dQ_i accumulates in place.
  for (Eigen::Index kb = 0; kb < n; kb += kKeyTile) {
    const Eigen::Index klen = std::min(kKeyTile, n - kb);
    // The scale goes on the keys: S = Q (sK)^T and dQ = dS (sK) take it for free, and dK =
    // s dS^T Q takes it once per key tile instead of once per pair.
    k_.topRows(klen) = k.middleRows(kb, klen) * scale;
    v_.topRows(klen) = v.middleRows(kb, klen);
    dk_.topRows(klen).setZero();
    dv_.topRows(klen).setZero();
    const Eigen::Index first = causal ? kb / kQueryTile * kQueryTile : 0;
    for (Eigen::Index qb = first; qb < n; qb += kQueryTile) {
      const Eigen::Index qlen = std::min(kQueryTile, n - qb);
      // Causal: keys after this tile's last query are masked in every row, so they are left
      // out of the products rather than computed and zeroed.
      const Eigen::Index kcols = causal ? std::min(klen, qb + qlen - kb) : klen;
      Eigen::Ref<Matrix<T>> queries = q_.topRows(qlen);
      Eigen::Ref<Matrix<T>> douts = dout_.topRows(qlen);
      queries = q.middleRows(qb, qlen);
      douts = dout.middleRows(qb, qlen);
      const Eigen::Ref<const Matrix<T>> keys = k_.topRows(kcols);
      const Eigen::Ref<const Matrix<T>> values = v_.topRows(kcols);
      Eigen::Ref<Matrix<T>> p = p_.topLeftCorner(qlen, kcols);
      Eigen::Ref<Matrix<T>> ds = ds_.topLeftCorner(qlen, kcols);
      p.noalias() = queries * keys.transpose();
      if (causal && kb + kcols - 1 > qb) {  // the tile crosses the diagonal
        for (Eigen::Index r = 0; r < qlen; ++r) {
          const Eigen::Index visible = std::clamp<Eigen::Index>(qb + r - kb + 1, 0, kcols);
          p.row(r).tail(kcols - visible).setConstant(minus_inf);
        }
      }
      p = (p.array().colwise() - lse_.segment(qb, qlen).array()).exp().matrix();
      dv_.topRows(kcols).noalias() += p.transpose() * douts;
      ds.noalias() = douts * values.transpose();  // dP
      ds = (p.array() * (ds.array().colwise() - delta_.segment(qb, qlen).array())).matrix();
      grad_q.middleRows(qb, qlen).noalias() += ds * keys;
      dk_.topRows(kcols).noalias() += ds.transpose() * queries;
    }
    grad_k.middleRows(kb, klen) = dk_.topRows(klen) * scale;
    grad_v.middleRows(kb, klen) = dv_.topRows(klen);
  }
}

template <class T>
void TiledSoftmaxBackward<T>::statistics(const SoftmaxRows<T>& q, const SoftmaxRows<T>& k,
                                         const SoftmaxRows<T>& v, const SoftmaxRows<T>& dout,
                                         T scale, bool causal) {
  const Eigen::Index n = q.rows();
  for (Eigen::Index qb = 0; qb < n; qb += TiledSoftmax<T>::kQueryTile) {
    const Eigen::Index qlen = std::min(TiledSoftmax<T>::kQueryTile, n - qb);
    forward_.attend(q, k, v, scale, causal, 0, qb, qlen);
    for (Eigen::Index r = 0; r < qlen; ++r) {
      const T sum = forward_.row_sum()(r);
      lse_(qb + r) = forward_.row_max()(r) + std::log(sum);
      delta_(qb + r) = dout.row(qb + r).dot(forward_.acc().row(r)) / sum;
    }
  }
}

/// The tiled forward over any inputs, each read in place where softmax_rows can and copied
/// once otherwise: what every softmax call writes its output with.
template <class DQ, class DK, class DV, class T = typename DQ::Scalar>
void tiled_softmax(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                   const Eigen::MatrixBase<DV>& v, std::common_type_t<T> scale, bool causal,
                   Eigen::Index window, SoftmaxOut<std::common_type_t<T>> out) {
  Matrix<T> q_copy, k_copy, v_copy;  // used only for rows a Ref cannot read in place
  TiledSoftmax<T>(q.cols(), v.cols())
      .run(softmax_rows(q, q_copy), softmax_rows(k, k_copy), softmax_rows(v, v_copy), scale, causal,
           window, out);
}

}  // namespace detail

/// Softmax attention, tiled with an online softmax (numerically stable, never an N x N buffer;
/// the tile products are Eigen GEMMs). Causal mode skips the tiles above the diagonal. Inputs
/// that are not row-major rows in memory (column-major, an expression) are copied once first.
/// @param q       N x Dk queries
/// @param k       N x Dk keys
/// @param v       N x Dv values
/// @param mask    Mask::causal (query i sees keys j <= i) or Mask::none
/// @param out     N x Dv result
/// @param scale   multiplies q . k; negative means 1/sqrt(Dk)
template <class DQ, class DK, class DV>
void softmax_attention_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                            const Eigen::MatrixBase<DV>& v, Mask mask,
                            Eigen::Ref<Matrix<typename DQ::Scalar>> out, double scale = -1) {
  using T = typename DQ::Scalar;
  static_assert(detail::is_supported_scalar<T>, "linattn kernels take float or double inputs");
  constexpr const char* where = "softmax_attention";
  detail::validate_softmax_inputs(q, k, v, where);
  detail::require_output_shape(out, q.rows(), v.cols(), where);
  const T s = static_cast<T>(detail::resolve_scale(scale, q.cols(), where));
  const detail::SerialEigenScope serial_eigen;  // a single-thread baseline, also under OpenMP
  detail::tiled_softmax(q, k, v, s, mask == Mask::causal, 0, out);
}

/// Softmax attention (tiled); returns N x Dv. See softmax_attention_into.
/// @param q  N x Dk queries; k N x Dk keys; v N x Dv values
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> softmax_attention(const Eigen::MatrixBase<DQ>& q,
                                              const Eigen::MatrixBase<DK>& k,
                                              const Eigen::MatrixBase<DV>& v, Mask mask,
                                              double scale = -1) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  softmax_attention_into(q, k, v, mask, out, scale);
  return out;
}

/// Gradients of softmax_attention: given dO = d loss / d out, writes d loss / d q, k and v. The
/// FlashAttention-2 algorithm on tiles (Eigen GEMMs, one thread): it recomputes the softmax
/// statistics rather than taking them from the forward, and allocates O(N + tile * (tile + Dk
/// + Dv)), never an N x N buffer (an input that is not row-major rows in memory, such as a
/// column-major matrix or an expression, is first copied once). Causal mode skips the tiles
/// above the diagonal.
/// @param q         N x Dk queries
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param grad_out  N x Dv gradient of the loss with respect to the attention output
/// @param mask      Mask::causal or Mask::none (as in the forward)
/// @param grad_q    N x Dk result, d loss / d q (may not alias the inputs)
/// @param grad_k    N x Dk result, d loss / d k
/// @param grad_v    N x Dv result, d loss / d v
/// @param scale     multiplies q . k; negative means 1/sqrt(Dk)
template <class DQ, class DK, class DV, class DO>
void softmax_attention_backward_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                     const Eigen::MatrixBase<DV>& v,
                                     const Eigen::MatrixBase<DO>& grad_out, Mask mask,
                                     Eigen::Ref<Matrix<typename DQ::Scalar>> grad_q,
                                     Eigen::Ref<Matrix<typename DQ::Scalar>> grad_k,
                                     Eigen::Ref<Matrix<typename DQ::Scalar>> grad_v,
                                     double scale = -1) {
  using T = typename DQ::Scalar;
  static_assert(detail::is_supported_scalar<T>, "linattn kernels take float or double inputs");
  constexpr const char* where = "softmax_attention_backward";
  detail::validate_softmax_inputs(q, k, v, where);
  if (grad_out.rows() != q.rows() || grad_out.cols() != v.cols()) {
    throw Error(std::string(where) + ": grad_out is " + detail::shape_string(grad_out) +
                " but the attention output is " + detail::shape_string(q.rows(), v.cols()));
  }
  detail::require_finite(grad_out, where, "grad_out");
  const auto require_shape = [&](const Eigen::Ref<Matrix<T>>& out, Eigen::Index cols,
                                 const char* name) {
    if (out.rows() != q.rows() || out.cols() != cols) {
      throw Error(std::string(where) + ": " + name + " is " +
                  detail::shape_string(out.rows(), out.cols()) + " but the gradient is " +
                  detail::shape_string(q.rows(), cols));
    }
  };
  require_shape(grad_q, q.cols(), "grad_q");
  require_shape(grad_k, k.cols(), "grad_k");
  require_shape(grad_v, v.cols(), "grad_v");
  const T s = static_cast<T>(detail::resolve_scale(scale, q.cols(), where));
  const detail::SerialEigenScope serial_eigen;  // a single-thread baseline, also under OpenMP
  Matrix<T> q_copy, k_copy, v_copy, grad_copy;  // used only for rows a Ref cannot read in place
  detail::TiledSoftmaxBackward<T>(q.rows(), q.cols(), v.cols())
      .run(detail::softmax_rows(q, q_copy), detail::softmax_rows(k, k_copy),
           detail::softmax_rows(v, v_copy), detail::softmax_rows(grad_out, grad_copy), s,
           mask == Mask::causal, grad_q, grad_k, grad_v);
}

/// Gradients of softmax_attention; returns {d q (N x Dk), d k (N x Dk), d v (N x Dv)}. See
/// softmax_attention_backward_into.
/// @param q         N x Dk queries
/// @param k         N x Dk keys
/// @param v         N x Dv values
/// @param grad_out  N x Dv gradient of the loss with respect to the attention output
/// @param mask      Mask::causal or Mask::none
/// @param scale     multiplies q . k; negative means 1/sqrt(Dk)
template <class DQ, class DK, class DV, class DO>
AttentionGradients<typename DQ::Scalar> softmax_attention_backward(
    const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
    const Eigen::MatrixBase<DO>& grad_out, Mask mask, double scale = -1) {
  using T = typename DQ::Scalar;
  AttentionGradients<T> grads{Matrix<T>(q.rows(), q.cols()), Matrix<T>(k.rows(), k.cols()),
                              Matrix<T>(v.rows(), v.cols())};
  softmax_attention_backward_into(q, k, v, grad_out, mask, grads.q, grads.k, grads.v, scale);
  return grads;
}

/// Causal softmax over the last `window` tokens (j in (i - window, i]), Longformer / StreamingLLM
/// style; same tiling, O(N * window) work.
/// @param q       N x Dk queries
/// @param k       N x Dk keys
/// @param v       N x Dv values
/// @param window  tokens each query sees, itself included; >= 1
/// @param out     N x Dv result
/// @param scale   negative means 1/sqrt(Dk)
template <class DQ, class DK, class DV>
void sliding_window_attention_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                                   const Eigen::MatrixBase<DV>& v, Eigen::Index window,
                                   Eigen::Ref<Matrix<typename DQ::Scalar>> out, double scale = -1) {
  using T = typename DQ::Scalar;
  static_assert(detail::is_supported_scalar<T>, "linattn kernels take float or double inputs");
  constexpr const char* where = "sliding_window_attention";
  detail::validate_softmax_inputs(q, k, v, where);
  if (window < 1) {
    throw Error(std::string(where) + ": window must be >= 1, got " + std::to_string(window));
  }
  detail::require_output_shape(out, q.rows(), v.cols(), where);
  const T s = static_cast<T>(detail::resolve_scale(scale, q.cols(), where));
  const detail::SerialEigenScope serial_eigen;
  detail::tiled_softmax(q, k, v, s, true, window, out);
}

/// Sliding-window softmax attention; returns N x Dv. See sliding_window_attention_into.
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> sliding_window_attention(const Eigen::MatrixBase<DQ>& q,
                                                     const Eigen::MatrixBase<DK>& k,
                                                     const Eigen::MatrixBase<DV>& v,
                                                     Eigen::Index window, double scale = -1) {
  Matrix<typename DQ::Scalar> out(q.rows(), v.cols());
  sliding_window_attention_into(q, k, v, window, out, scale);
  return out;
}

/// Softmax attention as most people write it: the full N x N score matrix, a row softmax,
/// one product. O(N^2) memory; kept as a second baseline and for tests.
/// @param q       N x Dk queries; k N x Dk keys; v N x Dv values
/// @param mask    Mask::causal (query i sees keys j <= i) or Mask::none
/// @param scale   negative means 1/sqrt(Dk)
template <class DQ, class DK, class DV>
Matrix<typename DQ::Scalar> materialized_softmax_attention(const Eigen::MatrixBase<DQ>& q,
                                                           const Eigen::MatrixBase<DK>& k,
                                                           const Eigen::MatrixBase<DV>& v,
                                                           Mask mask, double scale = -1) {
  using T = typename DQ::Scalar;
  static_assert(detail::is_supported_scalar<T>, "linattn kernels take float or double inputs");
  constexpr const char* where = "materialized_softmax_attention";
  detail::validate_softmax_inputs(q, k, v, where);
  const T s = static_cast<T>(detail::resolve_scale(scale, q.cols(), where));
  Matrix<T> scores(q.rows(), k.rows());
  scores.noalias() = (q * s) * k.transpose();
  if (mask == Mask::causal) {
    scores.template triangularView<Eigen::StrictlyUpper>().setConstant(
        -std::numeric_limits<T>::infinity());
  }
  const Vector<T> row_max = scores.rowwise().maxCoeff();
  scores = (scores.colwise() - row_max).array().exp().matrix();
  const Vector<T> row_sum = scores.rowwise().sum();
  Matrix<T> out(q.rows(), v.cols());
  out.noalias() = scores * v;
  out.array().colwise() /= row_sum.array();
  return out;
}

/// The decoding baseline: a key/value cache that grows by one row per step (amortised doubling,
/// no per-step reallocation of the whole cache) and attends over everything cached.
template <class T>
class SoftmaxKVCache {
  static_assert(detail::is_supported_scalar<T>, "SoftmaxKVCache<T> takes float or double");

 public:
  /// @param key_dim    Dk
  /// @param value_dim  Dv
  /// @param scale      multiplies q . k; negative means 1/sqrt(Dk)
  SoftmaxKVCache(Eigen::Index key_dim, Eigen::Index value_dim, double scale = -1)
      : key_dim_(detail::require_positive_dim(key_dim, "SoftmaxKVCache", "key_dim")),
        value_dim_(detail::require_positive_dim(value_dim, "SoftmaxKVCache", "value_dim")),
        scale_(static_cast<T>(detail::resolve_scale(scale, key_dim, "SoftmaxKVCache"))),
        query_(key_dim) {}

  /// Appends k, v and attends over the whole cache; returns the Dv output.
  /// @param q  Dk query; k Dk key; v Dv value (row or column vectors)
  template <class DQ, class DK, class DV>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v) {
    Vector<T> out(value_dim_);
    step_into(q, k, v, out);
    return out;
  }

  /// As step, writing the output into `out` (Dv).
  template <class DQ, class DK, class DV>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, Eigen::Ref<Vector<T>> out) {
    constexpr const char* where = "SoftmaxKVCache::step";
    detail::require_finite_vector(q, key_dim_, where, "q");
    detail::require_output_size(out, value_dim_, where);
    append_one(k, v, where);
    query_ = q.reshaped() * scale_;
    Eigen::Ref<Vector<T>> scores = scores_.head(size_);
    scores.noalias() = keys_.topRows(size_) * query_;
    const T top = scores.maxCoeff();
    scores = (scores.array() - top).exp().matrix();
    out.noalias() = values_.topRows(size_).transpose() * scores;
    out /= scores.sum();
  }

  /// Appends many keys and values without attending (prompt prefill of the cache).
  /// @param k  N x Dk keys; v N x Dv values
  template <class DK, class DV>
  void append(const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v) {
    constexpr const char* where = "SoftmaxKVCache::append";
    if (k.cols() != key_dim_ || v.cols() != value_dim_ || k.rows() != v.rows()) {
      throw Error(std::string(where) + ": k is " + detail::shape_string(k) + " and v is " +
                  detail::shape_string(v) + "; expected N x " + std::to_string(key_dim_) +
                  " and N x " + std::to_string(value_dim_));
    }
    detail::require_finite(k, where, "k");
    detail::require_finite(v, where, "v");
    if (k.rows() == 0) return;  // nothing to append
    reserve(size_ + k.rows());
    keys_.middleRows(size_, k.rows()) = k;
    values_.middleRows(size_, v.rows()) = v;
    size_ += k.rows();
  }

  /// Drops every token after the first `tokens` (rollback); keeps the capacity.
  void truncate(Eigen::Index tokens) {
    if (tokens < 0 || tokens > size_) {
      throw Error("SoftmaxKVCache::truncate: tokens must be in [0, " + std::to_string(size_) +
                  "], got " + std::to_string(tokens));
    }
    size_ = tokens;
  }

  /// Grows the capacity to at least `tokens` rows.
  void reserve(Eigen::Index tokens) {
    if (tokens <= capacity()) return;
    const Eigen::Index capacity = std::max<Eigen::Index>(tokens, 2 * this->capacity());
    keys_.conservativeResize(capacity, key_dim_);
    values_.conservativeResize(capacity, value_dim_);
    scores_.resize(capacity);
  }

  /// Tokens cached.
  Eigen::Index tokens() const { return size_; }
  /// Rows allocated for keys and values, >= tokens().
  Eigen::Index capacity() const { return keys_.rows(); }
  /// Dk, the width of q and k.
  Eigen::Index key_dim() const { return key_dim_; }
  /// Dv, the width of v and the output.
  Eigen::Index value_dim() const { return value_dim_; }
  /// The scale multiplying q . k (resolved: 1/sqrt(Dk) when made with a negative one).
  T scale() const { return scale_; }
  /// Cached keys, tokens() x Dk.
  typename Matrix<T>::ConstRowsBlockXpr keys() const { return keys_.topRows(size_); }
  /// Cached values, tokens() x Dv.
  typename Matrix<T>::ConstRowsBlockXpr values() const { return values_.topRows(size_); }
  /// Bytes held for the cached tokens (keys and values), not counting spare capacity.
  std::size_t bytes() const {
    return static_cast<std::size_t>(size_ * (key_dim_ + value_dim_)) * sizeof(T);
  }
  /// Drops every token; keeps the capacity.
  void reset() { size_ = 0; }

 private:
  template <class DK, class DV>
  void append_one(const Eigen::MatrixBase<DK>& k, const Eigen::MatrixBase<DV>& v,
                  const char* where) {
    detail::require_finite_vector(k, key_dim_, where, "k");
    detail::require_finite_vector(v, value_dim_, where, "v");
    reserve(size_ + 1);
    keys_.row(size_) = k.reshaped().transpose();
    values_.row(size_) = v.reshaped().transpose();
    ++size_;
  }

  Eigen::Index key_dim_, value_dim_;
  T scale_;
  Eigen::Index size_ = 0;
  Matrix<T> keys_, values_;  // capacity x Dk, capacity x Dv
  Vector<T> scores_;
  Vector<T> query_;
};

/// The KV caches of B sequences through one softmax attention layer of H heads (the KV heads:
/// fewer than the query heads under GQA), cache b * H + h for head h of sequence b: what a
/// SessionPool holds for a hybrid model's softmax layers, as a RecurrentStateBatch is a
/// linear layer's. Each cache is a SoftmaxKVCache, stepped by the caller.
/// @tparam T  float or double
template <class T>
class KVCacheBatch {
 public:
  /// What make_states returns (a SessionPool<> takes a KVCacheBatch as a softmax layer).
  using States = KVCacheBatch;

  /// B * H empty caches of Dk-wide keys and Dv-wide values.
  /// @param batch      B >= 1, sequences
  /// @param heads      H >= 1, KV heads per sequence
  /// @param key_dim    Dk
  /// @param value_dim  Dv
  /// @param scale      multiplies q . k; negative means 1/sqrt(Dk)
  KVCacheBatch(Eigen::Index batch, Eigen::Index heads, Eigen::Index key_dim, Eigen::Index value_dim,
               double scale = -1)
      : heads_(detail::require_positive_dim(heads, "KVCacheBatch", "heads")),
        caches_(static_cast<std::size_t>(
                    detail::require_positive_dim(batch, "KVCacheBatch", "batch") * heads),
                SoftmaxKVCache<T>(key_dim, value_dim, scale)) {}

  /// Caches for `batch` sequences of this layer's shape, empty (a SessionPool's layer).
  KVCacheBatch make_states(Eigen::Index batch) const {
    const SoftmaxKVCache<T>& first = caches_.front();
    return KVCacheBatch(batch, heads_, first.key_dim(), first.value_dim(), first.scale());
  }
  /// B, sequences.
  Eigen::Index batch() const { return static_cast<Eigen::Index>(caches_.size()) / heads_; }
  /// H, caches per sequence.
  Eigen::Index heads() const { return heads_; }
  /// Head `head`'s cache of sequence `b`.
  SoftmaxKVCache<T>& cache(Eigen::Index b, Eigen::Index head) { return caches_[index(b, head)]; }
  /// Read-only.
  const SoftmaxKVCache<T>& cache(Eigen::Index b, Eigen::Index head) const {
    return caches_[index(b, head)];
  }
  /// Drops every cached token (keeps the capacity).
  void reset() {
    for (SoftmaxKVCache<T>& cache : caches_) cache.reset();
  }

 private:
  friend struct detail::PoolAccess;
  std::size_t index(Eigen::Index b, Eigen::Index head) const {
    if (b < 0 || b >= batch() || head < 0 || head >= heads_) {
      throw Error("KVCacheBatch::cache: (sequence " + std::to_string(b) + ", head " +
                  std::to_string(head) + ") is out of range [0, " + std::to_string(batch()) +
                  ") x [0, " + std::to_string(heads_) + ")");
    }
    return static_cast<std::size_t>(b * heads_ + head);
  }

  Eigen::Index heads_;
  std::vector<SoftmaxKVCache<T>> caches_;  // b * H + h
};

/// The decoding twin of sliding_window_attention: a ring buffer of the last `window` keys and
/// values; each step attends over them. Constant memory, O(window * (Dk + Dv)) per step.
template <class T>
class SlidingWindowCache {
  static_assert(detail::is_supported_scalar<T>, "SlidingWindowCache<T> takes float or double");

 public:
  /// @param key_dim    Dk
  /// @param value_dim  Dv
  /// @param window     tokens each query sees, itself included; >= 1
  /// @param scale      multiplies q . k; negative means 1/sqrt(Dk)
  SlidingWindowCache(Eigen::Index key_dim, Eigen::Index value_dim, Eigen::Index window,
                     double scale = -1)
      : scale_(static_cast<T>(detail::resolve_scale(scale, key_dim, "SlidingWindowCache"))),
        keys_(detail::require_positive_dim(window, "SlidingWindowCache", "window"),
              detail::require_positive_dim(key_dim, "SlidingWindowCache", "key_dim")),
        values_(window, detail::require_positive_dim(value_dim, "SlidingWindowCache", "value_dim")),
        scores_(window),
        query_(key_dim) {}

  /// Writes k, v over the oldest entry and attends over the window; returns the Dv output.
  /// @param q  Dk query; k Dk key; v Dv value
  template <class DQ, class DK, class DV>
  Vector<T> step(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v) {
    Vector<T> out(value_dim());
    step_into(q, k, v, out);
    return out;
  }

  /// As step, writing the output into `out` (Dv); allocates nothing.
  template <class DQ, class DK, class DV>
  void step_into(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, Eigen::Ref<Vector<T>> out) {
    constexpr const char* where = "SlidingWindowCache::step";
    detail::require_finite_vector(q, key_dim(), where, "q");
    detail::require_finite_vector(k, key_dim(), where, "k");
    detail::require_finite_vector(v, value_dim(), where, "v");
    detail::require_output_size(out, value_dim(), where);
    const Eigen::Index slot = static_cast<Eigen::Index>(tokens_ % window());
    keys_.row(slot) = k.reshaped().transpose();
    values_.row(slot) = v.reshaped().transpose();
    ++tokens_;
    // Softmax is order-free, so the ring need not be unrolled.
    const Eigen::Index live = std::min<Eigen::Index>(window(), static_cast<Eigen::Index>(tokens_));
    query_ = q.reshaped() * scale_;
    Eigen::Ref<Vector<T>> scores = scores_.head(live);
    scores.noalias() = keys_.topRows(live) * query_;
    const T top = scores.maxCoeff();
    scores = (scores.array() - top).exp().matrix();
    out.noalias() = values_.topRows(live).transpose() * scores;
    out /= scores.sum();
  }

  /// Tokens stepped since construction or reset; may exceed window().
  std::int64_t tokens() const { return tokens_; }
  /// Tokens each query sees, itself included.
  Eigen::Index window() const { return keys_.rows(); }
  /// Dk, the width of q and k.
  Eigen::Index key_dim() const { return keys_.cols(); }
  /// Dv, the width of v and the output.
  Eigen::Index value_dim() const { return values_.cols(); }
  /// Bytes held for keys and values (the full window).
  std::size_t bytes() const {
    return static_cast<std::size_t>(window() * (key_dim() + value_dim())) * sizeof(T);
  }
  /// Forgets every token; keeps the window and dimensions.
  void reset() { tokens_ = 0; }

 private:
  T scale_;
  std::int64_t tokens_ = 0;
  Matrix<T> keys_, values_;  // window x Dk, window x Dv
  Vector<T> scores_;
  Vector<T> query_;
};

}  // namespace linattn

/// The compiled mode's instances of the softmax tiles, one scalar type T each; `prefix` is
/// `extern template` (every TU that defines LINATTN_COMPILED) or `template` (the library).
#define LINATTN_SOFTMAX_INSTANCES(prefix, T)     \
  prefix class linattn::detail::TiledSoftmax<T>; \
  prefix class linattn::detail::TiledSoftmaxBackward<T>;

#ifdef LINATTN_COMPILED
#define LINATTN_DECLARE_SOFTMAX_KERNELS(T) LINATTN_SOFTMAX_INSTANCES(extern template, T)
LINATTN_DECLARE_SOFTMAX_KERNELS(float)
LINATTN_DECLARE_SOFTMAX_KERNELS(double)
#undef LINATTN_DECLARE_SOFTMAX_KERNELS
#endif
