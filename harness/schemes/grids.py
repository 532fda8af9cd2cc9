"""Fixed vector grids for `vq` (harness/schemes/vq.py): the points a group of p rotated, normalized coordinates is
coded to, the same for every layer and head (nothing is stored with the cache; like codebook's Lloyd-Max levels).

- `kmeans_grid(p, b)`: the 2**(p b) points of a k-means quantizer of N(0, I_p) (p = 2: b = 2, 3, 4; p = 4: b = 2),
  Lloyd's algorithm in float64 on GRID_SAMPLES_PER_POINT fixed normal samples per point (numpy's generator, seed
  GRID_SEED) from the samples' first points, elementwise sums only (the same bits on every machine); computed once and kept in the
  disk cache. A group's code is its nearest point's index (p b bits).
- E8 (p = 8, b = 2, 3, 4): the Voronoi code of the E8 lattice modulo 2**b E8 (Conway and Sloane), shifted by the
  deep hole (1, 0, ..., 0) so that the code is centred: 2**(8 b) points, b bits per coordinate, coded by the
  lattice coordinates modulo 2**b (`e8_encode`, `e8_decode`), the nearest lattice point by Conway and Sloane's
  algorithm (no table at all).

Relative MSE per coordinate on N(0, 1) vectors of 64 with one least-squares scale per vector, 2 / 3 / 4 bits
(a one-off script): scalar Lloyd-Max (codebook's) 0.113 / 0.033 / 0.0089; E8 with the best of E8_SCALES per
vector 0.126 / 0.029 / 0.0073 (E8 helps from 3 bits on: its Voronoi shaping loses at 2); on smollm2-135m's values
(codebook's setting) 2-D and 4-D k-means grids at 2 bits cut codebook's error by 8% and 16%.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from harness.io import cache_root, write_atomic

GRID_SAMPLES_PER_POINT = 128  # normal samples per grid point the k-means is fitted on
GRID_ITERATIONS = 30
GRID_SEED = 20260526
GRID_VERSION = 1
KMEANS_GRIDS = {2: (2, 3, 4), 4: (2,)}  # p -> the widths b with a k-means grid
E8_WIDTHS = (2, 3, 4)
E8_SHIFT = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0])  # a deep hole of E8
# candidate scales of the normalized coordinates (per-coordinate rms 1) per width: the encoder keeps, per vector,
# the one of least error (measured on N(0, 1) vectors of 64, the best single scale times 0.8 ... 1.25)
E8_SCALES = {
    b: tuple(s * f / (1 << b) for f in (0.8, 0.9, 1.0, 1.12, 1.25)) for b, s in ((2, 5.6), (3, 5.6), (4, 5.6))
}
E8_GENERATOR = torch.tensor(
    [
        [2, 0, 0, 0, 0, 0, 0, 0],
        [-1, 1, 0, 0, 0, 0, 0, 0],
        [0, -1, 1, 0, 0, 0, 0, 0],
        [0, 0, -1, 1, 0, 0, 0, 0],
        [0, 0, 0, -1, 1, 0, 0, 0],
        [0, 0, 0, 0, -1, 1, 0, 0],
        [0, 0, 0, 0, 0, -1, 1, 0],
        [0.5] * 8,
    ],
    dtype=torch.float64,
)  # fmt: skip  rows generate E8 (determinant 1): a lattice point is k @ E8_GENERATOR, k integer


def _nearest(x: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Index of the nearest of points (K, p) to each row of x (N, p), elementwise float64 sums, in chunks; the
    squared distances summed one coordinate at a time (the bits of a sum over the coordinates' axis, without its
    (n, K, p) temporaries)."""
    out = np.empty(len(x), dtype=np.int64)
    for start in range(0, len(x), 4096):
        part = x[start : start + 4096]
        distance = np.square(part[:, None, 0] - points[None, :, 0])  # (n, K)
        for j in range(1, x.shape[1]):
            distance += np.square(part[:, None, j] - points[None, :, j])
        out[start : start + 4096] = distance.argmin(1)
    return out


