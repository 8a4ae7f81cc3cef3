// SPDX-License-Identifier: MIT
// linattn::compiled: the chunked kernels that accumulate in double.
#include <linattn/detail/compiled.hpp>

#define LINATTN_DEFINE_DOUBLE_KERNELS(T, O) LINATTN_KERNEL_INSTANCES(template, T, O)
LINATTN_DEFINE_DOUBLE_KERNELS(double, double)
LINATTN_DEFINE_DOUBLE_KERNELS(double, float)
LINATTN_DEFINE_DOUBLE_KERNELS(double, Eigen::half)
LINATTN_DEFINE_DOUBLE_KERNELS(double, Eigen::bfloat16)
