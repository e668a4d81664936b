"""The CPU's default dtype: bf16 only where the CPU multiplies bf16 natively and neither torch
nor oneDNN is held below it; fp32 elsewhere (this machine's own answer is checked against
torch's view of it)."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from tokenmill.protocol import device_defaults
from tokenmill.protocol.config import EngineArgs
from tokenmill.protocol.cpu_features import cpu_flags, native_bf16

ZEN4 = frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"})
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
ZEN3 = frozenset({"avx", "avx2", "fma", "f16c"})
SKYLAKE_X = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl"})


@pytest.mark.parametrize(
    "flags, environ, expected",
    [
        (ZEN4, {}, True),
        (SAPPHIRE_RAPIDS, {}, True),
        (ZEN3, {}, False),
        (SKYLAKE_X, {}, False),  # AVX-512 without bf16 dot products
        (ZEN4, {"ATEN_CPU_CAPABILITY": "avx2"}, False),
        (ZEN4, {"ATEN_CPU_CAPABILITY": "default"}, False),
        (ZEN4, {"ATEN_CPU_CAPABILITY": "avx512"}, True),
        (ZEN4, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
        (ZEN4, {"ONEDNN_MAX_CPU_ISA": "avx512_core_vnni"}, False),
        (SAPPHIRE_RAPIDS, {"ONEDNN_MAX_CPU_ISA": "avx512_core_amx"}, True),
    ],
)
def test_native_bf16(flags: frozenset[str], environ: dict[str, str], expected: bool) -> None:
    assert native_bf16(flags, environ) is expected


def test_cpu_flags_reads_cpuinfo(tmp_path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_this_machine_agrees_with_torch() -> None:
    """Where the flags say bf16 is native, oneDNN's bf16 GEMM must be there too (and the
    other way round): the default dtype follows what the matmuls can do."""
    if os.environ.get("ATEN_CPU_CAPABILITY") or os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip("the ISA is capped by the environment")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        assert not native_bf16()
    elif torch.backends.mkldnn.is_available() and "avx512f" in cpu_flags():
        assert native_bf16() == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    else:  # no AVX-512 here: no bf16 dot products, whatever else converts bf16
        assert not native_bf16()


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_cpu_auto_dtype(tiny_model, monkeypatch, native: bool, expected: str) -> None:
    monkeypatch.setattr(device_defaults, "native_bf16", lambda: native)
    args = EngineArgs(model=str(tiny_model("llama-gqa")), device="cpu")
    assert args.create_engine_config().model_config.dtype == expected
    # An explicit dtype is never overridden.
    args = EngineArgs(model=str(tiny_model("llama-gqa")), device="cpu", dtype="float32")
    assert args.create_engine_config().model_config.dtype == "float32"
