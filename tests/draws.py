"""Random inputs for the kernels' tests, drawn with numpy: jax.random compiles a program per shape, which
cost the suite ~30 s of XLA compiles (benchmarks/results/test-suite.md, the compile profile of 2026-12-06)."""

import numpy as np


def normals(seed, *shapes) -> list[np.ndarray]:
    """Standard normal float32 arrays of these shapes, one generator seeded with `seed` drawing in order."""
    draws = np.random.default_rng(seed)
    return [draws.standard_normal(shape, np.float32) for shape in shapes]
