"""From a quality target to a deployable cache: the smallest cache that meets a target (or the best quality at a
size), found by search on cached calibration measurements and confirmed by the frontier's evaluation.
`python -m harness.advise model=NAME target.ppl_ratio=1.02`, or harness.advise(model, tokenizer, ...).

This module owns the search:
- the target (Target): ppl_ratio <= value, kl_mean <= value, or compression >= value (then the best quality at that
  size), at the user's context length (true compression of one sequence of `context` tokens, every fitted table
  counted); backend `auto` searches every family, `triton` only those the fused kernel decodes;
- the families (FAMILIES): the storages that lead the committed frontier (results/frontier), each with the widths
  its measured knapsack spends; per family and budget the knapsack's allocation (harness.api.allocate, policy
  measured: each unit's KL at each width measured once on the calibration windows, cached on disk);
- the proxy (`proxy`): ppl_ratio and kl_mean teacher-forced on the calibration windows through the cache: a
  bisection on the budget finds each family's smallest budget whose proxy meets a quality target, or the budget
  whose compression meets a size;
- the confirmation: each family's chosen point through the frontier's evaluation on held-out windows (n sequences of
  the evaluation split, never the calibration's), with bootstrap intervals; for a quality target, met, a step below
  it too, missed (the proxy, measured on the windows the tables were fitted on, can be optimistic), steps up until
  one meets it, at most MAX_STEPS_UP; for a size, a step either side; the answer is the most compressed confirmed
  point meeting the target (a size: the lowest ppl_ratio at no less compression), said to meet it only within its
  interval where the interval's far end does not, and a target no point meets is answered with the closest point.
Every measurement is one step file in the run directory, written when done: a rerun reads what is there (resumable).
The page and the allocation file are harness/report/advise.py's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from harness import data, evaluate, metrics
from harness.api import Calibration, allocate
from harness.cache import QuantizedKVCache
from harness.calibrate import cached_head_entropies
from harness.capacity import cache_bytes, shape_from_config
from harness.io import write_json_atomic
from harness.policies import Allocation
from harness.schemes import Scheme, from_point

METRICS = ("ppl_ratio", "kl_mean", "compression")
BACKENDS = ("auto", "triton")
BISECTION_STEPS = 7  # halvings of each family's budget range (a 1-6 bit range to within 0.04 bits)
STEP = 0.25  # bits between a chosen budget and the neighbours confirmed beside it
MAX_STEPS_UP = 4  # steps above the proxy's choice confirmed when the held-out windows miss a quality target


@dataclass(frozen=True)
class Family:
    """A storage the search allocates in: its scheme's point fields, the widths its knapsack spends, and whether the
    fused Triton kernel decodes it."""

    name: str
    scheme: dict
    widths: tuple[int, ...]
    fused: bool = False

    def make_scheme(self) -> Scheme:
        return from_point(self.scheme)

    @property
    def budgets(self) -> tuple[float, float]:
        """The budget range its knapsack can spend (bits per element): its narrowest to its widest width."""
        return float(min(self.widths)), float(max(self.widths))


# The committed frontier's leaders (results/frontier/README.md): pca's measured knapsack at every compression, the
# best before it (nuqkey_codebook with 1% key outliers), and the fused family: of the formats the fused kernel
# decodes, pca_block_ugs's knapsack leads pca_block_uf's at 3.5x, 4.6x and 6.3x (1.031 / 1.106 / 1.342 against
# 1.043 / 1.148 / 1.535) at about the same instructions a byte at 3.5x (pca_block_ugsa's, better still, costs 1.5-1.8x
# the instructions a byte: results/kernels/README.md).
FAMILIES = (
    Family("pca", {"scheme": "pca", "sink_tokens": 1}, (1, 2, 3, 4, 5, 6)),
    Family("nuqkey_codebook", {"scheme": "nuqkey_codebook", "sink_tokens": 1, "outliers": 0.01}, (2, 3, 4)),
    Family("pca_block_ugs", {"scheme": "pca_block_ugs", "sink_tokens": 1}, (1, 2, 3, 4, 5, 6), fused=True),
)


@dataclass(frozen=True)
class Target:
    """What the user asks: `metric` (ppl_ratio or kl_mean at most `value`; compression at least `value`), at
    `context` tokens of one sequence, searched over the families `backend` allows."""

    metric: str
    value: float
    context: int = 4096
    backend: str = "auto"

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"target: unknown {self.metric!r}; allowed: target.{', target.'.join(METRICS)}")
        low = 1.0 if self.metric != "kl_mean" else 0.0
        if isinstance(self.value, bool) or not isinstance(self.value, int | float) or not self.value >= low:
            raise ValueError(f"target.{self.metric}: {self.value!r}; allowed: a number >= {low:g}")
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1:
            raise ValueError(f"context: {self.context!r} is not a positive integer")
        if self.backend not in BACKENDS:
            raise ValueError(f"target.backend: unknown {self.backend!r}; allowed: {', '.join(BACKENDS)}")

    def quality_met(self, value: float) -> bool:
        """Whether a ppl_ratio or kl_mean `value` meets a quality target."""
        return value <= self.value * (1 + 1e-12)

    def families(self, families=FAMILIES) -> tuple[Family, ...]:
        return tuple(f for f in families if self.backend == "auto" or f.fused)


@dataclass
class Candidate:
    """One measured point: a family at a budget, its true compression at the target's context, its proxy figures
    and (once confirmed) its held-out figures with intervals."""

    family: str
    budget: float
    compression: float
    proxy: dict = field(default_factory=dict)  # ppl_ratio, kl_mean on the calibration windows
    confirmed: dict = field(default_factory=dict)  # metric -> [value, low, high], n


class Steps:
    """The run directory's step files: each measurement once, by a key of what it depends on (resumable)."""

    def __init__(self, run_dir: Path, identity: dict):
        self.dir = Path(run_dir) / "steps"
        self.identity = identity
        self.computed = 0  # steps measured by this process (a resumed run reads the others)

    def get(self, kind: str, what: dict, compute: Callable[[], dict]) -> dict:
        text = json.dumps([self.identity, kind, what], sort_keys=True)
        path = self.dir / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
        if path.exists():
            return json.loads(path.read_text())["result"]
        result = compute()
        self.computed += 1
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"kind": kind, "what": what, "result": result})
        return result


