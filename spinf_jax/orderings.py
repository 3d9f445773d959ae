"""Option-order averaging, shared by decisions (spinf_jax.decisions) and {?} queries (spinf_jax.scoring):
which orders of a question's options are asked, and how their answers combine.

Small models lean toward the option listed first. Asking the same question with the options listed in
other orders, each a branch of the same read, and averaging the answers in log space cancels that lean.
Every sum here runs in a canonical order (orderings and options by the options' ids), so a combination's
bits do not depend on the order the options or the orderings were listed in.
"""

import itertools

import numpy as np

from spinf_jax import api

MAX_ALL = 4  # "all" asks n! orderings: 24 at 4 options, 120 at 5


def orders(n: int, which: str | None) -> list[tuple[int, ...]]:
    """The option orders asked, as indices into the options as listed; the listed order first."""
    if which is None:
        return [tuple(range(n))]
    if which == "rotations":
        return [tuple((k + j) % n for j in range(n)) for k in range(n)]
    return list(itertools.permutations(range(n)))


def count_error(n: int, which: str | None) -> str | None:
    """Why these orderings may not be asked of n options, or None."""
    if which == "all" and n > MAX_ALL:
        return (
            f'"all" orderings of {n} options would be {np.prod(range(1, n + 1)):,} prompts; it is allowed up '
            f'to {MAX_ALL} options: use "rotations"'
        )
    return None


def distribution(logprobs: np.ndarray) -> np.ndarray:
    """Log-probabilities (or logits) → probabilities over them, summed in the order given."""
    weights = np.exp(logprobs - np.max(logprobs))
    return weights / np.sum(weights)


def by_id(normalise, values: np.ndarray, ids) -> np.ndarray:
    """normalise(values), computed over the options sorted by id: the same bits however they are listed."""
    canonical = np.argsort(np.array(list(ids), dtype=object))
    out = np.empty(len(ids))
    out[canonical] = normalise(np.asarray(values)[canonical])
    return out


def combine(ids, asked: list[tuple[int, ...]], probabilities: list[np.ndarray]) -> api.Combined:
    """The orderings' log-mean: per option, the mean over orderings of its log-probability (each ordering's
    probabilities given per option, in the options' listed order), renormalised; with the top option's id,
    the share of orderings that agree with it, and the largest range of an option's probability across
    orderings."""
    canonical = sorted(range(len(asked)), key=lambda k: [ids[i] for i in asked[k]])
    total = np.zeros(len(ids))
    for k in canonical:
        total = total + np.log(probabilities[k])
    p = by_id(distribution, total / len(asked), ids)
    top = int(np.argmax(p))
    each = np.array(probabilities)  # [orderings, options]
    return api.Combined(
        method="log-mean",
        orderings=len(asked),
        probabilities=p.tolist(),
        top=ids[top],
        agreement=float(np.mean(np.argmax(each, axis=1) == top)),
        spread=float(np.max(np.max(each, axis=0) - np.min(each, axis=0))),
    )
