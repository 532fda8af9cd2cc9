"""Decode steps of a QuantizedKVCache on the triton backend replayed from one CUDA graph, inside generate().

This module owns `graphed_decoding` and the `GraphedStep` under it. An eager decode step of a transformers model
waits on the host: on the H100 (results/kernels, check-6e86fcf's e2e profile) three 4-bit steps of a
Llama-3-8B-shaped model took 41 ms of device time and 104 ms of host time. A CUDA graph replays all of a step's
kernels from one host call. What makes the step replayable, the same at every step:
- every store holds the capacity for all the tokens up front (QuantizedKVCache.reserve): nothing reallocates;
- the write position and the attended length live on the device (QuantizedKVCache.device_positions): the
  quantize kernel writes there and the attention kernel reads that many tokens, its splits planned over the
  reserved capacity;
- the model gets cache_position and position_ids as device tensors and no attention mask (the fused kernel
  attends every stored token: no padded batches), so no shape depends on a host length.
A replay runs no Python, so the step advances the stores' host lengths itself. Within `graphed_decoding(model,
cache, max_tokens)` the model's one-token forwards over `cache` (generate()'s decode steps) go through the
graph: the first WARMUP_STEPS eagerly (they compile the kernels), then the capture, then replays. Prompt
forwards stay eager. Without CUDA (or graphs=False) the same steps run eagerly: one code path but the capture.
Beam search's reordering rewrites the stores' tensors in place (kernels.layout.PackedStore.take_rows), where the
replayed step reads them.
A batch that changes size and a crop (assisted generation, prompt lookup decoding), which would move the replayed
step's shapes or device-side positions, are one-line errors.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from harness.attention import PACKED, installed

WARMUP_STEPS = 2  # eager steps before the capture (they compile the kernels and allocate the workspaces)


class GraphedStep:
    """One-token forwards of `model` over `cache` (a QuantizedKVCache on the triton backend holding its prompt)
    at device-side positions, for a context of up to `max_tokens` tokens: `step(ids)` returns the logits. `graphs`:
    replay from one CUDA graph after WARMUP_STEPS eager steps (default: on CUDA). `forward`: what runs the model
    (default: calling it). `close()` gives the cache back on host lengths."""

    def __init__(self, model, cache, max_tokens: int, graphs: bool | None = None, forward=None):
        length = cache.get_seq_length()
        if not length:
            raise ValueError("cache: holds no tokens; run the prompt through the model first")
        if length >= max_tokens:
            raise ValueError(f"max_tokens: {max_tokens} leaves no room after the {length} stored tokens")
        self.forward = model if forward is None else forward
        self.cache, self.max_tokens = cache, max_tokens
        cache.reserve(max_tokens)
        device = cache.quantized_layers()[0].device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        if self.graphs and device.type != "cuda":
            raise ValueError(f"graphs: CUDA graphs need the cache on CUDA, not {device}")
        self.position = torch.tensor([length], dtype=torch.int32, device=device)  # where the next K/V go
        self.length = self.position + 1  # the tokens the next step attends
        self.cache_position = torch.tensor([length], dtype=torch.long, device=device)
        cache.device_positions((self.position, self.length))
        self.ids: torch.Tensor | None = None  # (B, 1) the step's input, written before each step
        self.logits: torch.Tensor | None = None  # (B, 1, vocab) its output, rewritten by each step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.steps = 0

    def resync(self) -> None:
        """Device positions from the host length, after forwards that did not go through `step`."""
        n = self.cache.get_seq_length()
        self.position.fill_(n)
        self.length.fill_(n + 1)
        self.cache_position.fill_(n)

    def _forward(self) -> None:
        """One decode step on the device-side state, replayable: the model, then the positions advance."""
        self.logits = self.forward(
            input_ids=self.ids,
            position_ids=self.cache_position.view(1, 1),
            cache_position=self.cache_position,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits
        for t in (self.position, self.length, self.cache_position):
            t.add_(1)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, 1) -> logits (B, 1, vocab), valid until the next step: an eager step, the capture (and its
        first replay) after WARMUP_STEPS of them, or a replay."""
        if self.cache.get_seq_length() + 1 > self.max_tokens:
            raise RuntimeError(f"graphed decoding: the context reached max_tokens {self.max_tokens}")
        if self.ids is None or self.ids.shape != ids.shape:
            if self.graph is not None:
                raise ValueError(
                    f"ids: shape {tuple(ids.shape)}, the captured step's is {tuple(self.ids.shape)}"
                )
            self.ids = torch.empty_like(ids)
        self.ids.copy_(ids)
        if self.graph is not None:
            self.graph.replay()
            for layer in self.cache.quantized_layers():  # what the replayed step's Python would have counted
                layer.k_store.advance(1)
                layer.v_store.advance(1)
        elif self.graphs and self.steps == WARMUP_STEPS:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._forward()  # records the kernels; the Python runs once, counting the host lengths
            self.graph.replay()
        elif self.graphs:  # warm-up on a side stream, as torch.cuda.graph asks
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward()
            torch.cuda.current_stream().wait_stream(side)
        else:
            self._forward()
        self.steps += 1
        return self.logits

    def close(self) -> None:
        """Back to host lengths (the cache stays usable as any QuantizedKVCache); the graph is dropped."""
        self.cache.device_positions(None)
        self.graph = None


