"""Multi-process training with a real torchrun (``python -m torch.distributed.run``), 2 CPU ranks over gloo.

Each run is tiny and single-threaded per rank. Checked: every rank ends with bitwise identical parameters (and
identical running reward statistics), the run learns the answer format, FSDP2 (``fully_shard``) trains on the
CPU too, a dead rank ends the job within ``distributed.timeout_s`` instead of hanging, and an uneven split of
``train.batch_size`` is a one-line error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

import pytest
import torch
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_len": 256, "init_std": 0.02, "seed": None}


def write_config(
    folder: Path,
    *,
    algorithm: str,
    options: dict[str, Any],
    train: dict[str, Any],
    strategy: str = "ddp",
    timeout_s: float = 60.0,
) -> Path:
    raw = {
        "run": {"name": "dist", "seed": 0, "output_dir": str(folder / "runs")},
        "environment": {"name": "arithmetic",
                        "options": {"difficulty": 1, "terms": 2, "operations": ["+"], "prompt": "{question} ="}},
        "reward": {"name": "format", "options": {"tag": "answer"}},
        "policy": {"name": "tiny", "options": TINY},
        "optimizer": {"name": algorithm, "options": options},
        "generator": {"name": "kv_cache"},
        "kernels": {"backend": "torch"},  # no native build in the subprocesses: the eager kernels
        "loggers": [{"name": "jsonl", "options": {"filename": "log.jsonl"}}],  # not metrics.jsonl: no plot at the end
        "train": {"batch_size": 16, "group_size": 4, "lr": 1e-2, "max_new_tokens": 6, "temperature": 1.0,
                  "device": "cpu", "eval_size": 8, "save_every": 0, **train},
        "distributed": {"strategy": strategy, "backend": "gloo", "timeout_s": timeout_s},
    }  # fmt: skip
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def torchrun(
    args: list[str], cwd: Path, *, timeout: float = 120, sites: tuple[Path, ...] = (), **env_vars: str
) -> subprocess.CompletedProcess[str]:
    """``palestra train ARGS`` on 2 ranks; ``sites``: plugin install folders (the fault-injection plugin) to add."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PALESTRA_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")
    }
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(str(s) for s in sites), **env_vars)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "palestra",
        "train",
        *args,
    ]
    return subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def rewards(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [m["reward/mean"] for m in lines if "reward/mean" in m]


# Single-process runs of the same settings (seeds 0 and 1): first five steps' mean reward 0.01-0.07, steps 15-20
# 0.64-0.90 (reinforce and grpo). Two ranks play other tasks (a seed stream per rank) but learn alike.
def assert_learns(values: list[float]) -> None:
    first, last = mean(values[:5]), mean(values[-5:])
    assert first <= 0.2 and last >= 0.4 and last - first >= 0.3, values


def test_ddp_on_two_cpu_ranks_keeps_identical_weights_and_learns(tmp_path: Path, sites: dict[str, Path]) -> None:
    # reinforce: its running reward statistics must be merged over the ranks, too.
    options = {"normalize": True, "norm_clip": 5.0, "baseline": "none", "entropy_coef": 0.0}
    config = write_config(tmp_path, algorithm="reinforce", options=options, train={"steps": 20})
    dump = tmp_path / "dump"
    started = time.perf_counter()
    out = torchrun(["--config", str(config)], tmp_path, sites=(sites["fault"],), PALESTRA_TEST_DUMP_PARAMS=str(dump))
    seconds = time.perf_counter() - started
    assert out.returncode == 0, out.stderr[-3000:]
    assert "distributed: 2 ranks, gloo, ddp, 8 tasks per rank" in out.stdout
    assert out.stdout.count("trained 20 steps") == 1  # rank 0 alone reports
    a, b = (torch.load(dump / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert a["params"].keys() == b["params"].keys()
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    ma, mb = a["extra"]["moments"], b["extra"]["moments"]
    assert all(torch.equal(ma[k], mb[k]) for k in ("count", "mean", "m2"))
    assert float(ma["count"].sum()) == 20 * 16 * 4  # every rank's rows counted once, on every rank
    run_dir = tmp_path / "runs" / "dist"
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert all(torch.equal(saved["policy"][k], a["params"][k]) for k in a["params"])
    assert len(saved["rng"]) == 2 and saved["world_size"] == 2
    assert_learns(rewards(run_dir))
    print(f"ddp 2 ranks, 20 steps: {seconds:.1f} s")


def test_async_rollouts_give_each_ddp_rank_its_own_worker_and_the_ranks_stay_identical(
    tmp_path: Path, sites: dict[str, Path]
) -> None:
    config = write_config(
        tmp_path, algorithm="grpo", options={"entropy_coef": 0.0}, train={"steps": 30, "async": {"lag": 1}}
    )
    dump = tmp_path / "dump"
    out = torchrun(["--config", str(config)], tmp_path, sites=(sites["fault"],), PALESTRA_TEST_DUMP_PARAMS=str(dump))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sampling 1 step ahead of the learner" in out.stderr  # rank 0's worker, said once
    a, b = (torch.load(dump / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    lines = [json.loads(line) for line in (tmp_path / "runs" / "dist" / "log.jsonl").read_text().splitlines()]
    assert [m["rollout/policy_lag"] for m in lines if "rollout/policy_lag" in m] == [0.0] + [1.0] * 29
    assert_learns(rewards(tmp_path / "runs" / "dist"))


def test_a_rank_whose_rollout_worker_fails_ends_the_job_and_names_the_checkpoint_to_resume_from(
    tmp_path: Path,
) -> None:
    """A save is collective, and the other rank is elsewhere: the failing rank says where the run resumes."""
    from test_async_rollouts import HANG_PLUGIN, HANG_SOURCE
    from train_processes import install_plugin

    (tmp_path / "site").mkdir()
    site = install_plugin(tmp_path / "site", HANG_PLUGIN, HANG_SOURCE, "async_hang")
    config = write_config(
        tmp_path, algorithm="grpo", options={}, train={"steps": 6, "save_every": 1, "async": {"lag": 1}}
    )
    raw = yaml.safe_load(config.read_text())
    raw["environment"] = {"name": "hanging", "options": {**raw["environment"]["options"], "fail": True, "hang_at": 4}}
    config.write_text(yaml.safe_dump(raw))
    started = time.monotonic()
    out = torchrun(["--config", str(config)], tmp_path, sites=(site,))
    assert out.returncode != 0, out.stderr[-3000:]
    assert time.monotonic() - started < 100  # the job ends; no rank waits out a collective
    # each rank's worker samples steps 1-3 (resets 1-3) and fails at step 4's batch, after the learners' step 2
    lines = [x for x in out.stderr.splitlines() if "failed while it sampled step 4's batch" in x]
    assert lines, out.stderr[-3000:]
    assert all(
        x.endswith(f"palestra train --resume {tmp_path / 'runs' / 'dist'} continues from step 2, its newest checkpoint")
        for x in lines
    ), lines
    assert (tmp_path / "runs" / "dist" / "checkpoints").is_dir()


def test_fsdp2_fully_shard_trains_on_two_cpu_ranks(tmp_path: Path, sites: dict[str, Path]) -> None:
    options = {"beta": 0.0, "clip_eps": 0.2, "scale": "group", "loss_agg": "token_mean", "entropy_coef": 0.0}
    config = write_config(tmp_path, algorithm="grpo", options=options, train={"steps": 20}, strategy="fsdp")
    dump = tmp_path / "dump"
    out = torchrun(["--config", str(config)], tmp_path, sites=(sites["fault"],), PALESTRA_TEST_DUMP_PARAMS=str(dump))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gloo, fsdp" in out.stdout
    a, b = (torch.load(dump / f"rank{r}.pt", weights_only=False)["params"] for r in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    run_dir = tmp_path / "runs" / "dist"
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert all(torch.equal(saved["policy"][k], a[k]) for k in a)  # a full, unsharded state dict
    assert_learns(rewards(run_dir))


def test_dapo_refill_draws_the_same_rounds_on_both_fsdp_ranks_and_learns(
    tmp_path: Path, sites: dict[str, Path]
) -> None:
    """Each rank counts its own tied groups, but both draw as many refills as the neediest one: a rank that sampled
    alone would run FSDP's gathers without the other and hang."""
    options = {"dynamic_sampling": True, "refill_rounds": 2, "entropy_coef": 0.0}
    config = write_config(tmp_path, algorithm="dapo", options=options, train={"steps": 20}, strategy="fsdp")
    dump = tmp_path / "dump"
    out = torchrun(["--config", str(config)], tmp_path, sites=(sites["fault"],), PALESTRA_TEST_DUMP_PARAMS=str(dump))
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = (torch.load(dump / f"rank{r}.pt", weights_only=False)["params"] for r in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    run_dir = tmp_path / "runs" / "dist"
    lines = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    rounds = [m["rollout/refill_rounds"] for m in lines if "rollout/refill_rounds" in m]
    # from random weights every group ties: two refills; once the format is being learnt, one is enough (measured:
    # 2.0 for 9 steps, then 1.0, with the groups short per rank falling 6.5 -> 0)
    assert len(rounds) == 20 and rounds[0] == 2.0 and rounds[-1] < 2.0 and set(rounds) <= {0.0, 1.0, 2.0}
    assert_learns(rewards(run_dir))


def test_a_dead_rank_ends_the_job_within_the_timeout(tmp_path: Path, sites: dict[str, Path]) -> None:
    options = {"beta": 0.0, "clip_eps": 0.2, "scale": "group", "loss_agg": "token_mean", "entropy_coef": 0.0}
    config = write_config(
        tmp_path, algorithm="grpo", options=options, train={"steps": 50, "batch_size": 4}, timeout_s=20
    )
    started = time.perf_counter()
    out = torchrun(
        ["--config", str(config)], tmp_path, timeout=90, sites=(sites["fault"],), PALESTRA_TEST_DIE_AT_STEP="2"
    )
    seconds = time.perf_counter() - started
    assert out.returncode != 0
    assert seconds < 60, f"the surviving rank took {seconds:.0f} s to go"
    assert "trained 50 steps" not in out.stdout
    assert "Root Cause" in out.stderr and "rank      : 1" in out.stderr  # the fault plugin killed rank 1, nothing else


def test_an_uneven_split_of_the_batch_is_a_one_line_error() -> None:
    from palestra.scale.distributed import DistributedContext

    ctx = DistributedContext(rank=1, world_size=2, backend="gloo")  # what two torchrun ranks see
    assert ctx.local_batch_size(16) == 8
    with pytest.raises(
        ValueError, match=r"^train\.batch_size: 3 tasks cannot be split evenly over 2 ranks; use a multiple of 2$"
    ):
        ctx.local_batch_size(3)


@pytest.fixture(autouse=True)
def _no_inherited_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
