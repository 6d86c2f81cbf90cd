"""What the benchmark scripts share: arguments, models, seeded workloads, engine drivers, output.

Every script times only generation: the model is loaded and every step shape compiled before the
clock starts, and a short warm-up run goes through the engine first.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from jaxpaged.args import add_engine_args as add_engine_flags
from jaxpaged.args import engine_kwargs as engine_flag_kwargs

TIMING_NOTE = "only generation is timed (model load, compilation and a warm-up run come before the clock)"

# Random-weight models with the shapes of real ones: `--model random:<preset>`.
PRESETS = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=100000.0),
    # SmolLM2-135M's depth and vocabulary with 8 query / 4 KV heads of 64, so TP 2, 4 and 8 divide it
    "llama-8h": dict(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
                     max_position_embeddings=8192, rope_theta=100000.0),
    # Llama-3.2-1B's shapes (sleep / wake timings: weights of a size that matters)
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                     max_position_embeddings=8192, rope_theta=500000.0),
    # Llama-3.2-1B's body with the default model's 49k vocabulary, bfloat16 weights and its tokenizer
    # (WITH_TOKENIZER): the 1B-class model of the quantization benches, remade the same on any machine
    "llama-1b-smol": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                          max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                 max_position_embeddings=2048, rope_theta=10000.0),
}

WITH_TOKENIZER = ("llama-1b-smol",)  # bfloat16 weights and the default model's tokenizer files
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")  # random:<WITH_TOKENIZER preset>-<type>: make_random_gguf
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

_WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be has "
          "had one first new after also who their two its time year people city world school music film "
          "river house water light game team group story night war history book line power form church "
          "system state village country family field north south record song century series language "
          "market island station road garden company season study paper model engine memory block page "
          "number small large early late local public great little long old young").split()


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- arguments ------------------------------------------------------------------------------
def add_engine_args(ap, *, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=None,
                    num_kv_blocks=None, exclude=()):
    """The engine flags (jaxpaged/args.py), with the benches' defaults (float32, no progress bars and
    the script's sizes), and --json. `exclude`: engine flags the script declares its own way."""
    helps = dict(model="model directory, GGUF file, or random:smollm2-135m / random:llama-1b-smol / random:tiny "
                       "(random weights, real shapes; random:llama-1b-smol-q8_0 / -q4_0 / -q4_1 / -q4_k: that "
                       "model as a GGUF of that type); "
                       "default: the embedded default model, SmolLM2-135M-Instruct")
    if max_model_len is None:
        helps["max_model_len"] = "longest prompt + output (default: the longest request the workload can draw)"
    add_engine_flags(ap, exclude=exclude, helps=helps, defaults=dict(
        dtype="float32", show_progress=False, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, num_kv_blocks=num_kv_blocks))
    ap.add_argument("--json", metavar="PATH", help="write the results here as JSON")


def add_workload_args(ap, *, num_prompts, prompt_len, output_len):
    g = ap.add_argument_group("workload (seeded; EOS is ignored, so output lengths are as drawn)")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--dist", default="uniform", choices=["uniform", "sharegpt"],
                   help="length distribution; sharegpt: long-tailed log-normal like chat traffic")
    g.add_argument("--prompt-len", type=int, nargs=2, default=list(prompt_len), metavar=("MIN", "MAX"))
    g.add_argument("--output-len", type=int, nargs=2, default=list(output_len), metavar=("MIN", "MAX"))
    g.add_argument("--random-tokens", action="store_true",
                   help="random token ids instead of tokenized text (always so for a model without tokenizer)")


