"""`python -m kernels.gpu.turned_ab --out CSV`: the turned-key decode kernel (kernels/turned_attention.py, the read
side of pca_gsa's and pca_ugsa's formats) timed beside SDPA over bf16 K/V, in one process on the same queries.

This module owns that timing. At the headline shape (kernels/gpu/bench.py's HEADLINE: 32 query / 8 KV heads,
head_dim 128, batch 8, 32K tokens) and each unit width of `--widths`, random codes under that width's fitted plans
(PLANS: smollm2-135m's pca_gsa / pca_ugsa tables, results/kernels/README.md "Keys turned in the kernel"; every KV
head at one key and one value plan, as the prototype reads them), a random orthogonal basis with scales and a mean per
head are timed through `turned_attention` with Lloyd-Max levels looked up (method `turned:lloyd`) and with evenly
spaced ones folded into the basis (`turned:uniform`): the whole call (its turn tables, the uniform fold, stage 1 and
torch's combine of the splits, as the prototype's host code runs them a step) launched from Python, and replayed
from a CUDA graph (`turned-graph:`, the GPU's own time). SDPA over random bf16 K/V of the same shape comes first
(`sdpa_default`, its backend in the note; `sdpa-graph` replayed). Each row's rel_err is against the format's contract
computed in float32 by torch for the first batch element (codes to levels, through the basis, keys turned by their
own position, softmax attention). Rows have kernels/gpu/bench.py's columns; bytes_read counts the codes, the query,
the output and the tables the kernel reads (basis rows, means, levels, turns). `--dry-run` runs on CPU under
TRITON_INTERPRET=1 at a tiny shape: a check that the code runs, no figure.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

import torch

from harness.schemes.pca_table import component_values, level_tables
from harness.schemes.rotary import turn
from kernels import groups
from kernels.gpu.bench import HEAD_SHAPES, HEADLINE, Bench, default_backend, rel_err, sdpa
from kernels.turned_attention import turned_attention

# unit width -> (key plan, value plan) of pca_gsa's fitted tables at head_dim 128 (each 16-channel group of the
# head_dim-64 fit two groups here); pca_ugsa's differ at 3-bit keys only (UGSA_KEY_PLANS)
PLANS = {
    1: ((3, 3, 1, 1, 0, 0, 0, 0), (2, 2, 1, 1, 1, 1, 0, 0)),
    2: ((4, 4, 2, 2, 2, 2, 0, 0), (3, 3, 2, 2, 2, 2, 1, 1)),
    3: ((4, 4, 3, 3, 3, 3, 2, 2), (4, 4, 3, 3, 3, 3, 2, 2)),
    4: ((5, 5, 4, 4, 4, 4, 3, 3), (5, 5, 4, 4, 4, 4, 3, 3)),
    5: ((6, 6, 5, 5, 5, 5, 4, 4), (6, 6, 5, 5, 5, 5, 4, 4)),
    6: ((7, 7, 6, 6, 6, 6, 5, 5), (7, 7, 6, 6, 6, 6, 5, 5)),
}
UGSA_KEY_PLANS = {3: (5, 5, 3, 3, 3, 3, 1, 1)}
DRY_SHAPE = {
    "config": "32x8",
    "hq": 4,
    "hkv": 2,
    "head_dim": 128,
    "batch": 1,
    "context": 100,
}  # the plans' head_dim
FIRST = 7  # the stores' first token's position (any: the turn tables start there)


def theta_of(d: int, device) -> torch.Tensor:
    """The rotary turn per position of each pair (i, i + d / 2), base 10000: (d / 2,) float32."""
    return 10000.0 ** (-torch.arange(d // 2, dtype=torch.float32, device=device) / (d // 2))


def random_codes(plan: tuple[int, ...], B: int, hkv: int, L: int, device, g: torch.Generator) -> torch.Tensor:
    """(B, hkv, L, 16 len(plan)) codes, group i's uniform over its 2**plan[i] levels, int32."""
    return torch.cat(
        [torch.randint(0, 1 << w, (B, hkv, L, groups.GROUP), generator=g, device=device, dtype=torch.int32)
         for w in plan], -1,
    )  # fmt: skip


def contract(q, codes, plans, bases, means, kind, theta, first, scale) -> torch.Tensor:
    """The format's attention for batch element 0 in float32: q (B, Hq, D); codes, plans, bases (Hkv, D, C), means
    (Hkv, D) a (key, value) pair each -> (Hq, D)."""
    tokens = []
    for c, plan, basis, mean in zip(codes, plans, bases, means):
        hkv, d = mean.shape
        widths = torch.tensor(plan, device=c.device).repeat_interleave(groups.GROUP).expand(hkv, d)
        z = component_values(c[:1], widths, torch.ones(hkv, d, device=c.device), kind)[0]  # (Hkv, T, D)
        tokens.append(mean[:, None] + torch.einsum("htc,hdc->htd", z, basis))
    keys, values = tokens
    positions = first + torch.arange(keys.shape[1], device=keys.device, dtype=torch.float64)
    keys = turn(keys, (positions[:, None] * theta.double()).float())  # angles in float64, as TokenPositions
    rep = q.shape[1] // keys.shape[0]
    scores = torch.einsum("hd,htd->ht", q[0].float(), keys.repeat_interleave(rep, 0)) * scale
    return torch.einsum("ht,htd->hd", scores.softmax(-1), values.repeat_interleave(rep, 0))


