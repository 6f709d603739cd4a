"""One process of a 2-process (multi-host style) JAX job on CPU, for tests/test_multiprocess.py.

    python tests/multiprocess_worker.py --coordinator localhost:PORT --num-processes 2 --process-id I \
        --devices 2 --plan 1x4=plain,spec_k2 --plan 2x2=spec_k2 [--stream 2x2=spec_k2] [--load-sharded 2x2] \
        --out results.json

Each process gets `--devices` virtual CPU devices (XLA_FLAGS, set before jax is imported), joins the job with
jax.distributed.initialize (CPU collectives over gloo), and runs the same qwen_mtp.generate calls on the shipped
model (float32) sharded on each mesh of --plan (qwen_mtp.parallel.sharding.make_mesh over jax.devices(): every process's
devices), weights placed by qwen_mtp.shard(load(...), mesh), or load(..., mesh=mesh) for --load-sharded meshes.
Process 0 writes {"meshes": {"DxM": {case: tokens}}, "mesh_processes", "stream", "timings", device counts} to
--out; every process writes {"stream": what its own stream callable received, "timings"} to --out + ".p<I>".
A failure prints its traceback and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ([5, 17, 99, 3, 250, 7, 41, 1000, 12, 64, 8], [300, 12, 7, 7, 7, 2048, 19, 5, 77])
NEW_TOKENS = 12


def cases():
    """name -> SpecConfig or None (imported late: qwen_mtp pulls in jax)."""
    from qwen_mtp import SpecConfig

    return {"plain": None, "spec_k2": SpecConfig(k=2), "window_k2": SpecConfig(k=2, window=8)}


def _cpu():
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_cases(model, names, stream_case=None, timings=None):
    """{case: tokens as lists} (eos disabled so every row runs NEW_TOKENS), and the stream log of stream_case."""
    import qwen_mtp

    out, streamed = {}, None
    specs = cases()
    for name in names:
        t, c = time.perf_counter(), _cpu()
        kw = {}
        if name == stream_case:
            streamed = [[] for _ in PROMPTS]

            def sink(rows, got=streamed):
                for b, r in enumerate(rows):
                    got[b].extend(int(t) for t in r)

            kw["stream"] = sink
        res = qwen_mtp.generate(model, [list(p) for p in PROMPTS], NEW_TOKENS, spec=specs[name], eos_token_id=[],
                                **kw)
        out[name] = res.tokens.tolist()
        if timings is not None:
            timings[name] = (round(time.perf_counter() - t, 2), round(_cpu() - c, 2))
        print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
    return out, streamed


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--plan", action="append", required=True,
                    help="DxM=case,case,...: the cases to run on the mesh data=D, model=M (repeatable)")
    ap.add_argument("--stream", action="append", default=[],
                    help="DxM=case: run that case with a stream callable and record what it delivered")
    ap.add_argument("--load-sharded", action="append", default=[],
                    help="DxM: place the weights with qwen_mtp.load(..., mesh=) (each process reads its own "
                         "slices) instead of qwen_mtp.shard(load(...), mesh)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--init-timeout", type=int, default=60, help="seconds to wait for every process to join")
    args = ap.parse_args(argv)

    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}").strip()
    sys.path.insert(0, str(REPO))
    t0 = time.perf_counter()
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_default_matmul_precision", "highest")
    if os.environ.get("QWEN_MTP_LOG_COMPILES"):
        import logging
        logging.basicConfig(level=logging.WARNING)
        jax.config.update("jax_log_compiles", True)
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=args.init_timeout)
    import qwen_mtp
    from qwen_mtp.loading.folder import default_model_path
    from qwen_mtp.parallel import sharding

    t_init, c_init = time.perf_counter(), _cpu()
    print(f"process {jax.process_index()} of {jax.process_count()} joined in {t_init - t0:.1f} s", flush=True)
    devices = jax.devices()
    base = qwen_mtp.load(default_model_path(), dtype="float32")
    stream_case = dict(s.split("=") for s in args.stream)
    result = {"process_count": jax.process_count(), "global_devices": len(devices),
              "local_devices": len(jax.local_devices()), "meshes": {}, "mesh_processes": {}, "stream": {},
              "timings": {}}
    for item in args.plan:
        text, names = item.split("=")
        d, m = (int(v) for v in text.split("x"))
        t, c = time.perf_counter(), _cpu()
        mesh = sharding.make_mesh(data=d, model=m)
        result["mesh_processes"][text] = sorted({dev.process_index for dev in mesh.devices.flat})
        if text in args.load_sharded:
            model = qwen_mtp.load(default_model_path(), dtype="float32", mesh=mesh)
        else:
            model = qwen_mtp.shard(base, mesh)
        result["timings"][f"{text} shard"] = (round(time.perf_counter() - t, 2), round(_cpu() - c, 2))
        times = {}
        print(f"mesh {text}: weights placed in {time.perf_counter() - t:.1f} s", flush=True)
        toks, streamed = run_cases(model, names.split(","), stream_case.get(text), times)
        result["timings"].update({f"{text} {k}": v for k, v in times.items()})
        result["meshes"][text] = toks
        if streamed is not None:
            result["stream"][text] = streamed
    result["timings"]["init"] = (round(t_init - t0, 2), round(c_init, 2))
    result["timings"]["total"] = (round(time.perf_counter() - t0, 2), round(_cpu(), 2))
    out = Path(args.out)
    Path(f"{out}.p{args.process_id}").write_text(json.dumps({"stream": result["stream"],
                                                              "timings": result["timings"]}))
    if args.process_id == 0:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # noqa: BLE001 - any failure: its traceback for the test's report, then exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)
