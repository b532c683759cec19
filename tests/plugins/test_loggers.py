"""The built-in loggers: console, jsonl, tensorboard and wandb, each writing for real into a temporary run directory."""

from __future__ import annotations

import json
import math
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from palestra import MissingDependency
from palestra.cli.dashboard import MetricsFileWarning, read_metrics
from palestra.config import ConfigError, build_component
from palestra.plugin_manager import get_registry
from palestra.plugins.loggers.tensorboard import TensorBoardLogger
from palestra.plugins.loggers.wandb import WandbLogger

CONFIG = {"run": {"name": "demo", "seed": 0}, "train": {"steps": 25, "lr": 1e-4}}


def logger(name: str, **options: Any) -> Any:
    return build_component("logger", {"name": name, "options": options}, path="loggers[0]")


def metrics_at(step: int) -> dict[str, float]:
    """Distinct, non-round values per step, so a value found in the output can only have come from this step."""
    return {
        "reward/mean": 0.5 + step / 64,
        "reward/ema": 0.25 + step / 128,
        "policy/entropy": 2.0 - step / 32,
        "policy/kl": step / 1024,
        "grad/norm": 1.0 + step / 16,
        "loss": -0.125 * step,
    }


def test_the_four_loggers_are_registered_by_palestra() -> None:
    registry = get_registry()
    assert {"console", "jsonl", "tensorboard", "wandb"} <= set(registry.names("logger"))
    for name in ("console", "jsonl", "tensorboard", "wandb"):
        reg = registry.get("logger", name)
        assert reg.distribution == "palestra" and reg.options is not None and reg.description
        built = logger(name)
        assert all(callable(getattr(built, method, None)) for method in ("open", "log", "close"))  # the Logger protocol


# ---- jsonl -------------------------------------------------------------------------------------------
def test_jsonl_lines_round_trip_with_step_time_and_null_for_non_finite(tmp_path: Path) -> None:
    import numpy as np
    import torch

    log = logger("jsonl")
    log.open(tmp_path, CONFIG)
    before = time.time()
    log.log(metrics_at(1), step=1)
    log.log(
        {"reward/mean": math.nan, "grad/norm": math.inf, "count": 3, "np": np.float32(0.5), "t": torch.tensor(0.25)},
        step=2,
    )
    # each line is flushed at once: readable while the logger is still open (a crash keeps it)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first == {"step": 1, "time": first["time"], **metrics_at(1)}
    assert list(first)[:2] == ["step", "time"] and before - 1 <= first["time"] <= time.time() + 1
    assert second == {
        "step": 2,
        "time": second["time"],
        "reward/mean": None,
        "grad/norm": None,
        "count": 3,
        "np": 0.5,
        "t": 0.25,
    }
    assert "NaN" not in lines[1] and "Infinity" not in lines[1]
    log.close()


def test_jsonl_appends_on_resume_and_survives_a_line_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = logger("jsonl")
    log.open(tmp_path, CONFIG)
    log.log(metrics_at(1), step=1)
    log.close()
    with path.open("a") as f:  # what a crash in the middle of a write leaves behind
        f.write('{"step": 2, "reward/me')
    log = logger("jsonl")
    log.open(tmp_path, CONFIG)
    log.log(metrics_at(3), step=3)
    log.close()
    with pytest.warns(MetricsFileWarning, match="skipped 1 unreadable line"):
        records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 3]
    assert records[1]["reward/mean"] == metrics_at(3)["reward/mean"]


def test_jsonl_rejects_bad_input_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^loggers\[0\]\.options\.filename: .*'\.\./out\.jsonl'"):
        logger("jsonl", filename="../out.jsonl")
    log = logger("jsonl", filename="logs/m.jsonl")
    log.open(tmp_path, CONFIG)
    with pytest.raises(ValueError, match="metric name 'step' is reserved"):
        log.log({"step": 1.0}, step=1)
    with pytest.raises(TypeError, match="metric 'reward/mean' must be a number, got list"):
        log.log({"reward/mean": [1.0]}, step=1)
    log.log({"x": 1.0}, step=1)
    log.close()
    assert json.loads((tmp_path / "logs" / "m.jsonl").read_text())["x"] == 1.0


# ---- console -----------------------------------------------------------------------------------------
def test_console_writes_plain_lines_with_key_metrics_when_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = logger("console", every=10)
    log.open(tmp_path / "demo", CONFIG)
    for step in range(1, 26):
        log.log(metrics_at(step), step=step)
    log.close()
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    # the first step, then each multiple of 10, then the last step (train.steps = 25)
    assert [line.split()[1] for line in lines] == ["1/25", "10/25", "20/25", "25/25"]
    assert "\r" not in err and "(100%)" in lines[-1] and "s/step" in lines[-1]
    m = metrics_at(25)
    assert f"reward {m['reward/mean']:.4g}" in lines[-1] and f"ema {m['reward/ema']:.4g}" in lines[-1]
    assert f"ent {m['policy/entropy']:.4g}" in lines[-1] and f"kl {m['policy/kl']:.4g}" in lines[-1]
    assert f"gnorm {m['grad/norm']:.4g}" in lines[-1]


