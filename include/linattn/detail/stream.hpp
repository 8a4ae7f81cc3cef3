// SPDX-License-Identifier: MIT
// The streaming micro-kernel: tiles of S stay in registers while a block of tokens streams
// through, so the causal recurrence runs at full FMA rate with exactly 4 C Dv FLOPs per token
// (no masked half, no intra-chunk product).
#pragma once

#include <algorithm>
#include <linattn/config.hpp>
#include <type_traits>

/// Bytes per token-block unit of the stream kernel: blocks of 256 / sizeof(T) tokens (64 float,
/// 32 double) measured fastest here; override by defining it before including linattn.
#ifndef LINATTN_STREAM_TOKEN_BLOCK
#define LINATTN_STREAM_TOKEN_BLOCK 256
#endif

namespace linattn::detail {

/// Operands of one streamed block: row-major with leading dimensions (ld*) in elements.
/// For t = 0..tokens-1:  S += k_t v_t^T;  num_t += S^T q_t  (S: C x Dv, num: tokens x Dv).
template <class T>
struct StreamOperands {
  const T* q;
  Eigen::Index ldq;
  const T* k;
  Eigen::Index ldk;
  const T* v;
  Eigen::Index ldv;
  T* s;
  Eigen::Index lds;
  T* num;
  Eigen::Index ldn;
  Eigen::Index tokens;
  Eigen::Index feature_dim;
  Eigen::Index value_dim;
};

/// Tile shape per architecture: R rows of S by WP packets of columns, held in registers. With
/// 16 registers (AVX2) 4 rows of 2 packets: 8 accumulators, the 2 v and 2 output packets and
/// the broadcasts fit, and each output row is loaded and stored half as often as with the 2 x 3
/// tile it had (AVX2 build, C = Dv = 64: 1.11-1.33 -> 0.89-0.91 ms at N = 4,096).
template <class T>
struct StreamShape {
  using Packet = typename Eigen::internal::packet_traits<T>::type;
  static constexpr int kPacket = Eigen::internal::unpacket_traits<Packet>::size;
  static constexpr bool kWide = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32;
  static constexpr int kRows = 4;
  static constexpr int kPackets = kWide ? 4 : 2;
};

/// One R x (WP packets) tile of S, updated and read for every token of the block. The output
/// partial sums of the R rows are added into num (other row tiles add theirs); without
/// Readout the tile is only updated (q and num unused).
template <class T, class Packet, int R, int WP, bool Readout>
void stream_tile(const StreamOperands<T>& a, Eigen::Index row, Eigen::Index col) {
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  constexpr int P = Eigen::internal::unpacket_traits<Packet>::size;
  // Locals, so stores through num cannot force the compiler to reload the operands.
  const Eigen::Index ldq = a.ldq, ldk = a.ldk, ldv = a.ldv, ldn = a.ldn, lds = a.lds;
  const Eigen::Index tokens = a.tokens;
  T* const s = a.s + row * lds + col;
  Packet acc[R][WP];
  LINATTN_UNROLL for (int r = 0; r < R; ++r) {
    LINATTN_UNROLL for (int w = 0; w < WP; ++w) acc[r][w] = ploadu<Packet>(s + r * lds + w * P);
  }
  const T* q = Readout ? a.q + row : nullptr;
  const T* k = a.k + row;
  const T* v = a.v + col;
  T* num = Readout ? a.num + col : nullptr;
  for (Eigen::Index t = 0; t < tokens; ++t) {
    Packet value[WP];
    Packet out[WP];
    LINATTN_UNROLL for (int w = 0; w < WP; ++w) {
      value[w] = ploadu<Packet>(v + w * P);
      if constexpr (Readout) out[w] = ploadu<Packet>(num + w * P);
    }
    LINATTN_UNROLL for (int r = 0; r < R; ++r) {
      const Packet key = pset1<Packet>(k[r]);
      if constexpr (Readout) {  // each row's update, then its share of the output
        const Packet query = pset1<Packet>(q[r]);
        LINATTN_UNROLL for (int w = 0; w < WP; ++w) {
          acc[r][w] = pmadd(key, value[w], acc[r][w]);
          out[w] = pmadd(query, acc[r][w], out[w]);
        }
      } else {
        LINATTN_UNROLL for (int w = 0; w < WP; ++w) acc[r][w] = pmadd(key, value[w], acc[r][w]);
      }
    }
    if constexpr (Readout) {
      LINATTN_UNROLL for (int w = 0; w < WP; ++w) pstoreu<T>(num + w * P, out[w]);
      q += ldq;
      num += ldn;
    }
    k += ldk;
    v += ldv;
  }
  LINATTN_UNROLL for (int r = 0; r < R; ++r) {
    LINATTN_UNROLL for (int w = 0; w < WP; ++w) pstoreu<T>(s + r * lds + w * P, acc[r][w]);
  }
}

/// The one-token case (decoding): WP packets of columns, all rows of S streamed through
/// registers once; two accumulator sets halve the dependency chain of the output.
template <class T, class Packet, int WP>
void token_columns(const StreamOperands<T>& a, Eigen::Index col) {
  using Eigen::internal::padd;
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  constexpr int P = Eigen::internal::unpacket_traits<Packet>::size;
  const Eigen::Index rows = a.feature_dim, lds = a.lds;
  const T* const q = a.q;
  const T* const k = a.k;
  T* s = a.s + col;
  Packet value[WP], even[WP], odd[WP];
  LINATTN_UNROLL for (int w = 0; w < WP; ++w) {
    value[w] = ploadu<Packet>(a.v + col + w * P);
    even[w] = pset1<Packet>(T(0));
    odd[w] = pset1<Packet>(T(0));
  }
  Eigen::Index r = 0;
  for (; r + 1 < rows; r += 2, s += 2 * lds) {
    const Packet key0 = pset1<Packet>(k[r]), key1 = pset1<Packet>(k[r + 1]);
    const Packet query0 = pset1<Packet>(q[r]), query1 = pset1<Packet>(q[r + 1]);
    LINATTN_UNROLL for (int w = 0; w < WP; ++w) {
      const Packet s0 = pmadd(key0, value[w], ploadu<Packet>(s + w * P));
      const Packet s1 = pmadd(key1, value[w], ploadu<Packet>(s + lds + w * P));
      pstoreu<T>(s + w * P, s0);
      pstoreu<T>(s + lds + w * P, s1);
      even[w] = pmadd(query0, s0, even[w]);
      odd[w] = pmadd(query1, s1, odd[w]);
    }
  }
  if (r < rows) {
    const Packet key = pset1<Packet>(k[r]), query = pset1<Packet>(q[r]);
    LINATTN_UNROLL for (int w = 0; w < WP; ++w) {
      const Packet s0 = pmadd(key, value[w], ploadu<Packet>(s + w * P));
      pstoreu<T>(s + w * P, s0);
      even[w] = pmadd(query, s0, even[w]);
    }
  }
  T* const num = a.num + col;
  LINATTN_UNROLL for (int w = 0; w < WP; ++w) {
    pstoreu<T>(num + w * P, padd(padd(even[w], odd[w]), ploadu<Packet>(num + w * P)));
  }
}

/// Calls visit(Packet-tag, WP, col) over the columns: full-width tiles, then narrower packet
/// tiles, then single scalar columns.
template <class T, class Visit>
void for_each_column_tile(Eigen::Index value_dim, Visit&& visit) {
  using Shape = StreamShape<T>;
  using Packet = typename Shape::Packet;
  constexpr Eigen::Index kWidth = Shape::kPackets * Shape::kPacket;
  Eigen::Index col = 0;
  for (; col + kWidth <= value_dim; col += kWidth) {
    visit(Packet{}, std::integral_constant<int, Shape::kPackets>{}, col);
  }
  const Eigen::Index packets = (value_dim - col) / Shape::kPacket;
  if constexpr (Shape::kPackets > 3) {
    if (packets == 3) visit(Packet{}, std::integral_constant<int, 3>{}, col);
  }
  if (packets == 2) visit(Packet{}, std::integral_constant<int, 2>{}, col);
  if (packets == 1) visit(Packet{}, std::integral_constant<int, 1>{}, col);
  col += packets * Shape::kPacket;
  // Fewer than kPacket columns are left: an int count bounds the loop, so GCC's loop analysis
  // sees no path with ~2^63 iterations (its -Waggressive-loop-optimizations false positive).
  const int scalars = static_cast<int>(value_dim - col);
  for (int i = 0; i < scalars; ++i) visit(T{}, std::integral_constant<int, 1>{}, col + i);
}

/// All columns of R rows of S.
template <class T, int R, bool Readout>
void stream_rows(const StreamOperands<T>& a, Eigen::Index row) {
  for_each_column_tile<T>(a.value_dim, [&](auto packet, auto packets, Eigen::Index col) {
    stream_tile<T, decltype(packet), R, decltype(packets)::value, Readout>(a, row, col);
  });
}

/// stream_product's work, with or without the readout.
template <class T, bool Readout>
void stream_blocks(const StreamOperands<T>& a) {
  if constexpr (Readout) {
    if (a.tokens == 1) {
      stream_one_token(a);
      return;
    }
  }
  // Token blocks small enough that a block's v and num rows stay in L1 across the row tiles.
  constexpr Eigen::Index kTokenBlock = LINATTN_STREAM_TOKEN_BLOCK / sizeof(T);
  if (a.tokens > kTokenBlock) {
    StreamOperands<T> block = a;
    for (Eigen::Index t = 0; t < a.tokens; t += kTokenBlock) {
      if constexpr (Readout) {
        block.q = a.q + t * a.ldq;
        block.num = a.num + t * a.ldn;
      }
      block.k = a.k + t * a.ldk;
      block.v = a.v + t * a.ldv;
      block.tokens = std::min(kTokenBlock, a.tokens - t);
      stream_blocks<T, Readout>(block);
    }
    return;
  }
  constexpr int kRows = StreamShape<T>::kRows;
  for (Eigen::Index row = 0; row < a.feature_dim; row += kRows) {
    switch (std::min<Eigen::Index>(kRows, a.feature_dim - row)) {
      case 1:
        stream_rows<T, 1, Readout>(a, row);
        break;
      case 2:
        stream_rows<T, 2, Readout>(a, row);
        break;
      case 3:
        if constexpr (kRows >= 3) stream_rows<T, 3, Readout>(a, row);
        break;
      default:
        if constexpr (kRows >= 4) stream_rows<T, 4, Readout>(a, row);
        break;
    }
  }
}

/// stream_product's one-token case (a.tokens == 1, q and num given), kept inline (out of the
/// compiled mode) so that a decoding step calls no library function (through stream_product a
/// C = 64 step measured 5-8% slower).
template <class T>
inline void stream_one_token(const StreamOperands<T>& a) {
  for_each_column_tile<T>(a.value_dim, [&](auto packet, auto packets, Eigen::Index col) {
    token_columns<T, decltype(packet), decltype(packets)::value>(a, col);
  });
}

/// num (tokens x Dv) += the causal streamed product; S is left after the last token. With q
/// and num null, S alone is updated (the sums of a segment, no outputs).
template <class T>
void stream_product(const StreamOperands<T>& a) {
  if (a.q == nullptr) {
    stream_blocks<T, false>(a);
  } else {
    stream_blocks<T, true>(a);
  }
}

/// Operands of one streamed block of the backward: row-major with leading dimensions (ld*) in
/// elements, which may be negative (the reversed pass walks its rows from the last one).
/// For t = 0..tokens-1:  X += f_t a_t b_t^T;  vert_t += X^T c_t (unless c is null);
/// horiz_t += X d_t (X: C x Dv, vert: tokens x Dv, horiz: tokens x C, f_t a factor per token,
/// ldf = 0 for one factor). Both readouts see X after token t.
template <class T>
struct GradientOperands {
  const T* a;
  Eigen::Index lda;
  const T* f;
  Eigen::Index ldf;
  const T* b;
  Eigen::Index ldb;
  const T* c;
  Eigen::Index ldc;
  const T* d;
  Eigen::Index ldd;
  T* x;
  Eigen::Index ldx;
  T* vert;
  Eigen::Index ldvert;
  T* horiz;
  Eigen::Index ldhoriz;
  Eigen::Index tokens;
  Eigen::Index feature_dim;
  Eigen::Index value_dim;
};

/// horiz[r] += the sum of the entries of sums[r], for r < R: four rows of floats at once on
/// AVX-512 and AVX (a transposing reduction of about a third of the instructions of four).
template <class T, class Packet, int R>
EIGEN_ALWAYS_INLINE void add_row_sums(const Packet (&sums)[R], T* horiz) {
  // Packets are compared by size: std::is_same on the vector types drops their attributes.
  constexpr int kSize = Eigen::internal::unpacket_traits<Packet>::size;
  static_cast<void>(kSize);
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (R == 4 && std::is_same_v<T, float> && kSize == 16) {
    const __m512 t0 =
        _mm512_add_ps(_mm512_unpacklo_ps(sums[0], sums[1]), _mm512_unpackhi_ps(sums[0], sums[1]));
    const __m512 t1 =
        _mm512_add_ps(_mm512_unpacklo_ps(sums[2], sums[3]), _mm512_unpackhi_ps(sums[2], sums[3]));
    // Each 128-bit lane: partial sums of rows 0, 1, 2, 3.
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 v =
        _mm256_add_ps(_mm512_castps512_ps256(u),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    const __m128 w = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    _mm_storeu_ps(horiz, _mm_add_ps(_mm_loadu_ps(horiz), w));
    return;
  }
#endif
#if defined(EIGEN_VECTORIZE_AVX)
  if constexpr (R == 4 && std::is_same_v<T, float> && kSize == 8) {
    const __m256 u =
        _mm256_hadd_ps(_mm256_hadd_ps(sums[0], sums[1]), _mm256_hadd_ps(sums[2], sums[3]));
    const __m128 w = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    _mm_storeu_ps(horiz, _mm_add_ps(_mm_loadu_ps(horiz), w));
    return;
  }
#endif
  LINATTN_UNROLL for (int r = 0; r < R; ++r) horiz[r] += Eigen::internal::predux(sums[r]);
}

/// One R x (WP packets) tile of X for every token of the block: the update and the column
/// readout as in stream_tile, and the row readout, whose sums over the tile's columns are
/// reduced across each packet (the only reduction the backward needs).
template <class T, class Packet, int R, int WP, bool Vert>
void gradient_tile(const GradientOperands<T>& o, Eigen::Index row, Eigen::Index col) {
  using Eigen::internal::ploadu;
  using Eigen::internal::pmadd;
  using Eigen::internal::pmul;
  using Eigen::internal::predux;
  using Eigen::internal::pset1;
  using Eigen::internal::pstoreu;
  constexpr int P = Eigen::internal::unpacket_traits<Packet>::size;
  const Eigen::Index lda = o.lda, ldb = o.ldb, ldc = o.ldc, ldd = o.ldd;
  const Eigen::Index ldvert = o.ldvert, ldhoriz = o.ldhoriz, ldx = o.ldx;
  const Eigen::Index tokens = o.tokens;
  T* const x = o.x + row * ldx + col;
  Packet acc[R][WP];
  LINATTN_UNROLL for (int r = 0; r < R; ++r) {
    LINATTN_UNROLL for (int w = 0; w < WP; ++w) acc[r][w] = ploadu<Packet>(x + r * ldx + w * P);
  }
  const T* a = o.a + row;
  const T* f = o.f;
  const Eigen::Index ldf = o.ldf;
  const T* b = o.b + col;
  const T* c = Vert ? o.c + row : nullptr;
  const T* d = o.d + col;
  T* vert = Vert ? o.vert + col : nullptr;
  T* horiz = o.horiz + row;
  for (Eigen::Index t = 0; t < tokens; ++t) {
    Packet value[WP];
    Packet grad[WP];
    Packet out[WP];
    Packet sums[R];
    LINATTN_UNROLL for (int w = 0; w < WP; ++w) {
      value[w] = ploadu<Packet>(b + w * P);
      grad[w] = ploadu<Packet>(d + w * P);
      if constexpr (Vert) out[w] = ploadu<Packet>(vert + w * P);
    }
    const T factor = *f;
    LINATTN_UNROLL for (int r = 0; r < R; ++r) {
      const Packet key = pset1<Packet>(a[r] * factor);
      LINATTN_UNROLL for (int w = 0; w < WP; ++w) acc[r][w] = pmadd(key, value[w], acc[r][w]);
      if constexpr (Vert) {
        const Packet query = pset1<Packet>(c[r]);
        LINATTN_UNROLL for (int w = 0; w < WP; ++w) out[w] = pmadd(query, acc[r][w], out[w]);
      }
      sums[r] = pmul(acc[r][0], grad[0]);
      for (int w = 1; w < WP; ++w) sums[r] = pmadd(acc[r][w], grad[w], sums[r]);
    }
    add_row_sums<T, Packet, R>(sums, horiz);
    if constexpr (Vert) {
      LINATTN_UNROLL for (int w = 0; w < WP; ++w) pstoreu<T>(vert + w * P, out[w]);
      c += ldc;
      vert += ldvert;
    }
    a += lda;
    f += ldf;
    b += ldb;
    d += ldd;
    horiz += ldhoriz;
  }
  LINATTN_UNROLL for (int r = 0; r < R; ++r) {
    LINATTN_UNROLL for (int w = 0; w < WP; ++w) pstoreu<T>(x + r * ldx + w * P, acc[r][w]);
  }
}

/// All columns of R rows of X.
template <class T, int R, bool Vert>
void gradient_rows(const GradientOperands<T>& o, Eigen::Index row) {
  for_each_column_tile<T>(o.value_dim, [&](auto packet, auto packets, Eigen::Index col) {
    gradient_tile<T, decltype(packet), R, decltype(packets)::value, Vert>(o, row, col);
  });
}

/// vert += and horiz += the streamed readouts of the block (see GradientOperands); X is left
/// after the last token.
template <class T>
void gradient_product(const GradientOperands<T>& o) {
  // Three full rows a token (b, d and vert) against the forward's two: half its token block.
  constexpr Eigen::Index kTokenBlock = LINATTN_STREAM_TOKEN_BLOCK / (2 * sizeof(T));
  if (o.tokens > kTokenBlock) {
    GradientOperands<T> block = o;
    for (Eigen::Index t = 0; t < o.tokens; t += kTokenBlock) {
      block.a = o.a + t * o.lda;
      block.f = o.f + t * o.ldf;
      block.b = o.b + t * o.ldb;
      block.c = o.c == nullptr ? nullptr : o.c + t * o.ldc;
      block.d = o.d + t * o.ldd;
      block.vert = o.vert == nullptr ? nullptr : o.vert + t * o.ldvert;
      block.horiz = o.horiz + t * o.ldhoriz;
      block.tokens = std::min(kTokenBlock, o.tokens - t);
      gradient_product(block);
    }
    return;
  }
  constexpr int kRows = StreamShape<T>::kRows;
  auto rows = [&](auto vert) {
    constexpr bool V = decltype(vert)::value;
    for (Eigen::Index row = 0; row < o.feature_dim; row += kRows) {
      switch (std::min<Eigen::Index>(kRows, o.feature_dim - row)) {
        case 1:
          gradient_rows<T, 1, V>(o, row);
          break;
        case 2:
          gradient_rows<T, 2, V>(o, row);
          break;
        case 3:
          if constexpr (kRows >= 3) gradient_rows<T, 3, V>(o, row);
          break;
        default:
          if constexpr (kRows >= 4) gradient_rows<T, 4, V>(o, row);
          break;
      }
    }
  };
  if (o.c != nullptr) {
    rows(std::true_type{});
  } else {
    rows(std::false_type{});
  }
}

/// One token of the denominator: z += k; returns q . z (q, k, z: C). Inline, so that a step
/// (one token, a few dozen cycles) pays no call into the compiled library for it.
template <class T>
EIGEN_ALWAYS_INLINE T token_denominator(const T* q, const T* k, Eigen::Index feature_dim, T* z) {
  using namespace Eigen::internal;
  using Packet = typename StreamShape<T>::Packet;
  constexpr Eigen::Index P = StreamShape<T>::kPacket;
  Packet acc = pset1<Packet>(T(0));
  Eigen::Index c = 0;
  for (; c + P <= feature_dim; c += P) {
    const Packet zc = padd(ploadu<Packet>(z + c), ploadu<Packet>(k + c));
    pstoreu<T>(z + c, zc);
    acc = pmadd(ploadu<Packet>(q + c), zc, acc);
  }
  T sum = predux(acc);
  // Fewer than P features are left: an int count, as in for_each_column_tile.
  const int tail = static_cast<int>(feature_dim - c);
  for (int i = 0; i < tail; ++i) {
    z[c + i] += k[c + i];
    sum += q[c + i] * z[c + i];
  }
  return sum;
}

/// For t = 0..tokens-1: z += k_t; den_t = q_t . z. q, k: tokens x C (leading dims ldq, ldk).
template <class T>
void stream_denominator(const T* q, Eigen::Index ldq, const T* k, Eigen::Index ldk,
                        Eigen::Index tokens, Eigen::Index feature_dim, T* z, T* den) {
  for (Eigen::Index t = 0; t < tokens; ++t, q += ldq, k += ldk) {
    den[t] = token_denominator(q, k, feature_dim, z);
  }
}

}  // namespace linattn::detail

/// The compiled mode's instances of the stream kernels, one accumulation type T each; `prefix`
/// is `extern template` (every TU that defines LINATTN_COMPILED) or `template` (the library).
#define LINATTN_STREAM_INSTANCES(prefix, T)                                                      \
  prefix void linattn::detail::stream_product<T>(const linattn::detail::StreamOperands<T>&);     \
  prefix void linattn::detail::gradient_product<T>(const linattn::detail::GradientOperands<T>&); \
  prefix void linattn::detail::stream_denominator<T>(                                            \
      const T*, Eigen::Index, const T*, Eigen::Index, Eigen::Index, Eigen::Index, T*, T*);

#ifdef LINATTN_COMPILED
#define LINATTN_DECLARE_STREAM_KERNELS(T) LINATTN_STREAM_INSTANCES(extern template, T)
LINATTN_DECLARE_STREAM_KERNELS(float)
LINATTN_DECLARE_STREAM_KERNELS(double)
#undef LINATTN_DECLARE_STREAM_KERNELS
#endif
