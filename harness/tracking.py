"""Weights & Biases tracking of a sweep: one W&B run per grid point, one summary run per sweep.

This module owns everything the harness sends to W&B and everything W&B writes to disk. Runs of one sweep
share a group (the sweep's run name); a point's run has the point's policy as job type, the point's full
configuration as config and its metrics (or, when infeasible, its status and error) as summary. `finish`
adds a "summary" run holding the results table and the sweep's plots.

Every file W&B writes stays under <run_dir>/wandb: offline runs, logs, the wandb-core service log (cache)
and artifact staging files (data; an offline table artifact is uploaded from there by `wandb sync`).

W&B is a mirror of the local results (points/*.json, results.parquet), never their source: any failure in
it (wandb missing, init or disk errors, anything it raises) gives one warning and switches tracking off for
the rest of the sweep. Mode "disabled" never imports wandb.
"""

from __future__ import annotations

import os
import shlex
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pandas as pd

from harness.config import HARNESS, Point
from harness.peers import label

MODES = ("online", "offline", "disabled")


def sync_command(run_dir: Path) -> str:
    """The shell command that uploads a sweep's offline runs (run it where W&B is reachable and logged in)."""
    return f"wandb sync {shlex.quote(str(Path(run_dir) / 'wandb'))}/offline-run-*"


def run_name(point: Point) -> str:
    """A short readable name for a point's run, e.g. `gpt2 entropy b3 a0.5 sink>0.9 asym_token`, or for a peer
    engine's point `smollm2-135m llama.cpp q4_0 + rotation`."""
    if point.engine != HARNESS:
        return f"{point.model} {label(point.to_dict())}"
    if point.sink_threshold is not None:
        sinks = f"sink>{point.sink_threshold}"
    elif point.sink_fraction is not None:
        sinks = f"sink{point.sink_fraction:.0%}"
    else:
        sinks = "nosink"
    return f"{point.model} {point.policy} b{point.budget} a{point.alpha} {sinks} {point.scheme}"


class Tracker:
    """Mirrors a sweep's points and its final table into W&B; never raises out of its public methods."""

    def __init__(
        self,
        mode: str = "offline",
        project: str = "kv-bits",
        entity: str | None = None,
        *,
        run_dir: Path,
        group: str,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"tracking mode {mode!r}; allowed: {', '.join(MODES)}")
        self.mode, self.project, self.entity, self.group = mode, project, entity, group
        self.run_dir = Path(run_dir)
        self.enabled = mode != "disabled"

    def log_point(self, point: Point, record: dict) -> None:
        """One finished run for one evaluated point: its configuration, and its metrics or why it has none."""

        def send(wandb: ModuleType) -> None:
            if record["status"] == "ok":
                summary = {"status": "ok", **record["metrics"]}
            else:
                summary = {"status": record["status"], "error": record.get("error", "")}
            summary["key"] = point.key()  # links the W&B run to <run_dir>/points/<key>.json
            with self._init(
                wandb, job_type=point.policy, name=run_name(point), config=point.to_dict()
            ) as run:
                run.summary.update(summary)

        self._guarded("logging a point", send)

    def finish(self, table: pd.DataFrame, images: dict[str, Path]) -> None:
        """The sweep's summary run (every row as a W&B table, plus the plots); tracking ends here."""

        def send(wandb: ModuleType) -> None:
            with self._init(
                wandb, job_type="summary", name=f"{self.group} summary", config={"points": len(table)}
            ) as run:
                # Logged before the images so that a bad image path still leaves the table in the run.
                rows = table.astype(object).where(
                    table.notna(), None
                )  # pandas' NA (nullable columns): no JSON
                run.log({"results": wandb.Table(dataframe=rows, allow_mixed_types=True)})
                run.log({name: wandb.Image(str(path)) for name, path in images.items()})
            # Stops the wandb-core service, which lives on after the last run and holds its log file
            # under this run_dir; a later Tracker in the same process starts its own.
            wandb.teardown()

        self._guarded("writing the summary run", send)
        self.enabled = False

    def _init(self, wandb: ModuleType, *, job_type: str, name: str, config: dict) -> Any:
        return wandb.init(
            mode=self.mode,
            project=self.project,
            entity=self.entity,
            dir=str(self.run_dir),  # wandb puts its files in <dir>/wandb
            group=self.group,
            job_type=job_type,
            name=name,
            config=config,
            # Each point's run is finished before the next starts; "create_new" keeps wandb from touching
            # any other run (and the global wandb.run) that the caller might have open.
            reinit="create_new",
            settings=wandb.Settings(
                silent=True,
                console="off",  # the sweep's console is the progress bar: not worth a file per point
                # Per-run system metrics, host/git metadata, GPU probing and pip freeze cost time on every
                # init; the session already records the environment once per sweep.
                x_disable_stats=True,
                x_disable_meta=True,
                x_disable_machine_info=True,
                x_save_requirements=False,
            ),
        )

    def _guarded(self, what: str, send: Callable[[ModuleType], None]) -> None:
        """Run `send(wandb)` unless tracking is off; on any failure warn once and turn tracking off."""
        if not self.enabled:
            return
        try:
            with self._wandb_dirs():
                import wandb

                send(wandb)
        except Exception as err:  # whatever wandb raises, the sweep and its local results go on
            self.enabled = False
            warnings.warn(
                f"W&B tracking switched off: {what} failed ({type(err).__name__}: {err}); "
                "local results are unaffected",
                RuntimeWarning,
                stacklevel=3,
            )

    @contextmanager
    def _wandb_dirs(self) -> Iterator[None]:
        """Point wandb's per-user data and cache dirs into <run_dir>/wandb for the duration of a call.

        wandb reads them from the environment when it needs them (artifact staging at log time; the
        wandb-core service's log when the service starts), so setting them only around our calls keeps
        W&B files out of ~/.local/share and ~/.cache without changing the environment for anything else.
        """
        dirs = {"WANDB_DATA_DIR": "data", "WANDB_CACHE_DIR": "cache"}
        saved = {var: os.environ.get(var) for var in dirs}
        os.environ.update({var: str(self.run_dir / "wandb" / sub) for var, sub in dirs.items()})
        try:
            yield
        finally:
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
