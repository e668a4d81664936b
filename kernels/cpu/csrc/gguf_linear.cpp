// gguf_linear: y = x @ W^T (+ bias) for a weight kept in a GGUF block format (Q4_0, Q4_1,
// Q8_0: 32 weights of a row share an fp16 scale d, and Q4_1 an fp16 minimum m), re-laid out
// once at load (kernels/cpu/gguf.py) into groups of 16 output columns:
//   qs: per block of 32 k, per pair of k (2p, 2p + 1) a vector of 32 values, lane j = column
//       j / 2 at k 2p + j % 2 (the pairs of k side by side, as AVX512-BF16 dot products read
//       them). Q8: [N / 16, K / 32, 16, 32] bytes, pair p's int8 values in row p. Q4:
//       [N / 16, K / 32, 4, 64] bytes, row c 32 16-bit words whose bits 4e to 4e + 3 hold
//       lane j of pair 4c + e: a shift and a mask take any pair out of the row, no shuffles;
//   d, m: [N / 16, K / 32, 16] fp16, per column of the group.
// A weight is w = d * (q - 8) (Q4_0), d * q + m (Q4_1), d * q (Q8_0), as GGUF defines it.
// Q4_Z is no GGML type but the int4 checkpoints' (AWQ, GPTQ): Q4_1's layout with m holding an
// integer zero point z per block (exact in fp16), w = d * (q - z). Q4_F neither: Q4_1 with d
// and m in fp32 (GGUF's Q4_K, whose per-32 scale and minimum, fp16 times a 6-bit integer, are
// exact in fp32 only). Q8_F and Q8_S are Q8_0's bytes with fp32 fields: Q8_F w = d * q + m
// (GGUF's Q5_K), Q8_S w = d * q for k 0-15 of a block and e * q for k 16-31, e in m's place
// (GGUF's Q6_K, a scale per 16 weights).
//
// Few rows (decodes) on AVX512-BF16: each block's values become exact bf16 integers in
// registers and meet the activations in dot products with fp32 sums; a block's 16 column
// sums are then scaled by d (and Q4_1 adds m times the block's sum of x): the 16 columns are
// the 16 lanes, so no horizontal sums. A 4-bit q becomes the bf16 128 + q by one bitwise op
// (0x4300 | q: 128's exponent, q in the mantissa's last bits; no shuffles), and 128 times
// the block's sum of x comes off its sums; an 8-bit one is converted. The weight streams
// once at ~0.6 (Q4) or ~1.1 (Q8) bytes a weight instead of bf16's 2.
// Up to 64 rows on a CPU without AMX the same loop runs too, a group of 16
// columns per task and its rows 12 at a time while the group's blocks stay in cache.
// Many rows (prefills), or a CPU without AVX512-BF16: a block of 64 columns is de-quantized
// into the layout `linear`'s microkernel reads (the weights' values rounded to x's dtype, as
// de-quantizing the checkpoint would give them) and multiplied there, for every row.
// These paths sum a row's products in different orders (and the loop's partial sums depend
// on its row count): in the batch-invariant mode (batch_invariant.h) every row count on
// AVX512-BF16 takes the loop with one fixed set of partial sums (gemv_invariant).
// gguf_rows, beside it for the layout's helpers, reads rows of such a weight back as fp32 (a
// tied embedding's lookup in its LM head's blocks).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "batch_invariant.h"
#include "ops.h"
#include "simd.h"
#include "vec.h"

