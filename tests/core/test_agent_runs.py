"""Agents in real rollouts and real runs: the one-sequence trajectory of an agent episode is what the sampler sampled,
token for token (a plain-text policy and a chat template with tools); an agent that edits its history falls back to
per-turn rows; `palestra train` with an `agent:` section (a third-party agent installed as a distribution) logs the
agent metrics and leaves no server behind; bad `agent:` sections are one line each."""

from __future__ import annotations

import json
import os
import socket
import threading
import warnings
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import openai
import pytest
import tiny_hf
import torch
from train_processes import error_line, palestra, write_config

from palestra.agents import AgentTask
from palestra.agents.bridge import AgentEnvironment
from palestra.agents.server import AgentServer
from palestra.config import build_component, validate_config
from palestra.engine.rollout import Rollout, collect
from palestra.plugins.envs.arithmetic import ArithmeticEnv
from palestra.plugins.generators.kv_cache import KVCacheGenerator
from palestra.plugins.policies.tiny import build_tiny_policy
from palestra.plugins.tools.parsers import HermesParser
from palestra.types import SamplingParams

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64, "seed": 0, "init_std": 0.3, "max_len": 512}
SPEC = {"type": "function", "function": {"name": "noop", "description": "Does nothing.",
                                         "parameters": {"type": "object", "properties": {}}}}  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Repeater:
    """Three requests: each reply is echoed back as received, followed by a user message."""

    def __init__(self, *, edit: bool = False, tools: bool = False) -> None:
        self.edit, self.tools = edit, tools

    async def rollout(self, client: openai.AsyncOpenAI, task: AgentTask) -> str:
        messages = list(task.messages)
        extra: dict[str, Any] = {"tools": [SPEC]} if self.tools else {}
        content = ""
        for k in range(3):
            reply = await client.chat.completions.create(model=task.model, messages=messages, **extra)
            message = reply.choices[0].message.model_dump(exclude_none=True)
            content = message.get("content") or ""
            if self.edit:
                message = {"role": "assistant", "content": content.upper() + "!"}
            messages += [message, {"role": "user", "content": f"again {k}"}]
        return content


def rollout(policy: Any, agent: Any, **kw: Any) -> tuple[Rollout, AgentEnvironment]:
    env = AgentEnvironment(ArithmeticEnv(difficulty=1, terms=2, prompt="{question} ="), agent, AgentServer(),
                           HermesParser(), max_turns=3, request_timeout_s=30)  # fmt: skip
    try:
        params = SamplingParams(max_new_tokens=6, temperature=1.0)
        rng = torch.Generator().manual_seed(3)
        ro = collect(
            env, policy, KVCacheGenerator(), params, 2, group_size=2, seed=0, rng=rng, trajectory="sequence", **kw
        )
    finally:
        env.close()
    return ro, env


def check_exact(policy: Any, ro: Rollout) -> None:
    """Each episode's row holds every turn's prompt ids as its prefix so far and the sampled ids after it (the only ids
    trained), with the sampler's log-probs, which the update's forward gives back."""
    batch = ro.experience(torch.zeros(len(ro.episodes)), pad_token_id=policy.tokenizer.pad_token_id).validate()
    assert batch.batch_size == len(ro.episodes)
    for e, record in enumerate(ro.sequences or []):
        assert record is not None
        sampled: list[int] = []
        logprobs: list[torch.Tensor] = []
        for c, g in enumerate(ro.generations):
            alive = [i for i, ep in enumerate(ro.episodes) if len(ep.turns) > c]
            if e not in alive:
                continue
            r = alive.index(e)
            prompt = g.prompt_ids[r][g.prompt_mask[r]].tolist()
            ids = g.completion_ids[r][g.completion_mask[r]].tolist()
            assert record.ids[: len(prompt)] == prompt and record.ids[len(prompt) : len(prompt) + len(ids)] == ids
            sampled += ids
            logprobs.append(g.logprobs[r][g.completion_mask[r]])
        assert [i for i, s in zip(record.ids, record.sampled) if s] == sampled
        assert torch.equal(batch.behaviour_logprobs[e][batch.completion_mask[e]], torch.cat(logprobs))
    with torch.no_grad():
        scores = policy.score(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                              entropy=False)  # fmt: skip
    m = batch.completion_mask
    torch.testing.assert_close(scores.logprobs[m], batch.behaviour_logprobs[m], atol=1e-5, rtol=0)


def test_an_agent_episode_is_one_sequence_of_exactly_the_sampled_tokens() -> None:
    torch.manual_seed(0)
    policy = build_tiny_policy(**{**TINY, "unknown": "drop"})
    ro, _ = rollout(policy, Repeater())
    assert [len(ep.turns) for ep in ro.episodes] == [3] * 4
    check_exact(policy, ro)


def test_a_chat_template_with_tools_keeps_the_agent_episode_exact(tmp_path: Path) -> None:
    folder = tiny_hf.build_qwen2(tmp_path / "qwen2")
    policy = build_component("policy", {"name": "hf", "options": {"path": str(folder)}}, path="policy")
    ro, _ = rollout(policy, Repeater(tools=True))
    assert ro.episodes[0].turns[-1].observation.tools == [SPEC]
    check_exact(policy, ro)


