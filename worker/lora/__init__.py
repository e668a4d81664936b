"""LoRA in the worker: adapter.py reads a PEFT adapter folder into per-module A and B
matrices under tokenmill's module names; punica.py maps a step's rows to adapter slots
(grouped by slot) and holds the torch reference of the batched shrink and expand matmuls whose
kernels live in kernels/cpu/lora.py (CPU) and kernels/lora.py (Triton). The slots, the layers
that apply them and the scheduler's side are the next pieces (DESIGN.md, LoRA)."""
