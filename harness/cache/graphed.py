"""Greedy decoding with a QuantizedKVCache on the triton backend, each decode step replayed from one CUDA graph.

This module owns `GraphedDecoder` and `generate_graphed`. An eager decode step waits on the host: on the H100
(results/kernels, check-6e86fcf's e2e profile) three 4-bit steps of a Llama-3-8B-shaped model took 41 ms of
device time and 104 ms of host time. A CUDA graph replays all of a step's kernels from one host call. What makes
the step replayable, the same at every step:
- every store holds the capacity for all the tokens up front (QuantizedKVCache.reserve): nothing reallocates;
- the write position and the attended length live on the device (QuantizedKVCache.device_positions): the
  quantize kernel writes there and the attention kernel reads that many tokens, its splits planned over the
  reserved capacity;
- the model gets cache_position and position_ids as device tensors and no attention mask (the fused kernel
  attends every stored token: no padded batches), so no shape depends on a host length;
- the greedy choice of the next token runs inside the step, writing the next step's input in place.
A replay runs no Python, so the decoder advances the stores' host lengths itself. Without graphs (CPU, where the
kernels run in Triton's interpreter, or graphs=False) the same step runs eagerly: one code path but the capture.
"""

from __future__ import annotations

import contextlib

import torch

from harness.attention import PACKED, installed

WARMUP_STEPS = 2  # eager steps before the capture (they compile the kernels and allocate the workspaces)


class GraphedDecoder:
    """Greedy decode steps of `model` over `cache` (an empty QuantizedKVCache on the triton backend) for up to
    `max_tokens` tokens of context: `prefill(input_ids)`, then `step()` per token. `graphs`: replay each step
    from one CUDA graph after WARMUP_STEPS eager ones (default: on CUDA). Use as a context manager, or call
    `close()`: the cache goes back to host lengths, usable as any QuantizedKVCache."""

    def __init__(self, model, cache, max_tokens: int, graphs: bool | None = None):
        if cache.get_seq_length() != 0:
            raise ValueError("cache: holds tokens already; GraphedDecoder prefills an empty cache")
        self.model, self.cache, self.max_tokens = model, cache, max_tokens
        self.graphs = graphs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.steps = 0
        self._installed = contextlib.ExitStack()
        self._installed.enter_context(installed(model, PACKED))

    def prefill(self, input_ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """input_ids (B, T) -> the first new token (B, 1): eager forwards of the prompt, `chunk` tokens at a time
        (None: all at once), after which every layer holds its capacity for max_tokens and decodes at
        device-side positions."""
        B, T = input_ids.shape
        if T > self.max_tokens:
            raise ValueError(f"max_tokens: {self.max_tokens} is less than the prompt's {T} tokens")
        device = input_ids.device
        if self.graphs is None:
            self.graphs = device.type == "cuda"
        elif self.graphs and device.type != "cuda":
            raise ValueError(f"graphs: CUDA graphs need the model on CUDA, not {device}")
        for start in range(0, T, chunk or T):
            part = input_ids[:, start : start + (chunk or T)]
            out = self.model(input_ids=part, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.ids = out.logits[:, -1].argmax(
            -1, keepdim=True
        )  # (B, 1): the next step's input, rewritten in place
        self.cache.reserve(self.max_tokens)
        self.position = torch.tensor([T], dtype=torch.int32, device=device)  # where the next token's K/V go
        self.length = self.position + 1  # the tokens the next step attends
        self.cache_position = torch.tensor([T], dtype=torch.long, device=device)
        self.cache.device_positions((self.position, self.length))
        return self.ids.clone()

    def _forward(self) -> None:
        """One decode step on the device-side state, replayable: the model, the greedy token, the positions."""
        out = self.model(
            input_ids=self.ids,
            position_ids=self.cache_position.view(1, 1),
            cache_position=self.cache_position,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        for t in (self.position, self.length, self.cache_position):
            t.add_(1)

    def step(self) -> torch.Tensor:
        """The next token (B, 1) after the last one: an eager step, the capture (and first replay) after
        WARMUP_STEPS of them, or a replay."""
        if self.cache.get_seq_length() + 1 > self.max_tokens:
            raise RuntimeError(f"GraphedDecoder: the context reached max_tokens {self.max_tokens}")
        if self.graph is not None:
            self.graph.replay()
            for layer in self.cache.quantized_layers():  # what the replayed step's Python would have counted
                layer.k_store.length += 1
                layer.v_store.length += 1
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
        return self.ids.clone()

    def close(self) -> None:
        """Back to host lengths (the cache stays usable); drop the graph and the packed attention's install."""
        self.cache.device_positions(None)
        self.graph = None
        self._installed.close()

    def __enter__(self) -> GraphedDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@torch.no_grad()
def generate_graphed(
    model, cache, input_ids: torch.Tensor, max_new_tokens: int, graphs: bool | None = None
) -> torch.Tensor:
    """input_ids (B, T) -> (B, T + max_new_tokens): greedy tokens (no stop token), as
    `model.generate(input_ids, past_key_values=cache, max_new_tokens=..., do_sample=False)` within
    harness.packed_attention, each decode step but the first few replayed from one CUDA graph (`graphs`, default
    on CUDA). `cache`: an empty QuantizedKVCache on the triton backend, every layer full attention."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: {max_new_tokens}; allowed: 1 or more")
    with GraphedDecoder(model, cache, input_ids.shape[1] + max_new_tokens - 1, graphs) as decoder:
        tokens = [decoder.prefill(input_ids)]
        tokens += [decoder.step() for _ in range(max_new_tokens - 1)]
    return torch.cat([input_ids, *tokens], dim=1)
