#!/usr/bin/env bash
# One prepared pass on a CUDA machine, needing only torch, triton, transformers, xxhash and
# psutil installed, plus the pyzmq/msgspec/gguf wheels carried in .whl/. Its steps, by name:
#   tests: the Triton kernels against their torch references, compiled on the GPU; greedy
#      parity of tokenmill on CUDA (Triton backend, CUDA graphs) with HF transformers on
#      random-weight models (every family: Gemma's windows and caps, MoE, Phi-3 too; TP=2
#      cases skip on one GPU), CUDA graphs against eager, bf16 log-probabilities against HF,
#      the Triton engine against the torch engine; async scheduling against in-turn steps
#      (identical greedy outputs, batch rows reused safely, a clean exit after an in-process
#      async engine);
#   moe: W1 throughput on a small Qwen3-MoE with dummy weights (the fused-MoE kernel), HF
#      beside;
#   steps: the fake-model step benchmark (a 2 ms sleeping forward, real input preparation and
#      sampling on the GPU) with async scheduling off and on, in-process and across processes;
#   w1: W1 throughput on the Qwen3-0.6B shape with dummy weights, async scheduling off and on
#      (alternating), HF on the first 64 requests, with tokenmill's per-step time split;
#   quant: the Triton quantized matmuls (GGUF blocks, int4 Q4_Z, W8A8) against their torch
#      references, compiled on the GPU; an int4 checkpoint on them against HF, int8 W8A8 on
#      them against the torch arithmetic, the fp8 KV cache through Triton attention; then W1
#      on the Qwen3-0.6B shape with dummy weights, bf16 against int8 W8A8 and an fp8 cache;
#   spec: speculative decoding: the rejection sampler's distribution test and the greedy
#      equality tests (tiny random models, TP=1, async scheduling off and on) on CUDA, then
#      bench_spec_decode.py on the Qwen3-0.6B shape with dummy weights (W1-cpu; the draft is
#      the target's shape with the same dummy weights, so nearly every proposal is accepted);
#   lora: the Triton shrink/expand against the torch reference on the GPU, the engine's mixed
#      adapters against HF+peft (needs peft: carry its wheel in .whl/), then W1 on the
#      Qwen3-0.6B shape with dummy weights without LoRA, and over 1 and 4 rank-16 adapters;
#   invariance: the batch-invariant mode on CUDA: the Triton matmul (kernels/matmul.py) against
#      its reference and a row's bits alone and in batches of 2-100 rows; the Triton path's
#      logits as bits alone, beside others, chunked, after a prefix hit and as verified n-gram
#      proposals, and each prefill token's attention as a decode's (fp32 and bf16); then the
#      mode's engine tests (tests/models/test_batch_invariance.py, fp32: its bf16 cases are the
#      CPU kernels').
# `scripts/gpu_check.sh` runs them all, in that order; `scripts/gpu_check.sh tests moe` runs
# those named. The steps' time limits (300, 240, 150, 360, 390, 400, 420, 500 s) add up to
# more than one 10-minute device call: `tests moe` fit one, `steps w1` another, `quant`,
# `spec` and `invariance` one each (a 15-minute lease, its start included, has room for about
# two).
# Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
ALL_STEPS="tests moe steps w1 quant spec lora invariance"
STEPS=${*:-$ALL_STEPS}
wants() { [[ " $STEPS " == *" $1 "* ]]; }
for step in $STEPS; do
  [[ " $ALL_STEPS " == *" $step "* ]] || { echo "unknown step: $step ($ALL_STEPS)"; exit 2; }
done
if ! python3 -c "import zmq, msgspec, gguf" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Import the checkout as the `tokenmill` package without installing it.
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/tokenmill
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
status=0

