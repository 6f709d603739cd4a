import os
import shutil
import tempfile

import xla_flags  # tests/ is on sys.path under pytest's default import mode (no jax import)

# One persistent compilation cache for the whole run, this process and every process it starts (CLI runs,
# notebook kernels, mesh and multi-process workers), in a fresh folder: a program compiled once is read back
# by the next process that needs it. Set before jax is imported (jax reads these at import). Only the process
# that makes the folder removes it, at its end (pytest_unconfigure below): under pytest-xdist that is the
# controller, whose environment the workers inherit, so they reuse its folder and make none. A folder named in
# JAX_COMPILATION_CACHE_DIR beforehand is the caller's, used and kept.
_MADE_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _MADE_CACHE = tempfile.mkdtemp(prefix="qwen_mtp_test_jax_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _MADE_CACHE
# Programs that compile in under a second are not written: of a run's ~4200 entries at 0, ~3900 were such programs,
# each serialised, compressed and written for little gain, and XLA:CPU's executable serialisation once crashed a
# worker (a segfault in put_executable_and_time, 2026-12-07). The CLI's own cache (compile_cache.py) keeps all.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "1")
os.environ.setdefault("QWEN_MTP_COMPILE_CACHE", os.environ["JAX_COMPILATION_CACHE_DIR"])
# XLA:CPU compiles the session's programs at LLVM O0 without its MLIR fusion emitters (tests/xla_flags.py: half the
# compile time, and the suite is compile-bound); QWEN_MTP_TEST_XLA_DEFAULTS=1 runs it with XLA's defaults.
xla_flags.add_test_flags()

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

import hf_tiny  # tests/ is on sys.path under pytest's default import mode

# name -> (builder kind, seed, config overrides, post-processing of the saved folder)
VARIANTS = {
    # num_v_heads (4) != num_k_heads (2), explicit layer_types 3:1
    "dense": ("dense", 1, {}, None),
    # released multimodal layout: model.language_model.*, config under text_config, model.visual.* ignored
    "dense_multimodal": ("dense", 2, {}, hf_tiny.to_multimodal_layout),
    # tied lm_head, num_v_heads == num_k_heads, layer types from full_attention_interval=2, sharded index
    "dense_tied_sharded": ("dense", 3, {"tie_word_embeddings": True, "linear_num_value_heads": 2,
                                        "full_attention_interval": 2, "num_hidden_layers": 4}, hf_tiny.shard),
    "moe_per_expert": ("moe", 4, {}, None),
    "moe_fused": ("moe", 5, {}, hf_tiny.to_fused_experts),
    # Qwen3-Next: fused in_proj_qkvz / in_proj_ba, MoE on every 2nd layer, dense MLP on the others
    "next": ("next", 6, {}, None),
}
# checkpoints with an MTP head (mtp.* tensors added to what transformers saved)
MTP_VARIANTS = {
    # tied embeddings at std 0.6 and a head leaning on the trunk hidden: drafts are accepted sometimes
    "dense_mtp": ("dense", 8, {"tie_word_embeddings": True, "embed_std": 0.6}, 3.0),
    # plain random head, MoE trunk (19 MTP tensors with fused experts)
    "moe_mtp": ("moe", 9, {}, 0.0),
}


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """ckpt(name) -> (transformers model in float64 as the oracle, f32 checkpoint folder); built once."""
    built = {}

    def get(name):
        if name in built:
            return built[name]
        if name in MTP_VARIANTS:
            kind, seed, overrides, passthrough = MTP_VARIANTS[name]
            model = hf_tiny.make_hf_model(kind, seed, **overrides)
            folder = hf_tiny.save_hf(model, tmp_path_factory.mktemp(name))
            hf_tiny.add_mtp(folder, seed, passthrough)
        else:
            kind, seed, overrides, post = VARIANTS[name]
            model = hf_tiny.make_hf_model(kind, seed, **overrides)
            folder = hf_tiny.save_hf(model, tmp_path_factory.mktemp(name))
            if post is not None:
                post(folder)
        built[name] = (hf_tiny.as_oracle(model), folder)
        return built[name]

    return get


@pytest.fixture
def report(request):
    """report(line): a line for the numerics summary printed at the end of the run. Lines travel as the test's
    user_properties, so they reach the summary from pytest-xdist's worker processes too."""
    return lambda line: request.node.user_properties.append(("qwen_mtp_report", str(line)))


def pytest_terminal_summary(terminalreporter):
    lines = [value for reports in terminalreporter.stats.values() for r in reports
             if getattr(r, "when", None) == "call" for name, value in getattr(r, "user_properties", ())
             if name == "qwen_mtp_report"]
    if lines:
        terminalreporter.section("qwen-mtp numerics report")
        for line in lines:
            terminalreporter.write_line(line)
    terminalreporter.write_line(f"XLA flags of this session: {os.environ.get('XLA_FLAGS') or '(XLA defaults)'}")


# The files the suite's two workers start first, slowest first (seconds per file on the 2-core CI host, 2026-12-07,
# `pytest --durations=0`). Under `--dist loadfile` a file runs whole on one worker, so a long file drawn last
# leaves the other worker idle for its length; with these first, the run ends on short files. pyproject's addopts
# pass --no-loadscope-reorder, since xdist's own order (most tests per file first) put the few-but-slow files
# last. Files not named keep pytest's order, after these. The order also decides which files share a worker
# process: a test must not lean on what another file left behind (tests/test_gpu_check.py's spent --budget once
# skipped tests/test_moe_routed.py's check).
SLOW_FIRST = (
    "test_gpu_compile.py", "test_moe_routed.py", "test_shipped_model.py", "test_certify.py", "test_spec_sampling.py",
    "test_sharding.py", "test_export_cuda.py", "test_notebooks.py", "test_causal_attention.py", "test_tree.py",
    "test_repetition_penalty.py", "test_kernel_quant_gate_up.py", "test_kernel_moe_expert_mlp.py",
    "test_trunk_oracle.py", "test_program_cache.py", "test_xla_defaults.py", "test_gpu_check.py", "test_startup.py",
    "test_kernel_quant_mma.py", "test_gpu_scale.py", "test_serve.py", "test_multiprocess.py", "test_kernel_rmsnorm.py",
    "test_fuzz.py", "test_mtp_reference.py", "test_random_weights.py", "test_kernel_quant_gemv.py",
    "test_spec_lossless.py", "test_nonfinite.py", "test_kernel_gdn_step.py", "test_engine.py", "test_train_resume.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: a file's own order is kept


def pytest_unconfigure(config):
    """The run's compilation cache goes with the process that made it (its tmp_path folders go by pyproject's
    tmp_path_retention_policy; tests/test_cleanup.py checks that both leave nothing behind)."""
    if _MADE_CACHE is not None:
        shutil.rmtree(_MADE_CACHE, ignore_errors=True)
