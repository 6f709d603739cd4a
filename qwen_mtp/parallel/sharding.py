"""Tensor and data parallelism on a jax.sharding.Mesh with axes `data` and `model`: one rule table, and the
functions that turn a `Weights` / decode-state pytree into NamedShardings.

The partitioning itself is JAX's (GSPMD): weights and caches are placed with the shardings below and every
jitted step is compiled for them; the loops know nothing of meshes. Two exceptions go through `spmd.py`:
the Pallas kernels (quantized matmul, windowed draft attention) run per shard inside a shard_map, because a
custom call has no partitioning rule of its own and would otherwise be given whole (gathered) operands.

Rule table: each weight dimension has a LOGICAL axis (the trunk's description of each leaf,
qwen_mtp/trunk/weights.py weight_info; `logical_axes` reads them), each logical axis a mesh axis (`RULES`).
Megatron-style tensor parallelism over `model`:
  heads        attention query heads: q_proj columns (per head: query then gate), o_proj rows
  kv_heads     attention key / value heads: k_proj, v_proj columns, the KV caches' head axis, the MTP ring's
  v_heads      GDN value heads: in_proj_z, in_proj_b / a columns, A_log, dt_bias, out_proj rows, the
               recurrent state's head axis
  conv         GDN conv channels (q | k | v of every key / value head): in_proj_qkv columns, the conv taps,
               the conv window of the state
  mlp          MLP intermediate columns: gate / up columns, down rows (dense MLP and the shared expert)
  expert_mlp   MoE expert intermediate columns (every expert split the same way: no token routing between
               devices, ragged_dot stays local)
  vocab        embed rows, lm_head columns (the tied lm_head is embed^T, split alike)
  fc_in        the MTP head's fc rows (the concatenated [embedding ; hidden] input)
and data parallelism over `data`:
  batch        the batch rows of the caches, the GDN state and every per-row buffer of the loops
`hidden`, head_dim and the norms are never split (replicated).

A dimension is split only when the mesh axis divides it in whole units (heads, not columns of a head;
whole blocks of a quantized weight's scales): otherwise it is REPLICATED on that axis and `plan` records
why (e.g. 2 KV heads on 4 devices), never split wrongly. `describe` prints those decisions.
A batch that the data axis does not divide is replicated over `data` (every data group computes every row).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas.per_shard import AXES, batch_axis
from qwen_mtp.errors import ArgumentError
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.quant import QuantArray
from qwen_mtp.trunk.state import GDNState, KVCache
from qwen_mtp.trunk.weights import lm_head_info, weight_info

RULES = {"heads": "model", "kv_heads": "model", "v_heads": "model", "conv": "model", "mlp": "model",
         "expert_mlp": "model", "vocab": "model", "fc_in": "model", "batch": "data"}


def check_mesh(mesh) -> Mesh:
    """A jax.sharding.Mesh with axes exactly ('data', 'model') (either may have size 1), returned with Auto
    axis types (the partitioner decides every intermediate's sharding; jax.make_mesh's default is Explicit)."""
    if not isinstance(mesh, Mesh):
        raise ArgumentError("mesh", "a jax.sharding.Mesh with axes ('data', 'model'), e.g. "
                            "qwen_mtp.parallel.sharding.make_mesh(data=1, model=4)", type(mesh).__name__)
    if tuple(mesh.axis_names) != AXES:
        raise ArgumentError("mesh", f"axis names {AXES} (either axis may have size 1)", f"{tuple(mesh.axis_names)}")
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(AXES))


def make_mesh(data: int = 1, model: int | None = None, devices=None) -> Mesh:
    """A ('data', 'model') mesh over the first data * model of `devices` (default: every device of every
    process, in jax.devices() order). model=None takes every device data leaves."""
    devices = list(jax.devices() if devices is None else devices)
    for name, v in (("data", data), ("model", model)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise ArgumentError(name, "a mesh axis size >= 1", repr(v))
    if model is None:
        if len(devices) % data:
            raise ArgumentError("data", f"a divisor of the {len(devices)} devices", repr(data))
        model = len(devices) // data
    if data * model > len(devices):
        raise ArgumentError("mesh", f"data x model <= the {len(devices)} devices", f"{data} x {model}")
    return jax.make_mesh((data, model), AXES, axis_types=(AxisType.Auto,) * 2, devices=devices[:data * model])


def parse_mesh(text: str) -> Mesh:
    """'data=2,model=4' (the CLI's --mesh; an axis left out has size 1, 'model=-1' takes the devices left)."""
    sizes = {"data": 1, "model": 1}
    try:
        for part in str(text).split(","):
            name, value = part.split("=")
            name = name.strip()
            if name not in sizes:
                raise ValueError(name)
            sizes[name] = int(value)
    except ValueError:
        raise ArgumentError("mesh", "'data=D,model=M' (axis sizes; model=-1 takes the devices left)",
                            repr(text)) from None
    return make_mesh(sizes["data"], None if sizes["model"] == -1 else sizes["model"])


# ------------------------------------------------------------------------------------------------ the rules
def logical_axes(weights, cfg: ModelConfig) -> dict:
    """{path name ("layers.0.mixer.q_proj"): logical axes} of every weight `weights` (a Weights pytree) may hold,
    read from the trunk's description of each leaf (weights.weight_info). Beyond those leaves: a tied model's
    quantized lm_head (a copy of embed^T) and a draft vocabulary's lm_head columns split like lm_head; the
    draft vocabulary's ids are replicated."""
    info = weight_info(cfg, "float32", mtp=getattr(weights, "mtp", None) is not None)
    out = {".".join(path_names(p)): i.axes for p, i in jax.tree_util.tree_flatten_with_path(info)[0]}
    head = lm_head_info(cfg).axes
    out.setdefault("lm_head", head)
    out.update({"draft_vocab.lm_head": head, "draft_vocab.ids": (None,)})
    return out


def _axes(table: dict, names: tuple, ndim: int) -> tuple:
    axes = table.get(".".join(names))
    if axes is None or len(axes) != ndim:
        raise KeyError(f"no sharding rule for a {ndim}-D weight {'.'.join(names)}")
    return axes


def _units(axis: str, cfg: ModelConfig) -> int | None:
    """How many whole units a logical axis counts (heads; 1-wide units otherwise: None)."""
    return {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "v_heads": cfg.gdn_num_v_heads}.get(axis)


def _split_size(axis, dim, cfg, mesh, align=1):
    """The mesh axis to split a dimension of size `dim` on (or None) and why not when None."""
    mesh_axis = RULES.get(axis)
    if mesh_axis is None:
        return None, None
    n = mesh.shape[mesh_axis]
    if n == 1:
        return None, None
    units = _units(axis, cfg) or dim
    if units % n or dim % n or (dim // n) % align:
        what = f"{units} {axis.replace('_', ' ')}" if _units(axis, cfg) else f"{axis} of {dim}"
        why = f"{what} not divisible by {mesh_axis}={n}" + (f" in blocks of {align}" if align > 1 else "")
        return None, why
    return mesh_axis, None


@dataclasses.dataclass
class Plan:
    """Per weight: its mesh axes, and the dimensions left replicated with the reason."""
    specs: dict = dataclasses.field(default_factory=dict)  # "layers.0.mixer.q_proj" -> PartitionSpec (logical)
    replicated: dict = dataclasses.field(default_factory=dict)  # name -> reason


def path_names(path) -> tuple:
    out = []
    for k in path:
        if hasattr(k, "name"):
            out.append(k.name)
        elif hasattr(k, "idx"):
            out.append(str(k.idx))
    return tuple(out)


def _plain_spec(axes, names, shape, cfg, mesh, plan):
    spec = []
    for axis, dim in zip(axes, shape):
        m, why = _split_size(axis, dim, cfg, mesh)
        if why:
            plan.replicated[".".join(names)] = why
        spec.append(m)
    return P(*spec)


def _quant_specs(axes, names, w: QuantArray, cfg, mesh, plan):
    """(q spec, scale spec) for a QuantArray: a logical dim is split only if both its values and its scale
    blocks split in whole blocks (an int4 K in whole groups; an fp8 N in whole 128-column blocks)."""
    lead = w.shape[:-2]
    bk, bn = w.block
    q_spec, s_spec = [], []
    for i, (axis, dim) in enumerate(zip(axes, w.shape)):
        if i < len(lead):
            m, why = _split_size(axis, dim, cfg, mesh)
            q_spec.append(m), s_spec.append(m)
        else:
            b = bk if i == len(lead) else bn
            qdim = w.q.shape[i]
            sdim = w.scale.shape[i]
            # int4 packs two rows of one group per byte: its K splits in whole groups only
            whole = w.kind == "int4" and i == len(lead)
            m, why = _split_size(axis, dim, cfg, mesh, align=b if (b < dim or whole) else 1)
            if m is not None and whole and dim % b:
                m, why = None, f"int4 K of {dim} is padded to whole groups of {b}"
            if m is not None and (qdim % mesh.shape[m] or (sdim > 1 and sdim % mesh.shape[m])):
                m, why = None, f"{w.kind} blocks of {b} along a dim of {dim} do not split over {m}"
            q_spec.append(m)
            s_spec.append(m if sdim > 1 else None)
        if why:
            plan.replicated[".".join(names)] = why
    return P(*q_spec), P(*s_spec), (q_spec[-2], q_spec[-1])


def weight_plan(weights, cfg: ModelConfig, mesh) -> tuple:
    """(pytree like `weights` with a PartitionSpec per array (a QuantArray gets a QuantArray of specs, with
    `spec` set), Plan). `weights` may hold arrays or ShapeDtypeStructs; `mesh` may be a jax.sharding.AbstractMesh
    (planning for devices this machine does not have: abstract_mesh(data, model))."""
    if not isinstance(mesh, jax.sharding.AbstractMesh) or tuple(mesh.axis_names) != AXES:
        mesh = check_mesh(mesh)
    plan = Plan()
    table = logical_axes(weights, cfg)

    def visit(path, leaf):
        names = path_names(path)
        if leaf is None:
            return None
        if isinstance(leaf, QuantArray):
            qs, ss, kn = _quant_specs(_axes(table, names, len(leaf.shape)), names, leaf, cfg, mesh, plan)
            plan.specs[".".join(names)] = qs
            return dataclasses.replace(leaf, q=qs, scale=ss, spec=kn)
        spec = _plain_spec(_axes(table, names, len(leaf.shape)), names, leaf.shape, cfg, mesh, plan)
        plan.specs[".".join(names)] = spec
        return spec

    specs = jax.tree_util.tree_map_with_path(visit, weights, is_leaf=lambda x: isinstance(x, QuantArray))
    return specs, plan


def abstract_mesh(data: int, model: int):
    """A ('data', 'model') AbstractMesh: plans (weight_plan, planned_bytes) for a mesh not present here."""
    return jax.sharding.AbstractMesh((data, model), AXES, axis_types=(AxisType.Auto,) * 2)


def planned_bytes(weights, cfg: ModelConfig, mesh) -> dict:
    """{'total', 'per_device', 'replicated'} bytes of `weights` (arrays or ShapeDtypeStructs) under the plan
    for `mesh` (a Mesh or abstract_mesh(...)): per_device is what each device holds; replicated what every
    device of a model group holds whole because its dimensions do not divide."""
    specs, _ = weight_plan(weights, cfg, mesh)
    out = {"total": 0, "per_device": 0, "replicated": 0}

    def one(x, spec):
        n = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
        parts = math.prod(mesh.shape[a] for a in spec if a is not None)
        out["total"] += n
        out["per_device"] += n // parts
        out["replicated"] += n if parts == 1 else 0

    def visit(w, s):
        if w is None:
            return
        if isinstance(w, QuantArray):
            one(w.q, s.q), one(w.scale, s.scale)
        else:
            one(w, s)

    jax.tree.map(visit, weights, specs, is_leaf=lambda x: x is None or isinstance(x, QuantArray))
    return out


def weight_shardings(weights, cfg: ModelConfig, mesh):
    """Pytree like `weights` of NamedShardings (QuantArray leaves: a QuantArray of NamedShardings)."""
    mesh = check_mesh(mesh)
    specs, _ = weight_plan(weights, cfg, mesh)

    def to_sharding(s):
        if isinstance(s, QuantArray):
            return dataclasses.replace(s, q=NamedSharding(mesh, s.q), scale=NamedSharding(mesh, s.scale))
        return NamedSharding(mesh, s)

    return jax.tree.map(to_sharding, specs, is_leaf=lambda x: isinstance(x, (P, QuantArray)))


def shard_weights(weights, cfg: ModelConfig, mesh):
    """`weights` placed on `mesh` by the rule table (QuantArrays get their per-shard `spec` for the kernels).
    One program moves the whole tree (not one per array)."""
    mesh = check_mesh(mesh)
    shardings = weight_shardings(weights, cfg, mesh)
    is_q = lambda x: isinstance(x, QuantArray)
    no_spec = lambda t: jax.tree.map(lambda x: dataclasses.replace(x, spec=None) if is_q(x) else x, t, is_leaf=is_q)
    if mesh.is_multi_process:  # each process builds its own shards from its own (host) copy: no weight crosses hosts
        def place(a, sh):
            h = np.asarray(a)
            return jax.make_array_from_callback(h.shape, sh, lambda index: h[index])
        placed = jax.tree.map(place, no_spec(weights), no_spec(shardings))
    else:
        placed = jax.jit(lambda w: w, out_shardings=no_spec(shardings))(no_spec(weights))
    return jax.tree.map(lambda w, s: dataclasses.replace(w, spec=s.spec) if is_q(w) else w, placed, shardings,
                        is_leaf=lambda x: is_q(x) or x is None)


# ------------------------------------------------------------------------------------------------ state
def _state_spec(leaf_kind, cfg, mesh, batch):
    b = batch_axis(mesh, batch)
    kv = _split_size("kv_heads", cfg.num_kv_heads, cfg, mesh)[0]
    if leaf_kind == "kv":
        return P(b, None, kv, None)
    if leaf_kind == "conv":
        return P(b, None, _split_size("conv", cfg.conv_dim, cfg, mesh)[0])
    return P(b, _split_size("v_heads", cfg.gdn_num_v_heads, cfg, mesh)[0], None, None)


def state_shardings(state, cfg: ModelConfig, mesh, batch: int):
    """NamedShardings for a decode state (tuple of KVCache / GDNState) or one KVCache (the MTP head's cache or
    Wind-MTP ring): batch over data, kv heads / GDN value heads / conv channels over model."""
    mesh = check_mesh(mesh)
    ns = lambda kind: NamedSharding(mesh, _state_spec(kind, cfg, mesh, batch))

    def one(s):
        if isinstance(s, KVCache):
            return KVCache(ns("kv"), ns("kv"))
        if isinstance(s, GDNState):
            return GDNState(ns("conv"), ns("rec"))
        raise TypeError(type(s).__name__)

    return tuple(one(s) for s in state) if isinstance(state, tuple) else one(state)


def rows_sharding(mesh, batch: int, ndim: int = 1) -> NamedSharding:
    """Per-row arrays ([B, ...]): batch over data where it divides."""
    return NamedSharding(mesh, P(batch_axis(mesh, batch), *([None] * (ndim - 1))))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ------------------------------------------------------------------------------------------------ reports
def device_bytes(weights) -> dict:
    """{device: bytes of weights it holds} (addressable devices of this process)."""
    out: dict = {}
    for leaf in jax.tree.leaves(weights):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.size * shard.data.dtype.itemsize
    return out


def describe(weights, cfg: ModelConfig, mesh) -> str:
    """The mesh, per-device bytes against the whole, and every dimension left replicated with its reason."""
    mesh = check_mesh(mesh)
    _, plan = weight_plan(weights, cfg, mesh)
    total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(weights))
    lines = [(f"mesh data={mesh.shape['data']} model={mesh.shape['model']} ({mesh.size} devices); "
             f"weights {total / 2**20:.2f} MiB in all")]
    per = device_bytes(weights)
    if per:
        lo, hi = min(per.values()), max(per.values())
        lines.append(f"per device {lo / 2**20:.2f} .. {hi / 2**20:.2f} MiB ({hi / total:.3f} of the whole)")
    if plan.replicated:
        lines.append("replicated over an axis that does not divide them:")
        lines += [f"  {name}: {why}" for name, why in sorted(plan.replicated.items())]
    return "\n".join(lines)
