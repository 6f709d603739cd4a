"""One process per host: jax.distributed start-up and agreeing on one value across processes."""

from __future__ import annotations

import os

import numpy as np

from qwen_mtp.errors import ArgumentError


def start_distributed():
    """--distributed: jax.distributed.initialize(), before any other jax call. jax 0.10.2 finds the processes
    itself under SLURM, Open MPI (mpirun), on Cloud TPU VMs and in Kubernetes (with the `kubernetes` package),
    and reads JAX_COORDINATOR_ADDRESS (also JAX_COORDINATOR_PORT, JAX_LOCAL_DEVICE_IDS) from the environment,
    but not a process count or id: for a launch by hand those come from JAX_NUM_PROCESSES and JAX_PROCESS_ID,
    read here."""
    import jax

    kw = {}
    for name, var in (("num_processes", "JAX_NUM_PROCESSES"), ("process_id", "JAX_PROCESS_ID")):
        if os.environ.get(var, "") != "":
            try:
                kw[name] = int(os.environ[var])
            except ValueError:
                raise ArgumentError(var, "an integer", repr(os.environ[var])) from None
    if jax.distributed.is_initialized():
        return
    try:
        jax.distributed.initialize(**kw)
    except (ValueError, RuntimeError) as e:  # no cluster found and the environment does not say (coordinator,
        # count, id); jax already started in this process; the coordinator unreachable
        raise ArgumentError("--distributed", "a multi-process job jax detects (SLURM, Open MPI, Cloud TPU, "
                            "Kubernetes) or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set",
                            str(e).splitlines()[0]) from None


def same_on_every_process(value: int) -> int:
    """Process 0's `value` on every process (a choice made from timings, which differ between processes, must
    be one choice: every process runs the same programs)."""
    import jax

    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))
