"""harness.metrics on hand-built tokens and runs: BLEU variants, generation and teacher-forced metrics, bootstrap."""

import math

import numpy as np
import pytest
import sacrebleu
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import metrics
from harness.evaluate import TeacherForced
from harness.metrics import (
    bootstrap_ci,
    bootstrap_cis,
    generation_items,
    generation_metrics,
    generation_statistics,
    paired_difference_ci,
    sentence_bleu_tokens,
    teacher_forced_metrics,
)


def decode(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


# --- sentence_bleu_tokens -----------------------------------------------------------------------------------


def test_sentence_bleu_identical_is_one() -> None:
    assert sentence_bleu_tokens([5, 6, 7, 8, 9], [5, 6, 7, 8, 9]) == pytest.approx(1.0)


def test_sentence_bleu_partial_match_with_brevity_penalty() -> None:
    # p1 = 4/5, p2 = 3/4, p3 = 2/3, p4 = 1/2 -> geometric mean (1/5)^(1/4); c = 5 < r = 6 -> BP = exp(1 - 6/5)
    expected = math.exp(-0.2) * (1 / 5) ** 0.25
    assert sentence_bleu_tokens([1, 2, 3, 4, 9], [1, 2, 3, 4, 5, 6]) == pytest.approx(expected)


def test_sentence_bleu_clips_repeated_tokens() -> None:
    # p1 = 2/4 (7 appears twice in ref), p2 = 1/3 (7 7 once), p3 = 0 -> 0 without smoothing
    assert sentence_bleu_tokens([7, 7, 7, 7], [7, 7, 1, 2]) == 0.0


def test_sentence_bleu_zero_four_gram_precision() -> None:
    hyp, ref = [1, 2, 3, 9, 5, 6], [1, 2, 3, 4, 5, 6]
    # p1 = 5/6, p2 = 3/5, p3 = 1/4, p4 = 0/3
    assert sentence_bleu_tokens(hyp, ref) == 0.0
    # add1 for n > 1: p2 = 4/6, p3 = 2/5, p4 = 1/4 -> (5/6 * 4/6 * 2/5 * 1/4)^(1/4) = (1/18)^(1/4); BP = 1
    assert sentence_bleu_tokens(hyp, ref, smoothing="add1") == pytest.approx((1 / 18) ** 0.25)


def test_sentence_bleu_rejects_unknown_smoothing() -> None:
    with pytest.raises(ValueError, match="smoothing"):
        sentence_bleu_tokens([1], [1], smoothing="floor")


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=12),
    st.lists(st.integers(0, 5), min_size=1, max_size=12),
    st.sampled_from(["none", "add1"]),
)
def test_sentence_bleu_bounds(hyp: list[int], ref: list[int], smoothing: str) -> None:
    assert 0.0 <= sentence_bleu_tokens(hyp, ref, smoothing=smoothing) <= 1.0 + 1e-12
    assert sentence_bleu_tokens(ref, ref, smoothing="add1") == pytest.approx(1.0)


# --- generation ---------------------------------------------------------------------------------------------


def test_generation_metrics_identical() -> None:
    tokens = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(0))
    metrics = generation_metrics(tokens, tokens.clone(), decode)
    assert metrics == pytest.approx(
        {"bleu": 1.0, "bleu_tok": 1.0, "token_match": 1.0, "first_divergence": 7.0}
    )


def test_generation_metrics_hand_built() -> None:
    base = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]])
    quant = torch.tensor([[1, 2, 0, 4, 5], [6, 7, 8, 9, 10], [0, 12, 13, 14, 0]])
    metrics = generation_metrics(base, quant, decode)
    assert metrics["token_match"] == pytest.approx(12 / 15)
    assert metrics["first_divergence"] == pytest.approx((2 + 5 + 0) / 3)
    assert 0.0 < metrics["bleu"] < 1.0
    items = generation_items(base, quant)
    np.testing.assert_allclose(items["first_divergence"], [2, 5, 0])
    np.testing.assert_allclose(items["bleu_tok"], [0.0, 1.0, 0.0])  # 4-gram precision 0 in rows 0 and 2


def test_corpus_bleu_matches_sacrebleu_on_any_resample() -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, 6, (5, 12), generator=gen)
    quant = torch.where(
        torch.rand(5, 12, generator=gen) < 0.3, torch.randint(0, 6, (5, 12), generator=gen), base
    )
    bleu = generation_statistics(base, quant, decode)["bleu"]
    for idx in (np.arange(5), np.array([0, 0, 3, 4, 4])):
        hyps = [decode(quant[i].tolist()) for i in idx]
        refs = [decode(base[i].tolist()) for i in idx]
        expected = sacrebleu.corpus_bleu(hyps, [refs], tokenize="13a").score / 100
        assert bleu(idx) == pytest.approx(expected)


def test_corpus_bleu_smooths_like_sacrebleu() -> None:
    base = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    quant = torch.tensor(
        [[1, 2, 3, 0, 5, 6, 0, 8]]
    )  # no matching 4-gram: sacrebleu's "exp" smoothing applies
    expected = sacrebleu.corpus_bleu([decode(quant[0].tolist())], [[decode(base[0].tolist())]]).score / 100
    assert generation_metrics(base, quant, decode)["bleu"] == pytest.approx(expected)
    assert expected > 0


def test_generation_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="tokens"):
        generation_items(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64))


