"""harness.advise (harness/protocols/advise.py, harness/report/advise.py, the command harness/advise.py) on a tiny
model: a target it can meet, one it cannot, a killed run resumed, the allocation file in generate(), bad input."""

import json

import pytest
import torch

import harness
import harness.advise as command
from harness.protocols import advise as protocol
from harness.report.advise import write_advice

SIZES = dict(sequences=16, tokens=48, calibration_sequences=2, calibration_tokens=64, model_name="tiny-llama")
FUSED = tuple(f for f in protocol.FAMILIES if f.fused)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny-llama, its disk caches in a folder of this module's, the bisection at 4 halvings (seconds, not minutes)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("KVBITS_CACHE", str(tmp_path_factory.mktemp("cache")))
    patch.setattr(protocol, "BISECTION_STEPS", 4)
    yield harness.load("tiny-llama")
    patch.undo()


@pytest.fixture(scope="module")
def met(tiny, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("met")
    model, tokenizer = tiny
    advice = harness.advise(model, tokenizer, run_dir, kl_mean=0.1, progress=lambda _: None, **SIZES)
    return run_dir, advice


def test_a_target_it_can_meet_is_met_on_held_out_windows_by_the_most_compressed_point(met):
    run_dir, advice = met
    chosen = advice.chosen
    assert chosen is not None and chosen.confirmed["n"] == 16
    assert chosen.confirmed["kl_mean"][0] <= 0.1  # confirmed, not only promised by the proxy
    meeting = [p for p in advice.confirmed if p.confirmed["kl_mean"][0] <= 0.1]
    assert chosen.compression == max(p.compression for p in meeting)
    low, value, high = chosen.confirmed["kl_mean"][1], *chosen.confirmed["kl_mean"][::2]
    assert low <= value <= high and advice.within_interval_only == (high > 0.1)
    for family in protocol.FAMILIES:  # every family searched, its points confirmed beside the proxy's
        assert any(p.family == family.name for p in advice.confirmed)


def test_its_allocation_file_generates_through_the_api(tiny, met, tmp_path):
    run_dir, advice = met
    model, tokenizer = tiny
    paths = write_advice(run_dir, advice, "python -m harness.advise ...", "tiny-llama")
    assert [p.name for p in paths] == ["advice.md", "advice.png", "allocation.json"]
    allocation, scheme = harness.load_allocation(run_dir / "allocation.json")
    assert (
        torch.equal(allocation.key_bits, advice.allocation.key_bits) and scheme.name == advice.chosen.family
    )
    calibration = harness.calibration(model, tokenizer, sequences=2, tokens=64)
    ids = torch.tensor([tokenizer("The cache", add_special_tokens=False)["input_ids"]])
    outs = []
    for alloc, sch in ((allocation, scheme), (advice.allocation, advice.family.make_scheme())):
        cache = harness.quantized_cache(model, alloc, sch, calibration)
        with harness.packed_attention(model):
            outs.append(model.generate(ids, past_key_values=cache, max_new_tokens=6, do_sample=False))
        assert cache.nbytes() > 0 and cache.get_seq_length() == ids.shape[1] + 5
    assert outs[0].shape == (1, ids.shape[1] + 6) and torch.equal(outs[0], outs[1])  # the file is the advice
    page = (run_dir / "advice.md").read_text()
    assert "**Answer:**" in page and f"{advice.chosen.compression:.2f}x" in page


def test_a_target_no_family_meets_is_refused_with_the_closest_point(tiny, tmp_path):
    model, tokenizer = tiny
    advice = harness.advise(
        model, tokenizer, tmp_path, kl_mean=1e-9, families=FUSED, progress=lambda _: None, **SIZES
    )
    assert advice.chosen is None and advice.allocation is None
    assert advice.closest.confirmed["kl_mean"][0] == min(p.confirmed["kl_mean"][0] for p in advice.confirmed)
    assert (
        max(p.budget for p in advice.confirmed) == FUSED[0].budgets[1]
    )  # the widest budget was tried, and missed
    paths = write_advice(tmp_path, advice, "cmd", "tiny-llama")
    assert "No family meets it" in (tmp_path / "advice.md").read_text() and len(paths) == 2


def test_a_killed_run_resumes_with_what_its_steps_hold(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    run = lambda: harness.advise(  # noqa: E731
        model, tokenizer, tmp_path, compression=4.0, families=FUSED, progress=lambda _: None, **SIZES
    )
    real = protocol.Searcher.confirm
    calls = []

    def dies_on_the_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(protocol.Searcher, "confirm", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(protocol.Searcher, "confirm", real)
    done = sorted(p.name for p in (tmp_path / "steps").glob("*.json"))
    assert sum(name.startswith("confirm-") for name in done) == 1 and not any(".tmp" in n for n in done)
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "steps").glob("*.json")}
    measured = []
    monkeypatch.setattr(protocol.Steps, "get", _counting(protocol.Steps.get, measured))
    resumed = run()
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "steps").glob("*.json")}
    assert all(after[name] == stamp for name, stamp in stamps.items())  # nothing done is done again
    assert "confirm" in measured and len(measured) == len(after) - len(stamps)  # what is left, once
    assert resumed.chosen.compression >= 4.0