namespace tokenmill {
namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGML's type ids
constexpr int64_t kQ4_Z = 1000, kQ4_F = 1001;     // tokenmill's (kernels/cpu/gguf.py)
constexpr int64_t kQ8_F = 1002, kQ8_S = 1003;
constexpr int64_t kGroup = 16;                    // output columns per group
constexpr int64_t kBlockK = 32;                   // weights per scale
constexpr int64_t kColumnBlock = 64;              // columns per task on the many-row path
constexpr int64_t kRowBlock = 256;                // rows per microkernel call there
constexpr int64_t kFewRows = 4;                   // rows up to which the dot-product loop runs
// Rows up to which the dot-product loop runs without AMX over a group's cached blocks
// (measured with 8 rows at a time on an AVX512-BF16 EPYC, 120 SmolLM2-shaped weights a pass,
// the loop against de-quantizing for the microkernel: Q4_1 at 16 rows 12.1 against 18.7 ms,
// 24 rows 17.5 against 30.6, 40 rows 29.2 against 38.7, 48 rows 33.5 against 33.7, 56 rows
// 38.9 against 47.6, 64 rows 44.3 against 41.5; Q8_0 at 40 rows 26.7 against 35.4, 64 rows
// 40.9 against 41.8; 12 rows at a time, 64 rows now take 41.1 and 38.2).
// With AMX the bf16 tiles multiply a de-quantized block faster from kFewRows + 1 rows on
// (measured before the loop took its 4-bit values without table lookups).
constexpr int64_t kDotRows = 64;
constexpr int64_t kPrefetchBlocks = 8;            // how far ahead that loop prefetches

// A byte per weight (else two 4-bit weights per byte).
bool eight_bit(int64_t qtype) { return qtype == kQ8_0 || qtype == kQ8_F || qtype == kQ8_S; }
// d and m in fp32 (else fp16).
bool fp32_fields(int64_t qtype) { return qtype == kQ4_F || qtype == kQ8_F || qtype == kQ8_S; }
// w = d * q + m (a minimum added per block).
bool adds_minimum(int64_t qtype) { return qtype == kQ4_1 || qtype == kQ4_F || qtype == kQ8_F; }
// Whether a block's sum of x takes part in its products (a minimum, a zero point, or 4-bit
// values' offset meets it).
bool takes_xsum(int64_t qtype) { return !eight_bit(qtype) || adds_minimum(qtype); }

// Bytes of qs per (group, block).
int64_t group_block_bytes(int64_t qtype) { return eight_bit(qtype) ? 16 * 32 : 4 * 64; }

// The 4-bit value of column c at k = 2p + e (within its block) in a Q4 group block: bits
// 4 (p % 4) on of row p / 4's word 2c + e (little-endian).
inline int q4_value(const uint8_t* gb, int64_t p, int64_t c, int64_t e) {
  const uint8_t byte = gb[(p / 4) * 64 + 2 * (2 * c + e) + (p % 4) / 2];
  return (p % 2 == 0) ? (byte & 0xF) : (byte >> 4);
}

// The weight of column c at k = 2p + e of a group block, as GGUF de-quantizes it in fp32
// (scale: the column's d; m: its minimum, zero point or second scale).
inline float weight_value(int64_t qtype, const uint8_t* gb, float scale, float m, int64_t p,
                          int64_t c, int64_t e) {
  if (eight_bit(qtype)) {
    const float q = static_cast<float>(static_cast<int8_t>(gb[p * 32 + 2 * c + e]));
    if (qtype == kQ8_S) return (p < 8 ? scale : m) * q;
    return qtype == kQ8_F ? scale * q + m : scale * q;
  }
  const int q = q4_value(gb, p, c, e);
  if (qtype == kQ4_0) return scale * static_cast<float>(q - 8);
  if (qtype == kQ4_Z) return scale * static_cast<float>(q - static_cast<int>(m));
  return scale * static_cast<float>(q) + m;
}

struct Weight {
  const uint8_t* qs;
  const void* d;  // fp16, or fp32 (Q4_F)
  const void* m;  // Q4_1's and Q4_F's minimum, Q4_Z's zero point
  int64_t qtype, n, k, blocks;
  bool f32() const { return fp32_fields(qtype); }
  const uint8_t* group_block(int64_t g, int64_t b) const {
    return qs + (g * blocks + b) * group_block_bytes(qtype);
  }
  // The 16 values of (group g, block b) in s (d or m).
  const void* scales(const void* s, int64_t g, int64_t b) const {
    return static_cast<const char*>(s) + (g * blocks + b) * kGroup * (f32() ? 4 : 2);
  }
  float scale(const void* s, int64_t g, int64_t b, int64_t c) const {
    const void* at = scales(s, g, b);
    return f32() ? static_cast<const float*>(at)[c]
                 : static_cast<float>(static_cast<const c10::Half*>(at)[c]);
  }
};


// ---- few rows: dot products on AVX512-BF16 ----

#define TOKENMILL_BF16_TARGET \
  __attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw,avx512dq,f16c,fma")))

// The 16 values of (group g, block b) in s, widened to fp32.
TOKENMILL_BF16_TARGET inline __m512 load_scales(const Weight& w, const void* s, int64_t g,
                                                int64_t b) {
  const void* at = w.scales(s, g, b);
  if (w.f32()) return _mm512_loadu_ps(at);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// Pair 4c + e of a Q4 group block's row c (`row`, 32 words) as the bf16 integers 128 + q.
template <int E>
TOKENMILL_BF16_TARGET inline __m512i q4_pair(__m512i row) {
  const __m512i shifted = E == 0 ? row : _mm512_srli_epi16(row, 4 * E);
  // (shifted & 0xF) | 0x4300, one ternary-logic op (A & B | C).
  return _mm512_ternarylogic_epi32(shifted, _mm512_set1_epi16(0xF), _mm512_set1_epi16(0x4300),
                                   0xEA);
}

// Pair p of a Q8 group block as bf16 integers (exact: |q| <= 128).
TOKENMILL_BF16_TARGET inline __m512i q8_pair(const uint8_t* row) {
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// s[r] += the pair's products with row r's x at j, j + 1 of the block (xr[r]: row r's x at
// the block's first k; x bf16: one dot product; fp32: the pair's two halves as fp32, each
// times its k's x; Offset: the values are 4-bit ones' 128 + q, which fp32 takes back to q
// exactly before it multiplies). The rows' addresses are computed once a block: computed
// from x, k and the pair's k at each use, at 8 rows they took the registers and spilled
// (1.4x slower).
template <int M, bool Offset = false, typename T>
TOKENMILL_BF16_TARGET inline void pair_dot(__m512 (&s)[M], __m512i v, const T* const (&xr)[M],
                                           int j) {
  if constexpr (std::is_same<T, at::BFloat16>::value) {
    for (int r = 0; r < M; ++r) {
      int32_t pair;
      std::memcpy(&pair, xr[r] + j, sizeof pair);
      s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)v, (__m512bh)_mm512_set1_epi32(pair));
    }
  } else {
    __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF0000)));
    if constexpr (Offset) {
      even = _mm512_sub_ps(even, _mm512_set1_ps(128.f));
      odd = _mm512_sub_ps(odd, _mm512_set1_ps(128.f));
    }
    for (int r = 0; r < M; ++r) {
      s[r] = _mm512_fmadd_ps(even, _mm512_set1_ps(xr[r][j]), s[r]);
      s[r] = _mm512_fmadd_ps(odd, _mm512_set1_ps(xr[r][j + 1]), s[r]);
    }
  }
}

