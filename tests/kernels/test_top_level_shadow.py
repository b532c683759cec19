"""kernels/ at the top of the source tree is palestra.kernels; imported as a top-level `kernels` it says why.

`python -m ...` or `python -c` run from the repository root puts the root on sys.path. There the folder would
hide Hugging Face's `kernels` package, which transformers (>= 5.25) imports, and fail deep inside transformers.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_folder_as_top_level_kernels_names_the_cause() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", "import kernels"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and f"{ROOT / 'kernels'} is palestra.kernels" in last, done.stderr
    assert "python -P" in last


def test_the_installed_package_imports_under_its_own_name() -> None:
    import palestra.kernels

    assert palestra.kernels.__name__ == "palestra.kernels"
    assert callable(palestra.kernels.logprob_entropy)


def test_the_test_run_does_not_put_the_source_tree_on_sys_path() -> None:
    """The README's `pytest -q` keeps the root off sys.path, so transformers finds Hugging Face's `kernels`."""
    roots = [p for p in sys.path if Path(p or ".").resolve() == ROOT]
    assert not roots, "the repository root is on sys.path: run `pytest`, not `python -m pytest`, from the root"
