"""harness.capacity_demo: the context search, the prediction beside it, and one capped trial end to end."""

from __future__ import annotations

import random

import pytest

from harness import capacity_demo


def args_for(*extra: str):
    return capacity_demo.parser().parse_args(["--model", "tiny-llama", "--batch", "2", *extra])


def test_the_search_finds_the_largest_fitting_multiple_of_the_step(monkeypatch):
    rng = random.Random(0)
    args = args_for("--step", "256", "--max-context", "65536")
    for _ in range(30):
        limit = rng.randrange(0, 70000)
        tried = []
        monkeypatch.setattr(
            capacity_demo, "fits", lambda a, bits, ctx, t=tried, n=limit: t.append(ctx) or (ctx <= n, None)
        )
        got = capacity_demo.largest_context(args, 4)
        want = min(limit, 65536) // 256 * 256
        assert got == want, (limit, got, tried)
        assert len(tried) < 30  # doubling then bisection, not a scan


def test_the_prediction_grows_as_the_widths_shrink():
    args = args_for("--memory-gib", "2")
    guesses = [capacity_demo.predicted(args, bits, overhead=2**30) for bits in (16, 8, 4, 2)]
    assert all(a < b for a, b in zip(guesses, guesses[1:])), guesses
    assert capacity_demo.predicted(args, 4, overhead=3 * 2**30) == 0  # nothing left for a cache


def test_bad_arguments_exit_2_with_one_line(cli):
    proc = cli("harness.capacity_demo", "--bits", "5")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --bits: 5; allowed: 2, 3, 4, 8, 16"


@pytest.mark.parametrize("gib, fits", [(8, True), (0.25, False)])
def test_a_capped_trial_fits_or_fails(gib, fits):
    """Through the quantized cache (prefill in chunks, decode): ample memory fits, a cap below the process does not."""
    args = args_for("--memory-gib", str(gib), "--chunk", "16", "--new-tokens", "3")
    ok, peak = capacity_demo.fits(args, 4, 40)
    assert ok == fits
    if fits:
        assert 0 < peak <= gib * 2**30
