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
only the chunk's last state is carried on. Both start from a given state and return the last one.
`tree_chunked` runs a packed pass of token trees the same way: the trunk from zeros, each template from the
trunk's last state and each group of option subtrees from the template's, on chunk grids that start at their
own first rows, so a question's bits depend on its trunk and itself alone (the tree-attention rule, with a
state in place of the trunk's keys).
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.scipy.linalg import solve_triangular

# A tree chunk's table row (spinf_jax.layout.Tree.recurrent_chunks): where it starts from, and which state
# it keeps for later chunks; KEEP_EXPORT + i hands its last state to the decoding of the pass's slot i.
START_ZERO, START_RUNNING, START_TRUNK, START_SLOT = range(4)
KEEP_NONE, KEEP_TRUNK, KEEP_SLOT, KEEP_EXPORT = range(4)

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
    inputs = [x.astype(jnp.float32) for x in (q, k, v, g, beta)]
    state, o = jax.lax.scan(lambda s, x: token(s, *x), state.astype(jnp.float32), inputs)
    return o, state


def token(state, q, k, v, g, beta) -> tuple[jax.Array, jax.Array]:
    """One token of the rule: state [H, Dk, Dv] f32, q, k [H, Dk], v [H, Dv], g, beta [H] → (the state after
    it, o [H, Dv]). A decode step runs this for each of its hypotheses."""
    state = state * jnp.exp(g)[:, None, None]
    predicted = jnp.einsum("hkv,hk->hv", state, k, precision=EXACT)
    state = state + jnp.einsum("hk,hv->hkv", k, beta[:, None] * (v - predicted), precision=EXACT)
    return state, jnp.einsum("hkv,hk->hv", state, q, precision=EXACT)


