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
//
// The step's inputs are checked once, and the layers run on buffers made once per call: the
// norms, the rotation, the cache write and attention take raw rows (no tensors made, viewed or
// checked per layer: at one request those cost about 10 us a layer, against about 2 for the
// work), and GGUF products are written into the buffers.
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

// A tensor [rows, n] of `like`'s dtype in `buffer`, made on first use (or when its shape
// changes: a model's projections differ in width).
at::Tensor& buffer_for(at::Tensor& buffer, const at::Tensor& like, int64_t rows, int64_t n) {
  if (!buffer.defined() || buffer.size(0) != rows || buffer.size(1) != n) {
    buffer = at::empty({rows, n}, like.options());
  }
  return buffer;
}

template <typename T>
void run_layers(const at::Tensor& hidden, at::TensorList weights,
                const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList kv_caches,
                const int64_t* positions, const float* cos, const float* sin,
                const int64_t* slots, const int64_t* table, int64_t table_width,
                const int64_t* lens, int64_t num_heads, int64_t num_kv_heads, double scale,
                float eps, at::IntArrayRef windows,
                const c10::List<c10::optional<at::Tensor>>& quant, at::IntArrayRef qtypes,
                at::Tensor& x, at::Tensor& residual) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  const int64_t batch = hidden.size(0), width = hidden.size(1), head = kv_caches[0].size(4);
  const int64_t q_width = num_heads * head, kv_width = num_kv_heads * head;
  const int64_t qkv_width = q_width + 2 * kv_width;
  const auto ptr = [](const at::Tensor& t) { return static_cast<T*>(t.data_ptr()); };
  // The residual stream starts as the embeddings (a copy: the op leaves its inputs alone).
  residual = hidden.clone();
  at::Tensor normed = at::empty_like(residual);
  at::Tensor attn = at::empty({batch, q_width}, hidden.options());
  at::Tensor qkv_buffer, o_buffer, gate_up_buffer, act_buffer, down_buffer;
  rms_norm_rows(ptr(residual), static_cast<T*>(nullptr), ptr(weights[0]), ptr(normed), batch,
                width, eps);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const auto bias = [&](int64_t i) -> c10::optional<at::Tensor> {
      return biases.get(l * kBiasesPerLayer + i);
    };
    // Projection i (qkv, o, gate/up, down) of `in`, weight w[weight]; a GGUF product goes
    // into `buffer`.
    const auto project = [&](const at::Tensor& in, int64_t i, int64_t weight,
                             const c10::optional<at::Tensor>& b, at::Tensor& buffer) {
      const int64_t p = l * kBiasesPerLayer + i;
      if (qtypes[p] == 0) return tokenmill::linear(in, w[weight], b);
      const int64_t q = p * kQuantPerProjection;
      if (qtypes[p] == kInt8) {
        return int8_linear(in, *quant.get(q), *quant.get(q + 1), *quant.get(q + 2), b);
      }
      const at::Tensor qs = *quant.get(q);
      at::Tensor& y = buffer_for(buffer, in, batch, qs.size(0) * 16);
      gguf_linear_out(in, qs, *quant.get(q + 1), quant.get(q + 2), qtypes[p], b, y);
      return y;
    };
    if (l > 0) rms_norm_rows(ptr(x), ptr(residual), ptr(w[0]), ptr(normed), batch, width, eps);
    const at::Tensor qkv = project(normed, 0, 1, bias(0), qkv_buffer);
    T* q = ptr(qkv);
    rotary_rows(q, qkv_width, positions, batch, num_heads + num_kv_heads, head, cos, sin);
    at::Tensor cache = kv_caches[l];
    kv_cache_write_rows(cache, q + q_width, q + q_width + kv_width, qkv_width, slots, batch);
    decode_attention_rows(q, qkv_width, hidden.scalar_type(), cache, table, table_width, lens,
                          batch, num_heads, scale, windows[l], 0.0, attn.data_ptr());
    // Row-parallel layers (o, down) add their bias after the product, as RowParallelLinear.
    x = project(attn, 1, 2, c10::nullopt, o_buffer);
    if (const auto b = bias(1); b.has_value()) x = x + *b;
    rms_norm_rows(ptr(x), ptr(residual), ptr(w[3]), ptr(normed), batch, width, eps);
    const int64_t gate_up = l * kBiasesPerLayer + 2, gq = gate_up * kQuantPerProjection;
    at::Tensor act;
    if (qtypes[gate_up] == 0) {
      act = tokenmill::linear_silu_mul(normed, w[4], bias(2));
    } else if (qtypes[gate_up] == kInt8) {
      act = int8_linear_silu_mul(normed, *quant.get(gq), *quant.get(gq + 1), *quant.get(gq + 2),
                                 bias(2));
    } else {
      const at::Tensor products = project(normed, 2, 4, bias(2), gate_up_buffer);
      const int64_t n = products.size(1) / 2;
      act = buffer_for(act_buffer, products, batch, n);
      silu_and_mul_parallel(ptr(products), ptr(act), batch, n);
    }
    x = project(act, 3, 5, c10::nullopt, down_buffer);
    if (const auto b = bias(3); b.has_value()) x = x + *b;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, at::TensorList weights,
    const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList kv_caches,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& seq_lens,
    int64_t num_heads,
    int64_t num_kv_heads, double scale, double eps, at::IntArrayRef windows,
    const c10::List<c10::optional<at::Tensor>>& quant, at::IntArrayRef qtypes) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(layers > 0, "decode_layers: no layers");
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
  TORCH_CHECK(hidden_in.dim() == 2, "decode_layers: hidden must be [B, hidden]");
  const at::Tensor hidden = hidden_in.contiguous();
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "decode_layers: hidden must be bf16 or fp32, got ", dtype);
  const int64_t batch = hidden.size(0), width = hidden.size(1);
  // What the ops check per call, checked here once for every layer.
  const at::Tensor& first = kv_caches[0];
  TORCH_CHECK(first.dim() == 5 && first.size(1) == 2,
              "decode_layers: a cache must be [blocks, 2, block_size, kv_heads, d]");
  const int64_t block_size = first.size(2), head = first.size(4);
  TORCH_CHECK(first.size(3) == num_kv_heads, "decode_layers: the caches hold ", first.size(3),
              " KV heads, not ", num_kv_heads);
  check_decode_heads("decode_layers", num_heads, num_kv_heads, head);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& cache = kv_caches[l];
    TORCH_CHECK(cache.is_contiguous() && cache.sizes() == first.sizes() &&
                    (cache.scalar_type() == dtype || cache.scalar_type() == at::kFloat8_e4m3fn),
                "decode_layers: layer ", l, "'s cache differs from the first's in shape or is "
                "not contiguous in the step's dtype (or fp8)");
    for (int64_t i : {0, 3}) {
      const at::Tensor& norm = weights[l * kWeightsPerLayer + i];
      TORCH_CHECK(norm.is_contiguous() && norm.numel() == width && norm.scalar_type() == dtype,
                  "decode_layers: layer ", l, "'s norm weights must be contiguous [", width,
                  "] in the step's dtype");
    }
  }
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == head &&
                  sin.sizes() == cos.sizes(),
              "decode_layers: cos/sin must be contiguous fp32 [positions, ", head, "]");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const at::Tensor slot = slots.to(at::kLong).contiguous();
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == batch && slot.numel() == batch && table.dim() == 2 &&
                  table.size(0) >= batch && lens.numel() >= batch,
              "decode_layers: one position, slot, block table row and length per request");
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* s = slot.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t table_width = table.size(1), capacity = first.size(0) * block_size;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(p[b] >= 0 && p[b] < cos.size(0), "decode_layers: position ", p[b],
                " outside the rotary table's ", cos.size(0));
    TORCH_CHECK(s[b] >= 0 && s[b] < capacity, "decode_layers: slot ", s[b],
                " outside the cache's ", capacity);
    TORCH_CHECK(len[b] >= 1 && len[b] <= table_width * block_size, "decode_layers: request ",
                b, " has length ", len[b], " for ", table_width, " blocks of ", block_size);
  }
  at::Tensor x, residual;
  if (dtype == at::kBFloat16) {
    run_layers<at::BFloat16>(hidden, weights, biases, kv_caches, p, cos.data_ptr<float>(),
                             sin.data_ptr<float>(), s, table.data_ptr<int64_t>(), table_width,
                             len, num_heads, num_kv_heads, scale, static_cast<float>(eps),
                             windows, quant, qtypes, x, residual);
  } else {
    run_layers<float>(hidden, weights, biases, kv_caches, p, cos.data_ptr<float>(),
                      sin.data_ptr<float>(), s, table.data_ptr<int64_t>(), table_width, len,
                      num_heads, num_kv_heads, scale, static_cast<float>(eps), windows, quant,
                      qtypes, x, residual);
  }
  return {x, residual};
}

}  // namespace tokenmill
