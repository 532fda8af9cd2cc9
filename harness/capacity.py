"""KV-cache capacity: the bytes a cache holds for a model, a context, a batch and an allocation of widths, and the
longest context that fits a memory size. `python -m harness.capacity --help`.

This module owns the arithmetic and nothing else (no weights, no tensors). Two conventions, as DESIGN.md 3.4:
- true bytes: what harness.cache.QuantizedKVCache.nbytes() reports for a real cache holding the same tokens,
  summed per layer, KV head and role (keys and values are both stored): packed payload (2/4/8-bit codes packed
  into uint8, 3-bit densely at 3 bits per code: kernels.reference.packed_dim), fp16 scales (and zeros for asym)
  per group of g along head_dim (keys: key_group_size; kivi's keys per channel over groups of g tokens, moved
  out of the residual window a whole group at a time), 16-bit heads, sink tokens and the residual window at 2
  bytes per element; keys and values each at their own widths and their role's byte model;
  a fitted table held once per layer and quantized KV head whatever the tokens and batch (Scheme.table_bytes:
  calkey's key scales and zeros), once the cache holds a token;
  sliding-window layers hold window - 1 tokens after an update (as QuantizedSlidingLayer), sink tokens leave a
  sliding window like any token; linear-attention state (conv + recurrent, at 2 bytes per element, as
  QuantizedKVCache.linear_state_nbytes) is reported apart and counted only in `total_bytes`.
- nominal bytes: fp16 bytes x mean_bits / 16 (the claim's "16 / mean bits" compression), where mean_bits is the
  plain mean of the widths over the cached (layer, KV head, K|V) units, as harness.policies.Allocation.mean_bits.

Model shapes come from a transformers config (a registered model's, a local config.json, or a preset of a model
we do not have, built through transformers' own config class so per-layer head_dim and KV heads are its), or
from explicit numbers. The bytes of one stored token of one head in one role are the scheme's (harness.schemes,
Scheme.token_bytes: the one byte model the cache's nbytes() also follows).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from transformers import AutoConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from harness.models import ModelUnavailable, gguf_config, gguf_path, hf_folder, model_spec
from harness.registry import unknown_name_message
from harness.schemes import KMEANS, ROLES, SCHEME_OPTIONS, SCHEMES, AsymToken, Scheme, from_point
from kernels.layout import FP16_BYTES, FULL_WIDTH

GIB = 2**30
GB = 10**9
KINDS = ("full", "sliding", "linear", "shared")  # "shared": reuses another layer's KV (Gemma 4), stores none
MAX_TOKENS = 2**40  # max_context's search bound: a cache that still fits there is unbounded (no full layers)
DEFAULT_SCHEME = AsymToken()  # asym_token g32, no fp16 sink or residual tokens


# ------------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer's cache: `kind` in KINDS; keys and values both (kv_heads, head_dim) per token."""

    kind: str
    kv_heads: int = 0
    head_dim: int = 0
    window: int | None = (
        None  # sliding layers: the model's sliding_window (the layer holds window - 1 tokens)
    )
    state_bytes: int = 0  # linear layers: conv + recurrent state per sequence, 2 bytes per element

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"layer kind: unknown {self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.kind == "sliding" and (self.window is None or self.window < 2):
            raise ValueError(f"sliding_window: {self.window!r}; a sliding layer needs a window >= 2")

    @property
    def cached(self) -> bool:
        return self.kind in ("full", "sliding")


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: tuple[LayerShape, ...]
    context_limit: int | None = None

    def cached_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.cached]


