"""The claim protocol: the public write-up's own measurement (CLAIMS.md "What is known"), on any registered model.

`sweep.protocol: claim` (conf/sweep/claim_*.yaml) selects it. On `num_sequences` windows of `sequence_tokens`
tokens from the evaluation text, with no KV cache (the whole sequence is recomputed for each of `new_tokens`
greedy tokens) and quantize-dequantize of every K and V inside attention (harness/attention/qdq.py):
- entropy (`policy.entropy_key`: H1 Shannon, as the claim's code, or H2 Rényi) from the first
  `calibration_sequences` of those same sequences at the query positions `calibration_positions` only
  (calibration and test overlap, as in the claim);
- widths with `budget_mode=claim` (harness/policies/): Uniform, Adaptive (alpha), Skip `skip` + adaptive
  (the `skip` lowest-entropy KV heads at 16 bits, the budget on the others);
- "Combined": uniform at the budget plus a top-k mask keeping ceil(visible / topk_factor) weights per attention
  row, renormalized; its "Nx" is 16 / mean bits x topk_factor, the claim's count (the mask frees no memory);
- BLEU = sentence BLEU on token ids without smoothing, averaged over sequences, against the unquantized
  model's own greedy continuation (computed through the same eager attention); token match; PPL ratio =
  perplexity of the sequences with QDQ attention over without; "Nx" = 16 / realized mean bits (sinks at 16).
Results go to run_dir (results/claims/<model>/<run>/): config.yaml and env.json (written before the model
loads), then tables.md (command on top) and rows.json (each row with the thread count and commit).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from harness import data, metrics, precision
from harness.attention import QDQ, QDQSpec, installed
from harness.cache import kv_heads
from harness.calibrate import head_entropies, layer_types
from harness.io import command_line, provenance, start_record, write_text_atomic
from harness.models import load_model, model_spec
from harness.policies import Entropy, from_point, kv_head_entropy
from harness.report.claim import render
from harness.schemes import get_scheme, packed_names
from kernels.layout import FULL_WIDTH

PROTOCOL = "claim"
KEYS = (
    "num_sequences",
    "sequence_tokens",
    "new_tokens",
    "calibration_sequences",
    "calibration_positions",
    "budget",
    "alpha",
    "skip",
    "widths",
    "topk_factor",
)
POSITIVE = ("num_sequences", "sequence_tokens", "new_tokens", "calibration_sequences", "topk_factor")


@dataclass(frozen=True)
class ClaimSettings:
    """One claim-protocol run: the model, the claim's sizes, and the allocation and scheme settings."""

    model: str
    num_sequences: int
    sequence_tokens: int
    new_tokens: int
    calibration_sequences: int
    calibration_positions: tuple[int, ...]
    budget: int
    alpha: float
    skip: int
    widths: tuple[int, ...]
    topk_factor: int
    entropy_key: str = "H1"
    scheme: str = "asym_token"
    group_size: int = 32
    seed: int = 0
    data_path: str | None = None
    bos: str = "auto"  # eval.bos (harness.data.uses_bos)
    dtype: str = "float32"  # model.dtype, resolved (harness/precision.py)


def settings(cfg: DictConfig) -> ClaimSettings:
    """The run's settings from the composed config; ValueError (one line naming the key) for bad input."""
    sweep = OmegaConf.to_container(cfg.sweep, resolve=True)
    models = sweep.get("models") or []
    if len(models) != 1:
        raise ValueError(f"sweep.models: the claim protocol runs one model per run; got {models}")
    model_spec(models[0])
    claim = sweep.get("claim") or {}
    unknown = sorted(set(claim) - set(KEYS))
    missing = [k for k in KEYS if k not in claim]
    if unknown or missing:
        raise ValueError(
            f"sweep.claim: {'unknown ' + str(unknown) if unknown else 'missing ' + str(missing)}; "
            f"allowed: {', '.join(KEYS)}"
        )
    for key in ("calibration_positions", "widths"):
        if not isinstance(claim[key], list):
            raise ValueError(f"sweep.claim.{key}: expected a list; got {claim[key]!r}")
        claim[key] = tuple(claim[key])
    return ClaimSettings(
        model=models[0],
        **claim,
        entropy_key=cfg.policy.get("entropy_key", "H2"),
        scheme=cfg.quant.scheme,
        group_size=cfg.quant.group_size,
        seed=cfg.seed,
        data_path=cfg.eval.data.path,
        bos=cfg.eval.get("bos", "auto"),
        dtype=precision.resolve(cfg.model.get("dtype", precision.DEFAULT), cfg.get("device", "cpu")),
    )


