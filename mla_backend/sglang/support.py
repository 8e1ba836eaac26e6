"""What the SGLang backend accepts, as sentences SGLang shows the user.

Each check returns None or one sentence that says what was asked, what we run and what to
change; the backend's factory raises ValueError with it, which SGLang reports as the scheduler's
start-up error. Nothing here needs a GPU: the cpu tier checks every message.
"""

from __future__ import annotations

import torch

NAME = "mla_backend"
PAGE_SIZE = 64  # ops.PAGE_SIZE, repeated here so register() does not import the ops
LATENT_DIM = 512  # kv_lora_rank the kernels are built for
ROPE_DIM = 64  # qk_rope_head_dim
MAX_HEADS = 128  # ops.MAX_HEADS
MAX_Q_TOKENS = 8  # ops.MAX_Q_TOKENS_PER_REQ
MODEL_DTYPES = (torch.bfloat16, torch.float16)
FP8_CACHE = torch.float8_e4m3fn
SPARSE_FP8_BYTES = 656  # formats.FP8_DS_MLA_BYTES: SGLang's fp8 DSA token (flashmla_kv layout)


def page_size_reason(page_size: int | None) -> str | None:
    if page_size != PAGE_SIZE:
        return (f"--page-size {page_size}: {NAME} pages hold {PAGE_SIZE} tokens; pass "
                f"--page-size {PAGE_SIZE} (or leave it unset: {NAME} sets it)")
    return None


def model_reason(*, is_mla: bool, kv_lora_rank: int | None,
                 qk_rope_head_dim: int | None) -> str | None:
    """The model: MLA (dense or DSA) with the 512 + 64 latent cache."""
    if not is_mla:
        return (f"{NAME} implements MLA attention only (DeepSeek-V2/V3/R1/V3.2 and models "
                f"built on them); this model's attention is not MLA: choose another "
                f"--attention-backend")
    if (kv_lora_rank, qk_rope_head_dim) != (LATENT_DIM, ROPE_DIM):
        return (f"{NAME} runs MLA with kv_lora_rank {LATENT_DIM} and qk_rope_head_dim "
                f"{ROPE_DIM}; this model has {kv_lora_rank} and {qk_rope_head_dim}")
    return None


