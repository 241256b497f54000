"""Tokenizer: GGUF and folder loading, chat templates, streaming detokenization, load errors."""

import os
import random
import shutil
from pathlib import Path

import pytest

from engine.errors import ModelLoadError, NInferError
from engine.model.default import DEFAULT_MODEL_ID, default_model_path
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

STREAM_TEXT = "Héllo wörld! Ça va? 🤖👍🏽 北京欢迎你 — naïve café, Größe, ñandú. 日本語のテキスト 🎉"


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


# ----- the embedded model -----


def test_default_model_path_exists():
    path = default_model_path()
    assert path.is_file()
    assert path.suffix == ".gguf"
    assert DEFAULT_MODEL_ID == "smollm2-135m-instruct"


@pytest.mark.parametrize(
    "text", ["Hello, world! How are you today?", "🤖👍🏽", "北京欢迎你", "Mixed: café 北京 🤖 done.\n\tx"]
)
def test_gguf_round_trip(smol, text):
    ids = smol.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert smol.decode(ids) == text


def test_gguf_vocab_and_special_tokens(smol):
    assert smol.vocab_size == 49152
    assert 2 in smol.eos_token_ids  # <|im_end|>
    assert smol.bos_token_id == 1  # <|im_start|>
    assert smol.token_to_id("<|im_end|>") == 2
    assert smol.token_text(2) == "<|im_end|>"
    assert smol.decode([2]) == ""  # special tokens are skipped by default
    assert smol.decode([2], skip_special_tokens=False) == "<|im_end|>"
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")  # SmolLM2 adds no BOS


def test_gguf_chat_template(smol):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = smol.render_chat(messages)
    assert smol.has_chat_template
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert not smol.render_chat(messages, add_generation_prompt=False).endswith("<|im_start|>assistant\n")
    ids = smol.apply_chat_template(messages)
    assert ids == smol.encode(text)
    # the template's control tokens are single special tokens, not spelled out as text
    assert ids.count(smol.token_to_id("<|im_start|>")) == 3
    assert ids[-4:] == smol.encode("<|im_start|>assistant\n") == [1, 520, 9531, 198]


def test_content_parts_are_joined(smol):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    text = smol.render_chat([{"role": "user", "content": parts}])
    assert "<|im_start|>user\nHello\nthere<|im_end|>" in text
    with pytest.raises(NInferError, match="text only"):
        smol.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_gguf_load_from_non_ascii_path(tmp_path, smol):
    target = tmp_path / "模型 目录" / "SmolLM2 模型.gguf"
    target.parent.mkdir()
    try:
        os.link(default_model_path(), target)
    except OSError:
        shutil.copyfile(default_model_path(), target)
    tok = Tokenizer.from_gguf(target)
    assert tok.vocab_size == 49152
    assert tok.encode("北京欢迎你") == smol.encode("北京欢迎你")
    assert Tokenizer.from_path(target).has_chat_template


# ----- incremental detokenization -----


def _stream(tok: Tokenizer, ids: list[int], chunk_sizes) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = tok.detokenizer()
    pieces, pos = [], 0
    for size in chunk_sizes:
        if pos >= len(ids):
            break
        pieces.append(detok.add(ids[pos : pos + size]))
        pos += size
    assert pos >= len(ids)
    pieces.append(detok.flush())
    return detok, pieces


def test_detokenizer_one_token_at_a_time(smol):
    ids = smol.encode(STREAM_TEXT)
    detok, pieces = _stream(smol, ids, [1] * len(ids))
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == smol.decode(ids) == STREAM_TEXT
    assert detok.text == STREAM_TEXT


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_detokenizer_random_chunks(smol, seed):
    rng = random.Random(seed)
    ids = smol.encode(STREAM_TEXT * 3)
    sizes = [rng.randint(1, 7) for _ in range(len(ids))]
    detok, pieces = _stream(smol, ids, sizes)
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == smol.decode(ids)
    assert detok.text == smol.decode(ids)


def test_detokenizer_with_special_tokens(smol):
    ids = smol.apply_chat_template([{"role": "user", "content": "Größe 🤖"}]) + smol.encode("Ça va 北京") + [2]
    detok, pieces = _stream(smol, ids, [1] * len(ids))
    assert "".join(pieces) == smol.decode(ids)
    keep = smol.detokenizer(skip_special_tokens=False)
    assert "".join([keep.add([i]) for i in ids] + [keep.flush()]) == smol.decode(ids, skip_special_tokens=False)


def test_detokenizer_flushes_an_incomplete_character(smol):
    ids = smol.encode("ok 🤖")
    detok = smol.detokenizer()
    streamed = "".join(detok.add([i]) for i in ids[:-1])  # the emoji's last byte is missing
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == smol.decode(ids[:-1])
    assert detok.flush() == ""


