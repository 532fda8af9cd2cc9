"""`python -m kernels.gpu.ab FILE... --out CSV`: versions of kernels/decode_attention.py timed in one process.

This module owns kernel A/B comparisons. Each FILE is a copy of kernels/decode_attention.py (an older
revision, a candidate), loaded as its own module so that its Triton kernels compile from its own source. At
each context and width map the same random bf16 K/V are packed once (kernels/layout.py, the current
quantize kernel), and every version's `decode_attention` runs on those stores, at its default splits and at
each `--splits`; SDPA over the 16-bit K/V is timed beside them as the baseline. A version written for the
token-major layout that kernels/layout.py held before the head-major one (the kernel of baf9cf7 and older: it
reads `store.payload` as (B, cap, row bytes) and `store.byte_offset`) is given the same stores rearranged
into that layout (`TokenMajorStore`), so both read the same bytes. Rows have kernels/gpu/bench.py's
columns (method `fused:<file stem>`; rel_err against SDPA over the dequantized stores, where that fits), so
decode.csv and these tables read alike. At its default splits each version is timed twice: launched from
Python as an eager decode step runs it (`fused:`), and replayed from a CUDA graph (`graph:<file stem>`), the
GPU's time alone: where the two differ, the host's launches (stage 1's, and the combine) set the pace. On CUDA
each default call's launches are also profiled apart (ab-launches.csv beside the CSV: each launch's kernel and
median device time), to show which launch takes a mixed map's time. `--dry-run` runs on CPU under
TRITON_INTERPRET=1 at a tiny shape: a check that the code runs, no figure (its graph rows have no time).
`--host` times the host side alone, on any machine (no GPU needed): each version's call with every Triton launch stubbed out (host_us: the call's own
Python), and with the JIT's argument binding for an sm_90 launch run in place of each launch (host_bind_us: the
Python Triton runs before it launches), the versions interleaved on the same stores. Its file checks and module
loading also serve harness/bench/perf_ab.py (the CPU read path's comparison). `--codes` and `--codes-allocation`
add the codes-only path (decode_attention_blocks over random codes, a query and a bias per block of `--qblock`
tokens, each map at each block size given: the pca family's kernel) at uniform and mixed maps and at the
proportions of recorded allocations, in the same CSV as the affine kernel's and SDPA's rows, each row with its
bytes (methods `codes:` and `codes-graph:`); `--grouped POINT PLAN...` the same at a recorded allocation whose widths
hold grouped rows under its own plans (kernels/groups.py: the pca_block*_ugs* formats; a plan for keys and values
alike, or for one role: grouped_entry); repeated, one allocation and its plans each time.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import statistics
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

import torch

from kernels.gpu.bench import (
    DRY_SHAPES,
    HEAD_SHAPES,
    Bench,
    default_backend,
    dequant_sdpa,
    fill,
    partial_bytes,
    rel_err,
    sdpa,
    tag,
    width_maps,
)
from kernels.gpu.inspect import plan_entry
from kernels.layout import PackedStore


def check_version_files(p: argparse.ArgumentParser, files: list[Path], original: str) -> None:
    """Stop with one line (exit 2) unless every file exists and the names differ (rows carry the name)."""
    for f in files:
        if not f.is_file():
            p.error(f"files: {str(f)!r} is not a file; allowed: copies of {original}")
    if len({f.stem for f in files}) != len(files):
        p.error("files: two files share a name; allowed: files with distinct names (the rows carry the name)")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_versions(files: list[Path]) -> dict:
    """name -> the module each file defines, under a name of its own (so its kernels compile from its source).

    A folder beside FILE named after its stem may hold that revision's own copies of the kernels modules it
    imports (`.ab/e715a9f/unpack.py`): while FILE is loaded they stand in for kernels.<module>, so an older
    kernel compiles with the helpers it was written against, not today's."""
    versions = {}
    for i, path in enumerate(files):
        companions = sorted(path.with_suffix("").glob("*.py"))
        saved = {f"kernels.{c.stem}": sys.modules.get(f"kernels.{c.stem}") for c in companions}
        try:
            for c in companions:
                sys.modules[f"kernels.{c.stem}"] = _load(f"kernels._ab{i}_{path.stem}_{c.stem}", c)
            versions[path.stem] = _load(f"kernels._ab{i}_{path.stem}", path)
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
    return versions


