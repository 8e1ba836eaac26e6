"""Every validation error of mla_backend.ops, on CPU tensors (no GPU or extension needed)."""

import pytest
import torch

from mla_backend import _extension, ops
from mla_backend.ops import sparse


def _args(batch=2, s_q=1, heads=16, dtype=torch.bfloat16):
    q = torch.randn(batch, s_q, heads, 576).to(dtype)
    cache = torch.randn(4, 64, 576).to(dtype)
    table = torch.zeros(batch, 2, dtype=torch.int32)
    seq = torch.full((batch,), 10, dtype=torch.int32)
    plan = ops.DecodePlan(batch=batch, q_tokens_per_req=s_q, num_heads=heads, kv_fp8=False,
                          rows_per_cta=16, unit_tokens=32,
                          num_ctas=1, metadata=torch.zeros(batch + 2, dtype=torch.int32),
                          partial_out=torch.zeros(2, s_q * heads, 512),
                          partial_lse=torch.zeros(2, s_q * heads))
    return dict(q=q, kv_cache=cache, block_table=table, seq_lens=seq, plan=plan,
                softmax_scale=0.04)


CASES = [
    ("q", lambda a: a["q"][..., :512], ValueError, r"q must be \[batch, s_q, heads, 576\]; got shape \(2, 1, 16, 512\)"),
    ("q", lambda a: a["q"].float(), TypeError, r"q must be bfloat16 or float16; got .*torch.float32"),
    ("q", lambda a: torch.randn(2, 9, 16, 576).bfloat16(), ValueError, r"s_q \(dim 1\) in \[1, 8\]"),
    ("q", lambda a: torch.randn(2, 1, 129, 576).bfloat16(), ValueError, r"heads \(dim 2\) in \[1, 128\]"),
    ("q", lambda a: a["q"].transpose(2, 3).contiguous().transpose(2, 3), ValueError, "contiguous last dim"),
    ("q", lambda a: "not a tensor", TypeError, "q must be a torch.Tensor; got str"),
    ("q", lambda a: torch.randn(2 * 16 * 576 + 4).bfloat16()[4:].view(2, 1, 16, 576), ValueError, "q must be 16-byte aligned"),
    ("q", lambda a: (a["q"][..., :512], a["q"][..., 512:], a["q"]), TypeError, r"a pair \(q_nope, q_pe\); got 3 items"),
    ("q", lambda a: (a["q"], a["q"][..., 512:]), ValueError, r"q_nope \(q\[0\]\) must have a last dim of 512; got shape \(2, 1, 16, 576\)"),
    ("q", lambda a: (a["q"][..., :512], a["q"][:1, ..., 512:]), ValueError, r"q_pe \(q\[1\]\) must be q_nope's shape \(2, 1, 16\) with a last dim of 64; got shape \(1, 1, 16, 64\)"),
    ("q", lambda a: (a["q"][..., :512], a["q"][..., 512:].half()), TypeError, r"q_pe \(q\[1\]\) must have q_nope's dtype torch.bfloat16; got .*float16"),
    ("q", lambda a: (a["q"][..., :512], a["q"][..., 508:572]), ValueError, r"q_pe \(q\[1\]\) must be 16-byte aligned"),
    ("q", lambda a: (a["q"][..., :512].float(), a["q"][..., 512:].float()), TypeError, r"q_nope \(q\[0\]\) must be bfloat16 or float16"),
    ("q", lambda a: (a["q"][..., :512], "pe"), TypeError, r"q_pe \(q\[1\]\) must be a torch.Tensor; got str"),
    ("kv_cache", lambda a: torch.randn(4, 32, 576).bfloat16(), ValueError, r"kv_cache must be \[num_blocks, 64, 576\]; got shape \(4, 32, 576\)"),
    ("kv_cache", lambda a: a["kv_cache"].half(), TypeError, r"kv_cache must have q's dtype torch.bfloat16 or be float8_e4m3fn; got .*float16"),
    ("kv_cache", lambda a: a["kv_cache"].to(torch.float8_e4m3fn), ValueError, "kv_scale is required with a float8_e4m3fn kv_cache"),
    ("kv_cache", lambda a: torch.zeros(4, 64, 576, dtype=torch.uint8), TypeError, r"view a per-tensor fp8 cache as torch.float8_e4m3fn.*uint8"),
    ("block_table", lambda a: a["block_table"].long(), ValueError, r"block_table must be int32 \[batch=2, max_blocks\].*int64"),
    ("block_table", lambda a: torch.zeros(3, 2, dtype=torch.int32), ValueError, r"block_table .*shape \(3, 2\)"),
    ("seq_lens", lambda a: a["seq_lens"].long(), ValueError, r"seq_lens must be contiguous int32 \[batch=2\]"),
    ("seq_lens", lambda a: torch.zeros(3, dtype=torch.int32), ValueError, r"seq_lens .*shape \(3,\)"),
    ("plan", lambda a: None, TypeError, "plan must be a DecodePlan from plan_decode; got NoneType"),
    ("softmax_scale", lambda a: -1.0, ValueError, "softmax_scale must be a positive finite float"),
    ("softmax_scale", lambda a: float("nan"), ValueError, "softmax_scale must be a positive finite float"),
]


