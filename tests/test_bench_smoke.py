"""Smoke tests of the benchmark scripts: each runs on a tiny model with a handful of requests.

They check that the scripts run and that their JSON has the documented keys and sane values; the
figures themselves are never asserted (speed is measured by the scripts, not by tests).
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from jaxpaged.bench import common as bc

# The same engine shapes for every in-process script, so the step compiles once (persistent cache).
ENGINE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "128", "--num-kv-blocks", "24"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model
    path = make_tiny_model(str(tmp_path_factory.mktemp("bench") / "tiny"), "llama", vocab_size=320)
    add_tiny_tokenizer(path, vocab_size=300)
    return path


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench_out")


@pytest.fixture(scope="module")
def common(model, compile_cache):
    return ["--model", model, "--compilation-cache-dir", compile_cache, *ENGINE]


@pytest.fixture(scope="module")
def throughput(common, out_dir):
    from jaxpaged.bench import throughput as bench_throughput
    path = str(out_dir / "throughput.json")
    out = bench_throughput.main([*common, "--num-prompts", "6", "--prompt-len", "4", "30", "--output-len", "2", "12",
                                 "--hf-batch-size", "4", "--json", path])
    return out, path


@pytest.fixture(scope="module")
def memory(common, out_dir):
    from jaxpaged.bench import memory as bench_memory
    path = str(out_dir / "memory.json")
    out = bench_memory.main([*common, "--num-prompts", "8", "--prompt-len", "20", "40",
                             "--output-len", "2", "12", "--n", "3", "--n-prompts", "2", "--system-len", "48",
                             "--system-prompts", "4", "--question-len", "2", "6", "--json", path,
                             "--weight-formats", "float32", "int8"])
    return out, path


@pytest.fixture(scope="module")
def prefix(common, out_dir):
    from jaxpaged.bench import prefix as bench_prefix
    path = str(out_dir / "prefix.json")
    out = bench_prefix.main([*common, "--system-len", "64", "--num-prompts", "4", "--prompt-len", "2", "6",
                             "--output-len", "2", "4", "--json", path])
    return out, path


@pytest.fixture(scope="module")
def host(common, out_dir):
    from jaxpaged.bench import host as bench_host
    path = str(out_dir / "host.json")
    out = bench_host.main([*common, "--running", "4", "--context", "12", "--steps", "3", "--warmup-steps", "1",
                           "--replays", "2", "--json", path])
    return out, path


def _json(path):
    with open(path) as f:
        return json.load(f)


def test_throughput(throughput):
    from jaxpaged.bench import throughput as bench_throughput
    out, path = throughput
    assert _json(path)["results"].keys() == {"jaxpaged", "static", "hf"}
    assert out["command"].startswith("jaxpaged bench throughput ") and "git_commit" in out
    wl = out["workload"]
    assert wl["num_prompts"] == 6 and wl["tokens"] == "tokenized text"
    drawn = None
    for name, r in out["results"].items():
        for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "elapsed_s"):
            assert r[key] > 0, (name, key)
        assert r["num_requests"] == 6
        assert r["total_tokens_per_s"] > r["output_tokens_per_s"]
        assert r["requests_per_s"] == pytest.approx(6 / r["elapsed_s"])
        assert all(0 < t <= lat for t, lat in zip(r["per_request"]["ttft_s"], r["per_request"]["latency_s"]))
        drawn = drawn or r["per_request"]["output_tokens"]
        assert r["per_request"]["output_tokens"] == drawn  # every backend generates the drawn lengths
    assert all(2 <= n <= 12 for n in drawn)
    text = bench_throughput.report(out)
    assert "only generation is timed" in text and "out vs hf" in text and "x" in text


def test_throughput_per_dtype(common):
    """--jaxpaged-dtype twice: one engine per dtype, each its own labelled row, the same drawn outputs."""
    from jaxpaged.bench import throughput as bench_throughput
    out = bench_throughput.main([*common, "--backend", "jaxpaged", "--jaxpaged-dtype", "float32",
                                 "--jaxpaged-dtype", "bfloat16", "--num-prompts", "2", "--prompt-len", "4", "8",
                                 "--output-len", "2", "4"])
    res = out["results"]
    assert res.keys() == {"jaxpaged-float32", "jaxpaged-bfloat16"} and out["engine"]["dtype"] == ["float32", "bfloat16"]
    drawn = [r["per_request"]["output_tokens"] for r in res.values()]
    assert drawn[0] == drawn[1]
    assert "out vs jaxpaged-bfloat16" in bench_throughput.report(out)


def test_memory(memory):
    out, path = memory
    assert _json(path)["paged"] == out["paged"]
    p, c, o = out["paged"], out["contiguous_max_model_len"], out["contiguous_oracle"]
    assert out["budget"]["num_kv_blocks"] == 23 and out["budget"]["tokens"] == 23 * 16
    assert 0 <= p["waste_pct_at_peak"] < 100 and p["peak_used_blocks"] <= 23
    assert p["tokens_held_at_peak"] <= p["peak_used_tokens"]
    assert c["waste_pct_at_peak"] > p["waste_pct_at_peak"]
    assert c["peak_running"] == 2 and p["peak_running"] == 4  # 368 positions / 128 per request; 4 slots
    assert o["peak_reserved_tokens"] <= out["budget"]["tokens"]
    for name in ("n", "system_prompt"):
        s = out["sharing"][name]
        assert s["peak_used_blocks"] < s["peak_unshared_blocks"], name
        assert 0 < s["saved_pct_at_peak"] < 100, name
    assert len(out["series"]["paged"]["used_tokens"]) == p["steps"]
    w = out["weights"]  # each format loaded in a fresh process
    assert set(w["formats"]) == {"float32", "int8"} and w["int8_over_float32"] < 0.35
    f32, i8 = w["formats"]["float32"], w["formats"]["int8"]
    assert f32["kv_pool_bytes"] == i8["kv_pool_bytes"] > 0 and i8["param_bytes"] < f32["param_bytes"]
    assert all(r["rss_after_compile"] >= r["rss_after_load"] > r["rss_before_load"] for r in (f32, i8))


def test_contiguous_simulation():
    from jaxpaged.bench import memory as bench_memory
    reqs = [bc.Req([1] * 10, 5), bc.Req([1] * 20, 1, n=2)]
    res, series = bench_memory.simulate_contiguous(reqs, budget_tokens=100, max_num_seqs=8, reserve=lambda r: 40)
    # two fit at once: the first request (5 steps) and one sample of the second (1 step), then the other
    assert series["running"] == [2, 2, 1, 1, 1]
    assert series["held_tokens"] == [30, 31, 12, 13, 14]
    assert res["peak_reserved_tokens"] == 80 and res["waste_pct_at_peak"] == pytest.approx(100 * (1 - 31 / 80))


def test_length_distributions():
    rng = np.random.default_rng(0)
    for dist in ("uniform", "sharegpt"):
        xs = bc.draw_lengths(rng, 2000, dist, 16, 256)
        assert xs.min() >= 16 and xs.max() <= 256
    sg = bc.draw_lengths(rng, 2000, "sharegpt", 16, 256)
    assert np.median(sg) < np.mean(sg) < 136  # long-tailed: most requests short


def test_prefix(prefix):
    out, path = prefix
    on, off = out["results"]["prefix_caching_on"], out["results"]["prefix_caching_off"]
    assert on["prefix_cache_hit_rate"] > 0.5 and off["prefix_cache_hit_rate"] == 0
    for r in (on, off):
        assert r["ttft_s"]["mean"] > 0 and r["output_tokens_per_s"] > 0
    assert out["ratios"]["mean_ttft_off_over_on"] > 0
    assert _json(path)["workload"]["shared_prefix_len"] == 64


def test_host(host):
    out, path = host
    rows = out["results"]
    assert [r["running"] for r in rows] == [4]
    for r in rows:
        assert 0 < r["device_s"] and 0 < r["step_wall_s"]
        assert r["schedule_s"] > 0 and r["update_s"] > 0 and r["execute_s"] > 0
        assert r["matmul_bench_flops_per_s"] > 0 and r["decode_efficiency_pct"] > 0
        assert r["context_mean"] >= 13
    assert _json(path)["results"][0]["running"] == 4


@pytest.mark.parametrize("mode", ["off", "on"])
def test_host_null_device(common, out_dir, mode):
    """--null-device with a simulated 1 ms device step: every field; a synchronous step waits for its device
    step, so it takes at least that long (async overlaps it, and may show less on a median)."""
    from jaxpaged.bench import host as bench_host
    path = str(out_dir / f"host_null_{mode}.json")
    out = bench_host.main([*common, "--null-device", "--running", "4", "--context", "12", "--steps", "6",
                           "--repeats", "2", "--warmup-steps", "1", "--device-ms", "1", "--async-scheduling", mode,
                           "--final-only", "--json", path])
    (r,) = out["results"]
    assert r["running"] == 4 and r["async_scheduling"] == (mode == "on") and len(r["repeats"]) == 2
    for k in ("schedule_ms", "prepare_ms", "transfer_ms", "readback_ms", "update_ms", "detokenize_ms",
              "host_cpu_ms_per_step", "null_steps_per_s"):
        assert r[k] > 0, k
    if mode == "off":  # nothing overlaps: every step waits out its device step, and the host's time is on top
        assert r["host_ms_per_step"] >= 1.0 and r["unhidden_host_ms_per_step"] > 0
    assert _json(path)["null_device"] is True


def test_startup(tmp_path):
    from jaxpaged.bench import startup as bench_startup
    from jaxpaged.testing.tiny_models import make_tiny_model
    model = make_tiny_model(str(tmp_path / "bare"), "llama")  # no tokenizer: the children skip transformers
    path = str(tmp_path / "startup.json")
    out = bench_startup.main(["--model", model, "--max-num-seqs", "2", "--max-num-batched-tokens", "8",
                              "--max-model-len", "64", "--warm-runs", "1", "--cache-root", str(tmp_path / "cache"),
                              "--json", path])
    assert out["cold"]["time_to_first_token_s"] > out["cold"]["engine_s"] > 0
    assert len(out["warm"]) == 1 and out["warm_median_time_to_first_token_s"] > 0
    assert out["cold"]["num_compilations"] >= 1 and os.path.isdir(out["cache_dir"])
    assert _json(path)["cold"] == out["cold"]


def test_latency(common, out_dir):
    """bench_latency: every jaxpaged row with its weight-read time, its engine without the prefix cache; peers not
    installed are named."""
    from jaxpaged.bench import latency as bench_latency
    path = str(out_dir / "latency.json")
    out = bench_latency.main([*common, "--backend", "jaxpaged-float32", "--backend", "jaxpaged-int8",
                              "--backend", "llama-cpp", "--concurrency", "1", "2", "--prompt-len", "5",
                              "--output-len", "6", "--repeats", "1", "--json", path])
    rows = {(r["backend"], r["running"]): r for r in out["rows"] if r["backend"].startswith("jaxpaged")}
    assert set(rows) == {(f"jaxpaged {n}", k) for n in ("float32", "int8") for k in (1, 2)}
    for r in rows.values():
        assert r["ms_per_token"] > 0 and r["ttft_ms"] > 0 and r["weight_read_ms"] > 0 and r["x_weight_read"] > 0
        assert r["cpu_ms_per_step"] > 0
        assert r["prefix_caching"] is False  # the repeats reuse the prompts: TTFT stays a whole prefill
    assert rows["jaxpaged int8", 1]["weight_bytes"] < 0.5 * rows["jaxpaged float32", 1]["weight_bytes"]
    assert ("llama-cpp" in out["missing"]) != any(r["backend"].startswith("llama.cpp") for r in out["rows"])
    assert out["peaks"]["memcpy_bytes_per_s"] > 0 and "cpu_flags" in out["machine"]
    assert _json(path)["rows"] == out["rows"]


def test_bench_step_parts(common, out_dir):
    """bench_step_parts: at 1 and 4 running, each part measured, their sum less the profiler's own cost and the
    gap to the step; the accounting closes: the step is its host and its compiled call (the same engine step),
    the device parts are the traced replay, the profiler that less the untraced one, so the gap is exactly the
    engine's call less the untraced replay of the same step (nothing counted twice, nothing left out)."""
    from jaxpaged.bench import step_parts as bench_step_parts
    path = out_dir / "parts.json"
    out = bench_step_parts.main([*common, "--running", "1", "4", "--context", "8", "--steps", "3", "--repeats", "2",
                                 "--json", str(path)])
    assert [r["running"] for r in out["results"]] == [1, 4]
    for r in out["results"]:
        parts = [r[f"{p}_ms"] for p in bench_step_parts.PARTS]
        assert r["step_ms"] > 0 and r["products_ms"] > 0 and r["attention_ms"] > 0 and r["host_ms"] > 0
        assert min(parts) >= 0 and r["sum_ms"] == pytest.approx(sum(parts) - r["profiler_ms"])
        assert r["gap_ms"] == pytest.approx(r["step_ms"] - r["sum_ms"]) and r["thunks_per_step"] > 0
        assert r["step_ms"] == pytest.approx(r["host_ms"] + r["call_ms"])
        device = sum(r[f"{k}_ms"] for k in (*bench_step_parts.KINDS, "between"))
        assert device == pytest.approx(r["window_ms"]) and r["replay_ms"] > 0
        assert r["profiler_ms"] == pytest.approx(r["window_ms"] - r["replay_ms"])
        assert r["gap_ms"] == pytest.approx(r["call_ms"] - r["replay_ms"], abs=1e-9)
        assert r["faults_per_step"] >= 0 and r["fault_ms"] >= 0 and r["top_xla_own"]
        assert r["replay_host_inputs"] >= 1  # the packed inputs go from the host, as in the engine
    assert out["fault_cost_us"] > 0 and out["read_all_weights_ms"] > 0 and out["weight_bytes"] > 0
    saved = json.load(open(path))
    assert saved["machine"]["cpu_flags"] and saved["load_average"] and saved["command"].startswith("jaxpaged bench")


