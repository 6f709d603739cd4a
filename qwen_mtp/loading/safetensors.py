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

Sharded loading (load_weights(..., mesh=...), qwen_mtp.load(path, mesh=...)): qwen_mtp/loading/sliced_reads.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from kernels_pallas import quant_layout as layout
from qwen_mtp.errors import ArgumentError, CheckpointError
from qwen_mtp.loading.sliced_reads import (
    _T,
    FP8_DTYPE,
    NP_DTYPES,
    Fp8Tensor,
    _Cast,
    _conv_taps,
    _dense,
    _Dequant,
    _Fp8Leaf,
    _Lazy,
    _LazyFp8,
    _materialise,
    _Plain,
    _Quantized,
    _Rows,
    _Stack,
    _Stored,
)
from qwen_mtp.trunk.config import CheckpointQuant, ModelConfig, load_quantization
from qwen_mtp.trunk.quant import QuantArray, QuantPolicy, from_values, quantize
from qwen_mtp.trunk.weights import AttnWeights, GDNWeights, LayerWeights, MLPWeights, MoEWeights, MTPWeights, Weights

FLOAT_DTYPES = {"F32", "F16", "BF16"}
IGNORED_PREFIXES = ("model.visual.",)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
INPUT_SCALE = "input_scale"


def _shard_files(folder: Path) -> dict:
    """tensor name -> file path, from model.safetensors.index.json or the single model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(index, None, "a JSON object with a 'weight_map'", f"{type(e).__name__}: {e}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(index, None, "'weight_map' to be an object", type(weight_map).__name__)
        if not weight_map:
            raise CheckpointError(index, None, "a 'weight_map' naming the checkpoint's tensors", "an empty map")
        root = folder.resolve()
        files = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise CheckpointError(index, name, "a shard file name (a non-empty string)", repr(shard))
            p = (folder / str(shard)).resolve()
            if Path(str(shard)).is_absolute() or not p.is_relative_to(root):
                raise CheckpointError(index, name, f"a shard path inside {root}", repr(shard))
            if not p.is_file():
                raise CheckpointError(index, name, "an existing shard file", f"missing file {shard!r}")
            files[name] = p
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(folder, None, "model.safetensors or model.safetensors.index.json", "neither")
    return {name: single for name in _open(single).keys()}


def _open(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(file, None, "a readable safetensors file", f"{type(e).__name__}: {e}") from None


# ------------------------------------------------------------------------------------------ row gathers and stacks
def rows_keep_blocks(idx, r: int) -> bool:
    """Whether gathering rows `idx` of a tensor with r rows per scale block leaves every block of r destination
    rows drawing on one source block (so the scales can move with the values)."""
    src = np.asarray(idx) // r
    return bool(np.array_equal(src, np.repeat(src[::r], r)[:len(src)]))


def _rows(t, idx):
    """Rows `idx` (axis -2, HF's output dimension) of a float array or an Fp8Tensor; an Fp8Tensor stays FP8
    when rows_keep_blocks, else it is dequantized (float32)."""
    idx = np.asarray(idx)
    if isinstance(t, _Lazy):
        return _Rows(t, idx)
    if isinstance(t, _LazyFp8):
        if rows_keep_blocks(idx, t.block[0]):
            return _LazyFp8(_Rows(t.values, idx), t.scale[..., idx[::t.block[0]] // t.block[0], :], t.block,
                            t.file, t.name)
        return _Rows(_Dequant(t), idx)
    if not isinstance(t, Fp8Tensor):
        return t[..., idx, :]
    if rows_keep_blocks(idx, t.block[0]):
        first = idx[::t.block[0]] // t.block[0]
        return Fp8Tensor(t.values[..., idx, :], t.scale[..., first, :], t.block, t.file, t.name)
    return t.dequantize()[..., idx, :]


def _stack(ts, name):
    """Per-expert tensors -> one [E, ...] tensor: FP8 when all are FP8 with one block, else float."""
    if isinstance(ts[0], (_Lazy, _LazyFp8)):  # a lazy reader's tensors (load(mesh=...))
        fp8 = [isinstance(t, _LazyFp8) for t in ts]
        if all(fp8) and len({t.block for t in ts}) == 1:
            return _LazyFp8(_Stack([t.values for t in ts]), np.stack([t.scale for t in ts]), ts[0].block,
                            ts[0].file, name)
        if any(fp8):
            return _Stack([_Cast(_dense(t), np.float32) for t in ts])
        return _Stack(ts)
    fp8 = [isinstance(t, Fp8Tensor) for t in ts]
    if all(fp8) and len({t.block for t in ts}) == 1:
        return Fp8Tensor(np.stack([t.values for t in ts]), np.stack([t.scale for t in ts]), ts[0].block,
                         ts[0].file, name)
    if any(fp8):
        return np.stack([np.asarray(_dense(t), np.float32) for t in ts])
    return np.stack(ts)


def qkvz_rows(cfg: ModelConfig):
    """Qwen3-Next's in_proj_qkvz rows [per key head: q(dk) k(dk) v(r dv) z(r dv)] -> (rows of our
    in_proj_qkv [all q | all k | all v], rows of in_proj_z)."""
    nk, dk, dv = cfg.gdn_num_k_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
    rep = cfg.gdn_num_v_heads // nk
    g = np.arange(nk * (2 * dk + 2 * rep * dv)).reshape(nk, -1)
    q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + rep * dv], axis=1)
    return np.concatenate([q.ravel(), k.ravel(), v.ravel()]), z.ravel()


def ba_rows(cfg: ModelConfig):
    """Qwen3-Next's in_proj_ba rows [per key head: b(r) a(r)] -> (rows of in_proj_b, rows of in_proj_a)."""
    rep = cfg.gdn_num_v_heads // cfg.gdn_num_k_heads
    g = np.arange(2 * cfg.gdn_num_v_heads).reshape(cfg.gdn_num_k_heads, 2 * rep)
    return g[:, :rep].ravel(), g[:, rep:].ravel()


