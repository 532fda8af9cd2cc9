"""The fitted codebooks of `cq2` and `cq4` (harness/schemes/cq.py, coupled quantization, Zhang et al. 2024): per
layer, role (keys turned back before RoPE, values), KV head, group of c consecutive channels and width b, the
2**(c b) centroids of a k-means of that group's calibration vectors (harness/calibrate/cq.py). A token's code
per group is its nearest centroid's index (c b bits, `nearest_centroid`).

Bytes: a head's codebook at width b, D / c groups of 2**(c b) centroids of c fp16 values, D 2**(c b) 2 bytes
(2 KiB at D = 64, c = 2, b = 2; 8 KiB at b = 3; 32 KiB at c = 4, b = 2), held once per store and counted.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pandas as pd
import torch

CQ_WIDTHS = {2: (2, 3), 4: (2,)}  # channels per group -> the widths fitted (at most 256 centroids)
CQ_ROLES = ("key", "value")


def nearest_centroid(x: torch.Tensor, centroids: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """x (N, G, c) float32, centroids (G, K, c) -> the index (N, G) int64 of each group's nearest centroid, by
    squared distances |x|**2 - 2 x.C + |C|**2 (a batched matmul per group), N in chunks; the first of equals."""
    out = torch.empty(x.shape[:2], dtype=torch.long, device=x.device)
    norms = centroids.square().sum(-1)  # (G, K)
    for start in range(0, len(x), chunk):
        part = x[start : start + chunk].transpose(0, 1)  # (G, n, c)
        distance = norms[:, None, :] - 2 * torch.bmm(
            part, centroids.transpose(1, 2)
        )  # (G, n, K), less |x|**2
        out[start : start + chunk] = distance.argmin(-1).T
    return out


@dataclass(frozen=True, eq=False)
class CqTable:
    """One layer's codebooks of one role, per width: fp16 (Hkv, G, 2**(c b), c)."""

    codebooks: dict[int, torch.Tensor]


@dataclass(frozen=True, eq=False)
class CqLayer:
    """One decoder layer's codebooks (keys before RoPE, values) and the radians per position of each key channel's
    rotary pair (D,) float32 (0 past R)."""

    key: CqTable
    value: CqTable
    turn: torch.Tensor

    def role(self, role: str) -> CqTable:
        return self.key if role == "key" else self.value

    @property
    def rotary_frequencies(self) -> torch.Tensor:
        return self.turn[: int((self.turn > 0).sum()) // 2]


class CqCalibration:
    """Every decoder layer's CqLayer (None without a KV cache of its own), groups of `channels`, fitted on one
    model's calibration windows."""

    def __init__(self, layers: tuple[CqLayer | None, ...], channels: int):
        self.layers, self.channels = layers, channels
        self.levels = "kmeans"  # as key_table.KeyCalibration's: cq fits no key levels

    def layer(self, index: int) -> CqLayer:
        found = self.layers[index] if index < len(self.layers) else None
        if found is None:
            raise ValueError(f"cq calibration: no fitted codebooks for layer {index}")
        return found

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, role, width, KV head, group, centroid): its c values (v0..), and the layer's turns
        as rows of role 'turn' (width 0, value v0 the turn of channel `group`)."""
        frames, c = [], self.channels
        for index, layer in enumerate(self.layers):
            if layer is None:
                continue
            for role in CQ_ROLES:
                for b, book in layer.role(role).codebooks.items():
                    H, G, K, _ = book.shape
                    h, g, k = (t.reshape(-1).numpy() for t in torch.meshgrid(
                        torch.arange(H), torch.arange(G), torch.arange(K), indexing="ij"))  # fmt: skip
                    values = book.float().reshape(-1, c).numpy()
                    frame = pd.DataFrame(
                        dict(layer=index, role=role, width=b, kv_head=h, group=g, centroid=k)
                    )
                    frames.append(
                        pd.concat([frame, pd.DataFrame(values, columns=[f"v{i}" for i in range(c)])], axis=1)
                    )
            turn = pd.DataFrame(dict(layer=index, role="turn", width=0, kv_head=0, group=range(len(layer.turn)),
                                     centroid=0, v0=layer.turn.numpy()))  # fmt: skip
            frames.append(turn)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def digest(self) -> str:
        frame = self.to_frame().fillna(0.0)
        numbers = frame.drop(columns=["role"]).to_numpy(dtype="float64").tobytes() if len(frame) else b""
        return hashlib.sha256(numbers + "".join(frame.get("role", [])).encode()).hexdigest()[:16]

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, num_layers: int, channels: int) -> CqCalibration:
        layers: list[CqLayer | None] = [None] * num_layers
        columns = [f"v{i}" for i in range(channels)]
        for index, rows in frame.groupby("layer"):
            tables = {}
            for role in CQ_ROLES:
                books = {}
                for b, part in rows[rows.role == role].groupby("width"):
                    part = part.sort_values(["kv_head", "group", "centroid"])
                    shape = (
                        int(part.kv_head.max()) + 1,
                        int(part.group.max()) + 1,
                        int(part.centroid.max()) + 1,
                    )
                    books[int(b)] = (
                        torch.tensor(part[columns].to_numpy(), dtype=torch.float32).view(*shape, -1).half()
                    )
                tables[role] = CqTable(books)
            turn = rows[rows.role == "turn"].sort_values("group")
            layers[int(index)] = CqLayer(
                tables["key"], tables["value"], torch.tensor(turn.v0.to_numpy(), dtype=torch.float32)
            )
        return cls(tuple(layers), channels)
