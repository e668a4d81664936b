// lora_shrink / lora_expand: the batched LoRA matmuls in which each row runs its own adapter
// (vLLM's punica ops, S-LoRA's SGMV), on rows grouped by slot as worker/lora/punica.py's
// LoRAMapping groups them: slot s's rows are sorted_rows[starts[s] : starts[s + 1]].
//   lora_shrink: y [T, R] fp32, y[t] = scale[s] * x[t] @ A[s]^T (zeros for rows of no slot)
//   lora_expand: out[t, offset : offset + N] += y[t] @ B[s]^T, the sum rounded to out's dtype
//                once (rows of no slot untouched)
// A task is a block of one slot's rows (and, in the expand, a block of output columns), so a
// prefill chunk's rows of one adapter share each load of its weights; tasks split across the
// engine's threads (at::parallel_for). On AVX-512 the loops are ours (bf16 dot products where
// the CPU has them); the AVX2 and plain builds compile portable loops (vec.h). A row's results
// do not depend on the rows beside it. decode_layers runs the same work on raw rows
// (lora_shrink_rows, lora_expand_rows), its arguments checked once a step.
// Measured on 2 Zen 4 cores against punica.py's torch ops, bf16, SmolLM2-135M's q/k/v (576 ->
// 576 + 192 + 192, three expands), rank 16, 8 slots: one decode row 5 against 25 us (shrink)
// and 18 against 83 us (expands, mostly the ops' call overhead); 64 decode rows over 4 slots
// 17 against 178 us and 35 against 405 us; 300 prefill rows of 2 adapters 59 against 190 us
// and 74 against 480 us. The AVX2 build's shrink, one row's dot products at a time, is 2-3x
// slower than torch's sgemm at 300 rows (faster at decode sizes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "vec.h"

namespace tokenmill {
namespace {

// Rows whose dot products share each load of A's row on AVX-512 (an accumulator vector each).
constexpr int kShrinkGroup = 4;
// Rows of a slot per shrink task: a few tasks for a prefill chunk's rows, one for a decode's.
constexpr int64_t kShrinkRows = 16;
// Output columns and rows per expand task (B's block transposed into 64 x R floats, 4 KB at
// rank 16); blocks of rows keep both threads busy on a prefill chunk's narrow k/v slices.
constexpr int64_t kExpandCols = 64;
constexpr int64_t kExpandRows = 256;
// Below this many multiply-adds a call runs on the calling thread (waking the pool costs more).
constexpr int64_t kSerialWork = 1 << 16;

// x . w over k values in 16 running sums (one row at a time: the compiler vectorizes this
// loop, not one over several rows' sums).
template <typename T>
TOKENMILL_INLINE float dot(const T* x, const T* w, int64_t k) {
  float sums[16] = {};
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    for (int j = 0; j < 16; ++j) sums[j] += to_float(x[i + j]) * to_float(w[i + j]);
  }
  for (; i < k; ++i) sums[0] += to_float(x[i]) * to_float(w[i]);
  float total = 0.f;
  for (float s : sums) total += s;
  return total;
}

// y rows ys[m] [rank] = scale * x rows xs[m] [k] @ a^T, for M rows.
template <int M, typename T>
TOKENMILL_INLINE void shrink_group(const T* const* xs, const T* a, int64_t rank, int64_t k,
                                   float scale, float* const* ys) {
  for (int m = 0; m < M; ++m) {
    for (int64_t r = 0; r < rank; ++r) ys[m][r] = scale * dot(xs[m], a + r * k, k);
  }
}

// The same by hand on AVX-512 for M rows at once (sharing each load of A's row): 16 products
// per fused multiply-add, bf16 widened to fp32.
template <int M, typename T>
TOKENMILL_AVX512_TARGET void shrink_group_avx512(const T* const* xs, const T* a, int64_t rank,
                                                 int64_t k, float scale, float* const* ys) {
  const __mmask16 tail = avx512::first(k % 16);
  for (int64_t r = 0; r < rank; ++r) {
    const T* ar = a + r * k;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
      const __m512 w = avx512::load(ar + i);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(avx512::load(xs[m] + i), w, acc[m]);
    }
    if (i < k) {
      const __m512 w = avx512::load(ar + i, tail);
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm512_fmadd_ps(avx512::load(xs[m] + i, tail), w, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) ys[m][r] = scale * _mm512_reduce_add_ps(acc[m]);
  }
}

// The same for bf16 on CPUs with AVX512-BF16: 32 products per vdpbf16ps (x's and A's rows both
// hold pairs of k side by side), K's tail masked.
template <int M>
__attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw"))) void shrink_group_dpbf16(
    const at::BFloat16* const* xs, const at::BFloat16* a, int64_t rank, int64_t k, float scale,
    float* const* ys) {
  const __mmask32 tail = static_cast<__mmask32>((1ull << (k % 32)) - 1);
  for (int64_t r = 0; r < rank; ++r) {
    const at::BFloat16* ar = a + r * k;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(ar + i);
      for (int m = 0; m < M; ++m) {
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(xs[m] + i), w);
      }
    }
    if (i < k) {
      const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(tail, ar + i);
      for (int m = 0; m < M; ++m) {
        const __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(tail, xs[m] + i);
        acc[m] = _mm512_dpbf16_ps(acc[m], v, w);
      }
    }
    for (int m = 0; m < M; ++m) ys[m][r] = scale * _mm512_reduce_add_ps(acc[m]);
  }
}

