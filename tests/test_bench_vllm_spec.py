"""spec.py --vllm: vLLM's side (jaxpaged/bench/vllm_spec_peer.py) skipped with a message when vLLM cannot be
imported, and run through the stand-in `vllm` package of test_bench_vllm.py: the engines each config gets,
the static batches, the requests, and the acceptance counts read from its metrics."""
import json

import pytest
from test_bench_vllm import _config_only, use_stand_in

from jaxpaged.bench import common as bc
from jaxpaged.bench import spec


def test_vllm_side_off_or_skipped(tmp_path):
    args = spec._parser().parse_args([])
    assert args.vllm_dtype == "float32" and not args.vllm
    assert spec._vllm_side("m", {}, [1], [2], args) == ({}, "vLLM not measured (--vllm runs its n-gram "
                                                                   "side by side)")
    args = spec._parser().parse_args(["--vllm", "--vllm-python", str(tmp_path / "nope")])
    got, note = spec._vllm_side("m", {}, [1], [2], args)
    assert got == {} and "cannot run" in note and str(tmp_path / "nope") in note
    with pytest.raises(SystemExit):  # vLLM's side compares its n-gram proposer only
        spec.main(["--vllm", "--method", "draft_model", "--draft", "random:tiny"])


def test_vllm_side_through_a_stand_in(tmp_path, monkeypatch):
    model = _config_only(tmp_path / "m")
    log = use_stand_in(tmp_path, monkeypatch)
    reqs = [bc.Req([5, 6, 7], 3), bc.Req([8, 9], 4), bc.Req([10], 2)]
    cases = {("grounded", 1): reqs, ("grounded", 2): reqs}
    args = spec._parser().parse_args(["--vllm", "--repeats", "2", "--ks", "2,3"])
    got, note = spec._vllm_side(model, cases, [1, 2], [2, 3], args)
    assert note.startswith("vLLM stand-in ran the same requests (dtype float32")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    inits = [ln["init"] for ln in lines if "init" in ln]
    assert [i.get("speculative_config") for i in inits] == [None] + [
        dict(method="ngram", prompt_lookup_min=2, prompt_lookup_max=5, num_speculative_tokens=k) for k in (2, 3)]
    assert all(i["max_num_seqs"] == 2 and i["disable_log_stats"] is False and i["dtype"] == "float32"
               for i in inits)
    calls = [ln for ln in lines if "init" not in ln]
    # per engine: a warm-up on the first batch reversed, the prefix cache emptied, then 2 passes of 3
    # batches of 1 and 2 passes of 2 batches of at most 2
    assert [len(c.get("prompts", [])) for c in calls] == ([1, 0] + [1, 1, 1] * 2 + [2, 1] * 2) * 3
    assert calls[0]["prompts"][0]["prompt_token_ids"] == [7, 6, 5] and calls[1] == {"reset_prefix_cache": True}
    assert [c["prompts"][0]["prompt_token_ids"] for c in calls[2:5]] == [[5, 6, 7], [8, 9], [10]]
    assert all(p["min_tokens"] == p["max_tokens"] and p["ignore_eos"] and p["temperature"] == 0
               for c in calls for p in c.get("params", []))
    assert set(got) == set(cases)
    for case in cases:
        per_c = got[case]
        assert list(per_c) == ["vllm_plain", "vllm_ngram_k2", "vllm_ngram_k3"]
        assert all(r["output_tokens"] == 2 * 9 and len(r["elapsed_s_per_pass"]) == 2 for r in per_c.values())
        assert "acceptance_rate_per_pos" not in per_c["vllm_plain"]
        k3 = per_c["vllm_ngram_k3"]  # the warm-up's draft is not counted
        assert k3["spec_decode_num_drafts"] == 6 and k3["spec_decode_num_draft_tokens"] == 18
        assert k3["acceptance_rate_per_pos"] == [1.0, 0.0, 0.0] and k3["mean_accepted_per_draft"] == 1.0


def test_ratios_to_own_plain_and_to_jaxpaged_plain():
    per_c = {name: {"time_per_output_token_s": t} for name, t in
             [("plain", 2.0), ("ngram_k2", 1.0), ("vllm_plain", 4.0), ("vllm_ngram_k2", 3.0)]}
    per_c["plain"]["pass_time_per_output_token_s"] = [2.0, 2.0, 4.0]     # the third pass slowed for plain
    per_c["ngram_k2"]["pass_time_per_output_token_s"] = [1.0, 1.2, 1.0]
    spec._add_ratios(per_c)
    assert per_c["ngram_k2"]["ratio_to_plain"] == 0.5 and "ratio_to_jaxpaged_plain" not in per_c["ngram_k2"]
    assert per_c["ngram_k2"]["median_pass_ratio"] == 0.5 and per_c["plain"]["median_pass_ratio"] == 1.0
    assert "median_pass_ratio" not in per_c["vllm_ngram_k2"]
    assert per_c["vllm_ngram_k2"]["ratio_to_plain"] == 0.75
    assert per_c["vllm_ngram_k2"]["ratio_to_jaxpaged_plain"] == 1.5
    assert per_c["vllm_plain"]["ratio_to_jaxpaged_plain"] == 2.0


def test_grounding_text_comes_from_the_flag(tmp_path):
    """The grounded workload's paragraphs come from --grounding-text's files (prose of 60-160 words; tables,
    headings and short lines skipped), relative to the current directory, not to where the package lies."""
    para = " ".join(f"word{i}" for i in range(80))
    f = tmp_path / "prose.md"
    f.write_text(f"# Title\n\n{para}\n\n| a | table |\n\nshort.\n\n{para} again\n")
    assert spec._paragraphs(2, [str(f), str(tmp_path / "missing.md")]) == [para, para + " again"]
    with pytest.raises(SystemExit, match="only 2 paragraphs"):
        spec._paragraphs(3, [str(f)])
    assert spec._parser().parse_args(["--grounding-text", str(f)]).grounding_text == [str(f)]
