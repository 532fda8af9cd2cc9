"""Passkey retrieval through a quantized KV cache: a random 5-digit key hidden at a depth of repetitive filler,
a question, a few greedy tokens, exact match of the key. `python -m harness.passkey --help`.

This module owns the prompts, the scorer and the run loop (points and resume: harness.run.records); the page of
a run is harness/report/passkey.py's.
- Prompt (exactly `context` tokens): special tokens the tokenizer adds, an instruction, filler, the needle
  ("The pass key is 12345. Remember it. 12345 is the pass key."), filler, the question ("What is the pass key?
  The pass key is"). round(depth * n_filler) filler tokens precede the needle. Pieces are tokenized apart and
  joined as token ids, so the length is exact for any tokenizer.
- Haystack (`haystack`): `repeat` (default) is the filler above, the same in every trial, so a depth's trials
  differ only in their keys' digits and tend to pass or fail together. So that trials are different documents,
  each trial's filler can be a run of its own (drawn with haystack_seed) that the needles cut: `shuffled`, the
  filler's five sentences in an order of their own each round; `text`, a window of the evaluation split of the
  default text (harness.data.split: never calibration text) at an offset of its own.
- Multi-key (`needles` N > 1): N needles of different keys, each naming its box ("The pass key of the red box
  is 12345. ..."), the question asking for the first box's ("What is the pass key of the red box? ..."); the asked
  needle sits at `depth`, the others at depth + j / N (mod 1), j = 1..N-1, so every depth has N - 1 distractors.
- Score: the first run of digits in the decoded answer equals the (asked) key.
- Policies: conf/policy/<name>.yaml (allocated by harness.policies on the model's calibration entropies, made
  as harness/run/measure.py makes them) at each budget, plus the unquantized baseline (a DynamicCache); and
  allocation files (`--allocations`: harness.load_allocation's, e.g. a frontier point `python -m harness.export`
  wrote), each with its own scheme and the parts that scheme fits, fitted on the same calibration windows (cached on
  disk as a sweep's are); such a point is named by the file's stem and a digest of its contents.
- prefill=exact (default): per batch of trials ONE full-precision chunked prefill of everything before the
  question, shared by every policy and budget; each quantized cache is QuantizedKVCache.from_prefilled of it, and
  the question and the answer tokens then read the document through the quantized cache.
  prefill=quantized: every policy prefills the whole prompt itself through its quantized cache (quantize-on-write;
  no sharing, one prefill per policy and budget).
- A scheme that predicts each layer from the layer below's reconstruction (Scheme.reads_previous_layer: xlayer)
  runs simulated (its cache keeps a full-precision working copy, as quant.simulate's sweeps do; the record says
  `simulate`); prefill=exact cannot convert a document that a sliding-window layer has already partly dropped
  (harness.cache.cannot_convert), so such a point is refused in one line before any prefill.
Results: results/passkey/<run>/points/<model>__c<context>__d<depth>__<policy>__b<budget>__<settings hash>.json,
one per point, written atomically once all its trials are done; a point whose file exists is skipped, and a
(context, depth) whose points all exist costs no prefill. Until then results/passkey/<run>/partial/ keeps each
point's answers so far, rewritten after each batch of trials, so a run stopped inside a (context, depth) resumes
at the batch (prefills only for the batches some point has not answered; the record's resumed_trials says how
many trials it read back).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import DynamicCache

from harness import data, io, precision
from harness.allocation_file import load_allocation
from harness.attention import PACKED, installed
from harness.cache import PREFILL_MODES, QuantizedKVCache
from harness.calibrate import cached_fit, cached_head_entropies
from harness.capacity import element_price, shape_from_config
from harness.config import compose, group_options
from harness.data import BOS_RULES, uses_bos
from harness.models import load_model, model_spec
from harness.policies import BUDGET_UNITS, Allocation, from_point
from harness.registry import unknown_name_message
from harness.report.passkey import BASELINE, write_report
from harness.run.records import PointLog
from harness.schemes import Scheme, get_scheme
from kernels.layout import FULL_WIDTH

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
# multi-key prompts: needle j names box BOXES[j]; the question asks for BOXES[0]'s
BOX_NEEDLE = " The pass key of the {box} box is {key}. Remember it. {key} is the pass key of the {box} box."
BOX_QUESTION = " What is the pass key of the {box} box? The pass key of the {box} box is"
BOXES = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")


# ------------------------------------------------------------------------------------------------ prompts


@dataclass(frozen=True)
class PasskeyPrompt:
    ids: torch.Tensor  # (context,) int64
    key: str
    needle_start: int  # token index where the needle begins
    question_tokens: int  # the last question_tokens ids are the question


def check_needles(needles) -> None:
    """ValueError naming passkey.needles unless it is a count of needles the prompts can name (one box each)."""
    if isinstance(needles, bool) or not isinstance(needles, int) or not 1 <= needles <= len(BOXES):
        raise ValueError(f"passkey.needles: {needles!r}; allowed: an integer in [1, {len(BOXES)}]")


HAYSTACKS = ("repeat", "shuffled", "text")  # module docstring


def check_haystack(haystack) -> None:
    """ValueError naming passkey.haystack unless it is one of HAYSTACKS."""
    if haystack not in HAYSTACKS:
        raise ValueError(f"passkey.haystack: unknown {haystack!r}; allowed: {', '.join(HAYSTACKS)}")


class PromptBuilder:
    """Passkey prompts of an exact token length for one tokenizer (the fixed pieces are tokenized once)."""

    def __init__(self, tokenizer, bos: bool = False, needles: int = 1, haystack: str = "repeat"):
        check_needles(needles)
        check_haystack(haystack)
        self.tokenizer = tokenizer
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        self.encode = encode
        self.needles = needles
        self.head = [tokenizer.bos_token_id] * bos + encode(INSTRUCTION)
        self.question = encode(QUESTION if needles == 1 else BOX_QUESTION.format(box=BOXES[0]))
        self.sentence = encode(FILLER)
        self.filler: list[int] = []
        self.haystack = haystack
        self.text = (
            data.text_ids(tokenizer, data.split(None).evaluation).tolist() if haystack == "text" else []
        )
        self.sentences = [encode(piece) for piece in re.findall(r" [^.]*\.", FILLER)]  # shuffled's pieces

    def _filler(self, n: int) -> list[int]:
        while len(self.filler) < n:  # tokenized in sentence-sized pieces, so any prefix is a valid filler
            self.filler += self.sentence
        return self.filler[:n]

    def _needle(self, j: int, key: str) -> list[int]:
        """Needle j's tokens: the single needle's, or box j's."""
        return self.encode(
            NEEDLE.format(key=key) if self.needles == 1 else BOX_NEEDLE.format(box=BOXES[j], key=key)
        )

    def minimum_context(self, key: str = "99999") -> int:
        needles = sum(len(self._needle(j, key)) for j in range(self.needles))
        return len(self.head) + needles + len(self.question)

    def _stream(self, n: int, seed: int) -> list[int]:
        """One trial's n filler tokens, which its needles cut: `shuffled`, the filler's sentences, each round of
        them in an order of its own drawn with `seed`; `text`, the evaluation text's n tokens from an offset
        `seed` picks."""
        if self.haystack == "shuffled":
            rng, out = random.Random(seed), []
            while len(out) < n:
                for i in rng.sample(range(len(self.sentences)), len(self.sentences)):
                    out += self.sentences[i]
            return out[:n]
        if n > len(self.text):
            raise ValueError(
                f"passkey.haystack: text holds {len(self.text)} tokens, fewer than the {n} asked for"
            )
        start = seed % (len(self.text) - n + 1)
        return self.text[start : start + n]

    def build(self, context: int, depth: float, keys: str | list[str], seed: int = 0) -> PasskeyPrompt:
        """The prompt of `context` tokens asking for keys[0] (a key alone: one needle) hidden at `depth`, the other
        keys' needles at depth + j / N (mod 1); `seed` draws a shuffled or text haystack (haystack_seed)."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        if len(keys) != self.needles:
            raise ValueError(f"{len(keys)} keys for a prompt of {self.needles} needles")
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"passkey.depths: {depth} is outside [0, 1]")
        needles = [self._needle(j, key) for j, key in enumerate(keys)]
        n_filler = context - len(self.head) - sum(map(len, needles)) - len(self.question)
        if n_filler < 0:
            raise ValueError(
                f"passkey.contexts: {context} tokens cannot hold the prompt; the minimum is {context - n_filler}"
            )
        depths = [depth] + [(depth + j / self.needles) % 1.0 for j in range(1, self.needles)]
        # (filler tokens before it, needle j), in document order (ties: the asked needle first)
        placed = sorted((round(d * n_filler), j) for j, d in enumerate(depths))
        if self.haystack == "repeat":  # each gap a filler of its own length, from the filler's start
            gap = lambda a, b: self._filler(b - a)  # noqa: E731
        else:  # the trial's own run of filler, which the needles cut
            stream = self._stream(n_filler, seed)
            gap = lambda a, b: stream[a:b]  # noqa: E731
        ids, used, asked_start = list(self.head), 0, 0
        for before, j in placed:
            ids += gap(used, before)
            used = before
            asked_start = len(ids) if j == 0 else asked_start
            ids += needles[j]
        ids += gap(used, n_filler) + self.question
        return PasskeyPrompt(torch.tensor(ids, dtype=torch.long), keys[0], asked_start, len(self.question))


def trial_key(seed: int, model: str, context: int, depth: float, trial: int, needle: int = 0) -> str:
    """The 5-digit key of one trial's needle: the same for every policy and budget, independent of run order."""
    tail = f"|{needle}" if needle else ""  # needle 0 keeps the key single-needle runs have always had
    digest = hashlib.sha256(f"{seed}|{model}|{context}|{depth:g}|{trial}{tail}".encode()).digest()
    return str(10000 + int.from_bytes(digest[:8], "little") % 90000)


