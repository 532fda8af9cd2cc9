"""The frontier report (harness.report.frontier) on synthetic records whose answers are known."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from harness import results
from harness.capacity import cache_bytes, shape_from_registry
from harness.report import frontier
from harness.schemes import from_point


def _record(key, policy, scheme, group_size, compression, ppl_shift, kl_shift, n=16, model="m"):
    """A point whose ppl_ratio is exp(ppl_shift) exactly and whose kl_mean is kl_shift plus noise shared by
    every point (the same rng per n), so paired differences are known."""
    rng = np.random.default_rng(n)
    nll_base = rng.normal(3.0, 0.2, n)
    kl_noise = rng.uniform(0, 0.01, n)
    return {
        "key": key,
        "status": "ok",
        "config": {"model": model, "scheme": scheme, "group_size": group_size, "sink_tokens": 0,
                   "residual": 0, "budget": 4, "policy": policy, "alpha": 0.25, "sink_threshold": None,
                   "sink_fraction": None, "seed": 0, "dtype": "float32", "num_sequences": n,
                   "sequence_tokens": 1024, "chunk": 128, "bos": "auto", "data_path": None,
                   "calibration_sequences": 8, "calibration_tokens": 512, "i0": 32},
        "metrics": {"compression_true": compression, "bytes_per_token": 1000.0 / compression,
                    "ppl_ratio": math.exp(ppl_shift), "kl_mean": kl_shift + float(kl_noise.mean())},
        "items": {
            "bleu_stats": [[10, 10, 8, 6, 4, 2, 10, 9, 8, 7]] * n,
            "token_match": [1.0] * n,
            "nll": list(nll_base + ppl_shift),
            "nll_base": list(nll_base),
            "kl_mean": list(kl_noise + kl_shift),
        },
    }  # fmt: skip


RECORDS = [
    _record("u4", "uniform", "asym_token", 32, 3.2, 0.02, 0.05),
    _record("u4g64", "uniform", "asym_token", 64, 3.56, 0.03, 0.06),
    _record("u3", "uniform", "asym_token", 64, 4.57, 0.12, 0.20),
    _record("e3", "entropy", "asym_token", 64, 4.57, 0.10, 0.15),
    _record("big", "entropy", "asym_token", 32, 3.0, 0.001, 0.001),  # best quality, but only 3x
]


def test_the_frontier_takes_the_best_point_that_compresses_at_least_the_target():
    table = frontier.frontier_table(RECORDS, "m", n_boot=100).set_index("at least")
    assert table.loc["3x", "key"] == "big"  # 3.0x counts as at least 3x
    assert table.loc["3.5x", "key"] == "u4g64"  # big (3.0x) and u4 (3.2x) compress too little
    assert table.loc["4.5x", "key"] == "e3"  # lower ppl_ratio than uniform at the same bytes
    assert table.loc["5x", "point"] == "none in the run"
    assert table.loc["3.5x", "point"] == "asym_token g64, 4 bits: uniform"
    cell = table.loc["3.5x", "ppl_ratio"]
    assert cell.startswith(f"{math.exp(0.03):.4g} [") and cell.endswith("n=16")


def test_one_sequences_compression_counts_every_fitted_table_in_full():
    """The committed pca headline point (results/frontier): the byte model at the evaluation's 32 generation caches
    of 320 tokens gives the compression the run measured; one sequence of 4K tokens holds each table once."""
    path = (
        Path(__file__).resolve().parents[2]
        / "results/frontier/2026-11-24_frontier/points/4920dc41e55f5d07.json"
    )
    record = json.loads(path.read_text())
    shape = shape_from_registry("smollm2-135m")
    scheme = from_point(record["config"])
    bits = record["allocation"]["key_bits"], record["allocation"]["value_bits"]
    batch = cache_bytes(shape, 319, bits[0], scheme, 32, bits[1])  # 256 + 64 tokens, the last never fed back
    assert batch.compression_true == pytest.approx(record["metrics"]["compression_true"], rel=1e-9)
    one = frontier.one_sequence_compression(record)
    assert one == pytest.approx(cache_bytes(shape, 4096, bits[0], scheme, 1, bits[1]).compression_true)
    assert 3.3 < one < record["metrics"]["compression_true"]  # the tables weigh more on one sequence
    table = frontier.frontier_table([record], "smollm2-135m", n_boot=100).set_index("at least")
    assert table.loc["3.5x", "at 1 x 4096"] == pytest.approx(one)
    assert math.isnan(frontier.frontier_table(RECORDS, "m", n_boot=100).iloc[0]["at 1 x 4096"])  # no model
    # xlayer's tables' size only its fit knows: the run's measured tables (its held bytes less the payload) counted
    # once on one sequence; one sequence of all 32 x 319 tokens holds what the run held
    xlayer = json.loads((path.parent / "b98189ce3dc9f1c7.json").read_text())
    whole = frontier.one_sequence_compression(xlayer, 319 * 32)
    measured = xlayer["metrics"]["compression_true"]
    assert measured < whole < 1.02 * measured  # the same tokens with one fp16 sink token instead of 32
    # one of the run's 32 caches holding every table by hand: the run held bytes_per_token x 32 x 320 bytes, of which
    # the payload of 32 x 319 tokens; the rest (the tables) joins one cache's payload. xlayer's tables outweigh 319
    # fp16 tokens (a compression below 1): they pay off only over long or many sequences
    config, bits = xlayer["config"], (xlayer["allocation"]["key_bits"], xlayer["allocation"]["value_bits"])
    xscheme = from_point(config)
    payload = cache_bytes(shape, 319, bits[0], xscheme, 32, bits[1], count_tables=False).true_bytes
    tables = xlayer["metrics"]["bytes_per_token"] * 32 * 320 - payload
    one_cache = cache_bytes(shape, 319, bits[0], xscheme, 1, bits[1], count_tables=False)
    spread = frontier.one_sequence_compression(xlayer, 319)
    assert spread == pytest.approx(one_cache.fp16_bytes / (one_cache.true_bytes + tables), rel=1e-12)
    assert spread < 1 < frontier.one_sequence_compression(xlayer) < measured


def test_the_frontier_gives_no_interval_below_16_sequences():
    records = [_record("u", "uniform", "asym_token", 32, 3.2, 0.02, 0.05, n=8)]
    cell = frontier.frontier_table(records, "m", n_boot=100).iloc[0]["kl_mean"]
    assert cell.endswith("(n=8 too small for an interval)")


def test_goals_say_met_or_by_how_much_they_are_missed():
    table = frontier.goals_table(RECORDS, "m").set_index("goal")
    assert list(table.index) == [
        "ppl_ratio <= 1.005 at >= 3.5x",
        "ppl_ratio <= 1.02 at >= 4.5x",
        "ppl_ratio <= 1.08 at >= 6x",
        "ppl_ratio <= 1.25 at >= 8x",
    ]  # DESIGN.md section 8
    assert table.loc["ppl_ratio <= 1.005 at >= 3.5x", "verdict"] == f"missed by {math.exp(0.03) - 1.005:+.3g}"
    assert table.loc["ppl_ratio <= 1.02 at >= 4.5x", "verdict"] == f"missed by {math.exp(0.10) - 1.02:+.3g}"
    met = frontier.goals_table([_record("k", "uniform", "kivi", 64, 3.6, 0.004, 0.01)], "m").set_index("goal")
    assert met.loc["ppl_ratio <= 1.005 at >= 3.5x", "verdict"] == "met"
    assert table.loc["ppl_ratio <= 1.08 at >= 6x", "verdict"] == "no point"


def test_an_allocation_meets_the_best_uniform_point_at_no_more_bytes():
    table = frontier.head_to_head(RECORDS, "m", n_boot=200).set_index("key")
    # e3 (4.57x) may only meet uniform points holding no more bytes: u3, not the better u4 or u4g64
    assert table.loc["e3", "best uniform at no more bytes"] == "asym_token g64, 4 bits: uniform"
    assert table.loc["e3", "bytes"] == "1.0000"
    kl = table.loc["e3", "kl_mean"]
    assert kl.startswith("**-0.05 [") and kl.endswith("n=16**")  # a constant paired gain: excludes zero
    # big (3.0x) holds more bytes than every uniform point: its reference is the best of them all, u4
    assert table.loc["big", "best uniform at no more bytes"] == "asym_token g32, 4 bits: uniform"
    assert table.loc["big", "bytes"] == f"{3.2 / 3.0:.4f} (unequal bytes)"  # flagged: not equal memory
    assert "u4" not in table.index  # uniform points are the references, not compared


def test_points_on_other_windows_are_never_paired():
    other = _record("u3x", "uniform", "asym_token", 64, 5.0, 0.0, 0.0)
    other["config"]["sequence_tokens"] = 512  # better and smaller, but measured on other windows
    table = frontier.head_to_head([*RECORDS, other], "m", n_boot=100).set_index("key")
    assert table.loc["e3", "best uniform at no more bytes"] == "asym_token g64, 4 bits: uniform"


def test_frontier_md_is_written_for_each_model(tmp_path):
    import json

    (tmp_path / "points").mkdir()
    for record in [*RECORDS, _record("x", "uniform", "asym_token", 32, 3.2, 0.0, 0.0, model="other")]:
        (tmp_path / "points" / f"{record['key']}.json").write_text(json.dumps(record))
    path = frontier.write_frontier(tmp_path, n_boot=50)
    text = path.read_text()
    assert text.count("## Frontier") == 2 and "# m\n" in text and "# other\n" in text


def test_a_peer_meets_the_best_harness_point_at_no_less_compression():
    peer = _record("q4_0", "uniform", "q4_0", 32, 3.56, 0.08, 0.04)
    peer["config"].update(engine="llamacpp", rotation=True)
    del peer["items"]["bleu_stats"], peer["items"]["token_match"]  # peers measure teacher-forced windows only
    f16 = _record("f16", "uniform", "f16", 32, 1.0, 0.0, 0.0)
    f16["config"].update(engine="llamacpp", rotation=False)
    table = frontier.peer_rows([*RECORDS, peer, f16], "m", n_boot=200)
    assert list(table["key"]) == ["q4_0"]  # the f16 reference is no peer point of the frontier
    row = table.iloc[0]
    assert row["peer"] == "llama.cpp q4_0 + rotation"
    assert (
        row["best harness point at no less compression"] == "asym_token g64, 4 bits: uniform"
    )  # u4g64, 3.56x; u4 compresses less
    assert row["harness minus peer, ppl_ratio"].startswith(f"**{math.exp(0.03) - math.exp(0.08):+.3g} [")


def test_a_peer_whose_bytes_per_token_count_other_tokens_meets_points_by_compression():
    """A sliding-window model: the peer's windows run past the window, so its bytes per token are a third of the
    harness caches' at the same compression. It still meets u4g64 (3.56x), not the 2-bit point that alone holds
    fewer bytes per token than it."""
    peer = _record("q4_0", "uniform", "q4_0", 32, 3.56, 0.08, 0.04)
    peer["config"].update(engine="llamacpp", rotation=True)
    peer["metrics"]["bytes_per_token"] /= 3
    del peer["items"]["bleu_stats"], peer["items"]["token_match"]
    two_bit = _record(
        "u2", "uniform", "asym_token", 32, 12.0, 2.0, 1.5
    )  # 83 bytes per token, below the peer's 94
    table = frontier.peer_rows([*RECORDS, two_bit, peer], "m", n_boot=200)
    assert table.iloc[0]["best harness point at no less compression"] == "asym_token g64, 4 bits: uniform"


def test_the_ablation_pairs_the_points_with_and_without_each_ingredient():
    plain = _record("sym", "uniform", "sym_token", 32, 3.56, 0.10, 0.08)
    rotated = _record("rot", "uniform", "rotate+sym_token", 32, 3.56, 0.05, 0.03)
    wider = _record(
        "rot64", "uniform", "rotate+sym_token", 64, 4.0, 0.07, 0.05
    )  # other group size: not matched
    table = frontier.ablation_table([plain, rotated, wider, *RECORDS], "m", n_boot=200).set_index(
        "ingredient"
    )
    assert list(table.index) == [ingredient for ingredient, _, _ in frontier.INGREDIENTS]
    row = table.loc[frontier.INGREDIENTS[0][0]]
    assert (row["without"], row["with"]) == (
        "sym_token g32, 4 bits: uniform",
        "rotate+sym_token g32, 4 bits: uniform",
    )
    assert row["ppl_ratio"].startswith(f"**{math.exp(0.05) - math.exp(0.10):+.3g} [")  # better: excludes zero
    assert row["kl_mean"].startswith("**-0.05 [") and row["bytes"] == "1.0000"
    # asym_token g64 is in RECORDS (u4g64): the equal-bytes zero-point ingredient is paired with it
    assert table.loc[frontier.INGREDIENTS[1][0], "with"] == "asym_token g64, 4 bits: uniform"
    missing = table.loc[frontier.INGREDIENTS[-1][0]]
    assert missing["without"] == "not in the run" and missing["with"] == "not in the run"


def test_an_ingredient_about_something_else_ignores_points_calibrated_on_more_text():
    """Key levels fitted on 4x the calibration text are one ingredient; every other ingredient must pair points
    calibrated on the primary config's text, even where the other point would win the tie on bytes and key."""
    plain = _record("sym", "uniform", "sym_token", 32, 3.56, 0.10, 0.08)
    rotated = _record("rot", "uniform", "rotate+sym_token", 32, 3.56, 0.05, 0.03)
    more_text = _record("a-rot", "uniform", "rotate+sym_token", 32, 3.56, 0.0, 0.0)  # sorts first by key
    more_text["config"]["calibration_sequences"] = 32
    table = frontier.ablation_table([plain, rotated, more_text], "m", n_boot=50).set_index("ingredient")
    assert table.loc[frontier.INGREDIENTS[0][0], "ppl_ratio"].startswith(
        f"**{math.exp(0.05) - math.exp(0.10):+.3g} ["
    )
    assert (
        frontier.matching(
            [plain, rotated, more_text], {"scheme": "rotate+sym_token", "calibration_sequences": 32}
        )["key"]
        == "a-rot"
    )


