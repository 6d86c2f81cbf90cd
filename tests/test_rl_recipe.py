"""The RL recipe of docs/research.md, end to end on a tiny model: roll out with processed logprobs, let a
trainer (its own plain-JAX model over the Hugging Face tensors, `jax.grad`) take a policy-gradient step,
push the weights with `update_weights` while the engine sleeps, wake it, roll out again. Every step, the
engine's logprobs of the tokens it sampled equal the trainer's recomputation within 1e-5."""
import glob
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxpaged import LLM, SamplingParams
from jaxpaged.testing.tiny_models import make_tiny_model

H, KV, HD, NL, THETA, EPS = 4, 2, 16, 2, 10000.0, 1e-6  # make_tiny_model's llama
TEMPERATURE = 0.8


def forward(w, ids):
    """The trainer's model: ids i32[L] -> logits f32[L, V] (Llama, as transformers computes it)."""
    L = ids.shape[0]
    x = w["model.embed_tokens.weight"][ids]  # [L, D]
    ang = jnp.arange(L)[:, None] / THETA ** (jnp.arange(0, HD, 2) / HD)[None, :]  # [L, HD/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]

    def rope(t):  # [L, heads, HD], rotate-half
        a, b = t[..., :HD // 2], t[..., HD // 2:]
        return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    def norm(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * g

    causal = jnp.tril(jnp.ones((L, L), bool))
    for layer in range(NL):
        p = f"model.layers.{layer}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(L, H, HD))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(L, KV, HD)).repeat(H // KV, axis=1)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(L, KV, HD).repeat(H // KV, axis=1)
        s = jnp.where(causal, jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD), -jnp.inf)  # [H, L, L]
        o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1), v).reshape(L, H * HD)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + (jax.nn.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def sampled_logprobs(w, ids, num_prompt):
    """Logprobs of ids[num_prompt:] under the sampling distribution (temperature only): f32[L - num_prompt]."""
    lp = jax.nn.log_softmax(forward(w, ids)[num_prompt - 1:-1] / TEMPERATURE, -1)
    return jnp.take_along_axis(lp, ids[num_prompt:, None], -1)[:, 0]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("policy")), "llama", seed=7, initializer_range=0.1)


def test_policy_gradient_loop(policy, engine_kwargs):
    llm = LLM(model=policy, logprobs_mode="processed_logprobs", **engine_kwargs)
    w = {k: jnp.asarray(v) for f in glob.glob(f"{policy}/*.safetensors") for k, v in load_file(f).items()}
    prompts = [[5 + i, 9, 13 + 3 * i, 2 * i + 40] for i in range(4)]
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=6, seed=100 * i, logprobs=0, ignore_eos=True)
              for i in range(len(prompts))]

    def loss(w, seqs, advantages):  # REINFORCE: -(advantage * log pi(sampled tokens))
        return -sum(a * sampled_logprobs(w, jnp.array(ids), 4).sum() for ids, a in zip(seqs, advantages))

    grad = jax.jit(jax.grad(loss))
    rewards = []
    for step in range(3):
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                   use_tqdm=False)]
        seqs = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
        for ids, o in zip(seqs, outs):
            engine_lp = [lp[t] for t, lp in zip(o.token_ids, o.logprobs)]
            np.testing.assert_allclose(engine_lp, sampled_logprobs(w, jnp.array(ids), 4), rtol=0, atol=1e-5,
                                       err_msg=f"step {step}")
        r = np.array([np.mean([t % 2 == 0 for t in o.token_ids]) for o in outs])  # reward: even token ids
        rewards.append(r.mean())
        g = grad(w, [jnp.array(s) for s in seqs], list(r - r.mean()))
        w = {k: v - 0.5 * g[k] for k, v in w.items()}
        llm.sleep(level=2)  # the trainer has the devices; the engine's weights are stale anyway
        llm.update_weights([(k, np.asarray(v)) for k, v in w.items()])
        llm.wake_up()
        params = [SamplingParams(**{**p.__dict__, "seed": p.seed + 1}) for p in params]  # fresh samples
    assert len(set(rewards)) > 1  # the rollouts changed with the weights
