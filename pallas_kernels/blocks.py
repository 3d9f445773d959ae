"""Block sizes for the Triton-backend kernels, whose loads and stores must be powers of two."""


def largest_block(size: int, cap: int) -> int:
    """The largest power of two ≤ cap, and ≥ 16 (Triton's smallest dot and block), that divides size."""
    block = cap
    while size % block:
        block //= 2
        if block < 16:
            raise ValueError(f"a Triton kernel's blocks need a dimension divisible by 16, got {size}")
    return block
