// AVX-512 helpers for the kernels' hand-written AVX-512 builds: 16 floats loaded from fp32 or
// bf16 (optionally masked, for a row's tail), stored back rounded as torch rounds (vec.h's
// bf16_bits, 16 at a time), and exp of 16 floats. Every helper inlines into a function
// compiled with TOKENMILL_AVX512_TARGET.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#define TOKENMILL_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define TOKENMILL_AVX512_INLINE TOKENMILL_AVX512_TARGET __attribute__((always_inline)) inline

namespace tokenmill {
namespace avx512 {

// The lanes [0, n) of a vector (n <= 16).
TOKENMILL_AVX512_INLINE __mmask16 first(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

TOKENMILL_AVX512_INLINE __m512 load(const float* p) { return _mm512_loadu_ps(p); }
TOKENMILL_AVX512_INLINE __m512 load(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
TOKENMILL_AVX512_INLINE __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
TOKENMILL_AVX512_INLINE __m512 load(const at::BFloat16* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
TOKENMILL_AVX512_INLINE __m512 load(const at::BFloat16* p, __mmask16 m) {
  return widen(_mm256_maskz_loadu_epi16(m, p));
}
// 16 fp8 (e4m3) values, exactly: a value's exponent and mantissa bits moved into an fp16's
// (bias 15 against 7) stand for it times 2^-8, subnormals included, so the fp16 widened to
// fp32 and times 256 is the value.
TOKENMILL_AVX512_INLINE __m512 load(const at::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(magnitude, sign)), _mm512_set1_ps(256.f));
}

// The bf16 bits of 16 floats in the low halves of 32-bit lanes: round to nearest even, a NaN
// kept quiet (as bf16_bits).
TOKENMILL_AVX512_INLINE __m512i bf16_lanes(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i high = _mm512_srli_epi32(u, 16);
  const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
}

// The same by the CPU's own conversion, for CPUs with AVX512-BF16 only (callers check
// cpu_isa() >= 2): one instruction, written as assembly so that it inlines into any AVX-512
// build. It flushes inputs below 2^-126 to zero.
TOKENMILL_AVX512_INLINE __m256i bf16_native(__m512 v) {
  __m256i h;
  asm("vcvtneps2bf16 %1, %0" : "=v"(h) : "v"(v));
  return h;
}

// v rounded to the element type and back (torch's bf16 ops round every result).
template <typename T>
TOKENMILL_AVX512_INLINE __m512 round_to(__m512 v);
template <>
TOKENMILL_AVX512_INLINE __m512 round_to<float>(__m512 v) {
  return v;
}
template <>
TOKENMILL_AVX512_INLINE __m512 round_to<at::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_lanes(v), 16));
}

// The same and the stores below, by the CPU's bf16 conversion where `native` (cpu_isa() >= 2).
template <typename T>
TOKENMILL_AVX512_INLINE __m512 round_to(__m512 v, bool native) {
  if constexpr (std::is_same<T, at::BFloat16>::value) {
    if (native) return widen(bf16_native(v));
  }
  return round_to<T>(v);
}

TOKENMILL_AVX512_INLINE void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
TOKENMILL_AVX512_INLINE void store(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}
TOKENMILL_AVX512_INLINE void store(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_lanes(v)));
}
TOKENMILL_AVX512_INLINE void store(at::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_lanes(v)));
}
TOKENMILL_AVX512_INLINE void store(float* p, __m512 v, __mmask16 m, bool) {
  _mm512_mask_storeu_ps(p, m, v);
}
TOKENMILL_AVX512_INLINE void store(at::BFloat16* p, __m512 v, __mmask16 m, bool native) {
  if (native) {
    _mm256_mask_storeu_epi16(p, m, bf16_native(v));
  } else {
    store(p, v, m);
  }
}

// exp of 16 floats: exp(x) = 2^n exp(r), x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes'
// degree-6 polynomial (within 2 units in the last place of expf); under -87.3 the result is
// exp(-87.3), above 88.7 infinity.
TOKENMILL_AVX512_INLINE __m512 exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// silu(g) * up as silu_and_mul computes it, before the store's rounding: silu(g) = g / (1 +
// exp(-g)) rounded to T, 1 / (1 + exp(-g)) a reciprocal estimate refined by one Newton step
// (within 2 fp32 places of the division); exp(-g) capped at exp(88) (g below -88: a result
// within 1e-36 of zero, as the division's) so that the denominator stays finite.
template <typename T>
TOKENMILL_AVX512_INLINE __m512 silu_times(__m512 g, __m512 up, bool native) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 neg = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(88.f));
  const __m512 den = _mm512_add_ps(one, exp(neg));
  __m512 inv = _mm512_rcp14_ps(den);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(round_to<T>(_mm512_mul_ps(g, inv), native), up);
}

}  // namespace avx512
}  // namespace tokenmill
