"""What the tests and the benchmarks share, shipped so that a user's own tests can use it too.

`tiny_models`: tiny random Hugging Face models of every supported family, saved to disk, and a small byte-level
tokenizer (torch and transformers, from the `test` extra, imported when called). `prompts`: the default model's
golden prompts. `sampled`: sampled tokens against an exact distribution (the filtered softmax, total variation
and its bound for n draws). `xla_env`: the test processes' XLA flags (a fast compile, simulated devices
in subprocesses). The engine never imports this package (tests/test_layout.py).
"""
