"""harness.protocols.passkey: prompt placement and length, the scorer, 16-bit equality with a DynamicCache, resumability."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from harness import io
from harness.attention import PACKED, installed
from harness.models import load_model
from harness.protocols import passkey
from harness.report.passkey import accuracy_table, fail_contexts, load_points


@pytest.fixture(scope="module")
def tiny():
    loaded = {name: load_model(name) for name in ("tiny-llama", "tiny-gemma3")}
    with contextlib.ExitStack() as stack:
        for model, _ in loaded.values():
            stack.enter_context(
                installed(model, PACKED)
            )  # quantized caches are attended from their packed form
        yield loaded


@pytest.mark.parametrize("context,depth", [(300, 0.0), (301, 0.1), (517, 0.5), (777, 0.9), (1000, 1.0)])
def test_prompt_length_and_depth(tiny, context, depth):
    tokenizer = tiny["tiny-llama"][1]
    builder = passkey.PromptBuilder(tokenizer)
    key = passkey.trial_key(0, "m", context, depth, 3)
    prompt = builder.build(context, depth, key)
    assert prompt.ids.shape == (context,)
    needle = builder.encode(passkey.NEEDLE.format(key=key))
    assert prompt.ids[prompt.needle_start : prompt.needle_start + len(needle)].tolist() == needle
    fixed = len(builder.head) + len(needle) + len(builder.question)
    filler = context - fixed
    assert (
        abs(prompt.needle_start - len(builder.head) - depth * filler) <= 0.5
    )  # depth of the filler, rounded
    text = tokenizer.decode(prompt.ids.tolist())
    assert text.endswith(passkey.QUESTION) and text.count(key) == 2
    assert prompt.ids[-prompt.question_tokens :].tolist() == builder.question


def test_prompt_too_short_names_the_option(tiny):
    builder = passkey.PromptBuilder(tiny["tiny-llama"][1])
    with pytest.raises(ValueError, match="passkey.contexts"):
        builder.build(builder.minimum_context() - 1, 0.5, "12345")


def test_trial_keys_are_five_digits_and_stable():
    keys = [passkey.trial_key(1, "m", 1024, 0.5, t) for t in range(50)]
    assert all(len(k) == 5 and k.isdigit() for k in keys)
    assert len(set(keys)) > 40
    assert keys == [passkey.trial_key(1, "m", 1024, 0.5, t) for t in range(50)]


@pytest.mark.parametrize(
    "text,key,expected",
    [
        (" 12345. Remember", "12345", True),
        ("12345", "12345", True),
        (" 123456", "12345", False),  # a longer number is not the key
        (" 1234", "12345", False),
        (" the key 54321 then 12345", "12345", False),  # only the first number counts
        (" no digits", "12345", False),
        (" 12 345", "12345", False),
    ],
)
def test_score(text, key, expected):
    assert passkey.score(text, key) is expected


@pytest.mark.parametrize("name,context", [("tiny-llama", 333), ("tiny-gemma3", 301)])  # gemma3: window 16
def test_sixteen_bits_give_the_dynamic_cache_answer(tiny, name, context):
    model, tokenizer = tiny[name]
    builder = passkey.PromptBuilder(tokenizer)
    prompts = [builder.build(context, d, passkey.trial_key(7, name, context, d, 0)) for d in (0.25, 0.75)]
    ids = torch.stack([p.ids for p in prompts])  # (2, context)
    q = prompts[0].question_tokens
    document = DynamicCache(config=model.config)
    passkey.prefill(model, ids[:, :-q], document, chunk=64)
    base, _ = passkey.answer_from_prefilled(model, document, ids[:, -q:], context - q, 6)

    reference = DynamicCache(config=model.config)  # the same prompt through one unshared DynamicCache
    passkey.prefill(model, ids[:, :-q], reference, chunk=97)
    assert torch.equal(base, passkey.answer(model, reference, ids[:, -q:], context - q, 6))

    text = model.config.get_text_config(decoder=True)
    bits = torch.full((text.num_hidden_layers, text.num_key_value_heads), 16)
    quantized, cache = passkey.answer_from_prefilled(model, document, ids[:, -q:], context - q, 6, bits)
    assert torch.equal(quantized, base)
    assert cache.nbytes() == cache.nbytes_fp16() > 0
    assert document.get_seq_length() == context - q  # the shared prefill is never written to


def _args(run: str, root, **over):
    argv = [
        "--models", "tiny-llama", "--contexts", "300", "--depths", "0.5", "--trials", "3", "--batch", "2",
        "--policies", "uniform", "--budgets", "2", "--calibration-sequences", "2", "--calibration-tokens", "48",
        "--root", str(root), "--run", run,
    ]  # fmt: skip
    for key, value in over.items():
        argv[argv.index(f"--{key}") + 1] = value
    return passkey.parser().parse_args(argv)


def test_run_writes_points_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "calibration"))
    run_dir = tmp_path / "runs" / "r"
    (job,) = passkey.jobs(_args("r", tmp_path / "runs"))
    assert passkey.run_model(job, run_dir, progress=lambda _: None) == 2  # baseline and uniform @ 2
    points = sorted((run_dir / "points").glob("*.json"))
    assert [p.name.split("__")[3] for p in points] == ["baseline", "uniform"]
    record = json.loads(points[1].read_text())
    assert record["status"] == "ok" and len(record["correct"]) == 3 and record["mean_bits"] == 2.0
    assert record["compression_true"] == pytest.approx(16 / (2 + 2 * 16 / 32))  # asym g=32: 2 fp16 per group
    stamps = [p.stat().st_mtime_ns for p in points]

    calls = []
    monkeypatch.setattr("harness.models.load_model", lambda *a, **k: calls.append(a))
    assert passkey.run_model(job, run_dir, progress=lambda _: None) == 0  # all done: nothing loaded
    assert calls == [] and [p.stat().st_mtime_ns for p in points] == stamps
    (other,) = passkey.jobs(_args("r", tmp_path / "runs", trials="4"))  # other settings: other points
    assert other.settings.digest() != job.settings.digest()


def test_a_run_stopped_inside_a_depth_resumes_at_the_batch(tmp_path, monkeypatch):
    """Stopped after its first trial (batch 1), a run keeps each point's answers in partial/; resumed at batch 2 it
    prefills only what some point lacks, and writes the points an unstopped run writes, trial for trial."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "calibration"))
    (reference,) = passkey.jobs(_args("ref", tmp_path / "runs"))
    assert passkey.run_model(reference, tmp_path / "runs" / "ref", progress=lambda _: None) == 2
    expected = {
        p.name: json.loads(p.read_text()) for p in (tmp_path / "runs" / "ref" / "points").glob("*.json")
    }

    run_dir = tmp_path / "runs" / "s"
    answer_batch, calls = passkey._answer_batch, []

    def stop_at_the_second_batch(*args):
        calls.append(1)
        if len(calls) == 3:  # the baseline and uniform answered trial 0; trial 1's first answer is stopped
            raise KeyboardInterrupt
        return answer_batch(*args)

    monkeypatch.setattr(passkey, "_answer_batch", stop_at_the_second_batch)
    (stopped,) = passkey.jobs(_args("s", tmp_path / "runs", batch="1"))
    with pytest.raises(KeyboardInterrupt):
        passkey.run_model(stopped, run_dir, progress=lambda _: None)
    assert not list((run_dir / "points").glob("*.json"))
    partials = {p.name: json.loads(p.read_text()) for p in (run_dir / "partial").glob("*.json")}
    assert sorted(partials) == sorted(expected) and all(len(p["rows"]) == 1 for p in partials.values())

    monkeypatch.setattr(passkey, "_answer_batch", answer_batch)
    prefills, prefill = [], passkey.prefill
    monkeypatch.setattr(passkey, "prefill", lambda *a, **k: prefills.append(a[1].shape) or prefill(*a, **k))
    # batch 2: trials 0-1 (trial 0 kept from the partial), then trial 2
    (resumed,) = passkey.jobs(_args("s", tmp_path / "runs"))
    assert passkey.run_model(resumed, run_dir, progress=lambda _: None) == 2
    assert [shape[0] for shape in prefills] == [2, 1]
    assert not list((run_dir / "partial").glob("*.json"))
    for name, want in expected.items():
        got = json.loads((run_dir / "points" / name).read_text())
        assert got["resumed_trials"] == 1 and "resumed_trials" not in want
        for field in ("answers", "correct", "keys", "compression_true", "mean_bits"):
            assert got[field] == want[field], field