def test_a_point_is_named_with_its_budget():
    config = {
        **RECORDS[0]["config"],
        "scheme": "codebook",
        "policy": "kv",
        "alpha": 0.0,
        "key_offset": 1,
        "budget": 3.5,
    }
    assert frontier.name(config) == "codebook, 3.5 bits: kv d=1"
    assert frontier.name({**RECORDS[0]["config"], "budget": 3}) == "asym_token g32, 3 bits: uniform"


def test_a_point_names_each_cache_option_once():
    """The scheme's label names its options (outliers, sink tokens, key levels); the policy part must not repeat
    them, and eviction, which no scheme label holds, follows the policy."""
    config = {
        **RECORDS[0]["config"],
        "scheme": "nuqkey_codebook",
        "sink_tokens": 1,
        "outliers": 0.02,
        "key_levels": "fisher_sqrt",
        "budget": 4,
    }
    storage = frontier.storage(config)
    assert "0.02" in storage and "fisher_sqrt" in storage and "sink" in storage
    assert frontier.name(config) == f"{storage}, 4 bits: uniform"
    evicting = {**config, "eviction": "h2o", "evict_keep": 0.5}
    assert frontier.name(evicting) == f"{storage}, 4 bits: uniform + h2o keep 0.5"


def test_a_point_calibrated_on_other_text_says_so_in_its_name():
    point = _record("a-rot", "uniform", "rotate+sym_token", 32, 3.56, 0.0, 0.0)["config"]
    assert frontier.name(point) == "rotate+sym_token g32, 4 bits: uniform"
    point["calibration_sequences"] = 32
    assert frontier.name(point) == "rotate+sym_token g32, 4 bits: uniform (calibrated on 32 x 512 tokens)"
    point["calibration_data_path"] = "stdlib_docstrings"
    assert frontier.name(point).endswith("(calibrated on 32 x 512 tokens of stdlib_docstrings)")


