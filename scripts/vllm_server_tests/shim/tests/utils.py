"""vLLM's test helper `RemoteOpenAIServer`, starting `jaxpaged serve` in place of `vllm serve`.

It stands for vLLM's `tests/utils.py` when vLLM's server tests run against jaxpaged
(scripts/vllm_server_tests/README.md). Every model id maps to jaxpaged's default model (or
$JAXPAGED_MODEL_DIR), served under the id the test asks for; vLLM's flags pass through where `jaxpaged serve`
has a flag of the same name, the others are dropped (with their value) and listed on stderr.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import openai
import requests

ROCM_ENV_OVERRIDES: dict = {}
ROCM_EXTRA_ARGS: list = []
VLLM_PATH = Path(os.environ.get("VLLM_TREE", Path(__file__).resolve().parent.parent))  # vLLM's work tree

PYTHON = os.environ.get("JAXPAGED_PYTHON", "python")  # the interpreter that has jaxpaged's dependencies
ROOT = os.environ.get("JAXPAGED_ROOT", "")  # the jaxpaged checkout (put first on its PYTHONPATH)
MODEL_DIR = os.environ.get("JAXPAGED_MODEL_DIR")  # None: jaxpaged's default model
_CLI = "import sys; from jaxpaged.cli import main; sys.exit(main())"
_FLAGS: dict[str, bool] | None = None  # jaxpaged serve's flags -> whether each takes a value


def _jaxpaged_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("JAXPAGED_PYTHONPATH", "")) if p)
    return env


def jaxpaged_flags() -> dict[str, bool]:
    """`jaxpaged serve --help`'s flags: {"--max-model-len": True (takes a value), "--enable-lora": False, ...}."""
    global _FLAGS
    if _FLAGS is None:
        out = subprocess.run([PYTHON, "-c", _CLI, "serve", "--help"], capture_output=True, text=True,
                             env=_jaxpaged_env(), timeout=300, check=True).stdout
        _FLAGS = {}
        for m in re.finditer(r"(?m)^\s+((?:-\w, )?(--[\w-]+)(?: ([A-Z_{][^\s,]*))?)", out):
            _FLAGS[m.group(2)] = m.group(3) is not None
        for m in re.finditer(r"--\[no-\]([\w-]+)|(--no-[\w-]+)", out):  # BooleanOptionalAction spellings
            _FLAGS[f"--{m.group(1)}" if m.group(1) else m.group(2)] = False
    return _FLAGS


DROPPED = {"--dtype"}  # vLLM's dtype choice is its own: jaxpaged picks the one that suits the machine (auto)


def translate(args: list[str]) -> tuple[list[str], list[str]]:
    """vLLM's `serve` arguments -> (jaxpaged's, the dropped ones)."""
    flags, out, dropped, i = jaxpaged_flags(), [], [], 0
    while i < len(args):
        a = args[i]
        name, inline = (a.split("=", 1) + [None])[:2] if a.startswith("--") else (a, None)
        has_next = inline is None and i + 1 < len(args) and not args[i + 1].startswith("--")
        prefixed = [f for f in flags if f.startswith(name)] if a.startswith("--") else []
        if name not in flags and len(prefixed) == 1:  # argparse's abbreviation (`--lora-module`), in both CLIs
            name = prefixed[0]
        if name in flags and name not in DROPPED:
            if flags[name] and inline is None and has_next:
                out += [name, args[i + 1]]
                i += 2
            else:
                out.append(name if inline is None else f"{name}={inline}")
                i += 1
            continue
        taken = [a] + ([args[i + 1]] if has_next else [])
        dropped += taken
        i += len(taken)
    return out, dropped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteOpenAIServer:
    """`jaxpaged serve` in a subprocess, with vLLM's test helper's interface."""
    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict | None = None, seed: int = 0,
                 auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs: dict | None = None):
        args = list(vllm_serve_args)
        if auto_port:
            args += ["--port", str(_free_port())]
        self.show_hidden_metrics = any(a.startswith("--show-hidden-metrics-for-version") for a in args)
        ours, self.dropped = translate(args)
        self.port = int(ours[ours.index("--port") + 1]) if "--port" in ours else 8000
        self.host = "127.0.0.1"
        if "--served-model-name" not in ours:
            ours += ["--served-model-name", model]
        if "--max-model-len" not in ours:  # vLLM's default is the model's (8192 here): a budget for this CPU
            ours += ["--max-model-len", os.environ.get("JAXPAGED_MAX_MODEL_LEN", "1024")]
        cap = os.environ.get("JAXPAGED_MAX_MODEL_LEN_CAP")  # a test's own length lowered to this (a CPU budget)
        at = ours.index("--max-model-len") + 1
        if cap and int(ours[at]) > int(cap):
            self.dropped += [f"--max-model-len {ours[at]} (capped to {cap})"]
            ours[at] = cap
        if str((env_dict or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() in ("1", "true"):
            ours.append("--enable-runtime-lora-updating")  # vLLM's switch is this environment variable
        model_dir = model if os.path.isdir(model) else MODEL_DIR
        if model_dir and "--model" not in ours:
            ours = ["--model", model_dir] + ours
        env = _jaxpaged_env()
        env.update(env_dict or {})
        self.log = open(os.path.join(os.environ.get("JAXPAGED_LOG_DIR", "."), f"serve-{self.port}.log"), "w")
        print(f"jaxpaged serve {' '.join(ours)}\n(dropped: {json.dumps(self.dropped)})", file=self.log, flush=True)
        self.proc = subprocess.Popen([PYTHON, "-c", _CLI, "serve", *ours], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._wait(max_wait_seconds or 900)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jaxpaged serve exited with {self.proc.returncode} before it was ready")
            try:
                if requests.get(self.url_for("health"), timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"jaxpaged serve was not ready within {timeout} s")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)
