"""Benchmark cases for the advantage estimators (used by ``palestra bench`` and bench/test_bench_advantages.py).

``cases(device, quick)`` returns one dict per (op, size, implementation): ``fn`` runs one call. Our rows:

* ``cpp`` (``cuda`` / ``triton`` on a GPU): the public API (``palestra.kernels.<op>``, argument checks and
  dispatch included) with that back end forced.
* ``torch``: the same public call with Palestra's own torch back end forced (it computes in float64). This
  is **the reference**: ``auto`` may only use a native back end where it is faster than this row
  (kernels/dispatch.py AUTO_BACKENDS, tests/kernels/test_auto_dispatch.py). It is marked ``baseline`` so
  that every native row reports its speed-up over it.

Both go through the same wrapper, :func:`ours`, which forces the back end by swapping one module global
(about 0.1 µs; ``set_backend`` in a context manager cost about 1 µs a call, a tenth of these ops' time).

Peers, measured in the same run (baselines, reported, not the rule for ``auto``):

* ``torchrl-vec``: torchrl's ``vec_generalized_advantage_estimate`` (a truncated-filter convolution; its
  inputs, [B, T, 1] with next values and done flags, are prepared outside the timed call). It raises
  ImportError when torchrl is not installed (the bench reports the row as an error).
* ``verl-loop``: a Python loop over time written here in the style of verl's
  ``compute_gae_advantage_return`` (vectorised over rows, carries held through padding), and the
  same for REINFORCE++ returns.
* ``torch-eager``: bare float32 eager torch for the group ops (view into groups, mean/std, as TRL / verl
  write it; no argument checks, no dispatch).

Inputs are right-padded (random lengths in [T/2, T]) with zero rewards at padding, where all the
implementations mean the same thing; bench/test_bench_advantages.py checks that they agree.

Run as a script, this file re-measures some ops with every implementation of a group timed **alternately**
(the noisy shared VM's load then falls on all of them alike) and writes them into a recorded run, leaving the
other ops' rows as they are::

    OMP_NUM_THREADS=1 python bench/cases_advantages.py --update bench/results/cpu.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

import palestra.kernels as K
from palestra.kernels import dispatch

GAMMA, LAM = 0.99, 0.95


def ours(backend: str, fn):
    """Run ``fn`` (a call of the public API) with ``backend`` forced.

    Every one of our rows, the torch reference's included, is timed through this same wrapper. It sets
    ``dispatch._forced`` directly (what ``set_backend`` sets, the name checked once here) and puts back
    what was there, so nothing stays forced after the call; its cost is about 0.1 µs."""
    if backend not in dispatch.BACKENDS:
        raise ValueError(f"unknown back end {backend!r}")

    def run():
        previous = dispatch._forced
        dispatch._forced = backend
        try:
            return fn()
        finally:
            dispatch._forced = previous

    return run


# ---- inputs -------------------------------------------------------------------------------------------
def sequences(B: int, T: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rewards = torch.randn(B, T, generator=gen) * mask
    values = torch.randn(B, T, generator=gen)
    return rewards.to(device), values.to(device), mask.to(device)


def torchrl_inputs(rewards, values, mask):
    """torchrl's [B, T, 1] layout: next values, and done = terminated at each row's last valid step (a
    terminal end: bootstrap value 0). The padding after it ends at T - 1 as a trajectory of its own (its
    outputs are ignored); flagging every padding step instead would split it into one-step trajectories,
    which torchrl pads to T each (a ~T-fold slowdown that says nothing about GAE itself)."""
    T = rewards.shape[1]
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    lengths = mask.sum(1)
    steps = torch.arange(T, device=mask.device)[None, :]
    last = steps == (lengths - 1)[:, None]
    done = last | (steps == T - 1)
    return tuple(x.unsqueeze(-1) for x in (values, next_values, rewards, done, last))


def torchrl_gae():
    try:
        from torchrl.objectives.value.functional import vec_generalized_advantage_estimate
    except ImportError as e:
        raise ImportError(f"torchrl is not installed ({e}); pip install torchrl tensordict") from None
    return vec_generalized_advantage_estimate


# ---- baselines written here ---------------------------------------------------------------------------
@torch.no_grad()
def verl_style_gae(rewards, values, mask, gamma: float, lam: float):
    """The reverse loop over time that verl's compute_gae_advantage_return runs (our own code)."""
    B, T = rewards.shape
    m = mask.to(values.dtype)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    last_adv = torch.zeros_like(next_value)
    reversed_advs = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * last_adv
        # padding: keep the carries of the next valid step
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last_adv = adv_t * m[:, t] + (1 - m[:, t]) * last_adv
        reversed_advs.append(last_adv)
    advantages = torch.stack(reversed_advs[::-1], dim=1)
    return advantages, advantages + values


