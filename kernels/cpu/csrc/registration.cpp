// The one place tokenmill's CPU ops are declared (torch.ops.tokenmill.*); each op's
// implementation lives in a file of its own, named after it.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(tokenmill, m) {
  m.def("cpu_isa() -> int");
  m.def("pack_linear_weight(Tensor weight, int block_n) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("pack_linear_weight", &tokenmill::pack_linear_weight);
  m.impl("linear", &tokenmill::linear);
}

TORCH_LIBRARY_IMPL(tokenmill, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa", &tokenmill::cpu_isa);
}
