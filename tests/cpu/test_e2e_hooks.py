"""The e2e tier's test-only hooks (tests/e2e/hooks.py) and how an engine's process loads
them (mla_backend.demo.engine_run, spec key "preload"): each option patches what it says and
nothing else, the perturbations change the kernel's inputs as documented, and the peer's
cache rounding matches the fp8_ds_mla format."""

import os

import pytest
import torch

from mla_backend import formats, ops
from mla_backend.demo import engine_run
from mla_backend.ops import dense, sparse
from mla_backend.vllm import version


class _Plan:
    q_tokens_per_req, num_heads, kv_fp8 = 1, 16, False


def _record(monkeypatch, module, name):
    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        return "result"

    monkeypatch.setattr(module, name, fake)
    return calls


def test_options_are_checked(hooks):
    with pytest.raises(ValueError, match="unknown hook options"):
        hooks.install({"perturbation": "x"})
    with pytest.raises(ValueError, match="perturb must be one of"):
        hooks.install({"perturb": "scale"})
    with pytest.raises(ValueError, match="round_cache_to"):
        hooks.install({"round_cache_to": "fp8"})
    for bad in ([1.5], [1.5, 0], ["1.5", 2.5]):
        with pytest.raises(ValueError, match="kv_scales must be"):
            hooks.install({"kv_scales": bad})


def test_no_option_patches_nothing(hooks):
    before = (ops.mla_decode, ops.sparse_mla_decode)
    hooks.install({})
    assert (ops.mla_decode, ops.sparse_mla_decode) == before


def test_count_records_s_q_and_kv_scale_and_passes_arguments_through(hooks, monkeypatch):
    calls = _record(monkeypatch, dense, "mla_decode")
    hooks.install({"count": True})
    q = torch.zeros(3, 4, 16, 576)
    scale = torch.tensor(1.5)
    lens = torch.tensor([5, 70, 130], dtype=torch.int32)
    assert ops.mla_decode(q, "cache", "table", lens, "plan", 0.1, causal=True,
                          kv_scale=scale) == "result"
    ops.mla_decode(q[:, :1], "cache", "table", lens, "plan", 0.1, kv_scale=scale)
    args, kwargs = calls[0]
    assert args[3] is lens and args[4] == "plan" and kwargs["kv_scale"] is scale
    rep = hooks.report()
    assert rep["mla_decode_calls_by_s_q"] == {"1": 1, "4": 1}
    assert rep["mla_decode_kv_scales"] == [1.5]
    assert rep["perturbed_calls"] == 0


def test_partial_page_dropped(hooks, monkeypatch):
    """seq_len rounded down to whole pages, with a plan made for those lengths."""
    calls = _record(monkeypatch, dense, "mla_decode")
    plans = []
    monkeypatch.setattr(dense, "plan_decode",
                        lambda lens, s_q, heads, kv_cache_dtype=None: plans.append(
                            (lens.tolist(), s_q, heads, kv_cache_dtype)) or "new plan")
    hooks.install({"perturb": "partial_page_dropped"})
    lens = torch.tensor([1, 63, 64, 65, 130], dtype=torch.int32)
    ops.mla_decode(torch.zeros(5, 1, 16, 576), "cache", "table", lens, _Plan(), 0.1)
    assert plans == [([0, 0, 64, 64, 128], 1, 16, None)]
    args, _ = calls[0]
    assert args[3].tolist() == [0, 0, 64, 64, 128] and args[4] == "new plan"
    assert lens.tolist() == [1, 63, 64, 65, 130]
    assert hooks.report()["perturbed_calls"] == 1


def test_rope_dropped(hooks, monkeypatch):
    calls = _record(monkeypatch, sparse, "sparse_mla_decode")
    hooks.install({"perturb": "rope_dropped"})
    q = torch.randn(4, 1, 16, 576)
    ops.sparse_mla_decode(q, "cache", "indices", "plan", 0.1)
    got = calls[0][0][0]
    assert torch.equal(got[..., :512], q[..., :512])
    assert not got[..., 512:].any() and q[..., 512:].any()
    assert hooks.report()["perturbed_calls"] == 1


def test_round_cache_to_fp8_ds_mla(hooks, monkeypatch):
    """The peer's bf16 cache gets kv_c as an fp8_ds_mla cache of the installed vLLM holds it;
    k_pe unchanged. The write hooked is the one that release makes for DeepSeek-V3.2."""
    if version.at_least((0, 33, 0)):
        _check_fused_writer_rounded(hooks, monkeypatch)
    else:
        _check_impl_writer_rounded(hooks, monkeypatch)