@contextlib.contextmanager
def graphed_decoding(model, cache, max_tokens: int, graphs: bool | None = None) -> Iterator[None]:
    """Within the block, `model` attends quantized caches from their packed form (as in
    harness.packed_attention), and its one-token forwards over `cache` (generate()'s decode steps) replay from
    one CUDA graph: `model.generate(ids, past_key_values=cache, ...)` gives the tokens it gives without the
    block, sampling, stopping and streaming included.

    cache: an empty QuantizedKVCache built with backend="triton" (every layer full attention, on CUDA); it
        reserves `max_tokens` tokens (prompt and new ones) once the prompt is in. No padded batches: a prompt
        forward with an attention mask that hides a token is refused (the replayed step attends every token).
    graphs: capture and replay (default: on CUDA); False, or without CUDA, runs the same steps eagerly.
    Forwards of more than one token (the prompt) and over other caches run as usual.
    """
    if cache.get_seq_length() != 0:
        raise ValueError("cache: holds tokens already; graphed decoding starts from an empty cache")
    forward = model.forward
    own_forward = "forward" in vars(model)  # an instance attribute (a hook's wrapper) to put back, or none
    state: dict[str, GraphedStep | None] = {"step": None}

    @functools.wraps(forward)
    def graphed_forward(*args, **kwargs):
        if kwargs.get("past_key_values") is not cache:
            return forward(*args, **kwargs)
        for name in ("output_attentions", "output_hidden_states"):
            if kwargs.get(name):
                raise NotImplementedError(
                    f"graphed_decoding: {name}=True (a replayed step returns logits only)"
                )
        ids, step = kwargs.get("input_ids", args[0] if args else None), state["step"]
        if step is not None and ids is not None and ids.shape[1] == 1:  # a decode step
            return CausalLMOutputWithPast(logits=step.step(ids), past_key_values=cache)
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise NotImplementedError(
                "graphed_decoding: the attention mask hides tokens (a padded batch); the replayed decode step "
                "attends every stored token"
            )
        out = forward(*args, **kwargs)  # the prompt (or a first single token), eagerly
        if step is None:
            state["step"] = GraphedStep(model, cache, max_tokens, graphs, forward)
        else:
            step.resync()
        return out

    with installed(model, PACKED):
        model.forward = graphed_forward
        try:
            yield
        finally:
            if own_forward:
                model.forward = forward
            else:
                del model.forward  # the class's forward again
            if state["step"] is not None:
                state["step"].close()