def masked_whiten_eager(x, mask, eps: float = 1e-8):
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + eps) * m


@torch.no_grad()
def verl_style_returns(rewards, mask, gamma: float):
    """REINFORCE++ returns as verl writes them: a reverse loop, reset at padding, then masked whitening."""
    B, T = rewards.shape
    m = mask.to(rewards.dtype)
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    out = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
        running = running * m[:, t]
    return masked_whiten_eager(out, mask)


def eager_group(rewards, k: int, scale: str, eps: float = 1e-6):
    g = rewards.view(-1, k)
    centred = g - g.mean(1, keepdim=True)
    if scale == "group":
        centred = centred / (g.std(1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (rewards.std() + eps)
    return centred.view(-1)


def eager_rloo(rewards, k: int):
    g = rewards.view(-1, k)
    return (g - (g.sum(1, keepdim=True) - g) / (k - 1)).view(-1)


# ---- cases --------------------------------------------------------------------------------------------
def native_backends(device: str) -> list[str]:
    return ["cuda", "triton"] if device == "cuda" else ["cpp"]


def our_backends(device: str) -> list[tuple[str, bool]]:
    """(back end, baseline) for our rows: the native ones, then the torch reference (a baseline: the
    native rows' speed-up over it is what AUTO_BACKENDS follows)."""
    return [(b, False) for b in native_backends(device)] + [("torch", True)]


def gae_sizes(device: str, quick: bool, big: bool = False) -> list[tuple[int, int]]:
    if big:
        return [(1024, 8192)] if device == "cuda" else [(1024, 4096)]
    if quick:
        return [(64, 256)]
    return [(256, 1024), (1024, 4096)] if device == "cuda" else [(256, 1024)]


def group_sizes(device: str, quick: bool, big: bool = False) -> list[tuple[int, int]]:
    if big:
        return [(1 << 20, 64)] if device == "cuda" else [(65536, 64)]
    if quick:
        return [(1024, 8)]
    return [(8192, 16), (65536, 64)] if device == "cuda" else [(8192, 16)]


def cases(device: str, quick: bool, big: bool = False) -> list[dict]:
    """All cases at the default sizes (``quick``: small ones; ``big``: only sizes past the defaults)."""
    out: list[dict] = []
    for B, T in gae_sizes(device, quick, big):
        r, v, m = sequences(B, T, device)
        size = f"B={B} T={T}"
        gae_bytes = B * T * (4 + 4 + 1 + 4 + 4)
        for backend, reference in our_backends(device):
            out.append(
                dict(
                    op="gae",
                    size=size,
                    impl=backend,
                    baseline=reference,
                    bytes=gae_bytes,
                    fn=ours(backend, lambda r=r, v=v, m=m: K.gae(r, v, m, GAMMA, LAM)),
                )
            )
        rl = torchrl_inputs(r, v, m)

        def run_torchrl(rl=rl):
            return torchrl_gae()(GAMMA, LAM, *rl)

        out.append(dict(op="gae", size=size, impl="torchrl-vec", baseline=True, bytes=gae_bytes, fn=run_torchrl))
        out.append(
            dict(
                op="gae",
                size=size,
                impl="verl-loop",
                baseline=True,
                bytes=gae_bytes,
                fn=lambda r=r, v=v, m=m: verl_style_gae(r, v, m, GAMMA, LAM),
            )
        )

        ret_bytes = B * T * (4 + 1 + 4)
        for backend, reference in our_backends(device):
            out.append(
                dict(
                    op="discounted_returns",
                    size=size,
                    impl=backend,
                    baseline=reference,
                    bytes=ret_bytes,
                    fn=ours(backend, lambda r=r, m=m: K.discounted_returns(r, m, GAMMA)),
                )
            )
        out.append(
            dict(
                op="discounted_returns",
                size=size,
                impl="verl-loop",
                baseline=True,
                bytes=ret_bytes,
                fn=lambda r=r, m=m: verl_style_returns(r, m, GAMMA),
            )
        )

    for B, k in group_sizes(device, quick, big):
        rewards = torch.randn(B, generator=torch.Generator().manual_seed(1)).to(device)
        size = f"B={B} group={k}"
        for scale in ("group", "none"):
            op = f"group_advantages[{scale}]"
            for backend, reference in our_backends(device):
                out.append(
                    dict(
                        op=op,
                        size=size,
                        impl=backend,
                        baseline=reference,
                        bytes=8 * B,
                        fn=ours(backend, lambda x=rewards, k=k, s=scale: K.group_advantages(x, k, scale=s)),
                    )
                )
            out.append(
                dict(
                    op=op,
                    size=size,
                    impl="torch-eager",
                    baseline=True,
                    bytes=8 * B,
                    fn=lambda x=rewards, k=k, s=scale: eager_group(x, k, s),
                )
            )
        for backend, reference in our_backends(device):
            out.append(
                dict(
                    op="rloo_advantages",
                    size=size,
                    impl=backend,
                    baseline=reference,
                    bytes=8 * B,
                    fn=ours(backend, lambda x=rewards, k=k: K.rloo_advantages(x, k)),
                )
            )
        out.append(
            dict(
                op="rloo_advantages",
                size=size,
                impl="torch-eager",
                baseline=True,
                bytes=8 * B,
                fn=lambda x=rewards, k=k: eager_rloo(x, k),
            )
        )
    return out


# ---- alternated re-measurement (``python bench/cases_advantages.py --update FILE.json``) ------------------
def alternated(group: list[dict], min_time: float, slice_s: float = 1e-3, min_rounds: int = 20) -> dict:
    """Time the implementations of one (op, size) group in turns: each round gives every implementation a
    slice of about ``slice_s`` (whole calls, each timed on its own, as ``palestra bench`` times them), the
    first one rotating from round to round, until ``min_time`` seconds and ``min_rounds`` rounds are spent.

    Returns ``{impl: (call times, per-round medians)}``."""
    import time

    from timing import sync, timed

    for case in group:  # warm-up: builds the native library, fills the caches
        for _ in range(3):
            case["fn"]()
    sync()
    calls = {}
    for case in group:
        one = statistics.median(timed(case["fn"]) for _ in range(5))
        calls[case["impl"]] = max(1, int(slice_s / max(one, 1e-9)))
    times = {case["impl"]: ([], []) for case in group}
    start, rounds = time.perf_counter(), 0
    while rounds < min_rounds or time.perf_counter() - start < min_time:
        k = rounds % len(group)
        for case in group[k:] + group[:k]:
            these = [timed(case["fn"]) for _ in range(calls[case["impl"]])]
            times[case["impl"]][0].extend(these)
            times[case["impl"]][1].append(statistics.median(these))
        rounds += 1
    return times


def remeasure(ops: set[str], device: str, min_time: float) -> tuple[list[dict], list[str]]:
    """Rows in ``palestra bench``'s format for ``ops`` at the default sizes, each group timed alternately,
    and notes: for every native row, the median over rounds of its time / the torch row's in that round."""
    from palestra.cli.bench import _add_ratios, peak_memory

    rows, notes = [], []
    chosen = [c for c in cases(device, quick=False) if c["op"] in ops]
    groups: dict[tuple[str, str], list[dict]] = {}
    for case in chosen:
        groups.setdefault((case["op"], case["size"]), []).append(case)
    for (op, size), group in groups.items():
        print(f"  {op} {size}: {', '.join(c['impl'] for c in group)}", file=sys.stderr)
        times = alternated(group, min_time)
        for case in group:
            calls, _ = times[case["impl"]]
            seconds = statistics.median(calls)
            rows.append(
                dict(
                    op=op,
                    size=size,
                    impl=case["impl"],
                    baseline=case["baseline"],
                    seconds=seconds,
                    peak_bytes=peak_memory(case["fn"], device),
                    gbps=case["bytes"] / seconds / 1e9,
                    error=None,
                )
            )
            q1, _, q3 = statistics.quantiles(calls, n=4)
            notes.append(
                f"  {op:<24} {size:<18} {case['impl']:<12} median {seconds * 1e6:7.2f} us  "
                f"(quartiles {q1 * 1e6:.2f}-{q3 * 1e6:.2f} us, {len(calls)} calls)"
            )
        for case in group:  # paired ratios: per round, a native row's median over each other row's
            if case["baseline"]:
                continue
            for other in group:
                if other is not case:
                    ratio = statistics.median(a / b for a, b in zip(times[case["impl"]][1], times[other["impl"]][1]))
                    notes.append(
                        f"  {op:<24} {size:<18} {case['impl']} / {other['impl']}, paired by round: "
                        f"{ratio:.2f} (< 1: {case['impl']} faster)"
                    )
    _add_ratios(rows)
    return rows, notes


def splice(path: Path, new_rows: list[dict], note: dict) -> list[dict]:
    """Replace the rows of the re-measured ops in the recorded run at ``path`` (where the first of them
    stood), keep every other row, record ``note`` in ``meta["remeasured"]``."""
    data = json.loads(path.read_text())
    ops = {r["op"] for r in new_rows}
    old = data["rows"]
    at = next((i for i, r in enumerate(old) if r["op"] in ops), len(old))
    kept = [r for r in old if r["op"] not in ops]
    at -= sum(1 for r in old[:at] if r["op"] in ops)
    data["rows"] = kept[:at] + new_rows + kept[at:]
    data["meta"].setdefault("remeasured", []).append(note)
    path.write_text(json.dumps(data, indent=2, default=str))
    return data["rows"]


def main(argv: list[str] | None = None) -> int:
    import argparse
    import datetime
    import subprocess

    from palestra.cli.bench import format_table

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--update", required=True, help="a recorded run (bench/results/cpu*.json) to splice the rows into")
    p.add_argument("--ops", default="group_advantages[group],group_advantages[none],rloo_advantages")
    p.add_argument("--min-time", type=float, default=20.0, help="seconds per (op, size) group")
    args = p.parse_args(argv)
    ops = {o.strip() for o in args.ops.split(",") if o.strip()}
    device = "cpu"
    print(f"re-measuring {sorted(ops)} on {device}, {torch.get_num_threads()} thread(s)", file=sys.stderr)
    rows, notes = remeasure(ops, device, args.min_time)
    repo = Path(__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=repo
    ).stdout.strip()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    note = dict(
        ops=sorted(ops),
        date=when,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        commit=commit,
        how="python bench/cases_advantages.py --update (each (op, size) group alternated, "
        f"{args.min_time:g} s per group; medians of single calls)",
    )
    path = Path(args.update)
    all_rows = splice(path, rows, note)
    table = format_table(all_rows)
    print(table)
    print("\n".join(notes))
    txt = path.with_suffix(".txt")
    threads = torch.get_num_threads()
    txt.write_text(
        table
        + "\n\n"
        + "\n".join(
            [
                f"Re-measured {when} (commit {commit} + working tree), {threads} thread(s): {', '.join(sorted(ops))}.",
                f"Those rows: `OMP_NUM_THREADS={threads} python bench/cases_advantages.py --update {path.as_posix()}`,",
                f"the implementations of each (op, size) timed alternately ({args.min_time:g} s a group, medians of",
                "single calls). `torch` is Palestra's own torch back end, the reference that `auto` is held to, timed",
                "through the same public call and wrapper as `cpp`; `torch-eager` is the bare TRL-style float32 peer",
                "(reported, not the rule).",
                "Every other row is the original `palestra bench` run (meta.threads threads).",
                *notes,
            ]
        )
        + "\n"
    )
    print(f"written: {path}, {txt}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py
    sys.exit(main())
