"""A multi-turn episode trained as one token sequence (palestra.engine.trajectory): exactly the sampled tokens."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import tiny_hf
import torch

from palestra.config import build_component
from palestra.engine.rollout import Rollout, collect
from palestra.models.policy import attended
from palestra.plugins.generators.kv_cache import KVCacheGenerator
from palestra.plugins.policies.tiny import build_tiny_policy
from palestra.types import Message, Observation, SamplingParams, StepResult

TINY = {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64, "seed": 0, "init_std": 0.3, "max_len": 512}


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Feedback:
    """Three turns of one agent: after each reply the environment answers with a line of feedback, appended to the
    conversation (``extend=True``) or, to break prefix preservation, rewriting the history (``extend=False``)."""

    agent_ids = ("assistant",)
    max_turns = 3

    def __init__(self, *, extend: bool = True, turns: int = 3) -> None:
        self.extend, self.turns = extend, turns

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        n = batch_size * group_size
        self.turn = 0
        self.obs = [self._first(i // group_size) for i in range(n)]
        return list(self.obs)

    @staticmethod
    def _first(task: int) -> Observation:
        text = f"{task} + {task + 1} = "
        return Observation(text, messages=[Message("user", text)], metadata={"task": task})

    def step(self, actions: list[str | None]) -> StepResult:
        self.turn += 1
        out: list[Observation | None] = []
        for i, (obs, action) in enumerate(zip(self.obs, actions)):
            if action is None or self.turn >= self.turns:
                out.append(None)
                continue
            note = f"\n{i}: try {self.turn}\n"
            prompt = obs.prompt + action + note if self.extend else f"{self.turn}{obs.prompt}{action}{note}"
            messages = [*(obs.messages or []), Message("assistant", action), Message("tool", note.strip())]
            out.append(Observation(prompt, messages=messages, metadata=obs.metadata, turn=self.turn))
        self.obs = [o if o is not None else prev for o, prev in zip(out, self.obs)]
        return StepResult(out, [o is None for o in out], [{"assistant": {}} for _ in out])


def tiny_policy() -> Any:
    torch.manual_seed(0)
    return build_tiny_policy(**{**TINY, "unknown": "drop"})


def play(
    policy: Any, env: Any, *, trajectory: str = "sequence", max_tokens: int | None = None, seed: int = 3
) -> Rollout:
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    return collect(env, policy, KVCacheGenerator(), params, 3, group_size=2, seed=0,
                   rng=torch.Generator().manual_seed(seed), trajectory=trajectory, max_tokens=max_tokens)  # fmt: skip


def ids_of(ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
    return ids[mask].tolist()


def check_exact(policy: Any, ro: Rollout) -> Any:
    """Each episode's row is the first prompt, then every turn's sampled ids at the positions the next turn's prompt
    had them, and the training forward's log-probs of those ids are the behaviour log-probs."""
    batch = ro.experience(
        torch.arange(len(ro.episodes), dtype=torch.float32), pad_token_id=policy.tokenizer.pad_token_id
    )
    batch.validate()
    assert batch.batch_size == len(ro.episodes)  # one row per episode
    turns_of = {}
    for c, g in enumerate(ro.generations):
        alive = [e for e, ep in enumerate(ro.episodes) if len(ep.turns) > c]
        for r, e in enumerate(alive):
            turns_of.setdefault(e, []).append((ids_of(g.prompt_ids[r], g.prompt_mask[r]),
                                                ids_of(g.completion_ids[r], g.completion_mask[r]),
                                                g.logprobs[r][g.completion_mask[r]]))  # fmt: skip
    for e in range(len(ro.episodes)):
        prompt = ids_of(batch.prompt_ids[e], batch.prompt_mask[e])
        width = int(batch.completion_mask[e].nonzero().max()) + 1
        sequence = prompt + batch.completion_ids[e, :width].tolist()
        sampled = [False] * len(prompt) + batch.completion_mask[e, :width].tolist()
        assert turns_of[e][0][0] == prompt
        for k, (turn_prompt, turn_ids, _) in enumerate(turns_of[e]):
            # what turn k was generated from is the sequence so far, and what it sampled comes next, marked sampled
            assert sequence[: len(turn_prompt)] == turn_prompt, (e, k)
            end = len(turn_prompt) + len(turn_ids)
            assert sequence[len(turn_prompt) : end] == turn_ids and all(sampled[len(turn_prompt) : end])
        assert sum(sampled) == sum(len(t[1]) for t in turns_of[e])  # nothing else is trained
        behaviour = torch.cat([t[2] for t in turns_of[e]])
        assert torch.equal(batch.behaviour_logprobs[e][batch.completion_mask[e]], behaviour)
    with torch.no_grad():
        scores = policy.score(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                              entropy=False)  # fmt: skip
    m = batch.completion_mask
    torch.testing.assert_close(scores.logprobs[m], batch.behaviour_logprobs[m], atol=1e-5, rtol=0)
    return batch


