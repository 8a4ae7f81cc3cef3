// SPDX-License-Identifier: MIT
// Decayed pairs of a piece of tokens whose log gates are per key feature, and their backward:
// what the chunked backwards of KDA and of the generalized delta rule share.
#pragma once

#include <algorithm>
#include <cstddef>
#include <linattn/config.hpp>
#include <linattn/detail/delta_rule.hpp>
#include <type_traits>
#include <vector>

namespace linattn::detail {

/// For a piece of m tokens with in-piece cumulative log gates G (m x Dk, one per key feature),
///   P(i, j) = sum_f x_if y_jf exp(G_if - G_jf) for j <= i, zeros above the diagonal,
/// by sub-blocks of kDeltaSubBlock rows as the forwards compute them: exp(G_i - G_j) =
/// exp(G_i - G_r) exp(G_r - G_j), r the token before i's sub-block, the second factor <= 1 for
/// j <= r and at most e^kDeltaSpread inside the sub-block; a sub-block whose own decays spread
/// further pairs within itself directly. decays(G, m) computes the factors once per piece;
/// pairs and gradients then run for any x and y.
template <class T>
class FeaturePairs {
 public:
  using RowsRef = Eigen::Ref<const Matrix<T>>;
  using OutRef = Eigen::Ref<Matrix<T>>;

  /// Buffers for pieces of up to `chunk` tokens of Dk = key_dim features.
  void reshape(Eigen::Index chunk, Eigen::Index key_dim) {
    layout(this, chunk, key_dim, [](auto* m, Eigen::Index r, Eigen::Index c) {
      if (m->rows() != r || m->cols() != c) m->resize(r, c);
    });
    chunk_ = chunk;
    inside_.assign(static_cast<std::size_t>(sub_blocks(chunk)), 0);
  }

  /// Bytes reshape(chunk, key_dim) holds.
  static std::size_t bytes(Eigen::Index chunk, Eigen::Index key_dim) {
    std::size_t total = static_cast<std::size_t>(sub_blocks(chunk));
    layout(static_cast<const FeaturePairs*>(nullptr), chunk, key_dim,
           [&](const auto* m, Eigen::Index r, Eigen::Index c) {
             using Buffer = std::remove_cv_t<std::remove_pointer_t<decltype(m)>>;
             total += static_cast<std::size_t>(r * c) * sizeof(typename Buffer::Scalar);
           });
    return total;
  }

  /// The factors of a piece: cum's rows [0, m) are its G (kept by reference until the next
  /// call: pairs and gradients read it).
  void decays(const Matrix<double>& cum, Eigen::Index m);

  /// out(i, j) = P(i, j) for x, y (m x Dk); zeros above the diagonal.
  void pairs(const RowsRef& x, const RowsRef& y, Eigen::Index m, OutRef out);

  /// The backward of pairs for dP (m x m, zeros above the diagonal): dx += its row
  /// share, dy += its column share, dcum += x o the row share - y o the column share.
  void gradients(const RowsRef& x, const RowsRef& y, const RowsRef& dpairs, Eigen::Index m,
                 OutRef dx, OutRef dy, OutRef dcum);

 private:
  static Eigen::Index sub_blocks(Eigen::Index chunk) {
    return (chunk + kDeltaSubBlock - 1) / kDeltaSubBlock;
  }

  /// visit(buffer, rows, cols) for each buffer (of its type, possibly null).
  template <class Self, class Visit>
  static void layout(Self* self, Eigen::Index chunk, Eigen::Index dk, Visit&& visit) {
    auto at = [&](auto member) { return self == nullptr ? nullptr : &(self->*member); };
    const Eigen::Index sub_block = std::min(chunk, kDeltaSubBlock);
    visit(at(&FeaturePairs::right_factor_), sub_blocks(chunk) * chunk, dk);
    for (auto m :
         {&FeaturePairs::left_factor_, &FeaturePairs::right_, &FeaturePairs::block_grad_}) {
      visit(at(m), chunk, dk);
    }
    visit(at(&FeaturePairs::left_), sub_block, dk);
    visit(at(&FeaturePairs::pair_terms_), 3, dk);
    visit(at(&FeaturePairs::spread_), chunk, dk);
  }

  /// f(i0, b, s, inside, width) for each sub-block s of the piece: tokens [i0, i0 + b), the
  /// keys [0, width) reached through the factors (up to its end when `inside`, else the keys
  /// before it; the rest pair directly).
  template <class F>
  void for_each_sub_block(Eigen::Index m, const F& f) const {
    for (Eigen::Index i0 = 0, s = 0; i0 < m; i0 += kDeltaSubBlock, ++s) {
      const Eigen::Index b = std::min(kDeltaSubBlock, m - i0);
      const bool inside = inside_[static_cast<std::size_t>(s)] != 0;
      f(i0, b, s, inside, inside ? i0 + b : i0);
    }
  }

