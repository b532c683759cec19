"""Replay's draw gathers only the drawn rows (issue 27, item 6): ``ReplayBuffer.mix`` gives, bit for bit, the batch the
straightforward algorithm builds (select the picked rows of each stored batch, then ``Experience.concat``), with the
same use of the generator; what it allocates follows the rows drawn, not the rows stored; and a GRPO run with replay
resumed from a checkpoint continues bitwise, in one process and after a SIGKILL.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from train_processes import palestra, start, write_config

from palestra.config import validate_config
from palestra.engine import checkpoint as ckpt
from palestra.engine.trainer import Trainer
from palestra.rl.replay import FIELDS, ReplayBuffer, replay_fields
from palestra.types import Experience

PAD = 3
KEPT = (*FIELDS, "ref_logprobs")


# ---- random ragged batches ----------------------------------------------------------------------------------
def ragged_batch(
    gen: torch.Generator, rows: int, prompt: int, completion: int, *, per_token: bool, ref: bool, tag: int
) -> Experience:
    """``rows`` rows with prompts ``prompt`` wide and completions ``completion`` wide (each row's real length random,
    the rest padding), random log-probs, rewards, advantages (a third of them exactly 0) and agent ids."""

    def uniform(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=gen)

    prompt_len = torch.randint(1, prompt + 1, (rows,), generator=gen)
    completion_len = torch.randint(1, completion + 1, (rows,), generator=gen)
    prompt_mask = torch.arange(prompt).flip(0).unsqueeze(0) < prompt_len.unsqueeze(1)  # left-padded
    completion_mask = torch.arange(completion).unsqueeze(0) < completion_len.unsqueeze(1)
    advantages = uniform(rows, completion) - 0.5 if per_token else uniform(rows) - 0.5
    advantages[uniform(rows) < 1 / 3] = 0.0  # whole rows with no signal (informative_only drops them)
    return Experience(
        prompt_ids=torch.where(prompt_mask, torch.randint(4, 50, (rows, prompt), generator=gen), PAD),
        prompt_mask=prompt_mask,
        completion_ids=torch.where(completion_mask, torch.randint(4, 50, (rows, completion), generator=gen), PAD),
        completion_mask=completion_mask,
        behaviour_logprobs=-uniform(rows, completion) * completion_mask,
        rewards=uniform(rows),
        advantages=advantages,
        group_ids=torch.arange(rows) // 4 + 100 * tag,
        agent_ids=[f"agent{tag}.{i % 3}" for i in range(rows)],
        ref_logprobs=-uniform(rows, completion) if ref else None,
    )


def reference_mix(buffer: ReplayBuffer, batch: Experience, generator: torch.Generator) -> Experience:
    """The draw as plainly as it can be written: a permutation of all stored rows, its first ``rows`` taken in stored
    order, each picked row looked up in its own batch, then one ``Experience.concat`` of the fresh rows and the
    picked rows of each batch (the algorithm ``mix`` had before it gathered in place)."""
    total = sum(b.batch_size for b in buffer.batches)
    if total == 0:
        return batch
    picked = sorted(torch.randperm(total, generator=generator)[: buffer.rows].tolist())
    pieces, start_row = [], 0
    for stored in buffer.batches:
        local = [i - start_row for i in picked if start_row <= i < start_row + stored.batch_size]
        if local:
            pieces.append(stored.select(local))
        start_row += stored.batch_size
    return Experience.concat([replay_fields(batch, copy=False), *pieces], pad_token_id=PAD)


def assert_same_rows(got: Experience, want: Experience) -> None:
    for name in KEPT:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert got.agent_ids == want.agent_ids


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("ref", [False, True])
@pytest.mark.parametrize("informative_only", [False, True])
def test_mix_draws_exactly_the_rows_of_the_plain_algorithm_with_the_same_generator_use(
    per_token: bool, ref: bool, informative_only: bool
) -> None:
    gen = torch.Generator().manual_seed(1000 * per_token + 100 * ref + 10 * informative_only)
    for trial in range(6):
        capacity, rows = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
        buffer = ReplayBuffer(capacity, rows, informative_only=informative_only)
        draw = torch.Generator().manual_seed(trial)
        for step in range(8):  # the window fills, then slides; widths differ from batch to batch
            shape = [int(x) for x in torch.randint(1, 9, (3,), generator=gen)]
            fresh = ragged_batch(gen, shape[0] + 1, shape[1], shape[2], per_token=per_token, ref=ref, tag=step)
            reference_draw = torch.Generator()
            reference_draw.set_state(draw.get_state())
            mixed = buffer.mix(fresh, draw, pad_token_id=PAD)
            assert_same_rows(mixed, reference_mix(buffer, fresh, reference_draw))
            assert torch.equal(draw.get_state(), reference_draw.get_state())  # the same random numbers consumed
            buffer.add(fresh)
        assert len(buffer.batches) == min(capacity, 8)


def test_a_batch_with_a_field_another_lacks_is_refused_in_one_line() -> None:
    gen = torch.Generator().manual_seed(0)
    buffer = ReplayBuffer(2, 4)
    buffer.add(ragged_batch(gen, 4, 3, 3, per_token=False, ref=True, tag=0))
    with pytest.raises(ValueError, match=r"^ReplayBuffer\.mix: ref_logprobs is set in some batches and not in others"):
        buffer.mix(ragged_batch(gen, 4, 3, 3, per_token=False, ref=False, tag=1), gen, pad_token_id=PAD)


# ---- what a draw allocates ----------------------------------------------------------------------------------
def allocated_bytes(fn: Callable[[], Any]) -> int:
    """Bytes the CPU allocator handed out while ``fn`` ran (torch's profiler; each allocation counted once, by the op
    that made it: an op's total would count ``full``'s ``empty`` twice)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)


