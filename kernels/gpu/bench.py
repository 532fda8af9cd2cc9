"""Kernel benchmark of the fused packed-KV decode path against 16-bit flash-decoding baselines.

This module owns the kernel benchmark. At each (head shape, batch, context) it times one layer's decode:
- `sdpa_<backend>`: torch SDPA over 16-bit K/V (bf16 on CUDA) with one backend forced (flash, efficient,
  cudnn; the backends that refuse the shape are left out) and `sdpa_default` (the backend torch picks, named
  in `note`);
- `flex_decode` (head shape 32x8, batch 8): FlexAttention (compiled) over the same K/V, where torch has it;
- `fp8_dequant_sdpa`: K/V stored as e4m3 with a per-token scale (harness's fp8 format), dequantized to bf16,
  then SDPA: what a cache without a fused fp8 kernel pays;
- `fused`: kernels.decode_attention over PackedStores at widths 2, 3, 4, 8, a mixed map and all 16;
- `dequant_sdpa` (head shape 32x8): PackedStore.dequantize() then SDPA, the torch path;
- `step_fused` / `step_bf16` (head shape 32x8): a whole per-layer decode step, i.e. writing the new token's
  K and V (quantize_into, or a copy into preallocated bf16 K/V) and attending;
- `fused_tuned` (head shape 32x8, batch 8, context 32K, widths 4, 3 and 2): block_n x num_stages x maxnreg x
  splits at 4 warps (and 256-token tiles at 2 bits), the fastest setting per width;
- `quantize`: quantize_into throughput.
Times are triton.testing.do_bench medians (warm-up; the L2 cache is flushed before each call) on CUDA, and
wall-clock medians in a dry run on CPU (TRITON_INTERPRET=1, tiny shapes: a check that the code runs, no
figure). `bytes_read` counts what each method fetches from memory (packed payload, scales and zeros; the
split partials the combine reads back; dequantized copies written and read again), `gbps` = bytes_read /
time, `frac_copy_bw` = gbps / the device-to-device copy bandwidth measured in the same run. Rows are
appended to the CSV as they are measured, so a run stopped early keeps what it did.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

GiB = 1 << 30
# Query and 16-bit K/V: bf16 on CUDA (tensor-core dots); fp16 in a dry run, as Triton's interpreter computes
# tl.dot on bf16 wrongly.
DTYPES = {"cuda": torch.bfloat16, "cpu": torch.float16}
HEAD_SHAPES = {"32x8": (32, 8, 128), "smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # (Hq, Hkv, D)
HEADLINE = {"config": "32x8", "batch": 8, "context": 32768}  # DESIGN.md section 8's targets
DRY_SHAPES = {"32x8": (4, 2, 32), "smollm2": (3, 1, 64)}
COLUMNS = [
    "config", "hq", "hkv", "head_dim", "batch", "context", "method", "widths", "mean_bits", "time_us",
    "bytes_read", "gbps", "frac_copy_bw", "rel_err", "note",
]  # fmt: skip
# The fused SDPA backends (math, which materializes the scores and repeats K/V per query head, is no
# flash-decoding baseline; sdpa_default shows it if torch picks it).
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


class Bench:
    """Timing and bookkeeping of one run: device, timer, copy bandwidth, the CSV rows written so far."""

    def __init__(self, device: str, csv_path: Path, deadline: float):
        self.device, self.deadline = torch.device(device), deadline
        self.dtype = DTYPES[self.device.type]
        self.csv_path = csv_path
        self.rows: list[dict] = []
        with open(csv_path, "w", newline="") as f:
            csv.DictWriter(f, fieldnames=COLUMNS).writeheader()
        self.copy_bw = 1.0
        self.copy_bw = self.copy_bandwidth(GiB if self.device.type == "cuda" else 1 << 20)

    def time_ms(self, fn: Callable[[], object]) -> float:
        """Median milliseconds of fn."""
        if self.device.type == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
        t0 = (
            time.perf_counter()
        )  # a dry run: one call, to see that it runs (an interpreter time is no figure)
        fn()
        return (time.perf_counter() - t0) * 1e3

    def time_graph_ms(self, fn: Callable[[], object]) -> float | None:
        """Median milliseconds of fn replayed from a CUDA graph: the GPU's time alone, without the host's
        launches (a decode step captured once and replayed, as CUDA-graph decoding runs it). Without CUDA there
        is no graph to replay: None (the row has no time)."""
        if self.device.type != "cuda":
            return None
        import triton.testing

        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")

    def copy_bandwidth(self, nbytes: int) -> float:
        """GB/s of a device-to-device copy (bytes read + bytes written per second)."""
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        return 2 * nbytes / self.time_ms(lambda: dst.copy_(src)) / 1e6

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def add(
        self, shape: dict, method: str, widths: str, mean_bits: float, ms: float | None, nbytes: int, **kw
    ):
        gbps = nbytes / ms / 1e6 if ms else float("nan")
        r = {
            **shape, "method": method, "widths": widths, "mean_bits": round(mean_bits, 3),
            "time_us": ms * 1e3 if ms else float("nan"), "bytes_read": nbytes, "gbps": gbps,
            "frac_copy_bw": gbps / self.copy_bw, "rel_err": "", "note": "", **kw,
        }  # fmt: skip
        self.rows.append(r)
        with open(self.csv_path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=COLUMNS).writerow(r)
        print(
            f"{shape['config']} B={shape['batch']} L={shape['context']} {method:>16} {widths:>16} "
            f"{r['time_us']:10.1f} us {gbps:7.0f} GB/s {r['frac_copy_bw']:.2f} {r['note']}",
            flush=True,
        )
        return r


def width_maps(hkv: int, names: list[str]) -> dict[str, list[int]]:
    """Per-KV-head widths for each named map. 'mixed' has mean width 4 where Hkv allows it: half the heads at
    2, a quarter at 4 and a quarter at 8 (Hkv = 8: 2,2,2,2,4,4,8,8); with fewer heads, 2 and 8 alternating,
    then 4 for an odd one out."""
    maps = {}
    for name in names:
        if name == "mixed":
            if hkv % 4 == 0:
                n2, n4 = hkv // 2, hkv // 4
                maps[name] = [2] * n2 + [4] * n4 + [8] * (hkv - n2 - n4)
            else:
                maps[name] = [(2, 8)[h % 2] for h in range(hkv - hkv % 2)] + [4] * (hkv % 2)
        else:
            maps[name] = [int(name)] * hkv
    return maps


def tag(name: str, bits: list[int]) -> str:
    return ",".join(map(str, bits)) if name == "mixed" else name


def fill(bits: list[int], kv: torch.Tensor, group_size: int):
    """A PackedStore holding kv (B, Hkv, L, D), written by the quantize kernel in chunks."""
    from kernels.layout import PackedStore
    from kernels.quantize import quantize_into

    B, H, L, D = kv.shape
    st = PackedStore(bits, D, B, group_size=group_size, dtype=kv.dtype, device=kv.device, capacity=L + 1)
    chunk = max(1, (1 << 26) // (B * H * D))
    for pos in range(0, L, chunk):
        quantize_into(st, kv[:, :, pos : pos + chunk], pos)
    st.length = L
    return st


def partial_bytes(B: int, hq: int, splits: int, head_dim: int) -> int:
    """Split partials written by stage 1 and read by the combine: m, l and o (D_B floats) per split."""
    d_b = 1 << (head_dim - 1).bit_length()
    return 2 * B * hq * splits * (d_b + 2) * 4


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend=None) -> torch.Tensor:
    """q (B, Hq, D), k/v (B, Hkv, L, D) -> (B, Hq, D), GQA; `backend` an SDPBackend to force, or None."""
    from torch.nn.attention import sdpa_kernel

    f = torch.nn.functional.scaled_dot_product_attention
    if backend is None:
        return f(q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]
    with sdpa_kernel([backend]):
        return f(q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]


def fp8_sdpa(q, kp, ks, vp, vs, scale: float) -> torch.Tensor:
    """e4m3 K/V payloads (B, Hkv, L, D) with fp16 per-token scales (B, Hkv, L): dequantize to bf16, then SDPA."""
    from kernels import reference

    return sdpa(
        q, reference.fp8_dequantize(kp, ks, q.dtype), reference.fp8_dequantize(vp, vs, q.dtype), scale
    )


def dequant_sdpa(q, kst, vst, scale: float) -> torch.Tensor:
    """The torch path: dequantize both stores to bf16, then SDPA."""
    return sdpa(q, kst.dequantize(), vst.dequantize(), scale)


def default_backend(q: torch.Tensor, k: torch.Tensor, scale: float) -> str:
    """The SDPA backend torch dispatches this decode shape to."""
    from torch.nn.attention import SDPBackend

    choice = torch._fused_sdp_choice(q[:, :, None], k, k, scale=scale, enable_gqa=True)
    return SDPBackend(choice).name.lower()


def flex_decode(dry_run: bool) -> Callable | None:
    """FlexAttention (compiled on CUDA), or None where torch lacks it."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    if dry_run:
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        return flex_attention
    return torch.compile(flex_attention)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> str:
    return f"{((got.float() - want.float()).norm() / want.float().norm()).item():.2e}"