// The C partial sums cleared; added into part[0].
template <int C, int M>
TOKENMILL_BF16_TARGET inline void clear_sums(__m512 (&part)[C][M]) {
  for (int c = 0; c < C; ++c) {
    for (int r = 0; r < M; ++r) part[c][r] = _mm512_setzero_ps();
  }
}
template <int C, int M>
TOKENMILL_BF16_TARGET inline void gather_sums(__m512 (&part)[C][M]) {
  for (int c = 1; c < C; ++c) {
    for (int r = 0; r < M; ++r) part[0][r] = _mm512_add_ps(part[0][r], part[c][r]);
  }
}

// Pair P of a Q8 group block into the partial sums part[P % C] (the index known at compile
// time: the sums stay in registers).
template <int M, int C, int P, typename T>
TOKENMILL_BF16_TARGET inline void q8_step(const uint8_t* gb, const T* const (&xr)[M],
                                          __m512 (&part)[C][M]) {
  pair_dot<M>(part[P % C], q8_pair(gb + P * 32), xr, 2 * P);
}
// Pairs Offset + P... of a Q8 group block.
template <int M, int C, int Offset, typename T, int... P>
TOKENMILL_BF16_TARGET inline void q8_pairs(const uint8_t* gb, const T* const (&xr)[M],
                                           __m512 (&part)[C][M],
                                           std::integer_sequence<int, P...>) {
  (q8_step<M, C, Offset + P>(gb, xr, part), ...);
}

// Row R of a Q4 group block: pairs 4R to 4R + 3, into part[(4R + E) % C].
template <int M, int C, int R, typename T, int... E>
TOKENMILL_BF16_TARGET inline void q4_row(const uint8_t* gb, const T* const (&xr)[M],
                                         __m512 (&part)[C][M], std::integer_sequence<int, E...>) {
  const __m512i row = _mm512_loadu_si512(gb + R * 64);
  (pair_dot<M, true>(part[(4 * R + E) % C], q4_pair<E>(row), xr, 8 * R + 2 * E), ...);
}

// The partial sums a block's pairs alternate between for M rows: about 8 chains at once.
constexpr int sums_for(int M) { return M >= 8 ? 1 : 8 / M; }

