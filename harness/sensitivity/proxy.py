"""The proxy sensitivity table: per (layer, KV head, width) attention-output error, from one forward pass for
all heads, and its disk cache.

In one calibration forward, each attention layer l computes its output O (B, T, Hq, D) with the model's own
eager attention (its masks, sliding windows and softcapping), then, for every KV head h and width w, again
with the K and V of head h alone stored and dequantized through the point's scheme:
    error(l, h, w) = sqrt( sum ||O'_q - O_q||^2 / sum ||O_q||^2 )
summed over sequences, positions and the query heads q of h's group (0 when O = 0).
Why this proxy: DESIGN.md 3.6 asks for the teacher-forced KL with only that head quantized, which costs one
evaluation per (head, width) (360 for smollm2's 90 heads at 4 widths); the proxy gets all of them from one
forward pass. It reads the head's real queries, keys and values and measures the error after the softmax,
where attention consumes it (a key error that leaves the attention rows unchanged costs nothing), and being
relative it puts heads with outputs of different scale on one footing. It ignores the output projection's
weight on the head and how later layers amplify or absorb the error: `proxy_check` (proxy_check.py) measures
whether the ranking survives that (Spearman correlation with the real KL).

Each layer is measured on full-precision inputs, so errors do not compound across layers. The whole
sequence is stored at once; every shipped scheme quantizes heads independently, so all heads are stored at w
together, and only h's g query heads are recomputed, against head h's stored K/V alone (the eager function
repeats one KV head g times; no other query head reads head h). For residual-window schemes (kivi) the
window is the sequence's last R tokens, not each query's most recent R as in decoding: a rougher proxy there.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from harness.attention import SENSITIVITY_PROBE, installed
from harness.calibrate.disk import disk_cached, model_identity, source_identity
from harness.calibrate.windows import layer_types
from harness.policies import quantized_widths
from harness.schemes import Scheme
from harness.sensitivity.common import cache_shape
from kernels.reference import WIDTHS as PACKED_WIDTHS

CACHE_VERSION = 2  # 2: no rows for KV-shared layers
Quantizer = Callable[[torch.Tensor, int, str], torch.Tensor]  # (x (B, Hkv, T, D), width, role) -> same shape


def scheme_quantizer(scheme: Scheme) -> Quantizer:
    """Store every head of x at one width in a fresh store of `scheme`; return what the store holds, dequantized."""

    def quantize(x: torch.Tensor, width: int, role: str) -> torch.Tensor:
        B, H, _, D = x.shape  # (B, Hkv, T, D)
        store = scheme.new_store([width] * H, D, B, x.dtype, x.device, role=role)
        store.append(x)
        return store.dequantize()

    return quantize


class _Meter:
    """Squared output errors (per KV head and width) and squared outputs (per KV head), summed per layer.

    Only `layers` (those with a KV cache of their own) are measured; the others just attend.
    """

    def __init__(self, quantize: Quantizer, widths: Sequence[int], layers: set[int]):
        self.quantize, self.widths, self.layers = quantize, list(widths), layers
        self.error: dict[int, torch.Tensor] = {}  # layer -> (Hkv, |W|) float64
        self.norm: dict[int, torch.Tensor] = {}  # layer -> (Hkv,) float64

    def record(self, layer: int, attend: Callable, query, key, value) -> torch.Tensor:
        """One layer's call: query (B, Hq, T, D), key and value (B, Hkv, T, D); returns the exact output.

        attend(q (B, n * g, T, D), k, v (B, n, T, D)) -> (out (B, T, n * g, D), _), the model's eager
        attention.
        """
        out = attend(query, key, value)[0]  # (B, T, Hq, D)
        if layer not in self.layers:  # reads another layer's K/V (KV sharing): nothing of its own to store
            return out
        n_kv = key.shape[1]
        assert out.shape[2] == query.shape[1], f"attention output {tuple(out.shape)} is not (B, T, Hq, D)"
        grouped = out.double().unflatten(2, (n_kv, -1))  # (B, T, Hkv, g, D)
        norm = grouped.square().sum((0, 1, 3, 4))  # (Hkv,)
        error = torch.zeros(n_kv, len(self.widths), dtype=torch.float64)
        queries = query.unflatten(1, (n_kv, -1))  # (B, Hkv, g, T, D)
        for j, width in enumerate(self.widths):
            k_all, v_all = self.quantize(key, width, "key"), self.quantize(value, width, "value")
            for h in range(n_kv):
                # only h's group reads h's K/V: attend its g query heads to head h alone
                heads = slice(h, h + 1)
                changed = attend(queries[:, h], k_all[:, heads], v_all[:, heads])[0]  # (B, T, g, D)
                error[h, j] = (changed.double() - grouped[:, :, h]).square().sum()
        self.error[layer] = self.error.get(layer, 0) + error
        self.norm[layer] = self.norm.get(layer, 0) + norm
        return out

    def table(self, num_layers: int, num_kv_heads: int) -> pd.DataFrame:
        rows = []
        for layer in sorted(self.error):
            ratio = self.error[layer] / self.norm[layer][:, None]  # (Hkv(layer), |W|)
            relative = torch.where(self.error[layer] == 0, 0.0, ratio).sqrt()
            for h in range(len(relative)):
                for j, width in enumerate(self.widths):
                    rows.append(dict(layer=layer, kv_head=h, bits=width, error=float(relative[h, j])))
        table = pd.DataFrame(rows, columns=["layer", "kv_head", "bits", "error"])
        table.attrs.update(num_layers=num_layers, num_kv_heads=num_kv_heads)
        return table


def measured_widths(widths: Sequence[int]) -> list[int]:
    quantized = quantized_widths(widths)
    if not quantized:
        raise ValueError(
            f"policy.widths: needs at least one quantized width ({', '.join(map(str, PACKED_WIDTHS))}); got {list(widths)}"
        )
    return quantized


@torch.no_grad()
def head_sensitivity(
    model, input_ids: torch.Tensor, scheme: Scheme, widths: Sequence[int] = PACKED_WIDTHS, batch_size: int = 1
) -> pd.DataFrame:
    """The proxy error of every cached (layer, KV head) at every quantized width in `widths`, on input_ids.

    input_ids: (S, T), fed batch_size sequences at a time. Returns columns layer, kv_head, bits, error (one
    row per head and width; 16 is never measured: its error is 0); attrs num_layers, num_kv_heads (the most of
    any layer). Layers without a KV cache of their own (linear attention, KV sharing) have no rows; a layer
    has rows for its own KV heads only.
    """
    widths = measured_widths(widths)
    scheme.check_widths(widths)
    cached = {i for i, kind in enumerate(layer_types(model.config)) if kind != "linear"}
    meter = _Meter(scheme_quantizer(scheme), widths, cached)
    with installed(model, SENSITIVITY_PROBE, meter):
        for start in range(0, input_ids.shape[0], batch_size):
            model(input_ids=input_ids[start : start + batch_size].to(model.device), use_cache=False)
    return meter.table(*cache_shape(model))


def cached_sensitivity(
    model,
    model_name: str,
    input_ids: torch.Tensor,
    scheme: Scheme,
    widths: Sequence[int] = PACKED_WIDTHS,
    source: str | None = None,
) -> pd.DataFrame:
    """head_sensitivity, read from disk (calibration's cache dir) when measured before with the same model,
    model config, calibration tokens (cut from the calibration `source`), scheme (name, group size, options) and
    widths."""
    widths = measured_widths(widths)
    options = json.dumps(dataclasses.asdict(scheme), sort_keys=True)
    identity = (
        f"{CACHE_VERSION}|{model_identity(model, model_name)}|{options}|{widths}|{tuple(input_ids.shape)}"
    ) + source_identity(source)
    table = disk_cached(
        f"{model_name}-sensitivity",
        identity,
        input_ids,
        lambda: head_sensitivity(model, input_ids, scheme, widths),
    )
    num_layers, num_kv_heads = cache_shape(model)
    table.attrs.update(num_layers=num_layers, num_kv_heads=num_kv_heads)
    return table