def io_bytes(shape: dict) -> tuple[int, int]:
    """(bytes of q read and the output written, bytes of 16-bit K and V) of one decode call at `shape`."""
    B, hq, hkv, D, L = (shape[k] for k in ("batch", "hq", "hkv", "head_dim", "context"))
    return 2 * B * hq * D * 2, 2 * B * hkv * L * D * 2


def bench_shape(run: Bench, shape: dict, maps: dict, args, flex) -> None:
    """Every method at one (head shape, batch, context); out-of-memory shapes are noted and skipped."""
    B, hq, hkv, D, L = (shape[k] for k in ("batch", "hq", "hkv", "head_dim", "context"))
    scale = D**-0.5
    try:
        q = torch.randn(B, hq, D, dtype=run.dtype, device=run.device)
        k = torch.randn(B, hkv, L, D, dtype=run.dtype, device=run.device)
        v = torch.randn(B, hkv, L, D, dtype=run.dtype, device=run.device)
    except torch.OutOfMemoryError:
        run.add(shape, "sdpa_default", "16", 16, None, io_bytes(shape)[1], note="oom")
        return
    bench_sdpa(run, shape, q, k, v, scale, flex, args.dry_run)
    bench_fp8(run, shape, q, k, v, scale)
    if shape["config"] == HEADLINE["config"]:
        step_16bit(run, shape, q, k, v, scale)
    for name, bits in list(maps.items()):
        if run.out_of_time():
            return
        bench_map(run, shape, name, bits, q, k, v, args)


