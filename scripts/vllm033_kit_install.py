"""Installs one part of the vLLM 0.33 kit (scripts/build-vllm033-kit) on the GPU machine.

Each part carries this file as kitinstall.py, a manifest.json and pieces of wheels. The
wheels form one byte stream cut into parts, so a wheel may begin in one part and end in a
later one: a piece that does not end its wheel waits in PREFIX/stage; the piece that ends
it joins all of them, checks the sha256 against the manifest and unpacks the wheel into
PREFIX/site. Parts therefore go in the order of their numbers.

    python3 kitinstall.py PART_DIR PREFIX          # install this part
    python3 kitinstall.py --check PART_DIR PREFIX  # after the last part: nothing missing,
                                                   # vLLM's needs met, torch 2.14 and vLLM import

Wheels are unpacked here rather than by `pip install --target`, which replaces whole
top-level folders and so would drop one `nvidia/` or `opentelemetry/` namespace package
when the next one lands in a later call. File modes come from the wheel (ptxas must run).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import sys
import zipfile

CHUNK = 1 << 20


def _sha256(paths: list[str]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while block := f.read(CHUNK):
                h.update(block)
    return h.hexdigest()


def _target(name: str, site: str, prefix: str) -> str | None:
    """Where a wheel member goes: .data/purelib|platlib into site, .data/scripts into
    PREFIX/bin, .data/data into PREFIX, headers nowhere (build-time only)."""
    top, _, rest = name.partition("/")
    if not top.endswith(".data"):
        return os.path.join(site, name)
    kind, _, rest = rest.partition("/")
    if kind in ("purelib", "platlib"):
        return os.path.join(site, rest)
    if kind == "scripts":
        return os.path.join(prefix, "bin", rest)
    if kind == "data":
        return os.path.join(prefix, rest)
    return None


def unpack_wheel(wheel: str, site: str, prefix: str) -> int:
    count = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            dest = _target(info.filename, site, prefix)
            if dest is None:
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if os.path.lexists(dest):
                os.unlink(dest)  # a running process may still map the old file
            with z.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, CHUNK)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(dest, mode)
            elif "/bin/" in dest:
                os.chmod(dest, 0o755)
            count += 1
    return count


def install(part_dir: str, prefix: str) -> None:
    with open(os.path.join(part_dir, "manifest.json")) as f:
        man = json.load(f)
    site, stage = os.path.join(prefix, "site"), os.path.join(prefix, "stage")
    done_dir = os.path.join(prefix, "installed")
    for d in (site, stage, done_dir):
        os.makedirs(d, exist_ok=True)
    for piece in man["pieces"]:
        wheel, idx, count = piece["wheel"], piece["index"], piece["count"]
        src = os.path.join(part_dir, "pieces", piece["file"])
        if idx + 1 < count:  # not the wheel's last piece: keep it for a later part
            shutil.copy(src, os.path.join(stage, piece["file"]))
            print(f"  staged {piece['file']} ({idx + 1} of {count} of {wheel})")
            continue
        paths = [os.path.join(stage, f"{wheel}.{i}") for i in range(count - 1)] + [src]
        missing = [p for p in paths[:-1] if not os.path.exists(p)]
        if missing:
            sys.exit(f"part {man['part']}: {wheel} needs its earlier pieces "
                     f"{[os.path.basename(p) for p in missing]} from parts "
                     f"{piece['from_parts']}: install the parts in order, on this machine")
        digest = _sha256(paths)
        if digest != piece["sha256"]:
            sys.exit(f"part {man['part']}: {wheel} sha256 {digest} != {piece['sha256']}")
        joined = os.path.join(stage, wheel)
        if count > 1:
            with open(joined, "wb") as out:
                for p in paths:
                    with open(p, "rb") as f:
                        shutil.copyfileobj(f, out, CHUNK)
        else:
            joined = src
        n = unpack_wheel(joined, site, prefix)
        for p in paths[:-1] + ([joined] if count > 1 else []):
            os.unlink(p)
        open(os.path.join(done_dir, wheel), "w").close()
        print(f"  installed {wheel} ({n} files)")
    print(f"kit part{man['part']:02d} (of part00..part{man['parts'] - 1:02d}) "
          f"installed into {site}")


def check(part_dir: str, prefix: str) -> int:
    """After the last part: every wheel installed, vLLM 0.33's requirements met by the kit
    plus the machine (those left out on purpose aside), and the imports a run needs."""
    with open(os.path.join(part_dir, "manifest.json")) as f:
        man = json.load(f)
    done = set(os.listdir(os.path.join(prefix, "installed")))
    missing = [w for w in man["all_wheels"] if w not in done]
    if missing:
        print(f"not installed (a part skipped or a fresh machine): {missing}")
        return 1
    from importlib import metadata

    from packaging.requirements import Requirement

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    # the requirements of vLLM and of every wheel the kit brought, against what is importable
    # (the kit first, then the machine); left-out packages aside
    site = os.path.join(prefix, "site")
    unmet = set()
    for dist in metadata.distributions(path=[site]):
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if norm(req.name) in man["left_out"]:
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                unmet.add(f"{req} for {dist.metadata['Name']} (absent)")
                continue
            if not req.specifier.contains(have, prereleases=True):
                unmet.add(f"{req} for {dist.metadata['Name']} (found {have})")
    print("requirements not met (the version found is used):"
          if unmet else "requirements of vLLM and the kit's wheels: all met (left-out aside)")
    for u in sorted(unmet):
        print(f"  {u}")
    import torch
    import triton
    import vllm

    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) from "
          f"{os.path.dirname(torch.__file__)}; triton {triton.__version__}; "
          f"vllm {vllm.__version__}; GPU: {torch.cuda.is_available()}")
    if not torch.__version__.startswith("2.14.0") or not torch.__file__.startswith(prefix):
        print("torch 2.14.0 is not the one imported: put PREFIX/site first on PYTHONPATH")
        return 1
    import vllm.entrypoints.llm  # noqa: F401
    import vllm.model_executor.models.deepseek_v2  # noqa: F401
    import vllm.v1.attention.backends.mla.flashmla  # noqa: F401

    # the CuTe DSL's `cutlass` package, as scripts/gpu-vllm033 puts it on PYTHONPATH (the
    # wheel's .pth file is not run for a PYTHONPATH entry)
    sys.path.insert(1, os.path.join(prefix, "site", "nvidia_cutlass_dsl", "dsl_packages"))
    bad = 0
    for mod in ("vllm._C_stable_libtorch", "vllm._flashmla_C",
                "vllm.vllm_flash_attn._vllm_fa3_C",
                "vllm.models.deepseek_v32.nvidia.ops.fused_q_cutedsl",  # CuTe DSL, for V3.2
                "quack.compile_utils"):  # the CuTe DSL router GEMM's warmup
        try:
            importlib.import_module(mod)
            print(f"  {mod}: loaded")
        except Exception as e:  # report every native module, then fail
            print(f"  {mod}: {type(e).__name__}: {e}")
            bad += 1
    print("import check OK" if not bad else "import check FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--check":
        sys.exit(check(args[1], args[2]))
    install(args[0], args[1])
