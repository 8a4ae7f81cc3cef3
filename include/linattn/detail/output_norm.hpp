// SPDX-License-Identifier: MIT
// The output norm's kernel: one token's channels, group by group, in the arithmetic type Acc.
#pragma once

#include <algorithm>
#include <cmath>
#include <linattn/config.hpp>
#include <linattn/detail/convert.hpp>
#include <type_traits>
#include <vector>

namespace linattn::detail {

/// Where a norm's gate enters (the public NormGate's values, in the same order).
enum class NormGateKind { none, silu_after, sigmoid_after, silu_before };

/// One head's adjacent features within a group: features [feature, feature + length) of head
/// `head`, flat channels from `channel` (= head * D + feature).
struct NormRun {
  Eigen::Index head, feature, length, channel;
};

/// What one token's norm reads besides the token: its runs (a group is runs
/// [group_runs[g], group_runs[g + 1])), the parameters and where the gate enters.
template <class Acc>
struct NormRowPlan {
  const NormRun* runs;             ///< every run of the token's H * D channels, in order
  const Eigen::Index* group_runs;  ///< groups + 1 run offsets
  Eigen::Index groups;             ///< H * D / G
  Eigen::Index channels;           ///< H * D
  Eigen::Index group;              ///< G
  const Acc* weight;               ///< indexed by flat channel (per_channel) or by feature
  const Acc* bias;                 ///< as weight, or null
  bool per_channel;                ///< weight and bias hold H * D entries
  bool subtract_mean;              ///< LayerNorm / GroupNorm rather than RMSNorm
  NormGateKind gate;               ///< where z enters
  Acc eps;                         ///< added to the mean square (or variance) under the root
};

/// The runs and group offsets of H heads of D features in groups of G flat channels.
inline void plan_norm_runs(Eigen::Index heads, Eigen::Index dim, Eigen::Index group,
                           std::vector<NormRun>& runs, std::vector<Eigen::Index>& group_runs) {
  runs.clear();
  group_runs.assign(1, 0);
  const Eigen::Index channels = heads * dim;
  for (Eigen::Index first = 0; first < channels; first += group) {
    for (Eigen::Index c = first; c < first + group;) {
      const Eigen::Index h = c / dim, d = c % dim;
      const Eigen::Index n = std::min(dim - d, first + group - c);
      runs.push_back(NormRun{h, d, n, c});
      c += n;
    }
    group_runs.push_back(static_cast<Eigen::Index>(runs.size()));
  }
}

/// Groups whose statistics norm_token computes side by side before writing their outputs.
inline constexpr Eigen::Index kNormGroupBatch = 8;
/// Channels of a batch of groups beyond which it takes fewer groups: its inputs, outputs and
/// scratch stay within L1.
inline constexpr Eigen::Index kNormBatchChannels = 1024;

/// Entries by which a norm's scratch rounds its parts up (each starts on Eigen's largest
/// alignment).
template <class Acc>
constexpr Eigen::Index kNormScratchAlign = EIGEN_MAX_ALIGN_BYTES > 0
                                               ? Eigen::Index(EIGEN_MAX_ALIGN_BYTES / sizeof(Acc))
                                               : 1;

/// Scratch for norm_token, for one token of `channels` channels: u and the gate's activation,
/// a value per channel each.
template <class Acc>
struct NormScratch {
  explicit NormScratch(Eigen::Index channels)
      : stride((channels + kNormScratchAlign<Acc> - 1) / kNormScratchAlign<Acc> *
               kNormScratchAlign<Acc>),
        entries(2 * stride) {}
  Acc* values() { return entries.data(); }
  Acc* gates() { return entries.data() + stride; }
  Eigen::Index stride;
  Eigen::Array<Acc, Eigen::Dynamic, 1> entries;
};

// The loops below run in Eigen's packets with unaligned loads and a scalar tail at each run's
// end: which entries take the tail depends on the run lengths alone, never on where the views
// lie, so the bits do not depend on the layout.

/// Eigen's packet of Acc and its width.
template <class Acc>
struct NormPacket {
  using type = typename Eigen::internal::packet_traits<Acc>::type;
  static constexpr Eigen::Index size = Eigen::internal::unpacket_traits<type>::size;
};

/// What run_reduce sums.
enum class NormSum { values, squares, squares_about_mean };

/// The sum of u, of u^2, or of (u - mean)^2 over n entries.
template <NormSum Kind, class Acc>
EIGEN_STRONG_INLINE Acc run_reduce(const Acc* u, Eigen::Index n, Acc mean) {
  using Packet = typename NormPacket<Acc>::type;
  constexpr Eigen::Index P = NormPacket<Acc>::size;
  using Eigen::internal::padd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmul;
  using Eigen::internal::psub;
  const Packet centre = Eigen::internal::pset1<Packet>(mean);
  auto term = [&](const Packet& x) {
    if constexpr (Kind == NormSum::values) {
      return x;
    } else if constexpr (Kind == NormSum::squares) {
      return pmul(x, x);
    } else {
      const Packet c = psub(x, centre);
      return pmul(c, c);
    }
  };
  Packet a0 = Eigen::internal::pset1<Packet>(Acc(0)), a1 = a0;
  Eigen::Index i = 0;
  for (; i + 2 * P <= n; i += 2 * P) {
    a0 = padd(a0, term(ploadu<Packet>(u + i)));
    a1 = padd(a1, term(ploadu<Packet>(u + i + P)));
  }
  for (; i + P <= n; i += P) a0 = padd(a0, term(ploadu<Packet>(u + i)));
  Acc total = Eigen::internal::predux(padd(a0, a1));
  for (; i < n; ++i) {
    const Acc x = Kind == NormSum::squares_about_mean ? u[i] - mean : u[i];
    total += Kind == NormSum::values ? x : x * x;
  }
  return total;
}

/// The gate's activation for n entries of z into out (which may be z): silu(z) = z / (1 +
/// exp(-z)) or sigmoid(z) = 1 / (1 + exp(-z)), both 0 (not NaN) far below 0. With Gated,
/// `gated` is multiplied by it in place (the gate before the norm) and out is not written.
template <bool Gated, class Acc>
EIGEN_STRONG_INLINE void activate_gate(const Acc* z, Acc* out, Acc* gated, Eigen::Index n,
                                       bool silu) {
  using Packet = typename NormPacket<Acc>::type;
  constexpr Eigen::Index P = NormPacket<Acc>::size;
  using Eigen::internal::padd;
  using Eigen::internal::pdiv;
  using Eigen::internal::ploadu;
  using Eigen::internal::pstoreu;
  const Packet one = Eigen::internal::pset1<Packet>(Acc(1));
  Eigen::Index i = 0;
  for (; i + P <= n; i += P) {
    const Packet x = ploadu<Packet>(z + i);
    const Packet denominator = padd(one, Eigen::internal::pexp(Eigen::internal::pnegate(x)));
    const Packet activation = pdiv(silu ? x : one, denominator);
    if constexpr (Gated) {
      pstoreu(gated + i, Eigen::internal::pmul(ploadu<Packet>(gated + i), activation));
    } else {
      pstoreu(out + i, activation);
    }
  }
  for (; i < n; ++i) {
    const Acc denominator = Acc(1) + std::exp(-z[i]);
    const Acc activation = (silu ? z[i] : Acc(1)) / denominator;
    if constexpr (Gated) {
      gated[i] *= activation;
    } else {
      out[i] = activation;
    }
  }
}

/// out = ((u - mean) * inverse_root) * w (+ b) (* gate) over n entries; out may be u or gate.
template <bool Bias, bool Gate, class Acc>
EIGEN_STRONG_INLINE void run_output(const Acc* u, const Acc* w, const Acc* b, const Acc* gate,
                                    Acc mean, Acc inverse_root, Acc* out, Eigen::Index n) {
  using Packet = typename NormPacket<Acc>::type;
  constexpr Eigen::Index P = NormPacket<Acc>::size;
  using Eigen::internal::padd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmul;
  const Packet centre = Eigen::internal::pset1<Packet>(mean);
  const Packet scale = Eigen::internal::pset1<Packet>(inverse_root);
  Eigen::Index i = 0;
  for (; i + P <= n; i += P) {
    Packet x = pmul(pmul(Eigen::internal::psub(ploadu<Packet>(u + i), centre), scale),
                    ploadu<Packet>(w + i));
    if constexpr (Bias) x = padd(x, ploadu<Packet>(b + i));
    if constexpr (Gate) x = pmul(x, ploadu<Packet>(gate + i));
    Eigen::internal::pstoreu(out + i, x);
  }
  for (; i < n; ++i) {
    Acc x = ((u[i] - mean) * inverse_root) * w[i];
    if constexpr (Bias) x += b[i];
    if constexpr (Gate) x *= gate[i];
    out[i] = x;
  }
}

/// The norm of one token: o, z and y point at head 0 of the token (features adjacent), the
/// heads `*_head` elements apart; z is null for an ungated norm. The token's o and z are read
/// whole (pass 1: u, act(z) and every group's statistics, the groups' dependency chains side
/// by side) before any output is written (pass 2), so y may be o's or z's memory (same layout)
/// for an in-place norm. o and y of type Acc are read and written where they are, others
/// through the scratch.
template <class Acc, class O, class Z, class Y>
void norm_token(const NormRowPlan<Acc>& plan, const O* o, Eigen::Index o_head, const Z* z,
                Eigen::Index z_head, Y* y, Eigen::Index y_head, NormScratch<Acc>& scratch) {
  constexpr bool direct_o = std::is_same_v<O, Acc>;
  constexpr bool direct_y = std::is_same_v<Y, Acc>;
  Acc* const values = scratch.values();
  Acc* const gates = scratch.gates();
  const bool gated = plan.gate != NormGateKind::none;
  const bool gate_before = plan.gate == NormGateKind::silu_before;
  const bool gate_after = gated && !gate_before;
  const bool silu = plan.gate != NormGateKind::sigmoid_after;
  // u (o, or o silu(z) with the gate before) stays in o's memory when it is o itself.
  const bool u_in_values = gate_before || !direct_o;
  auto u_at = [&](const NormRun& run) -> const Acc* {
    if constexpr (direct_o) {
      if (!u_in_values) return o + run.head * o_head + run.feature;
    }
    return values + run.channel;
  };
  Acc means[kNormGroupBatch], inverse_roots[kNormGroupBatch];
  const Acc inverse_group = Acc(1) / Acc(plan.group);
  // At most kNormGroupBatch groups and kNormBatchChannels channels a batch (large groups, as
  // Mamba-2's, one at a time).
  const Eigen::Index batch_size =
      std::max<Eigen::Index>(1, std::min(kNormGroupBatch, kNormBatchChannels / plan.group));
  for (Eigen::Index batch = 0; batch < plan.groups; batch += batch_size) {
    const Eigen::Index batch_groups = std::min(batch_size, plan.groups - batch);
    // Pass 1: each group's u and act(z) where they do not stay in place, then its statistics.
    // The groups of a batch are independent, so their sums' long dependency chains (a
    // horizontal sum, a root, a division) overlap, while their inputs stay in L1.
    for (Eigen::Index j = 0; j < batch_groups; ++j) {
      const Eigen::Index first_run = plan.group_runs[batch + j];
      const Eigen::Index last_run = plan.group_runs[batch + j + 1];
      if (u_in_values || gated) {
        for (Eigen::Index r = first_run; r < last_run; ++r) {
          const NormRun& run = plan.runs[r];
          const Eigen::Index n = run.length, c = run.channel;
          if (u_in_values) convert(o + run.head * o_head + run.feature, values + c, n);
          if (gated) {
            const Z* const z_run = z + run.head * z_head + run.feature;
            const Acc* gate_input;
            if constexpr (std::is_same_v<Z, Acc>) {
              gate_input = z_run;
            } else {
              convert(z_run, gates + c, n);
              gate_input = gates + c;
            }
            if (gate_before) {
              activate_gate<true>(gate_input, gates + c, values + c, n, true);
            } else {
              activate_gate<false>(gate_input, gates + c, values + c, n, silu);
            }
          }
        }
      }
      Acc mean = Acc(0), squares = Acc(0);
      if (plan.subtract_mean) {
        // The variance about the mean, a second sum: one pass's E[u^2] - mean^2 cancels.
        Acc sum = Acc(0);
        for (Eigen::Index r = first_run; r < last_run; ++r) {
          sum += run_reduce<NormSum::values>(u_at(plan.runs[r]), plan.runs[r].length, Acc(0));
        }
        mean = sum * inverse_group;
        for (Eigen::Index r = first_run; r < last_run; ++r) {
          squares += run_reduce<NormSum::squares_about_mean>(u_at(plan.runs[r]),
                                                             plan.runs[r].length, mean);
        }
      } else {
        for (Eigen::Index r = first_run; r < last_run; ++r) {
          squares += run_reduce<NormSum::squares>(u_at(plan.runs[r]), plan.runs[r].length, Acc(0));
        }
      }
      means[j] = mean;
      inverse_roots[j] = squares * inverse_group + plan.eps;
    }
    for (Eigen::Index j = 0; j < batch_groups; ++j) {
      inverse_roots[j] = Acc(1) / std::sqrt(inverse_roots[j]);
    }
    // Pass 2: the batch's outputs, run by run (their inputs are all read by now).
    for (Eigen::Index j = 0; j < batch_groups; ++j) {
      const Acc mean = means[j], inverse_root = inverse_roots[j];
      for (Eigen::Index r = plan.group_runs[batch + j]; r < plan.group_runs[batch + j + 1]; ++r) {
        const NormRun& run = plan.runs[r];
        const Eigen::Index n = run.length;
        const Eigen::Index at = plan.per_channel ? run.channel : run.feature;
        Acc* out;
        if constexpr (direct_y) {
          out = y + run.head * y_head + run.feature;
        } else {
          out = values + run.channel;  // u's own place, or free
        }
        const Acc* const u = u_at(run);
        const Acc* const w = plan.weight + at;
        const Acc* const gate = gates + run.channel;
        if (plan.bias == nullptr) {
          if (gate_after) {
            run_output<false, true>(u, w, w, gate, mean, inverse_root, out, n);
          } else {
            run_output<false, false>(u, w, w, gate, mean, inverse_root, out, n);
          }
        } else {
          const Acc* const b = plan.bias + at;
          if (gate_after) {
            run_output<true, true>(u, w, b, gate, mean, inverse_root, out, n);
          } else {
            run_output<true, false>(u, w, b, gate, mean, inverse_root, out, n);
          }
        }
        if constexpr (!direct_y) {
          convert(static_cast<const Acc*>(out), y + run.head * y_head + run.feature, n);
        }
      }
    }
  }
}

}  // namespace linattn::detail
