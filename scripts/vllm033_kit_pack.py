"""Packs the vLLM 0.33 kit's wheels into parts of at most LIMIT bytes (scripts/build-vllm033-kit
downloads them; this trims, cuts and writes). Usage:

    python3 scripts/vllm033_kit_pack.py WHEEL_DIR TRIM_DIR OUT_DIR

All wheels, trimmed ones rewritten into TRIM_DIR, are laid end to end in one byte stream
(smallest first, torch last) that is cut every LIMIT bytes less the part's own files: part N
holds the pieces of the stream that fall in its slice, so only the wheels that cross a cut
travel in more than one piece. Each part gets pieces/, manifest.json (for each piece: its
wheel, index, count, and the whole wheel's sha256), kitinstall.py and install.sh; OUT_DIR
gets a README with the call order.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

MIB = 1 << 20
LIMIT = 60 * MIB
RESERVE = 256 * 1024  # install.sh, kitinstall.py, manifest.json
PREFIX = "/opt/vk33"

# What a decode-only run on Hopper never loads, by wheel (path prefixes inside the wheel).
TRIM = {
    "vllm-": (
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FA2: Hopper prefill uses FA3
        "vllm/vllm-rs",                               # Rust front end of `vllm-rs serve`
        "vllm/third_party/fmha_sm100/",               # Blackwell attention
    ),
    "triton-": (
        "triton/backends/nvidia/bin/ptxas-blackwell",  # picked only for sm >= 100
        "triton/backends/nvidia/lib/cupti-blackwell/",
        "triton/backends/nvidia/lib/cupti/libcupti_static.a",  # static: link time only
        "triton/backends/nvidia/lib/cupti/libnvperf_host_static.a",
        "triton/instrumentation/libGPUInstrumentationTestLib.so",  # Triton's own tests
        "triton/plugins/libTritonPluginsTestLib.so",
        "triton/FileCheck",
    ),
}


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MIB):
            h.update(block)
    return h.hexdigest()


def trim_wheel(src: str, dst_dir: str, drop: tuple[str, ...]) -> tuple[str, int]:
    """Copies a wheel without the members under `drop` and with its RECORD to match; returns
    the new path and the compressed bytes dropped. `zip -d` removes members without
    recompressing the rest (minutes saved on torch-sized wheels)."""
    dst = os.path.join(dst_dir, os.path.basename(src))
    with zipfile.ZipFile(src) as z:
        gone = [i for i in z.infolist() if i.filename.startswith(drop)]
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        kept = "".join(line for line in z.read(record).decode().splitlines(keepends=True)
                       if not line.startswith(drop))
    dropped = sum(i.compress_size for i in gone)
    if os.path.exists(dst) and os.path.getmtime(dst) > os.path.getmtime(src):
        return dst, dropped
    tmp = dst + ".tmp"
    shutil.copy(src, tmp)
    subprocess.run(["zip", "-q", "-d", tmp] + [i.filename for i in gone], check=True)
    with tempfile.TemporaryDirectory() as t:
        os.makedirs(os.path.join(t, os.path.dirname(record)))
        with open(os.path.join(t, record), "w") as f:
            f.write(kept)
        subprocess.run(["zip", "-q", os.path.abspath(tmp), record], cwd=t, check=True)
    os.replace(tmp, dst)
    return dst, dropped


def order_key(path: str) -> tuple[int, int]:
    # small wheels first so most of them travel whole; torch (the biggest) closes the stream
    return (1 if os.path.basename(path).startswith("torch-") else 0, os.path.getsize(path))


def plan(wheels: list[str]) -> list[list[dict]]:
    """Cuts the stream of wheels into parts: each piece = (wheel, index, offset, length)."""
    room = LIMIT - RESERVE
    parts: list[list[dict]] = [[]]
    free = room
    for w in wheels:
        size, off, pieces = os.path.getsize(w), 0, []
        while off < size:
            if free == 0:
                parts.append([])
                free = room
            n = min(free, size - off)
            pieces.append({"path": w, "offset": off, "length": n, "part": len(parts) - 1})
            parts[-1].append(pieces[-1])
            off += n
            free -= n
        for i, p in enumerate(pieces):
            p.update(index=i, count=len(pieces),
                     from_parts=sorted({q["part"] for q in pieces[:-1]}))
    return parts


INSTALL_SH = """#!/usr/bin/env bash
# vLLM 0.33 kit: part {part:02d} of part00..part{last:02d}, which go in order on one machine.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PREFIX=${{VK33_PREFIX:-{prefix}}}
start=$(date +%s)
python3 "$HERE/kitinstall.py" "$HERE" "$PREFIX"
echo "part{part:02d}: $(( $(date +%s) - start )) s"
"""

CHECK_SH = """# the last part: everything is there, then the import check under torch 2.14
PYTHONPATH="$PREFIX/site" PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 \\
  python3 "$HERE/kitinstall.py" --check "$HERE" "$PREFIX"
