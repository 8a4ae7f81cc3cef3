// SPDX-License-Identifier: MIT
// Caller memory for the multi-head view tests: B x H x N x D elements in a [B, H, N, D],
// [B, N, H, D] or padded layout, with the views over it.
#pragma once

#include <algorithm>
#include <linattn/config.hpp>
#include <linattn/heads_view.hpp>
#include <vector>

namespace linattn_test {

using linattn::HeadStrides;
using linattn::HeadsView;
using linattn::Matrix;

enum class Layout { bhnd, bnhd, padded };

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::bhnd:
      return "[B,H,N,D]";
    case Layout::bnhd:
      return "[B,N,H,D]";
    case Layout::padded:
      return "padded, dim stride 2";
  }
  return "?";
}

/// B x H x N x D elements of caller memory in a layout. `padded` leaves gaps between tokens,
/// heads and sequences and puts features two elements apart (so head_rows cannot be used);
/// every gap holds `gap`. The buffer is exactly as long as the last element needs, so a read
/// past it is a sanitizer error.
template <class T>
class Heads {
 public:
  Heads(Layout layout, Eigen::Index batch, Eigen::Index heads, Eigen::Index tokens,
        Eigen::Index dim, T gap)
      : layout_(layout), batch_(batch), heads_(heads), tokens_(tokens), dim_(dim) {
    switch (layout) {
      case Layout::bhnd:
        strides_ = HeadStrides{heads * tokens * dim, tokens * dim, dim, 1};
        break;
      case Layout::bnhd:
        strides_ = HeadStrides{tokens * heads * dim, dim, heads * dim, 1};
        break;
      case Layout::padded:
        strides_.dim = 2;
        strides_.token = 2 * dim + 3;
        strides_.head = tokens * strides_.token + 5;
        strides_.batch = heads * strides_.head + 7;
        break;
    }
    const Eigen::Index size = (batch - 1) * strides_.batch + (heads - 1) * strides_.head +
                              (tokens - 1) * strides_.token + (dim - 1) * strides_.dim + 1;
    data_.assign(static_cast<std::size_t>(size), gap);
  }

  /// Through the factories for the contiguous layouts, so they are what is tested.
  HeadsView<T> view() {
    switch (layout_) {
      case Layout::bhnd:
        return HeadsView<T>::bhnd(data_.data(), {batch_, heads_, tokens_, dim_});
      case Layout::bnhd:
        return HeadsView<T>::bnhd(data_.data(), linattn::BnhdShape{batch_, tokens_, heads_, dim_});
      case Layout::padded:
        break;
    }
    return HeadsView<T>(data_.data(), batch_, heads_, tokens_, dim_, strides_);
  }
  HeadsView<const T> cview() const {
    return HeadsView<const T>(data_.data(), batch_, heads_, tokens_, dim_, strides_);
  }

  Matrix<T> head(Eigen::Index b, Eigen::Index h) const { return cview().head(b, h); }
  void set_head(Eigen::Index b, Eigen::Index h, const Matrix<T>& m) { view().head(b, h) = m; }

  /// True when every element outside the B x H x N x D ones still holds `gap`.
  bool gaps_hold(T gap) const {
    Heads copy = *this;
    for (Eigen::Index b = 0; b < batch_; ++b) {
      for (Eigen::Index h = 0; h < heads_; ++h) copy.view().head(b, h).setConstant(gap);
    }
    return std::all_of(copy.data_.begin(), copy.data_.end(), [&](T x) { return x == gap; });
  }

  std::vector<T>& data() { return data_; }
  const std::vector<T>& data() const { return data_; }
  const HeadStrides& strides() const { return strides_; }
  Eigen::Index heads() const { return heads_; }
  Eigen::Index dim() const { return dim_; }

 private:
  Layout layout_;
  Eigen::Index batch_, heads_, tokens_, dim_;
  HeadStrides strides_;
  std::vector<T> data_;
};

}  // namespace linattn_test