// Which of the three group loops above a build runs.
enum class Dot { kPlain, kAvx512, kDpBf16 };

template <Dot D, int M, typename T>
TOKENMILL_INLINE void shrink_group_by(const T* const* xs, const T* a, int64_t rank, int64_t k,
                                      float scale, float* const* ys) {
  if constexpr (D == Dot::kDpBf16) {
    shrink_group_dpbf16<M>(xs, a, rank, k, scale, ys);
  } else if constexpr (D == Dot::kAvx512) {
    shrink_group_avx512<M>(xs, a, rank, k, scale, ys);
  } else {
    shrink_group<M>(xs, a, rank, k, scale, ys);
  }
}

// A slot's rows, kShrinkGroup at a time, then one at a time.
template <Dot D, typename T>
TOKENMILL_INLINE void shrink_rows_by(const T* x, int64_t k, const int64_t* rows, int64_t count,
                                     const T* a, int64_t rank, float scale, float* y) {
  const T* xs[kShrinkGroup];
  float* ys[kShrinkGroup];
  int64_t i = 0;
  for (; i + kShrinkGroup <= count; i += kShrinkGroup) {
    for (int m = 0; m < kShrinkGroup; ++m) {
      xs[m] = x + rows[i + m] * k;
      ys[m] = y + rows[i + m] * rank;
    }
    shrink_group_by<D, kShrinkGroup>(xs, a, rank, k, scale, ys);
  }
  for (; i < count; ++i) {
    xs[0] = x + rows[i] * k;
    ys[0] = y + rows[i] * rank;
    shrink_group_by<D, 1>(xs, a, rank, k, scale, ys);
  }
}

template <typename T>
TOKENMILL_INLINE void shrink_rows_impl(const T* x, int64_t k, const int64_t* rows, int64_t count,
                                       const T* a, int64_t rank, float scale, float* y) {
  shrink_rows_by<Dot::kPlain>(x, k, rows, count, a, rank, scale, y);
}

void shrink_rows_avx512(const at::BFloat16* x, int64_t k, const int64_t* rows, int64_t count,
                        const at::BFloat16* a, int64_t rank, float scale, float* y) {
  if (cpu_isa() >= 2) {
    shrink_rows_by<Dot::kDpBf16>(x, k, rows, count, a, rank, scale, y);
  } else {
    shrink_rows_by<Dot::kAvx512>(x, k, rows, count, a, rank, scale, y);
  }
}

void shrink_rows_avx512(const float* x, int64_t k, const int64_t* rows, int64_t count,
                        const float* a, int64_t rank, float scale, float* y) {
  shrink_rows_by<Dot::kAvx512>(x, k, rows, count, a, rank, scale, y);
}

TOKENMILL_ISA_PORTABLE_VARIANTS(shrink_rows, (const at::BFloat16* x, int64_t k,
                                              const int64_t* rows, int64_t count,
                                              const at::BFloat16* a, int64_t rank, float scale,
                                              float* y),
                                (x, k, rows, count, a, rank, scale, y))
TOKENMILL_ISA_PORTABLE_VARIANTS(shrink_rows, (const float* x, int64_t k, const int64_t* rows,
                                              int64_t count, const float* a, int64_t rank,
                                              float scale, float* y),
                                (x, k, rows, count, a, rank, scale, y))

