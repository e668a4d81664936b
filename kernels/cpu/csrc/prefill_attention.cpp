// prefill_attention: causal attention for the requests still prefilling, reading their keys
// and values in place from the paged cache (this step's already written there), earlier
// context included (a later chunk of a prompt, a prefix-cache hit, a speculative verify).
//
// Request p's queries are the tokens [query_start[p], query_start[p + 1]) of query [T, heads,
// d]; after them it holds seq_lens[p] tokens, so its i-th query sits at position
// seq_lens[p] - q_len + i and sees keys k <= that position (and k > position - window with a
// sliding window). A task is (request, KV head, up to kQueriesPerTask queries): its keys and
// values are packed once, in chunks of kKeyChunk, into the microkernel's layout; each block of
// kQueryBlock queries (the group's query heads stacked as rows) then runs flash attention over
// the chunks it reaches: scores by one batch-reduce GEMM (oneDNN's microkernel through torch,
// AMX tiles where the CPU has them), an online softmax in fp32, values accumulated by a
// second GEMM. Threads take the tasks longest first, one at a time. bf16 multiplies bf16
// (probabilities rounded to bf16, as torch's CPU flash attention does) where oneDNN has a
// bf16 microkernel (AVX-512), else in fp32; fp32 in fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "vec.h"

namespace tokenmill {
namespace {

constexpr int64_t kQueryBlock = 32;  // query positions per pair of GEMMs
constexpr int64_t kKeyChunk = 128;   // keys per pair of GEMMs
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// One chunk's scores -> probabilities for rows [0, rows): scale, soft-cap, mask, then the
// online softmax's update of each row's max and sum; the accumulated values `acc` [rows, d]
// rescaled where a row's max grew. p [rows, width] gets exp(s - max) in the GEMM's type,
// zero where masked (and in the padding up to width).
template <typename P>
TOKENMILL_INLINE void softmax_chunk_impl(const float* scores, P* p, int64_t rows, int64_t width,
                                         int64_t keys, int64_t first_key, const int64_t* row_pos,
                                         int64_t window, float scale, float softcap,
                                         float* row_max, float* row_sum, float* acc, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = scores + r * width;
    P* pr = p + r * width;
    // The keys this row sees within the chunk: [lo, hi).
    const int64_t pos = row_pos[r];
    const int64_t hi = std::min<int64_t>(keys, pos - first_key + 1);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1 - first_key) : 0;
    float buf[kKeyChunk];
    float top = kNegInf;
    for (int64_t j = lo; j < hi; ++j) {
      float v = s[j] * scale;
      if (softcap > 0.f) v = softcap * std::tanh(v / softcap);
      buf[j] = v;
      top = std::max(top, v);
    }
    const float new_max = std::max(row_max[r], top);
    if (new_max == kNegInf) {  // nothing seen yet: the chunk adds nothing
      for (int64_t j = 0; j < width; ++j) pr[j] = from_float<P>(0.f);
      continue;
    }
    const float rescale = row_max[r] == kNegInf ? 0.f : exp_poly(row_max[r] - new_max);
    float sum = 0.f;
    for (int64_t j = 0; j < width; ++j) {
      float e = 0.f;
      if (j >= lo && j < hi) e = round_to<P>(exp_poly(buf[j] - new_max));
      pr[j] = from_float<P>(e);
      sum += e;
    }
    row_sum[r] = row_sum[r] * rescale + sum;
    if (rescale != 1.f) {
      float* a = acc + r * d;
      for (int64_t i = 0; i < d; ++i) a[i] *= rescale;
    }
    row_max[r] = new_max;
  }
}

