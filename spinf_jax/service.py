"""One model's scoring side, loaded once: the engine, the scorer over it (limits, prompt packs, calibration)
and the decider. The server, the CLI's `score`, `calibrate` and `packs calibrate`, Ray's actors and notebooks
each build one and use its parts; none assembles them on its own.

    service = Service.load("spinf/gemma-3-270m")
    service.score({"inputs": [...], "scoring": {...}})    # SPEC section 1 → section 2
    service.decide({"id": ..., "state": ..., "question": ..., "options": [...]})
    service.systemone({"state": ..., "questions": {"refund": {"type": "noul", "instructions": ...}}})
"""

from collections.abc import Sequence
from dataclasses import dataclass

from spinf_jax.builtin_models import DEFAULT_MODEL
from spinf_jax.calibration import Calibration
from spinf_jax.compiler import Limits
from spinf_jax.decision_apis import DecisionApis
from spinf_jax.decisions import Decider
from spinf_jax.engine import Engine
from spinf_jax.loader import random_model
from spinf_jax.packer import Buckets
from spinf_jax.packs.compiled import CompiledPack, compile_packs
from spinf_jax.packs.loader import LoadedPack
from spinf_jax.progress import Progress
from spinf_jax.scoring import Scorer


@dataclass
class Service:
    engine: Engine
    scorer: Scorer
    decider: Decider
    apis: DecisionApis  # System One and OpenAI's Decisions API

    @classmethod
    def over(
        cls,
        engine: Engine,
        packs: dict[str, LoadedPack] | None = None,
        calibration: Calibration | None = None,
        limits: Limits | None = None,
    ) -> "Service":
        """The scorer and decider over a built engine. packs: read and checked (packs.loader.load_packs),
        compiled here for the model's tokenizer; None: the official ones."""
        scorer = Scorer(
            engine, limits, packs=compile_packs(packs, engine.model.tokenizer), calibration=calibration
        )
        decider = Decider(engine, limits, calibration=calibration)
        return cls(engine, scorer, decider, DecisionApis(engine, limits, calibration))

    @classmethod
    def load(
        cls,
        model: str | None = None,
        precision: str | None = None,
        *,
        buckets: Sequence[int] | None = None,
        random_weights: str | None = None,
        progress: Progress | None = None,
        **over,
    ) -> "Service":
        """Load a model (a Hub id, a folder or a GGUF file; the default model when None) and build the rest
        (`over`'s arguments). random_weights: for benchmarks, made-up weights at the shape of this
        transformers config.json with `model`'s tokenizer (`serve --random-weights`; bf16 unless told)."""
        sized = {"buckets": Buckets(tuple(buckets))} if buckets else {}
        model = model or DEFAULT_MODEL
        if random_weights is not None:
            engine = Engine(random_model(random_weights, model, precision or "bf16"), **sized)
        else:
            engine = Engine.load(model, precision, progress=progress, **sized)
        return cls.over(engine, **over)

    @property
    def packs(self) -> dict[str, CompiledPack]:
        """The prompt packs requests may name, by id."""
        return self.scorer.packs

    def score(self, body: dict) -> dict:
        """A scoring request (SPEC section 1) → its response (section 2)."""
        return self.scorer.score(body)

    def decide(self, body: dict) -> dict:
        """A decision, or a shared request of several (SPEC section 5) → its result."""
        return self.decider.decide(body)

    def systemone(self, body: dict) -> dict:
        """A System One request ({model, state, questions: {id: {type, ...}}}) → its reply (SPEC 5b)."""
        return self.apis.systemone(body)

    def systemone_batch(self, body: dict) -> dict:
        """{states: [...], questions: {...}} → {results: [a System One reply per state], total_usage}."""
        return self.apis.systemone_batch(body)

    def decisions(self, body: dict) -> dict:
        """An OpenAI Decisions request ({model, input, questions: [...]}) → its reply."""
        return self.apis.decisions(body)
