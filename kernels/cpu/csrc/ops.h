// Declarations of tokenmill's CPU ops (registered in registration.cpp).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>
#include <vector>

namespace tokenmill {

// What this CPU runs (isa.cpp): 3 AMX (bf16 tiles), 2 AVX-512 with bf16 dot products,
// 1 AVX-512, 0 AVX2 and FMA, -1 none of these.
int64_t cpu_isa();
// Caps what cpu_isa() says (-1 to 3), so that lower builds run; returns the new value.
int64_t limit_cpu_isa(int64_t limit);

// linear.cpp: a weight [N, K] re-laid out once for `linear`, and the product x @ W^T.
at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t block_n);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias);
// silu(gate) * up of a gated MLP's packed gate/up weight (gate in the first half of its
// blocks, up in the second) without its [.., 2n] product: silu_and_mul(linear(x, packed)).
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& packed,
                           const c10::optional<at::Tensor>& bias);

// gguf_linear.cpp: x @ W^T (+ bias) for a weight in a GGUF block format (Q4_0, Q4_1, Q8_0),
// re-laid out by kernels/cpu/gguf.py into qs, d (and Q4_1's m).
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                       const c10::optional<at::Tensor>& m, int64_t qtype,
                       const c10::optional<at::Tensor>& bias);
// The same into y ([M, N], contiguous, x's dtype).
void gguf_linear_out(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                     const c10::optional<at::Tensor>& m, int64_t qtype,
                     const c10::optional<at::Tensor>& bias, at::Tensor& y);
// The fp32 rows `ids` [T] of such a weight, [T, K], as GGUF de-quantizes them (a tied
// embedding's lookup in its LM head's blocks).
at::Tensor gguf_rows(const at::Tensor& qs, const at::Tensor& d,
                     const c10::optional<at::Tensor>& m, int64_t qtype, const at::Tensor& ids);

// int8_linear.cpp: W8A8, x @ W^T (+ bias) with x quantized per row to int8 in the call and W
// per output column at load (kernels/cpu/int8.py) into qweight, scales and colsum.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& colsum, const c10::optional<at::Tensor>& bias);
// silu_and_mul(int8_linear(...)) of a gated MLP's gate/up weight, without the [.., 2n] product.
at::Tensor int8_linear_silu_mul(const at::Tensor& x, const at::Tensor& qweight,
                                const at::Tensor& scales, const at::Tensor& colsum,
                                const c10::optional<at::Tensor>& bias);

// rms_norm.cpp: RMSNorm of x (after residual += x, in place, when given).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    const c10::optional<at::Tensor>& residual);
// The same on `rows` rows of d values (T bf16 or fp32; residual may be null), into out.
template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t d,
                   float eps);

// activation.cpp: silu(gate) * up of a [.., 2n] gate/up output; the same over `rows` rows of
// [gate (n) | up (n)] (the loop linear_silu_mul's tasks run on their blocks).
at::Tensor silu_and_mul(const at::Tensor& x);
void silu_and_mul_rows(const at::BFloat16* x, at::BFloat16* out, int64_t rows, int64_t n);
void silu_and_mul_rows(const float* x, float* out, int64_t rows, int64_t n);
// The op's work on raw rows, its rows split across the threads.
template <typename T>
void silu_and_mul_parallel(const T* x, T* out, int64_t rows, int64_t n);

// argmax.cpp: per row of x [R, V], the first position of its largest (or smallest) value, a
// NaN counting as the extreme (torch.argmax / argmin).
at::Tensor first_extreme(const at::Tensor& x, bool largest);

// rotary.cpp: queries/keys [T, heads, d] rotated in place by their positions.
void rotary_embedding(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin);
// The same on raw rows: token t's heads at x + t * row_stride, positions checked by the caller.
template <typename T>
void rotary_rows(T* x, int64_t row_stride, const int64_t* positions, int64_t tokens,
                 int64_t heads, int64_t d, const float* cos, const float* sin);

