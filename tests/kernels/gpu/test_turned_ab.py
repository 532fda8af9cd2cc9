"""kernels/gpu/turned_ab.py: the turned-key prototype kernel timed beside SDPA, checked against the format's contract."""

from __future__ import annotations

import csv
import os

import pytest
import torch

from harness.schemes.pca_table import LLOYD, level_tables
from kernels import groups
from kernels.gpu import turned_ab
from kernels.turned_attention import turned_attention


def test_dry_run_rows_each_kind_launched_and_replayed(tmp_path, interpreted):
    """Under the interpreter, at a tiny shape: SDPA's two rows first, then per width and level kind a launched row,
    within the fp16 operands' rounding of the contract, and a graph row (no time without CUDA)."""
    out = tmp_path / "turned.csv"
    proc = interpreted(
        turned_ab.main, "kernels.gpu.turned_ab", "--dry-run", "--widths", "3", "--out", str(out)
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == [
        "sdpa_default", "sdpa-graph", "turned:uniform", "turned-graph:uniform", "turned:lloyd", "turned-graph:lloyd",
    ]  # fmt: skip
    launched = [r for r in rows if r["method"].startswith("turned:")]
    assert all(0 < float(r["rel_err"]) < 5e-3 for r in launched)
    # pca_ugsa's 3-bit keys take their own plan; both average 3 bits a component
    assert launched[0]["widths"] == "5,5,3,3,3,3,1,1/4,4,3,3,3,3,2,2"
    assert launched[1]["widths"] == "4,4,3,3,3,3,2,2/4,4,3,3,3,3,2,2"
    assert {float(r["mean_bits"]) for r in launched} == {3.0}
    assert all(r["time_us"] == "nan" for r in rows if "graph" in r["method"])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need TRITON_INTERPRET=1")
def test_the_contract_is_the_kernels_and_feels_the_turn():
    """`contract` agrees with the kernel on random codes from an odd position; read without the turn (theta 0) it
    does not, so rel_err can fail."""
    g = torch.Generator().manual_seed(5)
    B, hq, hkv, D, L, first = 2, 6, 2, 64, 37, 1234
    plans = ((5, 3, 1, 3), (2, 4, 4, 2))
    codes = [turned_ab.random_codes(p, B, hkv, L, "cpu", g) for p in plans]
    bases = [torch.linalg.qr(torch.randn(hkv, D, D, generator=g))[0] for _ in range(2)]
    means = [torch.randn(hkv, D, generator=g) for _ in range(2)]
    q, theta = torch.randn(B, hq, D, generator=g), turned_ab.theta_of(D, "cpu")
    levels = level_tables(torch.device("cpu"), LLOYD)[0]
    got = turned_attention(q, *(groups.pack(c, p) for c, p in zip(codes, plans)), *plans, bases[0], means[0],
                           bases[1], means[1], levels, theta, first, D**-0.5, block_n=16)[0]  # fmt: skip
    want = turned_ab.contract(q, codes, plans, bases, means, LLOYD, theta, first, D**-0.5)
    unturned = turned_ab.contract(
        q, codes, plans, bases, means, LLOYD, torch.zeros_like(theta), first, D**-0.5
    )
    scale = want.norm()
    assert (got - want).norm() / scale < 5e-3
    assert (got - unturned).norm() / scale > 5e-2