def test_a_start_records_its_command_before_it_runs(tmp_path, monkeypatch):
    """commands.txt gets each start's command line as it begins and tables.md is rewritten with it before any
    point runs: a start stopped before its end is on record, a resumed start with the same command adds nothing, and
    --report-only adds nothing."""
    argv = ["--models", "tiny-llama", "--contexts", "300", "--policies", "uniform", "--root", str(tmp_path)]
    stops, reports = [], []

    def stopped(*args, **kwargs):
        stops.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(passkey, "run_model", stopped)
    monkeypatch.setattr(passkey, "write_report", lambda run_dir: reports.append(len(stops)) or [])
    commands = tmp_path / "default" / "commands.txt"
    for extra in ([], [], ["--trials", "5"]):
        with pytest.raises(KeyboardInterrupt):
            passkey.main([*argv, *extra])
    passkey.main([*argv, "--report-only"])
    assert len(stops) == 3
    assert reports == [0, 1, 2, 3]  # each start's report before its points, then --report-only's
    assert commands.read_text().splitlines() == [
        io.command_line("python -m harness.passkey", argv),
        io.command_line("python -m harness.passkey", [*argv, "--trials", "5"]),
    ]


def test_failure_rule():
    accuracy = accuracy_table(_frame(), "m")
    assert fail_contexts(accuracy) == {"uniform @ 2 bits": 2048, "uniform @ 4 bits": None}