def bench_sdpa(run: Bench, shape: dict, q, k, v, scale: float, flex, dry_run: bool) -> None:
    """The 16-bit baselines: SDPA with each backend that takes the shape, torch's default backend (named in
    the note) and, at the headline head shape and batch, FlexAttention."""
    from torch.nn.attention import SDPBackend

    qkv_bytes, kv_bytes = io_bytes(shape)
    for name, backend in SDPA_BACKENDS.items():
        try:
            sdpa(q, k, v, scale, getattr(SDPBackend, backend))
        except (RuntimeError, torch.OutOfMemoryError):
            continue  # this backend does not take the shape (or the math backend's scores do not fit)
        run.add(
            shape,
            f"sdpa_{name}",
            "16",
            16,
            run.time_ms(partial(sdpa, q, k, v, scale, getattr(SDPBackend, backend))),
            kv_bytes + qkv_bytes,
        )
    picked = default_backend(q, k, scale)
    run.add(
        shape,
        "sdpa_default",
        "16",
        16,
        run.time_ms(lambda: sdpa(q, k, v, scale)),
        kv_bytes + qkv_bytes,
        note=picked,
    )
    headline_cfg = shape["config"] == HEADLINE["config"]
    if flex is not None and headline_cfg and (shape["batch"] == HEADLINE["batch"] or dry_run):
        try:
            run.add(
                shape,
                "flex_decode",
                "16",
                16,
                run.time_ms(lambda: flex(q[:, :, None], k, v, scale=scale, enable_gqa=True)),
                kv_bytes + qkv_bytes,
            )
        except Exception as err:  # noqa: BLE001 - a compile failure is a result to report, not a crash
            run.add(shape, "flex_decode", "16", 16, None, kv_bytes, note=f"failed: {type(err).__name__}")


