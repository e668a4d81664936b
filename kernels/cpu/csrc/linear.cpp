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
#include <type_traits>
#include <vector>

#include "batch_invariant.h"
#include "ops.h"
#include "simd.h"

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

// linear_silu_mul's last step on CPUs with AVX512-BF16: rows of the gate's and the up's fp32
// products (block_n wide) -> silu(gate) * up in bf16, each product first rounded to bf16 with
// its bias as store_bf16_avx512 rounds it: silu_and_mul of linear's output, bit for bit.
TOKENMILL_AVX512_TARGET void silu_mul_epilogue(const float* gate, const float* up,
                                               const float* gate_bias, const float* up_bias,
                                               int64_t rows, int64_t n, at::BFloat16* dst,
                                               int64_t dst_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; j += 16) {
      __m512 g = _mm512_loadu_ps(gate + r * n + j), u = _mm512_loadu_ps(up + r * n + j);
      if (gate_bias != nullptr) {
        g = _mm512_add_ps(g, _mm512_loadu_ps(gate_bias + j));
        u = _mm512_add_ps(u, _mm512_loadu_ps(up_bias + j));
      }
      g = avx512::widen(avx512::bf16_native(g));
      u = avx512::widen(avx512::bf16_native(u));
      const __m512 v = avx512::silu_times<at::BFloat16>(g, u, true);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * dst_stride + j),
                          avx512::bf16_native(v));
    }
  }
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

// Rows up to which gemv_block runs instead of the AMX microkernel.
constexpr int64_t kGemvRows = 4;

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

namespace {

// One product x @ W^T on a packed weight, ready to run block by block.
struct Product {
  at::Tensor x;     // [m, k], contiguous
  at::Tensor tail;  // the last row block padded with zero rows (see below), or undefined
  const at::Tensor& packed;
  const float* bias;
  bool vnni;
  int64_t m, k, blocks, block_n, tail_m0;

  Product(const char* op, const at::Tensor& x_in, const at::Tensor& packed_in,
          const at::Tensor& bias_fp32)
      : packed(packed_in), bias(bias_fp32.defined() ? bias_fp32.data_ptr<float>() : nullptr) {
    vnni = packed.dim() == 4;
    TORCH_CHECK(vnni || packed.dim() == 3, op, ": not a packed weight: ", packed.sizes());
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == packed.scalar_type(), op,
                ": x must be 2-D in the weight's dtype (", packed.scalar_type(), "), got ",
                x_in.sizes(), " ", x_in.scalar_type());
    blocks = packed.size(0);
    block_n = packed.size(2);
    k = vnni ? packed.size(1) * 2 : packed.size(1);
    m = x_in.size(0);
    TORCH_CHECK(x_in.size(1) == k, op, ": x has ", x_in.size(1), " features, the weight ", k);
    x = x_in.contiguous();
    // The last row block, of more than 16 rows but not a multiple of 16, runs padded with zero
    // rows (copied once here), so that oneDNN compiles a microkernel for 31 row counts, not
    // for every count a step brings (each compile took milliseconds of a step). Fewer rows run
    // as they are: padded to 16, one request's decode took 20% longer.
    tail_m0 = (row_blocks() - 1) * kBlockM;
    const int64_t tail_rows = m - tail_m0;
    if (m > 0 && tail_rows > 16 && tail_rows % 16 != 0) {
      tail = at::zeros({(tail_rows + 15) / 16 * 16, k}, x.options());
      tail.narrow(0, 0, tail_rows).copy_(x.narrow(0, tail_m0, tail_rows));
    }
  }

  int64_t row_blocks() const { return (m + kBlockM - 1) / kBlockM; }
  // Up to kGemvRows rows on CPUs with AVX512-BF16: gemv_block, not the AMX microkernel. In
  // the batch-invariant mode only where the microkernel is not AMX: without AMX, oneDNN's
  // AVX512-BF16 kernel sums a row's pairs of k in gemv_block's order (the same bits at any
  // row count: tests/unit/test_cpu_batch_invariance.py); AMX tiles sum in their own order.
  bool gemv_rows() const {
    const bool amx_invariant = cpu_isa() >= 3 && batch_invariant_mode();
    return vnni && m <= kGemvRows && cpu_isa() >= 2 && !amx_invariant;
  }

