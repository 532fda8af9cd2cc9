"""The claim protocol's tables (harness/claim.py measures): Claim 2's table (BLEU, token match, PPL ratio, Nx per
configuration), Claim 1's (the combined row per model), every row's paired difference to uniform with its
bootstrap interval, and the whole tables.md of a claim run (render)."""

from __future__ import annotations

import math

import numpy as np

from harness.metrics import format_difference, paired_difference_ci
from harness.report.paired import DEFAULT_N_BOOT


def _ppl_increase(ratio: float) -> str:
    return f">{math.floor(ratio)}x" if ratio >= 10 else f"{(ratio - 1) * 100:+.1f}%"


def claim2_table(measured: list[dict]) -> str:
    """Claim 2's table (Config, BLEU, Token match, PPL ratio, Nx) of the non-combined rows."""
    lines = ["| Config | BLEU | Token match | PPL ratio | Nx |", "|---|---|---|---|---|"]
    for r in measured:
        if not r["label"].startswith("Combined"):
            lines.append(
                f"| {r['label']} | {r['bleu_tok']:.3f} | {r['token_match']:.1%} | {r['ppl_ratio']:.3f} "
                f"| {r['compression']:.2f}x |"
            )
    return "\n".join(lines)


def claim1_table(measured: list[dict]) -> str:
    """Claim 1's table (Model, Architecture, Combined BLEU, PPL increase): one line per combined row."""
    combined = [r for r in measured if r["label"].startswith("Combined")]
    header = f"| Model | Architecture | {combined[0]['label']} BLEU | PPL increase |" if combined else ""
    lines = [header, "|---|---|---|---|"]
    for r in combined:
        lines.append(
            f"| {r['model']} | {r['architecture']} | {r['bleu_tok']:.3f} | {_ppl_increase(r['ppl_ratio'])} |"
        )
    return "\n".join(lines)


def _item_statistics(row: dict) -> dict:
    """Per-resample statistics of one row from its per-sequence items: mean BLEU, mean token match, and the
    PPL ratio exp(mean NLL - mean baseline NLL) (every sequence has the same length)."""
    items = {name: np.asarray(values) for name, values in row["items"].items()}  # each (num_sequences,)
    return {
        "BLEU": lambda idx: items["bleu_tok"][idx].mean(),
        "Token match": lambda idx: items["token_match"][idx].mean(),
        "PPL ratio": lambda idx: math.exp(items["nll"][idx].mean() - items["nll_base"][idx].mean()),
    }


def differences_table(measured: list[dict], n_boot: int = DEFAULT_N_BOOT, seed: int = 0) -> str:
    """Every row minus the first (uniform at the budget), paired over the same sequences: the difference, its
    expanded percentile bootstrap 95% interval and n (harness.metrics.format_difference)."""
    reference = _item_statistics(measured[0])
    lines = ["| Config | BLEU | Token match | PPL ratio |", "|---|---|---|---|"]
    for row in measured[1:]:
        mine = _item_statistics(row)
        n = len(row["items"]["nll"])
        cells = []
        for name, statistic in mine.items():
            everything = np.arange(n)
            difference = statistic(everything) - reference[name](everything)
            low, high = paired_difference_ci(statistic, reference[name], n, n_boot, seed)
            cells.append(format_difference(difference, low, high, low > 0 or high < 0, n))
        lines.append(f"| {row['label']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def render(s, measured: list[dict], command: str) -> str:
    """tables.md: the command, what was measured, then Claim 2's and Claim 1's tables and every row's paired
    difference to the first (uniform). s: the run's settings (harness.claim.ClaimSettings, read by attribute)."""
    positions = ", ".join(map(str, s.calibration_positions))
    return f"""# Claim protocol on {s.model}

Command: `{command}`

Claim protocol on {s.model} (not the claim's models unless gpt2): {s.num_sequences} evaluation sequences of
{s.sequence_tokens} tokens (seed {s.seed}), {s.new_tokens} greedy tokens each with no KV cache, quantize-dequantize
of every K and V inside attention ({s.scheme}, groups of {s.group_size}). Entropy {s.entropy_key} from the first
{s.calibration_sequences} of the same sequences at query positions {positions} (calibration and test overlap, as
in the claim); budget_mode=claim. BLEU: sentence BLEU on token ids, no smoothing, against the unquantized model's
greedy continuation, mean over sequences. Nx = 16 / realized mean bits, heads kept at 16 bits counted (the claim
printed 4.00x for every row). Combined = uniform {s.budget}-bit plus a top-k mask keeping the ceil(visible /
{s.topk_factor}) largest weights of each attention row, renormalized, counted as {s.topk_factor}x as the claim did;
the mask frees no memory.

## Claim 2 (claim protocol on {s.model})

{claim2_table(measured)}

## Claim 1 (claim protocol on {s.model})

{claim1_table(measured)}

## Paired differences to {measured[0]["label"]} (95% interval over the {s.num_sequences} sequences)

{differences_table(measured)}
"""
