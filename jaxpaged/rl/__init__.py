"""Controls for RL loops, under vLLM's names: pause / resume generation around weight updates
(`pause.py`) and sleep / wake releasing device memory (`sleep.py`). The engine holds one of each and
forwards its public methods to them; they change the engine only through its parts' public methods."""