def dtype_reason(model_dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> str | None:
    """Model dtype bf16/fp16; cache in the model dtype, or per-tensor fp8 e4m3."""
    if model_dtype not in MODEL_DTYPES:
        return (f"model dtype {model_dtype}: {NAME} runs bfloat16 or float16; pass "
                f"--dtype bfloat16")
    if kv_cache_dtype == FP8_CACHE or kv_cache_dtype == model_dtype:
        return None
    if kv_cache_dtype == torch.float8_e5m2:
        return (f"--kv-cache-dtype fp8_e5m2: {NAME} reads a float8_e4m3fn cache (per-tensor "
                f"scale); pass --kv-cache-dtype fp8_e4m3 or auto")
    return (f"kv cache dtype {kv_cache_dtype} with model dtype {model_dtype}: {NAME} keeps the "
            f"cache in the model dtype or in fp8 e4m3; pass --kv-cache-dtype auto or fp8_e4m3")


def sparse_dtype_reason(model_dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> str | None:
    """DSA: the sparse kernels take a bfloat16 query over a bfloat16 cache or SGLang's
    656-byte fp8 cache (--kv-cache-dtype fp8_e4m3)."""
    if model_dtype != torch.bfloat16:
        return (f"model dtype {model_dtype}: {NAME}'s sparse (DSA) kernels run bfloat16; pass "
                f"--dtype bfloat16")
    if kv_cache_dtype in (torch.bfloat16, FP8_CACHE):
        return None
    return (f"kv cache dtype {kv_cache_dtype}: {NAME}'s sparse (DSA) kernels read a bfloat16 "
            f"cache or the 656-byte fp8 cache; pass --kv-cache-dtype bfloat16 or fp8_e4m3")


def sparse_cache_reason(kv_cache_dtype: torch.dtype, cache_bytes_per_token: int | None,
                        store_fp8: bool) -> str | None:
    """DSA: the pool SGLang built must hold what the sparse kernels read: 576 bf16 values, or
    the 656-byte fp8 token (SGLang writes a 576-byte fp8 token without tile scales when a DSA
    kernel option asks for it, e.g. --dsa-decode-backend trtllm)."""
    if kv_cache_dtype != FP8_CACHE:
        return None
    if store_fp8 and cache_bytes_per_token == SPARSE_FP8_BYTES:
        return None
    return (f"the fp8 DSA cache SGLang built holds {cache_bytes_per_token} bytes per token; "
            f"{NAME} reads the {SPARSE_FP8_BYTES}-byte layout (512 fp8 values, 4 float32 tile "
            f"scales, 64 bf16 rope): leave --dsa-prefill-backend / --dsa-decode-backend unset "
            f"(not trtllm), or pass --kv-cache-dtype bfloat16")


def sparse_parallel_reason(cp_size: int, hisparse: bool) -> str | None:
    """DSA: prefill context parallelism splits the tokens and their top-k across ranks, and
    HiSparse swaps pages through its own buffer; neither is mapped by our adapter."""
    if cp_size > 1:
        return (f"attention context parallelism (size {cp_size}) is not supported by {NAME} "
                f"for DSA models; leave --attention-backend unset (SGLang's dsa backend) for it")
    if hisparse:
        return (f"--enable-hisparse is not supported by {NAME}; leave --attention-backend "
                f"unset (SGLang's dsa backend) for it")
    return None


def sparse_split_reason(prefill: str | None, decode: str | None) -> str | None:
    """DSA: our backend serves every token of a DSA model (prefill included, over the
    indexer's top-k); a split with another backend for one phase (SGLang's hybrid backend) is
    not what was tested, so it is refused rather than run."""
    if prefill is None or decode is None or prefill == decode:
        return None
    return (f"--prefill-attention-backend {prefill} with --decode-attention-backend {decode}: "
            f"on a DSA model {NAME} runs prefill and decode both; pass --attention-backend "
            f"{NAME} alone, or leave it unset (SGLang's dsa backend) for the split")


def parallel_reason(heads_per_gpu: int, dcp_size: int) -> str | None:
    if heads_per_gpu > MAX_HEADS:
        return (f"{heads_per_gpu} query heads per GPU (heads / attention tensor-parallel "
                f"size): {NAME} decodes at most {MAX_HEADS}; raise --tp-size")
    if dcp_size > 1:
        return (f"decode context parallelism (size {dcp_size}) is not supported by {NAME} "
                f"in SGLang; use --attention-backend flashmla for it")
    return None


def speculative_reason(num_draft_tokens: int | None, eagle_topk: int | None) -> str | None:
    """Speculative decoding sends num_draft_tokens query tokens per request to verify, as a
    chain (causal within the request's block): no draft tree."""
    if eagle_topk is not None and eagle_topk > 1:
        return (f"--speculative-eagle-topk {eagle_topk}: {NAME} verifies a chain of draft "
                f"tokens (causal), not a tree; use --speculative-eagle-topk 1")
    if num_draft_tokens and num_draft_tokens > MAX_Q_TOKENS:
        return (f"--speculative-num-draft-tokens {num_draft_tokens}: {NAME} verifies at most "
                f"{MAX_Q_TOKENS} query tokens per request; use {MAX_Q_TOKENS} or fewer")
    return None


def platform_reason(device_capability: tuple[int, int] | None,
                    extension_error: str | None) -> str | None:
    """GPU and extension. extension_error: why the extension did not load (None: loaded)."""
    if device_capability is not None and device_capability[0] != 9:
        major, minor = device_capability
        return (f"{NAME} kernels run on Hopper GPUs (compute capability 9.x, sm_90a); this GPU "
                f"is {major}.{minor}: choose another --attention-backend (e.g. flashinfer)")
    if extension_error is not None:
        return f"{NAME}'s CUDA extension is not available{extension_error}"
    return None
