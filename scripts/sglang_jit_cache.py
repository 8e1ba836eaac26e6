"""Builds, on a machine with no GPU, the JIT modules that SGLang's engines compile on first use
on Hopper (sm_90a), laid out as their loaders look for them, and checks that layout by calling
those loaders with a recorder in place of the library loader.

  python scripts/sglang_jit_cache.py build OUTDIR   # needs nvcc 13.0 (CUDA_HOME) and ninja
  python scripts/sglang_jit_cache.py check OUTDIR   # every module found where it is looked for

OUTDIR layout (each .so alone; build folders are dropped):
  flashinfer-aot/<uri>/<uri>.so   FlashInfer's AOT folder (flashinfer/data/aot): a module found
                                  there is loaded as it is, no ninja, no source check
  tvm-ffi/<name>__arch_9.0a__tvmffi_<version>/<name>.so
                                  SGLang's JIT cache ($TVM_FFI_CACHE_DIR, default
                                  ~/.cache/tvm-ffi); <name> hashes the kernel sources
Run with SGLang's kit on the path (the CPU venv /work/venv-sg has the same versions).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ARCH = (9, 0)  # Hopper: FlashInfer and SGLang both target it as sm_90a
FLASHINFER_AOT = "flashinfer-aot"
TVM_FFI = "tvm-ffi"


def _set_arch_env() -> None:
    """FlashInfer reads its target list at import (no GPU here to ask): set it first."""
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", f"{ARCH[0]}.{ARCH[1]}a")


def flashinfer_specs() -> list:
    """FlashInfer JitSpecs the engines build on Hopper. Dense MLA prefill with
    flashinfer_mla_disable_ragged (flashmla and mla_backend engines): BatchMLAPagedAttention,
    backend "auto" -> "fa3" on sm_90a, q/kv/o in the model dtype (bf16; an fp8_e4m3 cache is
    cast to bf16 before this kernel), int32 indices, 512 + 64 latent. (The tiny models' router,
    one expert group with top-2 of 2, skips FlashInfer's fused_topk_deepseek: SGLang requires
    topk_group * n_group >= top-k for it, and routes through a Triton kernel instead.)"""
    _set_arch_env()
    import torch
    from flashinfer.jit import core
    from flashinfer.jit.attention.modules import gen_batch_mla_module

    if (ARCH[0], f"{ARCH[1]}a") not in core.current_compilation_context.TARGET_CUDA_ARCHS:
        raise RuntimeError("flashinfer was imported before FLASHINFER_CUDA_ARCH_LIST=9.0a was "
                           "set: run this script as a program")
    bf16 = torch.bfloat16
    return [gen_batch_mla_module("fa3", bf16, bf16, bf16, torch.int32, 512, 64, False)]


def sglang_builders() -> list:
    """(label, zero-argument callable) for SGLang's JIT modules (sglang.kernels.jit) that the
    tiny DeepSeek engines reach on Hopper, with the template arguments they are called with:
    silu_and_mul of the dense and expert MLPs (bf16); the fused RoPE of RotaryEmbedding
    (64 dims, bf16 q and k; GPT-J style for MLA, NeoX style for the V3.2 indexer); V3.2's
    indexer: the Hadamard rotation (bf16), the fused k norm + RoPE + fp8 store and the
    index-cache store that its can_use check builds (bf16 keys, int64 slots, page 64). Norms,
    the KV-cache write, the router and the MoE GEMMs run on sgl_kernel or Triton instead."""
    import torch
    from sglang.kernels.ops.activation import activation
    from sglang.kernels.ops.attention import fused_store_index_cache as index_store
    from sglang.kernels.ops.attention import rope
    from sglang.kernels.ops.quantization import hadamard
    from sglang.kernels.ops.quantization.dsv32 import elementwise as dsv32

    bf16 = torch.bfloat16
    return [
        ("activation bf16", lambda: activation.activation_module(bf16)),
        ("fused_rope gptj 64 bf16", lambda: rope._jit_fused_rope_module(False, 64, bf16, bf16)),
        ("fused_rope neox 64 bf16", lambda: rope._jit_fused_rope_module(True, 64, bf16, bf16)),
        ("hadamard bf16", lambda: hadamard._jit_hadamard_module(bf16)),
        ("dsv32 k indexer norm rope store p64",
         lambda: dsv32._jit_k_indexer_norm_rope_store_module(bf16, 64)),
        ("dsa index-cache store bf16 int64 p64",
         lambda: index_store._jit_dsa_fused_store_module(bf16, torch.int64, 64)),
    ]


@contextlib.contextmanager
def _hopper_target(tvm_cache: pathlib.Path):
    """SGLang's JIT aimed at sm_90a and at tvm_cache (its arch comes from the GPU otherwise)."""
    from sglang.kernels.jit.utils.arch import override_jit_cuda_arch

    old = os.environ.get("TVM_FFI_CACHE_DIR")
    os.environ["TVM_FFI_CACHE_DIR"] = str(tvm_cache)
    try:
        with override_jit_cuda_arch(*ARCH):
            yield
    finally:
        if old is None:
            os.environ.pop("TVM_FFI_CACHE_DIR", None)
        else:
            os.environ["TVM_FFI_CACHE_DIR"] = old


