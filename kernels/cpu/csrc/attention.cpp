// Paged attention for decodes, reading the KV cache in place, and the cache write.
//
// kv_cache_write: a step's new keys and values [T, kv_heads, d] into their slots of one
// layer's cache [blocks, 2, block_size, kv_heads, d] (slot s: block s / block_size, row
// s % block_size).
//
// decode_attention: one query token per request, [B, heads, d]; request b attends to its
// first seq_lens[b] cached positions through its row of the block table. A job is (request,
// part of the context) over every KV head, chunk by chunk of a block's positions (whose rows
// lie together in memory, read once); each KV head's query heads (grouped-query attention)
// share every key and value read, and scores go through an online softmax in fp32, 16 keys
// at a time. Where there are too few requests to keep every thread busy the context is split
// and the parts merged (flash-decoding); threads take the jobs longest first. In the
// batch-invariant mode (batch_invariant.h) the cuts are every kInvariantPart keys of a
// request's context whatever the step holds, and every request, of one part or several, goes
// through the same merge: its bits depend on its own context alone. Optional: a
// sliding window (keys p - window < k <= p) and soft-capped scores (softcap * tanh(s /
// softcap)), as Gemma 2. A head's softmax reference moves only when a score passes it by
// kSlack. On CPUs with AVX512-BF16 a bf16 cache's dots run on bf16 pairs (vdpbf16ps: exact
// products, fp32 sums); the weighted values stay in fp32 (in bf16, as torch's CPU flash
// attention rounds them, SmolLM2's bf16 log-probabilities strayed past the HF test's bound,
// and it was slower). Measured on 2 AMX cores, 64 requests of 200 bf16 positions (3 KV heads
// of 64, 3 query heads each) from DRAM: 0.53 ms a layer, 3.8x faster than a task per
// (request, KV head) that went position by position with a horizontal sum per score.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "batch_invariant.h"
#include "ops.h"
#include "simd.h"
#include "vec.h"