def bench_fp8(run: Bench, shape: dict, q, k, v, scale: float) -> None:
    """fp8 (e4m3, per-token scale) K/V: dequantize to bf16, then the default SDPA."""
    from kernels import reference

    B, hkv, L, D = k.shape  # (B, Hkv, L, D)
    qkv_bytes, kv_bytes = io_bytes(shape)
    try:
        kp, ks, _ = reference.fp8_quantize_dequantize(k, run.dtype)
        vp, vs, _ = reference.fp8_quantize_dequantize(v, run.dtype)
        fp8_fn = partial(fp8_sdpa, q, kp, ks, vp, vs, scale)
        fp8_bytes = 2 * (B * hkv * L * (D + 2)) + 2 * kv_bytes + qkv_bytes  # e4m3 + scales, bf16 out and back
        run.add(shape, "fp8_dequant_sdpa", "fp8", 8 + 16 / D, run.time_ms(fp8_fn), fp8_bytes)
        del kp, vp, ks, vs
    except torch.OutOfMemoryError:
        run.add(shape, "fp8_dequant_sdpa", "fp8", 8, None, kv_bytes, note="oom")


def bench_map(run: Bench, shape: dict, name: str, bits: list[int], q, k, v, args) -> None:
    """The fused kernel over stores of one width map; at the headline head shape also the torch path
    (dequant_sdpa), a whole decode step and, at 2, 3 and 4 bits at the headline batch and context, the tuning
    grid."""
    from kernels.decode_attention import decode_attention, plan_splits

    B, hq, D, L = (shape[x] for x in ("batch", "hq", "head_dim", "context"))
    scale, headline_cfg = D**-0.5, shape["config"] == HEADLINE["config"]
    qkv_bytes, kv_bytes = io_bytes(shape)
    t, mean = tag(name, bits), sum(bits) / len(bits)
    try:
        kst, vst = fill(bits, k, args.group_size), fill(bits, v, args.group_size)
    except torch.OutOfMemoryError:
        run.add(shape, "fused", t, mean, None, 0, note="oom")
        return
    splits = plan_splits(kst, vst, L, 32, run.device)[2]
    fetched = kst.nbytes() + vst.nbytes() + qkv_bytes + partial_bytes(B, hq, splits, D)
    # Against SDPA over the dequantized stores (a guard against timing a broken kernel), where it fits.
    err = (
        rel_err(decode_attention(q, kst, vst, scale), dequant_sdpa(q, kst, vst, scale))
        if B * L <= 8 * 32768
        else ""
    )
    ms = run.time_ms(partial(decode_attention, q, kst, vst, scale))
    run.add(shape, "fused", t, mean, ms, fetched, rel_err=err, note=f"splits={splits}")
    if headline_cfg and name != "16":
        deq_bytes = kst.nbytes() + vst.nbytes() + 2 * kv_bytes + qkv_bytes
        try:
            run.add(
                shape,
                "dequant_sdpa",
                t,
                mean,
                run.time_ms(partial(dequant_sdpa, q, kst, vst, scale)),
                deq_bytes,
            )
        except torch.OutOfMemoryError:
            run.add(shape, "dequant_sdpa", t, mean, None, deq_bytes, note="oom")
    if headline_cfg:
        step_fused(run, shape, t, mean, q, kst, vst, k, v, scale, fetched)
    at_headline = args.dry_run or all(shape[x] == HEADLINE[x] for x in ("batch", "context"))
    if headline_cfg and name in ("2", "3", "4") and at_headline:
        tune(
            run,
            shape,
            t,
            mean,
            q,
            kst,
            vst,
            scale,
            fetched - partial_bytes(B, hq, splits, D),
            args.dry_run,
        )


def step_fused(run: Bench, shape, t, mean, q, kst, vst, k, v, scale, attn_bytes) -> None:
    """A per-layer decode step of the fused path: quantize the new token's K and V into the stores (one launch,
    as the cache does), then attend (the same position is rewritten at every call)."""
    from kernels.decode_attention import decode_attention
    from kernels.quantize import quantize_into

    B, hkv, L, D = k.shape
    new_k, new_v = k[:, :, -1:].clone(), v[:, :, -1:].clone()

    def fused():
        quantize_into(kst, new_k, L - 1, v_store=vst, v=new_v)
        return decode_attention(q, kst, vst, scale)

    write = 2 * B * hkv * D * k.element_size() + (kst.nbytes() + vst.nbytes()) // max(L, 1)
    run.add(shape, "step_fused", t, mean, run.time_ms(fused), attn_bytes + write)


