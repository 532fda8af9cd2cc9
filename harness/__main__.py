"""`python -m harness [overrides]`: compose the Hydra config, validate it, run its protocol (harness.protocols).

Without `+sweep=NAME` it evaluates uniform and the configured policy at the configured budget (plus the
unquantized baseline); with one it runs that sweep's grid. Invalid input stops before any model weights load with one
line naming the key and what is allowed (exit code 2): the config, then run_dir (writable; results/ only from a
clean tree unless allow_dirty=true), then what the model's config and tokenizer say (harness.validate).
With model.download=true, the run's Hugging Face models missing here are fetched from the Hub before that
last check.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from harness.io import CONF_DIR, set_threads
from harness.models import ModelUnavailable, fetch_missing
from harness.protocols import PROTOCOLS
from harness.validate import (
    ConfigError,
    check_model_inputs,
    check_run_dir,
    preflight_overrides,
    protocol,
    run_models,
    validate_config,
)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        points = validate_config(cfg)
        set_threads(cfg.threads)  # before any work, tokenizing included
        check_run_dir(cfg)
        if cfg.model.get(
            "download", False
        ):  # hf models missing here come from the Hub (a refusal is one line)
            fetch_missing(run_models(cfg, points))
        check_model_inputs(cfg, points)  # the model's config and tokenizer, never its weights
    except (ConfigError, ModelUnavailable) as err:  # ModelUnavailable: e.g. gpt2 without local weights
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        PROTOCOLS[protocol(cfg)].run(cfg, points)
    except ModelUnavailable as err:  # one line naming what to install or provide
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def entry() -> None:
    try:
        preflight_overrides(sys.argv[1:], CONF_DIR)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    entry()
