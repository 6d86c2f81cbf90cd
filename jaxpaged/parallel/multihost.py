"""Multi-host serving on JAX's multi-controller runtime (`jax.distributed`); see docs/scale-out.md.

Every process loads the same model onto one global mesh (tensor parallelism over all processes' devices)
and compiles the same step buckets. Process 0 (the leader) schedules; before each step its runner's step
sink (`LeaderSink`) puts the step's host inputs (bucket key, padded batch and sampling arrays;
zlib-compressed) into the coordination service's key-value store under `jaxpaged/step/<n>`. The other
processes (followers) read step n, build the same device inputs and call the same compiled step, so every
device joins the step's collectives.
An empty message tells the followers to stop.

Failures: the leader's sink runs each step under a watchdog. A follower that dies (the step's collective fails
at once) or hangs (the step takes longer than `distributed_timeout`) fails the step with FollowerLostError,
and every later one; the engine loop then reports the engine down. Followers exit when the leader's
coordination service goes away.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import threading
import zlib

import numpy as np

from jaxpaged.config import EngineConfig
from jaxpaged.executor import FatalStepError
from jaxpaged.step.runner import ModelRunner

log = logging.getLogger("jaxpaged.parallel.multihost")

STEP_KEY = "jaxpaged/step/"
CONFIG_KEY = "jaxpaged/config/"
HEARTBEAT_SECONDS = 10   # the coordination service marks a silent process dead after this long
READY_TIMEOUT_S = 1800   # start-up: every process has loaded and compiled (compiling a big model is slow)
STOP_TIMEOUT_S = 10      # shutdown: the leader waits this long for the followers to leave
_LOCAL_ONLY = ("model", "process_id", "coordinator_address", "compilation_cache_dir", "show_progress",
               "warmup", "distributed_timeout")


class FollowerLostError(FatalStepError):
    """A follower process died or stopped answering: the multi-host step cannot complete."""


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """`jax.distributed.initialize` (gloo collectives on CPU, recoverable tasks); call before any JAX use."""
    import jax
    if jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:  # without it the coordination service aborts the leader when a follower dies
        jax.config.update("jax_enable_recoverability", True)
    except AttributeError:
        log.warning("this jax has no jax_enable_recoverability: a dead follower also ends the leader")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                               heartbeat_timeout_seconds=HEARTBEAT_SECONDS)


def _leave() -> None:
    """Disconnect from the coordination service (after the stop barrier, so no process sees it vanish)."""
    import jax
    try:
        jax.distributed.shutdown()
    except Exception as e:  # noqa: BLE001 -- already gone: nothing to leave
        log.warning("jax.distributed.shutdown: %s", e)


def _client():
    from jax._src import distributed
    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized (call multihost.initialize first)")
    return distributed.global_state.client


# -- start-up: every process must run the same engine ----------------------------------------------
def fingerprint(config: EngineConfig, model_dir: str) -> dict:
    """The settings every process must share: engine fields (not the local ones) and a model digest."""
    fp = {k: v for k, v in vars(config).items() if k not in _LOCAL_ONLY}
    key = "model (config.json and weight files)"
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        fp[key] = f"{model_dir}: no model here"  # still published: the others fail at once, not on a timeout
        return fp
    h = hashlib.sha256()
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        h.update(f.read())
    for name in sorted(os.listdir(model_dir)):
        if name.endswith((".safetensors", ".npy", ".gguf")):
            h.update(f"{name}:{os.path.getsize(os.path.join(model_dir, name))}".encode())
    fp[key] = h.hexdigest()[:16]
    return fp


def check_same_config(config: EngineConfig, model_dir: str, timeout_s: float = 300.0) -> None:
    """Publish this process's fingerprint, read every other one; ValueError naming what differs."""
    client, mine = _client(), json.dumps(fingerprint(config, model_dir), default=str)
    client.key_value_set(f"{CONFIG_KEY}{config.process_id}", mine)
    mine, diffs = json.loads(mine), []
    for p in range(config.num_processes):
        theirs = json.loads(client.blocking_key_value_get(f"{CONFIG_KEY}{p}", int(timeout_s * 1000)))
        diffs += [f"{k} (process {config.process_id}: {mine[k]!r}, process {p}: {theirs.get(k)!r})"
                  for k in mine if mine[k] != theirs.get(k)]
    # every process has read every fingerprint before any leaves: process 0 hosts the coordination service,
    # and if it raised at once, a slower process would find the service gone instead of the difference
    client.wait_at_barrier("jaxpaged/config-checked", int(timeout_s * 1000))
    if diffs:
        raise ValueError("settings differ between the processes of the multi-host job (they must match): "
                         + "; ".join(diffs))


