"""What replay costs a step: a training step with a replay buffer against a plain step on the same config.

    OMP_NUM_THREADS=1 python bench/replay_step_cost.py [--model tiny|trl_llama] [--warmup 30] [--steps 100]
        [--capacity 16] [--rows 512] [--out bench/results/replay_step_cost.json]

Two trainers of one config in one process: ``replay`` (``replay_capacity`` x ``replay_rows``, default 16 x 512, the
rest of the config as it is) and ``plain`` (replay off). Their steps alternate, never side by side, and the order of
each pair swaps from one pair to the next (plain first, then replay first), so that a machine whose load changes
slows both alike. The first ``--warmup`` steps of each are not counted: lazy builds, first allocations, and a buffer
that is not full yet (16 batches). The figures are medians over the counted steps:

* ``step_ratio``: a replay step's wall time over a plain step's (the issue's goal: at most 1.3);
* ``update_ratio`` and ``update_per_row_ratio``: the update's time (forward, backward, optimiser step) over the
  plain update's, as is and per trained row (fresh plus replayed): the second is 1.0 when replay adds no cost but
  that of the rows it adds;
* ``mix_share``: the draw itself (``ReplayBuffer.mix``: the fresh rows and the drawn rows gathered into one batch)
  as a share of the replay step, and ``mix_vs_whole_buffer``: the same draw timed against drawing from the whole
  buffer concatenated (the algorithm before gathering by rows), on the final buffer, alternately.

Models (``--model``): ``tiny``, ``examples/hundred_facts.yaml`` as it is (the built-in tiny transformer, replay of
informative rows only); ``trl_llama``, the issue's measurement: ``bench/learning_vs_trl.py``'s random 2-layer Llama
(hidden 64, built here) on all 100 sums, two new tokens, ``examples/grpo.yaml``'s GRPO, every row kept.

The JSON (one entry per model; several runs share the file) records the CPU (its model name, whether it has AMX,
the threads, the load average before and after): the machine may be busy, and the figures are for it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub

ROOT = Path(__file__).resolve().parents[1]


def cpu_kind() -> dict[str, Any]:
    """The CPU's model name and whether it has AMX (bf16 matrix units): step times differ a lot between the two."""
    from palestra.kernels.build import cpu_bf16_kind, cpu_model

    kind = cpu_bf16_kind()
    return {
        "cpu": cpu_model(),
        "cpu_kind": {"amx": "AMX", "avx512_bf16": "no AMX, avx512_bf16"}.get(kind, "no AMX"),
        "amx": kind == "amx",
        "cpus": os.cpu_count(),
    }


def overrides(model: str, work: Path) -> tuple[Path, list[str]]:
    """The config file and the overrides both sides share."""
    common = [f"run.output_dir={work}", "loggers=[]", "train.eval_every=0", "train.save_every=0"]
    if model == "tiny":
        return ROOT / "examples" / "hundred_facts.yaml", common
    sys.path.insert(0, str(ROOT / "bench"))
    import learning_vs_trl

    folder = work / "model"
    learning_vs_trl.build_model(folder, hidden=64, layers=2, seed=0)
    env = learning_vs_trl.environment_options(argparse.Namespace(max_operand=9))
    return ROOT / "examples" / "grpo.yaml", [
        *common,
        f"environment.options={json.dumps(env)}",
        "reward.name=correctness",
        "reward.options.tag=null",
        "policy.name=hf",
        f"policy.options.path={folder}",
        "policy.options.dtype=float32",
        "train.batch_size=16",
        "train.group_size=8",
        "train.lr=0.001",
        "train.max_new_tokens=2",
        "train.temperature=1.0",
        "train.device=cpu",
    ]


class Recorder:
    """Wraps a learner's ``rows_for_update`` (the rows one update trains on: the fresh ones, plus the drawn ones with
    replay) and, with replay, its buffer's ``mix`` (the draw), on that learner only: the rows of every update, the
    completion tokens of every fresh row, the draw's seconds, and the last fresh batch (for the draw-against-whole-
    buffer timing at the end)."""

    def __init__(self, learner: Any) -> None:
        self.rows: list[int] = []
        self.tokens: list[float] = []
        self.draw_s: list[float] = []
        self.last: tuple[Any, Any] | None = None
        self.rows_for_update, learner.rows_for_update = learner.rows_for_update, self.update_rows
        self.buffer = learner.replay
        if self.buffer is not None:
            self.mix, self.buffer.mix = self.buffer.mix, self.timed_mix

    def update_rows(self, batch: Any) -> Any:
        self.tokens.append(float(batch.completion_mask.sum()) / batch.batch_size)
        rows = self.rows_for_update(batch)
        self.rows.append(0 if rows is None else rows.batch_size)
        return rows

    def timed_mix(self, batch: Any, generator: Any, *, pad_token_id: Any) -> Any:
        started = time.perf_counter()
        mixed = self.mix(batch, generator, pad_token_id=pad_token_id)
        self.draw_s.append(time.perf_counter() - started)
        self.last = (batch, pad_token_id)
        return mixed


