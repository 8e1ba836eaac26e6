"""The built extension's registration through torch's stable ABI, checked without a GPU: the
ops and schemas torch.ops.mla_backend has after loading it under the running torch, the C++
entry points' validation messages (their CUDA kernels called with CPU tensors, which fail a
check before any device work; every argument kind is unboxed on the way), and the .so's
undefined symbols (torch's C shim only, no ATen / c10 / torch C++ symbol).

Runs on the package's extension or $MLA_BACKEND_EXTENSION; skipped when there is none or
when the package's own one was built from other sources than this tree's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mla_backend import _extension
from mla_backend._sources import sources_sha256

# The schemas mla_backend/ops/*.py call (csrc/torch_bindings.cpp registers them)
SCHEMAS = {
    "dense_partial_bytes": "mla_backend::dense_partial_bytes() -> int",
    "mla_decode": (
        "mla_backend::mla_decode(Tensor q, Tensor? q_pe, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor metadata, Tensor(a!) partial_out, Tensor(b!) partial_lse, Tensor(c!) out, "
        "Tensor(d!) lse, int num_ctas, int rows_per_cta, float softmax_scale, bool causal, "
        "Tensor? kv_scale, float kv_scale_value, bool fp16_operands) -> ()"),
    "plan_decode": (
        "mla_backend::plan_decode(Tensor seq_lens, Tensor(a!) metadata, int num_ctas, "
        "int min_units, int unit_tokens, int whole_extra, int align_extra, int restart_pad, "
        "int lpt_extra, int one_unit_max) -> ()"),
    "plan_sparse_decode": (
        "mla_backend::plan_sparse_decode(Tensor? topk_length, Tensor(a!) metadata, "
        "int q_tokens_per_req, int topk, int num_ctas, int min_units, int unit_tokens) -> ()"),
    "sparse_mla_decode": (
        "mla_backend::sparse_mla_decode(Tensor q, Tensor? q_pe, Tensor kv_cache, Tensor indices, "
        "Tensor? topk_length, Tensor metadata, Tensor(a!) partial_out, Tensor(b!) partial_lse, "
        "Tensor(c!) out, Tensor(d!) lse, int num_ctas, int rows_per_cta, float softmax_scale, "
        "bool combine, int uniform_units, int units_per_cta) -> ()"),
}

TREE = Path(_extension.__file__).resolve().parent.parent


def _why_not_testable() -> str | None:
    path = _extension.extension_path()
    if path is None:
        return "no built extension (mla_backend/_C*.so or $MLA_BACKEND_EXTENSION)"
    if not os.environ.get("MLA_BACKEND_EXTENSION") and (TREE / "csrc").is_dir():
        tree = sources_sha256(TREE)
        if _extension.build_sources() != tree:
            return (f"{path} was built from other sources than this tree's csrc/ + setup.py; "
                    f"rebuild: python setup.py build_ext --inplace --force")
    return None


@pytest.fixture(scope="module")
def so_path() -> str:
    reason = _why_not_testable()
    if reason is not None:
        pytest.skip(reason)
    # a build that exists but does not load under this torch is what this file is for: fail
    assert _extension.load(), f"the extension does not load under torch {torch.__version__}: " \
                              f"{_extension.load_error()}"
    return _extension.extension_path()


def test_registers_every_op_with_its_schema(so_path):
    assert _extension.registered_schemas() == SCHEMAS


# ops with no tensor argument (build constants): one kernel for every device
CONSTANTS = {"dense_partial_bytes"}


def test_every_op_has_a_cuda_kernel(so_path):
    for name in SCHEMAS.keys() - CONSTANTS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mla_backend::{name}", "CUDA"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"mla_backend::{name}", "CPU")
    for name in CONSTANTS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mla_backend::{name}",
                                                              "CompositeExplicitAutograd"), name


def test_dense_partial_bytes_sets_the_workspace_dtype(so_path):
    """The build says how wide its dense split partials are (2: q's dtype by default, 4: float32
    under -DMLA_BACKEND_16BIT_PARTIALS=0), and the workspaces mla_backend.ops allocates follow
    it."""
    from mla_backend.ops import dense

    width = torch.ops.mla_backend.dense_partial_bytes()
    assert width in (2, 4)
    assert dense._partial_dtype("decode_workspace").itemsize == width


def _dense_call(partial_dtype, q_dtype=torch.bfloat16):
    """mla_decode's arguments, valid up to partial_out's dtype (H 16, s_q 1, batch 2)."""
    return (torch.zeros(2, 1, 16, 576, dtype=q_dtype), None, torch.zeros(3, 64, 576, dtype=q_dtype),
            _i32(2, 3), _i32(2), _i32(4), torch.zeros(8, 16, 512, dtype=partial_dtype),
            _f32(8, 16), torch.zeros(2, 1, 16, 512, dtype=q_dtype), _f32(2, 1, 16), 4, 16, 0.1,
            True, None, 1.0, False)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_mla_decode_refuses_partials_of_another_width(so_path, q_dtype):
    """A plan whose partial_out is not what this build writes is an error naming both, never
    a buffer read as the other type."""
    sixteen = torch.ops.mla_backend.dense_partial_bytes() == 2
    wrong = [torch.float32] if sixteen else [q_dtype, torch.bfloat16, torch.float16]
    if sixteen:  # the other 16-bit type is wrong too
        wrong.append(torch.float16 if q_dtype == torch.bfloat16 else torch.bfloat16)
    want = {torch.float32: "Float", torch.bfloat16: "BFloat16", torch.float16: "Half"}
    right = q_dtype if sixteen else torch.float32
    for dtype in wrong:
        with pytest.raises(RuntimeError, match=re.escape(
                f"mla_decode: partial_out must be {want[right]}: this build writes ")) as e:
            _call_cuda_kernel("mla_decode", *_dense_call(dtype, q_dtype))
        assert f"; got {want[dtype]}" in str(e.value)


def _call_cuda_kernel(name: str, *args):
    """The op's CUDA kernel, whatever device the arguments are on."""
    op = getattr(torch.ops.mla_backend, name).default
    return op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA), *args)


