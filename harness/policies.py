"""Bit-allocation policies: per-KV-head entropy statistics and a budget -> bits per layer and KV head.

This module owns the allocation rules and nothing else (no model code, no I/O):
- `kv_head_entropy`: the entropy table (one row per layer and query head) -> one entropy per KV head;
- `head_errors`: a measured sensitivity table (harness/sensitivity.py) -> each head's error at each width;
- `allocate`: entropy (+ measured errors) + budget + policy -> an `Allocation` (bits per layer and KV head,
  16 = unquantized);
- `validate`: the checks on a policy config, each failure one line naming its config key.

Policies: `uniform` (one width everywhere), `entropy` (b_h = c + alpha * (H_avg - H_h): fewer bits for
high-entropy heads, low-entropy sink heads kept at 16), `sinks` (sinks at 16, the rest uniform),
`random` (entropy's widths dealt to random heads: the control), `inverted` (entropy's slope reversed),
`sensitivity` (greedy on measured errors: every head starts at the smallest width, then the promotion with the
largest error reduction per extra bit that the budget still allows, until none fits) and `layerwise` (the same
greedy with one width per layer, on the layer's summed error). The measured policies take 16 as a width only
when `widths` lists it; alpha is unused.
Budget units: `bytes` (the default) meets the budget in true bytes: `budget` bits per element is converted to
the bytes uniform at that width would hold, and the scheme's byte model (a `price` per element at each width)
prices every head, so a 16-bit sink head, which stores no scales, is charged its real bytes and policies
compared at one budget hold equal bytes. `bits` charges every head its width alone (equal mean bits), the
claim's convention. Budget modes: `exact` (the sinks are paid for by the other heads, the total never exceeds
the budget) and `claim` (a public write-up's procedure: nearest rounding, the budget applies to the non-sink
heads only, in bits).
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import pandas as pd
import torch

ENTROPY_POLICIES = ("uniform", "entropy", "sinks", "random", "inverted")  # the entropy table is enough
MEASURED_POLICIES = ("sensitivity", "layerwise")  # they need a measured table (harness.sensitivity)
POLICIES = ENTROPY_POLICIES + MEASURED_POLICIES
BUDGET_MODES = ("exact", "claim")
BUDGET_UNITS = ("bytes", "bits")
ALLOWED_WIDTHS = (2, 3, 4, 8, 16)
UNQUANTIZED = 16
ENTROPY_KEYS = ("H2", "H1")
AGGREGATES = ("mean", "min")
TOLERANCE = 1e-9  # bits: float slack when comparing an integer total with budget * n


@dataclass(frozen=True, eq=False)
class Allocation:
    """One policy's bits per (layer, KV head) and how it got there."""

    bits: torch.Tensor  # int64 [num_layers, num_kv_heads]; 16 = unquantized; uncached rows and padding hold 0
    mean_bits: float  # realized mean over the cached heads (sinks count 16)
    sinks: torch.Tensor  # bool [num_layers, num_kv_heads]
    continuous: torch.Tensor  # float64 [num_layers, num_kv_heads]; pre-rounding b_h, NaN for sinks/uncached
    policy: str

    @property
    def cached(self) -> torch.Tensor:
        """bool [num_layers, num_kv_heads]: the heads that have a KV cache."""
        return self.bits > 0

    def histogram(self) -> dict[int, int]:
        """Width -> number of cached heads at that width (sinks under 16)."""
        return dict(sorted(Counter(self.bits[self.cached].tolist()).items()))

    def to_records(self) -> list[dict]:
        """One JSON-ready dict per cached head, in (layer, kv_head) order."""
        records = []
        for layer, kv_head in self.cached.nonzero().tolist():
            value = self.continuous[layer, kv_head].item()
            records.append(
                {
                    "layer": layer,
                    "kv_head": kv_head,
                    "bits": int(self.bits[layer, kv_head]),
                    "sink": bool(self.sinks[layer, kv_head]),
                    "continuous": None if math.isnan(value) else value,
                }
            )
        return records


# ---------------------------------------------------------------------------------------------- validate


