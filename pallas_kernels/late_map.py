"""`jax.lax.map` whose output buffers come into being only when its loop runs."""

import jax
import jax.numpy as jnp


def late_map(fn, xs):
    """fn over the leading axis of the pytree xs, one slice at a time, like `jax.lax.map(fn, xs)`.

    lax.map writes into zero-initialised output buffers. XLA merges those zeros into one constant and copies
    it into every loop (at the 12B shape, 394 MB a layer, 4.5% of a pass on an H100), and its scheduler may
    place every copy at the start of the program: in a model with a loop per layer, every layer's outputs
    were then alive at once (18 GiB of a 16k-token pass). Here each output buffer is filled from a scalar of
    the loop's own inputs times zero (XLA does not fold x * 0 for floats: NaN * 0 is NaN), plus the
    output's index: no two loops' buffers are the same computation to merge, each loop writes into its own
    in place, and it comes into being only once the loop's inputs exist. Every slice is then overwritten.
    """
    n = jax.tree.leaves(xs)[0].shape[0]
    shapes, tree = jax.tree.flatten(jax.eval_shape(fn, jax.tree.map(lambda x: x[0], xs)))
    seed = sum(x.reshape(-1)[0].astype(jnp.float32) for x in jax.tree.leaves(xs)) * 0
    out = tree.unflatten([jnp.full((n, *s.shape), seed + j, s.dtype) for j, s in enumerate(shapes)])

    def one(i, out):
        y = fn(jax.tree.map(lambda x: x[i], xs))
        return jax.tree.map(lambda o, r: o.at[i].set(r), out, y)

    return jax.lax.fori_loop(0, n, one, out)
