"""`python -m harness [overrides]`: compose the Hydra config, validate it, run the grid, print the table.

Without `+sweep=NAME` it evaluates uniform and the configured policy at the configured budget (plus the
unquantized baseline); with one it runs that sweep's grid. Invalid input stops before any model loads with one
line naming the key and what is allowed (exit code 2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from harness.validate import ConfigError, preflight_overrides, protocol, validate_config

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        points = validate_config(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    from harness.models import ModelUnavailable

    try:
        if protocol(cfg) == "claim":
            from harness import claim

            claim.run(cfg)
        else:
            from harness.session import run_session  # heavy imports only after validation

            run_session(cfg, points)
    except (
        ModelUnavailable
    ) as err:  # e.g. gpt2 without local weights: one line naming what to install or provide
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
