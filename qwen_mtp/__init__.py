"""qwen-mtp: Qwen3.5-family inference in JAX (hybrid Gated DeltaNet + gated attention trunk).

Public API: load, prefill_logits, mtp_logits, generate(..., spec=SpecConfig(k)) and the types they return.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .config import ModelConfig, load_config
from .errors import ArgumentError, CheckpointError, ConfigError, MissingMTPHeadError, QwenMTPError
from .quant import QuantArray, QuantPolicy, check_method, formats, weight_bytes
from .generate import GenerateResult, generate, mtp_logits, prefill_logits
from .sampling import Sampling
from .speculative import SpecConfig
from .stats import GenerateStats
from .weights import Weights


@dataclasses.dataclass(frozen=True)
class Model:
    config: ModelConfig
    weights: Weights
    path: str
    dtype: str
    quant: QuantPolicy | None = None  # what load(quant=...) quantized; None: nothing

    @property
    def has_mtp(self) -> bool:
        return self.weights.mtp is not None

    def weight_bytes(self) -> dict:
        """{'total', 'quantized', 'plain'}: bytes of the weights as held in memory."""
        return weight_bytes(self.weights)

    def describe_quant(self) -> str:
        """One paragraph: the quantization policy and the formats of the matrices actually held."""
        held = ", ".join(f"{n} x {k}" for k, n in sorted(formats(self.weights).items()))
        head = self.quant.describe() if self.quant is not None else "not quantized"
        return f"{head}. Matrices held: {held}."


def load(path, *, dtype: str = "float32", quant: str | None = None, group_size: int = 128,
         quant_lm_head: bool = False, quant_mtp: bool = True) -> Model:
    """Load a Hugging Face checkpoint folder (config.json + safetensors, single or sharded).

    quant: None (every tensor in `dtype`), "int8" (symmetric per output channel), "int4" (symmetric, groups of
    `group_size` rows along the input dimension, packed two per byte) or "fp8" (e4m3, one scale per 128 x 128
    block): the trunk's matrices are quantized as they load, the MTP head's too unless quant_mtp=False, the
    lm_head only with quant_lm_head=True; see quant.QuantPolicy for what always stays in `dtype`.
    Activations and the compute stay in `dtype`."""
    from checkpoints.hf_safetensors import DTYPES, load_weights

    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ArgumentError("dtype", f"one of {sorted(DTYPES)}", repr(dtype))
    check_method(quant, group_size)
    for name, flag in (("quant_lm_head", quant_lm_head), ("quant_mtp", quant_mtp)):
        if not isinstance(flag, bool):
            raise ArgumentError(name, "True or False", repr(flag))
    policy = None if quant is None else QuantPolicy(quant, int(group_size), quant_lm_head, quant_mtp)
    cfg = load_config(path)
    return Model(config=cfg, weights=load_weights(path, cfg, dtype, policy), path=str(Path(path)), dtype=dtype,
                 quant=policy)


__all__ = ["load", "prefill_logits", "mtp_logits", "generate", "SpecConfig", "Sampling", "Model", "ModelConfig", "QuantArray", "QuantPolicy", "GenerateResult", "GenerateStats",
           "QwenMTPError", "ConfigError", "CheckpointError", "ArgumentError", "MissingMTPHeadError"]
