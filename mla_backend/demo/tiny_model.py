"""Tiny DeepSeek-architecture checkpoints for the demo and the end-to-end tests.

`write_checkpoint` writes `config.json` + `model.safetensors` (HF DeepSeek names, as vLLM
loads them) with weights that make attention non-uniform: vLLM's dummy weights are
U(+-1e-3), which give near-uniform attention and logits — every backend "agrees" on such a
model, and the comparison proves nothing. Here matrices are U(+-sqrt(3 / fan_in)) (unit
variance outputs), norms are 1, and the query projection is scaled by `attention_gain` so the
attention logits have a standard deviation of about `attention_gain`.

The MoE layer routes every token to all of its experts (experts = experts per token = 2): a
router choosing among experts flips its choice on bf16-level differences between backends
(seen on the H200: one step's logprobs 0.37 apart while the attention outputs agreed to
6e-4), which would turn a kernel comparison into a coin toss.

`write_config` writes only `config.json` (for `load_format="dummy"`, e.g. DeepSeek-sized
models in the end-to-end benchmark). `write_tokenizer` adds a word-level tokenizer, for a
server whose API needs one (SGLang's OpenAI API detokenizes what it returns).
"""

from __future__ import annotations

import json
import math
import os

import torch

ARCHS = {
    # DeepSeek-V3 (Model Runner V1): q through a LoRA (q_a, q_b), sigmoid router with bias.
    "v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
           "routed_scaling_factor": 2.5},
    # DeepSeek-V2-Lite style (Model Runner V2 by default): q_proj, softmax greedy router.
    "v2": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
           "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
           "routed_scaling_factor": 1.0},
    # DeepSeek-V3.2 (sparse attention, DSA): V3 plus a lightning indexer per layer.
    "v32": {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "index_n_heads": 64, "index_head_dim": 128},
}


def make_config(*, arch: str = "v3", heads: int = 16, layers: int = 2, hidden: int = 512,
                vocab: int = 2048, q_lora_rank: int | None = 256, intermediate: int = 1024,
                experts: int = 2, experts_per_token: int = 2, moe_intermediate: int = 256,
                max_positions: int = 8192, index_topk: int = 256) -> dict:
    """A DeepSeek config with the real MLA dims (latent 512, rope 64, nope 128, v 128): the
    last layer is MoE (vLLM's DeepSeek model needs one), the others dense. arch "v32" adds
    the indexer (64 heads of 128, `index_topk` keys per query token)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}; got {arch!r}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1; got {layers}")
    cfg = dict(ARCHS[arch])
    cfg.update({
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
        "moe_intermediate_size": moe_intermediate, "num_hidden_layers": layers,
        "first_k_dense_replace": layers - 1, "moe_layer_freq": 1,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "n_routed_experts": experts, "n_shared_experts": 1,
        "num_experts_per_tok": experts_per_token,
        "n_group": 1, "topk_group": 1,
        "q_lora_rank": None if arch == "v2" else q_lora_rank, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "hidden_act": "silu", "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    })
    if arch == "v32":
        cfg["index_topk"] = index_topk
    return cfg


def write_config(path: str, **kwargs) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(make_config(**kwargs), f, indent=1)
    return path


def _shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, with HF DeepSeek names (per-expert MoE weights)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_lora, q_lora = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h),
              "model.norm.weight": (h,), "lm_head.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if q_lora is None:
            shapes[a + "q_proj.weight"] = (heads * (nope + rope), h)
        else:
            shapes[a + "q_a_proj.weight"] = (q_lora, h)
            shapes[a + "q_a_layernorm.weight"] = (q_lora,)
            shapes[a + "q_b_proj.weight"] = (heads * (nope + rope), q_lora)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (kv_lora + rope, h)
        shapes[a + "kv_a_layernorm.weight"] = (kv_lora,)
        shapes[a + "kv_b_proj.weight"] = (heads * (nope + v), kv_lora)
        shapes[a + "o_proj.weight"] = (h, heads * v)
        if "index_topk" in cfg:  # the lightning indexer (vLLM fuses wk + weights_proj)
            ix, ih, idim = a + "indexer.", cfg["index_n_heads"], cfg["index_head_dim"]
            shapes[ix + "wq_b.weight"] = (ih * idim, q_lora)
            shapes[ix + "wk.weight"] = (idim, h)
            shapes[ix + "weights_proj.weight"] = (ih, h)
            shapes[ix + "k_norm.weight"] = (idim,)
            shapes[ix + "k_norm.bias"] = (idim,)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        m = p + "mlp."
        if i < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            mlps = [m]
        else:
            inter = cfg["moe_intermediate_size"]
            shapes[m + "gate.weight"] = (cfg["n_routed_experts"], h)
            if cfg["topk_method"] == "noaux_tc":
                shapes[m + "gate.e_score_correction_bias"] = (cfg["n_routed_experts"],)
            mlps = [f"{m}experts.{e}." for e in range(cfg["n_routed_experts"])]
            mlps.append(m + "shared_experts.")
        for mlp in mlps:
            shapes[mlp + "gate_proj.weight"] = (inter, h)
            shapes[mlp + "up_proj.weight"] = (inter, h)
            shapes[mlp + "down_proj.weight"] = (h, inter)
    return shapes


def write_checkpoint(path: str, *, seed: int = 0, attention_gain: float = 2.0,
                     **config_kwargs) -> str:
    """Write config.json + model.safetensors (bf16) to `path`; return `path`."""
    from safetensors.torch import save_file

    cfg = make_config(**config_kwargs)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in _shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(("e_score_correction_bias", "norm.bias")):
            t = torch.zeros(shape)
        elif name == "model.embed_tokens.weight":
            t = (torch.rand(shape, generator=gen) * 2 - 1) * math.sqrt(3.0)
        else:
            bound = math.sqrt(3.0 / shape[1])
            if name.endswith(("q_b_proj.weight", "q_proj.weight")):
                bound *= attention_gain
            t = (torch.rand(shape, generator=gen) * 2 - 1) * bound
        tensors[name] = t.to(torch.bfloat16).contiguous()
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def write_tokenizer(path: str, vocab: int = 2048) -> str:
    """Write tokenizer.json + tokenizer_config.json to `path` (a model dir); return `path`.
    Token i is the word "t<i>"; 0, 1 and 2 are "<s>", "</s>" (make_config's bos and eos) and
    "<unk>" (any other word). Words are split at whitespace; decoding joins them with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False,
                   "model_max_length": 1 << 20}, f, indent=1)
    return path