"""


def write_parts(parts: list[list[dict]], out: str, installer: str, meta: dict) -> list[dict]:
    all_wheels = sorted({os.path.basename(p["path"]) for part in parts for p in part})
    digests = {os.path.basename(p["path"]): sha256(p["path"]) for part in parts for p in part
               if p["index"] == 0}
    summary = []
    for k, pieces in enumerate(parts):
        d = os.path.join(out, f"part{k:02d}")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.join(d, "pieces"))
        entries = []
        for p in pieces:
            wheel = os.path.basename(p["path"])
            name = wheel if p["count"] == 1 else f"{wheel}.{p['index']}"
            with open(p["path"], "rb") as f, open(os.path.join(d, "pieces", name), "wb") as o:
                f.seek(p["offset"])
                left = p["length"]
                while left:
                    block = f.read(min(MIB, left))
                    o.write(block)
                    left -= len(block)
            entries.append({"wheel": wheel, "file": name, "index": p["index"],
                            "count": p["count"], "from_parts": p["from_parts"],
                            "sha256": digests[wheel]})
        last = k == len(parts) - 1
        man = {"part": k, "parts": len(parts), "pieces": entries, "all_wheels": all_wheels,
               "left_out": meta["left_out"]}
        with open(os.path.join(d, "manifest.json"), "w") as f:
            json.dump(man, f, indent=1)
        shutil.copy(installer, os.path.join(d, "kitinstall.py"))
        with open(os.path.join(d, "install.sh"), "w") as f:
            f.write(INSTALL_SH.format(part=k, last=len(parts) - 1, prefix=PREFIX))
            if last:
                f.write(CHECK_SH)
        os.chmod(os.path.join(d, "install.sh"), 0o755)
        size = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(d) for n in ns)
        if size > LIMIT:
            sys.exit(f"part{k:02d} is {size} bytes, over {LIMIT}")
        summary.append({"part": f"part{k:02d}", "bytes": size, "pieces": entries})
    return summary


def readme(summary: list[dict], meta: dict, out: str) -> None:
    total = sum(s["bytes"] for s in summary)
    n = len(summary)
    lines = [
        "# vLLM 0.33.0 + torch 2.14.0 kit for the GPU machine (scripts/build-vllm033-kit)",
        "",
        f"{n} parts, {total / MIB:.1f} MiB in all (each at most {LIMIT // MIB} MiB).",
        f"Everything lands in {PREFIX}/site; pieces of a wheel that crosses a part's end wait",
        f"in {PREFIX}/stage until the part with its last piece joins them (sha256 checked).",
        "",
        "## Call order: one GPU-tool call per part, in this order, on one warm machine",
        "",
        "A machine replaced in between (a fresh one) needs every part again from part00.",
        "",
    ]
    for s in summary:
        lines.append(f"{s['part'][4:]}. command `bash .kit033/{s['part']}/install.sh`, "
                     f"carry `[\".kit033/{s['part']}\"]`  ({s['bytes'] / MIB:.1f} MiB)")
    lines += [
        "",
        "The last part ends with an import check (`import check OK`). Then every command",
        f"that runs vLLM 0.33 starts with `export PYTHONPATH={PREFIX}/site:$PWD` (the kit",
        "ahead of the machine's torch 2.11); `bash scripts/gpu-vllm033` does that, with the",
        "extension carried: carry `[\"mla_backend/_C.abi3.so\", \"mla_backend/_build_info.py\"]`",
        "(the build record lets the gpu tier accept the .so). The last part leaves room for",
        "them, so its call can go on: `bash .kit033/" + f"part{len(summary) - 1:02d}" +
        "/install.sh && bash scripts/gpu-vllm033 torch ext`.",
        "",
        "## Parts",
        "",
    ]
    for s in summary:
        lines.append(f"- {s['part']} ({s['bytes'] / MIB:.1f} MiB): " + ", ".join(
            e["wheel"] + ("" if e["count"] == 1 else f" [piece {e['index'] + 1}/{e['count']}]")
            for e in s["pieces"]))
    lines += ["", "## Trimmed from wheels (never loaded by a decode-only run on Hopper)", ""]
    lines += [f"- {w}: {mib:.1f} MiB compressed" for w, mib in meta["trimmed"].items()]
    lines += ["", "## Left out (vLLM 0.33 requires them; the run path does not import them)", ""]
    lines += [f"- {', '.join(meta['left_out'])}"]
    lines += ["", "## Reused from the machine", "", meta["reused"], ""]
    with open(os.path.join(out, "README"), "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    wheel_dir, trim_dir, out = sys.argv[1:4]
    meta = json.load(open(os.path.join(wheel_dir, "kit-meta.json")))
    os.makedirs(trim_dir, exist_ok=True)
    wheels, trimmed = [], {}
    for name in sorted(os.listdir(wheel_dir)):
        if not name.endswith(".whl"):
            continue
        path = os.path.join(wheel_dir, name)
        drop = next((v for k, v in TRIM.items() if name.startswith(k)), None)
        if drop:
            path, dropped = trim_wheel(path, trim_dir, drop)
            trimmed[name] = dropped / MIB
        wheels.append(path)
    meta["trimmed"] = trimmed
    wheels.sort(key=order_key)
    for old in os.listdir(out) if os.path.isdir(out) else []:
        if old.startswith("part"):
            shutil.rmtree(os.path.join(out, old))
    os.makedirs(out, exist_ok=True)
    installer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm033_kit_install.py")
    summary = write_parts(plan(wheels), out, installer, meta)
    readme(summary, meta, out)
    for s in summary:
        print(f"{s['part']}: {s['bytes'] / MIB:5.1f} MiB  {len(s['pieces'])} pieces")
    print(f"{len(summary)} parts, {sum(s['bytes'] for s in summary) / MIB:.1f} MiB; "
          f"see {os.path.join(out, 'README')}")


if __name__ == "__main__":
    main()
