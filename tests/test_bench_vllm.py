"""throughput.py --backend vllm: skipped with a message when vLLM cannot be imported, and run through
a stand-in `vllm` package (vLLM itself is not installed here): the command, its environment, the job.
The stand-in also serves tests/test_bench_vllm_spec.py."""
import json
import os

import numpy as np

from jaxpaged.bench import throughput, vllm_peer
from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model

STAND_IN = '''
import json, os
__version__ = "stand-in"
class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
class _Out:
    def __init__(self, n):
        self.token_ids = list(range(n))
class _Req:
    def __init__(self, n):
        self.outputs = [_Out(n)]
class _Metric:
    def __init__(self, name, **kw):
        self.name, self.labels = name, {}
        self.__dict__.update(kw)
class LLM:
    """Speculating (speculative_config given), every request makes one draft; its first token is accepted."""
    def __init__(self, **kw):
        self.k = (kw.get("speculative_config") or {}).get("num_speculative_tokens", 0)
        self.drafts = 0
        with open(os.environ["STAND_IN_LOG"], "a") as f:
            f.write(json.dumps(dict(init=kw, omp=os.environ.get("OMP_NUM_THREADS"),
                                    bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))) + "\\n")
    def generate(self, prompts, params, use_tqdm=True):
        with open(os.environ["STAND_IN_LOG"], "a") as f:
            f.write(json.dumps(dict(prompts=prompts, params=[p.kw for p in params])) + "\\n")
        self.drafts += len(prompts) if self.k else 0
        return [_Req(p.kw["max_tokens"]) for p in params]
    def reset_prefix_cache(self):
        with open(os.environ["STAND_IN_LOG"], "a") as f:
            f.write(json.dumps(dict(reset_prefix_cache=True)) + "\\n")
    def get_metrics(self):
        out = [_Metric("vllm:num_requests_running", value=0)]
        if self.k:
            d = self.drafts
            out += [_Metric("vllm:spec_decode_num_drafts", value=d),
                    _Metric("vllm:spec_decode_num_draft_tokens", value=d * self.k),
                    _Metric("vllm:spec_decode_num_accepted_tokens", value=d),
                    _Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[d] + [0] * (self.k - 1))]
        return out
'''


def _config_only(path) -> str:
    """A model directory with only config.json: enough for the workload and for the vllm backend."""
    os.makedirs(path)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


def _args(model, *extra):
    return ["--model", model, "--num-prompts", "3", "--prompt-len", "4", "8", "--output-len", "2", "5",
            "--max-num-seqs", "4", "--random-tokens", *extra]


def test_skipped_with_a_message(tmp_path):
    model = _config_only(tmp_path / "m")
    out = throughput.main(_args(model, "--backend", "vllm"))  # this venv has no vllm
    assert out["results"] == {} and "`import vllm` fails under" in out["skipped"]["vllm"]
    assert "--vllm-python" in out["skipped"]["vllm"]
    out = throughput.main(_args(model, "--backend", "vllm", "--vllm-python", str(tmp_path / "nope")))
    assert "cannot run" in out["skipped"]["vllm"]


