"""Request bodies of the OpenAI-compatible API. Unknown fields are accepted and ignored, as OpenAI clients send many."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, Strict, StrictBool


# Bounds on what one request may hold (a 400 beyond them), so no request can make the server do unbounded work.
MAX_MESSAGES, MAX_TOOLS, MAX_STOP, MAX_STOP_CHARS = 4096, 128, 16, 512
MAX_PARTS = 16384  # content parts or tool calls of one message
MAX_PROMPTS = 4096  # prompts of one completions request (the server's queue usually takes fewer: a 400 that says so)
INT32_MAX = 2**31 - 1  # the largest token count (max_tokens, top_k, budget_tokens) a request may name

# JSON types as the OpenAI spec has them: no coercion of "10" or true to a number, or of "yes" to a boolean.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # a JSON integer is a number too
Bool = StrictBool
TokenCount = Annotated[int, Strict(), Field(ge=1, le=INT32_MAX)]


def _bounded_stop(stop: str | list[str] | None) -> str | list[str] | None:
    """One check for both spellings of stop, so the error names the field plainly (not one error per union member)."""
    items = [stop] if isinstance(stop, str) else stop or []
    if len(items) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop strings are allowed, not {len(items)}")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise ValueError(f"each stop string must be at most {MAX_STOP_CHARS} characters")
    if any(s == "" for s in items):
        raise ValueError("a stop string must not be empty (it would end the answer before it starts)")
    return stop


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


def _text_parts(content: str | list[dict[str, Any]] | None):
    """Content parts must name their type, and a text part's text must be a string (never coerced from 5)."""
    for part in content if isinstance(content, list) else ():
        if not isinstance(part.get("type"), str):
            raise ValueError("each content part needs a \"type\" string, e.g. {\"type\": \"text\", \"text\": ...}")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise ValueError("a text part's \"text\" must be a string")
    return content


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | Annotated[list[dict[str, Any]], Field(max_length=MAX_PARTS)] | None,
                       AfterValidator(_text_parts)] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_PARTS)
    tool_call_id: str | None = None


class StreamOptions(_Open):
    include_usage: Bool = False


class TextFormat(_Open):
    type: Literal["text"]


class JSONObjectFormat(_Open):
    type: Literal["json_object"]


class JSONSchemaSpec(_Open):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: Bool | None = None


class JSONSchemaFormat(_Open):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JSONObjectFormat, JSONSchemaFormat], Field(discriminator="type")]


class SamplingFields(_Open):
    """Fields shared by the completion endpoints; None means the server's default for the current mode."""
    model: str
    stream: Bool = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Float | None = Field(default=None, gt=0.0, le=10.0)
    stop: Annotated[str | list[str] | None, AfterValidator(_bounded_stop)] = None
    seed: Int | None = Field(default=None, ge=-2**63, le=2**63 - 1)  # int64, as the sampler's generator takes
    n: Int = Field(default=1, ge=1, le=8)
    ignore_eos: Bool = False
    logit_bias: dict[str, Float] | None = Field(default=None, max_length=1024)
    response_format: ResponseFormat | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def _ids(value: list) -> bool:
    return all(type(t) is int for t in value)  # a Python loop: other threads run while a long list is checked


def _prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """A completions prompt: text, texts, token ids or lists of token ids (never coerced). Checked here, item by
    item, rather than by the schema's union, which holds the interpreter ~0.5 s per million ids."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value:
        if _ids(value):
            return value
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, not {len(value)}")
        if all(type(p) is str for p in value):
            return value
        if all(type(p) is list and p and _ids(p) for p in value):
            return value
    raise ValueError("prompt must be a string, a list of strings, a list of token ids or a list of lists of token "
                     "ids, and not empty")


Prompt = Annotated[str | list[str] | list[Int] | list[list[Int]],
                   PlainValidator(_prompt, json_schema_input_type=str | list[str] | list[Int] | list[list[Int]])]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: Int | None = Field(default=None, ge=0, le=20)
    echo: Bool = False
    best_of: Int | None = Field(default=None, ge=1, le=1)  # only 1: several candidates per choice are not available
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
