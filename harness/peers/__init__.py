"""Peers: other implementations of a quantized KV cache, measured by the harness on the same model file, tokens,
chunks and metrics as its own points, so that tables and Pareto plots show them beside ours.

Engines (a point's `engine`; the harness's own points have none, harness.config.HARNESS):
- llamacpp (harness/peers/llamacpp.py): llama.cpp through llama-cpp-python on the model's GGUF, K and V stored as
  one of its cache types, its Hadamard rotation of K and V on or off; compared with its own f16 cache.
- quanto, hqq (harness/peers/quantized_cache.py): transformers' QuantizedCache with that backend, compared with
  the harness's unquantized baseline (same model, same weights).

A peer point's `scheme` is the engine's storage type (q4_0, int4, ...), its `budget` the width of one code
(`mean_bits`), its `policy` the engine's name (W&B job type, table label).
This module owns the engine table, making and checking peer points, their labels, and dispatching a
measurement to the engine (harness/peers/record.py turns a measurement into a record).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from harness.config import Point
from harness.models import model_names, model_spec
from harness.peers import llamacpp, quantized_cache
from harness.peers.quantized_cache import GROUP_SIZE, RESIDUAL

# engine -> (its storage types: name -> bits of one code, the module it needs, its install hint)
LLAMACPP_TYPES = {"f16": 16, "q8_0": 8, "q5_1": 5, "q5_0": 5, "q4_1": 4, "q4_0": 4, "iq4_nl": 4}
ENGINES = {
    "llamacpp": (LLAMACPP_TYPES, "llama_cpp", "make install (llama-cpp-python, built from source)"),
    "quanto": ({"int2": 2, "int4": 4}, "optimum.quanto", "make install (optimum-quanto)"),
    "hqq": ({f"int{b}": b for b in (1, 2, 3, 4, 8)}, "hqq", "make install (hqq)"),
}


def _allowed(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: unknown {value!r}; allowed: {', '.join(map(str, allowed))}")


def peer_point(base: Point, fields: Mapping) -> Point:
    """A peer point from a sweep's `peers` entry (`engine`, `scheme`, `rotation` for llamacpp, optionally `model`)
    on the harness point `base` (its context fields: data, eval sizes, seed).

    Fields a peer ignores take the values the baseline row gives them, so the baseline a runner derives from a
    peer point is the one it derives from a harness point of the same context.
    """
    extra = set(fields) - {"engine", "scheme", "rotation", "model"}
    if extra:
        raise ValueError(
            f"sweep.peers: unknown field {sorted(extra)[0]!r}; allowed: engine, scheme, rotation, model"
        )
    engine = fields.get("engine")
    _allowed("sweep.peers.engine", engine, list(ENGINES))
    types = ENGINES[engine][0]
    _allowed(f"sweep.peers.scheme (engine {engine})", fields.get("scheme"), list(types))
    if engine != "llamacpp" and "rotation" in fields:
        raise ValueError(f"sweep.peers.rotation: engine {engine} has none; allowed with: llamacpp")
    rotation = fields.get("rotation", True) if engine == "llamacpp" else None
    if engine == "llamacpp":
        _allowed("sweep.peers.rotation", rotation, [True, False])
        rotation = rotation and fields["scheme"] != "f16"  # llama.cpp rotates quantized K/V only
    return base.replace(
        model=fields.get("model", base.model),
        engine=engine,
        rotation=rotation,
        policy=engine,
        budget=types[fields["scheme"]],
        scheme=fields["scheme"],
        alpha=0.0,
        sink_threshold=None,
        sink_fraction=None,
        policy_seed=0,
    )  # no eviction: harness.protocols.sweep sets the eviction fields


def check_point(point: Point) -> None:
    """ValueError (one line: the key, what is allowed) for a peer point this machine cannot measure."""
    engine = point.engine
    _allowed("engine", engine, list(ENGINES))
    types, module, install = ENGINES[engine]
    _allowed(f"scheme (engine {engine})", point.scheme, list(types))
    if engine == "llamacpp" and model_spec(point.model)["source"] != "gguf_package":
        gguf = [n for n in model_names() if model_spec(n)["source"] == "gguf_package"]
        raise ValueError(
            f"model: engine llamacpp reads a GGUF file, {point.model} has none; allowed: {', '.join(gguf)}"
        )
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        raise ValueError(f"engine: {engine} needs the Python module {module}; run: {install}")


def label(row: Mapping) -> str:
    """A peer point's configuration, e.g. 'llama.cpp q4_0 + rotation' or 'transformers quanto int4'."""
    if row["engine"] == "llamacpp":
        return f"llama.cpp {row['scheme']}" + (" + rotation" if row.get("rotation") is True else "")

    return f"transformers {row['engine']} {row['scheme']} (g{GROUP_SIZE}, residual {RESIDUAL})"


def engine_label(row: Mapping) -> str:
    """A peer point's engine with its options, without its cache type: 'llama.cpp + rotation', 'transformers hqq'."""
    if row["engine"] == "llamacpp":
        return "llama.cpp" + (" + rotation" if row.get("rotation") is True else "")
    return f"transformers {row['engine']}"


def measure(ctx, point: Point) -> dict:
    """A peer point's record body: {"status": "ok", "metrics", "items"} or {"status": "infeasible", "error"}.

    ctx: the harness.run.context.ModelContext of the point's context (its model, tokenizer, teacher-forced sequences,
    unquantized baseline; `peer_state` keeps what the points of one engine share, e.g. llama.cpp's f16 run).
    """
    if point.engine == "llamacpp":
        return llamacpp.measure(ctx, point)

    return quantized_cache.measure(ctx, point)
