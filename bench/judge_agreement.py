"""How well the judged politeness of ``examples/customer_service_judged.yaml`` agrees with the rule-based one.

Plays 50 dialogues of the ``customer_service`` environment (the example's options; the intent and retrieval agents
answer right, so each reply prompt shows the right fact), then answers each with a reply written here in one of
three tones, cycling: polite (greetings, thanks, apologies, offers of help), neutral (the fact alone) and rude
(``whatever``, ``go away``, ...). Each reply is scored by

* the rule (``politeness``, docs/multi-agent.md: 0.6 for one kind of polite marker, 1.0 for two, 0 if any rude
  word), and
* the judge exactly as the example configures it (its options read from the example file), on this machine's CPU,

and the figures reported are: Spearman's and Pearson's correlation of the two scores over the 50 replies; on the
polite and rude replies (the rule's classes: > 0, and a rude word), the judge's accuracy when it calls a reply
polite at a score >= 0.5 and the probability that it scores a random polite reply above a random rude one (ROC AUC,
ties counted half); the judge's mean score per tone; and its parse failures. Every reply, both scores and the
judge's raw answer are in the JSON::

    OMP_NUM_THREADS=2 python bench/judge_agreement.py --threads 2 --out bench/results/judge_agreement.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "customer_service_judged.yaml"
JUDGE_LABEL = "politeness_judge"

# Reply templates by tone; {fact} is the shown fact ("refunds take 7 days"), {Fact} the same capitalised.
TONES: dict[str, tuple[str, ...]] = {
    "polite": (
        "Hello! Thanks for asking: {fact}. Happy to help.",
        "Thank you for waiting. {Fact}. Glad to help.",
        "Sorry for the trouble. {Fact}. Happy to help.",
        "Hi, thank you for your note. {Fact}.",
        "Thanks for asking! {Fact}.",
        "Hello, sorry for the wait: {fact}. Thank you.",
    ),
    "neutral": (
        "{Fact}.",
        "{Fact}, see your account.",
        "Note that {fact}.",
        "{Fact}. Check the site.",
    ),
    "rude": (
        "Whatever. {Fact}.",
        "{Fact}. Not my problem.",
        "Stupid question. {Fact}. Go away.",
        "Go away, {fact}.",
        "{Fact}, whatever. Stop asking.",
        "Not my problem. Ask someone else.",
    ),
}
ORDER = ("polite", "neutral", "rude", "polite", "rude")  # 50 replies: 20 polite, 10 neutral, 20 rude


def judge_options(example: Path) -> dict[str, Any]:
    """The options of the example's judged component, as its config validates them (paths resolved)."""
    from palestra.config import load_config

    config = load_config(example)
    for term in config.reward.options.components:
        if (term.label or term.name) == JUDGE_LABEL:
            o = term.options
            return {f: getattr(o, f) for f in o.__dataclass_fields__}
    raise SystemExit(f"{example}: no reward component labelled {JUDGE_LABEL!r}")


def reply_prompts(example: Path, n: int, seed: int) -> tuple[list[str], list[dict[str, Any]]]:
    """``n`` reply prompts of the example's environment, the intent and retrieval turns answered right."""
    import yaml

    from palestra.config import build_component

    env_node = yaml.safe_load(example.read_text())["environment"]
    env = build_component("environment", env_node, path="environment")
    obs = env.reset(n, seed=seed)
    for role in ("intent", "retrieval"):
        assert all(o.agent_id == role for o in obs)
        answer = (lambda m: m["intent"]) if role == "intent" else (lambda m: m["gold_ids"][0])
        obs = env.step([answer(o.metadata) for o in obs]).observations
    # the trainer's reward rows carry the acting agent (palestra.multiagent.credit): the judge judges "response" rows
    return [o.prompt for o in obs], [{**o.metadata, "agent_id": o.agent_id} for o in obs]