def _linear_state_bytes(config) -> int:
    """Conv + recurrent state bytes per sequence of one gated-delta-net layer (Qwen3.5 / Qwen3-Next)."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    conv = (2 * key_dim + value_dim) * config.linear_conv_kernel_dim  # (conv_dim, kernel)
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return (conv + recurrent) * FP16_BYTES


def shape_from_config(config, name: str = "config", context_limit: int | None = None) -> ModelShape:
    """A ModelShape from a transformers config, with the layer types and per-layer geometry transformers'
    caches use (get_layer_types_and_kwargs, per_layer_config)."""
    text = config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(text)
    layers = []
    for layer_type, kw, layer in zip(types, kwargs, text.per_layer_config):
        heads = getattr(layer, "num_attention_heads", None) or text.num_attention_heads
        kv_heads = getattr(layer, "num_key_value_heads", None) or heads
        head_dim = getattr(layer, "head_dim", None) or text.hidden_size // heads
        if layer_type == "full_attention":
            layers.append(LayerShape("full", kv_heads, head_dim))
        elif layer_type in ("sliding_attention", "chunked_attention"):
            layers.append(LayerShape("sliding", kv_heads, head_dim, window=kw["sliding_window"]))
        elif layer_type == "linear_attention":
            layers.append(LayerShape("linear", state_bytes=_linear_state_bytes(text)))
        elif layer_type == "dummy":
            layers.append(LayerShape("shared"))
        else:
            raise NotImplementedError(f"harness.capacity: layer type {layer_type!r} is not modelled")
    limit = context_limit or getattr(text, "max_position_embeddings", None)
    return ModelShape(name, tuple(layers), limit)


def element_price(shape: ModelShape, scheme: Scheme):
    """price(bits, role) -> bytes per stored element of `role` (keys or values) of the model's cached KV heads,
    averaged over them by their head_dim: the byte model that a bytes budget (harness.policies) charges each
    unit (a head's keys, its values). A fitted table (Scheme.table_bytes) is held once whatever the context, so no
    token is charged for it."""
    cached = [layer for layer in shape.layers if layer.cached]
    elements = sum(layer.kv_heads * layer.head_dim for layer in cached)

    def price(bits: int, role: str) -> float:
        held = sum(layer.kv_heads * scheme.token_bytes(bits, layer.head_dim, role) for layer in cached)
        return held / elements

    return price


def shape_from_registry(name: str) -> ModelShape:
    """The shape of a model in conf/model (tiny: its config; gguf: the GGUF's metadata; hf: a local config)."""
    spec = model_spec(name)
    if spec["source"] == "tiny":
        config = AutoConfig.for_model(spec["arch"], **spec["config"])
    elif spec["source"] == "gguf_package":
        path = gguf_path(spec)
        config = gguf_config(name, path)  # kept on disk after the first parse of the metadata
    else:
        try:
            config = AutoConfig.from_pretrained(hf_folder(spec), local_files_only=True)
        except OSError as err:
            where = spec.get("path") or spec["hf_id"]
            raise ModelUnavailable(f"model {name}: no local config for {where}; {spec['install']}") from err
    return shape_from_config(config, name, spec.get("context_limit"))


def shape_from_json(path: str | Path) -> ModelShape:
    """The shape of a model from its config.json (model_type selects transformers' config class)."""
    values = json.loads(Path(path).read_text())
    if "model_type" not in values:
        raise ValueError(f"capacity.config: {path} has no model_type")
    return shape_from_config(AutoConfig.for_model(values.pop("model_type"), **values), Path(path).stem)


def explicit_shape(
    full: tuple[int, int, int] | None = None,
    sliding: tuple[int, int, int, int] | None = None,
    linear: tuple[int, int] | None = None,
    name: str = "explicit",
) -> ModelShape:
    """A shape from numbers: full = (layers, kv_heads, head_dim), sliding = (layers, kv_heads, head_dim, window),
    linear = (layers, state bytes per sequence). Layer order does not change any byte count."""
    layers = []
    if full:
        layers += [LayerShape("full", full[1], full[2])] * full[0]
    if sliding:
        layers += [LayerShape("sliding", sliding[1], sliding[2], window=sliding[3])] * sliding[0]
    if linear:
        layers += [LayerShape("linear", state_bytes=linear[1])] * linear[0]
    if not layers:
        raise ValueError("capacity: give at least one of --full, --sliding, --linear")
    return ModelShape(name, tuple(layers))


# Models we do not have, as transformers config kwargs. gemma4-31b: google/gemma-4-31B's text config as quoted
# by several public parsers (not read from Google's file here): 60 layers, 5 sliding (window 1024, 16 KV heads
# x 256) then 1 global (4 KV heads x 512, attention_k_eq_v: V is K before RoPE, normed, and is stored too).
PRESETS = {
    "gemma4-31b": dict(
        model_type="gemma4_text",
        num_hidden_layers=60,
        hidden_size=5376,
        intermediate_size=21504,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=256,
        num_global_key_value_heads=4,
        global_head_dim=512,
        attention_k_eq_v=True,
        sliding_window=1024,
        max_position_embeddings=262144,
    ),
}


def shape_from_preset(name: str) -> ModelShape:

    if name not in PRESETS:
        raise ValueError(unknown_name_message("capacity.preset", name, sorted(PRESETS)))
    values = dict(PRESETS[name])
    return shape_from_config(AutoConfig.for_model(values.pop("model_type"), **values), name)


# ------------------------------------------------------------------------------------------------- bytes


def layer_bits(shape: ModelShape, bits) -> list[list[int]]:
    """Widths per layer and KV head from one int, or per layer (a [L, H] tensor or nested lists; rows of layers
    without a KV cache are ignored, and a row as long as the most KV heads of a cached layer is padding past
    the layer's own heads, so a harness.policies.Allocation's bits fit)."""
    if isinstance(bits, int) and not isinstance(bits, bool):
        return [[bits] * layer.kv_heads for layer in shape.layers]
    rows = bits.tolist() if hasattr(bits, "tolist") else [list(row) for row in bits]
    if len(rows) != len(shape.layers):
        raise ValueError(f"bits: {len(rows)} rows for a model of {len(shape.layers)} layers")
    width = max((layer.kv_heads for layer in shape.layers if layer.cached), default=0)  # padded rows
    out = []
    for i, (row, layer) in enumerate(zip(rows, shape.layers)):
        if not layer.cached:
            out.append([])
            continue
        if len(row) not in (layer.kv_heads, width):
            raise ValueError(
                f"bits: layer {i} has {layer.kv_heads} KV heads but {len(row)} widths were given"
            )
        out.append([int(b) for b in row[: layer.kv_heads]])
    return out


def held_tokens(
    layer: LayerShape, tokens: int, sink_tokens: int = 0, residual: int = 0, chunk: int = 1
) -> tuple[int, int]:
    """(tokens kept at 16 bits, tokens quantized) that `layer` holds after `tokens` tokens, as the cache's stores
    keep them: sinks are sequence positions [0, sink_tokens), the residual window the newest tokens after them;
    a per-channel role quantizes whole chunks of `chunk` tokens only (kivi's keys: more stay in the window). A
    sliding window that evicts part of a chunk is not modelled (the chunk's codes stay stored until it leaves)."""
    held = tokens if layer.kind == "full" else min(tokens, layer.window - 1)
    sinks = max(0, min(sink_tokens, tokens) - (tokens - held))  # sinks still inside a sliding window
    residual = min(residual, held - sinks)
    quantized = (held - sinks - residual) // chunk * chunk
    return held - quantized, quantized


def mean_bits(shape: ModelShape, bits, value_bits=None) -> float:
    """Mean width over the cached (layer, KV head, K|V) units; value_bits None: the values at `bits`."""
    widths = [
        b
        for grid in (bits, bits if value_bits is None else value_bits)
        for row in layer_bits(shape, grid)
        for b in row
    ]
    return sum(widths) / len(widths)


@dataclass
class CacheBytes:
    """What a cache holds for `batch` sequences of `tokens` tokens (a row of the capacity table)."""

    tokens: int
    batch: int
    true_bytes: int  # the K/V stores, as QuantizedKVCache.nbytes()
    fp16_bytes: int  # an unquantized 2-byte cache of the same tokens, as QuantizedKVCache.nbytes_fp16()
    mean_bits: float
    linear_state_bytes: int  # as QuantizedKVCache.linear_state_nbytes(); not in true_bytes
    by_kind: dict = field(default_factory=dict)  # kind -> true bytes of that kind's layers

    @property
    def nominal_bytes(self) -> float:
        return self.fp16_bytes * self.mean_bits / FULL_WIDTH

    @property
    def total_bytes(self) -> int:
        return self.true_bytes + self.linear_state_bytes

    @property
    def compression_true(self) -> float:
        return self.fp16_bytes / self.true_bytes if self.true_bytes else math.nan

    @property
    def compression_nominal(self) -> float:
        return FULL_WIDTH / self.mean_bits


def cache_bytes(
    shape: ModelShape,
    tokens: int,
    bits,
    scheme: Scheme = DEFAULT_SCHEME,
    batch: int = 1,
    value_bits=None,
    count_tables: bool = True,
) -> CacheBytes:
    """True, fp16 and nominal bytes of `batch` sequences after `tokens` tokens; `bits` (the keys', and the values'
    unless `value_bits` gives theirs) as in layer_bits. count_tables False: the fitted tables left out (a scheme whose
    tables' size only its fit knows, unbound, can still be priced per token)."""
    for key, value in (("capacity.context", tokens), ("capacity.batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{key}: {value!r} is not a non-negative integer")
    roles = dict(
        zip(ROLES, (layer_bits(shape, bits), layer_bits(shape, bits if value_bits is None else value_bits)))
    )
    true = fp16 = state = 0
    by_kind: dict[str, int] = {}
    for i, layer in enumerate(shape.layers):
        state += layer.state_bytes * batch
        if not layer.cached:
            continue
        tokens_held = sum(held_tokens(layer, tokens, scheme.sink_tokens, scheme.residual))
        held = 0
        for role, widths in roles.items():
            chunk = scheme.role_group_size(role) if scheme.per_channel(role) else 1
            unquantized, quantized = held_tokens(layer, tokens, scheme.sink_tokens, scheme.residual, chunk)
            held += sum(
                unquantized * scheme.token_bytes(FULL_WIDTH, layer.head_dim, role)
                + quantized * scheme.token_bytes(b, layer.head_dim, role)
                for b in widths[i]
            )  # every head of the layer in this role
        # fitted tables (calkey's keys): once per layer and quantized head, whatever the tokens and batch
        tables = (
            sum(scheme.table_bytes(b, layer.head_dim, r) for r, w in roles.items() for b in w[i])
            if tokens and count_tables
            else 0
        )
        layer_true = round(batch * held) + tables  # a per-channel role's whole groups: an integer
        true += layer_true
        by_kind[layer.kind] = by_kind.get(layer.kind, 0) + layer_true
        fp16 += 2 * batch * tokens_held * layer.kv_heads * layer.head_dim * FP16_BYTES
    return CacheBytes(tokens, batch, true, fp16, mean_bits(shape, bits, value_bits), state, by_kind)


def _peak_bytes(shape: ModelShape, tokens: int, bits, scheme: Scheme, batch: int, value_bits=None) -> int:
    """The most bytes (K/V and linear state) held at any length up to `tokens`.

    Per layer the bytes are piecewise linear in the length, with kinks where sinks fill, the residual fills, a
    sliding window fills and its sinks have left, and drops where a per-channel role moves a group of g tokens
    out of the residual window (each later group adds bytes, so the last length before a move is the highest
    of them); the maximum over [0, tokens] lies at one of those or at tokens.
    """
    s, r = scheme.sink_tokens, scheme.residual
    kinks = {s, s + r}
    for role in ROLES:
        g = scheme.role_group_size(role)
        if scheme.per_channel(role) and tokens - s - r >= g:
            kinks.add(s + r + (tokens - s - r) // g * g - 1)  # just before the last group moved
    for layer in shape.layers:
        if layer.kind == "sliding":
            kinks |= {layer.window - 1, layer.window - 1 + s}
    lengths = [t for t in kinks if t < tokens] + [tokens]
    return max(cache_bytes(shape, t, bits, scheme, batch, value_bits).total_bytes for t in lengths)


def max_context(
    shape: ModelShape,
    memory_bytes: int,
    bits,
    scheme: Scheme = DEFAULT_SCHEME,
    batch: int = 1,
    value_bits=None,
) -> int | None:
    """The longest context whose cache never exceeds memory_bytes on the way there (K/V plus linear state);
    -1 if not even an empty cache fits, None if every length fits (no full-attention layer)."""
    fits = lambda t: _peak_bytes(shape, t, bits, scheme, batch, value_bits) <= memory_bytes  # noqa: E731
    if not fits(0):
        return -1
    if fits(MAX_TOKENS):
        return None
    low, high = 0, MAX_TOKENS  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


# ---------------------------------------------------------------------------------------------------- CLI


def _ints(text: str, count: int, flag: str) -> tuple[int, ...]:
    parts = text.split(":")
    if len(parts) != count or not all(p.isdigit() for p in parts):
        raise ValueError(f"{flag}: {text!r}; expected {count} integers joined by ':'")
    return tuple(int(p) for p in parts)


def _bits_from(path: str) -> tuple[list[list[int]], list[list[int]]]:
    """The keys' and the values' widths of a harness point JSON (results/<sweep>/<run>/points/<key>.json; rows
    made before keys and values could differ hold one `bits` for both)."""
    record = json.loads(Path(path).read_text())
    if "allocation" not in record:
        raise ValueError(f"capacity.bits_from: {path} holds no allocation (a point JSON of a quantized run)")
    allocation = record["allocation"]
    if "key_bits" in allocation:
        return allocation["key_bits"], allocation["value_bits"]
    return allocation["bits"], allocation["bits"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.capacity", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a name from conf/model")
    src.add_argument("--config", help="a local config.json")
    src.add_argument("--preset", help=f"a model we do not have: {', '.join(PRESETS)}")
    src.add_argument("--full", help="explicit full-attention layers: LAYERS:KV_HEADS:HEAD_DIM")
    p.add_argument("--sliding", help="explicit sliding layers (with --full): LAYERS:KV_HEADS:HEAD_DIM:WINDOW")
    p.add_argument("--linear", help="explicit linear layers (with --full): LAYERS:STATE_BYTES_PER_SEQUENCE")
    p.add_argument("--context", type=int, nargs="+", required=True, help="tokens held (one or more)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--bits", type=int, nargs="+", default=[4], help="uniform widths to report (16 = fp16)")
    p.add_argument("--bits-from", help="a point JSON whose allocation gives the widths (replaces --bits)")
    p.add_argument("--scheme", default="asym_token", help=f"one of {', '.join(SCHEMES)}")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument(
        "--key-group-size", type=int, default=None, help="the keys' groups (default: --group-size)"
    )
    p.add_argument("--sink-tokens", type=int, default=0)
    p.add_argument("--residual", type=int, default=0)
    p.add_argument(
        "--outliers", type=float, default=0.0, help="share of each key kept in fp16 with its index (calkey)"
    )
    p.add_argument("--key-levels", default=KMEANS, help="how nuqkey's key levels are fitted (bytes alike)")
    p.add_argument(
        "--memory-gib", type=float, nargs="*", default=[], help="report the longest context that fits"
    )
    p.add_argument("--json", action="store_true", help="print JSON rows instead of the table")
    return p


def _shape(args) -> ModelShape:
    if args.model:
        return shape_from_registry(args.model)
    if args.config:
        return shape_from_json(args.config)
    if args.preset:
        return shape_from_preset(args.preset)
    return explicit_shape(
        _ints(args.full, 3, "--full"),
        _ints(args.sliding, 4, "--sliding") if args.sliding else None,
        _ints(args.linear, 2, "--linear") if args.linear else None,
    )


def _describe(shape: ModelShape) -> str:
    groups: dict[tuple, int] = {}
    for layer in shape.layers:
        key = (layer.kind, layer.kv_heads, layer.head_dim, layer.window, layer.state_bytes)
        groups[key] = groups.get(key, 0) + 1
    parts = []
    for (kind, heads, dim, window, state), n in groups.items():
        if kind == "linear":
            parts.append(f"{n} linear ({state} B state/seq)")
        elif kind == "shared":
            parts.append(f"{n} KV-shared")
        else:
            parts.append(f"{n} {kind} ({heads} KV heads x {dim}{f', window {window}' if window else ''})")
    return f"{shape.name}: " + ", ".join(parts)


def cli_scheme(args) -> Scheme:
    """The scheme the command's --scheme and option flags (one per Scheme option) describe."""
    return from_point({"scheme": args.scheme, **{key: getattr(args, key) for key in SCHEME_OPTIONS}})


def rows(args) -> tuple[ModelShape, list[dict]]:
    shape = _shape(args)
    scheme = cli_scheme(args)
    allocations = (
        [("allocation", *_bits_from(args.bits_from))] if args.bits_from else [(b, b, b) for b in args.bits]
    )
    out = []
    for label, bits, value_bits in allocations:
        for tokens in args.context:
            c = cache_bytes(shape, tokens, bits, scheme, args.batch, value_bits)
            row = {
                "bits": label,
                "context": tokens,
                "batch": args.batch,
                "mean_bits": c.mean_bits,
                "true_GiB": c.true_bytes / GIB,
                "true_GB": c.true_bytes / GB,
                "nominal_GiB": c.nominal_bytes / GIB,
                "fp16_GiB": c.fp16_bytes / GIB,
                "compression_true": c.compression_true,
                "compression_nominal": c.compression_nominal,
                "linear_state_GiB": c.linear_state_bytes / GIB,
                **{f"{kind}_GiB": b / GIB for kind, b in sorted(c.by_kind.items())},
                "true_bytes": c.true_bytes,
            }
            for gib in args.memory_gib:
                row[f"max_context@{gib:g}GiB"] = max_context(
                    shape, int(gib * GIB), bits, scheme, args.batch, value_bits
                )
            out.append(row)
    return shape, out


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        shape, table = rows(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        print(json.dumps(table, indent=1))
        return

    print(_describe(shape))
    outliers = f" outliers={args.outliers:g}" if args.outliers else ""
    print(
        f"scheme {args.scheme} g={args.group_size} sink_tokens={args.sink_tokens} residual={args.residual}{outliers}"
    )
    print(pd.DataFrame(table).to_string(index=False, float_format=lambda x: f"{x:.4g}"))


if __name__ == "__main__":
    main()
