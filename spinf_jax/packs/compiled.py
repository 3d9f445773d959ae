"""Packs bound to a model's tokenizer: every question compiled once, when the server starts, as ordinary
queries (spinf_jax.compiler), so a question the model cannot ask (an option that merges with its template,
a template over the limit) stops the start with the file and the field, and requests reuse the tokens."""

from dataclasses import dataclass

from spinf_jax import api
from spinf_jax.compiler import Limits, Query, compile_request
from spinf_jax.errors import ScoringError
from spinf_jax.packs.format import Pack, PackError, Presentation
from spinf_jax.packs.loader import LoadedPack, load_packs


@dataclass(frozen=True)
class CompiledPack:
    loaded: LoadedPack
    queries: tuple[Query, ...]  # every question of the pack, in its order, each asked on empty content too
    empty_ids: tuple[int, ...] | None  # a wrapping pack's empty content: tokens(prefix + suffix)

    @property
    def pack(self) -> Pack:
        return self.loaded.pack

    @property
    def presentation(self) -> Presentation:
        return self.loaded.pack.presentation


def compile_pack(loaded: LoadedPack, tokenizer, limits: Limits | None = None) -> CompiledPack:
    pack = loaded.pack
    request = api.ScoreRequest(
        messages=[api.Message(content="x")],
        scoring=api.Scoring(queries=list(pack.questions), empty_floor=True),
    )
    try:
        [content] = compile_request(request, tokenizer, limits or Limits()).contents
    except ScoringError as e:
        field = (e.param or "").replace("scoring.queries", "questions")
        raise PackError(loaded.path, field, f"{e.message} ({e.code})") from None
    p = pack.presentation
    empty = None if p.bare else tuple(tokenizer.encode(p.prefix + p.suffix))
    return CompiledPack(loaded, content.queries, empty)


def compile_packs(
    loaded: dict[str, LoadedPack] | None, tokenizer, limits: Limits | None = None
) -> dict[str, CompiledPack]:
    """Packs by id, compiled for a tokenizer; loaded None: the official ones. A model without a tokenizer
    (scored from token ids) has none."""
    if tokenizer is None:
        return {}
    loaded = load_packs() if loaded is None else loaded
    return {pack_id: compile_pack(pack, tokenizer, limits) for pack_id, pack in loaded.items()}
