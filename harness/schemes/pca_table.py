"""The fitted transforms of `pca` (harness/schemes/pca.py): per layer, role (keys turned back before RoPE, values)
and KV head, a decorrelating basis and, per unit width, how many bits each component gets (KVTC's transform
coding: a PCA, then bits to components by dynamic programming, trailing components at 0 bits).

The fit (harness/calibrate/pca.py) makes every number of the tables: per component c of a head a Lloyd-Max scale
at each width, and per unit width w the plan b (D,) of component widths summing to w D.

`turn`: the radians per position of each key channel's rotary pair (as key_table.KeyTable.turn; 0 past R), which
the key store needs to turn keys back and forth; values are not turned.

`PcaFormat`: what a scheme of the pca family codes against, the same for the fit and the store: the frame of the
keys (before RoPE, relative to their block of tokens, or as cached), the levels (Lloyd-Max or evenly spaced), and
how a plan's widths group (one width per component, or per group of components from a few widths).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from harness.schemes.lloyd_max import lloyd_max, uniform_quantizer

PCA_WIDTHS = (1, 2, 3, 4, 5, 6, 8)  # the unit widths (mean bits per element) a plan is fitted for
MAX_COMPONENT_BITS = 8
MIN_GROUPS = 4  # a plan has at least 4 groups: 4 groups of 0, 1, 2, 4, 8 bits reach every unit width 1 to 8
SCALE_MIN = 2.0**-14  # the smallest normal fp16: a component never seen away from 0 keeps a positive scale
PCA_ROLES = ("key", "value")
PRE, BLOCK, POST = "pre", "block", "post"  # key frames
LLOYD, UNIFORM = "lloyd", "uniform"  # level sets
QUANTIZERS = {LLOYD: lloyd_max, UNIFORM: uniform_quantizer}


@dataclass(frozen=True)
class PcaFormat:
    """What a pca-family scheme codes against (module docstring).

    key_frame: PRE, keys turned back to position 0 (before RoPE); BLOCK, turned back to the first position of
    their block of `block` tokens (first + k block, `first` the store's first position), so a key keeps RoPE's
    turn by its offset in the block only and a kernel turns a block's query once; POST, keys as cached (after
    RoPE). levels: LLOYD (Lloyd-Max levels of N(0, 1)) or UNIFORM (Max's evenly spaced ones: a code's value is
    an affine map of the code). A plan gives each `group` consecutive components (0: all of a head's) one width from
    `group_widths`;
    each head has its own plans, or (shared_plans) every head of a role has the same one at each width.
    own_pairs (BLOCK frame only): the first own_pairs rotary pairs of a key (i, i + R / 2, i < own_pairs: the
    fastest-turning ones) are turned back by each key's own position instead of its block's, and the key basis is
    block-diagonal, those pairs' channels a block of their own whose components come after the rest's (so that a
    kernel turns a few channels a token, through a small basis, and folds the rest into a query a block).
    """

    key_frame: str = PRE
    block: int = 0
    levels: str = LLOYD
    group: int = 1
    group_widths: tuple[int, ...] = tuple(range(MAX_COMPONENT_BITS + 1))
    shared_plans: bool = (
        False  # one plan per role and width for every head of the model (a kernel's constant)
    )
    own_pairs: int = 0

    def __post_init__(self):
        assert self.key_frame in (PRE, BLOCK, POST) and self.levels in QUANTIZERS, self
        assert (self.block > 0) == (self.key_frame == BLOCK), self
        assert self.own_pairs >= 0 and (self.own_pairs == 0 or self.key_frame == BLOCK), self
        assert 0 in self.group_widths and max(self.group_widths) <= MAX_COMPONENT_BITS, self

    def group_at(self, head_dim: int) -> int:
        """Components a group of this format's plans takes at head_dim: `group` (0: the whole head), at most a
        MIN_GROUPS-th of the head (so that every unit width has a plan)."""
        return min(self.group, max(head_dim // MIN_GROUPS, 1)) if self.group else head_dim

    def identity(self) -> str:
        """What a fit cached on disk adds to its identity for this format: nothing for pca's own."""
        return "" if self == PCA_FORMAT else f"|{self}"

    def reference_positions(self, positions: torch.Tensor, first: int) -> torch.Tensor:
        """The positions (as `positions`, int64) keys at `positions` are turned back to (key_frame)."""
        if self.key_frame == PRE:
            return positions
        if self.key_frame == POST:
            return torch.zeros_like(positions)
        return first + torch.div(positions - first, self.block, rounding_mode="floor") * self.block


def own_channels(half: int, own_pairs: int) -> torch.Tensor:
    """The key channels of the first own_pairs rotary pairs (i, i + half) (PcaFormat.own_pairs), int64
    (2 own_pairs,); ValueError where the rotary embedding has fewer pairs."""
    if own_pairs > half:
        raise ValueError(f"pca: own_pairs {own_pairs} of a rotary embedding of {half} pairs")
    i = torch.arange(own_pairs)
    return torch.cat([i, i + half])


PCA_FORMAT = PcaFormat()  # pca's own: keys before RoPE, Lloyd-Max levels, a width per component
PLAN_BYTES = 1  # a component's width, uint8


def head_table_bytes(head_dim: int) -> int:
    """Bytes of one quantized head's fitted table: its basis, mean and scales (fp16) and plan (uint8 a component),
    2 D**2 + 5 D."""
    return (head_dim * head_dim + 2 * head_dim) * 2 + head_dim * PLAN_BYTES


@functools.cache
def level_tables(device: torch.device, kind: str = LLOYD) -> tuple[torch.Tensor, torch.Tensor]:
    """The levels of N(0, 1) of `kind` (QUANTIZERS) at every component width, padded: levels
    (MAX_COMPONENT_BITS + 1, 256) float32 (row b: the 2**b levels, then +inf; row 0: the one level 0) and
    boundaries (MAX_COMPONENT_BITS + 1, 255) float32 (row b: the 2**b - 1 boundaries, then +inf). Read only."""
    n = 1 << MAX_COMPONENT_BITS
    levels = torch.full((MAX_COMPONENT_BITS + 1, n), float("inf"))
    bounds = torch.full((MAX_COMPONENT_BITS + 1, n - 1), float("inf"))
    levels[0, 0] = 0.0
    for b in range(1, MAX_COMPONENT_BITS + 1):
        q = QUANTIZERS[kind](b)
        levels[b, : 1 << b] = torch.tensor(q.levels)
        bounds[b, : (1 << b) - 1] = torch.tensor(q.boundaries)
    return levels.to(device), bounds.to(device)


def quantize_codes(
    z: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor, kind: str = LLOYD
) -> torch.Tensor:
    """Components z (B, H, T, D) float32 (finite) at per-component widths bits (H, D) (0 to MAX_COMPONENT_BITS)
    and scales scale (H, D) float32 -> codes (B, H, T, D) int64: the index of the level of b bits (levels of `kind`)
    whose cell holds z / scale, a value on a boundary taken by the lower level (0 at width 0)."""
    B, H, T, D = z.shape
    bits = bits.long()
    levels, bounds = level_tables(torch.device(z.device), kind)
    y = z / scale[None, :, None]  # (B, H, T, D)
    if kind == UNIFORM:
        return _uniform_codes(y, bits, levels, bounds)
    rows = bounds[bits].reshape(H * D, -1)  # (H D, 255): each component's boundaries, +inf padded
    y = y.permute(1, 3, 0, 2).reshape(H * D, B * T)  # (H D, B T)
    code = torch.searchsorted(rows, y.contiguous(), side="left")  # (H D, B T)
    return code.view(H, D, B, T).permute(2, 0, 3, 1)  # (B, H, T, D)


def _uniform_codes(
    y: torch.Tensor, bits: torch.Tensor, levels: torch.Tensor, bounds: torch.Tensor
) -> torch.Tensor:
    """quantize_codes' codes of y = z / scale at evenly spaced levels (level_tables' levels and bounds), bit for bit
    its search, without one: the code below y's place on the levels' spacing, less a quarter step (so within one of
    the answer, at or below it), then raised past the one boundary it may lie below."""
    coded = bits > 0  # (H, D); at 0 bits every code is 0 (its boundaries are all +inf)
    low, high = levels[bits, 0].double(), levels[bits, (1 << bits) - 1].double()
    spacing = torch.where(coded, (high - low) / ((1 << bits) - 1).clamp(min=1), 1.0)  # (H, D) float64
    first = torch.where(coded, low + spacing / 2, 0.0)  # the lowest boundary
    inv = (1 / spacing).float()[None, :, None]  # (1, H, 1, D)
    shift = (0.75 - first / spacing).float()[None, :, None]
    top = ((1 << bits) - 1).float()[None, :, None]  # the highest code
    code = torch.minimum((y * inv + shift).floor_().clamp_(min=0), top).long()  # (B, H, T, D)
    # every width's boundaries, one +inf more (the highest code, 255 at 8 bits, reads one above it): a component's
    # are row `bits` of it
    padded = F.pad(bounds, (0, 1), value=float("inf")).reshape(-1)  # ((MAX_COMPONENT_BITS + 1) 256)
    return code + (y > padded[code + (bits * 256)[None, :, None]]).long()


def quantize_components(
    z: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor, kind: str = LLOYD
) -> tuple[torch.Tensor, torch.Tensor]:
    """(quantize_codes of z, bits, scale, kind; component_values of those codes)."""
    code = quantize_codes(z, bits, scale, kind)
    return code, component_values(code, bits, scale, kind)


def component_values(
    code: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor, kind: str = LLOYD
) -> torch.Tensor:
    """The components (B, H, T, D) float32 that codes (B, H, T, D) stand for at widths bits (H, D) and scales
    scale (H, D) float32: the code's level of b bits (of `kind`) times the scale; 0 at width 0."""
    B, H, T, D = code.shape
    levels, _ = level_tables(torch.device(code.device), kind)
    n = levels.shape[1]
    flat = levels[bits.long()].reshape(-1)  # (H D n): each component's levels, +inf padded
    base = (torch.arange(H * D, device=code.device) * n).view(H, D)
    values = flat[code.long() + base[None, :, None]]  # (B, H, T, D)
    return torch.where(bits[None, :, None] > 0, values * scale[None, :, None], 0.0)


@dataclass(frozen=True, eq=False)
class PcaTable:
    """One layer's fitted transforms of one role, per KV head: fp16 mean and basis, and per unit width the plan
    (bits per component, summing to w D) and its components' fp16 scales."""

    mean: torch.Tensor  # (Hkv, D) float16
    basis: torch.Tensor  # (Hkv, D, D) float16: column c of head h is its component c
    plans: dict[int, torch.Tensor]  # w -> (Hkv, D) uint8
    scales: dict[int, torch.Tensor]  # w -> (Hkv, D) float16

    def __post_init__(self):
        H, D = self.mean.shape
        assert self.basis.shape == (H, D, D) and self.basis.dtype == torch.float16, self.basis.shape
        for w, plan in self.plans.items():
            assert plan.shape == (H, D) and bool((plan.long().sum(1) == w * D).all()), (w, plan.shape)
            assert self.scales[w].shape == (H, D) and self.scales[w].dtype == torch.float16, w


@dataclass(frozen=True, eq=False)
class PcaLayer:
    """One decoder layer's transforms: keys (before RoPE) and values, and the radians per position of each key
    channel's rotary pair (D,) float32 (0 past R)."""

    key: PcaTable
    value: PcaTable
    turn: torch.Tensor

    def role(self, role: str) -> PcaTable:
        return self.key if role == "key" else self.value

    @property
    def rotary_frequencies(self) -> torch.Tensor:
        """inv_freq (R / 2,) float32 of the layer's rotary pairs (empty without RoPE)."""
        return self.turn[: int((self.turn > 0).sum()) // 2]


PLAN_COLUMNS = [f"plan{w}" for w in PCA_WIDTHS]
SCALE_COLUMNS = [f"scale{w}" for w in PCA_WIDTHS]


@dataclass(frozen=True, eq=False)
class PcaCalibration:
    """Every decoder layer's PcaLayer (None for a layer without a KV cache of its own), fitted on one model's
    calibration windows; `levels` as key_table.KeyCalibration's (k-means: pca fits no key levels)."""

    layers: tuple[PcaLayer | None, ...]
    levels: str = "kmeans"

    def layer(self, index: int) -> PcaLayer:
        found = self.layers[index] if index < len(self.layers) else None
        if found is None:
            raise ValueError(f"pca calibration: no fitted transform for layer {index}")
        return found

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, role, KV head, component c): the mean of channel c, column c of the basis
        (basis0..), the turn of channel c, and per width the plan's bits and scale of component c."""
        frames = []
        for index, layer in enumerate(self.layers):
            if layer is None:
                continue
            for role in PCA_ROLES:
                table = layer.role(role)
                H, D = table.mean.shape
                head, comp = torch.meshgrid(torch.arange(H), torch.arange(D), indexing="ij")
                columns = (
                    table.basis.float().transpose(1, 2).reshape(H * D, D)
                )  # row (h, c): column c of head h
                frame = pd.DataFrame(
                    dict(
                        layer=index,
                        role=role,
                        kv_head=head.reshape(-1).numpy(),
                        component=comp.reshape(-1).numpy(),
                        mean=table.mean.float().reshape(-1).numpy(),
                        turn=layer.turn.repeat(H).numpy(),
                        **{
                            f"plan{w}": table.plans[w].reshape(-1).numpy().astype("int64") for w in PCA_WIDTHS
                        },
                        **{f"scale{w}": table.scales[w].float().reshape(-1).numpy() for w in PCA_WIDTHS},
                    )
                )
                basis = pd.DataFrame(columns.numpy(), columns=[f"basis{j}" for j in range(D)])
                frames.append(pd.concat([frame, basis], axis=1))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def digest(self) -> str:
        """A short hash of every fitted number with its place: equal digests, equal transforms."""
        frame = self.to_frame()
        values = frame.drop(columns=["role"]).to_numpy(dtype="float64") if len(frame) else frame.to_numpy()
        roles = "".join(frame["role"]) if len(frame) else ""
        return hashlib.sha256(values.tobytes() + roles.encode()).hexdigest()[:16]

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, num_layers: int) -> PcaCalibration:
        """The inverse of to_frame for a model of num_layers decoder layers (the columns read once, each layer's
        rows sliced off them: a frame of 30 layers reads in tens of milliseconds)."""
        layers: list[PcaLayer | None] = [None] * num_layers
        frame = frame.sort_values(["layer", "role", "kv_head", "component"], kind="stable")
        roles = frame["role"].to_numpy()
        groups = (
            frame["layer"].to_numpy(dtype="int64") * len(PCA_ROLES)
            + np.select([roles == role for role in PCA_ROLES], range(len(PCA_ROLES)), -1)
        )  # one number per (layer, role): the rows of a group are consecutive and in (kv_head, component) order
        starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
        ends = np.r_[starts[1:], len(groups)]
        heads, comps = frame["kv_head"].to_numpy(), frame["component"].to_numpy()
        width = sum(c.startswith("basis") for c in frame.columns)
        columns = {
            "basis": frame[[f"basis{j}" for j in range(width)]].to_numpy(),
            "mean": frame["mean"].to_numpy(),
            "turn": frame["turn"].to_numpy(),
            **{f"plan{w}": frame[f"plan{w}"].to_numpy() for w in PCA_WIDTHS},
            **{f"scale{w}": frame[f"scale{w}"].to_numpy() for w in PCA_WIDTHS},
        }
        parts: dict[int, dict[str, tuple[int, int]]] = {}  # layer -> role -> its rows [start, end)
        for start, end in zip(starts, ends):
            layer, role = divmod(int(groups[start]), len(PCA_ROLES))
            parts.setdefault(layer, {})[PCA_ROLES[role]] = (start, end)
        for index, by_role in parts.items():
            tables, turn = {}, None
            for role in PCA_ROLES:
                start, end = by_role[role]
                H, D = int(heads[start:end].max()) + 1, int(comps[start:end].max()) + 1
                col = {name: values[start:end] for name, values in columns.items()}
                basis = torch.tensor(col["basis"][:, :D], dtype=torch.float32)
                tables[role] = PcaTable(
                    torch.tensor(col["mean"]).view(H, D).half(),
                    basis.view(H, D, D).transpose(1, 2).half().contiguous(),
                    {w: torch.tensor(col[f"plan{w}"]).view(H, D).to(torch.uint8) for w in PCA_WIDTHS},
                    {w: torch.tensor(col[f"scale{w}"]).view(H, D).half() for w in PCA_WIDTHS},
                )
                turn = torch.tensor(col["turn"], dtype=torch.float32).view(H, D)[0]
            layers[index] = PcaLayer(tables["key"], tables["value"], turn)
        return cls(tuple(layers))
