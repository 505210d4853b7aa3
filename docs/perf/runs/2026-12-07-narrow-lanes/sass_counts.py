"""SASS instructions a warp spends on one pipeline stage of each grouped-GEMM K loop, for the tree as it is and
with each patch given applied: nvcc builds gemm_nvfp4.cu (the text NVRTC gets) for an arch, cuobjdump reads the
SASS back, and every backward branch whose body holds mma (HMMA / HGMMA) is a K loop; its instructions over its
block barriers (one a stage) are a stage's.

    python docs/perf/runs/2026-12-07-narrow-lanes/sass_counts.py --arch sm_90a --patch docs/perf/runs/2026-12-07-narrow-lanes/A.patch ...

Needs nvcc and cuobjdump (cuobjdump: the PyPI wheel nvidia-cuda-cuobjdump, bin/ inside it, on PATH)."""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]


def kernel_text(tree: Path) -> tuple[str, list[str]]:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from glm_ep.backend.cuda import kernel_loader as l; "
            "print(' '.join(l.define_options())); print(l.kernel_source('gemm_nvfp4.cu'), end='')")
    out = subprocess.run([sys.executable, "-c", code, str(tree)], check=True, capture_output=True, text=True).stdout
    opts, src = out.split("\n", 1)
    return src, opts.split()


def stacks(cubin: Path) -> dict[str, int]:
    """Each entry's stack bytes (cuobjdump -res-usage): a register spill shows here."""
    out = subprocess.run(["cuobjdump", "-res-usage", str(cubin)], check=True, capture_output=True, text=True).stdout
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"Function (\S+):\s*\n\s*REG:\d+ STACK:(\d+)", out)}


def loops(sass: str) -> dict[str, list[tuple[float, int, collections.Counter]]]:
    out = {}
    parts = re.split(r"\n\s*Function : (\S+)\n", sass)
    for name, body in zip(parts[1::2], parts[2::2]):
        ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)]
        spans = []
        for addr, text in ins:
            m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
            if m and int(m.group(1), 16) < addr:
                spans.append((int(m.group(1), 16), addr))
        found = []
        for lo, hi in spans:
            if any(lo <= a < b <= hi and (a, b) != (lo, hi) for a, b in spans):
                continue  # not innermost: a grid or tile loop around the K loops
            body_ins = [t for a, t in ins if lo <= a <= hi]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body_ins)
            if ops["HMMA"] + ops["HGMMA"] and ops["BAR"]:
                found.append((len(body_ins) / ops["BAR"], ops["BAR"], ops))
        out[name] = found
    return out


def build(tree: Path, arch: str, work: Path, tag: str) -> dict:
    src, opts = kernel_text(tree)
    cu, cubin = work / f"{tag}.cu", work / f"{tag}.cubin"
    cu.write_text(src)
    # -ftz=true: the loader's NVRTC build of this file for sm_90a (kernel_loader._arch_cubin)
    subprocess.run(["nvcc", "--cubin", f"-arch={arch}", "-std=c++17", "-ftz=true", *opts, "-o", str(cubin), str(cu)],
                   check=True)
    found = loops(subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True,
                                 text=True).stdout)
    stack = stacks(cubin)
    return {name: (found[name], stack.get(name, 0)) for name in found}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--patch", action="append", default=[], help="a patch to measure beside the tree (repeatable)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trees = [("tree", ROOT)]
        for i, p in enumerate(args.patch):
            wt = work / f"wt{i}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(wt)], check=True)
            subprocess.run(["git", "-C", str(wt), "apply", str(Path(p).resolve())], check=True)
            trees.append((Path(p).stem, wt))
        try:
            res = {tag: build(tree, args.arch, work, tag) for tag, tree in trees}
        finally:
            for i, _ in enumerate(args.patch):
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / f"wt{i}")])
    names = sorted(n for n in res["tree"] if "_glu_" in n and res["tree"][n][0])
    print(f"SASS instructions a warp and a stage, {args.arch} (gate + up kernels; one loop per x-tile count)\n")
    print("| kernel | " + " | ".join(tag for tag, _ in trees) + " |")
    print("|---|" + "---:|" * len(trees))
    for n in names:
        cells = [" / ".join(f"{per:.0f}" for per, _, _ in res[tag].get(n, ([], 0))[0]) for tag, _ in trees]
        print(f"| `{n.replace('nvfp4_gemm_sorted_glu_', '')}` | " + " | ".join(cells) + " |")
    spills = sorted({(n, tag, res[tag][n][1]) for tag, _ in trees for n in res[tag] if res[tag][n][1]})
    print("\nStack bytes (spills): " + ("; ".join(f"`{n}` {b} ({tag})" for n, tag, b in spills) or "none"))


if __name__ == "__main__":
    main()
