// Paged attention for decodes, reading the KV cache in place, and the cache write.
//
// kv_cache_write: a step's new keys and values [T, kv_heads, d] into their slots of one
// layer's cache [blocks, 2, block_size, kv_heads, d] (slot s: block s / block_size, row
// s % block_size).
//
// decode_attention: one query token per request, [B, heads, d]; request b attends to its
// first seq_lens[b] cached positions through its row of the block table. A task is (request,
// KV head, part of the context): the KV head's query heads (grouped-query attention) share
// every key and value read, scores go through an online softmax in fp32 (16 keys at a
// time), and where there are too few (request, KV head) pairs to keep every thread busy the
// context is split and the parts merged (flash-decoding). Optional: a sliding window (keys
// p - window < k <= p) and soft-capped scores (softcap * tanh(s / softcap)), as Gemma 2.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "vec.h"

namespace tokenmill {
namespace {

constexpr int64_t kKeysPerStep = 16;   // scores computed (and the max taken) per pass
constexpr int64_t kMinKeysPerPart = 64;  // a context is not split finer than this
constexpr int64_t kMaxGroup = 16;      // query heads per KV head
constexpr int64_t kMaxHead = 512;

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

// The same on AVX-512 (d a multiple of 16): each key and value row is loaded (and widened
// from bf16) once for all the group's query heads, scores as fused multiply-adds into one
// vector per head.
template <typename T>
TOKENMILL_AVX512_TARGET void attend_part_avx512(
    const float* q, int64_t group, int64_t d, const T* cache, const int64_t* blocks,
    int64_t block_size, int64_t kv_heads, int64_t kv_head, int64_t first, int64_t last,
    float softcap, float* acc, Part& part) {
  const int64_t row = kv_heads * d;
  const int64_t block_stride = 2 * block_size * row;
  for (int64_t g = 0; g < group; ++g) {
    part.max[g] = -std::numeric_limits<float>::infinity();
    part.sum[g] = 0.f;
  }
  std::fill(acc, acc + group * d, 0.f);
  float scores[kMaxGroup][kKeysPerStep];
  const T* rows[kKeysPerStep];
  for (int64_t start = first; start < last; start += kKeysPerStep) {
    const int64_t n = std::min(kKeysPerStep, last - start);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = start + t;
      rows[t] = cache + blocks[pos / block_size] * block_stride + (pos % block_size) * row +
                kv_head * d;
    }
    // The next step's keys and values are requested now: each block of the context lies
    // elsewhere in memory, where the hardware's prefetchers cannot guess it.
    const int64_t next = std::min(kKeysPerStep, last - start - n);
    for (int64_t t = 0; t < next; ++t) {
      const int64_t pos = start + n + t;
      const char* k = reinterpret_cast<const char*>(
          cache + blocks[pos / block_size] * block_stride + (pos % block_size) * row + kv_head * d);
      const char* v = k + block_size * row * sizeof(T);
      for (int64_t b = 0; b < d * int64_t(sizeof(T)); b += 64) {
        _mm_prefetch(k + b, _MM_HINT_T0);
        _mm_prefetch(v + b, _MM_HINT_T0);
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      __m512 dots[kMaxGroup];
      for (int64_t g = 0; g < group; ++g) dots[g] = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        const __m512 k = avx512::load(rows[t] + i);
        for (int64_t g = 0; g < group; ++g) {
          dots[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * d + i), k, dots[g]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float s = _mm512_reduce_add_ps(dots[g]);
        if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
        scores[g][t] = s;
      }
    }
    float weights[kMaxGroup][kKeysPerStep];
    const __mmask16 valid = n == 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, scores[g]);
      const float step_max = std::max(part.max[g], _mm512_reduce_max_ps(s));
      const float rescale = std::exp(part.max[g] - step_max);
      const __m512 w =
          _mm512_maskz_mov_ps(valid, avx512::exp(_mm512_sub_ps(s, _mm512_set1_ps(step_max))));
      _mm512_storeu_ps(weights[g], w);
      const float sum = part.sum[g] * rescale + _mm512_reduce_add_ps(w);
      if (rescale != 1.f) {
        const __m512 r = _mm512_set1_ps(rescale);
        for (int64_t i = 0; i < d; i += 16) {
          _mm512_storeu_ps(acc + g * d + i, _mm512_mul_ps(_mm512_loadu_ps(acc + g * d + i), r));
        }
      }
      part.max[g] = step_max;
      part.sum[g] = sum;
    }
    // Values: each 16 columns of the group's sums stay in registers across the step's keys.
    for (int64_t i = 0; i < d; i += 16) {
      __m512 sums[kMaxGroup];
      for (int64_t g = 0; g < group; ++g) sums[g] = _mm512_loadu_ps(acc + g * d + i);
      for (int64_t t = 0; t < n; ++t) {
        const __m512 vi = avx512::load(rows[t] + block_size * row + i);
        for (int64_t g = 0; g < group; ++g) {
          sums[g] = _mm512_fmadd_ps(_mm512_set1_ps(weights[g][t]), vi, sums[g]);
        }
      }
      for (int64_t g = 0; g < group; ++g) _mm512_storeu_ps(acc + g * d + i, sums[g]);
    }
  }
}

// The portable builds (AVX2, plain x86-64; AVX-512 runs attend_part_avx512).
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

template <typename T>
void write_rows(T* cache, const T* key, const T* value, const int64_t* slots, int64_t tokens,
                int64_t block_size, int64_t row) {
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    T* k = cache + (block * 2 * block_size + offset) * row;
    std::copy(key + t * row, key + (t + 1) * row, k);
    std::copy(value + t * row, value + (t + 1) * row, k + block_size * row);
  }
}

}  // namespace

