"""GPU check, the one command to run first on a lent GPU (under 8 minutes; never part of CI):

    python benchmarks/gpu_check                 # on the GPU machine
    python benchmarks/gpu_check --interpret     # the same checks on CPU, kernels in interpret mode (a smoke test)

1. every Pallas kernel compiled for the device (not interpret mode) against its pure-JAX reference at the test
   shapes and at real Qwen3.5 draft shapes, f32 and bf16, with the ring in one part and split in several;
2. timings of kernel and reference (XLA) at the real shapes, with achieved GB/s against the device's
   bandwidth (bytes = the ring's K and V, the queries, the new rows and the output, each read or written once).
   Every kernel timing in this script is device time: n calls chained in one compiled loop (`timing.time_call`), not n
   dispatches from Python, whose ~40-60 us floor hid the small kernels in the first H200 run;
3. the library baseline where it is installed: tokamax.dot_product_attention (mosaic, triton, cudnn, xla) on
   the same inputs, [ring ; new rows] keys with the Wind-MTP mask, timed beside our kernel (each
   implementation that refuses the case says why);
4. end to end on the shipped model: plain, speculative native and speculative windowed greedy generate (the
   windowed one with its kernel, checked in the compiled program, streaming on and off) give the same tokens;
5. the quantized-matmul kernel (int8 per channel, int4 groups, fp8 blocks and per channel) against its XLA
   reference at small shapes and at the real 27B matrices (gate / up, down, lm_head) for M = 1, 5 and 512,
   timed beside the reference (XLA dequantize-then-dot), a plain bf16 dot of the same shape and qwix
   (qwix.quantize + qwix.dot, where qwix expresses the format: int8 per channel, int4 groups along K and fp8
   128 x 128 tiles when the tiles divide K and N), with achieved GB/s (bytes of q, scale, x and the output, each
   moved once) against the device's bandwidth, and whether backend "auto" (quant_matmul.xla_is_faster) picks
   the one this run measured faster; int4 and fp8 blocks also at 16 .. 256 rows, to place XLA_ROWS.
   `--quant-only` runs just this part;
6. tensor parallel over every visible GPU (mesh data=1, model=n, qwen_mtp.shard), when more than one is
   visible: a Qwen3.5-27B slice (real layer dimensions, 4 layers = one 3 GDN : 1 attention period, and the MTP
   head) with random int4 weights (groups of 128, lm_head included: the quantized-matmul kernel runs per shard)
   gives the same greedy tokens on n GPUs as on one, plain and speculative (windowed draft, its kernel per
   shard), with f32 activations (bf16's rounding would part near-tied random logits); then the decode step time
   (TPOT) of plain and speculative greedy decode in bf16 on 1 GPU and on n, and their ratio. With one GPU it
   prints that it is skipped; on CPU with several (virtual) devices it runs a small config instead
   (`XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/gpu_check --interpret --tp-only`).
   `--tp-only` runs just this part;
7. end to end on a Qwen3.5-27B-shaped slice (the same 4 real layers and MTP head as item 6, `--e2e27b-layers`
   to change the depth) with random bf16 weights, not quantized, on one device: plain, speculative native k3 and
   speculative windowed k3 (W 4032, S 64) greedy generate, and native k3 with a draft vocabulary of 32768 ids
   (the k drafts then read a 32768-column lm_head instead of the whole one), each compiled by a first call and
   timed on a second,
   with TPOT, tokens/s and achieved GB/s of the weights read against the device's bandwidth. Bytes read per
   plain step = every trunk layer's arrays + the final norm + lm_head (the embedding rows gathered are
   negligible and not counted). Per speculative round (speculative.spec_decode as it is): the verify reads the
   trunk and lm_head once (its k + 1 rows in one pass), the k drafts read lm_head k times and the MTP head
   k - 1 times (the first draft reuses the refill's output), the refill reads the head once (no lm_head):
   trunk + (k + 1) lm_head + k head. Round time = decode time / rounds. Random weights accept at random, so the
   speculative figure is a cost per round, printed as round time / plain step time, not a speedup. On CPU the
   `--interpret` smoke form skips it (CI time; it prints why); `--e2e27b-only` runs just this part, on CPU at
   a small config of the same layer pattern.
8. the causal attention kernel of the trunk and the native head (kernels_pallas/causal_attention.py) against
   its blocked pure-JAX reference at small shapes (ragged rows, parts, an fp8 cache), then at Qwen3.5-27B's
   attention (24 query heads, 4 kv heads, head_dim 256, bf16) over long caches: a 256-row prefill chunk at the
   end of a 128K and of a 1M-slot cache, a decode step and a k = 8 verify at 128K and 1M; timed beside the
   reference (XLA) and, for the decode step, jax.nn.dot_product_attention with cuDNN (key_value_seq_lengths:
   the one case it can express without a materialised mask), with achieved GB/s (bytes = the visible K and V
   slots, queries and output, each moved once); then end to end, a 27B slice (4 real layers, bf16 random
   weights) prefilling a 128K and a 1M-token prompt and decoding 16 tokens: prefill tokens/s and TPOT (a context
   whose caches do not fit is refused before allocating and reported). `--long-only` runs just this part; the
   full run includes the end-to-end form only under `--budget` (its 1M prefill alone took 144 s on an H200).
9. the GDN decode step and verify kernels (kernels_pallas/gdn_step.py, gdn_verify.py: the rule's step form and
   the gated norm as one kernel a GDN layer) against their XLA references at small shapes, then at the real
   GDN heads of 27B, 35B-A3B and 397B-A17B (the step at batch 1 and 8, the verify of k = 3 and 8 drafts), timed
   beside the references (the XLA kernels they replace), with achieved GB/s (bytes = the f32 state read, and
   written by the step, and the rows' qkv, z, b, a and output, each moved once); beside each step case the conv
   step kernel (kernels_pallas/gdn_conv.py: the conv and its next state in place) at the same rows and channels;
   at batch 1 the step also with pad_row (out_proj's two rows: the same row, then zeros the kernel writes); then
   the RMSNorm row kernel (kernels_pallas/rmsnorm.py, norms.py) at the real hidden sizes, timed beside XLA's, and
   the attention's new-rows kernel (kernels_pallas/attention_rows.py, new_rows.py: the q | gate, k and v
   products' K partials summed, q_norm and k_norm, RoPE, the queries written in the attention kernel's rows, the
   keys and values into the caches) at the real heads, timed beside XLA's kernels in a loop that carries the
   caches, and the GDN rollback kernel (kernels_pallas/gdn_rollback.py, rollback.py: both states of a GDN layer
   rebuilt in place after a verify) at the real GDN layers, timed beside XLA's reference in a loop that carries
   the states. `--gdn-only` runs just this part.
10. the MoE block's kernels: the routed experts at decode, the prefill paths and the plan sweep (moe.py, its
   docstring), and the router's top-k kernel (router.py: kernels_pallas/moe_router.py against lax.top_k, bit for
   bit, at the real routers, timed beside XLA's sort and slice). `--moe-only` runs just this part.
The --*-only flags combine into one command (`--quant-only --moe-only`: the numerics of every part named run
first, then each part's main timings, then the rest: the plan sweeps, prefill, the long prefill). Exits non-zero if any check fails. Each part runs on when another raises (its error in one line), and a summary of
the parts closes the output. `--budget SECONDS` fits the run to a lease: parts and cases not started by then are
skipped and named, and the full run then ends with item 8's end-to-end 27B prefill at `--long-contexts` (128K,
then 1M while at least 150 s are left). On the lent H200:
`python3 benchmarks/gpu_check --budget 400 2>&1 | tee $OUT/gpu_check.log` (timeout_s about 480).

On the lent H200 run it from the repository root as it is, with the image's python3 (its jax, the CUDA 13
plugin, flax, safetensors and tokenizers are there; the package puts the repository on sys.path). jax there
may be newer than the project's pin: the check prints the version. tokamax and qwix are not in that image:
carry their wheels and those of what the image lacks (`pip download --no-deps --only-binary=:all:
--python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform any -d .whl tokamax qwix
einshape immutabledict tensorboardx pydantic pydantic-core annotated-types typing-inspection xprof fire termcolor
gviz-api`; tokamax imports xprof), carry ".whl", then
`pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site` first there
(benchmarks/results/h200-2026-12-04/README.md: the first run, its command and logs).

Layout (until 2026-12-05 one script, benchmarks/gpu_check.py, which the first H200 run used): `__main__` (what
`python benchmarks/gpu_check` runs: the repository's root on sys.path, then `cli.main`), `cli` (the flags, which
sections each form runs), `common` (paths, bandwidth, one-line errors, max_rel), `timing` (the chained-loop
device timer and the checked timing), `budget` (--budget, one section, the summary), one module per item:
`windowed` (1-3), `end_to_end` (4), `quant` (5), `tensor_parallel` (6), `e2e_27b` (7), `causal` and
`long_context` (8), `gdn`, `norms`, `queries` and `rollback` (9), and `models` (the small config and the random-weight models of items 6-8).
"""


from . import common  # noqa: F401  (puts the repository's root on sys.path: kernels_pallas, qwen_mtp)