def whole_buffer_mix(buffer: ReplayBuffer, batch: Experience, generator: torch.Generator) -> Experience:
    """The draw before it gathered by rows: the whole buffer concatenated, then the picked rows selected."""
    stored = Experience.concat(list(buffer.batches), pad_token_id=PAD)
    picked = stored.select(torch.randperm(stored.batch_size, generator=generator)[: buffer.rows].sort().values)
    return Experience.concat([replay_fields(batch, copy=False), picked], pad_token_id=PAD)


def test_a_draw_allocates_for_the_rows_drawn_not_for_the_buffer() -> None:
    gen = torch.Generator().manual_seed(0)
    buffer = ReplayBuffer(16, 8)
    for step in range(16):  # 16 x 64 stored rows with 256-token completions: ~10 MB of rows
        buffer.add(ragged_batch(gen, 64, 16, 256, per_token=False, ref=True, tag=step))
    fresh = ragged_batch(gen, 8, 16, 256, per_token=False, ref=True, tag=99)
    mixed = buffer.mix(fresh, torch.Generator().manual_seed(1), pad_token_id=PAD)
    result = sum(getattr(mixed, k).nbytes for k in KEPT)  # what the 16 rows of the result take
    stored = sum(getattr(b, k).nbytes for b in buffer.batches for k in KEPT)

    drawn = allocated_bytes(lambda: buffer.mix(fresh, torch.Generator().manual_seed(1), pad_token_id=PAD))
    whole = allocated_bytes(lambda: whole_buffer_mix(buffer, fresh, torch.Generator().manual_seed(1)))
    assert whole >= stored  # the meter sees a copy of the whole buffer when one is made
    # The result, allocated once, and the permutation of all stored rows (8 bytes a row: the draw's use of the
    # generator depends on their number), then a few index tensors; no copy of the picked rows on the way (the
    # widths agree here), which selecting each batch's rows and then concatenating them would make.
    assert drawn <= result + 8 * buffer.stored_rows + 4096, (drawn, result, stored)
    assert drawn * 40 < stored


