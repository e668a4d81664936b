// first_extreme: per row of x [R, V] (bf16 or fp32), the position of its largest value
// (largest = false: its smallest), the first of equal ones, as torch.argmax / argmin give it:
// a NaN counts as the extreme, so a row holding one gives its first NaN's position. A greedy
// request's token from its logits in two vectorized passes over the row (the extreme, then
// its first position), where torch's reduction with an index is not vectorized and the
// sampler's chunked torch form takes eight ops (~40 us a row of 49152 on an AVX512 EPYC).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "ops.h"
#include "simd.h"
#include "vec.h"

namespace tokenmill {
namespace {

template <typename T>
int64_t first_extreme_scalar(const T* x, int64_t n, bool largest) {
  int64_t at = 0;
  float best = to_float(x[0]);
  if (std::isnan(best)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = to_float(x[i]);
    if (std::isnan(v)) return i;
    if (largest ? v > best : v < best) {
      best = v;
      at = i;
    }
  }
  return at;
}

template <typename T>
TOKENMILL_AVX512_TARGET int64_t first_extreme_avx512(const T* x, int64_t n, bool largest) {
  // Pass 1: the extreme, and whether a NaN is there.
  __m512 best = _mm512_set1_ps(largest ? -std::numeric_limits<float>::infinity()
                                       : std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = avx512::first(n - i);
    const __m512 v = avx512::load(x + i, valid);
    nan |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
    best = largest ? _mm512_mask_max_ps(best, valid, best, v)
                   : _mm512_mask_min_ps(best, valid, best, v);
  }
  if (nan) return first_extreme_scalar(x, n, largest);  // the first NaN's position
  const float extreme = largest ? _mm512_reduce_max_ps(best) : _mm512_reduce_min_ps(best);
  // Pass 2: its first position.
  const __m512 target = _mm512_set1_ps(extreme);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = avx512::first(n - i);
    const __mmask16 hit =
        _mm512_mask_cmp_ps_mask(valid, avx512::load(x + i, valid), target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // (not reached: the extreme is one of the row's values)
}

template <typename T>
int64_t first_extreme_row(const T* x, int64_t n, bool largest) {
  return cpu_isa() >= 1 ? first_extreme_avx512(x, n, largest)
                        : first_extreme_scalar(x, n, largest);
}

}  // namespace

at::Tensor first_extreme(const at::Tensor& x_in, bool largest) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) > 0, "first_extreme: x must be [R, V] with V > 0, "
              "got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "first_extreme: x must be bf16 or fp32, got ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      o[r] = x.scalar_type() == at::kBFloat16
                 ? first_extreme_row(x.data_ptr<at::BFloat16>() + r * n, n, largest)
                 : first_extreme_row(x.data_ptr<float>() + r * n, n, largest);
    }
  });
  return out;
}

}  // namespace tokenmill
