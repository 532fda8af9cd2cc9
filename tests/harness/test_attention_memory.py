"""harness.attention_memory: bad arguments stop before any child runs (exit 2), and the measurement sees what it
claims to: the packed path's peak holds its score block (SCORE_ELEMENTS float32) and stays within three of them
(before the score steps ran in place it took four and a half), while sdpa over float32 K/V needs less."""

from __future__ import annotations

import subprocess

import pytest

from harness import attention_memory
from kernels.packed_attention import SCORE_ELEMENTS


@pytest.mark.parametrize(
    "args, message",
    [
        (["--q-heads", "8"], "--q-heads: 8 is not a multiple of --kv-heads 3"),
        (["--bits", "5"], "--bits: 5; allowed: 2, 3, 4, 8"),
        (["--contexts", "128"], "--contexts: each must be at least --chunk 256"),
        (["--batch", "0"], "--batch: 0 is not a positive integer"),
    ],
)
def test_bad_arguments_stop_before_any_child_runs(args, message, capsys, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: pytest.fail("a child ran"))
    with pytest.raises(SystemExit) as stop:
        attention_memory.main(args)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_the_packed_peak_holds_one_score_block_and_stays_within_three(capsys):
    attention_memory.main(["--contexts", "512"])
    row = capsys.readouterr().out.strip().splitlines()[-1]  # | 512 | packed | sdpa |
    packed, sdpa = (float(x) for x in row.strip("|").split("|")[1:])
    block = SCORE_ELEMENTS * 4 / attention_memory.MIB
    assert block <= packed <= 3 * block, row
    assert sdpa < packed, row
