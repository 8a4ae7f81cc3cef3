// SPDX-License-Identifier: MIT
// What linattn asks of OpenMP: how many threads a call may use, and keeping Eigen serial.
#pragma once

#include <algorithm>
#include <linattn/config.hpp>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linattn::detail {

/// The number of threads one call may use: `threads`, or OpenMP's default for 0; always 1
/// without OpenMP.
inline int resolve_threads(int threads) {
#ifdef _OPENMP
  if (threads > 0) return threads;
  return omp_in_parallel() ? 1 : std::max(1, omp_get_max_threads());
#else
  static_cast<void>(threads);
  return 1;
#endif
}

/// resolve_threads(Options::threads).
inline int resolve_threads(const Options& options) { return resolve_threads(options.threads); }

/// While alive, Eigen's own products called from this thread run on it alone: an OpenMP build
/// of Eigen would otherwise spread each small chunk product over all cores (slower, and more
/// threads than Options::threads asked for). It sets this thread's OpenMP thread count ICV to
/// 1 and puts the caller's value back; other threads are not affected. (Eigen::setNbThreads,
/// if the program called it, still wins.)
class SerialEigenScope {
 public:
#ifdef _OPENMP
  SerialEigenScope() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SerialEigenScope() { omp_set_num_threads(saved_); }
#else
  // User-provided, so a scope that does nothing draws no unused-variable warning.
  SerialEigenScope() {}   // NOLINT(modernize-use-equals-default)
  ~SerialEigenScope() {}  // NOLINT(modernize-use-equals-default)
#endif
  SerialEigenScope(const SerialEigenScope&) = delete;
  SerialEigenScope& operator=(const SerialEigenScope&) = delete;

 private:
#ifdef _OPENMP
  int saved_;
#endif
};

}  // namespace linattn::detail
