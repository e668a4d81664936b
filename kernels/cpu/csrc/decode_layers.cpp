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
// LoRA (worker/lora/layers.py's LoRALayer on a projection): `lora` holds per projection its
// a_stacked [S, slices * R, K] and its slices' b_stacked [S, N_i, R] (up to 3: q/k/v; None
// past its slices, all None where the projection has no adapter slots), `lora_offsets` each
// slice's first output column (3 per projection; both lists empty where no projection has
// slots), `lora_scales` the slots' scales [S], and lora_rows / lora_starts the step's
// LoRAMapping (sorted_rows, starts). After a projection's product (and q/k/v's and gate/up's
// bias; o's and down's bias after, as RowParallelLinear adds it) the adapters' product is
// added by lora.cpp's shrink and expands, as LoRALayer.apply runs them; gate/up with adapters
// is then not fused with SiLU-and-mul (product, LoRA, silu_and_mul, as LlamaMLP runs it).
// Without a mapping (None) the adapters are not read: the step is the one without LoRA.
// Measured on Zen 4, SmolLM2-135M's shapes in bf16, random weights, one thread's CPU time: 64
// requests over 4 adapters of rank 16 cost 9% more a step than 64 without LoRA (layer by
// layer with LoRA: 19% more), one request with an adapter 1.4% more (layer by layer: 48%).
// What the adapters add is about a third their weights' reads (39 MB a step at 4 slots),
// the rest the expands' and shrinks' arithmetic and the unfused gate/up.
//
// The step's inputs are checked once, and the layers run on buffers made once per call: the
// norms, the rotation, the cache write and attention take raw rows (no tensors made, viewed or
// checked per layer: at one request those cost about 10 us a layer, against about 2 for the
// work), and GGUF products are written into the buffers.
#include <ATen/ATen.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "ops.h"

