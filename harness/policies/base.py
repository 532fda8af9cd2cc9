"""The policy type: what an allocation rule is, what it returns, and how a grid point names one.

This module owns:
- `Allocation`: widths per allocation unit (layer, KV head, K|V), for keys and values separately, plus the sinks
  and the pre-rounding levels; `bits` is the one width per head that today's consumers read;
- `Policy`: a frozen dataclass per allocation rule, its fields the rule's hyperparameters (checked in
  `__post_init__`, each failure one line naming the config key); `allocate(entropy, budget, ...)` is the one
  method a rule implements, `label()` names it in reports, `normalize()` maps configurations that allocate
  identically to one, `point_fields()` writes it back as a grid point's policy fields;
- `HeadPolicy` and `SinkPolicy`: the common case, a rule that shares a budget among the cached heads of the
  entropy table (with a sink rule, for `SinkPolicy`) and implements only `free_widths`; `UnitPolicy`, a
  SinkPolicy whose `free_widths` gives each head's keys and values apart (two units per head);
- `POLICIES` (name -> class) and `from_point` (a grid point's or result row's policy).

A grid point is flat (harness.config.Point): `policy` names the class, `policy_seed` is the field `seed`, every
other field has its own key. A policy that has no field for a point key ignores it, and `point_fields` writes that
key's neutral value (alpha 0, key_offset 0, no sink rule, seed 0).
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import pandas as pd
import torch

from harness.policies.budget import budget_range, free_target, head_scale_bits, quantized_widths, scale_bits
from harness.policies.stats import ENTROPY_KEYS, kv_head_entropy
from harness.registry import Registry, unknown_name_message
from harness.schemes.base import ROLES
from kernels.layout import FULL_WIDTH
from kernels.reference import WIDTHS as PACKED_WIDTHS

# what a policy may assign (16 = unquantized): the packed widths, and 1, 5 and 6, which pca stores (a scheme's
# check_widths refuses those it does not)
ALLOWED_WIDTHS = tuple(sorted({1, 5, 6, *PACKED_WIDTHS, FULL_WIDTH}))
BUDGET_MODES = ("exact", "claim")
BUDGET_UNITS = ("bytes", "bits")
POINT_KEYS = {"seed": "policy_seed"}  # field -> grid point key, where they differ
NEUTRAL = {  # the point keys a policy has no field for
    "alpha": 0.0,
    "key_offset": 0.0,
    "sink_threshold": None,
    "sink_fraction": None,
    "policy_seed": 0,
}


@dataclass(frozen=True, eq=False)
class Allocation:
    """One policy's widths per (layer, KV head, K|V) and how it got there."""

    key_bits: (
        torch.Tensor
    )  # int64 [num_layers, num_kv_heads]; 16 = unquantized; uncached rows and padding hold 0
    value_bits: torch.Tensor  # int64 [num_layers, num_kv_heads]; likewise, for the values
    sinks: torch.Tensor  # bool [num_layers, num_kv_heads]
    continuous: (
        torch.Tensor
    )  # float64 [num_layers, num_kv_heads]; keys' pre-rounding level, NaN for sinks/uncached
    policy: str
    value_continuous: torch.Tensor | None = None  # float64 [num_layers, num_kv_heads]; None: `continuous`

    def __post_init__(self) -> None:
        if self.value_continuous is None:
            object.__setattr__(self, "value_continuous", self.continuous)

    @classmethod
    def per_head(cls, bits: torch.Tensor, sinks: torch.Tensor, continuous: torch.Tensor, policy: str):
        """Keys and values of each head at the same width (bits: int64 [num_layers, num_kv_heads])."""
        return cls(bits, bits, sinks, continuous, policy)

    @property
    def is_per_head(self) -> bool:
        """Whether every head's keys and values share one width."""
        return torch.equal(self.key_bits, self.value_bits)

    @property
    def bits(self) -> torch.Tensor:
        """int64 [num_layers, num_kv_heads]: the one width of each head's keys and values; ValueError when
        they differ (read key_bits and value_bits there)."""
        if not self.is_per_head:
            raise ValueError(
                f"allocation: {self.policy} gives keys and values different widths; this consumer reads one "
                "width per head (use key_bits and value_bits)"
            )
        return self.key_bits

    @property
    def cached(self) -> torch.Tensor:
        """bool [num_layers, num_kv_heads]: the heads that have a KV cache."""
        return self.key_bits > 0

    @property
    def mean_bits(self) -> float:
        """Realized mean width over the cached units (layer, KV head, K|V); sinks count 16."""
        total = self.key_bits.sum().item() + self.value_bits.sum().item()
        return total / (2 * int(self.cached.sum()))

    def histogram(self) -> dict:
        """Width -> number of cached heads at that width (sinks under 16), when keys and values share widths;
        otherwise the units by role: {"key": {width: heads}, "value": {width: heads}}."""
        if self.is_per_head:
            return _counts(self.bits[self.cached])
        return {"key": _counts(self.key_bits[self.cached]), "value": _counts(self.value_bits[self.cached])}

    def to_dict(self) -> dict:
        """JSON-ready: `policy` and the [num_layers, num_kv_heads] grids as nested lists (levels NaN -> null)."""
        return {
            "policy": self.policy,
            "key_bits": self.key_bits.tolist(),
            "value_bits": self.value_bits.tolist(),
            "sinks": self.sinks.tolist(),
            "continuous": _levels(self.continuous),
            "value_continuous": _levels(self.value_continuous),
        }

    @classmethod
    def from_dict(cls, values: Mapping) -> Allocation:
        """The allocation of `to_dict()`'s output; `sinks` and the levels may be null (not recorded: no sinks,
        NaN levels). ValueError naming the key for a missing or malformed entry."""
        missing = [k for k in ("policy", "key_bits", "value_bits") if k not in values]
        if missing:
            raise ValueError(
                f"allocation.{missing[0]}: missing; an allocation needs policy, key_bits, value_bits"
            )
        key_bits = _grid("allocation.key_bits", values["key_bits"], torch.long)
        shape = tuple(key_bits.shape)
        value_bits = _grid("allocation.value_bits", values["value_bits"], torch.long, shape)
        for name, grid in (("key_bits", key_bits), ("value_bits", value_bits)):
            bad = sorted(set(grid.unique().tolist()) - {0, *ALLOWED_WIDTHS})
            if bad:
                allowed = ", ".join(map(str, ALLOWED_WIDTHS))
                raise ValueError(
                    f"allocation.{name}: {bad[0]} is not a width; allowed: {allowed} (0: uncached)"
                )
        if not torch.equal(key_bits > 0, value_bits > 0):
            raise ValueError(
                "allocation.value_bits: caches other heads than allocation.key_bits (0: uncached)"
            )
        sinks = values.get("sinks")
        sinks = (
            torch.zeros(shape, dtype=torch.bool)
            if sinks is None
            else _grid("allocation.sinks", sinks, torch.bool, shape)
        )
        levels = [
            torch.full(shape, math.nan, dtype=torch.float64)
            if values.get(k) is None
            else _grid(f"allocation.{k}", values[k], torch.float64, shape)
            for k in ("continuous", "value_continuous")
        ]
        return cls(key_bits, value_bits, sinks, levels[0], str(values["policy"]), levels[1])

    def to_records(self) -> list[dict]:
        """One JSON-ready dict per cached head, in (layer, kv_head) order: its key and value widths and levels
        (and `bits`, `continuous` when the allocation gives keys and values one width per head)."""
        per_head = self.is_per_head
        records = []
        for layer, kv_head in self.cached.nonzero().tolist():
            key_level = _level(self.continuous[layer, kv_head])
            record = {
                "layer": layer,
                "kv_head": kv_head,
                "key_bits": int(self.key_bits[layer, kv_head]),
                "value_bits": int(self.value_bits[layer, kv_head]),
                "sink": bool(self.sinks[layer, kv_head]),
                "key_continuous": key_level,
                "value_continuous": _level(self.value_continuous[layer, kv_head]),
            }
            if per_head:
                record.update(bits=record["key_bits"], continuous=key_level)
            records.append(record)
        return records


