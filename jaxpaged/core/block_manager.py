"""Host bookkeeping of the block pool: free blocks, ref counts, the prefix cache, LRU eviction.

Block 0 is the null block and is never handed out. A full block may be registered in the prefix
cache under the key (parent key's hash, its token ids): equal keys mean equal token prefixes, since
dict lookup compares the token ids themselves. A request whose prompt came as embeddings has no token ids
to key its blocks by (placeholders): it neither takes nor registers cached blocks (`Request.cacheable`;
its n > 1 samples still share their prompt blocks directly). A request's first block has its steering's
digest and its LoRA adapter as parent, so blocks computed under different steering or adapters never match. A cached
block whose ref count drops to 0 stays cached and becomes evictable; evictable blocks are reused least recently
freed first.

Sliding window (only when every layer slides, as in Mistral): a query at position p sees keys
p - window < k <= p, so once a request has computed c tokens, a block whose last position is
<= c - window is never read again. `allocate` drops the request's reference to such blocks and puts
the null block in their place in `req.block_ids` (positions keep their index): they go back to the
free list, or, when registered in the prefix cache, stay cached and evictable — their contents are
still the K/V of that prefix. A request's row of the engine's block table may keep the old ids:
attention never reads positions outside the window.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from jaxpaged.core.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is the null block)")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.ref_count = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(1, num_blocks))  # not cached, ref 0
        self.evictable: OrderedDict[int, None] = OrderedDict()      # cached, ref 0, oldest first
        self.cache: dict[tuple, int] = {}                            # key -> block id
        self.block_key: dict[int, tuple] = {}                        # block id -> key
        self.hit_tokens = 0
        self.queried_tokens = 0

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    # -- keys -----------------------------------------------------------------------------
    def _key(self, req: Request, i: int) -> tuple:
        """Prefix-cache key of the request's i-th full block (computed once, kept on the request)."""
        while len(req.block_keys) <= i:
            j = len(req.block_keys)
            # steering and the LoRA adapter change K/V: they are the first block's parent
            parent = hash(req.block_keys[j - 1]) if j else (req.params.steering_key, req.lora_int_id)
            bs = self.block_size
            req.block_keys.append((parent, tuple(req.token_ids[j * bs:(j + 1) * bs])))
        return req.block_keys[i]

    # -- allocation -----------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0 and block in self.evictable:
            del self.evictable[block]
        self.ref_count[block] += 1

    def _new_block(self) -> int:
        if self.free_blocks:
            b = self.free_blocks.popleft()
        else:
            b, _ = self.evictable.popitem(last=False)
            del self.cache[self.block_key.pop(b)]
        self.ref_count[b] = 1
        return b

    def match_prefix(self, req: Request) -> int:
        """On admission, take the longest cached prefix of full blocks; return the tokens it covers.

        A hit never covers the request's last token (that token must be computed to sample from)."""
        if req.block_ids:
            raise RuntimeError(f"request {req.request_id} already holds blocks")
        max_blocks = (len(req.token_ids) - 1) // self.block_size
        if req.sibling is not None and req.sibling.num_computed_tokens >= req.num_prompt_tokens \
                and req.sibling.block_ids:
            # n > 1: share the sibling's full prompt blocks directly (works without the prefix cache),
            # up to the first one the sibling's window has dropped
            shared = req.sibling.block_ids[:min(max_blocks, req.num_prompt_tokens // self.block_size)]
            shared = shared[:shared.index(0)] if 0 in shared else shared
            for b in shared:
                self._take(b)
            req.block_ids = list(shared)
            self._drop_behind_window(req, len(shared) * self.block_size)
            return len(shared) * self.block_size
        if not self.enable_prefix_caching or req.params.return_prompt_hidden_states or not req.cacheable:
            return 0  # prompt hidden states: cached positions would have none, so compute them all
        self.queried_tokens += len(req.token_ids)
        for i in range(max_blocks):
            b = self.cache.get(self._key(req, i))
            if b is None:
                break
            self._take(b)
            req.block_ids.append(b)
        n = len(req.block_ids) * self.block_size
        self.hit_tokens += n
        self._drop_behind_window(req, n)
        return n

    def max_blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, advancing <= step_tokens a step
        (with a sliding window: its window and one step, wherever the blocks' boundaries fall)."""
        full = -(-num_tokens // self.block_size)
        if self.sliding_window is None:
            return full
        return min(full, (step_tokens + self.sliding_window - 3) // self.block_size + 2)

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(req.block_ids))

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Give the request enough blocks to hold `num_tokens` tokens; False (nothing taken) if short.

        With a sliding window, first release the blocks no query from `req.num_computed_tokens` on sees."""
        self._drop_behind_window(req, req.num_computed_tokens)
        need = self.blocks_needed(req, num_tokens)
        if need > self.num_free_blocks:
            return False
        req.block_ids.extend(self._new_block() for _ in range(need))
        return True

    def _drop_behind_window(self, req: Request, computed: int) -> None:
        """Release the blocks no query from position `computed` on can see (sliding window only)."""
        if self.sliding_window is None:
            return
        dead = max(computed - self.sliding_window + 1, 0) // self.block_size
        for i in range(min(dead, len(req.block_ids))):
            b = req.block_ids[i]
            if b:
                req.block_ids[i] = 0
                self._release(b)

    def _release(self, b: int) -> None:
        self.ref_count[b] -= 1
        if self.ref_count[b] < 0:
            raise RuntimeError(f"block {b} freed more often than taken")
        if self.ref_count[b] == 0:
            if b in self.block_key:
                self.evictable[b] = None
            else:
                self.free_blocks.append(b)

    def cache_blocks(self, req: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache (none of a request that is not
        `cacheable`: a prompt given as embeddings)."""
        if not self.enable_prefix_caching or not req.cacheable:
            return
        full = req.num_computed_tokens // self.block_size
        for i in range(req.num_registered_blocks, full):
            b = req.block_ids[i]
            if b == 0 or b in self.block_key:  # dropped behind the window, or cached already
                continue
            key = self._key(req, i)
            if key not in self.cache:  # an equal block cached by another request stays the cached one
                self.cache[key] = b
                self.block_key[b] = key
        req.num_registered_blocks = max(req.num_registered_blocks, full)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Release the request's blocks past those holding its first `num_tokens` tokens (speculative
        decoding: blocks that held only rejected proposals; never registered, so they go to the free list)."""
        keep = -(-num_tokens // self.block_size)
        if len(req.block_ids) > keep:
            for b in reversed(req.block_ids[keep:]):
                if b:
                    self._release(b)
            del req.block_ids[keep:]
            req.blocks_epoch += 1  # ids past `keep` will differ: the persistent batch rewrites the row

    def free(self, req: Request) -> None:
        """Drop the request's references; blocks reaching 0 become free (tail first) or evictable."""
        for b in reversed(req.block_ids):
            if b:  # 0: dropped behind the window already
                self._release(b)
        req.block_ids = []
        req.blocks_epoch += 1
        req.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        for b in list(self.evictable):
            del self.cache[self.block_key.pop(b)]
            self.free_blocks.append(b)
        self.evictable.clear()
