"""GPU benchmarks of the fused packed-KV kernels against fp16 SDPA and dequantize-then-attend.

This module owns the kernel benchmark: decode attention over PackedStores (kernels/decode_attention.py) at
uniform widths 2/4/8, a mixed map with mean width 4, and all-16, against
torch.nn.functional.scaled_dot_product_attention on fp16 K/V and against the torch path
(PackedStore.dequantize() then SDPA); plus the quantize kernel's throughput (kernels/quantize.py). Times are
triton.testing.do_bench medians with warm-up, cycling through several buffer sets so that repeated calls do
not hit in L2. Each row reports the bytes the method must read, the achieved GB/s and its fraction of a
device-to-device copy's bandwidth measured in the same run. Writes CSV, a plot and a README to
results/kernels/<gpu name>/. Needs CUDA; `python -m kernels.bench --help` works anywhere.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing

from kernels.decode_attention import decode_attention
from kernels.layout import PackedStore
from kernels.quantize import quantize_into

DEVICE = "cuda"  # every buffer lives here (a module constant so a CPU dry run can patch it)
GiB = 1 << 30
ROTATE_BYTES = 4  # rotate buffer sets until they span this many times the L2 cache
MAX_SETS = 8
FILL_ELEMENTS = 1 << 26  # tokens are quantized into a store in chunks of about this many input elements
COLUMNS = [
    "config",
    "hq",
    "hkv",
    "head_dim",
    "batch",
    "context",
    "method",
    "widths",
    "time_us",
    "bytes_read",
    "gbps",
    "frac_copy_bw",
    "rel_err",
    "note",
]


def width_maps(hkv: int, names: list[str]) -> dict[str, list[int]]:
    """Per-KV-head widths for each named map; 'mixed' is half the heads at 2, a quarter at 4, a quarter at 8."""
    maps = {}
    for name in names:
        if name == "mixed":
            n2, n4 = hkv // 2, hkv // 4
            maps[name] = [2] * n2 + [4] * n4 + [8] * (hkv - n2 - n4)
        elif name != "fp16":
            maps[name] = [int(name)] * hkv
    return maps


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn (do_bench: warm-up, then repetitions; it also flushes L2 between calls)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rotating(make: Callable[[], object], set_bytes: int) -> list:
    """Enough independent buffer sets that cycling through them spans ROTATE_BYTES x L2."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    n = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES * l2 / max(set_bytes, 1))))
    return [make() for _ in range(n)]


