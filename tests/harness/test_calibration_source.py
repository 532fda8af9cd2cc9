"""Calibration text apart from evaluation text (eval.calibration.data.path): the corpora by name, the windows each
source gives, the keys of points and of the disk cache, the checks before a load, and what a row records."""

import json
import os
import platform
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from harness import data, preload
from harness.calibrate import cached_head_entropies, head_entropies
from harness.calibrate.disk import cache_dir, source_identity
from harness.config import Point
from harness.models import load_model
from harness.run import runner
from harness.validate import ConfigError, check_model_inputs, validate_config

ROOT = Path(__file__).resolve().parents[2]


def compose_points(*overrides) -> tuple[object, list[Point]]:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return cfg, validate_config(cfg)


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))


def random_corpus(path: Path, documents: int, seed: int | None = None) -> Path:
    """A text file of random words in `documents` blank-line-separated documents (both splits get some)."""
    rng = np.random.default_rng(seed)
    words = ["".join(chr(c) for c in rng.integers(97, 123, rng.integers(1, 9))) for _ in range(300)]
    path.write_text("\n\n".join(" ".join(rng.choice(words, rng.integers(50, 400))) for _ in range(documents)))
    return path


def test_module_docstrings_are_every_docstring_in_walk_order():
    source = '''"""Module doc."""
def f():
    """F's doc."""
class C:
    """C's doc."""
    async def g(self):
        """G's doc."""
        return 1
x = "not a docstring"
'''
    assert (
        data._module_docstrings(source) == "Module doc.\n\nF's doc.\n\nC's doc.\n\nG's doc."
    )  # breadth first
    assert data._module_docstrings("x = 1\n") == ""


def test_stdlib_docstrings_are_library_modules_split_apart_from_the_default_corpus():
    docs = data.documents("stdlib_docstrings")
    assert "json/__init__.py" in docs and docs["json/__init__.py"].startswith(
        "JSON (JavaScript Object Notation)"
    )
    left_out = data.STDLIB_LEFT_OUT
    assert not any(left_out & set(Path(name).parts[:-1]) for name in docs)
    assert len(docs) > 300 and sum(map(len, docs.values())) > 1_000_000  # about 3x pydoc_data.topics
    s = data.split("stdlib_docstrings")
    assert s.calibration_docs and s.evaluation_docs and not set(s.calibration_docs) & set(s.evaluation_docs)
    # read back from the disk cache, per Python version
    cached = (
        Path(os.environ["KVBITS_CACHE"]) / "corpora" / f"stdlib_docstrings-{platform.python_version()}.json"
    )
    assert cached.exists() and json.loads(cached.read_text()) == docs
    assert data.documents(None) == data.documents("pydoc_topics") != docs
    assert data.source_name(None) == "pydoc_topics"
    assert data.source_name("stdlib_docstrings") == f"stdlib_docstrings (Python {platform.python_version()})"


def test_calibration_windows_come_from_the_calibration_source_and_nothing_else_moves(tmp_path):
    other = random_corpus(tmp_path / "other.txt", 40)
    _, (default,) = compose_points("model=tiny-llama", "eval=tiny", "policy=uniform")
    apart = default.replace(calibration_data_path=str(other))
    assert (
        default.calibration_data_path is None
        and default.key()
        == Point.from_dict({k: v for k, v in default.to_dict().items() if k != "calibration_data_path"}).key()
    )  # points made before the field keep their keys
    assert apart.key() != default.key()
    _, tok = load_model("tiny-llama")
    before, after = data.point_windows(tok, default), data.point_windows(tok, apart)
    assert torch.equal(before.prompts, after.prompts) and torch.equal(before.sequences, after.sequences)
    expected = data.token_windows(
        tok, data.split(str(other)).calibration, apart.calibration_sequences, apart.calibration_tokens,
        apart.seed, bos=after.bos,
    )  # fmt: skip
    assert torch.equal(after.calibration, expected) and not torch.equal(after.calibration, before.calibration)
    # the default: the calibration split of the evaluation's source, as before the field existed
    same = data.token_windows(
        tok, data.split(None).calibration, default.calibration_sequences, default.calibration_tokens,
        default.seed, bos=before.bos,
    )  # fmt: skip
    assert torch.equal(before.calibration, same)
    # naming the evaluation's corpus explicitly gives the same windows
    named = data.point_windows(tok, default.replace(calibration_data_path="pydoc_topics"))
    assert torch.equal(named.calibration, before.calibration)


def test_fitted_tables_are_keyed_by_their_calibration_source():
    model, _ = load_model("tiny-llama")
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))
    assert source_identity(None) == source_identity("pydoc_topics") == ""
    first = cached_head_entropies(model, "tiny-llama", ids, i0=4)
    assert len(list(cache_dir().glob("tiny-llama-*.parquet"))) == 1
    cached_head_entropies(model, "tiny-llama", ids, i0=4, source="pydoc_topics")  # the same table
    assert len(list(cache_dir().glob("tiny-llama-*.parquet"))) == 1
    other = cached_head_entropies(model, "tiny-llama", ids, i0=4, source="stdlib_docstrings")
    assert len(list(cache_dir().glob("tiny-llama-*.parquet"))) == 2  # its own entry, though the tokens match
    expected = head_entropies(model, ids, i0=4)
    for table in (first, other):
        np.testing.assert_allclose(table["H2"], expected["H2"])


def test_a_calibration_source_too_short_or_missing_stops_naming_its_key(tmp_path):
    short = random_corpus(tmp_path / "short.txt", 8, seed=1)
    cfg, points = compose_points(f"eval.calibration.data.path={short}")
    counts = preload.token_counts("smollm2-135m", {"calibration": data.split(str(short)).calibration})
    assert counts["calibration"] < 8 * 512
    with pytest.raises(ConfigError) as err:
        check_model_inputs(cfg, points)
    line = str(err.value)
    assert line.startswith("eval.calibration.num_sequences / eval.calibration.tokens: the text (")
    assert str(short) in line and line.endswith("or give more text with eval.calibration.data.path")
    cfg, points = compose_points(f"eval.calibration.data.path={tmp_path / 'missing'}")
    with pytest.raises(ConfigError, match=r"^eval.calibration.data.path: .* is neither a file nor a folder"):
        check_model_inputs(cfg, points)
    check_model_inputs(*compose_points("eval.calibration.data.path=stdlib_docstrings"))  # long enough


def test_a_row_records_both_sources_and_its_fits_read_the_calibration_source(tmp_path):
    other = random_corpus(tmp_path / "other.txt", 40, seed=2)
    _, points = compose_points(
        "model=tiny-llama", "eval=tiny", "policy=uniform", f"eval.calibration.data.path={other}"
    )
    frame = runner.run(points, tmp_path / "run", batch_size=4)
    row = frame.set_index("policy").loc["uniform"]
    assert row["status"] == "ok" and row["calibration_data_path"] == str(other)
    assert row["data_source"] == "pydoc_topics" and row["calibration_source"] == str(other)
    model, tok = load_model("tiny-llama")
    windows = data.point_windows(tok, points[0])
    expected = head_entropies(model, windows.calibration, i0=points[0].i0)
    entropy = pd.read_parquet(tmp_path / "run" / "entropy-tiny-llama.parquet")
    np.testing.assert_allclose(entropy["H2"], expected["H2"])
