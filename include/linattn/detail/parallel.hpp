// SPDX-License-Identifier: MIT
// Threads: OpenMP when the including code is compiled with it, serial otherwise.
#pragma once

#include <algorithm>
#include <cmath>
#include <exception>
#include <linattn/config.hpp>
#include <linattn/detail/chunked.hpp>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linattn::detail {

/// The number of threads one call may use: Options::threads, or OpenMP's default for 0;
/// always 1 without OpenMP.
inline int resolve_threads(const Options& options) {
#ifdef _OPENMP
  if (options.threads > 0) return options.threads;
  return omp_in_parallel() ? 1 : std::max(1, omp_get_max_threads());
#else
  static_cast<void>(options);
  return 1;
#endif
}

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

/// Shortest sequence worth splitting across threads, per thread.
inline constexpr Eigen::Index kMinRowsPerThread = 1024;

/// Time to absorb a token (state only, one GEMM) relative to attending it (the full kernel).
/// It sizes the first segment so that all threads finish the first pass together.
inline constexpr double kAbsorbCost = 0.4;

/// Segment boundaries for `threads` threads over n rows, aligned to the chunk: a short first
/// segment (attended while the others are absorbed), then `threads` equal ones.
inline std::vector<Eigen::Index> segment_bounds(Eigen::Index n, int threads, Eigen::Index chunk) {
  const double unit = static_cast<double>(n) / (static_cast<double>(threads) + kAbsorbCost);
  auto align = [&](double rows) {
    const Eigen::Index r = static_cast<Eigen::Index>(rows);
    return std::min(n, std::max(chunk, (r / chunk) * chunk));
  };
  std::vector<Eigen::Index> bounds{0, align(kAbsorbCost * unit)};
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
template <class T, class Source, class OutRef>
void causal_sequence_parallel(const Source& src, CarriedState<T>& state, OutRef out,
                              const Options& options, int threads) {
  const Eigen::Index n = src.rows();
  const Eigen::Index chunk = std::max<Eigen::Index>(1, options.chunk);
  const std::vector<Eigen::Index> bounds = segment_bounds(n, threads, chunk);
  const int segments = static_cast<int>(bounds.size()) - 1;  // threads + 1
  auto rows_of = [&](int s) { return bounds[s + 1] - bounds[s]; };
  auto range = [&](int s) { return RowRange<Source>(src, bounds[s], rows_of(s)); };

  // starts[s] is the state before segment s; starts[segments] the final state.
  std::vector<CarriedState<T>> starts(segments + 1,
                                      CarriedState<T>(state.s.rows(), state.s.cols()));
  starts[0] = state;
  parallel_for(segments - 1, threads, [&](Eigen::Index s) {
    const int seg = static_cast<int>(s);
    ChunkedKernel<T> kernel(state.s.rows(), state.s.cols(), rows_of(seg), options);
    if (seg == 0) {
      starts[1] = starts[0];
      kernel.causal(range(0), starts[1], OutRef(out.middleRows(bounds[0], rows_of(0))));
    } else {
      kernel.absorb(range(seg), starts[seg + 1]);  // local sums, prefixed in pass 2
    }
  });
  const double log_decay = std::log(options.decay);
  for (int s = 1; s + 1 < segments; ++s) {
    CarriedState<T> local = std::move(starts[s + 1]);
    starts[s + 1] = starts[s];
    append_segment(starts[s + 1], local, rows_of(s), log_decay);
  }
  std::vector<CarriedState<T>> ends(segments, CarriedState<T>(0, 0));
  parallel_for(segments - 1, threads, [&](Eigen::Index s) {
    const int seg = static_cast<int>(s) + 1;
    ends[seg] = starts[seg];
    ChunkedKernel<T> kernel(state.s.rows(), state.s.cols(), rows_of(seg), options);
    kernel.causal(range(seg), ends[seg], OutRef(out.middleRows(bounds[seg], rows_of(seg))));
  });
  state = std::move(ends[segments - 1]);
}

/// Tokens per step of the feature split: two barriers per step, so steps longer than a chunk.
inline constexpr Eigen::Index kFeatureSplitStep = 256;

#ifdef _OPENMP
/// Causal attention over one sequence with the rows of S (the features) split across threads.
/// Every step all threads load a share of the next tokens into shared buffers; each streams
/// all of them through its own rows of S and z, giving partial numerators and denominators;
/// then each sums the partials of a share of the rows and writes those outputs. No FLOP is
/// repeated; only the order of that last sum depends on the thread count. The plain path only
/// (no decay, no log-scales), which keeps every thread's rows independent.
template <class T, class Source, class OutRef>
void causal_feature_split(const Source& src, CarriedState<T>& state, OutRef out,
                          const Options& options, int threads) {
  static_assert(!Source::log_scaled, "the feature split runs the plain path only");
  const Eigen::Index n = src.rows();
  const Eigen::Index c = state.s.rows();
  const Eigen::Index dv = state.s.cols();
  constexpr Eigen::Index kRows = StreamShape<T>::kRows;
  const Eigen::Index tiles = (c + kRows - 1) / kRows;
  const Eigen::Index step = std::min(n, std::max(options.chunk, kFeatureSplitStep));
  // Two of everything, alternating by step, so one barrier after the loads and one after the
  // stream are enough: a step's outputs read parity p while the next step fills parity 1 - p.
  std::vector<ChunkBuffers<T>> buffers(2, ChunkBuffers<T>(step, c, dv));
  std::vector<Matrix<T>> num(2 * threads, Matrix<T>(step, dv));
  std::vector<Vector<T>> den(2 * threads, Vector<T>(step));
  std::exception_ptr error;
  bool failed = false;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int team = omp_get_num_threads();  // may be fewer than asked
    const Eigen::Index row_begin = std::min(c, tiles * t / team * kRows);
    const Eigen::Index row_end = std::min(c, tiles * (t + 1) / team * kRows);
    Vector<T> row_sum(dv);
    int parity = 0;
    for (Eigen::Index begin = 0; begin < n; begin += step, parity ^= 1) {
      const Eigen::Index len = std::min(step, n - begin);
      const Eigen::Index share_begin = len * t / team;
      const Eigen::Index share_end = len * (t + 1) / team;
      ChunkBuffers<T>& buf = buffers[parity];
      try {
        if (share_end > share_begin) {
          src.load_queries(begin + share_begin, share_end - share_begin, buf, share_begin);
          src.load_keys_values(begin + share_begin, share_end - share_begin, buf, share_begin);
        }
      } catch (...) {
#pragma omp critical(linattn_parallel_error)
        {
          if (!error) error = std::current_exception();
          failed = true;
        }
      }
#pragma omp barrier
      bool stop = false;
#pragma omp critical(linattn_parallel_error)
      stop = failed;
      if (stop) break;  // every thread sees the same flag after the barrier
      Matrix<T>& my_num = num[parity * team + t];
      Vector<T>& my_den = den[parity * team + t];
      my_num.topRows(len).setZero();
      my_den.head(len).setZero();
      if (row_end > row_begin) {
        const StreamOperands<T> operands{buf.q.data() + row_begin,
                                         c,
                                         buf.k.data() + row_begin,
                                         c,
                                         buf.v.data(),
                                         dv,
                                         state.s.data() + row_begin * dv,
                                         dv,
                                         my_num.data(),
                                         dv,
                                         len,
                                         row_end - row_begin,
                                         dv};
        stream_product(operands);
        stream_denominator(buf.q.data() + row_begin, c, buf.k.data() + row_begin, c, len,
                           row_end - row_begin, state.z.data() + row_begin, my_den.data());
      }
#pragma omp barrier
      for (Eigen::Index r = share_begin; r < share_end; ++r) {
        row_sum = num[parity * team].row(r).transpose();
        T d = den[parity * team](r);
        for (int u = 1; u < team; ++u) {
          row_sum += num[parity * team + u].row(r).transpose();
          d += den[parity * team + u](r);
        }
        write_output_row(row_sum.transpose(), d, 0.0, options, out.row(begin + r));
      }
    }
  }
  if (error) std::rethrow_exception(error);
  state.log_scale = 0.0;
}
#endif