def test_read_pass_reads_packed_bytes_as_bytes():
    """step_parts' weight-read bound reads a leaf of packed codes by a maximum over its bytes (no float32 copy of
    every byte: that pass ran at a third of the memory's rate), float leaves by a float32 sum; its value covers
    every leaf."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.bench.step_parts import read_pass
    tree = {"codes": jnp.asarray(np.arange(4096) % 251, jnp.uint8).reshape(4, 1024),
            "signed": jnp.full((3, 5), -2, jnp.int8), "w": jnp.full((8, 8), 0.5, jnp.bfloat16)}
    fn = read_pass()
    hlo = fn.lower(tree).as_text()
    assert not re.search(r"tensor<4x1024xf32>|tensor<3x5xf32>", hlo), "a byte leaf was converted to float32"
    assert "stablehlo.maximum" in hlo and "tensor<8x8xf32>" in hlo
    assert float(jax.block_until_ready(fn(tree))) == 250 + 254 + 32  # int8 -2 read as its byte 254


def test_bench_step_parts_prefill(common):
    """bench_step_parts --prefill: the step in which 2 new prompts join 0 and 2 decoding requests, after the
    decode row of 2; each such step computes the prompts' tokens beside the decodes, and is split like one."""
    from jaxpaged.bench import step_parts as bench_step_parts
    out = bench_step_parts.main([*common, "--running", "0", "2", "--prefill", "2", "--context", "8", "--steps", "2",
                                 "--repeats", "1"])
    rows = out["results"]
    assert [(r["running"], r.get("prefill")) for r in rows] == [(0, 2), (2, None), (2, 2)]
    assert rows[0]["tokens"] == 2 * 8 and rows[2]["tokens"] == 2 + 2 * 8
    for r in rows:
        assert r["step_ms"] > 0 and r["products_ms"] > 0 and r["attention_ms"] > 0
        assert r["sum_ms"] == pytest.approx(sum(r[f"{p}_ms"] for p in bench_step_parts.PARTS) - r["profiler_ms"])
        assert r["gap_ms"] == pytest.approx(r["call_ms"] - r["replay_ms"], abs=1e-9)
    assert bench_step_parts.label(rows[2]) == "2 running + 2 prompts"


