"""min_tokens and stop strings, as vLLM's detokenizer applies them (vllm#22014): no stop string
is looked for while at most min_tokens tokens were generated, and a later match must end in text
that came after the min_tokens-th token (it may start before it). Token by token and all at
once give the same text."""

from __future__ import annotations

import pytest
from rlt.engine.detokenizer import IncrementalDetokenizer
from rlt_models import load_tokenizer

TEXT = "The river had risen during the night, and the meadow was a lake"


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3))


def run(tokenizer, ids, one_by_one: bool, **options) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, **options)
    for chunk in ([t] for t in ids) if one_by_one else [ids]:
        detok.add_tokens(chunk)
    detok.flush()
    return detok


def expected_text(tokenizer, ids, stop: str, min_tokens: int) -> str:
    """The rule, computed from decoded prefixes: the first match ending after the text of the
    first min_tokens tokens."""
    full = tokenizer.decode(ids)
    floor = len(tokenizer.decode(ids[:min_tokens])) if min_tokens else 0
    start = full.find(stop, max(floor - len(stop) + 1, 0))
    return full if start < 0 else full[:start]


@pytest.mark.parametrize("one_by_one", [True, False])
@pytest.mark.parametrize("min_tokens", [0, 1, 3, 5, 8])
@pytest.mark.parametrize("stop", ["e", "er", "the"])
def test_stop_strings_wait_for_min_tokens(tokenizer, one_by_one, min_tokens, stop):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    detok = run(tokenizer, ids, one_by_one, stop=(stop,), min_tokens=min_tokens)
    expected = expected_text(tokenizer, ids, stop, min_tokens)
    assert detok.text == expected
    assert detok.stopped == (expected != TEXT)


def test_a_match_inside_the_first_tokens_is_skipped_and_a_later_one_stops(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    head = tokenizer.decode(ids[:4])
    assert "river" in head
    plain = run(tokenizer, ids, True, stop=("river", "meadow"))
    assert plain.text == TEXT[: TEXT.index("river")]
    held = run(tokenizer, ids, True, stop=("river", "meadow"), min_tokens=4)
    assert held.text == TEXT[: TEXT.index("meadow")]


def test_a_match_spanning_the_min_tokens_boundary_stops(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    pieces = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    # a boundary inside "river had": the stop starts before it and ends after it
    k = next(k for k in range(1, len(ids)) if 4 < len(pieces[k]) < TEXT.index("had") + 3)
    assert TEXT.index("river had") < len(pieces[k]) < TEXT.index("river had") + len("river had")
    detok = run(tokenizer, ids, True, stop=("river had",), min_tokens=k)
    assert detok.text == TEXT[: TEXT.index("river had")] and detok.stopped


def test_without_a_later_match_nothing_stops(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    detok = run(tokenizer, ids, True, stop=("river",), min_tokens=len(ids))
    assert detok.text == TEXT and not detok.stopped