# ------------------------------------------------------------------------------------------ the reader
class _Reader:
    """Hands out validated tensors (numpy float arrays, or Fp8Tensor for an F8_E4M3 weight with its scale) and
    records which names were used. lazy=True: lazy tensors instead (_Stored, _LazyFp8), validated alike; the
    values are read when a slice is asked for (an FP8 weight's scales are read at once)."""

    def __init__(self, folder: Path, quant: CheckpointQuant | None, lazy: bool = False):
        self.lazy = lazy
        self.files = _shard_files(folder)
        self.handles = {f: _open(f) for f in set(self.files.values())}
        for f, h in self.handles.items():  # the index must not name tensors its shard lacks
            keys = set(h.keys())
            for name, g in self.files.items():
                if g == f and name not in keys:
                    raise CheckpointError(f, name, "the tensor named for this shard in the index", "absent")
        self.used = set()
        self.quant = quant
        self.n_fp8 = 0
        self._headers = {}
        if quant is not None:  # every scale names a weight
            for name, file in sorted(self.files.items()):
                owner = self.scale_owner(name)
                if owner is not None and owner not in self.files:
                    what = "input scale" if name.endswith("." + INPUT_SCALE) else "scale"
                    raise CheckpointError(file, name, f"the weight {owner!r} this {what} belongs to",
                                          "no such tensor")

    def scale_owner(self, name):
        """The weight a scale tensor belongs to, or None if `name` is no scale."""
        if name.endswith("." + INPUT_SCALE):
            return name[:-len(INPUT_SCALE)] + "weight"
        if name.endswith(self.quant.scale_suffix):
            return name[:-len(self.quant.scale_suffix)]
        return None

    def scales_of(self, name):
        """The scale and input-scale tensors present beside weight `name`."""
        if self.quant is None:
            return []
        out = [name + self.quant.scale_suffix]
        if name.endswith(".weight"):
            out.append(name[:-len("weight")] + INPUT_SCALE)
        return [s for s in out if s in self.files]

    def has(self, name):
        return name in self.files

    def _meta(self, name):
        file = self.files[name]
        sl = self.handles[file].get_slice(name)
        return file, sl.get_dtype(), list(sl.get_shape())

    def _span(self, file, name, dtype, shape):
        """(offset in the file, byte count) of a tensor's data, checked against its shape and the file size."""
        try:
            header, start = self._header(file)
            begin, end = header[name]["data_offsets"]
            n = int(np.prod(shape)) * np.dtype(NP_DTYPES[dtype]).itemsize
            if end - begin != n:
                raise ValueError(f"{end - begin} bytes for shape {list(shape)} of {dtype}")
            size = os.path.getsize(file)
            if start + end > size:
                raise ValueError(f"{max(size - start - begin, 0)} of {n} bytes present")
            return start + begin, n
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(file, name, "readable tensor data", f"{type(e).__name__}: {e}") from None

    def _header(self, file):
        if file not in self._headers:
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._headers[file] = (json.loads(f.read(n)), 8 + n)
        return self._headers[file]

    def _data(self, file, name, dtype, shape, fp8=False):
        """The tensor's data: numpy (_read), or a _Stored for a lazy reader."""
        if not self.lazy:
            return self._read(file, name, dtype, shape)
        offset, _ = self._span(file, name, dtype, shape)
        return _Stored(file, name, dtype, shape, offset, fp8)

    def _read(self, file, name, dtype, shape):
        """The tensor's data as numpy. F32 / F16 through safetensors; BF16 and F8_E4M3 (no numpy dtype) from the
        bytes the safetensors header points at (safe_open has validated header and file size already)."""
        try:
            if dtype in ("F32", "F16"):
                return self.handles[file].get_tensor(name)
            if file not in self._headers:
                with open(file, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    self._headers[file] = (json.loads(f.read(n)), 8 + n)
            header, start = self._headers[file]
            begin, end = header[name]["data_offsets"]
            dt = np.dtype(NP_DTYPES[dtype])
            if end - begin != int(np.prod(shape)) * dt.itemsize:
                raise ValueError(f"{end - begin} bytes for shape {list(shape)} of {dtype}")
            raw = np.fromfile(file, dtype=np.uint8, count=end - begin, offset=start + begin)
            if raw.size != end - begin:
                raise ValueError(f"{raw.size} of {end - begin} bytes present")
            return raw.view(dt).reshape(shape)
        except (SafetensorError, OSError, ValueError, KeyError) as e:
            raise CheckpointError(file, name, "readable tensor data", f"{type(e).__name__}: {e}") from None

    def get(self, name, shape):
        if name not in self.files:
            where = sorted({str(f) for f in self.files.values()})
            raise CheckpointError(", ".join(where), name, f"a tensor of shape {list(shape)}", "no such tensor")
        file, dtype, found = self._meta(name)
        if found != list(shape):
            raise CheckpointError(file, name, f"shape {list(shape)}", f"shape {found}")
        if dtype == FP8_DTYPE and self.quant is not None:
            return self._fp8(name, file, found)
        if dtype not in FLOAT_DTYPES:
            expected = f"a floating dtype ({'/'.join(sorted(FLOAT_DTYPES))})"
            if self.quant is not None:
                expected += f" or {FP8_DTYPE} with its scale"
            elif dtype.startswith("F8"):
                expected += "; FP8 weights only in a checkpoint whose config.json has a quantization_config"
            raise CheckpointError(file, name, expected, dtype)
        for s in self.scales_of(name):
            raise CheckpointError(self.files[s], s, f"a scale only beside an {FP8_DTYPE} weight",
                                  f"beside {name!r} of dtype {dtype}")
        arr = self._data(file, name, dtype, found)
        self.used.add(name)
        return arr

    def _scale_shapes(self, shape) -> dict:
        """{allowed scale shape: block (r, c)} for a weight of `shape` [..., out, in]."""
        *lead, R, C = shape
        q = self.quant
        grid = lambda b: (*lead, layout.cdiv(R, b[0]), layout.cdiv(C, b[1]))
        if q.method == "fp8":
            return {grid(q.block): q.block}
        out = {(*lead, R, 1): (1, C)}  # per channel
        for s in ((*lead, 1, 1), (1,), ()):  # per tensor
            out.setdefault(s, (R, C))
        if q.block is not None:
            out.setdefault(grid(q.block), q.block)
        return out

    def _fp8(self, name, file, shape):
        sname = name + self.quant.scale_suffix
        if sname not in self.files:
            raise CheckpointError(file, name, f"its scale {sname!r} beside this {FP8_DTYPE} weight", "no such tensor")
        if len(shape) < 2:
            raise CheckpointError(file, name, f"a matrix (>= 2-D) when stored as {FP8_DTYPE}", f"shape {shape}")
        sfile, sdtype, sshape = self._meta(sname)
        if sdtype not in FLOAT_DTYPES:
            raise CheckpointError(sfile, sname, f"a floating scale dtype ({'/'.join(sorted(FLOAT_DTYPES))})", sdtype)
        allowed = self._scale_shapes(shape)
        block = allowed.get(tuple(sshape))
        if block is None:
            want = " or ".join(str(list(s)) for s in allowed)
            raise CheckpointError(sfile, sname, f"shape {want} (scales of {name!r} of shape {shape})",
                                  f"shape {sshape}")
        values = self._data(file, name, FP8_DTYPE, shape, fp8=True)
        if not self.lazy and np.any((values.view(np.uint8) & 0x7F) == 0x7F):  # lazy: checked as slices are read
            raise CheckpointError(file, name, "finite e4m3 values", "NaN entries")
        scale = np.asarray(self._read(sfile, sname, sdtype, sshape), np.float32)
        if not np.all(np.isfinite(scale)):
            raise CheckpointError(sfile, sname, "finite scales", "non-finite entries")
        if scale.ndim < 2:  # per tensor
            scale = np.broadcast_to(scale.reshape(1, 1), (*shape[:-2], 1, 1))
        self.used.update([name, *self.scales_of(name)])
        self.n_fp8 += 1
        return (_LazyFp8 if self.lazy else Fp8Tensor)(values, scale, block, str(file), name)

    def check_all_used(self, allowed_unused=()):
        for name, file in sorted(self.files.items()):
            if name in self.used or name in allowed_unused or name.startswith(IGNORED_PREFIXES):
                continue
            raise CheckpointError(file, name, "only tensors the config accounts for", "an unexpected tensor")


# ------------------------------------------------------------------------------------------ layers
# Every function reads tensors in HF's [out, in] orientation; `lin` (a matrix the policy may quantize) and
# `keep` (a matrix kept in the load dtype unless the checkpoint holds it in FP8) transpose to [in, out];
# `plain` gives a float array in the load dtype (FP8 dequantized).
def _attention(r, p, cfg, plain, lin, keep):
    H, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return AttnWeights(
        q_proj=lin(r.get(p + "q_proj.weight", (2 * nh * hd, H))),
        k_proj=lin(r.get(p + "k_proj.weight", (nkv * hd, H))),
        v_proj=lin(r.get(p + "v_proj.weight", (nkv * hd, H))),
        o_proj=lin(r.get(p + "o_proj.weight", (H, nh * hd))),
        q_norm=plain(r.get(p + "q_norm.weight", (hd,))),
        k_norm=plain(r.get(p + "k_norm.weight", (hd,))))


def _gdn(r, p, cfg, plain, lin, keep):
    H, nv, dv = cfg.hidden_size, cfg.gdn_num_v_heads, cfg.gdn_v_head_dim
    kd, vd = cfg.gdn_key_dim, cfg.gdn_value_dim
    if cfg.family == "qwen3_next":
        # fused projections, grouped per key head: [q(dk) k(dk) v(r*dv) z(r*dv)] and [b(r) a(r)]
        qkvz = r.get(p + "in_proj_qkvz.weight", (2 * kd + 2 * vd, H))
        qkv_idx, z_idx = qkvz_rows(cfg)
        qkv, z = _rows(qkvz, qkv_idx), _rows(qkvz, z_idx)
        ba = r.get(p + "in_proj_ba.weight", (2 * nv, H))
        b_idx, a_idx = ba_rows(cfg)
        b, a = _rows(ba, b_idx), _rows(ba, a_idx)
    else:
        qkv = r.get(p + "in_proj_qkv.weight", (2 * kd + vd, H))
        z = r.get(p + "in_proj_z.weight", (vd, H))
        b = r.get(p + "in_proj_b.weight", (nv, H))
        a = r.get(p + "in_proj_a.weight", (nv, H))
    conv = _conv_taps(r.get(p + "conv1d.weight", (cfg.conv_dim, 1, cfg.conv_kernel)))
    return GDNWeights(
        in_proj_qkv=lin(qkv), in_proj_z=lin(z), in_proj_b=keep(b), in_proj_a=keep(a),
        conv=plain(conv), A_log=plain(r.get(p + "A_log", (nv,))),
        dt_bias=plain(r.get(p + "dt_bias", (nv,))), norm=plain(r.get(p + "norm.weight", (dv,))),
        out_proj=lin(r.get(p + "out_proj.weight", (H, vd))))


def _mlp(r, p, H, inter, lin):
    return MLPWeights(gate=lin(r.get(p + "gate_proj.weight", (inter, H))),
                      up=lin(r.get(p + "up_proj.weight", (inter, H))),
                      down=lin(r.get(p + "down_proj.weight", (H, inter))))


def _moe(r, p, cfg, plain, lin, keep):
    H, E, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    if r.has(p + "experts.gate_up_proj"):  # fused: [E, 2I, H] (gate rows first), [E, H, I]
        gu = r.get(p + "experts.gate_up_proj", (E, 2 * inter, H))
        gate, up = _rows(gu, np.arange(inter)), _rows(gu, np.arange(inter, 2 * inter))
        down = r.get(p + "experts.down_proj", (E, H, inter))
    else:
        e = lambda i, n, s: r.get(f"{p}experts.{i}.{n}_proj.weight", s)
        gate = _stack([e(i, "gate", (inter, H)) for i in range(E)], f"{p}experts.*.gate_proj.weight")
        up = _stack([e(i, "up", (inter, H)) for i in range(E)], f"{p}experts.*.up_proj.weight")
        down = _stack([e(i, "down", (H, inter)) for i in range(E)], f"{p}experts.*.down_proj.weight")
    return MoEWeights(router=keep(r.get(p + "gate.weight", (E, H))), gate=lin(gate), up=lin(up), down=lin(down),
                      shared=_mlp(r, p + "shared_expert.", H, cfg.shared_expert_intermediate_size, lin),
                      shared_gate=keep(r.get(p + "shared_expert_gate.weight", (1, H))))


def _layer(r, p, cfg, kind, mlp_kind, plain, lin, keep):
    H = cfg.hidden_size
    mixer = (_attention(r, p + "self_attn.", cfg, plain, lin, keep) if kind == "full_attention"
             else _gdn(r, p + "linear_attn.", cfg, plain, lin, keep))
    ff = (_moe(r, p + "mlp.", cfg, plain, lin, keep) if mlp_kind == "moe"
          else _mlp(r, p + "mlp.", H, cfg.intermediate_size, lin))
    return LayerWeights(input_norm=plain(r.get(p + "input_layernorm.weight", (H,))),
                        post_norm=plain(r.get(p + "post_attention_layernorm.weight", (H,))),
                        mixer=mixer, mlp=ff)


def _mtp(r, cfg, plain, lin, keep):
    H = cfg.hidden_size
    return MTPWeights(fc=lin(r.get("mtp.fc.weight", (H, 2 * H))),
                      pre_fc_norm_embedding=plain(r.get("mtp.pre_fc_norm_embedding.weight", (H,))),
                      pre_fc_norm_hidden=plain(r.get("mtp.pre_fc_norm_hidden.weight", (H,))),
                      norm=plain(r.get("mtp.norm.weight", (H,))),
                      layer=_layer(r, "mtp.layers.0.", cfg, "full_attention", cfg.mtp_mlp_type, plain, lin, keep))


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
    jdtype = DTYPES[dtype]
    np_dtype = np.float32 if jdtype == jnp.float32 else ml_dtypes.bfloat16

    def cast(x):
        return jnp.asarray(np.ascontiguousarray(x).astype(np_dtype))

    def plain(x):
        return cast(_dense(x))

    def matrix(on):
        def f(t):
            if isinstance(t, Fp8Tensor):
                return _quant_array(t)
            w = np.swapaxes(t, -1, -2)
            return quantize(w, policy.method, policy.group_size) if policy is not None and on else cast(w)
        return f

    lin, keep, lin_mtp = matrix(True), matrix(False), matrix(policy is not None and policy.mtp)

    if mesh is not None:  # lazy leaves, built with their shardings at the end
        def cast(x):
            return _Plain(x, np_dtype)

        def matrix(on):
            def f(t):
                if isinstance(t, _LazyFp8):
                    return _Fp8Leaf(t)
                return _Quantized(_T(t), policy.method, policy.group_size) if policy is not None and on \
                    else cast(_T(t))
            return f

        lin, keep, lin_mtp = matrix(True), matrix(False), matrix(policy is not None and policy.mtp)

    def quantize_tied(embed_raw):
        if mesh is not None:
            return _Quantized(_T(embed_raw), policy.method, policy.group_size)
        return quantize(embed_raw.T, policy.method, policy.group_size)

    r = _Reader(folder, ckq, lazy=mesh is not None)
    P, H, V = cfg.tensor_prefix, cfg.hidden_size, cfg.vocab_size
    if not r.has(P + "embed_tokens.weight"):
        other = "model." if P != "model." else "model.language_model."
        if r.has(other + "embed_tokens.weight"):  # e.g. a text checkpoint saved with the multimodal prefix
            P = other
    embed_raw = _dense(r.get(P + "embed_tokens.weight", (V, H)))
    embed = cast(embed_raw)
    layers = tuple(_layer(r, f"{P}layers.{i}.", cfg, kind, mk, plain, lin, keep)
                   for i, (kind, mk) in enumerate(zip(cfg.layer_types, cfg.mlp_types)))
    final_norm = plain(r.get(P + "norm.weight", (H,)))
    if cfg.tie_word_embeddings:
        # a quantized copy of embed^T when the policy asks; the embedding stays as loaded
        lm_head = quantize_tied(embed_raw) if policy is not None and policy.lm_head else None
    else:
        lm_head = matrix(policy is not None and policy.lm_head)(r.get("lm_head.weight", (V, H)))
    mtp = None
    if any(name.startswith("mtp.") for name in r.files):
        n = max(cfg.mtp_num_layers, 1)
        if n != 1:
            raise CheckpointError(folder, "mtp.layers.*", "mtp_num_hidden_layers == 1 (as released)", n)
        mtp = _mtp(r, cfg, plain, lin_mtp, keep)
    tied_unused = {"lm_head.weight", *r.scales_of("lm_head.weight")} if cfg.tie_word_embeddings else ()
    r.check_all_used(allowed_unused=tied_unused)
    if ckq is not None and r.n_fp8 == 0:
        raise CheckpointError(folder, None, f"F8_E4M3 weights with their scales (config.json declares "
                              f"quant_method {ckq.method!r})", "no quantized tensor")
    weights = Weights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head, mtp=mtp)
    return weights if mesh is None else _materialise(weights, cfg, mesh)
