"""Win/draw/loss rates of a policy on a ``textarena`` environment: an untrained policy, or a run's checkpoint.

Builds the run's components exactly as ``palestra train`` does (same seed, so ``--config`` alone gives the very
initial weights training starts from), loads the checkpoint's weights when one is given, plays ``--games`` games
on seeds that training and the trainer's held-out evaluation never use, and counts each agent's result from the
game's outcome (``metadata["outcome"]``: textarena's reward per player, > 0 win, 0 draw, < 0 loss)::

    python bench/textarena_win_rate.py --config examples/textarena_rps.yaml --games 200             # before
    python bench/textarena_win_rate.py --run runs/textarena_rps --games 200                         # after
    python bench/textarena_win_rate.py --run runs/textarena_rps --games 200 --sample                # sampled
    python bench/textarena_win_rate.py --checkpoint runs/textarena_rps/checkpoints/step-000050.pt
    python bench/textarena_win_rate.py --run runs/textarena_rps --config examples/textarena_rps.yaml \
        'environment.options.opponents={"1": random}'      # the trained weights against another opponent

Greedy decoding by default (``--sample``: sampling at ``train.temperature``). ``invalid`` counts the games the
agent lost by its own invalid moves (textarena: a second invalid move in a row loses), ``unfinished`` the
episodes cut at the environment's ``max_turns``. ``--json`` prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RESULTS = ("win", "draw", "loss")


def load(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The validated config and the checkpoint to load (None: the initial policy)."""
    from palestra.config import load_config, validate_config

    checkpoint: str | None = None
    if args.run:
        checkpoint = str(Path(args.run) / "checkpoint.pt")
    elif args.checkpoint:
        checkpoint = args.checkpoint
    if checkpoint is not None and not Path(checkpoint).is_file():
        raise SystemExit(f"textarena_win_rate: no checkpoint at {checkpoint}")
    if args.config:
        config = load_config(args.config, args.overrides)
    elif checkpoint is not None:
        if args.overrides:
            raise SystemExit("textarena_win_rate: overrides need --config (a checkpoint's own config is used as saved)")
        from palestra.engine.checkpoint import load_checkpoint

        config = validate_config(load_checkpoint(checkpoint, mmap=True)["config"])
    else:
        raise SystemExit(
            "textarena_win_rate: give --config FILE (the initial policy), --run RUN_DIR or --checkpoint PATH"
        )
    if config.environment.name != "textarena":
        raise SystemExit(f"textarena_win_rate: the run's environment is {config.environment.name!r}, not 'textarena'")
    return config, checkpoint


def play(
    config: Any, checkpoint: str | None, games: int, *, batch: int, sample: bool, seed: int | None
) -> dict[str, Any]:
    """Play ``games`` games and count every agent's results."""
    import torch

    from palestra.engine.rollout import collect
    from palestra.engine.trainer import Trainer, derive_seed
    from palestra.types import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:  # nothing is written there: the trainer only builds the components
        trainer = Trainer(config, run_dir=tmp)
    if checkpoint is not None:
        from palestra.engine.checkpoint import load_checkpoint

        trainer.policy.load_state_dict(load_checkpoint(checkpoint)["policy"])
    policy, env = trainer.policy, trainer.eval_env
    policy.eval()
    t = config.train
    params = SamplingParams(
        max_new_tokens=t.max_new_tokens, temperature=t.temperature if sample else 0.0, top_p=t.top_p
    )
    base = config.run.seed if seed is None else seed
    counts: dict[str, Counter[str]] = {a: Counter() for a in env.agent_ids}
    rewards: dict[str, float] = dict.fromkeys(env.agent_ids, 0.0)
    turns = 0
    started = time.perf_counter()
    done = 0
    chunk = 0
    while done < games:
        n = min(batch, games - done)
        gen = torch.Generator(device=trainer.device).manual_seed(derive_seed(base, "win-rate/sampling", chunk))
        with torch.no_grad():
            ro = collect(
                env, policy, trainer.generator, params, n, seed=derive_seed(base, "win-rate/games", chunk), rng=gen
            )
        for ep in ro.episodes:
            outcome, agents = ep.metadata["outcome"], ep.metadata["agents"]
            turns += len(ep.turns)
            for agent, player in agents.items():
                if not outcome["finished"]:
                    counts[agent]["unfinished"] += 1
                    continue
                r = float(outcome["rewards"][str(player)])
                rewards[agent] += r
                result = "win" if r > 0 else "loss" if r < 0 else "draw"
                counts[agent][result] += 1
                if result == "loss" and (outcome.get("invalid_move") or {}).get(str(player)):
                    counts[agent]["invalid"] += 1
        done += n
        chunk += 1
    o = config.environment.options
    return {
        "game": o.game,
        "opponents": dict(o.opponents),
        "checkpoint": checkpoint,
        "decoding": f"sampled (temperature {t.temperature})" if sample else "greedy",
        "games": games,
        "seconds": round(time.perf_counter() - started, 2),
        "turns_per_game": turns / games,
        "agents": {
            a: {**{k: c[k] / games for k in (*RESULTS, "invalid", "unfinished")}, "mean_reward": rewards[a] / games}
            for a, c in counts.items()
        },
    }


def report(result: dict[str, Any]) -> str:
    opp = ", ".join(f"player {p}: {k}" for p, k in result["opponents"].items()) or "none (self-play)"
    lines = [
        f"{result['game']}, opponents {opp}; {result['games']} games, {result['decoding']}, "
        f"{result['checkpoint'] or 'initial policy'} "
        f"({result['seconds']} s, {result['turns_per_game']:.1f} agent turns a game)",
        f"{'agent':<12}{'win':>8}{'draw':>8}{'loss':>8}{'invalid':>9}{'unfinished':>12}{'reward':>9}",
    ]
    for agent, r in result["agents"].items():
        lines.append(
            f"{agent:<12}{r['win']:>8.3f}{r['draw']:>8.3f}{r['loss']:>8.3f}{r['invalid']:>9.3f}"
            f"{r['unfinished']:>12.3f}{r['mean_reward']:>9.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--run", metavar="RUN_DIR", help="a finished run: its checkpoint.pt and the config saved in it")
    src.add_argument("--checkpoint", metavar="PATH", help="a checkpoint file (checkpoint.pt or checkpoints/step-N.pt)")
    p.add_argument(
        "--config", metavar="FILE", help="the run's config; alone: the untrained policy (the run's initial weights)"
    )
    p.add_argument("--games", type=int, default=200, help="games to play (default 200)")
    p.add_argument("--batch", type=int, default=100, help="games played at once (default 100)")
    p.add_argument("--sample", action="store_true", help="sample at train.temperature instead of greedy decoding")
    p.add_argument("--seed", type=int, default=None, help="seeds the games and the sampling (default: run.seed)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (with --config)")
    args = p.parse_args(argv)
    if args.games < 1 or args.batch < 1:
        p.error("--games and --batch must be positive")
    config, checkpoint = load(args)
    result = play(config, checkpoint, args.games, batch=args.batch, sample=args.sample, seed=args.seed)
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
