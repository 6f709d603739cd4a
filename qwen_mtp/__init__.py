"""qwen-mtp: Qwen3.5-family inference in JAX (hybrid Gated DeltaNet + gated attention trunk).

The public face: load a checkpoint, generate with or without the MTP head's drafts, and the types they return.
The wings behind it (docs/architecture.md):
  trunk/     the model: config, weights, state, quantized arrays, attention, Gated DeltaNet, MLP/MoE, forward
  head/      the MTP head: its forward, the Wind-MTP ring, the draft vocabulary, tree shapes
  decoding/  generate: request checks, prefill, the plain and speculative loops, rollback, sampling, stats
  loading/   Model, load / save / shard, safetensors and orbax checkpoints, quantize-and-convert
  parallel/  sharding rules over a ('data', 'model') mesh, multi-process start-up
  compiling/ the persistent compile cache and the cache of lowered programs
  tools/     the command line, certify, analysis, profiling, lowering for cuda
"""

from __future__ import annotations

from qwen_mtp.compiling.compile_cache import disable_compile_cache, enable_compile_cache
from qwen_mtp.decoding.generate import GenerateResult, generate, mtp_logits, precompile, prefill_logits
from qwen_mtp.decoding.sampling import Sampling
from qwen_mtp.decoding.speculative import SpecConfig
from qwen_mtp.decoding.stats import GenerateStats
from qwen_mtp.errors import (
                             ArgumentError,
                             CheckpointError,
                             ConfigError,
                             InsufficientMemoryError,
                             MissingExtraError,
                             MissingMTPHeadError,
                             NonFiniteError,
                             QwenMTPError,
)
from qwen_mtp.head.tree import DynamicTree, StaticTree
from qwen_mtp.loading.model import Model, load, save, shard, with_draft_vocab
from qwen_mtp.parallel.sharding import make_mesh
from qwen_mtp.serving.engine import Engine
from qwen_mtp.serving.requests import SamplingParams
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.quant import QuantArray, QuantPolicy

__all__ = ["load", "save", "shard", "with_draft_vocab", "prefill_logits", "mtp_logits", "generate", "precompile",
           "enable_compile_cache", "disable_compile_cache", "SpecConfig", "StaticTree", "DynamicTree", "Sampling",
           "make_mesh", "Model", "ModelConfig",
           "QuantArray", "QuantPolicy", "GenerateResult", "GenerateStats",
           "QwenMTPError", "ConfigError", "CheckpointError", "ArgumentError", "MissingMTPHeadError", "NonFiniteError",
           "InsufficientMemoryError", "MissingExtraError", "Engine", "SamplingParams"]
