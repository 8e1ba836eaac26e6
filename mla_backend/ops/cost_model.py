"""The measured costs the planners schedule by.

A plan spreads work units (32 or 64 keys of a dense request, 64 index entries of a sparse
one) over one wave of CTAs; dense decode picks its kernel by the query rows, the batch and the
cache's dtype (MMA_MAX_ROWS, MMA_MIN_BATCH_*).
Two rules come from measurements: every CTA gets at least
MIN_TOKENS_PER_CTA keys of work, and a sparse plan of equal-length requests rounds each CTA's
share up to whole requests (no request split over CTAs, so no merge kernel) when that costs
less than the split would.
"""

from __future__ import annotations

from ._common import D_V

# Swept on the H200 for dense decode: 64 helped batch 1 at 1k keys but hurt it at 16k, and 256
# hurt batch 1 at every length. On the H100 (2026-11-27) 64 helped batch 1 at 1k (-4 to -7%)
# and lost at batch 2 and at 4k (+0.2 to +1.5 us; docs/notes/2026-11-27-split-minimum-and-spans.md).
MIN_TOKENS_PER_CTA = 128

# Dense decode on the wgmma kernel with at most DENSE_ONE_PAGE_MAX_TILES row tiles (H * s_q <=
# 256): a step of at most DENSE_ONE_PAGE_MAX_PAGES pages in all gives each CTA at least one page,
# not MIN_TOKENS_PER_CTA keys (the GPU planner sees the step's lengths; the host does not).
# Measured on the H100 with one page everywhere (2026-11-27;
# docs/notes/2026-11-27-split-minimum-and-spans.md): batch 1 at 1k (8-24 pages) -4 to -7% at
# 1-4 tiles, +1.2 us at 8 tiles; batch 2 at 1k (about 32 pages) +0.2 to +0.7 us; batch 1 at 4k
# +0.5 to +1.3 us on 6 of 12 rows. DENSE_ONE_PAGE_MAX_PAGES -1: never.
DENSE_ONE_PAGE_MAX_PAGES = 24
DENSE_ONE_PAGE_MAX_TILES = 4

# The same minimum on a per-tensor fp8 cache where the wgmma kernel holds every query row in one
# row tile (H * s_q <= 64): its CTAs convert each page before the tensor cores read it, so a step
# of few pages gains from more, shorter CTAs. Measured on the H100 (2026-11-27, H 16 and 64,
# s_q 1 and 2, batch 1-8, 1k/4k/16k; docs/notes/2026-11-27-fp8-small-steps.md): one page took
# 0.4-2.1 us (3-14%) off batch 1-4 at 1k and batch 1-2 at 4k and moved the other rows by at most
# 0.5 us; at two and four row tiles it lost up to 0.9 us (batch 2-4, 1k), so they keep 128.
# Measured again with the pages converted by the consumers (2026-11-28, H 16 and 64, s_q 1 and
# 2, batch 1-8, 1k and 4k; bench/results/dense_decode_fp8_consumer_conversion-h100-80gb-hbm3-
# 2026-11-28.json, c3): 128 keys was 4-10% slower at batch 1-4 at 1k and batch 1 at 4k, and
# within 0.6 us elsewhere (2-4% faster at batch 2, 4k).
MIN_TOKENS_PER_CTA_FP8_ONE_TILE = 64