def test_step_profile_one_call_per_window():
    """step_profile.profile_step on a two-thunk program (a product fusion, then a loop fusion): the window holds
    one call's thunks (not the session's untimed first call's), its kinds and between add up to it, and the
    profiler's cost is that window less the untraced call of the same rank."""
    import re

    import jax
    import jax.numpy as jnp

    from jaxpaged.bench.step_profile import KINDS, profile_step
    a = jnp.ones((64, 64), jnp.float32)  # [64, 64]
    fn = jax.jit(lambda x, y: jnp.tanh(x @ y) + 1).lower(a, a).compile()
    text = fn.as_text()
    entry = re.search(r"^ENTRY .*?^}", text, re.M | re.S).group(0)
    thunks = len(re.findall(r"= \S+ fusion\(", entry))
    out = profile_step(lambda: jax.block_until_ready(fn(a, a)), text, re.match(r"HloModule ([^\s,]+)", text).group(1),
                       reps=3)
    assert thunks == 2 and out["thunks_per_step"] == thunks and out["products_ms"] > 0
    assert sum(out[f"{k}_ms"] for k in (*KINDS, "between")) == pytest.approx(out["window_ms"])
    assert out["profiler_ms"] == pytest.approx(out["window_ms"] - out["replay_ms"]) and out["replay_ms"] > 0


