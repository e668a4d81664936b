// rms_norm: RMSNorm over the last dimension, optionally after adding x into the residual
// (in place, as the residual stream runs through a layer), in the torch path's arithmetic:
// the sum in fp32, y = x * rsqrt(mean(x^2) + eps) rounded to the dtype, then times the
// weight (rounded again). One pass per row instead of the torch path's nine ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"
#include "simd.h"
#include "vec.h"

namespace tokenmill {
namespace {

template <typename T>
TOKENMILL_INLINE void norm_row(const T* x, T* residual, const T* weight, T* out, int64_t d, float eps) {
  const T* src = x;
  if (residual != nullptr) {
    for (int64_t i = 0; i < d; ++i) {
      residual[i] = from_float<T>(to_float(residual[i]) + to_float(x[i]));
    }
    src = residual;
  }
  // 16 running sums (one vector's worth), added in a fixed order at the end.
  float sums[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    for (int j = 0; j < 16; ++j) {
      const float v = to_float(src[i + j]);
      sums[j] += v * v;
    }
  }
  for (; i < d; ++i) {
    const float v = to_float(src[i]);
    sums[0] += v * v;
  }
  float total = 0.f;
  for (float s : sums) total += s;
  const float scale = 1.f / std::sqrt(total / float(d) + eps);
  for (int64_t k = 0; k < d; ++k) {
    out[k] = from_float<T>(to_float(weight[k]) * round_to<T>(to_float(src[k]) * scale));
  }
}

template <typename T>
TOKENMILL_INLINE void norm_rows_impl(const T* x, T* residual, const T* weight, T* out,
                                     int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    norm_row(x + r * d, residual != nullptr ? residual + r * d : nullptr, weight, out + r * d, d,
             eps);
  }
}

// The same by hand on AVX-512, with the same bits (bf16 rounded by the CPU's conversion where
// it has one, which flushes values below 2^-126 to zero): the 16 running sums are one
// vector's lanes.
template <typename T>
TOKENMILL_AVX512_TARGET void norm_rows_avx512(const T* x, T* residual, const T* weight, T* out,
                                              int64_t rows, int64_t d, float eps) {
  const int64_t full = d / 16 * 16;
  const __mmask16 tail = avx512::first(d - full);
  const bool native = cpu_isa() >= 2;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = x + r * d;
    if (residual != nullptr) {
      T* res = residual + r * d;
      for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 m = i < full ? avx512::first(16) : tail;
        const __m512 sum = _mm512_add_ps(avx512::load(res + i, m), avx512::load(src + i, m));
        avx512::store(res + i, sum, m, native);
      }
      src = res;
    }
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += 16) {
      const __m512 v = avx512::load(src + i);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    float sums[16];
    _mm512_storeu_ps(sums, acc);
    for (int64_t i = full; i < d; ++i) {
      const float v = to_float(src[i]);
      sums[0] += v * v;
    }
    float total = 0.f;
    for (float s : sums) total += s;
    const __m512 scale = _mm512_set1_ps(1.f / std::sqrt(total / float(d) + eps));
    T* dst = out + r * d;
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = i < full ? avx512::first(16) : tail;
      const __m512 y =
          avx512::round_to<T>(_mm512_mul_ps(avx512::load(src + i, m), scale), native);
      avx512::store(dst + i, _mm512_mul_ps(avx512::load(weight + i, m), y), m, native);
    }
  }
}

TOKENMILL_ISA_PORTABLE_VARIANTS(norm_rows, (const at::BFloat16* x, at::BFloat16* residual,
                                            const at::BFloat16* weight, at::BFloat16* out,
                                            int64_t rows, int64_t d, float eps),
                                (x, residual, weight, out, rows, d, eps))
TOKENMILL_ISA_PORTABLE_VARIANTS(norm_rows, (const float* x, float* residual, const float* weight,
                                            float* out, int64_t rows, int64_t d, float eps),
                                (x, residual, weight, out, rows, d, eps))

}  // namespace

template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t d,
                   float eps) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const int64_t at = begin * d;
    norm_rows(x + at, residual != nullptr ? residual + at : nullptr, weight, out + at,
              end - begin, d, eps);
  });
}
template void rms_norm_rows(const at::BFloat16*, at::BFloat16*, const at::BFloat16*,
                            at::BFloat16*, int64_t, int64_t, float);
template void rms_norm_rows(const float*, float*, const float*, float*, int64_t, int64_t, float);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const c10::optional<at::Tensor>& residual) {
  const int64_t d = x.size(-1);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.numel() == d,
              "rms_norm: x must be contiguous and the weight hold its last dimension's ", d);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype ",
              weight.scalar_type(), " differs from x's ", x.scalar_type());
  const bool add = residual.has_value() && residual->defined();
  if (add) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: the residual must be contiguous and shaped as x");
  }
  at::Tensor out = at::empty_like(x);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows(x.data_ptr<at::BFloat16>(), add ? residual->data_ptr<at::BFloat16>() : nullptr,
                  weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, d, e);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rms_norm: x must be bf16 or fp32");
    rms_norm_rows(x.data_ptr<float>(), add ? residual->data_ptr<float>() : nullptr,
                  weight.data_ptr<float>(), out.data_ptr<float>(), rows, d, e);
  }
  return out;
}

}  // namespace tokenmill
