import pytest
import tokenizers
from tokenizers import decoders, models

from spinf_jax.answers import Vocabulary, parse_amount, parse_number, vocabulary
from spinf_jax.builtin_models import DEFAULT_MODEL
from spinf_jax.loader import open_checkpoint, resolve
from spinf_jax.tokenizer import Tokenizer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", 42.0),
        ("  -3 ", -3.0),
        ("+4", 4.0),
        ("\u22125", -5.0),  # unicode minus
        ("3.25", 3.25),
        (".5", 0.5),
        ("1,234", 1234.0),
        ("12,345,678", 12345678.0),
        ("3,5", 3.5),
        ("0,500", 0.5),  # a thousands group never starts with a lone 0
        ("1.234", 1.234),  # one dot is a decimal point
        ("1.234.567", 1234567.0),
        ("1,234.5", 1234.5),
        ("1.234.567,89", 1234567.89),
        ("12%", 0.12),
        ("12.5 %", 0.125),
        ("0.29%", 0.0029),
        ("-1,5%", -0.015),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", " ", "abc", "twelve", "1 2", "1-2", "1.", "1,,2", "1.2.3", "1,2.3", "1.2,3.4", "1,00,000", "- 5",
     "12 %%", "%", "1e5", "inf", "nan", "$5", "5 apples", "\u0663"],
)  # fmt: skip
def test_parse_number_refuses(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("5", (5.0, None)),
        ("$5", (5.0, "USD")),
        ("5$", (5.0, "USD")),
        ("$ 1,234.56", (1234.56, "USD")),
        ("US$12", (12.0, "USD")),
        ("€12,50", (12.5, "EUR")),
        ("12,50 €", (12.5, "EUR")),
        ("£3", (3.0, "GBP")),
        ("¥1000", (1000.0, "JPY")),
        ("₹ 1,234", (1234.0, "INR")),
        ("USD 100", (100.0, "USD")),
        ("100 CHF", (100.0, "CHF")),
        ("CAD5", (5.0, "CAD")),
        ("-$5", (-5.0, "USD")),
        ("$-5", (-5.0, "USD")),
        ("\u22122 EUR", (-2.0, "EUR")),
        ("5k", (5000.0, None)),
        ("2.5K USD", (2500.0, "USD")),
        ("$1.2m", (1.2e6, "USD")),
        ("1.5M EUR", (1.5e6, "EUR")),
        ("5 mn GBP", (5e6, "GBP")),
        ("$2.3bn", (2.3e9, "USD")),
        ("4B", (4e9, None)),
        ("5MXN", (5.0, "MXN")),  # a currency code, not M for million
        ("$5 USD", (5.0, "USD")),  # written twice, but the same currency
    ],
)
def test_parse_amount(text, expected):
    assert parse_amount(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "USD", "$", "five dollars", "5 dollars", "5 XYZ", "5 usd", "5%", "$5 EUR", "-$-5", "$5 6", "1,,2 €",
     "5 kk"],
)  # fmt: skip
def test_parse_amount_refuses(text):
    assert parse_amount(text) == (None, None)


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return Tokenizer.from_gguf(open_checkpoint(resolve(DEFAULT_MODEL)))


@pytest.fixture(scope="module")
def gemma_vocabulary(gemma) -> Vocabulary:
    return vocabulary(gemma)


def test_gemma_digits_are_number_tokens(gemma, gemma_vocabulary):
    v = gemma_vocabulary
    assert v.size == gemma.backend.get_vocab_size() == v.number.shape[0]
    for digit in "0123456789":
        [token] = gemma.encode(digit)
        assert v.number[token] and v.amount[token] and v.text[token]
    assert v.can_mask_numbers()
    # Gemma has no " 1" token: a space before digits is a token of its own, allowed in numbers so that a
    # template ending before that space ("A:") can still be answered " 14".
    space, one = gemma.encode(" 1")
    assert gemma.decode([space]) == " " and v.text[space] and v.number[space] and v.amount[space]
    assert v.number[one]
    assert not v.number[gemma.encode("  ")[0]]


def test_gemma_words_are_text(gemma, gemma_vocabulary):
    v = gemma_vocabulary
    for word in ("September", " September", "crème brûlée"):
        tokens = gemma.encode(word)
        assert v.text[tokens].all() and not v.number[tokens].any() and not v.amount[tokens].any()


def test_gemma_newlines_and_ends(gemma, gemma_vocabulary):
    v = gemma_vocabulary
    newlines = gemma.encode("\n") + gemma.encode("\n\n") + [gemma.backend.token_to_id("<0x0A>")]
    assert v.newline[newlines].all() and not v.text[newlines].any()
    ends = [gemma.backend.token_to_id(t) for t in ("<eos>", "<end_of_turn>")]
    assert v.end[ends].all() and not v.text[ends].any()
    assert sorted(v.end.nonzero()[0]) == sorted(ends)
    assert not v.text[gemma.bos_id] and not v.end[gemma.bos_id]


def test_gemma_byte_fallback(gemma, gemma_vocabulary):
    v = gemma_vocabulary
    # Gemma spells a hieroglyph byte by byte; alone, each byte decodes to U+FFFD, yet they are text.
    tokens = gemma.encode("𓀀")
    assert all(gemma.backend.id_to_token(t).startswith("<0x") for t in tokens) and v.text[tokens].all()
    byte = gemma.backend.token_to_id
    assert not v.text[byte("<0x00>")] and not v.text[byte("<0x09>")]  # control bytes
    assert not v.newline[byte("<0x00>")]


def test_gemma_amount_tokens(gemma, gemma_vocabulary):
    v = gemma_vocabulary
    for written in ("$", "USD", " USD", "€", "bn", " k"):
        tokens = gemma.encode(written)
        assert v.amount[tokens].all() and not v.number[tokens].any(), written


def test_vocabulary_is_computed_once_and_read_only(gemma, gemma_vocabulary):
    assert vocabulary(gemma) is gemma_vocabulary
    with pytest.raises(ValueError):
        gemma_vocabulary.text[0] = True


def word_level(words: list[str]) -> Tokenizer:
    """A whole-word tokenizer whose "▁" decodes to a space, with "</s>" special and "maybe" an ordinary
    added token."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *words])}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.decoder = decoders.Replace("▁", " ")
    backend.add_special_tokens(["</s>"])
    backend.add_tokens(["maybe"])
    return Tokenizer(backend, bos_id=None, add_bos=False)


def test_without_every_digit_numbers_cannot_be_masked():
    tok = word_level(["yes", "no", "▁1", "23", "USD", "\n"])
    v = Vocabulary.of(tok)
    token = tok.backend.token_to_id
    assert v.size == 9
    assert v.number[token("▁1")] and v.number[token("23")] and not v.number[token("yes")]
    assert v.digits == frozenset("123") and not v.can_mask_numbers()
    assert v.amount[token("USD")] and not v.text[token("\n")] and v.newline[token("\n")]
    assert v.end[token("</s>")] and not v.text[token("</s>")]
    assert v.text[token("maybe")] and not v.end[token("maybe")]  # added, but not special
    assert v.text[token("[UNK]")]  # never added as a special token: an ordinary word here


def test_every_digit_in_some_number_token_is_enough():
    assert Vocabulary.of(word_level(["01234", "▁56", "789"])).can_mask_numbers()


def test_anything():
    v = Vocabulary.anything(5)
    assert v.text.all() and v.number.all() and v.amount.all()
    assert not v.newline.any() and not v.end.any()
    assert v.can_mask_numbers()
