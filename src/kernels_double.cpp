// SPDX-License-Identifier: MIT
// linattn::compiled: the kernels (chunked, streamed, stepped, backward; both families) that
// accumulate in double.
#include <linattn/delta_rule.hpp>
#include <linattn/detail/compiled.hpp>
#include <linattn/detail/delta_rule.hpp>
#include <linattn/detail/delta_rule_backward.hpp>
#include <linattn/detail/gradient_stream.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/softmax.hpp>

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

// The stream kernels behind every step, prefill and backward, and the delta rule's step.
LINATTN_STREAM_INSTANCES(template, double)
LINATTN_DELTA_STEP_INSTANCES(template, double)
LINATTN_DELTA_BACKWARD_INSTANCES(template, double)
// The linear/gated engine's backward: its two streamed passes and their thread split.
LINATTN_GRADIENT_INSTANCES(template, double)
// The softmax baseline's tiles, forward and backward.
LINATTN_SOFTMAX_INSTANCES(template, double)
// The view forward's drivers, and the checks of double views.
#define LINATTN_DEFINE_DOUBLE_HEADS(T, S) LINATTN_HEADS_INSTANCES(template, T, S)
LINATTN_DEFINE_DOUBLE_HEADS(double, double)
LINATTN_DEFINE_DOUBLE_HEADS(double, float)
LINATTN_DEFINE_DOUBLE_HEADS(double, Eigen::half)
LINATTN_DEFINE_DOUBLE_HEADS(double, Eigen::bfloat16)
LINATTN_HEADS_CHECK_INSTANCES(template, double)
// The delta rule's view drivers, and its checks of the double views.
#define LINATTN_DEFINE_DOUBLE_DELTA_HEADS(T, S) LINATTN_DELTA_HEADS_INSTANCES(template, T, S)
LINATTN_DEFINE_DOUBLE_DELTA_HEADS(double, double)
LINATTN_DEFINE_DOUBLE_DELTA_HEADS(double, float)
LINATTN_DEFINE_DOUBLE_DELTA_HEADS(double, Eigen::half)
LINATTN_DEFINE_DOUBLE_DELTA_HEADS(double, Eigen::bfloat16)
LINATTN_DELTA_HEADS_CHECK_INSTANCES(template, double)
