"""The gated delta rule: the recurrence of Qwen3.5's Gated DeltaNet layers (issue 27).

Per value head, a state S [Dk, Dv] (f32) is carried over the tokens; token t decays it, corrects what it
predicts for the token's key towards the token's value, and is read by the token's query:

    S ← exp(g_t) · S
    S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t)
    o_t = Sᵀ q_t

q and k come in L2-normalised and q scaled (the layer does that); g_t ≤ 0 is the log decay, β_t in (0, 1)
how far the token's value overwrites what the state held for its key.

`recurrent` is the definition, a token at a time. `chunked` computes it `chunk` tokens at a time with the
chunkwise (WY / UT) form of the DeltaNet papers: within a chunk the corrections are one triangular solve, and
only the chunk's last state is carried on. Both start from a given state and return the last one: in a tree,
the trunk runs from zeros, and each branch from the trunk's last state on a chunk grid that starts at the
branch's first token, so a branch's bits depend on its trunk and itself alone (the tree-attention rule, with a
state in place of the trunk's keys).
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

EXACT = jax.lax.Precision.HIGHEST


@jax.jit
def recurrent(
    q: jax.Array,  # [T, H, Dk]
    k: jax.Array,  # [T, H, Dk]
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H] log decay, ≤ 0
    beta: jax.Array,  # [T, H]
    state: jax.Array,  # [H, Dk, Dv] f32
) -> tuple[jax.Array, jax.Array]:  # o [T, H, Dv] f32, the last state [H, Dk, Dv]
    def step(s, token):
        q_t, k_t, v_t, g_t, b_t = token
        s = s * jnp.exp(g_t)[:, None, None]
        predicted = jnp.einsum("hkv,hk->hv", s, k_t, precision=EXACT)
        s = s + jnp.einsum("hk,hv->hkv", k_t, b_t[:, None] * (v_t - predicted), precision=EXACT)
        return s, jnp.einsum("hkv,hk->hv", s, q_t, precision=EXACT)

    inputs = [x.astype(jnp.float32) for x in (q, k, v, g, beta)]
    state, o = jax.lax.scan(step, state.astype(jnp.float32), inputs)
    return o, state


@partial(jax.jit, static_argnames=("chunk",))
def chunked(q, k, v, g, beta, state, *, chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """`recurrent` (the same arguments and results), `chunk` tokens at a time. The tokens are padded at the
    end to whole chunks with k = 0, β = 0 and g = 0, which leave the state as it was. In f32 throughout, as
    transformers' reference is."""
    t = q.shape[0]
    pad = -t % chunk

    def chunks(x):  # [T, H, ...] → [N, H, C, ...]
        x = jnp.pad(x.astype(jnp.float32), [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        x = x.reshape(-1, chunk, *x.shape[1:])
        return jnp.moveaxis(x, 1, 2)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    gamma = jnp.cumsum(g, axis=-1)  # [N, H, C]: log decay from the chunk start to each token, itself included
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    # decay[i, j] = exp(gamma_i - gamma_j) for j ≤ i: what token j's write has decayed by when token i reads
    decay = jnp.exp(jnp.where(lower, gamma[..., :, None] - gamma[..., None, :], -jnp.inf))
    kk = jnp.einsum("nhik,nhjk->nhij", k, k, precision=EXACT)
    # The corrections of a chunk solve (I + A) x = β·(values, keys decayed from the chunk's start), with A
    # the strictly lower β_i k_i·k_j decay_ij: each token's correction net of what the chunk's earlier ones
    # already wrote for its key.
    system = jnp.where(jnp.tril(lower, -1), beta[..., :, None] * kk * decay, 0.0)
    system = system + jnp.eye(chunk, dtype=jnp.float32)
    solve = partial(solve_triangular, lower=True, unit_diagonal=True)
    values = solve(system, beta[..., None] * v)  # [N, H, C, Dv]
    from_start = jnp.exp(gamma)  # [N, H, C]
    keys_from_start = solve(system, (beta * from_start)[..., None] * k)  # [N, H, C, Dk]
    within = jnp.einsum("nhik,nhjk->nhij", q, k, precision=EXACT) * decay  # [N, H, C, C]
    q_from_start = q * from_start[..., None]
    k_to_end = k * jnp.exp(gamma[..., -1:] - gamma)[..., None]
    chunk_decay = jnp.exp(gamma[..., -1])[..., None, None]  # [N, H, 1, 1]

    def one(s, c):  # s [H, Dk, Dv]
        values, keys_from_start, within, q_from_start, k_to_end, chunk_decay = c
        new = values - jnp.einsum("hck,hkv->hcv", keys_from_start, s, precision=EXACT)
        o = jnp.einsum("hck,hkv->hcv", q_from_start, s, precision=EXACT)
        o = o + jnp.einsum("hij,hjv->hiv", within, new, precision=EXACT)
        s = s * chunk_decay + jnp.einsum("hck,hcv->hkv", k_to_end, new, precision=EXACT)
        return s, o

    per_chunk = (values, keys_from_start, within, q_from_start, k_to_end, chunk_decay)
    state, o = jax.lax.scan(one, state.astype(jnp.float32), per_chunk)  # o [N, H, C, Dv]
    n, h, c, dv = o.shape
    return jnp.moveaxis(o, 2, 1).reshape(n * c, h, dv)[:t], state