// b [cols, rank] (cols <= kExpandCols) transposed into bt [rank, kExpandCols], zeros past cols.
template <typename T>
TOKENMILL_INLINE void transpose_block(const T* b, int64_t rank, int64_t cols, float* bt) {
  std::fill(bt, bt + rank * kExpandCols, 0.f);
  for (int64_t j = 0; j < cols; ++j) {
    for (int64_t r = 0; r < rank; ++r) bt[r * kExpandCols + j] = to_float(b[j * rank + r]);
  }
}

// out rows (at out + row * out_stride) += y rows @ b^T for b [cols, rank], through bt.
template <typename T>
TOKENMILL_INLINE void expand_cols_impl(const float* y, int64_t y_stride, const int64_t* rows,
                                       int64_t count, const T* b, int64_t rank, int64_t cols,
                                       float* bt, T* out, int64_t out_stride) {
  transpose_block(b, rank, cols, bt);
  for (int64_t i = 0; i < count; ++i) {
    const float* yr = y + rows[i] * y_stride;
    float acc[kExpandCols] = {};
    for (int64_t r = 0; r < rank; ++r) {
      const float v = yr[r];
      const float* br = bt + r * kExpandCols;
      for (int64_t j = 0; j < kExpandCols; ++j) acc[j] += v * br[j];
    }
    T* o = out + rows[i] * out_stride;
    for (int64_t j = 0; j < cols; ++j) o[j] = from_float<T>(to_float(o[j]) + acc[j]);
  }
}

// The same by hand on AVX-512 for M rows at once: their M x 64 sums stay in registers while
// each row of bt is loaded once.
constexpr int kExpandGroup = 4;
constexpr int kExpandVecs = kExpandCols / 16;

template <int M, typename T>
TOKENMILL_AVX512_INLINE void expand_group_avx512(const float* const* ys, const float* bt,
                                                 int64_t rank, int64_t cols, T* const* outs,
                                                 bool native) {
  __m512 acc[M][kExpandVecs];
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < kExpandVecs; ++v) acc[m][v] = _mm512_setzero_ps();
  }
  for (int64_t r = 0; r < rank; ++r) {
    __m512 w[kExpandVecs];
    for (int v = 0; v < kExpandVecs; ++v) w[v] = _mm512_loadu_ps(bt + r * kExpandCols + 16 * v);
    for (int m = 0; m < M; ++m) {
      const __m512 yv = _mm512_set1_ps(ys[m][r]);
      for (int v = 0; v < kExpandVecs; ++v) acc[m][v] = _mm512_fmadd_ps(yv, w[v], acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < kExpandVecs && 16 * v < cols; ++v) {
      const __mmask16 valid = avx512::first(cols - 16 * v);
      T* o = outs[m] + 16 * v;
      avx512::store(o, _mm512_add_ps(avx512::load(o, valid), acc[m][v]), valid, native);
    }
  }
}