def _check_impl_writer_rounded(hooks, monkeypatch):
    """vLLM 0.25: the sparse impl's do_kv_cache_update gets the rounded kv_c."""
    from vllm.v1.attention.backend import SparseMLAAttentionImpl

    writes = []
    monkeypatch.setattr(SparseMLAAttentionImpl, "do_kv_cache_update",
                        lambda self, kv_c, k_pe, *rest: writes.append((kv_c, k_pe, rest)))
    hooks.install({"round_cache_to": "fp8_ds_mla"})
    kv_c = torch.randn(6, 512).to(torch.bfloat16) * 3
    k_pe = torch.randn(6, 1, 64).to(torch.bfloat16)
    SparseMLAAttentionImpl.do_kv_cache_update(None, kv_c, k_pe, "cache", "slots", "auto", 1.0)
    got, pe, rest = writes[0]
    expect = formats.dequantize_fp8_ds_mla(formats.quantize_fp8_ds_mla(kv_c, k_pe[:, 0]))
    assert torch.equal(got, expect[:, :512].to(torch.bfloat16))
    assert pe is k_pe and rest == ("cache", "slots", "auto", 1.0)
    assert not torch.equal(got, kv_c)  # e4m3 keeps 3 mantissa bits: the values moved
    assert (got.float() - kv_c.float()).abs().max() <= kv_c.float().abs().max() / 16
    with pytest.raises(RuntimeError, match="bf16 cache"):
        SparseMLAAttentionImpl.do_kv_cache_update(None, kv_c, k_pe, "c", "s", "fp8_ds_mla", 1.0)
    assert hooks.report()["rounded_cache_writes"] == 1


def _check_fused_writer_rounded(hooks, monkeypatch):
    """vLLM 0.33: DeepSeek-V3.2's attention layer calls the fused norm/RoPE kernel (by its
    module's name, with the keywords the hook reads) to write the cache; the hook runs that
    kernel without its cache write and writes kv_c rounded through fp8_ds_mla (power-of-two
    tile scales, from the kernel's float32 kv_c, as 0.33's writer) and k_pe unchanged to the
    same slots; the caller's kv_c_out gets the kernel's kv_c in bf16 as before."""
    import inspect

    from vllm import _custom_ops
    from vllm.models.deepseek_v32 import attention

    assert "fused_norm_rope" in attention.DeepseekV32Attention.forward.__code__.co_names
    used = {"mla_kv_cache", "mla_kv_cache_dtype", "mla_k_scale", "kv_c_out", "k_pe_out",
            "slot_mapping"}
    assert used <= set(inspect.signature(attention.fused_norm_rope).parameters)
    # tiles of very different magnitudes, the last one under the 1e-4 scale floor
    kv_c = torch.randn(6, 512) * torch.tensor([3.0, 0.01, 50.0, 1e-6]).repeat_interleave(128)
    k_pe = torch.randn(6, 64).to(torch.bfloat16)
    kernel_calls, writes = [], []

    def kernel(positions, q_c, *rest, mla_kv_cache=None, kv_c_out=None, k_pe_out=None,
               **kwargs):
        kernel_calls.append((mla_kv_cache, kv_c_out.dtype))
        kv_c_out.copy_(kv_c)  # the kernel stores its float32 kv_c in kv_c_out's dtype
        k_pe_out.copy_(k_pe)
        return q_c + 1

    monkeypatch.setattr(attention, "fused_norm_rope", kernel)
    monkeypatch.setattr(_custom_ops, "concat_and_cache_mla",
                        lambda *args: writes.append(args))
    hooks.install({"round_cache_to": "fp8_ds_mla"})
    q_c, slots, scale = torch.zeros(6, 8), torch.arange(6), torch.tensor([1.0])
    kv_out = torch.empty(6, 512, dtype=torch.bfloat16)
    pe_out = torch.empty_like(k_pe)
    got_q = attention.fused_norm_rope("pos", q_c, slot_mapping=slots, mla_kv_cache="cache",
                                      mla_kv_cache_dtype="auto", mla_k_scale=scale,
                                      kv_c_out=kv_out, k_pe_out=pe_out)
    assert torch.equal(got_q, q_c + 1) and kernel_calls == [(None, torch.float32)]
    assert torch.equal(kv_out, kv_c.to(torch.bfloat16))
    (got, pe, cache, slot_arg, dtype, scale_arg), = writes
    assert pe is pe_out and torch.equal(pe, k_pe)
    assert (cache, slot_arg, dtype, scale_arg) == ("cache", slots, "auto", scale)

    def rounded(x):
        tiles = x.float().reshape(6, 4, 128)
        tile_scale = torch.exp2(torch.ceil(torch.log2(
            (tiles.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-4))))
        return ((tiles / tile_scale).to(torch.float8_e4m3fn).float() * tile_scale).reshape(6, 512)

    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), rounded(kv_c))
    # rounding the bf16 kv_c instead moves some values by one e4m3 step (double rounding)
    assert not torch.equal(rounded(kv_c.to(torch.bfloat16)), rounded(kv_c))
    # e4m3 keeps 3 mantissa bits: within 1/16 of the tile's amax (plus, in a tiny tile whose
    # scale is floored at 1e-4, half a subnormal step)
    err = (got.float() - kv_c).abs().reshape(6, 4, 128).amax(-1)
    assert (err <= kv_c.abs().reshape(6, 4, 128).amax(-1) / 16 + 1e-4 * 2 ** -9).all()
    assert err.amax() > 0
    assert hooks.report()["rounded_cache_writes"] == 1
    # no cache to write (profiling, PCP): the kernel as called, nothing rounded
    attention.fused_norm_rope("pos", q_c, kv_c_out=kv_out, k_pe_out=pe_out)
    assert kernel_calls[1] == (None, torch.bfloat16) and len(writes) == 1
    with pytest.raises(RuntimeError, match="bf16 cache"):
        attention.fused_norm_rope("pos", q_c, slot_mapping=slots, mla_kv_cache="cache",
                                  mla_kv_cache_dtype="fp8_ds_mla", kv_c_out=kv_out,
                                  k_pe_out=pe_out)


