// linattn: linear-attention kernels on Eigen 3.4.
// SPDX-License-Identifier: MIT
#pragma once

#include <Eigen/Core>
#include <cstdint>
#include <stdexcept>
#include <string>

/// Library version; CMake reads these three lines.
#define LINATTN_VERSION_MAJOR 0
#define LINATTN_VERSION_MINOR 2
#define LINATTN_VERSION_PATCH 0

/// Checks an internal invariant (a bug, not bad input). Define LINATTN_ASSERT before including
/// any linattn header to route it elsewhere; compiled out under NDEBUG.
#ifndef LINATTN_ASSERT
#ifdef NDEBUG
#define LINATTN_ASSERT(cond) static_cast<void>(0)
#else
#include <cassert>
#define LINATTN_ASSERT(cond) assert(cond)
#endif
#endif

/// Unrolls the next loop completely: the register tiles of the stream kernels are arrays of
/// packets indexed by such loops, and GCC at -O2 keeps them rolled, with the tiles in memory
/// (the plain kernel then runs at a quarter of its -O3 speed).
#if defined(__GNUC__) && !defined(__INTEL_COMPILER)
#define LINATTN_UNROLL _Pragma("GCC unroll 32")
#else
#define LINATTN_UNROLL
#endif

namespace linattn {

/// Row-major dynamic matrix: rows are tokens.
template <class T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Dynamic column vector.
template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

/// Which head of a grouped input (H_in heads, a divisor of the output's H heads) output head h
/// reads. Models differ, and their weights are laid out for their own rule, so a port must
/// name the rule its model was trained or converted with.
enum class HeadGrouping {
  /// h / (H / H_in): consecutive output heads share an input head. FLA's kernels
  /// (i_h = i_hv // (HV // H)), HF transformers' repeat_interleave (Qwen3-Next, Qwen3.5) and
  /// repeat_kv (GQA), ggml's broadcast in mul_mat and flash attention.
  interleaved,
  /// h % H_in: the input heads repeat as a whole, as ggml_repeat lays them out when a graph
  /// repeats q/k up to the value heads before an op that takes equal head counts.
  tiled,
};

/// The input head that output head h of `heads` reads from an input of `input_heads` heads
/// (a divisor of `heads`) under `grouping`.
inline Eigen::Index grouped_input_head(HeadGrouping grouping, Eigen::Index h, Eigen::Index heads,
                                       Eigen::Index input_heads) {
  return grouping == HeadGrouping::tiled ? h % input_heads : h / (heads / input_heads);
}

/// The head counts of a layer: H output heads (the delta rule's value heads) and the heads its
/// q, k and v arrive with, each H or a divisor of it (grouped heads, shared by the options'
/// head_grouping). A layer's calls take exactly these counts: a view or step rows with other
/// counts throw, so that one sequence's rows are never read as another's heads.
struct LayerHeads {
  /// H heads for the output and for q, k and v. Implicit, so a layer made with a head count
  /// keeps its meaning.
  LayerHeads(Eigen::Index heads)  // NOLINT(google-explicit-constructor)
      : out(heads), query(heads), key(heads), value(heads) {}
  /// H output heads and the given heads of q, k and v, in that order.
  LayerHeads(Eigen::Index heads, Eigen::Index query_heads, Eigen::Index key_heads,
             Eigen::Index value_heads)
      : out(heads), query(query_heads), key(key_heads), value(value_heads) {}
  /// Fewer q/k heads than value heads: Qwen3.5's and Qwen3-Next's 16 q/k heads over 32 value
  /// heads (`grouped_query_key(32, 16)`), Mamba-2's groups of B and C.
  static LayerHeads grouped_query_key(Eigen::Index heads, Eigen::Index query_key_heads) {
    return LayerHeads(heads, query_key_heads, query_key_heads, heads);
  }
  /// Fewer k/v heads than q heads: grouped- and multi-query attention.
  static LayerHeads grouped_key_value(Eigen::Index heads, Eigen::Index key_value_heads) {
    return LayerHeads(heads, heads, key_value_heads, key_value_heads);
  }

