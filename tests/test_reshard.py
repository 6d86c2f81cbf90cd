"""update_weights from arrays sharded as a trainer holds them (FSDP over 8 devices) into an engine of
tensor parallel 4 x data parallel 2, on 8 simulated CPU devices (tests/reshard_checks.py, a subprocess)."""
import json
import os
import subprocess
import sys

from jaxpaged.testing.xla_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_fsdp_weights_resharded_to_tp4_dp2_on_device(tmp_path):
    env = subprocess_env(8, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "reshard_checks.py"), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["replica_devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert facts["values_equal"] and facts["shardings_kept"]
    assert facts["tokens"] == facts["reference"]  # the new weights, as one device computes them