def test_engine_run_preloads_in_process(tmp_path, monkeypatch):
    """engine_run imports each preload module and calls install(options) before the engine
    exists, with vLLM's engine core in this process; tensor parallelism is refused."""
    (tmp_path / "preload_probe.py").write_text(
        "installed = []\n"
        "def install(options):\n    installed.append(options)\n"
        "def report():\n    return {'installed': installed}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # put back after the test
    loaded = engine_run._preload({"preload": {"preload_probe": {"count": True}}})
    assert loaded["preload_probe"].report() == {"installed": [{"count": True}]}
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    with pytest.raises(ValueError, match="one GPU"):
        engine_run._preload({"preload": {"preload_probe": {}}, "tensor_parallel_size": 2})


def test_engine_run_without_preload_changes_nothing(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert engine_run._preload({}) == {}
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_kv_scales_set_after_loading(hooks, monkeypatch):
    """Every MLA layer gets the given k/v scales after vLLM's own post-load step (which would
    leave 1.0 where no scale was loaded): tensors for the cache writer and the kernels, floats
    for the backends that read those."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    loaded = []
    monkeypatch.setattr(MLAAttention, "process_weights_after_loading",
                        lambda self, act_dtype: loaded.append(act_dtype))
    hooks.install({"kv_scales": [1.5, 2.5]})

    class Layer:
        _k_scale, _v_scale = torch.ones(()), torch.ones(())
        _k_scale_float = _v_scale_float = 1.0

    layer = Layer()
    MLAAttention.process_weights_after_loading(layer, torch.bfloat16)
    assert loaded == [torch.bfloat16]
    assert float(layer._k_scale) == 1.5 and float(layer._v_scale) == 2.5
    assert (layer._k_scale_float, layer._v_scale_float) == (1.5, 2.5)
    assert hooks.report()["scaled_layers"] == 1


@pytest.mark.parametrize("flat", [False, True])
def test_engine_run_reads_vllms_logprobs(flat):
    """engine_run turns the installed vLLM's outputs (its own CompletionOutput with the
    logprobs its engine builds: a dict per position, or FlatLogprobs when asked) into token ids
    and per position [token, logprob] pairs, best first, the sampled token included."""
    pytest.importorskip("vllm")
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs
    from vllm.outputs import CompletionOutput, RequestOutput

    # per position: the sampled token, its rank, then the top-2 (token, logprob)
    steps = [(5, 1, [(5, -0.1), (9, -2.5)]), (7, 3, [(8, -0.2), (2, -0.9)])]
    logprobs = create_sample_logprobs(flat)
    for sampled, rank, top in steps:
        sampled_lp = dict(top).get(sampled, -3.0)
        append_logprobs_for_next_position(logprobs, [sampled] + [t for t, _ in top],
                                          [sampled_lp] + [lp for _, lp in top],
                                          [None] * 3, rank, 2)
    out = RequestOutput("r0", None, [11, 12, 13], None, [CompletionOutput(
        0, "", [5, 7], None, logprobs)], True)
    seen = []

    class LLM:
        def generate(self, prompts, params, use_tqdm):
            seen.append((prompts, params.logprobs, params.temperature))
            return [out]

    got = engine_run._generate(LLM(), {"prompts": [[11, 12, 13]], "max_tokens": 2,
                                       "logprobs": 2})
    assert seen == [([{"prompt_token_ids": [11, 12, 13]}], 2, 0.0)]
    assert got == [{"prompt_len": 3, "token_ids": [5, 7], "logprobs": [
        [[5, pytest.approx(-0.1)], [9, pytest.approx(-2.5)]],
        [[8, pytest.approx(-0.2)], [2, pytest.approx(-0.9)], [7, pytest.approx(-3.0)]]]}]
