"""The interface records: StepResult and Experience checks, episodes, and the reference rollout driver."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest
import torch

from palestra.engine.rollout import reward_rows, run_episodes
from palestra.types import Environment, Episode, Experience, Observation, StepResult, Turn


class Echo:
    """A two-agent environment: 'speaker' and 'listener' alternate; an episode ends when someone says 'bye'."""

    agent_ids = ("speaker", "listener")
    max_turns = 4

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        self.turn = [0] * (batch_size * group_size)
        return [Observation(f"task {i // group_size}", "speaker", metadata={"row": i}) for i in range(len(self.turn))]

    def step(self, actions: Sequence[str | None]) -> StepResult:
        obs: list[Observation | None] = []
        done, info = [], []
        for i, action in enumerate(actions):
            if action is None:
                obs.append(None), done.append(True), info.append({})
                continue
            agent = self.agent_ids[self.turn[i] % 2]
            self.turn[i] += 1
            finished = "bye" in action
            nxt = self.agent_ids[self.turn[i] % 2]
            obs.append(
                None if finished else Observation(f"heard {action}", nxt, metadata={"row": i}, turn=self.turn[i])
            )
            done.append(finished)
            info.append({agent: {"said": action}})
        return StepResult(obs, done, info)


def test_run_episodes_records_turns_and_truncation() -> None:
    env = Echo()
    assert isinstance(env, Environment)

    def respond(obs: list[Observation]) -> list[str]:
        # Row 0 says bye on its second turn; row 1 never does (it is truncated at max_turns).
        return ["bye" if o.metadata["row"] == 0 and o.turn == 1 else f"hi from {o.agent_id}" for o in obs]

    episodes = run_episodes(env, respond, 2)
    assert [t.agent_id for t in episodes[0].turns] == ["speaker", "listener"] and not episodes[0].truncated
    assert [t.agent_id for t in episodes[1].turns] == ["speaker", "listener"] * 2 and episodes[1].truncated
    assert episodes[0].turns[1].info == {"said": "bye"}
    assert episodes[1].turns[1].observation.prompt == "heard hi from speaker"
    _prompts, completions, metadata = reward_rows(episodes, "speaker")
    assert completions == ["hi from speaker", "hi from speaker"] and [m["turn"] for m in metadata] == [0, 2]
    with pytest.raises(ValueError, match="the responder returned 1 completions for 2 observations"):
        run_episodes(env, lambda obs: ["x"], 2)
    with pytest.raises(ValueError, match="episode 0 has no turn by agent 'judge' to score"):
        reward_rows(episodes, "judge")


def test_step_result_rows_must_agree() -> None:
    with pytest.raises(ValueError, match="one entry per row; got lengths 1, 2 and 1"):
        StepResult([None], [True, True], [{}])
    with pytest.raises(ValueError, match="row 0 has done=False but observation None"):
        StepResult([None], [False], [{}])


def test_episode_helpers() -> None:
    obs = Observation("p")
    ep = Episode([Turn("a", obs, "x"), Turn("b", obs, "y"), Turn("a", obs, "z")], {"k": 1})
    assert ep.agents == ["a", "b"] and [t.completion for t in ep.by_agent("a")] == ["x", "z"]
    assert ep.last.completion == "z" and ep.transcript() == "[0] a: x\n[1] b: y\n[2] a: z"
    with pytest.raises(ValueError, match="no turns"):
        _ = Episode().last


def experience(b: int = 3, t: int = 5, p: int = 4, **changes: object) -> Experience:
    fields: dict[str, object] = dict(
        prompt_ids=torch.randint(0, 50, (b, p)),
        prompt_mask=torch.ones(b, p, dtype=torch.bool),
        completion_ids=torch.randint(0, 50, (b, t)),
        completion_mask=torch.rand(b, t) > 0.3,
        behaviour_logprobs=-torch.rand(b, t),
        rewards=torch.rand(b),
        advantages=torch.randn(b),
        group_ids=torch.tensor([0, 0, 1][:b]),
        agent_ids=["assistant"] * b,
    )
    fields.update(changes)
    return Experience(**fields)  # type: ignore[arg-type]


def test_experience_validate_accepts_consistent_batches() -> None:
    e = experience().validate()
    assert e.batch_size == 3
    experience(advantages=torch.randn(3, 5), ref_logprobs=-torch.rand(3, 5)).validate()


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"rewards": torch.rand(2)}, "Experience.rewards: expected shape [3] (B=3, T=5), got [2]"),
        (
            {"advantages": torch.rand(3, 4)},
            "Experience.advantages: expected shape [3] or [3, 5] (B=3, T=5), got [3, 4]",
        ),
        (
            {"completion_mask": torch.ones(3, 5)},
            "Experience.completion_mask: expected dtype torch.bool, got torch.float32",
        ),
        ({"group_ids": torch.zeros(3)}, "Experience.group_ids: expected dtype torch.int64, got torch.float32"),
        (
            {"rewards": torch.ones(3, dtype=torch.int64)},
            "Experience.rewards: expected a floating dtype, got torch.int64",
        ),
        ({"agent_ids": ["a"]}, "Experience.agent_ids: expected 3 entries, got 1"),
        (
            {"reward_components": {"format": torch.ones(4)}},
            "Experience.reward_components['format']: expected shape [3]",
        ),
        (
            {"completion_ids": torch.zeros(3, dtype=torch.int64)},
            "Experience.completion_ids: expected shape [B, T], got [3]",
        ),
    ],
)
def test_experience_validate_names_the_field(changes: dict[str, object], expected: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}") as info:
        experience(**changes).validate()
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
