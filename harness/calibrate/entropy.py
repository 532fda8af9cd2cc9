"""Per-head attention entropy from one calibration pass, and its on-disk cache.

For layer l, query head h and query position i, p is the post-softmax attention row over the keys the mask
lets position i see (causal and sliding-window masks included). Rényi order 2: H2(p) = -ln(sum_j p_j^2);
Shannon: H1(p) = -sum_j p_j ln p_j (nats). A head's value is the mean over query positions i >= i0 and over
the calibration sequences. Linear-attention layers have no attention rows and no KV cache, and layers that
reuse another layer's K/V (Gemma 4's KV sharing) no cache of their own: no rows here. Under GQA query head
h of layer l reads KV head h // (Hq / Hkv(l)); Gemma 4's global layers have fewer KV heads than its sliding.

The probabilities come from each model's own eager attention function (so softcapping, sinks and masks are the
model's), called through harness.attention's ENTROPY_PROBE, which hands them to this module's recorder and
discards the (B, H, T, T) matrices layer by layer. That call runs in float32 whatever the model's dtype: in a
bfloat16 model the queries, keys, values and mask are upcast first, so scores, softmax and entropies are
float32, and the attention output is rounded back to the model's dtype for the layers after it.
"""

from __future__ import annotations

import pandas as pd
import torch

from harness.attention import ENTROPY_PROBE, installed
from harness.cache import kv_heads
from harness.calibrate.disk import disk_cached, model_identity, source_identity
from harness.calibrate.windows import layer_types

CACHE_VERSION = 2  # 2: no rows for KV-shared layers


def table_attrs(config) -> dict:
    """An entropy table's attrs: num_layers, num_kv_heads (the most of any layer: an allocation's width) and
    kv_heads (per layer; a layer with fewer KV heads pads its allocation row)."""
    heads = kv_heads(config)
    return dict(num_layers=len(heads), num_kv_heads=max(heads), kv_heads=heads)


class _Recorder:
    """Sums of H2, H1 and counts per (layer, query head) over the rows seen so far.

    Rows are query positions i >= i0, or exactly `positions` when given.
    """

    def __init__(self, i0: int, positions: list[int] | None = None):
        self.i0, self.positions = i0, positions
        self.sums: dict[int, torch.Tensor] = {}  # layer -> (3, Hq): sum H2, sum H1, count

    def record(self, layer: int, weights: torch.Tensor) -> None:
        p = weights.detach().double()  # (B, Hq, Tq, Tk); rows are query positions 0..Tq-1 (no cache)
        p = p[:, :, self.i0 :] if self.positions is None else p[:, :, self.positions]
        if p.shape[2] == 0:
            return
        h2 = -torch.log((p * p).sum(-1))  # (B, Hq, Tq')
        h1 = -torch.special.xlogy(p, p).sum(-1)
        stats = torch.stack(
            [h2.sum((0, 2)), h1.sum((0, 2)), torch.full_like(h2[0, :, 0], h2.shape[0] * h2.shape[2])]
        )
        self.sums[layer] = self.sums.get(layer, 0) + stats


@torch.no_grad()
def head_entropies(
    model, input_ids: torch.Tensor, i0: int = 32, batch_size: int = 1, positions: list[int] | None = None
) -> pd.DataFrame:
    """Per (layer, query head) attention entropy of `model` on input_ids (S, T).

    Rows: query positions i >= i0, or only the listed `positions` (the claim protocol's few rows; i0 unused).

    Returns columns layer, layer_type, q_head, kv_head, H2, H1, n_positions; attrs as `table_attrs`.
    """
    if positions is not None and not all(0 <= i < input_ids.shape[1] for i in positions):
        raise ValueError(f"calibration: positions {positions} must lie in [0, {input_ids.shape[1]})")
    if positions is None and input_ids.shape[1] <= i0:
        raise ValueError(
            f"calibration: sequences of {input_ids.shape[1]} tokens leave no query position >= i0={i0}"
        )
    kinds, n_kv = layer_types(model.config), kv_heads(model.config)
    recorder = _Recorder(i0, positions)
    with installed(model, ENTROPY_PROBE, recorder):
        for start in range(0, input_ids.shape[0], batch_size):
            model(input_ids=input_ids[start : start + batch_size].to(model.device), use_cache=False)
    rows = []
    for layer, stats in sorted(recorder.sums.items()):
        if kinds[layer] == "linear":
            continue  # attends another layer's K/V (KV sharing): no cache of its own
        n_q = stats.shape[1]
        for h in range(n_q):
            count = int(stats[2, h])
            rows.append(
                dict(
                    layer=layer,
                    layer_type=kinds[layer],
                    q_head=h,
                    kv_head=h // (n_q // n_kv[layer]),
                    H2=float(stats[0, h] / count),
                    H1=float(stats[1, h] / count),
                    n_positions=count,
                )
            )
    table = pd.DataFrame(rows)
    table.attrs.update(table_attrs(model.config))
    return table


def cached_head_entropies(
    model, model_name: str, input_ids: torch.Tensor, i0: int = 32, source: str | None = None
) -> pd.DataFrame:
    """head_entropies, read from disk when the same model, tokens (from the calibration `source`) and i0 were
    calibrated before."""
    # The model's config is part of the key: a registry entry that changes its architecture or init (tiny
    # models) must not read another model's statistics.
    identity = f"{CACHE_VERSION}|{model_identity(model, model_name)}|{i0}|{tuple(input_ids.shape)}"
    identity += source_identity(source)
    table = disk_cached(model_name, identity, input_ids, lambda: head_entropies(model, input_ids, i0=i0))
    table.attrs.update(table_attrs(model.config))
    return table
