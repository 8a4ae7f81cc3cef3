// SPDX-License-Identifier: MIT
// What every view backward shares (multi_head_backward.hpp, delta_rule_backward.hpp): the
// scalar and gate constraints, the gradient views' checks, the thread buffers' rows and their
// stores, and the one dispatch of (sequence, group of heads) items over the threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <linattn/config.hpp>
#include <linattn/detail/openmp.hpp>
#include <linattn/detail/parallel.hpp>
#include <linattn/detail/validate.hpp>
#include <linattn/gates.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/multi_head.hpp>
#include <numeric>
#include <string>
#include <type_traits>

namespace linattn::detail {

/// The scalars of a view backward: q, k, v and grad_out of T (const or not), and the gradient
/// views of T.
template <class Q, class K, class V, class G, class T>
using enable_if_backward_views =
    std::enable_if_t<std::is_same_v<std::remove_const_t<Q>, std::remove_const_t<T>> &&
                     std::is_same_v<std::remove_const_t<K>, std::remove_const_t<T>> &&
                     std::is_same_v<std::remove_const_t<V>, std::remove_const_t<T>> &&
                     std::is_same_v<std::remove_const_t<G>, std::remove_const_t<T>>>;

/// True for the gate views of the gated view backward: HeadsView<G> or log_gates(view) of the
/// scalar T (HeadDecays has an overload of its own; the bonus has no view backward).
template <class Gates, class T>
inline constexpr bool is_gate_view = false;
template <class G, class T>
inline constexpr bool is_gate_view<HeadsView<G>, T> =
    std::is_same_v<std::remove_const_t<G>, std::remove_const_t<T>>;
template <class G, class T>
inline constexpr bool is_gate_view<LogGates<HeadsView<G>>, T> =
    std::is_same_v<std::remove_const_t<G>, std::remove_const_t<T>>;

template <class Gates, class T>
using enable_if_gate_view = std::enable_if_t<is_gate_view<Gates, T>>;

/// Throws unless the gradient view `grad` has the shape of `input`.
template <class T, class I>
void require_gradient_view(const HeadsView<T>& grad, const HeadsView<I>& input, const char* where,
                           const char* grad_name, const char* input_name) {
  if (grad.batch() != input.batch() || grad.heads() != input.heads() ||
      grad.tokens() != input.tokens() || grad.dim() != input.dim()) {
    throw Error(std::string(where) + ": " + grad_name + " is " + grad.sizes_string() + " but " +
                input_name + " is " + input.sizes_string() +
                "; a gradient has the shape of its input");
  }
}

/// With check_finite, scans every head of grad_out over the threads, as scan_heads the inputs.
template <class G>
void scan_grad_out(const HeadsView<G>& grad_out, const Options& options, const char* where) {
  if (!options.check_finite) return;
  scan_view(
      grad_out, resolve_threads(options), [](const auto& rows) { return all_finite(rows); },
      [&](const auto& head, Eigen::Index b, Eigen::Index h) {
        if (!all_finite(head)) require_finite(head, where, head_name("grad_out", b, h).c_str());
      });
}

/// The first `rows` rows of `buffer`, grown to at least rows x cols.
template <class T>
Eigen::Ref<Matrix<T>> buffer_rows(Matrix<T>& buffer, Eigen::Index rows, Eigen::Index cols) {
  if (buffer.rows() < rows || buffer.cols() != cols) {
    buffer.resize(std::max(rows, buffer.rows()), cols);
  }
  return Eigen::Ref<Matrix<T>>(buffer.topRows(rows));
}

/// Rows [begin, begin + src.rows()) of head (b, h) of `view` = src, or += src with `add` (a
/// later reader of a shared input head).
template <class T, class Src>
void store_head_rows(const HeadsView<T>& view, Eigen::Index b, Eigen::Index h, Eigen::Index begin,
                     const Eigen::MatrixBase<Src>& src, bool add) {
  auto put = [&](auto rows) {
    if (add) {
      rows += src;
    } else {
      rows = src;
    }
  };
  if (view.strides().dim == 1) {
    put(view.head_rows(b, h).middleRows(begin, src.rows()));
  } else {
    put(view.head(b, h).middleRows(begin, src.rows()));
  }
}

/// True when output head h is a later reader of its head of `input` (grouped heads): it adds
/// its gradient to what the first reader wrote, h - h % (H / H_in) interleaved, h % H_in tiled.
template <class I>
bool adds_to_input_head(const HeadsView<I>& input, Eigen::Index heads, Eigen::Index h,
                        HeadGrouping grouping) {
  if (grouping == HeadGrouping::tiled) return h >= input.heads();
  return h % (heads / input.heads()) != 0;
}

/// The output heads one thread takes at a time, so that every output head reading a shared
/// input head falls in one group and one thread writes (first reader) and adds (the later
/// ones, in increasing h) its gradient: interleaved, the least common multiple of H / H_in over
/// the inputs; tiled, all H heads when any input is grouped (its readers h % H_in span them).
inline Eigen::Index backward_head_group(Eigen::Index heads,
                                        std::initializer_list<Eigen::Index> input_heads,
                                        HeadGrouping grouping) {
  Eigen::Index group = 1;
  for (const Eigen::Index in : input_heads) {
    if (in == heads) continue;
    group = grouping == HeadGrouping::tiled ? heads : std::lcm(group, heads / in);
  }
  return group;
}

/// Runs one_head(s, h, buffers) for every output head h of every non-empty sequence s, over
/// items (sequence, `group` consecutive heads) handed out one at a time to up to `threads`
/// threads, each with its own Buffers kept from item to item. The first exception stops the
/// other threads at their next item and is rethrown.
template <class Buffers, class OneHead>
void for_each_head_group(const SequenceRows& sequences, Eigen::Index heads, Eigen::Index group,
                         int threads, const OneHead& one_head) {
  const Eigen::Index groups = heads / group;
  const Eigen::Index items = sequences.count * groups;
  const int team =
      static_cast<int>(std::max<Eigen::Index>(1, std::min<Eigen::Index>(threads, items)));
  std::atomic<Eigen::Index> next{0};
  std::atomic<bool> failed{false};
  const SerialEigenScope serial_eigen;
  parallel_for(team, team, [&](Eigen::Index) {
    Buffers buffers;
    try {
      for (Eigen::Index i = next++; i < items && !failed.load(); i = next++) {
        const Eigen::Index s = i / groups;
        if (sequences.rows(s) == 0) continue;  // an empty packed sequence: nothing to write
        const Eigen::Index first = (i % groups) * group;
        for (Eigen::Index h = first; h < first + group; ++h) one_head(s, h, buffers);
      }
    } catch (...) {
      failed = true;
      throw;
    }
  });
}

}  // namespace linattn::detail
