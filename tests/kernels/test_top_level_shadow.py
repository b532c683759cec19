"""Python run from the repository root finds Hugging Face's `kernels`, which transformers (>= 5.25) imports.

`python -m ...` and `python -c` put the current folder on sys.path. The root's kernels/ folder (palestra.kernels)
has no __init__.py, so there it is only a namespace portion and the installed `kernels` package wins; with an
__init__.py it hid that package and transformers failed to import.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def from_root(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what `python` itself puts on sys.path
    env.update(OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_transformers_imports_from_the_repository_root() -> None:
    # AutoModelForCausalLM alone is a lazy name that imports nothing yet; PreTrainedModel imports what loading a
    # model imports, Hugging Face's `kernels` among them
    done = from_root("-c", "from transformers import AutoModelForCausalLM, PreTrainedModel", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_python_m_pytest_collects_from_the_repository_root() -> None:
    done = from_root("-m", "pytest", "--co", "-q", timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert " tests collected" in done.stdout.splitlines()[-1], done.stdout[-3000:]