def _fit_grid(p: int, b: int) -> np.ndarray:
    k = 1 << (p * b)
    samples = np.random.default_rng(GRID_SEED).standard_normal((GRID_SAMPLES_PER_POINT * k, p))
    points = samples[:k].copy()
    for _ in range(GRID_ITERATIONS):
        index = _nearest(samples, points)
        for j in range(p):  # each coordinate's mean over its cell (an empty cell keeps its point)
            total = np.bincount(index, weights=samples[:, j], minlength=k)
            count = np.bincount(index, minlength=k)
            points[:, j] = np.where(count > 0, total / np.maximum(count, 1), points[:, j])
    return points


@functools.cache
def kmeans_grid(p: int, b: int) -> torch.Tensor:
    """The k-means grid of N(0, I_p) at b bits per coordinate: float32 (2**(p b), p), from the disk cache or fitted
    (module docstring). Read only."""
    if b not in KMEANS_GRIDS.get(p, ()):
        raise ValueError(f"vq grid: no {p}-dimensional grid at {b} bits; allowed: {KMEANS_GRIDS}")
    path = cache_root() / "grids" / f"kmeans-p{p}-b{b}-v{GRID_VERSION}.npy"
    if path.exists():
        points = np.load(path)
    else:
        points = _fit_grid(p, b)
        path.parent.mkdir(parents=True, exist_ok=True)

        def save(tmp):
            with open(tmp, "wb") as f:
                np.save(f, points)

        write_atomic(path, save)
    return torch.tensor(points, dtype=torch.float32)


def grid_encode(y: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """The index (..., G) int64 of the nearest grid point (K, p) to each group y (..., G, p)."""
    flat = y.reshape(-1, 1, y.shape[-1])
    index = torch.empty(flat.shape[0], dtype=torch.long, device=y.device)
    for start in range(
        0, len(flat), 8192
    ):  # elementwise squared distances: the same answer at any thread count
        part = flat[start : start + 8192]
        index[start : start + 8192] = (part - points[None]).square().sum(-1).argmin(-1)
    return index.view(y.shape[:-1])


# ---------------------------------------------------------------------------------------------------------- E8


def nearest_d8(x: torch.Tensor) -> torch.Tensor:
    """The nearest point of D8 (integer vectors of even sum) to each x (..., 8): round, and where the sum is odd
    move the coordinate that rounded farthest the other way (Conway and Sloane)."""
    f = torch.round(x)
    odd = torch.remainder(f.sum(-1), 2) != 0
    off = x - f
    far = off.abs().argmax(-1, keepdim=True)
    step = torch.where(off.gather(-1, far) >= 0, 1.0, -1.0).to(x.dtype)
    return torch.where(odd[..., None], f.scatter_add(-1, far, step), f)


def nearest_e8(x: torch.Tensor) -> torch.Tensor:
    """The nearest point of E8 = D8 u (D8 + 1/2) to each x (..., 8)."""
    a, b = nearest_d8(x), nearest_d8(x - 0.5) + 0.5
    return torch.where((x - a).square().sum(-1, keepdim=True) <= (x - b).square().sum(-1, keepdim=True), a, b)


def e8_encode(y: torch.Tensor, b: int) -> torch.Tensor:
    """Groups y (..., 8) (float) to their Voronoi code modulo 2**b E8 around the deep hole: digits (..., 8) int64 in
    [0, 2**b), the coordinates of the nearest lattice point to y - shift modulo 2**b."""
    point = nearest_e8(y.double() - E8_SHIFT.to(y.device, torch.float64))
    k = torch.round(point @ torch.linalg.inv(E8_GENERATOR.to(y.device)))
    return torch.remainder(k, 1 << b).long()


def e8_decode(digits: torch.Tensor, b: int) -> torch.Tensor:
    """The code points (..., 8) float64 of digits (..., 8): the lattice point of the digits' coset nearest the origin
    (k @ G less the nearest point of 2**b E8), plus the shift."""
    m = 1 << b
    point = digits.double() @ E8_GENERATOR.to(digits.device)
    return point - m * nearest_e8(point / m) + E8_SHIFT.to(digits.device, torch.float64)
