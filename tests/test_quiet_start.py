"""A quiet start (issue #47): on a machine without an accelerator, `jaxpaged generate` writes its progress
and its text, nothing else, though the environment holds JAX's CUDA and TPU plugins (the `test` extra):
the CLI sets JAX_PLATFORMS=cpu before jax is imported (jaxpaged/cli.py select_platform). Its twin, with the
detection off (an accelerator reported), shows the plugins' noise is there to silence."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from jaxpaged.cli import accelerator_present, select_platform
from jaxpaged.testing.tiny_models import add_tiny_tokenizer, make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISE = ("Traceback", "E0000", "Jax plugin configuration error", "WARNING", "libtpu", "cuDNN")
# the variables tests/conftest.py sets to hush the plugins: a newcomer's shell has none of them
HUSH = ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "TPU_SKIP_MDS_QUERY", "TPU_WORKER_HOSTNAMES",
        "TPU_ACCELERATOR_TYPE")
PLUGINS = [m for m in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12", "libtpu")
           if importlib.util.find_spec(m.split(".")[0]) and importlib.util.find_spec(m)]
PROGRESS = re.compile(r"^\[[^]]+\] |^\[\d|^[a-z ]+: +\d+%\|")  # "[prompt] Hi", "[2 tokens in ...]", a progress bar
no_accelerator = pytest.mark.skipif(accelerator_present(), reason="this machine has a GPU or TPU")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_tiny_model(str(tmp_path_factory.mktemp("quiet") / "m"), "llama", vocab_size=300)
    add_tiny_tokenizer(d)
    return d


def generate(model, detection: bool) -> subprocess.CompletedProcess:
    """`jaxpaged generate --prompt Hi --max-tokens 2` in a fresh process with a newcomer's environment;
    without `detection`, the CLI is told an accelerator is present (JAX_PLATFORMS stays unset)."""
    env = {k: v for k, v in os.environ.items() if k not in HUSH} | {"PYTHONPATH": ROOT}
    patch = "" if detection else "c.accelerator_present = lambda: True; "
    code = f"import sys, jaxpaged.cli as c; {patch}sys.exit(c.main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "generate", "--prompt", "Hi", "--max-tokens", "2", "--model", model,
           "--max-model-len", "64", "--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--dtype", "float32"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)


@no_accelerator
def test_generate_writes_progress_and_text_only(model):
    res = generate(model, detection=True)
    assert res.returncode == 0, res.stderr
    lines = [line for line in re.split(r"[\r\n]+", res.stderr) if line.strip()]
    assert lines and all(PROGRESS.match(line) for line in lines), res.stderr
    assert not any(word in res.stderr for word in NOISE), res.stderr
    assert lines[-2] == "[prompt] Hi" and "[2 tokens in" in lines[-1]


@no_accelerator
@pytest.mark.skipif(not PLUGINS, reason="no JAX GPU/TPU plugin installed: nothing to make noise")
def test_without_the_detection_the_plugins_are_loud(model):
    res = generate(model, detection=False)
    assert res.returncode == 0, res.stderr
    assert any(word in res.stderr for word in NOISE), res.stderr


def test_select_platform():
    env = {"JAX_PLATFORMS": "tpu"}
    select_platform(env)
    assert env == {"JAX_PLATFORMS": "tpu"}  # a choice made is kept
    env = {}
    select_platform(env)
    assert env == ({} if accelerator_present() else {"JAX_PLATFORMS": "cpu"})