def _counting(get, measured):
    def counted(self, kind, what, compute):
        return get(self, kind, what, lambda: measured.append(kind) or compute())

    return counted


@pytest.mark.parametrize(
    "args, message",
    [
        (["model=tiny-llama"], r"^target: give exactly one of"),
        (
            ["model=tiny-llama", "target.ppl_ratio=1.02", "target.kl_mean=0.1"],
            r"^target: give exactly one of",
        ),
        (["model=tiny-llama", "target.ppl=1.02"], r"^target.ppl: unknown; allowed: target.ppl_ratio"),
        (["model=tiny-llama", "target.ppl_ratio=0.9"], r"^target.ppl_ratio: 0.9; allowed: a number >= 1"),
        (
            ["model=tiny-llama", "target.kl_mean=0.1", "target.backend=cuda"],
            r"^target.backend: unknown 'cuda'",
        ),
        (["target.kl_mean=0.1"], r"^model: missing"),
        (["model=tiny-llama", "target.kl_mean=0.1", "budget=3"], r"^budget: unknown option"),
        (["model=tiny-llama", "target.kl_mean=0.1", "run_name=../x"], r"^run_name: "),
        (["model=tiny-llama", "target.kl_mean=0.1", "context=0"], r"^context: 0 is not a positive integer"),
        (["tiny-llama"], r"^tiny-llama: expected key=value"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(args, message):
    with pytest.raises(ValueError, match=message):
        command.parse(args)


def test_the_command_exits_2_before_any_model_loads(monkeypatch, capsys):
    monkeypatch.setattr("harness.api.load", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as exit_:
        command.main(["model=tiny-llama", "target.kl_mean=-1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: target.kl_mean: -1")


def test_the_triton_backend_searches_only_what_the_fused_kernel_decodes():
    target = protocol.Target("ppl_ratio", 1.02, backend="triton")
    assert target.families() == FUSED and all(f.make_scheme().fusable for f in FUSED)
    assert json.dumps(protocol.Target("kl_mean", 0.1).__dict__)


class _ByBudget:
    """A Searcher whose held-out ppl_ratio at a budget is `curve(budget)` (no model): records what it confirms."""

    def __init__(self, curve):
        self.curve, self.confirmed = curve, []

    def candidate(self, family, budget):
        return protocol.Candidate(family.name, budget, 16 / budget)

    def confirm(self, family, point):
        self.confirmed.append(point.budget)
        value = self.curve(point.budget)
        point.confirmed = {"n": 16, "ppl_ratio": [value, value - 0.002, value + 0.002]}
        return point


@pytest.mark.parametrize(
    "proxy_best, expected",
    [
        (3.5, [3.5, 3.25]),  # met: a step below it too (missed there, so 3.5 stands)
        (3.0, [3.0, 3.25, 3.5]),  # missed: steps up until one meets it, never below a missed budget
        (1.25, [1.25, 1.5, 1.75, 2.0, 2.25]),  # missed MAX_STEPS_UP times: the walk stops
        (5.75, [5.75, 5.5]),
        (1.0, [1.0, 1.25, 1.5, 1.75, 2.0]),  # at the family's lowest budget
    ],
)
def test_a_quality_target_confirms_the_proxy_choice_then_walks_one_way(proxy_best, expected):
    family = next(f for f in protocol.FAMILIES if f.name == "pca")
    low, high = family.budgets
    target = protocol.Target("ppl_ratio", 1.02)
    searcher = _ByBudget(lambda b: 1.02 + 0.04 * (3.4 - b))  # meets from 3.4 bits up
    confirmed = protocol._confirmations(searcher, family, proxy_best, target)
    assert searcher.confirmed == [b for b in expected if low <= b <= high]
    assert [p.budget for p in confirmed] == searcher.confirmed
    chosen, _, _ = protocol.choose(target, confirmed)
    meets = [b for b in searcher.confirmed if b >= 3.4]
    assert (chosen is None and not meets) or chosen.budget == min(meets)
