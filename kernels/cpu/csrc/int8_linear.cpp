// int8_linear: W8A8 products. A weight [N, K] is quantized once at load per output column
// (kernels/cpu/int8.py: s_w[n] = max |w[n, :]| / 127, q = round(w / s_w), in [-127, 127])
// and laid out in blocks of 64 columns as oneDNN's int8 microkernel reads them:
//   qweight: int8 [N / 64, K / 4, 64, 4] (four k side by side: AMX int8 tiles' and
//            AVX512-VNNI's form), with colsum int32 [N] (each column's sum of q).
// Each call quantizes x per row (token), asymmetrically into unsigned bytes (the microkernel
// multiplies unsigned by signed bytes: AMX's tdpbusd, VNNI's vpdpbusd): with lo = min(x, 0)
// and hi = max(x, 0) over the row, s_x = (hi - lo) / 255, a zero point zp = round(-lo * 255 /
// (hi - lo)) and xu = clamp(round(x * 255 / (hi - lo)) + zp, 0, 255); then
//   y[m, n] = s_x[m] * s_w[n] * (sum_k xu q - zp[m] * colsum[n])  (+ bias[n]).
// (Against a symmetric [-127, 127] per row, SmolLM2's log-probabilities moved a third less on
// average and half as much at the worst tokens.)
// Integer sums are exact, so the product equals de-quantize-then-multiply up to fp32's
// rounding of the final scaling. Tasks are (row block, column block) as in linear.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"
#include "vec.h"

namespace tokenmill {
namespace {

constexpr int64_t kBlockN = 64;   // output columns per block
constexpr int64_t kBlockM = 256;  // rows per microkernel call

#define TOKENMILL_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

struct RowScale {
  float scale;
  int32_t zero;
};

// A row's scale and zero point from its range [lo, hi] (lo <= 0 <= hi), and 255 / (hi - lo).
inline RowScale row_scale(float lo, float hi, float* inv) {
  const float range = hi - lo;
  *inv = range > 0.f ? 255.f / range : 0.f;
  return {range / 255.f, static_cast<int32_t>(std::nearbyint(-lo * *inv))};
}

// Row r of x quantized into out (see the top of the file).
template <typename T>
RowScale quantize_row_scalar(const T* x, int64_t k, uint8_t* out) {
  float lo = 0.f, hi = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    lo = std::min(lo, static_cast<float>(x[i]));
    hi = std::max(hi, static_cast<float>(x[i]));
  }
  float inv;
  const RowScale s = row_scale(lo, hi, &inv);
  for (int64_t i = 0; i < k; ++i) {
    const int q = static_cast<int>(std::nearbyint(static_cast<float>(x[i]) * inv)) + s.zero;
    out[i] = static_cast<uint8_t>(std::min(255, std::max(0, q)));
  }
  return s;
}

template <typename T>
TOKENMILL_INT8_TARGET inline __m512 load16(const T* x) {
  if constexpr (std::is_same<T, at::BFloat16>::value) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_loadu_ps(x);
  }
}

// The same on AVX-512 (k a multiple of 16; the rounding is the same: to nearest, ties even).
template <typename T>
TOKENMILL_INT8_TARGET RowScale quantize_row_avx512(const T* x, int64_t k, uint8_t* out) {
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 v = load16(x + i);
    lo = _mm512_min_ps(lo, v);
    hi = _mm512_max_ps(hi, v);
  }
  float inv_s;
  const RowScale s = row_scale(_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi), &inv_s);
  const __m512 inv = _mm512_set1_ps(inv_s);
  const __m512i zero = _mm512_set1_epi32(s.zero), low = _mm512_setzero_si512();
  for (int64_t i = 0; i < k; i += 16) {
    __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load16(x + i), inv)), zero);
    q = _mm512_max_epi32(q, low);  // (the unsigned saturation below caps 255)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtusepi32_epi8(q));
  }
  return s;
}

template <typename T>
void store_block(const int32_t* c, int64_t rows, int64_t width, const RowScale* sx,
                 const float* sw, const int32_t* colsum, const float* bias, T* y,
                 int64_t y_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      const int32_t acc = c[r * width + j] - sx[r].zero * colsum[j];
      float v = static_cast<float>(acc) * (sx[r].scale * sw[j]);
      if (bias != nullptr) v += bias[j];
      y[r * y_stride + j] = from_float<T>(v);
    }
  }
}