namespace tokenmill {
namespace {

constexpr int64_t kKeysPerStep = 16;   // scores computed (and the max taken) per pass
constexpr int64_t kMinKeysPerPart = 64;  // a context is not split finer than this
// In the batch-invariant mode a context's parts are this many keys each (its last the rest).
// The mode's cost against the step's own cuts on 2 AVX512-BF16 EPYC cores (bf16, 9 query
// heads on 3 KV heads of 64), at 1 x 384 keys, 64 x ~200, 1 x 1000, 1 x 4000, 4 x 1000, 16 x
// 500: 256: +14% (parts of 256 and 128 on 2 threads where the step cuts 192 and 192), 0, +1,
// +8, +2, -1%; 128: +16, +3, +9, +14, +7, +5%; 512: +45% (one part, one thread), 0, -2, +4,
// -2, 0%. Machines with more threads would want shorter parts for one long context.
constexpr int64_t kInvariantPart = 256;
// Values of all the parts up to which they are merged without a parallel region.
constexpr int64_t kSerialMerge = 4096;
constexpr int64_t kMaxGroup = 16;      // query heads per KV head
constexpr int64_t kMaxHead = 512;
// How far a score may pass a head's running reference (its softmax's exponent offset) before
// the reference moves: weights up to exp(8) ~ 3000 keep fp32 sums far from overflowing.
constexpr float kSlack = 8.f;

template <typename T>
TOKENMILL_INLINE float dot(const float* q, const T* k, int64_t d) {
  float sums[16] = {0.f};
  for (int64_t i = 0; i < d; i += 16) {
    for (int j = 0; j < 16; ++j) sums[j] += q[i + j] * to_float(k[i + j]);
  }
  float total = 0.f;
  for (float s : sums) total += s;
  return total;
}

struct Part {
  float max[kMaxGroup];
  float sum[kMaxGroup];
};

// One (request, KV head, range of keys) task: G queries (already scaled) against keys
// [first, last) of the request's context; acc [G, d] gets the unnormalized sum of values.
template <typename T>
TOKENMILL_INLINE void attend_part_impl(const float* q, int64_t group, int64_t d, const T* cache,
                        const int64_t* blocks, int64_t block_size, int64_t kv_heads,
                        int64_t kv_head, int64_t first, int64_t last, float softcap, float* acc,
                        Part& part) {
  const int64_t row = kv_heads * d;  // one position's K (or V) across KV heads
  const int64_t block_stride = 2 * block_size * row;
  for (int64_t g = 0; g < group; ++g) {
    part.max[g] = -std::numeric_limits<float>::infinity();
    part.sum[g] = 0.f;
  }
  std::fill(acc, acc + group * d, 0.f);
  float scores[kMaxGroup][kKeysPerStep];
  for (int64_t start = first; start < last; start += kKeysPerStep) {
    const int64_t n = std::min(kKeysPerStep, last - start);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = start + t;
      const T* k = cache + blocks[pos / block_size] * block_stride + (pos % block_size) * row +
                   kv_head * d;
      for (int64_t g = 0; g < group; ++g) {
        float s = dot(q + g * d, k, d);
        if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
        scores[g][t] = s;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float step_max = part.max[g];
      for (int64_t t = 0; t < n; ++t) step_max = std::max(step_max, scores[g][t]);
      const float rescale = std::exp(part.max[g] - step_max);
      float* a = acc + g * d;
      if (rescale != 1.f) {
        for (int64_t i = 0; i < d; ++i) a[i] *= rescale;
      }
      float sum = part.sum[g] * rescale;
      for (int64_t t = 0; t < n; ++t) {
        const float p = std::exp(scores[g][t] - step_max);
        sum += p;
        const int64_t pos = start + t;
        const T* v = cache + blocks[pos / block_size] * block_stride + block_size * row +
                     (pos % block_size) * row + kv_head * d;
        for (int64_t i = 0; i < d; ++i) a[i] += p * to_float(v[i]);
      }
      part.max[g] = step_max;
      part.sum[g] = sum;
    }
  }
}

// ---- AVX-512: a task's keys block by block, every KV head's scores 16 keys at a time.
//
// A chunk is up to 16 consecutive positions of one block: their rows (all KV heads side by
// side) lie together in memory, 16 x kv_heads x d for the keys and as many for the values,
// and are read once for all heads while the next chunk's are prefetched. A query head's dot
// with each key is a vector of partial sums; the 16 keys' vectors are then added across
// lanes together (sum16) into one vector of 16 scores, so that the softmax runs on vectors.

// acc += the bf16 pairs' products a.b, lane by lane (AVX512-BF16's vdpbf16ps; products of
// bf16 are exact in fp32). Written as assembly so that it inlines into any AVX-512 build;
// callers check cpu_isa() >= 2.
TOKENMILL_AVX512_INLINE __m512 dot_bf16_pairs(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// 16 vectors -> one whose lane t is the sum of x[t]'s lanes.
TOKENMILL_AVX512_INLINE __m512 sum16(const __m512* x) {
  __m512 y[8], z[4], w[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0, 2 of each 128 bits: x[2i]; 1, 3: x[2i + 1]
    y[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                         _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // lane j of each 128 bits: x[4i + j]
    const __m512d a = _mm512_castps_pd(y[2 * i]), b = _mm512_castps_pd(y[2 * i + 1]);
    z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i) {  // 128 bits j: keys 8i + 4(j / 2), partial
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// One query head's dots with the chunk's n keys (key t at keys + t * row), lanes >= n zero.
// kPairs: q is bf16 and the dots are vdpbf16ps over pairs (d a multiple of 32); otherwise q
// is fp32 and the keys are widened. D: the head size where it is known when compiled (its
// loops unrolled, the query kept in registers across the keys), 0 where d says; G the same
// for the group size (chunk_values).
template <typename T, bool kPairs, int D>
TOKENMILL_AVX512_INLINE __m512 chunk_scores(const void* q, const T* keys, int64_t row,
                                            int64_t n, int64_t d_runtime) {
  const int64_t d = D > 0 ? D : d_runtime;
  __m512 x[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    __m512 sum = _mm512_setzero_ps();
    if (t < n) {
      const T* k = keys + t * row;
      if constexpr (kPairs) {
        const auto* qb = static_cast<const at::BFloat16*>(q);
        for (int64_t i = 0; i < d; i += 32) {
          sum = dot_bf16_pairs(sum, _mm512_loadu_si512(qb + i), _mm512_loadu_si512(k + i));
        }
      } else {
        const float* qf = static_cast<const float*>(q);
        for (int64_t i = 0; i < d; i += 16) {
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(qf + i), avx512::load(k + i), sum);
        }
      }
    }
    x[t] = sum;
  }
  return sum16(x);
}

// The chunk's weighted values (weights [group][16], fp32) added into a query group's sums
// (acc [group, d]), each value row widened once for the group's heads.
template <typename T, int D, int G>
TOKENMILL_AVX512_INLINE void chunk_values(const T* values, int64_t row, int64_t n,
                                          int64_t group_runtime, int64_t d_runtime,
                                          const float (*weights)[16], float* acc) {
  const int64_t d = D > 0 ? D : d_runtime;
  const int64_t group = G > 0 ? G : group_runtime;
  for (int64_t i = 0; i < d; i += 16) {
    __m512 sums[kMaxGroup];
    for (int64_t g = 0; g < group; ++g) sums[g] = _mm512_loadu_ps(acc + g * d + i);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 vi = avx512::load(values + t * row + i);
      for (int64_t g = 0; g < group; ++g) {
        sums[g] = _mm512_fmadd_ps(_mm512_set1_ps(weights[g][t]), vi, sums[g]);
      }
    }
    for (int64_t g = 0; g < group; ++g) _mm512_storeu_ps(acc + g * d + i, sums[g]);
  }
}

inline void prefetch_rows(const void* p, int64_t bytes) {  // SSE: any x86-64 build
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}

// One (request, range of keys [first, last)) task for every KV head. q: the request's query
// heads, bf16 unscaled (kPairs; scores times `scale`) or fp32 scaled (scale 1). acc
// [kv_heads, group, d] gets the unnormalized sums of values, parts[h] their max and sum.
template <typename T, bool kPairs, int D>
TOKENMILL_AVX512_INLINE void attend_heads_avx512_impl(
    const void* q, int64_t kv_heads, int64_t group, int64_t d, const T* cache,
    const int64_t* blocks, int64_t block_size, int64_t first, int64_t last, float scale,
    float softcap, float* acc, Part* parts) {
  const int64_t row = kv_heads * d;
  const int64_t block_stride = 2 * block_size * row;
  const int64_t q_size = kPairs ? 2 : 4;  // bytes per query element
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t g = 0; g < group; ++g) {
      parts[h].max[g] = -std::numeric_limits<float>::infinity();
      parts[h].sum[g] = 0.f;
    }
  }
  std::fill(acc, acc + kv_heads * group * d, 0.f);
  alignas(64) float weights[kMaxGroup][16];
  // Each query head's sum of weights, 16 lanes wide (added across lanes at the end).
  std::vector<float> weight_sums(kv_heads * group * 16, 0.f);
  // The chunk at position pos: its keys (values block_size rows further) and its length.
  const auto chunk = [&](int64_t pos, int64_t& n) {
    const int64_t block = pos / block_size, offset = pos - block * block_size;
    n = std::min({int64_t(16), block_size - offset, last - pos});
    return cache + blocks[block] * block_stride + offset * row;
  };
  // Each block lies elsewhere: the prefetchers cannot guess the next. The chunk after the next
  // one is requested as a chunk starts (the first chunk also requests the next).
  const auto prefetch = [&](int64_t pos) {
    int64_t n;
    const T* k = chunk(pos, n);
    prefetch_rows(k, n * row * int64_t(sizeof(T)));
    prefetch_rows(k + block_size * row, n * row * int64_t(sizeof(T)));
  };
  for (int64_t pos = first; pos < last;) {
    int64_t n;
    const T* keys = chunk(pos, n);
    const T* values = keys + block_size * row;
    const int64_t next = pos + n;
    if (next < last) {
      int64_t next_n;
      chunk(next, next_n);
      if (pos == first) prefetch(next);
      if (next + next_n < last) prefetch(next + next_n);
    }
    const __mmask16 valid = avx512::first(n);
    for (int64_t h = 0; h < kv_heads; ++h) {
      Part& part = parts[h];
      float* acc_h = acc + h * group * d;
      for (int64_t g = 0; g < group; ++g) {
        const void* qg = static_cast<const char*>(q) + (h * group + g) * d * q_size;
        __m512 s = chunk_scores<T, kPairs, D>(qg, keys + h * d, row, n, d);
        if (scale != 1.f) s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
        if (softcap > 0.f) {
          alignas(64) float capped[16];
          _mm512_store_ps(capped, s);
          for (int64_t t = 0; t < n; ++t) capped[t] = softcap * std::tanh(capped[t] / softcap);
          s = _mm512_load_ps(capped);
        }
        s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
        // The reference moves only when a score passes it by more than kSlack (always on
        // the first chunk, whose reference is -inf): most chunks take no horizontal max, no
        // rescale and no scalar exp.
        if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(part.max[g] + kSlack), _CMP_GT_OQ)) {
          const float top = _mm512_reduce_max_ps(s);
          const float rescale = std::exp(part.max[g] - top);
          const __m512 r = _mm512_set1_ps(rescale);
          float* ws = weight_sums.data() + (h * group + g) * 16;
          _mm512_storeu_ps(ws, _mm512_mul_ps(_mm512_loadu_ps(ws), r));
          float* a = acc_h + g * d;
          for (int64_t i = 0; i < d; i += 16) {
            _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_loadu_ps(a + i), r));
          }
          part.max[g] = top;
        }
        const __m512 w = _mm512_maskz_mov_ps(
            valid, avx512::exp(_mm512_sub_ps(s, _mm512_set1_ps(part.max[g]))));
        _mm512_store_ps(weights[g], w);
        float* ws = weight_sums.data() + (h * group + g) * 16;
        _mm512_storeu_ps(ws, _mm512_add_ps(_mm512_loadu_ps(ws), w));
      }
      // Values, compiled for the common group sizes (the group's sums stay in registers).
      const T* v_h = values + h * d;
      switch (group) {
        case 1: chunk_values<T, D, 1>(v_h, row, n, 1, d, weights, acc_h); break;
        case 2: chunk_values<T, D, 2>(v_h, row, n, 2, d, weights, acc_h); break;
        case 3: chunk_values<T, D, 3>(v_h, row, n, 3, d, weights, acc_h); break;
        case 4: chunk_values<T, D, 4>(v_h, row, n, 4, d, weights, acc_h); break;
        case 8: chunk_values<T, D, 8>(v_h, row, n, 8, d, weights, acc_h); break;
        default: chunk_values<T, D, 0>(v_h, row, n, group, d, weights, acc_h);
      }
    }
    pos = next;
  }
  for (int64_t h = 0; h < kv_heads; ++h) {
    for (int64_t g = 0; g < group; ++g) parts[h].sum[g] =
        _mm512_reduce_add_ps(_mm512_loadu_ps(weight_sums.data() + (h * group + g) * 16));
  }
}

