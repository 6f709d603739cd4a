"""The launch plan of the decode kernel (quant_gemv.py) and of its grouped form over (token, expert) pairs
(quant_gemv_grouped.py): how many columns a one-warp program covers (a lane's 4-byte words per row), how many
stored rows one load reads, and how K is cut into parts (split_k.k_parts) until the grid fills the GPU; and the
alternatives to that plan that benchmarks/gpu_check times (the constants below come from sm_90 instruction
counts on a CPU host, benchmarks/sm90_estimates.py, not from a GPU)."""

from __future__ import annotations

import dataclasses

from kernels_pallas.quant_layout import VALUES_PER_COLUMN, cdiv
from kernels_pallas.split_k import SMS, k_parts

SUB_ROWS = 16  # stored rows per load (per thread: 16 x 16 bytes in flight)
STEP_ROWS = 16  # per-channel formats: rows per loop step (one load)
# CTAs (one warp each): 8 per SM of an H100 / H200 (132 SMs), two per scheduler, each with its next tile's loads
# in flight (about 150 registers: 13 such CTAs fit an SM, so one wave); K is split into parts to get there
# (split_k.k_parts): parts of MIN_STEPS_PER_SPLIT steps or more, f32 partials under MAX_PARTIAL_TRAFFIC of the bytes
TARGET_PROGRAMS = SMS * 8
MIN_STEPS_PER_SPLIT = 2
MAX_PARTIAL_TRAFFIC = 0.05
MOST_PER_SM = 16  # alternatives' "most" K parts: 16 one-warp CTAs a SM, ~32 KB of loads in flight at 1 word a lane


def mode(kind: str, k: int, block) -> str:
    """'int4', 'channel' (one scale per column over all of K, or one per tensor) or 'block' (per K block)."""
    if kind == "int4":
        return "int4"
    return "channel" if block[0] >= k else "block"


def reads_words(kind: str) -> bool:
    """int8 / int4 values are read as int32 words of 4 columns; fp8 as bytes."""
    return kind in ("int8", "int4")


WORDS = (1, 2, 4)  # a lane's 4-byte words per row: one 4-, 8- or 16-byte load


def vector_words(M: int) -> int:
    """4-byte words per thread and row: 4 (one 16-byte load) at 1 .. 2 rows; more rows hold more accumulators
    (2 x M x 4 x words per thread), so 2 words at 3 .. 4 rows and 1 above (no spill on sm_90)."""
    return 4 if M <= 2 else (2 if M <= 4 else 1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """grid (col_tiles, splits); a program covers `cols` stored columns (int32 words for int8 / int4, bytes for
    fp8) and `per` loop steps of `step` stored rows (one scale block), loaded `rows` rows at a time."""
    cols: int
    col_tiles: int
    step: int
    rows: int
    steps: int
    per: int
    splits: int
    num_warps: int
    prefetch: bool = True  # load the next R rows before the arithmetic on these (False: after; gpu_check times both)

    @property
    def programs(self) -> int:
        return self.col_tiles * self.splits

    def step_values(self, kind: str) -> int:  # the stored values one pass of the innermost loop reads
        return self.rows * self.cols * VALUES_PER_COLUMN[kind]


def plan(M, K, N, kind, block, *, num_warps=None, splits=None, rows=None, prefetch=None, words=None,
         pairs=1) -> Plan:
    """Launch parameters from the shapes (module doc); a keyword given wins (tests: `rows` < 16 keeps the
    interpret-mode program small; `words`, a lane's 4-byte words per row (1, 2 or 4), and `splits` are the plan
    alternatives benchmarks/gpu_check times). pairs: the grouped kernel's (token, expert) pairs, each M = 1 row
    over its own expert, the grid `pairs` times longer (K's parts are cut for all of it)."""
    bk = block[0]
    md = mode(kind, K, block)
    unit = 4 if reads_words(kind) else 1
    ncols = cdiv(N, unit)  # stored columns: words or bytes
    if num_warps is None:
        num_warps = 1
    if words is not None:
        if words not in WORDS:
            raise ValueError(f"quant_gemv plan: words (a lane's 4-byte words per row) must be one of {WORDS}, "
                             f"found {words!r}")
        per_lane = words
    else:
        per_lane = vector_words(M)
        if pairs > 1 and pairs * cdiv(ncols, 32 * per_lane * num_warps * (1 if reads_words(kind) else 4)) < SMS:
            per_lane = 1  # few pairs x narrow experts (35B-A3B: 8 x 512 columns): 4x the column tiles, 4-byte loads
    cols = 32 * per_lane * num_warps * (1 if reads_words(kind) else 4)
    col_tiles = cdiv(ncols, cols)
    if md == "int4":
        step = bk // 2
    elif md == "block":
        step = bk
    else:
        step = STEP_ROWS
    rows = min(SUB_ROWS if rows is None else rows, step)
    if step % rows:
        raise ValueError(f"quant_gemv plan: rows {rows} must divide the step of {step} stored rows")
    stored = cdiv(K, bk) * bk // 2 if md == "int4" else K
    steps = cdiv(stored, step)
    weight_bytes = pairs * stored * ncols * (4 if reads_words(kind) else 1)
    splits, per = k_parts(steps, col_tiles * pairs, weight_bytes, M * pairs, N,
                          target=TARGET_PROGRAMS, min_steps=MIN_STEPS_PER_SPLIT, max_traffic=MAX_PARTIAL_TRAFFIC,
                          wave=SMS if pairs > 1 else 0, splits=splits)
    if prefetch is None:  # fp8 bytes carried across the loop lose their packing (byte shuffles, spills on sm_90)
        prefetch = reads_words(kind)
    return Plan(cols, col_tiles, step, rows, steps, per, splits, num_warps, bool(prefetch))


def alternatives(M, K, N, kind, block, *, pairs=1, words=WORDS, splits=("plan", "half", "double")) -> list:
    """The launch plans worth timing against the plan's own choice at one shape (benchmarks/gpu_check times them:
    the plan's constants come from sm_90 instruction counts, not from a GPU): [(words, splits, Plan, own)], a
    lane's 4-byte words per row x K's parts: "plan" (the plan's cut of K for that tile), "half" / "double" of it,
    "most" (parts until the grid holds MOST_PER_SM programs a SM, as far as K's loop steps allow) or a number;
    `own` marks the plan's own choice; alternatives that give the same plan are listed once. Rows per load stay
    at SUB_ROWS: 32 or 64 did not compile for sm_90 within 5 minutes on a CPU host (the unrolled loop)."""
    block = tuple(block)
    own = plan(M, K, N, kind, block, pairs=pairs)
    out, seen = [], set()
    for w in words:
        base = plan(M, K, N, kind, block, pairs=pairs, words=w)
        most = min(base.steps, cdiv(MOST_PER_SM * SMS, pairs * base.col_tiles))
        for sp in splits:
            n = {"plan": base.splits, "half": max(1, base.splits // 2), "double": 2 * base.splits,
                 "most": most}.get(sp) if isinstance(sp, str) else int(sp)
            if n is None:
                raise ValueError(f"quant_gemv alternatives: splits are plan, half, double, most or a number, "
                                 f"found {sp!r}")
            p = plan(M, K, N, kind, block, pairs=pairs, words=w, splits=n)
            if (p.cols, p.splits) not in seen:
                seen.add((p.cols, p.splits))
                out.append((w, p.splits, p, (p.cols, p.splits) == (own.cols, own.splits)))
    return out