class TokenMajorStore:
    """A kernels.layout.PackedStore's tokens in the older token-major layout, for versions that read it:
    payload uint8 (B, cap, row bytes) with the quantized heads width-major in each row at `byte_offset`;
    scale/zero fp16 (B, n_quant, cap, D // g) and full (B, n_full, cap, D) at `slot`."""

    def __init__(self, store):
        self.bits, self.batch, self.head_dim = store.bits, store.batch, store.head_dim
        self.group_size, self.symmetric = store.group_size, store.symmetric
        self.length = store.length
        quant = [bk for bk in store.buckets if bk.width != 16]
        full = [bk for bk in store.buckets if bk.width == 16]
        self.n_quant = sum(len(bk.heads) for bk in quant)
        offset, slot = [0] * len(store.bits), [0] * len(store.bits)
        row, n = 0, 0
        for bk in quant:  # width-major, KV-head order within a width, as the older layout put them
            for h in bk.heads.tolist():
                offset[h], slot[h] = row, n
                row, n = row + bk.payload.shape[-1], n + 1
        n = 0
        for bk in full:
            for h in bk.heads.tolist():
                slot[h], n = n, n + 1
        dev = store.slot.device
        self.payload = torch.cat([bk.payload.transpose(1, 2).flatten(2) for bk in quant], 2).contiguous() if quant \
            else torch.empty(store.batch, store.capacity, 0, dtype=torch.uint8, device=dev)  # fmt: skip
        groups = store.head_dim // store.group_size
        empty = torch.empty(store.batch, 0, store.capacity, groups, dtype=torch.float16, device=dev)
        self.scale = torch.cat([bk.scale for bk in quant], 1) if quant else empty
        self.zero = None if store.symmetric else (torch.cat([bk.zero for bk in quant], 1) if quant else empty)
        self.full = full[0].values if full else torch.empty(
            store.batch, 0, store.capacity, store.head_dim, dtype=store.dtype, device=dev
        )  # fmt: skip
        self.byte_offset = torch.tensor(offset, dtype=torch.int32, device=dev)
        self.slot = torch.tensor(slot, dtype=torch.int32, device=dev)
        self.capacity = store.capacity

    def nbytes(self) -> int:
        return self._nbytes

    @classmethod
    def of(cls, store):
        out = cls(store)
        out._nbytes = store.nbytes()
        return out


def reads_token_major(module) -> bool:
    """Whether a version of kernels/decode_attention.py reads the older token-major layout."""
    return not hasattr(module, "_bucket_args")


