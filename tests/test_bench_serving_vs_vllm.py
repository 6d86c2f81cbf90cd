"""`jaxpaged bench serving_vs_vllm --jaxpaged-args=FLAGS`: one more jaxpaged server per string, at its defaults
plus those `jaxpaged serve` flags, side by side with the default one (servers replaced by a recorder here)."""
import json

import pytest

from jaxpaged.bench import serving_vs_vllm as svv


def _run(monkeypatch, tmp_path, *argv) -> tuple[list, dict]:
    started = []

    def fake_server(name, cmd, env, args, log_dir):
        started.append((name, cmd))
        return {"concurrent": {"output_throughput": 1.0 + len(started), "median_ttft_ms": 1.0, "median_tpot_ms": 1.0}}

    monkeypatch.setattr(svv, "run_server", fake_server)
    monkeypatch.setattr(svv.bc, "resolve_model", lambda model: str(tmp_path))
    out = tmp_path / "out.json"
    assert svv.main(["--skip-vllm", "--request-rate", "0", "--json", str(out), *argv]) == 0
    return started, json.loads(out.read_text())


def test_each_extra_string_is_one_more_server(monkeypatch, tmp_path):
    started, res = _run(monkeypatch, tmp_path, "--jaxpaged-args=--async-scheduling",
                        "--jaxpaged-args", "--no-enable-prefix-caching --kv-cache-memory-gb 1")
    (n0, base), (n1, first), (n2, second) = started
    assert first == base + ["--async-scheduling"]
    assert second == base + ["--no-enable-prefix-caching", "--kv-cache-memory-gb", "1"]
    assert len({n0, n1, n2}) == 3  # each server its own log
    assert list(res["runs"]) == ["jaxpaged auto", "jaxpaged auto --async-scheduling",
                                 "jaxpaged auto --no-enable-prefix-caching --kv-cache-memory-gb 1"]
    assert res["settings"]["jaxpaged_args"] == ["--async-scheduling",
                                                "--no-enable-prefix-caching --kv-cache-memory-gb 1"]


@pytest.mark.parametrize("flags", ["--port 9", "--max-num-seqs=8", ""])
def test_flags_the_bench_sets_are_refused(monkeypatch, tmp_path, capsys, flags):
    with pytest.raises(SystemExit):
        _run(monkeypatch, tmp_path, f"--jaxpaged-args={flags}")
    err = capsys.readouterr().err
    assert "--jaxpaged-args" in err and ("is set by this bench" in err if flags else "no flags" in err)
