"""Lazy, cached JIT builds of the C++ and CUDA back ends.

Nothing is compiled at import time: the first call that needs a native back end builds it with ninja
through ``torch.utils.cpp_extension.load`` and loads it with ``torch.ops.load_library``. The build
directory is keyed by a hash of the sources, flags and torch version, so a second process (or a second
test run) reuses the objects without recompiling. A failure raises :class:`KernelBuildError`, whose
message names the op whose source failed and the compiler's first error line.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = [
    "CPU_LIBRARY",
    "CUDA_LIBRARY",
    "KernelBuildError",
    "KernelCacheError",
    "NativeLibrary",
    "cache_dir_problem",
    "cache_root",
    "cpu_simd_level",
    "csrc_dir",
]


class KernelBuildError(RuntimeError):
    """A native back end could not be built or loaded. ``op`` names the op, ``reason`` says why."""

    def __init__(self, op: str, reason: str):
        self.op, self.reason = op, reason
        super().__init__(f"palestra kernel '{op}': {reason}")


class KernelCacheError(KernelBuildError):
    """The build cache is not a writable folder: no native library can be built or loaded, for any op."""

    def __init__(self, reason: str):
        super().__init__("all ops", reason)


def csrc_dir() -> Path:
    """The C++/CUDA sources: the repository's csrc/ (editable install) or the installed package data."""
    return Path(str(resources.files("palestra._csrc")))


def cache_root() -> Path:
    root = os.environ.get("PALESTRA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "palestra"
    )
    return Path(root) / "extensions"