def haystack_seed(seed: int, model: str, context: int, depth: float, trial: int) -> int:
    """The seed of one trial's own haystack (PromptBuilder.build): the same for every policy and budget."""
    digest = hashlib.sha256(f"{seed}|{model}|{context}|{depth:g}|{trial}|haystack".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def trial_keys(seed: int, model: str, context: int, depth: float, trial: int, needles: int) -> list[str]:
    """The keys of one trial's needles, the asked one first, all different."""
    keys: list[str] = []
    j = 0
    while len(keys) < needles:
        key = trial_key(seed, model, context, depth, trial, j)
        keys += [] if key in keys else [key]
        j += 1
    return keys


def extract_answer(text: str) -> str | None:
    """The first run of digits in a decoded answer, or None."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def score(text: str, key: str) -> bool:
    """Exact match: the answer's first number is the key (a longer or shorter number is wrong)."""
    return extract_answer(text) == key


# --------------------------------------------------------------------------------------------- decoding


def _forward(model, ids: torch.Tensor, start: int, cache) -> torch.Tensor:
    """Last-position logits (B, V) of ids (B, L) at positions start..start+L-1, through cache."""
    positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)  # (B, L)
    out = model(
        input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1
    )
    return out.logits[:, -1]


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache, chunk: int, start: int = 0) -> torch.Tensor:
    """Feed ids (B, L) into cache in chunks of `chunk` tokens (bounded attention memory); last logits (B, V)."""
    logits = None
    for s in range(0, ids.shape[1], chunk):
        logits = _forward(model, ids[:, s : s + chunk], start + s, cache)
    return logits