// The same by hand on AVX-512 (width a multiple of 16, at most kKeyChunk): a row's vectors
// that hold keys it sees stay in registers between the max and the exponentials, and only the
// first and last of them are masked. `native`: probabilities rounded to bf16 by the CPU's own
// conversion (AVX512-BF16; it flushes values below 2^-126 to zero, which a probability
// rounded there loses nothing by).
template <bool native, typename P>
TOKENMILL_AVX512_INLINE void softmax_chunk_body(const float* scores, P* p, int64_t rows,
                                                int64_t width, int64_t keys, int64_t first_key,
                                                const int64_t* row_pos, int64_t window,
                                                float scale, float softcap, float* row_max,
                                                float* row_sum, float* acc, int64_t d) {
  constexpr int kVectors = kKeyChunk / 16;
  const __m512 neg_inf = _mm512_set1_ps(kNegInf), vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = scores + r * width;
    P* pr = p + r * width;
    const int64_t pos = row_pos[r];
    const int64_t hi = std::min<int64_t>(keys, pos - first_key + 1);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1 - first_key) : 0;
    if (hi <= lo) {  // no key of the chunk: it adds nothing
      for (int64_t j = 0; j < width; j += 16) avx512::store(pr + j, _mm512_setzero_ps());
      continue;
    }
    // The vectors [v0, v0 + n) hold the keys [lo, hi); the others are zero.
    const int64_t v0 = lo / 16 * 16, n = (round_up(hi, 16) - v0) / 16;
    for (int64_t j = 0; j < v0; j += 16) avx512::store(pr + j, _mm512_setzero_ps());
    for (int64_t j = v0 + 16 * n; j < width; j += 16) avx512::store(pr + j, _mm512_setzero_ps());
    const __mmask16 first_mask = __mmask16(0xffffu << (lo - v0));
    const __mmask16 last_mask = avx512::first(hi - (v0 + 16 * (n - 1)));
    __m512 v[kVectors];
    __m512 top = neg_inf;
#pragma GCC unroll 8
    for (int t = 0; t < kVectors; ++t) {
      if (t >= n) break;
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + v0 + 16 * t), vscale);
      if (softcap > 0.f) {  // softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1)
        const __m512 e = avx512::exp(_mm512_mul_ps(x, _mm512_set1_ps(2.f / softcap)));
        const __m512 th = _mm512_sub_ps(
            _mm512_set1_ps(1.f),
            _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
        x = _mm512_mul_ps(th, _mm512_set1_ps(softcap));
      }
      __mmask16 seen = t == 0 ? first_mask : __mmask16(0xffff);
      if (t == n - 1) seen &= last_mask;
      v[t] = _mm512_mask_mov_ps(neg_inf, seen, x);
      top = _mm512_max_ps(top, v[t]);
    }
    const float new_max = std::max(row_max[r], _mm512_reduce_max_ps(top));
    const float rescale = row_max[r] == kNegInf ? 0.f : std::exp(row_max[r] - new_max);
    const __m512 vmax = _mm512_set1_ps(new_max);
    __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int t = 0; t < kVectors; ++t) {
      if (t >= n) break;
      // exp(-inf) is 0 here (the exponent's floor), masked to 0 exactly.
      const __mmask16 seen = _mm512_cmp_ps_mask(v[t], neg_inf, _CMP_NEQ_OQ);
      __m512 e = _mm512_maskz_mov_ps(seen, avx512::exp(_mm512_sub_ps(v[t], vmax)));
      if constexpr (native && std::is_same<P, at::BFloat16>::value) {
        const __m256i h = avx512::bf16_native(e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + v0 + 16 * t), h);
        e = avx512::widen(h);
      } else {
        e = avx512::round_to<P>(e);
        avx512::store(pr + v0 + 16 * t, e);
      }
      sum = _mm512_add_ps(sum, e);
    }
    row_sum[r] = row_sum[r] * rescale + _mm512_reduce_add_ps(sum);
    if (rescale != 1.f) {
      float* a = acc + r * d;
      const __m512 f = _mm512_set1_ps(rescale);
      for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 m = avx512::first(d - i);
        avx512::store(a + i, _mm512_mul_ps(avx512::load(a + i, m), f), m);
      }
    }
    row_max[r] = new_max;
  }
}

#define TOKENMILL_SOFTMAX_PARAMS                                                             \
  const float *scores, P *p, int64_t rows, int64_t width, int64_t keys, int64_t first_key,   \
      const int64_t *row_pos, int64_t window, float scale, float softcap, float *row_max,    \
      float *row_sum, float *acc, int64_t d
#define TOKENMILL_SOFTMAX_ARGS \
  scores, p, rows, width, keys, first_key, row_pos, window, scale, softcap, row_max, row_sum, acc, d

template <typename P>
TOKENMILL_AVX512_TARGET void softmax_chunk_avx512(TOKENMILL_SOFTMAX_PARAMS) {
  if (cpu_isa() >= 2) {
    softmax_chunk_body<true>(TOKENMILL_SOFTMAX_ARGS);
  } else {
    softmax_chunk_body<false>(TOKENMILL_SOFTMAX_ARGS);
  }
}