def _frame():
    import pandas as pd

    rows = []
    for context, base, two, four in ((1024, 10, 9, 10), (2048, 8, 3, 8), (4096, 0, 0, 0)):
        for policy, budget, correct in (("baseline", 16, base), ("uniform", 2, two), ("uniform", 4, four)):
            rows.append(
                dict(
                    model="m", context=context, depth=0.5, policy=policy, budget=budget, status="ok",
                    label=f"{policy} @ {budget:g} bits" if policy != "baseline" else "baseline (fp)",
                    correct=correct, trials=10,
                )
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_bad_options_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="passkey.contexts"):
        passkey.jobs(_args("x", tmp_path, contexts="4096"))  # tiny-llama's limit is 2048
    with pytest.raises(ValueError, match="passkey.policies"):
        passkey.jobs(_args("x", tmp_path, policies="entropi"))
    with pytest.raises(ValueError, match="policy.budget"):
        passkey.jobs(_args("x", tmp_path, budgets="1"))
    with pytest.raises(ValueError, match="passkey.depths"):
        passkey.jobs(_args("x", tmp_path, depths="1.5"))
    with pytest.raises(
        ValueError, match="passkey.haystack: unknown 'essays'; allowed: repeat, shuffled, text"
    ):
        passkey.jobs(passkey.parser().parse_args(["--haystack", "essays", "--root", str(tmp_path)]))
    text, repeat = (
        passkey.jobs(passkey.parser().parse_args([*extra, "--root", str(tmp_path)]))[0].settings
        for extra in (["--haystack", "text"], [])
    )
    assert text.haystack == "text" and text.digest() != repeat.digest()  # other prompts: other points