@torch.no_grad()
def answer(model, cache, question: torch.Tensor, start: int, new_tokens: int) -> torch.Tensor:
    """Greedy answer tokens (B, new_tokens): the question (B, q) at `start` through cache, then single steps."""
    tokens = [_forward(model, question, start, cache).argmax(-1)]  # new_tokens x (B,)
    for step in range(1, new_tokens):
        tokens.append(
            _forward(model, tokens[-1][:, None], start + question.shape[1] + step - 1, cache).argmax(-1)
        )
    return torch.stack(tokens, 1)


def answer_from_prefilled(
    model,
    document_cache,
    question: torch.Tensor,
    start: int,
    new_tokens: int,
    bits=None,
    scheme="asym_token",
    key_calibration=None,
    simulate: bool = False,
):
    """prefill=exact: answer tokens (B, M) and the cache read, from a full-precision DynamicCache of the document.

    bits None: the baseline (a copy of the DynamicCache); else QuantizedKVCache.from_prefilled at `bits` (an
    Allocation, or the widths QuantizedKVCache takes) in `scheme` (a Scheme or its name), reading the parts the
    scheme fits (`key_calibration`: harness.calibrate.cached_fit's), with a working copy if `simulate`.
    """
    if bits is None:
        cache = copy.deepcopy(document_cache)
    else:
        cache = QuantizedKVCache.from_prefilled(
            document_cache, model.config, bits, scheme, prefill="exact", key_calibration=key_calibration,
            simulate=simulate,
        )  # fmt: skip
    return answer(model, cache, question, start, new_tokens), cache


# ------------------------------------------------------------------------------------------------ points


