// Helpers shared by the kernels: builds of one loop for each instruction set
// (TOKENMILL_ISA_VARIANTS), and bf16 <-> fp32 as torch rounds them (round to nearest even, NaN
// kept quiet), written as plain integer code that the compiler vectorizes for each build.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>
#include <algorithm>
#include <cstring>

#include "ops.h"

// `name(params)` compiled three times from `name##_impl` (an always-inline function): for
// AVX-512, for AVX2 with FMA and for plain x86-64, the build run chosen by cpu_isa() at each
// call (which tests cap to run the lower builds on any machine).
#define TOKENMILL_ISA_VARIANTS(name, params, args)                                        \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma"))) void name##_avx512 params { \
    name##_impl args;                                                                      \
  }                                                                                        \
  TOKENMILL_ISA_PORTABLE_VARIANTS(name, params, args)

// The same where `name##_avx512` is written by hand (with simd.h): only the AVX2 and plain
// builds come from `name##_impl`.
#define TOKENMILL_ISA_PORTABLE_VARIANTS(name, params, args)                         \
  __attribute__((target("avx2,fma"))) void name##_avx2 params { name##_impl args; } \
  void name##_base params { name##_impl args; }                                     \
  void name params {                                                                \
    const int64_t isa = cpu_isa();                                                  \
    if (isa >= 1) {                                                                 \
      name##_avx512 args;                                                           \
    } else if (isa >= 0) {                                                          \
      name##_avx2 args;                                                             \
    } else {                                                                        \
      name##_base args;                                                             \
    }                                                                               \
  }

#define TOKENMILL_INLINE __attribute__((always_inline)) inline

namespace tokenmill {

TOKENMILL_INLINE float to_float(at::BFloat16 h) {
  uint32_t bits = uint32_t(h.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

TOKENMILL_INLINE float to_float(float f) { return f; }

// An fp8 (e4m3) KV cache's element: exact in fp32.
TOKENMILL_INLINE float to_float(at::Float8_e4m3fn v) { return static_cast<float>(v); }

TOKENMILL_INLINE uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// fp32 -> the element type (bf16 rounded as torch rounds it).
template <typename T>
TOKENMILL_INLINE T from_float(float f);
template <>
TOKENMILL_INLINE float from_float<float>(float f) {
  return f;
}
template <>
TOKENMILL_INLINE at::BFloat16 from_float<at::BFloat16>(float f) {
  return at::BFloat16(bf16_bits(f), at::BFloat16::from_bits());
}
// fp8 e4m3 saturates at its largest finite value, 448 (c10's conversion would give NaN past
// it), rounding to nearest even below: `x.clamp(-448, 448).to(torch.float8_e4m3fn)`.
constexpr float kFp8Max = 448.f;
template <>
TOKENMILL_INLINE at::Float8_e4m3fn from_float<at::Float8_e4m3fn>(float f) {
  return at::Float8_e4m3fn(std::min(kFp8Max, std::max(-kFp8Max, f)));
}

// A value rounded to the element type and back (torch's elementwise ops on bf16 round each
// result).
template <typename T>
TOKENMILL_INLINE float round_to(float f) {
  return to_float(from_float<T>(f));
}

// exp(x) as avx512::exp computes it, written so that the compiler vectorizes it for each
// build: x = n ln2 + r, a polynomial in r, 2^n put into the exponent bits.
TOKENMILL_INLINE float exp_poly(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}

}  // namespace tokenmill
