// SPDX-License-Identifier: MIT
// The compiled mode: with LINATTN_COMPILED defined (the linattn::compiled target defines it),
// the chunked kernels for the built-in scalar types are declared here and built once, in the
// library, instead of in every translation unit that calls them.
#pragma once

#include <Eigen/Core>
#include <linattn/detail/parallel.hpp>

/// Every (accumulation, output) scalar pair the library builds: X(T, O) for each.
#define LINATTN_KERNEL_TYPES(X) \
  X(float, float)               \
  X(float, Eigen::half)         \
  X(float, Eigen::bfloat16)     \
  X(double, double)             \
  X(double, float)              \
  X(double, Eigen::half)        \
  X(double, Eigen::bfloat16)

/// Every input scalar type the library builds: X(S) for each.
#define LINATTN_INPUT_TYPES(X) \
  X(float)                     \
  X(double)                    \
  X(Eigen::half)               \
  X(Eigen::bfloat16)

/// The explicit instantiations of one pair; `prefix` is `extern template` or `template`.
#define LINATTN_KERNEL_INSTANCES(prefix, T, O)                                                 \
  prefix void linattn::detail::causal_rows<T, O>(                                              \
      const linattn::detail::ChunkSource<T>&, linattn::detail::CarriedState<T>&,               \
      linattn::detail::OutRows<O>, const linattn::Options&, int);                              \
  prefix void linattn::detail::non_causal_rows<T, O>(                                          \
      const linattn::detail::ChunkSource<T>&, const linattn::detail::ChunkSource<T>&,          \
      linattn::detail::CarriedState<T>&, linattn::detail::OutRows<O>, const linattn::Options&, \
      int);

/// The delta rule's chunked and streamed kernels of one pair (detail/delta_rule.hpp declares
/// them where they are defined, since this header does not include it).
#define LINATTN_DELTA_INSTANCES(prefix, T, O)      \
  prefix class linattn::detail::DeltaKernel<T, O>; \
  prefix class linattn::detail::DeltaStream<T, O>;

/// The delta rule's one-token step of one accumulation type T (declared in
/// detail/delta_rule.hpp); the stream kernels' instances are in detail/stream.hpp.
#define LINATTN_DELTA_STEP_INSTANCES(prefix, T) \
  prefix void linattn::detail::delta_step<T>(   \
      linattn::Matrix<T>&, linattn::detail::DeltaStepBuffers<T>&, T, Eigen::Index);

/// The generalized delta rule's chunked and streamed kernels of one pair and its one-token
/// step of one accumulation type (declared in detail/dplr_delta_rule.hpp).
#define LINATTN_DPLR_INSTANCES(prefix, T, O)      \
  prefix class linattn::detail::DplrKernel<T, O>; \
  prefix class linattn::detail::DplrStream<T, O>;
#define LINATTN_DPLR_STEP_INSTANCES(prefix, T)                                 \
  prefix void linattn::detail::dplr_step<T>(linattn::Matrix<T>&,               \
                                            linattn::detail::DplrTokenRefs<T>, \
                                            linattn::Vector<T>&, linattn::Vector<T>&);

/// The delta rule's backward workspace of one accumulation type T: the members that do not
/// depend on the inputs' types (declared in detail/delta_rule_backward.hpp).
#define LINATTN_DELTA_BACKWARD_INSTANCES(prefix, T) \
  prefix class linattn::detail::DeltaBackward<T>;   \
  prefix class linattn::detail::DeltaChunkBackward<T>;

/// What src/kernels_{float,double}.cpp define for one pair of LINATTN_KERNEL_TYPES: the engine's
/// chunked drivers, the delta rule's chunked and streamed kernels, and both families' view
/// drivers (the last two macros come from multi_head.hpp and delta_rule.hpp, which a file that
/// expands this includes).
#define LINATTN_PAIR_INSTANCES(prefix, T, O)  \
  LINATTN_KERNEL_INSTANCES(prefix, T, O)      \
  LINATTN_DELTA_INSTANCES(prefix, T, O)       \
  LINATTN_DPLR_INSTANCES(prefix, T, O)        \
  LINATTN_HEADS_INSTANCES(prefix, T, O)       \
  LINATTN_DELTA_HEADS_INSTANCES(prefix, T, O) \
  LINATTN_DPLR_HEADS_INSTANCES(prefix, T, O)

/// What they define for one input type of LINATTN_INPUT_TYPES: both families' view checks.
#define LINATTN_INPUT_CHECK_INSTANCES(prefix, S) \
  LINATTN_HEADS_CHECK_INSTANCES(prefix, S)       \
  LINATTN_DELTA_HEADS_CHECK_INSTANCES(prefix, S) \
  LINATTN_DPLR_HEADS_CHECK_INSTANCES(prefix, S)

#ifdef LINATTN_COMPILED
#define LINATTN_DECLARE_KERNELS(T, O) LINATTN_KERNEL_INSTANCES(extern template, T, O)
LINATTN_KERNEL_TYPES(LINATTN_DECLARE_KERNELS)
#undef LINATTN_DECLARE_KERNELS
#endif
