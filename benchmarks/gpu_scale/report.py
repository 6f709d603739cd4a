"""What the run prints: per model, the plain step and each speculative round at each context against the bytes
they read (reads.py) and the HBM roofline, the TPOT the rounds imply at the published acceptance lengths; the
Wind-MTP paper's per-step table beside ours; the cached start."""

from .reads import round_reads, step_reads

# acceptance length (tokens per round, bonus included) of Qwen3.5's own MTP head, published for Qwen3.5-397B-A17B
# on coding prompts, at k = 1..4: not measured here (random weights accept nothing)
AL_PUBLISHED = {1: 1.93, 2: 2.73, 3: 3.39, 4: 3.97}
AL_SOURCE = "AL published for Qwen3.5-397B's MTP on coding prompts, not measured here"
# the Wind-MTP paper's per-step table: Qwen3.6-35B-A3B at 1M cached positions, batch 1, on a B200
PAPER = {"model": "Qwen3.6-35B-A3B", "context": 1 << 20, "device": "B200", "bandwidth": 8.0e12, "native_ms": 26.4,
             "windowed_ms": 18.3}


def tb(bw):
    return f"{bw / 1e12:.2f} TB/s" if bw else "unknown"


def weights_line(model, parts):
    from qwen_mtp.trunk.quant import weight_bytes

    total = weight_bytes(model.weights)["total"]
    q = "bf16" if model.quant is None else f"{model.quant.method} g{model.quant.group_size} (lm_head, MTP head too)"
    moe = f", experts {gb(parts['experts'])} of them" if parts["experts"] else ""
    return f"{q} weights {gb(total)}{moe}"


def gb(n):
    """Bytes in GB (MB below 0.1 GB: the short form's tiny models)."""
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def _share(nbytes, sec, bw):
    gbs = nbytes / sec / 1e9
    return (f"{gbs:5.0f} GB/s" if gbs >= 10 else f"{gbs:5.2f} GB/s") + (f" = {100 * gbs * 1e9 / bw:3.0f}%" if bw else "")


def model_table(name, res, ctxs, ks, p, batch, bw, dtype, per_kernel=None):
    """per_kernel: launch_probe's seconds a tiny dependent kernel takes on this device (None: not measured)."""
    cfg, parts = res["cfg"], res["parts"]
    item = 2 if dtype == "bfloat16" else 4
    unit, uname = (1e9, "GB") if sum(parts.values()) >= 1e8 else (1e6, "MB")  # MB: the short form's tiny models
    for ctx in ctxs:
        step = res["plain"].get(ctx)
        rounds = [(c, s) for (c, x), s in res["rounds"].items() if x == ctx]
        if step is None and not rounds:
            continue
        print(f"  {name} at {ctx} cached positions (peak {tb(bw)}):", flush=True)
        if step is not None:
            r = step_reads(parts, cfg, batch, ctx, item)
            total = sum(r.values())
            print(f"    plain TPOT {1e3 * step:8.3f} ms; a step reads {gb(total)} (weights {gb(r['weights'])}"
                  f"{' with routed experts only' if parts['experts'] else ''} + KV {gb(r['kv'])} + GDN states "
                  f"{gb(r['state'])}): {_share(total, step, bw)}{' of peak' if bw else ''}", flush=True)
            kernels = res.get("kernels", {}).get("plain")
            if kernels and bw:
                beyond = step - total / bw
                probe = (f"; at the launch probe's {1e6 * per_kernel:.2f} us a kernel they take "
                         f"{1e3 * kernels * per_kernel:.3f} ms" if per_kernel else "")
                print(f"    {kernels} kernels a step (launches.py, from the compiled HLO): the step takes "
                      f"{1e3 * beyond:.3f} ms beyond its bytes' time at peak, {1e6 * beyond / kernels:.2f} us a "
                      f"kernel{probe}", flush=True)
        if rounds:
            print(f"    {'round':38s} {'ms':>8s} {'plain steps':>11s} {uname + ' read':>8s} {'GB/s, % peak':>15s}  "
                  f"TPOT at the published AL ({AL_SOURCE})", flush=True)
        for case, sec in sorted(rounds, key=lambda cs: (cs[0].k, cs[0].window or 0, cs[0].draft_vocab or 0)):
            frac = case.draft_vocab / cfg.vocab_size if case.draft_vocab else 1.0
            r = round_reads(parts, cfg, batch, ctx, item, case.k, case.window, case.sinks, frac)
            total = sum(r.values())
            steps = f"{sec / step:11.2f}" if step else f"{'-':>11s}"
            al = AL_PUBLISHED.get(case.k)
            implied = ""
            if al:
                implied = f"AL {al:.2f}: {1e3 * sec / al:.3f} ms" + (f" = {al * step / sec:.2f}x plain" if step else "")
            print(f"    {case.label:38s} {1e3 * sec:8.3f} {steps} {total / unit:8.3f} {_share(total, sec, bw):>15s}  "
                  f"{implied}", flush=True)


def paper_table(results, ctxs, ks, p, bw):
    """Ours at 1M (or the largest context measured) beside the Wind-MTP paper's per-step table."""
    ctx = PAPER["context"] if PAPER["context"] in ctxs else max(ctxs)
    print(f"Wind-MTP paper's per-step table: {PAPER['model']} at {PAPER['context']} cached positions, batch 1, on a "
          f"{PAPER['device']} (~{tb(PAPER['bandwidth'])}): native MTP step {PAPER['native_ms']} ms, windowed "
          f"{PAPER['windowed_ms']} ms, native / windowed {PAPER['native_ms'] / PAPER['windowed_ms']:.2f} "
          f"(+{100 * (PAPER['native_ms'] / PAPER['windowed_ms'] - 1):.0f}%)", flush=True)
    scale = bw / PAPER["bandwidth"] if bw else None
    any_row = False
    for name, res in results.items():
        got = {(c.k, c.window is None): s for (c, x), s in res["rounds"].items() if x == ctx and not c.draft_vocab}
        for k in sorted({k for k, _ in got}):
            if (k, True) not in got or (k, False) not in got:
                continue
            nat, win = got[(k, True)], got[(k, False)]
            scaled = (f"; at the paper's bandwidth (x {scale:.2f}): native {1e3 * nat * scale:.1f} ms, windowed "
                      f"{1e3 * win * scale:.1f} ms" if scale else "")
            print(f"  ours, {name} at {ctx} cached positions, k = {k}: native round {1e3 * nat:.2f} ms, windowed "
                  f"(W {p['window']}, S {p['sinks']}) {1e3 * win:.2f} ms, native / windowed {nat / win:.2f} "
                  f"({100 * (nat / win - 1):+.0f}%){scaled}", flush=True)
            any_row = True
    if not any_row:
        print(f"  ours: no model measured both native and windowed rounds at {ctx} positions", flush=True)


def cached_line(got):
    if got is None:
        print("cached start: nothing was compiled, nothing to read back", flush=True)
        return
    name, child, wall, first = got
    n = len(child["times"])
    print(f"cached start: a second process lowered {n} programs of {name} ({', '.join(child['times'])}) with jax's "
          f"persistent compile cache warm: {sum(child['times'].values()):.1f} s for them (trace, lower, read), "
          f"ready {child['process_s']:.1f} s after its imports ({wall:.1f} s wall), against "
          f"{sum(first.values()):.1f} s compiling them first (" + ", ".join(f"{k} {v:.1f} s" for k, v in first.items())
          + ")", flush=True)
