"""Run under a real 2-process torchrun by tests/core/test_mappo_scale.py (not collected by pytest).

Every rank builds the same tiny policy and MAPPO, then prepares its half of three fixed global batches; rank 0
also prepares the whole batches in a single-process MAPPO. Writes OUT/rank<r>.json with both ranks' per-agent
running statistics (reward moments, value normaliser) and, on rank 0, the single-process ones.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from palestra.config import build_component, load_config
from palestra.context import TrainContext
from palestra.engine.learner import Learner
from palestra.scale.distributed import DistributedContext
from palestra.types import Experience

AGENTS = ["router", "responder", "auditor"]
TINY = "{d_model: 32, n_layers: 1, n_heads: 2, d_ff: 64, max_len: 128, seed: null}"


def global_batch(step: int, tokenizer_size: int, rows: int = 12, prompt: int = 5, width: int = 6) -> Experience:
    g = torch.Generator().manual_seed(1000 + step)
    mask = torch.rand(rows, width, generator=g) > 0.25
    mask[:, 0] = True
    return Experience(
        prompt_ids=torch.randint(1, tokenizer_size, (rows, prompt), generator=g),
        prompt_mask=torch.ones(rows, prompt, dtype=torch.bool),
        completion_ids=torch.randint(1, tokenizer_size, (rows, width), generator=g),
        completion_mask=mask,
        behaviour_logprobs=-torch.rand(rows, width, generator=g),
        rewards=torch.randn(rows, generator=g) * (1 + step) + torch.arange(rows) % 3,  # agents differ in scale
        advantages=torch.zeros(rows),
        group_ids=torch.arange(rows) // 2,
        agent_ids=[AGENTS[i % 3] for i in range(rows)],
        metadata=[{"state": f"query {step} {i}"} for i in range(rows)],
    )


def statistics(algo) -> dict[str, list[float]]:
    out = {}
    for name, state in (("reward", algo.reward_moments.state_dict()), ("value", algo.value_normalizer.state_dict())):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}"] = value.double().reshape(-1).tolist()
    out["agents"] = list(algo.agents)
    return out


def build(config, context):
    torch.manual_seed(7)  # the critic's initial weights: the same everywhere
    algo = build_component("optimizer", config.optimizer, path="optimizer")
    return Learner(algo, policy, context)


out = Path(sys.argv[1])
config = load_config(
    None,
    [
        "optimizer.name=mappo",
        "optimizer.options={critic_d_model: 16, critic_layers: 1, critic_heads: 2, critic_d_ff: 32}",
        "train.device=cpu",
        "distributed.backend=gloo",
        f"policy.options={TINY}",
        "kernels.backend=torch",
    ],
)
dist = DistributedContext.from_config(config, "cpu")
torch.manual_seed(0)
policy = build_component("policy", config.policy, path="policy")
algo = build(config, TrainContext.for_run(config, dist))
single = build(config, TrainContext.local(config.train)) if dist.rank == 0 else None
half = 12 // dist.world_size
for step in range(3):
    batch = global_batch(step, len(policy.tokenizer))
    algo.prepare(batch.select(range(dist.rank * half, (dist.rank + 1) * half)))
    if single is not None:
        single.prepare(global_batch(step, len(policy.tokenizer)))
result = {"rank": dist.rank, "world_size": dist.world_size, "distributed": statistics(algo.algorithm)}
if single is not None:
    result["single"] = statistics(single.algorithm)
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{dist.rank}.json").write_text(json.dumps(result))
dist.close()
# As `palestra train` does (palestra.cli.train.end_rank): a finished rank leaves with os._exit, because the
# interpreter's teardown after a gloo process group now and then aborts ("terminate called without an active
# exception").
sys.stdout.flush()
os._exit(0)
