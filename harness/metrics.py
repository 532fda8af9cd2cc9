"""Quality metrics of a quantized-cache run against the same model with an unquantized cache.

This module owns the arithmetic only: it takes generated tokens (harness.evaluate.greedy_generate) or
teacher-forced runs (harness.evaluate.TeacherForced) and returns numbers; it never runs a model.

- Generation: corpus BLEU of decoded text (sacrebleu, tokenize "13a", on 0..1), sentence BLEU on token ids
  averaged over prompts, token match share, first divergence index.
- Teacher-forced: perplexities and their ratio, KL(p_base || p_quant) mean and 99th percentile, top-1 agreement.
- Uncertainty: paired percentile bootstrap over items (prompts or sequences), expanded for small samples
  (Hesterberg's expanded percentile interval: the percentile interval at a wider nominal level, so that a 95%
  interval over 16 items covers about 95%, where the plain percentile interval covers about 92%). Every metric is
  written once as a *statistic*, a function of an array of item indices; the point estimate is the statistic on
  all items, and a bootstrap replicate is the statistic on resampled items (corpus BLEU and the KL percentile are
  recomputed from their per-item parts on each resample).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from sacrebleu.metrics import BLEU

if TYPE_CHECKING:
    from harness.evaluate import TeacherForced

Statistic = Callable[[np.ndarray], float]  # item indices (may repeat) -> metric value

SACREBLEU_SMOOTHING = "exp"  # sacrebleu's default for corpus BLEU
# No interval over fewer paired units (prompts or sequences): a percentile bootstrap over a handful of items
# has a handful of possible means, and its "95%" interval undercovers (DESIGN.md 3.5). Reports print
# "n too small" below it.
MIN_PAIRED_UNITS = 16


# --- generation ---------------------------------------------------------------------------------------------


def _ngrams(tokens: list[int], n: int) -> Counter[tuple[int, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def sentence_bleu_tokens(hyp: list[int], ref: list[int], max_n: int = 4, smoothing: str = "none") -> float:
    """Sentence BLEU of one hypothesis against one reference, on token ids, on 0..1.

    BLEU = BP * exp(mean_n log p_n) for n = 1..max_n, where p_n is the clipped n-gram precision and
    BP = min(1, exp(1 - len(ref) / len(hyp))).

    smoothing:
    - "none" (default, as in the write-up this variant comes from): any p_n == 0, including a hypothesis
      with no n-grams of some order, gives 0.
    - "add1": add-one smoothing of the n-gram counts for n > 1 (Lin & Och 2004), p_n = (m_n + 1) / (t_n + 1);
      p_1 is left unsmoothed.
    """
    if smoothing not in ("none", "add1"):
        raise ValueError(f"smoothing: unknown {smoothing!r}; allowed: none, add1")
    if not hyp:
        return 0.0
    log_precisions = []
    for n in range(1, max_n + 1):
        hyp_ngrams, ref_ngrams = _ngrams(hyp, n), _ngrams(ref, n)
        matches = sum(min(count, ref_ngrams[gram]) for gram, count in hyp_ngrams.items())
        total = sum(hyp_ngrams.values())
        if smoothing == "add1" and n > 1:
            matches, total = matches + 1, total + 1
        if matches == 0:
            return 0.0
        log_precisions.append(math.log(matches / total))
    brevity_penalty = min(1.0, math.exp(1 - len(ref) / len(hyp)))
    return brevity_penalty * math.exp(sum(log_precisions) / max_n)


def _first_divergence(base_row: np.ndarray, quant_row: np.ndarray) -> int:
    differs = np.flatnonzero(base_row != quant_row)
    return int(differs[0]) if differs.size else len(base_row)


def generation_items(base_tokens: torch.Tensor, quant_tokens: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-prompt values (each (N,) float64): bleu_tok, token_match, first_divergence."""
    if base_tokens.shape != quant_tokens.shape or base_tokens.ndim != 2:
        raise ValueError(
            f"tokens must both be (N, M); got {tuple(base_tokens.shape)}, {tuple(quant_tokens.shape)}"
        )
    base, quant = base_tokens.cpu().numpy(), quant_tokens.cpu().numpy()  # (N, M) each
    return {
        "bleu_tok": np.array(
            [sentence_bleu_tokens(q.tolist(), b.tolist()) for b, q in zip(base, quant, strict=True)]
        ),
        "token_match": (base == quant).mean(axis=1, dtype=np.float64),
        "first_divergence": np.array(
            [_first_divergence(b, q) for b, q in zip(base, quant, strict=True)], dtype=np.float64
        ),
    }


