// SPDX-License-Identifier: MIT
// The depthwise causal convolution's kernel: one sequence's tokens over a band of channels.
#pragma once

#include <algorithm>
#include <cmath>
#include <linattn/config.hpp>
#include <type_traits>
#include <vector>

namespace linattn::detail {

/// Operands of one sequence's convolution, row-major with leading dimensions (ld*) in
/// elements. Output row t, channel c (the taps K, the dilation d, W = (K - 1) d):
///   y[t, c] = act(bias[c] + sum_i taps[i, c] * x[t - (K - 1 - i) d, c]),
/// where a row before the sequence's first is row W + t - (K - 1 - i) d of `history` (the
/// rolling window, oldest first), or zero when history is null.
template <class T>
struct ConvOperands {
  const T* x;
  Eigen::Index ldx;
  const T* history;  ///< W x C rows before x, or null for a sequence that starts at zero
  Eigen::Index ldh;
  T* y;
  Eigen::Index ldy;
  const T* taps;  ///< K x C, tap-major (taps[i * C + c] = the model's weight[c, i])
  const T* bias;  ///< C, or null
  Eigen::Index tokens;
  Eigen::Index channels;
  Eigen::Index kernel_size;
  Eigen::Index dilation;
  bool silu;
};

/// The most taps a convolution may have (the register arrays below are sized by it).
inline constexpr Eigen::Index kMaxConvTaps = 8;

/// Channels per band: a band walks down the tokens 4 KiB of a row at a time (in float), and the
/// rows it reads back stay in L2.
inline constexpr Eigen::Index kConvBand = 1024;

/// x * sigmoid(x) on a packet (Eigen's vectorised exp).
template <class T, class Packet>
EIGEN_ALWAYS_INLINE Packet silu_packet(const Packet& x) {
  using namespace Eigen::internal;
  const Packet one = pset1<Packet>(T(1));
  return pdiv(x, padd(one, pexp(pnegate(x))));
}

/// One output row over channels [first, last) with every tap on a row of input (rows[i] for
/// tap i, indexed by channel): K taps and the activation known at compile time, so the taps
/// unroll and two packets are in flight at once.
template <class T, int K, bool Silu, bool Bias>
void conv_row(const T* const (&rows)[kMaxConvTaps], const T* taps, Eigen::Index channels,
              const T* bias, T* out, Eigen::Index first, Eigen::Index last) {
  using namespace Eigen::internal;
  using Packet = typename packet_traits<T>::type;
  // The packet's size from T's traits: a template argument of the packet type itself loses its
  // vector attributes (GCC's -Wignored-attributes).
  constexpr Eigen::Index P = packet_traits<T>::size;
  auto one_packet = [&](Eigen::Index c) {
    Packet acc = Bias ? ploadu<Packet>(bias + c) : pset1<Packet>(T(0));
    LINATTN_UNROLL for (int i = 0; i < K; ++i) {
      acc = pmadd(ploadu<Packet>(taps + i * channels + c), ploadu<Packet>(rows[i] + c), acc);
    }
    return Silu ? silu_packet<T>(acc) : acc;
  };
  Eigen::Index c = first;
  for (; c + 2 * P <= last; c += 2 * P) {
    const Packet y0 = one_packet(c), y1 = one_packet(c + P);
    pstoreu<T>(out + c, y0);
    pstoreu<T>(out + c + P, y1);
  }
  for (; c + P <= last; c += P) pstoreu<T>(out + c, one_packet(c));
  for (; c < last; ++c) {
    T acc = Bias ? bias[c] : T(0);
    for (int i = 0; i < K; ++i) acc += taps[i * channels + c] * rows[i][c];
    out[c] = Silu ? acc / (T(1) + std::exp(-acc)) : acc;
  }
}

/// conv_row with K, the activation and the bias as template arguments.
template <class T>
void conv_row_dispatch(const ConvOperands<T>& a, const T* const (&rows)[kMaxConvTaps], T* out,
                       Eigen::Index first, Eigen::Index last) {
  auto with = [&](auto taps, auto silu, auto bias) {
    conv_row<T, decltype(taps)::value, decltype(silu)::value, decltype(bias)::value>(
        rows, a.taps, a.channels, a.bias, out, first, last);
  };
  auto with_taps = [&](auto silu, auto bias) {
    switch (a.kernel_size) {
      case 1:
        return with(std::integral_constant<int, 1>{}, silu, bias);
      case 2:
        return with(std::integral_constant<int, 2>{}, silu, bias);
      case 3:
        return with(std::integral_constant<int, 3>{}, silu, bias);
      case 4:
        return with(std::integral_constant<int, 4>{}, silu, bias);
      case 5:
        return with(std::integral_constant<int, 5>{}, silu, bias);
      case 6:
        return with(std::integral_constant<int, 6>{}, silu, bias);
      case 7:
        return with(std::integral_constant<int, 7>{}, silu, bias);
      default:
        return with(std::integral_constant<int, 8>{}, silu, bias);
    }
  };
  auto with_silu = [&](auto bias) {
    if (a.silu) {
      with_taps(std::true_type{}, bias);
    } else {
      with_taps(std::false_type{}, bias);
    }
  };
  if (a.bias != nullptr) {
    with_silu(std::true_type{});
  } else {
    with_silu(std::false_type{});
  }
}

/// The convolution of channels [first, first + count) of one sequence (see ConvOperands).
template <class T>
void conv_band(const ConvOperands<T>& a, Eigen::Index first, Eigen::Index count) {
  const Eigen::Index taps = a.kernel_size, d = a.dilation, window = (taps - 1) * d;
  const Eigen::Index last = first + count;
  // Without history, the taps before a sequence's first token read a row of zeros (indexed by
  // channel, as the input rows are): the same arithmetic as a zero window, bit for bit.
  const std::vector<T> zeros(a.history == nullptr && window > 0 ? last : 0, T(0));
  const T* rows[kMaxConvTaps] = {};
  for (Eigen::Index t = 0; t < a.tokens; ++t) {
    for (Eigen::Index i = 0; i < taps; ++i) {
      const Eigen::Index src = t - (taps - 1 - i) * d;
      if (src >= 0) {
        rows[i] = a.x + src * a.ldx;
      } else if (a.history != nullptr) {
        rows[i] = a.history + (window + src) * a.ldh;
      } else {
        rows[i] = zeros.data();
      }
    }
    conv_row_dispatch(a, rows, a.y + t * a.ldy, first, last);
  }
}

/// Operands of one sequence's backward, laid out as ConvOperands; the gradients of the taps and
/// the bias are added to (K x C and C, over every sequence), those of x and the history written.
template <class T>
struct ConvBackwardOperands {
  ConvOperands<T> forward;  ///< x, history and the parameters (y unused)
  const T* grad_y;
  Eigen::Index ldgy;
  T* grad_x;
  Eigen::Index ldgx;
  T* grad_history;  ///< W x C (row stride C), or null when there is no history
  T* grad_taps;     ///< K x C, added to
  T* grad_bias;     ///< C, added to; null without bias
};

/// The backward of conv_band over channels [first, first + count) of one sequence, from its
/// last token back: each token's dz = dy * act'(z) (z recomputed) goes into a ring of the
/// W + 1 latest, from which dx of the token reads its K later dz.
template <class T>
void conv_backward_band(const ConvBackwardOperands<T>& g, Eigen::Index first, Eigen::Index count) {
  using Row = Eigen::Array<T, 1, Eigen::Dynamic>;
  using RowMap = Eigen::Map<Row>;
  using ConstRowMap = Eigen::Map<const Row>;
  const ConvOperands<T>& a = g.forward;
  const Eigen::Index taps = a.kernel_size, d = a.dilation, window = (taps - 1) * d;
  const Eigen::Index n = a.tokens, ring_rows = window + 1;
  Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> ring(ring_rows, count);
  Row z(count), sigma(count);
  // Input row src (negative: the history's, or zeros without one), channels of the band.
  auto input = [&](Eigen::Index src, const T*& row) {
    if (src >= 0) {
      row = a.x + src * a.ldx + first;
      return true;
    }
    if (a.history == nullptr) return false;
    row = a.history + (window + src) * a.ldh + first;
    return true;
  };
  auto tap = [&](Eigen::Index i) { return ConstRowMap(a.taps + i * a.channels + first, count); };
  auto grad_tap = [&](Eigen::Index i) {
    return RowMap(g.grad_taps + i * a.channels + first, count);
  };
  // d loss / d (input row e) from the dz of the tokens that read it, e + (K - 1 - i) d < n.
  auto input_grad = [&](Eigen::Index e, T* out) {
    RowMap dx(out + first, count);
    dx.setZero();
    for (Eigen::Index i = 0; i < taps; ++i) {
      const Eigen::Index t = e + (taps - 1 - i) * d;
      if (t >= 0 && t < n) dx += tap(i) * ring.row(t % ring_rows);
    }
  };
  for (Eigen::Index t = n - 1; t >= 0; --t) {
    if (a.bias) {
      z = ConstRowMap(a.bias + first, count);
    } else {
      z.setZero();
    }
    for (Eigen::Index i = 0; i < taps; ++i) {
      const T* row = nullptr;
      if (input(t - (taps - 1 - i) * d, row)) z += tap(i) * ConstRowMap(row, count);
    }
    const ConstRowMap dy(g.grad_y + t * g.ldgy + first, count);
    RowMap dz(ring.data() + (t % ring_rows) * count, count);
    if (a.silu) {
      sigma = T(1) / (T(1) + (-z).exp());
      dz = dy * sigma * (T(1) + z * (T(1) - sigma));
    } else {
      dz = dy;
    }
    if (g.grad_bias) RowMap(g.grad_bias + first, count) += dz;
    for (Eigen::Index i = 0; i < taps; ++i) {
      const T* row = nullptr;
      if (input(t - (taps - 1 - i) * d, row)) grad_tap(i) += dz * ConstRowMap(row, count);
    }
    input_grad(t, g.grad_x + t * g.ldgx);
  }
  if (g.grad_history) {
    for (Eigen::Index r = 0; r < window; ++r)
      input_grad(r - window, g.grad_history + r * a.channels);
  }
}

}  // namespace linattn::detail

/// The compiled mode's instances of the convolution's kernels (forward and backward), one scalar
/// type T each.
#define LINATTN_CONV_INSTANCES(prefix, T)                                                          \
  prefix void linattn::detail::conv_band<T>(const linattn::detail::ConvOperands<T>&, Eigen::Index, \
                                            Eigen::Index);                                         \
  prefix void linattn::detail::conv_backward_band<T>(                                              \
      const linattn::detail::ConvBackwardOperands<T>&, Eigen::Index, Eigen::Index);

#ifdef LINATTN_COMPILED
LINATTN_CONV_INSTANCES(extern template, float)
LINATTN_CONV_INSTANCES(extern template, double)
#endif