# Dense decode's kernel for few query rows (s_q * H <= MMA_MAX_ROWS: the head counts of TP 8 and
# TP 16): the mma.sync kernel (16-row tiles, two CTAs per SM) from MMA_MIN_BATCH_* requests on
# (None: never), else the wgmma kernel (64-row tiles, one CTA per SM), which runs every larger
# row count. Measured on the H100 (2026-11-27; H 8 and 16, s_q 1; bench/results/
# dense_decode_few_rows-h100-80gb-hbm3-2026-11-27.json): on a 16-bit cache the wgmma kernel was
# faster on 18 of 24 rows (batch 1, 8, 32, 128; 1k, 4k, 16k keys), by up to 41% (batch 1,
# 1k), and slower by at most 9% on the other six (five of them H 8). On a per-tensor fp8 cache
# (the mma.sync kernel with fp16 operands; H 8 s_q 1 and 2, H 16 s_q 1; bench/results/
# dense_decode_fp8_few_rows_mma-h100-80gb-hbm3-2026-11-27.json, call c9) the plan sees the
# batch, not the lengths: from 16 requests the mma.sync kernel took 20 to 29% less time at 4k
# and 16k keys and lost up to 21% at 1k (geometric mean over those rows -10% at batch 16); at
# 8 requests it lost at 1k and 4k (up to 50%) and gained at 16k (19 to 26%). Against the wgmma
# kernel with the pages converted by its consumers (2026-11-28, H 16, s_q 1, 4k; the json of
# MIN_TOKENS_PER_CTA_FP8_ONE_TILE, c1 and c2): level at batch 32 (62-64 us per layer on either)
# and 13% faster at batch 128 (177-178 against 201-205 us).
# On an fp8 cache the mma.sync kernel takes at most MMA_MAX_ROWS_FP8 rows: against the wgmma
# kernel with fp16 tiles (2026-11-28, batch 16-128, 1k/4k/16k; bench/results/
# dense_decode_fp8_few_rows_wgmma_f16-h100-80gb-hbm3-2026-11-28.json), at 16 rows (H 16 s_q 1,
# H 8 s_q 2) the wgmma kernel was 3-22% faster at batch 16 and 32 and within +2.2 / -3.3% at
# batch 128; at 8 rows (H 8 s_q 1) the mma.sync kernel was 4-10% faster at 4k and 13% at
# batch 128, 1k, and 1.5-7% slower elsewhere.
# Read at each plan (bench/dense_decode.py --mma-max-rows sets both row caps, --mma-min-batch
# both batches); set them before making a workspace: its plans are cached per batch size.
MMA_MAX_ROWS = 16
MMA_MAX_ROWS_FP8 = 8
MMA_MIN_BATCH_16BIT: int | None = None
MMA_MIN_BATCH_FP8: int | None = 16

# The wgmma kernel on a per-tensor fp8 cache with a bf16 q: its consumers convert each page to
# fp16 (one instruction per pair of values) rather than bf16 (four), and then convert Q to fp16
# once per request piece (each row scaled by a power of two of its own), from this many requests
# on (None: never). The Q conversion costs each CTA ~0.8 us; each page saves ~0.4. Measured on
# the H100 (2026-11-28, H 16/64/128, s_q 1 and 2, batch 1-128, 1k/4k/16k; bench/results/
# dense_decode_fp8_fp16_operands-h100-80gb-hbm3-2026-11-28.json), fp16 against bf16 operands:
# batch 1 +4 to +7.5% at 1k and 4k, -3 to +1.5% at 16k; batch 4 +0 to +6% at 1k, -4 to -8% at
# 16k; batch 8 +2.7 to +3.8% at 1k on one row tile, -0.2 to -8% elsewhere; batch 16 to 128
# -2.7 to -16% on every row the wgmma kernel runs.
# Read at each call (set it before capturing a CUDA graph).
FP8_FP16_OPERANDS_MIN_BATCH: int | None = 8

# Dense decode of requests that all have the same length: each CTA takes whole requests (none
# split: no partials, nothing to merge) when that gives a CTA at most this many units (pages
# of the wgmma kernel, 32-key units of the mma.sync kernel), or 1/32 of the balanced share if
# that is more, above the balanced share; -1: never. The same trade as the sparse planner's
# WHOLE_REQUEST_EXTRA_UNITS. Read at each plan (bench/dense_decode.py --whole-extra).
DENSE_WHOLE_REQUEST_EXTRA_UNITS = 4

# Dense decode on the wgmma kernel: an aligned plan (every request on CTAs of its own, its start
# on a CTA boundary) when it needs at most this many units per CTA above the balanced share; -1:
# never. A CTA whose range holds a request's start runs two pieces and restarts its pipeline in
# between: measured on the H100 (2026-11-27) at 4-6 us per step, about 1.5 units of one CTA at
# batch 32 (bench/results/dense_decode_spans-h100-80gb-hbm3-2026-11-27.json). Read at each plan
# (bench/dense_decode.py --align-extra).
DENSE_ALIGN_EXTRA_UNITS = 1

