"""scripts/sglang_jit_cache.py: the prebuilt JIT cache's layout is where FlashInfer's and SGLang's
own loaders look for sm_90a modules. `check` runs in a fresh process each time (the loaders
memoize what they load). The names expected here come from the libraries' naming functions
(FlashInfer's URI, SGLang's source hash and build-folder name), not from the script."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sglang_jit_cache.py"
ARCH_ENV = {"FLASHINFER_CUDA_ARCH_LIST": "9.0a"}


def _check(out: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, **ARCH_ENV)
    return subprocess.run([sys.executable, str(SCRIPT), "check", str(out)], env=env,
                          capture_output=True, text=True, timeout=300)


def _expected_names() -> tuple[list[str], list[str]]:
    """FlashInfer URIs and SGLang build folders (arch 9.0a) of the modules the script builds."""
    import torch
    from flashinfer.jit.attention.modules import get_batch_mla_uri
    from sglang.kernels.jit.utils import compile as jit
    from sglang.kernels.jit.utils.arch import override_jit_cuda_arch

    bf16 = torch.bfloat16
    uris = [get_batch_mla_uri("fa3", bf16, bf16, bf16, torch.int32, 512, 64, False)]
    csrc = jit.KERNEL_PATH / "csrc"
    kernels = [  # load_jit's marker args (pdl on: sm_90) and its CUDA file
        (("activation", "bf16_t", "true"), "elementwise/activation.cuh"),
        (("fused_rope", "false", "64", "true", "bf16_t", "bf16_t"), "elementwise/rope.cuh"),
        (("fused_rope", "true", "64", "true", "bf16_t", "bf16_t"), "elementwise/rope.cuh"),
        (("hadamard", "bf16_t"), "fast-hadamard-transform/hadamard_jit.cuh"),
        (("dpsk_v32_k_indexer_norm_rope_store_p64", "bf16_t", "true", "64"),
         "deepseek_v32/indexer_k.cuh"),
        (("fused_store_index_k_cache", "bf16_t", "int64_t", "64", "true"),
         "dsa/fused_store_index_cache.cuh"),
    ]
    with override_jit_cuda_arch(9, 0):
        folders = [jit._jit_build_dir_name("sgl_kernel_jit_" + "_".join(args) + "_"
                                           + jit._local_jit_source_hash([str(csrc / f)]))
                   for args, f in kernels]
    return uris, folders


def test_flashinfer_module_targets_sm90a():
    # a fresh process: FlashInfer fixes its target list when first imported
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import sglang_jit_cache as m; "
            "(s,) = m.flashinfer_specs(); print(s.name); print(' '.join(s.extra_cuda_cflags))")
    result = subprocess.run([sys.executable, "-c", code, str(SCRIPT.parent)],
                            env=dict(os.environ, **ARCH_ENV), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    name, flags = result.stdout.splitlines()[-2:]
    assert name == _expected_names()[0][0]
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags.split()


def test_check_fails_on_an_empty_cache(tmp_path):
    result = _check(tmp_path)
    assert result.returncode != 0
    assert "MissingJITCacheError" in result.stderr, result.stderr[-2000:]


def test_check_misses_an_sglang_module_in_another_arch_folder(tmp_path):
    uris, folders = _expected_names()
    for uri in uris:
        (tmp_path / "flashinfer-aot" / uri).mkdir(parents=True)
        (tmp_path / "flashinfer-aot" / uri / f"{uri}.so").write_bytes(b"")
    for folder in folders:  # an sm_100a build must not be taken for sm_90a
        name = folder.split("__arch_")[0]
        wrong = tmp_path / "tvm-ffi" / folder.replace("__arch_9.0a", "__arch_10.0a")
        wrong.mkdir(parents=True)
        (wrong / f"{name}.so").write_bytes(b"")
    result = _check(tmp_path)
    assert result.returncode != 0
    assert "cache miss: SGLang would compile" in result.stderr, result.stderr[-2000:]


def test_check_opens_every_module_where_the_loaders_look(tmp_path):
    uris, folders = _expected_names()
    wanted = []
    for uri in uris:
        wanted.append(pathlib.Path("flashinfer-aot") / uri / f"{uri}.so")
    for folder in folders:
        wanted.append(pathlib.Path("tvm-ffi") / folder / f"{folder.split('__arch_')[0]}.so")
    for rel in wanted:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    result = _check(tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    opened = [line.removeprefix("loader opens ") for line in result.stdout.splitlines()
              if line.startswith("loader opens ")]
    assert sorted(opened) == sorted(str(p) for p in wanted)
