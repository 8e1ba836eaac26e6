"""Test-only hooks for the e2e engines, imported into an engine's process by
mla_backend.demo.engine_run before the engine is built (spec key
`"preload": {"tests.e2e.hooks": OPTIONS}`; the engine then runs in that one process), or
into every process of a multi-GPU engine by tests/e2e/worker_hooks.py (each process then
writes its report to a file of its own after every hooked call).

The adapters call `ops.mla_decode` / `ops.sparse_mla_decode` as attributes of the
`mla_backend.ops` package at call time, so replacing those attributes here reaches every
call the engine makes. A Python wrapper runs on every call of an eager engine; under CUDA
graphs only while a graph is captured (what it does then is what the graph replays).

OPTIONS (all optional):
  count: true          record per call the query tokens per request (q.shape[1]) of
                       ops.mla_decode and the kv_scale it was given (calls made while a CUDA
                       graph is captured counted apart), and the calls of ops.sparse_mla_decode.
  perturb: NAME        a deliberately wrong kernel, for the negative controls (eager engines
                       only):
    "partial_page_dropped"  (dense) the keys of each request's partly filled last page are
                            left out: seq_len rounded down to a multiple of 64, i.e. pages
                            counted as seq_len // 64 instead of rounding up;
    "rope_dropped"          (sparse) scores over the 512 latent dims only: q's 64 RoPE dims
                            are zeroed, as a kernel that skipped the RoPE tile would compute;
    "lse_shifted_on_dcp_rank_1"
                            (dense, decode context parallel) the lse returned on DCP rank 1
                            is 1 too large, so vLLM's DCP merge weights that rank's keys e
                            times too much (a shift on every rank would cancel in the merge).
  kv_scales: [K, V]    after vLLM's loading, every MLA layer's fp8 KV-cache scales are set to
                       K and V (k_scale, v_scale; the cache writer and the decode read them),
                       as a checkpoint's scales would set them. vLLM 0.25 does not load a
                       DeepSeek checkpoint's ModelOpt scales into its MLA layers (its scale-name
                       mapping is applied twice: "Found k_scale in the checkpoint ... not
                       loaded"), so they are set here.
  round_cache_to: "fp8_ds_mla"
                       (a peer's run on a bf16 cache) every KV-cache write of a sparse MLA
                       backend stores kv_c rounded through vLLM's fp8_ds_mla format
                       (quantized per 128-value tile and dequantized, with the tile scales
                       of the writer that fills a real fp8_ds_mla cache in the installed
                       vLLM): that backend then computes attention over the values an
                       fp8_ds_mla kernel reads (rounded to bf16). The write hooked: the sparse
                       impl's do_kv_cache_update (0.25), DeepSeek-V3.2's fused norm/RoPE
                       kernel (0.33).
report() returns what happened, for the engine's result ("preload").
"""

from __future__ import annotations

import json
import os
from collections import Counter

import torch

from mla_backend import formats, ops
from mla_backend.ops import dense, sparse
from mla_backend.vllm import version

PERTURBATIONS = ("partial_page_dropped", "rope_dropped", "lse_shifted_on_dcp_rank_1")
POW2_SCALE_FLOOR = 1e-4  # vLLM 0.33's fp8_ds_mla writer: tile scales at least this
LSE_SHIFT = 1.0  # lse_shifted_on_dcp_rank_1: ln(e), one rank's keys weighted e times
_seen: dict = {"options": {}, "calls_by_s_q": Counter(), "captured_by_s_q": Counter(),
               "sparse_calls": 0, "perturbed_calls": 0, "rounded_cache_writes": 0,
               "scaled_layers": 0, "two_part_q_calls": 0}
_kv_scales: dict[int, object] = {}  # id -> the tensor or float given as kv_scale
_report_path: list[str] = []  # where report() goes after every hooked call (worker processes)


