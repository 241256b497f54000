"""The tiny seeded Qwen3.5 VL checkpoint (tests/engine/vision_models.py) with a chat tokenizer of its own, served
in-process, for the image API tests: a vocabulary of 256 whose special tokens have the ids the
checkpoint's config names (<|image_pad|> 250, <|vision_start|> 252, <|vision_end|> 253) and a chat template that
renders an image part as Qwen3.5's does (<|vision_start|><|image_pad|><|vision_end|>)."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

from engine.build import assemble_engine, load_model
from engine.config.loading import load_settings
from engine.server.state import ServerState
from tests.api.conftest import RunningServer
from tests.engine.vision_models import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START

IM_START, IM_END, VISION_PAD = 248, 249, 254
ENDOFTEXT = "<|endoftext|>"
SPECIALS = {"<|im_start|>": IM_START, "<|im_end|>": IM_END, "<|image_pad|>": IMAGE_TOKEN,
            "<|video_pad|>": VIDEO_TOKEN, "<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END,
            "<|vision_pad|>": VISION_PAD}

# Qwen3.5's chat template cut to what these tests use: roles, text and image items, tool results as user turns.
CHAT_TEMPLATE = """
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for item in content -%}
            {%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif 'text' in item -%}
                {{- item.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
    {%- if message.role == 'tool' -%}
        {{- '<|im_start|>user\\n<tool_response>\\n' + render_content(message.content) -}}
        {{- '\\n</tool_response><|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""


def add_vl_tokenizer(folder: Path) -> None:
    """Replaces the folder's tokenizer with a byte-level Qwen3_5Tokenizer without merges (the class transformers
    loads for a qwen3_5 folder): tokens 0..127 are the ASCII bytes (ASCII text is its own byte values), 128..247
    the characters U+00C0.. (two UTF-8 bytes each, so every answer decodes to text that tells its tokens apart),
    SPECIALS and <|endoftext|> 255 the rest of the 256. <|im_end|> ends answers."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(128)}
    vocab.update({"".join(chars[b] for b in chr(0xC0 + k).encode()): 128 + k for k in range(120)})
    vocab.update({**SPECIALS, ENDOFTEXT: 255})
    tok = Qwen3_5Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", unk_token=ENDOFTEXT,
                           pad_token=ENDOFTEXT)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)


def text_ids(text: str) -> list[int]:
    """The ids of ASCII text under add_vl_tokenizer's vocabulary: its bytes."""
    return list(text.encode("ascii"))


def user_prompt(*pieces: str | int) -> list[int]:
    """The ids CHAT_TEMPLATE makes of one user turn and the generation prompt: each int piece an image of that
    many tokens (<|vision_start|> pads <|vision_end|>), each string ASCII text."""
    ids = [IM_START, *text_ids("user\n")]
    for piece in pieces:
        ids += [VISION_START, *[IMAGE_TOKEN] * piece, VISION_END] if isinstance(piece, int) else text_ids(piece)
    return ids + [IM_END, *text_ids("\n"), IM_START, *text_ids("assistant\n")]


def png(image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def serving_state(folder: Path, served: str) -> ServerState:
    """A ServerState over a started engine of the folder's model (CPU, fp32 as loaded)."""
    model = load_model(folder, device="cpu", max_context=512, max_concurrency=4)
    loaded = assemble_engine(model)
    loaded.engine.start()
    settings, _ = load_settings([], {})
    state = ServerState(settings, [served])
    state.loaded = loaded
    return state


@contextlib.contextmanager
def served(folder: Path, name: str):
    """(RunningServer) over the folder's model; the engine is shut down afterwards."""
    state = serving_state(folder, name)
    try:
        with RunningServer(state) as running:
            yield running
    finally:
        state.loaded.engine.shutdown()