@pytest.mark.parametrize("run", ["../escape", "a/b", ".."])
def test_run_is_a_folder_name_under_root(tmp_path, capsys, run):
    root = tmp_path / "root"
    with pytest.raises(SystemExit) as exit_:
        passkey.main(["--root", str(root), "--run", run, "--report-only"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --run: {run!r} is not a plain name; allowed: a folder name without / or \\ that is not . or .."
    ]
    assert not tmp_path.joinpath("escape").exists() and not root.exists()


def test_report_reads_points(tmp_path):
    points = tmp_path / "points"
    points.mkdir()
    for row in _frame().to_dict("records"):
        n = row["trials"]
        record = {
            "status": "ok",
            "config": {k: row[k] for k in ("model", "context", "depth", "policy", "budget")},
            "correct": [True] * row["correct"] + [False] * (n - row["correct"]),
        }
        (points / f"{row['policy']}{row['budget']}{row['context']}.json").write_text(json.dumps(record))
    frame = load_points(tmp_path)
    assert accuracy_table(frame, "m").loc["uniform @ 2 bits", 2048] == pytest.approx(0.3)
    from harness.report.passkey import write_report

    assert [p.name for p in write_report(tmp_path)] == ["tables.md", "passkey.png"]
    assert "| uniform @ 2 bits | 2048 |" in (tmp_path / "tables.md").read_text()


def test_one_needle_prompts_are_the_ones_runs_have_always_read(tiny):
    """The multi-key builder leaves single-needle prompts (and so every committed run's names and answers) as
    they were: head, filler, needle, filler restarted, question."""
    builder = passkey.PromptBuilder(tiny["tiny-llama"][1])
    for context, depth in ((301, 0.3), (640, 0.85)):
        key = passkey.trial_key(0, "m", context, depth, 1)
        assert passkey.trial_keys(0, "m", context, depth, 1, 1) == [key]
        needle = builder.encode(passkey.NEEDLE.format(key=key))
        n_filler = context - len(builder.head) - len(needle) - len(builder.question)
        before = round(depth * n_filler)
        expected = builder.head + builder._filler(before) + needle + builder._filler(n_filler - before)
        assert builder.build(context, depth, key).ids.tolist() == expected + builder.question


def _is_shuffled_filler(filler: list[int], sentences: list[list[int]]) -> bool:
    """Whether `filler` is a prefix of rounds of `sentences`, each round every sentence once in some order."""
    left = []
    while filler:
        left = left or list(range(len(sentences)))
        match = [i for i in left if filler[: len(sentences[i])] == sentences[i][: len(filler)]]
        if not match:
            return False
        left.remove(match[0])
        filler = filler[len(sentences[match[0]]) :]
    return True


@pytest.mark.parametrize("haystack", ["text", "shuffled"])
@pytest.mark.parametrize(
    "needles,context,depth", [(1, 301, 0.0), (1, 777, 0.37), (3, 640, 0.9), (2, 1000, 1.0)]
)
def test_a_trials_own_haystack_is_one_run_the_needles_cut(tiny, haystack, needles, context, depth):
    """haystack=text / shuffled: the prompt is exactly `context` tokens, its filler (the prompt less head, needles
    and question) one contiguous run of the evaluation split's tokens / rounds of the filler's sentences, each in
    an order of its own; another trial another run; the needle at its depth of the run."""
    from harness import data

    tokenizer = tiny["tiny-llama"][1]
    builder = passkey.PromptBuilder(tokenizer, needles=needles, haystack=haystack)
    text = data.text_ids(tokenizer, data.split(None).evaluation).tolist()
    fillers = []
    for trial in (0, 1):
        keys = passkey.trial_keys(0, "m", context, depth, trial, needles)
        prompt = builder.build(context, depth, keys, passkey.haystack_seed(0, "m", context, depth, trial))
        ids = prompt.ids.tolist()
        assert len(ids) == context and ids[: len(builder.head)] == builder.head
        assert ids[-prompt.question_tokens :] == builder.question
        for j, key in enumerate(keys):  # cut the needles out where they stand
            needle = builder._needle(j, key)
            at = next(i for i in range(len(ids)) if ids[i : i + len(needle)] == needle)
            assert j or at == prompt.needle_start
            ids = ids[:at] + ids[at + len(needle) :]
        filler = ids[len(builder.head) : len(ids) - prompt.question_tokens]
        if haystack == "text":
            start = next(i for i in range(len(text)) if text[i : i + len(filler)] == filler)
            assert filler == text[start : start + len(filler)]
        else:
            assert _is_shuffled_filler(filler, builder.sentences)
            assert not _is_shuffled_filler(filler[1:] + filler[:1], builder.sentences)  # the check can fail
        before = prompt.needle_start - len(builder.head)  # filler tokens before the asked needle
        assert needles > 1 or abs(before - depth * len(filler)) <= 0.5
        fillers.append(filler)
    assert fillers[0] != fillers[1]


@pytest.mark.parametrize(
    "needles,context,depth", [(2, 400, 0.0), (3, 517, 0.4), (4, 777, 1.0), (3, 600, 0.9)]
)
def test_a_multi_key_prompt_hides_every_key_and_asks_for_the_first_box(tiny, needles, context, depth):
    tokenizer = tiny["tiny-llama"][1]
    builder = passkey.PromptBuilder(tokenizer, needles=needles)
    keys = passkey.trial_keys(5, "m", context, depth, 2, needles)
    assert len(set(keys)) == needles and all(len(k) == 5 for k in keys)
    prompt = builder.build(context, depth, keys)
    assert prompt.ids.shape == (context,) and prompt.key == keys[0]
    asked = builder.encode(passkey.BOX_NEEDLE.format(box=passkey.BOXES[0], key=keys[0]))
    assert prompt.ids[prompt.needle_start : prompt.needle_start + len(asked)].tolist() == asked
    text = tokenizer.decode(prompt.ids.tolist())
    assert all(text.count(k) == 2 for k in keys)
    assert text.endswith(passkey.BOX_QUESTION.format(box="red")) and text.count("of the red box") == 4
    # the asked needle after round(depth * filler) filler tokens and the needles the others' depths put first
    needle_tokens = [
        len(builder.encode(passkey.BOX_NEEDLE.format(box=passkey.BOXES[j], key=k)))
        for j, k in enumerate(keys)
    ]
    n_filler = context - len(builder.head) - sum(needle_tokens) - len(builder.question)
    others = [(depth + j / needles) % 1 for j in range(1, needles)]
    ahead = sum(
        n
        for j, n in enumerate(needle_tokens[1:], 1)
        if round(others[j - 1] * n_filler) < round(depth * n_filler)
    )
    assert prompt.needle_start == len(builder.head) + round(depth * n_filler) + ahead


def test_a_multi_key_option_out_of_range_is_refused(tmp_path):
    for needles in (0, 9):
        with pytest.raises(ValueError, match="^passkey.needles: "):
            passkey.jobs(_file_args("r", tmp_path, needles=needles))


def _file_args(run: str, root, *files: str, needles: int = 1):
    return passkey.parser().parse_args(
        [
            "--models", "tiny-llama", "--contexts", "480", "--depths", "0.5", "--trials", "2", "--batch", "2",
            "--policies", "--calibration-sequences", "2", "--calibration-tokens", "48", "--root", str(root),
            "--run", run, "--needles", str(needles), "--allocations", *files,
        ]
    )  # fmt: skip


def _uniform(model, bits: int):
    """A uniform Allocation at `bits` for every (layer, KV head) of `model`."""
    from harness.policies import Allocation

    text = model.config.get_text_config(decoder=True)
    shape = (text.num_hidden_layers, text.num_key_value_heads)
    return Allocation.per_head(
        torch.full(shape, bits),
        torch.zeros(shape, dtype=torch.bool),
        torch.full(shape, float(bits)),
        "uniform",
    )


def test_allocation_files_are_points_with_their_own_scheme(tiny, tmp_path, monkeypatch):
    """A 16-bit allocation file answers as the unquantized cache does; a pca file (fitted parts and all) runs
    beside it, its record naming its scheme and file; a changed file is another point."""
    import harness

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "calibration"))
    model, _ = tiny["tiny-llama"]
    sixteen, pca = _uniform(model, 16), _uniform(model, 3)
    files = [
        str(harness.save_allocation(tmp_path / "full.json", sixteen, "asym_token")),
        str(harness.save_allocation(tmp_path / "pca3.json", pca, harness.make_scheme("pca", sink_tokens=1))),
    ]
    run_dir = tmp_path / "runs" / "f"
    (job,) = passkey.jobs(_file_args("f", tmp_path / "runs", *files, needles=2))
    assert passkey.run_model(job, run_dir, progress=lambda _: None) == 3  # baseline and the two files
    records = {
        r["config"]["policy"].split("-")[0]: r
        for r in map(json.loads, map(Path.read_text, sorted((run_dir / "points").glob("*.json"))))
    }
    assert set(records) == {"baseline", "full", "pca3"} and all(r["status"] == "ok" for r in records.values())
    assert records["full"]["answers"] == records["baseline"]["answers"]
    assert records["full"]["compression_true"] == 1.0 and records["pca3"]["compression_true"] > 3
    assert (
        records["pca3"]["config"]["scheme"].startswith("pca")
        and records["pca3"]["config"]["allocation_file"] == files[1]
    )
    assert records["pca3"]["config"]["needles"] == 2 and records["pca3"]["mean_bits"] == 3.0
    assert passkey.run_model(job, run_dir, progress=lambda _: None) == 0  # resumed: nothing left
    harness.save_allocation(tmp_path / "pca3.json", pca, harness.make_scheme("pca", sink_tokens=0))
    (changed,) = passkey.jobs(_file_args("f", tmp_path / "runs", *files, needles=2))
    assert changed.files[1].name != job.files[1].name  # the file's bytes are part of its points' names


