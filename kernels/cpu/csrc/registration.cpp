// The one place tokenmill's CPU ops are declared (torch.ops.tokenmill.*); each op's
// implementation lives in a file of its own, named after it.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(tokenmill, m) {
  m.def("cpu_isa() -> int");
  m.def("limit_cpu_isa(int limit) -> int");
  m.def("pack_linear_weight(Tensor weight, int block_n) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("linear_silu_mul(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor qs, Tensor d, Tensor? m, int qtype, Tensor? bias) -> Tensor");
  m.def("gguf_rows(Tensor qs, Tensor d, Tensor? m, int qtype, Tensor ids) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor colsum, Tensor? bias) -> Tensor");
  m.def(
      "int8_linear_silu_mul(Tensor x, Tensor qweight, Tensor scales, Tensor colsum, Tensor? bias) "
      "-> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!)? residual) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("first_extreme(Tensor x, bool largest) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("kv_cache_write(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slots) -> ()");
  m.def(
      "decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "float scale, int window, float softcap) -> Tensor");
  m.def(
      "decode_layers(Tensor hidden, Tensor[] weights, Tensor?[] biases, Tensor[] kv_caches, "
      "Tensor positions, Tensor cos, Tensor sin, Tensor slots, Tensor block_table, "
      "Tensor seq_lens, int num_heads, int num_kv_heads, float scale, float eps, "
      "int[] windows, Tensor?[] quant, int[] qtypes, Tensor?[] lora, int[] lora_offsets, "
      "Tensor? lora_scales, Tensor? lora_rows, Tensor? lora_starts) -> (Tensor, Tensor)");
  m.def(
      "prefill_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, "
      "Tensor query_start, Tensor seq_lens, float scale, int window, float softcap) -> ()");
  m.def(
      "lora_shrink(Tensor x, Tensor a_stacked, Tensor sorted_rows, Tensor starts, Tensor scale) "
      "-> Tensor");
  m.def(
      "lora_expand(Tensor(a!) out, Tensor y, Tensor b_stacked, Tensor sorted_rows, "
      "Tensor starts, int offset) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("pack_linear_weight", &tokenmill::pack_linear_weight);
  m.impl("linear", &tokenmill::linear);
  m.impl("linear_silu_mul", &tokenmill::linear_silu_mul);
  m.impl("gguf_linear", &tokenmill::gguf_linear);
  m.impl("gguf_rows", &tokenmill::gguf_rows);
  m.impl("int8_linear", &tokenmill::int8_linear);
  m.impl("int8_linear_silu_mul", &tokenmill::int8_linear_silu_mul);
  m.impl("rms_norm", &tokenmill::rms_norm);
  m.impl("silu_and_mul", &tokenmill::silu_and_mul);
  m.impl("first_extreme", &tokenmill::first_extreme);
  m.impl("rotary_embedding", &tokenmill::rotary_embedding);
  m.impl("kv_cache_write", &tokenmill::kv_cache_write);
  m.impl("decode_attention", &tokenmill::decode_attention);
  m.impl("prefill_attention", &tokenmill::prefill_attention);
  m.impl("decode_layers", &tokenmill::decode_layers);
  m.impl("lora_shrink", &tokenmill::lora_shrink);
  m.impl("lora_expand", &tokenmill::lora_expand);
}

TORCH_LIBRARY_IMPL(tokenmill, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa", &tokenmill::cpu_isa);
  m.impl("limit_cpu_isa", &tokenmill::limit_cpu_isa);
}
