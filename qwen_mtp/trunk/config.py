"""Static, hashable model configuration parsed from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from qwen_mtp.errors import ConfigError

# model_type -> (family, is the config nested under text_config?, prefix of trunk tensors)
MODEL_TYPES = {
    "qwen3_5_text": ("qwen3_5", False, "model."),
    "qwen3_5": ("qwen3_5", True, "model.language_model."),
    "qwen3_5_moe_text": ("qwen3_5_moe", False, "model."),
    "qwen3_5_moe": ("qwen3_5_moe", True, "model.language_model."),
    "qwen3_next": ("qwen3_next", False, "model."),
}
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    family: str  # qwen3_5 | qwen3_5_moe | qwen3_next
    vocab_size: int
    hidden_size: int
    layer_types: tuple  # per layer: "linear_attention" | "full_attention"
    mlp_types: tuple  # per layer: "dense" | "moe"
    # full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # gated delta net
    gdn_num_k_heads: int
    gdn_num_v_heads: int
    gdn_k_head_dim: int
    gdn_v_head_dim: int
    conv_kernel: int
    # mlp / moe
    intermediate_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    # misc
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple
    pad_token_id: int | None
    mtp_num_layers: int
    tensor_prefix: str  # "model." or "model.language_model."

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_num_k_heads * self.gdn_k_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_num_v_heads * self.gdn_v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def has_moe(self) -> bool:
        return "moe" in self.mlp_types

    @property
    def mtp_mlp_type(self) -> str:
        """The MTP layer's MLP: an MoE block exactly when the trunk's MLPs are."""
        return "moe" if self.family == "qwen3_5_moe" or (self.family == "qwen3_next" and self.has_moe) else "dense"


def _int_list(x):
    if x is None:
        return ()
    if isinstance(x, int):
        return (x,)
    return tuple(int(i) for i in x)


def parse_config(raw: dict, file="config.json") -> ModelConfig:
    """Build a ModelConfig from the dict of a config.json; raise ConfigError naming the field on any problem."""
    if not isinstance(raw, dict):
        raise ConfigError(file, "<root>", "a JSON object", type(raw).__name__)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ConfigError(file, "model_type", f"one of {sorted(MODEL_TYPES)}", repr(model_type))
    family, nested, prefix = MODEL_TYPES[model_type]
    top = raw
    if nested:
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError(file, "text_config", f"a nested object for model_type {model_type!r}",
                              repr(raw.get("text_config")))
        raw = raw["text_config"]

    def get(name, default=dataclasses.MISSING, typ=int):
        if name in raw and raw[name] is not None:
            val = raw[name]
        elif nested and name in top and top[name] is not None:
            val = top[name]
        elif default is not dataclasses.MISSING:
            return default
        else:
            raise ConfigError(file, name, f"a value of type {typ.__name__}", "nothing")
        if typ is int and (isinstance(val, bool) or not isinstance(val, int)):
            raise ConfigError(file, name, "an integer", repr(val))
        if typ is float and (isinstance(val, bool) or not isinstance(val, (int, float))):
            raise ConfigError(file, name, "a number", repr(val))
        if typ is int and val <= 0 and name not in ("pad_token_id",):
            raise ConfigError(file, name, "a positive integer", repr(val))
        return typ(val)

    n_layers = get("num_hidden_layers")
    hidden = get("hidden_size")
    n_heads = get("num_attention_heads")
    layer_types = raw.get("layer_types")
    if layer_types is None:
        interval = get("full_attention_interval", 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(layer_types, (list, tuple)):
        raise ConfigError(file, "layer_types", f"a list of {n_layers} entries from {LAYER_TYPES}", repr(layer_types))
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers or any(not isinstance(t, str) or t not in LAYER_TYPES for t in layer_types):
        raise ConfigError(file, "layer_types", f"{n_layers} entries from {LAYER_TYPES}", repr(list(layer_types)))

    # MLP kind per layer
    num_experts = get("num_experts", 0) if family != "qwen3_5" else 0
    if family == "qwen3_5_moe":
        if num_experts == 0:
            raise ConfigError(file, "num_experts", "a positive integer for an MoE model", "nothing")
        mlp_types = ("moe",) * n_layers
    elif family == "qwen3_next":
        only = set(_int_list(raw.get("mlp_only_layers", [])))
        step = get("decoder_sparse_step", 1)
        mlp_types = tuple("moe" if (i not in only and num_experts > 0 and (i + 1) % step == 0) else "dense"
                          for i in range(n_layers))
    else:
        mlp_types = ("dense",) * n_layers
    has_moe = "moe" in mlp_types
    has_dense = "dense" in mlp_types

    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(file, "rope_parameters", "an object", repr(rope))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(file, "rope_parameters.rope_type", "'default' (the only RoPE implemented)", repr(rope_type))
    def positive_number(name, val):
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val <= 0:
            raise ConfigError(file, name, "a finite positive number", repr(val))
        return float(val)

    def flag(name, val):
        if not isinstance(val, bool):
            raise ConfigError(file, name, "true or false", repr(val))
        return val

    theta = positive_number("rope_theta", rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    prf = positive_number("partial_rotary_factor", rope.get("partial_rotary_factor", raw.get(
        "partial_rotary_factor", 0.25 if family == "qwen3_next" else 1.0)))
    head_dim = get("head_dim", hidden // n_heads)
    rotary_dim = int(head_dim * prf)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ConfigError(file, "partial_rotary_factor", f"a factor giving an even rotary dim in (0, {head_dim}]",
                          repr(prf))

    n_kv = get("num_key_value_heads", n_heads)
    if n_heads % n_kv:
        raise ConfigError(file, "num_key_value_heads", f"a divisor of num_attention_heads={n_heads}", n_kv)
    nk = get("linear_num_key_heads")
    nv = get("linear_num_value_heads")
    if nv % nk:
        raise ConfigError(file, "linear_num_value_heads", f"a multiple of linear_num_key_heads={nk}", nv)
    top_k = get("num_experts_per_tok", 0 if not has_moe else dataclasses.MISSING) if has_moe else 0
    if has_moe and not 0 < top_k <= num_experts:
        raise ConfigError(file, "num_experts_per_tok", f"in [1, num_experts={num_experts}]", top_k)

    eos = raw.get("eos_token_id", top.get("eos_token_id"))
    try:
        eos_ids = _int_list(eos)
    except (TypeError, ValueError):
        raise ConfigError(file, "eos_token_id", "an integer or a list of integers", repr(eos)) from None
    tie = flag("tie_word_embeddings", raw.get("tie_word_embeddings", top.get("tie_word_embeddings", False)))
    mtp_layers = raw.get("mtp_num_hidden_layers", raw.get("num_nextn_predict_layers", 0)) or 0
    if isinstance(mtp_layers, bool) or not isinstance(mtp_layers, int) or mtp_layers < 0:
        raise ConfigError(file, "mtp_num_hidden_layers", "an integer >= 0", repr(mtp_layers))
    norm_topk = flag("norm_topk_prob", raw.get("norm_topk_prob", True))
    eps = raw.get("rms_norm_eps", top.get("rms_norm_eps"))
    eps = positive_number("rms_norm_eps", 1e-6 if eps is None else eps)
    pad = raw.get("pad_token_id", top.get("pad_token_id"))
    return ModelConfig(
        model_type=model_type, family=family, vocab_size=get("vocab_size"), hidden_size=hidden,
        layer_types=layer_types, mlp_types=mlp_types,
        num_heads=n_heads, num_kv_heads=n_kv, head_dim=head_dim, rotary_dim=rotary_dim, rope_theta=theta,
        gdn_num_k_heads=nk, gdn_num_v_heads=nv, gdn_k_head_dim=get("linear_key_head_dim"),
        gdn_v_head_dim=get("linear_value_head_dim"), conv_kernel=get("linear_conv_kernel_dim", 4),
        intermediate_size=get("intermediate_size") if has_dense else 0,
        num_experts=num_experts if has_moe else 0, top_k=top_k,
        moe_intermediate_size=get("moe_intermediate_size") if has_moe else 0,
        shared_expert_intermediate_size=get("shared_expert_intermediate_size") if has_moe else 0,
        norm_topk_prob=norm_topk,
        rms_norm_eps=eps, tie_word_embeddings=tie,
        max_position_embeddings=get("max_position_embeddings", 32768), eos_token_ids=eos_ids,
        pad_token_id=int(pad) if isinstance(pad, int) else None, mtp_num_layers=int(mtp_layers),
        tensor_prefix=prefix,
    )


def read_config_json(path) -> tuple:
    """(the parsed config.json of a checkpoint folder, its path); ConfigError when missing or not JSON."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(file, "<file>", "an existing config.json", "no such file")
    try:
        return json.loads(file.read_text()), file
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(file, "<file>", "valid JSON", f"{type(e).__name__}: {e}") from None


