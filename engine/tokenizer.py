"""Text <-> token ids, chat templates and streaming detokenization.

A tokenizer comes from a GGUF file's metadata (``Tokenizer.from_gguf``) or from a Hugging Face
folder (``Tokenizer.from_folder``). Both end up as a transformers fast tokenizer; encoding and
decoding go straight to its Rust backend, chat templates through transformers' Jinja renderer.

GGUF metadata is read here with a small reader over ``mmap`` (only the header is touched, never
tensor data): transformers' own reader walks the 49k-entry vocabulary through numpy memmap slices,
which takes about a second; this takes about 50 ms. The metadata is then handed to transformers'
GGUF tokenizer conversion, exactly as ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` would.
"""

from __future__ import annotations

import json
import mmap
import struct
import threading
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError, NInferError

# Tokens that end a turn in common chat templates; when the template uses one, it stops generation.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
_FOLDER_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
_NO_TEMPLATE_REMEDY = "Use /v1/completions with a plain prompt, or pass a chat template."
RELEASE_GIL_CHARS = 8192  # texts at least this long are encoded with the GIL released (Tokenizer.encode)


class Tokenizer:
    """One model's tokenizer. Build it with ``from_gguf``, ``from_folder`` or ``from_path``."""

    def __init__(self, hf: Any, *, chat_template: str | None = None, extra_eos_ids: tuple[int, ...] = ()):
        self._hf = hf
        self._backend = hf.backend_tokenizer  # tokenizers.Tokenizer
        template = chat_template if chat_template is not None else hf.chat_template
        if isinstance(template, dict):  # named templates: use the default one
            template = template.get("default")
        self.chat_template: str | None = template or None
        self.vocab_size: int = len(hf)
        self.bos_token_id: int | None = hf.bos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(self._find_eos_ids(extra_eos_ids))
        self._plain: Any = None  # a copy of the backend that reads special-token text as text (made when needed)
        self._plain_lock = threading.Lock()

    # ----- loading -----

    @classmethod
    def from_path(cls, path: Path, chat_template: str | None = None) -> Tokenizer:
        """A ``.gguf`` file or a Hugging Face folder."""
        path = Path(path)
        if path.is_dir():
            return cls.from_folder(path, chat_template)
        return cls.from_gguf(path, chat_template)

    @classmethod
    def from_gguf(cls, path: Path, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer and chat template stored in a GGUF file's metadata. Reads no tensors."""
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"Model file not found: {path}", "Check the path, or pass a model folder instead.")
        try:
            metadata = read_gguf_metadata(path)
        except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as err:
            raise ModelLoadError(
                f"{path} is not a readable GGUF file ({_short(err)}).",
                "The file may be incomplete or damaged: download it again, or choose another model.",
            ) from None
        try:
            hf = _hf_tokenizer_from_gguf(metadata)
        except Exception as err:  # transformers/tokenizers raise many kinds for an unusable vocabulary
            raise ModelLoadError(
                f"Cannot build the tokenizer stored in {path}: {_short(err)}",
                "This GGUF's tokenizer may not be supported; try the model's Hugging Face folder instead.",
            ) from None
        extra = tuple(
            metadata[key] for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if key in metadata
        )
        return cls(hf, chat_template=chat_template, extra_eos_ids=extra)

    @classmethod
    def from_folder(cls, path: Path, chat_template: str | None = None) -> Tokenizer:
        """A Hugging Face folder: tokenizer.json / tokenizer_config.json / chat_template.jinja."""
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"Model folder not found: {path}", "Check the path, or pass a .gguf file instead.")
        if not any((path / name).is_file() for name in _FOLDER_TOKENIZER_FILES):
            raise ModelLoadError(
                f"{path} has no tokenizer files (tokenizer.json or tokenizer_config.json).",
                "Use a complete Hugging Face model folder, or a .gguf file.",
            )
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            if getattr(hf, "backend_tokenizer", None) is None:
                raise ValueError(f"{type(hf).__name__} has no fast (tokenizer.json) backend")
        except Exception as err:  # transformers raises OSError, ValueError, JSON errors, ...
            raise ModelLoadError(
                f"Cannot load the tokenizer in {path}: {_short(err)}",
                "The folder needs a valid tokenizer.json (or files transformers converts to one); "
                "download the model again if files are damaged.",
            ) from None
        return cls(hf, chat_template=chat_template, extra_eos_ids=_generation_config_eos(path))

    def _find_eos_ids(self, extra: tuple[int, ...]) -> set[int]:
        ids = {i for i in extra if isinstance(i, int) and 0 <= i < self.vocab_size}
        if self._hf.eos_token_id is not None:
            ids.add(self._hf.eos_token_id)
        for token in _TURN_END_TOKENS:
            if self.chat_template and token in self.chat_template:
                token_id = self._backend.token_to_id(token)
                if token_id is not None:
                    ids.add(token_id)
        return ids

    # ----- text <-> ids -----

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """The token ids of `text`. A long text is encoded with the GIL released (tokenizers' encode_batch; encode
        holds it throughout, and a 1M-character prompt takes seconds), so the server's event loop and other threads
        run meanwhile; the ids are the same. ``parse_special=False`` reads the text of special tokens (e.g.
        ``<|im_end|>``) as plain text instead of as those tokens."""
        backend = self._backend if parse_special else self._plain_backend()
        if len(text) < RELEASE_GIL_CHARS:
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _plain_backend(self) -> Any:
        """A copy of the backend with ``encode_special_tokens`` set (the flag is the backend's own, shared by every
        thread that encodes, so it is never flipped on the one in use); made once, ~0.1 s."""
        with self._plain_lock:
            if self._plain is None:
                from tokenizers import Tokenizer as Backend

                plain = Backend.from_str(self._backend.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The token's text on its own (for logprobs); part of a UTF-8 character shows as U+FFFD."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token written exactly as in the vocabulary (e.g. ``"<|im_end|>"``), or None."""
        return self._backend.token_to_id(token)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ----- chat -----

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def render_chat(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text the chat template makes of OpenAI-style messages."""
        if not self.has_chat_template:
            raise NInferError("This model has no chat template, so it cannot take chat messages.", _NO_TEMPLATE_REMEDY)
        from jinja2 import TemplateError

        try:
            return self._hf.apply_chat_template(
                [_normalize_message(m) for m in messages],
                tools=tools or None,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **template_kwargs,
            )
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
            raise NInferError(
                f"The model's chat template cannot render these messages: {_short(err)}",
                "Check the message roles and their order (many templates need user/assistant turns to alternate).",
            ) from None

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """The prompt token ids. Special tokens come from the template text itself, none are added."""
        text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Streams text as token ids arrive, without re-decoding the whole output each time.

    Two offsets into the ids: ``_read`` (everything before it has been returned as text) and
    ``_prefix`` (where the decode window starts; the tokens in [_prefix, _read) were returned in the
    previous step and are decoded again only as context). Each step decodes the window with and
    without the new tokens; the new text is the difference. The context matters: sentencepiece drops
    the space of a window's first token, and a character split over byte tokens decodes as U+FFFD
    until its last byte arrives, so text is held back while the window's text ends with U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text returned so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _emit(self, piece: str) -> str:
        self._prefix, self._read = self._read, len(self._ids)
        if piece:
            self._pieces.append(piece)
        return piece

    def add(self, token_ids: list[int]) -> str:
        """Take new token ids; return the text they complete (possibly "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        context = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return ""  # nothing new yet, or the last character is still incomplete
        return self._emit(window[len(context) :])

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end comes out as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        full = self._decode(self._ids)  # once per stream, so the pieces add up to decode(all ids)
        done = self.text
        if full.startswith(done):
            return self._emit(full[len(done) :])
        context = self._decode(self._ids[self._prefix : self._read])
        return self._emit(self._decode(self._ids[self._prefix :])[len(context) :])


# ----- helpers -----


def _normalize_message(message: dict) -> dict:
    """An OpenAI message as chat templates expect it: string content, tool-call arguments as objects."""
    out = dict(message)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
        # images stay parts, for the template to place (engine.server.images hands it {"type": "image"})
        out["content"] = [p if isinstance(p, dict) and p.get("type") == "image" else
                          {"type": "text", "text": _text_of_part(p)} for p in content]
    elif isinstance(content, list):
        out["content"] = "\n".join(_text_of_part(part) for part in content)
    if out.get("tool_calls"):
        out["tool_calls"] = [_normalize_tool_call(call) for call in out["tool_calls"]]
    return out


def _text_of_part(part: Any) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type", "text") in ("text", "input_text"):
        return str(part.get("text", ""))
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise NInferError(f"This model reads text only; a message has a content part of type {kind!r}.",
                      "Send only text content parts.")


def _normalize_tool_call(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    return {**call, "function": function}


def _generation_config_eos(folder: Path) -> tuple[int, ...]:
    try:
        eos = json.loads((folder / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(i for i in eos if isinstance(i, int)) if isinstance(eos, list) else ()


def _short(err: BaseException, limit: int = 300) -> str:
    text = str(err).strip() or type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _hf_tokenizer_from_gguf(metadata: dict) -> Any:
    """What ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` builds, from metadata already read."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    architecture = metadata["general.architecture"]
    tokenizer_dict, config = (
        {name: metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in metadata}
        for renames in (GGUF_TOKENIZER_MAPPING["tokenizer"], GGUF_TOKENIZER_MAPPING["tokenizer_config"])
    )
    tokens = tokenizer_dict.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError("the file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    kind = tokenizer_dict.get("tokenizer_type")
    if kind == "llama":  # sentencepiece files without the flag get BOS, as in llama.cpp and transformers
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # its chat template writes <bos> itself (transformers does the same)
        config["add_bos_token"] = False
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        config[name] = tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None
    backend, extra_kwargs = convert_gguf_tokenizer(architecture, tokenizer_dict)
    config.update(extra_kwargs)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)


# GGUF metadata value types: scalar struct formats, 8 = string, 9 = array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """All key/value metadata of a GGUF (v2/v3) file. Raises ValueError/struct.error on a bad file."""
    with open(path, "rb") as file:
        if file.read(4) != b"GGUF":
            raise ValueError("it does not start with the GGUF magic bytes")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _MetadataReader(blob).read()


class _MetadataReader:
    def __init__(self, blob: mmap.mmap):
        self.blob = blob
        self.size = len(blob)
        self.pos = 4

    def unpack(self, fmt: str) -> Any:
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > self.size:
            raise ValueError("the metadata is truncated")
        text = self.blob[self.pos : end].decode("utf-8")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALAR:
            return self.unpack(_SCALAR[kind])
        if kind == 8:
            return self.string()
        if kind != 9:
            raise ValueError(f"unknown metadata value type {kind}")
        item_kind, count = self.unpack("<IQ")
        if count > self.size - self.pos:  # every item takes at least one byte
            raise ValueError("the metadata is truncated")
        if item_kind in _SCALAR:
            fmt = _SCALAR[item_kind]
            items = list(struct.unpack_from(f"<{count}{fmt[1]}", self.blob, self.pos))
            self.pos += count * struct.calcsize(fmt)
            return items
        return [self.value(item_kind) for _ in range(count)]

    def read(self) -> dict[str, Any]:
        version, _tensor_count, kv_count = self.unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (only 2 and 3)")
        if kv_count > self.size:
            raise ValueError("the metadata is truncated")
        metadata = {}
        for _ in range(kv_count):
            key = self.string()
            metadata[key] = self.value(self.unpack("<I"))
        if "general.architecture" not in metadata:
            raise ValueError("its metadata has no general.architecture")
        return metadata