// The same on AVX-512 (with AVX512-BF16 for bf16 outputs): the same fp32 arithmetic.
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) void store_block_avx512(
    const int32_t* c, int64_t rows, int64_t width, const RowScale* sx, const float* sw,
    const int32_t* colsum, const float* bias, T* y, int64_t y_stride) {
  __m512 w[kBlockN / 16], b[kBlockN / 16];
  __m512i sums[kBlockN / 16];
  const int vectors = static_cast<int>(width / 16);
  for (int j = 0; j < vectors; ++j) {
    w[j] = _mm512_loadu_ps(sw + 16 * j);
    b[j] = bias != nullptr ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
    sums[j] = _mm512_loadu_si512(colsum + 16 * j);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(sx[r].scale);
    const __m512i zero = _mm512_set1_epi32(sx[r].zero);
    for (int j = 0; j < vectors; ++j) {
      const __m512i acc = _mm512_sub_epi32(_mm512_loadu_si512(c + r * width + 16 * j),
                                           _mm512_mullo_epi32(zero, sums[j]));
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(s, w[j]));
      if (bias != nullptr) v = _mm512_add_ps(v, b[j]);
      T* dst = y + r * y_stride + 16 * j;
      if constexpr (std::is_same<T, at::BFloat16>::value) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
      } else {
        _mm512_storeu_ps(dst, v);
      }
    }
  }
}

// x quantized per row, the last row block padded to a multiple of 16 rows past 16 (one
// microkernel per such count, as linear.cpp pads).
struct Quantized {
  std::vector<uint8_t> xq;
  std::vector<RowScale> sx;
  int64_t m, k, row_blocks, tail_m0, tail_run;

  template <typename T>
  Quantized(const T* xp, int64_t m_in, int64_t k_in) : m(m_in), k(k_in) {
    row_blocks = (m + kBlockM - 1) / kBlockM;
    tail_m0 = (row_blocks - 1) * kBlockM;
    const int64_t tail = m - tail_m0;
    tail_run = tail > 16 && tail % 16 ? (tail + 15) / 16 * 16 : tail;
    xq.assign((tail_m0 + tail_run) * k, 0);
    sx.resize(m);
    const bool avx512 = cpu_isa() >= 1 && k % 16 == 0;
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        sx[r] = avx512 ? quantize_row_avx512(xp + r * k, k, xq.data() + r * k)
                       : quantize_row_scalar(xp + r * k, k, xq.data() + r * k);
      }
    });
  }

  int64_t rows(int64_t m0) const { return std::min(kBlockM, m - m0); }

  // Rows [m0, m0 + rows(m0)) of columns [c0, c0 + width) of column block nb (width 64, or
  // 32 for either half), scaled (+ bias), into y (row stride y_stride).
  template <typename T>
  void block(const at::Tensor& qweight, const float* sw, const int32_t* cs, const float* bias,
             int64_t m0, int64_t nb, int64_t c0, int64_t width, int32_t* scratch, T* y,
             int64_t y_stride) const {
    const auto* wq = reinterpret_cast<const int8_t*>(qweight.data_ptr());
    const int64_t col = nb * kBlockN + c0;
    at::native::cpublas::brgemm(m0 == tail_m0 ? tail_run : rows(m0), width, k, k, kBlockN, width,
                                false, xq.data() + m0 * k, wq + nb * k * kBlockN + c0 * 4,
                                scratch, true);
    (cpu_isa() >= 2 ? store_block_avx512<T> : store_block<T>)(
        scratch, rows(m0), width, sx.data() + m0, sw + col, cs + col,
        bias != nullptr ? bias + col : nullptr, y, y_stride);
  }
};