# -- models ---------------------------------------------------------------------------------
def resolve_model(spec: str | None) -> str:
    """A model directory: the default model (fetched and converted once), a random preset (a GGUF preset's and
    a GGUF file's: the directory the engine loads the file from, `gguf_load.gguf_model_dir`), or a path."""
    if spec is None:
        from jaxpaged.checkpoints.default_model import default_model_dir
        return default_model_dir(verbose=True)
    if spec.startswith("random:"):
        name = spec.split(":", 1)[1]
        preset, _, qtype = name.rpartition("-")
        if name in PRESETS or preset not in PRESETS:
            return make_random_model(name)
        return make_random_gguf(preset, qtype.upper())
    from jaxpaged.checkpoints.gguf_load import gguf_model_dir, is_gguf_file
    if is_gguf_file(spec):
        return gguf_model_dir(spec)  # loads from the file, kept quantized (jaxpaged/checkpoints/gguf_load.py)
    if not os.path.isdir(spec):
        raise SystemExit(f"--model {spec}: no such directory or GGUF file")
    return spec


def make_random_model(preset: str, root: str | None = None) -> str:
    """Save (once) a random Llama model of a preset's shapes, without tokenizer (bfloat16, with the default
    model's tokenizer for WITH_TOKENIZER presets); return its directory."""
    if preset not in PRESETS:
        raise SystemExit(f"unknown random preset {preset!r}; choose from {', '.join(PRESETS)}")
    from jaxpaged.config import default_cache_dir
    path = os.path.join(root or os.path.join(default_cache_dir(), "bench-models"), f"random-{preset}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import tempfile

    import torch
    import transformers as tf
    say(f"creating random model {preset} in {path}")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**PRESETS[preset], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    model = tf.LlamaForCausalLM(cfg)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(path))
    if preset in WITH_TOKENIZER:
        import shutil

        from jaxpaged.checkpoints.default_model import default_model_dir
        model = model.to(torch.bfloat16)
        source = default_model_dir(verbose=True)
        for name in _TOKENIZER_FILES:
            shutil.copy(os.path.join(source, name), os.path.join(tmp, name))
    model.save_pretrained(tmp, safe_serialization=True)
    try:
        os.rename(tmp, path)
    except OSError:  # made concurrently by another run
        pass
    return path


def make_random_gguf(preset: str, qtype: str, root: str | None = None) -> str:
    """`random:<preset>-<type>` (e.g. random:llama-1b-smol-q4_k): the random model of a WITH_TOKENIZER
    preset written once as a GGUF of `qtype` (GGUF_TYPES; every matrix, the embedding included, in that type,
    norms F32) with the default model's GGUF tokenizer metadata, so llama.cpp runs the file and tokenizes as
    the engine does; returns the directory the engine loads it from (the file: `gguf_load.gguf_source`)."""
    if preset not in WITH_TOKENIZER or qtype not in GGUF_TYPES:
        raise SystemExit(f"unknown GGUF preset {preset}-{qtype.lower()}; choose from "
                         f"{', '.join(f'random:{p}-{t.lower()}' for p in WITH_TOKENIZER for t in GGUF_TYPES)}")
    from jaxpaged.checkpoints.default_model import default_gguf_path
    from jaxpaged.checkpoints.gguf_load import gguf_model_dir
    from jaxpaged.testing.gguf_files import write_gguf
    hf = make_random_model(preset, root)
    path = f"{hf}.{qtype}.gguf"
    if not os.path.isfile(path):
        say(f"writing {path}")
        tmp = f"{path}.tmp-{os.getpid()}"
        write_gguf(hf, tmp, qtype, tokenizer_from=default_gguf_path(verbose=True))
        os.replace(tmp, path)
    return gguf_model_dir(path)


def engine_kwargs(args, **over) -> dict:
    """EngineConfig's keyword arguments from the engine flags (`over` wins), less the model (the scripts
    resolve --model: resolve_model)."""
    kw = engine_flag_kwargs(args, **over)
    del kw["model"]
    return kw


