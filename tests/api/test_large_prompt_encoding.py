"""A huge prompt is tokenized with the GIL released: the ids are exactly the tokenizer's, and while a worker thread
encodes a 2M-character prompt the server in the same process keeps answering /health."""
import random
import threading
import time

import pytest

from engine.tokenizer import RELEASE_GIL_CHARS


def mixed_text(chars: int, seed: int) -> str:
    """Text that exercises the pre-tokenizer and the added tokens: words, digits, runs of spaces and newlines,
    accents, CJK, emoji, and the chat template's special tokens in the middle of it."""
    rng = random.Random(seed)
    pieces = ["hello", " world", "  ", "\n\n", "\t", "12345", "3.14159", "Ünïcödé", "naïve café", "你好世界", "🙂👍🏽",
              "<|im_start|>", "<|im_end|>", "<|endoftext|>", "don't", "I'm", "   indented", "x" * 40, "!?", "—"]
    out, n = [], 0
    while n < chars:
        piece = rng.choice(pieces)
        out.append(piece)
        n += len(piece)
    return "".join(out)[:chars]


@pytest.mark.parametrize("chars", [RELEASE_GIL_CHARS - 1, RELEASE_GIL_CHARS, 300_000, 1_000_000])
@pytest.mark.parametrize("special", [False, True])
def test_long_texts_encode_to_the_same_ids(default_engine, chars, special):
    tok = default_engine.tokenizer
    text = mixed_text(chars, seed=chars)
    expected = tok._backend.encode(text, add_special_tokens=special).ids  # the Rust tokenizer's own encode
    ids = tok.encode(text, add_special_tokens=special)
    assert ids == expected
    assert ids == tok._hf(text, add_special_tokens=special)["input_ids"]  # and transformers' tokenizer call


def test_health_answers_while_a_huge_prompt_is_encoded(default_engine, http):
    """The encode runs on a worker thread, as the server runs it (asyncio.to_thread); /health is asked over and
    over meanwhile. With the GIL held for the whole encode, no answer could arrive before it ends."""
    text = mixed_text(2_000_000, seed=7)
    answered_during: list[int] = []
    encoding = threading.Event()
    ended = threading.Event()

    def encode():
        encoding.set()
        default_engine.tokenizer.encode(text)
        ended.set()

    worker = threading.Thread(target=encode)
    worker.start()
    encoding.wait()
    while not ended.is_set():
        status = http.get("/health").status_code
        if not ended.is_set():  # answered while the encode still ran
            answered_during.append(status)
    worker.join()
    assert len(answered_during) >= 3 and set(answered_during) == {200}, answered_during


def test_another_thread_keeps_running_during_an_encode(default_engine):
    """The same, without a server: a thread that counts while a huge text is encoded keeps counting."""
    text = mixed_text(1_000_000, seed=3)
    ticks, ended = [], threading.Event()

    def count():
        while not ended.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    time.sleep(0.02)
    before = len(ticks)
    default_engine.tokenizer.encode(text)
    during = len(ticks) - before
    ended.set()
    counter.join()
    assert during >= 10, f"the counting thread ran {during} times during the encode"