# --- teacher-forced -----------------------------------------------------------------------------------------


def run(nll: list[list[float]], top1: list[list[int]], kl: list[list[float]] | None = None) -> TeacherForced:
    shape = torch.tensor(nll).shape
    return TeacherForced(
        targets=torch.zeros(shape, dtype=torch.int64),
        nll=torch.tensor(nll),
        top1=torch.tensor(top1),
        kl=None if kl is None else torch.tensor(kl),
    )


def test_teacher_forced_metrics_hand_built() -> None:
    base = run([[1.0, 2.0], [3.0, 2.0]], [[1, 2], [3, 4]])
    quant = run([[1.5, 2.0], [3.0, 3.5]], [[1, 0], [3, 4]], kl=[[0.0, 0.1], [0.2, 0.3]])
    metrics = teacher_forced_metrics(base, quant)
    assert metrics["ppl"] == pytest.approx(math.exp(10 / 4))
    assert metrics["ppl_base"] == pytest.approx(math.exp(8 / 4))
    assert metrics["ppl_ratio"] == pytest.approx(math.exp(2 / 4))
    assert metrics["kl_mean"] == pytest.approx(0.15)
    assert metrics["kl_p99"] == pytest.approx(np.quantile([0.0, 0.1, 0.2, 0.3], 0.99))
    assert metrics["top1_agree"] == pytest.approx(3 / 4)


def test_teacher_forced_metrics_needs_kl() -> None:
    base = run([[1.0]], [[1]])
    with pytest.raises(ValueError, match="baseline"):
        teacher_forced_metrics(base, base)


# --- bootstrap ----------------------------------------------------------------------------------------------


def mean_of(values: np.ndarray):
    return lambda idx: float(values[idx].mean())


def test_bootstrap_ci_contains_the_mean() -> None:
    values = np.random.default_rng(0).normal(size=50)
    low, high = bootstrap_ci(mean_of(values), len(values))
    assert low < values.mean() < high


def test_bootstrap_ci_shrinks_with_more_items() -> None:
    rng = np.random.default_rng(0)
    few, many = rng.normal(size=20), rng.normal(size=2000)
    low_few, high_few = bootstrap_ci(mean_of(few), len(few))
    low_many, high_many = bootstrap_ci(mean_of(many), len(many))
    assert high_many - low_many < (high_few - low_few) / 3  # about sqrt(100) = 10 times narrower


def test_bootstrap_ci_is_seeded() -> None:
    values = np.random.default_rng(0).normal(size=30)
    assert bootstrap_ci(mean_of(values), 30, seed=3) == bootstrap_ci(mean_of(values), 30, seed=3)
    assert bootstrap_ci(mean_of(values), 30, seed=3) != bootstrap_ci(mean_of(values), 30, seed=4)


def test_paired_difference_of_identical_runs_is_zero() -> None:
    gen = torch.Generator().manual_seed(2)
    base = torch.randint(0, 6, (8, 10), generator=gen)
    quant = torch.randint(0, 6, (8, 10), generator=gen)
    run_a = generation_statistics(base, quant, decode)
    run_b = generation_statistics(base, quant.clone(), decode)
    for name in run_a:
        assert paired_difference_ci(run_a[name], run_b[name], 8, n_boot=200) == (0.0, 0.0)


def test_paired_difference_sees_a_consistent_gap() -> None:
    rng = np.random.default_rng(0)
    a = rng.normal(size=40)
    b = a - 0.5 + 0.01 * rng.normal(size=40)  # b is a minus about 0.5 on every item: paired CI is narrow
    low, high = paired_difference_ci(mean_of(a), mean_of(b), 40)
    assert 0.45 < low < high < 0.55


def test_bootstrap_cis_cover_every_metric() -> None:
    base = torch.randint(0, 6, (6, 10), generator=torch.Generator().manual_seed(3))
    statistics = generation_statistics(base, base.flip(1), decode)
    cis = bootstrap_cis(statistics, 6, n_boot=100)
    point = generation_metrics(base, base.flip(1), decode)
    assert set(cis) == set(point)
    for low, high in cis.values():
        assert low <= high
        assert 0.0 <= low


def test_batched_statistics_give_each_resample_what_it_gives_alone():
    """mean_statistic and bleu_statistic over a batch of resamples (B, n): row b bit for bit the statistic of
    resample b alone, so bootstrap_ci's one batched call gives the interval its B calls gave; a paired difference
    of two batched statistics is batched."""
    rng = np.random.default_rng(3)
    values = rng.normal(size=17)
    stats = rng.integers(0, 40, size=(17, 10))
    stats[:, 6:] += stats[:, 2:6]  # n-gram totals at least the matches
    resamples = rng.integers(0, 17, size=(50, 17))
    for statistic in (metrics.mean_statistic(values), metrics.bleu_statistic(stats)):
        rows = [statistic(idx) for idx in resamples]
        assert statistic(resamples).tolist() == rows
        plain = lambda idx, statistic=statistic: statistic(idx)  # noqa: E731 - the same, unbatched
        assert bootstrap_ci(statistic, 17, n_boot=200) == bootstrap_ci(plain, 17, n_boot=200)
    a, b = metrics.mean_statistic(values), metrics.mean_statistic(values[::-1].copy())
    assert paired_difference_ci(a, b, 17, n_boot=200) == paired_difference_ci(
        lambda idx: a(idx), b, 17, n_boot=200
    )
