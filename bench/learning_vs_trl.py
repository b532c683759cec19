"""Learning, not speed: Palestra's GRPO against TRL's ``GRPOTrainer`` on the same small random HF model.

    python bench/learning_vs_trl.py                              # 400 steps each, seed 0
    python bench/learning_vs_trl.py --steps 400 --seeds 0 1 \\
        --out bench/results/learning_vs_trl.json --plot bench/results/learning_vs_trl.png

Both sides train, from the same random weights (one folder, read by both), a 2-layer Llama (hidden 64) with a
17-token character vocabulary (``0-9 + = space`` and four specials), built here (nothing is downloaded), on the
``arithmetic`` environment's prompts (``a + b =`` with operands 0..4: 25 facts) with the same sparse reward:
1.0 when the completion is exactly the sum (Palestra's ``correctness`` reward with ``tag: null``, called by both
sides), else 0. Both generate ``--new-tokens`` tokens (default: as many as the largest sum has digits, so that every
answer can be written; 1 for the 25 facts, where a random model's first token is the right digit about 1 time in 17,
and 2 for ``--max-operand 9``, the 100 facts, where a one-digit answer must be followed by EOS). Same batch
(``--batch`` prompts x ``--group`` completions), steps, sampling (temperature 1, no top-p / top-k), optimiser
(AdamW, no weight decay, gradient norm clipped at 1), learning rate (``--lr``), clip range 0.2 and no KL term.

What differs is each library's GRPO as its user would run it: TRL's defaults (``loss_type="dapo"``,
``scale_rewards="group"``), and Palestra's GRPO as ``examples/grpo.yaml`` sets it (see docs/learning.md);
``--palestra-set`` / ``--trl-scale`` change either side. The figure is the mean training reward over the last
``--window`` steps, per side and seed, and their ratio; ``--plot`` draws both reward curves (moving average).

``--variant LABEL KEY=VALUE ...`` (repeatable) runs several Palestra settings against the same TRL runs, seed by
seed, in one invocation (each on top of ``--palestra-set``); the ratios are then all from the same run:

    python bench/learning_vs_trl.py --steps 300 --max-operand 9 --seeds 0 1 2 --variant none \
        --variant replay_4x128 optimizer.options.replay_capacity=4 optimizer.options.replay_rows=128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789+= ")


def build_model(folder: Path, *, hidden: int, layers: int, seed: int) -> None:
    """A random Llama and its character tokenizer (one token per character), saved as a transformers folder."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {name: i for i, name in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def environment_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"difficulty": 1, "max_operand": args.max_operand, "terms": 2, "operations": ["+"], "prompt": "{question} ="}


# ---- Palestra -----------------------------------------------------------------------------------------
def run_palestra(args: argparse.Namespace, folder: Path, seed: int, work: Path, variant: list[str]) -> list[float]:
    import torch

    from palestra.config import load_config
    from palestra.engine.trainer import Trainer

    # examples/grpo.yaml's optimiser and train settings, with the comparison's model, reward, batch and steps
    config = load_config(
        ROOT / "examples" / "grpo.yaml",
        [
            f"run.seed={seed}",
            f"run.output_dir={work}",
            "loggers=[]",
            f"environment.options={json.dumps(environment_options(args))}",
            "reward.name=correctness",
            "reward.options.tag=null",
            "policy.name=hf",
            f"policy.options.path={folder}",
            "policy.options.dtype=float32",
            f"train.steps={args.steps}",
            f"train.batch_size={args.batch}",
            f"train.group_size={args.group}",
            f"train.lr={args.lr}",
            f"train.max_new_tokens={args.new_tokens}",
            "train.temperature=1.0",
            "train.device=cpu",
            "train.eval_size=16",
            *args.palestra_set,
            *variant,
        ],
    )
    torch.set_num_threads(1)
    trainer = Trainer(config, run_dir=work / "palestra")
    return [trainer.step()["reward/mean"] for _ in range(args.steps)]


