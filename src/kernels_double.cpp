// SPDX-License-Identifier: MIT
// linattn::compiled: the chunked kernels (the delta rule's included) that accumulate in double.
#include <linattn/detail/compiled.hpp>
#include <linattn/detail/delta_rule.hpp>

#define LINATTN_DEFINE_DOUBLE_KERNELS(T, O) LINATTN_KERNEL_INSTANCES(template, T, O)
LINATTN_DEFINE_DOUBLE_KERNELS(double, double)
LINATTN_DEFINE_DOUBLE_KERNELS(double, float)
LINATTN_DEFINE_DOUBLE_KERNELS(double, Eigen::half)
LINATTN_DEFINE_DOUBLE_KERNELS(double, Eigen::bfloat16)

#define LINATTN_DEFINE_DOUBLE_DELTA_KERNELS(T, O) LINATTN_DELTA_INSTANCES(template, T, O)
LINATTN_DEFINE_DOUBLE_DELTA_KERNELS(double, double)
LINATTN_DEFINE_DOUBLE_DELTA_KERNELS(double, float)
LINATTN_DEFINE_DOUBLE_DELTA_KERNELS(double, Eigen::half)
LINATTN_DEFINE_DOUBLE_DELTA_KERNELS(double, Eigen::bfloat16)
