"""Checkpoint I/O: Hugging Face safetensors checkpoints (single file or sharded) -> qwen_mtp weight pytrees."""

from qwen_mtp.loading.safetensors import load_weights

__all__ = ["load_weights"]