def test_a_three_turn_episode_trains_as_one_sequence_of_exactly_the_sampled_tokens() -> None:
    policy = tiny_policy()
    ro = play(policy, Feedback())
    assert [len(ep.turns) for ep in ro.episodes] == [3] * 6
    batch = check_exact(policy, ro)
    # the feedback between turns is in the row but not trained: fewer trained than total completion tokens
    assert int(batch.completion_mask.sum()) < int((batch.completion_ids != policy.tokenizer.pad_token_id).sum())
    assert [m["turns"] for m in batch.metadata] == [3] * 6


def test_per_turn_rows_re_encode_the_history_and_sequences_do_not() -> None:
    policy = tiny_policy()
    per_turn = play(policy, Feedback(), trajectory="per_turn")
    sequence = play(policy, Feedback(), trajectory="sequence")
    rows = per_turn.experience(torch.zeros(6), pad_token_id=0)
    seqs = sequence.experience(torch.zeros(6), pad_token_id=0)
    assert rows.batch_size == 18 and seqs.batch_size == 6
    # turn 0 is sampled alike (the same seed); per-turn rows then carry the history once per turn
    assert [ep.turns[0].completion for ep in per_turn.episodes] == [ep.turns[0].completion for ep in sequence.episodes]
    read = lambda b: int(b.prompt_mask.sum() + attended(b.completion_mask).sum())  # noqa: E731
    assert read(rows) > 2 * read(seqs)


def test_an_environment_that_rewrites_the_history_falls_back_to_per_turn_rows_and_says_so() -> None:
    policy = tiny_policy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ro = play(policy, Feedback(extend=False))
    said = [str(w.message) for w in caught if "train.trajectory" in str(w.message)]
    assert len(said) == 1 and "per-turn rows" in said[0]
    assert ro.sequences is not None and all(s is None for s in ro.sequences)
    batch = ro.experience(torch.zeros(6), pad_token_id=0).validate()
    assert batch.batch_size == 18  # three rows per episode, as before


def test_the_token_budget_ends_an_episode_unfinished() -> None:
    policy = tiny_policy()
    free = play(policy, Feedback())
    first_turn = max(len(s.ids) for s in free.sequences if s is not None)  # type: ignore[union-attr]
    budget = min(len(s.ids) for s in free.sequences) - 1  # type: ignore[union-attr]
    ro = play(policy, Feedback(), max_tokens=budget)
    assert all(len(s.ids) <= budget + 6 for s in ro.sequences)  # type: ignore[union-attr]
    assert any(ep.truncated and len(ep.turns) < 3 for ep in ro.episodes)
    assert first_turn > budget
    check_exact(policy, ro)


def test_chat_template_sequences_on_a_tiny_qwen2(tmp_path: Path) -> None:
    folder = tiny_hf.build_qwen2(tmp_path / "qwen2")
    policy = build_component("policy", {"name": "hf", "options": {"path": str(folder)}}, path="policy")
    assert policy.prefix_preserving()
    ro = play(policy, Feedback())
    assert all(s is not None for s in ro.sequences)  # type: ignore[union-attr]
    check_exact(policy, ro)
    # the template's rendering of the whole conversation, tokenized, is what a per-turn row would have been: the
    # sequence holds the same text (up to how the tokenizer splits it at the turn boundaries)
    last = ro.episodes[0].turns[-1].observation
    text = policy.tokenizer.hf.decode(ro.sequences[0].ids, skip_special_tokens=False)  # type: ignore[index,union-attr]
    assert text.startswith(policy.prompt_text(last))


class _Policy:
    def __init__(self, preserving: bool) -> None:
        self.preserving = preserving

    def prefix_preserving(self) -> bool:
        return self.preserving


def test_the_layout_is_chosen_once_at_start_up_and_said_in_one_line() -> None:
    from palestra.config import ConfigError
    from palestra.engine.trajectory import choose_trajectory
    from palestra.plugins.envs.arithmetic import ArithmeticEnv

    keeps, breaks = _Policy(True), _Policy(False)
    assert choose_trajectory("auto", ArithmeticEnv(), keeps) == ("per_turn", "")  # one turn: the same rows
    assert choose_trajectory("sequence", ArithmeticEnv(), keeps) == ("per_turn", "")
    assert choose_trajectory("auto", Feedback(), keeps)[0] == "sequence"
    assert choose_trajectory("sequence", Feedback(), keeps)[0] == "sequence"
    mode, line = choose_trajectory("per_turn", Feedback(), keeps)
    assert mode == "per_turn" and "train.trajectory" in line
    mode, line = choose_trajectory("auto", Feedback(), breaks)
    assert mode == "per_turn" and "not prefix-preserving" in line
    mode, line = choose_trajectory("sequence", Feedback(), breaks)  # a template that cannot: per-turn, said
    assert mode == "per_turn" and "not prefix-preserving" in line
    mode, line = choose_trajectory("auto", Feedback(), keeps, per_agent=True)  # MAPPO and friends
    assert mode == "per_turn" and "agents:" in line
    with pytest.raises(ConfigError, match=r"^train\.trajectory: 'sequence' .* use 'per_turn' or 'auto'$"):
        choose_trajectory("sequence", Feedback(), keeps, per_agent=True)