void kv_cache_write(at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "kv_cache_write: the cache must be a contiguous [blocks, 2, block_size, kv_heads, "
              "d], got ", kv_cache.sizes());
  const int64_t block_size = kv_cache.size(2), row = kv_cache.size(3) * kv_cache.size(4);
  const at::Tensor k = key.contiguous(), v = value.contiguous();
  const at::Tensor s = slots.to(at::kLong).contiguous();
  const int64_t tokens = s.numel();
  TORCH_CHECK(k.numel() == tokens * row && v.numel() == tokens * row &&
                  k.scalar_type() == kv_cache.scalar_type() &&
                  v.scalar_type() == kv_cache.scalar_type(),
              "kv_cache_write: key/value must be [T, kv_heads, d] in the cache's dtype");
  const int64_t capacity = kv_cache.size(0) * block_size;
  const int64_t* sp = s.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "kv_cache_write: slot ", sp[t],
                " outside the cache's ", capacity);
  }
  if (kv_cache.scalar_type() == at::kBFloat16) {
    write_rows(kv_cache.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(),
               v.data_ptr<at::BFloat16>(), sp, tokens, block_size, row);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kFloat, "kv_cache_write: bf16 or fp32 only");
    write_rows(kv_cache.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), sp, tokens,
               block_size, row);
  }
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
  TORCH_CHECK(kv_cache.size(4) == d && d % 16 == 0 && d <= kMaxHead,
              "decode_attention: head size ", d, " must match the cache's and be a multiple of "
              "16 up to ", kMaxHead);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup,
              "decode_attention: ", heads, " query heads do not group over ", kv_heads,
              " KV heads (at most ", kMaxGroup, " per KV head)");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(),
              "decode_attention: query and cache dtypes differ");
  const int64_t group = heads / kv_heads;
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
  // Queries scaled once, in fp32.
  const at::Tensor q = (query.to(at::kFloat) * scale).contiguous();
  at::Tensor out = at::empty_like(query);

  // Enough parts that every thread has work, none shorter than kMinKeysPerPart keys.
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, len[b]);
  const int64_t threads = at::get_num_threads();
  const int64_t pairs = batch * kv_heads;
  int64_t parts = std::max<int64_t>(1, (2 * threads + batch - 1) / batch);
  parts = std::min(parts, std::max<int64_t>(1, longest / kMinKeysPerPart));
  std::vector<float> acc(pairs * parts * group * d);
  std::vector<Part> stats(pairs * parts);
  const float cap = static_cast<float>(softcap);
  // A task is (request, part of its context) and goes through every KV head: the heads' rows
  // of a position sit side by side, so the context is read from memory once (the heads after
  // the first find it in the caches).
  at::parallel_for(0, batch * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t b = job / parts, part = job % parts;
      const int64_t pair = b * kv_heads + h, task = pair * parts + part;
      int64_t first = window > 0 ? std::max<int64_t>(0, len[b] - window) : 0;
      const int64_t span = len[b] - first, per = (span + parts - 1) / parts;
      const int64_t lo = first + part * per, hi = std::min(len[b], lo + per);
      float* a = acc.data() + task * group * d;
      Part& s = stats[task];
      const float* qh = q.data_ptr<float>() + (b * heads + h * group) * d;
      const int64_t* blocks = table.data_ptr<int64_t>() + b * width;
      if (lo >= hi) {
        for (int64_t g = 0; g < group; ++g) {
          s.max[g] = -std::numeric_limits<float>::infinity();
          s.sum[g] = 0.f;
        }
        std::fill(a, a + group * d, 0.f);
        continue;
      }
      const bool avx512 = cpu_isa() >= 1;
      if (kv_cache.scalar_type() == at::kBFloat16) {
        const auto* cache = kv_cache.data_ptr<at::BFloat16>();
        if (avx512) {
          attend_part_avx512(qh, group, d, cache, blocks, block_size, kv_heads, h, lo, hi, cap,
                             a, s);
        } else {
          attend_part(qh, group, d, cache, blocks, block_size, kv_heads, h, lo, hi, cap, a, s);
        }
      } else {
        const float* cache = kv_cache.data_ptr<float>();
        if (avx512) {
          attend_part_avx512(qh, group, d, cache, blocks, block_size, kv_heads, h, lo, hi, cap,
                             a, s);
        } else {
          attend_part(qh, group, d, cache, blocks, block_size, kv_heads, h, lo, hi, cap, a, s);
        }
      }
    }
  });
  // Merge the parts of each (request, KV head): rescale each to the largest max, add, divide.
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(d);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / kv_heads, h = pair % kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < parts; ++p) top = std::max(top, stats[pair * parts + p].max[g]);
        std::fill(merged.begin(), merged.end(), 0.f);
        float total = 0.f;
        for (int64_t p = 0; p < parts; ++p) {
          const Part& s = stats[pair * parts + p];
          if (s.sum[g] == 0.f) continue;
          const float w = std::exp(s.max[g] - top);
          total += s.sum[g] * w;
          const float* a = acc.data() + ((pair * parts + p) * group + g) * d;
          for (int64_t i = 0; i < d; ++i) merged[i] += w * a[i];
        }
        const int64_t offset = (b * heads + h * group + g) * d;
        if (out.scalar_type() == at::kBFloat16) {
          auto* o = out.data_ptr<at::BFloat16>() + offset;
          for (int64_t i = 0; i < d; ++i) o[i] = from_float<at::BFloat16>(merged[i] / total);
        } else {
          float* o = out.data_ptr<float>() + offset;
          for (int64_t i = 0; i < d; ++i) o[i] = merged[i] / total;
        }
      }
    }
  });
  return out;
}

}  // namespace tokenmill
