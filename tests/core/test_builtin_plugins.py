"""The built-in plugins: environments (single- and multi-agent) and rewards on hand-made completions."""

from __future__ import annotations

from typing import Any

import pytest

from palestra.checked_reward import RewardError
from palestra.config import ConfigError, build_component
from palestra.engine.rollout import reward_rows, run_episodes
from palestra.plugin_manager import get_registry
from palestra.plugins.envs.arithmetic import ArithmeticEnv, evaluate
from palestra.plugins.envs.relay import ATTRIBUTES, ROLES, RelayEnv
from palestra.plugins.rewards.basic import extract_tag, parse_number
from palestra.types import Environment, Observation


def test_the_builtins_are_registered_by_the_palestra_distribution() -> None:
    registry = get_registry()
    assert {"arithmetic", "relay"} <= set(registry.names("environment"))
    assert {"format", "correctness", "length", "weighted_sum", "layered"} <= set(registry.names("reward"))
    for kind, name in [("environment", "arithmetic"), ("environment", "relay"), ("reward", "layered")]:
        reg = registry.get(kind, name)
        assert reg.distribution == "palestra" and reg.options is not None and reg.description


def env(name: str, **options: Any) -> Any:
    return build_component("environment", {"name": name, "options": options}, path="environment")


def reward(name: str, **options: Any) -> Any:
    return build_component("reward", {"name": name, "options": options}, path="reward")