template <typename T>
at::Tensor run(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
               const at::Tensor& colsum, const float* bias) {
  const int64_t m = x.size(0), blocks = qweight.size(0), n = blocks * kBlockN;
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const Quantized q(x.data_ptr<T>(), m, x.size(1));
  T* yp = y.data_ptr<T>();
  // Where the blocks do not share evenly among the threads (576 columns: 9 blocks on 2),
  // tasks take half blocks.
  const int64_t parts = blocks * q.row_blocks % at::get_num_threads() != 0 ? 2 : 1;
  const int64_t width = kBlockN / parts, columns = blocks * parts;
  at::parallel_for(0, columns * q.row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> scratch(kBlockM * kBlockN);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task % columns, m0 = (task / columns) * kBlockM;
      const int64_t nb = c / parts, c0 = (c % parts) * width;
      q.block(qweight, scales.data_ptr<float>(), colsum.data_ptr<int32_t>(), bias, m0, nb, c0,
              width, scratch.data(), yp + m0 * n + nb * kBlockN + c0, n);
    }
    at::native::cpublas::brgemm_release(true);
  });
  return y;
}

// A gated MLP's gate/up (gate in the first half of the blocks, up in the second): a task's
// gate block j and up block j go into rows of [gate | up] in T, as `run` writes them, and
// silu_and_mul's own loop makes the output: silu_and_mul(int8_linear(...)) bit for bit.
template <typename T>
at::Tensor run_silu_mul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& colsum, const float* bias) {
  const int64_t m = x.size(0), half = qweight.size(0) / 2, n = half * kBlockN;
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const Quantized q(x.data_ptr<T>(), m, x.size(1));
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, half * q.row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> scratch(kBlockM * kBlockN);
    std::vector<T> gate_up(kBlockM * 2 * kBlockN);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j = task % half, m0 = (task / half) * kBlockM;
      for (int64_t part = 0; part < 2; ++part) {
        q.block(qweight, scales.data_ptr<float>(), colsum.data_ptr<int32_t>(), bias, m0,
                j + part * half, 0, kBlockN, scratch.data(), gate_up.data() + part * kBlockN,
                2 * kBlockN);
      }
      for (int64_t r = 0; r < q.rows(m0); ++r) {
        silu_and_mul_rows(gate_up.data() + r * 2 * kBlockN, yp + (m0 + r) * n + j * kBlockN, 1,
                          kBlockN);
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return y;
}

// The checks both ops make; returns the fp32 bias (or undefined).
at::Tensor check(const char* op, const at::Tensor& x, const at::Tensor& qweight,
                 const at::Tensor& scales, const at::Tensor& colsum,
                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.dim() == 4 && qweight.scalar_type() == at::kChar &&
                  qweight.is_contiguous() && qweight.size(2) == kBlockN && qweight.size(3) == 4,
              op, ": qweight must be a contiguous int8 [N / 64, K / 4, 64, 4], got ",
              qweight.sizes());
  const int64_t n = qweight.size(0) * kBlockN, k = qweight.size(1) * 4;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n,
              op, ": scales must be fp32 [", n, "]");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() == n,
              op, ": colsum must be int32 [", n, "]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, op, ": x must be [M, ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": x must be bf16 or fp32, got ", x.scalar_type());
  return bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor();
}

}  // namespace

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& colsum, const c10::optional<at::Tensor>& bias_in) {
  const at::Tensor bias = check("int8_linear", x_in, qweight, scales, colsum, bias_in);
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const at::Tensor x = x_in.contiguous();
  if (x.scalar_type() == at::kBFloat16) return run<at::BFloat16>(x, qweight, scales, colsum, bp);
  return run<float>(x, qweight, scales, colsum, bp);
}

at::Tensor int8_linear_silu_mul(const at::Tensor& x_in, const at::Tensor& qweight,
                                const at::Tensor& scales, const at::Tensor& colsum,
                                const c10::optional<at::Tensor>& bias_in) {
  const at::Tensor bias = check("int8_linear_silu_mul", x_in, qweight, scales, colsum, bias_in);
  TORCH_CHECK(qweight.size(0) % 2 == 0, "int8_linear_silu_mul: gate and up must have as many "
              "blocks of 64 columns, got ", qweight.size(0), " blocks");
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const at::Tensor x = x_in.contiguous();
  if (x.scalar_type() == at::kBFloat16) {
    return run_silu_mul<at::BFloat16>(x, qweight, scales, colsum, bp);
  }
  return run_silu_mul<float>(x, qweight, scales, colsum, bp);
}

}  // namespace tokenmill
