"""Prometheus metrics, vLLM's names under the `jaxpaged:` prefix, in a registry of the app's own.

Gauges and the preemption counter are read from the engine's stats at scrape time; token counters and
latency histograms are updated by the routes when a request ends.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# vLLM 0.32's bucket families (vllm/v1/metrics/buckets.py): time to first token; request latency (e2e and
# the phases of a request: queue, prefill, decode, inference); inter-token latency (also the per-request TPOT)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                  240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)


def buckets_1_2_5(most: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `most` (vLLM's buckets for token counts, up to max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineCollector:
    """Gauges (and the preemption counter) straight from `engine.stats()` at scrape time."""

    def __init__(self, engine, model_name: str, max_model_len: int):
        self.engine, self.model_name, self.max_model_len = engine, model_name, max_model_len

    def collect(self):
        s = self.engine.stats()
        # one sample per data-parallel replica, labelled replica="0", "1", ...
        per = s.get("replicas", [s])
        if len(per) > 1:  # requests handed to the engine thread but not yet routed
            per = [dict(r) for r in per]
            per[0]["num_waiting"] += s["num_waiting"] - sum(r["num_waiting"] for r in per)
        labels = ["model_name", "replica", "engine"]  # engine: vLLM's name for the replica's index
        for name, doc, key in (
                ("num_requests_running", "Requests (samples) holding a batch slot.", "num_running"),
                ("num_requests_waiting", "Requests (samples) waiting for a batch slot.", "num_waiting"),
                ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "kv_cache_usage"),
                ("prefix_cache_hit_rate", "Fraction of looked-up prompt blocks found in the prefix cache.",
                 "prefix_cache_hit_rate")):
            g = GaugeMetricFamily(f"jaxpaged:{name}", doc, labels=labels)
            for i, r in enumerate(per):
                g.add_metric([self.model_name, str(i), str(i)], float(r[key]))
            yield g
        g = GaugeMetricFamily("jaxpaged:num_requests_waiting_by_reason", "Waiting requests by reason: capacity "
                              "(a batch slot, KV blocks, the token budget) or deferred (an adapter that does not "
                              "fit the LoRA slots, a sample waiting for its first sample's prompt); they sum to "
                              "num_requests_waiting.", labels=labels + ["reason"])
        for i, r in enumerate(per):
            deferred = int(r.get("num_waiting_deferred", 0))
            g.add_metric([self.model_name, str(i), str(i), "capacity"], float(r["num_waiting"] - deferred))
            g.add_metric([self.model_name, str(i), str(i), "deferred"], float(deferred))
        yield g
        c = CounterMetricFamily("jaxpaged:num_preemptions", "Requests preempted (blocks freed, recomputed "
                                "later) since start.", labels=labels)
        for i, r in enumerate(per):
            c.add_metric([self.model_name, str(i), str(i)], float(r["num_preemptions"]))
        yield c
        for name, doc in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache since start."),
                          ("prefix_cache_hits", "Prompt tokens the prefix cache served since start.")):
            c = CounterMetricFamily(f"jaxpaged:{name}", doc, labels=labels)
            for i, r in enumerate(per):
                c.add_metric([self.model_name, str(i), str(i)], float(r.get(name, 0)))
            yield c
        c = CounterMetricFamily("jaxpaged:num_step_failures", "Steps that failed (their requests ended with "
                                "a 500) since start.", labels=labels)
        for i, r in enumerate(per):
            c.add_metric([self.model_name, str(i), str(i)], float(r["num_step_failures"]))
        yield c
        if all("block_size" in r for r in per):
            yield self._cache_config(per)
        if all("iteration_tokens" in r for r in per):  # an engine without step counts has no histogram
            yield self._iteration_tokens(per, labels)
        if "spec_decode_num_drafts" in per[0]:  # speculative decoding (vLLM's names)
            yield from self._spec_decode(per, labels)

    def _spec_decode(self, per, labels):
        for name, doc in (("num_drafts", "Requests x steps that carried proposals."),
                          ("num_draft_tokens", "Tokens proposed."),
                          ("num_accepted_tokens", "Proposed tokens accepted by the target.")):
            c = CounterMetricFamily(f"jaxpaged:spec_decode_{name}", doc, labels=labels)
            for i, r in enumerate(per):
                c.add_metric([self.model_name, str(i), str(i)], float(r[f"spec_decode_{name}"]))
            yield c
        c = CounterMetricFamily("jaxpaged:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, "
                                "by position in the proposal (0-based).", labels=labels + ["position"])
        for i, r in enumerate(per):
            for j, n in enumerate(r["spec_decode_num_accepted_tokens_per_pos"]):
                c.add_metric([self.model_name, str(i), str(i), str(j)], float(n))
        yield c

    def _cache_config(self, per):
        """vLLM's cache_config_info: 1, its labels the KV cache's configuration (each replica's)."""
        keys = ["block_size", "num_gpu_blocks", "cache_dtype", "kv_cache_size_tokens", "kv_cache_max_concurrency",
                "engine"]
        g = GaugeMetricFamily("jaxpaged:cache_config_info", "Information of the KV cache's configuration.",
                              labels=keys)
        for i, r in enumerate(per):
            size = r["kv_blocks_total"] * r["block_size"]
            g.add_metric([str(r["block_size"]), str(r["kv_blocks_total"]), str(r.get("kv_cache_dtype")), str(size),
                          str(size / self.max_model_len), str(i)], 1.0)
        return g

    def _iteration_tokens(self, per, labels):
        """Tokens per engine step (vLLM's iteration_tokens_total), from each replica's step counts."""
        h = HistogramMetricFamily("jaxpaged:iteration_tokens_total", "Tokens of each engine step that gave "
                                  "tokens: its new tokens and the computed prompts of the requests it gave their "
                                  "first (as vLLM's).", labels=labels)
        for i, r in enumerate(per):
            it = r["iteration_tokens"]
            total, cum = 0, []
            for bound, n in zip(list(it["buckets"]) + ["+Inf"], it["counts"]):
                total += n
                cum.append((str(float(bound)) if bound != "+Inf" else bound, float(total)))
            h.add_metric([self.model_name, str(i), str(i)], cum, float(it["sum"]))
        return h


class Metrics:
    def __init__(self, engine, model_name: str, max_model_len: int = 4096):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        lbl = ["model_name"]
        self.prompt_tokens = Counter("jaxpaged:prompt_tokens", "Prompt tokens processed.", lbl,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("jaxpaged:generation_tokens", "Tokens generated.", lbl,
                                         registry=r).labels(model_name)
        self.requests = Counter("jaxpaged:request_success", "Requests ended, by finish reason.",
                                lbl + ["finished_reason"], registry=r)
        self.ttft = Histogram("jaxpaged:time_to_first_token_seconds", "Time to first token.", lbl,
                              buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("jaxpaged:request_time_per_output_token_seconds", "Mean time per output token "
                              "after the first, per request.", lbl, buckets=_ITL_BUCKETS,
                              registry=r).labels(model_name)
        for attr, name, doc in (
                ("queue", "request_queue_time_seconds", "Arrival to first scheduled (WAITING phase)."),
                ("prefill", "request_prefill_time_seconds", "First scheduled to first token (PREFILL phase)."),
                ("decode", "request_decode_time_seconds", "First token to last token (DECODE phase)."),
                ("inference", "request_inference_time_seconds", "First scheduled to last token (RUNNING phase).")):
            setattr(self, attr, Histogram(f"jaxpaged:{name}", doc, lbl, buckets=_PHASE_BUCKETS,
                                          registry=r).labels(model_name))
        self.itl = Histogram("jaxpaged:inter_token_latency_seconds", "Time between a request's tokens of one "
                             "step and of the next.", lbl, buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("jaxpaged:e2e_request_latency_seconds", "Arrival to last token.", lbl,
                             buckets=_PHASE_BUCKETS, registry=r).labels(model_name)
        tokens = buckets_1_2_5(max_model_len)
        for attr, name, doc, buckets in (
                ("req_prompt", "request_prompt_tokens", "Prompt tokens of each finished request.", tokens),
                ("req_generation", "request_generation_tokens", "Generated tokens of each finished request.", tokens),
                ("req_n", "request_params_n", "The n request parameter of each finished request.", (1, 2, 5, 10, 20)),
                ("req_max_tokens", "request_params_max_tokens", "The max_tokens request parameter (as run) of each "
                 "finished request.", tokens)):
            setattr(self, attr, Histogram(f"jaxpaged:{name}", doc, lbl, buckets=buckets, registry=r).labels(model_name))
        self.preemptions = Histogram("jaxpaged:request_num_preemptions", "Times each finished request was "
                                     "preempted.", lbl, buckets=(1, 2, 3, 4, 5, 10, 20), registry=r).labels(model_name)
        r.register(_EngineCollector(engine, model_name, max_model_len))

    def observe(self, prompt_tokens: int, output_tokens: int, finish_reason: str, ttft: float | None,
                tpot: float | None, e2e: float, n: int = 1, max_tokens: int | None = None) -> None:
        """Record one ended engine request (finish_reason 'stop' | 'length' | 'abort' | 'error'); `n`, `max_tokens`:
        its parameters (max_tokens as run: null is the rest of max_model_len)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        self.requests.labels(self.model_name, finish_reason).inc()
        if finish_reason in ("abort", "error"):
            return
        self.req_prompt.observe(prompt_tokens)
        self.req_generation.observe(output_tokens)
        self.req_n.observe(n)
        if max_tokens is not None:
            self.req_max_tokens.observe(max_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.e2e.observe(e2e)

    def observe_phases(self, metrics: dict) -> None:
        """The phases of one finished engine request from its output's timestamps (`RequestOutput.metrics`):
        queue, prefill, decode, inference and its inter-token latencies, as vLLM computes them."""
        arrival, scheduled = metrics.get("arrival_time"), metrics.get("scheduled_time")
        first, last = metrics.get("first_token_time"), metrics.get("last_token_time")
        if arrival is not None and scheduled is not None:
            self.queue.observe(max(scheduled - arrival, 0.0))
        if scheduled is not None and first is not None:
            self.prefill.observe(max(first - scheduled, 0.0))
        if first is not None and last is not None:
            self.decode.observe(max(last - first, 0.0))
        if scheduled is not None and last is not None:
            self.inference.observe(max(last - scheduled, 0.0))
        for t in metrics.get("inter_token_latencies") or ():
            self.itl.observe(t)
        self.preemptions.observe(metrics.get("num_preemptions", 0))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
