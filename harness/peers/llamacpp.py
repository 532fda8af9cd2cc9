"""llama.cpp as a peer: its KV cache types, measured on the harness's teacher-forced windows.

The model is the GGUF file the harness loads (harness.models.gguf_path), run by llama.cpp through
llama-cpp-python with flash attention on (llama.cpp needs it for a quantized V cache), K and V both stored as
one cache type. A llama.cpp context is driven by harness.evaluate.teacher_forced itself (LlamaCppModel below):
the same token ids, the same chunks (one llama_decode per chunk of eval.chunk tokens, n_batch = n_ubatch =
chunk, so every K/V is written to the cache, quantized, before any query of its chunk reads it), the same
metrics. The quantized types are compared with llama.cpp's own f16 cache on the same windows: ppl_ratio and KL
of its full logits (llama-cpp-python's logits_all).

Rotation: llama.cpp multiplies K and V of a quantized cache by a Hadamard matrix (head_dim a multiple of 64).
The pinned llama.cpp reads the environment variable LLAMA_ATTN_ROT_DISABLE when it builds a context's KV cache
(llama_kv_cache's constructor, src/llama-kv-cache.cpp), so it is set per context here and restored after.

True bytes come from ggml's block sizes (ggml/src/ggml-common.h: a block of 32 elements is 18 bytes in q4_0 and
iq4_nl, 20 in q4_1, 22 in q5_0, 24 in q5_1, 34 in q8_0; f16 is 2 bytes per element) over the layers' KV heads
and head_dim, sliding-window layers holding their window as harness.capacity counts them.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from harness import evaluate
from harness.capacity import held_tokens
from harness.config import Point
from harness.models import gguf_path, model_spec
from harness.peers.record import fp16_bytes, model_shape, record

ROTATION_ENV = "LLAMA_ATTN_ROT_DISABLE"


@dataclass(frozen=True)
class KVType:
    """A llama.cpp cache type: its ggml_type enum value (ggml.h) and its block (elements, bytes)."""

    ggml_type: int
    block: int
    block_bytes: int

    def row_bytes(self, elements: int) -> int:
        """Bytes of `elements` contiguous values (one head's K or V of one token)."""
        if elements % self.block:
            raise ValueError(f"head_dim {elements} is not a multiple of the block size {self.block}")
        return elements // self.block * self.block_bytes


KV_TYPES = {
    "f16": KVType(1, 1, 2),
    "q8_0": KVType(8, 32, 34),
    "q5_1": KVType(7, 32, 24),
    "q5_0": KVType(6, 32, 22),
    "q4_1": KVType(3, 32, 20),
    "q4_0": KVType(2, 32, 18),
    "iq4_nl": KVType(20, 32, 18),
}


def cache_bytes(model: str, kv_type: str, tokens: int) -> int:
    """Bytes a cache of `kv_type` K and V holds for one sequence of `tokens` tokens of a registered model."""
    kind = KV_TYPES[kv_type]
    total = 0
    for layer in model_shape(model).layers:
        if layer.cached:
            held = held_tokens(layer, tokens)[1]  # no fp16 sink or residual tokens
            total += held * layer.kv_heads * 2 * kind.row_bytes(layer.head_dim)  # K and V
    return total


@contextlib.contextmanager
def _rotation(enabled: bool):
    """LLAMA_ATTN_ROT_DISABLE set for the contexts made inside (0: llama.cpp's default, rotation on)."""
    before = os.environ.get(ROTATION_ENV)
    os.environ[ROTATION_ENV] = "0" if enabled else "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ROTATION_ENV]
        else:
            os.environ[ROTATION_ENV] = before


def open_llama(
    path,
    kv_type: str,
    rotation: bool,
    n_ctx: int,
    chunk: int,
    logits_all: bool = True,
    threads: int | None = None,
):
    """A llama_cpp.Llama on the GGUF at `path`: K and V as `kv_type`, flash attention on, one decode per chunk.

    threads: default torch's thread count (OMP_NUM_THREADS sets both). llama.cpp's threads meet at spinning
    barriers after every op: on cores other processes also use, more threads than free cores make it tens of
    times slower (2 threads on 2 busy cores decoded SmolLM2 at under 1 token/s, 1 thread at about 30).
    """
    from llama_cpp import Llama

    threads = threads or torch.get_num_threads()
    with _rotation(rotation):
        return Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=chunk,
            n_ubatch=chunk,
            n_threads=threads,
            n_threads_batch=threads,
            type_k=KV_TYPES[kv_type].ggml_type,
            type_v=KV_TYPES[kv_type].ggml_type,
            flash_attn=True,
            logits_all=logits_all,
            verbose=False,
        )


