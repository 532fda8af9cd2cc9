"""The grid point type: committed runs read back with their keys, config keys, dict round trips."""

import json
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.config import CONFIG_KEYS, FIELDS, GROUPS, HARNESS, PEER_FIELDS, Point, base_point, config_key
from harness.config import compose as compose_config
from harness.protocols.sweep import expand

ROOT = Path(__file__).resolve().parents[2]


def committed_records() -> list[dict]:
    paths = [*ROOT.glob("results/*/*/points/*.json"), *ROOT.glob("results/perf/dtype/*/points/*.json")]
    records = [
        json.loads(p.read_text()) for p in paths if "passkey" not in p.parts
    ]  # passkey: no grid points
    return [r for r in records if "config" in r and "key" in r]


def test_every_committed_point_reads_back_with_its_key_and_its_dict():
    records = committed_records()
    assert len(records) > 200, "no committed points to check"
    for r in records:
        point = Point.from_dict(r["config"])
        assert point.key() == r["key"], r["key"]
        assert point.to_dict() == r["config"], r["key"]


def test_older_records_take_todays_defaults_outside_their_key():
    # a point record of 2026-11-21 (results/beyond/2026-11-21_beyond, since rerun), made before bos,
    # budget_unit and dtype were point fields: its key and config as that run wrote them
    old = json.loads((Path(__file__).parent / "data" / "point-2026-11-21.json").read_text())
    point = Point.from_dict(old["config"])
    assert point.key() == old["key"]
    assert (point.bos, point.budget_unit, point.dtype) == ("auto", "bytes", "float32")
    assert {"bos", "budget_unit", "dtype"} <= point.unrecorded
    assert point.replace(bos="auto").key() != old["key"]  # a recorded field enters the key


def cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_grid_points_are_frozen_complete_and_round_trip():
    points = expand(cfg("+sweep=smoke", "+sweep.peers=[{engine:quanto,scheme:int4}]"))
    assert {p.engine for p in points} == {HARNESS, "quanto"}
    for p in points:
        assert Point.from_dict(p.to_dict()) == p and not p.unrecorded
        assert isinstance(p.to_dict()["widths"], list)
        assert (set(PEER_FIELDS) <= set(p.to_dict())) == (p.engine != HARNESS)
        with pytest.raises(FrozenInstanceError):
            p.budget = 1


def test_every_field_declares_its_config_key_and_group():
    assert set(CONFIG_KEYS) == set(FIELDS) == {f for g in GROUPS.values() for f in g}
    assert config_key("evict_keep") == "eviction.keep" and config_key("policy_seed") == "policy.seed"
    assert config_key("calibration_sequences") == "eval.calibration.num_sequences"
    assert config_key("group_size") == "quant.group_size" and config_key("chunk") == "eval.chunk"
    with pytest.raises(TypeError, match=r"^point field: unknown 'bits'"):
        Point.from_dict({**expand(cfg())[0].to_dict(), "bits": 4})


def test_the_unit_kl_probe_enters_the_key_only_away_from_2_x_128_tokens():
    point = base_point(compose_config(["policy=measured", "quant=pca", "policy.widths=[2,3,4]"]))
    assert (point.probe_sequences, point.probe_tokens) == (2, 128)
    before = {k: v for k, v in point.to_dict().items() if k not in ("probe_sequences", "probe_tokens")}
    assert Point.from_dict(before).key() == point.key()  # points made before the probe keep their keys
    probe = ["eval.calibration.probe.num_sequences=4", "eval.calibration.probe.tokens=256"]
    longer = base_point(compose_config(["policy=measured", "quant=pca", "policy.widths=[2,3,4]", *probe]))
    assert (longer.probe_sequences, longer.probe_tokens) == (4, 256) and longer.key() != point.key()
    assert longer.replace(probe_sequences=2, probe_tokens=128).key() == point.key()
    # a context width enters the key only when set: the points made before it keep theirs
    assert point.probe_context is None and "probe_context" in point.to_dict()
    around = base_point(
        compose_config(
            [
                "policy=measured",
                "quant=pca",
                "policy.widths=[2,3,4]",
                *probe[1:],
                "eval.calibration.probe.context=2",
            ]
        )
    )
    assert around.probe_context == 2 and around.key() not in (point.key(), longer.key())
    assert around.replace(probe_context=None, probe_tokens=128).key() == point.key()
    # a sweep keys a policy that measures on no probe without it: the same evaluation, one key
    plain = ["policy=entropy", "policy.budget=3"]
    assert expand(cfg(*plain, *probe)) == expand(cfg(*plain))
    assert {p.probe_tokens for p in expand(cfg(*plain, *probe))} == {128}
    assert expand(cfg(*plain, "eval.calibration.probe.context=2")) == expand(cfg(*plain))


def test_key_group_size_enters_the_key_only_when_set():
    point = expand(cfg("quant=kivi"))[0]
    assert point.key_group_size is None and point.key_offset == 0.0
    before = {k: v for k, v in point.to_dict().items() if k not in ("key_group_size", "key_offset")}
    assert Point.from_dict(before).key() == point.key()  # points made before the fields keep their keys
    (apart,) = {p for p in expand(cfg("quant=kivi", "quant.key_group_size=128")) if p.policy == point.policy}
    assert apart.key_group_size == 128 and apart.key() != point.key()
    assert apart.replace(key_group_size=None) == point