def step_16bit(run: Bench, shape, q, k, v, scale) -> None:
    """A per-layer decode step on 16-bit K/V in preallocated buffers (a static cache): copy the new token's
    K and V in, then the default SDPA."""
    B, hkv, L, D = k.shape
    new_k, new_v = k[:, :, -1:].clone(), v[:, :, -1:].clone()
    pos = torch.tensor([L - 1], device=k.device)

    def static():
        k.index_copy_(2, pos, new_k)
        v.index_copy_(2, pos, new_v)
        return sdpa(q, k, v, scale)

    nbytes = (2 * B * hkv * L * D + 4 * B * hkv * D) * k.element_size()
    run.add(shape, "step_bf16", "16", 16, run.time_ms(static), nbytes)


def tune(run: Bench, shape, t, mean, q, kst, vst, scale, base_bytes, dry_run: bool) -> None:
    """The fused kernel over block_n x num_stages x maxnreg (0: uncapped) x splits (multiples of the default) at
    4 warps (32-token tiles and 8 warps were slower at every width on the H100, check-6e86fcf); one row per
    setting, the fastest marked in `note`. At 2 bits 256-token tiles come first: 2 stages under the register
    cap compile without spills at 5.19 thread-instructions per KV byte against 5.50 at 128 tokens, but need 92 KB
    of shared memory (2 blocks an SM), which only a GPU can weigh (`python -m kernels.gpu.inspect --widths 2
    --block-n 128 256 --stages 2 --maxnreg 128`, Triton 3.6, sm_90a)."""
    from kernels.decode_attention import _default_splits, decode_attention

    B, hq, D, L = q.shape[0], q.shape[1], q.shape[2], kst.length
    base = _default_splits(L, B * len(kst.bits), 32, q.device)
    wide = [(256, 4, 2, 128, m) for m in (1, 2)] if set(kst.bits) == {2} else []
    grid = [(32, 4, 2, 0, 1)] if dry_run else wide + [
        (bn, 4, s, r, m) for bn in (128, 64) for s in (2, 3) for r in (128, 0) for m in (1, 2)
    ]  # fmt: skip
    best = None
    for bn, w, stages, maxnreg, mult in grid:
        if run.out_of_time():
            break
        splits = base * mult
        fn = partial(
            decode_attention,
            q,
            kst,
            vst,
            scale,
            num_splits=splits,
            block_n=bn,
            num_warps=w,
            num_stages=stages,
            maxnreg=maxnreg,
        )
        try:
            ms = run.time_ms(fn)
        except Exception as err:  # noqa: BLE001 - a setting the compiler rejects (registers, shared memory)
            run.add(
                shape,
                "fused_tuned",
                t,
                mean,
                None,
                0,
                note=f"block_n={bn} warps={w} stages={stages} maxnreg={maxnreg} splits={splits} failed: "
                f"{type(err).__name__}",
            )
            continue
        r = run.add(
            shape,
            "fused_tuned",
            t,
            mean,
            ms,
            base_bytes + partial_bytes(B, hq, splits, D),
            note=f"block_n={bn} warps={w} stages={stages} maxnreg={maxnreg} splits={splits}",
        )
        best = r if best is None or ms * 1e3 < best["time_us"] else best
    if best is not None:
        best["note"] += " best"


