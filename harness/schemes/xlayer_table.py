"""The fitted predictors of `xlayer` (harness/schemes/xlayer.py, AQUA-KV's cross-layer prediction): per layer and KV
head, linear maps from the K/V the layer can read when it stores a token to that token's key and value.

Inputs (AQUA-KV's design), for layer l with P the nearest cached layer below it (none for the first):
    keys of l, head h:   [keys of P, every head, before RoPE]                        (N, Hp D)
    values of l, head h: [keys of l, every head, before RoPE; values of P, every head] (N, Hl D + Hp Dv)
A full map is a weight (in, out) and a bias (out,); a rank-r map is down (in, r), up (r, out) and the bias
(harness/calibrate/xlayer.py fits them).

Bytes per head (fp16): a full map in * out + out, a rank-r map (in + out) r + out.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass

import pandas as pd
import torch

from harness.schemes.pca_table import PcaCalibration

XLAYER_ROLES = ("key", "value")


@dataclass(frozen=True, eq=False)
class Predictor:
    """One layer's map for one role, per KV head: full (weight) or rank r (down, up), and the bias; fp16."""

    bias: torch.Tensor  # (H, out)
    weight: torch.Tensor | None = None  # (H, in, out)
    down: torch.Tensor | None = None  # (H, in, r)
    up: torch.Tensor | None = None  # (H, r, out)

    @property
    def inputs(self) -> int:
        return (self.weight if self.weight is not None else self.down).shape[1]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, in) float32 -> the prediction (B, H, T, out) float32."""
        bias = self.bias.float()[None, :, None]  # (1, H, 1, out)
        if self.inputs == 0:
            return bias.expand(x.shape[0], -1, x.shape[1], -1)
        if self.weight is not None:
            return torch.einsum("bti,hio->bhto", x, self.weight.float()) + bias
        low = torch.einsum("bti,hir->bhtr", x, self.down.float())
        return torch.einsum("bhtr,hro->bhto", low, self.up.float()) + bias

    def head_nbytes(self) -> int:
        """Bytes of one head's map and bias (fp16)."""
        parts = [self.bias] + [t for t in (self.weight, self.down, self.up) if t is not None]
        return sum(t[0].numel() for t in parts) * 2


