"""Measurement without a GPU: the SASS of one kernel's hot loop (its longest backward branch), counted
by opcode, for a kernel file built as the CUDA backend builds it (``loader.kernel_source`` with
``loader.define_options``):

    python3 tools/sass_loop.py gemm_nvfp4.cu nvfp4_gemm_sorted_glu_m128wgk64 [--arch sm_90a] [--list]

Needs nvcc and cuobjdump: PATH first, then the ``nvidia/*/bin`` folders of this environment's
site-packages (``pip install nvidia-cuda-cuobjdump`` puts one there). The counts are static: the
instructions of one trip round the loop (e.g. one k block of a GEMM), not how often each issues.
"""

from __future__ import annotations

import argparse
import re
import shutil
import site
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

_LINE = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;")


def parse_sass(text: str) -> list[tuple[int, str]]:
    """(address, instruction) for every instruction line of ``cuobjdump -sass`` output."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, text.splitlines()) if m]


def opcode(instruction: str) -> str:
    """The opcode without its predicate and modifiers: ``@!P0 LDGSTS.E.BYPASS.128 [...]`` -> ``LDGSTS``."""
    words = instruction.split()
    op = words[1] if words[0].startswith("@") else words[0]
    return op.split(".")[0]


def hot_loop(ins: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The instructions from the target to the source of the longest backward branch (never-taken
    ``@!PT`` branches aside); empty where there is none."""
    best: tuple[int, int] | None = None
    for addr, text in ins:
        if opcode(text) != "BRA" or text.startswith("@!PT"):
            continue
        target = int(text.split()[-1], 16)
        if target < addr and (best is None or addr - target > best[1] - best[0]):
            best = (target, addr)
    return [] if best is None else [(a, t) for a, t in ins if best[0] <= a <= best[1]]


def histogram(loop: list[tuple[int, str]]) -> Counter:
    return Counter(opcode(text) for _, text in loop)


def find_tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for root in site.getsitepackages() + [site.getusersitepackages()]:
        for cand in sorted(Path(root).glob(f"nvidia/*/bin/{name}")):
            return str(cand)
    raise SystemExit(f"{name} not found on PATH nor under site-packages/nvidia/*/bin "
                     f"(pip install nvidia-cuda-{name} provides cuobjdump)")


def build_sass(kernel_file: str, function: str, arch: str) -> str:
    from glm_ep.backend.cuda import kernel_loader as loader

    nvcc, cuobjdump = find_tool("nvcc"), find_tool("cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / kernel_file, Path(tmp) / "k.cubin"
        src.write_text(loader.kernel_source(kernel_file))
        subprocess.run([nvcc, "--cubin", f"-arch={arch}", "-std=c++17", "-ftz=true", *loader.define_options(),
                        "-o", str(cubin), str(src)], check=True)
        out = subprocess.run([cuobjdump, "-sass", "-fun", function, str(cubin)], check=True, capture_output=True,
                             text=True).stdout
    if not parse_sass(out):
        raise SystemExit(f"{kernel_file} has no function {function} for {arch}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel_file", help="a file of glm_ep/kernels, e.g. gemm_nvfp4.cu")
    ap.add_argument("function", help="an entry point, e.g. nvfp4_gemm_sorted_glu_m128wgk64")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--list", action="store_true", help="print the loop's instructions too")
    args = ap.parse_args()
    ins = parse_sass(build_sass(args.kernel_file, args.function, args.arch))
    loop = hot_loop(ins)
    counts = histogram(loop)
    print(f"{args.function} ({args.arch}): {len(ins)} instructions, hot loop {len(loop)}")
    print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common()))
    if args.list:
        for addr, text in loop:
            print(f"  {addr:#06x} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