/// Causal attention over `src` from `state` into `out` on up to `threads` threads: split
/// across the sequence when it is long enough, one pass of the chunked kernel otherwise.
template <class T, class Source, class OutRef>
void run_causal(const Source& src, CarriedState<T>& state, OutRef out, const Options& options,
                int threads) {
  const Eigen::Index n = src.rows();
  const Eigen::Index usable = std::min<Eigen::Index>(threads, n / kMinRowsPerThread);
  if (usable >= 2) {
#ifdef _OPENMP
    // Without decay or scales the features split with no extra work; else split the tokens.
    if constexpr (!Source::log_scaled) {
      const Eigen::Index tiles =
          (state.s.rows() + StreamShape<T>::kRows - 1) / StreamShape<T>::kRows;
      if (options.decay == 1.0 && state.unscaled() && tiles >= 2) {
        causal_feature_split(src, state, out, options,
                             static_cast<int>(std::min<Eigen::Index>(usable, tiles)));
        return;
      }
    }
#endif
    causal_sequence_parallel(src, state, out, options, static_cast<int>(usable));
    return;
  }
  ChunkedKernel<T> kernel(state.s.rows(), state.s.cols(), n, options);
  kernel.causal(src, state, out);
}

/// Non-causal attention over `src` into `out` (state from empty): the sums split across
/// threads by segment and added, then the outputs split the same way.
template <class T, class Source, class OutRef>
void run_non_causal(const Source& src, CarriedState<T>& state, OutRef out, const Options& options,
                    int threads) {
  const Eigen::Index n = src.rows();
  Options tuned = options;
  tuned.decay = 1.0;
  // The non-causal sums are plain GEMMs, which like longer panels than the causal chunk.
  tuned.chunk = std::max<Eigen::Index>(options.chunk, 256);
  const int usable = static_cast<int>(std::min<Eigen::Index>(threads, n / kMinRowsPerThread));
  if (usable < 2) {
    ChunkedKernel<T> kernel(state.s.rows(), state.s.cols(), n, tuned);
    kernel.non_causal(src, state, out);
    return;
  }
  std::vector<Eigen::Index> bounds(usable + 1);
  for (int t = 0; t <= usable; ++t) bounds[t] = n * t / usable;
  auto range = [&](Eigen::Index t) {
    return RowRange<Source>(src, bounds[t], bounds[t + 1] - bounds[t]);
  };
  std::vector<CarriedState<T>> sums(usable, CarriedState<T>(state.s.rows(), state.s.cols()));
  parallel_for(usable, usable, [&](Eigen::Index t) {
    ChunkedKernel<T> kernel(state.s.rows(), state.s.cols(), bounds[t + 1] - bounds[t], tuned);
    kernel.absorb(range(t), sums[t]);
  });
  for (int t = 0; t < usable; ++t) append_segment(state, sums[t], 0, 0.0);
  parallel_for(usable, usable, [&](Eigen::Index t) {
    ChunkedKernel<T> kernel(state.s.rows(), state.s.cols(), bounds[t + 1] - bounds[t], tuned);
    kernel.attend_fixed(range(t), state,
                        OutRef(out.middleRows(bounds[t], bounds[t + 1] - bounds[t])));
  });
}

}  // namespace linattn::detail