@dataclass(frozen=True, eq=False)
class CrossLayerLayer:
    """One decoder layer's predictors, the radians per position of each key channel's rotary pair (D,) float32 (0
    past R) and the layer its inputs come from (`previous`; None: the first cached layer, predicted by its bias)."""

    key: Predictor
    value: Predictor
    turn: torch.Tensor
    previous: int | None

    def role(self, role: str) -> Predictor:
        return self.key if role == "key" else self.value

    @property
    def rotary_frequencies(self) -> torch.Tensor:
        return self.turn[: int((self.turn > 0).sum()) // 2]


class CrossLayerCalibration:
    """Every decoder layer's CrossLayerLayer (None for a layer without a KV cache of its own), fitted on one model's
    calibration windows at one rank (None: full), for xlayer_pca the pca transforms of their residuals
    (`residual`, harness/schemes/pca_table.py's), and the chain of the cache being built (`chain`: the stores of
    one QuantizedKVCache by (layer, role), held weakly; `xlayer.Xlayer.for_layer` starts a new one at the first
    cached layer)."""

    def __init__(
        self,
        layers: tuple[CrossLayerLayer | None, ...],
        rank: int | None = None,
        residual: PcaCalibration | None = None,
    ):
        self.layers, self.rank = layers, rank
        self.residual = residual  # xlayer_pca's transforms of the residuals (None: codebook's format)
        self.levels = "kmeans"  # as key_table.KeyCalibration's: xlayer fits no key levels
        self.chain: weakref.WeakValueDictionary | None = None

    @property
    def first_layer(self) -> int:
        return next(i for i, layer in enumerate(self.layers) if layer is not None)

    def layer(self, index: int) -> CrossLayerLayer:
        found = self.layers[index] if index < len(self.layers) else None
        if found is None:
            raise ValueError(f"xlayer calibration: no fitted predictor for layer {index}")
        return found

    def to_frame(self) -> pd.DataFrame:
        """One row per stored number: layer, role, part (bias, weight, down, up, turn), kv_head, i, j, value."""
        frames = []
        for index, layer in enumerate(self.layers):
            if layer is None:
                continue
            for role in XLAYER_ROLES:
                p = layer.role(role)
                for part in ("bias", "weight", "down", "up"):
                    t = getattr(p, part)
                    if t is None:
                        continue
                    t = (
                        t.float().reshape(t.shape[0], -1, t.shape[-1])
                        if part != "bias"
                        else t.float()[:, None]
                    )
                    h, i, j = torch.meshgrid(*(torch.arange(n) for n in t.shape), indexing="ij")
                    frames.append(pd.DataFrame(dict(
                        layer=index, role=role, part=part, kv_head=h.reshape(-1).numpy(), i=i.reshape(-1).numpy(),
                        j=j.reshape(-1).numpy(), value=t.reshape(-1).numpy(),
                    )))  # fmt: skip
                    if part == "weight" and t.shape[1] == 0:  # an empty map keeps its shape
                        frames.append(pd.DataFrame(dict(
                            layer=[index], role=[role], part=["empty"], kv_head=[t.shape[0]], i=[0], j=[t.shape[2]],
                            value=[0.0],
                        )))  # fmt: skip
            frames.append(pd.DataFrame(dict(
                layer=index, role="key", part="turn", kv_head=0, i=torch.arange(len(layer.turn)).numpy(),
                j=-1 if layer.previous is None else layer.previous, value=layer.turn.numpy(),
            )))  # fmt: skip
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def digest(self) -> str:
        """A short hash of every fitted number with its place (the residuals' transforms too): equal digests, equal
        fits."""
        frame = self.to_frame()
        numbers = (
            frame[["layer", "kv_head", "i", "j", "value"]].to_numpy(dtype="float64") if len(frame) else None
        )
        text = "".join(frame["role"] + frame["part"]) if len(frame) else ""
        data = b"" if numbers is None else numbers.tobytes()
        residual = "" if self.residual is None else self.residual.digest()
        return hashlib.sha256(data + text.encode() + str(self.rank).encode() + residual.encode()).hexdigest()[
            :16
        ]

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, num_layers: int, rank: int | None) -> CrossLayerCalibration:
        """The inverse of to_frame for a model of num_layers decoder layers."""
        layers: list[CrossLayerLayer | None] = [None] * num_layers
        for index, rows in frame.groupby("layer"):
            turn_rows = rows[rows.part == "turn"].sort_values("i")
            previous = int(turn_rows.j.iloc[0])
            predictors = {}
            for role in XLAYER_ROLES:
                parts = {}
                for part, group in rows[(rows.role == role) & (rows.part != "turn")].groupby("part"):
                    if part == "empty":
                        continue
                    shape = (int(group.kv_head.max()) + 1, int(group.i.max()) + 1, int(group.j.max()) + 1)
                    values = torch.tensor(
                        group.sort_values(["kv_head", "i", "j"]).value.to_numpy(), dtype=torch.float32
                    )
                    parts[part] = values.view(shape).half()
                empty = rows[(rows.role == role) & (rows.part == "empty")]
                if len(empty):
                    parts["weight"] = torch.zeros(int(empty.kv_head.iloc[0]), 0, int(empty.j.iloc[0])).half()
                parts["bias"] = parts["bias"][:, 0]
                predictors[role] = Predictor(**parts)
            turn = torch.tensor(turn_rows.value.to_numpy(), dtype=torch.float32)
            layers[int(index)] = CrossLayerLayer(
                predictors["key"], predictors["value"], turn, None if previous < 0 else previous
            )
        return cls(tuple(layers), rank)
