"""Load generator for an OpenAI-compatible server; reports what vLLM's `bench serve` reports.

    jaxpaged bench serving --base-url http://127.0.0.1:8000 --num-prompts 200 \
        --request-rate 8 --max-concurrency 32 --input-len 128 --output-len 128

Prompts are random words (`--input-len` of them, about as many tokens), every request streams with
`ignore_eos` and `max_tokens=--output-len`, so output lengths are fixed; prompt and output token counts
come from each response's `usage`. Arrivals are a Poisson process at `--request-rate` per second (`inf`:
all at once), at most `--max-concurrency` in flight. Prints a table, then the JSON (also written to
`--result-json`). TTFT = first streamed text; ITL = gaps between text chunks; TPOT = (e2e - TTFT) /
(output tokens - 1), per request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def make_prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(input_len)) for _ in range(n)]


def request_body(args, model: str, prompt: str) -> tuple[str, dict]:
    body = dict(model=model, max_tokens=args.output_len, stream=True, temperature=args.temperature,
                stream_options={"include_usage": True}, ignore_eos=args.ignore_eos)
    if args.endpoint == "chat":
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", body | {"prompt": prompt}


async def one_request(client: httpx.AsyncClient, path: str, body: dict) -> Result:
    res = Result()
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices") or []:
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if res.ttft == 0.0:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
        res.e2e = time.perf_counter() - t0
        res.ok = res.output_tokens > 0 or res.ttft > 0
        if not res.ok:
            res.error = "no output"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        prompts = make_prompts(args.num_prompts + args.num_warmups, args.input_len, args.seed)
        for p in prompts[:args.num_warmups]:
            w = await one_request(client, *request_body(args, model, p))
            if not w.ok:
                raise SystemExit(f"warm-up request failed: {w.error}")
        prompts = prompts[args.num_warmups:]

        from tqdm.auto import tqdm
        bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=args.no_progress)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = np.random.default_rng(args.seed)

        async def limited(p):
            if sem is None:
                res = await one_request(client, *request_body(args, model, p))
            else:
                async with sem:
                    res = await one_request(client, *request_body(args, model, p))
            bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return summarize(args, model, results, duration)


def _stats(prefix: str, values_s: list[float]) -> dict:
    v = np.asarray(values_s, np.float64) * 1000 if values_s else np.zeros(1)
    return {f"mean_{prefix}_ms": float(v.mean()), f"median_{prefix}_ms": float(np.median(v)),
            f"std_{prefix}_ms": float(v.std()), f"p99_{prefix}_ms": float(np.percentile(v, 99))}


def summarize(args, model: str, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    inp, out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "model": model, "endpoint": args.endpoint, "base_url": args.base_url,
        "num_prompts": len(results), "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok), "errors": errors[:5],
        "total_input_tokens": inp, "total_output_tokens": out,
        "request_throughput": len(ok) / duration, "output_throughput": out / duration,
        "total_token_throughput": (inp + out) / duration,
        **_stats("ttft", [r.ttft for r in ok]), **_stats("tpot", tpots),
        **_stats("itl", [x for r in ok for x in r.itl]), **_stats("e2el", [r.e2e for r in ok]),
    }


def table(s: dict) -> str:
    rows = [("=", "Serving Benchmark Result"),
            ("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Maximum request concurrency:", s["max_concurrency"] or "unlimited"),
            ("Request rate (req/s):", s["request_rate"]),
            ("Benchmark duration (s):", f"{s['duration']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append(("-", title))
        name = key.upper()
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize() if stat != 'p99' else 'P99'} {name} (ms):",
                         f"{s[f'{stat}_{key}_ms']:.2f}"))
    lines = []
    for label, value in rows:
        if label in ("=", "-"):
            lines.append(f"{' ' + value + ' ':{label}^50}")
        else:
            lines.append(f"{label:<40}{value:<10}")
    lines.append("=" * 50)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson) or inf")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=128, help="words per prompt")
    p.add_argument("--output-len", type=int, default=128, help="tokens per response")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None, help="also write the JSON here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if (args.num_prompts < 1 or args.request_rate <= 0
            or (args.max_concurrency is not None and args.max_concurrency < 1)):
        p.error("--num-prompts, --request-rate and --max-concurrency must be positive")
    summary = asyncio.run(run(args))
    print(table(summary))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.result_json:
        with open(args.result_json, "w") as f:
            f.write(text + "\n")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