def load_config(path) -> ModelConfig:
    return parse_config(*read_config_json(path))


# ------------------------------------------------------------------------------------ quantization_config
QUANT_METHODS = ("fp8", "compressed-tensors")
CT_FORMATS = ("float-quantized", "naive-quantized")  # compressed-tensors formats that store e4m3 values as such
CT_STRATEGIES = ("channel", "tensor", "block")


@dataclasses.dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's own quantization (`quantization_config` in config.json), validated: FP8 e4m3 weights only.

    method "fp8": Qwen's block-wise layout; `<weight>_scale_inv` beside each quantized weight, one scale per
        `block` = weight_block_size = (rows of the output dim, columns of the input dim), as config.json writes it.
    method "compressed-tensors": `<layer>.weight_scale` beside each quantized weight: per channel [out, 1], per
        tensor [] / [1], or, when a config group names the block strategy, per `block` = its block_structure.
    Which tensors are quantized is decided per tensor by the scales present (qwen_mtp/loading/safetensors.py),
    not by the config's target / ignore lists. Activation settings (input_activations, activation_scheme,
    `input_scale` tensors) are accepted and not used: activations stay in the load dtype."""

    method: str
    block: tuple | None  # (rows, cols) of one scale's block in HF's [out, in] orientation; None: no block scales

    @property
    def scale_suffix(self) -> str:
        """Appended to a weight's name to name its scale."""
        return "_scale_inv" if self.method == "fp8" else "_scale"