@dataclass(frozen=True)
class Settings:
    """Everything besides (model, context, depth, policy, budget) that can change an answer."""

    trials: int = 20
    seed: int = 0
    scheme: str = "asym_token"
    group_size: int = 32
    prefill: str = "exact"
    new_tokens: int = 8
    chunk: int = 1024
    calibration_sequences: int = 8
    calibration_tokens: int = 512
    i0: int = 32
    bos: str = "auto"  # eval.bos: every prompt and calibration window starts with BOS (harness.data.uses_bos)
    budget_unit: str = "bytes"  # policy.budget_unit of every policy (harness.policies)
    dtype: str = "float32"  # the model's, resolved (harness/precision.py)
    needles: int = 1  # keys hidden in each prompt, one asked for (module docstring: multi-key)
    haystack: str = "repeat"  # HAYSTACKS (module docstring)

    def __post_init__(self):
        if self.bos not in BOS_RULES:
            raise ValueError(f"passkey.bos: unknown {self.bos!r}; allowed: {', '.join(BOS_RULES)}")
        if self.budget_unit not in BUDGET_UNITS:
            raise ValueError(
                f"passkey.budget_unit: unknown {self.budget_unit!r}; allowed: {', '.join(BUDGET_UNITS)}"
            )
        if self.dtype not in precision.DTYPES:
            raise ValueError(f"passkey.dtype: unknown {self.dtype!r}; allowed: {', '.join(precision.DTYPES)}")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(
                f"passkey.prefill: unknown {self.prefill!r}; allowed: {', '.join(PREFILL_MODES)}"
            )
        for key in (
            "trials",
            "group_size",
            "new_tokens",
            "chunk",
            "calibration_sequences",
            "calibration_tokens",
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"passkey.{key}: {value!r} is not a positive integer")
        check_needles(self.needles)
        check_haystack(self.haystack)

    def digest(self) -> str:
        """A hash of the settings; a float32 dtype, a single needle and the repeated filler are left out, so points
        made before they were recorded keep their names."""
        fields = {k: v for k, v in self.__dict__.items() if UNRECORDED_DEFAULTS.get(k, object()) != v}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:8]


# Settings fields out of the digest at these values
UNRECORDED_DEFAULTS = {"dtype": "float32", "needles": 1, "haystack": "repeat"}


def point_name(model: str, context: int, depth: float, policy: str, budget: float, settings: Settings) -> str:
    return f"{model}__c{context}__d{depth:g}__{policy}__b{budget:g}__{settings.digest()}"


def policy_config(name: str) -> dict:
    """conf/policy/<name>.yaml as the primary config composes it (defaults included), as a plain dict."""
    names = group_options("policy")
    if name not in names:
        raise ValueError(unknown_name_message("passkey.policies", name, names))
    return OmegaConf.to_container(compose([f"policy={name}"]).policy, resolve=True)


def policy_point(config: dict, seed: int, budget_unit: str) -> dict:
    """A conf/policy config as a grid point's policy fields (harness.policies.from_point), with the passkey's own
    seed (the random control's draw) and budget unit."""
    return {**config, "policy": config["name"], "policy_seed": seed, "budget_unit": budget_unit}


def allocations(
    entropy, policies: list[str], budgets: list[float], seed: int, budget_unit: str = "bits", price=None
) -> dict[tuple[str, float], object]:
    """(policy, budget) -> harness.policies.Allocation, or the ValueError text of an infeasible budget.

    `price`: the scheme's bytes per element at each width, for `budget_unit="bytes"` (harness.policies)."""
    out = {}
    for name in policies:
        point = policy_point(policy_config(name), seed, budget_unit)
        for budget in budgets:
            try:
                out[(name, budget)] = from_point(point).allocate(entropy, budget, price=price)
            except ValueError as err:
                out[(name, budget)] = str(err)
    return out


def calibration_windows(tokenizer, settings: Settings) -> torch.Tensor:
    """The calibration windows (C, T) int64 of the default text's calibration split, as a sweep cuts them."""
    return data.token_windows(
        tokenizer, data.split(None).calibration, settings.calibration_sequences, settings.calibration_tokens,
        settings.seed, bos=data.uses_bos(tokenizer, settings.bos),
    )  # fmt: skip


def calibration_entropy(model, tokenizer, name: str, settings: Settings):
    """The model's per-head entropies from the calibration split, as harness.run.context.build_context makes them."""
    return cached_head_entropies(model, name, calibration_windows(tokenizer, settings), i0=settings.i0)


