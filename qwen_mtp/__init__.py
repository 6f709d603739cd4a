"""qwen-mtp: Qwen3.5-family inference in JAX (hybrid Gated DeltaNet + gated attention trunk).

Public API: load, prefill_logits, mtp_logits, generate(..., spec=SpecConfig(k)) and the types they return.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .config import ModelConfig, load_config
from .errors import ArgumentError, CheckpointError, ConfigError, MissingMTPHeadError, QwenMTPError
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

    @property
    def has_mtp(self) -> bool:
        return self.weights.mtp is not None


def load(path, *, dtype: str = "float32") -> Model:
    """Load a Hugging Face checkpoint folder (config.json + safetensors, single or sharded)."""
    from checkpoints.hf_safetensors import DTYPES, load_weights

    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ArgumentError("dtype", f"one of {sorted(DTYPES)}", repr(dtype))
    cfg = load_config(path)
    return Model(config=cfg, weights=load_weights(path, cfg, dtype), path=str(Path(path)), dtype=dtype)


__all__ = ["load", "prefill_logits", "mtp_logits", "generate", "SpecConfig", "Sampling", "Model", "ModelConfig", "GenerateResult", "GenerateStats",
           "QwenMTPError", "ConfigError", "CheckpointError", "ArgumentError", "MissingMTPHeadError"]
