// SPDX-License-Identifier: MIT
// Checks on the memory of HeadsViews: the bytes a view covers, rows that share elements, and
// a scan for NaN and Inf naming the sequence and head.
#pragma once

#include <algorithm>
#include <cstdint>
#include <linattn/config.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/heads_view.hpp>
#include <string>
#include <utility>
#include <vector>

namespace linattn::detail {

/// The first and one past the last byte a view covers.
template <class S>
std::pair<std::uintptr_t, std::uintptr_t> view_bytes(const HeadsView<S>& v) {
  const HeadStrides& s = v.strides();
  const Eigen::Index last = (v.batch() - 1) * s.batch + (v.heads() - 1) * s.head +
                            (v.tokens() - 1) * s.token + (v.dim() - 1) * s.dim;
  const auto first = reinterpret_cast<std::uintptr_t>(v.data());
  return {first, first + static_cast<std::uintptr_t>((last + 1) * sizeof(S))};
}

/// True when the byte ranges of two views meet (a view of one buffer may still touch none
/// of the other's elements: the check is for outputs, which must keep clear of the inputs).
template <class A, class B>
bool views_meet(const HeadsView<A>& a, const HeadsView<B>& b) {
  const auto [a_first, a_last] = view_bytes(a);
  const auto [b_first, b_last] = view_bytes(b);
  return a_first < b_last && b_first < a_last;
}

/// True when a view's (sequence, head, token) rows of D adjacent features never share an
/// element: its three strides, smallest first, each step past everything the smaller span.
template <class S>
bool rows_distinct(const HeadsView<S>& v) {
  std::vector<std::pair<Eigen::Index, Eigen::Index>> axes;  // (stride, count) of axes > 1
  if (v.batch() > 1) axes.emplace_back(v.strides().batch, v.batch());
  if (v.heads() > 1) axes.emplace_back(v.strides().head, v.heads());
  if (v.tokens() > 1) axes.emplace_back(v.strides().token, v.tokens());
  std::sort(axes.begin(), axes.end());
  Eigen::Index span = v.dim();
  for (const auto& [stride, count] : axes) {
    if (stride < span) return false;
    span = stride * (count - 1) + span;
  }
  return true;
}

/// Throws on the first NaN or Inf of a view (features adjacent), naming its sequence and head.
template <class S>
void require_finite_view(const HeadsView<S>& view, const char* where, const char* name) {
  for (Eigen::Index b = 0; b < view.batch(); ++b) {
    for (Eigen::Index h = 0; h < view.heads(); ++h) {
      if (all_finite(view.head_rows(b, h))) continue;
      const std::string label = std::string(name) + " (sequence " + std::to_string(b) + ", head " +
                                std::to_string(h) + "; rows are tokens)";
      require_finite(view.head_rows(b, h), where, label.c_str());
    }
  }
}

}  // namespace linattn::detail