def _i32(*shape):
    return torch.zeros(*shape, dtype=torch.int32)


def _f32(*shape):
    return torch.zeros(*shape, dtype=torch.float32)


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


# (op, arguments, the C++ message); each call fails the op's first check
CHECK_CASES = [
    ("plan_decode", lambda: (torch.zeros(2, dtype=torch.int64), _i32(4), 4, 1, 32, 4, -1, -1, -1, -1),
     "plan_decode: seq_lens must be contiguous int32 on CUDA"),
    ("mla_decode",
     lambda: (_bf16(2, 576), None, _bf16(3, 64, 576), _i32(2, 3), _i32(2), _i32(4),
              _f32(8, 16, 512), _f32(8, 16), _bf16(2, 1, 16, 512), _f32(2, 1, 16), 4, 16, 0.1,
              False, None, 1.0, False),
     "mla_decode: bad q"),
    ("mla_decode",  # the optional kv_scale given
     lambda: (_bf16(2, 576), None, _bf16(3, 64, 576), _i32(2, 3), _i32(2), _i32(4),
              _f32(8, 16, 512), _f32(8, 16), _bf16(2, 1, 16, 512), _f32(2, 1, 16), 4, 64, 0.1,
              True, _f32(1), 1.0, True),
     "mla_decode: bad q"),
    ("mla_decode",  # q is the latent part: the rope part must match it
     lambda: (_bf16(2, 1, 16, 512), _bf16(2, 1, 8, 64), _bf16(3, 64, 576), _i32(2, 3), _i32(2),
              _i32(4), _f32(8, 16, 512), _f32(8, 16), _bf16(2, 1, 16, 512), _f32(2, 1, 16), 4,
              16, 0.1, False, None, 1.0, False),
     "mla_decode: bad q_pe"),
    ("plan_sparse_decode", lambda: (None, torch.zeros(4, dtype=torch.int64), 1, 64, 4, 1, 64),
     "plan_sparse_decode: metadata must be contiguous int32 [groups + 2] on CUDA"),
    ("plan_sparse_decode", lambda: (_i32(2), _f32(4), 1, 64, 4, 1, 64),
     "plan_sparse_decode: metadata must be contiguous int32 [groups + 2] on CUDA"),
    ("sparse_mla_decode",
     lambda: (_bf16(2, 576), None, _bf16(3, 64, 576), _i32(2, 1, 64), _i32(2), _i32(4),
              _f32(8, 16, 512), _f32(8, 16), _bf16(2, 1, 16, 512), _f32(2, 1, 16), 4, 64, 0.1,
              True, 0, 0),
     "sparse_mla_decode: bad q"),
    ("sparse_mla_decode",  # q whole (576) with a rope part given too
     lambda: (_bf16(2, 1, 16, 576), _bf16(2, 1, 16, 64), _bf16(3, 64, 576), _i32(2, 1, 64),
              None, _i32(4), _f32(8, 16, 512), _f32(8, 16), _bf16(2, 1, 16, 512),
              _f32(2, 1, 16), 4, 64, 0.1, False, 1, 2),
     "sparse_mla_decode: bad q"),
    ("sparse_mla_decode",  # q is the latent part: the rope part's columns must be contiguous
     lambda: (_bf16(2, 1, 16, 512), _bf16(2, 1, 64, 16).transpose(2, 3), _bf16(3, 64, 576),
              _i32(2, 1, 64), None, _i32(4), _f32(8, 16, 512), _f32(8, 16),
              _bf16(2, 1, 16, 512), _f32(2, 1, 16), 4, 64, 0.1, False, 1, 2),
     "sparse_mla_decode: bad q_pe"),
    ("sparse_mla_decode",  # q right, the cache's token width wrong
     lambda: (_bf16(2, 1, 16, 576), None, _bf16(3, 64, 512), _i32(2, 1, 64), None, _i32(4),
              _f32(8, 16, 512), _f32(8, 16), _bf16(2, 1, 16, 512), _f32(2, 1, 16), 4, 64, 0.1,
              False, 1, 2),
     "sparse_mla_decode: bad kv_cache"),
    ("sparse_mla_decode",  # the two parts right, the cache's token width wrong
     lambda: (_bf16(2, 1, 16, 512), _bf16(2, 1, 16, 64), _bf16(3, 64, 512), _i32(2, 1, 64),
              None, _i32(4), _f32(8, 16, 512), _f32(8, 16), _bf16(2, 1, 16, 512),
              _f32(2, 1, 16), 4, 64, 0.1, False, 1, 2),
     "sparse_mla_decode: bad kv_cache"),
]


@pytest.mark.parametrize("name,args,message", CHECK_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CHECK_CASES)])
def test_cpp_checks_reach_python_with_their_message(so_path, name, args, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        _call_cuda_kernel(name, *args())


def test_links_only_torchs_c_shim(so_path):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "--undefined-only", so_path], check=True,
                         capture_output=True, text=True).stdout
    torch_shim = set()
    other_unversioned = set()
    for line in out.splitlines():
        kind, name = line.split()[-2:]
        if kind == "w":  # weak: the toolchain's optional hooks
            continue
        if name.startswith(("aoti_torch_", "torch_")):
            torch_shim.add(name)
        elif "@" not in name:  # versioned ones are libstdc++, glibc and the CUDA runtime's
            other_unversioned.add(name)
    assert other_unversioned == set(), "symbols from outside torch's C shim (ATen / c10 C++?)"
    assert {"aoti_torch_library_init_def", "torch_library_impl",
            "aoti_torch_get_current_cuda_stream"} <= torch_shim
