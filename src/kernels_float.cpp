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

// Per (accumulation, input/output) pair: the engine's chunked drivers, the delta rule's chunked
// and streamed kernels, and both families' view drivers.
#define LINATTN_DEFINE_FLOAT_PAIR(T, O)    \
  LINATTN_KERNEL_INSTANCES(template, T, O) \
  LINATTN_DELTA_INSTANCES(template, T, O)  \
  LINATTN_HEADS_INSTANCES(template, T, O)  \
  LINATTN_DELTA_HEADS_INSTANCES(template, T, O)
LINATTN_DEFINE_FLOAT_PAIR(float, float)
LINATTN_DEFINE_FLOAT_PAIR(float, Eigen::half)
LINATTN_DEFINE_FLOAT_PAIR(float, Eigen::bfloat16)

// Per input type: the view calls' checks (float and the 16-bit types).
#define LINATTN_DEFINE_FLOAT_CHECKS(S)       \
  LINATTN_HEADS_CHECK_INSTANCES(template, S) \
  LINATTN_DELTA_HEADS_CHECK_INSTANCES(template, S)
LINATTN_DEFINE_FLOAT_CHECKS(float)
LINATTN_DEFINE_FLOAT_CHECKS(Eigen::half)
LINATTN_DEFINE_FLOAT_CHECKS(Eigen::bfloat16)

// Per accumulation type: the stream kernels behind every step, prefill and backward, the delta
// rule's step and backward workspace, the engine's backward (its two streamed passes and their
// thread split) and the softmax baseline's tiles.
LINATTN_STREAM_INSTANCES(template, float)
LINATTN_DELTA_STEP_INSTANCES(template, float)
LINATTN_DELTA_BACKWARD_INSTANCES(template, float)
LINATTN_GRADIENT_INSTANCES(template, float)
LINATTN_SOFTMAX_INSTANCES(template, float)
