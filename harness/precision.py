"""The floating-point precision a model runs in (`model.dtype`): allowed names, native bf16 detection, `auto`.

- `float32` (the default of every conf/model file) and `bfloat16` load the model's weights in that dtype once
  (a GGUF's dequantized weights are cast at load); activations, the K/V handed to the cache and its
  full-precision parts follow. Log-softmax, NLL, KL and attention entropies are computed in float32 either way.
- `auto` picks bfloat16 where the device computes it natively (a CPU with AVX-512 BF16 or AMX-BF16 units, an
  aarch64 CPU with the BF16 extension, a CUDA GPU that supports it) and float32 elsewhere; a grid point records
  the dtype it resolved to, never `auto`.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Names only: grid points and result tables import this module, and need no torch to read a run.
DTYPES = ("float32", "bfloat16")
AUTO = "auto"
DEFAULT = "float32"
# /proc/cpuinfo flags of bf16 arithmetic units: x86 AVX-512 BF16 and AMX-BF16; aarch64 lists "bf16" in Features.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
CPUINFO = Path("/proc/cpuinfo")


def dtype_names() -> list[str]:
    return [*DTYPES, AUTO]


def cpu_flags(cpuinfo: Path | None = None) -> set[str]:
    """The CPU's feature flags from the first `flags` (x86) or `Features` (aarch64) line of `cpuinfo` (default
    /proc/cpuinfo); empty where it cannot be read."""
    try:
        text = Path(cpuinfo or CPUINFO).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16(device: str = "cpu", cpuinfo: Path | None = None) -> bool:
    """Whether `device` computes bfloat16 natively (CPU: any of BF16_FLAGS; CUDA: torch's own check)."""
    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(cpu_flags(cpuinfo) & set(BF16_FLAGS))


def resolve(name: str, device: str = "cpu", key: str = "model.dtype") -> str:
    """The dtype name a point runs in: `name` itself, or auto's choice on `device`; ValueError naming `key` for
    other names."""
    if name == AUTO:
        return "bfloat16" if native_bf16(device) else DEFAULT
    if name not in DTYPES:
        raise ValueError(f"{key}: unknown {name!r}; allowed: {', '.join(dtype_names())}")
    return name


def torch_dtype(name: str):
    """The torch dtype of a resolved name (float32 or bfloat16)."""
    if name not in DTYPES:
        raise ValueError(f"model.dtype: unknown {name!r}; allowed: {', '.join(DTYPES)}")
    return getattr(torch, name)


def describe(device: str = "cpu") -> dict:
    """What env.json and every row record about precision support on this machine."""
    flags = sorted(cpu_flags() & set(BF16_FLAGS))
    return {"native_bf16": native_bf16(device), "bf16_cpu_flags": flags}
