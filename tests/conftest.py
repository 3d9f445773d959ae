import os

# Tests run on the CPU with f32 matmuls at full precision, whatever machine they are on.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