def test_an_unreadable_allocation_file_is_a_one_line_error(tmp_path):
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^passkey.allocations: .*bad.json"):
        passkey.jobs(_file_args("r", tmp_path, str(tmp_path / "bad.json")))


def test_the_report_pairs_each_point_with_the_baseline_trial_by_trial(tmp_path):
    """Two depths of 10 trials: the baseline right on all 20, one point wrong on 6 (bold: its interval excludes
    0), another right where the baseline is: +0 with a degenerate interval; a point run at one depth is paired at that
    depth and says so; a point whose trials differ from the baseline's at a shared depth gets '—'."""
    points = tmp_path / "points"
    points.mkdir()
    answers = {"baseline": [[True] * 10, [True] * 10], "uniform": [[True] * 7 + [False] * 3] * 2,
               "entropy": [[True] * 10, [True] * 10], "kv": [[False] * 10],
               "inverted": [[True] * 10, [True] * 9]}  # fmt: skip
    for policy, by_depth in answers.items():
        for depth, correct in zip((0.25, 0.75), by_depth):
            config = {
                "model": "m",
                "context": 2048,
                "depth": depth,
                "policy": policy,
                "budget": 16 if policy == "baseline" else 3,
            }
            (points / f"{policy}{depth}.json").write_text(
                json.dumps({"status": "ok", "config": config, "correct": correct})
            )
    from harness.report.passkey import paired_table

    table = paired_table(load_points(tmp_path), "m", n_boot=200)
    assert table.loc["uniform @ 3 bits", 2048].startswith("**-0.3 [") and table.loc[
        "uniform @ 3 bits", 2048
    ].endswith("n=20**")
    assert table.loc["entropy @ 3 bits", 2048] == "+0 [+0, +0] n=20"
    assert table.loc["kv @ 3 bits", 2048] == "-1 (n=10 too small for an interval); depths 0.25 only"
    assert table.loc["inverted @ 3 bits", 2048] == "—"


