"""Speculative decoding: proposals (host n-gram lookup) verified by the target in the ordinary ragged step
(see docs/architecture.md, "A speculative step")."""