def test_an_agent_that_edits_its_history_falls_back_to_per_turn_rows_and_says_so() -> None:
    torch.manual_seed(0)
    policy = build_tiny_policy(**{**TINY, "unknown": "drop"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ro, _ = rollout(policy, Repeater(edit=True))
    said = [str(w.message) for w in caught if "train.trajectory" in str(w.message)]
    assert len(said) == 1 and "per-turn rows" in said[0]
    assert ro.sequences is not None and all(s is None for s in ro.sequences)
    assert ro.experience(torch.zeros(4), pad_token_id=0).validate().batch_size == 12


# ---- real runs ----------------------------------------------------------------------------------------
PLUGIN = "palestra_agent_runs_plugin"
PLUGIN_SOURCE = '''
from dataclasses import dataclass

from palestra import hookimpl
from palestra.agents import AgentResult


@dataclass
class Options:
    turns: int = 2


class Echo:
    """Asks `turns` times, each time with the last reply appended; reports the length of its answer as a reward."""

    def __init__(self, turns: int = 2) -> None:
        self.turns = turns

    async def rollout(self, client, task):
        messages = list(task.messages)
        text = ""
        for _ in range(self.turns):
            reply = await client.chat.completions.create(model=task.model, messages=messages)
            text = reply.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "sure?"}]
        return AgentResult(text, metadata={"echoed": True}, reward=float(len(text)))


@hookimpl
def register_agents(register):
    register("echo_agent", Echo, options=Options, description="asks twice")
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The agent plugin above as an installed distribution: the module and a dist-info with its entry point."""
    site = tmp_path_factory.mktemp("agent-plugin")
    (site / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    info = site / "palestra_agent_runs_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: palestra-agent-runs-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[palestra]\nagent_runs = {PLUGIN}\n")
    return site


def agent_config(raw_config: Any, agent: dict[str, Any], **train: Any) -> dict[str, Any]:
    terms = [{"name": "correctness"}, {"name": "agent_reward", "weight": 0.01}]
    reward = {"name": "weighted_sum", "options": {"components": terms}}
    raw: dict[str, Any] = raw_config(
        sections={"reward": reward}, **{"steps": 3, "save_every": 3, "batch_size": 2, "group_size": 2, **train}
    )
    raw["agent"] = agent
    return raw


def test_a_training_run_with_a_third_party_agent_logs_the_agent_metrics(
    tmp_path: Path, plugin_site: Path, raw_config: Any
) -> None:
    raw = agent_config(raw_config, {"name": "echo_agent", "options": {"turns": 2}, "max_turns": 3})
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path, site=plugin_site)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trajectory: one token sequence per episode" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "runs" / "r" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "agents/requests_per_episode" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["agents/requests_per_episode"] == 2.0 and r["agents/error_rate"] == 0.0
        assert r["agents/timeout_rate"] == 0.0 and r["agents/latency_s"] > 0.0
        assert "reward/agent_reward" in r


def test_the_endpoint_is_gone_when_the_run_ends(tmp_path: Path, raw_config: Any) -> None:
    from palestra.engine.trainer import Trainer

    raw = agent_config(raw_config, {"name": "calculator_agent", "max_turns": 2}, steps=1, save_every=1)
    config = validate_config(raw)
    trainer = Trainer(config, run_dir=tmp_path / "run")
    trainer.train()
    server = trainer.env.server
    assert server.port and not server.running
    assert not [t for t in threading.enumerate() if t.name == "palestra-agent-endpoint"]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


@pytest.mark.parametrize(
    "change, line",
    [
        ({"tools": {"tools": [{"name": "calculator"}]}},
         "agent: an agent runs its own tools (it sends their specs with its requests); remove the tools: section, "
         "or the agent: section to train the built-in tool loop"),
        ({"agent": {"name": "calculator_agent", "host": "0.0.0.0"}},
         "agent.host: the rollout endpoint binds to 127.0.0.1 only (it serves the policy to local agents); "
         "got '0.0.0.0'"),
        ({"agent": {"name": "calculator_agent", "request_timeout_s": 200}},
         "agent.request_timeout_s: 200 s is not below train.data_timeout_s=120; a silent agent must time out before "
         "the environment step does (lower it or raise train.data_timeout_s)"),
        ({"environment": {"name": "relay"}},
         "agent: an agent plays the tasks of a single-turn environment; environment 'relay' has max_turns=3 (the "
         "agent makes its own turns)"),
        ({"agent": {"name": "calculater_agent"}},
         "agent.name: no agent named 'calculater_agent'; did you mean 'calculator_agent'?"),
        ({"agent": {"name": "calculator_agent", "max_turns": 0}}, "agent.max_turns: must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_a_bad_agent_section_is_one_line_and_writes_nothing(
    tmp_path: Path, raw_config: Any, change: dict[str, Any], line: str
) -> None:
    raw = agent_config(raw_config, {"name": "calculator_agent"}, steps=1)
    raw["train"]["data_timeout_s"] = 120
    raw.update(change)
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path)
    assert result.returncode == 2
    assert error_line(result) == f"palestra train: error: {line}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