def bench_quantize(run: Bench, shape: dict, maps: dict, tokens: int, group_size: int) -> None:
    """quantize_into throughput for `tokens` new tokens per sequence: bytes = bf16 input read + packed written."""
    from kernels.layout import PackedStore
    from kernels.quantize import quantize_into

    B, hkv, D = shape["batch"], shape["hkv"], shape["head_dim"]
    for name, bits in maps.items():
        st = PackedStore(
            bits, D, B, group_size=group_size, dtype=run.dtype, device=run.device, capacity=tokens
        )
        x = torch.randn(B, hkv, tokens, D, dtype=run.dtype, device=run.device)
        ms = run.time_ms(lambda st=st, x=x: quantize_into(st, x, 0))
        st.length = tokens
        nbytes = x.numel() * x.element_size() + st.nbytes()
        run.add({**shape, "context": tokens}, "quantize", tag(name, bits), sum(bits) / len(bits), ms, nbytes,
                note=f"{B * tokens / ms / 1e3:.3g} Mtok/s")  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    """Decode latency vs context, one panel per (head shape, batch), one line per method and width map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keep = ("fused", "sdpa_default", "flex_decode", "fp8_dequant_sdpa", "dequant_sdpa")
    dec = [r for r in rows if r["method"] in keep and r["time_us"] == r["time_us"]]
    panels = sorted({(r["config"], r["batch"]) for r in dec})
    if not panels:
        return
    cols = len({b for _, b in panels})
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 4 * nrows), squeeze=False)
    for ax, (cfg, batch) in zip(axes.flat, panels, strict=False):
        sub = [r for r in dec if (r["config"], r["batch"]) == (cfg, batch)]
        for key in sorted({(r["method"], r["widths"]) for r in sub}):
            pts = sorted((r["context"], r["time_us"]) for r in sub if (r["method"], r["widths"]) == key)
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"{key[0]} {key[1]}")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="context (tokens)",
            ylabel="time (us)",
            title=f"{cfg} batch {batch}",
        )
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kernels.gpu.bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs", nargs="+", default=list(HEAD_SHAPES), help=f"head shapes: {', '.join(HEAD_SHAPES)}"
    )
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--context", nargs="+", type=int, default=[1024, 4096, 16384, 32768, 65536, 131072])
    p.add_argument(
        "--widths", nargs="+", default=["2", "3", "4", "8", "mixed", "16"], help="2/3/4/8/16 or mixed"
    )
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--quantize-tokens", type=int, default=4096)
    p.add_argument("--out", type=Path, required=True, help="folder for decode.csv and decode.png")
    p.add_argument(
        "--time-budget", type=float, default=1e9, help="seconds; stops starting new shapes after it"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes: checks the code runs"
    )
    args = p.parse_args(argv)
    shapes = DRY_SHAPES if args.dry_run else HEAD_SHAPES
    for c in args.configs:
        if c not in shapes:
            p.error(f"--configs: {c!r} is not a head shape; allowed: {', '.join(shapes)}")
    for w in args.widths:
        if w != "mixed" and w not in ("2", "3", "4", "8", "16"):
            p.error(f"--widths: {w!r} is not allowed; allowed: 2, 3, 4, 8, 16, mixed")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("error: --dry-run needs TRITON_INTERPRET=1 in the environment (set before Python starts)")
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: kernels.gpu.bench needs a CUDA GPU (or --dry-run); nothing was run")
    args.out.mkdir(parents=True, exist_ok=True)
    run = Bench(
        "cpu" if args.dry_run else "cuda", args.out / "decode.csv", time.monotonic() + args.time_budget
    )
    print(f"device-to-device copy {run.copy_bw:.0f} GB/s", flush=True)
    shapes = DRY_SHAPES if args.dry_run else HEAD_SHAPES
    flex = flex_decode(args.dry_run)
    # The headline shape first, so that a run cut short still answers DESIGN.md's targets.
    order = sorted(
        ((c, b, n) for c in args.configs for b in args.batch for n in args.context),
        key=lambda s: (s[0] != HEADLINE["config"], s[1] != HEADLINE["batch"], s[2] != HEADLINE["context"]),
    )
    for cfg, batch, context in order:
        if run.out_of_time():
            print("time budget spent: the remaining shapes were not run", flush=True)
            break
        hq, hkv, D = shapes[cfg]
        shape = {"config": cfg, "hq": hq, "hkv": hkv, "head_dim": D, "batch": batch, "context": context}
        bench_shape(run, shape, width_maps(hkv, args.widths), args, flex)
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
    if not run.out_of_time():
        hq, hkv, D = shapes[args.configs[0]]
        base = {"config": args.configs[0], "hq": hq, "hkv": hkv, "head_dim": D, "batch": args.batch[0]}
        bench_quantize(run, base, width_maps(hkv, args.widths), args.quantize_tokens, args.group_size)
    plot(run.rows, args.out / "decode.png")
    print(f"wrote {args.out}/decode.csv, decode.png ({len(run.rows)} rows)")


if __name__ == "__main__":
    main()