def rows(s: ClaimSettings) -> list[dict]:
    """The claim's configurations: label, the policy's point fields (harness.policies.from_point) and budget, plus
    top-k."""
    b, a = s.budget, s.alpha
    claim = dict(budget=b, widths=s.widths, budget_mode="claim", entropy_key=s.entropy_key)
    return [
        dict(label=f"Uniform {b}-bit", policy="uniform", alpha=0.0, skip=0, topk_factor=None, **claim),
        dict(label=f"Adaptive {b}-bit (alpha {a:g})", policy="entropy", alpha=a, skip=0, topk_factor=None, **claim),
        dict(
            label=f"Skip {s.skip} + adaptive {b}-bit", policy="entropy", alpha=a, skip=s.skip, topk_factor=None, **claim
        ),
        dict(
            label=f"Combined {FULL_WIDTH / b * s.topk_factor:g}x", policy="uniform", alpha=0.0, skip=0,
            topk_factor=s.topk_factor, **claim,
        ),
    ]  # fmt: skip


def validate(cfg: DictConfig) -> list[dict]:
    """Check a claim-protocol config; return its rows (the claim's 'points')."""
    s = settings(cfg)
    for name in POSITIVE:
        value = getattr(s, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"sweep.claim.{name}: {value!r} is not a positive integer")
    if not isinstance(s.skip, int) or s.skip < 0:
        raise ValueError(f"sweep.claim.skip: {s.skip!r} is not an integer >= 0")
    if s.calibration_sequences > s.num_sequences:
        raise ValueError(
            f"sweep.claim.calibration_sequences: {s.calibration_sequences} exceeds num_sequences={s.num_sequences}"
        )
    if not s.calibration_positions or not all(
        isinstance(i, int) and 0 <= i < s.sequence_tokens for i in s.calibration_positions
    ):
        raise ValueError(
            f"sweep.claim.calibration_positions: {list(s.calibration_positions)} must be query positions "
            f"in [0, {s.sequence_tokens})"
        )
    limit = model_spec(s.model).get("context_limit", 2048)
    if s.sequence_tokens + s.new_tokens > limit:
        raise ValueError(
            f"sweep.claim.sequence_tokens: + new_tokens exceeds {s.model}'s context limit {limit}"
        )
    if s.scheme not in packed_names():  # the quantize-dequantize attention reads per-token groups only
        raise ValueError(
            f"quant.scheme: {s.scheme!r} with the claim protocol; allowed: {', '.join(packed_names())}"
        )
    if isinstance(s.group_size, bool) or not isinstance(s.group_size, int) or s.group_size < 1:
        raise ValueError(f"quant.group_size: {s.group_size!r} is not a positive integer")
    try:
        policy = Entropy(widths=s.widths, budget_mode="claim", entropy_key=s.entropy_key, alpha=s.alpha)
        policy.check_budget(s.budget)
    except (
        ValueError
    ) as err:  # budget, alpha and widths are set under sweep.claim here; entropy_key under policy
        message = str(err)
        if not message.startswith("policy.entropy_key:"):
            message = message.replace("policy.", "sweep.claim.", 1)
        raise ValueError(message) from None
    return rows(s)


# ------------------------------------------------------------------------------------------------ measure


def greedy_no_cache(model, ids, new_tokens: int):
    """Greedy tokens (N, M) after ids (N, T), recomputing the whole sequence at each step (no KV cache)."""
    seq = ids
    for _ in range(new_tokens):
        logits = model(input_ids=seq, use_cache=False, logits_to_keep=1).logits[:, -1]  # (N, V)
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[:, ids.shape[1] :]


def sequence_nll(model, ids):
    """Mean next-token NLL per sequence (N,) float64 of ids (N, T), one sequence per forward."""
    out = []
    for row in ids:
        logits = model(input_ids=row[None], use_cache=False).logits[0, :-1].float()  # (T-1, V)
        out.append(torch.nn.functional.cross_entropy(logits, row[1:]).double())
    return torch.stack(out)


def architecture(config) -> str:
    """The claim's architecture label: standard or hybrid (which layer kinds), + GQA when KV heads are shared."""
    kinds = sorted(set(layer_types(config)))
    text = config.get_text_config(decoder=True)
    label = "standard" if kinds == ["full"] else f"hybrid ({' + '.join(kinds)})"
    return label + (" + GQA" if min(kv_heads(config)) < text.num_attention_heads else "")