def build_llm(model_dir: str, args, **over):
    from jaxpaged import LLM
    kw = engine_kwargs(args, **over)
    say(f"building engine: {', '.join(f'{k}={v}' for k, v in kw.items() if k != 'show_progress')}")
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, **kw)
    n = sum(e.runner.num_compilations for e in replica_engines(llm.engine))
    say(f"engine ready in {time.perf_counter() - t0:.1f} s ({n} step shapes)")
    return llm


def replica_engines(engine) -> list:
    """The LLMEngines behind `LLM.engine`: its replicas with data parallelism, else itself."""
    return list(getattr(engine, "engines", [engine]))


# -- workloads ------------------------------------------------------------------------------
@dataclass
class Req:
    prompt_ids: list[int]
    output_len: int
    n: int = 1
    structured_outputs: object = None  # a StructuredOutputsParams, or None


@dataclass
class Workload:
    requests: list[Req]
    info: dict = field(default_factory=dict)


def draw_lengths(rng: np.random.Generator, n: int, dist: str, lo: int, hi: int) -> np.ndarray:
    """uniform: integers in [lo, hi]. sharegpt: log-normal, median at 30% of the log-range, 2 sigma
    spanning it, clipped to [lo, hi] (most requests short, a tail of long ones)."""
    if not 1 <= lo <= hi:
        raise SystemExit(f"bad length range [{lo}, {hi}]")
    if dist == "uniform":
        return rng.integers(lo, hi + 1, n)
    span = np.log(hi / lo)
    x = rng.lognormal(np.log(lo) + 0.3 * span, max(span / 3, 1e-6), n)
    return np.clip(np.rint(x), lo, hi).astype(int)


def text_ids(tokenizer, rng: np.random.Generator, n_tokens: int) -> list[int]:
    """n_tokens token ids of random English-like text (every prompt drawn independently)."""
    ids: list[int] = []
    words = max(8, n_tokens)
    while len(ids) < n_tokens:
        text = " ".join(rng.choice(_WORDS, words)).capitalize() + "."
        ids = tokenizer.encode(text)
        words *= 2
    return ids[:n_tokens]


def prompt_ids(rng: np.random.Generator, n_tokens: int, tokenizer, vocab_size: int) -> list[int]:
    if tokenizer is None:
        return [int(t) for t in rng.integers(3, vocab_size, n_tokens)]  # clear of pad/bos/eos ids
    return text_ids(tokenizer, rng, n_tokens)


def model_vocab_and_tokenizer(model_dir: str, random_tokens: bool = False):
    """(vocab size, tokenizer or None) of a model directory, without building an engine."""
    from jaxpaged.config import ModelConfig
    from jaxpaged.core.tokenizer import Tokenizer
    return ModelConfig.from_dir(model_dir).vocab_size, None if random_tokens else Tokenizer.from_dir(model_dir)


def make_workload(args, model_dir: str, *, num_prompts=None, prefix_len=0, n=1, seed_offset=0) -> Workload:
    """The seeded workload of args (num_prompts, dist, prompt_len, output_len, random_tokens); with
    prefix_len > 0 every prompt starts with the same prefix_len tokens (a shared system prompt)."""
    vocab, tok = model_vocab_and_tokenizer(model_dir, args.random_tokens)
    rng = np.random.default_rng(args.seed + seed_offset)
    num = args.num_prompts if num_prompts is None else num_prompts
    plens = draw_lengths(rng, num, args.dist, *args.prompt_len)
    olens = draw_lengths(rng, num, args.dist, *args.output_len)
    prefix = prompt_ids(rng, prefix_len, tok, vocab) if prefix_len else []
    reqs = [Req(prefix + prompt_ids(rng, int(p), tok, vocab), int(o), n) for p, o in zip(plens, olens)]
    info = dict(num_prompts=num, dist=args.dist, prompt_len=list(args.prompt_len), output_len=list(args.output_len),
                tokens="random ids" if tok is None else "tokenized text", seed=args.seed + seed_offset,
                shared_prefix_len=prefix_len, n=n, mean_prompt_len=float(np.mean([len(r.prompt_ids) for r in reqs])),
                mean_output_len=float(np.mean(olens)), ignore_eos=True, temperature=0.0)
    return Workload(reqs, info)


