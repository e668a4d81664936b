// decode_layers: a decode step's decoder layers from the embeddings on (Llama's: RMSNorm,
// q/k/v, rotary, the cache write, decode attention, o, RMSNorm, gate/up with SiLU-and-mul,
// down) as one call, the CPU's counterpart of a captured CUDA graph. A layer's dozen ops cost
// about as much in Python and dispatch as in arithmetic at one request; here they are calls
// of the kernels' own C++ functions, the ones each op runs, in the layers' order, so the
// result is the layer-by-layer one bit for bit. On 2 AMX cores one request's decode (SmolLM2
// bf16) went 16.4 -> 12.4 ms a token; 64 requests (W1-cpu) 6% faster. A projection whose
// qtypes entry is not 0 is a GGUF weight (its qs, d and m in `quant`; gguf_linear, and
// SiLU-and-mul after the gate/up product, as the layers run it), or, with qtype kInt8, an
// int8 W8A8 one (its qweight, scales and colsum; int8_linear).
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "ops.h"

namespace tokenmill {

namespace {
constexpr int64_t kInt8 = 2000;  // kernels/cpu/int8.py's QTYPE
constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate/up, down
constexpr int64_t kBiasesPerLayer = 4;   // qkv, o, gate/up, down (each optional)
constexpr int64_t kQuantPerProjection = 3;  // a GGUF weight's qs, d, m
}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden, at::TensorList weights,
    const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList kv_caches,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& seq_lens,
    int64_t num_heads,
    int64_t num_kv_heads, double scale, double eps, at::IntArrayRef windows,
    const c10::List<c10::optional<at::Tensor>>& quant, at::IntArrayRef qtypes) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer,
              "decode_layers: ", kWeightsPerLayer, " weights per layer, got ", weights.size(),
              " for ", layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(biases.size()) == layers * kBiasesPerLayer,
              "decode_layers: ", kBiasesPerLayer, " biases (or None) per layer, got ",
              biases.size());
  TORCH_CHECK(static_cast<int64_t>(windows.size()) == layers,
              "decode_layers: one window per layer, got ", windows.size());
  TORCH_CHECK(static_cast<int64_t>(qtypes.size()) == layers * kBiasesPerLayer &&
                  static_cast<int64_t>(quant.size()) ==
                      layers * kBiasesPerLayer * kQuantPerProjection,
              "decode_layers: a qtype and 3 GGUF tensors (or None) per projection");
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
    // Projection i (qkv, o, gate/up, down) of x, weight w[weight].
    const auto project = [&](const at::Tensor& in, int64_t i, int64_t weight,
                             const c10::optional<at::Tensor>& b) {
      const int64_t p = l * kBiasesPerLayer + i;
      if (qtypes[p] == 0) return tokenmill::linear(in, w[weight], b);
      const int64_t q = p * kQuantPerProjection;
      if (qtypes[p] == kInt8) {
        return int8_linear(in, *quant.get(q), *quant.get(q + 1), *quant.get(q + 2), b);
      }
      return gguf_linear(in, *quant.get(q), *quant.get(q + 1), quant.get(q + 2), qtypes[p], b);
    };
    if (l > 0) x = rms_norm(x, w[0], eps, residual);
    const at::Tensor qkv = project(x, 0, 1, bias(0));
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
    x = project(attn.view({batch, num_heads * head}), 1, 2, c10::nullopt);
    if (const auto b = bias(1); b.has_value()) x = x + *b;
    x = rms_norm(x, w[3], eps, residual);
    const int64_t gate_up = l * kBiasesPerLayer + 2, gq = gate_up * kQuantPerProjection;
    const at::Tensor act =
        qtypes[gate_up] == 0       ? tokenmill::linear_silu_mul(x, w[4], bias(2))
        : qtypes[gate_up] == kInt8 ? int8_linear_silu_mul(x, *quant.get(gq), *quant.get(gq + 1),
                                                          *quant.get(gq + 2), bias(2))
                                   : silu_and_mul(project(x, 2, 4, bias(2)));
    x = project(act, 3, 5, c10::nullopt);
    if (const auto b = bias(3); b.has_value()) x = x + *b;
  }
  return {x, residual};
}

}  // namespace tokenmill
