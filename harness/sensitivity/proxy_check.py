"""The proxy check: does the proxy rank heads as the real loss does? The teacher-forced KL with one sampled
head quantized alone, beside that head's proxy error, and their Spearman correlation (`python -m
harness.sensitivity` runs it: harness/protocols/sensitivity_check.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from harness import evaluate
from harness.schemes import Scheme
from harness.sensitivity.common import quantized_factory, spearman
from kernels.layout import FULL_WIDTH


def sample_heads(table: pd.DataFrame, count: int, seed: int = 0) -> list[tuple[int, int]]:
    """`count` distinct measured (layer, kv_head) pairs drawn with `seed` (all of them when fewer), sorted."""
    heads = sorted(set(zip(table["layer"].tolist(), table["kv_head"].tolist())))
    order = torch.randperm(len(heads), generator=torch.Generator().manual_seed(seed))[:count]
    return sorted(heads[i] for i in order.tolist())


@torch.no_grad()
def proxy_check(
    model,
    sequences: torch.Tensor,
    table: pd.DataFrame,
    heads: Sequence[tuple[int, int]],
    width: int,
    scheme: Scheme,
    chunk: int = 128,
) -> tuple[pd.DataFrame, float]:
    """Teacher-forced KL on sequences (S, T) with only one head quantized at `width`, for each of `heads`.

    Returns (rows layer, kv_head, bits, proxy, kl_mean; the Spearman correlation of proxy with kl_mean). Every
    other head stays at 16 bits; the cache stores with quantize-on-write (prefill=quantized), as the runner's
    teacher-forced metrics do.
    """
    measured = table[table["bits"] == width].set_index(["layer", "kv_head"])["error"]
    if measured.empty:
        raise ValueError(f"--width: {width} was not measured; measured widths: {sorted(set(table['bits']))}")
    base = evaluate.teacher_forced(model, sequences, evaluate.dynamic_cache_factory(model), chunk=chunk)
    shape = (table.attrs["num_layers"], table.attrs["num_kv_heads"])
    rows = []
    for layer, kv_head in heads:
        bits = torch.full(shape, FULL_WIDTH, dtype=torch.long)
        bits[layer, kv_head] = width
        factory = quantized_factory(model, scheme, bits, bits)
        run = evaluate.teacher_forced(model, sequences, factory, chunk=chunk, baseline=base)
        kl = float(run.kl.double().mean())
        rows.append(
            dict(layer=layer, kv_head=kv_head, bits=width, proxy=measured[layer, kv_head], kl_mean=kl)
        )
    result = pd.DataFrame(rows, columns=["layer", "kv_head", "bits", "proxy", "kl_mean"])
    return result, spearman(result["proxy"], result["kl_mean"])
