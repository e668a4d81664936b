// rotary_embedding: rotates queries and keys [T, heads, d] in place by their positions'
// rows of the cos/sin tables [positions, d] (fp32; rotate-half / NeoX layout, as HF Llama),
// in the torch path's arithmetic: cos and sin rounded to the dtype, each product rounded, then
// their sum: out[i] = x[i] cos[i] - x[i + d/2] sin[i] for the first half, + x[i - d/2] sin[i]
// for the second. One pass instead of the torch path's five ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"
#include "simd.h"
#include "vec.h"

namespace tokenmill {
namespace {

template <typename T>
TOKENMILL_INLINE void rotate_token(T* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  float c[512], s[512], row[512];  // d <= 512 (checked by the caller)
  for (int64_t i = 0; i < d; ++i) {
    c[i] = round_to<T>(cos[i]);
    s[i] = round_to<T>(sin[i]);
  }
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * d;
    for (int64_t i = 0; i < d; ++i) row[i] = to_float(v[i]);
    for (int64_t i = 0; i < half; ++i) {
      v[i] = from_float<T>(round_to<T>(row[i] * c[i]) + round_to<T>(-row[i + half] * s[i]));
    }
    for (int64_t i = half; i < d; ++i) {
      v[i] = from_float<T>(round_to<T>(row[i] * c[i]) + round_to<T>(row[i - half] * s[i]));
    }
  }
}

template <typename T>
TOKENMILL_INLINE void rotate_impl(T* x, int64_t row_stride, const int64_t* positions,
                                  int64_t tokens, int64_t heads, int64_t d, const float* cos,
                                  const float* sin) {
  for (int64_t t = 0; t < tokens; ++t) {
    rotate_token(x + t * row_stride, heads, d, cos + positions[t] * d, sin + positions[t] * d);
  }
}

// The same by hand on AVX-512, with the same bits (bf16 rounded by the CPU's conversion where
// it has one, which flushes values below 2^-126 to zero).
template <typename T>
TOKENMILL_AVX512_TARGET void rotate_avx512(T* x, int64_t row_stride, const int64_t* positions,
                                           int64_t tokens, int64_t heads, int64_t d,
                                           const float* cos, const float* sin) {
  const int64_t half = d / 2;
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(int32_t(0x80000000u)));
  const bool native = cpu_isa() >= 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + positions[t] * d;
    const float* s = sin + positions[t] * d;
    T* token = x + t * row_stride;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 m = avx512::first(half - i);
      const __m512 c1 = avx512::round_to<T>(avx512::load(c + i, m), native);
      const __m512 s1 = avx512::round_to<T>(avx512::load(s + i, m), native);
      const __m512 c2 = avx512::round_to<T>(avx512::load(c + half + i, m), native);
      const __m512 s2 = avx512::round_to<T>(avx512::load(s + half + i, m), native);
      for (int64_t h = 0; h < heads; ++h) {
        T* v = token + h * d;
        const __m512 x1 = avx512::load(v + i, m), x2 = avx512::load(v + half + i, m);
        const __m512 neg_x2 = _mm512_xor_ps(x2, sign);
        avx512::store(v + i,
                      _mm512_add_ps(avx512::round_to<T>(_mm512_mul_ps(x1, c1), native),
                                    avx512::round_to<T>(_mm512_mul_ps(neg_x2, s1), native)),
                      m, native);
        avx512::store(v + half + i,
                      _mm512_add_ps(avx512::round_to<T>(_mm512_mul_ps(x2, c2), native),
                                    avx512::round_to<T>(_mm512_mul_ps(x1, s2), native)),
                      m, native);
      }
    }
  }
}

TOKENMILL_ISA_PORTABLE_VARIANTS(rotate, (at::BFloat16* x, int64_t row_stride,
                                         const int64_t* positions, int64_t tokens, int64_t heads,
                                         int64_t d, const float* cos, const float* sin),
                                (x, row_stride, positions, tokens, heads, d, cos, sin))
TOKENMILL_ISA_PORTABLE_VARIANTS(rotate, (float* x, int64_t row_stride, const int64_t* positions,
                                         int64_t tokens, int64_t heads, int64_t d,
                                         const float* cos, const float* sin),
                                (x, row_stride, positions, tokens, heads, d, cos, sin))

}  // namespace

template <typename T>
void rotary_rows(T* x, int64_t row_stride, const int64_t* positions, int64_t tokens,
                 int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(heads * d, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    rotate(x + begin * row_stride, row_stride, positions + begin, end - begin, heads, d, cos,
           sin);
  });
}
template void rotary_rows(at::BFloat16*, int64_t, const int64_t*, int64_t, int64_t, int64_t,
                          const float*, const float*);
template void rotary_rows(float*, int64_t, const int64_t*, int64_t, int64_t, int64_t,
                          const float*, const float*);

void rotary_embedding(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin) {
  // Each token's heads contiguous; tokens may sit further apart (queries and keys viewed
  // inside the fused q/k/v output).
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) &&
                  x.stride(0) >= x.size(1) * x.size(2),
              "rotary_embedding: x must be [T, heads, d] with each token's heads contiguous, "
              "got sizes ", x.sizes(), " strides ", x.strides());
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && d <= 512, "rotary_embedding: head size must be even and <= 512");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == d,
              "rotary_embedding: cos/sin must be contiguous fp32 [positions, ", d, "]");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == tokens, "rotary_embedding: one position per token");
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "rotary_embedding: position ", p[t],
                " outside the table's ", max_pos);
  }
  if (x.scalar_type() == at::kBFloat16) {
    rotary_rows(x.data_ptr<at::BFloat16>(), x.stride(0), p, tokens, heads, d,
                cos.data_ptr<float>(), sin.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "rotary_embedding: x must be bf16 or fp32");
    rotary_rows(x.data_ptr<float>(), x.stride(0), p, tokens, heads, d, cos.data_ptr<float>(),
                sin.data_ptr<float>());
  }
}

}  // namespace tokenmill
