"""Prompts given as embeddings: the runner's feature that feeds them to the step (core/prompt_embeds.py).

In the runner's features only with `enable_prompt_embeds` (an engine without the flag compiles and runs
the step as it would without this file). With it, every step takes two more inputs:

- from_embeds bool[T] (in the packed buffer): the token rows whose input is a given embedding;
- prompt_embeds f32[E, D] (beside it, E = the largest bucket): those rows' embeddings, at the rows' own
  indices (row i of the step reads row i of it).

A step scheduling no prompt position of such a request (every decode step, every step while no such
request is admitted) sends all-false rows and the zeros that stay on the device: no copy of [E, D], no
extra compilation (one per bucket, as without the flag). The decoder puts the rows in place of the token
lookup's output (before Gemma 2's embedding scale, after Gemma 3's), so an embedding equal to a token's
(scaled, on Gemma 3) row of the table gives exactly that token's computation;
the tokens generated after the prompt take the ordinary lookup.

Measured on the compiled step of a tiny Llama (bucket 16): without the flag its HLO is the one of the tree
before this feature, byte for byte but source locations; with it, a [T, D] select more (+1040 flops).
The price of the flag is the [E, D] float32 array held on the device (SmolLM2-135M at the default budget:
512 x 576 x 4 bytes = 1.2 MB) and, in a step that feeds embeddings, its copy to the device.
"""
from __future__ import annotations

import numpy as np

from jaxpaged.step.features import StepFeature


class PromptEmbeds(StepFeature):
    def __init__(self, max_tokens: int, hidden_size: int, place):
        self.shape = (max_tokens, hidden_size)  # [E, D]
        self.placeholders = dict(prompt_embeds=place(np.zeros(self.shape, np.float32)))  # on the device
        self.requests: set = set()  # admitted requests with embeddings, until they finish

    def track(self, req) -> None:
        if req.prompt_embeds is not None:
            self.requests.add(req)

    def inputs(self, out, slots, T, batch, sp):
        use = batch["from_embeds"] = np.zeros(T, np.bool_)  # [T]
        sp["prompt_embeds"] = self.placeholders["prompt_embeds"]
        if not self.requests:
            return None
        self.requests = {r for r in self.requests if not r.is_finished}
        values, row = None, 0
        for req, n in out.scheduled:
            c, e = req.num_computed_tokens, req.prompt_embeds  # e: f32[P, D]
            m = min(c + n, 0 if e is None else len(e)) - c  # prompt positions of this chunk
            if m > 0:
                if values is None:  # a fresh buffer: the previous step's may still be on its way
                    values = sp["prompt_embeds"] = np.zeros(self.shape, np.float32)
                values[row:row + m] = e[c:c + m]
                use[row:row + m] = True
            row += n
        return None

    def decoder_args(self, batch: dict, sp: dict) -> dict:
        T = batch["input_ids"].shape[0]
        return dict(prompt_embeds=(batch["from_embeds"], sp["prompt_embeds"][:T]))  # bool[T], f32[T, D]
