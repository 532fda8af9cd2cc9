"""harness.bench.perf end to end at a tiny size (the real run is smollm2-135m at 2K and 8K, on a quiet machine)."""

from __future__ import annotations

import csv

from harness.bench import perf


def test_perf_writes_every_cache_with_its_resident_bytes(tmp_path):
    out = tmp_path / "decode_step.csv"
    perf.main(
        ["--model", "tiny-llama", "--batch", "2", "--contexts", "40", "--bits", "4", "2", "--steps", "1",
         "--warmup", "0", "--without", "quanto", "hqq", "--out", str(out)]
    )  # fmt: skip
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# command: python -m harness.bench.perf --model tiny-llama")
    rows = list(csv.DictReader(lines[2:]))
    names = [r["cache"] for r in rows]
    assert names[:2] == ["DynamicCache", "StaticCache"] and len(names) == 6  # packed and simulated per width
    by_name = {r["cache"]: r for r in rows}
    dynamic = int(by_name["DynamicCache"]["resident_bytes"])
    for bits in (4, 2):
        packed = int(by_name[f"QuantizedKVCache asym_token g32 {bits}-bit packed-only"]["resident_bytes"])
        simulated = int(by_name[f"QuantizedKVCache asym_token g32 {bits}-bit simulated"]["resident_bytes"])
        assert packed < dynamic / 4 < simulated  # the working copy is an unquantized cache's worth
    assert all(float(r["median_step_s"]) > 0 for r in rows)