@dataclass(frozen=True)
class AllocationFile:
    """A cache read from an allocation file (harness.load_allocation): the policy name of its points (the file's
    stem and a digest of its bytes), its allocation and scheme."""

    path: str
    name: str
    allocation: Allocation
    scheme: Scheme

    @property
    def budget(self) -> float:
        """What its points' names and records give as the budget: the allocation's mean bits."""
        return float(self.allocation.mean_bits)


def allocation_file(path: str) -> AllocationFile:
    """The AllocationFile at `path`; ValueError (one line, naming passkey.allocations and the path) if unreadable."""
    try:
        allocation, scheme = load_allocation(path)
    except ValueError as err:
        raise ValueError(f"passkey.allocations: {str(err).splitlines()[0]}") from None
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:8]
    return AllocationFile(str(path), f"{Path(path).stem}-{digest}", allocation, scheme)


# ------------------------------------------------------------------------------------------------- run


@dataclass
class Job:
    """What one model's run evaluates."""

    model: str
    contexts: list[int]
    depths: list[float]
    policies: list[str]
    budgets: list[float]
    settings: Settings
    batch_size: int = 4
    files: tuple[AllocationFile, ...] = ()  # allocation files, each its own (policy, budget) point


def _pending(job: Job, log: PointLog, context: int, depth: float) -> list[tuple[str, float]]:
    wanted = [(BASELINE, FULL_WIDTH)] + [(p, b) for p in job.policies for b in job.budgets]
    wanted += [(f.name, f.budget) for f in job.files]
    return [pb for pb in wanted if not log.done(point_name(job.model, context, depth, *pb, job.settings))]


@dataclass(frozen=True)
class Storage:
    """How a (policy, budget) stores its cache: the scheme, the parts it fitted, and what its record's config says
    of them beside the settings (an allocation file's path and scheme)."""

    scheme: Scheme
    fitted: object = None
    config: tuple = ()

    @property
    def simulate(self) -> bool:
        """Whether its cache keeps a working copy: only a scheme that reads the layer below's reconstruction."""
        return self.scheme.reads_previous_layer


def check_convertible(job: Job, shape, schemes: list[Scheme], document: int) -> None:
    """ValueError (one line) where prefill=exact would hand a scheme that reads the layer below's reconstruction a
    `document` (the longest prompt's tokens before its question) that a sliding-window layer of `shape`
    (harness.capacity's) has partly dropped: a sliding layer holds window - 1 tokens."""
    if job.settings.prefill != "exact":
        return
    windows = [layer.window for layer in shape.layers if layer.kind == "sliding"]
    for scheme in schemes:
        if scheme.reads_previous_layer and windows and document > min(windows) - 1:
            raise ValueError(
                f"passkey.prefill: exact cannot convert a {document}-token document for {scheme.name}, "
                f"which predicts each layer from the layer below's, once {job.model}'s sliding window of "
                f"{min(windows)} tokens has dropped part of it; allowed: quantized"
            )


@dataclass
class _Progress:
    """One pending (policy, budget)'s answers so far at one (context, depth): the answer tokens of its first
    len(rows) trials, the true and fp16 bytes of the caches they read, seconds answering and in the shared
    prefills they read, and how many of the rows a stopped run left in the partial this one resumed from."""

    rows: list  # trials x new_tokens token ids
    held: list  # [true bytes, fp16 bytes]
    answer_s: float = 0.0
    prefill_s: float = 0.0
    resumed_trials: int = 0

    @classmethod
    def resume(cls, partial: dict | None) -> _Progress:
        """From a point's partial (harness.run.records.PointLog.read_partial), or from nothing."""
        if partial is None:
            return cls([], [0, 0])
        return cls(
            partial["rows"], partial["held"], partial["answer_s"], partial["prefill_s"], len(partial["rows"])
        )

    def add(self, tokens: torch.Tensor, first: int, cache, answer_s: float, prefill_s: float) -> None:
        """A batch's answer tokens (B, new_tokens) to trials first .. first + B - 1, the quantized cache they read
        (None for the baseline) and the seconds spent; the trials it already has are left out (a run resumed at
        another batch size)."""
        skip = len(self.rows) - first
        self.rows += tokens[skip:].tolist()
        self.answer_s += answer_s
        self.prefill_s += prefill_s
        if cache is not None:  # every trial's cache holds the same bytes (one context): count the kept ones
            kept, batch = tokens.shape[0] - skip, tokens.shape[0]
            self.held = [
                self.held[0] + cache.nbytes() * kept // batch,
                self.held[1] + cache.nbytes_fp16() * kept // batch,
            ]

    def partial(self, provenance: dict) -> dict:
        """What PointLog.write_partial keeps of it (the process's provenance beside it)."""
        fields = ("rows", "held", "answer_s", "prefill_s")
        return {**{k: getattr(self, k) for k in fields}, "provenance": provenance}