// attend_heads_avx512_impl for the head sizes models use (compiled for each), else any.
template <typename T, bool kPairs>
TOKENMILL_AVX512_INLINE void attend_heads_avx512_d(const void* q, int64_t kv_heads, int64_t group,
                                                   int64_t d, const T* cache,
                                                   const int64_t* blocks, int64_t block_size,
                                                   int64_t first, int64_t last, float scale,
                                                   float softcap, float* acc, Part* parts) {
#define TOKENMILL_ATTEND(D)                                                                 \
  attend_heads_avx512_impl<T, kPairs, D>(q, kv_heads, group, d, cache, blocks, block_size, \
                                         first, last, scale, softcap, acc, parts)
  switch (d) {
    case 64: TOKENMILL_ATTEND(64); break;
    case 128: TOKENMILL_ATTEND(128); break;
    case 256: TOKENMILL_ATTEND(256); break;
    default: TOKENMILL_ATTEND(0);
  }
#undef TOKENMILL_ATTEND
}

TOKENMILL_AVX512_TARGET void attend_heads_avx512(const void* q, bool pairs, int64_t kv_heads,
                                                 int64_t group, int64_t d,
                                                 const at::BFloat16* cache, const int64_t* blocks,
                                                 int64_t block_size, int64_t first, int64_t last,
                                                 float scale, float softcap, float* acc,
                                                 Part* parts) {
  if (pairs) {
    attend_heads_avx512_d<at::BFloat16, true>(q, kv_heads, group, d, cache, blocks, block_size,
                                              first, last, scale, softcap, acc, parts);
  } else {
    attend_heads_avx512_d<at::BFloat16, false>(q, kv_heads, group, d, cache, blocks,
                                               block_size, first, last, scale, softcap, acc,
                                               parts);
  }
}

