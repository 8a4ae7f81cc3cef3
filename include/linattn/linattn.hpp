// SPDX-License-Identifier: MIT
// linattn: header-only linear-attention kernels on Eigen 3.4. The umbrella header.
#pragma once

#include <linattn/backward.hpp>
#include <linattn/config.hpp>
#include <linattn/delta_rule.hpp>
#include <linattn/delta_rule_backward.hpp>
#include <linattn/dplr_delta_rule.hpp>
#include <linattn/dplr_delta_rule_backward.hpp>
#include <linattn/draft_ring.hpp>
#include <linattn/feature_map.hpp>
#include <linattn/feature_maps.hpp>
#include <linattn/gated.hpp>
#include <linattn/gated_delta_net.hpp>
#include <linattn/gated_short_conv.hpp>
#include <linattn/gates.hpp>
#include <linattn/gradients.hpp>
#include <linattn/heads_view.hpp>
#include <linattn/layer.hpp>
#include <linattn/linear_attention.hpp>
#include <linattn/mamba2.hpp>
#include <linattn/multi_head.hpp>
#include <linattn/multi_head_backward.hpp>
#include <linattn/output_norm.hpp>
#include <linattn/recurrent_state.hpp>
#include <linattn/rwkv7_time_mix.hpp>
#include <linattn/session_pool.hpp>
#include <linattn/short_conv.hpp>
#include <linattn/softmax.hpp>
#include <linattn/state_batch.hpp>
#include <linattn/state_io.hpp>