# ---- resume ----------------------------------------------------------------------------------------------------
def grpo_replay(raw_config: Callable[..., dict[str, Any]], output_dir: Path, **train: Any) -> dict[str, Any]:
    """conftest's run with examples/hundred_facts.yaml's kind of replay (GRPO, informative rows only, clip-higher) and
    a reward that differs for almost every completion: a few steps of the sums' own reward leave every group tied,
    and an informative-only buffer empty."""
    grpo = {
        "name": "grpo",
        "options": {
            "beta": 0.0,
            "clip_eps_high": 0.28,
            "entropy_coef": 0.1,
            "replay_capacity": 3,
            "replay_rows": 12,
            "replay_informative_only": True,
        },
    }
    length = {"name": "length", "options": {"target": 64, "unit": "chars"}}  # fmt: skip
    return raw_config(output_dir, sections={"optimizer": grpo, "reward": length}, **train)


def replayed_metrics(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "time" and not k.startswith("perf/")} for m in metrics]


def test_a_grpo_replay_run_resumed_in_process_continues_bitwise(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    config = validate_config(grpo_replay(raw_config, tmp_path, steps=8, save_every=0, lr_schedule="constant"))
    whole = Trainer(config, run_dir=tmp_path / "whole")
    want = [whole.step() for _ in range(8)]
    first = Trainer(config, run_dir=tmp_path / "first")
    got = [first.step() for _ in range(4)]
    path = first.save_step()
    assert first.learner.replay is not None and len(first.learner.replay.batches) == 3
    assert first.learner.replay.stored_rows > 12  # a full window: the draws after the checkpoint pick among its rows
    second = Trainer(config, run_dir=tmp_path / "second")
    second.load(path)
    got += [second.step() for _ in range(4)]
    assert replayed_metrics(got) == replayed_metrics(want)
    a, b = whole.state_dict(), second.state_dict()
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"]), "parameters differ after resume"
    buffer_a, buffer_b = a["optimizer"]["extra"]["replay"], b["optimizer"]["extra"]["replay"]
    assert len(buffer_a) == len(buffer_b) == 3
    for x, y in zip(buffer_a, buffer_b):
        assert x.keys() == y.keys() and x["agent_ids"] == y["agent_ids"]
        assert all(torch.equal(x[k], y[k]) for k in FIELDS)


@pytest.mark.slow  # two training runs in subprocesses, one killed and resumed: ~10 s
def test_a_grpo_replay_run_killed_and_resumed_ends_with_the_same_metrics_and_checkpoint(
    tmp_path: Path, raw_config: Callable[..., dict[str, Any]]
) -> None:
    raw = grpo_replay(raw_config, Path("runs"), steps=12, save_every=3, keep_checkpoints=2, lr_schedule="constant")
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        write_config(tmp_path / side, raw)
    killed = start(["--config", "config.yaml"], tmp_path / "b")
    run_a, run_b = tmp_path / "a" / "runs" / "r", tmp_path / "b" / "runs" / "r"
    wanted = run_b / "checkpoints" / ckpt.step_name(6)
    deadline = time.monotonic() + 120
    while not wanted.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL and not (run_b / ckpt.FINAL_NAME).exists(), "nothing was resumed"
    whole = palestra(["--config", "config.yaml"], tmp_path / "a")
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed = palestra(["--resume", str(run_b)], tmp_path / "b")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def lines(run: Path) -> list[dict[str, Any]]:
        return replayed_metrics([json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if x.strip()])

    assert lines(run_a) == lines(run_b)
    a, b = ckpt.load_checkpoint(run_a / ckpt.FINAL_NAME), ckpt.load_checkpoint(run_b / ckpt.FINAL_NAME)
    assert all(torch.equal(a["policy"][k], b["policy"][k]) for k in a["policy"]), "parameters differ after resume"
    replay_a, replay_b = a["optimizer"]["extra"]["replay"], b["optimizer"]["extra"]["replay"]
    assert [r["agent_ids"] for r in replay_a] == [r["agent_ids"] for r in replay_b]
    assert all(torch.equal(x[k], y[k]) for x, y in zip(replay_a, replay_b) for k in FIELDS)
