// SPDX-License-Identifier: MIT
// A view of caller memory holding many heads of many sequences: [B, H, N, D] with any strides.
#pragma once

#include <linattn/config.hpp>
#include <string>
#include <type_traits>

namespace linattn {

/// Distances in elements between neighbours along each axis of a HeadsView.
struct HeadStrides {
  Eigen::Index batch = 0;  ///< between sequences b and b + 1
  Eigen::Index head = 0;   ///< between heads h and h + 1
  Eigen::Index token = 0;  ///< between tokens n and n + 1 (rows of one head)
  Eigen::Index dim = 1;    ///< between features d and d + 1 (columns of one head)
};

/// The logical sizes of a HeadsView, in the one order every factory takes whatever the memory
/// layout: HeadShape{B, H, N, D}.
struct HeadShape {
  Eigen::Index batch;   ///< B, sequences
  Eigen::Index heads;   ///< H, heads per sequence
  Eigen::Index tokens;  ///< N, tokens per sequence
  Eigen::Index dim;     ///< D, features per token
};

/// The sizes of a contiguous [B, N, H, D] tensor in its memory order, as HeadsView::bnhd takes
/// them: BnhdShape{B, N, H, D}. The constructor is explicit so that a bare list of four sizes
/// never passes for it (a list in the other order would swap N and H without any error).
struct BnhdShape {
  Eigen::Index batch;   ///< B, sequences
  Eigen::Index tokens;  ///< N, tokens per sequence
  Eigen::Index heads;   ///< H, heads per sequence
  Eigen::Index dim;     ///< D, features per token
  /// @param batch  B   @param tokens  N   @param heads  H   @param dim  D (memory order)
  explicit BnhdShape(Eigen::Index batch, Eigen::Index tokens, Eigen::Index heads, Eigen::Index dim)
      : batch(batch), tokens(tokens), heads(heads), dim(dim) {}
  /// The same tensor's sizes from its logical shape {B, H, N, D}.
  explicit BnhdShape(const HeadShape& logical)
      : BnhdShape(logical.batch, logical.tokens, logical.heads, logical.dim) {}
};

/// A non-owning view of B x H x N x D elements of caller memory: B sequences (batch), H heads,
/// N tokens, D features, laid out with any strides. head(b, h) is an N x D Eigen::Map, rows
/// are tokens, as every other linattn routine takes. No copy is made; the memory must outlive
/// the view. T is `const Scalar` for inputs and `Scalar` for outputs.
template <class T>
class HeadsView {
 public:
  /// The element type, T without const.
  using Scalar = std::remove_const_t<T>;
  /// True for output views (T not const).
  static constexpr bool is_writable = !std::is_const_v<T>;
  /// Matrix<Scalar>, const for read-only views.
  using MatrixType = std::conditional_t<is_writable, Matrix<Scalar>, const Matrix<Scalar>>;
  /// One head, any strides.
  using HeadMap =
      Eigen::Map<MatrixType, Eigen::Unaligned, Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>>;
  /// One head whose features are adjacent (strides().dim == 1): vectorised loads.
  using RowsMap = Eigen::Map<MatrixType, Eigen::Unaligned, Eigen::OuterStride<>>;

  /// @param data     element (0, 0, 0, 0)
  /// @param batch    B, sequences
  /// @param heads    H, heads per sequence
  /// @param tokens   N, tokens per sequence
  /// @param dim      D, features per token
  /// @param strides  element distances along each axis (each >= 0)
  HeadsView(T* data, Eigen::Index batch, Eigen::Index heads, Eigen::Index tokens, Eigen::Index dim,
            const HeadStrides& strides)
      : data_(data), batch_(batch), heads_(heads), tokens_(tokens), dim_(dim), strides_(strides) {
    if (batch < 1 || heads < 1 || tokens < 1 || dim < 1) {
      throw Error("HeadsView: sizes must be >= 1, got [B, H, N, D] = " + sizes_string());
    }
    if (data == nullptr) throw Error("HeadsView: data is null for " + sizes_string());
    if (strides.batch < 0 || strides.head < 0 || strides.token < 0 || strides.dim < 0) {
      throw Error("HeadsView: strides must be >= 0, got " + strides_string());
    }
  }

