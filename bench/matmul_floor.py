"""The matmul floor of a SmolLM2-135M GRPO step on this CPU: each part's multiplies at the rate this machine's matmuls
reach at that part's shapes, against what a measured step took.

SmolLM2-135M: 30 layers of width 576 (9 query heads, 3 key/value heads of 64), MLP 1536, a tied 49,152-token output
head. A token's forward costs 2 x (weights it multiplies) FLOP; a backward twice its forward. The parts of a step of
``--rows`` completions, ``--prompt`` prompt and ``--completion`` completion tokens each:

- generation: the prompts' prefill (``--distinct`` distinct prompts with ``static_kv``, every row with ``kv_cache``)
  and one 64-row decode step per new token;
- scoring: one forward over every row (the frozen reference), the output head over the completion tokens only;
- update: a forward and a backward over every row (the output head over the completion tokens).

The rates are measured here, one shape at a time (``torch.mm``, the weight as the model holds it, ``--threads``
threads), for the row counts each part multiplies at (decode: 64; the others: a micro-batch's tokens). With
``--measured FILE`` (a bench/e2e_vs_trl.py result) it prints each part's share of its floor.

    OMP_NUM_THREADS=1 python bench/matmul_floor.py --threads 1 \\
        --measured bench/results/e2e_vs_trl_smollm2_static_kv.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from busy_machine import cpu_kind  # bench/: the CPU model, AMX or not, the core count

WIDTH, MLP, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152
# one layer's weights as (in, out): q, k, v, o, gate, up, down
LAYER = [(WIDTH, WIDTH), (WIDTH, KV), (WIDTH, KV), (WIDTH, WIDTH), (WIDTH, MLP), (WIDTH, MLP), (MLP, WIDTH)]
BODY = LAYERS * sum(i * o for i, o in LAYER)  # multiplies per token in the transformer blocks
HEAD = WIDTH * VOCAB


def rate(rows: int, shape: tuple[int, int], dtype: torch.dtype, reps: int) -> float:
    """FLOP/s of ``[rows, in] @ [in, out]`` in ``dtype`` (the median of ``reps`` timed runs after a warm-up)."""
    a = torch.randn(rows, shape[0], dtype=dtype)
    w = torch.randn(shape[1], shape[0], dtype=dtype).t()  # as nn.Linear holds it: [out, in], used transposed
    for _ in range(2):
        torch.mm(a, w)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, w)
        times.append(time.perf_counter() - t)
    return 2 * rows * shape[0] * shape[1] / statistics.median(times)


def seconds_per_token(rows: int, dtype: torch.dtype, reps: int) -> dict[str, float]:
    """Seconds one token's matmuls take at ``rows`` rows: the blocks, and the output head."""
    body = LAYERS * sum(2 * i * o / rate(rows, (i, o), dtype, reps) for i, o in LAYER)
    return {"body": body, "head": 2 * HEAD / rate(rows, (WIDTH, VOCAB), dtype, reps)}


def floor(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    decode = seconds_per_token(64, dtype, args.reps)
    batch = seconds_per_token(args.micro_tokens, dtype, args.reps)
    tokens = args.rows * (args.prompt + args.completion)
    completion = args.rows * args.completion
    prefill_rows = args.distinct if args.distinct else args.rows
    parts = {
        "generate": prefill_rows * args.prompt * batch["body"] + completion * (decode["body"] + decode["head"]),
        "score": tokens * batch["body"] + completion * batch["head"],
        "update": 3 * (tokens * batch["body"] + completion * batch["head"]),
    }
    flop = {
        "generate": 2 * (prefill_rows * args.prompt * BODY + completion * (BODY + HEAD)),
        "score": 2 * (tokens * BODY + completion * HEAD),
        "update": 6 * (tokens * BODY + completion * HEAD),
    }
    return {
        "floor_s": parts,
        "step_floor_s": sum(parts.values()),
        "tflop": {k: v / 1e12 for k, v in flop.items()},
        "gflop_per_s": {"decode_64_rows": 2 * (BODY + HEAD) / sum(decode.values()) / 1e9,
                        f"batch_{args.micro_tokens}_rows": 2 * (BODY + HEAD) / sum(batch.values()) / 1e9},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=50, help="prompt tokens a row")
    ap.add_argument("--completion", type=int, default=55, help="completion tokens a row")
    ap.add_argument("--distinct", type=int, default=8, help="distinct prompts prefilled (0: every row, as kv_cache)")
    ap.add_argument("--micro-tokens", type=int, default=1680, help="tokens a training micro-batch multiplies at once")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--measured", type=Path, help="a bench/e2e_vs_trl.py result: each part's share of its floor")
    ap.add_argument("--setup", help="the setup's key in --measured, when it holds several")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"cpu": cpu_kind(), "threads": args.threads, "dtype": args.dtype, **vars(args)}
    result.pop("measured"), result.pop("out"), result.pop("setup")
    result.update(floor(args, getattr(torch, args.dtype)))
    if args.measured:
        setups = json.loads(args.measured.read_text())
        if args.setup is None and len(setups) > 1:
            raise SystemExit(f"--setup: {args.measured} holds several setups, name one of {sorted(setups)}")
        setup = setups[args.setup] if args.setup is not None else next(iter(setups.values()))
        got = setup["palestra"]["breakdown_median"]
        measured = {k: got[f"perf/{k}_s"] for k in ("generate", "score", "update")}
        result["measured_s"] = {**measured, "step": got["perf/step_s"]}
        result["measured_from"] = str(args.measured)
        result["share_of_floor"] = {k: result["floor_s"][k] / v for k, v in measured.items()}
        result["share_of_floor"]["step"] = result["step_floor_s"] / got["perf/step_s"]
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