def _stub_libcuda(folder: pathlib.Path) -> str:
    """An empty libcuda.so (soname libcuda.so.1) for `-lcuda` at link time: the wheel's CUDA
    has no driver stub; on the GPU machine the driver's libcuda.so.1 is loaded instead."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "stub.c"
    src.write_text("void mla_backend_libcuda_stub(void) {}\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(folder / "libcuda.so"), str(src)], check=True)
    return str(folder)


def build(out: pathlib.Path) -> list[pathlib.Path]:
    """Compiles every module into out; returns the .so files written."""
    if not os.environ.get("CUDA_HOME"):
        sys.exit("CUDA_HOME is not set: source the nvcc 13.0 environment first")
    work = pathlib.Path(tempfile.mkdtemp(prefix="sg-jit-build-"))
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(work)  # FlashInfer's build folders
    stub = _stub_libcuda(work / "stubs")
    os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{stub}"
    written = []
    for spec in flashinfer_specs():
        print(f"flashinfer: building {spec.name}", flush=True)
        spec.build(verbose=os.environ.get("FLASHINFER_JIT_VERBOSE") == "1")
        dest = out / FLASHINFER_AOT / spec.name / f"{spec.name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, dest)
        written.append(dest)
    tvm_cache = out / TVM_FFI
    with _hopper_target(tvm_cache):
        for label, make in sglang_builders():
            print(f"sglang jit: building {label}", flush=True)
            try:
                make()
            except Exception as e:  # built, but loading needs the driver's libcuda.so.1
                if "libcuda" not in str(e) and "cannot open shared object" not in str(e):
                    raise
    for folder in tvm_cache.iterdir():  # keep only the library the loader opens
        for f in folder.iterdir():
            if f.name != f"{folder.name.split('__arch_')[0]}.so":
                shutil.rmtree(f) if f.is_dir() else f.unlink()
        written += list(folder.glob("*.so"))
    shutil.rmtree(work, ignore_errors=True)
    return written


def check(out: pathlib.Path) -> list[str]:
    """Calls FlashInfer's and SGLang's own loaders for every module with out as their cache
    and a recorder in place of the library loader; JIT compilation is switched off, so a
    module not found where the loader looks raises. Returns the paths the loaders opened."""
    _set_arch_env()
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    import tvm_ffi
    import tvm_ffi.cpp
    from flashinfer.jit import core as fi_core
    from flashinfer.jit import env as fi_env

    opened: list[str] = []

    def record(path, *args, **kwargs):
        opened.append(str(path))
        return object()

    def no_compile(*args, **kwargs):
        raise RuntimeError(f"cache miss: SGLang would compile {args[:1]}")

    saved = (fi_env.FLASHINFER_AOT_DIR, fi_core.JitSpec.load, tvm_ffi.load_module,
             tvm_ffi.cpp.load_inline, tvm_ffi.cpp.load)
    fi_env.FLASHINFER_AOT_DIR = out / FLASHINFER_AOT
    fi_core.JitSpec.load = lambda self, so_path: record(so_path)
    tvm_ffi.load_module = record
    tvm_ffi.cpp.load_inline = tvm_ffi.cpp.load = no_compile
    try:
        for spec in flashinfer_specs():
            spec.build_and_load()
        with _hopper_target(out / TVM_FFI):
            for _, make in sglang_builders():
                make()
    finally:
        (fi_env.FLASHINFER_AOT_DIR, fi_core.JitSpec.load, tvm_ffi.load_module,
         tvm_ffi.cpp.load_inline, tvm_ffi.cpp.load) = saved
    return opened


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["build", "check"])
    parser.add_argument("outdir", type=pathlib.Path)
    args = parser.parse_args()
    out = args.outdir.resolve()
    if args.action == "build":  # check in a fresh process: the builders memoize their modules
        for so in build(out):
            print(f"built {so.relative_to(out)} ({so.stat().st_size / 2**20:.1f} MiB)")
        return
    for path in check(out):
        print(f"loader opens {pathlib.Path(path).relative_to(out)}")


if __name__ == "__main__":
    main()
