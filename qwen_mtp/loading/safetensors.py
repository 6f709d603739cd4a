"""Read a Hugging Face Qwen3.5 / Qwen3.5-MoE / Qwen3-Next safetensors checkpoint into `Weights`.

Every tensor is checked against the config before anything is built: presence, shape and dtype. Tensors the
config does not account for are an error too (a config that undercounts layers must not load silently),
except the vision tower (`model.visual.*`) and a tied `lm_head.weight`.

Pre-quantized FP8 checkpoints (config.json `quantization_config`, parsed by config.load_quantization) load as
they are and stay FP8 in memory. Two layouts:
  quant_method "fp8" (Qwen's):  `<w>_scale_inv` [..., ceil(out / r), ceil(in / c)] beside an F8_E4M3 `<w>`,
                                 (r, c) = weight_block_size; weight = value * scale_inv of its block
  "compressed-tensors":          `<w>_scale` (i.e. `<layer>.weight_scale`) beside an F8_E4M3 `<w>`: per channel
                                 [..., out, 1], per tensor [] / [1] / [..., 1, 1], or blocks of a block
                                 strategy's block_structure; weight = value * scale
Which tensors are quantized is decided per tensor by the scale present beside it, never by a list of names
(Qwen keeps norms, embeddings, lm_head, gates in bf16). A quantized matrix becomes a quant.QuantArray in our
[in, out] = [K, N] orientation: values and scales transposed, HF's scale [ceil(N/r), ceil(K/c)] becomes
[ceil(K/c), ceil(N/r)] with block (bk, bn) = (c, r). `input_scale` tensors (static activation quantization) are
accepted beside a quantized weight and ignored: activations stay in the load dtype (dynamic, unquantized),
which is at least as precise as the static fp8 activations the checkpoint was calibrated for. A quantized
tensor our model does not multiply through `ops.linear` (the embedding, conv taps, norms) is dequantized to
the load dtype. A checkpoint whose scales do not fit their weights is a CheckpointError naming the tensor.

Splits. The loader rearranges some tensors before transposing: Qwen3-Next's fused in_proj_qkvz / in_proj_ba
(split per key head, then regrouped), fused MoE experts.gate_up_proj (split into gate and up), per-expert
tensors (stacked). Every split is a gather of rows (HF's output dimension); an FP8 piece keeps its values and
takes the matching scale rows when each block of r destination rows draws on a single source block (the
split falls on block boundaries, or the piece lies inside one block); a piece for which that fails is
dequantized to the load dtype (`_rows`). Experts stack as FP8 when all of them are FP8 with the same block,
else all are dequantized. At the real shapes with r = 128 nothing is dequantized:
  Qwen3-Next-80B-A3B (key heads 16, value heads 32, head dims 128): in_proj_qkvz per key head is
    q 128 | k 128 | v 256 | z 256 rows, every piece on a 128 boundary; in_proj_ba is 16 x (b 2 | a 2) = 64
    rows, all inside the first 128-row block, so b and a both take that block's scale row;
  fused gate_up_proj splits at moe_intermediate_size: 512 (Qwen3.5-35B-A3B, Qwen3-Next-80B-A3B) and 1024
    (Qwen3.5-122B-A10B, 397B-A17B), multiples of 128 (tests/test_fp8_checkpoint.py checks these).
Qwen3.5's own GDN projections are separate tensors (no split).

Which HF tensor each leaf reads (name, shape, orientation): weight_info in qwen_mtp/trunk/weights.py; the row
maps of the fused tensors: qwen_mtp/loading/hf_layout.py; the files, the tensor checks and the FP8-aware row
gathers / stacks: qwen_mtp/loading/safetensors_files.py. Eager and sharded loading share one reading of the
tree; they differ only in the leaf builder (_Eager: arrays now; _Sharded: leaves built in their shardings).

Sharded loading (load_weights(..., mesh=...), qwen_mtp.load(path, mesh=...)): qwen_mtp/loading/sliced_reads.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qwen_mtp.errors import ArgumentError, CheckpointError
from qwen_mtp.loading.hf_layout import ba_rows, gate_up_rows, qkvz_rows
from qwen_mtp.loading.safetensors_files import Reader, rows, stack
from qwen_mtp.loading.sliced_reads import (
    _T,
    Fp8Tensor,
    _conv_taps,
    _dense,
    _Fp8Leaf,
    _LazyFp8,
    _materialise,
    _Plain,
    _Quantized,
)
from qwen_mtp.trunk.config import ModelConfig, load_quantization
from qwen_mtp.trunk.quant import QUANTIZED_FIELDS, QuantArray, QuantPolicy, from_values, quantize
from qwen_mtp.trunk.weights import (
    AttnWeights,
    GDNWeights,
    LayerWeights,
    MLPWeights,
    MoEWeights,
    MTPWeights,
    Weights,
    lm_head_info,
    weight_info,
)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# ------------------------------------------------------------------------------------------ leaf builders
class _Eager:
    """Builds each leaf now: a jax array in the load dtype, or a QuantArray."""

    def __init__(self, np_dtype):
        self.np_dtype = np_dtype

    def cast(self, x):
        return jnp.asarray(np.ascontiguousarray(x).astype(self.np_dtype))

    def T(self, t):
        return np.swapaxes(t, -1, -2)

    def quantize(self, w, method, group_size):
        return quantize(w, method, group_size)

    def fp8(self, t: Fp8Tensor) -> QuantArray:
        return _quant_array(t)


class _Sharded(_Eager):
    """Builds lazy leaves (sliced_reads._Pending), placed with their shardings at the end (`_materialise`)."""

    def cast(self, x):
        return _Plain(x, self.np_dtype)

    def T(self, t):
        return _T(t)

    def quantize(self, w, method, group_size):
        return _Quantized(w, method, group_size)

    def fp8(self, t: _LazyFp8):
        return _Fp8Leaf(t)


@dataclasses.dataclass
class _Read:
    """One reading of the checkpoint (eager or sharded alike): reader, text prefix, leaf builder, policy."""

    r: Reader
    P: str
    b: _Eager
    policy: QuantPolicy | None

    def plain(self, x):
        return self.b.cast(_dense(x))

    def matrix(self, on: bool):
        """A matrix HF stores [out, in]: an FP8 one as it is; else transposed, quantized if `on` under the policy."""
        def f(t):
            if isinstance(t, (Fp8Tensor, _LazyFp8)):
                return self.b.fp8(t)
            w = self.b.T(t)
            if self.policy is not None and on:
                return self.b.quantize(w, self.policy.method, self.policy.group_size)
            return self.b.cast(w)
        return f

    def get(self, info, expert=None):
        """The HF tensor of a leaf (one expert's for an "{e}" pattern), checked against its shape."""
        return self.r.get(info.hf_name(self.P, expert), info.hf_shape)

    def fused(self, info):
        return info.hf_fused.format(P=self.P)

    def leaf(self, field: str, info, lin, t=None):
        """A leaf from its HF tensor `t` (read by name when None): norms and vectors plain, the conv taps
        rearranged, matrices through `lin` when the quantization rule names them (quant.QUANTIZED_FIELDS, the
        rule quant.abstract follows), else kept in the load dtype unless FP8 in the checkpoint."""
        t = self.get(info) if t is None else t
        if info.hf_form == "conv":
            return self.plain(_conv_taps(t))
        if info.hf_form != "T":
            return self.plain(t)
        return (lin if field in QUANTIZED_FIELDS else self.matrix(False))(t)

    def fields(self, infos, lin, given=None):
        """{field: leaf} of a module (AttnWeights, GDNWeights, MLPWeights of LeafInfo), read in field order;
        `given`: HF tensors already gathered for some fields."""
        given = given or {}
        return {f.name: self.leaf(f.name, getattr(infos, f.name), lin, given.get(f.name))
                for f in dataclasses.fields(infos)}


# ------------------------------------------------------------------------------------------ layers
def _gdn(rd: _Read, info: GDNWeights, cfg, lin):
    if cfg.family != "qwen3_next":
        return GDNWeights(**rd.fields(info, lin))
    # fused projections, grouped per key head: [q(dk) k(dk) v(r*dv) z(r*dv)] and [b(r) a(r)]
    H, nv, kd, vd = cfg.hidden_size, cfg.gdn_num_v_heads, cfg.gdn_key_dim, cfg.gdn_value_dim
    qkvz = rd.r.get(rd.fused(info.in_proj_qkv), (2 * kd + 2 * vd, H))
    qkv_idx, z_idx = qkvz_rows(cfg)
    ba = rd.r.get(rd.fused(info.in_proj_b), (2 * nv, H))
    b_idx, a_idx = ba_rows(cfg)
    given = {"in_proj_qkv": rows(qkvz, qkv_idx), "in_proj_z": rows(qkvz, z_idx), "in_proj_b": rows(ba, b_idx),
             "in_proj_a": rows(ba, a_idx)}
    return GDNWeights(**rd.fields(info, lin, given))


def _moe(rd: _Read, info: MoEWeights, cfg, lin):
    H, E, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    if rd.r.has(rd.fused(info.gate)):  # fused: [E, 2I, H] (gate rows first), [E, H, I]
        gu = rd.r.get(rd.fused(info.gate), (E, 2 * inter, H))
        gate_idx, up_idx = gate_up_rows(cfg)
        gate, up = rows(gu, gate_idx), rows(gu, up_idx)
        down = rd.r.get(rd.fused(info.down), (E, H, inter))
    else:
        gate, up, down = (stack([rd.get(i, e) for e in range(E)], i.hf_name(rd.P, "*"))
                          for i in (info.gate, info.up, info.down))
    return MoEWeights(router=rd.leaf("router", info.router, lin), gate=lin(gate), up=lin(up), down=lin(down),
                      shared=MLPWeights(**rd.fields(info.shared, lin)),
                      shared_gate=rd.leaf("shared_gate", info.shared_gate, lin))


def _layer(rd: _Read, info: LayerWeights, cfg, lin):
    if isinstance(info.mixer, AttnWeights):
        mixer = AttnWeights(**rd.fields(info.mixer, lin))
    else:
        mixer = _gdn(rd, info.mixer, cfg, lin)
    ff = _moe(rd, info.mlp, cfg, lin) if isinstance(info.mlp, MoEWeights) else MLPWeights(**rd.fields(info.mlp, lin))
    return LayerWeights(input_norm=rd.plain(rd.get(info.input_norm)), post_norm=rd.plain(rd.get(info.post_norm)),
                        mixer=mixer, mlp=ff)


def _mtp(rd: _Read, info: MTPWeights, cfg, lin):
    return MTPWeights(fc=rd.leaf("fc", info.fc, lin),
                      pre_fc_norm_embedding=rd.plain(rd.get(info.pre_fc_norm_embedding)),
                      pre_fc_norm_hidden=rd.plain(rd.get(info.pre_fc_norm_hidden)),
                      norm=rd.plain(rd.get(info.norm)), layer=_layer(rd, info.layer, cfg, lin))


def _quant_array(t: Fp8Tensor) -> QuantArray:
    """HF [..., out, in] FP8 -> our [..., in, out] QuantArray (values and scales transposed, block (c, r))."""
    q = np.ascontiguousarray(np.swapaxes(t.values, -1, -2))
    s = np.ascontiguousarray(np.swapaxes(t.scale, -1, -2))
    try:
        return from_values(q, s, "fp8", q.shape, (t.block[1], t.block[0]))
    except ValueError as e:
        raise CheckpointError(t.file, t.name, "scales matching their weight", str(e)) from None


def checkpoint_policy(weights: Weights) -> QuantPolicy:
    """The QuantPolicy of what an FP8 checkpoint held quantized (source 'checkpoint')."""
    is_q = lambda x: isinstance(x, QuantArray)
    mtp = weights.mtp is not None and any(is_q(x) for x in jax.tree.leaves(weights.mtp, is_leaf=is_q))
    return QuantPolicy("fp8", lm_head=is_q(weights.lm_head), mtp=mtp, source="checkpoint")


def load_weights(folder, cfg: ModelConfig, dtype="float32", policy: QuantPolicy | None = None, mesh=None) -> Weights:
    """`policy` None: every tensor in `dtype`. Otherwise the matrices it names are quantized as they load
    (qwen_mtp/trunk/quant.py), each from its float32 values, so a bf16 load and an f32 load quantize alike.

    A checkpoint whose config.json has a quantization_config (FP8) loads its FP8 matrices as QuantArrays
    (module docstring); `policy` must then be None: re-quantizing an already quantized checkpoint is refused
    (an ArgumentError naming `quant`), since it would round every weight twice.

    `mesh` (a checked ('data', 'model') jax.sharding.Mesh): the weights are built straight into the shardings
    of qwen_mtp/parallel/sharding.py (weight_shardings of the tree's shapes), each with jax.make_array_from_callback:
    every device's slice is read from the file when it is placed (a memory map of the tensor's byte range; our
    [in, out] slice [k0:k1, n0:n1] reads HF's [n0:n1, k0:k1]; row gathers and per-expert stacks read only the
    rows they need; slices a device shares with others, e.g. replicas over `data`, are read once per leaf), and
    only the slices of this process's devices are read. So no host or device ever holds a whole model, only its
    share. Quantizing as it loads (`policy`) needs whole columns for its scales: such a matrix is read whole on
    the host, quantized there and its slices placed (peak host memory: one tensor, e.g. one layer's stacked
    experts). A pre-quantized FP8 checkpoint's values are read slice by slice as stored, its scales whole. The
    result is the same, bit for bit, as loading without a mesh and sharding.shard_weights."""
    if dtype not in DTYPES:
        raise CheckpointError(folder, None, f"dtype one of {sorted(DTYPES)}", repr(dtype))
    folder = Path(folder)
    ckq = load_quantization(folder) if (folder / "config.json").is_file() else None
    if ckq is not None and policy is not None:
        raise ArgumentError("quant", f"None: {folder} is already quantized ({ckq.method} FP8 in its config.json) and "
                            "loads as it is", repr(policy.method))
    np_dtype = np.float32 if DTYPES[dtype] == jnp.float32 else ml_dtypes.bfloat16
    r = Reader(folder, ckq, lazy=mesh is not None)
    info = weight_info(cfg, dtype, mtp=True)
    P = cfg.tensor_prefix
    if not r.has(info.embed.hf_name(P)):
        other = "model." if P != "model." else "model.language_model."
        if r.has(info.embed.hf_name(other)):  # e.g. a text checkpoint saved with the multimodal prefix
            P = other
    rd = _Read(r, P, _Eager(np_dtype) if mesh is None else _Sharded(np_dtype), policy)
    lin = rd.matrix(True)
    embed_raw = _dense(rd.get(info.embed))
    embed = rd.b.cast(embed_raw)
    layers = tuple(_layer(rd, li, cfg, lin) for li in info.layers)
    final_norm = rd.plain(rd.get(info.final_norm))
    head = lm_head_info(cfg)
    if cfg.tie_word_embeddings:
        # a quantized copy of embed^T when the policy asks; the embedding stays as loaded
        lm_head = rd.b.quantize(rd.b.T(embed_raw), policy.method, policy.group_size) \
            if policy is not None and policy.lm_head else None
    else:
        lm_head = rd.matrix(policy is not None and policy.lm_head)(rd.get(info.lm_head))
    mtp = None
    if any(name.startswith("mtp.") for name in r.files):
        n = max(cfg.mtp_num_layers, 1)
        if n != 1:
            raise CheckpointError(folder, "mtp.layers.*", "mtp_num_hidden_layers == 1 (as released)", n)
        mtp = _mtp(rd, info.mtp, cfg, rd.matrix(policy is not None and policy.mtp))
    tied_unused = {head.hf, *r.scales_of(head.hf)} if cfg.tie_word_embeddings else ()
    r.check_all_used(allowed_unused=tied_unused)
    if ckq is not None and r.n_fp8 == 0:
        raise CheckpointError(folder, None, f"F8_E4M3 weights with their scales (config.json declares "
                              f"quant_method {ckq.method!r})", "no quantized tensor")
    weights = Weights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head, mtp=mtp)
    return weights if mesh is None else _materialise(weights, cfg, mesh)
