"""fp8_ds_mla bytes from formats.quantize_fp8_ds_mla against vLLM 0.25's own cache writer
(torch.ops._C_cache_ops.concat_and_cache_mla, kv_cache_dtype="fp8_ds_mla"). Needs the GPU and
vLLM's compiled ops (kit parts 0 and 1 on the GPU machine)."""

import pytest
import torch

from mla_backend import formats as fmt

pytestmark = pytest.mark.gpu


def _vllm_writer():
    try:
        import vllm._C_stable_libtorch  # noqa: F401  registers torch.ops._C_cache_ops
    except ImportError as e:
        pytest.skip(f"vLLM's compiled ops are not installed here ({e})")
    return torch.ops._C_cache_ops.concat_and_cache_mla


@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_fp8_ds_mla_bytes_equal_vllm_writer(tokens):
    write = _vllm_writer()
    g = torch.Generator().manual_seed(tokens)
    mag = torch.logspace(-4, 3, tokens).unsqueeze(1)
    kv_c = (torch.randn(tokens, 512, generator=g) * mag).to(torch.bfloat16).cuda()
    kv_c[0, 128:256] = 0  # an all-zero tile
    k_pe = torch.randn(tokens, 64, generator=g).to(torch.bfloat16).cuda()
    num_blocks = -(-tokens // 64) + 2
    cache = torch.zeros(num_blocks, 64, 656, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(num_blocks * 64, generator=g)[:tokens].cuda()
    scale = torch.tensor(1.0, device="cuda")
    write(kv_c, k_pe, cache, slots, "fp8_ds_mla", scale)
    theirs = cache.view(-1, 656)[slots]
    ours = fmt.quantize_fp8_ds_mla(kv_c, k_pe)
    mismatch = (theirs != ours).any(-1)
    assert not mismatch.any(), f"{int(mismatch.sum())} of {tokens} tokens differ"