# ---- arithmetic: single agent, single turn -----------------------------------------------------------
def test_arithmetic_reset_lays_out_groups_and_is_seeded() -> None:
    e = env("arithmetic", difficulty=2)
    assert isinstance(e, Environment) and e.agent_ids == ("assistant",) and e.max_turns == 1
    obs = e.reset(3, seed=5, group_size=2)
    assert len(obs) == 6
    for g in range(3):
        assert obs[2 * g].prompt == obs[2 * g + 1].prompt and obs[2 * g].metadata == obs[2 * g + 1].metadata
    assert len({o.prompt for o in obs}) == 3  # three different tasks (for this seed)
    for o in obs:
        a, b = (int(x) for x in o.metadata["question"].split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and o.metadata["answer"] == str(a + b)
        assert o.prompt == f"What is {a} + {b}? Put the final answer in <answer></answer>."
        assert o.agent_id == "assistant" and o.messages is not None and o.messages[0].as_dict()["role"] == "user"
    assert [o.prompt for o in e.reset(3, seed=5, group_size=2)] == [o.prompt for o in obs]
    assert [o.prompt for o in e.reset(3, seed=6, group_size=2)] != [o.prompt for o in obs]


def test_arithmetic_step_ends_every_episode() -> None:
    e = env("arithmetic")
    obs = e.reset(2, seed=0)
    result = e.step([f"<answer>{obs[0].metadata['answer']}</answer>", "no idea"])
    assert result.done == [True, True] and result.observations == [None, None]
    assert result.info[0] == {"assistant": {"expected": obs[0].metadata["answer"]}}
    with pytest.raises(RuntimeError, match=r"every episode is done; call reset\(\)"):
        e.step(["again", "again"])
    e.reset(2, seed=0)
    with pytest.raises(ValueError, match=r"got 1 actions for a batch of 2 rows"):
        e.step(["only one"])
    with pytest.raises(ValueError, match=r"actions\[1\] must be a string \(row 1 is still running\), got NoneType"):
        e.step(["a", None])
    with pytest.raises(ValueError, match=r"group_size must be a positive integer, got 0"):
        e.reset(2, group_size=0)


def test_arithmetic_precedence_and_options() -> None:
    assert evaluate([2, 3, 4], ["+", "*"]) == 14
    assert evaluate([2, 3, 4, 5], ["*", "-", "*"]) == -14
    assert evaluate([9, 3, 2], ["-", "-"]) == 4
    e = ArithmeticEnv(difficulty=1, terms=4, operations=["+", "-", "*"])
    for o in e.reset(20, seed=1):
        tokens = o.metadata["question"].split()
        numbers, ops = [int(t) for t in tokens[::2]], tokens[1::2]
        assert len(numbers) == 4 and set(ops) <= {"+", "-", "*"}
        assert int(o.metadata["answer"]) == evaluate(numbers, ops)
    with pytest.raises(ConfigError, match=r"^arithmetic.operations: needs at least one"):
        ArithmeticEnv(operations=[])


def test_arithmetic_max_operand_caps_operands_and_the_prompt_stops_at_the_closing_tag() -> None:
    seen = set()
    for o in ArithmeticEnv(difficulty=1, max_operand=2).reset(50, seed=3):
        seen.update(int(t) for t in o.metadata["question"].split()[::2])
        assert o.stop == ["</answer>"]
    assert seen == {0, 1, 2}
    assert {
        int(t)
        for o in ArithmeticEnv(difficulty=2, max_operand=12).reset(30, seed=0)
        for t in o.metadata["question"].split()[::2]
    } <= {10, 11, 12}
    with pytest.raises(
        ConfigError, match=r"^arithmetic.max_operand: must be >= 10, the smallest 2-digit operand, got 5$"
    ):
        ArithmeticEnv(difficulty=2, max_operand=5)


def test_arithmetic_answered_by_run_episodes_and_scored() -> None:
    e = env("arithmetic")
    episodes = run_episodes(e, lambda obs: [f"<answer>{o.metadata['answer']}</answer>" for o in obs], 4, seed=3)
    assert [len(ep.turns) for ep in episodes] == [1] * 4 and not any(ep.truncated for ep in episodes)
    prompts, completions, metadata = reward_rows(episodes)
    assert reward("correctness")(prompts, completions, metadata).scores.tolist() == [1.0] * 4
    assert metadata[0]["agent_id"] == "assistant" and metadata[0]["turn"] == 0


# ---- relay: turn-based multi-agent -------------------------------------------------------------------
def oracle(obs: list[Observation], wrong_doc: bool = False) -> list[str]:
    """Plays every role perfectly (or with the retriever picking a wrong document)."""
    out = []
    for o in obs:
        m = o.metadata
        if o.turn == 0:
            out.append(f"<query>{m['entity']} | {m['attribute']}</query>")
        elif o.turn == 1:
            doc = (m["gold_doc"] + 1) % len(m["documents"]) if wrong_doc else m["gold_doc"]
            out.append(f"I pick <doc>{doc}</doc>")
        else:
            doc = o.prompt.split("Document: ")[1].split("\n")[0]
            out.append(f"<answer>{m['answer'] if doc == m['documents'][m['gold_doc']] else 'unknown'}</answer>")
    return out


def test_relay_agents_take_turns() -> None:
    e = env("relay")
    assert e.agent_ids == ROLES and e.max_turns == 3
    obs = e.reset(2, seed=1, group_size=2)
    assert [o.agent_id for o in obs] == ["planner"] * 4
    assert obs[0].metadata == obs[1].metadata and obs[0].metadata != obs[2].metadata
    m = obs[0].metadata
    assert m["attribute"] in ATTRIBUTES and m["entity"] in m["documents"][m["gold_doc"]]
    assert m["answer"] in m["documents"][m["gold_doc"]] and len(m["documents"]) == 4
    assert ATTRIBUTES[m["attribute"]][0].format(e=m["entity"]) in obs[0].prompt

    res = e.step(oracle(obs))
    assert res.done == [False] * 4
    assert [o.agent_id for o in res.observations] == ["retriever"] * 4
    assert res.info[0] == {"planner": {"query": f"{m['entity']} | {m['attribute']}", "query_ok": True}}
    assert f"Query: {m['entity']} | {m['attribute']}" in res.observations[0].prompt
    for i, d in enumerate(m["documents"]):
        assert f"[{i}] {d}" in res.observations[0].prompt

    res = e.step(oracle(res.observations))
    assert [o.agent_id for o in res.observations] == ["responder"] * 4
    assert res.info[0] == {"retriever": {"doc": m["gold_doc"], "doc_ok": True}}
    assert f"Document: {m['documents'][m['gold_doc']]}" in res.observations[0].prompt

    res = e.step(oracle(res.observations))
    assert res.done == [True] * 4 and res.observations == [None] * 4
    assert res.info[0] == {"responder": {"answer": m["answer"]}}


def test_relay_episodes_score_per_agent() -> None:
    e = env("relay", entities=2, documents=3)
    good = run_episodes(e, oracle, 3, seed=4)
    assert all([t.agent_id for t in ep.turns] == list(ROLES) for ep in good)
    assert good[0].agents == list(ROLES) and "[2] responder:" in good[0].transcript()
    correctness = reward("correctness")
    assert correctness(*reward_rows(good, "responder")).scores.tolist() == [1.0] * 3
    assert all(ep.by_agent("retriever")[0].info["doc_ok"] for ep in good)

    bad = run_episodes(e, lambda obs: oracle(obs, wrong_doc=True), 3, seed=4)
    assert [ep.metadata for ep in bad] == [ep.metadata for ep in good]
    assert not any(ep.by_agent("retriever")[0].info["doc_ok"] for ep in bad)
    assert correctness(*reward_rows(bad, "responder")).scores.tolist() == [0.0] * 3
    # The planner's own score: did it produce a well-formed query?
    query_format = reward("format", tag="query")
    assert query_format(*reward_rows(good, "planner")).scores.tolist() == [1.0] * 3


def test_relay_passes_on_garbage_and_shares_one_agent() -> None:
    e = env("relay", roles="shared")
    assert e.agent_ids == ("assistant",)
    episodes = run_episodes(e, lambda obs: ["hmm, not sure"] * len(obs), 2, seed=0)
    turns = episodes[0].turns
    assert [t.agent_id for t in turns] == ["assistant"] * 3 and [t.observation.turn for t in turns] == [0, 1, 2]
    assert turns[0].info == {"query": None, "query_ok": False}
    assert "Query: hmm, not sure" in turns[1].observation.prompt
    assert turns[1].info == {"doc": None, "doc_ok": False}
    assert "Document: (no document was retrieved)" in turns[2].observation.prompt
    assert turns[2].info == {"answer": None}


def test_relay_rows_finish_independently_of_actions_for_done_rows() -> None:
    e = RelayEnv()
    obs = e.reset(1, seed=2)
    for _ in range(3):
        res = e.step(oracle([o for o in obs if o is not None]))
        obs = res.observations
    assert res.done == [True]
    with pytest.raises(RuntimeError, match="every episode is done"):
        e.step([None])


def test_relay_options_are_checked() -> None:
    with pytest.raises(ConfigError) as info:
        env("relay", entities=1, documents=5)
    assert (
        str(info.value)
        == "environment.options.documents: must be at most entities * 4 = 4 (the facts there are), got 5"
    )


# ---- rewards on hand-made completions ---------------------------------------------------------------
def score(r: Any, completions: list[str], metadata: list[dict[str, Any]] | None = None) -> list[float]:
    metadata = metadata if metadata is not None else [{} for _ in completions]
    return r([""] * len(completions), completions, metadata).scores.tolist()


def test_format_reward() -> None:
    completions = [
        "<answer>42</answer>",
        "The sum is <answer> 7 </answer>.",
        "<answer></answer>",
        "<answer>1</answer><answer>2</answer>",
        "42",
        "<answer>4",
    ]
    assert score(reward("format"), completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert score(reward("format", pattern=r"^\d+$"), ["42", "x42", "7\n"]) == [1.0, 0.0, 1.0]
    assert score(reward("format", tag="final"), ["<final>x</final>", "<answer>x</answer>"]) == [1.0, 0.0]


def test_correctness_reward() -> None:
    meta = [{"answer": "1234"}] * 5 + [{"answer": "Tarn"}, {"answer": "Tarn"}, {"answer": "-3"}]
    completions = [
        "<answer>1234</answer>",
        "<answer>1,234</answer>",
        "<answer>1234.0</answer>",
        "<answer>1235</answer>",
        "1234",  # no tag
        "<answer> tarn. </answer>",
        "<answer>Tam</answer>",
        "first <answer>3</answer> then <answer>-3</answer>",  # the last tag counts
    ]
    assert score(reward("correctness"), completions, meta) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert score(reward("correctness", tolerance=1.0), ["<answer>1235</answer>"], [{"answer": "1234"}]) == [1.0]
    assert score(reward("correctness", tag=None), [" 1234 "], [{"answer": 1234}]) == [1.0]
    assert score(reward("correctness", key="gold"), ["<answer>x</answer>"], [{"gold": "X"}]) == [1.0]
    with pytest.raises(RewardError, match=r"mode is numeric but the expected answer 'Tarn' is not a number"):
        score(reward("correctness", mode="numeric"), ["<answer>Tarn</answer>"], [{"answer": "Tarn"}])
    assert parse_number(" 1,000. ") == 1000.0 and parse_number("12abc") is None
    assert extract_tag("<a>1</a> <a> 2 </a>", "a") == "2" and extract_tag("none", "a") is None


def test_length_reward() -> None:
    words = reward("length", target=4)
    assert score(words, ["one two three four", "one two", "one two three four five six seven eight", ""]) == [
        1.0,
        0.5,
        0.0,
        0.0,
    ]
    chars = reward("length", target=10, unit="chars", tolerance=2)
    assert score(chars, ["x" * 10, "x" * 12, "x" * 7, "x" * 17]) == pytest.approx([1.0, 1.0, 0.9, 0.5])