  const Matrix<double>* cum_ = nullptr;
  Eigen::Index chunk_ = 0;
  Matrix<T> right_factor_;             ///< (L / B) L x Dk: exp(G_r - G_j), per sub-block
  Matrix<T> left_factor_;              ///< L x Dk: exp(G_i - G_r) of i's sub-block
  Matrix<T> right_, left_;             ///< L x Dk, B x Dk: rows times the factors
  Matrix<T> block_grad_;               ///< L x Dk: one sub-block's products
  Matrix<T> pair_terms_;               ///< 3 x Dk: one pair's terms, computed alone
  Matrix<double> spread_;              ///< L x Dk: log factors before their exp
  std::vector<unsigned char> inside_;  ///< L / B: sub-blocks whose pairs go through a GEMM
};

template <class T>
void FeaturePairs<T>::decays(const Matrix<double>& cum_all, Eigen::Index m) {
  cum_ = &cum_all;
  const auto cum = cum_all.topRows(m);
  // Every exp on a T buffer, vectorised (an exp of a cast expression is not).
  const auto exp_of = [](auto&& logs, auto&& out) {
    out = logs.template cast<T>();
    out.array() = out.array().exp();
  };
  for (Eigen::Index i0 = 0, s = 0; i0 < m; i0 += kDeltaSubBlock, ++s) {
    const Eigen::Index b = std::min(kDeltaSubBlock, m - i0);
    auto last = spread_.topRows(1);
    last = cum.row(i0 + b - 1);
    if (i0 > 0) last -= cum.row(i0 - 1);
    const bool inside = -last.minCoeff() <= kDeltaSpread;
    inside_[static_cast<std::size_t>(s)] = inside ? 1 : 0;
    const Eigen::Index width = inside ? i0 + b : i0;
    if (width > 0) {
      auto spread = spread_.topRows(width);  // G_r - G_j
      spread = -cum.topRows(width);
      if (i0 > 0) spread.rowwise() += cum.row(i0 - 1);
      exp_of(spread, right_factor_.middleRows(s * chunk_, width));
    }
    auto spread = spread_.topRows(b);  // G_i - G_r
    spread = cum.middleRows(i0, b);
    if (i0 > 0) spread.rowwise() -= cum.row(i0 - 1);
    exp_of(spread, left_factor_.middleRows(i0, b));
  }
}

template <class T>
void FeaturePairs<T>::pairs(const RowsRef& x, const RowsRef& y, Eigen::Index m, OutRef out) {
  const auto cum = cum_->topRows(m).array();
  for_each_sub_block(
      m, [&](Eigen::Index i0, Eigen::Index b, Eigen::Index s, bool inside, Eigen::Index width) {
        if (width > 0) {
          auto right = right_.topRows(width);
          auto left = left_.topRows(b);
          right.array() =
              y.topRows(width).array() * right_factor_.middleRows(s * chunk_, width).array();
          left.array() = x.middleRows(i0, b).array() * left_factor_.middleRows(i0, b).array();
          out.block(i0, 0, b, width).noalias() = left * right.transpose();
        }
        if (inside) return;
        for (Eigen::Index i = i0; i < i0 + b; ++i) {
          for (Eigen::Index j = i0; j <= i; ++j) {
            out(i, j) = (x.row(i).array() * y.row(j).array() *
                         (cum.row(i) - cum.row(j)).template cast<T>().exp())
                            .sum();
          }
        }
      });
  out.topLeftCorner(m, m).template triangularView<Eigen::StrictlyUpper>().setZero();
}

template <class T>
void FeaturePairs<T>::gradients(const RowsRef& x, const RowsRef& y, const RowsRef& dpairs,
                                Eigen::Index m, OutRef dx, OutRef dy, OutRef dcum) {
  const auto cum = cum_->topRows(m).array();
  for_each_sub_block(
      m, [&](Eigen::Index i0, Eigen::Index b, Eigen::Index s, bool inside, Eigen::Index width) {
        if (width > 0) {
          const auto right_factor = right_factor_.middleRows(s * chunk_, width);
          const auto left_factor = left_factor_.middleRows(i0, b);
          const auto block = dpairs.block(i0, 0, b, width);
          // The rows' share: left o (dP (y o right)).
          auto right = right_.topRows(width);
          right.array() = y.topRows(width).array() * right_factor.array();
          auto row_grad = block_grad_.topRows(b);
          row_grad.noalias() = block * right;
          row_grad.array() *= left_factor.array();
          dx.middleRows(i0, b) += row_grad;
          dcum.middleRows(i0, b).array() += x.middleRows(i0, b).array() * row_grad.array();
          // The columns' share: right o (dP^T (x o left)).
          auto left = left_.topRows(b);
          left.array() = x.middleRows(i0, b).array() * left_factor.array();
          auto col_grad = block_grad_.topRows(width);
          col_grad.noalias() = block.transpose() * left;
          col_grad.array() *= right_factor.array();
          dy.topRows(width) += col_grad;
          dcum.topRows(width).array() -= y.topRows(width).array() * col_grad.array();
        }
        if (inside) return;
        for (Eigen::Index i = i0; i < i0 + b; ++i) {
          for (Eigen::Index j = i0; j <= i; ++j) {
            if (dpairs(i, j) == T(0)) continue;
            auto terms = pair_terms_.array();
            terms.row(0) = dpairs(i, j) * (cum.row(i) - cum.row(j)).template cast<T>().exp();
            terms.row(1) = terms.row(0) * y.row(j).array();
            terms.row(2) = terms.row(0) * x.row(i).array();
            dx.row(i).array() += terms.row(1);
            dy.row(j).array() += terms.row(2);
            dcum.row(i).array() += x.row(i).array() * terms.row(1);
            dcum.row(j).array() -= y.row(j).array() * terms.row(2);
          }
        }
      });
}

}  // namespace linattn::detail
