"""Tokenizer wrapper, incremental detokenizer, stop strings (host only)."""
from __future__ import annotations

import functools
import json
import os

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt")  # the template variables a render call sets itself


class Tokenizer:
    """A model directory's `tokenizer.json` (through the `tokenizers` library) and its chat template.

    Behaves like transformers' fast tokenizer for what the engine needs — encode with special tokens,
    decode, the chat template rendered the way transformers renders it — without importing
    transformers (and torch) at start-up, which costs seconds.
    """

    def __init__(self, backend, config: dict, source: str):
        self.backend, self.source = backend, source
        self.special = {}
        for name in _SPECIAL:
            v = config.get(name)
            self.special[name] = v.get("content") if isinstance(v, dict) else v
        eos = self.special["eos_token"]
        self.eos_token_id = backend.token_to_id(eos) if eos else None
        self.chat_template = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take the default
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default")
        self.cleanup = bool(config.get("clean_up_tokenization_spaces", False))
        # the class tokenizer_config.json names (the one transformers' AutoTokenizer loads), as vLLM's /tokenizer_info
        self.tokenizer_class = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
        self._template = None
        self._short: dict[tuple, str] = {}  # decodes of 1-2 token windows: the detokenizer's usual case
        self._steps: dict[tuple, str | None] = {}  # (skip, a, b) -> text b adds after a (see `step_text`)

    @classmethod
    def from_dir(cls, model_dir: str) -> "Tokenizer | None":
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            return None
        from tokenizers import Tokenizer as Backend
        try:
            backend = Backend.from_file(path)
            cfg_path = os.path.join(model_dir, "tokenizer_config.json")
            config = {}
            if os.path.isfile(cfg_path):
                with open(cfg_path) as f:
                    config = json.load(f)
            tpl = os.path.join(model_dir, "chat_template.jinja")
            if os.path.isfile(tpl):
                with open(tpl) as f:
                    config["chat_template"] = f.read()
        except Exception as e:  # tokenizers raises plain Exceptions; name the file
            raise ValueError(f"{model_dir}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
        return cls(backend, config, model_dir)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.cleanup else text

    def decode_window(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`decode`, remembered for windows of 1 or 2 tokens (a pure function: same ids, same text)."""
        if len(ids) > 2:
            return self.decode(ids, skip_special_tokens)
        key = (skip_special_tokens, *ids)
        text = self._short.get(key)
        if text is None:
            if len(self._short) >= 1 << 18:
                self._short.clear()
            text = self._short[key] = self.decode(ids, skip_special_tokens)
        return text

    def step_text(self, prev: int, token: int, skip_special_tokens: bool = True) -> str | None:
        """The text `token` adds after `prev` (decode([prev, token]) past decode([prev])), or None if it
        adds nothing yet (nothing, or an incomplete character). Remembered: a pure function of its ids,
        and the incremental detokenizer's usual step."""
        key = (skip_special_tokens, prev, token)
        try:
            return self._steps[key]
        except KeyError:
            pass
        new = _text_past(self.decode_window([prev], skip_special_tokens),
                         self.decode_window([prev, token], skip_special_tokens))
        if len(self._steps) >= 1 << 18:
            self._steps.clear()
        self._steps[key] = new
        return new

    def convert_ids_to_tokens(self, ids):
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """Render the conversation (and `tools`, for templates that use them) with the chat template and
        tokenize it (no extra special tokens)."""
        return self.encode(self.render_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False)

    def render_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                             tools: list[dict] | None = None, continue_final_message: bool = False,
                             template_kwargs: dict | None = None) -> str:
        """The conversation rendered with the chat template, as text (not tokenized). `continue_final_message`:
        the text ends with the last message's content (stripped), what the template puts after it cut off, so
        the model continues that message (as transformers' apply_chat_template). `template_kwargs`: further
        template variables (e.g. Qwen3's `enable_thinking`), over the special tokens' but never one of
        TEMPLATE_OWN (ValueError naming it)."""
        own = sorted(set(template_kwargs or ()) & set(TEMPLATE_OWN))
        if own:
            raise ValueError(f"template variables {', '.join(own)} are set by the call itself, not template_kwargs")
        if not self.chat_template:
            raise ValueError(f"{self.source}: the tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     **{**self.special, **(template_kwargs or {})})
        if continue_final_message:
            final = str(messages[-1].get("content") or "").strip() if messages else ""
            at = text.rfind(final)
            if at < 0:
                raise ValueError("continue_final_message: the last message's content does not appear in the "
                                 "rendered conversation")
            text = text[:at + len(final)]
        return text

    @functools.cached_property
    def max_bytes_per_token(self) -> int | None:
        """The most UTF-8 bytes of text one token can stand for, or None where no sound bound is known.

        Sound for BPE with no normalizer and pre-tokenizers that keep every character (ByteLevel, Metaspace,
        Digits, Punctuation, Split not removing): each token then stands for at most its vocabulary string's
        UTF-8 bytes (a byte-level or metaspace string encodes to at least the bytes it stands for), an
        unknown token for one character (<= 4 bytes). A text of B bytes therefore has >= B / this tokens."""
        spec = json.loads(self.backend.to_str())
        if spec["model"].get("type") != "BPE" or spec.get("normalizer") is not None:
            return None
        if not _keeps_text(spec.get("pre_tokenizer")):
            return None
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max(4, max((len(t.encode("utf-8")) for t in vocab), default=0))


def _keeps_text(pre: dict | None) -> bool:
    """Whether a tokenizer.json pre-tokenizer keeps every character of the text in some piece."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", ()))
    if kind == "Split":
        return pre.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "Punctuation")


def _compile_template(source: str):
    """Jinja as transformers configures it for chat templates (sandboxed, trimmed blocks)."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def _text_past(prefix: str, full: str) -> str | None:
    """What `full` (a window's text) adds past `prefix` (its first tokens' text); None while that is
    nothing or ends in an incomplete character (U+FFFD waiting for its next byte-token)."""
    return full[len(prefix):] if len(full) > len(prefix) and not full.endswith("\ufffd") else None


def _clean_up(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def generation_eos_ids(model_dir: str) -> set[int]:
    """EOS ids from generation_config.json (models often list more than config.json does)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return set()
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return set()
    return set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))


class IncrementalDetokenizer:
    """Text of a growing token sequence, decoded a few tokens at a time.

    Decodes a window of recent tokens and emits only the part past the previous window, and never a
    trailing U+FFFD (an incomplete multi-byte character waits for its next byte-token). Stop strings
    are searched in the new text; a match truncates the text before the stop string.

    It follows a request's token list (prompt + output) and may fall behind it: `catch_up` feeds it the
    tokens it has not seen, one at a time, so the text is the same whenever it is asked for (the engine
    catches up every step only requests that stream or have stop strings).
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, context: bool = True):
        self.tok = tokenizer
        # a little context so word-initial spaces decode right (none: placeholder ids of prompt embeddings)
        self.ids = list(prompt_ids[-6:]) if context else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self._reach = [(s, len(s) - 1) for s in stop]  # a new match starts at most len - 1 chars back
        self.skip = skip_special_tokens
        self.max_stop = max((len(s) for s in stop), default=0)
        self.next = len(prompt_ids)  # index of the next token to decode in the followed token list

    def add(self, token_id: int) -> bool:
        """Append one token; return True if a stop string now ends the text."""
        self.next += 1
        return self.tok is not None and self._add(token_id)

    def catch_up(self, token_ids: list[int], end: int | None = None) -> bool:
        """Add the tokens of `token_ids` (the followed prompt + output) not seen yet, up to the first not
        read back yet (negative; usually there is one new token) or index `end`; return True if a stop
        string now ends the text. (The library's decode_batch was measured slower than this, one window at
        a time.)"""
        hit, n = False, len(token_ids) if end is None else end
        while self.next < n and not hit and token_ids[self.next] >= 0:
            hit = self.add(token_ids[self.next])
        return hit

    def _add(self, token_id: int) -> bool:
        ids, tok, skip = self.ids, self.tok, self.skip
        ids.append(token_id)
        p, r = self.prefix_offset, self.read_offset
        if r - p == 1 and len(ids) - r == 1:  # the usual window: the last token shown, then this one
            new = tok.step_text(ids[p], token_id, skip)
        else:
            new = _text_past(tok.decode_window(ids[p:r], skip), tok.decode_window(ids[p:], skip))
        if new is None:
            return False
        self.prefix_offset, self.read_offset = r, len(ids)
        if not self.stop:
            self.text += new
            return False
        # each string is searched only where a match of it would end in the new text (one window as long
        # as the longest string let text crafted against the shorter ones cost 24x more at the bound)
        n = len(self.text)
        self.text += new
        find = self.text.find
        hits = [i for s, k in self._reach if (i := find(s, n - k if n > k else 0)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False

    def visible_text(self, finished: bool) -> str:
        """The text safe to show: while running, hold back a tail that could begin a stop string."""
        if finished or not self.stop:
            return self.text
        return self.text[:max(0, len(self.text) - self.max_stop + 1)]
