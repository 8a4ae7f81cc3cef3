// SPDX-License-Identifier: MIT
// Conversions between the 16-bit input types and float, many at a time, and a scan of 16-bit
// memory for NaN and Inf.
#pragma once

#include <cstdint>
#include <cstring>
#include <linattn/config.hpp>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace linattn::detail {

/// dst[i] = To(src[i]) for i < n (static_cast): the general case, e.g. double to half.
template <class From, class To>
void convert(const From* src, To* dst, Eigen::Index n) {
  for (Eigen::Index i = 0; i < n; ++i) dst[i] = static_cast<To>(src[i]);
}

// The four conversions the 16-bit kernels run on every chunk, with the same values as
// static_cast. Eigen 3.4 converts element by element through a portable routine with branches
// (it never uses F16C under GCC: its test for it requires clang), which costs more than the
// attention kernel itself; these loops are branch-free, so the compiler vectorises them, and
// use F16C where the target has it.

/// The float with the bits of half `h`, exactly, without branches.
inline float half_bits_to_float(std::uint32_t h) {
  const std::uint32_t magnitude = h & 0x7FFFu;
  // Normal numbers: move exponent and mantissa into place and rebias (15 -> 127); Inf and NaN
  // (all-ones exponent) get the rest of the float's all-ones exponent.
  // Masks rather than ?:, which GCC does not vectorise here.
  std::uint32_t bits = (magnitude << 13) + 0x38000000u;
  bits += 0x38000000u & (0u - static_cast<std::uint32_t>(magnitude >= 0x7C00u));
  // Zero and subnormals: magnitude * 2^-24, exact in float (converted from a signed integer,
  // which x86 does in one instruction).
  const float subnormal =
      static_cast<float>(static_cast<std::int32_t>(magnitude)) * 5.9604644775390625e-8f;
  std::uint32_t subnormal_bits;
  std::memcpy(&subnormal_bits, &subnormal, sizeof(subnormal_bits));
  const std::uint32_t tiny = 0u - static_cast<std::uint32_t>(magnitude < 0x0400u);
  bits = (subnormal_bits & tiny) | (bits & ~tiny);
  bits |= (h & 0x8000u) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

/// half to float, exactly: 8 at a time with F16C, else branch-free bit arithmetic.
inline void convert(const Eigen::half* src, float* dst, Eigen::Index n) {
  Eigen::Index i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(bits));
  }
#endif
  for (; i < n; ++i) dst[i] = half_bits_to_float(Eigen::numext::bit_cast<std::uint16_t>(src[i]));
}

/// float to half, rounding to nearest even: 8 at a time with F16C, else Eigen's conversion.
inline void convert(const float* src, Eigen::half* dst, Eigen::Index n) {
  Eigen::Index i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bits);
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<Eigen::half>(src[i]);
}

/// bfloat16 to float, exactly: the 16 bits are the float's top half.
inline void convert(const Eigen::bfloat16* src, float* dst, Eigen::Index n) {
  for (Eigen::Index i = 0; i < n; ++i) {
    const std::uint32_t bits =
        static_cast<std::uint32_t>(Eigen::numext::bit_cast<std::uint16_t>(src[i])) << 16;
    std::memcpy(dst + i, &bits, sizeof(bits));
  }
}

/// float to bfloat16, rounding to nearest even as Eigen does (NaN to a quiet NaN of the same
/// sign). Not Eigen's AVX-512 packet conversion: VCVTNEPS2BF16 flushes subnormals to zero.
inline void convert(const float* src, Eigen::bfloat16* dst, Eigen::Index n) {
  for (Eigen::Index i = 0; i < n; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, src + i, sizeof(bits));
    const std::uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const std::uint32_t nan = 0x7FC0u | ((bits >> 16) & 0x8000u);
    const std::uint32_t out = (bits & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
    dst[i] = Eigen::numext::bit_cast<Eigen::bfloat16>(static_cast<std::uint16_t>(out));
  }
}

/// The exponent field of a 16-bit float type: all ones exactly for Inf and NaN.
template <class Scalar>
constexpr std::uint16_t kExponentBits = std::is_same_v<Scalar, Eigen::half> ? 0x7C00 : 0x7F80;

/// True if any of the n 16-bit floats at p is NaN or +-Inf. Four at a time in a 64-bit word
/// (a lane of (w & E) ^ E is zero exactly where the exponent is all ones), which is fast at
/// any optimisation level and vectorises further where the compiler can.
template <class Scalar>
bool has_nonfinite_bits(const Scalar* p, Eigen::Index n) {
  static_assert(sizeof(Scalar) == 2, "16-bit floats only");
  constexpr std::uint16_t exponent = kExponentBits<Scalar>;
  constexpr std::uint64_t ones = 0x0001000100010001ULL;
  constexpr std::uint64_t exponents = ones * exponent;
  std::uint64_t hits = 0;
  Eigen::Index i = 0;
  for (; i + 4 <= n; i += 4) {
    std::uint64_t word;
    std::memcpy(&word, p + i, sizeof(word));
    const std::uint64_t lanes = (word & exponents) ^ exponents;
    hits |= (lanes - ones) & ~lanes & (ones << 15);  // nonzero iff some lane is zero
  }
  for (; i < n; ++i) {
    hits |= (Eigen::numext::bit_cast<std::uint16_t>(p[i]) & exponent) == exponent;
  }
  return hits != 0;
}

}  // namespace linattn::detail
