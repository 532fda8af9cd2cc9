"""The Lloyd-Max quantizer of the standard normal: the 2**b levels of least mean squared error for N(0, 1) (Max
1960), which the `codebook` scheme (harness/schemes/codebook.py) uses for the coordinates of rotated, normalized
vectors; and `uniform_quantizer`, the best evenly spaced 2**b levels for N(0, 1) (Max's uniform table), whose
codes a GPU kernel turns into values with bit operations and one multiply instead of a table read.

Computed in float64 with the normal's closed forms, on the positive half (the quantizer is symmetric, levels +-c):
the cell of level c_i is [t_i, t_{i+1}) with t_0 = 0, t_i = (c_{i-1} + c_i) / 2, t_{L/2} = inf, and the optimum
is the fixed point of Lloyd's iteration, every level the conditional mean of its cell:
    c_i = m_i(c) = (phi(t_i) - phi(t_{i+1})) / (Q(t_i) - Q(t_{i+1})),   Q(t) = 1 - Phi(t) (accurate in the tail).
Lloyd's plain iteration c <- m(c) needs hundreds of thousands of steps at 8 bits, so Newton's method solves
m(c) = c instead (its Jacobian is tridiagonal in closed form), from the companding (Panter-Dite) levels
sqrt(3) Phi^-1((i + 1/2) / L), until no level moves by more than TOLERANCE. At the fixed point the MSE is
1 - sum over cells of P_i c_i**2.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

TOLERANCE = (
    1e-9  # Newton converges quadratically: the step after one below this is at float64's noise (~1e-11)
)
MAX_STEPS = 50  # Newton steps; every width here converges in fewer than 10


@dataclass(frozen=True)
class LloydMax:
    """The b-bit quantizer of N(0, 1): levels (2**b,) ascending, boundaries (2**b - 1,) the midpoints between
    neighbouring levels (a value maps to the level of the cell it falls in), mse E[(x - level(x))**2]."""

    bits: int
    levels: tuple[float, ...]
    boundaries: tuple[float, ...]
    mse: float


def _phi(t: torch.Tensor) -> torch.Tensor:
    """The standard normal density (0 at +inf)."""
    return torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)


def _cells(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For positive ascending levels c (n,): cell edges t (n + 1,) = 0, midpoints, inf; each cell's probability
    p (n,) and conditional mean m (n,) under N(0, 1)."""
    inf = c.new_full((1,), math.inf)
    t = torch.cat([c.new_zeros(1), (c[1:] + c[:-1]) / 2, inf])
    tail = torch.special.ndtr(-t)  # Q(t)
    p = tail[:-1] - tail[1:]
    return t, p, (_phi(t[:-1]) - _phi(t[1:])) / p


def _newton_step(c: torch.Tensor) -> torch.Tensor:
    """One Newton step towards m(c) = c. With cell [a, b] of mass p and mean m: dm/da = phi(a) (m - a) / p,
    dm/db = phi(b) (b - m) / p, and each inner edge is the mean of its two levels (d edge / d level = 1/2)."""
    t, p, m = _cells(c)
    da = _phi(t[:-1]) * (m - t[:-1]) / p  # (n,) d m_i / d t_i
    db = torch.where(torch.isinf(t[1:]), 0.0, _phi(t[1:]) * (t[1:] - m) / p)  # d m_i / d t_{i+1}
    da[0] = 0.0  # t_0 = 0 is fixed by symmetry
    n = len(c)
    jac = torch.diag((da + db) / 2) - torch.eye(n, dtype=c.dtype)  # d (m - c) / d c
    jac += torch.diag(da[1:] / 2, -1) + torch.diag(db[:-1] / 2, 1)
    return c - torch.linalg.solve(jac, m - c)


@functools.cache
def lloyd_max(bits: int) -> LloydMax:
    """The Lloyd-Max quantizer of N(0, 1) at `bits` bits (1 to 8), computed once per width."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits: {bits!r} has no Lloyd-Max codebook here; allowed: an integer 1 to 8")
    half = 1 << (bits - 1)  # positive levels
    i = torch.arange(half, dtype=torch.float64)
    c = math.sqrt(3) * torch.special.ndtri(0.5 + (i + 0.5) / (2 * half))  # (half,) companding start
    for _ in range(MAX_STEPS):
        new = _newton_step(c)
        moved = float((new - c).abs().max())
        c = new
        if moved < TOLERANCE:
            break
    else:
        raise RuntimeError(f"Lloyd-Max at {bits} bits did not converge in {MAX_STEPS} Newton steps")
    _, p, m = _cells(c)
    assert float((m - c).abs().max()) < TOLERANCE, bits  # every level the mean of its cell
    mse = 1 - 2 * float((p * c * c).sum())
    levels = torch.cat([-c.flip(0), c])  # (2 * half,) ascending
    boundaries = (levels[1:] + levels[:-1]) / 2  # (2 * half - 1,), 0 in the middle
    return LloydMax(bits, tuple(levels.tolist()), tuple(boundaries.tolist()), mse)


def _uniform_mse(step: float, bits: int) -> float:
    """E[(x - level(x))**2] for x ~ N(0, 1) and the levels (i - (2**b - 1) / 2) * step, i = 0 .. 2**b - 1, each
    value to its nearest level: per cell [a, b) of level c, I2 - 2 c I1 + c**2 I0 with I0 = P(a <= x < b),
    I1 = phi(a) - phi(b), I2 = I0 + a phi(a) - b phi(b) (0 at an infinite edge)."""
    n = 1 << bits
    c = (torch.arange(n, dtype=torch.float64) - (n - 1) / 2) * step
    inf = c.new_full((1,), math.inf)
    t = torch.cat([-inf, (c[1:] + c[:-1]) / 2, inf])  # (n + 1,) cell edges
    t_phi = torch.where(torch.isinf(t), 0.0, t * _phi(t))
    i0 = torch.special.ndtr(t[1:]) - torch.special.ndtr(t[:-1])
    i1 = _phi(t[:-1]) - _phi(t[1:])
    i2 = i0 + t_phi[:-1] - t_phi[1:]
    return float((i2 - 2 * c * i1 + c * c * i0).sum())


@functools.cache
def uniform_quantizer(bits: int) -> LloydMax:
    """The evenly spaced 2**b levels (symmetric about 0, no level at 0) of least mean squared error for N(0, 1):
    the step by golden-section search on the closed-form MSE (unimodal in the step), to 1e-12."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits: {bits!r} has no uniform quantizer here; allowed: an integer 1 to 8")
    lo, hi = 1e-3, 4.0  # the optimal step lies inside for every width (8 bits: 0.031; 1 bit: 1.596)
    ratio = (math.sqrt(5) - 1) / 2
    while hi - lo > 1e-12:
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if _uniform_mse(a, bits) < _uniform_mse(b, bits):
            hi = b
        else:
            lo = a
    step = (lo + hi) / 2
    n = 1 << bits
    levels = (torch.arange(n, dtype=torch.float64) - (n - 1) / 2) * step
    boundaries = (levels[1:] + levels[:-1]) / 2
    return LloydMax(bits, tuple(levels.tolist()), tuple(boundaries.tolist()), _uniform_mse(step, bits))
