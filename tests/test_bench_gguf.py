"""The benches on GGUF files: `random:<preset>-<type>` writes the preset's random model once as a GGUF with the
default model's tokenizer, and `jaxpaged bench latency` runs jaxpaged (the file kept packed) and llama.cpp
(when installed) on that same file side by side, recording its tensor types, the command and the commit.
A small preset of the default model's vocabulary stands in for the 1B-class one; figures are never asserted."""
import os
import re
import sys

import pytest

from jaxpaged.bench import common as bc

SMALL = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=10000.0)
ENGINE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "128", "--num-kv-blocks", "24"]
LLAMA_PYTHON = os.path.expanduser("~/llama-venv/bin/python")  # llama_cpp_peer's install path, where present


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """(the GGUF of a small WITH_TOKENIZER preset in Q4_K, the directory the engine loads it from)."""
    from jaxpaged.checkpoints.gguf_load import gguf_source
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bc.PRESETS, "smol-small", SMALL)
        mp.setattr(bc, "WITH_TOKENIZER", (*bc.WITH_TOKENIZER, "smol-small"))
        d = bc.make_random_gguf("smol-small", "Q4_K", root=str(tmp_path_factory.mktemp("presets")))
    return gguf_source(d), d


def test_gguf_preset_names(monkeypatch):
    """random:<preset>-<type> is a GGUF of a WITH_TOKENIZER preset; other names stay random models or are refused
    with the choices."""
    made = []
    monkeypatch.setattr(bc, "make_random_gguf", lambda p, t: made.append(("gguf", p, t)) or "g")
    monkeypatch.setattr(bc, "make_random_model", lambda p: made.append(("hf", p)) or "m")
    assert bc.resolve_model("random:llama-1b-smol-q4_k") == "g" and bc.resolve_model("random:llama-1b-smol") == "m"
    assert bc.resolve_model("random:llama-1b") == "m" and bc.resolve_model("random:nothing-q4_0") == "m"
    assert made == [("gguf", "llama-1b-smol", "Q4_K"), ("hf", "llama-1b-smol"), ("hf", "llama-1b"),
                    ("hf", "nothing-q4_0")]
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="unknown GGUF preset tiny-q4_0; choose from random:llama-1b-smol-q8_0, "):
        bc.resolve_model("random:tiny-q4_0")
    with pytest.raises(SystemExit, match="unknown GGUF preset llama-1b-smol-q2_k"):
        bc.resolve_model("random:llama-1b-smol-q2_k")


def test_gguf_preset_file(small_gguf):
    """Every matrix Q4_K (the tied embedding too), the norms F32; the tokenizer is the default model's."""
    from jaxpaged.bench.latency import gguf_info
    from jaxpaged.checkpoints.default_model import default_model_dir
    from jaxpaged.core.tokenizer import Tokenizer
    path, d = small_gguf
    assert path.endswith("random-smol-small.Q4_K.gguf")
    assert gguf_info(path)["types"] == {"Q4_K": 2 * 7 + 1, "F32": 2 * 2 + 1}
    text = "The river house, by the old station: 1947 songs!"
    assert Tokenizer.from_dir(d).encode(text) == Tokenizer.from_dir(default_model_dir()).encode(text)


def test_latency_on_the_same_gguf(small_gguf, compile_cache, tmp_path):
    """jaxpaged (packed: the weight-read bytes are the packed matrices') and llama.cpp on one file, one run."""
    from jaxpaged.bench import latency
    path, _ = small_gguf
    llama = LLAMA_PYTHON if os.path.isfile(LLAMA_PYTHON) else sys.executable
    out = latency.main(["--model", path, "--compilation-cache-dir", compile_cache, *ENGINE, "--backend",
                        "jaxpaged-bfloat16", "--backend", "llama-cpp", "--llama-python", llama, "--concurrency", "1",
                        "--prompt-len", "5", "--output-len", "6", "--repeats", "1", "--json", str(tmp_path / "l.json")])
    rows = {r["backend"]: r for r in out["rows"]}
    ours = rows["jaxpaged bfloat16"]
    assert ours["ms_per_token"] > 0 and ours["weight_read_ms"] > 0
    params = _param_count(SMALL)
    assert ours["weight_bytes"] < 0.45 * 2 * params  # 4-bit codes, a scale and a minimum per 32: not bf16, not int8
    assert out["gguf"]["model"]["path"] == path and out["gguf"]["model"]["types"]["Q4_K"] == 15
    assert out["command"].startswith("jaxpaged bench latency --model ") and "--backend llama-cpp" in out["command"]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", out["git_commit"])
    peer = f"llama.cpp ({os.path.basename(path)})"
    assert ("llama-cpp" in out["missing"]) != (peer in rows)
    if peer in rows:
        assert out["gguf"]["llama.cpp"]["path"] == path
        assert rows[peer]["weight_bytes"] == out["gguf"]["llama.cpp"]["tensor_bytes"] and rows[peer]["ms_per_token"] > 0
        assert rows[peer]["gguf_types"] == out["gguf"]["model"]["types"] and rows[peer]["llama_cpp"]["version"]


