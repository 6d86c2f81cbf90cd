"""Built on the engine for RL trainers: the Tunix rollout (`tunix_rollout.py`, `JaxpagedRollout`) and the
Tunix model families it maps onto the engine's parameter pytree (`tunix_models.py`). The controls an RL loop
calls (pause, sleep, weight updates, under vLLM's names) are the engine's, below it: jaxpaged/controls/."""
