#!/usr/bin/env bash
# One prepared pass on a CUDA machine: correctness tests that need no model download
# (random-weight models, kernels, scheduler), then throughput on dummy weights from the
# shipped configs, with HF transformers on the same GPU in the same run.
# Expects the pyzmq/msgspec wheels in .whl/ when the machine lacks them; writes logs to $OUT.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if ! python3 -c "import zmq, msgspec" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Import the checkout as the `tokenmill` package without installing it.
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/tokenmill
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

echo "== tests on CUDA (device=auto picks the GPU)"
timeout 150 python3 -m pytest -q -x -m "not slow" -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest.log" | tail -25

echo "== throughput, SmolLM2-135M shape, dummy weights, W1-cpu"
timeout 90 python3 scripts/bench_throughput.py --model scripts/configs/smollm2-135m \
  --load-format dummy --workload W1-cpu --compare hf 2>&1 | grep -v Warning | tee "$OUT/bench_smollm2_w1cpu.log" | tail -8

echo "== throughput, Qwen2.5-0.5B shape, dummy weights, W1 (256 requests)"
timeout 240 python3 scripts/bench_throughput.py --model scripts/configs/qwen2.5-0.5b \
  --load-format dummy --workload W1 --max-num-batched-tokens 8192 --compare hf 2>&1 \
  | grep -v Warning | tee "$OUT/bench_qwen05_w1.log" | tail -8
