"""PNG figures from the benchmark JSON files (any subset of them).

    jaxpaged bench plot --throughput results/throughput.json --memory results/memory.json \
        --prefix results/prefix.json --host results/host.json --out-dir docs/figures

Figures: throughput.png (output and total tok/s by backend), latency.png (per-request latency and TTFT
distributions by backend), memory.png (KV positions over time, paged vs contiguous), prefix.png (TTFT
with prefix caching on vs off), host.png (step time split into device and host parts by running requests).
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np


def _load(path):
    with open(path) as f:
        return json.load(f)


def _cdf(ax, xs, label):
    xs = np.sort(np.asarray(xs, float))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)


def plot_throughput(d, out_dir, plt) -> list[str]:
    res = d["results"]
    names = list(res)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(len(names))
    out = [res[n]["output_tokens_per_s"] for n in names]
    tot = [res[n]["total_tokens_per_s"] for n in names]
    ax.bar(x - 0.2, out, 0.4, label="output tok/s")
    ax.bar(x + 0.2, tot, 0.4, label="total tok/s (prompt + output)")
    for xi, v in zip(x, out):
        ax.annotate(f"{v:.0f}", (xi - 0.2, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylabel("tokens / s")
    wl = d["workload"]
    ax.set_title(f"{wl['num_prompts']} prompts ({wl['dist']}), generation only", fontsize=10)
    ax.legend(fontsize=8)
    paths = [_save(fig, out_dir, "throughput.png", plt)]

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for n in names:
        pr = res[n]["per_request"]
        _cdf(axes[0], pr["latency_s"], n)
        _cdf(axes[1], pr["ttft_s"], n)
    for ax, what in zip(axes, ("request latency (s)", "time to first token (s)")):
        ax.set_xlabel(what)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("all requests arrive at t = 0", fontsize=10)
    return paths + [_save(fig, out_dir, "latency.png", plt)]


def plot_memory(d, out_dir, plt) -> list[str]:
    s, b = d["series"], d["budget"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    p = s["paged"]
    axes[0].plot(p["used_tokens"], label="allocated (blocks x block_size)")
    axes[0].plot(p["held_tokens"], label="tokens held")
    axes[0].set_title(f"paged: waste at peak {d['paged']['waste_pct_at_peak']:.1f}%, "
                      f"peak running {d['paged']['peak_running']}", fontsize=10)
    c = s["contiguous"]
    axes[1].plot(c["reserved_tokens"], label=f"reserved (max_model_len {b['max_model_len']} each)")
    axes[1].plot(c["held_tokens"], label="tokens held")
    cm = d["contiguous_max_model_len"]
    axes[1].set_title(f"contiguous: waste at peak {cm['waste_pct_at_peak']:.1f}%, peak running {cm['peak_running']}",
                      fontsize=10)
    for ax in axes:
        ax.axhline(b["tokens"], color="k", ls="--", lw=0.8, label="KV budget")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("KV positions")
    return [_save(fig, out_dir, "memory.png", plt)]


def plot_prefix(d, out_dir, plt) -> list[str]:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in d["results"].items():
        _cdf(ax, r["per_request"]["ttft_s"], name.replace("prefix_caching_", "prefix caching "))
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"system prompt {d['workload']['shared_prefix_len']} tokens: mean TTFT "
                 f"{d['ratios']['mean_ttft_off_over_on']:.1f}x lower with caching", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return [_save(fig, out_dir, "prefix.png", plt)]


def plot_host(d, out_dir, plt) -> list[str]:
    rows = d["results"]
    labels = [str(r["running"]) for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    dev = np.array([r["device_s"] for r in rows])
    wall = np.array([r["step_wall_s"] for r in rows])
    ax.bar(x, dev / wall * 100, label="device")
    ax.bar(x, (wall - dev) / wall * 100, bottom=dev / wall * 100, label="host (not hidden)")
    for xi, r in zip(x, rows):
        ax.annotate(f"{1e3 * r['step_wall_s']:.0f} ms\neff {r['decode_efficiency_pct']:.0f}%", (xi, 101),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, labels)
    ax.set_xlabel("running requests")
    ax.set_ylabel("% of decode step time")
    ax.set_ylim(0, 125)
    ax.legend(fontsize=8, loc="lower right")
    return [_save(fig, out_dir, "host.png", plt)]


def _save(fig, out_dir, name, plt) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--throughput")
    ap.add_argument("--memory")
    ap.add_argument("--prefix")
    ap.add_argument("--host")
    ap.add_argument("--out-dir", default="docs/figures")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(args.out_dir, exist_ok=True)
    paths = []
    for path, fn in ((args.throughput, plot_throughput), (args.memory, plot_memory), (args.prefix, plot_prefix),
                     (args.host, plot_host)):
        if path:
            paths += fn(_load(path), args.out_dir, plt)
    if not paths:
        ap.error("give at least one of --throughput, --memory, --prefix, --host")
    for p in paths:
        print(p)
    return paths


if __name__ == "__main__":
    main()
