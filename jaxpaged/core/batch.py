"""The persistent batch (host, numpy only): the step's slot arrays, kept between steps.

A slot's row — block-table entries, sampling parameters, token history for penalties — is written when
a request joins the slot, and afterwards only where it changed: new blocks at the row's tail, new tokens
at the history's tail. Nothing is rebuilt per step. The per-token arrays of one step (token ids,
positions, slot mapping) are computed with vectorized numpy from one short pass over the scheduled
requests (O(1) each, plus a slice copy of a prefill chunk's tokens).

With async scheduling a decode token may not be known on the host yet (its step is still running):
`prepare` then marks it in `prev_index` (the slot whose previous-step token it is, -1 for known
tokens), and the step reads it from the previous step's device array of sampled tokens.

Block-table rows are exact for every entry whose block id is non-zero; an entry a sliding window has
since set to the null block (0) in `req.block_ids` may keep its old id: attention never reads there.
"""
from __future__ import annotations

import numpy as np

NUM_BANNED = 16  # ids suppressed while a request is below min_tokens (EOS + stop ids)

# per-slot sampling parameters fixed for a request's life: written once, when it joins a slot
_STATIC = dict(temperature=(np.float32, 0.0), top_p=(np.float32, 1.0), top_k=(np.int32, 0),
               min_p=(np.float32, 0.0), seed=(np.uint32, 0), presence_penalty=(np.float32, 0.0),
               frequency_penalty=(np.float32, 0.0), repetition_penalty=(np.float32, 1.0),
               prompt_len=(np.int32, 0))


