"""The ``tiny`` policy: its character tokenizer, the transformer (KV cache, padding, scores, gradients), options."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from palestra.config import ConfigError, build_component
from palestra.plugin_manager import get_registry
from palestra.plugins.policies.char_tokenizer import UNK_TEXT, CharTokenizer
from palestra.plugins.policies.tiny import TinyOptions, TinyTransformerPolicy

SMALL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64, "seed": 0}


def make_policy(**overrides) -> TinyTransformerPolicy:
    # A larger init than the default makes the logits far from uniform, so that comparisons mean something.
    return TinyTransformerPolicy(**{**SMALL, "init_std": 0.3, **overrides})


def left_padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = True
    return ids, mask


def random_rows(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- tokenizer ---------------------------------------------------------------------------------------
def test_tokenizer_vocabulary_and_round_trip():
    tok = CharTokenizer("0123456789+-*= ?", ["<answer>", "</answer>"])
    assert len(tok) == 4 + 2 + 16 == 22
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.vocab[:6] == ("<pad>", "<bos>", "<eos>", "<unk>", "<answer>", "</answer>")
    text = "12 + 7 = ?<answer>19</answer>"
    ids = tok.encode(text)
    assert ids[-4:] == [
        tok.token_to_id("<answer>"),
        tok.token_to_id("1"),
        tok.token_to_id("9"),
        tok.token_to_id("</answer>"),
    ]
    assert ids.count(4) == 1 and ids.count(5) == 1 and len(ids) == len("12 + 7 = ?") + 4
    assert tok.decode(ids) == text
    # pad/bos/eos are not text; <unk> shows as the replacement character.
    assert tok.decode([1, *tok.encode("3"), 0, 2, 3]) == "3" + UNK_TEXT


def test_tokenizer_atoms_longest_first_and_unknown_characters():
    tok = CharTokenizer("abc", ["ab", "abc"])
    ab, abc = tok.token_to_id("ab"), tok.token_to_id("abc")
    assert tok.encode("abcab") == [abc, ab]
    assert tok.encode("abxc") == [ab, tok.unk_token_id, tok.token_to_id("c")]
    assert tok.decode(tok.encode("abxc")) == "ab" + UNK_TEXT + "c"
    dropping = CharTokenizer("abc", ["ab"], unknown="drop")
    assert dropping.decode(dropping.encode("Why a cab!")) == "acab"
    # An atom never matches across characters that are not all there.
    assert CharTokenizer("<>a", ["<a>"]).encode("<a") == [5, 7]


def test_tokenizer_serialises_and_rejects_bad_arguments():
    tok = CharTokenizer("xyz ", ["<t>"], unknown="drop")
    again = CharTokenizer.from_dict(tok.to_dict())
    assert again == tok and again.vocab == tok.vocab and again.encode("x<t>q y") == tok.encode("x<t>q y")
    with pytest.raises(ValueError, match="alphabet: has the character 'x' twice"):
        CharTokenizer("xyx")
    with pytest.raises(ValueError, match=r"atoms\[1\]"):
        CharTokenizer("ab", ["<a>", "b"])
    with pytest.raises(ValueError, match="id 99 is not in the vocabulary"):
        tok.decode([4, 99])
    with pytest.raises(ValueError, match="id -1"):
        tok.decode([-1])


# ---- options -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, culprit",
    [
        ({"n_heads": 3}, "policy.options.n_heads"),  # does not divide d_model=64
        ({"d_model": 48, "n_heads": 16}, "policy.options.n_heads"),  # head size 3 is odd: RoPE needs pairs
        ({"d_model": 4}, "policy.options.d_model"),
        ({"init_std": 0}, "policy.options.init_std"),
        ({"alphabet": "0120"}, "policy.options.alphabet"),
        ({"atoms": ["<answer>", "<answer>"]}, "policy.options.atoms[1]"),
        ({"unknown": "skip"}, "policy.options.unknown"),
    ],
)
def test_bad_options_name_the_option_in_one_line(options, culprit):
    with pytest.raises(ConfigError) as info:
        TinyTransformerPolicy(**options)
    message = str(info.value)
    assert message.startswith(culprit) and "\n" not in message
    # The same through the registry and a config node.
    with pytest.raises(ConfigError, match=culprit.replace("[", r"\[").replace("]", r"\]")):
        build_component("policy", {"name": "tiny", "options": options}, path="policy")


def test_registers_policy_and_generator():
    registry = get_registry()
    policy_reg = registry.get("policy", "tiny")
    assert policy_reg.options is TinyOptions and policy_reg.distribution == "palestra"
    assert registry.get("generator", "kv_cache").distribution == "palestra"
    policy = build_component("policy", {"name": "tiny", "options": {"d_model": 32, "d_ff": 64}}, path="policy")
    assert isinstance(policy, TinyTransformerPolicy) and policy.hidden_size == 32
    generator = build_component("generator", {"name": "kv_cache"}, path="generator")
    assert callable(generator.generate)


def test_prompt_longer_than_max_len_is_a_one_line_error():
    policy = TinyTransformerPolicy(**SMALL, max_len=8)
    ids, mask = left_padded([[5] * 9])
    with pytest.raises(ValueError, match=r"^policy\.options\.max_len: a sequence of 9 tokens") as info:
        policy.score(ids[:, :8], mask[:, :8], ids[:, 8:], mask[:, 8:])
    assert "\n" not in str(info.value)


def test_seed_reproduces_weights_and_state_dict_rebuilds_the_policy():
    a, b = TinyTransformerPolicy(**SMALL), TinyTransformerPolicy(**SMALL)
    c = TinyTransformerPolicy(**{**SMALL, "seed": 1})
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.embed.weight, c.embed.weight)
    trained = make_policy(tie_embeddings=False, alphabet="0123456789+=", atoms=["<a>"])
    rebuilt = TinyTransformerPolicy(**{**dataclasses.asdict(trained.options), "seed": 5})
    rebuilt.load_state_dict(trained.state_dict())
    ids, mask = left_padded(random_rows([6, 3], len(trained.tokenizer), seed=1))
    assert torch.equal(
        trained.trunk(ids, mask, mask.long().cumsum(-1) - 1)[0], rebuilt.trunk(ids, mask, mask.long().cumsum(-1) - 1)[0]
    )
    assert rebuilt.tokenizer == trained.tokenizer


# ---- the transformer ---------------------------------------------------------------------------------
def full_logits(policy: TinyTransformerPolicy, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden, cache = policy.trunk(ids, mask, positions)
    assert cache is None
    return policy.output_head()(hidden)


def test_kv_cache_decoding_matches_a_full_forward_with_left_padding():
    policy = make_policy()
    vocab = len(policy.tokenizer)
    prompts = random_rows([5, 2, 7, 1], vocab, seed=2)
    ids, mask = left_padded(prompts)
    steps = 6
    new_tokens = torch.randint(4, vocab, (len(prompts), steps), generator=torch.Generator().manual_seed(3))
    full_ids = torch.cat([ids, new_tokens], 1)
    full_mask = torch.cat([mask, torch.ones_like(new_tokens, dtype=torch.bool)], 1)
    with torch.no_grad():
        expected = full_logits(policy, full_ids, full_mask)
    assert torch.isfinite(expected).all()  # padded query positions included: no NaN anywhere

    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits, cache = policy.decode_step(ids, mask, positions, None)
    torch.testing.assert_close(logits, expected[:, ids.shape[1] - 1], rtol=0, atol=1e-5)
    next_position = positions[:, -1:] + 1
    attn = mask
    for t in range(steps):
        attn = torch.cat([attn, torch.ones((len(prompts), 1), dtype=torch.bool)], 1)
        logits, cache = policy.decode_step(new_tokens[:, t : t + 1], attn, next_position + t, cache)
        assert len(cache) == 2 and cache[0][0].shape == (len(prompts), 4, ids.shape[1] + t + 1, 32 // 4)
        torch.testing.assert_close(logits, expected[:, ids.shape[1] + t], rtol=0, atol=1e-5)
    # Prefilling part of the prompt and feeding several tokens at once agrees too.
    _, cache = policy.trunk(
        full_ids[:, :4], full_mask[:, :4], (full_mask[:, :4].long().cumsum(-1) - 1).clamp(min=0), use_cache=True
    )
    pos = (full_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden2, _ = policy.trunk(full_ids[:, 4:], full_mask, pos[:, 4:], cache, use_cache=True)
    torch.testing.assert_close(policy.lm_head(hidden2), expected[:, 4:], rtol=0, atol=1e-5)


def test_a_left_padded_row_scores_like_the_row_alone():
    policy = make_policy()
    vocab = len(policy.tokenizer)
    prompts = random_rows([7, 2, 4], vocab, seed=4)
    completions = random_rows([3, 5, 1], vocab, seed=5)
    p_ids, p_mask = left_padded(prompts)
    c_ids = torch.zeros((3, 5), dtype=torch.int64)
    c_mask = torch.zeros((3, 5), dtype=torch.bool)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)] = torch.tensor(c)
        c_mask[i, : len(c)] = True
    batch = policy.score(p_ids, p_mask, c_ids, c_mask)
    for i in range(3):
        alone = policy.score(
            torch.tensor([prompts[i]]),
            torch.ones((1, len(prompts[i])), dtype=torch.bool),
            torch.tensor([completions[i]]),
            torch.ones((1, len(completions[i])), dtype=torch.bool),
        )
        n = len(completions[i])
        torch.testing.assert_close(batch.logprobs[i, :n], alone.logprobs[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(batch.entropy[i, :n], alone.entropy[0], rtol=0, atol=1e-5)
        assert (batch.logprobs[i, n:] == 0).all() and (batch.entropy[i, n:] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_score_matches_a_float64_reference_and_gradients_flow(temperature):
    policy = make_policy(tie_embeddings=False)
    vocab = len(policy.tokenizer)
    p_ids, p_mask = left_padded(random_rows([4, 6], vocab, seed=6))
    c_ids = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(7))
    c_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    scores = policy.score(p_ids, p_mask, c_ids, c_mask, temperature=temperature)

    with torch.no_grad():
        logits = full_logits(policy, torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1))[:, 5:10]
        log_q = torch.log_softmax(logits.double() / temperature, -1)
        ref_logp = log_q.gather(-1, c_ids[..., None]).squeeze(-1) * c_mask
        ref_entropy = -(log_q.exp() * log_q).sum(-1) * c_mask
    assert scores.logprobs.dtype == torch.float32 and scores.logprobs.shape == (2, 5)
    torch.testing.assert_close(scores.logprobs.double(), ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(scores.entropy.double(), ref_entropy, rtol=0, atol=1e-5)

    (-(scores.logprobs.sum()) - 0.1 * scores.entropy.sum()).backward()
    for name, param in policy.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_values_after_enable_value_head():
    policy = make_policy()
    p_ids, p_mask = left_padded(random_rows([3, 5], len(policy.tokenizer), seed=8))
    c_ids = torch.tensor([[6, 7, 8], [9, 2, 0]])
    c_mask = torch.tensor([[True, True, True], [True, True, False]])
    with pytest.raises(RuntimeError, match="enable_value_head"):
        policy.score(p_ids, p_mask, c_ids, c_mask, values=True)
    head = policy.enable_value_head()
    assert any(p is head.weight for p in policy.parameters())
    assert (policy.score(p_ids, p_mask, c_ids, c_mask, values=True).values == 0).all()  # zero-initialised
    with torch.no_grad():
        head.weight.normal_(generator=torch.Generator().manual_seed(0))
        head.bias.fill_(0.5)
    out = policy.score(p_ids, p_mask, c_ids, c_mask, values=True)
    hidden, _ = policy.trunk(
        torch.cat([p_ids, c_ids], 1),
        torch.cat([p_mask, c_mask], 1),
        (torch.cat([p_mask, c_mask], 1).long().cumsum(-1) - 1).clamp(min=0),
    )
    expected = head(hidden[:, 4:7]).squeeze(-1) * c_mask
    torch.testing.assert_close(out.values, expected, rtol=0, atol=1e-6)
    out.values.sum().backward()
    assert head.weight.grad is not None and policy.embed.weight.grad is not None


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    plain, checkpointed = make_policy(), make_policy(gradient_checkpointing=True)
    p_ids, p_mask = left_padded(random_rows([4, 2], len(plain.tokenizer), seed=9))
    c_ids = torch.tensor([[5, 6, 7], [8, 9, 2]])
    c_mask = torch.ones_like(c_ids, dtype=torch.bool)
    grads = []
    for policy in (plain, checkpointed):
        policy.train()
        scores = policy.score(p_ids, p_mask, c_ids, c_mask)
        (scores.logprobs.sum() + scores.entropy.sum()).backward()
        grads.append({n: p.grad for n, p in policy.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-6)
