"""LoRA in the worker: adapter.py reads a PEFT adapter folder into per-module A and B
matrices under tokenmill's module names. The batched shrink and expand matmuls that apply a
step's adapters row by row live below, in kernels/: punica.py (the rows' slots grouped by
`LoRAMapping`, and the torch reference), cpu/lora.py (CPU) and lora.py (Triton). The slots,
the layers that apply them and the scheduler's side are the next pieces (DESIGN.md, LoRA)."""