def _levels(levels: torch.Tensor) -> list[list[float | None]]:
    return [[None if math.isnan(v) else v for v in row] for row in levels.tolist()]


def _grid(key: str, values: object, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """values as a 2-D tensor of dtype ([num_layers, num_kv_heads], `shape` when given); ValueError naming key."""
    try:
        if dtype == torch.float64:  # levels: null where there is none
            values = [[math.nan if v is None else v for v in row] for row in values]
        grid = torch.tensor(values, dtype=torch.float64 if dtype == torch.long else dtype)
        if dtype == torch.long:
            if not torch.equal(grid, grid.round()):
                raise ValueError
            grid = grid.long()
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"{key}: expected a [num_layers, num_kv_heads] grid of numbers; got {values!r:.60}"
        ) from None
    if grid.dim() != 2 or (shape is not None and tuple(grid.shape) != shape):
        want = "2-D" if shape is None else f"shape {shape} (as allocation.key_bits)"
        raise ValueError(f"{key}: shape {tuple(grid.shape)}; expected {want}")
    return grid


def _counts(widths: torch.Tensor) -> dict[int, int]:
    return dict(sorted(Counter(widths.tolist()).items()))


def _level(value: torch.Tensor) -> float | None:
    value = value.item()
    return None if math.isnan(value) else value