def workload_max_len(args, prefix_len: int = 0) -> int:
    """The longest request the workload arguments can draw (the default max_model_len)."""
    return prefix_len + args.prompt_len[1] + args.output_len[1]


# -- driving the engine ---------------------------------------------------------------------
@dataclass
class RunRecord:
    elapsed_s: float
    num_steps: int
    prompt_tokens: list[int]
    output_tokens: list[int]   # per request, all n samples together
    ttft_s: list[float]
    latency_s: list[float]


def sampling_params(req: Req):
    from jaxpaged import SamplingParams
    return SamplingParams(n=req.n, max_tokens=req.output_len, temperature=0.0, ignore_eos=True,
                          structured_outputs=req.structured_outputs)


_run_ids = iter(range(10 ** 9))


def drive(engine, reqs: list[Req], *, batch_size: int | None = None, arrivals=None, on_step=None,
          loras=None) -> RunRecord:
    """Run reqs to completion; time from the first submission to the last finish.

    batch_size None: continuous batching (each request queued at its arrival offset, all at 0 by
    default). batch_size k: static batching, the next k requests are queued only once the engine is
    empty. on_step(engine) is called after every step (not timed separately; keep it cheap). loras: a
    LoRARequest (or None) per request."""
    tag = f"b{next(_run_ids)}"
    pending = deque(range(len(reqs)))
    index: dict[str, int] = {}
    done = {}
    t0 = time.monotonic()
    steps = 0

    def add(i):
        rid = f"{tag}-{i}"
        at = t0 + (arrivals[i] if arrivals is not None else 0.0)
        lora = {} if loras is None or loras[i] is None else dict(lora_request=loras[i])
        engine.add_request(rid, {"prompt_token_ids": reqs[i].prompt_ids}, sampling_params(reqs[i]), arrival_time=at,
                           **lora)
        index[rid] = i

    while pending or engine.has_unfinished_requests():
        now = time.monotonic()
        if batch_size is None:
            while pending and (arrivals is None or t0 + arrivals[pending[0]] <= now):
                add(pending.popleft())
        elif not engine.has_unfinished_requests():
            for _ in range(min(batch_size, len(pending))):
                add(pending.popleft())
        if not engine.has_unfinished_requests():  # idle until the next arrival
            time.sleep(max(0.0, t0 + arrivals[pending[0]] - time.monotonic()))
            continue
        for o in engine.step():
            if o.finished:
                done[index[o.request_id]] = o
        steps += 1
        if on_step is not None:
            on_step(engine)
    elapsed = time.monotonic() - t0
    outs = [done[i] for i in range(len(reqs))]
    return RunRecord(elapsed, steps, [len(r.prompt_ids) for r in reqs],
                     [sum(len(c.token_ids) for c in o.outputs) for o in outs],
                     [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs],
                     [o.metrics["finished_time"] - o.metrics["arrival_time"] for o in outs])


def warm_up(engine, vocab_size: int) -> None:
    """A few short requests through every phase (prefill, decode, finish); then forget their prefixes."""
    rng = np.random.default_rng(12345)
    lens = [min(L, engine.max_model_len - 4) for L in (5, 40, 100)]
    reqs = [Req([int(t) for t in rng.integers(3, vocab_size, L)], 4) for L in lens]
    drive(engine, reqs)
    engine.block_manager.reset_prefix_cache()


# -- results --------------------------------------------------------------------------------
def dist_stats(xs) -> dict:
    xs = np.asarray([x for x in xs if x is not None], float)
    if not len(xs):
        return {}
    return dict(mean=float(xs.mean()), p50=float(np.percentile(xs, 50)), p90=float(np.percentile(xs, 90)),
                p99=float(np.percentile(xs, 99)), max=float(xs.max()))


