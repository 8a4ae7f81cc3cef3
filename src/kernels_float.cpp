// SPDX-License-Identifier: MIT
// linattn::compiled: the kernels (chunked, streamed, stepped, backward; both families) that
// accumulate in float.
#include <linattn/delta_rule.hpp>
#include <linattn/detail/compiled.hpp>
#include <linattn/detail/delta_rule.hpp>
#include <linattn/detail/delta_rule_backward.hpp>
#include <linattn/detail/gradient_stream.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/softmax.hpp>

#define LINATTN_DEFINE_FLOAT_KERNELS(T, O) LINATTN_KERNEL_INSTANCES(template, T, O)
LINATTN_DEFINE_FLOAT_KERNELS(float, float)
LINATTN_DEFINE_FLOAT_KERNELS(float, Eigen::half)
LINATTN_DEFINE_FLOAT_KERNELS(float, Eigen::bfloat16)

#define LINATTN_DEFINE_FLOAT_DELTA_KERNELS(T, O) LINATTN_DELTA_INSTANCES(template, T, O)
LINATTN_DEFINE_FLOAT_DELTA_KERNELS(float, float)
LINATTN_DEFINE_FLOAT_DELTA_KERNELS(float, Eigen::half)
LINATTN_DEFINE_FLOAT_DELTA_KERNELS(float, Eigen::bfloat16)

// The stream kernels behind every step, prefill and backward, and the delta rule's step.
LINATTN_STREAM_INSTANCES(template, float)
LINATTN_DELTA_STEP_INSTANCES(template, float)
LINATTN_DELTA_BACKWARD_INSTANCES(template, float)
// The linear/gated engine's backward: its two streamed passes and their thread split.
LINATTN_GRADIENT_INSTANCES(template, float)
// The softmax baseline's tiles, forward and backward.
LINATTN_SOFTMAX_INSTANCES(template, float)
// The view forward's drivers, and the checks of the float and 16-bit views.
#define LINATTN_DEFINE_FLOAT_HEADS(T, S) LINATTN_HEADS_INSTANCES(template, T, S)
LINATTN_DEFINE_FLOAT_HEADS(float, float)
LINATTN_DEFINE_FLOAT_HEADS(float, Eigen::half)
LINATTN_DEFINE_FLOAT_HEADS(float, Eigen::bfloat16)
LINATTN_HEADS_CHECK_INSTANCES(template, float)
LINATTN_HEADS_CHECK_INSTANCES(template, Eigen::half)
LINATTN_HEADS_CHECK_INSTANCES(template, Eigen::bfloat16)
// The delta rule's view drivers, and its checks of the float and 16-bit views.
#define LINATTN_DEFINE_FLOAT_DELTA_HEADS(T, S) LINATTN_DELTA_HEADS_INSTANCES(template, T, S)
LINATTN_DEFINE_FLOAT_DELTA_HEADS(float, float)
LINATTN_DEFINE_FLOAT_DELTA_HEADS(float, Eigen::half)
LINATTN_DEFINE_FLOAT_DELTA_HEADS(float, Eigen::bfloat16)
LINATTN_DELTA_HEADS_CHECK_INSTANCES(template, float)
LINATTN_DELTA_HEADS_CHECK_INSTANCES(template, Eigen::half)
LINATTN_DELTA_HEADS_CHECK_INSTANCES(template, Eigen::bfloat16)