def _param_count(c: dict) -> int:
    D, F, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = D // c["num_attention_heads"] * c["num_key_value_heads"]
    return V * D + L * (2 * D * D + 2 * D * kv + 3 * D * F)


# A stand-in for llama-cpp-python, importable by the peer's worker through PYTHONPATH: it logs each load and
# generation to $FAKE_LLAMA_LOG and fails where $FAKE_LLAMA_FAIL says ("load", or "gen N": the N-th generation).
FAKE_LLAMA_CPP = '''
import os, time
__version__ = "fake-0"
def _log(what):
    with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
        f.write(what + "\\n")
def llama_print_system_info():
    return b"FAKE = 1"
class Llama:
    def __init__(self, model_path, n_ctx, n_threads, verbose):
        if os.environ.get("FAKE_LLAMA_FAIL") == "load":
            raise ValueError(f"fake: cannot load {model_path}")
        self.gens = 0
        _log(f"load {os.path.basename(model_path)} threads={n_threads}")
    def reset(self):
        pass
    def generate(self, prompt, temp, reset):
        self.gens += 1
        if os.environ.get("FAKE_LLAMA_FAIL") == f"gen {self.gens}":
            raise RuntimeError("fake: generation failed")
        _log(f"gen {self.gens}")
        n = 0
        while True:
            n += 1
            time.sleep(0.001)
            yield 100 + n
'''


@pytest.fixture
def fake_llama(tmp_path, monkeypatch):
    """(latency's args for the llama.cpp peer run by this interpreter on the stand-in, the log of its calls)."""
    import argparse
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_LLAMA_CPP)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    monkeypatch.delenv("FAKE_LLAMA_FAIL", raising=False)
    return argparse.Namespace(llama_python=sys.executable, llama_threads=2, output_len=6), log


def _calls(log) -> list[str]:
    return log.read_text().split("\n")[:-1] if log.exists() else []


def test_llama_cpp_in_the_same_rounds(fake_llama, tmp_path):
    """The peer loads the file once and warms it up (one generation) before any repeat, then times one
    generation a repeat when asked: its row holds one figure a repeat, with the worker's identity."""
    from jaxpaged.bench.latency import LlamaCpp
    args, log = fake_llama
    peer = LlamaCpp(args, str(tmp_path / "m.gguf"), [[1, 2, 3]])
    try:
        assert peer.why is None and _calls(log) == ["load m.gguf threads=2", "gen 1"]
        assert peer.peer.info["version"] == "fake-0" and peer.peer.info["system_info"] == "FAKE = 1"
        for r in range(3):
            peer.repeat(r)
            assert _calls(log)[-1] == f"gen {r + 2}"  # one timed generation a repeat, when asked
        assert len(peer.runs) == 3 and all(len(g["ms_per_token_runs"]) == 1 for g in peer.runs)
        assert all(g["ms_per_token_runs"][0] > 0 and g["ttft_ms_runs"][0] > 0 for g in peer.runs)
    finally:
        peer.close()
    assert peer.peer is None


@pytest.mark.parametrize("fail, match", [("load", "fake: cannot load"), ("gen 3", "fake: generation failed")])
def test_llama_cpp_failure_is_named(fake_llama, tmp_path, monkeypatch, fail, match):
    """A worker that fails to load the file, or in a later repeat, leaves no llama.cpp row and says why (its
    stderr); the caller's other rows are not its business (latency.main keeps them)."""
    from jaxpaged.bench.latency import LlamaCpp
    args, log = fake_llama
    monkeypatch.setenv("FAKE_LLAMA_FAIL", fail)
    peer = LlamaCpp(args, str(tmp_path / "m.gguf"), [[1, 2, 3]])
    try:
        for r in range(3):
            peer.repeat(r)  # the warm-up is generation 1: "gen 3" fails in the second repeat
        assert peer.why and "llama-cpp worker failed" in peer.why and match in peer.why
        assert peer.rows() == {} and peer.peer is None
    finally:
        peer.close()