@pytest.mark.parametrize("name,make,exc,msg", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_mla_decode_rejects(name, make, exc, msg):
    args = _args()
    args[name] = make(args)
    with pytest.raises(exc, match=msg):
        ops.mla_decode(**args)


def test_query_in_two_parts_reaches_the_device_check():
    """A valid (q_nope, q_pe) pair, strided as vLLM hands it, passes every shape check."""
    args = _args()
    q = args["q"]
    nope = q[..., :512].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # heads outermost
    args["q"] = (nope, q[..., 512:])
    with pytest.raises(ValueError, match="q_nope \\(q\\[0\\]\\) must be on a CUDA device"):
        ops.mla_decode(**args)


def test_plan_must_match_q():
    args = _args()
    args["plan"] = _args(heads=8)["plan"]
    with pytest.raises(ValueError, match="plan is for batch 2, s_q 1, H 8; q has batch 2, s_q 1, H 16"):
        ops.mla_decode(**args)


@pytest.mark.parametrize("strides", [(64 * 584, 584, 1), (64 * 576 + 8, 576, 1)],
                         ids=["token-stride-584", "block-stride-36872"])
def test_fp8_cache_strides_must_be_16_byte_multiples(strides):
    """A per-tensor fp8 cache whose token or block stride is 8 bytes off a 16-byte multiple:
    the kernels' 16-byte copies of its rows would fault, so it is refused by name."""
    args = _args()
    flat = torch.zeros(4 * strides[0], dtype=torch.float8_e4m3fn)
    args["kv_cache"] = flat.as_strided((4, 64, 576), strides)
    args["plan"] = ops.DecodePlan(**{**args["plan"].__dict__, "kv_fp8": True})
    with pytest.raises(ValueError, match="kv_cache must be 16-byte aligned"):
        ops.mla_decode(**args, kv_scale=1.0)


def test_kv_scale_without_fp8_cache():
    with pytest.raises(ValueError, match="kv_scale applies only to an fp8 kv_cache"):
        ops.mla_decode(**_args(), kv_scale=1.0)


def test_fp8_cache_checks():
    args = _args()
    args["kv_cache"] = args["kv_cache"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"kv_scale must be a positive finite float .*got -1.0"):
        ops.mla_decode(**args, kv_scale=-1.0)
    with pytest.raises(ValueError, match=r"kv_scale must be a 1-element float32 tensor.*shape \(2,\)"):
        ops.mla_decode(**args, kv_scale=torch.ones(2))
    with pytest.raises(ValueError, match="plan was made for a 16-bit cache but kv_cache is "
                                         "torch.float8_e4m3fn: pass kv_cache_dtype"):
        ops.mla_decode(**args, kv_scale=0.5)
    with pytest.raises(TypeError, match="kv_cache_dtype must be None, bfloat16, float16 or "
                                        "float8_e4m3fn; got torch.float32"):
        ops.plan_decode(torch.zeros(3, dtype=torch.int32), 1, 16, kv_cache_dtype=torch.float32)


def test_out_must_match():
    with pytest.raises(ValueError, match=r"out must be contiguous torch.bfloat16 \[2, 1, 16, 512\]"):
        ops.mla_decode(**_args(), out=torch.empty(2, 1, 16, 512))


def test_cpu_tensors_are_rejected_before_any_kernel():
    with pytest.raises(ValueError, match="q must be on a CUDA device; got shape"):
        ops.mla_decode(**_args())


def test_plan_decode_rejects():
    with pytest.raises(ValueError, match=r"seq_lens must be a contiguous 1-D int32 tensor \[batch\]; got .*int64"):
        ops.plan_decode(torch.zeros(3, dtype=torch.int64), 1, 16)
    with pytest.raises(ValueError, match=r"num_q_tokens_per_req must be an int in \[1, 8\]; got 0"):
        ops.plan_decode(torch.zeros(3, dtype=torch.int32), 0, 16)
    with pytest.raises(ValueError, match=r"num_heads must be an int in \[1, 128\]; got 200"):
        ops.plan_decode(torch.zeros(3, dtype=torch.int32), 1, 200)
    with pytest.raises(ValueError, match="seq_lens must be on a CUDA device"):
        ops.plan_decode(torch.zeros(3, dtype=torch.int32), 1, 16)
    with pytest.raises(ValueError, match="seq_lens must be a contiguous 1-D int32"):
        ops.plan_decode(torch.zeros(6, dtype=torch.int32)[::2], 1, 16)
    for bad in (0, 128.0):
        with pytest.raises(ValueError, match=f"_min_tokens_per_cta must be a positive int; "
                                             f"got {bad}"):
            ops.plan_decode(torch.zeros(3, dtype=torch.int32), 1, 16, _min_tokens_per_cta=bad)


def test_decode_workspace_rejects():
    with pytest.raises(ValueError, match="max_batch must be a positive int; got 0"):
        ops.decode_workspace(0, 1, 16, device="cuda")
    with pytest.raises(ValueError, match=r"num_q_tokens_per_req must be an int in \[1, 8\]; got 9"):
        ops.decode_workspace(4, 9, 16, device="cuda")
    with pytest.raises(ValueError, match=r"num_heads must be an int in \[1, 128\]; got 256"):
        ops.decode_workspace(4, 1, 256, device="cuda")
    with pytest.raises(ValueError, match="device must be a CUDA device; got cpu"):
        ops.decode_workspace(4, 1, 16, device="cpu")


def test_missing_extension_error_names_the_op_and_the_build(monkeypatch, tmp_path):
    monkeypatch.setitem(_extension._state, "loaded", False)
    monkeypatch.setitem(_extension._state, "error", None)
    monkeypatch.setenv("MLA_BACKEND_EXTENSION", str(tmp_path / "missing_C.abi3.so"))
    with pytest.raises(_extension.ExtensionNotBuiltError,
                       match=r"mla_backend.ops.mla_decode needs the CUDA extension .*"
                             r"pip install --no-build-isolation"):
        _extension.require("mla_decode")


# ----------------------------------------------------------------------------- sparse


def _sparse_args(batch=2, s_q=1, heads=16, topk=64, length=None):
    plan = ops.SparsePlan(batch=batch, q_tokens_per_req=s_q, num_heads=heads, topk=topk,
                          topk_length=length, rows_per_cta=64, unit_tokens=64, num_ctas=1,
                          metadata=torch.zeros(batch * s_q + 2, dtype=torch.int32),
                          partial_out=torch.zeros(2, heads, 512),
                          partial_lse=torch.zeros(2, heads))
    return dict(q=torch.randn(batch, s_q, heads, 576).bfloat16(),
                kv_cache=torch.randn(4, 64, 576).bfloat16(),
                indices=torch.zeros(batch, s_q, topk, dtype=torch.int32), plan=plan,
                softmax_scale=0.04)


SPARSE_CASES = [
    ("q", lambda a: a["q"].half(), TypeError, r"q must be bfloat16 for the sparse kernels; got .*float16"),
    ("q", lambda a: a["q"][..., :512], ValueError, r"q must be \[batch, s_q, heads, 576\]; got shape \(2, 1, 16, 512\)"),
    ("q", lambda a: torch.randn(2, 1, 129, 576).bfloat16(), ValueError, r"heads in \[1, 128\]"),
    ("q", lambda a: torch.randn(2 * 16 * 576 + 4).bfloat16()[4:].view(2, 1, 16, 576), ValueError, "q must be 16-byte aligned"),
    ("kv_cache", lambda a: a["kv_cache"].to(torch.float8_e4m3fn), TypeError, "not a per-tensor float8_e4m3fn cache"),
    ("kv_cache", lambda a: a["kv_cache"].half(), TypeError, r"kv_cache must be bfloat16 \[.., 576\] or uint8 fp8_ds_mla \[.., 656\]"),
    ("kv_cache", lambda a: torch.zeros(4, 64, 576, dtype=torch.uint8), ValueError, r"kv_cache must be \[num_blocks, 64, 656\] for dtype torch.uint8; got shape \(4, 64, 576\)"),
    ("kv_cache", lambda a: torch.zeros(256, 576).bfloat16(), ValueError, r"kv_cache must be \[num_blocks, 64, 576\] for"),
    ("kv_cache", lambda a: torch.zeros(4, 64, 580).bfloat16()[..., 4:], ValueError, "16-byte aligned"),
    ("kv_cache", lambda a: torch.empty(1 << 20, 64, 576, dtype=torch.bfloat16, device="meta"), ValueError,
     r"kv_cache must have its rows within 64 GiB of its first .*shape \(1048576, 64, 576\)"),
    ("indices", lambda a: a["indices"].long(), ValueError, r"indices must be int32 \[batch=2, s_q=1, topk <= 16384\]"),
    ("indices", lambda a: torch.zeros(2, 1, 16385, dtype=torch.int32), ValueError, r"topk <= 16384.*16385"),
    ("indices", lambda a: torch.zeros(2, 2, 64, dtype=torch.int32), ValueError, r"indices .*shape \(2, 2, 64\)"),
    ("plan", lambda a: None, TypeError, "plan must be a SparsePlan from plan_sparse_decode; got NoneType"),
    ("plan", lambda a: _sparse_args(topk=32)["plan"], ValueError, "plan is for batch 2, s_q 1, H 16, topk 32"),
    ("softmax_scale", lambda a: 0.0, ValueError, "softmax_scale must be a positive finite float"),
    # the query as the pair (q_nope, q_pe)
    ("q", lambda a: (a["q"][..., :512], a["q"][..., 512:], a["q"]), TypeError, r"a pair \(q_nope, q_pe\); got 3 items"),
    ("q", lambda a: (a["q"], a["q"][..., 512:]), ValueError, r"q_nope \(q\[0\]\) must have a last dim of 512; got shape \(2, 1, 16, 576\)"),
    ("q", lambda a: (a["q"][..., :512], a["q"][:1, ..., 512:]), ValueError, r"q_pe \(q\[1\]\) must be q_nope's shape \(2, 1, 16\) with a last dim of 64; got shape \(1, 1, 16, 64\)"),
    ("q", lambda a: (a["q"][..., :512], a["q"][..., 448:]), ValueError, r"q_pe \(q\[1\]\) must be q_nope's shape \(2, 1, 16\) with a last dim of 64; got shape \(2, 1, 16, 128\)"),
    ("q", lambda a: (a["q"][..., :512], a["q"][..., 512:].half()), TypeError, r"q_pe \(q\[1\]\) must have q_nope's dtype torch.bfloat16; got shape \(2, 1, 16, 64\) dtype torch.float16"),
    ("q", lambda a: (a["q"][..., :512].half(), a["q"][..., 512:].half()), TypeError, r"q_nope \(q\[0\]\) must be bfloat16 for the sparse kernels; got shape \(2, 1, 16, 512\) dtype torch.float16"),
    ("q", lambda a: (a["q"][0, ..., :512], a["q"][0, ..., 512:]), ValueError, r"q_nope \(q\[0\]\) must be \[batch, s_q, heads, 512\]; got shape \(1, 16, 512\)"),
    ("q", lambda a: (torch.zeros(2, 1, 129, 512).bfloat16(), torch.zeros(2, 1, 129, 64).bfloat16()), ValueError, r"q_nope \(q\[0\]\) must have s_q >= 1 and heads in \[1, 128\]; got shape \(2, 1, 129, 512\)"),
    ("q", lambda a: (a["q"][..., :512], "pe"), TypeError, r"q_pe \(q\[1\]\) must be a torch.Tensor; got str"),
    ("q", lambda a: (a["q"][..., :512], a["q"][..., 512:].to("meta")), ValueError, r"q_pe \(q\[1\]\) is on meta but q_nope is on cpu"),
]


@pytest.mark.parametrize("name,make,exc,msg", SPARSE_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(SPARSE_CASES)])
def test_sparse_mla_decode_rejects(name, make, exc, msg):
    args = _sparse_args()
    args[name] = make(args)
    with pytest.raises(exc, match=msg):
        ops.sparse_mla_decode(**args)


