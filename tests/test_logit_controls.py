"""logit_bias, allowed_token_ids and bad_words (vLLM's meanings) against hand computation on transformers'
logits: greedy loops that apply the same bias / mask / bans by hand. One tiny model with a BPE tokenizer."""
import math

import numpy as np
import pytest
from oracle import hf_model

from jaxpaged import LLM, SamplingParams
from jaxpaged.core.logit_controls import MAX_BAD_WORDS, MAX_LOGIT_BIAS
from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model

V = 300
GREEDY = dict(temperature=0, ignore_eos=True, max_tokens=6)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    d = make_tiny_model(str(tmp_path_factory.mktemp("controls") / "m"), "llama", vocab_size=V, seed=21)
    add_tiny_tokenizer(d, V)
    return d


@pytest.fixture(scope="module")
def llm(path, engine_kwargs):
    return LLM(model=path, **{**engine_kwargs, "block_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 4,
                              "max_model_len": 64, "warmup": True})  # every shape: settings never recompile


@pytest.fixture(scope="module")
def tok(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def hf_greedy(path, prompt, n, adjust):
    """Greedy tokens by transformers, `adjust(output so far, logits [V])` applied to each step's logits."""
    import torch
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf_model(path)(torch.tensor([prompt + out])).logits[0, -1].double().numpy()
        out.append(int(np.argmax(adjust(out, logits))))
    return out


def hf_last_logprobs(path, ids):
    import torch
    with torch.no_grad():
        return torch.log_softmax(hf_model(path)(torch.tensor([ids])).logits[0, -1].double(), -1).numpy()


PROMPT = [5, 9, 40, 77, 120, 31]


def test_logit_bias(llm, path):
    row = hf_last_logprobs(path, PROMPT)
    first, second = np.argsort(-row)[:2]
    bias = {int(second): float(row[first] - row[second] + 0.5), int(first): -2.0, 7: 1.5}
    compiled = llm.stats()["num_compilations"]
    out = llm.generate(PROMPT, SamplingParams(logit_bias=bias, logprobs=0, **GREEDY))[0].outputs[0]

    def add(_, logits):
        logits = logits.copy()
        for t, b in bias.items():
            logits[t] += b
        return logits
    assert out.token_ids == hf_greedy(path, PROMPT, 6, add)
    assert out.token_ids[0] == second  # the bias moved the choice
    np.testing.assert_allclose(out.logprobs[0][second], row[second], atol=1e-4)  # raw logprobs, before bias
    assert llm.stats()["num_compilations"] == compiled  # per-request settings never recompile


def test_allowed_token_ids(llm, path):
    allowed = [3, 17, 42, 99, 250]
    both = llm.generate([PROMPT, PROMPT], [SamplingParams(allowed_token_ids=allowed, **GREEDY),
                                           SamplingParams(**GREEDY)])  # one batch: the other slot is free

    def only(_, logits):
        return np.where(np.isin(np.arange(V), allowed), logits, -np.inf)
    assert both[0].outputs[0].token_ids == hf_greedy(path, PROMPT, 6, only)
    assert both[1].outputs[0].token_ids == hf_greedy(path, PROMPT, 6, lambda _, x: x)


def vllm_bad_word_ids(tok, word):
    """vLLM's rule, by hand: the word alone and with a leading space (kept if as long, differing first)."""
    plain = tok.encode(word.lstrip(), add_special_tokens=False)
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    return [plain] + ([spaced] if len(spaced) == len(plain) and spaced[0] != plain[0] else [])


def test_bad_words(llm, path, tok):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    g = plain.token_ids
    # a one-token word the plain run generates, and a two-token word
    single = next(tok.decode([t]) for t in g if tok.decode([t]).strip()
                  and tok.encode(tok.decode([t]).lstrip(), add_special_tokens=False) == [t])
    double = tok.decode(g[3:5]).lstrip() or "the fox"
    for words in ([single], [double]):
        seqs = [s for w in words for s in vllm_bad_word_ids(tok, w)]

        def ban(out, logits):
            logits = logits.copy()
            for s in seqs:
                if len(s) == 1 or (len(out) >= len(s) - 1 and out[len(out) - len(s) + 1:] == s[:-1]):
                    logits[s[-1]] = -np.inf
            return logits
        got = llm.generate(PROMPT, SamplingParams(bad_words=words, max_tokens=8, temperature=0,
                                                  ignore_eos=True))[0].outputs[0].token_ids
        assert got == hf_greedy(path, PROMPT, 8, ban), words
        if words == [single]:  # generated before, now never
            assert got != g and seqs[0][0] not in got
        else:  # the same path up to the word's first token, then its last token is banned
            assert seqs[0] == g[3:5] and got[:4] == g[:4] and got[4] != g[4]


@pytest.mark.parametrize("kw,field", [
    (dict(logit_bias={V: 1.0}), "logit_bias"),
    (dict(logit_bias={1: math.inf}), "logit_bias"),
    (dict(logit_bias={1: 2e9}), "logit_bias"),
    (dict(logit_bias={"1": 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, V]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -1]), "allowed_token_ids"),
    (dict(bad_words=["ok", ""]), "bad_words"),
    (dict(bad_words=["w"] * (MAX_BAD_WORDS + 1)), "bad_words"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
])
def test_bad_input_names_the_field(llm, kw, field):
    with pytest.raises(ValueError, match=field) as e:
        llm.generate(PROMPT, SamplingParams(max_tokens=2, **kw))
    assert getattr(e.value, "param", field) == field
    assert len(llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2  # still serves


def test_bad_words_need_a_tokenizer(tmp_path, engine_kwargs):
    d = make_tiny_model(str(tmp_path / "m"), "llama", vocab_size=V, seed=21)  # the shapes above: no compile
    llm = LLM(model=d, **{**engine_kwargs, "block_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 4,
                          "max_model_len": 64})
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate([1, 2], SamplingParams(bad_words=["x"]))
    assert llm.generate([1, 2], SamplingParams(max_tokens=1))[0].outputs[0].finish_reason is not None