def measure(model, s: ClaimSettings, ids, configurations: list[dict] | None = None) -> list[dict]:
    """Every claim row (`configurations`, by default `rows(s)`) on sequences ids (N, T) of `model`: allocation,
    BLEU, token match, PPL ratio, Nx."""
    symmetric = get_scheme(s.scheme, s.group_size).symmetric
    entropy = head_entropies(model, ids[: s.calibration_sequences], positions=list(s.calibration_positions))
    n_heads = int((~kv_head_entropy(entropy, s.entropy_key).isnan()).sum())
    with torch.no_grad():
        plain = QDQSpec(torch.full((entropy.attrs["num_layers"], entropy.attrs["num_kv_heads"]), FULL_WIDTH))
        with installed(model, QDQ, plain):
            base_tokens = greedy_no_cache(model, ids, s.new_tokens)
            base_nll = sequence_nll(model, ids)
        out = []
        for row in tqdm(
            configurations or rows(s), desc=f"claim protocol on {s.model}", unit="row", dynamic_ncols=True
        ):
            policy = from_point({**row, "sink_fraction": row["skip"] / n_heads if row["skip"] else None})
            alloc = policy.allocate(entropy, row["budget"])
            spec = QDQSpec(alloc.bits, s.group_size, symmetric, row["topk_factor"])
            with installed(model, QDQ, spec):
                tokens = greedy_no_cache(model, ids, s.new_tokens)
                nll = sequence_nll(model, ids)
            items = metrics.generation_items(base_tokens, tokens)
            out.append(
                {
                    "label": row["label"],
                    "model": s.model,
                    "dtype": s.dtype,
                    "architecture": architecture(model.config),
                    "bleu_tok": float(items["bleu_tok"].mean()),
                    "token_match": float(items["token_match"].mean()),
                    "first_divergence": float(items["first_divergence"].mean()),
                    "ppl": math.exp(nll.mean()),
                    "ppl_base": math.exp(base_nll.mean()),
                    "ppl_ratio": math.exp(nll.mean() - base_nll.mean()),
                    "mean_bits": alloc.mean_bits,
                    "compression": FULL_WIDTH / alloc.mean_bits * (row["topk_factor"] or 1),
                    "n_sinks": int(alloc.sinks.sum()),
                    "histogram": alloc.histogram(),
                    "bits": alloc.bits.tolist(),
                    "items": {
                        **{k: v.tolist() for k, v in items.items()},
                        "nll": nll.tolist(),
                        "nll_base": base_nll.tolist(),
                    },  # per sequence
                    "tokens": tokens.tolist(),
                }
            )
    return out


# ---------------------------------------------------------------------------------------------- the record


def rerender(run_dir: Path) -> str:
    """tables.md of a finished claim run, rewritten from its rows.json and env.json (no model loads)."""
    stored = json.loads((run_dir / "rows.json").read_text())
    command = json.loads((run_dir / "env.json").read_text())["command"]
    settings_ = ClaimSettings(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in stored["settings"].items()}
    )
    return render(settings_, stored["rows"], command)


def main(argv: list[str] | None = None) -> None:
    """`python -m harness.claim RUN_DIR...`: rewrite each claim run's tables.md from its stored rows."""
    for name in argv if argv is not None else sys.argv[1:]:
        run_dir = Path(name)
        write_text_atomic(run_dir / "tables.md", rerender(run_dir))
        print(run_dir / "tables.md")


def run(cfg: DictConfig, configurations: list[dict] | None = None) -> list[dict]:
    """Run the claim protocol of a validated config (its rows: `validate`, by default `rows`) into cfg.run_dir;
    print and return the measured rows.

    config.yaml and env.json are written before the model loads, so the record names the code that ran.
    """
    s = settings(cfg)
    run_dir = Path(cfg.run_dir)
    env = start_record(
        run_dir,
        command_line("python -m harness"),
        cfg.device,
        cfg.get("allow_dirty", False),
        s.dtype,
        config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
    )
    model, tokenizer = load_model(s.model, device=cfg.device, dtype=s.dtype)
    text = data.split(s.data_path)
    bos = data.uses_bos(tokenizer, s.bos)
    ids = data.token_windows(tokenizer, text.evaluation, s.num_sequences, s.sequence_tokens, s.seed, bos=bos)
    ids = ids.to(model.device)
    measured = [{**row, **provenance(env)} for row in measure(model, s, ids, configurations)]
    write_text_atomic(run_dir / "rows.json", json.dumps({"settings": asdict(s), "rows": measured}, indent=1))
    tables = render(s, measured, env["command"])
    write_text_atomic(run_dir / "tables.md", tables)
    print(tables, file=sys.stdout)
    return measured
