"""harness.bench.attention_memory: bad arguments stop before any child runs (exit 2), and the measurement sees what it
claims to: the packed path's peak holds one block of dequantized keys and values (MAX_BLOCK tokens at 2048) and
no more than that and four outputs' worth besides (no scores of the block, nothing of the whole context), while
sdpa over float32 K/V needs less."""

from __future__ import annotations

import subprocess

import pytest

from harness.bench import attention_memory
from kernels.packed_attention import MAX_BLOCK


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


def test_the_packed_peak_holds_one_dequantized_block_and_little_else(capsys):
    attention_memory.main(
        ["--contexts", "2048"]
    )  # defaults: batch 8, 9 query and 3 KV heads of 64, 256 queries
    row = capsys.readouterr().out.strip().splitlines()[-1]  # | 2048 | packed | sdpa |
    packed, sdpa = (float(x) for x in row.strip("|").split("|")[1:])
    keys_and_values = 2 * 8 * 3 * MAX_BLOCK * 64 * 4 / attention_memory.MIB  # one block, float32
    output = 8 * 9 * 256 * 64 * 4 / attention_memory.MIB
    assert keys_and_values <= packed <= keys_and_values + 4 * output, row
    assert sdpa < packed, row
