// SPDX-License-Identifier: MIT
// fuzz_kernels: the linear engine's checks (forward, gated, bonus, backward) on every map.
#include "engine_checks.hpp"

namespace linattn_fuzz {

#define LINATTN_FUZZ_ENGINE(T, Map)                                                            \
  template void run_engine<T, Map>(const Input&, const Matrix<T>&, const Matrix<T>&,           \
                                   const Matrix<T>&, const Matrix<T>&, const Map&, bool, bool, \
                                   bool);
#define LINATTN_FUZZ_ENGINE_MAPS(T)                       \
  LINATTN_FUZZ_ENGINE(T, linattn::EluPlusOne)             \
  LINATTN_FUZZ_ENGINE(T, linattn::Relu)                   \
  LINATTN_FUZZ_ENGINE(T, linattn::PositiveRandomFeatures) \
  LINATTN_FUZZ_ENGINE(T, linattn::RandomFourierFeatures)  \
  LINATTN_FUZZ_ENGINE(T, PassThrough)
LINATTN_FUZZ_ENGINE_MAPS(float)
LINATTN_FUZZ_ENGINE_MAPS(double)

}  // namespace linattn_fuzz
