"""The fitted key tables of `calkey` (harness/schemes/calkey.py) and `nuqkey` (harness/schemes/nuqkey.py): per layer,
KV head and channel an fp16 scale and zero, fitted offline on calibration keys (harness/calibrate/keys.py), so a
stored key token carries no per-token metadata. A key channel c is stored as x ~ zero[c] + scale[c] * y with y in
[-1, 1] (calkey.py quantizes y). nuqkey reads, per channel and width b in LEVEL_WIDTHS, 2**b levels of the channel's
pre-RoPE values (KVQuant's non-uniform datatype), and `turn`, the radians per position of each channel's rotary pair
(0 past R), which its store needs to turn keys back before RoPE and forward again.

`KEY_LEVELS`: how the levels were fitted (quant.key_levels; harness/calibrate/keys.py has what each means).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

LEVEL_WIDTHS = (2, 3, 4)  # the widths nuqkey's levels are fitted for
# How the levels weigh each calibration key element (quant.key_levels): alike, or by a power of the calibration
# loss's gradient there (harness/calibrate/keys.py).
KMEANS, FISHER, FISHER_SQRT = "kmeans", "fisher", "fisher_sqrt"
KEY_LEVELS = (KMEANS, FISHER, FISHER_SQRT)


def check_key_levels(levels: object) -> None:
    """ValueError naming quant.key_levels unless `levels` is one of KEY_LEVELS."""
    if levels not in KEY_LEVELS:
        raise ValueError(f"quant.key_levels: {levels!r} is not allowed; allowed: {', '.join(KEY_LEVELS)}")


SCALE_MIN = 2.0**-14  # the smallest normal fp16: a channel never seen away from 0 still has a positive scale
LEVEL_COLUMNS = [f"level{b}_{i}" for b in LEVEL_WIDTHS for i in range(1 << b)]
COLUMNS = ["layer", "kv_head", "channel", "scale", "zero", "turn", *LEVEL_COLUMNS]


@dataclass(frozen=True, eq=False)
class KeyTable:
    """One layer's fitted key table, per KV head and channel: fp16 scale (> 0) and zero (calkey); the pre-RoPE
    levels of each width (nuqkey) and the radians per position of each channel's rotary pair."""

    scale: torch.Tensor  # (Hkv, D) float16
    zero: torch.Tensor  # (Hkv, D) float16
    turn: torch.Tensor  # (D,) float32: channels i and i + R / 2 turn by p * turn[i] at position p; 0 past R
    levels: dict[int, torch.Tensor]  # width b -> (Hkv, D, 2**b) float16, ascending along the last dim

    def __post_init__(self):
        assert self.scale.shape == self.zero.shape and self.scale.dim() == 2, (
            self.scale.shape,
            self.zero.shape,
        )
        assert self.scale.dtype == self.zero.dtype == torch.float16, (self.scale.dtype, self.zero.dtype)
        assert self.turn.shape == self.scale.shape[1:], (self.turn.shape, self.scale.shape)
        for b, lv in self.levels.items():
            assert lv.shape == (*self.scale.shape, 1 << b) and lv.dtype == torch.float16, (b, lv.shape)

    @property
    def rotary_frequencies(self) -> torch.Tensor:
        """inv_freq (R / 2,) float32 of the layer's rotary pairs (empty without RoPE)."""
        rotary = int((self.turn > 0).sum())
        return self.turn[: rotary // 2]


@dataclass(frozen=True, eq=False)
class KeyCalibration:
    """Every decoder layer's KeyTable (None for a layer without a KV cache of its own), fitted on one model's
    calibration windows; `levels`: how their levels were fitted (KEY_LEVELS)."""

    tables: tuple[KeyTable | None, ...]
    levels: str = KMEANS

    def layer(self, index: int) -> KeyTable:
        table = self.tables[index] if index < len(self.tables) else None
        if table is None:
            raise ValueError(f"key calibration: no fitted key table for layer {index}")
        return table

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, KV head, channel): COLUMNS (scale and zero as float32 of their fp16 values)."""
        frames = []
        for layer, table in enumerate(self.tables):
            if table is None:
                continue
            heads, dim = table.scale.shape
            head, channel = torch.meshgrid(torch.arange(heads), torch.arange(dim), indexing="ij")
            levels = torch.cat([table.levels[b].float() for b in LEVEL_WIDTHS], -1).reshape(heads * dim, -1)
            frame = pd.DataFrame(
                dict(
                    layer=layer,
                    kv_head=head.reshape(-1).numpy(),
                    channel=channel.reshape(-1).numpy(),
                    scale=table.scale.float().reshape(-1).numpy(),
                    zero=table.zero.float().reshape(-1).numpy(),
                    turn=table.turn.repeat(heads).numpy(),
                )
            )
            frames.append(pd.concat([frame, pd.DataFrame(levels.numpy(), columns=LEVEL_COLUMNS)], axis=1))
        return pd.concat(frames, ignore_index=True)[COLUMNS] if frames else pd.DataFrame(columns=COLUMNS)

    def digest(self) -> str:
        """A short hash of every fitted scale and zero with its place: equal digests, equal tables."""
        values = self.to_frame().to_numpy(dtype="float64")  # (rows, COLUMNS)
        return hashlib.sha256(values.tobytes()).hexdigest()[:16]

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, num_layers: int, levels: str = KMEANS) -> KeyCalibration:
        """The inverse of to_frame for a model of num_layers decoder layers whose levels were fitted `levels` (the
        columns read once, each layer's rows sliced off them)."""
        tables: list[KeyTable | None] = [None] * num_layers
        if frame.empty:  # no layer with a table of its own
            return cls(tuple(tables), levels)
        frame = frame.sort_values(["layer", "kv_head", "channel"], kind="stable")
        layer_of = frame["layer"].to_numpy(dtype="int64")
        starts = np.flatnonzero(np.r_[True, layer_of[1:] != layer_of[:-1]])
        heads, channels = frame["kv_head"].to_numpy(), frame["channel"].to_numpy()
        scales, zeros, turns = (frame[c].to_numpy() for c in ("scale", "zero", "turn"))
        level_values = frame[LEVEL_COLUMNS].to_numpy()
        for start, end in zip(starts, np.r_[starts[1:], len(layer_of)]):
            shape = (int(heads[start:end].max()) + 1, int(channels[start:end].max()) + 1)
            scale, zero = (torch.tensor(c[start:end]).view(shape).half() for c in (scales, zeros))
            turn = torch.tensor(turns[start:end], dtype=torch.float32).view(shape)[0]
            per_width, at = {}, 0
            for b in LEVEL_WIDTHS:
                per_width[b] = (
                    torch.tensor(level_values[start:end, at : at + (1 << b)]).view(*shape, 1 << b).half()
                )
                at += 1 << b
            tables[int(layer_of[start])] = KeyTable(scale, zero, turn, per_width)
        return cls(tuple(tables), levels)