def test_a_cross_layer_prefill_converts_as_one_exact_call_stores_it(tiny, tmp_path, monkeypatch):
    """xlayer_pca at 2 bits (each layer predicted from the layer below's reconstruction: a simulated cache): its
    cache converted from the shared full-precision prefill answers, token for token, as a cache that stored the
    same document itself in one prefill=exact call (the document attends its own full-precision K/V both ways)."""
    import harness
    from harness.cache import QuantizedKVCache
    from harness.calibrate import cached_fit

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "calibration"))
    model, tokenizer = tiny["tiny-llama"]
    scheme = harness.make_scheme("xlayer_pca", sink_tokens=1)
    calib = torch.randint(3, tokenizer.vocab_size, (2, 48), generator=torch.Generator().manual_seed(5))
    fitted = cached_fit(scheme, model, "tiny-llama", calib, 400)
    builder = passkey.PromptBuilder(tokenizer)
    prompts = [builder.build(333, d, passkey.trial_key(3, "tiny-llama", 333, d, 0)) for d in (0.2, 0.6)]
    ids = torch.stack([p.ids for p in prompts])  # (2, 333)
    q = prompts[0].question_tokens
    document = DynamicCache(config=model.config)
    passkey.prefill(model, ids[:, :-q], document, chunk=64)
    alloc = _uniform(model, 2)
    tokens, cache = passkey.answer_from_prefilled(
        model, document, ids[:, -q:], 333 - q, 6, alloc, scheme, fitted, simulate=True
    )
    stored = QuantizedKVCache(
        model.config, alloc, scheme, prefill="exact", simulate=True, key_calibration=fitted
    )
    passkey.prefill(model, ids[:, :-q], stored, chunk=333)  # one call: the whole document
    assert torch.equal(tokens, passkey.answer(model, stored, ids[:, -q:], 333 - q, 6))
    assert cache.nbytes() == stored.nbytes() > 0
    with pytest.raises(ValueError, match="^quant.simulate: xlayer_pca "):  # never a packed-only xlayer cache
        passkey.answer_from_prefilled(model, document, ids[:, -q:], 333 - q, 6, alloc, scheme, fitted)