@dataclass
class Searcher:
    """One model's search (module docstring): its calibration, held-out windows, baselines and step files."""

    model: object
    calibration: Calibration
    sequences: torch.Tensor  # (n, T) held-out windows
    target: Target
    steps: Steps
    progress: Callable[[str], None] = print
    chunk: int = 128
    _baselines: dict = field(default_factory=dict)
    _fitted: dict = field(default_factory=dict)

    def allocation(self, family: Family, budget: float) -> Allocation:
        return allocate(
            self.model, self.calibration, budget, policy="measured", scheme=family.make_scheme(),
            widths=list(family.widths), sink_threshold=None, chunk=self.chunk, span=self.target.context,
        )  # fmt: skip

    def compression(self, family: Family, alloc: Allocation) -> float:
        """True compression of one sequence of the target's context, every fitted table counted."""
        shape = shape_from_config(self.model.config)
        held = cache_bytes(
            shape, self.target.context, alloc.key_bits, family.make_scheme(), 1, alloc.value_bits
        )
        return held.fp16_bytes / held.true_bytes

    def _baseline(self, which: str, windows: torch.Tensor) -> evaluate.TeacherForced:
        if which not in self._baselines:
            self.progress(f"unquantized baseline on the {which} windows")
            self._baselines[which] = evaluate.teacher_forced(
                self.model,
                windows,
                evaluate.dynamic_cache_factory(self.model),
                chunk=self.chunk,
                batch_size=8,
            )
        return self._baselines[which]

    def _run(self, family: Family, alloc: Allocation, windows: torch.Tensor, which: str):
        """(baseline, run) teacher-forced on `windows` through a cache of `alloc` in `family`'s scheme."""
        scheme = family.make_scheme()
        if family.name not in self._fitted:
            self._fitted[family.name] = self.calibration.fitted(self.model, scheme, self.target.context)
        fitted = self._fitted[family.name]
        base = self._baseline(which, windows)
        factory = lambda: QuantizedKVCache(  # noqa: E731
            self.model.config, alloc, scheme, prefill="quantized", simulate=True, key_calibration=fitted
        )
        return base, evaluate.teacher_forced(
            self.model, windows, factory, chunk=self.chunk, batch_size=8, baseline=base
        )

    def candidate(self, family: Family, budget: float) -> Candidate:
        """The family's point at `budget` with its proxy figures (a step)."""
        budget = round(budget, 4)

        def measure() -> dict:
            alloc = self.allocation(family, budget)
            base, run = self._run(family, alloc, self.calibration.ids, "calibration")
            tfm = metrics.teacher_forced_metrics(base, run)
            return {"compression": self.compression(family, alloc), "ppl_ratio": tfm["ppl_ratio"],
                    "kl_mean": tfm["kl_mean"]}  # fmt: skip

        self.progress(f"proxy: {family.name} at {budget:g} bits")
        got = self.steps.get("proxy", {"family": asdict(family), "budget": budget}, measure)
        proxy = {k: got[k] for k in ("ppl_ratio", "kl_mean")}
        return Candidate(family.name, budget, got["compression"], proxy)

    def confirm(self, family: Family, point: Candidate, n_boot: int = 1000) -> Candidate:
        """The point's held-out ppl_ratio and kl_mean, each [value, low, high] with its bootstrap 95% interval over
        the n windows (a step)."""

        def measure() -> dict:
            alloc = self.allocation(family, point.budget)
            base, run = self._run(family, alloc, self.sequences, "held-out")
            statistics = metrics.teacher_forced_statistics(base, run)
            n = len(self.sequences)
            out = {"n": n}
            for metric in ("ppl_ratio", "kl_mean"):
                low, high = metrics.bootstrap_ci(statistics[metric], n, n_boot=n_boot)
                out[metric] = [float(statistics[metric](np.arange(n))), low, high]
            return out

        self.progress(
            f"confirm: {family.name} at {point.budget:g} bits on {len(self.sequences)} held-out windows"
        )
        point.confirmed = self.steps.get(
            "confirm", {"family": asdict(family), "budget": point.budget}, measure
        )
        return point

    def meets(self, point: Candidate) -> bool:
        """Whether a point's proxy figures (a size: its compression) meet the target."""
        if self.target.metric == "compression":
            return point.compression >= self.target.value * (1 - 1e-9)
        return self.target.quality_met(point.proxy[self.target.metric])

    def search(self, family: Family) -> tuple[Candidate, list[Candidate]]:
        """The family's chosen point by bisection on the budget, and every point measured. A quality target: the
        smallest budget whose proxy meets it (else the widest budget, the closest); a size: the largest budget
        compressing enough (else the narrowest)."""
        quality = self.target.metric != "compression"
        low, high = family.budgets
        tried, best = [], None
        for _ in range(BISECTION_STEPS):
            mid = (low + high) / 2
            point = self.candidate(family, mid)
            tried.append(point)
            if self.meets(point):
                best = point
                low, high = (low, mid) if quality else (mid, high)
            else:
                low, high = (mid, high) if quality else (low, mid)
        if best is None:
            best = self.candidate(family, family.budgets[1] if quality else family.budgets[0])
            tried.append(best)
        return best, tried


