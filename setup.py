"""Build script: the CUDA extension mla_backend._C when torch (CUDA build) and nvcc are
available, otherwise the pure-Python package, with one line saying why.

Env vars:
  MLA_BACKEND_SKIP_CUDA=1     never build the extension
  MLA_BACKEND_PTXAS_VERBOSE=1 print ptxas' per-kernel register / shared-memory report
  MLA_BACKEND_CUTLASS_INCLUDE path to CUTLASS/CuTe headers (default: the nvidia-cutlass wheel)
  MLA_BACKEND_NVCC_FLAGS      extra nvcc flags, space-separated (experiment builds, e.g. -DNAME=1;
                              -DMLA_BACKEND_16BIT_PARTIALS=0 or 1: dense split partials in
                              float32, or 16-bit unstaged; see csrc/splitkv/params.h)
  MAX_JOBS                    parallel nvcc jobs (ninja); default: number of CPUs
"""

import glob
import importlib.util
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# The oldest torch the extension loads under, as torch's stable-ABI version number
# (major << 56 | minor << 48): 2.11.
TORCH_TARGET_VERSION = (2 << 56) | (11 << 48)


def _record(status: str, sources: str | None = None) -> None:
    """Keep the build decision in the package: pip hides a successful build's output
    (`pip install -v .` shows it), so mla_backend reports it when the extension is missing.
    sources: the fingerprint of csrc/ + setup.py the extension is built from (the test tiers
    refuse a .so built from other sources)."""
    with open(os.path.join(ROOT, "mla_backend", "_build_info.py"), "w") as f:
        f.write('"""Written by setup.py: how the CUDA extension was (not) built."""\n\n')
        f.write(f"CUDA_EXTENSION = {status!r}\n")
        f.write(f"SOURCES_SHA256 = {sources!r}\n")


def _sources_sha256() -> str | None:
    """mla_backend._sources.sources_sha256 of this tree (loaded by path: the package itself
    may not be importable at build time)."""
    spec = importlib.util.spec_from_file_location(
        "_mla_backend_sources", os.path.join(ROOT, "mla_backend", "_sources.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.sources_sha256(ROOT)


def _skip(reason: str) -> dict:
    print(f"mla_backend: CUDA extension skipped ({reason}); installing the pure-Python package.",
          file=sys.stderr)
    _record(f"skipped at build time: {reason}")
    return {}


def _cutlass_include() -> str | None:
    env = os.environ.get("MLA_BACKEND_CUTLASS_INCLUDE")
    if env:
        return env
    try:
        import cutlass_library  # the nvidia-cutlass wheel ships CUTLASS/CuTe headers
    except ImportError:
        return None
    inc = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return inc if os.path.isdir(inc) else None


def _cuda_extension_kwargs() -> dict:
    if os.environ.get("MLA_BACKEND_SKIP_CUDA") == "1":
        return _skip("MLA_BACKEND_SKIP_CUDA=1")
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError as e:
        return _skip(f"torch is not importable in the build environment ({e}); use "
                     "`python -m pip install --no-build-isolation .` with torch installed")
    if torch.version.cuda is None:
        return _skip(f"torch {torch.__version__} is a CPU-only build")
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 11):
        return _skip(f"torch {torch.__version__} is older than 2.11, the oldest torch whose "
                     "stable ABI the extension is written for")
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return _skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    cutlass = _cutlass_include()
    if cutlass is None:
        return _skip("CUTLASS headers not found (pip install nvidia-cutlass, "
                     "or set MLA_BACKEND_CUTLASS_INCLUDE)")

    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True)
                     + glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    nvcc_flags = [
        "-O3", "-std=c++17",
        "-gencode=arch=compute_90a,code=sm_90a",
        "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
        "-DNDEBUG", "-lineinfo",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ]
    if os.environ.get("MLA_BACKEND_PTXAS_VERBOSE") == "1":
        nvcc_flags.append("-Xptxas=-v")
    nvcc_flags += os.environ.get("MLA_BACKEND_NVCC_FLAGS", "").split()
    # torch's stable ABI: the oldest torch the build must load under (any newer one loads it
    # too); with it defined, torch's unstable headers (ATen, c10, torch/library.h) refuse to
    # compile. USE_CUDA declares the CUDA part of the C shim (the current stream).
    abi = [f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION:#018x}", "-DUSE_CUDA",
           "-DPy_LIMITED_API=0x030A0000"]
    ext = CUDAExtension(
        name="mla_backend._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc"), cutlass],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"] + abi, "nvcc": nvcc_flags + abi},
        py_limited_api=True,
    )
    # Link only the libraries that export the C shim and the CUDA runtime: CUDAExtension also
    # names libc10 / libtorch / libc10_cuda, and libc10 would then provide the std::
    # stringstream constructors the headers' error messages use.
    ext.libraries = ["torch_cpu", "torch_cuda", "cudart"]
    print(f"mla_backend: building CUDA extension for sm_90a with nvcc {nvcc}, "
          f"CUTLASS headers {cutlass}, MAX_JOBS={os.environ['MAX_JOBS']}", file=sys.stderr)
    _record(f"built for sm_90a against torch {torch.__version__}", _sources_sha256())
    return {
        "ext_modules": [ext],
        "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)},
        "options": {"bdist_wheel": {"py_limited_api": "cp310"}},
    }


setup(**_cuda_extension_kwargs())
