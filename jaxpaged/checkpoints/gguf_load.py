"""A GGUF file as an engine model: `LLM(model="x.gguf")`, `jaxpaged serve --model x.gguf`.

`gguf_model_dir` gives the file a small directory beside it in the cache (config.json, the tokenizer, and
`gguf_source.json` naming the file), made once per file (path, size, modification time): the engine reads
the config and tokenizer there as from any model directory, and `load_gguf_params` reads the weights from
the GGUF itself, one tensor at a time.

keep_quantized: the matrices (layers, MoE experts, the embedding and so a tied lm_head, an untied lm_head)
whose GGUF type maps onto the engine's quantized format (jaxpaged/checkpoints/gguf_quant.py) stay quantized,
as `QArray`s made from their codes, exactly; a matrix that mixes types over its layers (Q4_K_M's Q4_K and
Q6_K) takes one form all its types fit (`leaf_form`). F32 / F16 / BF16 tensors, types without a mapping,
norms and routers are dequantized into the engine dtype.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from jaxpaged.checkpoints.gguf_quant import GGUF_QUANT_TYPES, GGUFCodes
from jaxpaged.checkpoints.weights import NP_DTYPES, empty_params, expected_hf_names, map_named_tensors
from jaxpaged.config import ModelConfig, default_cache_dir
from jaxpaged.models.qarray import QArray

SOURCE_FILE = "gguf_source.json"
_PACKED_LEAVES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "embed")
_TOP = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head"}


def is_gguf_file(path: str) -> bool:
    """Whether `path` is a file that starts with the GGUF magic."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_model_dir(path: str, cache_dir: str | None = None) -> str:
    """The model directory of GGUF file `path` (config.json, tokenizer files, gguf_source.json), made once
    under `cache_dir` (default: `default_cache_dir()/gguf`); ValueError naming the file when it is not a
    GGUF the engine runs."""
    from jaxpaged.checkpoints.gguf import GGUFModel
    path = os.path.abspath(path)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    base = os.path.splitext(os.path.basename(path))[0]
    out = os.path.join(cache_dir or os.path.join(default_cache_dir(), "gguf"), f"{base}-{key}")
    if os.path.isfile(os.path.join(out, SOURCE_FILE)):
        return out
    g = GGUFModel(path)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=os.path.dirname(out))
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(g.config, f, indent=2)
        g.tokenizer().save_pretrained(tmp, save_jinja_files=False)
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:  # written last: marks the directory complete
            json.dump({"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}, f)
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(out, SOURCE_FILE)):  # not a concurrent maker that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_source(model_dir: str) -> str | None:
    """The GGUF file a `gguf_model_dir` directory stands for (None for any other directory)."""
    f = os.path.join(model_dir, SOURCE_FILE)
    if not os.path.isfile(f):
        return None
    with open(f) as fh:
        return json.load(fh)["path"]


def load_gguf_params(path: str, cfg: ModelConfig, dtype: str, keep_quantized: bool = True, progress=None) -> dict:
    """The numpy parameter pytree of GGUF file `path`, float leaves in `dtype`; with keep_quantized its
    quantized matrices as QArrays (see the module docstring)."""
    from jaxpaged.checkpoints.gguf import GGUFModel
    g = GGUFModel(path)
    np_dtype = NP_DTYPES[dtype]
    plans = _plans(g, cfg) if keep_quantized else {}
    out = empty_params(cfg, dtype)
    codes = {}  # leaf -> (u uint8 [.., K, N], s, m) being filled, made QArrays at the end
    for key, (group, bits, zero, has_m) in plans.items():
        tree, name = _leaf_home(out, key)
        shape = tree[name].shape[::-1] if key == "embed" else tree[name].shape  # codes: W [in, out]
        gshape = (*shape[:-2], -(-shape[-2] // group), shape[-1])
        codes[key] = (np.empty(shape, np.uint8), np.empty(gshape, np.float32),
                      np.empty(gshape, np.float32) if has_m else None)
        tree[name] = None  # the float leaf is not needed
    seen = set()

    def floats():  # the float tensors, for map_named_tensors; the codes of the kept leaves stored on the way
        for hf, t in g.raw_tensors(keep_quantized=bool(plans)):
            dests = _destinations(cfg, hf)
            if isinstance(t, GGUFCodes) and dests[0][0] in plans:
                for key, where, cols in dests:
                    store_codes(codes[key], plans[key], where, t, cols, hf, path)
                seen.add(hf)
                if progress is not None:
                    progress.update(1)
            else:
                yield hf, t.dequantize().T if isinstance(t, GGUFCodes) else t
    for name, parts in map_named_tensors(cfg, floats(), path):
        for in_layers, key, where, part in parts:
            tree = out["layers"] if in_layers else out
            if where:
                tree[key][where] = part.astype(np_dtype)
            else:
                tree[key] = part.astype(np_dtype)
        seen.add(name)
        if progress is not None:
            progress.update(1)
    missing = [n for n in expected_hf_names(cfg) if n not in seen]
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for key, (group, bits, zero, _) in plans.items():
        u, s, m = codes.pop(key)
        tree, name = _leaf_home(out, key)
        a = QArray.from_codes(u, s, m, zero=zero, group=group, bits=bits, dtype=dtype)
        if key == "embed":  # [V, D], groups along D: the codes of W [D, V] transposed
            a = QArray(a.q.T.copy(), a.scale.T.copy(), dtype, None if a.m is None else a.m.T.copy(), group, bits, zero)
        tree[name] = a
    return out


def _leaf_home(params: dict, key: str) -> tuple[dict, str]:
    return (params, key) if key in ("lm_head", "embed") else (params["layers"], key)


def _destinations(cfg: ModelConfig, hf: str) -> list[tuple[str, tuple, tuple[int, int] | None]]:
    """HF name -> [(leaf, index, columns of the codes or None)] (Phi-3's fused rows are columns of W)."""
    from jaxpaged.checkpoints.weights import _EXPERT_NAMES, layer_name_map
    if hf in _TOP:
        return [(_TOP[hf], (), None)]
    if not hf.startswith("model.layers."):
        return [(None, (), None)]
    i, rest = hf[len("model.layers."):].split(".", 1)
    if ".experts." in rest:
        e, matrix = rest.split(".experts.")[1].split(".", 1)
        return [(_EXPERT_NAMES.get(matrix), (int(i), int(e)), None)]
    return [(key, (int(i),), rows) for key, _, rows in layer_name_map(cfg).get(rest, [(None, False, None)])]


def _plans(g, cfg: ModelConfig) -> dict[str, tuple[int, int, int, bool]]:
    """leaf -> (group, bits, zero, has_m) for the leaves kept quantized: every tensor feeding it of a type
    with a mapping; one form for all of them."""
    types: dict[str, set[str]] = {}
    for t in g.reader.tensors:
        for key, _, _ in _destinations(cfg, g.hf_name(t.name).format(0)):
            if key in _PACKED_LEAVES:
                types.setdefault(key, set()).add(t.tensor_type.name)
    return {key: leaf_form(ts) for key, ts in types.items()
            if ts <= set(GGUF_QUANT_TYPES) and not (key == "lm_head" and cfg.tie_word_embeddings)}


def leaf_form(types: set[str]) -> tuple[int, int, int, bool]:
    """(group, bits, zero, has_m): the one quantized form every GGUF type in `types` fits exactly (a zero
    folded into a minimum, -z * s, is within float rounding): the finest group; a minimum where any type
    has one (zero 0); otherwise the types' zero, or 8-bit codes around 128 where the zeros differ."""
    forms = [(_GROUP[t], _BITS[t], _ZERO.get(t, 0), t in _WITH_MIN) for t in types]
    has_m = any(f[3] for f in forms)
    zeros = {f[2] for f in forms}
    bits = max(f[1] for f in forms)
    if has_m:
        zero = 0
    elif len(zeros) == 1:
        zero = zeros.pop()
    else:
        zero, bits = 128, 8
    return min(f[0] for f in forms), bits, zero, has_m


_GROUP = {t: v[2] for t, v in GGUF_QUANT_TYPES.items()}
_BITS = {t: v[3] for t, v in GGUF_QUANT_TYPES.items()}
_ZERO = {"Q8_0": 128, "Q4_0": 8, "Q5_0": 16, "Q6_K": 32}
_WITH_MIN = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")


def store_codes(dst, plan, where: tuple, c: GGUFCodes, cols, hf: str, path: str) -> None:
    """One tensor's codes into the leaf's arrays at `where`, in the leaf's form `plan`."""
    u_all, s_all, m_all = dst
    group, _, zero, has_m = plan
    u, s = c.u, c.s
    if cols is not None:
        u, s = u[:, cols[0]:cols[1]], s[:, cols[0]:cols[1]]
    m = None if c.m is None else (c.m if cols is None else c.m[:, cols[0]:cols[1]])
    if u.shape != u_all.shape[len(where):]:
        raise ValueError(f"{path}: tensor {hf!r} has shape {u.shape[::-1]}, expected {u_all.shape[len(where):][::-1]}")
    reps = c.group // group
    s = np.repeat(s, reps, axis=0) if reps > 1 else s
    if has_m:
        m = np.repeat(m, reps, axis=0) if m is not None and reps > 1 else m
        m_all[where] = m if m is not None else -np.float32(c.zero) * s  # the zero folded into a minimum
    elif zero != c.zero:
        u = (u.astype(np.int16) - c.zero + zero).astype(np.uint8)
    u_all[where] = u
    s_all[where] = s