def test_points_judged_on_other_text_get_their_own_section_against_the_references(tmp_path):
    """A run with points on two texts: the main tables read the default text's only; the other text's section
    has its best point per compression, the text it was calibrated on, and paired differences to uniform
    asym_token g32 and the q4_0 emulation at 4 bits on its own windows."""
    import json

    def on(record, text, calibration):
        record["config"].update(data_path=text, calibration_data_path=calibration)
        record["resolved"] = {"calibration_source": calibration or "pydoc_topics"}
        return record

    home = [
        on(_record(k, "uniform", "asym_token", 32, c, p, p), None, None) for k, c, p in (("h4", 3.2, 0.05),)
    ]
    other = [
        on(
            _record("o-u4", "uniform", "asym_token", 32, 3.2, 0.08, 0.08), "stdlib_docstrings", "pydoc_topics"
        ),
        on(
            _record("o-q4", "uniform", "rotate+sym_token", 32, 3.56, 0.06, 0.06),
            "stdlib_docstrings",
            "pydoc_topics",
        ),
        on(_record("o-pca", "uniform", "pca", 32, 3.9, 0.01, 0.01), "stdlib_docstrings", "pydoc_topics"),
        on(_record("o-bad", "uniform", "pca", 32, 9.0, 0.0, 0.0), "other.txt", None),  # a third text
    ]
    for record in other[:3]:
        record["config"]["sink_tokens"] = 1 if record["config"]["scheme"] == "pca" else 0
    assert frontier.texts([*home, *other]) == [None, "other.txt", "stdlib_docstrings"]
    table = frontier.other_text_table(other[:3], "m", n_boot=50).set_index("at least")
    assert table.loc["3.5x", "key"] == "o-pca" and table.loc["3.5x", "calibrated on"] == "pydoc_topics"
    assert table.loc["3.5x", "point"] == "pca sink_tokens=1, 4 bits: uniform (calibrated on pydoc_topics)"
    cell = table.loc["3.5x", "minus uniform asym_token g32, 4 bits, ppl_ratio"]
    # bold: its interval excludes 0
    assert cell.startswith(f"**{math.exp(0.01) - math.exp(0.08):+.3g} [") and cell.endswith("n=16**")
    assert (
        table.loc["3x", "minus llama.cpp's q4_0 emulated (rotate+sym_token g32, 4 bits), ppl_ratio"]
        != "not in the run"
    )
    (tmp_path / "points").mkdir()
    for record in [*home, *other]:
        (tmp_path / "points" / f"{record['key']}.json").write_text(json.dumps(record))
    text = frontier.write_frontier(tmp_path, n_boot=50).read_text()
    main = text.split("judged on other text")[0]
    assert "o-pca" not in main and "h4" in main  # the main tables: the default text's points only
    assert (
        "# m: judged on other text (stdlib_docstrings)" in text
        and "# m: judged on other text (other.txt)" in text
    )