# -- the step message --------------------------------------------------------------------------------
def encode_step(key: tuple[int, bool, bool], batch: dict, sp: dict) -> bytes:
    """(step variant (T, decode_only, verify), host batch, host sampling arrays) -> bytes; device-resident
    inputs (the runner's placeholders: all -1 `history`, zero `prev_tokens`, all-ones grammar `bitmask`,
    unused logit-control and speculative per-position arrays) are left out and rebuilt by the follower (a
    multi-host engine steps synchronously, so no token waits on the device)."""
    def host(d):
        return {k: v for k, v in d.items() if isinstance(v, (np.ndarray, np.generic))}
    arrays = {f"b.{k}": np.asarray(v) for k, v in host(batch).items()}
    arrays.update({f"s.{k}": np.asarray(v) for k, v in host(sp).items()})
    header = json.dumps({"key": [int(key[0]), bool(key[1]), bool(key[2])],
                         "arrays": [[k, a.dtype.str, a.shape] for k, a in arrays.items()]}).encode()
    body = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())
    return zlib.compress(len(header).to_bytes(4, "little") + header + body, 1)


def decode_step(message: bytes, runner: ModelRunner) -> tuple[tuple[int, bool, bool], dict, dict]:
    raw = zlib.decompress(message)
    n = int.from_bytes(raw[:4], "little")
    header = json.loads(raw[4:4 + n])
    batch, sp, offset = {}, {}, 4 + n
    for name, dtype, shape in header["arrays"]:
        dt = np.dtype(dtype)
        size = int(np.prod(shape)) * dt.itemsize
        a = np.frombuffer(raw, dt, int(np.prod(shape)), offset).reshape(shape)
        offset += size
        (batch if name.startswith("b.") else sp)[name[2:]] = a
    key = tuple(header["key"])
    for name, none in runner.placeholders(key[2]).items():  # the device-resident inputs left out
        if name not in batch:
            sp.setdefault(name, none)
    return key, batch, sp


class StepChannel:
    """Step messages through the coordination service's key-value store, numbered 1, 2, ..."""

    def __init__(self):
        self.client, self.n = _client(), 0

    def send(self, message: bytes) -> None:
        self.n += 1
        self.client.key_value_set_bytes(f"{STEP_KEY}{self.n}", message)
        if self.n > 1:  # every follower read step n-1: it took part in that step's collectives
            self.client.key_value_delete(f"{STEP_KEY}{self.n - 1}")

    def recv(self) -> bytes:
        self.n += 1
        while True:
            try:
                return self.client.blocking_key_value_get_bytes(f"{STEP_KEY}{self.n}", 60_000)
            except Exception as e:  # noqa: BLE001 -- jaxlib raises its own error types
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise RuntimeError(f"lost the leader (process 0): {e}") from None


