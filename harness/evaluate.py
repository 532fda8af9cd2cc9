"""Evaluation loops: run a model through a KV cache and collect what harness.metrics consumes.

This module owns the forward passes: greedy generation step by step through a cache, and teacher-forced
scoring fed chunk by chunk through a cache. It knows nothing about quantization: the cache comes from a
factory (a fresh cache per batch), so the same loop gives the baseline (DynamicCache) and a quantized run.

Every forward passes explicit position_ids (the count of tokens fed so far), so positions never depend on
what a cache reports as its length; the attention mask over cached tokens is the cache's business.
Models must be in eval mode (model.eval()): a model in training mode is refused, since dropout would make
runs differ for reasons other than the cache.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

CacheFactory = Callable[[], transformers.Cache]  # a fresh, empty cache per batch
# teacher-forced metrics: float32 log-probs scored at a time, positions x V. 16 MiB temporaries stay under glibc's
# largest mmap threshold (32 MiB), so they are reused from the heap; at 64 MiB each was fresh memory, page-faulted
# in every step, and scoring took 3.7x as long (4 x 128 positions of a 49152-token vocabulary, 1 thread).
SCORE_ELEMENTS = 1 << 22


@dataclass
class TeacherForced:
    """What one teacher-forced run produced over S sequences of T tokens (position t predicts token t+1).

    A baseline run (made without a baseline) keeps its full log-probs, stored in `logprobs_dtype` (float16 by
    default: (S, T-1, V) is the big one, V can be 150k). A run made against a baseline keeps no log-probs:
    it computes KL(p_base || p_this) per position while its own logits are in hand. nll and top1 are always
    computed from float32 log-probs.
    """

    targets: torch.Tensor  # (S, T-1) int64, tokens 1..T-1
    nll: torch.Tensor  # (S, T-1) float32, -log p(target)
    top1: torch.Tensor  # (S, T-1) int64, argmax of the prediction
    logprobs: torch.Tensor | None = None  # (S, T-1, V) logprobs_dtype, baseline runs only
    kl: torch.Tensor | None = None  # (S, T-1) float32 nats, runs made against a baseline only


def _check_eval(model: transformers.PreTrainedModel) -> None:
    if model.training:
        raise ValueError("put the model in eval mode (model.eval()) before evaluating it")


def _batches(n: int, batch_size: int) -> Iterator[slice]:
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


def _forward(
    model: transformers.PreTrainedModel,
    input_ids: torch.Tensor,
    start: int,
    cache: transformers.Cache,
    **kwargs,
) -> torch.Tensor:
    """Logits (B, L or kept, V) of input_ids (B, L) sitting at positions start..start+L-1, through cache."""
    batch, length = input_ids.shape
    positions = torch.arange(start, start + length, device=input_ids.device)  # (L,)
    out = model(
        input_ids=input_ids,
        position_ids=positions.expand(batch, length),  # (B, L)
        past_key_values=cache,
        use_cache=True,
        **kwargs,
    )
    return out.logits


@dataclass
class Prefilled:
    """One batch of prompts after a full-precision prefill: what every decode of that batch starts from."""

    rows: slice  # which prompts
    cache: transformers.DynamicCache  # the prompts' K/V (never mutated: decodes start from copies)
    first: torch.Tensor  # (B,) greedy first new token, from the prefill's last logits
    prompt_tokens: int

    @property
    def batch_size(self) -> int:
        return self.first.shape[0]


def dynamic_cache_factory(model: torch.nn.Module) -> CacheFactory:
    """Fresh unquantized caches for `model` (sliding-window layers keep their window)."""
    return lambda: transformers.DynamicCache(config=model.config)


def _prefill(model, prompts: torch.Tensor, cache: transformers.Cache) -> torch.Tensor:
    """Feed prompts (B, P) into cache; return the greedy first new token (B,)."""
    logits = _forward(model, prompts.to(model.device), 0, cache, logits_to_keep=1)  # (B, 1, V)
    return logits[:, -1].argmax(dim=-1)


def _add_time(clock: dict | None, stage: str, since: float) -> float:
    """Add the seconds since `since` to clock[stage] (when a clock is kept); return the time now."""
    now = time.perf_counter()
    if clock is not None:
        clock[stage] = clock.get(stage, 0.0) + now - since
    return now


def _decode(model, cache: transformers.Cache, first: torch.Tensor, prompt_tokens: int, new_tokens: int):
    """Greedy tokens (B, M) on CPU: `first`, then M - 1 single-token forwards through cache (the last is never fed)."""
    generated = [first]  # M x (B,)
    for step in range(1, new_tokens):
        logits = _forward(model, generated[-1][:, None], prompt_tokens + step - 1, cache)  # (B, 1, V)
        generated.append(logits[:, -1].argmax(dim=-1))
    return torch.stack(generated, dim=1).cpu()


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    new_tokens: int,
    cache_factory: CacheFactory,
    batch_size: int = 8,
) -> torch.Tensor:
    """Greedy continuations (N, M) int64 on CPU of prompts (N, P) int64, all of one length (no padding).

    Per batch: one prefill forward of the prompts into a fresh cache, then one forward per further new token
    (M - 1 of them; the last token is never fed). Ties go to torch.argmax. No stop token: always M tokens.
    """
    _check_eval(model)
    outputs = []
    for rows in _batches(prompts.shape[0], batch_size):
        cache = cache_factory()
        first = _prefill(model, prompts[rows], cache)
        outputs.append(_decode(model, cache, first, prompts.shape[1], new_tokens))
    return torch.cat(outputs)


@torch.no_grad()
def prefill(model: torch.nn.Module, prompts: torch.Tensor, batch_size: int = 8) -> list[Prefilled]:
    """Full-precision prefill of prompts (N, P) in batches, to be shared by every decode (prefill=exact)."""
    _check_eval(model)
    out = []
    for rows in _batches(prompts.shape[0], batch_size):
        cache = transformers.DynamicCache(config=model.config)
        out.append(Prefilled(rows, cache, _prefill(model, prompts[rows], cache), prompts.shape[1]))
    return out


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    prefilled: list[Prefilled],
    new_tokens: int,
    cache_from_prefilled: Callable[[transformers.Cache], transformers.Cache] | None = None,
    clock: dict | None = None,
) -> torch.Tensor:
    """Greedy continuations (N, M) from shared prefills: each batch decodes through
    `cache_from_prefilled(prefill cache)` (e.g. a quantized copy), or through a copy of the prefill cache itself
    when None (the unquantized baseline). Equals greedy_generate with prefill=exact caches.

    clock: where given, seconds are added to its `cache_s` (making each batch's cache from its prefill) and
    `steps_s` (the decode steps)."""
    outputs = []
    for p in prefilled:
        t = time.perf_counter()
        cache = copy.deepcopy(p.cache) if cache_from_prefilled is None else cache_from_prefilled(p.cache)
        t = _add_time(clock, "cache_s", t)
        outputs.append(_decode(model, cache, p.first, p.prompt_tokens, new_tokens))
        _add_time(clock, "steps_s", t)
    return torch.cat(outputs)


def file_tensor(path: str | Path, shape: tuple[int, ...], mode: str = "w+") -> torch.Tensor:
    """A float16 tensor of `shape` backed by the file at `path` (a memory map: its pages live on disk, not in the
    process's memory; a baseline's log-probs at long context, 16 windows scored over 4096 positions of a
    262,144-token vocabulary, are 34 GB). mode "w+" creates the file (or overwrites it); "r" maps an existing one
    read-only, to be read only (a write faults). Not copy-on-write: the kernel counts a private writable map's
    every page against memory and refuses one larger than the machine's."""
    array = np.memmap(path, dtype=np.float16, mode=mode, shape=shape)
    with warnings.catch_warnings():  # torch warns that it cannot write a read-only array; nothing writes it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def _kl(base_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p_base || p) (...) in nats from log-probs (..., V); both rounded to the baseline's storage dtype.

    Rounding this run's log-probs like the stored baseline makes a run against an identical baseline give
    exactly 0 instead of fp16 rounding noise; in float32 storage the rounding is a no-op. Computed in float32;
    rounding can leave tiny negative values, which are kept.
    """
    base = base_logprobs.float()  # (..., V)
    this = logprobs.to(base_logprobs.dtype).float()  # (..., V)
    p_base = base.exp()
    terms = torch.where(p_base > 0, p_base * (base - this), 0.0)  # (..., V)
    return terms.sum(dim=-1)


def _check_teacher_forced(model, sequences, baseline, logprobs_dtype, score_from, logprobs_file) -> None:
    """ValueError (one line) for teacher_forced's arguments that cannot go together."""
    if logprobs_file is not None and logprobs_dtype != torch.float16:
        raise ValueError(
            "logprobs_file: log-probs kept on disk are float16; pass logprobs_dtype=torch.float16"
        )
    _check_eval(model)
    if baseline is not None and baseline.logprobs is None:
        raise ValueError("baseline must be a run made without a baseline (one that kept its log-probs)")
    if not 0 <= score_from < sequences.shape[1]:
        raise ValueError(
            f"score_from: {score_from} must lie in [0, {sequences.shape[1]}) for {sequences.shape[1]} tokens"
        )


@torch.no_grad()
def teacher_forced(
    model: transformers.PreTrainedModel,
    sequences: torch.Tensor,
    cache_factory: CacheFactory,
    chunk: int = 128,
    batch_size: int = 1,
    baseline: TeacherForced | None = None,
    logprobs_dtype: torch.dtype = torch.float16,
    clock: dict | None = None,
    score_from: int = 0,
    logprobs_file: str | Path | None = None,
) -> TeacherForced:
    """Score sequences (S, T) int64 teacher-forced, fed in chunks of `chunk` tokens through a fresh cache per batch.

    Tokens 0..T-2 are fed (token T-1 is only a target). Without `baseline` the run keeps its log-probs in
    `logprobs_dtype` (it can be a baseline); with `baseline` (a run on the same sequences made without one)
    it keeps KL(p_baseline || p_this) per position instead. The device holds one chunk's logits at a time;
    results are on CPU.

    score_from: tokens before it are context only: the run scores the predictions of tokens score_from..T-1
    (every target, tokens 1..T-1, at 0 or 1), and its arrays hold those targets alone, (S, T - max(score_from, 1)).
    The context is fed through the same cache in the same chunks, without its logits (chunks wholly in it compute
    only their last position's), so the scored positions' figures equal those of a run scoring every target.

    logprobs_file: a baseline run keeps its log-probs (float16 only) in this file, created (file_tensor), not in
    memory.
    """
    _check_teacher_forced(model, sequences, baseline, logprobs_dtype, score_from, logprobs_file)
    sequences = sequences.cpu()
    skip = max(score_from, 1) - 1  # fed positions whose predictions are not scored
    targets = sequences[:, skip + 1 :]  # (S, T-1-skip): the scored targets
    if baseline is not None and not torch.equal(baseline.targets, targets):
        raise ValueError("baseline was made on different sequences")
    n_seq, n_pos = targets.shape
    nll = torch.empty(n_seq, n_pos)  # (S, n)
    top1 = torch.empty(n_seq, n_pos, dtype=torch.int64)  # (S, n)
    kl = None if baseline is None else torch.empty(n_seq, n_pos)  # (S, n)
    logprobs = None  # (S, n, V), allocated once V is known from the logits
    fed = sequences.shape[1] - 1

    for rows in _batches(n_seq, batch_size):
        t = time.perf_counter()
        cache = cache_factory()
        inputs = sequences[rows, :-1].to(model.device)  # (B, T-1)
        for start in range(0, fed, chunk):
            if start + chunk <= skip:  # context alone: its keys and values, no scores
                _forward(model, inputs[:, start : start + chunk], start, cache, logits_to_keep=1)
                t = _add_time(clock, "forward_s", t)
                continue
            logits = _forward(model, inputs[:, start : start + chunk], start, cache)  # (B, L, V)
            t = _add_time(clock, "forward_s", t)
            B, L, V = logits.shape
            if baseline is None and logprobs is None:
                shape = (n_seq, n_pos, V)
                if logprobs_file is None:
                    logprobs = torch.empty(shape, dtype=logprobs_dtype)
                else:
                    logprobs = file_tensor(logprobs_file, shape)
            # The metrics go a few positions at a time, so that their float32 temporaries stay near
            # SCORE_ELEMENTS (B x L x V each would be GBs at V = 262k); every position is scored alike.
            step = max(1, SCORE_ELEMENTS // (B * V))
            for first in range(max(skip - start, 0), L, step):
                cols = slice(start + first - skip, start + min(first + step, L) - skip)
                part = logits[:, first : first + step]  # (B, l, V)
                chunk_logprobs = torch.log_softmax(part.float(), dim=-1)  # (B, l, V)
                chunk_targets = targets[rows, cols].to(model.device)  # (B, l)
                nll[rows, cols] = -chunk_logprobs.gather(-1, chunk_targets[..., None]).squeeze(-1).cpu()
                top1[rows, cols] = chunk_logprobs.argmax(dim=-1).cpu()
                if baseline is not None:
                    kl[rows, cols] = _kl(baseline.logprobs[rows, cols].to(model.device), chunk_logprobs).cpu()
                else:
                    logprobs[rows, cols] = chunk_logprobs.to(logprobs_dtype).cpu()
            del logits  # freed before the next chunk's forward
            t = _add_time(clock, "score_s", t)
    return TeacherForced(targets=targets.clone(), nll=nll, top1=top1, logprobs=logprobs, kl=kl)
