// SPDX-License-Identifier: MIT
// linattn::compiled: the kernels (chunked, streamed, stepped, backward; both families) that
// accumulate in double.
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
LINATTN_PAIR_INSTANCES(template, double, double)
LINATTN_PAIR_INSTANCES(template, double, float)
LINATTN_PAIR_INSTANCES(template, double, Eigen::half)
LINATTN_PAIR_INSTANCES(template, double, Eigen::bfloat16)

// Per input type: the view calls' checks (double).
LINATTN_INPUT_CHECK_INSTANCES(template, double)

// Per accumulation type: the stream kernels behind every step, prefill and backward, the delta
// rule's step and backward workspace, the engine's backward (its two streamed passes and their
// thread split), the softmax baseline's tiles and the short convolution.
LINATTN_STREAM_INSTANCES(template, double)
LINATTN_DELTA_STEP_INSTANCES(template, double)
LINATTN_DPLR_STEP_INSTANCES(template, double)
LINATTN_DELTA_BACKWARD_INSTANCES(template, double)
template class linattn::detail::DplrBackward<double>;
template class linattn::detail::DplrChunkBackward<double>;
LINATTN_GRADIENT_INSTANCES(template, double)
LINATTN_SOFTMAX_INSTANCES(template, double)
LINATTN_CONV_INSTANCES(template, double)