// Rows [0, M) of x [M, k] against column group g: y[r, 16 g + c]. The 16 columns are the 16
// lanes. Where the rows are fewer than 8, a block's pairs alternate between C partial sums,
// so that about 8 chains of dot products run at once, enough to hide a dot product's latency.
// A task reads one group's blocks, one stream of memory: taking 2 or 4 groups a task (their
// chains sharing each broadcast of x) read 2-4 streams at once and streamed 23-27% slower
// from DRAM at 1-4 rows (measured over 120 SmolLM2-shaped weights on an AVX512-BF16 EPYC:
// Q4_1 one row 3.14 against 4.10 ms, four rows 4.37 against 5.17; Q8_0 one row 4.59 against
// 6.29). Once: the group's blocks are read once (a call's only pass over its rows), so they
// are requested non-temporally, which keeps them out of the caches' outer levels: a decode
// step streams ~100 MB of weights past everything else it touches (the step's Python, the
// attention's caches), and the weights' lines no longer push those out (one request's steps
// with SmolLM2's Q4_1 file on an AVX512-BF16 EPYC: 4.62 against 4.84 ms, 8 alternating runs).
template <int M, int C, bool Once, typename T>
TOKENMILL_BF16_TARGET void gemv_group(const Weight& w, int64_t g, const T* x, const float* xsum,
                                      const float* bias, T* y, int64_t y_stride) {
  constexpr auto hint = Once ? _MM_HINT_NTA : _MM_HINT_T0;
  const int64_t gb_bytes = group_block_bytes(w.qtype);
  // The 4-bit values' offset o.
  const float offset =
      !eight_bit(w.qtype) && std::is_same<T, at::BFloat16>::value ? 128.f : 0.f;
  __m512 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  __m512 part[C][M];
  __m512(&s)[M] = part[0];
  for (int64_t b = 0; b < w.blocks; ++b) {
    clear_sums(part);
    const T* xr[M];  // the rows' x at this block
    for (int r = 0; r < M; ++r) xr[r] = x + r * w.k + b * kBlockK;
    const uint8_t* gb = w.group_block(g, b);
    // The block kPrefetchBlocks ahead, and its scales (each in its own pages, which the
    // hardware prefetchers reach late).
    const char* ahead = reinterpret_cast<const char*>(gb) + kPrefetchBlocks * gb_bytes;
    for (int64_t line = 0; line < gb_bytes; line += 64) _mm_prefetch(ahead + line, hint);
    _mm_prefetch(reinterpret_cast<const char*>(w.scales(w.d, g, b + kPrefetchBlocks)), hint);
    if (w.m != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(w.scales(w.m, g, b + kPrefetchBlocks)), hint);
    }
    if (eight_bit(w.qtype)) {
      q8_pairs<M, C, 0>(gb, xr, part, std::make_integer_sequence<int, 8>{});
      if (w.qtype == kQ8_S) {  // k 0-15 done: their scale d, then on with e's
        gather_sums(part);
        const __m512 dv = load_scales(w, w.d, g, b);
        for (int r = 0; r < M; ++r) acc[r] = _mm512_fmadd_ps(dv, s[r], acc[r]);
        clear_sums(part);
      }
      q8_pairs<M, C, 8>(gb, xr, part, std::make_integer_sequence<int, 8>{});
    } else {
      constexpr auto pairs = std::make_integer_sequence<int, 4>{};
      q4_row<M, C, 0>(gb, xr, part, pairs);
      q4_row<M, C, 1>(gb, xr, part, pairs);
      q4_row<M, C, 2>(gb, xr, part, pairs);
      q4_row<M, C, 3>(gb, xr, part, pairs);
    }
    gather_sums(part);
    // The block's weights are w = d q + c per column (c: Q4_1's minimum, -8 d for Q4_0, -z d
    // for a zero point z, else 0) and its sums s of (o + q) x (o = 128 for 4-bit values with
    // bf16 x, else 0): its products d s + (c - o d) times the block's sum of x, two fused
    // multiply-adds a row.
    const __m512 dv = load_scales(w, w.qtype == kQ8_S ? w.m : w.d, g, b);
    for (int r = 0; r < M; ++r) acc[r] = _mm512_fmadd_ps(dv, s[r], acc[r]);
    if (takes_xsum(w.qtype)) {
      __m512 cv = adds_minimum(w.qtype) ? load_scales(w, w.m, g, b) : _mm512_setzero_ps();
      __m512 zv = _mm512_set1_ps(offset);  // o, plus Q4_0's 8 or the zero point
      if (w.qtype == kQ4_0) zv = _mm512_set1_ps(offset + 8.f);
      if (w.qtype == kQ4_Z) zv = _mm512_add_ps(zv, load_scales(w, w.m, g, b));
      cv = _mm512_fnmadd_ps(zv, dv, cv);
      for (int r = 0; r < M; ++r) {
        acc[r] = _mm512_fmadd_ps(cv, _mm512_set1_ps(xsum[r * w.blocks + b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < M; ++r) {
    const int64_t col = g * kGroup;
    __m512 v = acc[r];
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col));
    T* dst = y + r * y_stride + col;
    if constexpr (std::is_same<T, at::BFloat16>::value) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
    } else {
      _mm512_storeu_ps(dst, v);
    }
  }
}

// Up to 8 rows: a task per group of 16 columns.
template <int M, typename T>
void gemv_rows(const Weight& w, const T* x, const float* xsum, const float* bias, T* y) {
  at::parallel_for(0, w.n / kGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      gemv_group<M, sums_for(M), true>(w, g, x, xsum, bias, y, w.n);
    }
  });
}

// Rows [r0, r0 + M) against group g.
template <int M, typename T>
void gemv_chunk(const Weight& w, int64_t g, const T* x, int64_t r0, const float* xsum,
                const float* bias, T* y) {
  gemv_group<M, sums_for(M), false>(w, g, x + r0 * w.k, xsum + r0 * w.blocks, bias,
                                    y + r0 * w.n, w.n);
}

// More than 8 rows: a task per group of 16 columns, its rows 12 at a time (then 8, then the
// rest) while the group's blocks (K / 32 * 256 bytes for 4 bits: 4.6 KB at K = 576) stay in
// the core's cache, so the weight streams from memory once and nothing is written but y.
// (12 rows' sums fill 24 of the 32 registers; against 8 at a time, 64 rows over 120
// SmolLM2-shaped weights: Q8_0 40.7 -> 38.2 ms, Q4_1 41.6 -> 41.1.)
template <typename T>
void gemv_many(const Weight& w, const T* x, int64_t m, const float* xsum, const float* bias,
               T* y) {
  at::parallel_for(0, w.n / kGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      int64_t r0 = 0;
      for (; r0 + 12 <= m; r0 += 12) gemv_chunk<12>(w, g, x, r0, xsum, bias, y);
      for (; r0 + 8 <= m; r0 += 8) gemv_chunk<8>(w, g, x, r0, xsum, bias, y);
      switch (m - r0) {
        case 0: break;
        case 1: gemv_chunk<1>(w, g, x, r0, xsum, bias, y); break;
        case 2: gemv_chunk<2>(w, g, x, r0, xsum, bias, y); break;
        case 3: gemv_chunk<3>(w, g, x, r0, xsum, bias, y); break;
        case 4: gemv_chunk<4>(w, g, x, r0, xsum, bias, y); break;
        case 5: gemv_chunk<5>(w, g, x, r0, xsum, bias, y); break;
        case 6: gemv_chunk<6>(w, g, x, r0, xsum, bias, y); break;
        default: gemv_chunk<7>(w, g, x, r0, xsum, bias, y);
      }
    }
  });
}