TOKENMILL_ISA_PORTABLE_VARIANTS(softmax_chunk, (const float* scores, at::BFloat16* p,
                                                int64_t rows, int64_t width, int64_t keys,
                                                int64_t first_key, const int64_t* row_pos,
                                                int64_t window, float scale, float softcap,
                                                float* row_max, float* row_sum, float* acc,
                                                int64_t d),
                                (scores, p, rows, width, keys, first_key, row_pos, window, scale,
                                 softcap, row_max, row_sum, acc, d))
TOKENMILL_ISA_PORTABLE_VARIANTS(softmax_chunk, (const float* scores, float* p, int64_t rows,
                                                int64_t width, int64_t keys, int64_t first_key,
                                                const int64_t* row_pos, int64_t window,
                                                float scale, float softcap, float* row_max,
                                                float* row_sum, float* acc, int64_t d),
                                (scores, p, rows, width, keys, first_key, row_pos, window, scale,
                                 softcap, row_max, row_sum, acc, d))

// dst = src * factor, rounded to the element type.
template <typename T>
TOKENMILL_INLINE void scaled_row_impl(const float* src, float factor, T* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = from_float<T>(src[i] * factor);
}

template <typename T>
TOKENMILL_AVX512_TARGET void scaled_row_avx512(const float* src, float factor, T* dst,
                                               int64_t d) {
  const __m512 f = _mm512_set1_ps(factor);
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = avx512::first(d - i);
    avx512::store(dst + i, _mm512_mul_ps(avx512::load(src + i, m), f), m);
  }
}

TOKENMILL_ISA_PORTABLE_VARIANTS(scaled_row, (const float* src, float factor, at::BFloat16* dst,
                                             int64_t d),
                                (src, factor, dst, d))
TOKENMILL_ISA_PORTABLE_VARIANTS(scaled_row, (const float* src, float factor, float* dst,
                                             int64_t d),
                                (src, factor, dst, d))

template <typename C, typename T>
TOKENMILL_INLINE C as(T v) {
  return from_float<C>(to_float(v));
}

// Where a position's key (its value is block_size rows further) lies in the cache.
template <typename T>
struct Pages {
  const T* cache;
  const int64_t* blocks;
  int64_t block_size, row, kv_head, d;
  const T* key(int64_t pos) const {
    return cache + blocks[pos / block_size] * 2 * block_size * row + (pos % block_size) * row +
           kv_head * d;
  }
  const T* value(int64_t pos) const { return key(pos) + block_size * row; }
};

// 16 rows of 16 32-bit words -> their transpose, in place (four rounds of shuffles).
TOKENMILL_AVX512_INLINE void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // r[4i + k], 128-bit lane l: rows 4i..4i+3 of column 4l + k.
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
    t[8 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
    r[4 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(t[4 + k], t[12 + k], 0xdd);
  }
}

// pack_chunk's bf16 layouts on AVX-512 (d a multiple of 32): keys 16 at a time, their 32-bit
// pairs of dims transposed in blocks of 16; values' pairs of keys by widening one row and
// shifting the other into the high halves. Keys and values past `keys` are left to the caller.
template <typename T>
TOKENMILL_AVX512_TARGET void pack_bf16_avx512(const Pages<T>& pages, int64_t first,
                                              int64_t keys, int64_t width, uint32_t* k32,
                                              uint32_t* v32) {
  const int64_t words = pages.d / 2;
  int64_t j = 0;
  for (; j + 16 <= keys; j += 16) {
    const uint32_t* src[16];
    for (int t = 0; t < 16; ++t) src[t] = reinterpret_cast<const uint32_t*>(pages.key(first + j + t));
    for (int64_t c = 0; c < words; c += 16) {
      __m512i r[16];
      for (int t = 0; t < 16; ++t) r[t] = _mm512_loadu_si512(src[t] + c);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(k32 + (c + i) * width + j, r[i]);
    }
  }
  for (; j < keys; ++j) {
    const auto* src = reinterpret_cast<const uint32_t*>(pages.key(first + j));
    for (int64_t i = 0; i < words; ++i) k32[i * width + j] = src[i];
  }
  for (int64_t jj = 0; jj < keys; jj += 2) {
    const auto* v0 = reinterpret_cast<const __m256i*>(pages.value(first + jj));
    const __m256i* v1 =
        jj + 1 < keys ? reinterpret_cast<const __m256i*>(pages.value(first + jj + 1)) : nullptr;
    uint32_t* dst = v32 + (jj / 2) * pages.d;
    for (int64_t i = 0; i < pages.d / 16; ++i) {
      __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(v0 + i));
      if (v1 != nullptr) {
        w = _mm512_or_si512(w, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(v1 + i)), 16));
      }
      _mm512_storeu_si512(dst + 16 * i, w);
    }
  }
}

