"""model.dtype: native bf16 detection, `auto`, validation, and the dtype in point keys, rows and passkey names."""

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness import precision, results
from harness.__main__ import entry
from harness.config import Point
from harness.models import load_model
from harness.protocols.passkey import Settings
from harness.protocols.sweep import expand
from harness.validate import ConfigError, _check_point, validate_config

ROOT = Path(__file__).resolve().parents[2]
X86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f {extra}\nbogomips\t: 1\n"


def cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "text, native",
    [
        (X86.format(extra="avx512_bf16 avx512_vnni"), True),
        (X86.format(extra="amx_tile amx_bf16"), True),
        (X86.format(extra="avx512_vnni amx_tile"), False),  # AMX without its bf16 unit
        ("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n", True),  # aarch64
        ("processor\t: 0\nFeatures\t: fp asimd\n", False),
        ("", False),
    ],
)
def test_native_bf16_from_cpu_flags(tmp_path, monkeypatch, text, native):
    info = tmp_path / "cpuinfo"
    info.write_text(text)
    assert precision.native_bf16("cpu", info) is native
    monkeypatch.setattr(precision, "CPUINFO", info)
    assert precision.resolve("auto") == ("bfloat16" if native else "float32")
    assert precision.resolve("float32") == "float32" and precision.resolve("bfloat16") == "bfloat16"
    assert precision.describe()["native_bf16"] is native


def test_unreadable_cpuinfo_means_not_native(tmp_path):
    assert precision.cpu_flags(tmp_path / "absent") == set()
    assert precision.native_bf16("cpu", tmp_path / "absent") is False


def test_this_machine_is_reported_as_torch_sees_it():
    """/proc/cpuinfo's answer agrees with torch's own CPU probe where torch has one (x86)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if probe is None or not Path("/proc/cpuinfo").exists():
        pytest.skip("no torch probe or no /proc/cpuinfo here")
    assert ("avx512_bf16" in precision.cpu_flags()) == probe()


def test_dtype_names_and_bad_names():
    assert precision.torch_dtype("bfloat16") is torch.bfloat16
    assert precision.torch_dtype("float32") is torch.float32
    for bad in ("float16", "bf16", ""):
        with pytest.raises(ValueError, match="model.dtype: unknown .*allowed: float32, bfloat16, auto"):
            precision.resolve(bad)


def test_bad_dtype_stops_before_loading_with_exit_2(in_process):
    """python -m harness run in this process (test_cli.py runs a refusal as a new process)."""
    with pytest.raises(
        ConfigError, match=r"^model.dtype: unknown 'float16'; allowed: float32, bfloat16, auto$"
    ):
        validate_config(cfg("model.dtype=float16"))
    proc = in_process(entry, "harness", "model.dtype=half", "tracking.wandb.mode=disabled")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: model.dtype: unknown 'half'; allowed: float32, bfloat16, auto"
    ]


def test_a_grid_point_holds_a_resolved_dtype():
    point = expand(cfg())[0]
    _check_point(point)
    for bad in (
        "auto",
        "float16",
    ):  # a sweep entry may set the field: `auto` is resolved only from model.dtype
        with pytest.raises(
            ConfigError, match=f"model.dtype: '{bad}' in a grid point; allowed: float32, bfloat16"
        ):
            _check_point(point.replace(dtype=bad))


def test_dtype_is_in_every_point_and_in_the_key_only_when_not_float32():
    fp32 = validate_config(cfg("+sweep=smoke"))
    bf16 = validate_config(cfg("+sweep=smoke", "model.dtype=bfloat16"))
    assert {p.dtype for p in fp32} == {"float32"} and {p.dtype for p in bf16} == {"bfloat16"}
    for a, b in zip(fp32, bf16, strict=True):
        assert a.replace(dtype="bfloat16") == b
        without = {k: v for k, v in a.to_dict().items() if k != "dtype"}
        assert (
            a.key() == Point.from_dict(without).key()
        )  # points made before the field existed keep their keys
        assert b.key() != a.key()
    auto = expand(cfg("+sweep=smoke", "model.dtype=auto"))
    assert {p.dtype for p in auto} == {precision.resolve("auto")}


def test_every_committed_point_keeps_its_key():
    paths = [p for p in ROOT.glob("results/**/points/*.json") if "passkey" not in p.parts]
    records = [json.loads(p.read_text()) for p in paths]
    records = [r for r in records if "config" in r and "key" in r]
    assert records, "no committed points to check"
    for r in records:  # made before the dtype was recorded (float32), or with it in the config
        config = r["config"] if "dtype" in r["config"] else {**r["config"], "dtype": "float32"}
        assert Point.from_dict(config).key() == r["key"], r["key"]


def test_rows_of_records_without_a_dtype_say_float32():
    old = {"key": "a", "status": "ok", "config": {"model": "m", "policy": "uniform"}, "metrics": {"ppl": 2.0}}
    new = {
        **old,
        "key": "b",
        "config": {**old["config"], "dtype": "bfloat16"},
        "resolved": {"native_bf16": True},
    }
    frame = results.table([old, new])
    assert frame["dtype"].tolist() == ["float32", "bfloat16"]
    assert frame["native_bf16"].isna().tolist() == [True, False] and bool(frame["native_bf16"].iloc[1])


def test_passkey_settings_name_float32_points_as_before():
    """Every committed passkey run is named by the settings its baseline points record (a point stored from an
    allocation file records that file's scheme label instead); the runs made before dtype and needles were
    recorded (no `needles` in their config) still carry the default Settings' name; a bfloat16 or multi-key run
    is named apart."""
    plain = Settings()
    assert plain.dtype == "float32" and plain.needles == 1
    fields = set(Settings.__dataclass_fields__)
    older = set()
    for run in sorted(p.parent for p in ROOT.glob("results/passkey/*/points")):
        points = {p: json.loads(p.read_text())["config"] for p in run.glob("points/*.json")}
        baselines = [c for c in points.values() if c["policy"] == "baseline"]
        assert baselines, run
        named = {Settings(**{k: v for k, v in c.items() if k in fields}).digest() for c in baselines}
        assert len(named) == 1 and {p.stem.rsplit("__", 1)[1] for p in points} == named, run
        if all("needles" not in c for c in points.values()):
            older |= named
    assert older == {plain.digest()}
    assert len({plain.digest(), Settings(dtype="bfloat16").digest(), Settings(needles=2).digest()}) == 3
    with pytest.raises(ValueError, match="passkey.dtype: unknown 'auto'"):
        Settings(dtype="auto")  # the command line resolves auto before building settings


def test_tiny_model_is_built_in_float32_then_cast_once():
    fp32, _ = load_model("tiny-llama")
    bf16, _ = load_model("tiny-llama", dtype="bfloat16")
    params = dict(bf16.named_parameters())
    for name, p in fp32.named_parameters():
        assert params[name].dtype == torch.bfloat16
        assert torch.equal(params[name], p.to(torch.bfloat16)), name