def test_cross_layer_files_run_simulated_and_refuse_what_exact_cannot_convert(tiny, tmp_path, monkeypatch):
    """A run of xlayer_pca files records `simulate` and its 16-bit file answers as the unquantized cache; on
    tiny-gemma3 (window 16) prefill=exact is refused in one line before anything is fitted, and
    prefill=quantized runs."""
    import harness

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "calibration"))
    scheme = harness.make_scheme("xlayer_pca", sink_tokens=1)
    model, _ = tiny["tiny-llama"]
    files = [
        str(harness.save_allocation(tmp_path / f"x{bits}.json", _uniform(model, bits), scheme))
        for bits in (16, 2)
    ]
    run_dir = tmp_path / "runs" / "x"
    (job,) = passkey.jobs(_file_args("x", tmp_path / "runs", *files))
    assert passkey.run_model(job, run_dir, progress=lambda _: None) == 3
    records = {
        r["config"]["policy"].split("-")[0]: r
        for r in map(json.loads, map(Path.read_text, sorted((run_dir / "points").glob("*.json"))))
    }
    assert records["x16"]["answers"] == records["baseline"]["answers"]
    assert records["x16"]["config"]["simulate"] is True and records["x2"]["config"]["simulate"] is True
    assert "simulate" not in records["baseline"]["config"] and records["x2"]["compression_true"] > 2

    gemma, _ = tiny["tiny-gemma3"]
    gemma_file = str(harness.save_allocation(tmp_path / "g2.json", _uniform(gemma, 2), scheme))
    argv = [
        "--models", "tiny-gemma3", "--contexts", "300", "--depths", "0.5", "--trials", "2", "--batch", "2",
        "--policies", "--calibration-sequences", "2", "--calibration-tokens", "48", "--root", str(tmp_path / "runs"),
        "--run", "g", "--allocations", gemma_file,
    ]  # fmt: skip
    (exact,) = passkey.jobs(passkey.parser().parse_args(argv))
    fits = []
    monkeypatch.setattr(passkey, "cached_fit", lambda *a, **k: fits.append(a))
    with pytest.raises(
        ValueError, match=r"^passkey.prefill: exact cannot convert a 2\d\d-token document for "
    ):
        passkey.run_model(exact, tmp_path / "runs" / "g", progress=lambda _: None)
    assert fits == [] and not list((tmp_path / "runs" / "g").rglob("*.json"))
    monkeypatch.undo()
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "calibration"))
    (quantized,) = passkey.jobs(passkey.parser().parse_args(argv + ["--prefill", "quantized"]))
    assert passkey.run_model(quantized, tmp_path / "runs" / "g", progress=lambda _: None) == 2
