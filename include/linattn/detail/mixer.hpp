// SPDX-License-Identifier: MIT
// What every mixer (a model's layer between its projections) checks and computes the same way:
// its views' shapes, its output's memory, its convolution windows, PyTorch's softplus, and the
// blocks of tokens a prefill walks.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <linattn/config.hpp>
#include <linattn/detail/view_checks.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/short_conv.hpp>
#include <string>
#include <utility>
#include <vector>

namespace linattn::detail {

/// Throws unless a mixer's shared settings are in range: norm_eps finite and > 0 (`eps_meaning`
/// says which eps), chunk >= 1, threads >= 0 and form a DeltaForm; `type` names the settings'
/// struct in messages.
template <class MixerOptions>
void require_mixer_options(const MixerOptions& options, const char* where, const char* type,
                           const char* eps_meaning) {
  const std::string field = std::string(where) + ": " + type + "::";
  if (!(options.norm_eps > 0.0) || !std::isfinite(options.norm_eps)) {
    throw Error(field + "norm_eps must be finite and > 0 (" + eps_meaning + "), got " +
                std::to_string(options.norm_eps));
  }
  if (options.chunk < 1) {
    throw Error(field + "chunk must be >= 1, got " + std::to_string(options.chunk));
  }
  if (options.threads < 0) {
    throw Error(field + "threads must be >= 0 (0 = OpenMP's default), got " +
                std::to_string(options.threads));
  }
  if (options.form != DeltaForm::automatic && options.form != DeltaForm::chunked &&
      options.form != DeltaForm::streamed) {
    throw Error(field + "form is not a DeltaForm");
  }
}

/// Throws unless `view` is [batch, heads, tokens, dim] with adjacent features; `meaning` says
/// what the mixer reads there.
template <class S>
void require_mixer_view(const HeadsView<S>& view, Eigen::Index batch, Eigen::Index heads,
                        Eigen::Index tokens, Eigen::Index dim, const char* where, const char* name,
                        const char* meaning) {
  if (view.batch() != batch || view.heads() != heads || view.tokens() != tokens ||
      view.dim() != dim || view.strides().dim != 1) {
    throw Error(std::string(where) + ": " + name + " is [B, H, N, D] = " + view.sizes_string() +
                " (dim stride " + std::to_string(view.strides().dim) + ") but must be [" +
                std::to_string(batch) + ", " + std::to_string(heads) + ", " +
                std::to_string(tokens) + ", " + std::to_string(dim) +
                "] with adjacent features: " + meaning);
  }
}

/// Throws when out's rows share elements or out meets any input's memory (a mixer reads its
/// inputs after it has written outputs).
template <class O, class... Inputs>
void require_mixer_output(const HeadsView<O>& out, const char* where,
                          const std::pair<const char*, Inputs>&... inputs) {
  if (!rows_distinct(out)) {
    throw Error(std::string(where) + ": out's rows overlap: give every (sequence, head, token) " +
                "its features of its own");
  }
  auto clear_of = [&](const char* name, const auto& input) {
    if (views_meet(input, out)) {
      throw Error(std::string(where) + ": out overlaps " + name + "'s memory: the mixer reads " +
                  "its inputs after writing outputs, so give out a buffer of its own");
    }
  };
  (clear_of(inputs.first, inputs.second), ...);
}

/// True when `windows` could come from conv.make_windows(batch).
template <class T>
bool windows_fit(const ConvWindows<T>& windows, const ShortConv<T>& conv, Eigen::Index batch) {
  return windows.batch() == batch && windows.channels() == conv.channels() &&
         windows.rows() == conv.window_rows();
}

/// Calls step(rows) with the B x C rows of a one-token view ([B, 1, 1, C]) as a matrix for a
/// convolution's step: a map of them in place when the sequences' rows lie apart, a copy when
/// they share memory (a batch stride below C, which an Eigen::Ref of the map would read as
/// contiguous rows).
template <class T, class Step>
void with_step_rows(const HeadsView<const T>& view, const Step& step) {
  const Eigen::Index batch = view.batch(), channels = view.dim();
  const Eigen::Index stride = view.strides().batch;
  if (batch == 1 || stride >= channels) {
    using RowsMap = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
    step(
        RowsMap(view.data(), batch, channels, Eigen::OuterStride<>(batch > 1 ? stride : channels)));
    return;
  }
  Matrix<T> rows(batch, channels);
  for (Eigen::Index b = 0; b < batch; ++b) {
    rows.row(b) = Eigen::Map<const Matrix<T>>(view.data() + b * stride, 1, channels);
  }
  step(rows);
}

/// Buffers a mixer's step reuses from one call to the next, kept in its States: a decoding
/// step allocates nothing once the first has run. A copy of the states (a DraftRing's record,
/// a pool's snapshot) starts without them, so copies stay the size of the state.
template <class T>
class StepScratch {
 public:
  StepScratch() = default;
  StepScratch(const StepScratch&) {}
  StepScratch& operator=(const StepScratch&) { return *this; }
  StepScratch(StepScratch&&) noexcept = default;
  StepScratch& operator=(StepScratch&&) noexcept = default;
  ~StepScratch() = default;

