"""Short answers: read the number or money amount written in one, and know which tokens may spell one.

Extraction slots ({*} text, {n} number, {$} amount) decode a few tokens under a mask of the vocabulary, then
parse what was written. Parsing is locale-free: the separators written decide what they mean.
"""

import functools
import re
from dataclasses import dataclass

import numpy as np

# ISO 4217 codes accepted as a written currency: the common ones, so that any three capitals ("THE", "CEO")
# are not read as a currency.
CURRENCY_CODES = frozenset({
    "USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "NZD", "CNY", "HKD", "SGD", "INR", "KRW", "TWD",
    "THB", "IDR", "MYR", "PHP", "SEK", "NOK", "DKK", "PLN", "CZK", "HUF", "RUB", "TRY", "ILS", "AED",
    "SAR", "ZAR", "BRL", "MXN", "ARS"
})  # fmt: skip
CURRENCY_SYMBOLS = {"US$": "USD", "$": "USD", "€": "EUR", "£": "GBP", "¥": "JPY", "₹": "INR"}
# Powers of ten of the suffixes written after an amount ("$5bn", "12 k EUR").
MULTIPLIERS = {"k": 3, "K": 3, "m": 6, "M": 6, "mn": 6, "bn": 9, "B": 9}
# Tokens that end a generation: end of sequence or end of turn, under the names models give them.
END_TOKENS = (
    "<eos>",
    "</s>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|im_end|>",
    "<|eot_id|>",
)

_SIGN = "[+\\-\u2212]"  # \u2212 is the unicode minus sign
_BODY = "[0-9][0-9.,]*|[.,][0-9]+"  # digits and separators; ".5" has no integer part
_NUMBER = re.compile(rf"(?P<sign>{_SIGN})?(?P<body>{_BODY})(?:\s*(?P<percent>%))?")


def _alternatives(names) -> str:
    """A regex alternation of literal names, longest first so that "mn" wins over "m" and "US$" over "$"."""
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


_CURRENCY = _alternatives([*CURRENCY_SYMBOLS, *CURRENCY_CODES])
_AMOUNT = re.compile(
    rf"(?P<sign>{_SIGN})?\s*(?P<before>{_CURRENCY})?\s*(?P<inner_sign>{_SIGN})?(?P<body>{_BODY})"
    rf"\s*(?P<multiplier>{_alternatives(MULTIPLIERS)})?\s*(?P<after>{_CURRENCY})?"
)


def _thousands(groups: list[str]) -> bool:
    """Whether digit groups split at thousands separators group in threes: 1-3 leading digits (not a lone 0,
    so "0,500" is a half), then groups of exactly three."""
    first, rest = groups[0], groups[1:]
    return 1 <= len(first) <= 3 and not first.startswith("0") and all(len(g) == 3 for g in rest)


def _plain(body: str) -> str | None:
    """Digits and separators → the same number in Python's notation ("1.234,5" → "1234.5"), or None when
    the separators make no number."""
    seps = re.findall(r"[.,]", body)
    groups = re.split(r"[.,]", body)
    if not seps:
        return body
    if any(not g for g in groups[1:]):  # "1,,2" or "1."
        return None
    if len(set(seps)) == 2:  # the last separator is the decimal one, all before it the thousands one
        if seps[-1] in seps[:-1] or not _thousands(groups[:-1]):
            return None
        return "".join(groups[:-1]) + "." + groups[-1]
    # One kind only. Commas are thousands wherever they group in threes ("1,234"), else decimals ("3,5");
    # dots are decimals unless there are several grouping in threes ("1.234.567"). ".5" has no integer part.
    if (len(seps) > 1 or seps[0] == ",") and _thousands(groups):
        return "".join(groups)
    return (groups[0] or "0") + "." + groups[1] if len(groups) == 2 else None


def _signed(sign: str | None, plain: str) -> str:
    return ("-" if sign in ("-", "\u2212") else "") + plain


def parse_number(text: str) -> float | None:
    """The number written in a short answer ("1,234.5", "−3,5", "12.5 %" → 0.125), or None.

    A percentage is returned as the fraction it stands for. Anything else than one number (words, two
    numbers, nothing) is None.
    """
    match = _NUMBER.fullmatch(text.strip())
    plain = match and _plain(match["body"])
    if not plain:
        return None
    # Scaling in the exponent keeps the result the correctly rounded value of what was written: 0.29, not
    # 29 / 100 = 0.29000000000000004.
    return float(_signed(match["sign"], plain) + ("e-2" if match["percent"] else ""))


