// SPDX-License-Identifier: MIT
// Threads: OpenMP when the including code is compiled with it, serial otherwise.
#pragma once

#include <algorithm>
#include <cmath>
#include <exception>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <linattn/detail/openmp.hpp>
#include <vector>

namespace linattn::detail {

/// Runs body(i) for i in [0, count) on up to `threads` threads. An exception thrown by any
/// body is rethrown here, after every thread has finished (none escapes an OpenMP region).
/// Eigen runs its products single-threaded inside the region, so nothing nests.
template <class Body>
void parallel_for(Eigen::Index count, int threads, const Body& body) {
#ifdef _OPENMP
  if (threads > 1 && count > 1) {
    std::exception_ptr error;
    const int team = static_cast<int>(std::min<Eigen::Index>(threads, count));
#pragma omp parallel for num_threads(team) schedule(dynamic, 1)
    for (Eigen::Index i = 0; i < count; ++i) {
      try {
        body(i);
      } catch (...) {
#pragma omp critical(linattn_parallel_error)
        if (!error) error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#else
  static_cast<void>(threads);
#endif
  for (Eigen::Index i = 0; i < count; ++i) body(i);
}

/// Fewest rows per thread of a scan over the inputs (a pass over memory).
inline constexpr Eigen::Index kMinScanRows = 4096;

/// require_finite over row blocks of `m` on up to `threads` threads: the scan is a pass over
/// memory, so every thread streams its own block.
template <class Derived>
void require_finite_parallel(const Eigen::MatrixBase<Derived>& m, const char* where,
                             const char* name, int threads) {
  const Eigen::Index blocks =
      std::max<Eigen::Index>(1, std::min<Eigen::Index>(threads, m.rows() / kMinScanRows));
  if (blocks == 1) {
    require_finite(m, where, name);
    return;
  }
  parallel_for(blocks, static_cast<int>(blocks), [&](Eigen::Index b) {
    const Eigen::Index first = m.rows() * b / blocks;
    const Eigen::Index last = m.rows() * (b + 1) / blocks;
    require_finite(m.middleRows(first, last - first), where, name, first);
  });
}

/// With check_finite, scans q, k and v on up to Options::threads threads. The routines call it
/// before they write anything, so bad input leaves the caller's output as it was.
template <class DQ, class DK, class DV>
void scan_inputs(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                 const Eigen::MatrixBase<DV>& v, const Options& options, const char* where,
                 const char* q_name, const char* k_name) {
  if (!options.check_finite) return;
  const int threads = resolve_threads(options);
  require_finite_parallel(q, where, q_name, threads);
  require_finite_parallel(k, where, k_name, threads);
  require_finite_parallel(v, where, "v", threads);
}

/// validate_sequence_shapes, then scan_inputs.
template <class DQ, class DK, class DV>
void validate_sequence_threads(const Eigen::MatrixBase<DQ>& q, const Eigen::MatrixBase<DK>& k,
                               const Eigen::MatrixBase<DV>& v, const Options& options,
                               const char* where, const char* q_name, const char* k_name) {
  validate_sequence_shapes(q, k, v, options, where, q_name, k_name);
  scan_inputs(q, k, v, options, where, q_name, k_name);
}

/// Shortest sequence worth splitting across threads, per thread.
inline constexpr Eigen::Index kMinRowsPerThread = 1024;

/// Time to absorb a token (the state alone: the stream without its readout) relative to
/// attending it, as measured (float, C = Dv = 64: 57 ns against 101 ns a token).
inline constexpr double kForwardAbsorbCost = 0.55;
/// The backward's: a segment's absorb (one product) against its streamed gradient pass.
inline constexpr double kBackwardAbsorbCost = 0.4;

/// Segment boundaries for `threads` threads over n rows, aligned to the chunk: a short first
/// segment (attended while the others are absorbed), then `threads` equal ones. absorb_cost:
/// the time to absorb a row relative to attending it, so that the first pass ends together.
inline std::vector<Eigen::Index> segment_bounds(Eigen::Index n, int threads, Eigen::Index chunk,
                                                double absorb_cost) {
  const double unit = static_cast<double>(n) / (static_cast<double>(threads) + absorb_cost);
  auto align = [&](double rows) {
    const Eigen::Index r = static_cast<Eigen::Index>(rows);
    return std::min(n, std::max(chunk, (r / chunk) * chunk));
  };
  std::vector<Eigen::Index> bounds{0, align(absorb_cost * unit)};
  const double rest = static_cast<double>(n - bounds[1]) / static_cast<double>(threads);
  for (int t = 1; t < threads; ++t) {
    bounds.push_back(std::max(bounds.back(), align(static_cast<double>(bounds[1]) + t * rest)));
  }
  bounds.push_back(n);
  return bounds;
}

/// Causal attention over one long sequence on several threads, continuing from `state` and
/// leaving it after the last row; the same result as ChunkedKernel::causal up to rounding.
/// Pass 1: thread 0 attends the first segment while the others absorb theirs into local
/// states; pass 2: a prefix over the segment states gives each segment its starting state;
/// pass 3: every later segment is attended from its start, one thread each.
template <class T, class O>
void causal_sequence_parallel(const ChunkSource<T>& src, CarriedState<T>& state, OutRows<O> out,
                              const Options& options, int threads) {
  const Eigen::Index n = src.rows();
  const Eigen::Index chunk = std::max<Eigen::Index>(1, options.chunk);
  const std::vector<Eigen::Index> bounds = segment_bounds(n, threads, chunk, kForwardAbsorbCost);
  const int segments = static_cast<int>(bounds.size()) - 1;  // threads + 1
  auto rows_of = [&](int s) { return bounds[s + 1] - bounds[s]; };

  // starts[s] is the state before segment s; starts[segments] the final state.
  std::vector<CarriedState<T>> starts(segments + 1,
                                      CarriedState<T>(state.s.rows(), state.s.cols()));
  // log of each segment's whole transition: one entry (a decay, scalar gates) or C.
  const bool per_feature = src.gate_dim() > 1;
  std::vector<double> transitions(segments, 0.0);
  std::vector<Eigen::Array<double, Eigen::Dynamic, 1>> row_transitions(per_feature ? segments : 0);
  starts[0] = state;
  parallel_for(segments - 1, threads, [&](Eigen::Index s) {
    const int seg = static_cast<int>(s);
    const RowRange<T> range(src, bounds[seg], rows_of(seg));
    ChunkedKernel<T, O> kernel(state.s.rows(), state.s.cols(), rows_of(seg), options);
    if (seg == 0) {
      starts[1] = starts[0];
      kernel.causal(range, starts[1], OutRows<O>(out.middleRows(bounds[0], rows_of(0))));
    } else {
      if (per_feature) {  // local sums, prefixed in pass 2
        kernel.absorb_rows(range, starts[seg + 1], row_transitions[seg]);
      } else {
        kernel.absorb(range, starts[seg + 1], &transitions[seg]);
      }
    }
  });
  for (int s = 1; s + 1 < segments; ++s) {
    CarriedState<T> local = std::move(starts[s + 1]);
    starts[s + 1] = starts[s];
    if (per_feature) {
      append_segment_rows(starts[s + 1], std::move(local), row_transitions[s]);
    } else {
      append_segment(starts[s + 1], local, transitions[s]);
    }
  }
  std::vector<CarriedState<T>> ends(segments, CarriedState<T>(0, 0));
  parallel_for(segments - 1, threads, [&](Eigen::Index s) {
    const int seg = static_cast<int>(s) + 1;
    ends[seg] = starts[seg];
    const RowRange<T> range(src, bounds[seg], rows_of(seg));
    ChunkedKernel<T, O> kernel(state.s.rows(), state.s.cols(), rows_of(seg), options);
    kernel.causal(range, ends[seg], OutRows<O>(out.middleRows(bounds[seg], rows_of(seg))));
  });
  state = std::move(ends[segments - 1]);
}

/// Causal attention over `src` from `state` into `out` on up to `threads` threads: split
/// across the sequence when it is long enough, one pass of the chunked kernel otherwise.
/// Compiled once per (T, O); the compiled mode (LINATTN_COMPILED) instantiates it in the
/// library for the built-in types.
template <class T, class O>
void causal_rows(const ChunkSource<T>& src, CarriedState<T>& state, OutRows<O> out,
                 const Options& options, int threads) {
  const Eigen::Index n = src.rows();
  const Eigen::Index usable = std::min<Eigen::Index>(threads, n / kMinRowsPerThread);
  if (usable >= 2) {
    causal_sequence_parallel<T, O>(src, state, out, options, static_cast<int>(usable));
    return;
  }
  ChunkedKernel<T, O> kernel(state.s.rows(), state.s.cols(), n, options);
  kernel.causal(src, state, out);
}

/// Non-causal attention (state from empty): the sums over every key of `keys` (split across
/// threads by segment and added), then every query of `queries` against them into `out`
/// (split the same way). One source for both is self-attention; two, of N_k and N_q rows,
/// cross-attention.
template <class T, class O>
void non_causal_rows(const ChunkSource<T>& keys, const ChunkSource<T>& queries,
                     CarriedState<T>& state, OutRows<O> out, const Options& options, int threads) {
  Options tuned = options;
  tuned.decay = 1.0;
  // The non-causal sums are plain GEMMs, which like longer panels than the causal chunk.
  tuned.chunk = std::max<Eigen::Index>(options.chunk, 256);
  const Eigen::Index c = state.s.rows(), dv = state.s.cols();
  auto bounds_of = [&](Eigen::Index n) {
    const int usable = static_cast<int>(
        std::max<Eigen::Index>(1, std::min<Eigen::Index>(threads, n / kMinRowsPerThread)));
    std::vector<Eigen::Index> bounds(usable + 1);
    for (int t = 0; t <= usable; ++t) bounds[t] = n * t / usable;
    return bounds;
  };
  const std::vector<Eigen::Index> key_bounds = bounds_of(keys.rows());
  const int key_parts = static_cast<int>(key_bounds.size()) - 1;
  if (key_parts == 1) {
    ChunkedKernel<T, O> kernel(c, dv, keys.rows(), tuned);
    kernel.absorb(keys, state);
  } else {
    std::vector<CarriedState<T>> sums(key_parts, CarriedState<T>(c, dv));
    parallel_for(key_parts, key_parts, [&](Eigen::Index t) {
      const Eigen::Index len = key_bounds[t + 1] - key_bounds[t];
      const RowRange<T> range(keys, key_bounds[t], len);
      ChunkedKernel<T, O> kernel(c, dv, len, tuned);
      kernel.absorb(range, sums[t]);
    });
    for (int t = 0; t < key_parts; ++t) append_segment(state, sums[t], 0.0);
  }
  const std::vector<Eigen::Index> query_bounds = bounds_of(queries.rows());
  const int query_parts = static_cast<int>(query_bounds.size()) - 1;
  parallel_for(query_parts, query_parts, [&](Eigen::Index t) {
    const Eigen::Index len = query_bounds[t + 1] - query_bounds[t];
    const RowRange<T> range(queries, query_bounds[t], len);
    ChunkedKernel<T, O> kernel(c, dv, len, tuned);
    kernel.attend_fixed(range, state, OutRows<O>(out.middleRows(query_bounds[t], len)));
  });
}

/// causal_rows for any row-major output expression (a Ref, a map, a block of one).
template <class T, class OutRef>
void run_causal(const ChunkSource<T>& src, CarriedState<T>& state, OutRef&& out,
                const Options& options, int threads) {
  using O = typename std::decay_t<OutRef>::Scalar;
  causal_rows<T, O>(src, state, OutRows<O>(out), options, threads);
}

/// non_causal_rows for any row-major output expression.
template <class T, class OutRef>
void run_non_causal(const ChunkSource<T>& src, CarriedState<T>& state, OutRef&& out,
                    const Options& options, int threads) {
  using O = typename std::decay_t<OutRef>::Scalar;
  non_causal_rows<T, O>(src, src, state, OutRows<O>(out), options, threads);
}

/// Cross-attention: non_causal_rows with keys and values from `keys`, queries from `queries`.
template <class T, class OutRef>
void run_cross(const ChunkSource<T>& keys, const ChunkSource<T>& queries, CarriedState<T>& state,
               OutRef&& out, const Options& options, int threads) {
  using O = typename std::decay_t<OutRef>::Scalar;
  non_causal_rows<T, O>(keys, queries, state, OutRows<O>(out), options, threads);
}

}  // namespace linattn::detail

#include <linattn/detail/compiled.hpp>  // the compiled mode's declarations, after the definitions
