"""The ``hf`` policy against real (tiny, locally built) transformers models: nothing mocked, nothing downloaded.

References are the HF models' own forward passes (``model(input_ids).logits``), in float64 where it matters, on
each row unpadded, so left padding, positions and the KV cache of the policy are all checked against them.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported anywhere in this test
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import tiny_hf
import torch

from palestra.config import ConfigError, build_component
from palestra.models.policy import CausalLMPolicy
from palestra.types import Message, Observation, SamplingParams

pytest.importorskip("transformers")

MODELS = ("llama", "qwen2")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: a second intra-op thread only adds hand-off cost, which is
    pathological on a busy 2-core CI machine (seconds per greedy decode instead of 0.1 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-hf")
    model_dir, tok_dir = tiny_hf.build_mismatched(root / "mismatched")
    return {
        "llama": tiny_hf.build_llama(root / "llama"),
        "qwen2": tiny_hf.build_qwen2(root / "qwen2"),
        "mismatched_model": model_dir,
        "mismatched_tokenizer": tok_dir,
        "t5": tiny_hf.build_not_causal(root / "t5"),
        "root": root,
    }


def build(path: Path | str, **options) -> CausalLMPolicy:
    """Through the config layer, exactly as a config's ``policy: {name: hf, options: ...}`` is built."""
    return build_component("policy", {"name": "hf", "options": {"path": str(path), **options}}, path="policy")


@pytest.fixture(scope="module")
def policies(folders: dict[str, Path]) -> dict[str, CausalLMPolicy]:
    return {name: build(folders[name]) for name in MODELS}


OBSERVATIONS = [
    Observation("What is 12 + 7? Put the answer in <answer></answer>."),
    Observation("1+1="),
    Observation("the quick brown fox"),
]


