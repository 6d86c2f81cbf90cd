"""Mosaic GPU interpret mode (JAX 0.10) made to run the kernels' transposed WGMMA operand.

JAX 0.10's GPU interpreter reads a WGMMA operand from shared memory through index transforms only; the
decode and ragged kernels multiply ``q @ k^T`` with ``k`` as a transposed view of its shared-memory tile
(``plgpu.transpose_ref``), which the interpreter rejects ("'TransposeTransform' object has no attribute
'indices'"). ``transposed_wgmma()`` swaps in, for the duration of a test, a WGMMA callback that reads
each operand through its indexers and then applies the transpose; every other construct runs on JAX's
own interpreter. The shim is tested against ``np.matmul`` in ``test_paged_attention_mosaic_gpu.py``.
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax._src.pallas.mosaic.interpret import utils as interpret_utils
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb
from jax._src.state.types import TransposeTransform


def _read(memory, key_array, transforms, thread, info):
    """The operand's contents: indexers first, then (at most one, last) transpose."""
    transforms = jax.tree.map(int, cb._remove_noop_transforms(transforms))
    perm = None
    if transforms and isinstance(transforms[-1], TransposeTransform):
        perm, transforms = transforms[-1].permutation, transforms[:-1]
    key = cb.HostAllocationKey.from_array(key_array)
    rng = interpret_utils.to_range(transforms)
    value, _, _ = memory.get_buffer_content(key, rng, thread, logging_info=info)
    return (value if perm is None else np.transpose(value, perm)), key, rng


def _wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
           acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
           source_info=None):
    memory = cb._get_shared_memory()
    thread = memory.get_global_thread_id(int(device_id), int(thread_id))
    info = interpret_utils.GPULoggingInfo(device_id=int(device_id),
                                          grid_point_coords=tuple(int(x) for x in grid_point_coords),
                                          thread_id=int(thread_id), source_info=source_info)
    a, _, _ = _read(memory, a_allocation_key_as_array, a_transforms, thread, info)  # [M, K]
    b, _, _ = _read(memory, b_allocation_key_as_array, b_transforms, thread, info)  # [K, N]
    acc, key, rng = _read(memory, acc_allocation_key_as_array, acc_transforms, thread, info)  # [M, N]
    memory.store_buffer_content(key, rng, acc + np.matmul(a, b, dtype=acc_dtype), thread, logging_info=info)
    return token


_JAX_WGMMA = cb.wgmma


@contextlib.contextmanager
def _callback(fn):
    saved, cb.wgmma = cb.wgmma, fn
    try:
        yield
    finally:
        cb.wgmma = saved


def transposed_wgmma():
    """Within the block, interpreted WGMMAs accept a transposed shared-memory operand."""
    return _callback(_wgmma)


@contextlib.contextmanager
def original_wgmma():
    """Within the block, JAX's own WGMMA callback (to show what it rejects); the interpreter's state is
    reset on the way out, as it must be after an error inside an interpreted kernel."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
    try:
        with _callback(_JAX_WGMMA):
            yield
    finally:
        reset_gpu_interpret_mode_state()
