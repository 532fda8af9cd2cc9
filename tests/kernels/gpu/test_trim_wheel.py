"""kernels/gpu/trim_wheel.py: a transformers wheel without the model families nothing reaches."""

from __future__ import annotations

import zipfile

import pytest

from kernels.gpu import trim_wheel

FILES = {
    "transformers/__init__.py": "from .utils import x\n",
    "transformers/integrations/gguf.py": "from ..models.qwen3_5.tokenization_qwen3_5 import REGEX\n",
    "transformers/models/__init__.py": "",
    "transformers/models/llama/modeling_llama.py": "from ..rope_base.modeling_rope_base import turn\n",
    "transformers/models/rope_base/modeling_rope_base.py": "import torch\n",
    "transformers/models/qwen3_5/tokenization_qwen3_5.py": "REGEX = 'a'\n",
    "transformers/models/whisper/modeling_whisper.py": "from ..speech_base import y\n",
    "transformers/models/speech_base/__init__.py": "y = 1\n",
    "transformers/models/whisper/README.md": "from ..llama import nothing (not Python)\n",
}
KEPT = [
    "transformers/__init__.py",
    "transformers/integrations/gguf.py",
    "transformers/models/__init__.py",
    "transformers/models/llama/modeling_llama.py",
    "transformers/models/rope_base/modeling_rope_base.py",
    "transformers/models/qwen3_5/tokenization_qwen3_5.py",
    "transformers-9.0.dist-info/RECORD",
]


def _wheel(path):
    record = "".join(f"{name},sha256=x,{len(text)}\n" for name, text in FILES.items())
    record += "transformers-9.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, text in FILES.items():
            z.writestr(name, text)
        z.writestr("transformers-9.0.dist-info/RECORD", record)


def test_keeps_what_is_reached_and_drops_the_rest_from_the_record(tmp_path):
    """A family in KEEP (llama) and what it imports (rope_base), one the core imports (qwen3_5), and every file
    outside a family stay; an unreached family (whisper) and what only it imports (speech_base) go, from the
    archive and from RECORD alike."""
    path = tmp_path / "transformers-9.0-py3-none-any.whl"
    _wheel(path)
    trim_wheel.main([str(path)])
    with zipfile.ZipFile(path) as z:
        assert z.namelist() == KEPT
        record = [
            line.split(",")[0] for line in z.read("transformers-9.0.dist-info/RECORD").decode().splitlines()
        ]
        assert z.read("transformers/models/llama/modeling_llama.py").decode() == FILES[KEPT[3]]
    assert record == KEPT[:-1] + ["transformers-9.0.dist-info/RECORD"]


def test_refuses_what_is_not_a_transformers_wheel(tmp_path, capsys):
    other = tmp_path / "regex-1.0-py3-none-any.whl"
    other.write_bytes(b"")
    with pytest.raises(SystemExit) as exc:
        trim_wheel.main([str(other)])
    assert exc.value.code == 2
    assert "wheel: " in capsys.readouterr().err
