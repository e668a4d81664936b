// Declarations of tokenmill's CPU ops (registered in registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace tokenmill {

// What this CPU runs (isa.cpp): 3 AMX (bf16 tiles), 2 AVX-512 with bf16 dot products,
// 1 AVX-512, 0 AVX2 and FMA, -1 none of these.
int64_t cpu_isa();

// linear.cpp: a weight [N, K] re-laid out once for `linear`, and the product x @ W^T.
at::Tensor pack_linear_weight(const at::Tensor& weight, int64_t block_n);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const c10::optional<at::Tensor>& bias);

}  // namespace tokenmill