def _answer_batch(model, job: Job, alloc, store: Storage | None, document: torch.Tensor, question: torch.Tensor,
                  shared: DynamicCache | None) -> tuple[torch.Tensor, object]:  # fmt: skip
    """One (policy, budget)'s answer tokens (B, new_tokens) to one batch and the cache they read: from `shared`,
    the document's full-precision prefill (prefill=exact, and the baseline), or through its own quantized
    prefill of `document` (B, L) (prefill=quantized)."""
    s, start = job.settings, document.shape[1]
    if alloc is None:
        return answer_from_prefilled(model, shared, question, start, s.new_tokens)
    if s.prefill == "exact":
        return answer_from_prefilled(
            model, shared, question, start, s.new_tokens, alloc, store.scheme, store.fitted, store.simulate
        )
    cache = QuantizedKVCache(
        model.config, alloc, store.scheme, prefill="quantized", key_calibration=store.fitted,
        simulate=store.simulate,
    )  # fmt: skip
    prefill(model, document, cache, s.chunk)
    return answer(model, cache, question, start, s.new_tokens), cache


def _answer_all(model, job: Job, prompts: list, names: dict, allocs: dict, storage: dict, log: PointLog,
                progress=print, provenance: dict | None = None) -> dict:  # fmt: skip
    """Every feasible (policy, budget) of `names` (-> its point name) answers every prompt it has not answered,
    batch by batch, from one full-precision prefill of each batch's document (prefill=exact; skipped where no
    point needs the batch) or through its own quantized prefill (prefill=quantized); each point's partial is
    rewritten after each batch, so a stopped run resumes at the batch. -> (policy, budget) -> _Progress."""
    s = job.settings
    feasible = [pb for pb in names if not isinstance(allocs.get(pb), str)]  # the caller records the others
    done = {pb: _Progress.resume(log.read_partial(names[pb])) for pb in feasible}
    context = prompts[0].ids.shape[-1]
    for first in range(0, s.trials, job.batch_size):
        end = min(first + job.batch_size, s.trials)
        answering = [pb for pb, p in done.items() if len(p.rows) < end]
        if not answering:
            continue  # every point read these trials before it was stopped
        ids = torch.stack([p.ids for p in prompts[first:end]])  # (B, context)
        q = prompts[first].question_tokens
        document, question = ids[:, : context - q], ids[:, context - q :]
        t0 = time.perf_counter()
        shared = DynamicCache(config=model.config)
        if s.prefill == "exact" or BASELINE in (pb[0] for pb in answering):
            prefill(model, document, shared, s.chunk)
        prefill_s = time.perf_counter() - t0
        for pb in answering:
            alloc = None if pb[0] == BASELINE else allocs[pb]
            t0 = time.perf_counter()
            tokens, cache = _answer_batch(model, job, alloc, storage.get(pb), document, question, shared)
            done[pb].add(tokens, first, None if alloc is None else cache, time.perf_counter() - t0, prefill_s)
            log.write_partial(names[pb], done[pb].partial(provenance or {}))
        progress(f"{job.model} context {context}: trials {end} / {s.trials} answered")
    return done


def _record(
    job: Job,
    where: tuple[int, float],
    pb: tuple,
    alloc,
    prompts: list,
    answers: _Progress | None,
    tokenizer,
    provenance,
    storage: Storage | None = None,
) -> dict:
    """One point's record at (context, depth) `where`: its configuration and provenance, and its accuracy with
    every answer, or why it is infeasible (`answers` None)."""
    s = job.settings
    context, depth = where
    config = dict(model=job.model, context=context, depth=depth, policy=pb[0], budget=pb[1], **s.__dict__)
    config.update(storage.config if storage is not None else ())
    if storage is not None and storage.simulate:
        config["simulate"] = True
    record = {"key": point_name(job.model, context, depth, *pb, s), "config": config, **provenance}
    if isinstance(alloc, str):
        return {**record, "status": "infeasible", "error": alloc}
    texts = [tokenizer.decode(row) for row in answers.rows]
    correct = [score(text, p.key) for text, p in zip(texts, prompts)]
    resumed = {"resumed_trials": answers.resumed_trials} if answers.resumed_trials else {}
    return {
        **record,
        **resumed,
        "status": "ok",
        "accuracy": sum(correct) / len(correct),
        "correct": correct,
        "keys": [p.key for p in prompts],
        "answers": texts,
        "needle_starts": [p.needle_start for p in prompts],
        "mean_bits": float(FULL_WIDTH) if alloc is None else alloc.mean_bits,
        "compression_nominal": 1.0 if alloc is None else FULL_WIDTH / alloc.mean_bits,
        "compression_true": 1.0 if alloc is None else answers.held[1] / answers.held[0],
        "answer_s": answers.answer_s,
        "shared_prefill_s": answers.prefill_s,
    }


