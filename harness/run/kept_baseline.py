"""Teacher-forced baselines kept on disk between starts.

A baseline whose float16 log-probs are too big for memory (harness.run.context.LOGPROBS_IN_MEMORY: smollm2-135m's
over the last half of 16 windows of 8K tokens are 6.4 GB, gemma3-270m's 34 GB) is written to the disk cache
(harness.io.cache_root) in baselines/<model>-<key>/, the key a digest of everything its figures depend on: the
model's identity (name, config, dtype) and device, the tokens, the chunk, batch and score_from, the thread count and
torch's version. A later start of the same evaluation maps it back instead of running the model again (at 8K on
this project's 2-core CPU the baseline took 26 minutes for smollm2-135m). A folder holds `logprobs.f16` ((S, n, V)
float16, mapped read-only) and `scores.pt` (targets, nll, top1 and the log-probs' shape), written last: a folder
without scores.pt is unfinished and is computed again. Delete a folder, or all of baselines/, to free the space.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from harness import evaluate
from harness.calibrate.disk import model_identity
from harness.io import cache_root, write_atomic

VERSION = 1  # raise when the baseline's figures change for a reason the key does not see
LOGPROBS = "logprobs.f16"
SCORES = "scores.pt"


def baseline_folder(model, model_name: str, sequences: torch.Tensor, chunk: int, batch_size: int,
                    score_from: int) -> Path:  # fmt: skip
    """Where the baseline of `sequences` (S, T) int64 through `model` under these settings is kept."""
    identity = "|".join(
        [
            f"{VERSION}",
            model_identity(model, model_name),
            f"device={model.device.type}",
            f"chunk={chunk}",
            f"batch={batch_size}",
            f"score_from={score_from}",
            f"threads={torch.get_num_threads()}",
            f"torch={torch.__version__}",
        ]
    )
    key = hashlib.sha256(identity.encode() + sequences.numpy().tobytes()).hexdigest()[:20]
    return cache_root() / "baselines" / f"{model_name}-{key}"


def kept_baseline(model, model_name: str, sequences: torch.Tensor, chunk: int, batch_size: int,
                  score_from: int) -> tuple[evaluate.TeacherForced, bool]:  # fmt: skip
    """The teacher-forced baseline of `sequences` (S, T) through a DynamicCache (harness.evaluate.teacher_forced),
    its log-probs on disk: read from its folder when an earlier start made it (True), else computed into it (False).
    """
    folder = baseline_folder(model, model_name, sequences, chunk, batch_size, score_from)
    if (folder / SCORES).exists():
        saved = torch.load(folder / SCORES)
        logprobs = evaluate.file_tensor(folder / LOGPROBS, tuple(saved.pop("shape")), mode="r")
        return evaluate.TeacherForced(**saved, logprobs=logprobs), True
    folder.mkdir(parents=True, exist_ok=True)
    _drop_unfinished(folder)
    # a hidden name of this process's own: starts racing on one folder never write one file (harness.io.write_atomic)
    tmp = folder / f".{LOGPROBS}.tmp{os.getpid()}"
    baseline = evaluate.teacher_forced(
        model, sequences, evaluate.dynamic_cache_factory(model), chunk=chunk, batch_size=batch_size,
        score_from=score_from, logprobs_file=tmp,
    )  # fmt: skip
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())  # the mapped pages reach the disk before the folder says it is whole
    os.replace(tmp, folder / LOGPROBS)  # this process's map stays valid: the file is renamed, not rewritten
    scores = {
        "targets": baseline.targets,
        "nll": baseline.nll,
        "top1": baseline.top1,
        "shape": list(baseline.logprobs.shape),
    }
    write_atomic(folder / SCORES, lambda path: torch.save(scores, path))
    return baseline, False


def _drop_unfinished(folder: Path) -> None:
    """Delete the log-probs files in `folder` that a process no longer running left half written."""
    for path in folder.glob(f".{LOGPROBS}.tmp*"):
        pid = int(path.name.rsplit("tmp", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:  # alive, another user's
            pass