def held_out_windows(
    tokenizer, sequences: int, tokens: int, seed: int = 0, bos: str = "auto"
) -> torch.Tensor:
    """n windows of the default corpus's evaluation split (never the calibration split), as the frontier cuts them."""
    return data.token_windows(
        tokenizer, data.split().evaluation, sequences, tokens, seed + 1, data.uses_bos(tokenizer, bos)
    )


@dataclass
class Advice:
    """The search's answer: the target, the chosen point (None: no family met it) or the closest point, whether it
    meets the target only within its interval, every confirmed point and every proxy point."""

    target: Target
    chosen: Candidate | None
    closest: Candidate | None
    within_interval_only: bool
    confirmed: list[Candidate]
    proxies: list[Candidate]
    allocation: Allocation | None = None
    family: Family | None = None

    def summary(self) -> dict:
        return {
            "target": asdict(self.target),
            "chosen": None if self.chosen is None else asdict(self.chosen),
            "closest": None if self.closest is None else asdict(self.closest),
            "within_interval_only": self.within_interval_only,
        }


def confirmed_meets(target: Target, point: Candidate) -> tuple[bool, bool]:
    """(meets at its point value, meets at its interval's far end) of a confirmed point."""
    if target.metric == "compression":
        return point.compression >= target.value * (1 - 1e-9), point.compression >= target.value * (1 - 1e-9)
    value, _, high = point.confirmed[target.metric]
    return target.quality_met(value), target.quality_met(high)


def choose(target: Target, confirmed: list[Candidate]) -> tuple[Candidate | None, Candidate | None, bool]:
    """(chosen, closest, within_interval_only) among confirmed points (module docstring)."""
    meeting = [p for p in confirmed if confirmed_meets(target, p)[0]]
    if target.metric == "compression":
        best = min(meeting, key=lambda p: p.confirmed["ppl_ratio"][0], default=None)
        closest = max(confirmed, key=lambda p: p.compression, default=None)
    else:
        best = max(meeting, key=lambda p: p.compression, default=None)
        closest = min(confirmed, key=lambda p: p.confirmed[target.metric][0], default=None)
    if best is None:
        return None, closest, False
    return best, best, not confirmed_meets(target, best)[1]