def test_console_keys_option_and_the_final_line_on_close(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = logger("console", keys=["loss", "reward/*"], every=100)
    log.open(tmp_path, {})  # no train.steps: no total, no percentage
    for step in range(1, 6):
        log.log({**metrics_at(step), "reward/format": step / 8}, step=step)
    log.close()  # step 5 was not yet shown: close shows it
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == ["1", "5"]
    m = metrics_at(5)
    # "loss", then the reward/* keys in sorted order, under their short names where they have one
    assert (
        lines[-1].split(" | ")[1]
        == f"loss -0.625 ema {m['reward/ema']:.4g} reward/format 0.625 reward {m['reward/mean']:.4g}"
    )
    assert "ent " not in lines[-1]  # not among the chosen keys


def test_console_numbers_stay_short() -> None:
    from palestra.plugins.loggers.console import format_value

    got = [format_value(v) for v in (0.0, 3, 0.123456, -0.125, 12345.6, 2.5e-5, 3e12, math.nan, math.inf)]
    assert got == ["0", "3", "0.1235", "-0.125", "12346", "2.500e-05", "3.000e+12", "nan", "inf"]


def test_console_bar_mode_draws_a_tqdm_bar_with_the_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = logger("console", mode="bar")
    log.open(tmp_path / "demo", CONFIG)
    for step in range(1, 26):
        log.log(metrics_at(step), step=step)
    log.close()
    err = capsys.readouterr().err
    assert "demo" in err and "25/25" in err and "100%" in err
    assert f"reward {metrics_at(25)['reward/mean']:.4g}" in err


# ---- tensorboard -------------------------------------------------------------------------------------
def test_tensorboard_event_files_read_back_with_the_logged_values(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = logger("tensorboard")
    log.open(tmp_path, CONFIG)
    for step in (1, 2, 5):
        log.log(metrics_at(step), step=step)
    log.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(metrics_at(1))
    for key in metrics_at(1):
        got = acc.Scalars(key)
        assert [e.step for e in got] == [1, 2, 5]
        assert [e.value for e in got] == pytest.approx([metrics_at(s)[key] for s in (1, 2, 5)], rel=1e-6)


def test_missing_optional_packages_are_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules is how Python marks a module as unimportable: the real import statement fails.
    for module in ("tensorboard", "torch.utils.tensorboard", "wandb"):
        monkeypatch.setitem(sys.modules, module, None)
    for name in ("tensorboard", "wandb"):
        with pytest.raises(ConfigError) as info:  # the config naming it is refused before anything is built
            logger(name)
        assert str(info.value) == (
            f"loggers[0].name: logger {name!r} needs the Python package {name!r}, which is not "
            f'installed; install it with: pip install "palestra[{name}]"'
        )
    with pytest.raises(
        MissingDependency
    ) as missing:  # building it directly (installed but broken): the one error class
        TensorBoardLogger()
    assert str(missing.value) == (
        "the tensorboard logger needs the Python package 'tensorboard', which fails to import (import of "
        'torch.utils.tensorboard halted; None in sys.modules); install it with: pip install "palestra[tensorboard]"'
    )
    with pytest.raises(
        MissingDependency, match=r"^the wandb logger needs the Python package 'wandb', which is not installed; "
    ):
        WandbLogger()


# ---- wandb -------------------------------------------------------------------------------------------
class _Listener:
    """A local TCP server that counts connections: the only address the test leaves wandb for any network use."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.1)
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.mark.slow
def test_wandb_offline_writes_under_the_run_dir_without_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener = _Listener()
    try:
        # Any request wandb made (to its server, or through a proxy to anywhere) would reach the listener.
        for var in ("WANDB_BASE_URL", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
            monkeypatch.setenv(var, listener.url)
        for var in ("NO_PROXY", "no_proxy", "WANDB_API_KEY"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("WANDB_MODE", "offline")
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
        run_dir = tmp_path / "runs" / "demo"
        start = time.monotonic()
        log = logger("wandb", project="palestra-test")
        log.open(run_dir, CONFIG)
        for step in range(1, 4):
            log.log({**metrics_at(step), "odd": math.nan}, step=step)
        log.close()
        elapsed = time.monotonic() - start
    finally:
        listener.close()
    assert listener.connections == 0
    assert elapsed < 20, f"an offline wandb run took {elapsed:.1f}s (was it waiting on the network?)"
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    data = b"".join(p.read_bytes() for p in runs[0].glob("run-*.wandb"))
    # the transaction log holds the metric names and the JSON of their values, the run's name and config
    for needle in (
        b"reward/mean",
        b"policy/kl",
        b"demo",
        b"palestra-test",
        json.dumps(metrics_at(3)["reward/mean"]).encode(),
    ):
        assert needle in data
