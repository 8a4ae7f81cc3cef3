// SPDX-License-Identifier: MIT
// The byte layout fuzz_kernels decodes, shared with make_corpus (which writes seeds in it).
//
//   byte 0  flags: bit 0 double (else float); bits 1-3 map (see MapKind); bit 4 normalize off;
//           bit 5 check_finite off; bit 6 specials (NaN/+-Inf among the values);
//           bit 7 softmax causal off
//   byte 1  N - 1 (mod 64)
//   byte 2  Dk - 1 (low nibble), Dv - 1 (high nibble)
//   byte 3  m - 1 (low nibble; random-feature count), seed (high nibble)
//   byte 4  Options::eps     index into kEps     (mod size)
//   byte 5  Options::decay   index into kDecay   (mod size)
//   byte 6  Options::chunk   index into kChunk   (mod size)
//   byte 7  softmax scale index into kScale (low nibble; also the backward's Options::scale),
//           window index into kWindow (high nibble)
//   byte 8  split point: tokens prefilled before stepping (mod N + 1)
//   byte 9  value magnitude index into kMagnitude (mod size); temperature (high nibble, kTemp)
//   then    q (N x Dk), k (N x Dk), v (N x Dv) and the backward's grad_out (N x Dv),
//           row-major, two bytes (int16 LE) per value,
//           scaled by kMagnitude / 32768; past the end of the input a xorshift stream seeded
//           from the header continues. With the specials flag, int16 values 32767, -32768 and
//           -32767 stand for +Inf, NaN and -Inf.
// Every table starts with valid entries; invalid ones (which must throw linattn::Error) follow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

namespace linattn_fuzz {

constexpr std::size_t kHeaderBytes = 10;

enum Flag : std::uint8_t {
  kFlagDouble = 1u << 0,
  kFlagNoNormalize = 1u << 4,
  kFlagNoCheckFinite = 1u << 5,
  kFlagSpecials = 1u << 6,
  kFlagNonCausalSoftmax = 1u << 7,
};
constexpr int kMapShift = 1;
constexpr std::uint8_t kMapMask = 0x7u << kMapShift;

/// Which feature map byte 0 selects.
enum class MapKind : std::uint8_t {
  elu_plus_one = 0,
  relu = 1,
  favor = 2,             // PositiveRandomFeatures, orthogonal, chi norms
  favor_hyperbolic = 3,  // PositiveRandomFeatures, hyperbolic
  favor_iid_fixed = 4,   // PositiveRandomFeatures, iid projection, fixed row norms
  fourier = 5,           // RandomFourierFeatures
  raw = 6,               // q and k passed as features directly (signed)
  fourier_iid = 7,       // RandomFourierFeatures, iid projection
};

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

constexpr double kEps[] = {1e-6, 0.0, 1e-3, 1.0, 1e-12, 1e-30, 1e-300, -1e-6, kNaN, kInf};
constexpr int kValidEps = 7;
constexpr double kDecay[] = {1.0, 0.99, 0.9, 0.5, 0.1, 1e-3, 1e-30, 0.0, 1.5, -0.5, kNaN, kInf};
constexpr int kValidDecay = 7;
constexpr long long kChunk[] = {64, 1, 2, 3, 5, 16, 63, 1000, 0, -1, -64};
constexpr int kValidChunk = 8;
constexpr double kScale[] = {-1.0, 0.0, 0.125, 1.0, 4.0, kNaN, kInf};
constexpr int kValidScale = 5;
constexpr long long kWindow[] = {1, 2, 3, 5, 16, 64, 100, 0, -1};
constexpr int kValidWindow = 7;
/// Largest |value|; the entries up to kBoundedMagnitudes keep every |input| <= 10.
constexpr double kMagnitude[] = {10.0, 1.0, 0.01, 100.0, 1e4, 1e30, 1e300};
constexpr int kBoundedMagnitudes = 3;
constexpr double kTemperature[] = {-1.0, 0.25, 1.0, 2.0, 0.0, kNaN};
constexpr int kValidTemperature = 4;

template <class T, std::size_t n>
constexpr std::size_t size_of(const T (&)[n]) {
  return n;
}

}  // namespace linattn_fuzz
