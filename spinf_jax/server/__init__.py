"""The HTTP layer: the hosted spinf scoring API on Litestar, over one engine thread."""
