"""Text options of a request's stream: stop strings wait for min_tokens; skip_special_tokens picks one of a
tokenizer's two prepared decodings."""

import pytest
from byte_tokenizer import byte_tokenizer

from dspark_serve.engine.detokenize import TokenText, text_stream


@pytest.fixture(scope="module")
def text():
    return TokenText(byte_tokenizer(300, specials=2))


def _run(text, ids, **kw):
    stream = text_stream(text, **kw)
    kept, pieces = [], []
    for i in range(0, len(ids), 2):  # two tokens a step
        k, delta = stream.push(ids[i:i + 2])
        kept += k
        pieces.append(delta)
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return kept, "".join(pieces), stream.stopped


@pytest.mark.parametrize("stop", [("XY",), ("XY", "LONGER STOP")])  # the second holds the first XY back
@pytest.mark.parametrize("min_tokens, want", [(0, "a"), (3, "a"), (4, "aXYb"), (6, "aXYb"), (7, "aXYbXYc")])
def test_stop_strings_end_the_output_only_from_min_tokens(text, stop, min_tokens, want):
    """The first XY is complete at token 3 and the second at token 6: a stop ends the output only once it has
    min_tokens tokens, and a stop completed before then is not matched later either."""
    ids = list(b"aXYbXYc")
    kept, got, stopped = _run(text, ids, stop=stop, min_tokens=min_tokens)
    assert got == want and stopped == (want != "aXYbXYc")
    assert kept == ids[:len(want) + 2] if stopped else kept == ids


def test_a_stop_string_across_min_tokens_ends_it(text):
    """A stop that starts before min_tokens and ends at or after it counts."""
    kept, got, stopped = _run(text, list(b"abcSTOPxyz"), stop=("STOP",), min_tokens=5)
    assert (got, stopped, len(kept)) == ("abc", True, 7)
    kept, got, _ = _run(text, list(b"abcSTOPxyz"), stop=("STOP",), min_tokens=5, include_stop=True)
    assert got == "abcSTOP"


def test_skip_special_tokens_variants(text):
    ids = [104, 105, 298, 33, 299]
    skipping = text.variant(True)
    keeping = text.variant(False)
    assert skipping is text and keeping is text.variant(False) and keeping.variant(True) is text  # built once
    assert _run(text, ids)[1] == "hi!" == text.tokenizer.decode(ids)
    want = "hi<|special_0|>!<|special_1|>"
    assert _run(text, ids, skip_special_tokens=False)[1] == want == text.tokenizer.decode(ids, skip_special_tokens=False)
    assert keeping.decode(ids) == want and skipping.decode(ids) == "hi!"
