// Element helpers shared by the elementwise kernels: bf16 <-> fp32 as torch rounds them
// (round to nearest even, NaN kept quiet), written as plain integer code that the compiler
// vectorizes for each instruction set a kernel is cloned for (TOKENMILL_CLONES).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

// A function compiled for AVX-512, AVX2 and plain x86-64, the best one chosen when the
// library loads (GCC's function multi-versioning).
#define TOKENMILL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

namespace tokenmill {

inline float to_float(at::BFloat16 h) {
  uint32_t bits = uint32_t(h.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float to_float(float f) { return f; }

inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// fp32 -> the element type (bf16 rounded as torch rounds it).
template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) {
  return f;
}
template <>
inline at::BFloat16 from_float<at::BFloat16>(float f) {
  return at::BFloat16(bf16_bits(f), at::BFloat16::from_bits());
}

// A value rounded to the element type and back (torch's elementwise ops on bf16 round each
// result).
template <typename T>
inline float round_to(float f) {
  return to_float(from_float<T>(f));
}

}  // namespace tokenmill
