"""Compile-only TPU targets on a machine without a TPU: topologies, meshes, and what a compiled program
reports (memory, cost, the scoped VMEM and bundle counts of its Mosaic kernels).

Needs libtpu (`pip install "jax[tpu]==<the installed jax>"`, in the `test` extra). A process that uses it
should start with `environment()` applied to its environment (set before JAX starts): libtpu stays quiet
(no metadata-server query), and a second process may load it while the first holds its lock file.
"""
from __future__ import annotations

import glob
import os
import re

CHIPS = {  # HBM bytes a chip, HBM bandwidth (bytes/s), bf16 peak (flop/s): the public spec sheets
    "v5e": dict(topology="v5e:2x4", hbm=16 * 2**30, bandwidth=819e9, peak=197e12),
    "v6e": dict(topology="v6e:2x4", hbm=32 * 2**30, bandwidth=1640e9, peak=918e12),
}


def environment(dump_dir: str | None = None) -> dict:
    """Environment variables for a process that compiles for TPU on a host without one; with `dump_dir`,
    libtpu writes each kernel's final bundles there (read by `bundle_counts`)."""
    env = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
           "JAX_PLATFORMS": "cpu"}
    if dump_dir:
        env["LIBTPU_INIT_ARGS"] = f"--xla_jf_dump_to={dump_dir}"
    return env


def has_libtpu() -> bool:
    import importlib.util
    return importlib.util.find_spec("libtpu") is not None


def topology_mesh(chip: str, tp: int, axes=("data", "model")):
    """A Mesh of `tp` compile-only devices of chip `chip` ("v5e" / "v6e"), shaped (1, tp) over `axes`."""
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh
    topo = topologies.get_topology_desc(topology_name=CHIPS[chip]["topology"], platform="tpu")
    if tp > len(topo.devices):
        raise ValueError(f"tp ({tp}) exceeds the {len(topo.devices)} chips of {CHIPS[chip]['topology']}")
    return Mesh(np.array(topo.devices[:tp]).reshape(1, tp), axes)


def scoped_vmem(compiled, kernel_name: str) -> int:
    """Bytes of scoped VMEM the compiler gave the custom calls named `kernel_name` (the largest)."""
    sizes = [0]
    for line in compiled.as_text().splitlines():
        if "tpu_custom_call" in line and kernel_name in line.split("=", 1)[0]:
            sizes += [int(s) for s in re.findall(r'"used_scoped_memory_configs":\[[^\]]*"size":"(\d+)"', line)]
    return max(sizes)


def bundle_counts(dump_dir: str, kernel_name: str) -> list[int]:
    """Total scheduled bundles of each kernel named `kernel_name` in a libtpu dump (`environment(dump_dir)`)."""
    out = []
    for path in sorted(glob.glob(os.path.join(dump_dir, f"*-{kernel_name}*-schedule-analysis_final_bundles.txt"))):
        with open(path) as f:
            m = re.search(r"total scheduled bundles:\s*(\d+)", f.read())
        if m:
            out.append(int(m.group(1)))
    return out


def pool_copies(compiled, min_bytes: int) -> int:
    """Relayouts (copies, and reshapes or transposes XLA could not make free) of at least `min_bytes` in
    the compiled program: a kernel whose pool layout differs from the layout XLA gave the pool costs one
    such copy per call."""
    sizes = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "s8": 1, "u8": 1, "f8e4m3fn": 1}
    n = 0
    for line in compiled.as_text().splitlines():
        m = re.match(r"\s*%\S+ = (\w+)\[([\d,]+)\]\S* (copy|copy-start|reshape|transpose)\(", line)
        if m and m.group(1) in sizes:
            count = 1
            for d in m.group(2).split(","):
                count *= int(d)
            n += count * sizes[m.group(1)] >= min_bytes
    return n
