"""The jit boundary and all that runs inside it: the model runner, the sampler, prompt logprobs, research
hooks, scoring, the choice of attention implementation and the KV cache's storage."""
