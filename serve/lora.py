"""LoRA adapters over HTTP: the request's `model` picks an adapter by name, /v1/models lists them with
`parent` = the base, and (with --enable-runtime-lora-updating) POST /v1/load_lora_adapter and
/v1/unload_lora_adapter ({"lora_name", "lora_path"}) change them while the server runs."""
from __future__ import annotations

import itertools
import json
import os

from starlette.requests import Request
from starlette.responses import PlainTextResponse

from jaxpaged.lora.request import LoRARequest
from serve.errors import APIError


class Adapters:
    """The server's adapters by name (lora_int_ids handed out in order)."""

    def __init__(self):
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def new(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(name, next(self._ids), path)


def parse_modules(specs: list[str] | None, base_model_name: str) -> list[tuple[str, str]]:
    """--lora-modules specs -> [(name, path)]; each NAME=PATH or vLLM's JSON form
    `{"name": N, "path": P, "base_model_name": B}` (B optional: the one served model's name, `base_model_name`).
    ValueError naming a malformed one."""
    out = []
    for spec in specs or []:
        if spec.lstrip().startswith("{"):
            out.append(_json_module(spec, base_model_name))
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {spec!r} is not NAME=PATH or a JSON object")
        out.append((name, path))
    return out


def _json_module(spec: str, base_model_name: str) -> tuple[str, str]:
    try:
        d = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--lora-modules: {spec!r} is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(d, dict):
        raise ValueError(f"--lora-modules: {spec!r} must be a JSON object")
    unknown = sorted(set(d) - {"name", "path", "base_model_name"})
    if unknown:
        raise ValueError(f"--lora-modules: {spec!r}: unknown keys {unknown} (name, path, base_model_name)")
    for key in ("name", "path"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise ValueError(f"--lora-modules: {spec!r}: {key!r} must be a non-empty string")
    base = d.get("base_model_name")
    if base is not None and base != base_model_name:
        raise ValueError(f"--lora-modules: {d['name']!r}: base_model_name {base!r} is not the served model "
                         f"{base_model_name!r} (one base model is served)")
    return d["name"], d["path"]


def resolve(st, model: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base model); unknown names are a 404."""
    if model is None or model == st.model_name:
        return None
    lora = st.adapters.by_name.get(model) if st.adapters is not None else None
    if lora is None:
        served = [st.model_name] + (sorted(st.adapters.by_name) if st.adapters is not None else [])
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", param="model",
                       code="model_not_found")
    return lora


async def _body(request: Request) -> tuple[str, str | None, bool]:
    """(lora_name, lora_path or None, load_inplace) of a load / unload body; a 400 naming a bad field."""
    try:
        data = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    name = data.get("lora_name") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name:
        raise APIError(400, "lora_name (a non-empty string) is required", param="lora_name")
    path, inplace = data.get("lora_path"), data.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise APIError(400, f"load_inplace must be a boolean, got {inplace!r}", param="load_inplace")
    return name, path if isinstance(path, str) else None, inplace


async def load(request: Request) -> PlainTextResponse:
    """POST /v1/load_lora_adapter (auth checked by the route); answers as vLLM's: the text
    `Success: LoRA adapter 'NAME' added successfully.`, 404 for a lora_path that does not exist, 400 for a
    name in use (unless `load_inplace`: the new adapter then replaces it, 400 while requests still use the
    old one) or an adapter the loader refuses (its message)."""
    st = request.app.state.server
    name, path, inplace = await _body(request)
    if path is None:
        raise APIError(400, "lora_path (a PEFT adapter directory) is required", param="lora_path")
    old = st.adapters.by_name.get(name)
    if (old is not None and not inplace) or name == st.model_name:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    if not os.path.exists(path):
        raise APIError(404, f"No adapter found for {path}", param="lora_path", code="adapter_not_found")
    lora = st.adapters.new(name, path)

    def swap(eng) -> None:  # on the engine thread, between steps: no request sees the name unserved
        if old is not None:
            try:
                eng.controls.remove_lora(old.lora_int_id)
            except ValueError as e:  # requests still use the old adapter
                raise APIError(400, str(e), param="lora_name") from None
        eng.controls.add_lora(lora)  # refused: the name keeps the old adapter (a request registers it again)
    try:
        await st.engine.call(swap)
    except ValueError as e:
        raise APIError(400, str(e), param="lora_path") from None
    st.adapters.by_name[name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload(request: Request) -> PlainTextResponse:
    """POST /v1/unload_lora_adapter (auth checked by the route): `Success: LoRA adapter 'NAME' removed
    successfully.`; 404 for a name not loaded, 400 while requests still use it."""
    st = request.app.state.server
    name, _, _ = await _body(request)
    lora = st.adapters.by_name.get(name)
    if lora is None:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                       code="model_not_found")
    try:
        await st.engine.call(lambda eng: eng.controls.remove_lora(lora.lora_int_id))
    except ValueError as e:  # requests still use it
        raise APIError(400, str(e), param="lora_name") from None
    del st.adapters.by_name[name]
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
