"""harness.bench.capacity_demo: the context search, the prediction beside it, and one capped trial end to end."""

from __future__ import annotations

import random

import pytest

from harness.bench import capacity_demo


def args_for(*extra: str):
    return capacity_demo.parser().parse_args(["--model", "tiny-llama", "--batch", "2", *extra])


@pytest.mark.parametrize("guessing", ["none", "exact", "random"])
def test_the_search_finds_the_largest_fitting_multiple_of_the_step(monkeypatch, guessing):
    rng = random.Random(0)
    args = args_for("--step", "256", "--max-context", "65536")
    for _ in range(40):
        limit = rng.randrange(0, 70000)
        guess = {"none": None, "exact": limit, "random": rng.randrange(-5, 200000)}[guessing]
        tried = []
        monkeypatch.setattr(
            capacity_demo, "fits", lambda a, bits, ctx, t=tried, n=limit: t.append(ctx) or (ctx <= n, None)
        )
        got = capacity_demo.largest_context(args, 4, guess)
        want = min(limit, 65536) // 256 * 256
        assert got == want, (limit, guess, got, tried)
        assert all(c % 256 == 0 and 0 < c <= 65536 for c in tried), tried
        assert len(tried) == len(set(tried)) and len(tried) < 30  # gallop then bisection, never a scan
        if guessing == "exact" and 256 <= limit < 65536:
            assert tried == [want, want + 256]  # a right prediction costs two trials


def test_main_writes_the_table_the_trials_and_the_environment(monkeypatch, tmp_path):
    """main end to end with trials faked by a limit per width: the search starts from each prediction."""
    limits = {16: 3000, 4: 20000}
    out = tmp_path / "demo.md"
    seen = []  # the file as each 4-bit trial starts: the 16-bit row written, 4 bits still searched

    def fake_fits(args, bits, context):
        if bits == 4 and not seen:
            seen.append(out.read_text())
        ok = context <= limits[bits] if args.trials else True  # the first trial measures the overhead
        args.trials.append((bits, context, ok, 2**30 if ok else None, 0.5))
        return ok, 2**30 if ok else None

    monkeypatch.setattr(capacity_demo, "fits", fake_fits)
    capacity_demo.main(
        ["--model", "tiny-llama", "--batch", "2", "--memory-gib", "2", "--bits", "16", "4", "--step", "512",
         "--out", str(out)]
    )  # fmt: skip
    text = out.read_text()
    assert (
        "| DynamicCache (float32) | 16 | 2560 | 5120 |" in seen[0]
        and "| 4 |" not in seen[0].split("Trials")[0]
    )
    assert "**Incomplete:** still searching 4 bits" in seen[0] and "Incomplete" not in text
    assert "| DynamicCache (float32) | 16 | 2560 | 5120 |" in text
    assert "| QuantizedKVCache asym_token g32 (packed-only) | 4 | 19968 | 39936 |" in text
    assert "glibc's MALLOC_MMAP_THRESHOLD_=65536 in every trial." in text
    args = args_for("--memory-gib", "2", "--dtype", "float32")
    trials = [line.split("|")[1:3] for line in text.split("Trials, in order:")[1].splitlines()[4:]]
    trials = [(int(bits), int(context)) for bits, context in trials]  # (bits, context) in order
    assert trials[0] == (16, 512)  # the one-chunk trial (--chunk 512)
    for bits in (16, 4):  # each width's first trial is its prediction rounded down to the step (within range)
        first = next(context for b, context in trials[1:] if b == bits)
        guess = capacity_demo.predicted(args, bits, capacity_demo.overhead_bytes(args, 2**30))
        assert first == min(max(guess, 512), 131072) // 512 * 512, (bits, guess)
    assert (tmp_path / "demo.env.json").exists()


def test_the_overhead_is_the_chunk_trial_less_its_own_kv():
    """tiny-llama's K/V per token (every layer, K and V, every KV head x head_dim), by hand, in each dtype."""
    shape = capacity_demo.shape_from_registry("tiny-llama")
    per_token = sum(2 * layer.kv_heads * layer.head_dim for layer in shape.layers)  # elements
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        args = args_for("--chunk", "96", "--dtype", dtype)
        assert capacity_demo.overhead_bytes(args, 10**9) == 10**9 - 2 * 96 * per_token * size


def test_the_prediction_grows_as_the_widths_shrink():
    args = args_for("--memory-gib", "2")
    guesses = [capacity_demo.predicted(args, bits, overhead=2**30) for bits in (16, 8, 4, 2)]
    assert all(a < b for a, b in zip(guesses, guesses[1:])), guesses
    assert capacity_demo.predicted(args, 4, overhead=3 * 2**30) == 0  # nothing left for a cache


def test_bad_arguments_exit_2_with_one_line(in_process):
    for argv, line in [
        (["--bits", "5"], "error: --bits: 5; allowed: 2, 3, 4, 8, 16"),
        (["--batch", "0"], "error: sizes: allowed: positive numbers"),
        (["--malloc-mmap-threshold", "-1"], "error: --malloc-mmap-threshold: -1; allowed: 0 or more bytes"),
    ]:
        proc = in_process(capacity_demo.main, "harness.bench.capacity_demo", *argv)
        assert proc.returncode == 2 and proc.stderr.strip() == line, argv


@pytest.mark.parametrize("gib, fits", [(8, True), (0.25, False)])
def test_a_capped_trial_fits_or_fails(gib, fits):
    """Through the quantized cache (prefill in chunks, decode): ample memory fits, a cap below the process does not."""
    args = args_for("--memory-gib", str(gib), "--chunk", "16", "--new-tokens", "3")
    ok, peak = capacity_demo.fits(args, 4, 40)
    assert ok == fits
    if fits:
        assert 0 < peak <= gib * 2**30


def test_every_trial_runs_with_the_mmap_threshold_asked_for(monkeypatch):
    """The child's environment carries glibc's MALLOC_MMAP_THRESHOLD_ as given (none at 0), the rest unchanged."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "999")
    monkeypatch.setenv("KVBITS_PROBE", "kept")
    seen = []

    class Done:
        returncode, stdout = 0, "vm_peak 123\n"

    monkeypatch.setattr(capacity_demo.subprocess, "run", lambda cmd, **kw: seen.append(kw["env"]) or Done())
    for given, want in (("65536", "65536"), ("4096", "4096"), ("0", None)):
        args = args_for("--malloc-mmap-threshold", given)
        assert capacity_demo.fits(args, 4, 512) == (True, 123)
        assert seen[-1].get("MALLOC_MMAP_THRESHOLD_") == want
        assert seen[-1]["KVBITS_PROBE"] == "kept"
    assert capacity_demo.parser().parse_args([]).malloc_mmap_threshold == 65536