def bleu_sufficient_stats(hyps: list[str], refs: list[str]) -> np.ndarray:
    """Per-sentence sacrebleu statistics (N, 2 + 2*4): hyp length, ref length, n-gram matches, n-gram totals."""
    scorer = BLEU(tokenize="13a", effective_order=True)  # effective_order only silences the sentence warning
    rows = []
    for hyp, ref in zip(hyps, refs, strict=True):
        score = scorer.sentence_score(hyp, [ref])
        rows.append([score.sys_len, score.ref_len, *score.counts, *score.totals])
    return np.array(rows, dtype=np.int64)


def corpus_bleu_from_stats(stats: np.ndarray) -> float:
    """sacrebleu corpus BLEU (its default "exp" smoothing) of summed per-sentence statistics, on 0..1."""
    return _bleu_of_total(stats.sum(axis=0))


def _bleu_of_total(total: np.ndarray) -> float:
    """corpus_bleu_from_stats of the statistics' sum (10,)."""
    score = BLEU.compute_bleu(
        correct=total[2:6].tolist(),
        total=total[6:10].tolist(),
        sys_len=int(total[0]),
        ref_len=int(total[1]),
        smooth_method=SACREBLEU_SMOOTHING,
    )
    return min(score.score / 100, 1.0)  # sacrebleu's 100.0 can come back as 100.00000000000004


def generation_statistics(
    base_tokens: torch.Tensor, quant_tokens: torch.Tensor, decode: Callable[[list[int]], str]
) -> dict[str, Statistic]:
    """Each generation metric as a function of prompt indices (for generation_metrics and the bootstrap).

    bleu is corpus BLEU recomputed from the selected prompts' sacrebleu statistics, so it equals
    sacrebleu.corpus_bleu on those prompts' texts (hypothesis = quant text, reference = base text).
    """
    items = generation_items(base_tokens, quant_tokens)
    hyps = [decode(row) for row in quant_tokens.tolist()]
    refs = [decode(row) for row in base_tokens.tolist()]
    bleu_stats = bleu_sufficient_stats(hyps, refs)  # (N, 10)
    statistics: dict[str, Statistic] = {"bleu": bleu_statistic(bleu_stats)}
    for name, values in items.items():
        statistics[name] = mean_statistic(values)
    return statistics


def generation_metrics(
    base_tokens: torch.Tensor, quant_tokens: torch.Tensor, decode: Callable[[list[int]], str]
) -> dict[str, float]:
    """{"bleu", "bleu_tok", "token_match", "first_divergence"} of quant against base tokens, each (N, M) int64.

    bleu: sacrebleu corpus BLEU (13a) of decoded texts / 100; bleu_tok: mean over prompts of
    sentence_bleu_tokens (no smoothing); token_match: share of equal positions; first_divergence: mean over
    prompts of the first differing index (M when none).
    """
    statistics = generation_statistics(base_tokens, quant_tokens, decode)
    all_items = np.arange(base_tokens.shape[0])
    return {name: statistic(all_items) for name, statistic in statistics.items()}


# --- teacher-forced -----------------------------------------------------------------------------------------


def _check_pair(base: TeacherForced, quant: TeacherForced) -> None:
    if quant.kl is None:
        raise ValueError("the quant run has no KL: make it with teacher_forced(..., baseline=<the base run>)")
    if not torch.equal(base.targets, quant.targets):
        raise ValueError("base and quant runs were made on different sequences")


def teacher_forced_items(base: TeacherForced, quant: TeacherForced) -> dict[str, np.ndarray]:
    """Per-sequence values (each (S,) float64): nll, nll_base, kl_mean, top1_agree (means over positions)."""
    _check_pair(base, quant)
    return {
        "nll": quant.nll.double().mean(dim=1).numpy(),
        "nll_base": base.nll.double().mean(dim=1).numpy(),
        "kl_mean": quant.kl.double().mean(dim=1).numpy(),
        "top1_agree": (quant.top1 == base.top1).double().mean(dim=1).numpy(),
    }


def teacher_forced_statistics(base: TeacherForced, quant: TeacherForced) -> dict[str, Statistic]:
    """Each teacher-forced metric as a function of sequence indices (for teacher_forced_metrics and the bootstrap).

    All sequences have the same length, so means of per-sequence means are means over positions; kl_p99 is
    the 99th percentile over all positions of the selected sequences.
    """
    items = teacher_forced_items(base, quant)
    nll, nll_base = items["nll"], items["nll_base"]
    kl = quant.kl.double().numpy()  # (S, T-1)
    return {
        "ppl": lambda idx: math.exp(nll[idx].mean()),
        "ppl_base": lambda idx: math.exp(nll_base[idx].mean()),
        "ppl_ratio": lambda idx: math.exp(nll[idx].mean() - nll_base[idx].mean()),
        "kl_mean": mean_statistic(items["kl_mean"]),
        "kl_p99": lambda idx: float(np.quantile(kl[idx], 0.99)),
        "top1_agree": mean_statistic(items["top1_agree"]),
    }