template <typename T>
void gemv(const Weight& w, const T* x, int64_t m, const float* xsum, const float* bias, T* y) {
  switch (m) {
    case 1: gemv_rows<1>(w, x, xsum, bias, y); break;
    case 2: gemv_rows<2>(w, x, xsum, bias, y); break;
    case 3: gemv_rows<3>(w, x, xsum, bias, y); break;
    case 4: gemv_rows<4>(w, x, xsum, bias, y); break;
    case 5: gemv_rows<5>(w, x, xsum, bias, y); break;
    case 6: gemv_rows<6>(w, x, xsum, bias, y); break;
    case 7: gemv_rows<7>(w, x, xsum, bias, y); break;
    case 8: gemv_rows<8>(w, x, xsum, bias, y); break;
    default: gemv_many(w, x, m, xsum, bias, y);
  }
}

// The batch-invariant mode's product on AVX512-BF16 (every row count): each row's sums in one
// order, whatever the call's rows: kInvariantSums partial sums per block, rows
// kInvariantRows at a time per group of columns (the rest in one smaller chunk, the same
// sums). On an AVX512-BF16 EPYC, 2 cores, a Q4_1 [1536, 576] bf16 weight, against the mode
// off at 1, 64 and 512 rows: 2 sums of 8 rows -2%, +1%, +17% (+24% for [576, 1536]); 1 sum
// of 12 rows: 1 row +11%; 4 sums of 4 rows: 64 rows +8%.
constexpr int kInvariantSums = 2;
constexpr int kInvariantRows = 8;  // 2 x 8 partial sums and 8 totals: 24 of the 32 registers

// Rows [0, n) (n <= N) against group g with C partial sums.
template <int C, int N, bool Once, typename T>
void gemv_group_upto(int64_t n, const Weight& w, int64_t g, const T* x, const float* xsum,
                     const float* bias, T* y) {
  if (n == N) {
    gemv_group<N, C, Once>(w, g, x, xsum, bias, y, w.n);
  } else if constexpr (N > 1) {
    gemv_group_upto<C, N - 1, Once>(n, w, g, x, xsum, bias, y);
  }
}

template <typename T>
void gemv_invariant(const Weight& w, const T* x, int64_t m, const float* xsum,
                    const float* bias, T* y) {
  constexpr int C = kInvariantSums, R = kInvariantRows;
  at::parallel_for(0, w.n / kGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      if (m <= R) {  // the group's blocks read once
        gemv_group_upto<C, R, true>(m, w, g, x, xsum, bias, y);
        continue;
      }
      for (int64_t r0 = 0; r0 < m; r0 += R) {
        gemv_group_upto<C, R, false>(std::min<int64_t>(R, m - r0), w, g, x + r0 * w.k,
                                     xsum + r0 * w.blocks, bias, y + r0 * w.n);
      }
    }
  });
}

// ---- many rows: de-quantize a block of columns, then the microkernel ----

// Columns [n0, n0 + kColumnBlock) de-quantized into `linear`'s packed layout of one column
// block: bf16 [K / 2, 64, 2] (`vnni`) or fp32 [K, 64].
template <typename C>
void dequantize_columns(const Weight& w, int64_t n0, bool vnni, C* out) {
  for (int64_t gl = 0; gl < kColumnBlock / kGroup; ++gl) {
    const int64_t g = n0 / kGroup + gl;
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* gb = w.group_block(g, b);

      for (int64_t p = 0; p < 16; ++p) {
        const int64_t k = b * kBlockK + 2 * p;
        for (int64_t c = 0; c < kGroup; ++c) {
          for (int64_t e = 0; e < 2; ++e) {
            const float v = weight_value(w.qtype, gb, w.scale(w.d, g, b, c),
                                         w.m != nullptr ? w.scale(w.m, g, b, c) : 0.f, p, c, e);
            const int64_t col = gl * kGroup + c;
            if (vnni) {
              out[((k / 2) * kColumnBlock + col) * 2 + e] = from_float<C>(v);
            } else {
              out[(k + e) * kColumnBlock + col] = from_float<C>(v);
            }
          }
        }
      }
    }
  }
}