class LlamaCppModel:
    """A llama.cpp context in the shape harness.evaluate drives a model: called with the next chunk of one sequence
    (input_ids (1, L), position_ids (1, L) continuing the context), it returns logits (1, L, V) float32.

    `fresh_cache()` is the cache factory: it empties the context and returns a token standing for its cache.
    """

    training = False
    device = torch.device("cpu")

    def __init__(self, llm):
        self.llm = llm

    def fresh_cache(self) -> SimpleNamespace:
        self.llm.reset()  # n_tokens = 0: the next eval removes every cached token first
        return SimpleNamespace(context=self.llm)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **_) -> SimpleNamespace:
        batch, length = input_ids.shape
        if batch != 1:
            raise ValueError("a llama.cpp context holds one sequence: evaluate with batch_size=1")
        start = self.llm.n_tokens
        if int(position_ids[0, 0]) != start:
            raise ValueError(f"chunk at position {int(position_ids[0, 0])}, the context holds {start} tokens")
        self.llm.eval(input_ids[0].tolist())
        logits = torch.from_numpy(self.llm.scores[start : start + length].copy())  # (L, V) float32
        return SimpleNamespace(logits=logits[None])  # (1, L, V)


def teacher_forced(
    path,
    sequences: torch.Tensor,
    kv_type: str,
    rotation: bool,
    chunk: int,
    baseline=None,
    score_from: int = 0,
) -> evaluate.TeacherForced:
    """harness.evaluate.teacher_forced of sequences (S, T) through llama.cpp with a `kv_type` cache (scoring tokens
    score_from..T-1)."""
    llm = open_llama(path, kv_type, rotation, n_ctx=sequences.shape[1], chunk=chunk)
    try:
        model = LlamaCppModel(llm)
        return evaluate.teacher_forced(
            model,
            sequences,
            model.fresh_cache,
            chunk=chunk,
            batch_size=1,
            baseline=baseline,
            score_from=score_from,
        )
    finally:
        llm.close()


def measure(ctx, point: Point) -> dict:
    """A llamacpp point's record body on ctx's teacher-forced sequences, against llama.cpp's f16 cache."""
    path = gguf_path(model_spec(point.model))
    chunk = point.chunk
    if "llamacpp_f16" not in ctx.peer_state:
        ctx.peer_state["llamacpp_f16"] = teacher_forced(
            path, ctx.sequences, "f16", False, chunk, score_from=point.score_from
        )
    f16 = ctx.peer_state["llamacpp_f16"]
    if point.scheme == "f16":  # the reference itself: every comparison at identity
        run = evaluate.TeacherForced(f16.targets, f16.nll, f16.top1, kl=torch.zeros_like(f16.nll))
    else:
        run = teacher_forced(
            path,
            ctx.sequences,
            point.scheme,
            point.rotation,
            chunk,
            baseline=f16,
            score_from=point.score_from,
        )
    sequences, tokens = ctx.sequences.shape[0], ctx.sequences.shape[1] - 1  # token T-1 is never fed
    held = sequences * cache_bytes(point.model, point.scheme, tokens)
    fp16 = fp16_bytes(point.model, tokens, sequences)
    return record(f16, run, point.budget, held, fp16, sequences * tokens)