def random_completions(policy: CausalLMPolicy, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded completions of different lengths (one of a single token) drawn from the tokenizer's ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(policy.tokenizer), (batch, length), generator=g)
    lengths = torch.tensor([length, 1, max(2, length // 2)])[:batch]
    mask = torch.arange(length)[None, :] < lengths[:, None]
    return ids.masked_fill(~mask, policy.tokenizer.pad_token_id), mask


def real_row(ids: torch.Tensor, mask: torch.Tensor, row: int) -> torch.Tensor:
    return ids[row][mask[row]]


# ---- loading ----------------------------------------------------------------------------------------
def test_loads_both_models_through_the_registry(policies: dict[str, CausalLMPolicy]) -> None:
    llama, qwen = policies["llama"], policies["qwen2"]
    for policy in (llama, qwen):
        assert isinstance(policy, CausalLMPolicy) and type(policy).__name__ == "HFPolicy"
        assert policy.hidden_size == 32
        assert policy.output_head() is policy.model.get_output_embeddings()
    hf_llama, hf_qwen = llama.tokenizer.hf, qwen.tokenizer.hf
    # The Llama tokenizer has no pad token: pad falls back to EOS; it adds BOS, so the policy does too.
    assert hf_llama.pad_token_id is None and llama.tokenizer.pad_token_id == hf_llama.eos_token_id
    assert llama.tokenizer.bos_token_id == hf_llama.bos_token_id is not None
    # The Qwen2 tokenizer defines BOS but never adds it: the policy must not either.
    assert qwen.tokenizer.pad_token_id == hf_qwen.pad_token_id != hf_qwen.eos_token_id
    assert hf_qwen.bos_token_id is not None and qwen.tokenizer.bos_token_id is None
    assert qwen.model.get_output_embeddings().weight is qwen.model.get_input_embeddings().weight  # tied
    ids, mask = llama.encode_observations(OBSERVATIONS[:2])
    assert ids[0, 0].item() == hf_llama.bos_token_id and mask[1].sum() < mask[0].sum() and not mask[1, 0]
    assert ids[1, 0].item() == llama.tokenizer.pad_token_id  # left padding
    text = "What is 305 + 48?\n<answer>353</answer>"
    for policy in (llama, qwen):
        assert policy.tokenizer.decode(policy.tokenizer.encode(text)) == text


def test_dtype_option_loads_bfloat16(folders: dict[str, Path]) -> None:
    policy = build(folders["llama"], dtype="bfloat16")
    assert next(policy.parameters()).dtype == torch.bfloat16
    ids, mask = policy.encode_observations(OBSERVATIONS)
    comp, cmask = random_completions(policy, 3, 4, seed=3)
    scores = policy.score(ids, mask, comp, cmask)
    assert torch.isfinite(scores.logprobs).all() and (scores.logprobs[cmask] < 0).all()


# ---- numbers against the HF model's own forward ------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_score_equals_float64_log_softmax_of_hf_logits(policies: dict[str, CausalLMPolicy], name: str) -> None:
    policy = policies[name]
    ids, mask = policy.encode_observations(OBSERVATIONS)  # left-padded: the rows have different lengths
    comp, cmask = random_completions(policy, len(OBSERVATIONS), 5, seed=11)
    scores = policy.score(ids, mask, comp, cmask, temperature=0.7)
    assert scores.logprobs.dtype == torch.float32 and scores.logprobs.shape == comp.shape
    with torch.no_grad():
        for b in range(len(OBSERVATIONS)):
            prompt, completion = real_row(ids, mask, b), real_row(comp, cmask, b)
            row = torch.cat([prompt, completion])[None]
            logits = policy.model(input_ids=row).logits[0, :, : len(policy.tokenizer)].double()  # unpadded rows
            states = logits[len(prompt) - 1 : len(row[0]) - 1] / 0.7
            logp_all = torch.log_softmax(states, dim=-1)
            want = logp_all.gather(-1, completion[:, None]).squeeze(-1)
            want_entropy = -(logp_all.exp() * logp_all).sum(-1)
            n = len(completion)
            torch.testing.assert_close(scores.logprobs[b, :n].double(), want, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(scores.entropy[b, :n].double(), want_entropy, atol=2e-5, rtol=1e-5)
            assert (scores.logprobs[b, n:] == 0).all() and (scores.entropy[b, n:] == 0).all()
    # Distinct rows give distinct numbers: the comparison above could not pass with a row-blind result.
    assert scores.logprobs[0, 0] != scores.logprobs[1, 0]


@pytest.mark.parametrize("name", MODELS)
def test_kv_cache_decode_matches_full_forward(policies: dict[str, CausalLMPolicy], name: str) -> None:
    policy = policies[name]
    ids, mask = policy.encode_observations(OBSERVATIONS)
    steps = 4
    g = torch.Generator().manual_seed(5)
    fed = torch.randint(0, len(policy.tokenizer), (len(OBSERVATIONS), steps), generator=g)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits, cache = policy.decode_step(ids, mask, positions, None)  # prefill
    got = [logits]
    next_pos = mask.sum(-1, keepdim=True)
    for t in range(steps - 1):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits, cache = policy.decode_step(fed[:, t : t + 1], mask, next_pos + t, cache)
        got.append(logits)
    got_t = torch.stack(got, dim=1)  # [B, steps, V]: the logits after the prompt and after each fed token
    assert got_t.dtype == torch.float32
    prompt_mask = mask[:, : ids.shape[1]]
    with torch.no_grad():
        for b in range(len(OBSERVATIONS)):
            prompt = real_row(ids, prompt_mask, b)
            row = torch.cat([prompt, fed[b, : steps - 1]])[None]
            want = policy.model(input_ids=row).logits[0, len(prompt) - 1 :, : len(policy.tokenizer)].float()
            torch.testing.assert_close(got_t[b], want, atol=2e-4, rtol=1e-4)


# ---- prompts ---------------------------------------------------------------------------------------
def test_chat_template_on_off_and_auto(folders: dict[str, Path], policies: dict[str, CausalLMPolicy]) -> None:
    messages = [Message("system", "answer briefly"), Message("user", "What is 2+2?")]
    obs = Observation("What is 2+2?", messages=messages)
    qwen = policies["qwen2"]  # auto, and its tokenizer has a template
    hf = qwen.tokenizer.hf
    templated = hf.apply_chat_template([m.as_dict() for m in messages], tokenize=False, add_generation_prompt=True)
    assert templated.endswith("<|im_start|>assistant\n")
    want = hf.encode(templated, add_special_tokens=False)
    assert qwen.encode_prompt(obs) == want
    ids, mask = qwen.encode_observations([obs])
    assert ids[0][mask[0]].tolist() == want
    assert qwen.encode_prompt(Observation("What is 2+2?")) == hf.encode("What is 2+2?", add_special_tokens=False)

    on = build(folders["qwen2"], chat_template="on")
    assert on.encode_prompt(obs) == want
    off = build(folders["qwen2"], chat_template="off")
    assert off.encode_prompt(obs) == hf.encode("What is 2+2?", add_special_tokens=False) != want
    # The Llama tokenizer has no template: auto falls back to the prompt text; "on" is a config error.
    assert policies["llama"].encode_prompt(obs) == policies["llama"].tokenizer.encode("What is 2+2?")
    with pytest.raises(ConfigError) as err:
        build(folders["llama"], chat_template="on")
    assert_one_line(err, "policy.options.chat_template:", "no chat template", str(folders["llama"]))


# ---- gradient checkpointing ----------------------------------------------------------------------------
def test_gradient_checkpointing_gives_the_same_gradients(folders: dict[str, Path]) -> None:
    plain = build(folders["qwen2"])
    checked = build(folders["qwen2"], gradient_checkpointing=True)
    flag = (
        "is_activation_checkpointing"
        if hasattr(plain.model, "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    assert getattr(checked.model, flag) and not getattr(plain.model, flag)
    assert checked.training and checked.model.training  # HF checkpoints only in training mode
    ids, mask = plain.encode_observations(OBSERVATIONS)
    comp, cmask = random_completions(plain, len(OBSERVATIONS), 5, seed=2)
    grads = []
    for policy in (plain, checked):
        scores = policy.score(ids, mask, comp, cmask)
        loss = -(scores.logprobs.sum() + 0.1 * scores.entropy.sum())
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(plain.parameters()))
    for n in grads[0]:
        assert grads[0][n].abs().sum() > 0, n
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=n)
    # Sampling while in training mode (no grad) keeps its KV cache despite checkpointing.
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    _, cache = checked.decode_step(ids, mask, positions, None)
    assert cache is not None and cache.get_seq_length() == ids.shape[1]


def test_deepcopy_gives_an_independent_equal_policy(policies: dict[str, CausalLMPolicy]) -> None:
    """The trainer deep-copies the policy for a frozen reference (KL terms)."""
    policy = policies["llama"]
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    assert type(ref) is type(policy) and ref.tokenizer.encode("1+1=") == policy.tokenizer.encode("1+1=")
    ids, mask = policy.encode_observations(OBSERVATIONS)
    comp, cmask = random_completions(policy, len(OBSERVATIONS), 4, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(
            ref.score(ids, mask, comp, cmask).logprobs, policy.score(ids, mask, comp, cmask).logprobs
        )
        next(ref.parameters()).add_(1.0)
    assert not torch.equal(next(ref.parameters()), next(policy.parameters()))


# ---- errors ------------------------------------------------------------------------------------------
def assert_one_line(err: pytest.ExceptionInfo[BaseException], start: str, *parts: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(start), msg
    for part in parts:
        assert part in msg, (part, msg)


def test_missing_path_names_the_option_and_the_path(folders: dict[str, Path]) -> None:
    missing = folders["root"] / "no-such-model"
    with pytest.raises(ConfigError) as err:
        build(missing)
    assert_one_line(err, "policy.options.path:", repr(str(missing)), "does not exist")
    empty = folders["root"] / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as err:
        build(empty)
    assert_one_line(err, "policy.options.path:", repr(str(empty)), "config.json")
    with pytest.raises(ConfigError) as err:
        build(folders["llama"], tokenizer_path=str(missing))
    assert_one_line(err, "policy.options.tokenizer_path:", repr(str(missing)), "does not exist")
    with pytest.raises(ConfigError) as err:
        build_component("policy", {"name": "hf", "options": {}}, path="policy")
    assert_one_line(err, "policy.options.path:", "missing required key")


def test_tokenizer_bigger_than_the_model_names_both_paths_and_sizes(folders: dict[str, Path]) -> None:
    model_dir, tok_dir = folders["mismatched_model"], folders["mismatched_tokenizer"]
    with pytest.raises(ConfigError) as err:
        build(model_dir, tokenizer_path=str(tok_dir))
    n = len(tiny_hf.build_tokenizer(add_bos=True, pad=True))
    assert_one_line(
        err,
        "policy.options.tokenizer_path:",
        repr(str(tok_dir)),
        repr(str(model_dir)),
        f"{n} tokens",
        "48 embedding rows",
    )


def test_not_a_causal_lm(folders: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as err:
        build(folders["t5"])
    assert_one_line(err, "policy.options.path:", repr(str(folders["t5"])), "'t5'", "not a causal language model")


# ---- sampling through palestra.models.sampling ------------------------------------------------------------------
def hf_greedy(
    policy: CausalLMPolicy, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, stops: list[int]
) -> list[list[int]]:
    """``model.generate(do_sample=False)`` from the same left-padded prompts, each row cut after its first stop.

    Ids past the tokenizer (a padded embedding, as Qwen's) are suppressed, as our policy never produces them.
    """
    rows_in_head = policy.model.get_output_embeddings().weight.shape[0]
    padding = list(range(len(policy.tokenizer), rows_in_head))
    with torch.no_grad():
        out = policy.model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask.long(),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=policy.tokenizer.pad_token_id,
            eos_token_id=stops,
            suppress_tokens=padding or None,
        )
    rows = []
    for row in out[:, prompt_ids.shape[1] :].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))  # HF pads after the stop
        rows.append(row[:end])
    return rows


@pytest.mark.parametrize("name", MODELS)
def test_greedy_sampling_matches_hf_generate(policies: dict[str, CausalLMPolicy], name: str) -> None:
    sampling = pytest.importorskip(
        "palestra.models.sampling", reason="palestra.models.sampling (the KV-cache sampler) is not in the tree yet"
    )
    policy = policies[name]
    eos = policy.tokenizer.eos_token_id
    policy.eval()
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0.0)
        gen = sampling.generate(policy, OBSERVATIONS, params)
        theirs = hf_greedy(policy, gen.prompt_ids, gen.prompt_mask, params.max_new_tokens, [eos])
        # Again with a stop token that greedy decoding is known to reach in row 0 (at step 5), so that
        # stopping, and rows finishing at different steps, are compared too.
        stop = theirs[0][5]
        params_stop = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[stop])
        gen_stop = sampling.generate(policy, OBSERVATIONS, params_stop)
        theirs_stop = hf_greedy(policy, gen.prompt_ids, gen.prompt_mask, params.max_new_tokens, [eos, stop])
    finally:
        policy.train()
    for g, want in ((gen, theirs), (gen_stop, theirs_stop)):
        lengths = g.completion_mask.sum(-1).tolist()
        ours = [g.completion_ids[b, : lengths[b]].tolist() for b in range(len(OBSERVATIONS))]
        assert ours == want
    assert max(len(r) for r in theirs) > 1 and min(len(r) for r in theirs_stop) <= 6


def test_generation_can_use_another_attention_than_training(
    folders: dict[str, Path], policies: dict[str, CausalLMPolicy]
) -> None:
    """attn_implementation=eager with generation_attn_implementation=sdpa: the KV-cache decoding runs under sdpa,
    every other forward under eager, and both give the plain policy's numbers."""
    from palestra.models.sampling import generate

    plain = policies["llama"]
    mixed = build(folders["llama"], attn_implementation="eager", generation_attn_implementation="sdpa")
    used: list[str] = []
    switch = mixed.hf_model.set_attn_implementation
    mixed.hf_model.set_attn_implementation = lambda impl, **kw: used.append(impl) or switch(impl, **kw)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    for policy in (plain, mixed):
        policy.eval()
    try:
        ours, theirs = generate(mixed, OBSERVATIONS, params), generate(plain, OBSERVATIONS, params)
        assert torch.equal(ours.completion_ids, theirs.completion_ids)
        torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-5, rtol=1e-5)
        assert used == ["sdpa"]  # once for the whole generation, not per token
        batch = (ours.prompt_ids, ours.prompt_mask, ours.completion_ids, ours.completion_mask)
        torch.testing.assert_close(mixed.score(*batch).logprobs, plain.score(*batch).logprobs, atol=1e-5, rtol=1e-5)
        assert used == ["sdpa", "eager"]
    finally:
        for policy in (plain, mixed):
            policy.train()
    with pytest.raises(ConfigError, match=r"policy\.options\.generation_attn_implementation"):
        build(folders["llama"], generation_attn_implementation="flash")


def test_a_padded_output_head_never_yields_ids_the_tokenizer_lacks(policies: dict[str, CausalLMPolicy]) -> None:
    policy = policies["qwen2"]
    n, rows = len(policy.tokenizer), policy.model.get_output_embeddings().weight.shape[0]
    assert rows > n  # the fixture pads its embedding, as Qwen does
    weight = policy.model.get_output_embeddings().weight
    saved = weight.detach().clone()
    sampling = pytest.importorskip("palestra.models.sampling")
    try:
        with torch.no_grad():  # make a padded row the most likely token everywhere: it still must never appear
            weight[n:] = weight[:1] * 50
        gen = sampling.generate(
            policy, OBSERVATIONS, SamplingParams(max_new_tokens=8), generator=torch.Generator().manual_seed(0)
        )
        scores = policy.score(gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert int(gen.completion_ids.max()) < n
    assert torch.allclose(scores.logprobs, gen.logprobs, atol=1e-5)