  /// Buffer `i` (< 6) as rows x cols; its contents are whatever the last step left.
  Matrix<T>& take(std::size_t i, Eigen::Index rows, Eigen::Index cols) {
    Matrix<T>& buffer = buffers_[i];
    if (buffer.rows() != rows || buffer.cols() != cols) buffer.resize(rows, cols);
    return buffer;
  }

 private:
  std::array<Matrix<T>, 6> buffers_;
};

/// PyTorch's softplus (beta 1, threshold 20): log(1 + exp(x)), x itself past 20.
template <class T>
T softplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}

/// The [first, first + count) tokens of a view.
template <class S>
HeadsView<S> token_rows(const HeadsView<S>& view, Eigen::Index first, Eigen::Index count) {
  const HeadStrides& s = view.strides();
  return HeadsView<S>(view.data() + first * s.token, view.batch(), view.heads(), count, view.dim(),
                      s);
}

/// Tokens per block of a mixer's prefill: a block's convolved inputs are read by the
/// recurrence while they are still in cache.
inline constexpr Eigen::Index kMixerBlockTokens = 256;

/// Throws unless `positions` rise strictly within [1, tokens]: the token counts after which a
/// prefill writes its states.
inline void require_checkpoints(const std::vector<Eigen::Index>& positions, Eigen::Index tokens,
                                const char* where) {
  Eigen::Index last = 0;
  for (std::size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] <= last || positions[i] > tokens) {
      throw Error(std::string(where) + ": checkpoint " + std::to_string(i) + " is at " +
                  std::to_string(positions[i]) +
                  " tokens; positions must rise strictly within [1, N = " + std::to_string(tokens) +
                  "]");
    }
    last = positions[i];
  }
}

/// Calls run(first, count) over tokens [0, tokens) in blocks of at most kMixerBlockTokens that
/// end at each of `positions` (checked by require_checkpoints), and at(i) after the block
/// that ends at positions[i].
template <class Run, class At>
void for_each_block(Eigen::Index tokens, const std::vector<Eigen::Index>& positions, const Run& run,
                    const At& at) {
  std::size_t next = 0;
  for (Eigen::Index first = 0; first < tokens;) {
    Eigen::Index end = std::min(tokens, first + kMixerBlockTokens);
    if (next < positions.size()) end = std::min(end, positions[next]);
    run(first, end - first);
    first = end;
    if (next < positions.size() && positions[next] == first) at(next++);
  }
}

/// snapshots[i] = states, reusing the storage of a snapshot already there (a vector as long
/// as the positions is filled in place; otherwise it grows by copies).
template <class States>
void write_snapshot(std::vector<States>& snapshots, std::size_t i, const States& states) {
  if (i < snapshots.size()) {
    snapshots[i] = states;
  } else {
    snapshots.push_back(states);
  }
}

}  // namespace linattn::detail
