"""Host bookkeeping, numpy at most and never jax (tests/test_layout.py imports every module here with jax
blocked): requests, the scheduler, the block manager and prefix cache, the persistent batch, outputs,
validation, the tokenizer and detokenizer, SamplingParams, logit controls and grammar matchers."""