  Eigen::Index out;    ///< H, heads of the output and of the states per sequence
  Eigen::Index query;  ///< H_q, heads of q
  Eigen::Index key;    ///< H_k, heads of k
  Eigen::Index value;  ///< H_v, heads of v
};

/// The settings every family's kernels share (the engine's Options and DeltaOptions derive
/// from it, and so does a new family's), validated once.
struct KernelOptions {
  /// Tokens per chunk of the parallel (chunked) form; >= 1. Changes speed, not results.
  Eigen::Index chunk = 64;
  /// Scan inputs for NaN and Inf and throw on them.
  bool check_finite = true;
  /// Threads for one call when linattn is built with OpenMP (CMake option LINATTN_OPENMP):
  /// 0 takes OpenMP's default (omp_get_max_threads(), 1 inside a parallel region), n > 0 at
  /// most n. Ignored without OpenMP. Results do not depend on it beyond rounding.
  int threads = 0;
  /// How output heads share the heads of grouped inputs (fewer heads than the output; Qwen3.5's
  /// 16 q/k heads over 32 value heads): HeadGrouping::interleaved as FLA and HF,
  /// HeadGrouping::tiled as ggml_repeat lays them out.
  HeadGrouping head_grouping = HeadGrouping::interleaved;
};

/// Settings of the linear/gated engine (linear attention with a feature map, decays, gates),
/// with the shared chunk, check_finite, threads and head_grouping of KernelOptions.
struct Options : KernelOptions {
  /// Added to the denominator outside the dot product; must be >= 0 and finite.
  double eps = 1e-6;
  /// State decay g in (0, 1]; 1 is plain linear attention, below 1 is retention-style decay.
  /// The non-causal routines ignore it.
  double decay = 1.0;
  /// false returns the numerator phi(q)^T S alone.
  bool normalize = true;
  /// s, multiplying phi(q) (FLA's `scale`): out = s phi(q)^T S / (s phi(q) . z + eps). In the
  /// normalised form it cancels but for eps; without normalize it scales the output (FLA's
  /// default for its kernels is Dk^-1/2). Must be finite and > 0.
  double scale = 1.0;
};

/// The form a delta-rule call over many tokens runs in; the results agree within docs/design.md's
/// bounds (1e-10 double, 1e-4 float with normalised keys).
enum class DeltaForm {
  automatic,  ///< the faster one for the shape, as bench_delta measures them
  chunked,    ///< the chunked WY form: 1.6-2x the recurrence's flops, all of them in GEMMs
  streamed,   ///< the recurrence token by token over blocks of loaded tokens, S in strips
};

/// Settings of the delta-rule kernels (DeltaNet, Gated DeltaNet, KDA), FLA's conventions, with
/// the shared chunk (of the chunked WY form), check_finite (of q, k and v: beta and the gates
/// are always checked), threads and head_grouping of KernelOptions.
struct DeltaOptions : KernelOptions {
  /// s, multiplying q: out_t = S_t^T (s q_t). Negative (the default) takes Dk^-1/2, FLA's
  /// default; otherwise finite and > 0.
  double scale = -1.0;
  /// Normalises q and k per token inside the kernel, x / sqrt(|x|^2 + 1e-6), as FLA's
  /// use_qk_l2norm_in_kernel and every released model do. Without it the keys' norms are the
  /// caller's: |beta| |k|^2 > 2 makes the recurrence grow without bound.
  bool l2_normalize = false;
  /// Accepts beta in (0, 2] (I - beta k k^T may then have a negative eigenvalue, FLA's
  /// allow_neg_eigval) instead of (0, 1].
  bool allow_negative_eigenvalues = false;
  /// The form prefill and the matrix and view calls run in (DeltaForm::automatic: the faster).
  DeltaForm form = DeltaForm::automatic;
};

/// Settings of the generalized (diagonal-plus-low-rank) delta rule's kernels (RWKV-7; FLA's
/// chunk_dplr_delta_rule), with the shared chunk, check_finite (of q, k, v, a and b: the gates
/// are always checked), threads and head_grouping of KernelOptions.
struct DplrOptions : KernelOptions {
  /// s, multiplying q: out_t = S_t^T (s q_t). Negative (the default) takes Dk^-1/2, FLA's
  /// default for chunk_dplr_delta_rule; RWKV-7's layer passes 1. Otherwise finite and > 0.
  double scale = -1.0;
  /// The form prefill and the matrix calls run in (DeltaForm::automatic: the faster).
  DeltaForm form = DeltaForm::automatic;
};

/// Thrown for bad input at the API boundary; the message names the argument and the shapes.
class Error : public std::invalid_argument {
 public:
  /// The message is "linattn: " followed by `what`.
  explicit Error(const std::string& what) : std::invalid_argument("linattn: " + what) {}
};

namespace detail {
/// How a SessionPool reaches the storage of the batches it lends (detail/session_parts.hpp).
struct PoolAccess;
}  // namespace detail

}  // namespace linattn
