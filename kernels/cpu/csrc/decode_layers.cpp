// decode_layers: a decode step's decoder layers from the embeddings on (Llama's: RMSNorm,
// q/k/v, rotary, the cache write, decode attention, o, RMSNorm, gate/up with SiLU-and-mul,
// down) as one call, the CPU's counterpart of a captured CUDA graph. A layer's dozen ops cost
// about as much in Python and dispatch as in arithmetic at one request; here they are calls
// of the kernels' own C++ functions, the ones each op runs, in the layers' order, so the
// result is the layer-by-layer one bit for bit. On 2 AMX cores one request's decode (SmolLM2
// bf16) went 16.4 -> 12.4 ms a token; 64 requests (W1-cpu) 6% faster.
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "ops.h"

namespace tokenmill {

namespace {
constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate/up, down
constexpr int64_t kBiasesPerLayer = 4;   // qkv, o, gate/up, down (each optional)
}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, at::TensorList weights,
    const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList kv_caches,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& seq_lens,
    int64_t num_heads,
    int64_t num_kv_heads, double scale, double eps, at::IntArrayRef windows) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer,
              "decode_layers: ", kWeightsPerLayer, " weights per layer, got ", weights.size(),
              " for ", layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(biases.size()) == layers * kBiasesPerLayer,
              "decode_layers: ", kBiasesPerLayer, " biases (or None) per layer, got ",
              biases.size());
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == layers,
              "decode_layers: one window per layer, got ", windows.size());
  TORCH_CHECK(hidden.dim() == 2, "decode_layers: hidden must be [B, hidden]");
  const int64_t batch = hidden.size(0);
  // The residual stream starts as the embeddings (a copy: the op leaves its inputs alone).
  at::Tensor residual = hidden.clone();
  at::Tensor x = rms_norm(hidden, weights[0], eps, c10::nullopt);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const auto bias = [&](int64_t i) -> c10::optional<at::Tensor> {
      return biases.get(l * kBiasesPerLayer + i);
    };
    if (l > 0) x = rms_norm(x, w[0], eps, residual);
    const at::Tensor qkv = tokenmill::linear(x, w[1], bias(0));
    const int64_t head = qkv.size(1) / (num_heads + 2 * num_kv_heads);
    const at::Tensor heads = qkv.view({batch, num_heads + 2 * num_kv_heads, head});
    at::Tensor qk = heads.narrow(1, 0, num_heads + num_kv_heads);
    const at::Tensor v = heads.narrow(1, num_heads + num_kv_heads, num_kv_heads);
    rotary_embedding(qk, positions, cos, sin);
    const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
    at::Tensor cache = kv_caches[l];
    kv_cache_write(cache, k, v, slots);
    const at::Tensor attn =
        decode_attention(q, cache, block_table, seq_lens, scale, windows[l], 0.0);
    // Row-parallel layers (o, down) add their bias after the product, as RowParallelLinear.
    x = tokenmill::linear(attn.view({batch, num_heads * head}), w[2], c10::nullopt);
    if (const auto b = bias(1); b.has_value()) x = x + *b;
    x = rms_norm(x, w[3], eps, residual);
    const at::Tensor act = tokenmill::linear_silu_mul(x, w[4], bias(2));
    x = tokenmill::linear(act, w[5], c10::nullopt);
    if (const auto b = bias(3); b.has_value()) x = x + *b;
  }
  return {x, residual};
}

}  // namespace tokenmill
