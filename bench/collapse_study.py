"""Why the built-in task's runs collapse to a constant answer: instrumented, controlled runs, one change at a time.

    python bench/collapse_study.py --list
    python bench/collapse_study.py --config grpo --hypotheses base scale_none unlock_early --seeds 0 --steps 600
    python bench/collapse_study.py ... --out bench/results/collapse_study.json

Each hypothesis is a set of ``key=value`` overrides on one example config (``--config``); every run is
instrumented from the outside (this script only wraps the algorithm's ``advantages`` call) and records, per step:

* ``entropy`` (the token mean the learner logs) and ``answer_entropy``: the policy's entropy at the first
  token after ``<answer>`` (the answer's first digit: the only token correctness depends on for sums <= 9);
* ``distinct``: distinct completions per group (a collapsed policy samples one answer 8 times);
* ``tied``: the fraction of groups whose rewards are all equal (their advantages are 0), and ``near_tied_adv``:
  the mean |advantage| of the odd row out in groups where exactly one row differs (what ``scale: group`` blows up);
* every ``--probe-every`` steps, on the step's batch: the gradient norm of the policy-gradient term and of the
  entropy bonus, each alone (``ent_share = |g_ent| / (|g_pg| + |g_ent|)``), and the RMS of the output logits;
* ``clip_frac`` and the curriculum's unlock step, from the learner's own metrics;
* ``adv_std``: the advantages' std over the valid tokens (the scale the entropy bonus is weighed against).

The summary per run: held-out reward and correctness after training, the lowest answer entropy, the answer
entropy when correctness unlocked, the mean near-tied advantage and entropy share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from robustness import BARE_ANSWER, run_one

# name -> (what it tests, overrides on top of the example config)
HYPOTHESES: dict[str, tuple[str, list[str]]] = {
    "base": ("the example as it is", []),
    # (a) scale: group divides near-tied groups' centred rewards by a tiny std
    "scale_none": ("(a) no std division", ["optimizer.options.scale=none"]),
    "scale_batch": ("(a) the batch's std instead of the group's", ["optimizer.options.scale=batch"]),
    "std_eps_0.5": ("(a) std + 0.5: near-tied groups no longer blown up", ["optimizer.options.std_eps=0.5"]),
    # (b) the entropy bonus under token-mean aggregation
    "entropy_0": ("(b) no entropy bonus", ["optimizer.options.entropy_coef=0.0"]),
    "entropy_0.2": ("(b) 4x the entropy bonus", ["optimizer.options.entropy_coef=0.2"]),
    "seq_mean": (
        "(b) per-row token mean instead of the batch token mean",
        ["optimizer.options.loss_agg=seq_mean_token_mean"],
    ),
    # (c) the learning rate
    "lr_3e-4": ("(c) lr 3e-4", ["train.lr=0.0003"]),
    "lr_3e-3": ("(c) lr 3e-3", ["train.lr=0.003"]),
    "warmup_cosine": ("(c) 50 warm-up steps, cosine decay", ["train.warmup_steps=50", "train.lr_schedule=cosine"]),
    # (d) the format curriculum: correctness joins late, after the answer digit has collapsed
    "unlock_early": ("(d) correctness unlocks at format average 0.05", ["reward.options.layers[1].unlock_at=0.05"]),
    "temperature_1.5": ("(e) sampling temperature 1.5", ["train.temperature=1.5"]),
    # (g) the answer's position and the format layer: the same policy on the same sums, scored differently
    "correctness_only": (
        "(g) correctness alone (no format layer, no curriculum), answer in the tag",
        ["reward.name=correctness"],
    ),
    "bare_answer": ("(g) a one-token bare answer scored by correctness (no tag, no format layer)", BARE_ANSWER),
    "bare_answer_tagged_prompt": (
        "(g) the same, the prompt ending in <answer> (the answer read at the tag's position)",
        [*BARE_ANSWER, 'environment.options.prompt="{question} = <answer>"'],
    ),
    "bare_answer_2_tokens": (
        "(g) the same with 2 new tokens (the answer then a terminator must both be right)",
        [*BARE_ANSWER, "train.max_new_tokens=2"],
    ),
    # (g) credit: once correctness is unlocked, a row whose format is right carries its advantage on its answer digits
    # only (the tags get 0); rows with a broken format keep it on every token. Done by this script (see instrument).
    "answer_credit": ("(g) advantage on the answer digits only once the format is right", []),
    # (f) the signal per step: more prompts per step (each of the 25 sums seen ~2.5 times a step instead of 0.6)
    "batch_64": ("(f) 64 prompts a step instead of 16", ["train.batch_size=64"]),
    "batch_64_scale_none": (
        "(f) 64 prompts a step, no std division",
        ["train.batch_size=64", "optimizer.options.scale=none"],
    ),
    # (h) the advantages' scale against the entropy bonus: algorithms that normalise their advantages to unit
    # scale (REINFORCE's running normalisation, REINFORCE++'s and PPO's whitening) make the same 0.05 bonus a
    # smaller share of the update (under Adam only the ratio matters)
    "normalize_on": ("(h) reinforce: running reward normalisation", ["optimizer.options.normalize=true"]),
    "normalize_off": ("(h) reinforce: no running reward normalisation", ["optimizer.options.normalize=false"]),
    "whiten_on": ("(h) ppo: advantages whitened over the batch", ["optimizer.options.whiten_advantages=true"]),
    "whiten_off": ("(h) ppo: advantages not whitened", ["optimizer.options.whiten_advantages=false"]),
    "entropy_0.05": ("(h) entropy bonus 0.05", ["optimizer.options.entropy_coef=0.05"]),
    "entropy_0.12": ("(h) entropy bonus 0.12", ["optimizer.options.entropy_coef=0.12"]),
    "entropy_0.25": ("(h) entropy bonus 0.25", ["optimizer.options.entropy_coef=0.25"]),
}


def instrument(record: list[dict[str, Any]], probe_every: int, *, answer_credit: bool = False):
    """A trainer hook that wraps ``trainer.algorithm.advantages`` to record the collapse diagnostics per step.

    ``answer_credit``: after the curriculum unlocked its last layer, rows that scored at least the first layer's
    maximum (their format is right) keep their advantage on digit tokens only (an experiment, not a library change).
    """
    import torch

    def hook(trainer: Any) -> None:
        algo, policy = trainer.algorithm, trainer.policy
        open_id = policy.tokenizer.token_to_id("<answer>")  # the tiny policy's character tokenizer: an atom
        inner = algo.advantages
        logits_rms: list[float] = []
        handle_box: list[Any] = []

        def on_logits(_module: Any, _inputs: Any, output: torch.Tensor) -> None:
            logits_rms.append(float(output.detach().float().pow(2).mean().sqrt()))

        digit_ids = torch.tensor([policy.tokenizer.token_to_id(d) for d in "0123456789"])

        def advantages(batch: Any) -> Any:
            batch = inner(batch)
            step = len(record)
            if answer_credit and all(trainer.reward.reward.unlocked):  # the layered reward inside its checks
                mask = batch.completion_mask
                adv = batch.advantages.float()[:, None].expand(mask.shape).clone()
                digits = torch.isin(batch.completion_ids, digit_ids.to(batch.completion_ids.device))
                format_ok = batch.rewards.float() >= 1.0
                adv[format_ok[:, None] & ~digits] = 0.0
                batch.advantages = adv * mask
            row: dict[str, Any] = {"step": step + 1}
            ids, mask = batch.completion_ids, batch.completion_mask
            g = trainer.config.train.group_size
            r = batch.rewards.float().view(-1, g)
            tied = (r.max(-1).values - r.min(-1).values) == 0
            row["tied"] = float(tied.float().mean())
            row["reward_mean"] = float(r.mean())
            adv = batch.advantages.float()
            # the advantages' scale: std over the valid tokens (per-row advantages: over rows)
            row["adv_std"] = float((adv[batch.completion_mask] if adv.dim() == 2 else adv).std())
            if adv.dim() == 2:  # per-token advantages: the first token's stands for the row
                adv = adv[:, 0]
            adv = adv.view(-1, g)
            # groups where exactly one row's reward differs from the other g - 1
            odd = []
            for k in range(r.shape[0]):
                values, counts = r[k].unique(return_counts=True)
                if len(values) == 2 and int(counts.min()) == 1:
                    lone = values[counts.argmin()]
                    odd.append(float(adv[k][r[k] == lone].abs().max()))
            row["near_tied_adv"] = statistics.mean(odd) if odd else None
            rows = [tuple(ids[i][mask[i]].tolist()) for i in range(ids.shape[0])]
            row["distinct"] = statistics.mean(len(set(rows[k * g : (k + 1) * g])) for k in range(len(rows) // g))
            if probe_every and step % probe_every == 0:
                row.update(probe(batch))
            record.append(row)
            return batch

        def probe(batch: Any) -> dict[str, Any]:
            params = [p for p in policy.parameters() if p.requires_grad]
            head = policy.output_head()
            logits_rms.clear()
            handle_box.append(head.register_forward_hook(on_logits))
            try:
                with torch.enable_grad():
                    scores = algo.score(policy, batch)
                    mask = batch.completion_mask
                    pg = algo.aggregate(-algo.token_advantages(batch) * scores.logprobs, mask)
                    ent = algo.aggregate(-algo.options.entropy_coef * scores.entropy, mask)
                    g_pg = torch.autograd.grad(pg, params, retain_graph=True, allow_unused=True)
                    g_ent = torch.autograd.grad(ent, params, allow_unused=True) if algo.options.entropy_coef > 0 else []
            finally:
                while handle_box:
                    handle_box.pop().remove()
            n_pg = float(torch.sqrt(sum((x.float() ** 2).sum() for x in g_pg if x is not None)))
            n_ent = float(torch.sqrt(sum((x.float() ** 2).sum() for x in g_ent if x is not None))) if g_ent else 0.0
            out = {
                "g_pg": n_pg,
                "g_ent": n_ent,
                "ent_share": n_ent / (n_pg + n_ent) if n_pg + n_ent > 0 else None,
                "logits_rms": logits_rms[0] if logits_rms else None,
            }
            # entropy at the token after <answer>
            ids = batch.completion_ids
            after_open = torch.zeros_like(batch.completion_mask)
            after_open[:, 1:] = (ids[:, :-1] == open_id) & batch.completion_mask[:, 1:]
            if after_open.any():
                out["answer_entropy"] = float(scores.entropy.detach()[after_open].mean())
            return out

        algo.advantages = advantages  # this study's instrumentation only; the library is not changed

    return hook


def summarise(result: dict[str, Any], record: list[dict[str, Any]]) -> dict[str, Any]:
    hist = result["history"]
    unlock = next((i + 1 for i, m in enumerate(hist) if m.get("curriculum/correctness/active", 1.0) >= 1.0), None)
    probes = [r for r in record if "g_pg" in r]
    answer_h = [(r["step"], r["answer_entropy"]) for r in probes if r.get("answer_entropy") is not None]
    at_unlock = None
    if unlock is not None and answer_h:
        at_unlock = min(answer_h, key=lambda x: abs(x[0] - unlock))[1]
    shares = [r["ent_share"] for r in probes if r.get("ent_share") is not None]
    near = [r["near_tied_adv"] for r in record if r.get("near_tied_adv") is not None]
    ent = [m["policy/entropy"] for m in hist[20:] if "policy/entropy" in m]
    plateau = [r["adv_std"] for r in record[200:] if r.get("adv_std") is not None]  # after the format phase
    return {
        "reward": result["reward"],
        "correctness": result["correctness"],
        "min_entropy": min(ent) if ent else None,
        "final_entropy": hist[-1].get("policy/entropy"),
        "min_answer_entropy": min(h for _, h in answer_h) if answer_h else None,
        "answer_entropy_at_unlock": at_unlock,
        "unlock_step": unlock,
        "final_distinct": statistics.mean(r["distinct"] for r in record[-20:]),
        "mean_near_tied_adv": statistics.mean(near) if near else None,
        "mean_ent_share": statistics.mean(shares) if shares else None,
        "mean_adv_std_after_200": statistics.mean(plateau) if plateau else None,
        "mean_clip_frac": statistics.mean(m.get("policy/clip_frac", 0.0) for m in hist),
        "logits_rms_last": next((r["logits_rms"] for r in reversed(probes) if r.get("logits_rms") is not None), None),
        "seconds": result["seconds"],
    }


def fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="grpo", help="example config the hypotheses change (or 'default')")
    parser.add_argument("--hypotheses", nargs="+", default=list(HYPOTHESES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    parser.add_argument("--probe-every", type=int, default=25)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--list", action="store_true", help="print the hypotheses and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, (what, overrides) in HYPOTHESES.items():
            print(f"{name:<16} {what}: {' '.join(overrides) or '(none)'}")
        return 0
    unknown = [h for h in args.hypotheses if h not in HYPOTHESES]
    if unknown:
        parser.error(f"--hypotheses: unknown {unknown}; see --list")

    runs: list[dict[str, Any]] = []
    if args.out is not None and args.out.exists():
        runs = json.loads(args.out.read_text())["runs"]  # append: a study is built up over several invocations
    for name in args.hypotheses:
        what, overrides = HYPOTHESES[name]
        for seed in args.seeds:
            record: list[dict[str, Any]] = []
            ov = [f"train.steps={args.steps}", *overrides, *args.set]
            hook = instrument(record, args.probe_every, answer_credit=name == "answer_credit")
            result = run_one(args.config, seed, ov, trainer_hook=hook)
            s = summarise(result, record)
            s.update(hypothesis=name, what=what, config=args.config, seed=seed, overrides=ov)
            runs.append({**s, "trace": record[:: max(1, args.probe_every)]})
            print(
                f"{name:<16} seed {seed}: reward {s['reward']:.3f} corr {fmt(s['correctness'])} "
                f"minH {fmt(s['min_entropy'])} minH_ans {fmt(s['min_answer_entropy'])} H_ans@unlock "
                f"{fmt(s['answer_entropy_at_unlock'])} unlock {s['unlock_step']} distinct {s['final_distinct']:.2f} "
                f"near_tied_adv {fmt(s['mean_near_tied_adv'], '.2f')} ent_share {fmt(s['mean_ent_share'])} "
                f"adv_std {fmt(s['mean_adv_std_after_200'])} "
                f"clip {s['mean_clip_frac']:.3f} logits {fmt(s['logits_rms_last'], '.1f')} {s['seconds']:.0f} s",
                flush=True,
            )
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
