"""A loaded model and the ways in and out of it: load (Hugging Face safetensors, pre-quantized FP8, or a folder
`save` wrote), save, shard onto a mesh, and the draft vocabulary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qwen_mtp.errors import ArgumentError
from qwen_mtp.trunk.config import ModelConfig, load_config, load_quantization
from qwen_mtp.trunk.quant import QuantPolicy, check_method, formats, weight_bytes
from qwen_mtp.trunk.weights import Weights


@dataclasses.dataclass(frozen=True)
class Model:
    config: ModelConfig
    weights: Weights
    path: str
    dtype: str
    quant: QuantPolicy | None = None  # what load(quant=...) quantized; None: nothing
    mesh: object = None  # the jax.sharding.Mesh the weights are sharded over (qwen_mtp.shard); None: one device

    @property
    def has_mtp(self) -> bool:
        return self.weights.mtp is not None

    def weight_bytes(self) -> dict:
        """{'total', 'quantized', 'plain'}: bytes of the weights as held in memory."""
        return weight_bytes(self.weights)

    def describe_sharding(self) -> str:
        """The mesh, per-device weight bytes and each dimension left replicated with its reason."""
        if self.mesh is None:
            return "not sharded (one device)"
        from qwen_mtp.parallel.sharding import describe
        return describe(self.weights, self.config, self.mesh)

    def describe_quant(self) -> str:
        """One paragraph: the quantization policy and the formats of the matrices actually held."""
        held = ", ".join(f"{n} x {k}" for k, n in sorted(formats(self.weights).items()))
        head = self.quant.describe() if self.quant is not None else "not quantized"
        return f"{head}. Matrices held: {held}."


def load(path, *, dtype: str = "float32", quant: str | None = None, group_size: int = 128,
         quant_lm_head: bool = False, quant_mtp: bool = True, mesh=None, draft_vocab: int | None = None) -> Model:
    """Load a Hugging Face checkpoint folder (config.json + safetensors, single or sharded).

    quant: None (every tensor in `dtype`), "int8" (symmetric per output channel), "int4" (symmetric, groups of
    `group_size` rows along the input dimension, packed two per byte) or "fp8" (e4m3, one scale per 128 x 128
    block): the trunk's matrices are quantized as they load, the MTP head's too unless quant_mtp=False, the
    lm_head only with quant_lm_head=True; see quant.QuantPolicy for what always stays in `dtype`.
    Activations and the compute stay in `dtype`.

    A pre-quantized FP8 checkpoint (config.json `quantization_config`: Qwen's block-wise "fp8" or FP8
    "compressed-tensors") loads as it is: each weight stored in e4m3 with its scale stays FP8 in memory, the
    others load in `dtype` (qwen_mtp/loading/safetensors.py); Model.quant then says what it held quantized
    (source "checkpoint"). quant= must be None for such a checkpoint (re-quantizing is an ArgumentError).

    A folder `save` wrote (qwen_mtp/loading/orbax_io.py) is restored as saved: its QuantArrays as stored, its plain
    arrays cast to `dtype`; quant=None takes its policy, a quant= naming another policy than the saved one is
    an ArgumentError.

    mesh: None (every weight on the default device) or a jax.sharding.Mesh with axes ('data', 'model'), e.g.
    qwen_mtp.parallel.sharding.make_mesh(data=1, model=4): the weights load straight into the shardings of
    qwen_mtp/parallel/sharding.py, each process reading from the files only the slices its devices hold (every weight is
    built with jax.make_array_from_callback from a memory map of its bytes; an orbax folder restores into the
    shardings, orbax reading the slices), so a model larger than one device's memory loads. The result equals,
    bit for bit and sharding for sharding, `shard(load(path, ...), mesh)`, and generate / prefill_logits /
    mtp_logits run under the mesh. Quantizing as it loads (quant=...) reads each matrix whole on the host, since
    a scale spans whole columns, quantizes it there and places its slices: peak host memory one tensor (e.g.
    one layer's stacked experts). A pre-quantized FP8 checkpoint's values are read slice by slice as stored.

    draft_vocab: None (the MTP head drafts over the whole vocabulary) or N: it drafts over the N most frequent
    ids of the token counts stored in the folder (draft_vocab.COUNTS_FILE; an ArgumentError when missing), every
    EOS id included; the verify keeps the full vocabulary, so the output is unchanged (qwen_mtp/head/draft_vocab.py,
    with_draft_vocab)."""
    from qwen_mtp.loading import orbax_io

    if draft_vocab is not None:  # size and counts file checked before the weights are read
        from qwen_mtp.head.draft_vocab import check_size, load_counts
        vocab = load_config(path).vocab_size
        check_size(draft_vocab, vocab)
        counts = load_counts(path, vocab)
        model = load(path, dtype=dtype, quant=quant, group_size=group_size, quant_lm_head=quant_lm_head,
                     quant_mtp=quant_mtp, mesh=mesh)
        return with_draft_vocab(model, draft_vocab, counts)  # the counts read above, not read again

    if mesh is not None:
        from qwen_mtp.parallel.sharding import check_mesh
        mesh = check_mesh(mesh)
    if orbax_io.is_orbax_folder(path):
        return _load_orbax(path, dtype, quant, group_size, quant_lm_head, quant_mtp, mesh)
    from qwen_mtp.loading.safetensors import DTYPES, checkpoint_policy, load_weights

    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ArgumentError("dtype", f"one of {sorted(DTYPES)}", repr(dtype))
    check_method(quant, group_size)
    for name, flag in (("quant_lm_head", quant_lm_head), ("quant_mtp", quant_mtp)):
        if not isinstance(flag, bool):
            raise ArgumentError(name, "True or False", repr(flag))
    policy = None if quant is None else QuantPolicy(quant, int(group_size), quant_lm_head, quant_mtp)
    cfg = load_config(path)
    weights = load_weights(path, cfg, dtype, policy, mesh=mesh)
    if load_quantization(path) is not None:  # a pre-quantized FP8 checkpoint: what it held in FP8
        policy = checkpoint_policy(weights)
    return Model(config=cfg, weights=weights, path=str(Path(path)), dtype=dtype, quant=policy, mesh=mesh)


def with_draft_vocab(model: Model, size: int | None, counts=None) -> Model:
    """`model` whose MTP head drafts over the `size` most frequent token ids of `counts` (int [V]; None: the
    draft_vocab.COUNTS_FILE of model.path, an ArgumentError when missing), every EOS id included; size None
    removes a draft vocabulary. Output is unchanged (the verify uses the full vocabulary); see draft_vocab.py."""
    from qwen_mtp.head import draft_vocab

    if not isinstance(model, Model):
        raise ArgumentError("model", "a qwen_mtp.Model (from qwen_mtp.load)", type(model).__name__)
    return draft_vocab.with_draft_vocab(model, size, counts)


def shard(model: Model, mesh) -> Model:
    """`model` with its weights placed on `mesh` (a jax.sharding.Mesh with axes 'data' and 'model', e.g.
    qwen_mtp.parallel.sharding.make_mesh(data=1, model=4)) by the rule table of qwen_mtp/parallel/sharding.py: tensor parallel over
    `model` (heads, kv heads, GDN heads, MLP and expert columns, vocabulary), data parallel over `data` (batch
    rows, at generate time). A dimension the axis does not divide stays replicated (model.describe_sharding()
    says which and why). generate / prefill_logits / mtp_logits then run under the mesh."""
    from qwen_mtp.parallel import sharding

    if not isinstance(model, Model):
        raise ArgumentError("model", "a qwen_mtp.Model (from qwen_mtp.load)", type(model).__name__)
    mesh = sharding.check_mesh(mesh)
    weights = sharding.shard_weights(model.weights, model.config, mesh)  # a draft vocabulary: split like lm_head
    return dataclasses.replace(model, weights=weights, mesh=mesh)


def _load_orbax(path, dtype, quant, group_size, quant_lm_head, quant_mtp, mesh=None) -> Model:
    from qwen_mtp.loading import orbax_io

    if not isinstance(dtype, str) or dtype not in orbax_io.DTYPES:
        raise ArgumentError("dtype", f"one of {sorted(orbax_io.DTYPES)}", repr(dtype))
    check_method(quant, group_size)
    cfg, weights, dtype, saved = orbax_io.restore(path, dtype, mesh=mesh)
    if quant is not None:
        asked = QuantPolicy(quant, int(group_size), quant_lm_head, quant_mtp)
        if saved is None or dataclasses.replace(saved, source="load") != asked:
            held = "unquantized weights" if saved is None else saved.describe()
            raise ArgumentError("quant", f"None (restore {path} as saved: {held}) or the saved policy",
                                f"{quant!r}, group_size={group_size}, quant_lm_head={quant_lm_head}, "
                                f"quant_mtp={quant_mtp}")
    return Model(config=cfg, weights=weights, path=str(Path(path)), dtype=dtype, quant=saved, mesh=mesh)


def save(model: Model, folder, *, overwrite: bool = False) -> Path:
    """Write `model` as an orbax checkpoint folder that `load(folder)` restores (qwen_mtp/loading/orbax_io.py): the
    weights (QuantArrays as stored), config.json, the quantization policy and the tokenizer files of model.path.
    Atomic: written beside `folder` and renamed into place. An existing `folder` is replaced only with
    overwrite=True, and only if `save` wrote it (or it is empty)."""
    from qwen_mtp.loading import orbax_io

    if not isinstance(model, Model):
        raise ArgumentError("model", "a qwen_mtp.Model (from qwen_mtp.load)", type(model).__name__)
    if model.weights.draft_vocab is not None:  # derived data: not saved (load(..., draft_vocab=N) rebuilds it)
        model = dataclasses.replace(model, weights=model.weights.replace(draft_vocab=None))
    return orbax_io.save(model, folder, overwrite=overwrite)
