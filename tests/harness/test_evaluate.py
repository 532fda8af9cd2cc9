"""harness.evaluate on a tiny random Llama: greedy decoding and chunked teacher forcing through a cache."""

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from harness import evaluate
from harness.evaluate import greedy_generate, teacher_forced
from harness.metrics import teacher_forced_metrics

VOCAB = 97


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def sharp_model(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The tiny model with q/k projections scaled 10x: its random init attends almost uniformly, so positions
    barely move its logits and an off-by-one position would go unnoticed; sharp attention makes them matter."""
    sharp = copy.deepcopy(model)
    with torch.no_grad():
        for layer in sharp.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    return sharp


BOTH_MODELS = pytest.mark.parametrize("model_name", ["model", "sharp_model"])


def random_tokens(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (rows, cols), generator=torch.Generator().manual_seed(seed)
    )  # (rows, cols)


class NoisyCache(DynamicCache):
    """A DynamicCache that stores keys and values with seeded Gaussian noise of std sigma added."""

    def __init__(self, sigma: float, seed: int = 0) -> None:
        super().__init__()
        self.sigma = sigma
        self.generator = torch.Generator().manual_seed(seed)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        key_states = key_states + self.sigma * torch.randn(key_states.shape, generator=self.generator)
        value_states = value_states + self.sigma * torch.randn(value_states.shape, generator=self.generator)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@BOTH_MODELS
def test_greedy_generate_matches_model_generate(model_name: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(model_name)
    prompts = random_tokens(3, 17, seed=1)  # (N, P)
    ours = greedy_generate(model, prompts, 9, DynamicCache, batch_size=2)  # two batches: 2 + 1 prompts
    reference = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=9,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )  # (N, P + M)
    assert ours.shape == (3, 9) and ours.dtype == torch.int64
    assert torch.equal(ours, reference[:, 17:])


def test_greedy_generate_noise_changes_tokens(model: LlamaForCausalLM) -> None:
    prompts = random_tokens(3, 17, seed=1)
    clean = greedy_generate(model, prompts, 9, DynamicCache)
    noisy = greedy_generate(model, prompts, 9, lambda: NoisyCache(1.0))
    assert not torch.equal(clean, noisy)


def test_evaluation_refuses_training_mode(model: LlamaForCausalLM) -> None:
    model.train()
    try:
        with pytest.raises(ValueError, match="eval"):
            greedy_generate(model, random_tokens(1, 4, seed=0), 2, DynamicCache)
    finally:
        model.eval()


@BOTH_MODELS
def test_teacher_forced_chunks_match_full_forward(model_name: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(model_name)
    sequences = random_tokens(3, 23, seed=2)  # (S, T)
    run = teacher_forced(model, sequences, DynamicCache, chunk=5, batch_size=2, logprobs_dtype=torch.float32)
    with torch.no_grad():
        full = torch.log_softmax(model(sequences).logits[:, :-1].float(), dim=-1)  # (S, T-1, V)
    assert run.logprobs.shape == (3, 22, VOCAB)
    torch.testing.assert_close(run.logprobs, full, atol=1e-5, rtol=0)
    targets = sequences[:, 1:]  # (S, T-1)
    assert torch.equal(run.targets, targets)
    torch.testing.assert_close(run.nll, -full.gather(-1, targets[..., None]).squeeze(-1), atol=1e-5, rtol=0)
    assert torch.equal(run.top1, full.argmax(dim=-1))


def test_teacher_forced_against_itself(model: LlamaForCausalLM) -> None:
    sequences = random_tokens(3, 23, seed=2)
    base = teacher_forced(model, sequences, DynamicCache, chunk=5)
    assert base.logprobs.dtype == torch.float16 and base.kl is None
    same = teacher_forced(model, sequences, DynamicCache, chunk=5, baseline=base)
    assert same.logprobs is None
    metrics = teacher_forced_metrics(base, same)
    assert metrics["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["kl_mean"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["kl_p99"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["top1_agree"] == 1.0


def test_teacher_forced_noisy_cache_raises_kl_monotonically(model: LlamaForCausalLM) -> None:
    sequences = random_tokens(4, 23, seed=3)
    base = teacher_forced(model, sequences, DynamicCache, chunk=5)
    results = [
        teacher_forced_metrics(
            base, teacher_forced(model, sequences, lambda s=s: NoisyCache(s), chunk=5, baseline=base)
        )
        for s in (0.03, 0.1, 0.3)
    ]
    kls = [r["kl_mean"] for r in results]
    assert 0 < kls[0] < kls[1] < kls[2]
    # The random model predicts almost uniformly (ppl ~ vocab), so the sign and order of its ppl change are
    # noise; the KL is the monotone signal. The noisiest cache must still move ppl off 1 (itself: 1 +- 1e-6).
    assert abs(results[-1]["ppl_ratio"] - 1) > 1e-3
    assert results[-1]["top1_agree"] < 1.0


@pytest.mark.parametrize("positions_at_a_time", [1, 3])
def test_teacher_forced_scores_a_few_positions_at_a_time_exactly_as_a_whole_chunk(
    model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch, positions_at_a_time: int
) -> None:
    """The metrics of a chunk are scored a few positions at a time (memory bounded at large vocabularies); every
    figure must be bit-identical to scoring the whole chunk at once (one slice), baseline and KL run alike."""
    sequences = random_tokens(3, 23, seed=5)  # (S, T)
    noisy = lambda: NoisyCache(0.1)  # noqa: E731

    def runs():
        base = teacher_forced(model, sequences, DynamicCache, chunk=7, batch_size=2)
        return base, teacher_forced(model, sequences, noisy, chunk=7, batch_size=2, baseline=base)

    monkeypatch.setattr(evaluate, "SCORE_ELEMENTS", 1 << 30)  # the whole chunk in one slice
    whole_base, whole = runs()
    monkeypatch.setattr(evaluate, "SCORE_ELEMENTS", positions_at_a_time * 2 * VOCAB)  # batch of 2
    sliced_base, sliced = runs()
    for a, b in ((whole_base, sliced_base), (whole, sliced)):
        assert torch.equal(a.nll, b.nll) and torch.equal(a.top1, b.top1)
    assert torch.equal(whole_base.logprobs, sliced_base.logprobs)
    assert torch.equal(whole.kl, sliced.kl) and whole.kl.abs().sum() > 0


def test_teacher_forced_rejects_other_sequences(model: LlamaForCausalLM) -> None:
    base = teacher_forced(model, random_tokens(2, 9, seed=4), DynamicCache, chunk=4)
    with pytest.raises(ValueError, match="different sequences"):
        teacher_forced(model, random_tokens(2, 9, seed=5), DynamicCache, chunk=4, baseline=base)


@pytest.mark.parametrize("score_from", [1, 4, 5, 12, 22])
def test_teacher_forced_scores_from_a_position_as_the_tail_of_a_whole_run(
    model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch, score_from: int
) -> None:
    """score_from feeds the context through the same cache and chunks without scoring it: the scored targets'
    figures are bit for bit the tail of a run that scores every target (baseline, KL against it, and a noisy
    cache), at a chunk boundary (5), inside a chunk, the first and the last target; 1 is every target."""
    sequences = random_tokens(3, 23, seed=6)  # (S, T)
    monkeypatch.setattr(evaluate, "SCORE_ELEMENTS", 3 * 2 * VOCAB)  # a few positions at a time, batch of 2

    def runs(start: int):
        base = teacher_forced(model, sequences, DynamicCache, chunk=5, batch_size=2, score_from=start)
        noisy = teacher_forced(
            model, sequences, lambda: NoisyCache(0.1), chunk=5, batch_size=2, baseline=base, score_from=start
        )
        return base, noisy

    whole_base, whole = runs(0)
    base, noisy = runs(score_from)
    tail = slice(score_from - 1, None)  # target index j predicts token j + 1
    assert torch.equal(base.targets, sequences[:, score_from:]) and base.nll.shape == (3, 23 - score_from)
    assert torch.equal(base.logprobs, whole_base.logprobs[:, tail])
    for a, b in ((base, whole_base), (noisy, whole)):
        assert torch.equal(a.nll, b.nll[:, tail]) and torch.equal(a.top1, b.top1[:, tail])
    assert torch.equal(noisy.kl, whole.kl[:, tail]) and noisy.kl.abs().sum() > 0
    if score_from > 1:  # a baseline scored from elsewhere (1 scores every target, as 0 does)
        with pytest.raises(ValueError, match="different sequences"):
            teacher_forced(
                model, sequences, DynamicCache, chunk=5, baseline=whole_base, score_from=score_from
            )


def test_teacher_forced_refuses_a_score_start_outside_the_sequences(model: LlamaForCausalLM) -> None:
    for start in (-1, 9):
        with pytest.raises(ValueError, match="score_from"):
            teacher_forced(model, random_tokens(2, 9, seed=4), DynamicCache, chunk=4, score_from=start)


def test_a_baseline_kept_on_disk_scores_as_one_in_memory(model: LlamaForCausalLM, tmp_path) -> None:
    """logprobs_file keeps the baseline's log-probs in that file, bit for bit the in-memory ones (mapped again, too),
    and a run against it gets the same KL."""
    sequences = random_tokens(3, 23, seed=7)
    memory = teacher_forced(model, sequences, DynamicCache, chunk=5, score_from=6)
    path = tmp_path / "logprobs.f16"
    disk = teacher_forced(model, sequences, DynamicCache, chunk=5, score_from=6, logprobs_file=path)
    assert torch.equal(disk.logprobs, memory.logprobs) and memory.logprobs.shape == (3, 17, VOCAB)
    mapped = evaluate.file_tensor(path, tuple(memory.logprobs.shape), mode="r")
    assert torch.equal(mapped, memory.logprobs)
    noisy = [
        teacher_forced(model, sequences, lambda: NoisyCache(0.1), chunk=5, baseline=b, score_from=6)
        for b in (memory, disk, evaluate.TeacherForced(disk.targets, disk.nll, disk.top1, logprobs=mapped))
    ]
    assert all(torch.equal(noisy[0].kl, n.kl) for n in noisy[1:]) and noisy[0].kl.abs().sum() > 0
    with pytest.raises(ValueError, match="logprobs_file"):
        teacher_forced(
            model, sequences, DynamicCache, chunk=5, logprobs_file=path, logprobs_dtype=torch.float32
        )
