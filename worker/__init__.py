"""The worker side: one process per tensor-parallel rank holding the model, the paged KV
cache tensors, the model runner and the sampler. Reached only through core/executor/."""
