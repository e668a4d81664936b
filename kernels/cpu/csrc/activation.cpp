// silu_and_mul: a gated MLP's [.., 2n] gate/up output -> silu(gate) * up [.., n], as the
// torch path computes it (torch's own vectorized SiLU on the gate half, in place, then the
// product): the same bits, in two ATen calls from C++ instead of three ops from Python.
#include <ATen/ATen.h>

#include "ops.h"

namespace tokenmill {

at::Tensor silu_and_mul(const at::Tensor& x) {
  const int64_t n = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) == 2 * n, "silu_and_mul: the last dimension must be even, got ",
              x.size(-1));
  at::Tensor gate = x.narrow(-1, 0, n);
  return at::silu_(gate).mul(x.narrow(-1, n, n));
}

}  // namespace tokenmill