def run_model(job: Job, run_dir: Path, progress=print, provenance: dict | None = None) -> int:
    """Evaluate every missing point of `job` into run_dir/points; returns the number of points written.

    `provenance` (harness.io.provenance: thread count, commit) is recorded in every point, outside its name.
    """
    log = PointLog(run_dir)
    todo = [(c, d) for c in job.contexts for d in job.depths if _pending(job, log, c, d)]
    if not todo:
        return 0
    model, tokenizer = load_model(job.model, dtype=job.settings.dtype)
    s = job.settings
    builder = PromptBuilder(tokenizer, bos=uses_bos(tokenizer, s.bos), needles=s.needles, haystack=s.haystack)
    scheme = get_scheme(s.scheme, s.group_size)
    shape = shape_from_config(model.config, job.model)
    price = element_price(shape, scheme)
    entropy = calibration_entropy(model, tokenizer, job.model, s)
    allocs = allocations(entropy, job.policies, job.budgets, s.seed, s.budget_unit, price)
    storage = {pb: Storage(scheme) for pb in allocs}
    longest = max(job.contexts)  # before any fit: the points prefill=exact cannot convert are refused
    keys = trial_keys(s.seed, job.model, longest, job.depths[0], 0, s.needles)
    question = builder.build(longest, job.depths[0], keys).question_tokens
    schemes = [scheme] * bool(job.policies) + [f.scheme for f in job.files]
    check_convertible(job, shape, schemes, longest - question)
    calib_ids = calibration_windows(tokenizer, s)
    for f in (
        job.files
    ):  # each with the parts its scheme fits, on the same windows, for positions up to the longest
        pb = (f.name, f.budget)
        allocs[pb] = f.allocation
        fitted = cached_fit(f.scheme, model, job.model, calib_ids, max(job.contexts), f.scheme.key_levels)
        storage[pb] = Storage(f.scheme, fitted, (("scheme", f.scheme.label()), ("allocation_file", f.path)))
    written = 0
    with installed(model, PACKED):  # the quantized caches are attended from their packed form
        for context, depth in todo:
            pending = _pending(job, log, context, depth)
            prompts = [
                builder.build(
                    context,
                    depth,
                    trial_keys(s.seed, job.model, context, depth, t, s.needles),
                    haystack_seed(s.seed, job.model, context, depth, t),
                )  # fmt: skip
                for t in range(s.trials)
            ]
            names = {pb: point_name(job.model, context, depth, *pb, s) for pb in pending}
            answers = _answer_all(model, job, prompts, names, allocs, storage, log, progress, provenance)
            for pb in pending:
                alloc = None if pb[0] == BASELINE else allocs[pb]
                where = (context, depth)
                record = _record(
                    job,
                    where,
                    pb,
                    alloc,
                    prompts,
                    answers.get(pb),
                    tokenizer,
                    provenance or {},
                    storage.get(pb),
                )
                log.write(record["key"], record)
                written += 1
            progress(f"{job.model} context {context} depth {depth:g}: {len(pending)} points written")
    return written


