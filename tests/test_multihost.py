"""Multi-host serving on loopback: two processes x 2 simulated CPU devices, TP=4 over both, gloo collectives.

A `jaxpaged serve` leader (process 0) and one follower give the openai client the same completions as a
single-process server; a killed follower makes the leader answer with an OpenAI error body within the
timeout (a stuck one: within --distributed-timeout); SIGTERM to the leader stops both; differing flags stop
both with an error naming them; `jaxpaged generate` on two processes prints the same completions."""
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from test_server import Server, free_port, make_tokenizer

from jaxpaged.testing.xla_env import subprocess_env

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 8  # --distributed-timeout
PROMPTS = ["the quick brown fox", "hello world " * 6, "a b c d the lazy dog jumps over"]
FLAGS = ["--served-model-name", "tiny", "--dtype", "float32", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "32", "--max-model-len", "128"]
CODE = ("import argparse, sys, jax; jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
        "from serve.app import add_serve_args, run_server\n"
        "args = add_serve_args(argparse.ArgumentParser()).parse_args(sys.argv[2:])\n"
        "run_server(args, engine_kwargs=dict(compilation_cache_dir=sys.argv[1], show_progress=False))\n")


class Job:
    """A leader and a follower `run_server` process on loopback."""

    def __init__(self, model_dir, cache, logs, *, follower_extra=(), extra=()):
        self.port, coord = free_port(), f"127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**subprocess_env(2), "PYTHONPATH": ROOT}
        common = ["--model", model_dir, *FLAGS, *extra, "--port", str(self.port), "--tensor-parallel-size", "4",
                  "--coordinator-address", coord, "--num-processes", "2", "--distributed-timeout", str(TIMEOUT)]
        self.logs = [str(logs / f"process{i}.log") for i in range(2)]
        self.procs = [subprocess.Popen([sys.executable, "-c", CODE, cache, *common, "--process-id", str(i),
                                        *(follower_extra if i else ())],
                                       cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
                      for i, log in enumerate(self.logs)]

    def wait_ready(self, timeout=300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a process exited:\n{self.output(0)}\n{self.output(1)}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the leader did not start:\n{self.output(0)}")

    def output(self, i) -> str:
        with open(self.logs[i]) as f:
            return f.read()[-6000:]

    def wait_exit(self, timeout) -> list:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from jaxpaged.testing.tiny_models import make_tiny_model
    d = str(tmp_path_factory.mktemp("mh_model"))
    make_tiny_model(d, "llama", vocab_size=256, num_heads=8, num_kv_heads=4)
    make_tokenizer(d)
    return d


def completions(url) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    out = [client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0).choices[0].text
           for p in PROMPTS]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0)
    return out + [chat.choices[0].message.content]


@pytest.fixture(scope="module")
def reference(model_dir, compile_cache, tmp_path_factory):
    srv = Server(model_dir, compile_cache, str(tmp_path_factory.mktemp("ref") / "server.log"))
    try:
        return completions(srv.url)
    finally:
        srv.stop()


def fails_fast(url, within: float) -> dict:
    """A completion fails with 503 and an OpenAI error body within `within` seconds; returns the error."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=3 * TIMEOUT)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert time.monotonic() - t0 < within
    assert err.value.status_code == 503
    body = err.value.response.json()["error"]
    assert body["code"] == "engine_unavailable" and "multi-host" in body["message"], body
    assert httpx.get(url + "/health", timeout=5).status_code == 503
    return body


def test_same_completions_then_stuck_follower_times_out(model_dir, compile_cache, reference, tmp_path):
    job = Job(model_dir, compile_cache, tmp_path)
    try:
        job.wait_ready()
        got = completions(job.url)
        assert got == reference and any(got)
        assert "follows process 0" in job.output(1)
        job.procs[1].send_signal(signal.SIGSTOP)  # alive but silent: the step's collective never completes
        body = fails_fast(job.url, within=TIMEOUT + 10)
        assert "did not finish within distributed_timeout" in body["message"]
    finally:
        job.kill()


def test_speculative_decoding(model_dir, compile_cache, reference, tmp_path):
    """n-gram speculation on both processes: the single-process completions, with steps that verified
    proposals (the follower builds the per-position inputs the leader left on the device)."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    job = Job(model_dir, compile_cache, tmp_path, extra=["--speculative-config", spec])
    try:
        job.wait_ready()
        assert completions(job.url) == reference
        text = httpx.get(job.url + "/metrics").text
        drafts = [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                  if ln.startswith("jaxpaged:spec_decode_num_drafts_total")]
        assert drafts and sum(drafts) > 0, text[-2000:]
    finally:
        job.kill()


def test_dead_follower_fails_requests_then_sigterm_stops_leader(model_dir, compile_cache, tmp_path):
    job = Job(model_dir, compile_cache, tmp_path)
    try:
        job.wait_ready()
        job.procs[1].kill()
        job.procs[1].wait()
        fails_fast(job.url, within=TIMEOUT + 10)
        job.procs[0].send_signal(signal.SIGTERM)
        assert job.wait_exit(60)[0] == 0, job.output(0)
    finally:
        job.kill()


def test_sigterm_to_leader_stops_both(model_dir, compile_cache, tmp_path):
    job = Job(model_dir, compile_cache, tmp_path)
    try:
        job.wait_ready()
        job.procs[0].send_signal(signal.SIGTERM)
        codes = job.wait_exit(60)
        assert codes == [0, 0], (codes, job.output(0), job.output(1))
        assert "the leader stopped" in job.output(1)
    finally:
        job.kill()


def test_differing_flags_stop_both_with_a_clear_error(model_dir, compile_cache, tmp_path):
    job = Job(model_dir, compile_cache, tmp_path, follower_extra=("--max-num-seqs", "8", "--block-size", "8"))
    try:
        codes = job.wait_exit(120)
        assert all(c not in (None, 0) for c in codes), codes
        for i in range(2):
            out = job.output(i)
            assert "settings differ between the processes" in out and "max_num_seqs" in out \
                and "block_size" in out, out
    finally:
        job.kill()


def test_generate_on_two_processes(model_dir, reference, tmp_path):
    """`jaxpaged generate` with the multi-host flags: the leader prints the single-process completions,
    the follower prints nothing, both exit 0."""
    env = {**subprocess_env(2), "PYTHONPATH": ROOT}
    argv = [sys.executable, "-m", "jaxpaged.cli", "generate", "--model", model_dir, "--dtype", "float32",
            "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
            "--max-tokens", "10", "--tensor-parallel-size", "4", "--coordinator-address",
            f"127.0.0.1:{free_port()}", "--num-processes", "2", *sum((["--prompt", p] for p in PROMPTS[:2]), [])]
    procs = [subprocess.Popen([*argv, "--process-id", str(i)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=open(tmp_path / f"process{i}.log", "w"), text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], (tmp_path / "process1.log").read_text()[-3000:]
    printed = [_without_gloo(out) for out in outs]
    assert printed == [reference[:2], []]


GLOO_PIECES = re.compile(r"\[Gloo\] Rank | is connected to | peer ranks\. "
                         r"|Expected number of connected peer ranks is : ")


def _without_gloo(out: str) -> list[str]:
    """stdout's lines less gloo's own "[Gloo] Rank r is connected to n peer ranks. Expected number of connected
    peer ranks is : n" messages. Two threads of a process print them at once, piece by piece, so their pieces
    interleave in any order: cut every fixed piece, then drop the lines left holding only the numbers."""
    lines = GLOO_PIECES.sub("", out).splitlines()
    return [ln for ln in lines if ln.strip() and not ln.strip().isdigit()]