// v[0..15] (rows of 16 floats) transposed in place: v[j] lane i <- v[i] lane j.
TOKENMILL_AVX512_INLINE void transpose16(__m512* v) {
  // Pairs of rows interleaved, then fours: u[4 * g + q] holds, per 128-bit quarter L, element
  // 4L + q of rows 4g .. 4g + 3.
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {
    const __m512* p = t + 4 * g;  // rows 4g, 4g + 1 (lo, hi), then 4g + 2, 4g + 3
    u[4 * g + 0] = _mm512_shuffle_ps(p[0], p[2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * g + 1] = _mm512_shuffle_ps(p[0], p[2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * g + 2] = _mm512_shuffle_ps(p[1], p[3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * g + 3] = _mm512_shuffle_ps(p[1], p[3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // The quarters: element 4L + q of all 16 rows from quarter L of u[q], u[4 + q], u[8 + q],
  // u[12 + q].
  for (int q = 0; q < 4; ++q) {
    const __m512 a = _mm512_shuffle_f32x4(u[q], u[4 + q], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 b = _mm512_shuffle_f32x4(u[q], u[4 + q], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 c = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 d = _mm512_shuffle_f32x4(u[8 + q], u[12 + q], _MM_SHUFFLE(3, 1, 3, 1));
    v[q] = _mm512_shuffle_f32x4(a, c, _MM_SHUFFLE(2, 0, 2, 0));
    v[8 + q] = _mm512_shuffle_f32x4(a, c, _MM_SHUFFLE(3, 1, 3, 1));
    v[4 + q] = _mm512_shuffle_f32x4(b, d, _MM_SHUFFLE(2, 0, 2, 0));
    v[12 + q] = _mm512_shuffle_f32x4(b, d, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// transpose_block on AVX-512, 16 x 16 values at a time: at a decode's 16 rows a slot the
// scalar loop took 30% of an expand (64 rows over 4 slots, 1536 columns: 72 -> 51 us on one
// core).
template <typename T>
TOKENMILL_AVX512_INLINE void transpose_block_avx512(const T* b, int64_t rank, int64_t cols,
                                                    float* bt) {
  for (int64_t r0 = 0; r0 < rank; r0 += 16) {
    const __mmask16 ranks = avx512::first(rank - r0);
    for (int64_t j0 = 0; j0 < kExpandCols; j0 += 16) {
      __m512 v[16];
      for (int j = 0; j < 16; ++j) {
        const T* row = b + (j0 + j) * rank + r0;
        v[j] = j0 + j < cols ? avx512::load(row, ranks) : _mm512_setzero_ps();
      }
      transpose16(v);
      for (int r = 0; r < 16 && r0 + r < rank; ++r) {
        _mm512_storeu_ps(bt + (r0 + r) * kExpandCols + j0, v[r]);
      }
    }
  }
}

template <typename T>
TOKENMILL_AVX512_TARGET void expand_cols_avx512(const float* y, int64_t y_stride,
                                                const int64_t* rows, int64_t count, const T* b,
                                                int64_t rank, int64_t cols, float* bt, T* out,
                                                int64_t out_stride) {
  transpose_block_avx512(b, rank, cols, bt);
  const bool native = cpu_isa() >= 2;
  const float* ys[kExpandGroup];
  T* outs[kExpandGroup];
  int64_t i = 0;
  for (; i + kExpandGroup <= count; i += kExpandGroup) {
    for (int m = 0; m < kExpandGroup; ++m) {
      ys[m] = y + rows[i + m] * y_stride;
      outs[m] = out + rows[i + m] * out_stride;
    }
    expand_group_avx512<kExpandGroup>(ys, bt, rank, cols, outs, native);
  }
  for (; i < count; ++i) {
    ys[0] = y + rows[i] * y_stride;
    outs[0] = out + rows[i] * out_stride;
    expand_group_avx512<1>(ys, bt, rank, cols, outs, native);
  }
}

TOKENMILL_ISA_PORTABLE_VARIANTS(expand_cols, (const float* y, int64_t y_stride,
                                              const int64_t* rows, int64_t count,
                                              const at::BFloat16* b, int64_t rank, int64_t cols,
                                              float* bt, at::BFloat16* out, int64_t out_stride),
                                (y, y_stride, rows, count, b, rank, cols, bt, out, out_stride))
TOKENMILL_ISA_PORTABLE_VARIANTS(expand_cols, (const float* y, int64_t y_stride,
                                              const int64_t* rows, int64_t count, const float* b,
                                              int64_t rank, int64_t cols, float* bt, float* out,
                                              int64_t out_stride),
                                (y, y_stride, rows, count, b, rank, cols, bt, out, out_stride))

void check_rows(const char* op, const at::Tensor& rows, int64_t tokens) {
  if (tokens == 0) return;
  const auto [low, high] = std::minmax_element(rows.data_ptr<int64_t>(),
                                               rows.data_ptr<int64_t>() + tokens);
  TORCH_CHECK(*low >= 0 && *high < tokens, op, ": sorted_rows must lie in 0..", tokens - 1,
              ", got ", *low, "..", *high);
}

// A task: rows [begin, begin + count) of sorted_rows, all of slot `slot`, and output columns
// from `col` (the expand's; 0 in the shrink).
struct Block {
  int64_t slot, begin, count, col;
};

// Each slot's rows in blocks of `rows` rows, times `cols` blocks of `block_cols` columns.
std::vector<Block> blocks(const int64_t* bounds, int64_t slots, int64_t rows, int64_t cols,
                          int64_t block_cols) {
  std::vector<Block> tasks;
  for (int64_t s = 0; s < slots; ++s) {
    for (int64_t b = bounds[s]; b < bounds[s + 1]; b += rows) {
      for (int64_t c = 0; c < cols; ++c) {
        tasks.push_back({s, b, std::min(rows, bounds[s + 1] - b), c * block_cols});
      }
    }
  }
  return tasks;
}

// Tasks run on the calling thread below kSerialWork multiply-adds (grain = all of them).
int64_t grain(int64_t work, const std::vector<Block>& tasks) {
  return work < kSerialWork ? std::max<int64_t>(1, tasks.size()) : 1;
}

}  // namespace

std::vector<int64_t> lora_slot_bounds(const char* op, const at::Tensor& sorted_rows,
                                      const at::Tensor& starts, int64_t slots, int64_t tokens) {
  TORCH_CHECK(sorted_rows.dim() == 1 && sorted_rows.size(0) == tokens &&
                  sorted_rows.scalar_type() == at::kLong && sorted_rows.is_contiguous(),
              op, ": sorted_rows must be contiguous int64 [", tokens, "], got ",
              sorted_rows.sizes(), " ", sorted_rows.scalar_type());
  TORCH_CHECK(starts.dim() == 1 && starts.size(0) == slots + 1 &&
                  starts.scalar_type() == at::kLong,
              op, ": starts must be int64 [", slots + 1, "] (one per slot and the end), got ",
              starts.sizes(), " ", starts.scalar_type());
  const at::Tensor s = starts.contiguous();
  std::vector<int64_t> bounds(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + slots + 1);
  for (int64_t i = 0; i < slots; ++i) {
    TORCH_CHECK(0 <= bounds[i] && bounds[i] <= bounds[i + 1], op,
                ": starts must rise from 0, got ", starts);
  }
  TORCH_CHECK(bounds[slots] == tokens, op, ": starts must end at T=", tokens, ", got ", starts);
  check_rows(op, sorted_rows, tokens);
  return bounds;
}

template <typename T>
void lora_shrink_rows(const T* x, int64_t k, const T* a, int64_t rank, const float* scales,
                      const int64_t* sorted_rows, const int64_t* bounds, int64_t slots,
                      float* y) {
  const std::vector<Block> tasks = blocks(bounds, slots, kShrinkRows, 1, 0);
  at::parallel_for(0, tasks.size(), grain((bounds[slots] - bounds[0]) * rank * k, tasks),
                   [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Block& t = tasks[i];
      shrink_rows(x, k, sorted_rows + t.begin, t.count, a + t.slot * rank * k, rank,
                  scales[t.slot], y);
    }
  });
}
template void lora_shrink_rows(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t,
                               const float*, const int64_t*, const int64_t*, int64_t, float*);
template void lora_shrink_rows(const float*, int64_t, const float*, int64_t, const float*,
                               const int64_t*, const int64_t*, int64_t, float*);

template <typename T>
void lora_expand_rows(T* out, int64_t out_stride, const float* y, int64_t y_stride, const T* b,
                      int64_t n, int64_t rank, const int64_t* sorted_rows,
                      const int64_t* bounds, int64_t slots) {
  const std::vector<Block> tasks =
      blocks(bounds, slots, kExpandRows, (n + kExpandCols - 1) / kExpandCols, kExpandCols);
  at::parallel_for(0, tasks.size(), grain((bounds[slots] - bounds[0]) * rank * n, tasks),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> bt(rank * kExpandCols);
    for (int64_t i = begin; i < end; ++i) {
      const Block& t = tasks[i];
      expand_cols(y, y_stride, sorted_rows + t.begin, t.count, b + (t.slot * n + t.col) * rank,
                  rank, std::min(kExpandCols, n - t.col), bt.data(), out + t.col, out_stride);
    }
  });
}
template void lora_expand_rows(at::BFloat16*, int64_t, const float*, int64_t,
                               const at::BFloat16*, int64_t, int64_t, const int64_t*,
                               const int64_t*, int64_t);
template void lora_expand_rows(float*, int64_t, const float*, int64_t, const float*, int64_t,
                               int64_t, const int64_t*, const int64_t*, int64_t);

at::Tensor lora_shrink(const at::Tensor& x_in, const at::Tensor& a_in,
                       const at::Tensor& sorted_rows_in, const at::Tensor& starts,
                       const at::Tensor& scale_in) {
  TORCH_CHECK(x_in.dim() == 2 && a_in.dim() == 3, "lora_shrink: x must be [T, K] and a_stacked ",
              "[S, R, K], got ", x_in.sizes(), " and ", a_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == a_in.scalar_type() &&
                  (x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat),
              "lora_shrink: x and a_stacked must both be bf16 or both fp32, got ",
              x_in.scalar_type(), " and ", a_in.scalar_type());
  const int64_t tokens = x_in.size(0), k = x_in.size(1);
  const int64_t slots = a_in.size(0), rank = a_in.size(1);
  TORCH_CHECK(a_in.size(2) == k, "lora_shrink: x has ", k, " features, a_stacked ", a_in.size(2));
  TORCH_CHECK(scale_in.dim() == 1 && scale_in.size(0) == slots &&
                  scale_in.scalar_type() == at::kFloat,
              "lora_shrink: scale must be fp32 [", slots, "], got ", scale_in.sizes(), " ",
              scale_in.scalar_type());
  const at::Tensor sorted_rows = sorted_rows_in.contiguous();
  const std::vector<int64_t> bounds =
      lora_slot_bounds("lora_shrink", sorted_rows, starts, slots, tokens);
  const at::Tensor x = x_in.contiguous(), a = a_in.contiguous(), scale = scale_in.contiguous();
  at::Tensor y = at::zeros({tokens, rank}, x.options().dtype(at::kFloat));
  const int64_t* rows = sorted_rows.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    lora_shrink_rows(x.data_ptr<at::BFloat16>(), k, a.data_ptr<at::BFloat16>(), rank,
                     scale.data_ptr<float>(), rows, bounds.data(), slots, y.data_ptr<float>());
  } else {
    lora_shrink_rows(x.data_ptr<float>(), k, a.data_ptr<float>(), rank, scale.data_ptr<float>(),
                     rows, bounds.data(), slots, y.data_ptr<float>());
  }
  return y;
}

void lora_expand(at::Tensor& out, const at::Tensor& y, const at::Tensor& b_in,
                 const at::Tensor& sorted_rows_in, const at::Tensor& starts, int64_t offset) {
  TORCH_CHECK(out.dim() == 2 && y.dim() == 2 && b_in.dim() == 3, "lora_expand: out must be ",
              "[T, N_total], y [T, R] and b_stacked [S, N, R], got ", out.sizes(), ", ",
              y.sizes(), " and ", b_in.sizes());
  TORCH_CHECK(out.scalar_type() == b_in.scalar_type() &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "lora_expand: out and b_stacked must both be bf16 or both fp32, got ",
              out.scalar_type(), " and ", b_in.scalar_type());
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.stride(1) == 1 && out.stride(1) == 1,
              "lora_expand: y must be fp32 and y and out contiguous along their rows, got ",
              y.scalar_type(), " with strides ", y.strides(), " and ", out.strides());
  const int64_t tokens = out.size(0), slots = b_in.size(0), n = b_in.size(1);
  const int64_t rank = b_in.size(2);
  TORCH_CHECK(y.size(0) == tokens && y.size(1) == rank, "lora_expand: y must be [", tokens, ", ",
              rank, "], got ", y.sizes());
  TORCH_CHECK(offset >= 0 && offset + n <= out.size(1), "lora_expand: columns ", offset, "..",
              offset + n, " do not fit in an output of ", out.size(1), " columns");
  const at::Tensor sorted_rows = sorted_rows_in.contiguous();
  const std::vector<int64_t> bounds =
      lora_slot_bounds("lora_expand", sorted_rows, starts, slots, tokens);
  const at::Tensor b = b_in.contiguous();
  const int64_t* rows = sorted_rows.data_ptr<int64_t>();
  if (out.scalar_type() == at::kBFloat16) {
    lora_expand_rows(out.data_ptr<at::BFloat16>() + offset, out.stride(0), y.data_ptr<float>(),
                     y.stride(0), b.data_ptr<at::BFloat16>(), n, rank, rows, bounds.data(),
                     slots);
  } else {
    lora_expand_rows(out.data_ptr<float>() + offset, out.stride(0), y.data_ptr<float>(),
                     y.stride(0), b.data_ptr<float>(), n, rank, rows, bounds.data(), slots);
  }
}

}  // namespace tokenmill
