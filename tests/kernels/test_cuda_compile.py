"""The CUDA kernels compile for Hopper (sm_90). Nothing CUDA runs on the CI machine, but nvcc does.

The .cu files are free of torch headers (the CPU torch wheel ships none of torch's CUDA headers), so
they compile on their own; their torch bindings (cuda/*_binding.cpp) are built only where a CUDA torch is.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from palestra.kernels.build import csrc_dir

pytestmark = [pytest.mark.slow, pytest.mark.native]

NVCC = shutil.which("nvcc")
CU_FILES = sorted((csrc_dir() / "cuda").glob("*.cu"))


def test_every_op_has_a_cuda_kernel():
    names = {f.stem for f in CU_FILES}
    assert {"logprob_entropy", "advantages", "reward_norm"} <= names, names


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cuda_kernel_compiles_for_sm90(source: Path, tmp_path: Path):
    obj = tmp_path / (source.stem + ".o")
    cmd = [NVCC, "-std=c++17", "-O3", "-arch=sm_90", "-I", str(csrc_dir()), "-c", str(source), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc failed for {source.name}:\n{proc.stderr[-4000:]}"
    assert obj.stat().st_size > 0
    # The kernels must not pull in torch: that is what lets them build without a CUDA torch.
    text = source.read_text()
    for forbidden in ("torch/", "ATen/", "c10/"):
        assert forbidden not in text, f"{source.name} includes a {forbidden} header"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_bindings_exist_for_every_kernel():
    for cu in CU_FILES:
        binding = cu.with_name(cu.stem + "_binding.cpp")
        assert binding.exists(), f"{cu.name} has no torch binding {binding.name}"
        assert "TORCH_LIBRARY_IMPL(palestra, CUDA" in binding.read_text()


def _cuda_torch_include() -> list[str] | None:
    """Include paths of a CUDA build of torch: this one's, or the headers named by PALESTRA_CUDA_TORCH_INCLUDE
    (a CUDA torch wheel's ``torch/include``, unpacked), so the bindings can be checked on a CPU-only machine."""
    import os

    import torch

    root = os.environ.get("PALESTRA_CUDA_TORCH_INCLUDE")
    if root:
        return [root, os.path.join(root, "torch", "csrc", "api", "include")]
    if torch.version.cuda:
        from torch.utils.cpp_extension import include_paths

        return include_paths(device_type="cuda")
    return None


CUDA_TORCH_INCLUDE = _cuda_torch_include()


def _cuda_toolkit_include() -> Path | None:
    import os

    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    homes.append(str(Path(NVCC).resolve().parent.parent) if NVCC else None)
    for home in filter(None, homes):
        if (Path(home) / "include" / "cuda_runtime_api.h").exists():
            return Path(home) / "include"
    return None


CUDA_HOME_INCLUDE = _cuda_toolkit_include()


@pytest.mark.skipif(
    CUDA_TORCH_INCLUDE is None or CUDA_HOME_INCLUDE is None, reason="needs a CUDA torch's headers and the CUDA toolkit"
)
@pytest.mark.parametrize("binding", sorted((csrc_dir() / "cuda").glob("*_binding.cpp")), ids=lambda p: p.name)
def test_cuda_binding_compiles_against_a_cuda_torch(binding: Path, tmp_path: Path):
    cmd = [
        "g++",
        "-std=c++20",
        "-fPIC",
        "-c",
        str(binding),
        "-o",
        str(tmp_path / "binding.o"),
        "-I",
        str(binding.parent),
        "-I",
        str(csrc_dir()),
    ]
    for inc in [*CUDA_TORCH_INCLUDE, str(CUDA_HOME_INCLUDE)]:
        cmd += ["-I", inc]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{binding.name} does not compile:\n{proc.stderr[-4000:]}"