def install(options: dict, report_path: str | None = None) -> None:
    """Apply options (see above). report_path: a file that report() is written to after every
    hooked call (atomically), for processes whose report cannot be returned otherwise."""
    unknown = set(options) - {"count", "perturb", "round_cache_to", "kv_scales"}
    if unknown:
        raise ValueError(f"unknown hook options {sorted(unknown)}")
    perturb = options.get("perturb")
    if perturb is not None and perturb not in PERTURBATIONS:
        raise ValueError(f"perturb must be one of {PERTURBATIONS}; got {perturb!r}")
    if options.get("round_cache_to") not in (None, "fp8_ds_mla"):
        raise ValueError(f"round_cache_to must be fp8_ds_mla; got {options['round_cache_to']!r}")
    kv_scales = options.get("kv_scales")
    if kv_scales is not None and not (len(kv_scales) == 2 and all(
            isinstance(x, (int, float)) and x > 0 for x in kv_scales)):
        raise ValueError(f"kv_scales must be [k_scale, v_scale] > 0; got {kv_scales!r}")
    _seen["options"] = dict(options)
    _report_path[:] = [report_path] if report_path else []
    if kv_scales is not None:
        _set_kv_scales_after_loading(float(kv_scales[0]), float(kv_scales[1]))
    if options.get("count") or perturb in ("partial_page_dropped", "lse_shifted_on_dcp_rank_1"):
        ops.mla_decode = _mla_decode
    if options.get("count") or perturb == "rope_dropped":
        ops.sparse_mla_decode = _sparse_mla_decode
    if options.get("round_cache_to"):
        # vLLM 0.33 writes V3.2's MLA cache in DeepseekV32Attention's fused norm/RoPE kernel
        # (power-of-two fp8_ds_mla scales); 0.25 in the sparse impl's do_kv_cache_update.
        if version.at_least((0, 33, 0)):
            _round_fused_cache_writes()
        else:
            _round_impl_cache_writes()


def _round_impl_cache_writes() -> None:
    from vllm.v1.attention.backend import SparseMLAAttentionImpl

    original = SparseMLAAttentionImpl.do_kv_cache_update

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                           k_scale):
        _check_bf16_cache(kv_cache_dtype)
        kv_c_normed = round_through_fp8_ds_mla(kv_c_normed, k_pe)
        _counted_write()
        return original(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                        k_scale)

    SparseMLAAttentionImpl.do_kv_cache_update = do_kv_cache_update


def _round_fused_cache_writes() -> None:
    """The fused kernel runs without its cache write, its normed kv_c going to a float32
    buffer (the kernel quantizes that float32 value for an fp8_ds_mla cache) and from there
    to the caller's kv_c_out, its RoPE'd k_pe to k_pe_out; then vLLM's concat_and_cache_mla
    writes the rounded kv_c and that k_pe to the same slots."""
    from vllm import _custom_ops
    from vllm.models.deepseek_v32 import attention

    original = attention.fused_norm_rope

    def fused_norm_rope(*args, mla_kv_cache=None, mla_kv_cache_dtype="auto", mla_k_scale=None,
                        kv_c_out=None, k_pe_out=None, slot_mapping=None, **kwargs):
        if mla_kv_cache is None:
            return original(*args, mla_kv_cache=None, mla_kv_cache_dtype=mla_kv_cache_dtype,
                            mla_k_scale=mla_k_scale, kv_c_out=kv_c_out, k_pe_out=k_pe_out,
                            slot_mapping=slot_mapping, **kwargs)
        _check_bf16_cache(mla_kv_cache_dtype)
        if kv_c_out is None or k_pe_out is None:
            raise RuntimeError("round_cache_to needs the fused kernel's kv_c_out and k_pe_out")
        kv_c_fp32 = torch.empty(kv_c_out.shape, dtype=torch.float32, device=kv_c_out.device)
        q_c = original(*args, mla_kv_cache=None, mla_kv_cache_dtype=mla_kv_cache_dtype,
                       mla_k_scale=mla_k_scale, kv_c_out=kv_c_fp32, k_pe_out=k_pe_out,
                       slot_mapping=slot_mapping, **kwargs)
        kv_c_out.copy_(kv_c_fp32)
        rounded = round_through_fp8_ds_mla(kv_c_fp32, k_pe_out, pow2_scales=True)
        scale = mla_k_scale if mla_k_scale is not None else torch.ones(
            1, dtype=torch.float32, device=kv_c_out.device)
        _custom_ops.concat_and_cache_mla(rounded, k_pe_out, mla_kv_cache, slot_mapping,
                                         mla_kv_cache_dtype, scale)
        _counted_write()
        return q_c

    attention.fused_norm_rope = fused_norm_rope