// Keys [first, first + keys) packed as the scores GEMM's B ([d, width]: in pairs of d for the
// bf16 microkernel, [d / 2, width, 2]) and values as the second GEMM's B ([width, d], pairs of
// keys for bf16: [width / 2, d, 2]); columns and rows past `keys` are zero.
template <typename C, typename T>
void pack_chunk(const Pages<T>& pages, int64_t first, int64_t keys, int64_t width, bool vnni,
                C* kp, C* vp) {
  const int64_t d = pages.d;
  std::fill(kp, kp + d * width, from_float<C>(0.f));
  std::fill(vp + keys * d, vp + width * d, from_float<C>(0.f));
  if constexpr (std::is_same<C, at::BFloat16>::value && std::is_same<T, at::BFloat16>::value) {
    // A key's pair of dims (i, i + 1) is one 32-bit word, so the keys' pairs are a transpose
    // of 32-bit words; a value's pairs of keys interleave two rows.
    TORCH_CHECK(vnni, "prefill_attention: bf16 products in bf16 take the paired layout");
    auto* k32 = reinterpret_cast<uint32_t*>(kp);
    if (cpu_isa() >= 1 && d % 32 == 0) {
      pack_bf16_avx512(pages, first, keys, width, k32, reinterpret_cast<uint32_t*>(vp));
      return;
    }
    for (int64_t j = 0; j < keys; ++j) {
      const auto* src = reinterpret_cast<const uint32_t*>(pages.key(first + j));
      for (int64_t i = 0; i < d / 2; ++i) k32[i * width + j] = src[i];
    }
    for (int64_t j = 0; j < keys; j += 2) {
      const T* v0 = pages.value(first + j);
      const T* v1 = j + 1 < keys ? pages.value(first + j + 1) : nullptr;
      C* dst = vp + (j / 2) * d * 2;
      for (int64_t i = 0; i < d; ++i) {
        dst[2 * i] = v0[i];
        dst[2 * i + 1] = v1 != nullptr ? v1[i] : from_float<C>(0.f);
      }
    }
  } else if (vnni) {  // bf16 products of another cache type (fp8): widened, then paired
    for (int64_t j = 0; j < keys; ++j) {
      const T* k = pages.key(first + j);
      const T* v = pages.value(first + j);
      for (int64_t i = 0; i < d; ++i) {
        kp[((i / 2) * width + j) * 2 + i % 2] = as<C>(k[i]);
        vp[((j / 2) * d + i) * 2 + j % 2] = as<C>(v[i]);
      }
    }
    if (keys % 2) {  // the last pair's second key: zero
      for (int64_t i = 0; i < d; ++i) vp[((keys / 2) * d + i) * 2 + 1] = from_float<C>(0.f);
    }
  } else {
    for (int64_t j = 0; j < keys; ++j) {
      const T* k = pages.key(first + j);
      const T* v = pages.value(first + j);
      for (int64_t i = 0; i < d; ++i) {
        kp[i * width + j] = as<C>(k[i]);
        vp[j * d + i] = as<C>(v[i]);
      }
    }
  }
}

// A task: (request, KV head, up to kQueriesPerTask of the request's queries from
// first_query). Its keys are packed once and serve each of its blocks of kQueryBlock queries.
constexpr int64_t kQueriesPerTask = 256;

struct Task {
  int64_t request, kv_head, first_query;  // first_query: within the request's chunk
};