def cache_dir_problem() -> str | None:
    """``None`` if the build cache (:func:`cache_root`) is a writable folder (created if missing), else one line
    naming ``PALESTRA_CACHE_DIR`` (or the default folder it would move) and why.

    Writable is what a build needs even when its objects are cached already: torch's JIT loader takes a lock
    file in the build folder and ninja rewrites its log there. The check creates and removes a probe file, so it
    holds for root too (whom permission bits do not stop, unlike a read-only mount)."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
        return None
    except OSError as e:
        why = e.strerror or type(e).__name__
        if isinstance(e, FileExistsError):  # mkdir(exist_ok=True) says so when a file holds the name
            why = "a file is in the way"
        env = os.environ.get("PALESTRA_CACHE_DIR")
        where = (
            f"PALESTRA_CACHE_DIR={env!r}"
            if env
            else f"the kernel cache {str(root)!r} (set PALESTRA_CACHE_DIR to move it)"
        )
        return f"{where}: not a writable folder ({why})"


# Which op each source file implements, so a compiler error can name the op. Files not listed
# (ops.cpp, shared headers) belong to every op.
def _op_of(source_name: str) -> str:
    stem = Path(source_name).stem.removesuffix("_binding")
    return stem if stem not in ("ops", "torch_names", "bindings") else "all ops"


@dataclass
class NativeLibrary:
    """One JIT-built shared object holding the implementations of every op for one device type."""

    name: str
    sources: tuple[str, ...]  # relative to csrc/; shell-style globs allowed
    cuda: bool = False

    def __post_init__(self):
        self._lock = threading.Lock()
        self._loaded = False
        self._error: KernelBuildError | None = None
        self._on_load: list = []

    # -- public -------------------------------------------------------------------------------
    def load(self) -> None:
        """Build (if needed) and load the library once per process; re-raise the first failure."""
        with self._lock:
            if self._loaded:
                return
            if self._error is not None:
                raise self._error
            try:
                self._build_and_load()
                self._loaded = True
            except KernelBuildError as e:
                self._error = e
                raise

    @property
    def loaded(self) -> bool:
        return self._loaded

    def source_files(self) -> list[Path]:
        root = csrc_dir()
        files: list[Path] = []
        for pattern in self.sources:
            files.extend(sorted(root.glob(pattern)))
        return files

    # -- internals -----------------------------------------------------------------------------
    def _flags(self) -> tuple[list[str], list[str], list[str]]:
        # -march=native is safe because the cache lives on the machine that compiled it, and the key
        # below includes the host's CPU flags.
        cflags = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-DPALESTRA_EXTENSION"]
        ldflags = ["-fopenmp"]
        cuda_flags = ["-O3", "--use_fast_math", "-lineinfo"] if self.cuda else []
        return cflags, cuda_flags, ldflags

    def _build_dir(self, files: list[Path]) -> Path:
        import torch

        h = hashlib.sha256()
        # Where the sources live counts too: ninja's build file records absolute paths, so two installs of the same
        # sources (a checkout and a copy) sharing one folder would rebuild over each other on every load.
        h.update(str(csrc_dir().resolve()).encode())
        headers = sorted(csrc_dir().rglob("*.h")) + sorted(csrc_dir().rglob("*.cuh"))
        for f in [*files, *headers]:  # a changed header must not load a stale cached build
            h.update(f.name.encode())
            h.update(f.read_bytes())
        parts = (*self._flags()[0], *self._flags()[1], torch.__version__, sys.version, _cpu_flags(), _ninja_version())
        for part in parts:
            h.update(part.encode())
        return cache_root() / f"{self.name}-{h.hexdigest()[:16]}"

    def _build_and_load(self) -> None:
        import torch
        from torch.utils import cpp_extension

        files = self.source_files()
        if not files:
            raise KernelBuildError("all ops", f"no sources for {self.name} under {csrc_dir()}")
        if self.cuda and not torch.cuda.is_available():
            raise KernelBuildError("all ops", "CUDA back end needs a CUDA build of torch and a visible GPU")
        if self.name != CPU_LIBRARY.name:
            CPU_LIBRARY.load()  # the schema (ops.cpp) lives in the CPU library
        problem = cache_dir_problem()
        if problem:  # a KernelBuildError, not an OSError from mkdir: ``auto`` falls back to torch on it
            raise KernelCacheError(problem)
        build_dir = self._build_dir(files)
        build_dir.mkdir(parents=True, exist_ok=True)
        cflags, cuda_flags, ldflags = self._flags()
        try:
            from torch.utils.cpp_extension import verify_ninja_availability

            verify_ninja_availability()
        except RuntimeError as e:
            raise KernelBuildError("all ops", f"ninja is not available ({e}); pip install ninja") from None
        # A first build takes tens of seconds (minutes for CUDA) before step 0 moves: say so, and how long it took.
        fresh = not (build_dir / f"{self.name}.so").is_file()
        kind = "CUDA" if self.cuda else "C++"
        if fresh:
            print(
                f"palestra: building the {kind} kernels ({self.name}; first run only)...", file=sys.stderr, flush=True
            )
        started = time.perf_counter()
        try:
            lib_path = cpp_extension.load(
                name=self.name,
                sources=[str(f) for f in files],
                extra_cflags=cflags,
                extra_cuda_cflags=cuda_flags,
                extra_ldflags=ldflags,
                extra_include_paths=[str(csrc_dir())],
                build_directory=str(build_dir),
                with_cuda=self.cuda,
                is_python_module=False,
                verbose=os.environ.get("PALESTRA_BUILD_VERBOSE") == "1",
            )
        except Exception as e:  # compiler errors arrive as RuntimeError/CalledProcessError with the log
            op, line = _first_error(str(e), files)
            raise KernelBuildError(op, f"{self.name} build failed: {line}") from e
        del lib_path  # load(is_python_module=False) has already run torch.ops.load_library on it
        if fresh:
            print(
                f"palestra: built the {kind} kernels in {time.perf_counter() - started:.1f} s (cached in {build_dir})",
                file=sys.stderr,
                flush=True,
            )
        for callback in self._on_load:
            callback()

    def on_load(self, callback) -> None:
        """Run ``callback`` once the library is loaded: ops register their fake and autograd
        formulas here, because ``torch.library`` needs the C++ schema to exist first."""
        self._on_load.append(callback)


def _ninja_version() -> str:
    """The version of the ninja on PATH (the one torch runs). Part of the cache key because two ninja versions
    each read the other's build log as stale and rebuild everything: a venv's ninja beside /usr/bin/ninja
    would otherwise rebuild one shared cache back and forth."""
    try:
        out = subprocess.run(["ninja", "--version"], capture_output=True, text=True, timeout=30, check=False)
        return f"ninja {out.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        return "ninja missing"


def _first_error(log: str, files: list[Path]) -> tuple[str, str]:
    """Pick the first compiler error out of a build log, and the op its file belongs to."""
    for line in log.splitlines():
        m = re.search(r"([\w./-]+\.(?:cpp|cu|h|cuh)):\d+(?::\d+)?: (?:fatal )?error", line)
        if m:
            return _op_of(m.group(1)), line.strip()
    for line in log.splitlines():
        if "error" in line.lower():
            return "all ops", line.strip()
    return "all ops", (log.strip().splitlines() or ["unknown error"])[-1]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor()


def cpu_simd_level() -> str:
    """Which inner loops the C++ ``logprob_entropy`` runs on this host: ``avx512``, ``avx2`` (with FMA) or
    ``portable``. The library is built with ``-march=native``, so this mirrors ``simd_level()`` in
    csrc/cpu/logprob_entropy.cpp: the host's flags, unless ``PALESTRA_CPU_PORTABLE=1`` forces the portable loops."""
    if os.environ.get("PALESTRA_CPU_PORTABLE") == "1":
        return "portable"
    flags = set(_cpu_flags().split())
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "portable"


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (``AMD EPYC 9B14``), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_bf16_kind() -> str:
    """How this CPU multiplies bf16 matrices: ``amx`` (Intel AMX tiles, the fast path oneDNN takes), ``avx512_bf16``
    (AVX-512 dot-product instructions, no AMX) or ``emulated`` (neither: bf16 is converted to float32 first)."""
    flags = set(_cpu_flags().split())
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return "emulated"


# The schema and every CPU implementation; built on first use of a cpp back end.
CPU_LIBRARY = NativeLibrary("palestra_cpu", ("ops.cpp", "cpu/*.cpp"))
# CUDA kernels (torch-free .cu files) and their thin torch bindings; needs a CUDA torch.
CUDA_LIBRARY = NativeLibrary("palestra_cuda", ("cuda/*.cu", "cuda/*_binding.cpp"), cuda=True)