def _check_bf16_cache(kv_cache_dtype: str) -> None:
    if kv_cache_dtype.startswith(("fp8", "nvfp4")):
        raise RuntimeError(f"round_cache_to is for a bf16 cache; got {kv_cache_dtype!r}")


def _counted_write() -> None:
    _seen["rounded_cache_writes"] += 1
    _write_report()


def _set_kv_scales_after_loading(k_scale: float, v_scale: float) -> None:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    original = MLAAttention.process_weights_after_loading

    def process_weights_after_loading(self, act_dtype):
        original(self, act_dtype)
        self._k_scale.fill_(k_scale)
        self._v_scale.fill_(v_scale)
        self._k_scale_float, self._v_scale_float = k_scale, v_scale
        _seen["scaled_layers"] += 1
        _write_report()

    MLAAttention.process_weights_after_loading = process_weights_after_loading


def round_through_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor,
                             pow2_scales: bool = False) -> torch.Tensor:
    """kv_c [T, 512] as an fp8_ds_mla cache holds it (dequantized, in bf16, which holds those
    values exactly); the RoPE part of that format is the bf16 input unchanged. Scales per
    128-value tile: amax / 448 (mla_backend.formats, vLLM's CUDA cache writer; bf16 kv_c), or
    with pow2_scales that rounded up to a power of two and at least 1e-4, as vLLM 0.33's fused
    V3.2 cache writer computes them (from the bf16 or float32 kv_c it is given)."""
    if not pow2_scales:
        packed = formats.quantize_fp8_ds_mla(kv_c, k_pe.reshape(k_pe.shape[0], formats.ROPE_DIM))
        latent = formats.dequantize_fp8_ds_mla(packed)[:, :formats.KV_LORA_RANK]
        return latent.to(kv_c.dtype)
    if (kv_c.dtype not in (torch.bfloat16, torch.float32) or kv_c.dim() != 2
            or kv_c.shape[-1] != formats.KV_LORA_RANK):
        raise ValueError(f"kv_c must be [T, {formats.KV_LORA_RANK}] bf16 or float32; got "
                         f"{tuple(kv_c.shape)} {kv_c.dtype}")
    tiles = kv_c.float().reshape(kv_c.shape[0], formats.FP8_DS_MLA_NUM_TILES,
                                 formats.FP8_DS_MLA_TILE)
    amax = tiles.abs().amax(dim=-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp_min(
        amax / torch.full_like(amax, formats.FP8_E4M3_MAX), POW2_SCALE_FLOOR))))
    values = (tiles / scale).to(torch.float8_e4m3fn).float() * scale
    return values.reshape(kv_c.shape).to(torch.bfloat16)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _mla_decode(q, kv_cache, block_table, seq_lens, plan, softmax_scale, causal=True,
                kv_scale=None, out=None):
    two_part = isinstance(q, tuple)  # (q_nope, q_pe) as vLLM hands them, no copy
    s_q = int((q[0] if two_part else q).shape[1])
    (_seen["captured_by_s_q"] if _capturing() else _seen["calls_by_s_q"])[s_q] += 1
    _seen["two_part_q_calls"] += two_part
    if kv_scale is not None:
        _kv_scales.setdefault(id(kv_scale), kv_scale)
    if _seen["options"].get("perturb") == "partial_page_dropped":
        if _capturing():
            raise RuntimeError("the perturbed kernels run in eager engines only")
        seq_lens = seq_lens - seq_lens % ops.PAGE_SIZE
        plan = dense.plan_decode(seq_lens, plan.q_tokens_per_req, plan.num_heads,
                                 kv_cache_dtype=torch.float8_e4m3fn if plan.kv_fp8 else None)
        _seen["perturbed_calls"] += 1
    result = dense.mla_decode(q, kv_cache, block_table, seq_lens, plan, softmax_scale,
                              causal=causal, kv_scale=kv_scale, out=out)
    if _seen["options"].get("perturb") == "lse_shifted_on_dcp_rank_1":
        if _capturing():
            raise RuntimeError("the perturbed kernels run in eager engines only")
        ranks = _ranks()
        if ranks.get("dcp_size", 1) < 2:
            raise RuntimeError("lse_shifted_on_dcp_rank_1 needs decode context parallelism: "
                               "without it the lse is not used and nothing is perturbed")
        if ranks["dcp"] == 1:
            result[1].add_(LSE_SHIFT)
            _seen["perturbed_calls"] += 1
    _write_report()
    return result