// attention.cpp: a step's keys/values into the paged cache, and decode attention reading it
// in place.
void kv_cache_write(at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& slots);
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale, int64_t window, double softcap);
// The same two on raw rows, their arguments checked by the caller: token t's key and value at
// key + t * stride and value + t * stride (T bf16 or fp32); request b's query heads [heads, d]
// at query + b * q_stride elements of q_type (the cache's dtype, or bf16/fp32 for an fp8
// cache), its block table row at table + b * width, its length len[b]; out [B, heads, d].
template <typename T>
void kv_cache_write_rows(at::Tensor& kv_cache, const T* key, const T* value, int64_t stride,
                         const int64_t* slots, int64_t tokens);
// Refuses head counts and sizes decode attention does not take (`op` names the caller).
void check_decode_heads(const char* op, int64_t heads, int64_t kv_heads, int64_t d);
void decode_attention_rows(const void* query, int64_t q_stride, at::ScalarType q_type,
                           const at::Tensor& kv_cache, const int64_t* table, int64_t width,
                           const int64_t* len, int64_t batch, int64_t heads, double scale,
                           int64_t window, double softcap, void* out);

// prefill_attention.cpp: the prefilling requests' causal attention over their cached keys and
// values (earlier context included), written into out.
void prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                       const at::Tensor& block_table, const at::Tensor& query_start,
                       const at::Tensor& seq_lens, double scale, int64_t window,
                       double softcap);

// lora.cpp: the batched LoRA matmuls, each row by its slot's adapter, on rows grouped by slot
// (slot s's rows sorted_rows[starts[s] : starts[s + 1]]; rows before starts[0] have none):
// y [T, R] fp32 = scale[s] * x @ A[s]^T, and out[:, offset : offset + N] += y @ B[s]^T.
at::Tensor lora_shrink(const at::Tensor& x, const at::Tensor& a_stacked,
                       const at::Tensor& sorted_rows, const at::Tensor& starts,
                       const at::Tensor& scale);
void lora_expand(at::Tensor& out, const at::Tensor& y, const at::Tensor& b_stacked,
                 const at::Tensor& sorted_rows, const at::Tensor& starts, int64_t offset);
// Their work on raw rows, the arguments checked by the caller (decode_layers checks a step's
// once): bounds [S + 1] are the checked starts (lora_slot_bounds; `op` names the caller in its
// errors); x rows of k values, a [S, rank, k], scales [S], y rows of `rank` floats (rows of no
// slot left as they are); out and y rows at out_stride and y_stride, b [S, n, rank].
std::vector<int64_t> lora_slot_bounds(const char* op, const at::Tensor& sorted_rows,
                                      const at::Tensor& starts, int64_t slots, int64_t tokens);
template <typename T>
void lora_shrink_rows(const T* x, int64_t k, const T* a, int64_t rank, const float* scales,
                      const int64_t* sorted_rows, const int64_t* bounds, int64_t slots,
                      float* y);
template <typename T>
void lora_expand_rows(T* out, int64_t out_stride, const float* y, int64_t y_stride, const T* b,
                      int64_t n, int64_t rank, const int64_t* sorted_rows,
                      const int64_t* bounds, int64_t slots);

// decode_layers.cpp: a decode step's Llama decoder layers in one call, from the embeddings to
// the last layer's (hidden, residual); projections with a qtype run on GGUF weights, and
// projections with LoRA operands add their adapters' products where the step has a mapping.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, at::TensorList weights,
    const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList kv_caches,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& seq_lens,
    int64_t num_heads,
    int64_t num_kv_heads, double scale, double eps, at::IntArrayRef windows,
    const c10::List<c10::optional<at::Tensor>>& quant, at::IntArrayRef qtypes,
    const c10::List<c10::optional<at::Tensor>>& lora, at::IntArrayRef lora_offsets,
    const c10::optional<at::Tensor>& lora_scales, const c10::optional<at::Tensor>& lora_rows,
    const c10::optional<at::Tensor>& lora_starts);

}  // namespace tokenmill