TOKENMILL_AVX512_TARGET void attend_heads_avx512(const void* q, bool, int64_t kv_heads,
                                                 int64_t group, int64_t d, const float* cache,
                                                 const int64_t* blocks, int64_t block_size,
                                                 int64_t first, int64_t last, float scale,
                                                 float softcap, float* acc, Part* parts) {
  attend_heads_avx512_d<float, false>(q, kv_heads, group, d, cache, blocks, block_size, first,
                                      last, scale, softcap, acc, parts);
}

TOKENMILL_AVX512_TARGET void attend_heads_avx512(const void* q, bool, int64_t kv_heads,
                                                 int64_t group, int64_t d,
                                                 const at::Float8_e4m3fn* cache,
                                                 const int64_t* blocks, int64_t block_size,
                                                 int64_t first, int64_t last, float scale,
                                                 float softcap, float* acc, Part* parts) {
  attend_heads_avx512_d<at::Float8_e4m3fn, false>(q, kv_heads, group, d, cache, blocks,
                                                  block_size, first, last, scale, softcap, acc,
                                                  parts);
}

// The portable builds (AVX2, plain x86-64; AVX-512 runs attend_heads_avx512).
TOKENMILL_ISA_VARIANTS(attend_part, (const float* q, int64_t group, int64_t d,
                                     const at::BFloat16* cache, const int64_t* blocks,
                                     int64_t block_size, int64_t kv_heads, int64_t kv_head,
                                     int64_t first, int64_t last, float softcap, float* acc,
                                     Part& part),
                       (q, group, d, cache, blocks, block_size, kv_heads, kv_head, first, last,
                        softcap, acc, part))