// C: the products' type, T: the queries' and outputs', K: the cache's (T's own, or fp8).
template <typename C, typename T, typename K = T>
void run_tasks(const std::vector<Task>& tasks, at::Tensor& out, const at::Tensor& query,
               const at::Tensor& kv_cache, const int64_t* table, int64_t width_blocks,
               const int64_t* starts, const int64_t* lens, float scale, int64_t window,
               float softcap, bool vnni) {
  const int64_t heads = query.size(1), d = query.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  const int64_t group = heads / kv_heads, q_stride = query.stride(0), o_stride = out.stride(0);
  const T* q_all = query.data_ptr<T>();
  T* out_all = out.data_ptr<T>();
  const K* cache = kv_cache.data_ptr<K>();
  // Threads take the tasks (longest first, see prefill_attention) one at a time as they
  // finish the one before: their costs differ by the requests' lengths.
  std::atomic<int64_t> next{0};
  const int64_t count = int64_t(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    // Rows rounded up to 16 and chunks packed at their full width: oneDNN compiles a
    // microkernel per shape, and a few dozen shapes then serve every step.
    const int64_t max_rows = round_up(kQueryBlock * group, 16);
    std::vector<C> qbuf(max_rows * d), kp, vp, p(max_rows * kKeyChunk);
    std::vector<float> scores(max_rows * kKeyChunk), acc(max_rows * d), row_max(max_rows),
        row_sum(max_rows);
    std::vector<int64_t> row_pos(max_rows);
    for (int64_t t = next++; t < count; t = next++) {
      const Task& task = tasks[t];
      const int64_t b = task.request, h = task.kv_head;
      const int64_t q_len = starts[b + 1] - starts[b], context = lens[b] - q_len;
      const int64_t task_queries = std::min(kQueriesPerTask, q_len - task.first_query);
      // The task's keys [origin, last), packed in chunks of kKeyChunk from origin.
      const int64_t last = context + task.first_query + task_queries;
      const int64_t origin =
          window > 0 ? std::max<int64_t>(0, context + task.first_query - window + 1) : 0;
      const int64_t chunks = (last - origin + kKeyChunk - 1) / kKeyChunk;
      kp.resize(chunks * kKeyChunk * d);
      vp.resize(chunks * kKeyChunk * d);
      const Pages<K> pages{cache, table + b * width_blocks, block_size, kv_heads * d, h, d};
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t k0 = origin + c * kKeyChunk, keys = std::min(kKeyChunk, last - k0);
        pack_chunk<C, K>(pages, k0, keys, kKeyChunk, vnni, kp.data() + c * kKeyChunk * d,
                         vp.data() + c * kKeyChunk * d);
      }
      for (int64_t q0 = task.first_query; q0 < task.first_query + task_queries;
           q0 += kQueryBlock) {
        const int64_t nq = std::min(kQueryBlock, task.first_query + task_queries - q0);
        const int64_t rows = round_up(nq * group, 16);  // the rows past nq * group: padding
        // Rows head-major: row g * nq + i is query head h * group + g at the block's i-th
        // token.
        for (int64_t g = 0; g < group; ++g) {
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t token = starts[b] + q0 + i, r = g * nq + i;
            const T* src = q_all + token * q_stride + (h * group + g) * d;
            if constexpr (std::is_same<C, T>::value) {
              std::memcpy(qbuf.data() + r * d, src, d * sizeof(T));
            } else {
              for (int64_t e = 0; e < d; ++e) qbuf[r * d + e] = as<C>(src[e]);
            }
            row_pos[r] = context + q0 + i;
          }
        }
        for (int64_t r = nq * group; r < rows; ++r) {  // zero, at no position: they see no key
          std::fill(qbuf.begin() + r * d, qbuf.begin() + (r + 1) * d, from_float<C>(0.f));
          row_pos[r] = -1;
        }
        std::fill(row_max.begin(), row_max.begin() + rows, kNegInf);
        std::fill(row_sum.begin(), row_sum.begin() + rows, 0.f);
        std::fill(acc.begin(), acc.begin() + rows * d, 0.f);
        // The chunks holding keys [first, end) of this block's queries.
        const int64_t end_key = context + q0 + nq;
        const int64_t first = window > 0 ? std::max<int64_t>(0, context + q0 - window + 1) : 0;
        for (int64_t c = (first - origin) / kKeyChunk; origin + c * kKeyChunk < end_key; ++c) {
          // The keys this block reaches in the chunk (packed kKeyChunk columns wide).
          const int64_t k0 = origin + c * kKeyChunk;
          const int64_t keys = std::min(kKeyChunk, end_key - k0), width = round_up(keys, 16);
          const C* kc = kp.data() + c * kKeyChunk * d;
          const C* vc = vp.data() + c * kKeyChunk * d;
          at::native::cpublas::brgemm(rows, width, d, d, kKeyChunk, width, false, qbuf.data(), kc,
                                      scores.data(), vnni);
          softmax_chunk(scores.data(), p.data(), rows, width, keys, k0, row_pos.data(), window,
                        scale, softcap, row_max.data(), row_sum.data(), acc.data(), d);
          at::native::cpublas::brgemm(rows, d, width, width, d, d, true, p.data(), vc,
                                      acc.data(), vnni);
        }
        for (int64_t g = 0; g < group; ++g) {
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t token = starts[b] + q0 + i, r = g * nq + i;
            T* dst = out_all + token * o_stride + (h * group + g) * d;
            scaled_row(acc.data() + r * d, row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f, dst, d);
          }
        }
      }
    }
    at::native::cpublas::brgemm_release(vnni);
  });
}

}  // namespace

void prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                       const at::Tensor& block_table, const at::Tensor& query_start,
                       const at::Tensor& seq_lens, double scale, int64_t window,
                       double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "prefill_attention: query must be [T, heads, d] with each token's heads "
              "contiguous, got sizes ", query.sizes(), " strides ", query.strides());
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2) && out.scalar_type() == query.scalar_type(),
              "prefill_attention: out must be shaped as the query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "prefill_attention: the cache must be a contiguous [blocks, 2, block_size, "
              "kv_heads, d]");
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((query.scalar_type() == kv_cache.scalar_type() || fp8) &&
                  (query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kFloat),
              "prefill_attention: query and cache must both be bf16 or fp32 (or the cache fp8)");
  const int64_t heads = query.size(1), d = query.size(2);
  const int64_t block_size = kv_cache.size(2), kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == d && d % 2 == 0, "prefill_attention: head size ", d,
              " must be even and match the cache's");
  TORCH_CHECK(heads % kv_heads == 0, "prefill_attention: ", heads,
              " query heads do not group over ", kv_heads, " KV heads");
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor starts = query_start.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  const int64_t requests = lens.numel();
  TORCH_CHECK(starts.numel() == requests + 1 && table.dim() == 2 && table.size(0) >= requests,
              "prefill_attention: one block table row and length per request, and its "
              "queries' start (and the end)");
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t width_blocks = table.size(1);
  std::vector<Task> tasks;
  for (int64_t b = 0; b < requests; ++b) {
    const int64_t q_len = s[b + 1] - s[b];
    TORCH_CHECK(q_len >= 0 && s[b] >= 0 && s[b + 1] <= query.size(0) && len[b] >= q_len &&
                    len[b] <= width_blocks * block_size,
                "prefill_attention: request ", b, " has ", q_len, " queries at ", s[b],
                " and length ", len[b], " for ", width_blocks, " blocks of ", block_size);
    for (int64_t first = 0; first < q_len; first += kQueriesPerTask) {
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({b, h, first});
    }
  }
  if (tasks.empty()) return;
  // A task's cost grows with its queries times the keys they see.
  auto cost = [&](const Task& t) {
    const int64_t q_len = s[t.request + 1] - s[t.request];
    const int64_t n = std::min(kQueriesPerTask, q_len - t.first_query);
    return n * (len[t.request] - q_len + t.first_query + n);
  };
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](const Task& a, const Task& b) { return cost(a) > cost(b); });
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t* tb = table.data_ptr<int64_t>();
  using F8 = at::Float8_e4m3fn;
  if (fp8 && query.scalar_type() == at::kFloat) {
    run_tasks<float, float, F8>(tasks, out, query, kv_cache, tb, width_blocks, s, len, sc, window,
                                cap, false);
  } else if (fp8 && cpu_isa() >= 1) {
    run_tasks<at::BFloat16, at::BFloat16, F8>(tasks, out, query, kv_cache, tb, width_blocks, s,
                                              len, sc, window, cap, true);
  } else if (fp8) {
    run_tasks<float, at::BFloat16, F8>(tasks, out, query, kv_cache, tb, width_blocks, s, len, sc,
                                       window, cap, false);
  } else if (query.scalar_type() == at::kFloat) {
    run_tasks<float, float>(tasks, out, query, kv_cache, tb, width_blocks, s, len, sc, window,
                            cap, false);
  } else if (cpu_isa() >= 1) {  // oneDNN's bf16 microkernel needs AVX-512
    run_tasks<at::BFloat16, at::BFloat16>(tasks, out, query, kv_cache, tb, width_blocks, s, len,
                                          sc, window, cap, true);
  } else {
    run_tasks<float, at::BFloat16>(tasks, out, query, kv_cache, tb, width_blocks, s, len, sc,
                                   window, cap, false);
  }
}

}  // namespace tokenmill
