"""Run by tests/test_sharded_load.py in a subprocess with 8 virtual CPU devices (XLA_FLAGS must be set before jax
is imported): load(path, mesh=...) and an orbax restore with mesh= against load(path) + qwen_mtp.shard.

    python tests/sharded_load_worker.py SMALL MOE TMP   (prints one JSON line of figures last)

SMALL: the shipped bf16 model (vocab 4096, 4 heads / 2 KV heads). MOE: a tiny MoE checkpoint, f32, per-expert
trunk experts (stacked on load) and an MTP head with fused experts (split on load). TMP: a folder to save into.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

import qwen_mtp
from qwen_mtp import ArgumentError, CheckpointError, QuantArray
from qwen_mtp.loading import orbax_io, sliced_reads
from qwen_mtp.parallel.sharding import make_mesh

is_q = lambda x: isinstance(x, QuantArray)


def shard(model, mesh):
    """qwen_mtp.shard(model, mesh) from host copies of the weights: the same shardings and bytes, without the
    resharding programs a device-to-device device_put compiles per leaf (a second each on this CPU)."""
    return qwen_mtp.shard(dataclasses.replace(model, weights=jax.tree.map(np.asarray, model.weights)), mesh)


def assert_same(ref, got, what):
    """Same tree (QuantArray statics, `spec` included), and per array the same sharding, dtype and bytes."""
    (la, ta), (lb, tb) = (jax.tree_util.tree_flatten_with_path(w, is_leaf=is_q) for w in (ref.weights, got.weights))
    assert ta == tb, f"{what}: tree structures differ"
    n = 0
    for (path, x), (_, y) in zip(la, lb):
        name = f"{what} {jax.tree_util.keystr(path)}"
        assert type(x) is type(y), name
        if is_q(x):
            assert x.spec is not None and x.spec == y.spec, f"{name}: spec {x.spec} vs {y.spec}"
            pairs = [(x.q, y.q), (x.scale, y.scale)]
        else:
            pairs = [(x, y)]
        for u, v in pairs:
            assert u.sharding == v.sharding, f"{name}: {u.sharding} vs {v.sharding}"
            assert u.dtype == v.dtype and u.shape == v.shape, name
            for su, sv in zip(sorted(u.addressable_shards, key=lambda s: s.device.id),
                              sorted(v.addressable_shards, key=lambda s: s.device.id)):
                assert su.index == sv.index, name
                assert np.array_equal(np.asarray(su.data).view(np.uint8), np.asarray(sv.data).view(np.uint8)), name
            n += 1
    assert got.mesh is not None and ref.mesh is not None and got.mesh.shape == ref.mesh.shape, what
    return n


class ReadLog:
    """Wraps sliced_reads._Stored.read: (tensor name, index, bytes) of every read from a safetensors file."""

    def __init__(self):
        self.reads, self.real = [], sliced_reads._Stored.read
        log = self

        def read(stored, index):
            out = log.real(stored, index)
            log.reads.append((stored.name, index, out.nbytes, int(np.prod(stored.shape)) * stored.dtype.itemsize))
            return out

        sliced_reads._Stored.read = read

    def close(self):
        sliced_reads._Stored.read = self.real


def main(small, moe, tmp):
    tmp = Path(tmp)
    figures = {}
    meshes = {"1x4": make_mesh(1, 4), "2x2": make_mesh(2, 2)}
    arrays, plains = 0, {}
    for label, path in (("small", small), ("moe", moe)):
        for quant in (None, "int4"):
            kw = {"dtype": "float32"} if quant is None else {"dtype": "bfloat16", "quant": "int4", "group_size": 32}
            plain = plains[label, quant] = qwen_mtp.load(path, **kw)
            for mname, mesh in meshes.items():
                what = f"{label} {quant or 'f32'} {mname}"
                ref = shard(plain, mesh)
                log = ReadLog()
                t = time.perf_counter()
                try:
                    got = qwen_mtp.load(path, mesh=mesh, **kw)
                finally:
                    log.close()
                figures[f"load {what} s"] = round(time.perf_counter() - t, 3)
                arrays += assert_same(ref, got, what)
                # every element of the file is read at most once, whole tensors only where quantized
                per = {}
                for name, index, nbytes, whole in log.reads:
                    per.setdefault(name, [0, whole])[0] += nbytes
                assert all(got_ <= whole for got_, whole in per.values()), what
                read, total = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
                figures[f"read {what}"] = f"{read} of {total} bytes"
                if quant is None:
                    assert read == total, what  # each element once, replicas sharing their read
                    check_slices(log.reads, label, mname, what)

    figures["cpu s: safetensors loads"] = round(time.process_time(), 1)

    # pre-quantized FP8 checkpoints: values read slice by slice as stored (per-expert FP8 stacked, the MTP head's
    # fused experts split on block boundaries, the embedding and conv taps dequantized slice by slice)
    from hf_fp8 import write_fp8

    fp8_picks = {"fp8": lambda name, w: "block" if w.ndim >= 2 else None,
                 "compressed-tensors": lambda name, w: None if w.ndim < 2 else "channel" if w.ndim == 2 else "tensor"}
    for layout, pick in fp8_picks.items():
        folder = tmp / f"fp8-{layout}"
        write_fp8(moe, folder, tmp / f"fp8-{layout}-deq", layout=layout, pick=pick, block=(16, 16), seed=3)
        plain = qwen_mtp.load(folder)
        assert plain.quant is not None and plain.quant.source == "checkpoint"
        for mname, mesh in meshes.items():
            log = ReadLog()
            try:
                got = qwen_mtp.load(folder, mesh=mesh)
            finally:
                log.close()
            arrays += assert_same(shard(plain, mesh), got, f"{layout} {mname}")
            assert got.quant == plain.quant
            per = {}
            for name, index, nbytes, whole in log.reads:
                per.setdefault(name, [0, whole])[0] += nbytes
            assert all(got_ <= whole for got_, whole in per.values()), layout
            figures[f"read fp8 {layout} {mname}"] = f"{sum(v[0] for v in per.values())} of " \
                                                    f"{sum(v[1] for v in per.values())} bytes"

    # errors stay typed: a NaN in an FP8 value is found in the slice read, a non-mesh is refused
    bad = tmp / "fp8-fp8"
    with open(bad / "model.safetensors", "r+b") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        name = "model.layers.0.mlp.experts.2.up_proj.weight"
        f.seek(f.tell() + header[name]["data_offsets"][0] + 5)
        f.write(b"\x7f")
    for mesh, want in ((meshes["1x4"], "NaN entries"), ("data=1,model=4", "jax.sharding.Mesh")):
        try:
            qwen_mtp.load(bad, mesh=mesh)
            raise AssertionError(f"loaded with {want}")
        except (CheckpointError, ArgumentError) as e:
            assert want in str(e), str(e)
    figures["cpu s: + fp8 loads"] = round(time.process_time(), 1)

    # orbax: save unsharded, restore straight into the shardings (as saved, cast to bf16, int4)
    small_model, moe_int4 = plains["small", None], plains["moe", "int4"]
    folders = {"small": qwen_mtp.save(small_model, tmp / "small"), "moe-int4": qwen_mtp.save(moe_int4, tmp / "moe-int4")}
    restored = {}
    for label, mname, dtype in (("small", "1x4", "bfloat16"), ("small", "2x2", "float32"),
                                ("moe-int4", "1x4", "bfloat16"), ("moe-int4", "2x2", "bfloat16")):
        mesh = meshes[mname]
        ref = shard(qwen_mtp.load(folders[label], dtype=dtype), mesh)
        t = time.perf_counter()
        got = qwen_mtp.load(folders[label], dtype=dtype, mesh=mesh)
        figures[f"restore {label} {dtype} {mname} s"] = round(time.perf_counter() - t, 3)
        arrays += assert_same(ref, got, f"orbax {label} {dtype} {mname}")
        restored[label, mname] = got
    figures["arrays compared"] = arrays

    # the CRC-32 check runs on a sharded restore: a metadata CRC that does not match the bytes is refused
    meta_file = tmp / "moe-int4" / orbax_io.META
    meta = json.loads(meta_file.read_text())
    meta["arrays"]["layers.0.mlp.gate.q"]["crc32"] ^= 1
    meta_file.write_text(json.dumps(meta))
    try:
        qwen_mtp.load(tmp / "moe-int4", mesh=meshes["2x2"])
        raise AssertionError("a wrong CRC-32 restored")
    except CheckpointError as e:
        assert "layers.0.mlp.gate.q" in str(e) and "CRC-32" in str(e), str(e)

    figures["cpu s: + orbax"] = round(time.process_time(), 1)

    print(json.dumps(figures))


def check_slices(reads, label, mname, what):
    """The reads of a tensor split over `model` are its devices' slices, not the whole tensor."""
    model = int(mname.split("x")[1])
    name = "model.layers.0.mlp.gate_proj.weight" if label == "small" else "model.layers.0.mlp.experts.0.up_proj.weight"
    mine = [(index, nbytes, whole) for n, index, nbytes, whole in reads if n == name]
    assert len(mine) == model, (what, name, mine)
    assert all(nbytes * model == whole for _, nbytes, whole in mine), (what, name, mine)
    # `model` distinct slices (the split dimension's parts), each read once
    slices = {tuple((ix.start, ix.stop) for ix in index) for index, _, _ in mine}
    assert len(slices) == model, (what, slices)


if __name__ == "__main__":
    main(*sys.argv[1:4])