TOKENMILL_ISA_VARIANTS(attend_part, (const float* q, int64_t group, int64_t d,
                                     const float* cache, const int64_t* blocks,
                                     int64_t block_size, int64_t kv_heads, int64_t kv_head,
                                     int64_t first, int64_t last, float softcap, float* acc,
                                     Part& part),
                       (q, group, d, cache, blocks, block_size, kv_heads, kv_head, first, last,
                        softcap, acc, part))
TOKENMILL_ISA_VARIANTS(attend_part, (const float* q, int64_t group, int64_t d,
                                     const at::Float8_e4m3fn* cache, const int64_t* blocks,
                                     int64_t block_size, int64_t kv_heads, int64_t kv_head,
                                     int64_t first, int64_t last, float softcap, float* acc,
                                     Part& part),
                       (q, group, d, cache, blocks, block_size, kv_heads, kv_head, first, last,
                        softcap, acc, part))

// A step's rows into their slots (token t's key at key + t * stride, its value likewise); an
// fp8 cache takes them rounded (saturating at +-448).
template <typename C, typename T>
void write_rows(C* cache, const T* key, const T* value, int64_t stride, const int64_t* slots,
                int64_t tokens, int64_t block_size, int64_t row) {
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      C* k = cache + (block * 2 * block_size + offset) * row;
      const T* key_t = key + t * stride;
      const T* value_t = value + t * stride;
      if constexpr (std::is_same<C, T>::value) {
        std::copy(key_t, key_t + row, k);
        std::copy(value_t, value_t + row, k + block_size * row);
      } else {
        for (int64_t i = 0; i < row; ++i) {
          k[i] = from_float<C>(to_float(key_t[i]));
          k[block_size * row + i] = from_float<C>(to_float(value_t[i]));
        }
      }
    }
  });
}

// A part of a request's context: keys [lo, hi) of request b (none where lo >= hi).
struct Job {
  int64_t b, lo, hi;
};

// A step's parts: request b's are list[start[b] : start[b + 1]], in the order of their keys.
struct Jobs {
  std::vector<int64_t> start;
  std::vector<Job> list;
};