@partial(jax.jit, static_argnames=("chunk",))
def chunked(q, k, v, g, beta, state, *, chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """`recurrent` (the same arguments and results), `chunk` tokens at a time. The tokens are padded at the
    end to whole chunks with k = 0, β = 0 and g = 0, which leave the state as it was. In f32 throughout, as
    transformers' reference is."""
    t = q.shape[0]
    pad = -t % chunk

    def chunks(x):  # [T, H, ...] → [N, C, H, ...]
        x = jnp.pad(x.astype(jnp.float32), [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(-1, chunk, *x.shape[1:])

    path = jnp.tril(jnp.ones((chunk, chunk), bool))  # in a chain every earlier token is on the path

    def one(s, c):
        return _chunk(*c, path, s, chunk - 1)[::-1]

    state, o = jax.lax.scan(one, state.astype(jnp.float32), tuple(map(chunks, (q, k, v, g, beta))))
    return o.reshape(-1, *o.shape[2:])[:t], state


# Chunks run side by side, this many at a time (a wave): the same program for every wave, whichever chunks
# share it, so a chunk's bits depend on its rows and its start state alone. Part of the arithmetic: programs
# that should agree must share it (the engine's: wave_width()).
WAVE = {"gpu": 32}


def wave_width() -> int:
    """Chunks a wave holds on this backend: wide on GPUs, whose recurrence was a loop of one chunk a step
    (3.4% of the fp8 peak for the Qwen3.5-4B shape on the H200); narrow on the CPU, where a wave's idle
    lanes (the trunk's chunks run one per wave) cost their full share."""
    return WAVE.get(jax.default_backend(), 4)


@partial(jax.jit, static_argnames=("chunk", "exports", "width", "kernel", "interpret", "group"))
def tree_chunked(
    q,
    k,
    v,
    g,
    beta,
    span_end,
    chunks,
    *,
    chunk: int = 64,
    exports: int = 0,
    width: int = 4,
    kernel: bool = False,
    interpret: bool = False,
    group: int = 1,
):
    """The gated delta rule over a packed tree pass (models.layers.TreeBatch): q, k, v, g, beta as in
    `recurrent` for every row [T, ...], each row's span_end [T], and the pass's recurrent chunks [N, 4]
    (spinf_jax.layout.Tree.recurrent_chunks: first row, rows, where it starts, which state it keeps). → (o
    [T, H, Dv] f32, the states the chunks keeping KEEP_EXPORT + i left, [exports, H, Dk, Dv]: the
    extraction slots', which decoding starts from).

    A chunk's rows are a run of the layout whose paths leave it through one row (the trunk's last, or a
    template's last): the chunk runs from that row's state, with "earlier on the path" in place of "earlier"
    (row j is on row i's path when j ≤ i < span_end[j]). A chunk starts from the state of the chunk before it
    in the table (START_RUNNING), of its tree's trunk or of its question's template (the last chunk before it
    that kept one), or from zeros. Chunks whose start states are known run together, `width` at a time
    (`_waves`): a trunk's chunks one after another, then all the pass's templates side by side, then their
    option groups. Each wave works out its chunks' parts that need no start state (`_chunk_parts`: the
    corrections' system, decays and scores of a chunk's rows against each other), then their products with the
    start states (`_from_state`). Every wave runs the same program, so a row's bits depend on its own chunk
    and the state it starts from, never on what else the pass holds or which chunks share its wave. With
    `kernel`, each wave is one Triton program per (lane, head) (`wave_kernel`; `interpret` runs it on the
    CPU): the same arithmetic, the corrections solved row by row, in one launch instead of a few dozen XLA
    kernels. The loop over waves runs to a count the device works out, and XLA:GPU then copies its condition
    to the host before every step: with `group`, a step runs that many waves in an inner loop of a fixed
    count (idle lanes past the last wave: the same bits), one such wait a group. (Working
    out every chunk's parts before the waves, a step of 32 or 128 chunks at a time, was slower on an H100,
    43.3 and 40.0 ms a layer against 37.3 for a 16,384-row pass, and not the same bits there:
    benchmarks/results/gated_delta_layer-h100-2026-12-07-ahead.md.)"""
    t, h, _ = k.shape
    n = chunks.shape[0]
    rows = jnp.arange(chunk)

    def padded(x):  # C rows more at the end, so that every chunk's rows can be sliced whole
        return jnp.pad(x.astype(jnp.float32), [(0, chunk)] + [(0, 0)] * (x.ndim - 1))

    q, k, v, g, beta = map(padded, (q, k, v, g, beta))
    ends = jnp.pad(span_end, (0, chunk))
    source = _sources(chunks)
    table, waves = _waves(chunks, source, t, width)
    table = jnp.concatenate([table, jnp.full((group, width), n, jnp.int32)])  # idle waves past the last
    # A chunk's state is kept at its index; n holds zeros (START_ZERO's), n + 1 takes idle lanes' writes.
    firsts = jnp.append(chunks[:, 0], t)  # index n: an idle lane, no rows
    counts = jnp.append(chunks[:, 1], 0)
    start_at = jnp.append(jnp.where(source < 0, n, source), n)

    def lane(first, count):
        inside = rows < count
        take = partial(jax.lax.dynamic_slice_in_dim, start_index=first, slice_size=chunk)
        q_c, k_c, v_c, g_c, b_c = (
            jnp.where(inside.reshape(-1, *[1] * (x.ndim - 1)), take(x), 0.0) for x in (q, k, v, g, beta)
        )
        path = inside[:, None] & inside[None, :] & (rows[None, :] <= rows[:, None])
        path = path & (first + rows[:, None] < take(ends)[None, :])
        return _heads_parts(q_c, k_c, v_c, g_c, b_c, path, jnp.maximum(count - 1, 0))

    def worked_out(idx):  # [width] chunks' _chunk_parts
        return jax.vmap(lane)(firsts[idx], counts[idx])

    def wave(w, carry):
        out, states = carry
        idx = table[w]  # [width] chunk indices, n where a lane is idle
        first, count = firsts[idx], counts[idx]
        kept_at = jnp.where(idx < n, idx, n + 1)  # where each lane's last state goes
        if kernel:
            lanes = (first, count, start_at[idx], kept_at)
            return wave_kernel(q, k, v, g, beta, ends, *lanes, out, states, chunk=chunk, interpret=interpret)
        o, s = jax.vmap(_heads_from_state)(worked_out(idx), states[start_at[idx]])
        at = jnp.where(rows[None, :] < count[:, None], first[:, None] + rows[None, :], t + chunk)
        out = out.at[at].set(o, mode="drop")  # a chunk's own rows, nothing else
        states = states.at[kept_at].set(s)
        return out, states

    out = jnp.zeros(v.shape, jnp.float32)
    states = jnp.zeros((n + 2, h, k.shape[-1], v.shape[-1]), jnp.float32)
    if group > 1:  # `group` waves a step of the loop (a count fixed at compile time), the last step's idle

        def step(i, carry):
            return jax.lax.fori_loop(0, group, lambda j, c: wave(i * group + j, c), carry)

        out, states = jax.lax.fori_loop(0, -(-waves // group), step, (out, states))
    else:
        out, states = jax.lax.fori_loop(0, waves, wave, (out, states))
    keep = chunks[:, 3]
    slot = jnp.where(keep >= KEEP_EXPORT, keep - KEEP_EXPORT, exports)  # past the end: dropped
    exported_by = jnp.full(exports, n, jnp.int32).at[slot].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    return out[:t], states[exported_by]


def _sources(chunks) -> jax.Array:
    """[N] the chunk whose last state each chunk starts from (-1: zeros), from the table's START_* codes."""
    n = chunks.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    start, keep = chunks[:, 2], chunks[:, 3]

    def last_before(kept):  # the last chunk before each one that kept this state, -1 if none
        latest = jax.lax.cummax(jnp.where(keep == kept, index, -1))
        return jnp.concatenate([jnp.array([-1], jnp.int32), latest[:-1]])

    return jnp.select(
        [start == START_RUNNING, start == START_TRUNK, start == START_SLOT],
        [index - 1, last_before(KEEP_TRUNK), last_before(KEEP_SLOT)],
        -1,
    ).astype(jnp.int32)


def _waves(chunks, source, rows: int, width: int) -> tuple[jax.Array, jax.Array]:
    """The order chunks run in: each chunk's depth (how many chunks its start state goes through) by pointer
    jumping; chunks of one depth in table order, `width` to a wave. → ([N, width] chunk indices per wave, N
    where a lane is idle; how many waves). The table's padding chunks (first row past the pass) run in
    none."""
    n = chunks.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    real = chunks[:, 0] < rows
    depth, up = (source >= 0).astype(jnp.int32), source
    for _ in range(max(1, (n - 1).bit_length())):  # depth doubles its reach each round
        ahead = up >= 0
        depth = depth + jnp.where(ahead, depth[jnp.maximum(up, 0)], 0)
        up = jnp.where(ahead, up[jnp.maximum(up, 0)], -1)
    depth = jnp.where(real, depth, n)  # padding last, in no wave
    order = jnp.argsort(depth * n + index)  # by depth, then table order
    per_depth = jnp.bincount(depth, length=n + 1)[:n]
    waves_per_depth = -(-per_depth // width)
    first_wave = jnp.cumsum(waves_per_depth) - waves_per_depth
    first_of_depth = jnp.cumsum(per_depth) - per_depth
    sorted_depth = depth[order]
    rank = jnp.arange(n) - first_of_depth[jnp.minimum(sorted_depth, n - 1)]
    wave = jnp.where(sorted_depth < n, first_wave[jnp.minimum(sorted_depth, n - 1)] + rank // width, n)
    table = (
        jnp.full((n, width), n, jnp.int32).at[wave, rank % width].set(order.astype(jnp.int32), mode="drop")
    )
    return table, jnp.sum(waves_per_depth)


def _chunk(q, k, v, g, beta, path, s0, last) -> tuple[jax.Array, jax.Array]:
    """One chunk of C rows from state s0 [H, Dk, Dv]: q, k [C, H, Dk], v [C, H, Dv], g, beta [C, H] (zero on
    rows that are not the chunk's), path [C, C] (row j is on row i's path: j ≤ i, both the chunk's) and the
    row whose state to return (`last`). → (o [C, H, Dv], the state after row `last`), with the chunkwise
    (WY / UT) form of the DeltaNet papers: the rows' corrections are one unit lower triangular system."""
    return _heads_from_state(_heads_parts(q, k, v, g, beta, path, last), s0)


def _heads_parts(q, k, v, g, beta, path, last) -> list[jax.Array]:
    """`_chunk_parts` of every head ([C, H, ...] inputs): each part with a leading H."""
    return jax.vmap(_chunk_parts, in_axes=(1, 1, 1, 1, 1, None, None))(q, k, v, g, beta, path, last)


def _heads_from_state(parts: list[jax.Array], s0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`_from_state` of every head: → (o [C, H, Dv], the last state [H, Dk, Dv])."""
    o, s = jax.vmap(_from_state)(parts, s0)
    return jnp.moveaxis(o, 0, 1), s


def _dot(a, b, contract=((1,), (0,))):
    """a @ b in f32, exactly (no TF32); contract ((1,), (1,)) is a @ bᵀ, ((0,), (0,)) aᵀ @ b. 2-D only: the
    Triton kernel (wave_kernel) runs the same functions."""
    numbers = (contract, ((), ()))
    return jax.lax.dot_general(a, b, numbers, precision=EXACT, preferred_element_type=jnp.float32)


def _chunk_parts(q, k, v, g, beta, path, last, solve=None) -> list[jax.Array]:
    """What `_chunk` works out for one head before it needs the start state, from q, k [C, Dk], v [C, Dv], g,
    beta [C], path [C, C] and the row `last`, the corrections' system solved by `solve` (`_solve_by_xla`
    unless given): (the corrections' values [C, Dv] and keys from the chunk's start
    [C, Dk], the rows' decayed scores against the rows on their paths [C, C], the queries decayed from the
    start [C, Dk], the keys decayed to row `last` [C, Dk], the decay from the start to `last` [])."""
    solve = solve or _solve_by_xla
    rows = jnp.arange(path.shape[0])
    # gamma[i]: log decay from the chunk's start to row i along its path, itself included
    gamma = jnp.sum(jnp.where(path, g[None, :], 0.0), axis=-1)
    # decay[i, j] = exp(gamma_i - gamma_j) for j on i's path: what row j's write has decayed by when i reads
    decay = jnp.exp(jnp.where(path, gamma[:, None] - gamma[None, :], -jnp.inf))
    before = path & (rows[None, :] < rows[:, None])
    # The corrections solve (I + A) x = β·(values, keys decayed from the chunk's start), with A the
    # β_i k_i·k_j decay_ij of the rows j before i on its path: each row's correction net of what its path
    # already wrote for its key.
    system = jnp.where(before, beta[:, None] * _dot(k, k, ((1,), (1,))) * decay, 0.0)
    from_start = jnp.exp(gamma)
    values, keys_from_start = solve(system, beta[:, None] * v, (beta * from_start)[:, None] * k)
    within = _dot(q, k, ((1,), (1,))) * decay
    # The state after row `last`: the start state decayed along its path, plus the writes of the rows on it.
    # (Masked sums, not indexing: one nonzero term, so exact, and what a Triton program can do.)
    at_last = rows == last
    gamma_last = jnp.sum(jnp.where(at_last, gamma, 0.0))
    on_path = jnp.max(jnp.where(path & at_last[:, None], 1, 0), axis=0) > 0
    to_last = jnp.where(on_path, jnp.exp(gamma_last - gamma), 0.0)
    queries, keys_to_last = q * from_start[:, None], k * to_last[:, None]
    return [values, keys_from_start, within, queries, keys_to_last, jnp.exp(gamma_last)]


def _solve_by_xla(a, *bs) -> list[jax.Array]:
    """x with (I + a) x = b for each b, a [C, C] strictly lower triangular: XLA's triangular solve."""
    system = a + jnp.eye(a.shape[0], dtype=a.dtype)
    return [solve_triangular(system, b, lower=True, unit_diagonal=True) for b in bs]


def _solve_by_rows(a, *bs) -> list[jax.Array]:
    """`_solve_by_xla` by forward substitution, a row a step (the order of transformers' chunked reference):
    what a Triton program can run, with masked sums for the rows it reads and writes. Not XLA's solve's
    order, so not its bits."""
    rows = jnp.arange(a.shape[0])

    def step(i, xs):
        at = rows[:, None] == i
        a_i = jnp.sum(jnp.where(at, a, 0.0), axis=0)  # row i of a: the rows before i, already solved
        solved = [b - jnp.sum(a_i[:, None] * x, axis=0)[None, :] for b, x in zip(bs, xs, strict=True)]
        return [jnp.where(at, new, x) for new, x in zip(solved, xs, strict=True)]

    return jax.lax.fori_loop(1, a.shape[0], step, list(bs))


def _from_state(parts: list[jax.Array], s0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`_chunk`'s results for one head from its `_chunk_parts` and start state s0 [Dk, Dv]: two products with
    the state, one for the corrections net of what it already holds for their keys, one for the queries.
    → (o [C, Dv], the last state [Dk, Dv])."""
    values, keys_from_start, within, queries, keys_to_last, to_last = parts
    new = values - _dot(keys_from_start, s0)
    o = _dot(queries, s0) + _dot(within, new)
    return o, s0 * to_last + _dot(keys_to_last, new, ((0,), (0,)))


# Value columns a wave_kernel program takes: each column of v, the outputs and the state is worked out on its
# own (the keys' side, the same for every column, again in each program), and the [Dk, Dv] f32 state of a
# 128-wide head whole (64 KiB) beside the chunk's tiles would not fit a program's registers.
VALUE_BLOCK = 64


def wave_kernel(q, k, v, g, beta, ends, first, count, start, keep, out, states, *, chunk, interpret=False):
    """One wave of `tree_chunked` as a Pallas kernel (Triton backend), its chunks side by side: q, k
    [T + C, H, Dk], v [T + C, H, Dv], g, beta [T + C, H] f32 and ends [T + C] (tree_chunked's, padded by a
    chunk of C rows), the lanes' first rows, row counts, the states they start from and the slots their last
    states go to ([W] each; an idle lane's slot is the last, N + 1, and it writes nothing), out [T + C, H, Dv]
    and states [N + 2, H, Dk, Dv] f32. → (out with the lanes' rows written, states with their last states
    kept), both updated in place. A program per (lane, head, VALUE_BLOCK value columns). The arithmetic is
    `_chunk_parts` then `_from_state`, in their order, but for the corrections' system, solved row by row
    (`_solve_by_rows`): close to the XLA waves' results, not their bits."""
    rows, heads, dk = q.shape
    dv = v.shape[2]
    lanes = first.shape[0]
    block = min(dv, VALUE_BLOCK)
    if dv % block:
        raise ValueError(f"value heads of {dv} do not split into blocks of {block} columns")
    whole = lambda lane, h, j: (0,)  # noqa: E731 - index maps are tiny lambdas by convention
    per_head = lambda lane, h, j: (0, h, 0)  # noqa: E731
    values = lambda lane, h, j: (0, h, j)  # noqa: E731
    in_specs = [
        pl.BlockSpec((rows, None, dk), per_head),
        pl.BlockSpec((rows, None, dk), per_head),
        pl.BlockSpec((rows, None, block), values),
        pl.BlockSpec((rows, None), lambda lane, h, j: (0, h)),
        pl.BlockSpec((rows, None), lambda lane, h, j: (0, h)),
        pl.BlockSpec((rows,), whole),
        *[pl.BlockSpec((lanes,), whole)] * 4,
        pl.BlockSpec((rows, None, block), values),
        pl.BlockSpec((states.shape[0], None, dk, block), lambda lane, h, j: (0, h, 0, j)),
    ]
    return pl.pallas_call(
        partial(_wave_program, chunk=chunk),
        out_shape=tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (out, states)),
        grid=(lanes, heads, dv // block),
        in_specs=in_specs,
        out_specs=(in_specs[-2], in_specs[-1]),
        input_output_aliases={10: 0, 11: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gated_delta_wave",
    )(q, k, v, g, beta, ends, first, count, start, keep, out, states)


def _wave_program(
    q_ref, k_ref, v_ref, g_ref, beta_ref, ends_ref, first_ref, count_ref, start_ref, keep_ref,
    _out_in, _states_in, out_ref, states_ref, *, chunk,
):  # fmt: skip
    """One lane's chunk for one head and one block of value columns (wave_kernel)."""
    lane = pl.program_id(0)
    first, count = first_ref[lane], count_ref[lane]

    # An idle lane keeps its state in the last slot, which nothing reads: it does nothing. (A chunk of no
    # rows is not idle: an empty template's hands its start state on.)
    @pl.when(keep_ref[lane] < states_ref.shape[0] - 1)
    def _():
        rows = jnp.arange(chunk, dtype=jnp.int32)
        inside = rows < count
        span = pl.ds(first, chunk)

        def load(ref, *rest):
            return jnp.where(inside.reshape(-1, *[1] * len(rest)), ref[(span, *rest)], 0.0)

        q, k, v = load(q_ref, slice(None)), load(k_ref, slice(None)), load(v_ref, slice(None))
        g, beta = load(g_ref), load(beta_ref)
        path = inside[:, None] & inside[None, :] & (rows[None, :] <= rows[:, None])
        path = path & (first + rows[:, None] < ends_ref[span][None, :])
        parts = _chunk_parts(q, k, v, g, beta, path, jnp.maximum(count - 1, 0), _solve_by_rows)
        o, s = _from_state(parts, states_ref[start_ref[lane]])
        plgpu.store(out_ref.at[span, :], o, mask=inside[:, None])
        states_ref[keep_ref[lane]] = s