# Dense decode on the wgmma kernel, where no aligned plan fits: a padded plan, each request that
# ends inside a CTA followed by this many units of padding (fewer where that CTA's range ends
# sooner), so a CTA that restarts its pipeline for a second piece gets fewer keys; -1: never.
# Measured on the H100 (2026-11-27), padded plans written by hand into the plan, mla_decode
# alone, against the planner's plan: 4 was best or within 1% of the best of 0-6 on every row
# (batch 32, 4k, H 16-128: -2.5 to -6.8%; batch 128, 1k, H 16-128: -4.8 to -7.7%; batch 32,
# 1k, H 128, s_q 4: -12.9%; batch 128 at 16k -0.3%; docs/notes/2026-11-27-restart-padding.md).
# Read at each plan (bench/dense_decode.py --restart-pad).
DENSE_RESTART_PAD_UNITS = 4

# Dense decode on the wgmma kernel with more requests than CTAs: whole requests longest first
# (in rounds, each round's longest to the least loaded CTAs; no request split, so no merge) when
# that puts at most this many units, or 1/32 of the balanced share if more, above the balanced
# share on the busiest CTA; -1: never. Measured on the H100 against -1 and 8, ours alone
# (docs/notes/2026-11-27-whole-request-lpt-plan.md): batch 128-256 at 1k -4 to -12% per layer;
# 8 took 4-6% off some 4k rows and added 4% to others, within the runs' spread. Read when a
# workspace makes a plan of a batch size (-1 then leaves that plan without an order) and at
# each plan (bench/dense_decode.py --lpt-extra).
DENSE_LPT_EXTRA_UNITS = 4

# Measured on the H100 for sparse decode: splitting a request over CTAs (a partial write per
# CTA, the merge kernel's launch and read) costs about 4 units of one CTA's time on a bf16
# cache at H >= 64, and 3 on an fp8_ds_mla cache below 64 heads.
WHOLE_REQUEST_EXTRA_UNITS = 4
WHOLE_REQUEST_EXTRA_UNITS_FP8_SMALL_H = 3

# Measured on the H100 for sparse decode on a bf16 cache (H = 32 and 64, batch 32): a split
# costs about 4.6 us plus 0.69 us per MB of float32 partials, against 2.0 us per unit of one
# CTA.
SPLIT_FIXED_US = 4.6
SPLIT_US_PER_MB = 0.69
BF16_UNIT_US = 2.0


def _min_units(unit_tokens: int, min_tokens: int | None = None) -> int:
    """The least work of one CTA, in units of unit_tokens keys: min_tokens keys (None:
    MIN_TOKENS_PER_CTA, read at each call) rounded up to whole units."""
    tokens = MIN_TOKENS_PER_CTA if min_tokens is None else min_tokens
    return -(-tokens // unit_tokens)


def _whole_requests_floor(groups: int, units_per_req: int, num_ctas: int, min_units: int,
                          num_heads: int, kv_fp8: bool) -> int:
    """The sparse planner's floor on units per CTA for `groups` requests of units_per_req
    units each: raised to whole requests per CTA (no request split, no merge kernel) when
    that adds few units to the balanced share, or (bf16 cache) fewer than the split's
    partials and merge would cost; else min_units."""
    balanced = max(-(-groups * units_per_req // num_ctas), min_units)
    whole = -(-balanced // units_per_req) * units_per_req
    if kv_fp8:
        limit = (WHOLE_REQUEST_EXTRA_UNITS_FP8_SMALL_H if num_heads < 64
                 else WHOLE_REQUEST_EXTRA_UNITS)
    else:
        ctas_used = -(-groups * units_per_req // balanced)
        partial_mb = ctas_used * num_heads * D_V * 4 / 1e6
        split_units = (SPLIT_FIXED_US + SPLIT_US_PER_MB * partial_mb) / BF16_UNIT_US
        limit = max(WHOLE_REQUEST_EXTRA_UNITS, split_units)
    return whole if whole - balanced <= limit else min_units