class PersistentBatch:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int, block_size: int):
        S = self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.block_tables = np.zeros((S, max_blocks_per_seq), np.int32)  # [S, B]
        self._row_owner: list = [(None, -1)] * S  # (request, blocks_epoch) whose blocks row s holds
        self._row_len = [0] * S              # entries of row s written
        self.static = {k: np.full(S, v, t) for k, (t, v) in _STATIC.items()}  # each [S]
        self.banned = np.full((S, NUM_BANNED), -1, np.int32)  # [S, NB] while below min_tokens
        self.min_tokens = np.zeros(S, np.int32)               # [S]
        self.filters = np.zeros(S, np.bool_)                  # [S] top_p / top_k / min_p in use
        self.penalties = np.zeros(S, np.bool_)                # [S]
        self.logprobs = np.zeros(S, np.bool_)                 # [S] logprobs asked
        self.history = np.full((S, max_model_len), -1, np.int32)  # [S, M] token ids, for penalties
        self._hist_len = [0] * S
        self._owner: list = [None] * S       # request whose sampling parameters row s holds
        self.hooks = None                    # research.SlotHooks when the step has hidden states / steering

    # -- rows, by difference --------------------------------------------------------------
    def _sync_blocks(self, s: int, req) -> None:
        owner = (req, req.blocks_epoch)
        n_old, n_new = self._row_len[s], len(req.block_ids)
        if self._row_owner[s] != owner:
            self.block_tables[s, :n_old] = 0
            self._row_owner[s], n_old = owner, 0
        if n_new > n_old:
            self.block_tables[s, n_old:n_new] = req.block_ids[n_old:]
        self._row_len[s] = n_new

    def _join(self, s: int, req) -> None:
        """Write the sampling row of a request that has just taken slot s."""
        p = req.params
        for name, value in (("temperature", p.temperature), ("top_p", p.top_p), ("top_k", p.top_k),
                            ("min_p", p.min_p), ("seed", req.seed), ("presence_penalty", p.presence_penalty),
                            ("frequency_penalty", p.frequency_penalty),
                            ("repetition_penalty", p.repetition_penalty), ("prompt_len", req.num_prompt_tokens)):
            self.static[name][s] = value
        ban = ([] if p.ignore_eos else sorted(req.eos_token_ids)) + p.stop_token_ids
        self.banned[s] = -1
        self.banned[s, :min(len(ban), NUM_BANNED)] = ban[:NUM_BANNED]
        self.min_tokens[s] = p.min_tokens
        self.filters[s] = p.top_p < 1 or p.top_k > 0 or p.min_p > 0
        self.penalties[s] = p.uses_penalties
        self.logprobs[s] = p.logprobs is not None
        self._owner[s] = req
        self._hist_len[s] = 0
        if self.hooks is not None:
            self.hooks.join(s, req)

    def _sync_history(self, s: int, req) -> None:
        h, n = self._hist_len[s], len(req.token_ids)
        if n > h:
            self.history[s, h:n] = req.token_ids[h:]
            self._hist_len[s] = n

    # -- one step -------------------------------------------------------------------------
    def prepare(self, scheduled, T: int, pending=frozenset()) -> tuple[dict, dict]:
        """The step's host arrays for `scheduled` [(request, tokens)], token arrays padded to T.

        `pending`: requests whose last token is still on the device (async scheduling); their token
        is taken from the previous step's sampled tokens (`prev_index`), and they cannot use penalties.
        Returns (batch, sampling) dicts of numpy arrays, the shapes fixed by (T, max_num_seqs)."""
        S, bs = self.max_num_seqs, self.block_size
        k = len(scheduled)
        slots, starts, counts, lens = [], [], [], []
        ids: list[int] = []
        prev_at: list[int] = []  # (index into slots) of pending tokens
        penalties, owner = self.penalties, self._owner
        row_len = self._row_len
        for i, (req, n) in enumerate(scheduled):
            s, c = req.slot, req.num_computed_tokens
            if owner[s] is not req:
                self._join(s, req)
            row_req, row_epoch = self._row_owner[s]
            if len(req.block_ids) != row_len[s] or row_req is not req or row_epoch != req.blocks_epoch:
                self._sync_blocks(s, req)  # else the row is up to date (most decode steps)
            slots.append(s)
            starts.append(c)
            counts.append(n)
            lens.append(len(req.token_ids))
            if req in pending:
                ids.extend(req.token_ids[c:c + n - 1])
                ids.append(0)
                prev_at.append(i)
            else:
                ids.extend(req.token_ids[c:c + n])
                if req.spec_token_ids:  # speculative decoding: the proposals follow the last token
                    ids.extend(req.spec_token_ids)
            if penalties[s]:
                self._sync_history(s, req)
        slots, starts, counts, lens = (np.array(x, np.int32) for x in (slots, starts, counts, lens))
        total = len(ids)
        ends = np.cumsum(counts)                                  # [k]
        rep = np.repeat(np.arange(k), counts)                     # [total] index into slots
        positions = np.arange(total, dtype=np.int32) - np.repeat(ends - counts - starts, counts)  # [total]
        slot_of = slots[rep]                                      # [total]
        input_ids = np.zeros(T, np.int32)                         # [T]
        input_ids[:total] = ids
        pos = np.zeros(T, np.int32)
        pos[:total] = positions
        slot_mapping = np.zeros(T, np.int32)                      # [T], padding -> null block
        slot_mapping[:total] = self.block_tables[slot_of, positions // bs] * bs + positions % bs
        prev_index = np.full(T, -1, np.int32)                     # [T]
        if prev_at:
            at = np.asarray(prev_at)
            prev_index[ends[at] - 1] = slots[at]
        seq_lens = np.zeros(S, np.int32)
        seq_lens[slots] = starts + counts
        per_slot = np.zeros(S, np.int32)
        per_slot[slots] = counts
        qsl = np.zeros(S + 1, np.int32)
        qsl[1:] = np.cumsum(per_slot)
        logits_idx = np.zeros(S, np.int32)
        logits_idx[slots] = ends - 1
        sample_slots = np.full(min(S, T), S, np.int32)  # [R]: at most T slots advance in a T-token step
        sample_slots[:k] = slots
        batch = dict(input_ids=input_ids, positions=pos, slot_mapping=slot_mapping, prev_index=prev_index,
                     block_tables=self.block_tables, seq_lens=seq_lens, query_start_loc=qsl,
                     logits_indices=logits_idx, sample_slots=sample_slots)
        return batch, self.sampling(slots, lens)

    def sampling(self, slots, lens) -> dict:
        """Per-slot sampling arrays (rows of slots not scheduled are don't-cares); flags over `slots`."""
        S = self.max_num_seqs
        gen_index = np.zeros(S, np.int32)
        history_len = np.zeros(S, np.int32)
        gen_index[slots] = lens - self.static["prompt_len"][slots]
        history_len[slots] = lens
        below = np.zeros(S, np.bool_)
        below[slots] = gen_index[slots] < self.min_tokens[slots]
        sp = dict(self.static)  # the persistent rows themselves: the step's inputs are packed (copied)
        sp.update(gen_index=gen_index, banned=np.where(below[:, None], self.banned, np.int32(-1)),
                  history_len=history_len)
        temp = self.static["temperature"][slots]
        sp["any_penalty"] = np.bool_(self.penalties[slots].any())
        sp["any_filter"] = np.bool_(self.filters[slots].any())
        sp["all_greedy"] = np.bool_((temp == 0).all())
        sp["any_logprobs"] = np.bool_(self.logprobs[slots].any())
        return sp


# step inputs that may already live on the device (then they are not copied again): never packed,
# passed beside the packed buffer, always — so the compiled step's signature does not depend on where
# they are. A new input of this kind (a large per-slot mask that is all ones when unused) goes here.
SEPARATE = ("prev_tokens", "history", "bitmask", "steering", "bias_ids", "bias_values", "draft_probs",
            "spec_bitmask", "spec_bias_ids", "spec_bias_values", "prompt_embeds", "logprob_token_ids")


def layout(batch: dict, sp: dict) -> tuple:
    """Where `pack` puts each array: ((dict index, name, shape, dtype, start, size), ...), the same for
    every step of one bucket."""
    out, start = [], 0
    for which, d in enumerate((batch, sp)):
        for name in sorted(d):
            if name not in SEPARATE:
                a = np.asarray(d[name])
                out.append((which, name, a.shape, a.dtype.name, start, a.size))
                start += a.size
    return tuple(out)


def pack(batch: dict, sp: dict) -> np.ndarray:
    """Every host array of the step (int32, uint32, float32 or bool; not SEPARATE) in one int32 buffer,
    by `layout`."""
    parts = []
    for d in (batch, sp):
        for name in sorted(d):
            if name not in SEPARATE:
                a = np.asarray(d[name])  # a bool flag may come as np.bool_ or as a 0-d array (multi-host)
                parts.append((a.astype(np.int32) if a.dtype == np.bool_ else a.view(np.int32)).reshape(-1))
    return np.concatenate(parts)