def _vllm_parts(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_nope, q_pe) of q [B, s_q, H, 576] as vLLM 0.25 hands them: q_nope a transposed view
    of a heads-outermost buffer, q_pe the last 64 columns of a [.., 192]-wide projection."""
    batch, s_q, heads, _ = q.shape
    nope = q[..., :512].reshape(-1, heads, 512).transpose(0, 1).contiguous().transpose(0, 1)
    proj = torch.zeros(batch * s_q, heads, 192, dtype=q.dtype)
    proj[..., 128:] = q[..., 512:].reshape(-1, heads, 64)
    return nope.view(batch, s_q, heads, 512), proj[..., 128:].view(batch, s_q, heads, 64)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view 2 bytes off 16-byte alignment."""
    spare = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = spare[1:].view(t.shape)
    view.copy_(t)
    return view


def test_sparse_query_in_two_parts_reaches_the_device_check():
    """A valid pair passes every shape check, strided as vLLM hands it and with a part off
    16-byte alignment alike (such a pair is joined by a copy, never an argument error); the
    device check then names the part."""
    args = _sparse_args()
    q = args["q"]
    nope, pe = _vllm_parts(q)
    assert not nope.is_contiguous() and not pe.is_contiguous()
    for pair in ((nope, pe), (nope, _misaligned(pe)), (_misaligned(nope), pe)):
        args["q"] = pair
        with pytest.raises(ValueError, match=r"q_nope \(q\[0\]\) must be on a CUDA device"):
            ops.sparse_mla_decode(**args)
    with pytest.raises(ValueError, match=r"q_nope \(q\[0\]\) must be on a CUDA device"):
        ops.sparse_mla_prefill((nope[:, 0], pe[:, 0]), args["kv_cache"], args["indices"][:, 0],
                               0.1)