namespace tokenmill {

namespace {
constexpr int64_t kInt8 = 2000;  // kernels/cpu/int8.py's QTYPE
constexpr int64_t kWeightsPerLayer = 6;  // input norm, qkv, o, post-attention norm, gate/up, down
constexpr int64_t kBiasesPerLayer = 4;   // qkv, o, gate/up, down (each optional)
constexpr int64_t kQuantPerProjection = 3;  // a GGUF weight's qs, d, m
constexpr int64_t kMaxSlices = 3;  // a projection's LoRA slices: q/k/v at most
constexpr int64_t kLoRAPerProjection = 1 + kMaxSlices;  // a_stacked, then each slice's B

// A projection's LoRA operands, resolved when the step is checked (a null: no adapter slots):
// a [S, slices * rank, k], slice i's b [S, n[i], rank] into output columns from offset[i].
struct LoRAProjection {
  const void* a = nullptr;
  int64_t k = 0, rank = 0, slices = 0, end = 0;  // end: past the last column a slice writes
  const void* b[kMaxSlices] = {};
  int64_t n[kMaxSlices] = {}, offset[kMaxSlices] = {};
};

// The step's LoRA: its mapping's rows and checked bounds, the slots' scales, each projection's
// operands (4 a layer), and y, the shrinks' fp32 buffer [batch, slices * rank at most].
struct LoRAStep {
  const int64_t* rows = nullptr;
  std::vector<int64_t> bounds;
  int64_t slots = 0;
  const float* scales = nullptr;
  std::vector<LoRAProjection> projections;
  at::Tensor y;
};

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
                const LoRAStep* lora, at::Tensor& x, at::Tensor& residual) {
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
    // Projection i's adapter slots, or null (none, or no mapping this step).
    const auto adapters = [&](int64_t i) -> const LoRAProjection* {
      if (lora == nullptr) return nullptr;
      const LoRAProjection& p = lora->projections[l * kBiasesPerLayer + i];
      return p.a != nullptr ? &p : nullptr;
    };
    // Adds the adapters' products for `in` into its projection's product `out`, as
    // LoRALayer.apply: one shrink into y, one expand per slice from its rank's columns of y.
    const auto add_lora = [&](const LoRAProjection* p, const at::Tensor& in,
                              const at::Tensor& out) {
      if (p == nullptr) return;
      // (The widths a projection's inputs and outputs have are known only here.)
      TORCH_CHECK(in.size(1) == p->k && p->end <= out.size(1), "decode_layers: layer ", l,
                  "'s LoRA takes ", p->k, " features and writes ", p->end, " columns, its ",
                  "projection ", in.size(1), " and ", out.size(1));
      float* y = lora->y.data_ptr<float>();
      const int64_t y_stride = p->slices * p->rank;
      lora_shrink_rows(ptr(in), p->k, static_cast<const T*>(p->a), y_stride, lora->scales,
                       lora->rows, lora->bounds.data(), lora->slots, y);
      for (int64_t i = 0; i < p->slices; ++i) {
        lora_expand_rows(ptr(out) + p->offset[i], out.stride(0), y + i * p->rank, y_stride,
                         static_cast<const T*>(p->b[i]), p->n[i], p->rank, lora->rows,
                         lora->bounds.data(), lora->slots);
      }
    };
    if (l > 0) rms_norm_rows(ptr(x), ptr(residual), ptr(w[0]), ptr(normed), batch, width, eps);
    const at::Tensor qkv = project(normed, 0, 1, bias(0), qkv_buffer);
    add_lora(adapters(0), normed, qkv);
    T* q = ptr(qkv);
    rotary_rows(q, qkv_width, positions, batch, num_heads + num_kv_heads, head, cos, sin);
    at::Tensor cache = kv_caches[l];
    kv_cache_write_rows(cache, q + q_width, q + q_width + kv_width, qkv_width, slots, batch);
    decode_attention_rows(q, qkv_width, hidden.scalar_type(), cache, table, table_width, lens,
                          batch, num_heads, scale, windows[l], 0.0, attn.data_ptr());
    // Row-parallel layers (o, down) add their bias after the product, as RowParallelLinear.
    x = project(attn, 1, 2, c10::nullopt, o_buffer);
    add_lora(adapters(1), attn, x);
    if (const auto b = bias(1); b.has_value()) x = x + *b;
    rms_norm_rows(ptr(x), ptr(residual), ptr(w[3]), ptr(normed), batch, width, eps);
    const int64_t gate_up = l * kBiasesPerLayer + 2, gq = gate_up * kQuantPerProjection;
    at::Tensor act;
    // (Adapters add to the gate/up product, which the fused kernels never make.)
    const LoRAProjection* gate_up_lora = adapters(2);
    if (gate_up_lora == nullptr && qtypes[gate_up] == 0) {
      act = tokenmill::linear_silu_mul(normed, w[4], bias(2));
    } else if (gate_up_lora == nullptr && qtypes[gate_up] == kInt8) {
      act = int8_linear_silu_mul(normed, *quant.get(gq), *quant.get(gq + 1), *quant.get(gq + 2),
                                 bias(2));
    } else {
      const at::Tensor products = project(normed, 2, 4, bias(2), gate_up_buffer);
      add_lora(gate_up_lora, normed, products);
      const int64_t n = products.size(1) / 2;
      act = buffer_for(act_buffer, products, batch, n);
      silu_and_mul_parallel(ptr(products), ptr(act), batch, n);
    }
    x = project(act, 3, 5, c10::nullopt, down_buffer);
    add_lora(adapters(3), act, x);
    if (const auto b = bias(3); b.has_value()) x = x + *b;
  }
}

