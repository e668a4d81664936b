// The batch-invariant mode's process-wide switch and its op, set_batch_invariant(bool), which
// kernels/batch_invariant.py calls when the model runner sets the mode (and kernels/cpu's
// load() once the library is in, since it may load after). Registered here, as a fragment of
// the tokenmill library, so that the ops' list in registration.cpp stays as it is.
#include <torch/library.h>

#include <atomic>

#include "batch_invariant.h"

namespace tokenmill {
namespace {

std::atomic<bool> invariant{false};

void set_batch_invariant(bool on) { invariant.store(on, std::memory_order_relaxed); }

}  // namespace

bool batch_invariant_mode() { return invariant.load(std::memory_order_relaxed); }

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("set_batch_invariant(bool on) -> ()", &tokenmill::set_batch_invariant);
}