def test_sparse_pair_plan_and_out_are_checked_against_the_latent_part():
    args = _sparse_args()
    args["q"] = _vllm_parts(args["q"])
    plan = _sparse_args(heads=8)["plan"]
    with pytest.raises(ValueError, match="plan is for batch 2, s_q 1, H 8, topk 64; q / indices "
                                         "have batch 2, s_q 1, H 16, topk 64"):
        ops.sparse_mla_decode(**{**args, "plan": plan})
    with pytest.raises(ValueError, match=r"out must be contiguous torch.bfloat16 \[2, 1, 16, 512\]"):
        ops.sparse_mla_decode(**args, out=torch.empty(2, 1, 16, 576, dtype=torch.bfloat16))


def test_sparse_kernel_query_reads_parts_in_place_and_joins_the_rest():
    """What the kernel is handed: one whole q as is; a pair whose rows the TMA can read where
    they lie as the same two tensors (no copy); a pair with a part off 16-byte alignment, or
    with a row stride that is not a 16-byte multiple, as one new joined [.., 576] tensor."""
    q = _sparse_args()["q"]
    whole, no_pe = sparse._kernel_query(q)
    assert whole is q and no_pe is None
    nope, pe = _vllm_parts(q)
    got_nope, got_pe = sparse._kernel_query((nope, pe))
    assert got_nope is nope and got_pe is pe
    odd_stride = torch.zeros(2, 1, 16, 68, dtype=q.dtype)[..., :64]  # 136-byte head stride
    odd_stride.copy_(pe)
    for pair in ((nope, _misaligned(pe)), (_misaligned(nope), pe), (nope, odd_stride)):
        joined, none = sparse._kernel_query(pair)
        assert none is None and joined.shape == (2, 1, 16, 576) and joined.is_contiguous()
        assert torch.equal(joined, q)


