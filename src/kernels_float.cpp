// SPDX-License-Identifier: MIT
// linattn::compiled: the chunked kernels that accumulate in float.
#include <linattn/detail/compiled.hpp>

#define LINATTN_DEFINE_FLOAT_KERNELS(T, O) LINATTN_KERNEL_INSTANCES(template, T, O)
LINATTN_DEFINE_FLOAT_KERNELS(float, float)
LINATTN_DEFINE_FLOAT_KERNELS(float, Eigen::half)
LINATTN_DEFINE_FLOAT_KERNELS(float, Eigen::bfloat16)