  // Rows [m0, m0 + kBlockM) of the product's column block nb, bias added, into dst (row
  // stride dst_stride, in the weight's dtype); `stream`: past the caches (bf16).
  template <typename T>
  void block(int64_t m0, int64_t nb, T* dst, int64_t dst_stride, bool stream,
             float* scratch) const {
    const int64_t rows = std::min(kBlockM, m - m0);
    const bool padded = m0 == tail_m0 && tail.defined();
    const int64_t rows_run = padded ? tail.size(0) : rows;
    const float* bias_n = bias != nullptr ? bias + nb * block_n : nullptr;
    if constexpr (std::is_same<T, at::BFloat16>::value) {
      product_bf16(m0, nb, scratch);
      const bool avx512 = cpu_isa() >= 2;
      for (int64_t r = 0; r < rows; ++r) {
        const float* c = scratch + r * block_n;
        if (avx512) {
          store_bf16_avx512(c, bias_n, dst + r * dst_stride, block_n, stream);
        } else {
          store_bf16_scalar(c, bias_n, dst + r * dst_stride, block_n);
        }
      }
    } else {
      const float* a = padded ? tail.data_ptr<float>() : x.data_ptr<float>() + m0 * k;
      const float* b = packed.data_ptr<float>() + nb * k * block_n;
      if (!padded) {
        if (bias_n != nullptr) {
          for (int64_t r = 0; r < rows; ++r) {
            std::copy(bias_n, bias_n + block_n, dst + r * dst_stride);
          }
        }
        at::native::cpublas::brgemm(rows, block_n, k, k, block_n, dst_stride, bias_n != nullptr,
                                    a, b, dst, false);
      } else {  // padded: the product into the scratch, then its rows out
        at::native::cpublas::brgemm(rows_run, block_n, k, k, block_n, block_n, false, a, b,
                                    scratch, false);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < block_n; ++j) {
            dst[r * dst_stride + j] =
                scratch[r * block_n + j] + (bias_n != nullptr ? bias_n[j] : 0.f);
          }
        }
      }
    }
  }

  // bf16: rows [m0, m0 + kBlockM) of column block nb, in fp32 and without the bias, into
  // scratch [kBlockM, block_n].
  void product_bf16(int64_t m0, int64_t nb, float* scratch) const {
    const bool padded = m0 == tail_m0 && tail.defined();
    const int64_t rows_run = padded ? tail.size(0) : std::min(kBlockM, m - m0);
    const auto* a = padded ? tail.data_ptr<at::BFloat16>() : x.data_ptr<at::BFloat16>() + m0 * k;
    const auto* b = packed.data_ptr<at::BFloat16>() + nb * k * block_n;
    at::native::cpublas::brgemm(rows_run, block_n, k, k, block_n, block_n, false, a, b, scratch,
                                true);
  }

  // Column block nb of every row (gemv_rows()), bias added, into dst (row stride dst_stride).
  void gemv(int64_t nb, at::BFloat16* dst, int64_t dst_stride) const {
    const auto* xp = x.data_ptr<at::BFloat16>();
    const at::BFloat16* w = packed.data_ptr<at::BFloat16>() + nb * k * block_n;
    const float* b = bias != nullptr ? bias + nb * block_n : nullptr;
    switch (m) {
      case 1: gemv_block_n<1>(block_n, xp, k, w, k, b, dst, dst_stride); break;
      case 2: gemv_block_n<2>(block_n, xp, k, w, k, b, dst, dst_stride); break;
      case 3: gemv_block_n<3>(block_n, xp, k, w, k, b, dst, dst_stride); break;
      default: gemv_block_n<4>(block_n, xp, k, w, k, b, dst, dst_stride);
    }
  }
};

at::Tensor fp32_bias(const c10::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor();
}

}  // namespace

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias_in) {
  const at::Tensor bias = fp32_bias(bias_in);
  const Product p("linear", x_in, packed, bias);
  const int64_t n = p.blocks * p.block_n;
  at::Tensor y = at::empty({p.m, n}, p.x.options());
  if (p.m == 0) return y;
  if (p.gemv_rows()) {
    auto* yp = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, p.blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nb = begin; nb < end; ++nb) p.gemv(nb, yp + nb * p.block_n, n);
    });
    return y;
  }
  const bool stream = p.m * n * 2 > kStreamBytes;
  // A thread's consecutive tasks share a block of rows (which stays in its L2 while the
  // weights stream past); with one block of rows, they share nothing and each weight block is
  // read once.
  at::parallel_for(0, p.blocks * p.row_blocks(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kBlockM * p.block_n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t nb = task % p.blocks, m0 = (task / p.blocks) * kBlockM;
      if (p.vnni) {
        p.block(m0, nb, y.data_ptr<at::BFloat16>() + m0 * n + nb * p.block_n, n, stream,
                scratch.data());
      } else {
        p.block(m0, nb, y.data_ptr<float>() + m0 * n + nb * p.block_n, n, false,
                scratch.data());
      }
    }
    if (stream) _mm_sfence();  // the non-temporal stores reach memory before others read y
    at::native::cpublas::brgemm_release(p.vnni);
  });
  return y;
}

