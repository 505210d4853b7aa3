"""The kernel files' nvcc builds that ``tests/cuda/test_kernels_build.py`` reads: nvcc's PTX of each file for each
arch it is built for (the text NVRTC gets at run time), then ptxas's cubin of that PTX.

About 170 s of one core on this project's kernels. ``conftest.py`` starts them, at a low priority, as soon as pytest
has collected a test that reads them, so they run on whatever the tests before them leave idle instead of after
them; a test awaits only the build it reads."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from glm_ep.backend.cuda import kernel_loader as loader

NVCC = shutil.which("nvcc") or next((str(p) for p in [Path("/usr/local/cuda/bin/nvcc")] if p.is_file()), None)
PTXAS = str(Path(NVCC).with_name("ptxas")) if NVCC else None
HAVE_NVCC = NVCC is not None and Path(PTXAS).is_file()
FILES = loader.kernel_files()
ARCHS = ("sm_90", "sm_121", "sm_90a")
#: the fixture name by which a test reads the builds: collecting one starts them
FIXTURE = "builds"


def built_for(path: Path, arch: str) -> bool:
    """Every file is built for the plain archs; an arch-specific one (``sm_90a``) only where the loader has one."""
    return not arch.endswith("a") or arch in loader.ARCH_SPECIFIC.get(path.name, {}).values()


@dataclass
class Build:
    ptx: Path
    ptx_rc: int
    ptx_log: str
    cubin_rc: int = -1  # ptxas's, once the PTX built
    cubin_log: str = ""


#: each build at a low priority (``nice``: a preexec_fn is not safe in the pool's threads)
NICE = [shutil.which("nice")] + ["-n", "10"] if shutil.which("nice") else []


def _build(root: Path, path: Path, arch: str) -> Build:
    """nvcc's PTX of a kernel file for ``arch`` (the text NVRTC gets), then ptxas's cubin of it: the two halves of
    ``nvcc --cubin``."""
    src, ptx = root / f"{path.stem}.{arch}.cu", root / f"{path.stem}.{arch}.ptx"
    src.write_text(loader.kernel_source(path.name))
    r = subprocess.run([*NICE, NVCC, "--ptx", f"-arch={arch}", "-std=c++17", *loader.define_options(), "-o", str(ptx),
                        str(src)], capture_output=True, text=True)
    b = Build(ptx, r.returncode, r.stdout + r.stderr)
    if b.ptx_rc == 0:
        r = subprocess.run([*NICE, PTXAS, f"-arch={arch}", "-o", str(ptx.with_suffix(".cubin")), str(ptx)],
                           capture_output=True, text=True)
        b.cubin_rc, b.cubin_log = r.returncode, r.stdout + r.stderr
    return b


class Builds:
    """Every (file, arch) build, started on all cores (largest file first); ``get(path, arch)`` awaits one."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="glm_ep_kernel_builds_"))
        self.pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
        jobs = [(p, a) for p in sorted(FILES, key=lambda p: -p.stat().st_size) for a in ARCHS if built_for(p, a)]
        self.futures: dict[tuple[str, str], Future[Build]] = {
            (p.name, a): self.pool.submit(_build, self.root, p, a) for p, a in jobs}

    def get(self, path: Path, arch: str) -> Build:
        return self.futures[path.name, arch].result()

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=True)
        shutil.rmtree(self.root, ignore_errors=True)


_started: Builds | None = None


def start() -> Builds:
    """The builds, started on the first call (nothing is built where nvcc is missing: the tests skip)."""
    global _started
    if _started is None:
        _started = Builds()
    return _started


def close() -> None:
    global _started
    if _started is not None:
        _started.close()
        _started = None