def _block_pair(val, file, field):
    if (not isinstance(val, (list, tuple)) or len(val) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in val)):
        raise ConfigError(file, field, "two positive integers [rows, cols]", repr(val))
    return (int(val[0]), int(val[1]))


def _parse_compressed_tensors(q: dict, file, f) -> CheckpointQuant:
    fmt = q.get("format")
    if fmt is not None and fmt not in CT_FORMATS:
        raise ConfigError(file, f + ".format", f"one of {list(CT_FORMATS)} (FP8 weights stored as e4m3)", repr(fmt))
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(file, f + ".config_groups", "a non-empty object of quantization groups", repr(groups))
    blocks = set()
    for g, spec in groups.items():
        w = spec.get("weights") if isinstance(spec, dict) else None
        wf = f"{f}.config_groups.{g}.weights"
        if not isinstance(w, dict):
            raise ConfigError(file, wf, "an object describing the weights' quantization", repr(w))
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ConfigError(file, wf, "type 'float' with num_bits 8 (FP8 e4m3 weights, the only compressed-tensors "
                              "scheme supported)", f"type {w.get('type')!r}, num_bits {w.get('num_bits')!r}")
        if w.get("symmetric", True) is not True:
            raise ConfigError(file, wf + ".symmetric", "true (no zero points)", repr(w.get("symmetric")))
        strategy = w.get("strategy")
        if strategy not in CT_STRATEGIES:
            raise ConfigError(file, wf + ".strategy", f"one of {list(CT_STRATEGIES)}", repr(strategy))
        if strategy == "block":
            blocks.add(_block_pair(w.get("block_structure"), file, wf + ".block_structure"))
    if len(blocks) > 1:
        raise ConfigError(file, f + ".config_groups", "at most one block_structure", sorted(blocks))
    return CheckpointQuant("compressed-tensors", blocks.pop() if blocks else None)


def parse_quantization(raw: dict, file="config.json") -> CheckpointQuant | None:
    """The `quantization_config` of a config.json dict (top level, or under text_config), or None."""
    q = raw.get("quantization_config") if isinstance(raw, dict) else None
    if q is None and isinstance(raw, dict) and isinstance(raw.get("text_config"), dict):
        q = raw["text_config"].get("quantization_config")
    if q is None:
        return None
    f = "quantization_config"
    if not isinstance(q, dict):
        raise ConfigError(file, f, "an object", repr(q))
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(file, f + ".quant_method", f"one of {list(QUANT_METHODS)} (FP8 checkpoints)", repr(method))
    if method == "compressed-tensors":
        return _parse_compressed_tensors(q, file, f)
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(file, f + ".fmt", "'e4m3'", repr(q.get("fmt")))
    if q.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise ConfigError(file, f + ".activation_scheme", "'dynamic' or 'static'", repr(q.get("activation_scheme")))
    return CheckpointQuant("fp8", _block_pair(q.get("weight_block_size"), file, f + ".weight_block_size"))


def load_quantization(path) -> CheckpointQuant | None:
    """parse_quantization of the folder's config.json (load_config's errors for a missing / unreadable file)."""
    return parse_quantization(*read_config_json(path))