// Normally the step decides the cuts: enough parts that every thread has work, none shorter
// than kMinKeysPerPart keys: a part per thread where the requests divide the threads evenly
// (one request: a part each), else about two jobs per thread, which balance requests of
// different lengths. In the batch-invariant mode the request alone does: every
// kInvariantPart keys from its context's first (its window's first with a sliding window).
Jobs plan_jobs(const int64_t* len, int64_t batch, int64_t window, int64_t threads,
               bool invariant) {
  int64_t parts = 0;
  if (!invariant) {
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, len[b]);
    parts = threads % batch == 0 ? threads / batch
                                 : std::max<int64_t>(1, (2 * threads + batch - 1) / batch);
    parts = std::min(parts, std::max<int64_t>(1, longest / kMinKeysPerPart));
  }
  Jobs jobs;
  jobs.start.resize(batch + 1);
  jobs.list.reserve(invariant ? batch : batch * parts);
  for (int64_t b = 0; b < batch; ++b) {
    jobs.start[b] = static_cast<int64_t>(jobs.list.size());
    const int64_t first = window > 0 ? std::max<int64_t>(0, len[b] - window) : 0;
    const int64_t span = len[b] - first;
    const int64_t count = invariant ? (span + kInvariantPart - 1) / kInvariantPart : parts;
    const int64_t per = invariant ? kInvariantPart : (span + parts - 1) / parts;
    for (int64_t p = 0; p < count; ++p) {
      jobs.list.push_back({b, first + p * per, std::min(len[b], first + (p + 1) * per)});
    }
  }
  jobs.start[batch] = static_cast<int64_t>(jobs.list.size());
  return jobs;
}

}  // namespace

template <typename T>
void kv_cache_write_rows(at::Tensor& kv_cache, const T* key, const T* value, int64_t stride,
                         const int64_t* slots, int64_t tokens) {
  const int64_t block_size = kv_cache.size(2), row = kv_cache.size(3) * kv_cache.size(4);
  if (kv_cache.scalar_type() == at::kFloat8_e4m3fn) {
    write_rows(kv_cache.data_ptr<at::Float8_e4m3fn>(), key, value, stride, slots, tokens,
               block_size, row);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == c10::CppTypeToScalarType<T>::value,
                "kv_cache_write: key/value must be in the cache's dtype (or, for an fp8 cache, "
                "bf16 or fp32)");
    write_rows(kv_cache.data_ptr<T>(), key, value, stride, slots, tokens, block_size, row);
  }
}
template void kv_cache_write_rows(at::Tensor&, const at::BFloat16*, const at::BFloat16*, int64_t,
                                  const int64_t*, int64_t);
template void kv_cache_write_rows(at::Tensor&, const float*, const float*, int64_t,
                                  const int64_t*, int64_t);

void kv_cache_write(at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "kv_cache_write: the cache must be a contiguous [blocks, 2, block_size, kv_heads, "
              "d], got ", kv_cache.sizes());
  const int64_t block_size = kv_cache.size(2), row = kv_cache.size(3) * kv_cache.size(4);
  const at::Tensor k = key.contiguous(), v = value.contiguous();
  const at::Tensor s = slots.to(at::kLong).contiguous();
  const int64_t tokens = s.numel();
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(k.numel() == tokens * row && v.numel() == tokens * row &&
                  k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == kv_cache.scalar_type() ||
                   (fp8 && (k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat))),
              "kv_cache_write: key/value must be [T, kv_heads, d] in the cache's dtype (or, for "
              "an fp8 cache, bf16 or fp32)");
  const int64_t capacity = kv_cache.size(0) * block_size;
  const int64_t* sp = s.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "kv_cache_write: slot ", sp[t],
                " outside the cache's ", capacity);
  }
  if (k.scalar_type() == at::kBFloat16) {
    kv_cache_write_rows(kv_cache, k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), row, sp,
                        tokens);
  } else {
    TORCH_CHECK(k.scalar_type() == at::kFloat, "kv_cache_write: bf16, fp32 or fp8 only");
    kv_cache_write_rows(kv_cache, k.data_ptr<float>(), v.data_ptr<float>(), row, sp, tokens);
  }
}