// A task is (row block, column block j of the gate): the gate's block j and the up's block j
// (blocks / 2 + j) go into a buffer of rows [gate | up], in the dtype as linear writes them,
// and silu_and_mul's own loop makes the task's output from it: the result is
// silu_and_mul(linear(x, packed)) bit for bit, without the [m, 2n] product in memory.
at::Tensor linear_silu_mul(const at::Tensor& x_in, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias_in) {
  const at::Tensor bias = fp32_bias(bias_in);
  const Product p("linear_silu_mul", x_in, packed, bias);
  TORCH_CHECK(p.blocks % 2 == 0, "linear_silu_mul: the gate and up halves must be whole "
              "blocks of ", p.block_n, " columns, got ", p.blocks * p.block_n, " columns");
  const int64_t half = p.blocks / 2, bn = p.block_n, n = half * bn;
  at::Tensor y = at::empty({p.m, n}, p.x.options());
  if (p.m == 0) return y;
  const bool gemv = p.gemv_rows();
  const int64_t row_blocks = gemv ? 1 : p.row_blocks();
  // Many rows on AVX512-BF16 (block_n a multiple of 16): the two products stay in fp32 and
  // one pass makes the output from them (3 passes over the rows otherwise).
  const bool epilogue = p.vnni && !gemv && cpu_isa() >= 2 && bn % 16 == 0;
  at::parallel_for(0, half * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kBlockM * bn * (epilogue ? 2 : 1));
    std::vector<at::BFloat16> both16(p.vnni && !epilogue ? kBlockM * 2 * bn : 0);
    std::vector<float> both32(p.vnni ? 0 : kBlockM * 2 * bn);
    std::vector<at::BFloat16> act16(p.vnni && !epilogue ? kBlockM * bn : 0);
    std::vector<float> act32(p.vnni ? 0 : kBlockM * bn);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j = task % half, m0 = (task / half) * kBlockM;
      const int64_t rows = std::min(kBlockM, p.m - m0);
      if (epilogue) {
        float* up = scratch.data() + kBlockM * bn;
        p.product_bf16(m0, j, scratch.data());
        p.product_bf16(m0, half + j, up);
        const float* bias_g = p.bias != nullptr ? p.bias + j * bn : nullptr;
        const float* bias_u = p.bias != nullptr ? p.bias + (half + j) * bn : nullptr;
        silu_mul_epilogue(scratch.data(), up, bias_g, bias_u, rows, bn,
                          y.data_ptr<at::BFloat16>() + m0 * n + j * bn, n);
      } else if (p.vnni) {
        if (gemv) {
          p.gemv(j, both16.data(), 2 * bn);
          p.gemv(half + j, both16.data() + bn, 2 * bn);
        } else {
          p.block(m0, j, both16.data(), 2 * bn, false, scratch.data());
          p.block(m0, half + j, both16.data() + bn, 2 * bn, false, scratch.data());
        }
        // All the task's rows in one call (one call per row cost as much as the SiLU), then
        // out to their places.
        silu_and_mul_rows(both16.data(), act16.data(), rows, bn);
        auto* out = y.data_ptr<at::BFloat16>() + m0 * n + j * bn;
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(out + r * n, act16.data() + r * bn, bn * sizeof(at::BFloat16));
        }
      } else {
        p.block(m0, j, both32.data(), 2 * bn, false, scratch.data());
        p.block(m0, half + j, both32.data() + bn, 2 * bn, false, scratch.data());
        silu_and_mul_rows(both32.data(), act32.data(), rows, bn);
        float* out = y.data_ptr<float>() + m0 * n + j * bn;
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(out + r * n, act32.data() + r * bn, bn * sizeof(float));
        }
      }
    }
    if (!gemv) at::native::cpublas::brgemm_release(p.vnni);
  });
  return y;
}

}  // namespace tokenmill
