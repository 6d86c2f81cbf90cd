"""Tokenizer wrapper, incremental detokenizer, stop strings (host only)."""
from __future__ import annotations

import json
import os

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class Tokenizer:
    """A Hugging Face tokenizer from a model directory, or None-like when the directory has none."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.eos_token_id = hf_tokenizer.eos_token_id

    @classmethod
    def from_dir(cls, model_dir: str) -> "Tokenizer | None":
        if not any(os.path.isfile(os.path.join(model_dir, f)) for f in _TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer
        try:
            return cls(AutoTokenizer.from_pretrained(model_dir))
        except Exception as e:  # transformers raises many kinds; name the directory
            raise ValueError(f"{model_dir}: cannot load the tokenizer ({type(e).__name__}: {e})") from None

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                          tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def convert_ids_to_tokens(self, ids):
        return self.hf.convert_ids_to_tokens(ids)


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
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-6:])  # a little context so word-initial spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.skip = skip_special_tokens
        self.max_stop = max((len(s) for s in stop), default=0)

    def add(self, token_id: int) -> bool:
        """Append one token; return True if a stop string now ends the text."""
        if self.tok is None:
            return False
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            start = max(0, len(self.text) - self.max_stop + 1)
            self.text += new
            if self.stop:
                hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    self.text = self.text[:min(hits)]
                    return True
        return False

    def visible_text(self, finished: bool) -> str:
        """The text safe to show: while running, hold back a tail that could begin a stop string."""
        if finished or not self.stop:
            return self.text
        return self.text[:max(0, len(self.text) - self.max_stop + 1)]