def _sparse_mla_decode(q, kv_cache, indices, plan, softmax_scale, topk_length=None, out=None):
    _seen["sparse_calls"] += 1
    if _seen["options"].get("perturb") == "rope_dropped":
        if _capturing():
            raise RuntimeError("the perturbed kernels run in eager engines only")
        if isinstance(q, tuple):  # (q_nope, q_pe) as the adapters hand it: a zero rope part
            q = (q[0], torch.zeros_like(q[1]))
        else:
            q = q.clone()
            q[..., formats.KV_LORA_RANK:] = 0
        _seen["perturbed_calls"] += 1
    result = sparse.sparse_mla_decode(q, kv_cache, indices, plan, softmax_scale,
                                      topk_length=topk_length, out=out)
    _write_report()
    return result


def _ranks() -> dict:
    """This process's tensor- and decode-context-parallel ranks and sizes, when vLLM's
    parallel groups exist here (a worker); else {}."""
    try:
        from vllm.distributed import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return {}
        tp, dcp = ps.get_tp_group(), ps.get_dcp_group()
    except (ImportError, AssertionError):
        return {}
    return {"tp": tp.rank_in_group, "tp_size": tp.world_size, "dcp": dcp.rank_in_group,
            "dcp_size": dcp.world_size}


def _write_report() -> None:
    if not _report_path:
        return
    path = _report_path[0]
    with open(path + ".tmp", "w") as f:
        json.dump(report(), f)
    os.replace(path + ".tmp", path)


def report() -> dict:
    """What the hooks saw: calls of ops.mla_decode by query tokens per request (eager calls,
    and calls while a graph was captured), how many took the query in two parts (as vLLM
    hands it, no copy), the distinct kv_scale values given to it, the
    perturbed calls and the rounded cache writes."""
    scales = sorted({float(s) for s in _kv_scales.values()})
    return {"options": _seen["options"],
            "mla_decode_calls_by_s_q": {str(k): v for k, v in sorted(_seen["calls_by_s_q"].items())},
            "mla_decode_captured_by_s_q": {str(k): v
                                           for k, v in sorted(_seen["captured_by_s_q"].items())},
            "mla_decode_kv_scales": scales,
            "mla_decode_two_part_q_calls": _seen["two_part_q_calls"],
            "sparse_mla_decode_calls": _seen["sparse_calls"],
            "perturbed_calls": _seen["perturbed_calls"],
            "rounded_cache_writes": _seen["rounded_cache_writes"],
            "scaled_layers": _seen["scaled_layers"], "ranks": _ranks()}