# -- the leader ------------------------------------------------------------------------------------
class LeaderSink:
    """Process 0's step sink (jaxpaged/step/sink.py): sends each step's inputs to the followers, and runs
    each step under a watchdog."""

    def __init__(self, channel: StepChannel, timeout_s: float):
        self.channel, self.timeout_s = channel, timeout_s
        self._failure: str | None = None
        self._closed = False

    def send(self, key: tuple[int, bool, bool], batch: dict, sp: dict) -> None:
        self.channel.send(encode_step(key, batch, sp))

    def guard(self, step):
        if self._failure:
            raise FollowerLostError(self._failure)
        box: dict = {}

        def run():
            try:
                box["result"] = step()
            except BaseException as e:  # noqa: BLE001 -- handed to the engine thread below
                box["error"] = e

        worker = threading.Thread(target=run, name="jaxpaged-multihost-step", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            self._fail(f"a multi-host step did not finish within distributed_timeout="
                       f"{self.timeout_s:g} s (a follower is stuck or unreachable)")
        if "error" in box:
            self._fail(f"a multi-host step failed ({type(box['error']).__name__}: {box['error']}); "
                       "a follower process probably died")
        return box["result"]

    def _fail(self, reason: str):
        self._failure = reason
        log.error("multi-host engine down: %s", reason)
        raise FollowerLostError(reason)

    def close(self) -> None:
        """Tell the followers to stop and wait (STOP_TIMEOUT_S at most) until they leave; once, also at exit."""
        if not self._closed:
            self._closed = True
            if self._failure:
                # a follower is lost: leaving the coordination service would block on it and then abort
                # the process (and a step may still hang in a collective), so end the process here, status 0
                log.warning("multi-host: exiting without the stop barrier (%s)", self._failure)
                logging.shutdown()
                os._exit(0)
            try:
                self.channel.send(b"")
                self.channel.client.wait_at_barrier("jaxpaged/stop", int(STOP_TIMEOUT_S * 1000))
                self._wait_followers_left()
            except Exception as e:  # noqa: BLE001 -- a follower may be dead already
                log.warning("the followers did not all stop cleanly: %s", e)
            _leave()

    def _wait_followers_left(self) -> None:
        """Keep the coordination service up until the followers have disconnected from it (a follower
        that finds it gone while disconnecting aborts). `get_live_nodes` returns once every live process
        called it, i.e. here once the followers have left; a daemon thread bounds the wait."""
        import jax
        client = self.channel.client
        if hasattr(client, "get_live_nodes"):
            n = jax.process_count()
            waiter = threading.Thread(target=client.get_live_nodes, args=(list(range(n)),), daemon=True)
            waiter.start()
            waiter.join(STOP_TIMEOUT_S)


# -- the followers ---------------------------------------------------------------------------------
def follow(runner: ModelRunner, channel: StepChannel) -> int:
    """Run the leader's steps until it says stop; returns the number of steps run."""
    import jax
    steps = 0
    while message := channel.recv():
        key, batch, sp = decode_step(message, runner)
        outs, runner.k_pool, runner.v_pool = runner.compiled_step(key)(
            runner.params, runner.k_pool, runner.v_pool, *runner.device_inputs(batch, sp))
        jax.block_until_ready(outs)
        steps += 1
    return steps


def build_engine(config: EngineConfig):
    """Process 0: an LLMEngine whose runner's step sink leads. Other processes: follow until the leader stops, then
    return None. Needs `initialize` first; tensor parallelism spans every process's devices."""
    import jax

    from jaxpaged.engine import LLMEngine
    model_dir = config.model
    if model_dir is None:
        from jaxpaged.checkpoints.default_model import default_model_dir
        model_dir = default_model_dir()
    check_same_config(config, model_dir)
    devices = jax.devices()
    if config.tensor_parallel_size != len(devices):
        raise ValueError(f"multi-host: tensor_parallel_size ({config.tensor_parallel_size}) must equal the "
                         f"devices of all {config.num_processes} processes ({len(devices)})")
    channel = StepChannel()
    sink = LeaderSink(channel, config.distributed_timeout) if config.process_id == 0 else None
    engine = LLMEngine(config, devices=devices, step_sink=sink)
    channel.client.wait_at_barrier("jaxpaged/ready", READY_TIMEOUT_S * 1000)  # all loaded and compiled
    if sink is not None:
        atexit.register(sink.close)
        return engine
    log.info("process %d follows process 0", config.process_id)
    steps = follow(engine.runner, channel)
    log.info("process %d: the leader stopped after %d steps", config.process_id, steps)
    channel.client.wait_at_barrier("jaxpaged/stop", STOP_TIMEOUT_S * 1000)
    _leave()
    return None
