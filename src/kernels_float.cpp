// SPDX-License-Identifier: MIT
// linattn::compiled: the chunked kernels (the delta rule's included) that accumulate in float.
#include <linattn/detail/compiled.hpp>
#include <linattn/detail/delta_rule.hpp>

#define LINATTN_DEFINE_FLOAT_KERNELS(T, O) LINATTN_KERNEL_INSTANCES(template, T, O)
LINATTN_DEFINE_FLOAT_KERNELS(float, float)
LINATTN_DEFINE_FLOAT_KERNELS(float, Eigen::half)
LINATTN_DEFINE_FLOAT_KERNELS(float, Eigen::bfloat16)

#define LINATTN_DEFINE_FLOAT_DELTA_KERNELS(T, O) LINATTN_DELTA_INSTANCES(template, T, O)
LINATTN_DEFINE_FLOAT_DELTA_KERNELS(float, float)
LINATTN_DEFINE_FLOAT_DELTA_KERNELS(float, Eigen::half)
LINATTN_DEFINE_FLOAT_DELTA_KERNELS(float, Eigen::bfloat16)