// The same on AVX512-BF16, one pair of k (16 columns x 2) at a time: the pair's integers
// widened to fp32 in two halves (columns 0-7, 8-15), times d (and plus m) per column, in the
// reference's arithmetic (no fused multiply-add), then rounded to bf16 (`vnni`) or split into
// the pair's two k rows (fp32).
template <typename C>
TOKENMILL_BF16_TARGET void dequantize_columns_avx512(const Weight& w, int64_t n0, bool vnni,
                                                     C* out) {
  const __m512i lo_cols = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  // Block by block, the 4 groups of a block side by side: each k's row of the output (64
  // columns) is written whole at once, while it is in L1.
  for (int64_t b = 0; b < w.blocks; ++b) {
    for (int64_t gl = 0; gl < kColumnBlock / kGroup; ++gl) {
      const int64_t g = n0 / kGroup + gl;
      const uint8_t* gb = w.group_block(g, b);
      const __m512 dv = load_scales(w, w.d, g, b);
      const __m512 d_lo = _mm512_permutexvar_ps(lo_cols, dv), d_hi = _mm512_permutexvar_ps(hi_cols, dv);
      __m512 m_lo = _mm512_setzero_ps(), m_hi = _mm512_setzero_ps();
      if (w.m != nullptr) {  // the minimum, zero point or second scale
        const __m512 mv = load_scales(w, w.m, g, b);
        m_lo = _mm512_permutexvar_ps(lo_cols, mv);
        m_hi = _mm512_permutexvar_ps(hi_cols, mv);
      }
      for (int64_t p = 0; p < 16; ++p) {
        __m512i q;  // the pair's 32 integers, as int16
        if (eight_bit(w.qtype)) {
          q = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + p * 32)));
        } else {
          const __m512i row = _mm512_loadu_si512(gb + (p / 4) * 64);
          q = _mm512_and_si512(_mm512_srl_epi16(row, _mm_cvtsi32_si128(4 * (p % 4))),
                               _mm512_set1_epi16(0xF));
          if (w.qtype == kQ4_0) q = _mm512_sub_epi16(q, _mm512_set1_epi16(8));
        }
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1)));
        if (w.qtype == kQ4_Z) {  // q - z: exact small integers
          lo = _mm512_sub_ps(lo, m_lo);
          hi = _mm512_sub_ps(hi, m_hi);
        }
        const bool second = w.qtype == kQ8_S && p >= 8;  // k 16-31 of a Q8_S block: e
        lo = _mm512_mul_ps(second ? m_lo : d_lo, lo);
        hi = _mm512_mul_ps(second ? m_hi : d_hi, hi);
        if (adds_minimum(w.qtype)) {
          lo = _mm512_add_ps(lo, m_lo);
          hi = _mm512_add_ps(hi, m_hi);
        }
        const int64_t k = b * kBlockK + 2 * p;
        if constexpr (std::is_same<C, at::BFloat16>::value) {
          _mm512_storeu_si512(out + ((k / 2) * kColumnBlock + gl * kGroup) * 2,
                              (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        } else {
          _mm512_storeu_ps(out + k * kColumnBlock + gl * kGroup, _mm512_permutex2var_ps(lo, even, hi));
          _mm512_storeu_ps(out + (k + 1) * kColumnBlock + gl * kGroup,
                           _mm512_permutex2var_ps(lo, odd, hi));
        }
      }
    }
  }
}

// rows x kColumnBlock fp32 products (+ bias) out to y's rows (row stride y_stride).
template <typename T>
TOKENMILL_BF16_TARGET void store_rows_avx512(const float* c, int64_t rows, const float* bias,
                                             T* y, int64_t y_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < kColumnBlock; j += 16) {
      __m512 v = _mm512_loadu_ps(c + r * kColumnBlock + j);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
      if constexpr (std::is_same<T, at::BFloat16>::value) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + j),
                            (__m256i)_mm512_cvtneps_pbh(v));
      } else {
        _mm512_storeu_ps(y + r * y_stride + j, v);
      }
    }
  }
}

template <typename T>
void store_rows(const float* c, int64_t rows, const float* bias, T* y, int64_t y_stride) {
  if (cpu_isa() >= 2) {
    store_rows_avx512(c, rows, bias, y, y_stride);
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < kColumnBlock; ++j) {
      y[r * y_stride + j] =
          from_float<T>(c[r * kColumnBlock + j] + (bias != nullptr ? bias[j] : 0.f));
    }
  }
}

template <typename T>
void dequantize_then_multiply(const Weight& w, const T* x, int64_t m, const float* bias,
                              T* y) {
  const bool vnni = std::is_same<T, at::BFloat16>::value;
  const int64_t k = w.k, row_blocks = (m + kRowBlock - 1) / kRowBlock;
  // Past 16 rows, rows up to a multiple of 16 padded with zeros, once (as linear does: a
  // microkernel per row count otherwise); only the real rows are stored. (Padded per column
  // block, the copies cost more than the product at 17-47 rows.)
  std::vector<T> padded;
  const T* xa = x;
  int64_t m_run = m;
  if (m > 16 && m % 16 != 0) {
    m_run = (m + 15) / 16 * 16;
    padded.assign(m_run * k, from_float<T>(0.f));
    std::copy(x, x + m * k, padded.begin());
    xa = padded.data();
  }
  at::parallel_for(0, w.n / kColumnBlock, 1, [&](int64_t begin, int64_t end) {
    // (64-byte aligned: each k's row of 64 columns is whole cache lines)
    std::vector<T> storage(k * kColumnBlock + 64 / sizeof(T));
    T* buf = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) &
                                  ~uintptr_t{63});
    std::vector<float> scratch(kRowBlock * kColumnBlock);
    for (int64_t cb = begin; cb < end; ++cb) {
      const int64_t n0 = cb * kColumnBlock;
      if (cpu_isa() >= 2) {
        dequantize_columns_avx512(w, n0, vnni, buf);
      } else {
        dequantize_columns(w, n0, vnni, buf);
      }
      for (int64_t rb = 0; rb < row_blocks; ++rb) {
        const int64_t m0 = rb * kRowBlock, rows = std::min(kRowBlock, m - m0);
        const int64_t rows_run = std::min(kRowBlock, m_run - m0);
        const T* a = xa + m0 * k;
        at::native::cpublas::brgemm(rows_run, kColumnBlock, k, k, kColumnBlock, kColumnBlock,
                                    false, a, buf, scratch.data(), vnni);
        store_rows(scratch.data(), rows, bias != nullptr ? bias + n0 : nullptr, y + m0 * w.n + n0,
                   w.n);
      }
    }
    at::native::cpublas::brgemm_release(vnni);
  });
}

}  // namespace