void check_decode_heads(const char* op, int64_t heads, int64_t kv_heads, int64_t d) {
  TORCH_CHECK(d % 16 == 0 && d <= kMaxHead, op, ": head size ", d,
              " must be a multiple of 16 up to ", kMaxHead);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, op, ": ",
              heads, " query heads do not group over ", kv_heads, " KV heads (at most ",
              kMaxGroup, " per KV head)");
}

void decode_attention_rows(const void* query, int64_t q_stride, at::ScalarType q_type,
                           const at::Tensor& kv_cache, const int64_t* table, int64_t width,
                           const int64_t* len, int64_t batch, int64_t heads, double scale,
                           int64_t window, double softcap, void* out) {
  const int64_t d = kv_cache.size(4), block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  const int64_t group = heads / kv_heads;
  // Queries scaled once, in fp32; on CPUs with bf16 dot products a bf16 query is used as it
  // is (its dots with the keys by vdpbf16ps) and its scores scaled.
  const bool avx512 = cpu_isa() >= 1;
  const bool pairs = kv_cache.scalar_type() == at::kBFloat16 && cpu_isa() >= 2 && d % 32 == 0;
  // Otherwise the queries in fp32, scaled (contiguous: row b at b * heads * d).
  std::vector<float> scaled;
  if (!pairs) {
    scaled.resize(batch * heads * d);
    const float s = static_cast<float>(scale);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < heads * d; ++i) {
        const int64_t at = b * q_stride + i;
        const float x = q_type == at::kBFloat16
                            ? static_cast<float>(static_cast<const at::BFloat16*>(query)[at])
                            : static_cast<const float*>(query)[at];
        scaled[b * heads * d + i] = x * s;
      }
    }
  }
  const float score_scale = pairs ? static_cast<float>(scale) : 1.f;

  const int64_t threads = at::get_num_threads();
  const bool invariant = batch_invariant_mode();
  const Jobs jobs = plan_jobs(len, batch, window, threads, invariant);
  const int64_t job_count = static_cast<int64_t>(jobs.list.size());
  std::vector<float> acc(job_count * kv_heads * group * d);
  std::vector<Part> stats(job_count * kv_heads);
  const float cap = static_cast<float>(softcap);
  // A job is (request, part of its context) and goes through every KV head: the heads' rows
  // of a position sit side by side, so the context is read from memory once. Threads take the
  // jobs longest first, one at a time as they finish the one before (their lengths differ).
  std::vector<int64_t> order(job_count);
  std::iota(order.begin(), order.end(), int64_t(0));
  const auto keys = [&](int64_t j) {
    const Job& job = jobs.list[j];
    return invariant ? job.hi - job.lo : len[job.b];
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return keys(a) > keys(b); });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, job_count), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < job_count; i = next++) {
      const int64_t job = order[i];
      const auto [b, lo, hi] = jobs.list[job];
      const int64_t* blocks = table + b * width;
      // The sums and stats of (request b, part, head h) at index job * kv_heads + h.
      float* job_acc = acc.data() + job * kv_heads * group * d;
      Part* job_stats = stats.data() + job * kv_heads;
      if (lo >= hi) {
        for (int64_t h = 0; h < kv_heads; ++h) {
          for (int64_t g = 0; g < group; ++g) {
            job_stats[h].max[g] = -std::numeric_limits<float>::infinity();
            job_stats[h].sum[g] = 0.f;
          }
        }
        std::fill(job_acc, job_acc + kv_heads * group * d, 0.f);
        continue;
      }
      if (avx512) {
        const void* qb =
            pairs ? static_cast<const void*>(static_cast<const at::BFloat16*>(query) + b * q_stride)
                  : static_cast<const void*>(scaled.data() + b * heads * d);
        if (fp8) {
          attend_heads_avx512(qb, false, kv_heads, group, d,
                              kv_cache.data_ptr<at::Float8_e4m3fn>(), blocks, block_size, lo, hi,
                              score_scale, cap, job_acc, job_stats);
        } else if (kv_cache.scalar_type() == at::kBFloat16) {
          attend_heads_avx512(qb, pairs, kv_heads, group, d, kv_cache.data_ptr<at::BFloat16>(),
                              blocks, block_size, lo, hi, score_scale, cap, job_acc, job_stats);
        } else {
          attend_heads_avx512(qb, false, kv_heads, group, d, kv_cache.data_ptr<float>(), blocks,
                              block_size, lo, hi, score_scale, cap, job_acc, job_stats);
        }
        continue;
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        float* a = job_acc + h * group * d;
        const float* qh = scaled.data() + (b * heads + h * group) * d;
        if (fp8) {
          attend_part(qh, group, d, kv_cache.data_ptr<at::Float8_e4m3fn>(), blocks, block_size,
                      kv_heads, h, lo, hi, cap, a, job_stats[h]);
        } else if (kv_cache.scalar_type() == at::kBFloat16) {
          attend_part(qh, group, d, kv_cache.data_ptr<at::BFloat16>(), blocks, block_size,
                      kv_heads, h, lo, hi, cap, a, job_stats[h]);
        } else {
          attend_part(qh, group, d, kv_cache.data_ptr<float>(), blocks, block_size, kv_heads, h,
                      lo, hi, cap, a, job_stats[h]);
        }
      }
    }
  });
  // Merge the parts of each (request, KV head) in the order of their keys: rescale each to the
  // largest max, add, divide (on this thread where that is less work than waking the others:
  // one request's few parts). A request of one part takes this path too (its weight exp(0) is
  // 1: its sums unchanged), so its bits do not depend on whether others were split.
  const int64_t pairs_count = batch * kv_heads;
  const int64_t merge_grain = job_count * kv_heads * group * d <= kSerialMerge ? pairs_count : 1;
  at::parallel_for(0, pairs_count, merge_grain, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(d);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / kv_heads, h = pair % kv_heads;
      const int64_t parts = jobs.start[b + 1] - jobs.start[b];
      const auto at = [&](int64_t p) { return (jobs.start[b] + p) * kv_heads + h; };
      for (int64_t g = 0; g < group; ++g) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < parts; ++p) top = std::max(top, stats[at(p)].max[g]);
        std::fill(merged.begin(), merged.end(), 0.f);
        float total = 0.f;
        for (int64_t p = 0; p < parts; ++p) {
          const Part& s = stats[at(p)];
          if (s.sum[g] == 0.f) continue;
          const float w = std::exp(s.max[g] - top);
          total += s.sum[g] * w;
          const float* a = acc.data() + (at(p) * group + g) * d;
          for (int64_t i = 0; i < d; ++i) merged[i] += w * a[i];
        }
        const int64_t offset = (b * heads + h * group + g) * d;
        if (q_type == at::kBFloat16) {
          auto* o = static_cast<at::BFloat16*>(out) + offset;
          for (int64_t i = 0; i < d; ++i) o[i] = from_float<at::BFloat16>(merged[i] / total);
        } else {
          float* o = static_cast<float*>(out) + offset;
          for (int64_t i = 0; i < d; ++i) o[i] = merged[i] / total;
        }
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3, "decode_attention: query must be [B, heads, d]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "decode_attention: the cache must be a contiguous [blocks, 2, block_size, "
              "kv_heads, d]");
  const int64_t batch = query.size(0), heads = query.size(1), d = query.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == d, "decode_attention: head size ", d, " must match the "
              "cache's ", kv_cache.size(4));
  check_decode_heads("decode_attention", heads, kv_heads, d);
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() ||
                  (fp8 && (query.scalar_type() == at::kBFloat16 ||
                           query.scalar_type() == at::kFloat)),
              "decode_attention: query and cache dtypes differ (an fp8 cache takes bf16 or "
              "fp32 queries)");
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(table.dim() == 2 && table.size(0) >= batch && lens.numel() >= batch,
              "decode_attention: one block table row and length per request");
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t width = table.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= width * block_size, "decode_attention: request ", b,
                " has length ", len[b], " for ", width, " blocks of ", block_size);
  }
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty_like(q);
  decode_attention_rows(q.data_ptr(), heads * d, q.scalar_type(), kv_cache,
                        table.data_ptr<int64_t>(), width, len, batch, heads, scale, window,
                        softcap, out.data_ptr());
  return out;
}

}  // namespace tokenmill
