"""Compile for an H100 / H200 (sm_90a) on a CPU-only host, and read back what the compiler made.

The jax-cuda plugin, started under ``JAX_PLATFORMS=cpu`` (it cannot start its GPU client without a
driver), still gives a compile-only CUDA topology: ``get_topology_desc(platform="cuda", topology=
"1x1xN", target_config=<XLA's H100 spec>)``. ``jax.jit(f).lower(<abstract args on a mesh of those
devices>).compile()`` then runs the real pipeline: Triton kernels to PTX and through ``ptxas`` inside
XLA, Mosaic GPU kernels through LLVM, PTX and ``ptxas`` in the plugin. What is read back:

- per kernel: registers and spills (``ptxas -v`` on the PTX XLA dumps for Triton; Mosaic GPU's own
  ``ptxas`` log), shared memory (XLA's thunk sequence for Triton; the launch's dynamic shared memory for
  Mosaic GPU);
- per compiled step: ``memory_analysis()``, and XLA's HLO cost analysis of the optimized module (the
  compile-only executable has no ``cost_analysis()``; the CPU client's analysis reads the same HLO).

The dump switches are read when the plugin loads, so every compile runs in a fresh subprocess
(``run``), which also keeps the CUDA plugin away from the test process. Jobs are functions in
``compile_jobs.py`` (also the subprocess's entry point); this module is their harness.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets", "h100_sxm.txtpb")
# What a compile without a device cannot do: autotune (XLA's default kernel choices instead), and size
# CUB's radix-sort scratch (large sorts, the sampler's top-k over the vocabulary, take XLA's own sort)
DEVICELESS_FLAGS = "--xla_gpu_autotune_level=0 --xla_gpu_enable_cub_radix_sort=false"
# H200 (the machine the predictions are for): same sm_90a die as the H100 spec, HBM3e
H200 = dict(hbm_bytes=141e9, hbm_bytes_per_s=4.8e12, bf16_flops_per_s=989e12)


def ptxas() -> str | None:
    """The ptxas binary: the nvidia-cuda-nvcc wheel's, else one on PATH."""
    try:
        import nvidia
        for base in nvidia.__path__:
            for path in sorted(glob.glob(os.path.join(base, "cu*", "bin", "ptxas"))):
                return path
    except ImportError:
        pass
    return shutil.which("ptxas")


def missing() -> str | None:
    """Why this machine cannot compile for sm_90a (None when it can): the plugin or ptxas absent."""
    import importlib.util
    if importlib.util.find_spec("jax_plugins") is None or not any(
            importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (13, 12)):
        return "the jax-cuda plugin is not installed (pip install -e '.[test]' brings jax-cuda13-plugin)"
    if ptxas() is None:
        return "no ptxas (pip install nvidia-cuda-nvcc, or a CUDA toolkit on PATH)"
    return None


def run(job: str, args: dict, timeout: float = 600) -> dict:
    """Run `compile_jobs.<job>(**args)` in a fresh CPU-only process with the dumps on; its JSON result.

    The job gets ``dumps`` = {"xla": dir, "mosaic": dir} to read kernel statistics from."""
    with tempfile.TemporaryDirectory(prefix="sm90_") as tmp:
        dumps = {"xla": os.path.join(tmp, "xla"), "mosaic": os.path.join(tmp, "mosaic")}
        for d in dumps.values():
            os.makedirs(d)
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={dumps['xla']} {DEVICELESS_FLAGS}",
                   MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=dumps["mosaic"])
        out = os.path.join(tmp, "result.json")
        payload = json.dumps(dict(args, dumps=dumps))
        proc = subprocess.run([sys.executable, "-m", "jaxpaged.bench.compile_jobs", job, payload, out], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"compile job {job} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def cuda_mesh(n: int, axis_names=("x",), shape=None):
    """A Mesh over `n` compile-only H100 devices (one host), shaped `shape` (default (n,))."""
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh
    with open(SPEC) as f:
        spec = f.read()
    topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n}", target_config=spec)
    return Mesh(np.array(topo.devices).reshape(shape or (n,)), axis_names)