def test_sparse_topk_length_must_be_the_plans():
    length = torch.full((2,), 5, dtype=torch.int32)
    args = _sparse_args(length=length)
    with pytest.raises(ValueError, match="topk_length must be the tensor the plan was made with"):
        ops.sparse_mla_decode(**args, topk_length=length.clone())
    with pytest.raises(ValueError, match="must be on a CUDA device"):  # plan's own is used
        ops.sparse_mla_decode(**args)


def test_sparse_prefill_rejects():
    q, kv = torch.randn(3, 16, 576).bfloat16(), torch.randn(100, 576).bfloat16()
    idx = torch.zeros(3, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q must be \[tokens, heads, 576\]"):
        ops.sparse_mla_prefill(q[0], kv, idx, 0.1)
    with pytest.raises(ValueError, match=r"indices must be int32 \[tokens=3, topk\]"):
        ops.sparse_mla_prefill(q, kv, idx[:2], 0.1)
    with pytest.raises(ValueError, match=r"kv must be \[num_blocks, 64, 576\] or \[S, 576\]"):
        ops.sparse_mla_prefill(q, kv.view(100, 2, 288), idx, 0.1)
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        ops.sparse_mla_prefill(q, kv, idx, 0.1)


def test_plan_sparse_decode_rejects():
    with pytest.raises(ValueError, match=r"topk must be an int in \[1, 16384\]; got 0"):
        ops.plan_sparse_decode(2, 1, 16, 0, device="cpu")
    with pytest.raises(ValueError, match=r"num_heads must be an int in \[1, 128\]"):
        ops.plan_sparse_decode(2, 1, 200, 64, device="cpu")
    with pytest.raises(ValueError, match=r"topk_length must be contiguous int32 \[batch=2\]"):
        ops.plan_sparse_decode(2, 1, 16, 64, topk_length=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        ops.plan_sparse_decode(2, 1, 16, 64, topk_length=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="pass device"):
        ops.plan_sparse_decode(2, 1, 16, 64)
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        ops.plan_sparse_decode(2, 1, 16, 64, device="cpu")
    with pytest.raises(ValueError, match="70000 query tokens; one sparse call takes at most 65535"):
        ops.plan_sparse_decode(35000, 2, 16, 64, device="cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype must be torch.bfloat16 or torch.uint8"):
        ops.plan_sparse_decode(2, 1, 16, 64, device="cpu", kv_cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="min_units_per_cta must be a positive int; got 0"):
        ops.plan_sparse_decode(2, 1, 16, 64, device="cpu", _min_units_per_cta=0)
    with pytest.raises(ValueError, match="max_groups must be a positive int"):
        ops.sparse_workspace(0, 16, device="cpu")


@pytest.mark.parametrize("groups,units_per_req,ctas,heads,fp8,want", [
    (256, 32, 132, 64, False, 64),   # 63 -> 64 units: whole requests, no merge
    (256, 32, 66, 128, True, 128),   # 125 -> 128
    (64, 8, 132, 16, False, 8),      # 4 -> 8 on a bf16 cache
    (64, 8, 132, 16, True, 2),       # ... but not on fp8_ds_mla below 64 heads
    (64, 8, 132, 64, True, 8),
    (32, 8, 132, 64, True, 2),       # 2 -> 8 adds 6 units: stays split on fp8_ds_mla
    (32, 8, 132, 64, False, 8),      # ... but on bf16 128 CTAs' partials (16.8 MB) cost more
    (32, 8, 132, 32, False, 2),      # half the partials at 32 heads: stays split
    (1, 8, 132, 64, False, 2),       # batch 1: 4 CTAs' partials are cheap, stays split
    (64, 32, 132, 64, False, 2),     # 16 -> 32 adds 16 units: stays split
    (32, 32, 132, 16, False, 2),     # 8 -> 32
    (1, 32, 132, 64, False, 2),      # one request over many CTAs
    (128, 8, 132, 64, False, 8),     # the balanced share is whole requests already
])
def test_whole_requests_floor(groups, units_per_req, ctas, heads, fp8, want):
    assert ops._whole_requests_floor(groups, units_per_req, ctas, 2, heads, fp8) == want


@pytest.mark.parametrize("heads,sms,want", [
    (1, 132, (64, 64, 132)), (64, 132, (64, 64, 132)),  # one 64-row tile: a CTA per SM
    (65, 132, (64, 64, 66)), (128, 132, (64, 64, 66)),  # two tiles share the SMs
    (16, 114, (64, 64, 114)), (128, 114, (64, 64, 57)),  # an H100 PCIe's 114 SMs
])
def test_sparse_grid_worked_by_hand(heads, sms, want):
    assert ops._sparse_grid(heads, sms) == want


@pytest.mark.parametrize("rows,sms,mma,want", [
    (1, 132, True, (16, 32, 264)), (16, 132, True, (16, 32, 264)),  # mma.sync: 16-row tiles, 2 / SM
    (1, 132, False, (64, 64, 132)), (16, 132, False, (64, 64, 132)),  # wgmma: one padded tile
    (17, 132, False, (64, 64, 132)), (64, 132, False, (64, 64, 132)),  # 64-token units
    (65, 132, False, (64, 64, 66)), (128, 132, False, (64, 64, 66)),
    (129, 132, False, (64, 64, 44)), (512, 132, False, (64, 64, 16)),  # s_q 4 x H 128: 8 tiles
    (1024, 132, False, (64, 64, 8)),                                   # s_q 8 x H 128: 16 tiles
    (16, 114, True, (16, 32, 228)), (1024, 114, False, (64, 64, 7)),
])
def test_dense_grid_worked_by_hand(rows, sms, mma, want):
    # the tiles depend on rows = s_q * H and the kernel alone (a per-tensor fp8 cache runs on
    # the same kernels)
    assert ops._grid(rows, sms, mma) == want


@pytest.mark.parametrize("rows,batch,kv_fp8,want", [
    (16, 1, False, False), (16, 128, False, False),  # 16-bit: the wgmma kernel at every batch
    (1, 4096, False, False),
    (8, 1, True, False), (8, 15, True, False),       # fp8: wgmma below 16 requests,
    (8, 16, True, True), (1, 500, True, True),       # mma.sync from 16 on up to 8 rows,
    (9, 500, True, False), (16, 16, True, False),    # wgmma above 8 rows
    (17, 32, True, False), (128, 128, True, False),  # more than 16 rows: always wgmma
])
def test_dense_kernel_rule_worked_by_hand(rows, batch, kv_fp8, want):
    assert ops._uses_mma(rows, batch, kv_fp8) is want


@pytest.mark.parametrize("max_rows,min_batch,rows,batch,want", [
    (0, 1, 1, 64, False), (0, 1, 16, 64, False),  # --mma-max-rows 0: every row count on wgmma
    (8, 1, 8, 1, True), (8, 1, 9, 1, False),      # --mma-min-batch 1: mma.sync at every batch
    (16, 1, 16, 1, True), (16, 1, 17, 1, False),
    (16, 4, 16, 3, False), (16, 4, 16, 4, True),
])
def test_dense_kernel_rule_follows_cost_model(monkeypatch, max_rows, min_batch, rows, batch,
                                              want):
    # cost_model's MMA_MAX_ROWS(_FP8) / MMA_MIN_BATCH_* (bench/dense_decode.py --mma-max-rows,
    # --mma-min-batch) are read at each call, for either cache dtype
    from mla_backend.ops import cost_model

    monkeypatch.setattr(cost_model, "MMA_MAX_ROWS", max_rows)
    monkeypatch.setattr(cost_model, "MMA_MAX_ROWS_FP8", max_rows)
    monkeypatch.setattr(cost_model, "MMA_MIN_BATCH_16BIT", min_batch)
    monkeypatch.setattr(cost_model, "MMA_MIN_BATCH_FP8", min_batch)
    for kv_fp8 in (False, True):
        assert ops._uses_mma(rows, batch, kv_fp8) is want


@pytest.mark.parametrize("min_batch,batch,kv_fp8,want", [
    (8, 7, True, False), (8, 8, True, True), (8, 300, True, True),  # fp16 tiles from 8 requests
    (8, 64, False, False),                                        # 16-bit cache: none to convert
    (None, 300, True, False), (1, 1, True, True),                 # never / always
])
def test_fp8_fp16_operands_rule_follows_cost_model(monkeypatch, min_batch, batch, kv_fp8, want):
    # the wgmma kernel's fp8 tiles in fp16 (a bf16 Q converted per piece) from
    # FP8_FP16_OPERANDS_MIN_BATCH requests, read at each mla_decode call
    from mla_backend.ops import cost_model

    monkeypatch.setattr(cost_model, "FP8_FP16_OPERANDS_MIN_BATCH", min_batch)
    plan = _args(batch=batch, heads=128)["plan"]
    plan = ops.DecodePlan(**{**plan.__dict__, "kv_fp8": kv_fp8})
    assert ops.dense._fp16_operands(plan) is want


@pytest.mark.parametrize("sms", [132, 114])
def test_grids_fill_one_wave(sms):
    # for every row count: all CTAs of all row tiles are resident at once (one wave: the
    # planner gives every CTA the same units), and one CTA more per tile would not be
    grids = [(heads, ops._sparse_grid(heads, sms), 1) for heads in range(1, 129)]
    grids += [(rows, ops._grid(rows, sms, mma), 2 if mma else 1)
              for rows in range(1, 1025) for mma in ((False, True) if rows <= 16 else (False,))]
    for rows, (rows_per_cta, _, ctas), ctas_per_sm in grids:
        tiles = -(-rows // rows_per_cta)
        assert tiles * ctas <= sms * ctas_per_sm < tiles * (ctas + 1), (rows, ctas)


# ----------------------------------------------------------------------------- caller-owned lse

LSE_CASES = [
    (lambda: torch.empty(2, 1, 8), ValueError,
     r"lse must be contiguous torch.float32 \[2, 1, 16\]; got shape \(2, 1, 8\) dtype torch.float32"),
    (lambda: torch.empty(2, 1, 16, dtype=torch.bfloat16), ValueError,
     r"lse must be contiguous torch.float32 \[2, 1, 16\]; got shape \(2, 1, 16\) dtype torch.bfloat16"),
    (lambda: torch.empty(16, 2).t().unsqueeze(1), ValueError,
     r"lse must be contiguous torch.float32 \[2, 1, 16\]; got shape \(2, 1, 16\)"),
    (lambda: [0.0], TypeError, "lse must be a torch.Tensor; got list"),
]


@pytest.mark.parametrize("make,exc,msg", LSE_CASES, ids=range(len(LSE_CASES)))
def test_mla_decode_rejects_lse(make, exc, msg):
    with pytest.raises(exc, match=msg):
        ops.mla_decode(**_args(), lse=make())


@pytest.mark.parametrize("make,exc,msg", LSE_CASES, ids=range(len(LSE_CASES)))
def test_sparse_mla_decode_rejects_lse(make, exc, msg):
    with pytest.raises(exc, match=msg):
        ops.sparse_mla_decode(**_sparse_args(), lse=make())


def test_a_valid_lse_passes_to_the_device_check():
    # a well-formed lse is accepted; the call then stops at the CPU tensors, as without lse
    lse = torch.empty(2, 1, 16)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        ops.mla_decode(**_args(), lse=lse)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        ops.sparse_mla_decode(**_sparse_args(), lse=lse)


def test_sparse_prefill_rejects_lse():
    q, kv = torch.randn(3, 16, 576).bfloat16(), torch.randn(100, 576).bfloat16()
    idx = torch.zeros(3, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"lse must be contiguous torch.float32 \[3, 16\]; got "
                                         r"shape \(3, 1, 16\)"):
        ops.sparse_mla_prefill(q, kv, idx, 0.1, lse=torch.empty(3, 1, 16))
    with pytest.raises(ValueError, match=r"lse must be contiguous torch.float32 \[3, 16\]; got "
                                         r"shape \(3, 16\) dtype torch.float16"):
        ops.sparse_mla_prefill(q, kv, idx, 0.1, lse=torch.empty(3, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"lse must be contiguous torch.float32 \[3, 16\]"):
        ops.sparse_mla_prefill(q, kv, idx, 0.1, lse=torch.empty(16, 3).t())
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        ops.sparse_mla_prefill(q, kv, idx, 0.1, lse=torch.empty(3, 16))