def parse_amount(text: str) -> tuple[float | None, str | None]:
    """(value, ISO 4217 currency) of a money amount: "$1.2bn" → (1.2e9, "USD"), "12,50 €" → (12.5, "EUR").

    A currency symbol or code may come before or after the number, a sign before either, and k/m/mn/bn/B
    multiply. (None, None) when the text is no amount; the currency is None when none is written.
    """
    match = _AMOUNT.fullmatch(text.strip())
    plain = match and _plain(match["body"])
    if not plain or (match["sign"] and match["inner_sign"]):
        return None, None
    # Written on both sides, it must be one currency: "$5 USD", not "$5 EUR".
    currencies = {CURRENCY_SYMBOLS.get(c, c) for c in (match["before"], match["after"]) if c}
    if len(currencies) > 1:
        return None, None
    exponent = MULTIPLIERS.get(match["multiplier"], 0)
    value = float(f"{_signed(match['sign'] or match['inner_sign'], plain)}e{exponent}")
    return value, next(iter(currencies), None)


# Control characters (Unicode Cc) and line or paragraph separators: never inside a one-line answer.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NUMBER_TOKEN = re.compile(" ?[0-9.,+\\-\u2212%]+")
_AMOUNT_WORDS = _alternatives([*CURRENCY_SYMBOLS, "US", *MULTIPLIERS])
_AMOUNT_TOKEN = re.compile(rf" ?(?:[A-Z]{{1,3}}|{_AMOUNT_WORDS})")  # besides number tokens


@dataclass(frozen=True, eq=False)  # identity equality: masks are arrays
class Vocabulary:
    """Which tokens may be generated inside each kind of answer slot, as [size] bool masks over token ids."""

    size: int
    text: np.ndarray  # inside a {*} answer: not special, not empty, no newline nor control character
    number: np.ndarray  # inside a {n} answer: digits, . , + - − % (after at most one leading space)
    amount: np.ndarray  # inside a {$} answer: number tokens, currency symbols and codes, k/m/bn suffixes
    newline: np.ndarray  # only whitespace with a newline: ends an answer that has no closing text
    end: np.ndarray  # end of sequence or of turn: ends an answer too
    digits: frozenset[str]  # the digits 0-9 that some number token spells
    texts: tuple[str, ...] = ()  # every token's text (empty for `anything`)

    def __post_init__(self):
        for mask in (self.text, self.number, self.amount, self.newline, self.end):
            mask.flags.writeable = False  # one Vocabulary is shared by every request: nobody may edit it

    @staticmethod
    def of(tokenizer) -> "Vocabulary":
        """Classify every token of a tokenizer by its decoded text (byte-fallback pieces such as <0x0A>
        included: that one is a newline, and <0x80>..<0xFF> decode to U+FFFD but are text, as non-ASCII
        words are spelled with them)."""
        backend = tokenizer.backend
        size = backend.get_vocab_size(with_added_tokens=True)
        texts = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        specials = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        if tokenizer.bos_id is not None:
            specials.add(tokenizer.bos_id)
        special = np.zeros(size, bool)
        special[list(specials)] = True
        ordinary = ~special

        def mask(keep) -> np.ndarray:
            return np.fromiter(map(keep, texts), bool, size) & ordinary

        # A lone space too: Gemma spells " 14" as " ", "1", "4", and a template may end before that space.
        number = mask(lambda t: t == " " or _NUMBER_TOKEN.fullmatch(t))
        end = np.zeros(size, bool)
        # Only special ones: where "</s>" is an ordinary token, it is text that a model may write.
        end[[i for i in map(backend.token_to_id, END_TOKENS) if i in specials]] = True
        return Vocabulary(
            size=size,
            text=mask(lambda t: t != "" and not _CONTROL.search(t)),
            number=number,
            amount=number | mask(_AMOUNT_TOKEN.fullmatch),
            newline=mask(lambda t: t.isspace() and "\n" in t),
            end=end,
            digits=frozenset("".join(texts[i] for i in np.flatnonzero(number))) & frozenset("0123456789"),
            texts=tuple(texts),
        )

    @staticmethod
    def anything(size: int) -> "Vocabulary":
        """For models without a tokenizer (random test models): any token may be in any answer."""
        every, none = np.ones(size, bool), np.zeros(size, bool)
        return Vocabulary(size, every, every, every, none, none, frozenset("0123456789"))

    def containing(self, text: str) -> list[int]:
        """The tokens whose text holds the first character of `text` that is not a space (an answer that
        ends at a closing text may not hold that character: it would hide the closing text in a token)."""
        char = text.strip()[:1]
        return [i for i, t in enumerate(self.texts) if char and char in t]

    def can_mask_numbers(self) -> bool:
        """Whether a {n} or {$} answer can be confined to number tokens: only if they spell every digit.
        (Digit tokens alone, " 7" or "7", satisfy this; so do longer number tokens that cover all ten.)"""
        return len(self.digits) == 10


@functools.cache  # tokenizers live as long as their model: holding them here keeps nothing else alive
def vocabulary(tokenizer) -> Vocabulary:
    """The tokenizer's Vocabulary, computed once (it decodes every token: under 1 s for 262k)."""
    return Vocabulary.of(tokenizer)