def replies(metadata: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(tone, reply)`` per dialogue: the tones cycle through :data:`ORDER`, each tone's templates in turn."""
    used = dict.fromkeys(TONES, 0)
    out = []
    for i, meta in enumerate(metadata):
        tone = ORDER[i % len(ORDER)]
        template = TONES[tone][used[tone] % len(TONES[tone])]
        used[tone] += 1
        fact = meta["gold_fact"]
        out.append((tone, template.format(fact=fact, Fact=fact[0].upper() + fact[1:])))
    return out


def ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties given their average rank (as Spearman's correlation needs)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def pearson(x: list[float], y: list[float]) -> float | None:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sx = math.sqrt(sum((a - mx) ** 2 for a in x))
    sy = math.sqrt(sum((b - my) ** 2 for b in y))
    if sx == 0 or sy == 0:
        return None  # a constant score correlates with nothing
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / (sx * sy)


def auc(positive: list[float], negative: list[float]) -> float:
    """P(a random positive scores above a random negative), ties counted half."""
    pairs = [(p > q) + 0.5 * (p == q) for p in positive for q in negative]
    return sum(pairs) / len(pairs)


def agreement(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rule = [r["rule"] for r in rows]
    judged = [r["judge"] for r in rows]
    polite = [r["judge"] for r in rows if r["rule_class"] == "polite"]
    rude = [r["judge"] for r in rows if r["rule_class"] == "rude"]
    right = sum(s >= 0.5 for s in polite) + sum(s < 0.5 for s in rude)
    return {
        "spearman": pearson(ranks(rule), ranks(judged)),
        "pearson": pearson(rule, judged),
        "polite_vs_rude_accuracy": right / (len(polite) + len(rude)),
        "polite_vs_rude_auc": auc(polite, rude),
        "polite_rows": len(polite),
        "rude_rows": len(rude),
        "judge_mean_by_tone": {
            tone: sum(r["judge"] for r in rows if r["tone"] == tone) / max(1, sum(r["tone"] == tone for r in rows))
            for tone in TONES
        },
        "rule_mean_by_tone": {
            tone: sum(r["rule"] for r in rows if r["tone"] == tone) / max(1, sum(r["tone"] == tone for r in rows))
            for tone in TONES
        },
    }


def rule_class(reply: str, score: float) -> str:
    """The rule's class of a reply: ``rude`` (a rude phrase), ``polite`` (a score above 0) or ``neutral``."""
    from palestra.plugins.envs._support_kb import RUDE, segment
    from palestra.plugins.rewards.dialogue import _has_phrase

    if any(_has_phrase(segment(reply), r) for r in RUDE):
        return "rude"
    return "polite" if score > 0 else "neutral"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--example", type=Path, default=EXAMPLE)
    parser.add_argument("--dialogues", type=int, default=50)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads for the judge")
    parser.add_argument("--out", type=Path, default=None, help="write the figures and every row as JSON here")
    parser.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help="override a judge option (YAML value)"
    )
    args = parser.parse_args(argv)

    import torch

    from palestra.config import build_component
    from palestra.plugins.rewards.dialogue import reply_politeness

    torch.set_num_threads(args.threads)
    import yaml

    overrides = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.option)}
    options = {**judge_options(args.example), **overrides, "threads": args.threads, "device": "cpu"}
    prompts, metadata = reply_prompts(args.example, args.dialogues, args.seed)
    toned = replies(metadata)
    loaded = time.perf_counter()
    judge = build_component("reward", {"name": "judge", "options": options}, path="reward").reward
    load_s = time.perf_counter() - loaded
    started = time.perf_counter()
    out = judge(prompts, [r for _, r in toned], metadata)
    judge_s = time.perf_counter() - started
    texts = [text for text, _ in judge._units(prompts, [r for _, r in toned], metadata, list(range(len(prompts))))]
    answers = [judge.cache.peek(t).answer for t in texts]  # what the judge said, as it cached it
    rows = []
    for i, ((tone, reply), answer) in enumerate(zip(toned, answers)):
        rule = reply_politeness(reply)
        rows.append(
            {
                "tone": tone,
                "reply": reply,
                "prompt": prompts[i],
                "rule": rule,
                "rule_class": rule_class(reply, rule),
                "judge": float(out.scores[i]),
                "answer": answer,
            }
        )
    result = {
        "command": " ".join(["python", "bench/judge_agreement.py", *(argv if argv is not None else sys.argv[1:])]),
        "judge_options": {k: v for k, v in options.items() if k not in ("path",)} | {"path": str(options["path"])},
        "dialogues": len(rows),
        "threads": args.threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_s": round(load_s, 2),
        "judge_s": round(judge_s, 2),
        "parse_failures": out.metrics["parse_failures"],
        **agreement(rows),
        "rows": rows,
    }
    summary = {k: v for k, v in result.items() if k != "rows"}
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
