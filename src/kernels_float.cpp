// SPDX-License-Identifier: MIT
// linattn::compiled: the kernels (chunked, streamed, stepped, backward; both families) that
// accumulate in float.
#include <linattn/delta_rule.hpp>
#include <linattn/detail/compiled.hpp>
#include <linattn/detail/delta_rule.hpp>
#include <linattn/detail/delta_rule_backward.hpp>
#include <linattn/detail/dplr_chunk_backward.hpp>
#include <linattn/detail/dplr_delta_rule.hpp>
#include <linattn/detail/dplr_delta_rule_backward.hpp>
#include <linattn/detail/gradient_stream.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/short_conv.hpp>
#include <linattn/softmax.hpp>

// Per (accumulation, input/output) pair: the chunked, streamed and view drivers of both families.
LINATTN_PAIR_INSTANCES(template, float, float)
LINATTN_PAIR_INSTANCES(template, float, Eigen::half)
LINATTN_PAIR_INSTANCES(template, float, Eigen::bfloat16)

// Per input type: the view calls' checks (float and the 16-bit types).
LINATTN_INPUT_CHECK_INSTANCES(template, float)
LINATTN_INPUT_CHECK_INSTANCES(template, Eigen::half)
LINATTN_INPUT_CHECK_INSTANCES(template, Eigen::bfloat16)

// Per accumulation type: the stream kernels behind every step, prefill and backward, the delta
// rule's step and backward workspace, the engine's backward (its two streamed passes and their
// thread split), the softmax baseline's tiles and the short convolution.
LINATTN_STREAM_INSTANCES(template, float)
LINATTN_DELTA_STEP_INSTANCES(template, float)
LINATTN_DPLR_STEP_INSTANCES(template, float)
LINATTN_DELTA_BACKWARD_INSTANCES(template, float)
template class linattn::detail::DplrBackward<float>;
template class linattn::detail::DplrChunkBackward<float>;
LINATTN_GRADIENT_INSTANCES(template, float)
LINATTN_SOFTMAX_INSTANCES(template, float)
LINATTN_CONV_INSTANCES(template, float)