@pytest.mark.parametrize(
    "probe, label",
    [
        ({}, ""),  # recorded before the probe fields
        ({"probe_sequences": 2, "probe_tokens": 128, "probe_context": None}, ""),
        ({"probe_sequences": 2, "probe_tokens": 512}, " + unit KLs on 2 x 512 tokens"),
        ({"probe_sequences": 2, "probe_tokens": 128, "probe_context": 2}, " + unit KLs around 2 bits"),
        (
            {"probe_sequences": 4, "probe_tokens": 256, "probe_context": 3.0},
            " + unit KLs on 4 x 256 tokens around 3 bits",
        ),
        (
            {"probe_sequences": 2, "probe_tokens": 128, "probe_context": math.nan},
            "",
        ),  # a table column's missing value
    ],
)
def test_a_points_label_names_a_probe_other_than_the_default(probe, label):
    from harness.report.labels import probe_label

    assert probe_label(probe) == label


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "run_dir",
    [
        pytest.param(p.parent, id=p.parent.relative_to(ROOT).as_posix())
        for p in sorted(ROOT.glob("results/*/*/frontier.md"))
    ],
)
def test_committed_frontier_md_regenerates_identically(run_dir):
    """Each committed frontier.md from its points/ alone, byte for byte: a report whose code changed after it was
    written is regenerated with the change, not left stale beside the points it claims to summarise."""
    assert (
        frontier.frontier_text(run_dir, results.load_records(run_dir))
        == (run_dir / "frontier.md").read_text()
    )