def cycle(sets: list, fn: Callable) -> Callable[[], object]:
    """A zero-argument callable applying fn to the next buffer set on each call."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(sets)
        return fn(sets[state["i"]])

    return call


def copy_bandwidth(nbytes: int = GiB) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written per second)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def filled_store(bits: list[int], batch: int, context: int, head_dim: int, group_size: int) -> PackedStore:
    """A PackedStore of `context` random fp16 tokens, quantized in chunks by the quantize kernel."""
    st = PackedStore(
        bits, head_dim, batch, group_size=group_size, dtype=torch.float16, device=DEVICE, capacity=context
    )
    chunk = max(1, FILL_ELEMENTS // (batch * len(bits) * head_dim))
    for pos in range(0, context, chunk):
        x = torch.randn(
            batch, len(bits), min(chunk, context - pos), head_dim, dtype=torch.float16, device=DEVICE
        )
        quantize_into(
            st.payload, st.scale, st.zero, st.full, st.width, st.byte_offset, st.slot, x, pos, group_size
        )
    st.length = context
    return st


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q (B, Hq, D), k/v (B, Hkv, L, D) fp16 -> (B, Hq, D) with GQA."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k, v, scale=sm_scale, enable_gqa=True
    )
    return out[:, :, 0]


def row(
    shape: dict, method: str, widths: str, ms: float | None, nbytes: int, copy_bw: float, **extra
) -> dict:
    gbps = nbytes / ms / 1e6 if ms else float("nan")
    return {
        **shape,
        "method": method,
        "widths": widths,
        "time_us": ms * 1e3 if ms else float("nan"),
        "bytes_read": nbytes,
        "gbps": gbps,
        "frac_copy_bw": gbps / copy_bw,
        "rel_err": "",
        "note": "",
        **extra,
    }


def bench_decode_shape(
    shape: dict, maps: dict[str, list[int]], with_fp16: bool, group_size: int, copy_bw: float
) -> list[dict]:
    """All decode methods at one (config, batch, context); shapes that run out of memory are noted and skipped."""
    B, hq, hkv, D, L = shape["batch"], shape["hq"], shape["hkv"], shape["head_dim"], shape["context"]
    sm_scale = D**-0.5
    rows = []
    fp16_bytes = 2 * B * hkv * L * D * 2  # K and V
    if with_fp16:
        try:
            sets = rotating(
                lambda: (
                    [torch.randn(B, hq, D, dtype=torch.float16, device=DEVICE)]
                    + [torch.randn(B, hkv, L, D, dtype=torch.float16, device=DEVICE) for _ in range(2)]
                ),
                fp16_bytes,
            )
            ms = bench(cycle(sets, lambda s: sdpa(s[0], s[1], s[2], sm_scale)))
            rows.append(row(shape, "sdpa_fp16", "16", ms, fp16_bytes, copy_bw))
        except torch.cuda.OutOfMemoryError:
            rows.append(row(shape, "sdpa_fp16", "16", None, fp16_bytes, copy_bw, note="oom"))
        sets = None
        torch.cuda.empty_cache()

    for name, bits in list(maps.items()) + [("16", [16] * hkv)]:
        tag = ",".join(map(str, bits)) if name == "mixed" else name
        try:
            sets = rotating(
                lambda bits=bits: (
                    torch.randn(B, hq, D, dtype=torch.float16, device=DEVICE),
                    filled_store(bits, B, L, D, group_size),
                    filled_store(bits, B, L, D, group_size),
                ),
                fp16_bytes * sum(bits) // (16 * hkv),
            )
        except torch.cuda.OutOfMemoryError:
            rows.append(row(shape, "fused", tag, None, 0, copy_bw, note="oom"))
            torch.cuda.empty_cache()
            continue
        packed = sets[0][1].nbytes() + sets[0][2].nbytes()
        ms = bench(cycle(sets, lambda s: decode_attention(s[0], s[1], s[2], sm_scale)))
        rows.append(row(shape, "fused", tag, ms, packed, copy_bw))
        try:
            # Guard against timing a broken kernel: compare one set with the torch path.
            q, ks, vs = sets[0]
            ref = sdpa(q, ks.dequantize(), vs.dequantize(), sm_scale).float()
            err = ((decode_attention(q, ks, vs, sm_scale).float() - ref).norm() / ref.norm()).item()
            rows[-1]["rel_err"] = f"{err:.2e}"
            if name != "16":
                # Torch path: dequantize every head (written then read back in fp16), then SDPA.
                ms = bench(cycle(sets, lambda s: sdpa(s[0], s[1].dequantize(), s[2].dequantize(), sm_scale)))
                rows.append(row(shape, "dequant_sdpa", tag, ms, packed + 2 * fp16_bytes, copy_bw))
        except torch.cuda.OutOfMemoryError:
            rows.append(row(shape, "dequant_sdpa", tag, None, packed + 2 * fp16_bytes, copy_bw, note="oom"))
        sets = None
        torch.cuda.empty_cache()
    return rows


def bench_quantize(
    shape: dict, maps: dict[str, list[int]], tokens: int, group_size: int, copy_bw: float
) -> list[dict]:
    """quantize_into throughput for `tokens` new tokens per sequence: bytes = fp16 input read + packed written."""
    B, hkv, D = shape["batch"], shape["hkv"], shape["head_dim"]
    rows = []
    for name, bits in maps.items():
        tag = ",".join(map(str, bits)) if name == "mixed" else name
        in_bytes = B * hkv * tokens * D * 2

        def make(bits=bits):
            st = PackedStore(
                bits, D, B, group_size=group_size, dtype=torch.float16, device=DEVICE, capacity=tokens
            )
            return st, torch.randn(B, hkv, tokens, D, dtype=torch.float16, device=DEVICE)

        try:
            sets = rotating(make, 2 * in_bytes)
            st0 = sets[0][0]
            out_bytes = (
                B * tokens * (st0.row_bytes + 2 * st0.scale[0, 0].numel() * (1 if st0.zero is None else 2))
            )
            fn = cycle(
                sets,
                lambda s: quantize_into(
                    s[0].payload,
                    s[0].scale,
                    s[0].zero,
                    s[0].full,
                    s[0].width,
                    s[0].byte_offset,
                    s[0].slot,
                    s[1],
                    0,
                    group_size,
                ),
            )
            ms = bench(fn)
            r = row({**shape, "context": tokens}, "quantize", tag, ms, in_bytes + out_bytes, copy_bw)
            r["note"] = f"{B * tokens / ms / 1e3:.3g} Mtok/s"
            rows.append(r)
        except torch.cuda.OutOfMemoryError:
            rows.append(row({**shape, "context": tokens}, "quantize", tag, None, 0, copy_bw, note="oom"))
        sets = None
        torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Decode latency vs context: one panel per (config, batch), one line per method and width map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dec = [r for r in rows if r["method"] != "quantize" and r["time_us"] == r["time_us"]]
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
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["32x8", "28x4"], help="HQxHKV head counts")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--context", nargs="+", type=int, default=[1024, 4096, 16384, 32768, 65536, 131072])
    p.add_argument(
        "--widths",
        nargs="+",
        default=["2", "4", "8", "mixed", "fp16"],
        help="width maps: uniform 2/3/4/8, 'mixed' (mean 4), 'fp16' (SDPA baseline)",
    )
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument(
        "--quantize-tokens",
        nargs="+",
        type=int,
        default=[1, 4096],
        help="new tokens per sequence for the quantize throughput rows",
    )
    p.add_argument(
        "--out", type=Path, default=Path("results/kernels"), help="parent of the <gpu name> folder"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("kernels.bench needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run.")
    gpu = torch.cuda.get_device_name(0)
    out_dir = args.out / re.sub(r"[^A-Za-z0-9._-]+", "_", gpu)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python -m kernels.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    copy_bw = copy_bandwidth()
    print(f"{gpu}: device-to-device copy {copy_bw:.0f} GB/s", flush=True)

    rows: list[dict] = []
    for cfg in args.configs:
        hq, hkv = map(int, cfg.split("x"))
        maps = width_maps(hkv, args.widths)
        for batch in args.batch:
            base = {"config": cfg, "hq": hq, "hkv": hkv, "head_dim": args.head_dim, "batch": batch}
            for context in args.context:
                new = bench_decode_shape(
                    {**base, "context": context}, maps, "fp16" in args.widths, args.group_size, copy_bw
                )
                for r in new:
                    print(
                        f"{cfg} B={batch} L={context} {r['method']:>12} {r['widths']:>16} "
                        f"{r['time_us']:10.1f} us {r['gbps']:7.0f} GB/s {r['frac_copy_bw']:.2f} {r['note']}",
                        flush=True,
                    )
                rows += new
            rows += bench_quantize(
                {**base, "context": 0}, maps, max(args.quantize_tokens), args.group_size, copy_bw
            )
            if min(args.quantize_tokens) != max(args.quantize_tokens):
                rows += bench_quantize(
                    {**base, "context": 0}, maps, min(args.quantize_tokens), args.group_size, copy_bw
                )

    header = f"# command: {command} | gpu: {gpu} | copy GB/s: {copy_bw:.1f} | torch {torch.__version__} | triton {triton.__version__}"
    with open(out_dir / "decode.csv", "w", newline="") as f:
        f.write(header + "\n")
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out_dir / "decode.png")
    (out_dir / "README.md").write_text(
        f"# Kernel benchmarks on {gpu}\n\n"
        f"Command: `{command}`\n\nGPU: {gpu}; device-to-device copy bandwidth {copy_bw:.1f} GB/s "
        f"(read + write, same run); torch {torch.__version__}, triton {triton.__version__}.\n\n"
        "Files: `decode.csv` (one row per method and shape; `context` is the quantized-token count for "
        "`quantize` rows), `decode.png` (decode latency vs context).\n\n"
        "Methods: `fused` = kernels.decode_attention over PackedStores (reads packed K/V once); "
        "`sdpa_fp16` = torch SDPA over fp16 K/V; `dequant_sdpa` = PackedStore.dequantize() then SDPA; "
        "`quantize` = kernels.quantize.quantize_into. `bytes_read` is what the method must move (fused: "
        "packed bytes; dequant_sdpa: packed + fp16 written and read back; quantize: fp16 in + packed out); "
        "`gbps` = bytes_read / time; `frac_copy_bw` = gbps / copy bandwidth. `rel_err` compares the fused "
        "output with dequant_sdpa.\n"
    )
    print(f"wrote {out_dir}/decode.csv, decode.png, README.md")


if __name__ == "__main__":
    main()