namespace {

// The weight's tensors checked against the layout above (`op` names the caller in errors).
Weight checked_weight(const char* op, const at::Tensor& qs, const at::Tensor& d,
                      const c10::optional<at::Tensor>& m_in, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 || qtype == kQ4_Z ||
                  qtype == kQ4_F || qtype == kQ8_F || qtype == kQ8_S,
              op, ": qtype must be Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_Z (1000), Q4_F "
              "(1001), Q8_F (1002) or Q8_S (1003), got ", qtype);
  TORCH_CHECK(qs.dim() == 4 && qs.scalar_type() == at::kByte && qs.is_contiguous() &&
                  qs.size(2) == (eight_bit(qtype) ? 16 : 4) &&
                  qs.size(3) == (eight_bit(qtype) ? 32 : 64),
              op, ": qs must be a contiguous uint8 [N / 16, K / 32, 16, 32] (8-bit) or "
              "[N / 16, K / 32, 4, 64] (4-bit), got ", qs.sizes());
  const int64_t groups = qs.size(0), blocks = qs.size(1);
  const auto scale_type = fp32_fields(qtype) ? at::kFloat : at::kHalf;
  TORCH_CHECK(d.scalar_type() == scale_type && d.is_contiguous() &&
                  d.sizes() == at::IntArrayRef({groups, blocks, kGroup}),
              op, ": d must be ", scale_type, " [N / 16, K / 32, 16], got ", d.sizes(),
              " ", d.scalar_type());
  const bool has_m = m_in.has_value() && m_in->defined();
  TORCH_CHECK(has_m == (qtype != kQ4_0 && qtype != kQ8_0),
              op, ": every type but Q4_0 and Q8_0 takes m");
  if (has_m) {
    TORCH_CHECK(m_in->scalar_type() == scale_type && m_in->is_contiguous() &&
                    m_in->sizes() == d.sizes(),
                op, ": m must be shaped and typed as d");
  }
  return Weight{qs.data_ptr<uint8_t>(), d.data_ptr(), has_m ? m_in->data_ptr() : nullptr, qtype,
                groups * kGroup, blocks * kBlockK, blocks};
}

}  // namespace

at::Tensor gguf_linear(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                       const c10::optional<at::Tensor>& m_in, int64_t qtype,
                       const c10::optional<at::Tensor>& bias_in) {
  const Weight w = checked_weight("gguf_linear", qs, d, m_in, qtype);
  TORCH_CHECK(x_in.dim() == 2, "gguf_linear: x must be [M, ", w.k, "], got ", x_in.sizes());
  at::Tensor y = at::empty({x_in.size(0), w.n}, x_in.options());
  gguf_linear_out(x_in, qs, d, m_in, qtype, bias_in, y);
  return y;
}