# ---------------------------------------------------------------------------------------------- checks


def is_real(value: object) -> bool:
    """A real number that is not a bool and not NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _checked_widths(widths: object) -> tuple[int, ...]:
    """The widths as given, as a tuple, or ValueError naming policy.widths."""
    allowed = ", ".join(map(str, ALLOWED_WIDTHS))
    if isinstance(widths, str | bytes) or not isinstance(widths, Iterable):
        raise ValueError(f"policy.widths: expected a list of widths from {allowed}; got {widths!r}")
    widths = list(widths)
    for width in widths:
        if not isinstance(width, numbers.Integral) or isinstance(width, bool) or width not in ALLOWED_WIDTHS:
            raise ValueError(f"policy.widths: {width!r} is not an allowed width; allowed: {allowed}")
    repeated = [w for i, w in enumerate(widths) if w in widths[:i]]
    if repeated:
        raise ValueError(f"policy.widths: {repeated[0]} appears twice in {widths}; allowed: each width once")
    if not any(width != FULL_WIDTH for width in widths):
        raise ValueError(
            f"policy.widths: needs at least one quantized width ({', '.join(map(str, PACKED_WIDTHS))}); got {widths}"
        )
    return tuple(int(width) for width in widths)


def _check_name(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(unknown_name_message(key, value, list(allowed)))


# ---------------------------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class Policy(ABC):
    """An allocation rule; subclasses are frozen dataclasses whose fields are its hyperparameters.

    `widths`: the widths it may assign (16 = unquantized, only where listed); `budget_mode`: `exact` (the total
    over all cached heads, sinks included, meets the budget) or `claim` (the claim's procedure: the budget
    applies to the non-sink heads); `budget_unit`: `bytes` (the budget holds in the scheme's true bytes) or
    `bits` (in mean bits); `entropy_key`: the entropy column read (H2 or H1).
    """

    name: ClassVar[str] = ""  # the registered name (POLICIES), set by `register`
    # The measured table it allocates from: a name in harness.sensitivity.MEASUREMENTS ("proxy", "unit_kl"),
    # which the runner measures once per model, scheme, widths and chunk and passes as `sensitivity`; None: none.
    measurement: ClassVar[str | None] = None
    # Whether a 16 in `widths` is a width it may give a unit (the measured policies weigh it against the others);
    # every other policy rounds among the quantized widths, keeping only its sink heads at 16.
    assigns_full_width: ClassVar[bool] = False

    widths: tuple[int, ...] = PACKED_WIDTHS
    budget_mode: str = "exact"
    budget_unit: str = "bytes"
    entropy_key: str = "H2"

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", _checked_widths(self.widths))
        if FULL_WIDTH in self.widths and not self.assigns_full_width:
            assigning = [name for name in POLICIES.names() if POLICIES.get(name).assigns_full_width]
            raise ValueError(
                f"policy.widths: {FULL_WIDTH} with policy.name {self.name}, which assigns only quantized widths "
                f"(its sink rule keeps heads at {FULL_WIDTH}); allowed: quantized widths, or {FULL_WIDTH} with "
                f"{', '.join(assigning)}"
            )
        _check_name("policy.budget_mode", self.budget_mode, BUDGET_MODES)
        _check_name("policy.budget_unit", self.budget_unit, BUDGET_UNITS)
        _check_name("policy.entropy_key", self.entropy_key, ENTROPY_KEYS)

    @abstractmethod
    def allocate(
        self,
        entropy: pd.DataFrame,
        budget: float,
        *,
        price: Callable[[int, str], float] | None = None,
        sensitivity: pd.DataFrame | None = None,
    ) -> Allocation:
        """Widths per (layer, KV head, K|V) at `budget` bits per element (harness/policies/__init__.py).

        `entropy`: the calibration table (harness.calibrate), which decides the cached heads; `price(w, role)`:
        the scheme's bytes per stored element of `role` (key or value) at width w
        (harness.capacity.element_price), needed by a bytes budget in exact mode; `sensitivity`: the measured table
        (harness.sensitivity) of a policy with a `measurement`.
        """

    def check_budget(self, budget: object) -> None:
        """ValueError naming policy.budget unless budget lies in [smallest quantized width, largest width]."""
        low, high = budget_range(self.widths)
        if not is_real(budget) or not low <= budget <= high:
            raise ValueError(
                f"policy.budget: {budget!r} is not allowed; expected a number of bits per head in "
                f"[{low}, {high}] (smallest quantized width to largest width)"
            )

    def label(self) -> str:
        """The policy as reports name it, without budget or scheme (e.g. 'entropy a=0.25 + sinks H2<0.5')."""
        return self.name

    def normalize(self) -> Policy:
        """The canonical form of this configuration: configurations that allocate identically normalise equal
        (the sweep gives them one key). A setting a policy ignores is no field of it (`from_point` drops
        it); what is left is the claim's mode, which budgets in bits whatever budget_unit says."""
        return replace(self, budget_unit="bits") if self.budget_mode == "claim" else self

    def point_fields(self) -> dict:
        """The grid point's policy fields but the budget (harness.config.POLICY_FIELDS), keys this policy has no
        field for at their neutral values."""
        out = {"policy": self.name, **NEUTRAL}
        for field in fields(self):
            out[POINT_KEYS.get(field.name, field.name)] = getattr(self, field.name)
        out["widths"] = list(self.widths)
        return out


POLICIES = Registry[type[Policy]]("policy.name")


def register(name: str):
    """Class decorator: add a Policy subclass to POLICIES under `name` (its `name`)."""

    def add(cls: type[Policy]) -> type[Policy]:
        cls.name = name
        return POLICIES.register(name)(cls)

    return add


def from_point(point: Mapping) -> Policy:
    """The policy of a grid point or result row: `policy` names it, its fields come from their point keys (a
    missing key takes the field's default, a key it has no field for is ignored); ValueError naming the key."""
    name = point.get("policy")
    if not isinstance(name, str):
        raise ValueError(unknown_name_message(POLICIES.key, name, POLICIES.names()))
    cls = POLICIES.get(name)
    keys = {field.name: POINT_KEYS.get(field.name, field.name) for field in fields(cls)}
    return cls(**{field: point[key] for field, key in keys.items() if key in point})


# ---------------------------------------------------------------------------------------- the common case


@dataclass(frozen=True, kw_only=True)
class Heads:
    """What a `HeadPolicy` shares out: the n cached heads of the entropy table, in (layer, kv_head) order, and
    the bits the m of them that are not sinks may hold."""

    # bool [num_layers, num_kv_heads]: the heads that have a KV cache
    cached: torch.Tensor
    # float64 [n]: each cached head's entropy
    entropy: torch.Tensor
    # bool [n]: the heads kept at 16
    sinks: torch.Tensor
    # bits per element per cached head
    budget: float
    # bits the non-sink heads may hold in total, in one role (a head's keys and values together: twice that)
    target: float
    # bits per element of scales a 16-bit head does not store, given to the others (a bytes budget; else 0)
    credit: float
    # that credit per role (ROLES: keys, values), for policies whose units are a head's keys and its values
    role_credit: tuple[float, ...]
    # the policy's quantized widths, ascending
    quantized: list[int]
    # the measured table of a policy with a `measurement`; else None
    sensitivity: pd.DataFrame | None

    def grid(self, free: torch.Tensor, sink=math.nan, uncached=math.nan) -> torch.Tensor:
        """[num_layers, num_kv_heads] of free's dtype: `free` ([m] or [n]) at the non-sink (or all) cached
        heads, `sink` at the sinks (when free covers only the others), `uncached` elsewhere."""
        flat = free
        if len(free) != len(self.entropy):
            flat = torch.full((len(self.entropy),), sink, dtype=free.dtype)  # [n]
            flat[~self.sinks] = free
        out = torch.full(self.cached.shape, uncached, dtype=free.dtype)  # [L, Hkv]
        out[self.cached] = flat
        return out


@dataclass(frozen=True)
class HeadPolicy(Policy):
    """A policy that gives every cached head of the entropy table one width (keys and values alike) within the
    budget: the sinks (`sinks`) at 16, the others by `free_widths`, the one method a subclass implements."""

    def sinks(self, h: torch.Tensor) -> torch.Tensor:
        """bool [n]: the heads kept at 16, of n cached heads with entropies h [n]; none by default."""
        return torch.zeros_like(h, dtype=torch.bool)

    @abstractmethod
    def free_widths(self, heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
        """The non-sink heads' widths (int64 [m], summing to at most heads.target) and their pre-rounding
        levels (float64 [m], NaN where there are none), m = heads that are not sinks."""

    def share(
        self,
        entropy: pd.DataFrame,
        budget: float,
        price: Callable[[int, str], float] | None,
        sensitivity: pd.DataFrame | None,
    ) -> Heads:
        """The cached heads of the entropy table, their sinks and what the others may hold (Heads); ValueError
        for a bytes budget without a price, a measured policy without its table, or a budget that cannot pay for
        the sinks."""
        self._check_inputs(budget, price, sensitivity)
        head_entropy = kv_head_entropy(entropy, self.entropy_key)  # [L, Hkv], NaN where no cache
        cached = ~torch.isnan(head_entropy)
        h = head_entropy[cached]  # [n]
        if len(h) == 0:
            raise ValueError("entropy table: no cached heads to allocate")
        sinks = self.sinks(h)  # [n]
        quantized = quantized_widths(self.widths)
        credit, role_credit = self._scale_credit(price)
        target = free_target(budget, len(h), int(sinks.sum()), self.budget_mode, quantized[0], credit)
        return Heads(
            cached=cached,
            entropy=h,
            sinks=sinks,
            budget=budget,
            target=target,
            credit=credit,
            role_credit=role_credit,
            quantized=quantized,
            sensitivity=sensitivity,
        )

    @property
    def bytes_budget(self) -> bool:
        """Whether the budget holds in true bytes (priced by the scheme's byte model), not in mean bits."""
        return self.budget_unit == "bytes" and self.budget_mode == "exact"

    def _check_inputs(self, budget: float, price, sensitivity) -> None:
        self.check_budget(budget)
        if self.bytes_budget and price is None:
            raise ValueError("policy.budget_unit: bytes needs the scheme's byte model (price=); or use bits")
        if self.measurement is not None and sensitivity is None:
            raise ValueError(
                f"policy.name: {self.name} allocates from measured errors; pass sensitivity= "
                f"(harness.sensitivity.MEASUREMENTS[{self.measurement!r}])"
            )

    def _scale_credit(self, price) -> tuple[float, tuple[float, ...]]:
        """Bits per element of scales a sink (16 bits) does not store, which the other heads get: for a head
        (its keys' and values' mean: the roles may be priced apart) and per role; 0 unless the budget is in
        bytes."""
        if not self.bytes_budget:
            return 0.0, (0.0,) * len(ROLES)
        return head_scale_bits(price, self.widths), tuple(scale_bits(price, self.widths, r) for r in ROLES)

    def allocate(
        self,
        entropy: pd.DataFrame,
        budget: float,
        *,
        price: Callable[[int, str], float] | None = None,
        sensitivity: pd.DataFrame | None = None,
    ) -> Allocation:
        heads = self.share(entropy, budget, price, sensitivity)
        free_bits, continuous = self.free_widths(heads)
        bits = heads.grid(free_bits, FULL_WIDTH, 0)
        return Allocation.per_head(
            bits, heads.grid(heads.sinks, True, False), heads.grid(continuous), self.name
        )


@dataclass(frozen=True)
class SinkPolicy(HeadPolicy):
    """A HeadPolicy with a sink rule: heads with entropy below `sink_threshold`, or the
    floor(sink_fraction * n + 0.5) lowest of the n cached heads (ties by order), kept at 16; at most one rule."""

    sink_threshold: float | None = None
    sink_fraction: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        threshold, fraction = self.sink_threshold, self.sink_fraction
        if threshold is not None and not (is_real(threshold) and threshold >= 0):
            raise ValueError(f"policy.sink_threshold: expected null or a number >= 0; got {threshold!r}")
        if fraction is not None and not (is_real(fraction) and 0 <= fraction <= 1):
            raise ValueError(f"policy.sink_fraction: expected null or a number in [0, 1]; got {fraction!r}")
        if threshold is not None and fraction is not None:
            raise ValueError(
                "policy.sink_fraction: set at most one sink rule; policy.sink_threshold and "
                f"policy.sink_fraction are both set ({threshold!r}, {fraction!r})"
            )

    @property
    def has_sink_rule(self) -> bool:
        return self.sink_threshold is not None or self.sink_fraction is not None

    def sinks(self, h: torch.Tensor) -> torch.Tensor:
        if self.sink_threshold is not None:
            return h < self.sink_threshold
        sinks = torch.zeros_like(h, dtype=torch.bool)
        if self.sink_fraction is not None:
            count = math.floor(self.sink_fraction * len(h) + 0.5)
            sinks[torch.argsort(h, stable=True)[:count]] = True
        return sinks

    def sink_label(self) -> str:
        """The sink rule as reports name it: 'sinks H2<0.5' or 'sinks top 2%' ('sinks none' without one)."""
        if self.sink_threshold is not None:
            return f"sinks H2<{self.sink_threshold:g}"
        if self.sink_fraction is not None:
            return f"sinks top {100 * self.sink_fraction:g}%"
        return "sinks none"


@dataclass(frozen=True)
class UnitPolicy(SinkPolicy):
    """A SinkPolicy whose heads' keys and values are separate units: `free_widths` gives the widths and levels of
    the 2m units of the m non-sink heads (int64 [2m], float64 [2m]: their keys, then their values), summing to at
    most twice heads.target (what one role may hold: a head's keys and values hold as many elements); a sink
    head keeps both at 16."""

    def allocate(
        self,
        entropy: pd.DataFrame,
        budget: float,
        *,
        price: Callable[[int, str], float] | None = None,
        sensitivity: pd.DataFrame | None = None,
    ) -> Allocation:
        heads = self.share(entropy, budget, price, sensitivity)
        bits, levels = self.free_widths(heads)  # [2m] each: keys, then values
        m = len(bits) // 2
        return Allocation(
            heads.grid(bits[:m], FULL_WIDTH, 0),
            heads.grid(bits[m:], FULL_WIDTH, 0),
            heads.grid(heads.sinks, True, False),
            heads.grid(levels[:m]),
            self.name,
            heads.grid(levels[m:]),
        )
