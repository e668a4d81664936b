// The batch-invariant mode's switch (kernels/batch_invariant.py), read by the kernels whose
// arithmetic for a row would otherwise depend on how many rows or requests a call holds: on,
// each chooses one order of operations per row (its length, its width), whatever the batch.
#pragma once

namespace tokenmill {

// Whether the mode is on in this process (set by torch.ops.tokenmill.set_batch_invariant).
bool batch_invariant_mode();

}  // namespace tokenmill
