"""POST /v1/completions with prompt_embeds (vLLM's: base64 of a torch.save'd tensor), on a server started with
--enable-prompt-embeds: the model's own embedding rows give the token-id prompt's tokens; refusals are 400s
naming prompt_embeds; the torch-free reader never unpickles anything but a tensor."""
import base64
import io
import pickle
import zipfile

import numpy as np
import pytest
from test_server import Server, assert_error, make_tokenizer, raw, wait_idle

from jaxpaged.testing.tiny_models import make_tiny_model
from serve.prompt_embeds import BadTensor, decode, load_tensor

torch = pytest.importorskip("torch")


def b64(t) -> str:
    buf = io.BytesIO()
    torch.save(t, buf)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("embeds_model"))
    make_tiny_model(d, "llama", vocab_size=256, seed=4)
    make_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def server(model, compile_cache, tmp_path_factory):
    srv = Server(model, compile_cache, str(tmp_path_factory.mktemp("logs") / "embeds.log"),
                 extra=("--enable-prompt-embeds",))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def table(model):
    from safetensors.numpy import load_file
    return next(a for k, a in load_file(f"{model}/model.safetensors").items() if "embed_tokens" in k)  # [V, D]


def complete(server, **body):
    r = raw(server, {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **body},
            key=None)
    assert r.status_code == 200, r.text
    return r.json()


def test_embeds_give_the_token_prompts_tokens(server, table):
    ids = [int(t) for t in np.random.default_rng(0).integers(5, 256, 21)]
    want = complete(server, prompt=ids)["choices"][0]
    got = complete(server, prompt_embeds=b64(torch.from_numpy(table[ids])))
    assert got["choices"][0]["token_ids"] == want["token_ids"]
    # the text is decoded without the prompt's tokens as context (it has none): no word-initial space here
    assert got["choices"][0]["text"] == want["text"].lstrip()
    assert got["usage"]["prompt_tokens"] == len(ids)
    # bfloat16, with a leading axis of 1, streamed: the same (the rows are exact in bfloat16 only if they are;
    # compare with the bfloat16-rounded rows as token-free float32 embeddings)
    rounded = torch.from_numpy(table[ids]).to(torch.bfloat16)
    ref = complete(server, prompt_embeds=b64(rounded.float()))["choices"][0]["token_ids"]
    assert complete(server, prompt_embeds=b64(rounded[None]))["choices"][0]["token_ids"] == ref


def test_both_prompt_and_embeds_embeddings_first(server, table):
    a, b = [7, 8, 9, 10, 11], [30, 31, 32]
    want = [complete(server, prompt=p)["choices"][0]["token_ids"] for p in (a, b)]
    got = complete(server, prompt=[b], prompt_embeds=[b64(torch.from_numpy(table[a]))])["choices"]
    assert [c["index"] for c in got] == [0, 1] and [c["token_ids"] for c in got] == want
    wait_idle(server)


@pytest.mark.parametrize("make,code,words", [
    (lambda t: "not base64!", "invalid_prompt_embeds", "base64"),
    (lambda t: base64.b64encode(b"not a zip").decode(), "invalid_prompt_embeds", "zip"),
    (lambda t: b64({"x": torch.zeros(2, 64)}), "invalid_prompt_embeds", "not a tensor"),
    (lambda t: b64(torch.zeros(4, 64, dtype=torch.int64)), "invalid_prompt_embeds", "floating-point"),
    (lambda t: b64(torch.zeros(64)), "invalid_prompt_embeds", "2-D"),
    (lambda t: b64(torch.zeros(4, 32)), "invalid_prompt_embeds", "hidden size 32"),
    (lambda t: b64(torch.zeros(0, 64)), "empty_prompt", "empty"),
    (lambda t: b64(torch.zeros(256, 64, dtype=torch.float16)), "context_length_exceeded", "max_model_len"),
])
def test_refusals(server, table, make, code, words):
    err = assert_error(raw(server, {"prompt_embeds": make(table), "max_tokens": 2}, key=None), 400,
                       "prompt_embeds", code)
    assert words in err["message"] and "prompt_embeds" in err["message"]


def test_refused_combinations(server, table):
    e = b64(torch.from_numpy(table[[5, 6, 7]]))
    for extra in ({"echo": True}, {"prompt_logprobs": 1}):
        assert_error(raw(server, {"prompt_embeds": e, "max_tokens": 2, **extra}, key=None), 400, "prompt_embeds",
                     "invalid_combination")
    assert_error(raw(server, {"max_tokens": 2}, key=None), 400, "prompt", "empty_prompt")


def test_refused_combinations_in_vllm_words(server, table):
    e = b64(torch.from_numpy(table[[5, 6, 7]]))
    for extra, words in (({"echo": True}, "Echo is unsupported with prompt embeds"),
                         ({"prompt_logprobs": 1}, "prompt_logprobs is not compatible with prompt embeds")):
        err = assert_error(raw(server, {"prompt_embeds": e, "max_tokens": 2, **extra}, key=None), 400,
                           "prompt_embeds", "invalid_combination")
        assert err["message"].startswith(words), err


class _Evil:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled')",))


def test_reader_refuses_what_is_not_a_tensor():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(_Evil(), protocol=2))
    with pytest.raises(BadTensor, match=r"builtin\w*\.exec"):
        load_tensor(buf.getvalue())
    with pytest.raises(BadTensor, match="_rebuild_sparse_tensor"):
        decode(b64(torch.zeros(3, 3).to_sparse()))
    for t in (torch.randn(4, 3).t(), torch.randn(10, 4)[2:5], torch.randn(3, 4).half(), torch.randn(2, 5).double()):
        np.testing.assert_array_equal(decode(b64(t)), t.numpy())  # strided, offset, other float dtypes
