"""`python -m harness.advise model=NAME target.ppl_ratio=1.02`: the smallest cache that keeps a model within a
quality target (or target.kl_mean=, or target.compression= for the best quality at a size), and the allocation file
to use it. The search is harness/protocols/advise.py's, the page harness/report/advise.py's.

Options (key=value): model (a registry name or a local model folder), exactly one of target.ppl_ratio,
target.kl_mean, target.compression; target.backend (auto, or triton: only what the fused kernel decodes); context
(the tokens of one sequence its true compression is counted at, default 4096); sequences and tokens (the held-out
windows that confirm, default 16 x 1024); run_name (results/advise/<run_name>/, default from the model and target;
re-running it resumes); threads; allow_dirty. Bad input: one line naming the key, exit code 2, before any model loads.
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path

from omegaconf import OmegaConf

from harness import io
from harness.models import model_names
from harness.protocols.advise import METRICS, Target, advise
from harness.report.advise import write_advice

ROOT = Path("results/advise")
KEYS = ("model", "context", "sequences", "tokens", "run_name", "threads", "allow_dirty", "target")


def parse(argv: list[str]) -> dict:
    """The options of key=value arguments, checked (ValueError naming the key, one line)."""
    for arg in argv:
        if "=" not in arg:
            raise ValueError(f"{arg}: expected key=value (e.g. model=smollm2-135m target.ppl_ratio=1.02)")
    options = OmegaConf.to_container(OmegaConf.from_dotlist(argv))
    unknown = sorted(set(options) - set(KEYS))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown option; allowed: {', '.join(KEYS)}")
    target = options.get("target") or {}
    if not isinstance(target, dict):
        raise ValueError(f"target: give target.{'=, target.'.join(METRICS)}=")
    extra = sorted(set(target) - {*METRICS, "backend"})
    if extra:
        raise ValueError(
            f"target.{extra[0]}: unknown; allowed: target.{', target.'.join((*METRICS, 'backend'))}"
        )
    asked = [m for m in METRICS if m in target]
    if len(asked) != 1:
        raise ValueError(f"target: give exactly one of target.{', target.'.join(METRICS)}; got {len(asked)}")
    if "model" not in options:
        raise ValueError("model: missing; allowed: a registry name or a local model folder")
    for key in ("sequences", "tokens"):
        value = options.get(key, 16 if key == "sequences" else 1024)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}: {value!r} is not a positive integer")
    value = target[asked[0]]
    value = float(value) if isinstance(value, int) and not isinstance(value, bool) else value
    options["target"] = Target(asked[0], value, options.get("context", 4096), target.get("backend", "auto"))
    default_name = f"{Path(str(options['model'])).name}-{asked[0]}-{value:g}" + (
        "" if options["target"].backend == "auto" else f"-{options['target'].backend}"
    )
    options["run_name"] = io.check_plain_name(options.get("run_name", default_name), "run_name")
    io.check_threads(options.get("threads"), key="threads")
    return options


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = io.command_line("python -m harness.advise", argv)
    try:
        options = parse(argv)
        run_dir = ROOT / options["run_name"]
        io.check_writable(run_dir, key="run_name")
        io.check_clean(run_dir, options.get("allow_dirty", False), key="allow_dirty")
        io.set_threads(options.get("threads"), key="threads")
        io.start_record(run_dir, command, allow_dirty=options.get("allow_dirty", False))
        from harness.api import load

        name = str(options["model"])
        model, tokenizer = load(name)
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    t0 = time.perf_counter()
    target = options["target"]
    advice = advise(
        model, tokenizer, run_dir, **{target.metric: target.value}, context=target.context, backend=target.backend,
        model_name=name if name in model_names() else None, sequences=options.get("sequences", 16),
        tokens=options.get("tokens", 1024),
        progress=lambda line: print(f"[{time.perf_counter() - t0:7.1f} s] {line}", flush=True),
    )  # fmt: skip
    for path in write_advice(run_dir, advice, command, name):
        print(f"wrote {path}")


class _CallableModule(types.ModuleType):
    """This module, callable as the function it is the command of: `harness.advise(model, tokenizer, run_dir, ...)`
    (harness.protocols.advise.advise) works whether or not the command's module was imported, which would
    otherwise replace the package's lazy export of that name."""

    def __call__(self, *args, **kwargs):
        return advise(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