# ---- TRL ----------------------------------------------------------------------------------------------
def run_trl(args: argparse.Namespace, folder: Path, seed: int, work: Path) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from palestra.plugins.envs.arithmetic import ArithmeticEnv
    from palestra.plugins.rewards.basic import CorrectnessReward

    env = ArithmeticEnv(**environment_options(args))
    observations = env.reset(args.batch * args.steps, seed=seed + 1)
    dataset = Dataset.from_list([{"prompt": o.prompt, "answer": o.metadata["answer"]} for o in observations])
    exact = CorrectnessReward(tag=None)

    def exact_answer(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [exact.score(c, {"answer": a}) for c, a in zip(completions, answer)]

    rewards: list[float] = []

    class Record(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            torch.set_num_threads(1)  # after TRL's own set-up, whatever it changed

        def on_log(self, *_: Any, logs: dict[str, float] | None = None, **__: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(work / "trl"),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_strategy="steps",
        logging_steps=1,
        seed=seed,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        scale_rewards=args.trl_scale,
        num_iterations=1,
        dataloader_num_workers=0,
        log_completions=False,
        shuffle_dataset=False,
    )
    trl = GRPOTrainer(
        model=model,
        reward_funcs=exact_answer,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Record()],
    )
    trl.remove_callback(PrinterCallback)
    trl.train()
    return rewards


def moving_average(xs: list[float], k: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated (default: the largest sum's digits)")
    p.add_argument("--max-operand", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--window", type=int, default=50, help="the figure: mean training reward over the last N steps")
    p.add_argument("--palestra-set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for Palestra's side")
    p.add_argument("--trl-scale", default="group", choices=["group", "batch", "none"], help="TRL's scale_rewards")
    p.add_argument("--sides", nargs="+", default=["palestra", "trl"], choices=["palestra", "trl"])
    p.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=None,
        metavar="LABEL [KEY=VALUE ...]",
        help="a labelled Palestra setting (repeatable); default: one, 'palestra', with --palestra-set only",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    digits = len(str(2 * args.max_operand))  # the largest sum's; one token per character
    if args.new_tokens is None:
        args.new_tokens = digits
    elif args.new_tokens < digits:
        p.error(
            f"--new-tokens {args.new_tokens}: the largest sum, {2 * args.max_operand}, needs {digits} tokens; "
            f"with fewer, the answers of {digits} digits can never be right and the reward has a ceiling below 1"
        )
    variants = {v[0]: v[1:] for v in args.variant} if args.variant else {"palestra": []}

    import torch

    torch.set_num_threads(1)
    results: dict[str, Any] = {"runs": []}
    with tempfile.TemporaryDirectory(prefix="learning_vs_trl_") as tmp:
        work = Path(tmp)
        folder = work / "model"
        build_model(folder, hidden=args.hidden, layers=args.layers, seed=0)
        runs = [("trl", None)] if "trl" in args.sides else []
        if "palestra" in args.sides:
            runs = list(variants.items()) + runs
        for seed in args.seeds:
            for label, overrides in runs:
                started = time.perf_counter()
                if overrides is None:
                    curve = run_trl(args, folder, seed, work / f"trl{seed}")
                else:
                    curve = run_palestra(args, folder, seed, work / f"{label}{seed}", overrides)
                seconds = time.perf_counter() - started
                last = statistics.fmean(curve[-args.window :])
                results["runs"].append(
                    {
                        "side": label,
                        "seed": seed,
                        "last_mean": last,
                        "seconds": seconds,
                        "overrides": overrides,
                        "curve": curve,
                    }
                )
                print(
                    f"{label:<14} seed {seed}: mean reward over the last {args.window} of {len(curve)} steps "
                    f"{last:.3f} (first {args.window}: {statistics.fmean(curve[: args.window]):.3f}); {seconds:.0f} s",
                    flush=True,
                )
    by = {label: [r["last_mean"] for r in results["runs"] if r["side"] == label] for label, _ in runs}
    if "trl" in by and len(by) > 1:
        trl_mean = statistics.fmean(by["trl"])
        results["ratios"] = {}
        print(f"| side | {' / '.join(f'seed {s}' for s in args.seeds)} | mean | / TRL | seconds per run |")
        print("| --- | --- | --- | --- | --- |")
        for label, lasts in by.items():
            ratio = statistics.fmean(lasts) / max(trl_mean, 1e-9)
            if label != "trl":
                results["ratios"][label] = ratio
            secs = statistics.fmean(r["seconds"] for r in results["runs"] if r["side"] == label)
            print(
                f"| {label} | {' / '.join(f'{x:.3f}' for x in lasts)} | {statistics.fmean(lasts):.3f} | "
                f"{ratio:.2f}x | {secs:.0f} |"
            )
    import transformers
    import trl

    results["meta"] = {
        **{k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "cpu": platform.machine(),
        "threads": 1,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str))
    if args.plot is not None:
        facts = (args.max_operand + 1) ** 2
        plot(results["runs"], args.plot, f"GRPO on {facts} sums, random {args.layers}-layer Llama, lr {args.lr:g}")
    return 0


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    """Training reward against steps (moving average of 20): one colour per side, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = list(dict.fromkeys(r["side"] for r in runs))
    palette = iter(["tab:blue", "tab:green", "tab:purple", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
    colours = {side: "black" if side == "trl" else next(palette, "tab:gray") for side in sides}
    fig, ax = plt.subplots(figsize=(7, 4))
    labelled: set[str] = set()
    for r in runs:
        ax.plot(
            moving_average(r["curve"], 20),
            color=colours[r["side"]],
            alpha=0.8,
            linewidth=1,
            label=None if r["side"] in labelled else r["side"],
        )  # one legend entry per side
        labelled.add(r["side"])
    ax.set_xlabel("step")
    ax.set_ylabel("training reward (moving average of 20)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