def _target(ppl_ratio, kl_mean, compression, context: int, backend: str) -> Target:
    """The one target given; ValueError (one line) unless exactly one is."""
    given = {
        k: v
        for k, v in (("ppl_ratio", ppl_ratio), ("kl_mean", kl_mean), ("compression", compression))
        if v is not None
    }
    if len(given) != 1:
        raise ValueError(f"target: give exactly one of ppl_ratio, kl_mean, compression; got {len(given)}")
    ((metric, value),) = given.items()
    return Target(metric, value, context, backend)


def _confirmations(searcher: Searcher, family: Family, proxy_best: float, target: Target) -> list:
    """The family's held-out confirmations. A size: the proxy's choice and its neighbours a STEP either side. A
    quality: the proxy's choice first; met, a STEP below it too (the proxy may be cautious); missed (the proxy is
    measured on the windows its tables were fitted on, so it can promise too much), a STEP up at a time until one
    meets it, at most MAX_STEPS_UP, without confirming a budget below a missed one (quality grows with the budget)."""
    low, high = family.budgets
    if target.metric == "compression":
        budgets = [b for b in (proxy_best - STEP, proxy_best, proxy_best + STEP) if low <= b <= high]
        return [searcher.confirm(family, searcher.candidate(family, b)) for b in budgets]
    confirmed = [searcher.confirm(family, searcher.candidate(family, proxy_best))]
    if confirmed_meets(target, confirmed[0])[0]:
        below = round(proxy_best - STEP, 4)
        if below >= low:
            confirmed.append(searcher.confirm(family, searcher.candidate(family, below)))
        return confirmed
    for steps_up in range(1, MAX_STEPS_UP + 1):
        up = round(proxy_best + STEP * steps_up, 4)
        if up > high:
            break
        confirmed.append(searcher.confirm(family, searcher.candidate(family, up)))
        if confirmed_meets(target, confirmed[-1])[0]:
            break
    return confirmed


def advise(
    model,
    tokenizer,
    run_dir: str | Path,
    *,
    ppl_ratio: float | None = None,
    kl_mean: float | None = None,
    compression: float | None = None,
    context: int = 4096,
    backend: str = "auto",
    model_name: str | None = None,
    families: tuple[Family, ...] = FAMILIES,
    sequences: int = 16,
    tokens: int = 1024,
    calibration_sequences: int = 8,
    calibration_tokens: int = 512,
    progress: Callable[[str], None] = print,
) -> Advice:
    """The search of the module docstring for `model` (in eval mode): the smallest cache whose ppl_ratio (or
    kl_mean) stays at most the value given, or with `compression`, the best quality at least that compressed, at one
    sequence of `context` tokens, over the families `backend` allows (auto, triton); its steps in run_dir/steps.

    model_name: the name its calibration measurements are cached under (a registry name shares a sweep's cached
    tables; None: the model's type and a digest of its weights, as harness.calibration names it). The confirmation
    reads `sequences` held-out windows of `tokens` tokens (the frontier's n = 16 x 1024 by default)."""
    target = _target(ppl_ratio, kl_mean, compression, context, backend)
    chosen_families = target.families(families)
    if not chosen_families:
        raise ValueError(f"target.backend: {target.backend} leaves no family; allowed: {', '.join(BACKENDS)}")
    ids = data.token_windows(
        tokenizer,
        data.split().calibration,
        calibration_sequences,
        calibration_tokens,
        0,
        data.uses_bos(tokenizer),
    )
    if model_name is None:
        from harness.api import calibration as make_calibration

        calibration = make_calibration(model, ids=ids)
    else:
        calibration = Calibration(model_name, ids, cached_head_entropies(model, model_name, ids, i0=32))
    identity = {"model": calibration.name, "target": asdict(target), "sequences": sequences, "tokens": tokens}
    searcher = Searcher(
        model, calibration, held_out_windows(tokenizer, sequences, tokens), target,
        Steps(run_dir, identity), progress,
    )  # fmt: skip
    by_name = {f.name: f for f in chosen_families}
    proxies, confirmed = [], []
    for family in chosen_families:
        best, tried = searcher.search(family)
        proxies += tried
        confirmed += _confirmations(searcher, family, best.budget, target)
    chosen, closest, within = choose(target, confirmed)
    advice = Advice(target, chosen, closest, within, confirmed, proxies)
    if chosen is not None:
        advice.family = by_name[chosen.family]
        advice.allocation = searcher.allocation(advice.family, chosen.budget)
    progress(f"{searcher.steps.computed} steps measured in this process")
    return advice