# ---------------------------------------------------------------------------------------------------- CLI


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.passkey", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m"])
    p.add_argument(
        "--contexts", type=int, nargs="+", help="prompt tokens; default 1024, 2048, ... up to the limit"
    )
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    p.add_argument("--trials", type=int, default=20, help="trials per (context, depth)")
    p.add_argument("--policies", nargs="*", default=["uniform", "entropy"], help="names from conf/policy")
    p.add_argument(
        "--allocations",
        nargs="*",
        default=[],
        help="allocation files (python -m harness.export), each a point",
    )
    p.add_argument("--needles", type=int, default=1, help="keys hidden per prompt, one asked for (multi-key)")
    p.add_argument(
        "--haystack", default="repeat", help=f"one of {', '.join(HAYSTACKS)}: the filler (module doc)"
    )
    p.add_argument("--budgets", type=float, nargs="+", default=[2, 3, 4])
    p.add_argument("--scheme", default="asym_token")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--prefill", default="exact", help=f"one of {', '.join(PREFILL_MODES)}")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy answer tokens")
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk in tokens")
    p.add_argument("--batch", type=int, default=4, help="trials per prefill batch")
    p.add_argument("--calibration-sequences", type=int, default=8)
    p.add_argument("--calibration-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bos", default="auto", help="auto, always or never: BOS before every prompt (eval.bos)")
    p.add_argument("--budget-unit", default="bytes", help="bytes (true bytes, default) or bits")
    io.add_run_arguments(p)
    p.add_argument(
        "--dtype", default=precision.DEFAULT, help=f"model dtype: {', '.join(precision.dtype_names())}"
    )
    p.add_argument("--run", default="default", help="results/passkey/<run>/; re-running the same run resumes")
    p.add_argument("--root", default="results/passkey")
    p.add_argument(
        "--report-only", action="store_true", help="rebuild tables.md and the plot, evaluate nothing"
    )
    return p


def default_contexts(model: str) -> list[int]:
    limit = model_spec(model).get("context_limit", 2048)
    return [1024 * 2**i for i in range(16) if 1024 * 2**i <= limit]


def jobs(args) -> list[Job]:
    """The validated jobs of the command line (ValueError naming the option for bad input)."""
    settings = Settings(
        args.trials, args.seed, args.scheme, args.group_size, args.prefill, args.new_tokens, args.chunk,
        args.calibration_sequences, args.calibration_tokens, bos=args.bos, budget_unit=args.budget_unit,
        dtype=precision.resolve(args.dtype, key="passkey.dtype"), needles=args.needles, haystack=args.haystack,
    )  # fmt: skip
    files = tuple(allocation_file(path) for path in args.allocations)
    get_scheme(args.scheme, args.group_size)
    if args.batch < 1:
        raise ValueError(f"passkey.batch: {args.batch} is not a positive integer")
    if any(not 0 <= d <= 1 for d in args.depths):
        raise ValueError(f"passkey.depths: {args.depths}; allowed: numbers in [0, 1]")
    for name in args.policies:
        policy = from_point(policy_point(policy_config(name), args.seed, args.budget_unit))
        for budget in args.budgets:
            policy.check_budget(budget)
    out = []
    for model in args.models:
        limit = model_spec(model).get("context_limit", 2048)
        contexts = args.contexts or default_contexts(model)
        if max(contexts) > limit:
            raise ValueError(
                f"passkey.contexts: {max(contexts)} exceeds {model}'s context_limit of {limit} tokens"
            )
        out.append(
            Job(model, contexts, args.depths, args.policies, args.budgets, settings, args.batch, files)
        )
    return out


def record_command(run_dir: Path, command: str) -> None:
    """Add `command` to run_dir/commands.txt as its start begins (tables.md prints the file), so a start stopped
    before its end is on record too; a command already there (the same run resumed) is not written twice."""
    path = run_dir / "commands.txt"
    kept = path.read_text().splitlines() if path.exists() else []
    if command not in kept:
        io.write_text_atomic(path, "".join(line + "\n" for line in [*kept, command]))


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run_dir = Path(args.root) / args.run
    command = io.command_line("python -m harness.passkey", argv)
    try:
        io.check_plain_name(args.run, "--run")  # a folder of --root, never a way out of it
        todo = [] if args.report_only else jobs(args)
        if todo:  # before any model loads: threads applied, a clean tree for results/, env.json written
            io.set_threads(args.threads, key="--threads")
            io.check_writable(run_dir, key="--root / --run")
            io.check_clean(run_dir, args.allow_dirty, key="--allow-dirty")
        if todo:
            env = io.start_record(run_dir, command, "cpu", args.allow_dirty, todo[0].settings.dtype)
            record_command(run_dir, command)
            write_report(run_dir)  # tables.md lists this start's command even if it is stopped
        run_dir.mkdir(parents=True, exist_ok=True)
        for job in todo:
            t0 = time.perf_counter()
            n = run_model(job, run_dir, provenance=io.provenance(env))
            print(f"{job.model}: {n} points in {time.perf_counter() - t0:.1f} s")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    for path in write_report(run_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