void gguf_linear_out(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d,
                     const c10::optional<at::Tensor>& m_in, int64_t qtype,
                     const c10::optional<at::Tensor>& bias_in, at::Tensor& y) {
  const Weight w = checked_weight("gguf_linear", qs, d, m_in, qtype);
  const int64_t n = w.n, k = w.k;
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "gguf_linear: x must be [M, ", k, "], got ",
              x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "gguf_linear: x must be bf16 or fp32, got ", x_in.scalar_type());
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == x_in.scalar_type() &&
                  y.sizes() == at::IntArrayRef({x_in.size(0), n}),
              "gguf_linear: the output must be a contiguous [", x_in.size(0), ", ", n, "] in x's "
              "dtype, got ", y.sizes(), " ", y.scalar_type());
  if (x_in.scalar_type() == at::kBFloat16 && cpu_isa() < 1) {
    // No bf16 microkernel below AVX-512: fp32 products of the same values, rounded back.
    y.copy_(gguf_linear(x_in.to(at::kFloat), qs, d, m_in, qtype, bias_in));
    return;
  }
  const at::Tensor x = x_in.contiguous();
  const at::Tensor bias = bias_in.has_value() && bias_in->defined()
                              ? bias_in->to(at::kFloat).contiguous()
                              : at::Tensor();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t rows = x.size(0);
  if (rows == 0) return;
  TORCH_CHECK(n % kColumnBlock == 0, "gguf_linear: N=", n, " is not a multiple of ",
              kColumnBlock);
  // The batch-invariant mode on AVX512-BF16: the dot-product loop for every row count
  // (gemv_invariant). Below AVX512-BF16 every count already meets the same de-quantized
  // weight in the same microkernel, a row's sums in one order.
  const bool invariant = batch_invariant_mode() && cpu_isa() >= 2;
  if (rows > kRowBlock && !invariant) {
    // Several row blocks: the whole weight de-quantized once into `linear`'s packed layout
    // (column blocks in parallel), then `linear`, whose tasks keep a block of rows in cache
    // while the weight streams past (one block of columns at a time over every row, the rows
    // would stream once per block of columns).
    const bool vnni = x.scalar_type() == at::kBFloat16;
    // Into one buffer per thread, kept: fresh pages for every call cost more than the copy
    // (a first touch of memory is slow on virtual machines).
    thread_local at::Tensor buffer;
    const int64_t bytes = n * k * x.element_size();
    if (!buffer.defined() || buffer.numel() < bytes) buffer = at::empty({bytes}, at::kByte);
    const at::Tensor packed =
        vnni ? at::from_blob(buffer.data_ptr(), {n / kColumnBlock, k / 2, kColumnBlock, 2},
                             x.options())
             : at::from_blob(buffer.data_ptr(), {n / kColumnBlock, k, kColumnBlock}, x.options());
    at::parallel_for(0, n / kColumnBlock, 1, [&](int64_t begin, int64_t end) {
      for (int64_t cb = begin; cb < end; ++cb) {
        if (vnni) {
          auto* out = packed.data_ptr<at::BFloat16>() + cb * kColumnBlock * k;
          cpu_isa() >= 2 ? dequantize_columns_avx512(w, cb * kColumnBlock, true, out)
                         : dequantize_columns(w, cb * kColumnBlock, true, out);
        } else {
          auto* out = packed.data_ptr<float>() + cb * kColumnBlock * k;
          cpu_isa() >= 2 ? dequantize_columns_avx512(w, cb * kColumnBlock, false, out)
                         : dequantize_columns(w, cb * kColumnBlock, false, out);
        }
      }
    });
    y.copy_(tokenmill::linear(x, packed, bias_in));
    return;
  }
  const bool dots = cpu_isa() >= 2 && (rows <= kFewRows || (rows <= kDotRows && cpu_isa() < 3));
  if (invariant || dots) {
    // A minimum, a zero point or 4-bit values' offset meets each block's sum of x (a plain
    // loop: torch ops here cost more than the product at one row).
    std::vector<float> xsum(takes_xsum(qtype) ? rows * w.blocks : 0);
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const at::BFloat16* xb = bf16 ? x.data_ptr<at::BFloat16>() : nullptr;
    const float* xf = bf16 ? nullptr : x.data_ptr<float>();
    // Past kDotRows rows (the batch-invariant mode's prefills) the rows split across the
    // threads (512 rows of K = 1536 on 2 cores: the product 2.73 -> 2.63 ms).
    const int64_t sum_rows = xsum.empty() ? 0 : rows;
    at::parallel_for(0, sum_rows, kDotRows, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * w.blocks; i < end * w.blocks; ++i) {
        float sum = 0.f;
        for (int64_t j = 0; j < kBlockK; ++j) {
          sum += bf16 ? to_float(xb[i * kBlockK + j]) : xf[i * kBlockK + j];
        }
        xsum[i] = sum;
      }
    });
    const auto product = [&](const auto* xp, auto* yp) {
      if (invariant) {
        gemv_invariant(w, xp, rows, xsum.data(), bp, yp);
      } else {
        gemv(w, xp, rows, xsum.data(), bp, yp);
      }
    };
    if (x.scalar_type() == at::kBFloat16) {
      product(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
    } else {
      product(x.data_ptr<float>(), y.data_ptr<float>());
    }
    return;
  }
  if (x.scalar_type() == at::kBFloat16) {
    dequantize_then_multiply(w, x.data_ptr<at::BFloat16>(), rows, bp, y.data_ptr<at::BFloat16>());
  } else {
    dequantize_then_multiply(w, x.data_ptr<float>(), rows, bp, y.data_ptr<float>());
  }
}

at::Tensor gguf_rows(const at::Tensor& qs, const at::Tensor& d,
                     const c10::optional<at::Tensor>& m_in, int64_t qtype,
                     const at::Tensor& ids_in) {
  const Weight w = checked_weight("gguf_rows", qs, d, m_in, qtype);
  TORCH_CHECK(ids_in.dim() == 1, "gguf_rows: ids must be [T], got ", ids_in.sizes());
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t t = ids.size(0);
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < w.n, "gguf_rows: id ", id[i], " is outside [0, ", w.n, ")");
  }
  at::Tensor out = at::empty({t, w.k}, at::kFloat);
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < t; ++i) {
    const int64_t g = id[i] / kGroup, c = id[i] % kGroup;
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* gb = w.group_block(g, b);
      const float scale = w.scale(w.d, g, b, c);
      const float m = w.m != nullptr ? w.scale(w.m, g, b, c) : 0.f;
      for (int64_t p = 0; p < 16; ++p) {
        for (int64_t e = 0; e < 2; ++e) {
          o[i * w.k + b * kBlockK + 2 * p + e] = weight_value(qtype, gb, scale, m, p, c, e);
        }
      }
    }
  }
  return out;
}

}  // namespace tokenmill