def compare(run: Bench, versions: dict, shape: dict, widths: list[str], splits: list[int], group_size: int):
    """Every version at every width map and split count, on the same stores; SDPA first."""
    B, hq, hkv, D, L = (shape[k] for k in ("batch", "hq", "hkv", "head_dim", "context"))
    dev, scale = run.device, D**-0.5
    qkv_bytes = 2 * B * hq * D * 2
    q = torch.randn(B, hq, D, dtype=run.dtype, device=dev)
    k = torch.randn(B, hkv, L, D, dtype=run.dtype, device=dev)
    v = torch.randn(B, hkv, L, D, dtype=run.dtype, device=dev)
    run.add(shape, "sdpa_default", "16", 16, run.time_ms(lambda: sdpa(q, k, v, scale)),
            2 * k.numel() * k.element_size() + qkv_bytes, note=default_backend(q, k, scale))  # fmt: skip
    for name, bits in width_maps(hkv, widths).items():
        kst, vst = fill(bits, k, group_size), fill(bits, v, group_size)
        want = dequant_sdpa(q, kst, vst, scale) if B * L <= 8 * 32768 else None
        older = (
            (TokenMajorStore.of(kst), TokenMajorStore.of(vst))
            if any(map(reads_token_major, versions.values()))
            else None
        )
        for stem, mod in versions.items():
            ks_, vs_ = older if reads_token_major(mod) else (kst, vst)
            for n in [None, *splits]:
                used = _splits_used(mod, ks_, vs_, L, dev, n, q.dtype)
                fn = partial(mod.decode_attention, q, ks_, vs_, scale, num_splits=n)
                fetched = kst.nbytes() + vst.nbytes() + qkv_bytes + partial_bytes(B, hq, used, D)
                method, t, mean = f"fused:{stem}", tag(name, bits), sum(bits) / len(bits)
                try:
                    err = rel_err(fn(), want) if want is not None else ""
                    ms = run.time_ms(fn)
                except Exception as e:  # noqa: BLE001 - a version that does not compile is a row, not a crash
                    run.add(
                        shape, method, t, mean, None, fetched, note=f"failed: {type(e).__name__}: {e}"[:200]
                    )
                    continue
                run.add(shape, method, t, mean, ms, fetched, rel_err=err, note=f"splits={used}")
                if n is None:  # the same call replayed from a CUDA graph: the launches' host time taken out
                    ms = run.time_graph_ms(fn)
                    run.add(shape, f"graph:{stem}", t, mean, ms, fetched, note=f"splits={used}")
                    if dev.type == "cuda":
                        profile_launches(run, shape, stem, t, fn)
        del kst, vst
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def allocation_map(pairs: Counter, hkv: int) -> tuple[list[int], list[int]]:
    """hkv KV heads' (key widths, value widths) in the proportions of an allocation's width pairs (kernels.gpu.
    inspect.allocation_pairs: pair -> units), by largest remainders, pairs in sorted order."""
    total = sum(pairs.values())
    share = {pair: hkv * n / total for pair, n in pairs.items()}
    count = {pair: int(x) for pair, x in share.items()}
    for pair in sorted(share, key=lambda pair: (count[pair] - share[pair], pair))[
        : hkv - sum(count.values())
    ]:
        count[pair] += 1
    heads = [pair for pair in sorted(count) for _ in range(count[pair])]
    return [k for k, _ in heads], [v for _, v in heads]


def codes_maps(
    hkv: int, names: list[str], allocations: list[Path], grouped: list[tuple[Path, dict, dict]] = ()
) -> dict[str, tuple[list[int], list[int], dict, dict]]:
    """The codes-only path's (key widths, value widths, key plans, value plans) per KV head: each of `names` as
    width_maps makes it (keys and values alike), each allocation file's proportions (allocation_map), under its
    file's stem, and each of `grouped`'s (allocation file, key plans, value plans: width -> kernels.groups plan,
    grouped_entry) the same with the plans of its widths."""
    from kernels.gpu.inspect import allocation_pairs

    for name in names:
        if name not in ("2", "3", "4", "8", "mixed"):
            raise ValueError(f"{name!r} is not a codes-only width map; allowed: 2, 3, 4, 8, mixed")
    maps = {name: (bits, bits, {}, {}) for name, bits in width_maps(hkv, names).items()}
    for path in allocations:
        maps[path.stem] = (*allocation_map(allocation_pairs(path), hkv), {}, {})
    for path, key_plans, value_plans in grouped:
        k_bits, v_bits = allocation_map(allocation_pairs(path), hkv)
        for role, bits, plans in (("key", k_bits, key_plans), ("value", v_bits, value_plans)):
            missing = sorted(set(bits) - {2, 3, 4, 8} - set(plans))
            if missing:
                raise ValueError(f"{path}: {missing[0]}-bit {role} heads and no plan for them")
        maps[path.stem] = (
            k_bits,
            v_bits,
            {w: p for w, p in key_plans.items() if w in k_bits},
            {w: p for w, p in value_plans.items() if w in v_bits},
        )
    return maps


