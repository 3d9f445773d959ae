"""Answers at extraction slots: beam search (or greedy generation) continuing a tree pass, one slot's
hypotheses as one group of rows in fixed-shape decode steps (pallas_kernels.decode_attention).

An answer is a run of tokens the slot's vocabulary allows (all text for {*}, number tokens for {n}, amount
tokens for {$}) that ends in one of these ways: the query's closing text follows it (`"{*}"` ends at the
closing quote); without closing text, a {*} answer ends where a newline or end-of-sequence token follows it,
and a {n} or {$} answer where any token follows that cannot continue it ("14" in "14 people"); or it reaches
max_tokens. Its log-probability is the sum over its tokens and its end (the closing text's tokens, the end
token, or the mass of the tokens that cannot continue a number).

The search here is plain Python over numpy: what the device gives it per hypothesis is the log-probabilities
of its most likely allowed next tokens (CANDIDATES of them), of one forced token, and of everything outside
the slot's kind of tokens. Every decision is made per slot from that slot's own numbers, so a slot's answers
do not depend on what it is decoded with.
"""

from dataclasses import dataclass, field

import numpy as np

from spinf_jax.layout import Extract

CANDIDATES = 8  # next tokens the device hands back per hypothesis and step (≥ the search width)
_END = -1  # the candidate "a number ends here", beside the tokens


@dataclass(frozen=True)
class Decoded:
    tokens: tuple[int, ...]  # the answer's tokens, without its closing text or end token
    logprob: float  # log P(answer tokens + closing text or end token | content + template)


@dataclass(frozen=True)
class _Hypothesis:
    answer: tuple[int, ...]
    closed: int  # closing-text tokens already appended (then every next token is forced)
    logprob: float
    pending: int  # the token it feeds at the next step: the last one appended
    columns: tuple[int, ...] = ()  # the history column of each token fed so far


@dataclass
class SlotSearch:
    """Beam search at one slot (greedy for a generated slot: width 1).

    `ends` marks the tokens that end an answer of a slot without closing text (newline, end of sequence);
    `excluded` the tokens that may not appear inside this slot's answers (those that hold the closing
    text's first character, other than the closing token itself)."""

    extract: Extract
    ends: np.ndarray  # [vocab] bool
    excluded: frozenset[int] = frozenset()
    live: list[_Hypothesis] = field(default_factory=list)
    finished: list[Decoded] = field(default_factory=list)
    fed: int = 0  # tokens fed to the model (usage: decode tokens)

    @property
    def width(self) -> int:
        return self.extract.width

    def start(self, logprobs: np.ndarray, tokens: np.ndarray, outside: float) -> None:
        """What was read at the slot row of the pass: candidates [CANDIDATES] each, the outside mass."""
        self._select(list(self._extend(_Hypothesis((), 0, 0.0, -1), logprobs, tokens, float(outside))))

    def feeds(self) -> list[tuple[int, tuple[int, ...], int]]:
        """This step's rows: per live hypothesis (token it feeds, history columns of its path before this
        step, the token forced after it or -1)."""
        return [(h.pending, h.columns, self._forced(h)) for h in self.live]

    def advance(self, logprobs: np.ndarray, tokens: np.ndarray, forced: np.ndarray, outside: np.ndarray):
        """What the step read after each live hypothesis (in feeds' order): candidates [n, CANDIDATES], the
        forced token's log-prob [n] and the mass outside the slot's kind [n]."""
        self.fed += len(self.live)
        column = len(self.live[0].columns) if self.live else 0
        out = []
        for w, h in enumerate(self.live):
            h = _Hypothesis(h.answer, h.closed, h.logprob, h.pending, (*h.columns, w))
            if self._forced(h) >= 0:
                out += self._close(h, float(forced[w]))
            else:
                out += self._extend(h, logprobs[w], tokens[w], float(outside[w]))
        assert all(len(h.columns) == column + 1 for h in out)
        self._select(out)

    @property
    def done(self) -> bool:
        if not self.live:
            return True
        k = self.extract.max_answers if not self.extract.generate else 1
        if len(self.finished) < k:
            return False
        kth = sorted((d.logprob for d in self.finished), reverse=True)[k - 1]
        # Log-probabilities only fall as tokens are added: no live hypothesis can still beat the k-th.
        return max(h.logprob for h in self.live) < kth

    def answers(self) -> list[Decoded]:
        """Finished answers, most likely first (ties by tokens, so the order is deterministic)."""
        return sorted(self.finished, key=lambda d: (-d.logprob, d.tokens))

    # -----------------------------------------------------------------------------------------------------

    def _forced(self, h: _Hypothesis) -> int:
        closing = self.extract.closing_ids
        if closing and (h.closed > 0 or len(h.answer) == self.extract.max_tokens):
            return closing[h.closed]
        return -1

    def _close(self, h: _Hypothesis, logprob: float) -> list[_Hypothesis]:
        token = self.extract.closing_ids[h.closed]
        closed = _Hypothesis(h.answer, h.closed + 1, h.logprob + logprob, token, h.columns)
        if closed.closed == len(self.extract.closing_ids):
            self.finished.append(Decoded(h.answer, closed.logprob))
            return []
        return [closed]

    def _extend(self, h: _Hypothesis, logprobs: np.ndarray, tokens: np.ndarray, outside: float):
        """h's successors among the candidates (up to the search's width of them, most likely first): live
        hypotheses (yielded) and finished answers (kept)."""
        closing = self.extract.closing_ids
        options = list(zip(logprobs.tolist(), tokens.tolist(), strict=True))
        if not closing and self.extract.kind != "text" and h.answer:
            options = sorted([*options, (outside, _END)], key=lambda o: -o[0])  # a number may end here
        taken = 0
        for lp, token in options:
            if lp == -np.inf or taken == self.width:
                break
            if token == _END or (not closing and self.ends[token]):
                taken += 1
                self.finished.append(Decoded(h.answer, h.logprob + lp))
            elif closing and token == closing[0]:
                taken += 1
                yield from self._close(h, lp)
            elif token not in self.excluded:
                taken += 1
                longer = _Hypothesis((*h.answer, token), 0, h.logprob + lp, token, h.columns)
                if not closing and len(longer.answer) == self.extract.max_tokens:
                    self.finished.append(Decoded(longer.answer, longer.logprob))  # the length bound
                else:
                    yield longer

    def _select(self, candidates: list[_Hypothesis]) -> None:
        candidates.sort(key=lambda h: (-h.logprob, h.answer, h.closed))
        self.live = candidates[: self.width]


def path_columns(columns: tuple[int, ...], row: int, steps: int) -> np.ndarray:
    """[steps] the history column of a hypothesis's token at every step: its path, then its own row."""
    path = np.zeros(steps, np.int32)
    path[: len(columns)] = columns
    path[len(columns)] = row
    return path