def parse_ptxas(text: str) -> dict:
    """Registers and spill bytes from `ptxas -v` output (one entry function)."""
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None or spills is None:
        raise ValueError(f"no ptxas statistics in:\n{text[-1000:]}")
    return dict(registers=int(regs.group(1)), spill_store_bytes=int(spills.group(1)),
                spill_load_bytes=int(spills.group(2)))


def new_files(directory: str, since: float) -> list[str]:
    """Files of `directory` written at or after time `since`: what the last compile dumped (dump names
    can repeat across compiles, so new names alone would miss a rewritten file)."""
    return sorted(p for p in glob.glob(os.path.join(directory, "*")) if os.path.getmtime(p) >= since)


def triton_stats(files: list[str], kernel: str) -> dict:
    """Statistics of Triton kernel `kernel` from one compile's XLA dump files."""
    for path in files:
        if path.endswith(".ptx") and f".entry {kernel}(" in open(path).read():
            proc = subprocess.run([ptxas(), "-v", "-arch=sm_90a", path, "-o", os.devnull], capture_output=True,
                                  text=True, check=True)
            stats = parse_ptxas(proc.stderr + proc.stdout)
            break
    else:
        raise ValueError(f"no PTX for {kernel} among {len(files)} dump files")
    for path in files:
        if path.endswith("thunk_sequence.txt"):
            m = re.search(rf"{kernel} grid: .*? shared_memory: (\d+) bytes", open(path).read())
            if m:
                stats["smem_bytes"] = int(m.group(1))
    return stats


def mosaic_stats(files: list[str], kernel: str) -> dict:
    """Statistics of Mosaic GPU kernel `kernel` from one compile's Mosaic dump files."""
    logs = sorted((p for p in files if os.path.basename(p).startswith(kernel) and p.endswith(".ptxas")),
                  key=os.path.getmtime, reverse=True)  # the newest
    if not logs:
        raise ValueError(f"no ptxas log for {kernel} among {len(files)} dump files")
    stats = parse_ptxas(open(logs[0]).read())
    passes = logs[0][:-len(".ptxas")] + ".mlir-passes.log"
    if os.path.exists(passes):
        sizes = re.findall(r"dynamic_shared_memory_size %c(\d+)_i32", open(passes).read())
        if sizes:
            stats["smem_bytes"] = int(sizes[-1])
    return stats




_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
KERNEL_TARGETS = ("mosaic_gpu_v2", "__gpu$xla.gpu.triton")


def type_bytes(text: str) -> int:
    """Bytes of every array type written in `text` (e.g. 'bf16[8,16]{1,0}', tuples included)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]", text):
        if dtype in _BYTES:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * _BYTES[dtype]
    return total


def kernel_call_bytes(hlo_text: str) -> int:
    """Operand + result bytes of every attention-kernel custom call in an optimized HLO module: what XLA's
    cost analysis counts for them (whole pools), not what they read (the blocks in use)."""
    total = 0
    for line in hlo_text.splitlines():
        if "custom-call(" in line and any(f'custom_call_target="{t}"' in line for t in KERNEL_TARGETS):
            result = line.split("=", 1)[1].split("custom-call(", 1)[0]
            operands = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", line)
            total += type_bytes(result) + (type_bytes(operands.group(1)) if operands else 0)
    return total


def step_costs(compiled) -> dict:
    """flops, bytes accessed (XLA's HLO cost analysis of the optimized module, read with the CPU client:
    the compile-only executable has no cost_analysis) and the attention kernels' operand bytes in it."""
    from jax._src import xla_bridge
    from jax._src.lib import xla_client
    module = compiled.runtime_executable().hlo_modules()[0]
    cost = xla_client._xla.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
    return dict(flops=float(cost["flops"]), bytes_accessed=float(cost["bytes accessed"]),
                kernel_operand_bytes=float(kernel_call_bytes(module.to_string())))


def memory(compiled) -> dict:
    """memory_analysis() of a compiled step, per device."""
    m = compiled.memory_analysis()
    return dict(argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
                alias_bytes=m.alias_size_in_bytes, temp_bytes=m.temp_size_in_bytes)


# XLA's while loops (the layer scan) count once in its cost analysis; a cost-only compile unrolls them
FULL_UNROLL = {"xla_gpu_enable_while_loop_unrolling": "WHILE_LOOP_UNROLLING_FULL_UNROLL"}