def grouped_entry(values: list[str]) -> tuple[Path, dict, dict]:
    """`--grouped POINT WIDTH=GROUP_WIDTHS...` -> (POINT, key plans, value plans), each {width: plan}: a plan
    WIDTH=... for keys and values alike, kWIDTH=... for keys only, vWIDTH=... for values only (a role's own plan
    wins over the shared one); ValueError naming what is wrong."""
    if len(values) < 2:
        raise ValueError(f"{' '.join(values)!r} is not POINT WIDTH=GROUP_WIDTHS...: no plans")
    shared, own = {}, {"k": {}, "v": {}}
    try:
        for value in values[1:]:
            role = value[0] if value[:1] in own else ""
            width, plan = plan_entry(value[len(role) :])
            (own[role] if role else shared)[width] = plan
    except argparse.ArgumentTypeError as err:
        raise ValueError(str(err)) from None
    return Path(values[0]), {**shared, **own["k"]}, {**shared, **own["v"]}


def fill_codes(bits: list[int], B: int, L: int, D: int, device, plans: dict | None = None) -> PackedStore:
    """A codes-only PackedStore of L random tokens (B, len(bits) heads, D), each head's codes uniform over its
    width's (under a grouped plan, each component's group's), written in chunks."""
    plans = {w: p for w, p in (plans or {}).items() if w in bits}
    st = PackedStore(bits, D, B, device=device, capacity=L + 1, codes_only=True, simulate=False, plans=plans)
    per_component = [[g for g in plans[w] for _ in range(16)] if w in plans else [w] * D for w in bits]
    mask = ((1 << torch.tensor(per_component, device=device)) - 1).to(torch.uint8)[None, :, None, :]
    chunk = max(1, (1 << 26) // (B * len(bits) * D))
    for pos in range(0, L, chunk):
        n = min(chunk, L - pos)
        st.append_codes(torch.randint(0, 256, (B, len(bits), n, D), dtype=torch.uint8, device=device) & mask)
    return st


def compare_codes(run: Bench, versions: dict, shape: dict, maps: dict, qblock: int) -> None:
    """Every version with a codes-only path (decode_attention_blocks) at every map of `maps` (codes_maps), on the
    same stores, a query and a bias per block of `qblock` tokens (method `codes:<stem>`, and `codes-graph:<stem>`
    replayed from a CUDA graph); rel_err against kernels.reference.attention_blocks_reference where it fits. Its
    rows sit beside compare's (SDPA's and the affine kernel's) in the same CSV, so bytes can be matched; on CUDA
    each call's launches (the block queries', stage 1's, the combine's) go to the launches CSV too, their widths
    tagged with the block size."""
    from kernels import reference

    B, hq, D, L = (shape[k] for k in ("batch", "hq", "head_dim", "context"))
    dev, scale = run.device, D**-0.5
    nb = -(-L // qblock)
    qb = (torch.randn(B, hq, nb, D, device=dev) * D**-0.5).to(run.dtype)
    bias = torch.randn(B, hq, nb, device=dev)
    query_bytes = qb.numel() * qb.element_size() + bias.numel() * 4 + B * hq * D * 4  # and the output
    for name, (k_bits, v_bits, k_plans, v_plans) in maps.items():
        kst, vst = fill_codes(k_bits, B, L, D, dev, k_plans), fill_codes(v_bits, B, L, D, dev, v_plans)
        plans = {**k_plans, **v_plans}  # the widths read as grouped rows
        want = None
        if B * L <= 8 * 32768:
            want = reference.attention_blocks_reference(
                qb, bias, kst.dequantize(), vst.dequantize(), scale, qblock
            )
        widths = (
            tag(name, k_bits)
            if v_bits == k_bits
            else ",".join(map(str, k_bits)) + "/" + ",".join(map(str, v_bits))
        )
        mean = (sum(k_bits) + sum(v_bits)) / (2 * len(k_bits))
        for stem, mod in versions.items():
            if not hasattr(mod, "decode_attention_blocks") or (plans and not hasattr(mod, "_plan_codes")):
                continue  # no codes-only path, or none for grouped rows
            fn = partial(mod.decode_attention_blocks, qb, bias, kst, vst, scale, qblock)
            plan = mod._store_map_plan(kst, vst, dev, qb.dtype)
            used = mod._split_plans(plan, kst, L, None, dev, None, qblock)[1]  # the default splits
            fetched = kst.nbytes() + vst.nbytes() + query_bytes + partial_bytes(B, hq, used, D)
            note = f"{name}; qblock={qblock}; splits={used}" + (f"; grouped {sorted(plans)}" if plans else "")
            try:
                err = rel_err(fn(), want) if want is not None else ""
                run.add(
                    shape, f"codes:{stem}", widths, mean, run.time_ms(fn), fetched, rel_err=err, note=note
                )
                run.add(shape, f"codes-graph:{stem}", widths, mean, run.time_graph_ms(fn), fetched, note=note)
            except Exception as e:  # noqa: BLE001 - a version that does not compile is a row, not a crash
                run.add(
                    shape,
                    f"codes:{stem}",
                    widths,
                    mean,
                    None,
                    fetched,
                    note=f"failed: {type(e).__name__}: {e}"[:200],
                )
                continue
            if dev.type == "cuda":  # the block queries' launch, stage 1 and the combine, each apart
                profile_launches(run, shape, stem, f"{widths} qblock={qblock}", fn)
        del kst, vst
        if dev.type == "cuda":
            torch.cuda.empty_cache()


LAUNCH_REPS = 10  # calls profiled for the per-launch device times
LAUNCH_COLUMNS = ["config", "batch", "context", "version", "widths", "launch", "kernel", "device_us"]


def profile_launches(run: Bench, shape: dict, version: str, widths: str, fn) -> None:
    """One call's launches (launch_times) appended to the launches CSV beside run's; a profile that fails is
    said, not fatal (a diagnostic)."""
    try:
        write_launches(run.csv_path, shape, version, widths, launch_times(fn, LAUNCH_REPS))
    except Exception as e:  # noqa: BLE001 - a diagnostic that fails is said, not fatal
        print(f"warning: {version} {widths}: no launch profile ({type(e).__name__}: {e})"[:300])


def launch_times(fn, reps: int) -> list[tuple[str, float]]:
    """(kernel name, median device microseconds) of each launch that one call of fn makes, in launch order,
    from `reps` calls under torch.profiler (CUDA): which of a call's launches (one per width bucket, then the
    combine) takes its time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    device = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    return per_launch([(e.name, e.time_range.elapsed_us()) for e in device], reps)


def per_launch(kernels: list[tuple[str, float]], reps: int) -> list[tuple[str, float]]:
    """[(name, us)] of `reps` identical calls in time order -> per launch of one call: (name, median us)."""
    n = len(kernels) // reps
    if (
        n == 0
        or n * reps != len(kernels)
        or any(kernels[i][0] != kernels[i % n][0] for i in range(len(kernels)))
    ):
        raise ValueError(f"{len(kernels)} device events are not {reps} repeats of one call's launches")
    return [(kernels[i][0], statistics.median(kernels[r * n + i][1] for r in range(reps))) for i in range(n)]


def write_launches(ab_csv: Path, shape: dict, version: str, widths: str, launches: list[tuple[str, float]]):
    """Append one call's launches to <ab.csv's stem>-launches.csv beside it (LAUNCH_COLUMNS)."""
    path = ab_csv.with_name(f"{ab_csv.stem}-launches.csv")
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=LAUNCH_COLUMNS)
        if new:
            w.writeheader()
        for i, (kernel, us) in enumerate(launches):
            w.writerow({"config": shape["config"], "batch": shape["batch"], "context": shape["context"],
                        "version": version, "widths": widths, "launch": i, "kernel": kernel,
                        "device_us": round(us, 2)})  # fmt: skip


def _splits_used(mod, k_store, v_store, L: int, dev, n: int | None, dtype) -> int:
    """The split columns a version's decode_attention plans (its plan_splits' signature changed over time)."""
    if reads_token_major(mod) or not hasattr(mod, "fast_bucket"):
        return mod.plan_splits(k_store, v_store, L, mod.BLOCK_N, dev, n)[2]
    return mod.plan_splits(k_store, v_store, L, None, dev, n, dtype)[2]


HOST_COLUMNS = ["config", "batch", "context", "version", "widths", "launches", "host_us", "host_bind_us", "rounds",
                "reps", "torch_threads", "triton"]  # fmt: skip
HOST_ROUNDS = 16  # interleaved rounds of each version (the median round counts)
HOST_REPS = 100  # calls a round
HOST_WARMUP = 4  # untimed rounds before them: the first timed calls of a process run slow


def _stub_launches(module, bind: bool) -> list:
    """Replace the `run` of every Triton kernel in `module` (a version loaded for this run alone) by a stub that
    counts its calls (with `bind`, after the JIT's argument binding for an sm_90 launch); returns [count] (a
    shared counter)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    count = [0]
    for kernel in vars(module).values():
        if isinstance(kernel, JITFunction):
            binder = (
                create_function_from_signature(kernel.signature, kernel.params, backend) if bind else None
            )

            def run(*args, grid, warmup, _binder=binder, **kwargs):
                count[0] += 1
                if _binder is not None:
                    _binder(*args, **kwargs)

            kernel.run = run
    return count


def host_times(versions: dict, shape: dict, widths: list[str], group_size: int) -> list[dict]:
    """HOST_COLUMNS rows: each version's decode_attention at each width map on the same (unfilled) CPU stores,
    launches stubbed; per call the median over HOST_ROUNDS rounds (the versions in turn each round) of the mean
    over HOST_REPS calls, in microseconds."""
    import triton

    from kernels.layout import PackedStore

    B, hq, hkv, D, L = (shape[k] for k in ("batch", "hq", "hkv", "head_dim", "context"))
    q = torch.zeros(B, hq, D, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    rows = []
    for name, bits in width_maps(hkv, widths).items():
        stores = [
            PackedStore(bits, D, B, group_size=group_size, dtype=torch.bfloat16, capacity=L) for _ in "kv"
        ]
        for st in stores:
            st.length = L
        older = tuple(TokenMajorStore.of(st) for st in stores) if any(map(reads_token_major, versions.values())) \
            else None  # fmt: skip
        times = {}
        for bind in (False, True):
            calls = {}
            for stem, mod in versions.items():
                count = _stub_launches(mod, bind)
                kv = older if reads_token_major(mod) else stores
                calls[stem] = (partial(mod.decode_attention, q, *kv, D**-0.5, out=out), count)
            for _ in range(HOST_WARMUP):
                for fn, _ in calls.values():
                    for _ in range(HOST_REPS):
                        fn()
            rounds = {stem: [] for stem in calls}
            for _ in range(HOST_ROUNDS):
                for stem, (fn, _) in calls.items():
                    t = time.perf_counter()
                    for _ in range(HOST_REPS):
                        fn()
                    rounds[stem].append((time.perf_counter() - t) / HOST_REPS * 1e6)
            for stem, (fn, count) in calls.items():
                count[0] = 0
                fn()
                times.setdefault(stem, {})["host_bind_us" if bind else "host_us"] = statistics.median(
                    rounds[stem]
                )
                times[stem]["launches"] = count[0]
        for stem, t in times.items():
            rows.append({"config": shape["config"], "batch": B, "context": L, "version": stem,
                         "widths": tag(name, bits), "launches": t["launches"], "host_us": round(t["host_us"], 1),
                         "host_bind_us": round(t["host_bind_us"], 1), "rounds": HOST_ROUNDS, "reps": HOST_REPS,
                         "torch_threads": torch.get_num_threads(), "triton": triton.__version__})  # fmt: skip
    return rows


def write_host_times(versions: dict, head_shape: tuple, args: argparse.Namespace) -> None:
    """--host: host_times at each context into args.out (HOST_COLUMNS), and a line per row on stdout."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    hq, hkv, D = head_shape
    rows = []
    for context in args.context:
        shape = {"config": args.config, "hq": hq, "hkv": hkv, "head_dim": D, "batch": args.batch,
                 "context": context}  # fmt: skip
        rows += host_times(versions, shape, args.widths, args.group_size)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=HOST_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    for r in rows:
        print(f"{r['version']:>24} {r['widths']:>16} launches {r['launches']}  host {r['host_us']:7.1f} us  "
              f"with binding {r['host_bind_us']:7.1f} us")  # fmt: skip
    print(f"wrote {args.out} ({len(rows)} rows)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kernels.gpu.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="copies of kernels/decode_attention.py")
    p.add_argument("--out", type=Path, required=True, help="the CSV to write")
    p.add_argument("--config", default="32x8", help=f"head shape: {', '.join(HEAD_SHAPES)}")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", nargs="+", type=int, default=[32768])
    p.add_argument("--widths", nargs="+", default=["2", "3", "4", "8", "mixed", "16"])
    p.add_argument("--splits", nargs="*", type=int, default=[], help="split counts tried besides the default")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument(
        "--codes",
        nargs="*",
        default=[],
        help="width maps (as --widths) of the codes-only path (decode_attention_blocks)",
    )
    p.add_argument(
        "--codes-allocation", nargs="*", type=Path, default=[],
        help="recorded points or allocation files: the codes-only path at a map of each one's width pairs",
    )  # fmt: skip
    p.add_argument(
        "--grouped", nargs="+", action="append", default=[], metavar="POINT WIDTH=GROUP_WIDTHS",
        help="as --codes-allocation, a point whose widths hold grouped rows under the plans after it (kernels/"
        "groups.py; W=... keys and values alike, kW=... keys only, vW=... values only); repeat for each point "
        "(pca_block_ugs's, pca_block_ugsa's, pca_block32_ugsa's)",
    )  # fmt: skip
    p.add_argument(
        "--qblock", nargs="+", type=int, default=[128],
        help="tokens a query block on the codes-only path; several: every codes map at each, in this order",
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, a tiny shape")
    p.add_argument("--host", action="store_true", help="the host side alone, launches stubbed (any machine)")
    args = p.parse_args(argv)
    shapes = DRY_SHAPES if args.dry_run else HEAD_SHAPES
    if args.config not in shapes:
        p.error(f"--config: {args.config!r} is not a head shape; allowed: {', '.join(shapes)}")
    check_version_files(p, args.files, "kernels/decode_attention.py")
    try:
        grouped = [grouped_entry(values) for values in args.grouped]
    except ValueError as err:
        p.error(f"--grouped: {err}")
    try:
        codes = codes_maps(shapes[args.config][1], args.codes, args.codes_allocation, grouped)
    except ValueError as err:
        p.error(f"--codes: {err}")
    bad = [q for q in args.qblock if q < 16 or q % 16]
    if bad:
        p.error(f"--qblock: {bad[0]} tokens a block; allowed: positive multiples of 16")
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("error: --dry-run needs TRITON_INTERPRET=1 in the environment (set before Python starts)")
    if args.host and os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("error: --host times the compiled path's host side; unset TRITON_INTERPRET")
    if args.host:
        write_host_times(load_versions(args.files), shapes[args.config], args)
        return
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: kernels.gpu.ab needs a CUDA GPU (or --dry-run); nothing was run")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run = Bench("cpu" if args.dry_run else "cuda", args.out, deadline=float("inf"))
    versions = load_versions(args.files)
    hq, hkv, D = shapes[args.config]
    for context in args.context:
        shape = {"config": args.config, "hq": hq, "hkv": hkv, "head_dim": D, "batch": args.batch,
                 "context": context}  # fmt: skip
        compare(run, versions, shape, args.widths, args.splits, args.group_size)
        for qblock in args.qblock:
            compare_codes(run, versions, shape, codes, qblock)
    print(f"wrote {args.out} ({len(run.rows)} rows)")


if __name__ == "__main__":
    main()