def summarize(rec: RunRecord) -> dict:
    n, p, o, t = len(rec.output_tokens), sum(rec.prompt_tokens), sum(rec.output_tokens), rec.elapsed_s
    return dict(requests_per_s=n / t, output_tokens_per_s=o / t, total_tokens_per_s=(p + o) / t, elapsed_s=t,
                num_requests=n, prompt_tokens=p, output_tokens=o, num_steps=rec.num_steps,
                ttft_s=dist_stats(rec.ttft_s), latency_s=dist_stats(rec.latency_s),
                per_request=dict(ttft_s=list(rec.ttft_s), latency_s=list(rec.latency_s),
                                 output_tokens=list(rec.output_tokens)))


def machine_info() -> dict:
    import jax
    return dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), python=platform.python_version(), jax=jax.__version__,
                jax_backend=jax.default_backend(), devices=[str(d) for d in jax.devices()], **cpu_info())


def cpu_info() -> dict:
    """The CPU's model name and flags (Linux /proc/cpuinfo; empty elsewhere): the vector units (avx512f,
    avx512_bf16, amx...) decide which products XLA's CPU backend runs natively."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return {}
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return dict(cpu_model=fields.get("model name"), cpu_flags=fields.get("flags", "").split())


def write_json(path: str | None, obj: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
        say(f"wrote {path}")


def table(rows: list[list], headers: list[str]) -> str:
    cells = [[h for h in headers]] + [[f"{c:.3g}" if isinstance(c, float) and abs(c) < 1000 else
                                       f"{c:.0f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def load_hf_model(model_dir: str, dtype: str):
    """The same weights as a transformers model (HF directories directly; converted ones by name map)."""
    import torch
    import transformers as tf

    from jaxpaged.checkpoints.weights import HF_LAYER_NAMES, HF_TOP_NAMES, is_orbax_dir, load_params
    from jaxpaged.config import ModelConfig
    tdtype = getattr(torch, dtype)
    if not is_orbax_dir(model_dir):
        return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype).eval()
    mc = ModelConfig.from_dir(model_dir)
    model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    params = load_params(model_dir, mc, "float32")

    def tensor(a, transpose):
        return torch.from_numpy(np.ascontiguousarray(a.T if transpose else a))
    state = {hf: tensor(params[ours], t) for hf, (ours, t) in HF_TOP_NAMES.items() if ours in params}
    for rest, (ours, t) in HF_LAYER_NAMES.items():
        if ours in params["layers"]:
            for i in range(mc.num_layers):
                state[f"model.layers.{i}.{rest}"] = tensor(params["layers"][ours][i], t)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and mc.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"{model_dir}: weights do not map onto transformers' model "
                           f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(tdtype).eval()


def run_info(command: str, argv: list[str] | None) -> dict:
    """What remakes a result: the command line (`jaxpaged bench <command> <flags>`) and the git commit of
    the checkout the code ran from ("+dirty" with uncommitted changes to tracked files; None outside git)."""
    import shlex
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*a):
        return subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "-uno") else "")
    except (OSError, subprocess.CalledProcessError):
        commit = None
    flags = sys.argv[1:] if argv is None else list(argv)
    return dict(command=shlex.join(["jaxpaged", "bench", command, *flags]), git_commit=commit)


def import_failure(python: str, module: str, env: dict | None = None, timeout: float = 120,
                   empty: str = "?") -> tuple[bool, str] | None:
    """None when `python -c "import module"` works (a peer's own venv); otherwise (whether `python` ran at all,
    why not: the exception, or the last line of the import's stderr, `empty` when it printed none)."""
    import subprocess
    try:
        p = subprocess.run([python, "-c", f"import {module}"], env=env, capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if p.returncode:
        return True, (p.stderr.strip().splitlines() or [empty])[-1]
    return None