def _unknown(key: str, value: object, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{key}: unknown {value!r}{hint}; allowed: {', '.join(allowed)}"


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _check_widths(widths: object) -> list[int]:
    """The sorted distinct widths, or ValueError naming policy.widths."""
    allowed = ", ".join(map(str, ALLOWED_WIDTHS))
    if isinstance(widths, str | bytes) or not isinstance(widths, Iterable):
        raise ValueError(f"policy.widths: expected a list of widths from {allowed}; got {widths!r}")
    widths = list(widths)
    for width in widths:
        if not isinstance(width, numbers.Integral) or isinstance(width, bool) or width not in ALLOWED_WIDTHS:
            raise ValueError(f"policy.widths: {width!r} is not an allowed width; allowed: {allowed}")
    if not any(width != UNQUANTIZED for width in widths):
        raise ValueError(f"policy.widths: needs at least one quantized width (2, 3, 4, 8); got {widths}")
    return sorted({int(width) for width in widths})


def _quantized(widths: Iterable[int]) -> list[int]:
    return sorted({int(width) for width in widths} - {UNQUANTIZED})


def validate(
    budget: float,
    policy: str,
    alpha: float,
    sink_threshold: float | None,
    sink_fraction: float | None,
    widths: Sequence[int],
    budget_mode: str,
    budget_unit: str = "bytes",
) -> None:
    """Raise ValueError (one line naming the config key and what is allowed) for a bad policy config."""
    if policy not in POLICIES:
        raise ValueError(_unknown("policy.name", policy, POLICIES))
    widths = _check_widths(widths)
    low, high = _quantized(widths)[0], widths[-1]
    if not _is_real(budget) or not low <= budget <= high:
        raise ValueError(
            f"policy.budget: {budget!r} is not allowed; expected a number of bits per head in "
            f"[{low}, {high}] (smallest quantized width to largest width)"
        )
    if not _is_real(alpha) or math.isinf(alpha):
        raise ValueError(f"policy.alpha: expected a finite real number; got {alpha!r}")
    if sink_threshold is not None and not (_is_real(sink_threshold) and sink_threshold >= 0):
        raise ValueError(f"policy.sink_threshold: expected null or a number >= 0; got {sink_threshold!r}")
    if sink_fraction is not None and not (_is_real(sink_fraction) and 0 <= sink_fraction <= 1):
        raise ValueError(f"policy.sink_fraction: expected null or a number in [0, 1]; got {sink_fraction!r}")
    if sink_threshold is not None and sink_fraction is not None:
        raise ValueError(
            "policy.sink_fraction: set at most one sink rule; policy.sink_threshold and "
            f"policy.sink_fraction are both set ({sink_threshold!r}, {sink_fraction!r})"
        )
    if budget_mode not in BUDGET_MODES:
        raise ValueError(_unknown("policy.budget_mode", budget_mode, BUDGET_MODES))
    if budget_unit not in BUDGET_UNITS:
        raise ValueError(_unknown("policy.budget_unit", budget_unit, BUDGET_UNITS))


# ------------------------------------------------------------------------------------------------ entropy


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
        raise ValueError(_unknown("policy.entropy_key", entropy_key, ENTROPY_KEYS))
    if aggregate not in AGGREGATES:
        raise ValueError(_unknown("policy.aggregate", aggregate, AGGREGATES))
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


# ---------------------------------------------------------------------------------------------- allocate


def _sink_mask(h: torch.Tensor, sink_threshold: float | None, sink_fraction: float | None) -> torch.Tensor:
    """bool [n]: threshold rule H < threshold, or the floor(q * n + 0.5) lowest (stable: ties by order)."""
    if sink_threshold is not None:
        return h < sink_threshold
    sinks = torch.zeros_like(h, dtype=torch.bool)
    if sink_fraction is not None:
        count = math.floor(sink_fraction * len(h) + 0.5)
        sinks[torch.argsort(h, stable=True)[:count]] = True
    return sinks


def _slope(policy: str, alpha: float) -> float:
    if policy in ("uniform", "sinks"):
        return 0.0
    return -abs(alpha) if policy == "inverted" else float(alpha)


def scale_bits(price: Callable[[int], float], widths: Sequence[int]) -> float:
    """Bits per element that a quantized head stores beside its codes (scales, zeros), from the byte model.

    `price(w)`: bytes per stored element at width w. The bytes budget needs it affine in the width (the same
    overhead at every quantized width), as every per-token and per-channel scheme here is; 16 stores none.
    """
    overhead = {w: 8 * price(w) - w for w in _quantized(widths)}
    values = list(overhead.values())
    if max(values) - min(values) > 1e-9:
        raise ValueError(
            f"policy.budget_unit: bytes needs a byte model with the same overhead at every width; got {overhead}"
        )
    full = 8 * price(UNQUANTIZED)
    if abs(full - UNQUANTIZED) > 1e-9:
        raise ValueError(f"policy.budget_unit: an unquantized head must cost 16 bits per element; got {full}")
    return values[0]


def _check_affordable(budget: float, n: int, n_sinks: int, low: int, credit: float = 0.0) -> None:
    needed = UNQUANTIZED * n_sinks + low * (n - n_sinks) - credit * n_sinks
    if needed > budget * n + TOLERANCE:
        raise ValueError(
            f"policy.budget: {budget} bits/head x {n} cached heads = {budget * n:g} bits cannot pay for "
            f"{n_sinks} sink heads at {UNQUANTIZED} bits with the other {n - n_sinks} at the smallest width "
            f"{low} ({needed:g} bits, {needed / n:.4g} bits/head)"
        )


def _solve_levels(offset: torch.Tensor, target: float, low: int, high: int) -> torch.Tensor:
    """float64 [m]: clip(c + offset, low, high) with c bisected so that the sum is target (never above)."""
    if len(offset) == 0:
        return offset.clone()
    lo = low - offset.max().item()  # every head at `low`
    hi = high - offset.min().item()  # every head at `high`
    if target >= high * len(offset):
        return (hi + offset).clamp(low, high)
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if (mid + offset).clamp(low, high).sum().item() <= target:
            lo = mid
        else:
            hi = mid
    return (lo + offset).clamp(low, high)


def _round_within(continuous: torch.Tensor, target: float, widths: list[int]) -> torch.Tensor:
    """int64 [m]: round down to a width, then one promotion pass by largest remaining fraction.

    A head whose step would push the total above target is skipped; later (smaller) steps may still fit.
    """
    grid = torch.tensor(widths, dtype=torch.float64)  # [|W|]
    index = (torch.searchsorted(grid, continuous, right=True) - 1).clamp(0, len(widths) - 1)  # [m]
    upper = (index + 1).clamp(max=len(widths) - 1)
    step = grid[upper] - grid[index]  # [m], 0 at the top width
    fraction = torch.where(step > 0, (continuous - grid[index]) / step.clamp(min=1), 0.0)
    total = grid[index].sum().item()
    for head in torch.argsort(-fraction, stable=True).tolist():
        if fraction[head] <= 0:
            break
        if total + step[head].item() <= target + TOLERANCE:
            total += step[head].item()
            index[head] += 1
    return grid[index].long()


def _claim_round(continuous: torch.Tensor, target: float, widths: list[int]) -> torch.Tensor:
    """int64 [m]: the write-up's rounding: nearest width, then fix-ups by closeness to an integer."""
    grid = torch.tensor(widths, dtype=torch.float64)  # [|W|]
    index = (continuous[:, None] - grid[None, :]).abs().argmin(dim=1)  # [m], ties -> lower width
    distance = (continuous - continuous.round()).abs()  # [m]
    top = len(widths) - 1
    while grid[index].sum().item() > target + TOLERANCE:
        head = torch.where(index > 0, distance, math.inf).argmin()
        index[head] -= 1
    while True:
        step = grid[(index + 1).clamp(max=top)] - grid[index]
        fits = (index < top) & (grid[index].sum() + step <= target + TOLERANCE)
        if not fits.any():
            return grid[index].long()
        index[torch.where(fits, distance, math.inf).argmin()] += 1


def head_errors(sensitivity: pd.DataFrame, shape: tuple[int, int], widths: Sequence[int]) -> torch.Tensor:
    """float64 [num_layers, num_kv_heads, |widths|]: each head's measured error at each width, 0 at 16.

    `sensitivity` has columns layer, kv_head, bits, error (harness.sensitivity); heads without rows are NaN.
    """
    missing = {"layer", "kv_head", "bits", "error"} - set(sensitivity.columns)
    if missing:
        raise ValueError(f"sensitivity table: missing columns {sorted(missing)}")
    out = torch.full((*shape, len(widths)), math.nan, dtype=torch.float64)
    for j, width in enumerate(widths):
        if width == UNQUANTIZED:
            out[..., j] = 0.0
            continue
        rows = sensitivity[sensitivity["bits"] == width]
        if rows.empty:
            measured = sorted(set(sensitivity["bits"].tolist()))
            raise ValueError(
                f"sensitivity table: no measurements at width {width}; measured widths: {measured}"
            )
        layer = torch.tensor(rows["layer"].to_numpy(dtype="int64"))  # [rows]
        kv_head = torch.tensor(rows["kv_head"].to_numpy(dtype="int64"))  # [rows]
        error = torch.tensor(rows["error"].to_numpy(dtype="float64"))  # [rows]
        inside = (layer >= 0) & (layer < shape[0]) & (kv_head >= 0) & (kv_head < shape[1])
        if not inside.all() or not (torch.isfinite(error) & (error >= 0)).all():
            raise ValueError(f"sensitivity table: rows outside {shape} heads or errors not finite and >= 0")
        out[layer, kv_head, j] = error
    return out


def _greedy(errors: torch.Tensor, sizes: torch.Tensor, costs: list[float], target: float) -> torch.Tensor:
    """int64 [u]: a width index per unit (a head, or a layer's heads sharing one width).

    errors: float64 [u, |W|], a unit's error at each width; costs: bits per element that each width costs,
    ascending; sizes: float64 [u], its heads (one step of s bits costs s * size bits). Every unit starts at widths[0]; then, repeatedly, the promotion with the largest
    error reduction per extra bit among those that keep the total within target and do not raise the error
    (ties: lowest unit, then the cheaper promotion). A promotion may skip widths: measured errors need not be
    convex in the width, and a step that gains nothing may open the way to one that gains much.
    """
    grid = torch.tensor(costs, dtype=torch.float64)  # [|W|]
    index = torch.zeros(len(sizes), dtype=torch.int64)  # [u]
    units = torch.arange(len(sizes))
    total = costs[0] * sizes.sum().item()
    while True:
        cost = (grid[None, :] - grid[index][:, None]) * sizes[:, None]  # [u, |W|] extra bits
        gain = errors[units, index][:, None] - errors  # [u, |W|]
        allowed = (cost > 0) & (total + cost <= target + TOLERANCE) & (gain >= 0)
        if not allowed.any():
            return index
        rate = torch.where(allowed, gain / cost.clamp(min=1), -math.inf)
        unit, width = divmod(int(rate.argmax()), len(costs))
        index[unit] = width
        total += cost[unit, width].item()


def _measured_widths(
    errors: torch.Tensor,
    layer: torch.Tensor,
    per_layer: bool,
    widths: list[int],
    costs: list[float],
    target: float,
) -> torch.Tensor:
    """int64 [m]: widths of m heads (errors float64 [m, |W|], layer int64 [m]) by _greedy within target bits
    (each width costing `costs` bits per element), each head its own unit or (per_layer) one unit per layer on
    the layer's summed error."""
    unit = torch.unique(layer, return_inverse=True)[1] if per_layer else torch.arange(len(layer))  # [m]
    n_units = int(unit.max()) + 1 if len(unit) else 0
    unit_errors = torch.zeros(n_units, len(widths), dtype=torch.float64).index_add_(0, unit, errors)
    sizes = torch.bincount(unit, minlength=n_units).double()  # [units]
    index = _greedy(unit_errors, sizes, costs, target)
    return torch.tensor(widths, dtype=torch.int64)[index[unit]]


def _permute_non_sinks(allocation: Allocation, seed: int) -> Allocation:
    """The same widths (and their b_h) dealt to the non-sink heads in a seeded random order."""
    free = allocation.cached & ~allocation.sinks  # [L, Hkv]
    order = torch.randperm(int(free.sum()), generator=torch.Generator().manual_seed(seed))
    bits, continuous = allocation.bits.clone(), allocation.continuous.clone()
    bits[free] = allocation.bits[free][order]
    continuous[free] = allocation.continuous[free][order]
    return replace(allocation, bits=bits, continuous=continuous, policy="random")


def allocate(
    entropy: pd.DataFrame,
    budget: float,
    policy: str = "entropy",
    alpha: float = 0.25,
    sink_threshold: float | None = None,
    sink_fraction: float | None = None,
    widths: Sequence[int] = (2, 3, 4, 8),
    budget_mode: str = "exact",
    seed: int = 0,
    entropy_key: str = "H2",
    aggregate: str = "mean",
    sensitivity: pd.DataFrame | None = None,
    budget_unit: str = "bits",
    price: Callable[[int], float] | None = None,
) -> Allocation:
    """Bits per (layer, KV head) for `policy` at `budget` bits per cached head (see the module docstring).

    The measured policies need `sensitivity`, a harness.sensitivity table measured at every quantized width
    in `widths`; the entropy table still decides which heads are sinks and which are cached. The config's
    default unit is bytes (the runner passes the scheme's byte model); here it must be asked for: with
    `budget_unit="bytes"` and `budget_mode="exact"`, `price(w)` is the scheme's bytes per stored element at
    width w (harness.capacity.Storage.token_bytes / head_dim) and the budget holds in those bytes.
    """
    validate(budget, policy, alpha, sink_threshold, sink_fraction, widths, budget_mode, budget_unit)
    bytes_budget = budget_unit == "bytes" and budget_mode == "exact"
    if bytes_budget and price is None:
        raise ValueError("policy.budget_unit: bytes needs the scheme's byte model (price=); or use bits")
    if policy in MEASURED_POLICIES and sensitivity is None:
        raise ValueError(
            f"policy.name: {policy} allocates from measured errors; pass sensitivity= "
            "(harness.sensitivity.cached_sensitivity)"
        )
    if policy == "random":
        rules = {"sink_threshold": sink_threshold, "sink_fraction": sink_fraction}
        options = {
            "widths": widths,
            "budget_mode": budget_mode,
            "entropy_key": entropy_key,
            "aggregate": aggregate,
            "budget_unit": budget_unit,
            "price": price,
        }
        return _permute_non_sinks(allocate(entropy, budget, "entropy", alpha, **rules, **options), seed)
    head_entropy = kv_head_entropy(entropy, entropy_key, aggregate)  # [L, Hkv]
    cached = ~torch.isnan(head_entropy)  # [L, Hkv]
    h = head_entropy[cached]  # [n], (layer, kv_head) order
    n = len(h)
    if n == 0:
        raise ValueError("entropy table: no cached heads to allocate")
    quantized = _quantized(widths)
    if policy == "uniform":
        sink_threshold = sink_fraction = None
    sinks = _sink_mask(h, sink_threshold, sink_fraction)  # [n]
    n_sinks = int(sinks.sum())
    if budget_mode == "exact":
        # bytes: every head's scales cost the same bits per element, except a sink's, which stores none;
        # the scales the sinks do not store go to the other heads.
        credit = scale_bits(price, widths) if bytes_budget else 0.0
        _check_affordable(budget, n, n_sinks, quantized[0], credit)
        target = budget * n - UNQUANTIZED * n_sinks + credit * n_sinks
    else:
        credit = 0.0
        target = budget * (n - n_sinks)
    if policy in MEASURED_POLICIES:
        candidates = quantized + ([UNQUANTIZED] if UNQUANTIZED in widths else [])
        errors = head_errors(sensitivity, tuple(cached.shape), candidates)[cached]  # [n, |W|]
        if torch.isnan(errors).any():
            raise ValueError("sensitivity table: lacks measurements for some cached heads")
        layer = cached.nonzero()[:, 0]  # [n]
        # Costs in bits per element with the scales: a promotion to 16 also drops the head's scales.
        costs = [w + credit if w != UNQUANTIZED else float(w) for w in candidates]
        free_target = target + credit * (n - n_sinks)
        free_bits = _measured_widths(
            errors[~sinks], layer[~sinks], policy == "layerwise", candidates, costs, free_target
        )
        continuous = torch.full((n - n_sinks,), math.nan, dtype=torch.float64)  # no pre-rounding value
    else:
        offset = _slope(policy, alpha) * (h.mean() - h)[~sinks]  # [n - n_sinks], H_avg over all n heads
        if budget_mode == "exact":
            continuous = _solve_levels(offset, target, quantized[0], quantized[-1])
            free_bits = _round_within(continuous, target, quantized)
        else:
            continuous = (budget + offset).clamp(quantized[0], quantized[-1])
            free_bits = _claim_round(continuous, target, quantized)
    flat_bits = torch.full((n,), UNQUANTIZED, dtype=torch.int64)  # [n]
    flat_bits[~sinks] = free_bits
    flat_continuous = torch.full((n,), math.nan, dtype=torch.float64)  # [n]
    flat_continuous[~sinks] = continuous
    bits = torch.zeros(cached.shape, dtype=torch.int64)
    bits[cached] = flat_bits
    sink_grid = torch.zeros(cached.shape, dtype=torch.bool)
    sink_grid[cached] = sinks
    continuous_grid = torch.full(cached.shape, math.nan, dtype=torch.float64)
    continuous_grid[cached] = flat_continuous
    return Allocation(bits, flat_bits.sum().item() / n, sink_grid, continuous_grid, policy)
