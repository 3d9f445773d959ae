"""Text → token ids. The engine only ever sees ids; this layer owns BOS handling and tokenizer loading.

Pieces (content, filled template, option) are encoded separately without special tokens; the caller adds
BOS once at the start of a sequence when the model's tokenizer wants one. That flag comes from the
checkpoint (GGUF `tokenizer.ggml.add_bos_token`, or what a Hugging Face tokenizer does to plain text):
Gemma without its BOS gives garbage scores.
"""

import functools
import json
import os
from pathlib import Path

import jinja2.sandbox
import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

# We use transformers only for its GGUF tokenizer converters; its import-time notice that PyTorch is missing
# is noise for us (torch is deliberately not installed). A user's own TRANSFORMERS_VERBOSITY still wins.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# llama.cpp token types
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_id: int | None,
        add_bos: bool,
        chat_template: str | None = None,
        eos_id: int | None = None,
    ):
        self.backend = backend
        self.bos_id = bos_id
        self.add_bos = add_bos and bos_id is not None
        self.chat_template = chat_template  # Jinja source, as the checkpoint carries it; None for base models
        self.eos_id = eos_id

    def encode(self, text: str) -> list[int]:
        """Token ids of one piece of text, no special tokens added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def prefix(self) -> list[int]:
        """What starts every sequence: [BOS] or nothing."""
        return [self.bos_id] if self.add_bos else []

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The text of a conversation as the model's chat template writes it, ending where the assistant's
        reply starts (add_generation_prompt), with thinking off where the template offers it
        (enable_thinking=False: Qwen3 and Qwen3.5 then write an empty think block, and the reply's first token
        is the answer). Rendered in Jinja's sandbox: a template is data from the checkpoint, not code we
        trust."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        token = self.backend.id_to_token
        return _compile_template(self.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            enable_thinking=False,
            bos_token=token(self.bos_id) if self.bos_id is not None else "",
            eos_token=token(self.eos_id) if self.eos_id is not None else "",
        )

    def save(self, folder: Path) -> None:
        """tokenizer.json and tokenizer_config.json: the files `from_folder` reads back into this tokenizer
        (how `spinf-jax quantize` gives a checkpoint made from a GGUF file its tokenizer)."""
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        token = self.backend.id_to_token
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token(self.bos_id) if self.bos_id is not None else None,
            "eos_token": token(self.eos_id) if self.eos_id is not None else None,
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        (folder / "tokenizer_config.json").write_text(
            json.dumps({k: v for k, v in config.items() if v is not None}, indent=2, ensure_ascii=False)
            + "\n"
        )

    @staticmethod
    def from_folder(folder: Path) -> "Tokenizer":
        folder = Path(folder)
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        bos_id, eos_id = (_special_id(backend, config.get(name)) for name in ("bos_token", "eos_token"))
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:  # no flag: BOS is wanted exactly when the tokenizer's own post-processor adds it
            ids = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos_id is not None and ids[:1] == [bos_id]
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one scores
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return Tokenizer(backend, bos_id, add_bos, template, eos_id)

    @staticmethod
    def from_gguf(gguf_file) -> "Tokenizer":
        """Build the tokenizer from a GGUF file's metadata (vocabulary, scores or merges, special ids)."""
        if gguf_file.field("tokenizer.ggml.model") in ("llama", "gemma4"):
            backend = _sentencepiece_bpe(gguf_file)
        else:  # byte-level BPE with merges in the file (gpt2-style): transformers' converter reads it
            # Imported here: it takes most of a second, and Gemma's GGUF files (the default model's) and every
            # tokenizer.json need none of it.
            from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS, GGUF_TOKENIZER_MAPPING

            fields = {}
            for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
                value = gguf_file.field("tokenizer." + key)
                if value is not None:
                    fields[name] = list(value) if isinstance(value, list | np.ndarray) else value
            model_type = gguf_file.config["model_type"]
            converter = GGUF_TO_FAST_CONVERTERS[_SAME_TOKENIZER_AS.get(model_type, model_type)]
            backend = converter(fields).converted()
        return Tokenizer(
            backend,
            gguf_file.field("tokenizer.ggml.bos_token_id"),
            bool(gguf_file.field("tokenizer.ggml.add_bos_token", False)),
            gguf_file.field("tokenizer.chat_template"),
            gguf_file.field("tokenizer.ggml.eos_token_id"),
        )


# transformers has no GGUF tokenizer converter under these model types: theirs is another family's.
_SAME_TOKENIZER_AS = {"qwen3_5_moe_text": "qwen3_5_text"}


def _special_id(backend: tokenizers.Tokenizer, token: str | dict | None) -> int | None:
    token = token.get("content") if isinstance(token, dict) else token
    return backend.token_to_id(token) if token else None


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


@functools.cache
def _compile_template(source: str) -> jinja2.Template:
    # The settings chat templates are written for (transformers renders them the same way).
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def _sentencepiece_bpe(gguf_file) -> tokenizers.Tokenizer:
    """A SentencePiece-style BPE vocabulary (GGUF tokenizer model "llama", e.g. Gemma 3, or "gemma4") as a
    `tokenizers` BPE: the merges the file holds (Gemma 4's, from its tokenizer.json), else merges made from
    the pieces' scores (_merges_by_score).
    """
    tokens = gguf_file.field("tokenizer.ggml.tokens")
    types = gguf_file.field("tokenizer.ggml.token_type")
    pieces = [t.replace(" ", "▁") for t in tokens]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = gguf_file.field("tokenizer.ggml.merges")
    if merges is None:
        merges = _merges_by_score(pieces, vocab, gguf_file.field("tokenizer.ggml.scores"), types)
    else:
        merges = [tuple(m.split(" ", 1)) for m in merges]
    unk = gguf_file.field("tokenizer.ggml.unknown_token_id")
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab,
            merges,
            unk_token=pieces[unk] if unk else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = gguf_file.field("tokenizer.ggml.add_space_prefix", False)
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
    )
    return backend


def _merges_by_score(pieces: list[str], vocab: dict, scores: list[float], types: list[int]) -> list:
    """SentencePiece stores scores, not merges. A merge (left, right) exists wherever both halves of a piece
    are pieces; merges apply in order of the merged piece's score, longer left halves first, then vocabulary
    order. llama.cpp writes user-defined pieces with score -1000 where SentencePiece gives them 0, so they
    count as 0 here. This reproduces the official Gemma 3 tokenizer.json merge for merge (514,906 merges).
    (transformers builds a Unigram model from these scores instead, which splits common words apart.)
    """
    mergeable = {i for i, t in enumerate(types) if t in (_NORMAL, _USER_DEFINED)}
    ranked = []
    for i, piece in enumerate(pieces):
        if i not in mergeable:
            continue
        score = 0.0 if types[i] == _USER_DEFINED else scores[i]
        for cut in range(1, len(piece)):
            left, right = vocab.get(piece[:cut]), vocab.get(piece[cut:])
            if left in mergeable and right in mergeable:
                ranked.append(((-score, -cut, cut - len(piece), i, left, right), piece[:cut], piece[cut:]))
    ranked.sort(key=lambda m: m[0])
    return [(left, right) for _, left, right in ranked]
