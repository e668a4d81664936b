// silu_and_mul: a gated MLP's [.., 2n] gate/up output -> silu(gate) * up [.., n] in one pass,
// in the torch path's roundings: silu(g) = g / (1 + exp(-g)) in fp32 rounded to the dtype,
// then its product with up rounded again. exp is a polynomial (within 2 units in the last
// place of expf), so results may differ from torch's in the last places of fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "ops.h"
#include "simd.h"
#include "vec.h"

namespace tokenmill {
namespace {

template <typename T>
TOKENMILL_INLINE void silu_mul_rows_impl(const T* x, T* out, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * n;
    const T* up = gate + n;
    T* dst = out + r * n;
    for (int64_t i = 0; i < n; ++i) {
      const float g = to_float(gate[i]);
      dst[i] = from_float<T>(round_to<T>(g / (1.f + exp_poly(-g))) * to_float(up[i]));
    }
  }
}

// On AVX-512 by avx512::silu_times; bf16 rounds by the CPU's conversion where it has one.
template <typename T>
TOKENMILL_AVX512_TARGET void silu_mul_rows_avx512(const T* x, T* out, int64_t rows, int64_t n) {
  const bool native = cpu_isa() >= 2;
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * n;
    const T* up = gate + n;
    T* dst = out + r * n;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = avx512::first(n - i);
      const __m512 v =
          avx512::silu_times<T>(avx512::load(gate + i, m), avx512::load(up + i, m), native);
      avx512::store(dst + i, v, m, native);
    }
  }
}

TOKENMILL_ISA_PORTABLE_VARIANTS(silu_mul_rows, (const at::BFloat16* x, at::BFloat16* out,
                                                int64_t rows, int64_t n),
                                (x, out, rows, n))
TOKENMILL_ISA_PORTABLE_VARIANTS(silu_mul_rows, (const float* x, float* out, int64_t rows,
                                                int64_t n),
                                (x, out, rows, n))

}  // namespace

void silu_and_mul_rows(const at::BFloat16* x, at::BFloat16* out, int64_t rows, int64_t n) {
  silu_mul_rows(x, out, rows, n);
}

void silu_and_mul_rows(const float* x, float* out, int64_t rows, int64_t n) {
  silu_mul_rows(x, out, rows, n);
}

template <typename T>
void silu_and_mul_parallel(const T* x, T* out, int64_t rows, int64_t n) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    silu_mul_rows(x + begin * 2 * n, out + begin * n, end - begin, n);
  });
}
template void silu_and_mul_parallel(const at::BFloat16*, at::BFloat16*, int64_t, int64_t);
template void silu_and_mul_parallel(const float*, float*, int64_t, int64_t);

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  const int64_t n = x_in.size(-1) / 2;
  TORCH_CHECK(x_in.size(-1) == 2 * n, "silu_and_mul: the last dimension must be even, got ",
              x_in.size(-1));
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "silu_and_mul: x must be bf16 or fp32, got ", x_in.scalar_type());
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t rows = n == 0 ? 0 : x.numel() / (2 * n);
  if (x.scalar_type() == at::kBFloat16) {
    silu_and_mul_parallel(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n);
  } else {
    silu_and_mul_parallel(x.data_ptr<float>(), out.data_ptr<float>(), rows, n);
  }
  return out;
}

}  // namespace tokenmill
