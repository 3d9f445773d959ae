"""Run a benchmark script with the engine's programs compiled with XLA:GPU command buffers that take while
loops and conditionals too (CUDA graph conditional nodes), set per program, not through XLA_FLAGS:

    python3 benchmarks/loops_in_graphs.py benchmarks/launch_costs.py --tokenizer ... --out ...

LOOP_KINDS replaces the option's list (it replaces XLA's default list, so it names the defaults too);
LOOP_UNROLL=1 also sets xla_gpu_command_buffer_unroll_loops. The H200 result (2026-12-05) is in
results/README.md: no shorter launch of the 12B pass.
"""

import os
import runpy
import sys

import jax

import spinf_jax.engine as engine

KINDS = os.environ.get(
    "LOOP_KINDS", "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
)
OPTIONS = {"xla_gpu_enable_command_buffer": KINDS} | (
    {"xla_gpu_command_buffer_unroll_loops": True} if os.environ.get("LOOP_UNROLL") else {}
)
PROGRAMS = [
    ("_score_pass", ("graphdef", "row_tile"), ()),
    ("_extract_pass", ("graphdef", "row_tile"), ()),
    ("_read_chunk", ("graphdef",), ()),
    ("_first_candidates", ("graphdef", "tile"), ()),
    ("_decode_step", ("graphdef", "tile", "block"), ("history",)),
]

if __name__ == "__main__":
    for name, static, donate in PROGRAMS:
        fn = getattr(engine, name).__wrapped__
        jitted = jax.jit(fn, static_argnames=static, donate_argnames=donate, compiler_options=OPTIONS)
        setattr(engine, name, jitted)
    print("compiler options", OPTIONS, flush=True)
    script = sys.argv[1]
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