def whole_buffer_draw(buffer: Any, batch: Any, generator: Any, pad_token_id: Any) -> Any:
    """The draw before it gathered by rows: the whole buffer concatenated, the picked rows selected from it."""
    import torch

    from palestra.rl.replay import replay_fields
    from palestra.types import Experience

    stored = Experience.concat(list(buffer.batches), pad_token_id=pad_token_id)
    picked = stored.select(torch.randperm(stored.batch_size, generator=generator)[: buffer.rows].sort().values)
    return Experience.concat([replay_fields(batch, copy=False), picked], pad_token_id=pad_token_id)


def alternate(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each call, ``rounds`` times, alternating, the order reversed every other round."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    names = list(calls)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - started)
    return times


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from palestra.config import load_config
    from palestra.engine.trainer import Trainer

    path, common = overrides(args.model, work)
    sides = {
        "plain": ["optimizer.options.replay_capacity=0", "optimizer.options.replay_rows=0"],
        "replay": [f"optimizer.options.replay_capacity={args.capacity}", f"optimizer.options.replay_rows={args.rows}"],
    }
    trainers = {
        name: Trainer(load_config(path, [*common, f"run.name={name}", *extra]), run_dir=work / name)
        for name, extra in sides.items()
    }
    record = {name: Recorder(trainer.learner) for name, trainer in trainers.items()}
    for trainer in trainers.values():  # warm-up, not counted: builds, allocations, the buffer filling
        for _ in range(args.warmup):
            trainer.step()
    for r in record.values():  # from here on, counted
        for kept in (r.rows, r.tokens, r.draw_s):
            kept.clear()
    metrics: dict[str, list[dict[str, float]]] = {k: [] for k in trainers}

    def step(name: str) -> Callable[[], None]:
        return lambda: metrics[name].append(trainers[name].step())

    walls = alternate({name: step(name) for name in trainers}, args.steps)
    step_s = {name: statistics.median(ws) for name, ws in walls.items()}
    update_s = {name: statistics.median(m["perf/update_s"] for m in ms) for name, ms in metrics.items()}
    rows = {name: statistics.median(r.rows) for name, r in record.items()}
    replay = record["replay"]
    draw_s = statistics.median(replay.draw_s)
    assert replay.last is not None and replay.buffer is not None, "the replay side never drew"
    batch, pad = replay.last
    buffer = replay.buffer
    draws = alternate(
        {
            "gather": lambda: replay.mix(batch, torch.Generator().manual_seed(0), pad_token_id=pad),
            "whole_buffer": lambda: whole_buffer_draw(buffer, batch, torch.Generator().manual_seed(0), pad),
        },
        50,
    )
    return {
        "config": str(path.relative_to(ROOT)),
        "capacity": args.capacity,
        "rows": args.rows,
        "step_s": step_s,
        "step_ratio": step_s["replay"] / step_s["plain"],
        "update_s": update_s,
        "update_ratio": update_s["replay"] / update_s["plain"],
        "rows_per_update": rows,
        "update_per_row_ratio": (update_s["replay"] / rows["replay"]) / (update_s["plain"] / rows["plain"]),
        "completion_tokens_per_row": {name: statistics.median(r.tokens) for name, r in record.items()},
        "stored_rows": buffer.stored_rows,
        "mix_s": draw_s,
        "mix_share": draw_s / step_s["replay"],
        "mix_vs_whole_buffer": {k: statistics.median(v) for k, v in draws.items()},
        "warmup": args.warmup,
        "steps": args.steps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "trl_llama"], default="tiny")
    p.add_argument("--warmup", type=int, default=30, help="uncounted steps of each side (the buffer fills)")
    p.add_argument("--steps", type=int, default=100, help="counted steps of each side, alternating")
    p.add_argument("--capacity", type=int, default=16)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    threads = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="replay_step_cost_") as tmp:
        result = measure(args, Path(tmp))
    result["meta"] = {
        **cpu_kind(),
        "threads": torch.get_num_threads(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(
        f"{args.model}: replay {args.capacity}x{args.rows} step {result['step_s']['replay']:.4f} s, plain "
        f"{result['step_s']['plain']:.4f} s: {result['step_ratio']:.2f}x (update {result['update_ratio']:.2f}x, "
        f"{result['update_per_row_ratio']:.2f}x per trained row: {result['rows_per_update']['replay']:.0f} rows "
        f"against {result['rows_per_update']['plain']:.0f}); the draw {1000 * result['mix_s']:.2f} ms "
        f"({100 * result['mix_share']:.1f} % of the replay step; whole-buffer draw "
        f"{1000 * result['mix_vs_whole_buffer']['whole_buffer']:.2f} ms); {result['meta']['cpu_kind']}, "
        f"{result['meta']['threads']} thread(s), load {load_before[0]:.1f}"
    )
    if args.out is not None:
        existing = json.loads(args.out.read_text()) if args.out.exists() else {}
        existing[args.model] = result
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(existing, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
