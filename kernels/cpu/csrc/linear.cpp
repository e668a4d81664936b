// linear: y = x @ W^T (+ bias) on a weight packed once at load into blocks of block_n output
// columns, each block laid out as the microkernel streams it:
//   bf16: [N / block_n, K / 2, block_n, 2]  (pairs of k side by side: AMX tiles' and
//         AVX512-BF16 dot products' "VNNI" form)
//   fp32: [N / block_n, K, block_n]
// Each (row block, column block) task is one call of oneDNN's batch-reduce GEMM microkernel
// (torch's cpublas::brgemm: AMX tiles where the CPU has them) over the whole K. Measured on 2
// AMX cores against oneDNN's prepacked linear, SmolLM2's 211 matmuls with their weights from
// DRAM: bf16 11.0 against 12.8 ms at 1 to 16 rows (19 against 16 GFLOPS at one row: the
// weights stream at 20 GB/s), even at 64, 10-20% slower at 256-2048 rows; fp32 15% faster
// at 1-64 rows, 3% at 256-2048. Up to 4 rows on CPUs with AVX512-BF16 run a loop of our own
// (gemv below) instead: one request's decode 8% faster end to end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ops.h"

namespace tokenmill {
namespace {

// Rows per microkernel call: up to this many rows read each weight block once (at 2048
// rows, blocks of 256 took 232 ms where 32-128 took 265-330).
constexpr int64_t kBlockM = 256;
// Outputs larger than this go to memory past the caches (non-temporal stores): writing them
// through the caches first read every line (at 2048 rows, 247 against 288 ms).
constexpr int64_t kStreamBytes = 8 << 20;

__attribute__((target("avx512f,avx512bf16,avx512vl"))) void store_bf16_avx512(
    const float* c, const float* bias, at::BFloat16* out, int64_t n, bool stream) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_loadu_ps(c + j);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out + j), h);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), h);
    }
  }
  for (; j < n; ++j) out[j] = at::BFloat16(c[j] + (bias != nullptr ? bias[j] : 0.f));
}

void store_bf16_scalar(const float* c, const float* bias, at::BFloat16* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = at::BFloat16(c[j] + (bias != nullptr ? bias[j] : 0.f));
}

// Products of a few rows (decode steps of a few requests) on CPUs with AVX512-BF16: the
// packed weight streamed once, 64 bytes (16 columns x one pair of k) per vdpbf16ps, with each
// row's pair of x broadcast; the weight is prefetched kPrefetchPairs pairs of k ahead (a
// block's rows lie in one run of memory, pages the hardware prefetchers start on late). On 2
// AMX cores SmolLM2's matmuls at one row ran from DRAM at 25 against 21 GB/s through the AMX
// microkernel, whose tiles hold 16 rows.
constexpr int64_t kPrefetchPairs = 8;

