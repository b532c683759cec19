"""Tool-use runs under every guarantee a run has: a run killed mid-episode resumes bitwise, torchrun with two ranks,
LoRA export, and the watchdog (a tool that hangs is the tool's timeout, not a stall).

A random tiny policy never writes a well-formed call, so these runs read calls with a test parser that makes one from
any turn not starting with a digit: episodes of 1-3 turns, each call really run, its result in the next prompt.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from train_processes import clean_env, install_plugin, write_config

from palestra.engine import checkpoint as ckpt

pytestmark = pytest.mark.slow

PLUGIN = "palestra_tool_runs_plugin"
PLUGIN_SOURCE = textwrap.dedent(
    '''
    import time
    from dataclasses import dataclass

    from palestra import hookimpl
    from palestra.tools import ParsedTurn, Tool, ToolCall


    class EagerParser:
        """A turn that starts with a digit is the answer; any other turn calls add (or nap, when it has a "-")."""

        def parse(self, text):
            if text[:1].isdigit():
                return ParsedTurn()
            if "-" in text:
                return ParsedTurn(calls=[ToolCall("nap", {})])
            return ParsedTurn(calls=[ToolCall("add", {"a": len(text), "b": 1})])

        def describe(self, tools):
            return "Call a tool, or answer with a number."


    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b


    @dataclass
    class NapOptions:
        seconds: float = 0.02
        timeout_s: float = 10.0


    def nap_tool(seconds=0.02, timeout_s=10.0):
        def nap() -> str:
            """Sleep a while."""
            time.sleep(seconds)
            return "rested"

        return Tool.from_function(nap, timeout_s=timeout_s)


    @hookimpl
    def register_tools(register):
        register("add", lambda: Tool.from_function(add), description="adds two integers (a test tool)")
        register("nap", nap_tool, options=NapOptions, description="sleeps (a test tool)")


    @hookimpl
    def register_tool_parsers(register):
        register("eager", EagerParser, description="every turn not starting with a digit is a call (a test parser)")
    '''
)
TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_len": 512, "init_std": 0.02, "seed": None}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_plugin(tmp_path_factory.mktemp("tool-runs-plugin"), PLUGIN, PLUGIN_SOURCE, "tool_runs")


def config(folder: Path, *, nap: dict[str, float] | None = None, **train: Any) -> Path:
    raw = {
        "run": {"name": "r", "seed": 0, "output_dir": "runs"},
        "environment": {"name": "arithmetic", "options": {"difficulty": 1, "prompt": "{question} ="}},
        "reward": {"name": "weighted_sum", "options": {"components": [
            {"name": "correctness", "options": {"tag": None}}, {"name": "tool_format", "weight": 0.5}]}},
        "policy": {"name": "tiny", "options": TINY},
        "optimizer": {"name": "grpo"},
        "kernels": {"backend": "torch"},
        "loggers": [{"name": "jsonl", "options": {"filename": "log.jsonl"}}],
        "tools": {"tools": [{"name": "add"}, {"name": "nap", "options": nap or {}}], "parser": {"name": "eager"},
                  "max_tool_calls": 2, "max_tokens": 120},
        "train": {"steps": 6, "batch_size": 4, "group_size": 2, "lr": 1e-2, "max_new_tokens": 6,
                  "temperature": 1.0, "device": "cpu", "eval_size": 4, "save_every": 0, **train},
    }  # fmt: skip
    return write_config(folder, raw)


def train(args: list[str], cwd: Path, site: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "palestra", "train", *args], cwd=cwd, env=clean_env(site),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def finished(proc: subprocess.Popen[str], timeout: float = 240) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def log(run_dir: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]
    timed = ("time", "tools/latency_s")  # wall-clock figures: they differ between any two runs
    return [{k: v for k, v in m.items() if k not in timed and not k.startswith("perf/")} for m in lines]


def test_a_tool_run_killed_mid_episode_resumes_bitwise(tmp_path: Path, site: Path) -> None:
    # each call naps 50 ms, so most of a step is spent inside episodes, between turns: that is where the kill lands
    path = config(tmp_path, nap={"seconds": 0.05}, save_every=2)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = train(["--config", str(path)], tmp_path / "a", site)
    killed = train(["--config", str(path)], tmp_path / "b", site)
    run_a, run_b = tmp_path / "a" / "runs" / "r", tmp_path / "b" / "runs" / "r"
    wanted = run_b / "checkpoints" / ckpt.step_name(2)
    deadline = time.monotonic() + 240
    while not wanted.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.3)  # into the next step's episodes
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    out = finished(whole)
    assert "trajectory: one token sequence per episode" in out
    # components of a third-party plugin run its code: a checkpoint's config names them only when the user does again
    again = ["tools.tools[0].name=add", "tools.tools[1].name=nap", "tools.parser.name=eager"]
    finished(train(["--resume", str(run_b), *again], tmp_path / "b", site))

    a, b = ckpt.load_checkpoint(run_a / ckpt.FINAL_NAME), ckpt.load_checkpoint(run_b / ckpt.FINAL_NAME)
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"]), "parameters differ after resume"
    assert log(run_a) == log(run_b)
    steps = [m for m in log(run_a) if "tools/calls_per_episode" in m]
    assert len(steps) == 6 and sum(m["tools/calls_per_episode"] for m in steps) > 0  # tools really ran


def test_a_tool_that_hangs_is_its_timeout_not_a_stall(tmp_path: Path, site: Path) -> None:
    # nap sleeps 60 s with a 0.5 s timeout; the step watchdog (5 s) never fires, the run finishes
    path = config(tmp_path, nap={"seconds": 60.0, "timeout_s": 0.5}, steps=3, step_timeout_s=20)
    started = time.monotonic()
    finished(train(["--config", str(path)], tmp_path, site), timeout=180)
    assert time.monotonic() - started < 150
    steps = [m for m in log(tmp_path / "runs" / "r") if "tools/calls_per_episode" in m]
    assert len(steps) == 3 and max(m["tools/error_rate/timeout"] for m in steps) > 0


@pytest.mark.distributed
def test_a_tool_run_on_two_torchrun_ranks(tmp_path: Path, site: Path) -> None:
    path = config(tmp_path, steps=3)
    raw = yaml.safe_load(path.read_text())
    raw["distributed"] = {"strategy": "ddp", "backend": "gloo", "timeout_s": 60.0}
    path.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "palestra", "train", "--config", str(path)]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, env=clean_env(site), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trajectory: one token sequence per episode" in out.stdout
    steps = [m for m in log(tmp_path / "runs" / "r") if "tools/calls_per_episode" in m]
    assert len(steps) == 3 and sum(m["tools/calls_per_episode"] for m in steps) > 0


def test_a_lora_tool_run_exports(tmp_path: Path, site: Path) -> None:
    pytest.importorskip("peft")
    import tiny_hf

    model = tiny_hf.build_llama(tmp_path / "llama")
    path = config(tmp_path, steps=2, export=True)
    raw = yaml.safe_load(path.read_text())
    raw["policy"] = {"name": "hf", "options": {"path": str(model), "lora": {"r": 4, "alpha": 8}}}
    path.write_text(yaml.safe_dump(raw))
    out = finished(train(["--config", str(path)], tmp_path, site))
    assert "trajectory: one token sequence per episode" in out
    exported = tmp_path / "runs" / "r" / "export"
    assert (exported / "config.json").is_file() and list(exported.glob("*.safetensors"))
