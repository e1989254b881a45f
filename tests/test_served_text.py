"""Text through the real service: a tiny pair with a real byte-level BPE tokenizer whose tokens split UTF-8
characters (emoji, CJK) anywhere; streamed deltas must add up to exactly the final text, stop strings cut there,
and tokenizing a huge prompt stalls no other stream."""

import threading
import time

import grpc
import pytest
from byte_tokenizer import byte_tokenizer, write_byte_tokenizer
from service import ServerProcess

from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.models.random_init import random_pair

VOCAB = 512


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    target, draft = random_pair(tmp_path_factory.mktemp("pair"), agree=0.005, block_size=6, vocab=VOCAB)
    write_byte_tokenizer(target, VOCAB)
    return target, draft


@pytest.fixture(scope="module")
def server(pair_dirs):
    srv = ServerProcess(*pair_dirs, "--max-model-len", "4096", "--max-prompt-chars", str(8 << 20))
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer(VOCAB)


def _stream(client, prompt, **kw):
    """-> (chunk token ids, chunk texts, the final message)."""
    ids, texts, final = [], [], None
    for msg in client.stream(prompt, **kw):
        if msg.HasField("chunk"):
            ids += msg.chunk.token_ids
            texts.append(msg.chunk.text)
            assert msg.chunk.num_output_tokens == len(ids)
        else:
            final = msg.complete
    return ids, texts, final


def _wide(text: str) -> int:
    """Characters of two or more UTF-8 bytes that decoded whole (not U+FFFD)."""
    return sum(1 for ch in text if ord(ch) >= 0x80 and ch != "\ufffd")


@pytest.fixture(scope="module")
def sampled(server, tokenizer):
    """Seeded sampled answers: random tokens of a byte-level vocabulary learnt on emoji and CJK text."""
    c = DSparkClient(server.address)
    runs = [_stream(c, "你好 😀 hello", temperature=1.0, seed=s, max_tokens=160, ignore_eos=True) for s in range(6)]
    c.close()
    return runs


def test_streamed_text_adds_up_to_the_final_text(sampled, tokenizer):
    for ids, texts, final in sampled:
        assert ids == list(final.output_ids) and len(ids) == 160
        assert "".join(texts) == final.text == tokenizer.decode(ids)
    assert sum(_wide(final.text) for _, _, final in sampled) > 20  # whole emoji / CJK characters came through
    assert any(t.endswith("\ufffd") is False and t for _, texts, _ in sampled for t in texts)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_stop_string_cuts_text_and_tokens(server, sampled, tokenizer, which):
    ids, _, final = sampled[which]
    full = final.text
    wide = [i for i, ch in enumerate(full[:-1]) if ord(ch) >= 0x80 and "\ufffd" not in full[i:i + 2] and i > 20]
    at = wide[0]  # a stop that starts with a multi-byte character
    stop = full[at:at + 2]
    first = full.index(stop)
    c = DSparkClient(server.address)
    got_ids, texts, done = _stream(c, "你好 😀 hello", temperature=1.0, seed=which, max_tokens=160, ignore_eos=True,
                                   stop=[stop, "never-in-the-output-\u2603"])
    c.close()
    assert done.finish_reason == 1 and done.text == full[:first] == "".join(texts)  # FINISH_REASON_STOP
    assert got_ids == list(done.output_ids) == ids[:len(got_ids)]
    assert stop in tokenizer.decode(got_ids) and stop not in tokenizer.decode(got_ids[:-1])


def test_a_huge_prompt_does_not_stall_other_streams(server):
    """A 3.5 MB text takes seconds to tokenize; meanwhile another client's chunks keep arriving."""
    c = DSparkClient(server.address)
    arrivals, errors = [], []
    stream = c.stream([1, 2, 3], temperature=0.0, max_tokens=3500, ignore_eos=True)

    def consume():
        try:
            for msg in stream:
                arrivals.append(time.monotonic())
        except grpc.RpcError as e:
            errors.append(e.code())

    reader = threading.Thread(target=consume)
    reader.start()
    while len(arrivals) < 5:
        time.sleep(0.01)
    big = DSparkClient(server.address)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        big.generate("def f(x):\n    return x\n" * 150_000, max_tokens=4)
    t1 = time.monotonic()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "maximum is" in e.value.details()
    stream.cancel()
    reader.join(30)
    during = [t for t in arrivals if t0 <= t <= t1]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert t1 - t0 > 0.5 and len(during) >= 10 and max(gaps) < 0.5, (t1 - t0, len(during), max(gaps, default=0))
    big.close()
    c.close()


def test_paced_streams_carry_several_steps_per_message(pair_dirs, tokenizer):
    """With a low message budget each chunk carries every step since the last; nothing is lost or reordered."""
    srv = ServerProcess(*pair_dirs, "--stream-messages-per-s", "40")
    try:
        results = [None] * 4

        def run(i):
            c = DSparkClient(srv.address)
            ids, texts, final = _stream(c, "你好", temperature=1.0, seed=i, max_tokens=120, ignore_eos=True)
            results[i] = (len(texts), final.stats.num_spec_steps, ids, "".join(texts), final)
            c.close()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for chunks, steps, ids, text, final in results:
            assert ids == list(final.output_ids) and text == final.text == tokenizer.decode(ids)
            assert chunks < steps / 2, (chunks, steps)
    finally:
        srv.kill()
