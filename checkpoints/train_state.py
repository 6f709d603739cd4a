"""The training run's whole state on disk, so `python -m checkpoints.train_small --resume` continues a run exactly
where it stopped (the same batches, the same updates: the same result as a run that never stopped).

A state folder holds one subfolder per saved step, `step_000123/`:
    arrays/      an orbax checkpoint of {"weights": Weights, "opt_state": the optimiser's state}
    state.json   the step, the phase ("lm" or "distill"), the batch sampler's numpy bit-generator state, the log
                 so far and the run's settings (written last: a step folder without it is incomplete)
and `tokenizer.json` (the run's tokenizer, trained once and reused by every resume). A step folder is written
under a temporary name and renamed into place, so a run killed while saving leaves the previous state whole;
only the newest KEEP step folders are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import jax

from qwen_mtp.errors import ArgumentError, CheckpointError

KEEP = 2
STATE = "state.json"
ARRAYS = "arrays"


def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp.PyTreeCheckpointer()


def step_folders(root) -> list:
    """Complete step folders of `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and (p / STATE).is_file())


def save(root, step: int, arrays: dict, meta: dict) -> Path:
    """Write step `step` (arrays: {"weights", "opt_state"}; meta: JSON-able) atomically; prune old steps."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        _checkpointer().save((tmp / ARRAYS).absolute(), arrays)
        (tmp / STATE).write_text(json.dumps({**meta, "step": step}, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in step_folders(root)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root):
    """(step folder, its state.json) of the newest complete step, or None."""
    found = step_folders(root)
    if not found:
        return None
    folder = found[-1]
    try:
        meta = json.loads((folder / STATE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(folder / STATE, None, "the JSON a training run writes", f"{type(e).__name__}: {e}")
    return folder, meta


def restore(folder, target: dict) -> dict:
    """The arrays of a step folder, restored into the structure of `target` (arrays or ShapeDtypeStructs)."""
    import orbax.checkpoint as ocp

    folder = Path(folder)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), target)
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=device,
                                                               global_shape=x.shape, dtype=x.dtype), abstract)
    try:
        return _checkpointer().restore((folder / ARRAYS).absolute(),
                                       args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args))
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; one typed error naming the folder
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise CheckpointError(folder / ARRAYS, None, "the training state this run saves",
                              f"{type(e).__name__}: {first}") from None


def check_resumable(root, settings: dict, meta: dict) -> None:
    """A resume must continue the same run: the settings that decide its result must match the saved ones."""
    saved = meta.get("settings", {})
    for key, value in settings.items():
        if key in saved and saved[key] != value:
            raise ArgumentError(f"--{key.replace('_', '-')}", f"{saved[key]!r}, as the run in {root} was started",
                                repr(value))