def test_detokenizer_decodes_small_windows(smol, monkeypatch):
    """Each step decodes only recent tokens: total work grows linearly with the output."""
    ids = smol.encode(STREAM_TEXT * 40)
    decoded = []
    real_decode = smol.decode

    def counting_decode(ids, skip_special_tokens=True):
        decoded.append(len(ids))
        return real_decode(ids, skip_special_tokens)

    monkeypatch.setattr(smol, "decode", counting_decode)
    detok = smol.detokenizer()
    text = "".join(detok.add([i]) for i in ids)
    assert max(decoded) < 16
    assert text + detok.flush() == real_decode(ids)


# ----- Hugging Face folders -----

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t.function.name }}: {{ t.function.description }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} city={{ c.function.arguments.city }}]{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is false %}<nothink>{% endif %}{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tokenizer",
    "what is the weather in Paris today?",
    "café 北京 🤖 naïve",
]


def _save_folder(folder: Path, chat_template: str | None) -> Path:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rust.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|endoftext|>", bos_token="<|im_start|>")
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def folder_tok(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("hf") / "分词器 folder"
    return Tokenizer.from_folder(_save_folder(folder, TOOLS_TEMPLATE))


def test_folder_encode_decode(folder_tok):
    for text in CORPUS + ["unseen words: zebra Ωmega 🎉"]:
        assert folder_tok.decode(folder_tok.encode(text)) == text
    assert folder_tok.token_to_id("<|im_end|>") is not None
    # eos from the tokenizer, plus <|im_end|> because the template ends turns with it
    assert folder_tok.eos_token_ids == {folder_tok.token_to_id("<|endoftext|>"), folder_tok.token_to_id("<|im_end|>")}


def test_folder_chat_template_with_tools_and_kwargs(folder_tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city"}}]
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = folder_tok.render_chat(messages, tools=tools)
    assert text.startswith("<|im_start|>tools\nget_weather: Weather for a city\n<|im_end|>\n")
    assert "[call get_weather city=Paris]" in text  # JSON arguments reach the template as an object
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert folder_tok.render_chat(messages, enable_thinking=False).endswith("<|im_start|>assistant\n<nothink>")
    assert "tools" not in folder_tok.render_chat(messages[:1])
    ids = folder_tok.apply_chat_template(messages, tools=tools)
    assert ids == folder_tok.encode(text)
    assert folder_tok.token_to_id("<|im_start|>") in ids


def test_detokenizer_sentencepiece_spaces(tmp_path):
    """Metaspace drops the space of the first token it decodes; streaming must still match decode()."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer(models.BPE(unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    rust.decoder = decoders.Metaspace()
    rust.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(str(tmp_path / "sp"))
    tok = Tokenizer.from_folder(tmp_path / "sp")
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    ids = [bos] + tok.encode("hello world, the lazy fox") + [eos] + tok.encode(" quick brown dog 北京") + [eos]
    for sizes in ([1] * len(ids), [2, 3, 1] * len(ids)):
        _, pieces = _stream(tok, ids, sizes)
        assert "".join(pieces) == tok.decode(ids) == "hello world, the lazy fox quick brown dog 北京"


def test_template_errors_are_user_errors(tmp_path):
    template = "{{ raise_exception('Conversation roles must alternate') }}"
    tok = Tokenizer.from_folder(_save_folder(tmp_path / "raising", template))
    with pytest.raises(NInferError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_no_chat_template(tmp_path):
    tok = Tokenizer.from_folder(_save_folder(tmp_path / "plain", None))
    assert not tok.has_chat_template
    with pytest.raises(NInferError, match="no chat template") as err:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "/v1/completions" in str(err.value)
    # a template can be supplied instead
    tok = Tokenizer.from_folder(tmp_path / "plain", chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "hi"


# ----- load errors -----


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        Tokenizer.from_folder(tmp_path)
    with pytest.raises(ModelLoadError, match="not found"):
        Tokenizer.from_folder(tmp_path / "missing")


def test_folder_with_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{ this is not json")
    with pytest.raises(ModelLoadError) as err:
        Tokenizer.from_folder(tmp_path)
    assert str(tmp_path) in str(err.value)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        os.urandom(4096),
        b"GGUF",
        b"GGUF" + os.urandom(64),
        b"GGUF\x03\x00\x00\x00" + b"\xff" * 16,  # absurd tensor / key counts
    ],
    ids=["empty", "random", "magic-only", "magic-then-random", "huge-counts"],
)
def test_corrupt_gguf(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError) as err:
        Tokenizer.from_gguf(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("size", [24, 1000, 500_000])
def test_truncated_gguf(tmp_path, size):
    path = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as src:
        path.write_bytes(src.read(size))
    with pytest.raises(ModelLoadError):
        Tokenizer.from_gguf(path)


def test_missing_gguf(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "nope.gguf")