def test_step_profile_kinds_and_shares():
    """step_profile: a dot inside a scanned fusion is a product, the loop a container; an instant shared by
    two running thunks counts half for each, an instant with none counts as between."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.bench.step_profile import kinds, parse_hlo, share

    def f(w, x):  # w [L, D, D], x [R, D]
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0].sum()
    text = jax.jit(f).lower(jnp.ones((2, 32, 32)), jnp.ones((8, 32))).compile().as_text()
    got = kinds(text)
    assert "products" in got.values() and "container" in got.values() and "xla_own" in got.values()
    opcodes = {n: op for n, (op, _, _) in parse_hlo(text)[0].items()}
    assert {got[n] for n in got if opcodes[n] == "while"} == {"container"}
    runs = {n: op for n, op in opcodes.items() if op in ("dot", "fusion")}  # thunks: a dot alone or fused
    by_op = lambda what: {got[n] for n in runs if f'/{what}" stack' in text.split(f"%{n} = ", 1)[1].split("\n")[0]}
    assert by_op("dot_general") == {"products"} and by_op("tanh") == {"xla_own"}
    assert share([(0, 10, "a"), (5, 20, "b"), (30, 40, "a")], 0, 50) == {"a": 17.5, "b": 12.5, "between": 20.0}
    assert share([(0, 10, "a")], 2, 6) == {"a": 4.0, "between": 0.0}


def test_hf_model_from_converted_dir(model, tmp_path):
    """The hf backend loads the engine's converted format onto transformers' model: same logits."""
    import torch

    from jaxpaged.bench.common import load_hf_model
    from jaxpaged.checkpoints.convert import convert
    dst = convert(model, str(tmp_path / "converted"), dtype="float32", progress=False)
    ids = torch.tensor([[5, 17, 33, 2, 90]])
    with torch.no_grad():
        want = load_hf_model(model, "float32")(ids).logits
        got = load_hf_model(dst, "float32")(ids).logits
    torch.testing.assert_close(got, want)


def test_plots(throughput, memory, prefix, host, tmp_path):
    from jaxpaged.bench import plot as plot_benchmarks
    paths = plot_benchmarks.main(["--throughput", throughput[1], "--memory", memory[1], "--prefix", prefix[1],
                                  "--host", host[1], "--out-dir", str(tmp_path)])
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["host.png", "latency.png", "memory.png", "prefix.png", "throughput.png"]
    assert all(os.path.getsize(p) > 1000 for p in paths)


def test_step_message(common, out_dir):
    """The multi-host message: every step measured, compressed below the raw arrays, decodable."""
    from jaxpaged.bench import step_message as bench_step_message
    path = str(out_dir / "step_message.json")
    out = bench_step_message.main([*common, "--num-prompts", "6", "--prompt-len", "20", "40",
                                   "--output-len", "4", "8", "--json", path])
    assert set(out) == {"full-budget steps", "decode steps"}
    for r in out.values():
        assert r["steps"] > 0 and 0 < r["message_bytes"] < r["raw_bytes"]
    assert json.load(open(path))["results"] == out


@pytest.mark.slow  # two engines and four workload runs
def test_bench_research(common, out_dir):
    from jaxpaged.bench import research as bench_research
    path = str(out_dir / "research.json")
    out = bench_research.main([*common, "--num-prompts", "4", "--prompt-len", "4", "20", "--output-len", "2", "6",
                               "--rounds", "1", "--step-reps", "2", "--json", path])
    assert json.load(open(path)).keys() == out.keys()
    assert set(out["ratio_to_plain"]) == {"hooks-idle", "hooks-steered", "hooks-hidden"}
    assert all(v > 0 for v in out["ratio_to_plain"].values()) and len(out["step_ratio_to_plain"]) == 2
    assert set(out["update_weights_s"]) == {"pytree-device", "pytree-numpy", "hf-pairs"}
    assert out["num_tensors"] == 2 + 1 + 9 * 2  # embed, norm, lm_head; 9 tensors in each of 2 layers


def test_lora(common, out_dir):
    from jaxpaged.bench import lora as bench_lora
    path = str(out_dir / "lora.json")
    out = bench_lora.main([*common, "--num-adapters", "2", "--rank", "4", "--num-prompts", "4", "--prompt-len", "4",
                           "20", "--output-len", "2", "8", "--json", path])
    saved = json.load(open(path))
    assert saved["lora_over_base_throughput"] > 0 and set(saved["product"]) == {"8", "64", "512"}
    lora = out["results"]["lora"]
    assert lora["lora_stats"]["lora_loads"] == 2 and len(lora["adapter_load_s"]) == 2
    assert lora["output_tokens"] == out["results"]["base"]["output_tokens"]


def test_wrap_steps_is_the_timing_seam(model, compile_cache):
    """ModelRunner.wrap_steps, the hook the benchmarks time and capture the step through: every step runs
    through the wrapper (same tokens), `None` restores the compiled steps, a stand-in compiles nothing."""
    from jaxpaged import LLM, SamplingParams
    llm = LLM(model=model, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
              num_kv_blocks=24, compilation_cache_dir=compile_cache, show_progress=False)
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    gen = lambda: [o.outputs[0].token_ids for o in llm.generate(["hello world"], sp, use_tqdm=False)]  # noqa: E731
    plain, runner, keys = gen(), llm.engine.runner, []

    def count(key, compiled):
        keys.append(key)
        return compiled()

    runner.wrap_steps(count)
    assert gen() == plain and len(keys) >= 5 and all(len(k) == 3 for k in keys)
    runner.wrap_steps(None)
    seen = len(keys)
    assert gen() == plain and len(keys) == seen
    with pytest.raises(TypeError, match="wrap must be a callable"):
        runner.wrap_steps("timer")
    before = runner.num_compilations
    runner.wrap_steps(lambda key, compiled: "stand-in")  # never calls compiled(): nothing is compiled
    assert runner.compiled_step((999, False)) == "stand-in" and runner.num_compilations == before
    runner.wrap_steps(None)
