"""benchmarks/gpu_scale: the full-depth models on one GPU, measured: Qwen3.5-27B and Qwen3.5-35B-A3B (bf16 and
int4) at their real depth with the MTP head, random weights made on the device, nothing downloaded.

    python benchmarks/gpu_scale --budget 420 2>&1 | tee gpu_scale.log     # on a GPU: the whole run, < 8 minutes
    python benchmarks/gpu_scale --short                                    # the CPU short form (tests/test_gpu_scale)

On a lent device (the `run` tool, one H200: timeout_s 480, the machine's own jax):
    python3 benchmarks/gpu_scale --budget 420 2>&1 | tee $OUT/gpu_scale.log
--runs 27B-bf16 (or another run) gives one model the whole budget; --contexts 4096 leaves out the long caches.

For each model, one at a time (device memory checked before anything is allocated; freed between models):
  - the weights drawn by qwen_mtp.trunk.random_weights(on_device=True) (int4: QuantPolicy("int4", 128,
    lm_head=True, mtp=True)) and their bytes;
  - the plain decode step (decoding/plain.py's jitted loop, called directly): TPOT and the bytes one step reads
    (the weights it reads, an MoE's routed experts only, + the KV cache up to the position + the GDN states), as
    a share of the device's HBM roofline (PEAK_BANDWIDTH: the device is detected by name);
  - the speculative round (decoding/speculative.py's jitted loop) at k = 1..4: native head, Wind-MTP (W 4032,
    S 64), each with and without a 32768-id draft vocabulary, in plain steps, and the TPOT it implies at the
    acceptance lengths Qwen3.5's own MTP reaches (AL_PUBLISHED: Qwen3.5-397B on coding prompts; not measured
    here: random weights accept nothing, and the cost of a round does not depend on what it accepts);
  - all of it at each context of --contexts (default 4096, 128K and 1M cached positions): decode cost does not
    depend on what the caches hold, so the caches are allocated once at the largest context, filled with random
    values and the positions set (no prefill); the Wind-MTP paper's per-step table (PAPER) printed beside ours at
    1M, ours also scaled to the paper's bandwidth;
  - the first compile of each program, and the cached start: a second process lowering the same programs with
    jax's persistent compile cache (filled by the first) warm.
The order: plain, k = 3 native and k = 3 windowed on every run first, then (each model made again: seconds)
the draft-vocabulary rounds and the other k. --budget (seconds) fits it to a lease: a part not expected to end
within its model's share of what is left is skipped and named, and the last line counts the skipped parts. Each
part prints its per-context times as it ends, with the kernels one step / round launches (counted in the compiled
program); the tables (bytes, roofline, AL) follow at the end, the plain step's with the time it takes beyond its
bytes' time at peak, per kernel: what launches may explain where a step falls short of the roofline.

Modules: cli (flags, plan, budget, the second process), models (runs, configs, peak bandwidths, memory, weights,
random caches), programs (the decode loops lowered from abstract inputs, timed), reads (bytes per step and per
round), launches (kernels per step from the compiled HLO), report (the tables).
"""
