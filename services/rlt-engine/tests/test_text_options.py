"""The detokenizer's text options (SamplingParams: include_stop_str_in_output,
skip_special_tokens, spaces_between_special_tokens), as vLLM's fast-tokenizer path applies
them; token by token and all at once give the same text."""

from __future__ import annotations

import pytest
from rlt.engine.detokenizer import IncrementalDetokenizer
from rlt.engine.output_processor import RequestState
from rlt_contracts import EngineRequest, SamplingParams
from rlt_models import load_tokenizer
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint("l2_t4", seed=3, gate_std=0.3))


def detokenize(tokenizer, ids, *, one_by_one: bool, ends_on_stop_token=False, **options):
    detok = IncrementalDetokenizer(tokenizer, **options)
    if one_by_one:
        for i, token in enumerate(ids):
            detok.add_tokens([token], ends_on_stop_token=ends_on_stop_token and i == len(ids) - 1)
    else:
        detok.add_tokens(ids, ends_on_stop_token=ends_on_stop_token)
    detok.flush()
    return detok


TEXT = "The river had risen during the night"


@pytest.mark.parametrize("one_by_one", [True, False])
def test_stop_string_across_token_boundaries_is_cut_or_kept(tokenizer, one_by_one):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    pieces = [tokenizer.decode([t]) for t in ids]
    assert "er ha" not in pieces and "river" not in pieces[:1]  # spans several tokens
    cut = detokenize(tokenizer, ids, one_by_one=one_by_one, stop=("er ha",))
    kept = detokenize(
        tokenizer, ids, one_by_one=one_by_one, stop=("er ha",), include_stop_str_in_output=True
    )
    assert cut.stopped and cut.text == "The riv"
    assert kept.stopped and kept.text == "The river ha"  # the rest of " had" is cut


@pytest.mark.parametrize("one_by_one", [True, False])
def test_the_first_completed_stop_string_is_kept_whole(tokenizer, one_by_one):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    options = dict(one_by_one=one_by_one, include_stop_str_in_output=True)
    # text grows token by token: "had" is complete before "had risen" could be
    assert detokenize(tokenizer, ids, stop=("had risen", "had"), **options).text == (
        "The river had"
    )
    assert detokenize(tokenizer, ids, stop=("risen", "iver"), **options).text == "The river"


@pytest.mark.parametrize("one_by_one", [True, False])
def test_special_tokens_are_skipped_unless_asked(tokenizer, one_by_one):
    text = "<|im_start|>user\nhello<|im_end|>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == 1 and ids[-1] == 2
    skipped = detokenize(tokenizer, ids, one_by_one=one_by_one)
    shown = detokenize(tokenizer, ids, one_by_one=one_by_one, skip_special_tokens=False)
    assert skipped.text == "user\nhello"
    assert shown.text == text
    # byte-level decoders put no separator between added tokens: the option changes nothing
    bare = detokenize(
        tokenizer,
        ids,
        one_by_one=one_by_one,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )
    assert bare.text == text


@pytest.mark.parametrize("one_by_one", [True, False])
def test_the_stop_token_text_is_left_out_unless_included(tokenizer, one_by_one):
    ids = tokenizer("It is a truth", add_special_tokens=False).input_ids
    stop_id = ids[-1]
    common = dict(one_by_one=one_by_one, ends_on_stop_token=True, stop_token_ids=(stop_id,))
    assert detokenize(tokenizer, ids, **common).text == tokenizer.decode(ids[:-1])
    kept = detokenize(tokenizer, ids, include_stop_str_in_output=True, **common)
    assert kept.text == "It is a truth"
    # a special stop token (EOS) shows only with skip_special_tokens=False and the option
    eos = [*ids[:-1], 0]
    common = dict(one_by_one=one_by_one, ends_on_stop_token=True, stop_token_ids=(0,))
    shown = detokenize(
        tokenizer, eos, skip_special_tokens=False, include_stop_str_in_output=True, **common
    )
    assert shown.text == tokenizer.decode(ids[:-1]) + "<|endoftext|>"
    assert detokenize(tokenizer, eos, skip_special_tokens=False, **common).text == (
        tokenizer.decode(ids[:-1])
    )


def wordpiece_tokenizer() -> Tokenizer:
    """A decoder that separates tokens with spaces (WordPiece), with two special tokens."""
    tokenizer = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens([AddedToken("<a>", special=True), AddedToken("<b>", special=True)])
    return tokenizer


@pytest.mark.parametrize("one_by_one", [True, False])
def test_spaces_between_special_tokens_follows_vllm_fast_detokenizer(one_by_one):
    tokenizer = wordpiece_tokenizer()
    ids = tokenizer.encode("hello <a><b> world").ids
    assert ids == [1, 3, 4, 2]
    spaced = detokenize(tokenizer, ids, one_by_one=one_by_one, skip_special_tokens=False)
    bare = detokenize(
        tokenizer,
        ids,
        one_by_one=one_by_one,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )
    assert spaced.text == "hello <a> <b> world" == tokenizer.decode(ids, skip_special_tokens=False)
    assert bare.text == "hello <a><b> world"  # only an added token after an added token
    # skipped special tokens: the option has no effect
    skipped = detokenize(tokenizer, ids, one_by_one=one_by_one, spaces_between_special_tokens=False)
    assert skipped.text == detokenize(tokenizer, ids, one_by_one=one_by_one).text


def test_streaming_holds_back_text_only_while_a_stop_string_could_cut_it():
    def state(**options) -> RequestState:
        params = SamplingParams(stop=("abc",), **options)
        request_state = RequestState(EngineRequest("r", (1,), params), None)
        request_state.output.token_ids.extend([5, 6])
        request_state.output.text = "hello ab"
        return request_state

    cut, kept = state().take(), state(include_stop_str_in_output=True).take()
    assert cut.text == "hello " and kept.text == "hello ab"  # "ab" may start a cut "abc"
