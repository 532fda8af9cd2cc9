"""The statistics every policy reads: the calibration entropy table -> one entropy per cached KV head.

`kv_head_entropy` turns the table harness.calibrate writes (one row per layer and query head) into a
[num_layers, num_kv_heads] grid: a KV head's entropy aggregated over its query heads, NaN where a layer has no
KV cache of its own or fewer KV heads than the widest layer. The NaN pattern is what every allocation calls
the cached heads.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from harness.registry import unknown_name_message

ENTROPY_KEYS = ("H2", "H1")  # policy.entropy_key: Renyi order 2 or Shannon (harness.calibrate)
AGGREGATES = ("mean", "min")  # over a KV head's query heads


def _table_shape(attrs: dict, layer: torch.Tensor, kv_head: torch.Tensor) -> tuple[int, int]:
    """(num_layers, num_kv_heads) from the producer's attrs, else from the rows (layer, kv_head: [rows])."""
    if len(layer) == 0 and not {"num_layers", "num_kv_heads"} <= attrs.keys():
        raise ValueError("entropy table: no rows and no num_layers/num_kv_heads attrs")
    num_layers = int(attrs["num_layers"]) if "num_layers" in attrs else int(layer.max()) + 1
    num_kv_heads = int(attrs["num_kv_heads"]) if "num_kv_heads" in attrs else int(kv_head.max()) + 1
    inside = ((layer >= 0) & (layer < num_layers) & (kv_head >= 0) & (kv_head < num_kv_heads)).all()
    if not inside:
        raise ValueError(f"entropy table: rows outside num_layers={num_layers}, num_kv_heads={num_kv_heads}")
    return num_layers, num_kv_heads


def _real_heads(attrs: dict, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """bool [num_layers, num_kv_heads]: each layer l's first attrs["kv_heads"][l] heads (all, without it)."""
    if "kv_heads" not in attrs:
        return torch.ones(num_layers, num_kv_heads, dtype=torch.bool)
    counts = torch.tensor([int(n) for n in attrs["kv_heads"]], dtype=torch.int64)  # [L]
    if len(counts) != num_layers or not ((counts >= 0) & (counts <= num_kv_heads)).all():
        raise ValueError(
            f"entropy table: kv_heads {list(attrs['kv_heads'])} do not fit num_layers={num_layers}, "
            f"num_kv_heads={num_kv_heads}"
        )
    return torch.arange(num_kv_heads)[None, :] < counts[:, None]


def kv_head_entropy(entropy: pd.DataFrame, entropy_key: str = "H2", aggregate: str = "mean") -> torch.Tensor:
    """float64 [num_layers, num_kv_heads]: each KV head's entropy, aggregated over its query heads.

    Layers without rows (no KV cache) are NaN, and so is the padding of a layer with fewer KV heads than
    num_kv_heads (attrs kv_heads: KV heads per layer, as harness.calibrate writes); a cached layer must have
    rows for every KV head it has.
    """
    if entropy_key not in ENTROPY_KEYS:
        raise ValueError(unknown_name_message("policy.entropy_key", entropy_key, ENTROPY_KEYS))
    if aggregate not in AGGREGATES:
        raise ValueError(unknown_name_message("policy.aggregate", aggregate, AGGREGATES))
    missing = {"layer", "kv_head", entropy_key} - set(entropy.columns)
    if missing:
        raise ValueError(f"entropy table: missing columns {sorted(missing)}")
    layer = torch.tensor(entropy["layer"].to_numpy(dtype="int64"))  # [rows]
    kv_head = torch.tensor(entropy["kv_head"].to_numpy(dtype="int64"))  # [rows]
    values = torch.tensor(entropy[entropy_key].to_numpy(dtype="float64"))  # [rows]
    if not torch.isfinite(values).all():
        raise ValueError(f"entropy table: {entropy_key} has non-finite values")
    num_layers, num_kv_heads = _table_shape(entropy.attrs, layer, kv_head)
    real = _real_heads(entropy.attrs, num_layers, num_kv_heads)  # [L, Hkv]
    if not real[layer, kv_head].all():
        raise ValueError("entropy table: rows for KV heads beyond their layer's kv_heads")
    out = torch.full((num_layers * num_kv_heads,), math.nan, dtype=torch.float64)
    reduce = "mean" if aggregate == "mean" else "amin"
    out = out.scatter_reduce(0, layer * num_kv_heads + kv_head, values, reduce, include_self=False)
    out = out.view(num_layers, num_kv_heads)  # [L, Hkv]
    if (torch.isnan(out) & real)[layer.unique()].any():
        raise ValueError("entropy table: a layer with rows lacks rows for some of its KV heads")
    return out