def time_width(run: Bench, shape: dict, width: int, kinds: list[str], g: torch.Generator) -> None:
    """turned_attention at unit width `width` under each level kind of `kinds`, launched and graph-replayed."""
    B, hq, hkv, D, L = (shape[k] for k in ("batch", "hq", "hkv", "head_dim", "context"))
    dev, scale = run.device, D**-0.5
    theta = theta_of(D, dev)
    q = torch.randn(B, hq, D, device=dev, generator=g)
    bases = [torch.linalg.qr(torch.randn(hkv, D, D, device=dev, generator=g))[0]
             * (torch.rand(hkv, 1, D, device=dev, generator=g) + 0.5) for _ in range(2)]  # fmt: skip
    means = [torch.randn(hkv, D, device=dev, generator=g) for _ in range(2)]
    for kind in kinds:
        k_plan, v_plan = PLANS[width]
        if kind == "uniform":
            k_plan = UGSA_KEY_PLANS.get(width, k_plan)
        plans = (k_plan, v_plan)
        codes = [random_codes(p, B, hkv, L, dev, g) for p in plans]
        packed = [groups.pack(c, p) for c, p in zip(codes, plans)]
        levels = level_tables(dev, kind)[0]
        fn = partial(turned_attention, q, packed[0], packed[1], *plans, bases[0], means[0], bases[1], means[1],
                     levels, theta, FIRST, scale, uniform=kind == "uniform")  # fmt: skip
        err = rel_err(fn()[0], contract(q, codes, plans, bases, means, kind, theta, FIRST, scale))
        tables = hkv * D * D * 2 + hkv * D * 4 + levels.numel() * 4 + (-(-L // 64) + 64) * D * 4
        nbytes = sum(p.numel() for p in packed) + 2 * B * hq * D * 4 + tables
        mean_bits = sum(sum(p) for p in plans) * groups.GROUP / (2 * D)
        widths = "/".join(",".join(map(str, p)) for p in plans)
        note = f"unit width {width}; pca_{'gsa' if kind == 'lloyd' else 'ugsa'} plans"
        run.add(shape, f"turned:{kind}", widths, mean_bits, run.time_ms(fn), nbytes, rel_err=err, note=note)
        run.add(shape, f"turned-graph:{kind}", widths, mean_bits, run.time_graph_ms(fn), nbytes, note=note)
        del codes, packed
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def time_sdpa(run: Bench, shape: dict, g: torch.Generator) -> None:
    """SDPA over random bf16 K/V at `shape` (torch's own backend choice, in the note), launched and graph-replayed."""
    B, hq, hkv, D, L = (shape[k] for k in ("batch", "hq", "hkv", "head_dim", "context"))
    q = torch.randn(B, hq, D, dtype=run.dtype, device=run.device, generator=g)
    k = torch.randn(B, hkv, L, D, dtype=run.dtype, device=run.device, generator=g)
    v = torch.randn_like(k)
    fn = partial(sdpa, q, k, v, D**-0.5)
    nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
    run.add(shape, "sdpa_default", "16", 16, run.time_ms(fn), nbytes, note=default_backend(q, k, D**-0.5))
    run.add(shape, "sdpa-graph", "16", 16, run.time_graph_ms(fn), nbytes)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the CSV to write")
    p.add_argument("--widths", type=int, nargs="+", default=[4, 2], choices=sorted(PLANS),
                   help="unit widths to time, in order (default: 4 2)")  # fmt: skip
    p.add_argument("--kinds", nargs="+", default=["uniform", "lloyd"], choices=["uniform", "lloyd"],
                   help="level kinds: lloyd (pca_gsa's, looked up), uniform (pca_ugsa's, folded)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, a tiny shape")
    args = p.parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("error: --dry-run needs TRITON_INTERPRET=1 in the environment (set before Python starts)")
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: kernels.gpu.turned_ab needs a CUDA GPU (or --dry-run); nothing was run")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run = Bench("cpu" if args.dry_run else "cuda", args.out, deadline=float("inf"))
    if args.dry_run:
        shape = DRY_SHAPE
    else:
        shape = dict(zip(("hq", "hkv", "head_dim"), HEAD_SHAPES[HEADLINE["config"]]), **HEADLINE)
    g = torch.Generator(device=run.device).manual_seed(0)
    time_sdpa(run, shape, g)
    for width in args.widths:
        time_width(run, shape, width, args.kinds, g)


if __name__ == "__main__":
    main()