// The step's LoRA operands checked once (see the header) and resolved into `step`, for `batch`
// rows of `dtype` through `layers` layers.
void check_lora(const c10::List<c10::optional<at::Tensor>>& lora, at::IntArrayRef offsets,
                const c10::optional<at::Tensor>& scales, const at::Tensor& rows,
                const at::Tensor& starts, int64_t layers, int64_t batch, at::ScalarType dtype,
                LoRAStep& step) {
  const int64_t projections = layers * kBiasesPerLayer;
  TORCH_CHECK(lora.size() == 0 || static_cast<int64_t>(lora.size()) ==
                                      projections * kLoRAPerProjection,
              "decode_layers: ", kLoRAPerProjection, " LoRA tensors (or None) per projection, ",
              "or none, got ", lora.size(), " for ", layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) ==
                  (lora.size() == 0 ? 0 : projections * kMaxSlices),
              "decode_layers: ", kMaxSlices, " LoRA offsets per projection, got ", offsets.size());
  step.projections.assign(projections, LoRAProjection());
  step.slots = scales.has_value() ? scales->size(0) : starts.size(0) - 1;
  int64_t y_width = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(lora.size()); ++i) {
    const int64_t j = i % kLoRAPerProjection, index = i / kLoRAPerProjection;
    const c10::optional<at::Tensor> t = lora.get(i);
    LoRAProjection& p = step.projections[index];
    if (!t.has_value()) continue;
    TORCH_CHECK(scales.has_value(), "decode_layers: LoRA weights without lora_scales");
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->scalar_type() == dtype &&
                    t->size(0) == step.slots,
                "decode_layers: projection ", index, "'s LoRA tensor ", j, " must be ",
                "contiguous [", step.slots, " slots, ..] in the step's dtype, got ", t->sizes(),
                " ", t->scalar_type());
    if (j == 0) {
      p.a = t->data_ptr();
      p.k = t->size(2);
      continue;
    }
    const int64_t slice = j - 1;
    TORCH_CHECK(p.a != nullptr && p.slices == slice, "decode_layers: projection ", index,
                "'s LoRA slice ", slice, " comes without its a_stacked or an earlier slice");
    if (slice == 0) p.rank = t->size(2);
    TORCH_CHECK(t->size(2) == p.rank, "decode_layers: projection ", index, "'s LoRA slices ",
                "differ in rank");
    p.b[slice] = t->data_ptr();
    p.n[slice] = t->size(1);
    p.offset[slice] = offsets[index * kMaxSlices + slice];
    TORCH_CHECK(p.offset[slice] >= 0, "decode_layers: a LoRA offset of ", p.offset[slice]);
    p.end = std::max(p.end, p.offset[slice] + p.n[slice]);
    p.slices = slice + 1;
  }
  for (int64_t index = 0; index < projections; ++index) {
    const LoRAProjection& p = step.projections[index];
    if (p.a == nullptr) continue;
    const at::Tensor a = *lora.get(index * kLoRAPerProjection);
    TORCH_CHECK(p.slices > 0 && a.size(1) == p.slices * p.rank, "decode_layers: projection ",
                index, "'s a_stacked ", a.sizes(), " must stack its ", p.slices,
                " slices' rank ", p.rank);
    y_width = std::max(y_width, a.size(1));
  }
  if (scales.has_value()) {
    TORCH_CHECK(scales->dim() == 1 && scales->is_contiguous() &&
                    scales->scalar_type() == at::kFloat,
                "decode_layers: lora_scales must be contiguous fp32 [S], got ", scales->sizes(),
                " ", scales->scalar_type());
    step.scales = scales->data_ptr<float>();
  }
  step.bounds = lora_slot_bounds("decode_layers", rows, starts, step.slots, batch);
  step.rows = rows.data_ptr<int64_t>();
  step.y = at::empty({batch, y_width}, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, at::TensorList weights,
    const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList kv_caches,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& seq_lens,
    int64_t num_heads,
    int64_t num_kv_heads, double scale, double eps, at::IntArrayRef windows,
    const c10::List<c10::optional<at::Tensor>>& quant, at::IntArrayRef qtypes,
    const c10::List<c10::optional<at::Tensor>>& lora, at::IntArrayRef lora_offsets,
    const c10::optional<at::Tensor>& lora_scales, const c10::optional<at::Tensor>& lora_rows,
    const c10::optional<at::Tensor>& lora_starts) {
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
  // The adapters run only where the step has a mapping (rows that run one).
  TORCH_CHECK(lora_rows.has_value() == lora_starts.has_value(),
              "decode_layers: lora_rows and lora_starts come together (the step's mapping)");
  LoRAStep lora_step;
  const LoRAStep* lora_in = nullptr;
  at::Tensor lora_row_ids;
  if (lora_rows.has_value()) {
    lora_row_ids = lora_rows->to(at::kLong).contiguous();
    check_lora(lora, lora_offsets, lora_scales, lora_row_ids, lora_starts->to(at::kLong), layers,
               batch, dtype, lora_step);
    lora_in = &lora_step;
  }
  at::Tensor x, residual;
  if (dtype == at::kBFloat16) {
    run_layers<at::BFloat16>(hidden, weights, biases, kv_caches, p, cos.data_ptr<float>(),
                             sin.data_ptr<float>(), s, table.data_ptr<int64_t>(), table_width,
                             len, num_heads, num_kv_heads, scale, static_cast<float>(eps),
                             windows, quant, qtypes, lora_in, x, residual);
  } else {
    run_layers<float>(hidden, weights, biases, kv_caches, p, cos.data_ptr<float>(),
                      sin.data_ptr<float>(), s, table.data_ptr<int64_t>(), table_width, len,
                      num_heads, num_kv_heads, scale, static_cast<float>(eps), windows, quant,
                      qtypes, lora_in, x, residual);
  }
  return {x, residual};
}

}  // namespace tokenmill
