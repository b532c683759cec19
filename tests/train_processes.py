"""`palestra train` as a real child process, for the tests of what a user sees: a clean environment (no plugin or
torchrun variables, one thread), a live SIGINT, and the one line a failed command prints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml


def write_config(folder: Path, raw: dict[str, Any]) -> Path:
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def install_plugin(folder: Path, module: str, source: str, entry: str) -> Path:
    """`source` as an installed plugin distribution in `folder`: the module and a dist-info naming it as the
    `palestra` entry point `entry`, as pip would leave it (put `folder` on PYTHONPATH through `clean_env`)."""
    (folder / f"{module}.py").write_text(source)
    distribution = f"palestra-{entry.replace('_', '-')}-plugin"
    info = folder / f"{distribution.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[palestra]\n{entry} = {module}\n")
    return folder


def clean_env(site: Path | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PALESTRA_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")
    }
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(site) if site else "")
    return env


def _default_sigint() -> None:
    # A background job's SIGINT is ignored (and Palestra leaves an ignored signal ignored): give the run a live one.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(args: list[str], cwd: Path, site: Path | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "palestra", "train", *args],
        cwd=cwd,
        env=clean_env(site),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )


def palestra(
    args: list[str], cwd: Path, site: Path | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    proc = start(args, cwd, site)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command printed: stderr must be exactly that line, no traceback."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]
