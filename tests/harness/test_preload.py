"""harness.preload: GGUF metadata against the gguf package's reader, head dims, token counts and their cache."""

import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import preload
from harness.models import byte_tokenizer

VALUES = st.one_of(
    st.tuples(st.just("uint32"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("int32"), st.integers(-(2**31), 2**31 - 1)),
    st.tuples(st.just("uint64"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("float32"), st.floats(-1e6, 1e6, width=32)),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("string"), st.text(max_size=20)),
    st.tuples(st.just("strings"), st.lists(st.text(max_size=8), min_size=1, max_size=40)),
    st.tuples(st.just("ints"), st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=40)),
)


def write_gguf(path: Path, fields: dict[str, tuple[str, object]], tensor_shape=(3, 5)) -> None:
    w = gguf.GGUFWriter(str(path), arch="llama")
    for key, (kind, value) in fields.items():
        if kind in ("strings", "ints"):
            w.add_array(key, value)
        else:
            getattr(w, f"add_{kind}")(key, value)
    w.add_tensor("weight", np.random.default_rng().standard_normal(tensor_shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@settings(max_examples=30, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-z]{1,6}\.[a-z_]{1,8}", fullmatch=True), VALUES, max_size=8))
def test_gguf_metadata_matches_the_gguf_package(fields):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.gguf"
        write_gguf(path, fields)
        reader = gguf.GGUFReader(str(path))
        expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert preload.gguf_metadata(path) == expected
        # Skipping keys (arrays included) keeps every later key where it is.
        kept = {k for k in expected if hash(k) % 2}
        assert preload.gguf_metadata(path, keep=lambda k: k in kept) == {k: expected[k] for k in kept}


def test_gguf_head_dims_from_key_length_or_embedding_over_heads(tmp_path):
    write_gguf(
        tmp_path / "a.gguf",
        {"llama.embedding_length": ("uint32", 576), "llama.attention.head_count": ("uint32", 9)},
    )
    assert preload.gguf_head_dims(tmp_path / "a.gguf") == {64}
    write_gguf(
        tmp_path / "b.gguf",
        {
            "llama.embedding_length": ("uint32", 640),
            "llama.attention.head_count": ("uint32", 4),
            "llama.attention.key_length": ("uint32", 256),
            "llama.attention.value_length": ("uint32", 128),
        },
    )
    assert preload.gguf_head_dims(tmp_path / "b.gguf") == {256, 128}
    (tmp_path / "c.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        preload.gguf_metadata(tmp_path / "c.gguf")


def test_head_dims_of_configs_per_layer():
    assert preload.head_dims("tiny-llama") == {32}
    assert preload.head_dims("tiny-gemma4") == {32, 64}  # sliding and global layers differ


@pytest.mark.slow
@pytest.mark.parametrize("name, head_dim", [("smollm2-135m", 64), ("gemma3-270m", 256)])
def test_gguf_head_dims_agree_with_transformers_config(name, head_dim):
    from transformers import AutoConfig

    from harness.models import _gguf_read_fast, gguf_path, model_spec

    path = gguf_path(model_spec(name))
    with _gguf_read_fast():  # gguf's reader as the harness runs it: the same fields, read faster
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    assert preload.head_dims(name) == {config.head_dim} == {head_dim}


def test_token_counts_are_the_tokenizers_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    rng = np.random.default_rng()
    texts = {"calibration": "é" * int(rng.integers(1, 50)), "evaluation": "ab " * int(rng.integers(1, 50))}
    tok = byte_tokenizer()
    expected = {k: len(tok(v, add_special_tokens=False)["input_ids"]) for k, v in texts.items()}
    assert expected["calibration"] == 2 * len(texts["calibration"])  # bytes: a real count, not characters
    assert preload.token_counts("tiny-llama", texts) == expected

    def no_tokenizer(name):
        raise AssertionError("the cached count should be read, not recomputed")

    monkeypatch.setattr(preload, "tokenizer", no_tokenizer)
    assert preload.token_counts("tiny-llama", texts) == expected
    with pytest.raises(AssertionError):  # another text is a new count
        preload.token_counts("tiny-llama", {**texts, "evaluation": texts["evaluation"] + "x"})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_the_kept_tokenizer_tokenizes_as_the_converted_one(name, tmp_path, monkeypatch):
    from harness import data

    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    converted = preload.tokenizer(name)  # converted from the GGUF, then saved
    kept = preload.tokenizer(name)  # read back from the disk cache
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    text = data.split(None)
    for sample in (text.calibration[:100_000], text.evaluation[-100_000:]):
        ids = converted(sample, add_special_tokens=False)["input_ids"]
        assert kept(sample, add_special_tokens=False)["input_ids"] == ids and len(ids) > 10_000
