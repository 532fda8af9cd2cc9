"""Weights from the Hugging Face Hub on request (harness.models.fetch: model.download=true,
load(download=True)), against a local HTTP server that speaks the Hub's file protocol and serves a tiny GPT-2
the test writes.

huggingface_hub reads HF_ENDPOINT and HF_HOME when it is imported, so every check runs the harness in a new
process (python -m harness, or a script calling harness.load) with both pointed at this test's server and
folder: the real download code runs, nothing reaches the network."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError
from transformers import GPT2Config, GPT2LMHeadModel

from harness.models import HUB_FILES, byte_tokenizer

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "c0ffee" * 6 + "c0ff"  # the one revision the server has (40 hex digits)
TOKEN = "hf_test_token"
# Files a repository holds beside what a causal LM needs; HUB_FILES leaves them on the server.
EXTRA = {"flax_model.msgpack": b"\0" * 64, "onnx/config.json": b"{}"}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> dict[str, bytes]:
    """The files of a tiny random GPT-2 (byte tokenizer, 256 tokens) as save_pretrained writes them, plus
    EXTRA."""
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    # initializer_range 0.2: attention and outputs far from uniform, so quantizing changes what a run measures
    config = GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=2, n_positions=1024, bos_token_id=0, eos_token_id=0,
        initializer_range=0.2,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert "model.safetensors" in files and "tokenizer.json" in files and "config.json" in files
    return {**files, **EXTRA}


class FakeHub(BaseHTTPRequestHandler):
    """The Hub's side of a download: the revision and tree calls of /api/models, the file calls of /resolve.

    Server state (set by the test on `server`): repos {repo id: {path: bytes}}; token (files need
    `Authorization: Bearer <token>`, as a gated model's; metadata stays public, as on the Hub); broken (a file
    whose first GET stops half-way and whose later GETs fail with 500: a server that broke mid-file); requests
    (method, path, authorization) of every call."""

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        server = self.server
        path = self.path.split("?")[0]
        server.requests.append((self.command, path, self.headers.get("Authorization")))
        if m := re.fullmatch(r"/api/models/(.+)/(revision|tree)/[^/]+", path):
            files = server.repos.get(m[1])
            if files is None:
                return self._reply(
                    404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}
                )
            if m[2] == "revision":
                info = {"id": m[1], "sha": COMMIT, "siblings": [{"rfilename": name} for name in files]}
            else:
                info = [
                    {"type": "file", "path": n, "size": len(b), "oid": _sha1(b)} for n, b in files.items()
                ]
            return self._reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
        if m := re.fullmatch(r"/(.+)/resolve/[^/]+/(.+)", path):
            self._file(server.repos.get(m[1], {}), m[2])
            return
        self._reply(404, b"not found")

    def _file(self, files: dict[str, bytes], name: str) -> None:
        server = self.server
        if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
            status = 403 if self.headers.get("Authorization") else 401
            return self._reply(status, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"})
        if name not in files:
            return self._reply(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"})
        body = files[name]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(body).hexdigest()}"'}
        if name == server.broken and self.command == "GET":
            if server.broke:
                return self._reply(500, b"server down")
            server.broke = True
            self._reply(200, body[: len(body) // 2], {**headers, "Content-Length": str(len(body))})
            self.close_connection = True  # the client sees half of the bytes promised
            return
        self._reply(200, body, headers)

    def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        headers = {"Content-Length": str(len(body)), **(headers or {})}
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _sha1(body: bytes) -> str:
    return hashlib.sha1(body).hexdigest()


@pytest.fixture
def hub(repo):
    """A running FakeHub serving `repo` as gpt2 (the registered model's Hugging Face id)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    server.daemon_threads = True
    server.repos, server.token, server.broken, server.broke, server.requests = (
        {"gpt2": repo},
        None,
        None,
        False,
        [],
    )
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def env(tmp_path, hub) -> dict[str, str]:
    """The environment of a harness process: the Hub is `hub`; its cache and the disk caches are this
    test's."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "TRANSFORMERS_"))}
    out.pop("TRITON_INTERPRET", None)
    return {
        **out,
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf"),
        "KVBITS_CACHE": str(tmp_path / "kv"),
    }


def harness_cli(env: dict[str, str], tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """python -m harness on the tiny sizes, into tmp_path/run."""
    command = [sys.executable, "-m", "harness", "model=gpt2", "eval=tiny", "tracking.wandb.mode=disabled"]
    command += [f"run_dir={tmp_path / 'run'}", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The harness's error lines on stderr (huggingface_hub's progress bars and warnings are the rest)."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def snapshot(tmp_path: Path) -> Path:
    return tmp_path / "hf" / "hub" / "models--gpt2" / "snapshots" / COMMIT


def local_snapshot(tmp_path: Path) -> str:
    """gpt2's snapshot as a local-only look-up finds it (what harness.models.hf_folder asks)."""
    return snapshot_download("gpt2", cache_dir=tmp_path / "hf" / "hub", local_files_only=True, **HUB_FILES)


def fetched(hub) -> list[str]:
    """The files the server sent (GET of /resolve), in order."""
    return [
        path.rsplit(f"/{COMMIT}/", 1)[1]
        for method, path, _ in hub.requests
        if method == "GET" and "/resolve/" in path
    ]


# ------------------------------------------------------------------------------------------------- the CLI


def test_local_only_is_the_default_and_its_refusal_names_the_flag(env, tmp_path, hub):
    proc = harness_cli(env, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_lines(proc) == [
        f"error: model gpt2: weights of gpt2 are not on this machine (Hugging Face cache "
        f"{tmp_path / 'hf' / 'hub'}: absent); fetch them with model.download=true (HF_TOKEN for a gated "
        "model), or place them in the Hugging Face cache (HF_HOME)"
    ]
    assert not [
        r for r in hub.requests if r[1].startswith("/api/models") or "/resolve/" in r[1]
    ]  # never asked
    assert not (tmp_path / "run").exists()


def test_download_fetches_the_model_with_the_token_and_the_run_completes(env, tmp_path, hub, repo):
    hub.token = TOKEN  # a gated model: its files need the token
    proc = harness_cli({**env, "HF_TOKEN": TOKEN}, tmp_path, "model.download=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "model gpt2: fetching gpt2 from http://127.0.0.1" in proc.stderr and "Fetching" in proc.stderr
    )  # progress
    files = {path for path in repo if path not in EXTRA}
    assert sorted(fetched(hub)) == sorted(files)  # each file once; what a causal LM does not read stays there
    assert {auth for _, path, auth in hub.requests if "/resolve/" in path} == {f"Bearer {TOKEN}"}
    assert {p.name: p.read_bytes() for p in Path(local_snapshot(tmp_path)).iterdir()} == {
        n: repo[n] for n in files
    }
    rows = (tmp_path / "run" / "points").glob("*.json")
    assert {json.loads(p.read_text())["status"] for p in rows} == {"ok"}


REFUSED = (
    r"the Hugging Face Hub refused http://127\.0\.0\.1:\d+/gpt2 \(HTTP {}\): the model is gated or private; "
    r"accept its terms on its Hub page and set HF_TOKEN to a token with access"
)
REFUSALS = {  # case: (the token the process has, the message after "error: model gpt2: ")
    "gated, no token": (None, REFUSED.format("401, no token was sent")),
    "gated, wrong token": ("hf_wrong", REFUSED.format("403, a token was sent")),
    "unknown repository": (
        TOKEN,
        r"http://127\.0\.0\.1:\d+/gpt2 was not found \(HTTP 404\); check the model's hf_id",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refused_download_is_one_line_and_leaves_no_snapshot(env, tmp_path, hub, case):
    token, expected = REFUSALS[case]
    hub.token = TOKEN
    if case == "unknown repository":
        hub.repos.clear()
    env = env if token is None else {**env, "HF_TOKEN": token}
    proc = harness_cli(env, tmp_path, "model.download=true")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc)
    assert re.fullmatch(f"error: model gpt2: {expected}", line), line
    assert not snapshot(tmp_path).exists() and not (tmp_path / "run").exists()
    with pytest.raises(LocalEntryNotFoundError):
        local_snapshot(tmp_path)


def test_a_download_broken_mid_file_is_one_line_then_refused_local_only_then_resumed(
    env, tmp_path, hub, repo
):
    hub.broken = "model.safetensors"
    proc = harness_cli(env, tmp_path, "model.download=true")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc)
    assert re.fullmatch(
        r"error: model gpt2: the download of http://127\.0\.0\.1:\d+/gpt2 broke off \(HfHubHTTPError: "
        r"Server error '500 Internal Server Error' .*\); nothing incomplete is used, and "
        r"model\.download=true again resumes it",
        line,
    ), line
    # Whole files only in the snapshot, and the Hub's file list marks it incomplete for a local-only load.
    kept = {p.name: p.read_bytes() for p in snapshot(tmp_path).iterdir()}
    assert "model.safetensors" not in kept and all(repo[name] == body for name, body in kept.items())
    with pytest.raises(IncompleteSnapshotError):
        local_snapshot(tmp_path)
    assert not (tmp_path / "run").exists()

    # From Python: local-only refuses the incomplete snapshot naming download=True, which then resumes it.
    hub.broken, hub.requests = None, []  # the server is back
    script = textwrap.dedent("""
        import harness, torch
        from harness.models import ModelUnavailable
        try:
            harness.load("gpt2")
        except ModelUnavailable as err:
            print("refused:", err)
        model, tokenizer = harness.load("gpt2", download=True)
        ids = tokenizer("Hello", return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
        print("generated:", out.shape[1] - ids.shape[1])
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused, generated = proc.stdout.strip().splitlines()[-2:]
    assert refused == (
        f"refused: model gpt2: weights of gpt2 are not on this machine (Hugging Face cache "
        f"{tmp_path / 'hf' / 'hub'}: only partly: a download broke off); fetch them with download=True "
        "(HF_TOKEN for a gated model), or place them in the Hugging Face cache (HF_HOME)"
    )
    assert generated == "generated: 5"
    assert fetched(hub) == ["model.safetensors"]  # the files completed before are not fetched again
    assert Path(local_snapshot(tmp_path), "model.safetensors").read_bytes() == repo["model.safetensors"]
