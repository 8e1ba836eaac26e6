"""The SGLang bench's DeepSeek-V3.2 engines (`python -m bench.e2e_decode --engine sglang --arch
v32`, bench/e2e_sglang.py) checked against SGLang 0.5.17 on CPU. For the V3.2-shaped model the
bench writes (H 128 and 16), each cache and each backend: every sgl.Engine argument is a
ServerArgs field, and SGLang's own ServerArgs (a Hopper's capability, our plugin registered,
the environment the engine's process gets) resolves it to what the bench means: our name or
`dsa` with the kernels named (not its FA3 decode default), the cache asked for, page 64,
decode graphs up to the batch, the radix cache on (the timed prompts come from it), SGLang's
dsa prefills kept on its sparse kernels; the model is a DSA model with index_topk 2048."""

import dataclasses

import pytest

from bench import e2e_decode, e2e_sglang
from mla_backend.demo import engines, sglang_run
from tests.sglang_cpu.test_engine_specs import _engine_kwargs, _server_args

THRESHOLD = "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD"
CASES = [(heads, cache, key) for heads in (128, 16) for cache in e2e_sglang.DSA_BACKENDS
         for key in e2e_sglang.DSA_BACKENDS[cache]]


def _args(cache: str):
    return e2e_decode._parse(["--engine", "sglang", "--arch", "v32", "--kv-cache-dtype", cache])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """config.json of the bench's V3.2 model per head count (ServerArgs reads only it)."""
    args = _args("bfloat16")
    return {h: e2e_decode.write_model(args, str(tmp_path_factory.mktemp(f"v32-h{h}")), h)
            for h in (128, 16)}


def _engine_env(monkeypatch, spec: dict) -> dict:
    """The variables sglang_run.run adds to the engine's process."""
    seen = {}

    def fake_run_engine(spec, log_path, *, env=None, **kw):
        seen.update(env)
        return {}

    monkeypatch.setattr(engines, "run_engine", fake_run_engine)
    sglang_run.run(spec, "/dev/null")
    return seen


@pytest.mark.parametrize("heads, cache, key", CASES, ids=[f"h{h}-{c}-{k}" for h, c, k in CASES])
def test_bench_v32_spec_resolves_in_sglang(monkeypatch, models, heads, cache, key):
    from sglang.srt.configs.model_config import get_dsa_index_topk, is_deepseek_dsa
    from sglang.srt.environ import envs
    from sglang.srt.server_args import ServerArgs

    args = _args(cache)
    spec = e2e_sglang.engine_spec(models[heads], key, batch=args.batch, context=args.context,
                                  steps=args.steps, repeats=args.repeats,
                                  log_interval=args.log_interval, arch="v32",
                                  kv_cache_dtype=cache)
    env = _engine_env(monkeypatch, spec)
    monkeypatch.setenv(THRESHOLD, "unset")  # recorded, so the test leaves it as it found it
    monkeypatch.delenv(THRESHOLD)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kwargs = _engine_kwargs(monkeypatch, spec)
    assert set(kwargs) - {f.name for f in dataclasses.fields(ServerArgs)} == set()
    sa = _server_args(monkeypatch, kwargs)
    name, kernel = e2e_sglang.DSA_BACKENDS[cache][key]
    assert sa.attention_backend == name
    assert sa.kv_cache_dtype == cache and sa.page_size == 64
    assert not sa.disable_cuda_graph and sa.cuda_graph_max_bs_decode == args.batch
    assert sa.max_running_requests == args.batch and not sa.disable_radix_cache
    assert sa.context_length == args.context + args.steps + 64
    assert sa.load_format == "dummy" and sa.decode_log_interval == args.log_interval
    hf_config = sa.get_model_config().hf_config
    assert is_deepseek_dsa(hf_config) and get_dsa_index_topk(hf_config) == 2048
    assert hf_config.num_attention_heads == heads
    if kernel is None:
        # ours: SGLang's kernel defaults do not apply, but none may be trtllm (its 576-byte fp8
        # token); the dense-prefill threshold is SGLang's own default, unused by ours
        assert "trtllm" not in (sa.dsa_prefill_backend, sa.dsa_decode_backend)
        assert THRESHOLD not in env and envs.SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD.get() \
            == 2048
    else:
        assert (sa.dsa_prefill_backend, sa.dsa_decode_backend) == (kernel, kernel)
        assert env[THRESHOLD] == "0"
        assert envs.SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD.get() == 0
    assert env["SGLANG_RECORD_STEP_TIME"] == "1"  # the step records the bench reads
