"""MAPPO on the shared learner loop, at scale: a real 2-process torchrun (DDP over gloo), FSDP2, and a SIGKILL
followed by ``--resume``. MAPPO's per-agent running statistics must be the same on every rank and the same as one
process's over the global batch; the ranks must end with bitwise equal weights and critics; a killed run must
resume to exactly the run that never stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "customer_service_mappo.yaml"
SMALL = [
    "train.batch_size=4",
    "train.group_size=2",
    "train.eval_size=4",
    "train.device=cpu",
    "train.log_every=1",
    "kernels.backend=torch",  # no native build in the subprocesses: the eager kernels
    "loggers=[{name: jsonl, options: {filename: log.jsonl}}]",  # not metrics.jsonl: no plot at the end
    "distributed.backend=gloo",
    "run.output_dir=runs",
]


def clean_env(sites: list[Path], **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PALESTRA_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")
    }
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(str(s) for s in sites), **extra)
    return env


def torchrun(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_per_agent_moments_are_merged_over_ranks_as_one_process_would(tmp_path: Path) -> None:
    out = torchrun(
        [str(REPO / "tests" / "core" / "scripts" / "mappo_moments.py"), str(tmp_path / "out")], tmp_path, clean_env([])
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == 2
    assert r0["distributed"] == r1["distributed"], "the ranks' per-agent statistics differ"
    single = r0["single"]
    assert r0["distributed"]["agents"] == single["agents"] == ["router", "responder", "auditor"]
    assert set(single) == set(r0["distributed"]) and any(k.endswith("count") for k in single)
    for key, want in single.items():
        if key == "agents" or key.endswith(".synced"):  # synced: what the last all-reduce merged (rank bookkeeping)
            continue
        got = r0["distributed"][key]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-9, atol=1e-9, msg=key)
    counts = single["reward.count"]
    assert sum(counts) == 3 * 12  # every rank's rows counted once


def dump(folder: Path) -> tuple[dict, dict]:
    return tuple(torch.load(folder / f"rank{r}.pt", weights_only=False) for r in (0, 1))  # type: ignore[return-value]


def assert_ranks_agree(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), "the ranks' weights differ"
    ea, eb = a["extra"], b["extra"]
    assert ea["agents"] == eb["agents"] and len(ea["agents"]) >= 2
    for part in ("reward_moments", "value_normalizer"):
        sa, sb = ea[part], eb[part]
        assert sa.keys() == sb.keys()
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert torch.equal(sa[k], sb[k]), f"{part}.{k} differs between the ranks"
    assert all(torch.equal(ea["critic"][k], eb["critic"][k]) for k in ea["critic"]), "the ranks' critics differ"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_mappo_trains_on_two_ranks_with_identical_weights_critics_and_statistics(
    tmp_path: Path, sites: dict[str, Path], strategy: str
) -> None:
    env = clean_env([sites["fault"]], PALESTRA_TEST_DUMP_PARAMS=str(tmp_path / "dump"))
    out = torchrun(
        [
            "-m",
            "palestra",
            "train",
            "--config",
            str(EXAMPLE),
            *SMALL,
            "train.steps=4",
            f"distributed.strategy={strategy}",
        ],
        tmp_path,
        env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"gloo, {strategy}" in out.stdout
    a, b = dump(tmp_path / "dump")
    assert_ranks_agree(a, b)
    saved = torch.load(tmp_path / "runs" / "customer_service_mappo" / "checkpoint.pt", weights_only=False)
    assert all(torch.equal(saved["policy"][k], a["params"][k]) for k in a["params"])  # a full, unsharded state
    assert {"shared", "critic"} < set(saved["optimizer"]["optimizers"])  # per-agent optimisers, gathered in full
    lines = [
        json.loads(x) for x in (tmp_path / "runs" / "customer_service_mappo" / "log.jsonl").read_text().splitlines()
    ]
    steps = [m for m in lines if "train/skipped" in m]
    assert len(steps) == 4 and all(m["train/skipped"] == 0.0 for m in steps)
    assert all(m["grad/norm/critic"] > 0 for m in steps)


def test_mappo_killed_mid_run_resumes_bitwise(tmp_path: Path) -> None:
    args = ["--config", str(EXAMPLE), *SMALL, "train.steps=6", "train.save_every=2"]
    env = clean_env([])
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    whole = subprocess.Popen(
        [sys.executable, "-m", "palestra", "train", *args],
        cwd=tmp_path / "a",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    killed = subprocess.Popen(
        [sys.executable, "-m", "palestra", "train", *args],
        cwd=tmp_path / "b",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_a, run_b = (
        tmp_path / "a" / "runs" / "customer_service_mappo",
        tmp_path / "b" / "runs" / "customer_service_mappo",
    )
    wanted = run_b / "checkpoints" / "step-000004.pt"
    deadline = time.monotonic() + 240
    while not wanted.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (run_b / "checkpoint.pt").exists(), "the run finished before the kill; nothing was resumed"
    _, err = whole.communicate(timeout=300)
    assert whole.returncode == 0, err[-3000:]
    resumed = subprocess.run(
        [sys.executable, "-m", "palestra", "train", "--resume", str(run_b), "train.steps=6"],
        cwd=tmp_path / "b",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = torch.load(run_a / "checkpoint.pt", weights_only=False)
    b = torch.load(run_b / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"]), "weights differ after resume"
    ea, eb = a["optimizer"]["extra"], b["optimizer"]["extra"]
    assert all(torch.equal(ea["critic"][k], eb["critic"][k]) for k in ea["critic"]), "critics differ after resume"
    assert ea["counters"] == eb["counters"]
    for name, state in a["optimizer"]["optimizers"].items():
        other = b["optimizer"]["optimizers"][name]["state"]
        assert all(
            torch.equal(v, other[i][k])
            for i, s in state["state"].items()
            for k, v in s.items()
            if isinstance(v, torch.Tensor)
        )

    def strip(p: Path) -> list[dict[str, Any]]:
        return [
            {k: v for k, v in json.loads(x).items() if k != "time" and not k.startswith("perf/")}
            for x in (p / "log.jsonl").read_text().splitlines()
        ]

    assert strip(run_a) == strip(run_b)


@pytest.fixture(autouse=True)
def _no_inherited_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)


def test_mappo_under_fsdp2_resumes_bitwise_from_a_mid_run_checkpoint(tmp_path: Path) -> None:
    """Saving mid-window (the shared layers' optimiser has not stepped yet) must not perturb the run, and a resume from
    that step file must end bitwise where the uninterrupted run ends: weights, critic, the shared-gradient window."""
    env = clean_env([])
    base = ["-m", "palestra", "train", "--config", str(EXAMPLE), *SMALL, "train.steps=6", "distributed.strategy=fsdp"]
    for name in ("saved", "straight"):
        (tmp_path / name).mkdir()
    out = torchrun([*base, "train.save_every=3"], tmp_path / "saved", env)
    assert out.returncode == 0, out.stderr[-3000:]
    out = torchrun(base, tmp_path / "straight", env)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "saved" / "runs" / "customer_service_mappo"
    straight = torch.load(
        tmp_path / "straight" / "runs" / "customer_service_mappo" / "checkpoint.pt", weights_only=True
    )
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    assert all(torch.equal(saved["policy"][k], straight["policy"][k]) for k in straight["policy"]), (
        "saving changed the run"
    )
    (run / "checkpoint.pt").unlink()  # as if the run had died after its step-3 checkpoint
    out = torchrun(["-m", "palestra", "train", "--resume", str(run), "train.steps=6"], tmp_path / "saved", env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "from " + str(run / "checkpoints" / "step-000003.pt") in out.stdout
    resumed = torch.load(run / "checkpoint.pt", weights_only=True)
    assert all(torch.equal(resumed["policy"][k], straight["policy"][k]) for k in straight["policy"]), "weights differ"
    ea, eb = resumed["optimizer"]["extra"], straight["optimizer"]["extra"]
    assert all(torch.equal(ea["critic"][k], eb["critic"][k]) for k in eb["critic"]), "critics differ"
    assert len(ea["shared_accum"]) > 0 and all(
        torch.equal(a, b) for a, b in zip(ea["shared_accum"], eb["shared_accum"])
    )
    assert ea["counters"] == eb["counters"]