  /// A contiguous [B, H, N, D] tensor (PyTorch's usual layout for attention).
  /// @param data   B * H * N * D elements
  /// @param shape  the logical sizes {B, H, N, D}, in that order for every layout
  static HeadsView bhnd(T* data, const HeadShape& shape) {
    const auto [b, h, n, d] = shape;
    return HeadsView(data, b, h, n, d, HeadStrides{h * n * d, n * d, d, 1});
  }

  /// A contiguous [B, N, H, D] tensor (the layout of fast-transformers, FLA and ggml, and of a
  /// fused QKV projection's output), its sizes in that order: bnhd(data, BnhdShape{B, N, H, D}).
  /// @param data   B * N * H * D elements
  /// @param shape  the sizes in memory order, BnhdShape{B, N, H, D} (or BnhdShape(head_shape))
  static HeadsView bnhd(T* data, const BnhdShape& shape) {
    const Eigen::Index b = shape.batch, n = shape.tokens, h = shape.heads, d = shape.dim;
    return HeadsView(data, b, h, n, d, HeadStrides{n * h * d, d, h * d, 1});
  }

  /// A HeadShape is in the logical order {B, H, N, D}, not bnhd's memory order; it does not
  /// compile here (written {B, N, H, D} it swapped N and H silently).
  template <class Shape, class = std::enable_if_t<std::is_same_v<Shape, HeadShape>>>
  static HeadsView bnhd(T* data, const Shape& shape) {
    static_assert(!std::is_same_v<Shape, HeadShape>,
                  "HeadsView::bnhd takes its sizes in memory order: bnhd(data, BnhdShape{B, N, H, "
                  "D}), or BnhdShape(shape) for a HeadShape{B, H, N, D}");
    return bnhd(data, BnhdShape(shape));
  }

  /// A read-only view of a writable one, implicitly (like T* to const T*).
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  HeadsView(const HeadsView<U>& other)  // NOLINT(google-explicit-constructor)
      : HeadsView(other.data(), other.batch(), other.heads(), other.tokens(), other.dim(),
                  other.strides()) {}

  /// Element (0, 0, 0, 0).
  T* data() const { return data_; }
  /// B, sequences.
  Eigen::Index batch() const { return batch_; }
  /// H, heads per sequence.
  Eigen::Index heads() const { return heads_; }
  /// N, tokens per sequence.
  Eigen::Index tokens() const { return tokens_; }
  /// D, features per token.
  Eigen::Index dim() const { return dim_; }
  /// Element distances along each axis.
  const HeadStrides& strides() const { return strides_; }

  /// Head h of sequence b: N x D.
  HeadMap head(Eigen::Index b, Eigen::Index h) const {
    return HeadMap(head_data(b, h), tokens_, dim_,
                   Eigen::Stride<Eigen::Dynamic, Eigen::Dynamic>(strides_.token, strides_.dim));
  }

  /// Head h of sequence b as a map with adjacent features; requires strides().dim == 1.
  RowsMap head_rows(Eigen::Index b, Eigen::Index h) const {
    LINATTN_ASSERT(strides_.dim == 1);
    return RowsMap(head_data(b, h), tokens_, dim_, Eigen::OuterStride<>(strides_.token));
  }

  /// "[B, H, N, D] = [2, 8, 128, 64]", for error messages.
  std::string sizes_string() const {
    return "[" + std::to_string(batch_) + ", " + std::to_string(heads_) + ", " +
           std::to_string(tokens_) + ", " + std::to_string(dim_) + "]";
  }

 private:
  T* head_data(Eigen::Index b, Eigen::Index h) const {
    LINATTN_ASSERT(b >= 0 && b < batch_ && h >= 0 && h < heads_);
    return data_ + b * strides_.batch + h * strides_.head;
  }
  std::string strides_string() const {
    return "{batch " + std::to_string(strides_.batch) + ", head " + std::to_string(strides_.head) +
           ", token " + std::to_string(strides_.token) + ", dim " + std::to_string(strides_.dim) +
           "}";
  }

  T* data_;
  Eigen::Index batch_, heads_, tokens_, dim_;
  HeadStrides strides_;
};

/// A read-only view, for inputs.
template <class Scalar>
using ConstHeadsView = HeadsView<const Scalar>;

}  // namespace linattn