if wants tests; then
  echo "== kernels and engine tests on CUDA"
  timeout 300 python3 -m pytest -q -p no:cacheprovider \
    tests/unit/test_triton_kernels.py \
    tests/models/test_cuda.py \
    tests/models/test_triton_backend.py \
    "tests/models/test_hf_parity.py::test_random_model_greedy_matches_hf" \
    tests/models/test_model_families.py \
    "tests/models/test_async_scheduling.py::test_tiny_model_async_equals_sync[1-overlapped]" \
    "tests/models/test_async_scheduling.py::test_tiny_model_async_equals_sync[1-steps-in-turn]" \
    tests/models/test_async_scheduling.py::test_rows_reused_only_after_the_step_that_wrote_them \
    tests/models/test_async_scheduling.py::test_process_exits_cleanly_after_in_process_async_engine \
    2>&1 | tee "$OUT/pytest.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if wants moe; then
  echo "== W1 throughput, a small Qwen3-MoE (16 experts, top-4), dummy weights, bf16 (the fused-MoE kernel)"
  timeout 240 python3 scripts/bench_throughput.py --model scripts/configs/qwen3-moe-tiny \
    --load-format dummy --workload W1 --compare hf --hf-requests 64 2>&1 | grep -v Warning \
    | tee "$OUT/bench_moe_w1.log" | tail -12
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if wants steps; then
  echo "== fake-model steps: 2 ms forward, 64 and 256 requests, async scheduling off and on"
  timeout 150 python3 scripts/bench_step_overlap.py --temperature 0 --forward-ms 2 \
    --requests 64 256 --executor uni mp 2>&1 | grep -v Warning \
    | tee "$OUT/bench_step_overlap.log" | tail -12
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if wants w1; then
  echo "== W1 throughput, Qwen3-0.6B shape, dummy weights, bf16, async scheduling off and on (HF: first 64 requests)"
  timeout 360 python3 scripts/bench_throughput.py --model scripts/configs/qwen3-0.6b \
    --load-format dummy --workload W1 --max-num-batched-tokens 8192 --compare hf \
    --hf-requests 64 --async-scheduling off on --step-times 2>&1 | grep -v Warning | tee "$OUT/bench_qwen3_w1.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if wants quant; then
  echo "== quantized matmuls (Triton) and the fp8 KV cache on CUDA"
  timeout 150 python3 -m pytest -q -p no:cacheprovider \
    tests/unit/test_triton_quantized.py \
    "tests/unit/test_triton_kernels.py::test_cache_write_and_attention_match_reference" \
    tests/models/test_int4_model.py::test_int4_checkpoint_on_triton_matmuls_matches_hf \
    tests/models/test_int8_model.py::test_int8_on_triton_matmuls_matches_the_torch_reference \
    tests/models/test_triton_backend.py::test_fp8_kv_cache_triton_engine_matches_torch_engine \
    2>&1 | tee "$OUT/pytest_quant.log" | tail -15
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  echo "== W1, Qwen3-0.6B shape, dummy weights, bf16: unquantized, int8 W8A8, fp8 KV cache"
  timeout 240 python3 scripts/bench_throughput.py --model scripts/configs/qwen3-0.6b \
    --load-format dummy --workload W1 --quantization none int8 --kv-cache-dtype auto fp8 \
    2>&1 | grep -v Warning | tee "$OUT/bench_quant_w1.log" | tail -12
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if wants spec; then
  echo "== speculative decoding on CUDA: rejection sampler, greedy equality, benchmark"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/test_spec_decode_parts.py \
    tests/unit/test_spec_governor.py tests/models/test_spec_decode.py -k "not smollm2 and not tp2" \
    2>&1 | tee "$OUT/pytest_spec.log" | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  timeout 200 python3 scripts/bench_spec_decode.py --model scripts/configs/qwen3-0.6b \
    --load-format dummy --draft scripts/configs/qwen3-0.6b --workloads W1-cpu \
    --concurrency 1 4 16 2>&1 | grep -v Warning | tee "$OUT/bench_spec_decode.log" | tail -14
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if wants lora; then
  echo "== LoRA on CUDA: Triton shrink/expand, mixed adapters against HF+peft, W1 with adapters"
  timeout 180 python3 -m pytest -q -p no:cacheprovider tests/unit/test_lora_punica.py \
    tests/models/test_lora.py -k "not tp2 and not smollm2" 2>&1 | tee "$OUT/pytest_lora.log" | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  timeout 240 python3 scripts/bench_throughput.py --model scripts/configs/qwen3-0.6b \
    --load-format dummy --workload W1 --lora 0 1 4 2>&1 | grep -v Warning \
    | tee "$OUT/bench_lora_w1.log" | tail -12
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if wants invariance; then
  echo "== batch-invariant mode on CUDA: the Triton matmul, the Triton path's logits as bits"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/unit/test_triton_matmul.py \
    tests/models/test_batch_invariance_triton.py 2>&1 | tee "$OUT/pytest_invariance.log" | tail -12
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/models/test_batch_invariance.py \
    -k "not bfloat16" 2>&1 | tee "$OUT/pytest_invariance_engine.log" | tail -12
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

exit $status