def teacher_forced_metrics(base: TeacherForced, quant: TeacherForced) -> dict[str, float]:
    """{"ppl", "ppl_base", "ppl_ratio", "kl_mean", "kl_p99", "top1_agree"} of quant against base.

    ppl = exp(mean NLL over all positions); KL(p_base || p_quant) per position in nats, its mean and 99th
    percentile; top1_agree = share of positions whose argmax agrees.
    """
    statistics = teacher_forced_statistics(base, quant)
    all_items = np.arange(base.targets.shape[0])
    return {name: statistic(all_items) for name, statistic in statistics.items()}


# --- uncertainty --------------------------------------------------------------------------------------------


def expanded_level(level: float, n_items: int) -> float:
    """The nominal level whose percentile interval covers about `level` over n_items items (Hesterberg's
    expanded percentile bootstrap: alpha' / 2 = Phi(-sqrt(n / (n - 1)) * t_{n-1, 1 - alpha / 2}))."""
    if n_items < 2:
        return level
    import scipy.stats  # here, not at the top: its import (about 1 s) would delay every command's start

    t = scipy.stats.t.ppf((1 + level) / 2, n_items - 1)
    return 1 - 2 * scipy.stats.norm.cdf(-math.sqrt(n_items / (n_items - 1)) * t)


def bootstrap_ci(
    statistic: Statistic, n_items: int, n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Expanded percentile bootstrap interval of statistic over items resampled with replacement.

    The resamples depend only on (n_items, n_boot, seed), so two statistics bootstrapped with the same seed
    see the same resampled items.
    """
    if n_items < 1:
        raise ValueError("bootstrap_ci needs at least one item")
    rng = np.random.default_rng(seed)
    resamples = rng.integers(0, n_items, size=(n_boot, n_items))  # (B, n_items)
    if getattr(statistic, "batched", False):
        values = np.asarray(statistic(resamples), dtype=np.float64)  # (B,)
    else:
        values = np.array([statistic(idx) for idx in resamples])  # (B,)
    wide = expanded_level(level, n_items)
    low, high = np.quantile(values, [(1 - wide) / 2, (1 + wide) / 2])
    return float(low), float(high)


def paired_difference_ci(
    statistic_a: Statistic,
    statistic_b: Statistic,
    n_items: int,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Bootstrap interval of statistic_a - statistic_b, both computed on the same resampled items.

    For two runs on the same prompts/sequences, e.g. a policy and uniform at the same budget:
    paired_difference_ci(stats_policy["bleu"], stats_uniform["bleu"], n_prompts).
    """
    difference = lambda idx: statistic_a(idx) - statistic_b(idx)  # noqa: E731
    if getattr(statistic_a, "batched", False) and getattr(statistic_b, "batched", False):
        difference = batched(difference)
    return bootstrap_ci(difference, n_items, n_boot, seed, level)


def batched(statistic: Statistic) -> Statistic:
    """`statistic` marked as one that also takes a batch of resamples: item indices (B, n) -> (B,) values, row b
    what statistic(idx[b]) gives (bootstrap_ci then makes one call instead of B)."""
    statistic.batched = True
    return statistic


def mean_statistic(values: np.ndarray) -> Statistic:
    """The mean of values (N,) over item indices, batched: a row's mean reduces as a 1-D mean does."""
    return batched(lambda idx: values[idx].mean(-1) if idx.ndim > 1 else float(values[idx].mean()))


def bleu_statistic(stats: np.ndarray) -> Statistic:
    """Corpus BLEU (corpus_bleu_from_stats) over item indices of per-sentence statistics (N, 10), batched (the
    sums in one reduction, sacrebleu's formula once a row)."""

    def statistic(idx: np.ndarray):
        if idx.ndim == 1:
            return corpus_bleu_from_stats(stats[idx])
        return np.array([_bleu_of_total(total) for total in stats[idx].sum(axis=1)])  # (B, 10) sums

    return batched(statistic)


def bootstrap_cis(
    statistics: dict[str, Statistic], n_items: int, n_boot: int = 1000, seed: int = 0, level: float = 0.95
) -> dict[str, tuple[float, float]]:
    """bootstrap_ci of every statistic (e.g. from generation_statistics), all on the same resamples."""
    return {
        name: bootstrap_ci(statistic, n_items, n_boot, seed, level) for name, statistic in statistics.items()
    }


def format_difference(difference: float, low: float, high: float, excludes_zero: bool, n: int) -> str:
    """'+0.012 [-0.004, +0.031] n=32', bold when the interval excludes zero; 'n=8 too small' below
    MIN_PAIRED_UNITS paired items; '—' without a uniform partner."""
    if math.isnan(difference):
        return "—"
    if n < MIN_PAIRED_UNITS:
        return f"{difference:+.3g} (n={n} too small for an interval)"
    text = f"{difference:+.3g} [{low:+.3g}, {high:+.3g}] n={n}"
    return f"**{text}**" if excludes_zero else text