def use_stand_in(tmp_path, monkeypatch):
    """Put the stand-in `vllm` package first on the workers' PYTHONPATH; returns the file it logs to."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(STAND_IN)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    return log


def test_runs_through_a_stand_in(tmp_path, monkeypatch):
    model = _config_only(tmp_path / "m")
    log = use_stand_in(tmp_path, monkeypatch)
    out = throughput.main(_args(model, "--backend", "vllm", "--vllm-cpu-bind", "0-1", "--vllm-dtype", "float32"))
    r = out["results"]["vllm"]
    init, warm, timed = [json.loads(line) for line in log.read_text().splitlines()]
    assert init["omp"] == "2" and init["bind"] == "0-1"
    assert init["init"]["model"] == model and init["init"]["dtype"] == "float32" and init["init"]["max_num_seqs"] == 4
    assert init["init"]["gpu_memory_utilization"] == 0.3  # vLLM's 0.92 default does not start here
    lens = [p["max_tokens"] for p in timed["params"]]
    assert all(p["min_tokens"] == p["max_tokens"] and p["ignore_eos"] and p["temperature"] == 0
               for p in timed["params"])
    assert r["output_tokens"] == sum(lens) and r["num_requests"] == 3 and r["vllm_version"] == "stand-in"
    assert len(timed["prompts"]) == 3 and all(4 <= len(p["prompt_token_ids"]) <= 8 for p in timed["prompts"])


def test_vllm_at_its_best_dtype_or_both(tmp_path, monkeypatch):
    """--vllm-dtype best (the default): bfloat16 on CPUs with bf16 units (AMX, AVX-512 BF16), float32
    elsewhere; both: one run each, labelled by dtype."""
    assert vllm_peer.best_dtype(["avx512f", "avx512_bf16", "amx_bf16", "amx_tile"]) == "bfloat16"
    assert vllm_peer.best_dtype(["avx512f", "avx512_bf16"]) == "bfloat16"
    assert vllm_peer.best_dtype(["avx512f", "avx2"]) == vllm_peer.best_dtype(["avx2"]) == "float32"
    model = _config_only(tmp_path / "m")
    log = use_stand_in(tmp_path, monkeypatch)
    out = throughput.main(_args(model, "--backend", "vllm", "--vllm-dtype", "both"))
    assert set(out["results"]) == {"vllm-float32", "vllm-bfloat16"}
    assert {r["vllm_dtype"] for r in out["results"].values()} == {"float32", "bfloat16"}
    inits = [json.loads(line)["init"]["dtype"] for line in log.read_text().splitlines() if "init" in line]
    assert inits == ["float32", "bfloat16"]


def test_converted_model_exported_for_vllm(tmp_path):
    from jaxpaged.checkpoints.convert import convert
    from jaxpaged.checkpoints.weights import load_params
    from jaxpaged.config import ModelConfig
    src = make_tiny_model(str(tmp_path / "hf"), "llama", vocab_size=300)
    add_tiny_tokenizer(src, 300)
    conv = convert(src, str(tmp_path / "conv"), dtype="float32", progress=False)
    out = vllm_peer.hf_dir_for(conv, str(tmp_path / "export"))
    assert out != conv and {"config.json", "tokenizer.json"} <= set(os.listdir(out))
    assert vllm_peer.hf_dir_for(src, str(tmp_path / "export")) == src
    cfg = ModelConfig.from_dir(src)
    a, b = load_params(src, cfg, "float32"), load_params(out, cfg, "float32")
    np.testing.assert_array_equal(a["layers"]["wq"], b["layers"]["wq"])


def test_vllm_w8a8_beside_its_plain_weights(tmp_path, monkeypatch):
    """--vllm-quantization none --vllm-quantization w8a8: one run each, the second on the compressed-tensors
    copy (jaxpaged/bench/w8a8.py), labelled and recorded."""
    src = make_tiny_model(str(tmp_path / "hf"), "llama", vocab_size=300)
    log = use_stand_in(tmp_path, monkeypatch)
    out = throughput.main(_args(src, "--backend", "vllm", "--vllm-dtype", "bfloat16",
                                "--vllm-quantization", "none", "--vllm-quantization", "w8a8"))
    assert set(out["results"]) == {"vllm", "vllm-w8a8"}
    assert out["results"]["vllm-w8a8"]["vllm_quantization"] == "w8a8"
    inits = [json.loads(line)["init"]["model"] for line in log.read_text().splitlines() if "init" in line]
    assert inits == [src, src + "-w8a8"]
    cfg = json.load(open(os.path.join(src + "-w8a8", "config.json")))
    assert cfg["quantization_config"]["format"] == "int-quantized"
