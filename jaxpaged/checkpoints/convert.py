"""Hugging Face directory or GGUF file -> the engine's format (config.json, tokenizer files, params/).

Written into a temporary directory beside DST and renamed onto DST at the end, so DST is either
absent, the old contents (without force), or complete: never half written. Tensors are converted
one at a time into the stacked parameter pytree, so peak memory stays near the output size.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile

from jaxpaged.checkpoints.weights import (
    NP_DTYPES,
    count_tensors,
    params_from_named_tensors,
    read_safetensors,
    safetensors_files,
    save_orbax_params,
)
from jaxpaged.config import ModelConfig
from jaxpaged.models.quant import check_quantization

# Files of a HF directory that travel with the weights (whichever exist).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "generation_config.json")


def convert(src: str, dst: str, dtype: str = "bfloat16", force: bool = False, progress: bool = True,
            quantization: str | None = None, torch_dtype: str | None = None, keep_quantized: bool = True) -> str:
    """Convert SRC (HF model directory or .gguf file) into DST in the engine's format; return DST.

    quantization: None, or "int8" / "int4" / "fp8": the matrices are quantized one tensor at a time and DST
    holds the quantized pytree (jaxpaged/models/quant.py), which loads without a float copy of the model.
    keep_quantized (a GGUF SRC without quantization): its quantized matrices are kept as the engine's
    quantized matrices, exactly (codes, scales, minimums: jaxpaged/checkpoints/gguf_load.py), and the engine
    loads DST with them packed; otherwise GGUF tensors are dequantized one at a time (then quantized to
    `quantization` where given). `dtype` sets the float tensors.

    Raises ValueError, naming the file, for a missing or unreadable SRC, an unsupported architecture
    or GGUF tensor type, a non-empty DST without `force`, or a full disk.

    torch_dtype: the dtype the checkpoint was published in, recorded in DST's config.json where SRC does not
    say (a GGUF file); `dtype="auto"` follows it.
    """
    if dtype not in NP_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(NP_DTYPES)}, got {dtype!r}")
    check_quantization(quantization)
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    if not os.path.exists(src):
        raise ValueError(f"{src}: no such file or directory")
    if os.path.exists(dst) and not (os.path.isdir(dst) and not os.listdir(dst)):
        if not force:
            raise ValueError(f"{dst}: exists and is not empty; pass force=True (--force) to replace it")
        if src == dst or src.startswith(dst + os.sep):
            raise ValueError(f"{dst}: is (or contains) the source; choose another destination")
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; DST gets the usual mode
        if os.path.isdir(src):
            _convert_hf(src, tmp, dtype, progress, quantization)
        elif src.endswith(".gguf") or _has_gguf_magic(src):
            _convert_gguf(src, tmp, dtype, progress, quantization, torch_dtype, keep_quantized)
        else:
            raise ValueError(f"{src}: not a model (expected a Hugging Face model directory or a .gguf file)")
        _replace_dir(tmp, dst)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _is_disk_full(e):
            raise ValueError(f"{dst}: disk full while writing the converted model (nothing was left "
                             f"behind; free space on {parent} and retry)") from None
        raise
    return dst


def _convert_hf(src: str, out: str, dtype: str, progress: bool, quantization: str | None) -> None:
    cfg_file = os.path.join(src, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{src}: not a model (no config.json; expected a Hugging Face model directory "
                         f"or a .gguf file)")
    try:
        with open(cfg_file) as f:
            cfg_dict = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file}: cannot read config ({e})") from None
    cfg = ModelConfig.from_hf_dict(cfg_dict, source=cfg_file)
    files = safetensors_files(src)

    def tensors():
        for p in files:
            yield from read_safetensors(p)
    _write(out, cfg, tensors(), dtype, src, progress, quantization)
    shutil.copy2(cfg_file, os.path.join(out, "config.json"))
    copied = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src, f))]
    for f in copied:
        shutil.copy2(os.path.join(src, f), os.path.join(out, f))
    if not any(f in copied for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        print(f"warning: {src} has no tokenizer files; the converted model will take token ids only",
              file=sys.stderr)


def _convert_gguf(src: str, out: str, dtype: str, progress: bool, quantization: str | None,
                  torch_dtype: str | None = None, keep_quantized: bool = True) -> None:
    from jaxpaged.checkpoints.gguf import GGUFModel
    from jaxpaged.checkpoints.gguf_load import load_gguf_params
    g = GGUFModel(src)
    cfg = ModelConfig.from_hf_dict(g.config, source=src)
    tok = g.tokenizer()
    if keep_quantized and quantization is None:
        with _bar(cfg, progress, "converting (quantized matrices kept)") as bar:
            params = load_gguf_params(src, cfg, dtype, keep_quantized=True, progress=bar)
        save_orbax_params(params, out)
    else:
        _write(out, cfg, g.tensors(), dtype, src, progress, quantization)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({**g.config, **({"torch_dtype": torch_dtype} if torch_dtype else {})}, f, indent=2)
    tok.save_pretrained(out, save_jinja_files=False)  # chat template inside tokenizer_config.json


def _write(out, cfg, tensors, dtype, source, progress, quantization=None) -> None:
    """Fill the parameter pytree from (HF name, array) pairs, one at a time, and save it under OUT."""
    with _bar(cfg, progress, f"converting to {quantization or dtype}") as bar:
        params = params_from_named_tensors(cfg, tensors, dtype, source=source, progress=bar,
                                           quantization=quantization)
    save_orbax_params(params, out)


def _bar(cfg, progress: bool, desc: str):
    """A progress bar over the model's tensors on stderr (disabled without `progress`)."""
    from tqdm.auto import tqdm
    return tqdm(total=count_tensors(cfg), desc=desc, unit="tensor", file=sys.stderr, disable=not progress)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from None


def _replace_dir(tmp: str, dst: str) -> None:
    """Rename the finished TMP onto DST; an old DST (force) is moved aside first and removed after."""
    if not os.path.exists(dst):
        os.rename(tmp, dst)
        return
    if os.path.isdir(dst) and not os.listdir(dst):
        os.rmdir(dst)
        os.rename(tmp, dst)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
    os.rename(dst, os.path.join(old, "x"))
    os.rename(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def _is_disk_full(e: BaseException | None) -> bool:
    """Whether e, or an exception it was raised from or during, is ENOSPC (orbax wraps errors)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False