template <int M, int NB>
__attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw"))) void gemv_block(
    const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t k,
    const float* bias, at::BFloat16* y, int64_t y_stride) {
  __m512 acc[M][NB];
  for (int r = 0; r < M; ++r) {
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  const int64_t pairs = k / 2, pair_bytes = NB * 64;
  const char* wb = reinterpret_cast<const char*>(w);
  for (int64_t p = 0; p < pairs; ++p) {
    const char* ahead = wb + (p + kPrefetchPairs) * pair_bytes;
    for (int j = 0; j < NB; ++j) _mm_prefetch(ahead + j * 64, _MM_HINT_T0);
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_loadu_si512(wb + p * pair_bytes + j * 64);
    }
    for (int r = 0; r < M; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[j], xv);
    }
  }
  for (int r = 0; r < M; ++r) {
    for (int j = 0; j < NB; ++j) {
      __m512 v = acc[r][j];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j * 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + j * 16),
                          (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int M>
void gemv_block_n(int64_t block_n, const at::BFloat16* x, int64_t x_stride,
                  const at::BFloat16* w, int64_t k, const float* bias, at::BFloat16* y,
                  int64_t y_stride) {
  switch (block_n) {
    case 64: gemv_block<M, 4>(x, x_stride, w, k, bias, y, y_stride); break;
    case 32: gemv_block<M, 2>(x, x_stride, w, k, bias, y, y_stride); break;
    default: gemv_block<M, 1>(x, x_stride, w, k, bias, y, y_stride);
  }
}

// y [m, N] = x [m, K] @ W^T for m <= kGemvRows, column blocks split among the threads.
constexpr int64_t kGemvRows = 4;

void gemv(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t blocks = packed.size(0), block_n = packed.size(2), n = blocks * block_n;
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const at::BFloat16* w = wp + nb * k * block_n;
      const float* b = bias != nullptr ? bias + nb * block_n : nullptr;
      at::BFloat16* out = yp + nb * block_n;
      switch (m) {
        case 1: gemv_block_n<1>(block_n, xp, k, w, k, b, out, n); break;
        case 2: gemv_block_n<2>(block_n, xp, k, w, k, b, out, n); break;
        case 3: gemv_block_n<3>(block_n, xp, k, w, k, b, out, n); break;
        default: gemv_block_n<4>(block_n, xp, k, w, k, b, out, n);
      }
    }
  });
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t block_n) {
  TORCH_CHECK(weight.dim() == 2, "pack_linear_weight: weight must be [N, K], got ",
              weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(block_n > 0 && n % block_n == 0, "pack_linear_weight: N=", n,
              " is not a multiple of block_n=", block_n);
  const int64_t blocks = n / block_n;
  if (weight.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(k % 2 == 0, "pack_linear_weight: a bf16 weight needs an even K, got ", k);
    return weight.reshape({blocks, block_n, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  TORCH_CHECK(weight.scalar_type() == at::kFloat,
              "pack_linear_weight: weight must be bf16 or fp32, got ", weight.scalar_type());
  return weight.reshape({blocks, block_n, k}).transpose(1, 2).contiguous();
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias_in) {
  const bool vnni = packed.dim() == 4;
  TORCH_CHECK(vnni || packed.dim() == 3, "linear: not a packed weight: ", packed.sizes());
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == packed.scalar_type(),
              "linear: x must be 2-D in the weight's dtype (", packed.scalar_type(), "), got ",
              x_in.sizes(), " ", x_in.scalar_type());
  const int64_t blocks = packed.size(0), block_n = packed.size(2);
  const int64_t k = vnni ? packed.size(1) * 2 : packed.size(1);
  const int64_t n = blocks * block_n, m = x_in.size(0);
  TORCH_CHECK(x_in.size(1) == k, "linear: x has ", x_in.size(1), " features, the weight ", k);
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  at::Tensor bias;
  if (bias_in.has_value() && bias_in->defined()) bias = bias_in->to(at::kFloat).contiguous();
  const float* bias_ptr = bias.defined() ? bias.data_ptr<float>() : nullptr;

  if (vnni && m <= kGemvRows && cpu_isa() >= 2) {
    gemv(x, packed, bias_ptr, y);
    return y;
  }
  const int64_t row_blocks = (m + kBlockM - 1) / kBlockM;
  const bool stream = m * n * 2 > kStreamBytes;
  // A thread's consecutive tasks share a block of rows (which stays in its L2 while the
  // weights stream past); with one block of rows, they share nothing and each weight block is
  // read once.
  // The last row block, of more than 16 rows but not a multiple of 16, runs padded with zero
  // rows (copied once here), so that oneDNN compiles a microkernel for 31 row counts, not for
  // every count a step brings (each compile took milliseconds of a step). Fewer rows run as
  // they are: padded to 16, one request's decode took 20% longer.
  const int64_t tail_m0 = (row_blocks - 1) * kBlockM, tail_rows = m - tail_m0;
  at::Tensor tail;
  if (tail_rows > 16 && tail_rows % 16 != 0) {
    tail = at::zeros({(tail_rows + 15) / 16 * 16, k}, x.options());
    tail.narrow(0, 0, tail_rows).copy_(x.narrow(0, tail_m0, tail_rows));
  }
  at::parallel_for(0, blocks * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kBlockM * block_n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t nb = task % blocks, m0 = (task / blocks) * kBlockM;
      const int64_t rows = std::min(kBlockM, m - m0);
      const bool padded = m0 == tail_m0 && tail.defined();
      const int64_t rows_run = padded ? tail.size(0) : rows;
      if (vnni) {
        const auto* a =
            padded ? tail.data_ptr<at::BFloat16>() : x.data_ptr<at::BFloat16>() + m0 * k;
        const auto* b = packed.data_ptr<at::BFloat16>() + nb * k * block_n;
        at::native::cpublas::brgemm(rows_run, block_n, k, k, block_n, block_n, false, a, b,
                                    scratch.data(), true);
        auto* out = y.data_ptr<at::BFloat16>() + m0 * n + nb * block_n;
        const float* bias_n = bias_ptr != nullptr ? bias_ptr + nb * block_n : nullptr;
        const bool avx512 = cpu_isa() >= 2;
        for (int64_t r = 0; r < rows; ++r) {
          const float* c = scratch.data() + r * block_n;
          if (avx512) {
            store_bf16_avx512(c, bias_n, out + r * n, block_n, stream);
          } else {
            store_bf16_scalar(c, bias_n, out + r * n, block_n);
          }
        }
      } else {
        const float* a = x.data_ptr<float>() + m0 * k;
        const float* b = packed.data_ptr<float>() + nb * k * block_n;
        float* c = y.data_ptr<float>() + m0 * n + nb * block_n;
        if (rows_run == rows) {
          if (bias_ptr != nullptr) {
            for (int64_t r = 0; r < rows; ++r) {
              std::copy(bias_ptr + nb * block_n, bias_ptr + (nb + 1) * block_n, c + r * n);
            }
          }
          at::native::cpublas::brgemm(rows, block_n, k, k, block_n, n, bias_ptr != nullptr, a,
                                      b, c, false);
        } else {  // padded: the product into the scratch, then its rows out
          at::native::cpublas::brgemm(rows_run, block_n, k, k, block_n, block_n, false,
                                      tail.data_ptr<float>(), b, scratch.data(), false);
          const float* bias_n = bias_ptr != nullptr ? bias_ptr + nb * block_n : nullptr;
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < block_n; ++j) {
              c[r * n + j] = scratch[r * block_n + j] + (bias_n != nullptr ? bias_n[j] : 0.f);
            }
          }
        }
      }
    }
    if (stream) _mm_sfence();  // the non-temporal stores reach memory before others read y
    at::native::cpublas::brgemm_release(vnni);
  });
  return y;
}

}  // namespace tokenmill
