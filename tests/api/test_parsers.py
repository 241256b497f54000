"""Reasoning and tool-call parsing of model output (engine/server/parsers.py): whole text, and streamed in every way
the text can be cut into deltas, must agree."""
import json
import random
import re
from pathlib import Path

import pytest

from engine.server.parsers import (ReasoningSplitter, ToolCall, ToolCallStreamer, parse_tool_calls, required_tool,
                                   split_reasoning, tool_names_for, validate_tools)

FIXTURES = Path(__file__).parent / "fixtures"
TOOLS = {"get_weather", "get_time", "search_web"}
SAME = object()  # content is the whole text, stripped: nothing in it is a call
ID_RE = re.compile(r"^call_[A-Za-z0-9]{24}$")

# name: (starts_in_reasoning, reasoning (first words, last words) or None, content, [(name, arguments)])
CASES = {
    "qwen3_think_tool_call.txt": (
        False, ("Okay, the user is asking", "Let me call the tool."), None,
        [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    "qwen3_think_mentions_tags.txt": (
        False, ("The system prompt says to wrap calls in <tool_call></tool_call>", '"arguments": ...}.'),
        "Let me look up the current time in Tokyo.", [("get_time", {"timezone": "Asia/Tokyo"})]),
    "deepseek_r1_prompt_opened_think.txt": (
        True, ("Okay, so the user wants", "No tool needed."), "17 × 23 = **391**.", []),
    "hermes_multiple_calls.txt": (
        False, None, "I'll check the weather in both cities for you.",
        [("get_weather", {"city": "Paris", "unit": "celsius"}),
         ("get_weather", {"city": "New York", "unit": "fahrenheit"})]),
    "hermes_no_newlines.txt": (
        False, None, None, [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    "bare_json_llama.txt": (
        False, None, None, [("get_weather", {"city": "San Francisco", "unit": "fahrenheit"})]),
    "bare_json_list.txt": (
        False, None, None, [("get_weather", {"city": "Berlin"}), ("get_time", {"timezone": "Europe/Berlin"})]),
    "fenced_json_preamble.txt": (
        False, None, "Sure! To answer that I need the current conditions, so I'll call the weather tool:",
        [("get_weather", {"city": "Lyon", "unit": "celsius"})]),
    "fenced_no_lang.txt": (
        False, None, None, [("search_web", {"query": "latest Python release", "max_results": 3})]),
    # the call object lacks its closing brace, after complete arguments: a call once its arguments began
    "invalid_json_tool_call.txt": (False, None, None, [("get_weather", {"city": "Paris"})]),
    "unknown_tool.txt": (False, None, SAME, []),
    "plain_braces.txt": (False, None, SAME, []),
    "python_fences.txt": (False, None, SAME, []),
    "json_answer.txt": (False, None, SAME, []),
    "invalid_then_valid.txt": (
        False, None,
        '<tool_call>\n{"name": "get_weather", arguments: {"city": "Rome"}}\n</tool_call>\n'
        "Sorry, let me try that again.",
        [("get_weather", {"city": "Rome"})]),
    "qwen3_coder_xml.txt": (
        False, None, "I'll search for that.", [("search_web", {"query": "NInfer inference engine", "max_results": 5})]),
    "mistral_tool_calls.txt": (False, None, None, [("get_weather", {"city": "Madrid", "unit": "celsius"})]),
    "arguments_as_string.txt": (
        False, None, None, [("search_web", {"query": "météo à Zürich — 東京", "max_results": 2})]),
}


def load(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_every_fixture_has_a_case():
    assert sorted(p.name for p in FIXTURES.glob("*.txt")) == sorted(CASES)


def whole(text, starts=False, tools=TOOLS):
    reasoning, content = split_reasoning(text, starts)
    parsed = parse_tool_calls(content, tools)
    return reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def stream(chunks, starts=False, tools=TOOLS):
    """The server's pipeline: reasoning splitter, then the tool-call streamer on the content deltas."""
    splitter, streamer = ReasoningSplitter(starts), ToolCallStreamer(tools)
    reasoning, events = [], []
    for chunk in chunks:
        r, c = splitter.feed(chunk)
        reasoning.append(r)
        events += streamer.feed(c)
    r, c = splitter.flush()
    reasoning.append(r)
    events += streamer.feed(c) + streamer.flush()
    return "".join(reasoning) or None, events


def summarize(events):
    """(content, [(name, arguments)]) from streamed events, checking the call protocol: each call begins once
    (index in order, a fresh id), its argument pieces follow with nothing between them, and they concatenate to
    the arguments its end gives."""
    calls, open_call = [], None
    for e in events:
        assert e[0] in ("content", "tool_call", "tool_args", "tool_end")
        if e[0] == "content":
            assert len(e) == 2 and e[1] and open_call is None
        elif e[0] == "tool_call":
            assert open_call is None and e[1] == len(calls) and ID_RE.match(e[2])
            open_call = [e[2], e[3], e[4]]
        elif e[0] == "tool_args":
            assert open_call is not None and e[1] == len(calls) and e[2]
            open_call[2] += e[2]
        else:
            assert open_call is not None and e[1] == len(calls) and open_call[2] == e[2]
            json.loads(e[2])
            calls.append(open_call)
            open_call = None
    assert open_call is None
    assert len({c[0] for c in calls}) == len(calls)
    content = "".join(e[1] for e in events if e[0] == "content") or None
    return content, [(c[1], c[2]) for c in calls]


def random_chunks(text, rng, most=8):
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        chunks.append(text[i:i + n])
        i += n
    return chunks


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixture_whole_text(name):
    starts, reasoning, content, calls = CASES[name]
    text = load(name)
    got_reasoning, got_content, got_calls = whole(text, starts)
    if reasoning is None:
        assert got_reasoning is None
    else:
        assert got_reasoning.startswith(reasoning[0]) and got_reasoning.endswith(reasoning[1])
        assert "<think>" not in got_reasoning and "</think>" not in got_reasoning
    assert got_content == (text.strip() if content is SAME else content)
    assert [(n, json.loads(a)) for n, a in got_calls] == calls
    for _, arguments in got_calls:
        assert isinstance(arguments, str) and isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixture_streaming_equals_whole(name):
    starts = CASES[name][0]
    text = load(name)
    expected = whole(text, starts)
    splits = [list(text), [text]]
    splits += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(f"chunks-{name}")
    splits += [random_chunks(text, rng, most) for most in (2, 3, 5, 8, 16, 40) for _ in range(6)]
    for chunks in splits:
        assert "".join(chunks) == text
        reasoning, events = stream(chunks, starts)
        assert (reasoning, *summarize(events)) == expected, chunks


@pytest.mark.parametrize("name", sorted(n for n, case in CASES.items() if case[1] is None))
def test_tool_streamer_alone_every_split(name):
    text = load(name)
    parsed = parse_tool_calls(text, TOOLS)
    expected = (parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls])
    for i in range(len(text) + 1):
        for j in (i, min(len(text), i + 1), min(len(text), i + 7)):
            streamer = ToolCallStreamer(TOOLS)
            events = streamer.feed(text[:i]) + streamer.feed(text[i:j]) + streamer.feed(text[j:]) + streamer.flush()
            assert summarize(events) == expected, (i, j)


def test_arguments_keep_non_ascii_and_tool_calls_render_in_openai_shape():
    parsed = parse_tool_calls(load("arguments_as_string.txt"), TOOLS)
    (call,) = parsed.tool_calls
    assert "Zürich" in call.arguments and "東京" in call.arguments
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "search_web", "arguments": call.arguments}}
    assert call.to_openai(index=2) == {"index": 2, **call.to_openai()}


def test_ids_are_unique_and_well_formed():
    ids = [ToolCall.new("f", "{}").id for _ in range(2000)]
    ids += [c.id for c in parse_tool_calls(load("hermes_multiple_calls.txt"), TOOLS).tool_calls]
    assert len(set(ids)) == len(ids)
    assert all(ID_RE.match(i) for i in ids)


# --- fuzz: random mixes of markers, JSON and text; streaming must equal whole text, and no text is lost ---
PIECES = ["<tool_call>", "</tool_call>", "\n", " ", "  ", "hello", "{x}", "[1]", "{", "}", "[", "]", '"', "`", "<",
          "\\", '{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"name": "nope", "arguments": {}}',
          '{"name": "get_time", "parameters": {"tz": "UTC"}}', '{"a": 1}', "```json\n", "```\n", "```", "```python\n",
          "[TOOL_CALLS]", "get_weather[ARGS]", '{"city": "Oslo"}', "<function=get_weather>",
          "<parameter=city>\nParis\n</parameter>", "</function>", "<think>", "</think>", '"arguments": ', "é東",
          '{"name": "get_weather", "arguments": {"city": ', "NaN", "12", '"x\\u00e9\\ud83d\\ude00"', "<function=nope>",
          "<parameter=n>", "</parameter>", ","]


@pytest.mark.parametrize("seed", range(8))
def test_fuzz_streaming_equals_whole(seed):
    rng = random.Random(seed)
    for _ in range(60):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 14)))
        for tools in (TOOLS, None):
            parsed = parse_tool_calls(text, tools)
            expected = (parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls])
            if not parsed.tool_calls:
                assert parsed.content == (text.strip() or None)
            for _, arguments in expected[1]:
                assert isinstance(json.loads(arguments), dict)
            for chunks in [list(text)] + [random_chunks(text, rng, m) for m in (3, 9)]:
                streamer = ToolCallStreamer(tools)
                events = [e for c in chunks for e in streamer.feed(c)] + streamer.flush()
                assert summarize(events) == expected, (text, chunks)
        for starts in (False, True):
            r_whole = split_reasoning(text, starts)
            splitter = ReasoningSplitter(starts)
            parts = [splitter.feed(c) for c in random_chunks(text, rng, 4)] + [splitter.flush()]
            assert ("".join(p[0] for p in parts) or None, "".join(p[1] for p in parts)) == r_whole, text


# --- which names count ---
def test_tool_names_filter():
    text = load("unknown_tool.txt")
    assert parse_tool_calls(text, TOOLS).tool_calls == []
    (call,) = parse_tool_calls(text, None).tool_calls  # None: any name counts
    assert call.name == "book_flight"
    assert parse_tool_calls(text, {"book_flight"}).content == "I can book that for you."
    for name in CASES:  # an empty set (no tools offered): everything is content
        assert parse_tool_calls(load(name), set()) == parse_tool_calls(load(name), {"other"})
        assert parse_tool_calls(load(name), set()).content == load(name).strip()


@pytest.mark.parametrize("text,content,names", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, ["get_weather"]),  # unclosed
    ('```json\n{"name": "get_weather", "arguments": {}}', None, ["get_weather"]),  # unclosed fence
    ('{"name": "get_weather", "arguments": {}}\nDone.', "Done.", ["get_weather"]),
    ('{"name": "get_weather", "parameters": {}}\n{"name": "get_time", "parameters": {}}', None,
     ["get_weather", "get_time"]),
    ('Sure: {"name": "get_weather", "arguments": {}}', 'Sure: {"name": "get_weather", "arguments": {}}', []),
    ('{"name": "get_weather"}', '{"name": "get_weather"}', []),  # bare JSON needs arguments
    ('<tool_call>{"name": "get_weather"}</tool_call>', None, ["get_weather"]),  # tagged: arguments default to {}
    # arguments that stop being JSON after they began: still the call, with what closes into an object
    ('<tool_call>{"name": "get_weather", "arguments": {"x": NaN}}</tool_call>', None, ["get_weather"]),
    ('{"name": "get_weather", "arguments": {"a": 1, "x": NaN}} then text', "then text", ["get_weather"]),
    ('<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>', []),
    ('<tool_call>{"type": "function", "function": {"name": "get_time", "arguments": {}}}</tool_call>', None,
     ["get_time"]),
    ("<tool_call>\n</tool_call>", "<tool_call>\n</tool_call>", []),
    ("[1, 2, 3] are the answers", "[1, 2, 3] are the answers", []),
    ("   \n  ", None, []),
    ("", None, []),
])
def test_edge_cases(text, content, names):
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == content
    assert [c.name for c in parsed.tool_calls] == names
    for i in range(len(text) + 1):
        streamer = ToolCallStreamer(TOOLS)
        events = streamer.feed(text[:i]) + streamer.feed(text[i:]) + streamer.flush()
        assert summarize(events) == (content, [(c.name, c.arguments) for c in parsed.tool_calls])


# --- streaming latency: text is not held back longer than needed ---
def test_plain_text_streams_at_once():
    s = ToolCallStreamer(TOOLS)
    assert s.feed("Hello, ") == [("content", "Hello,")]  # trailing whitespace waits for what follows
    assert s.feed("world") == [("content", " world")]
    assert s.feed(" <tool") == []
    assert s.feed("kit> ok") == [("content", " <toolkit> ok")]
    assert s.flush() == []


def test_content_before_a_call_is_sent_before_the_call_completes():
    s = ToolCallStreamer(TOOLS)
    assert s.feed("I'll check.\n<tool_") == [("content", "I'll check.")]
    assert s.feed('call>\n{"name": "get_weather", "argu') == []
    events = s.feed('ments": {"ci')  # the name is offered and the arguments began: the call is announced
    assert [(e[0], e[1], e[3], e[4]) for e in events] == [("tool_call", 0, "get_weather", "{")]
    assert s.feed('ty": "Par') == [("tool_args", 0, '"city": "Par')]  # a key waits for its value
    assert s.feed('is"}}\n</tool_call>') == [("tool_args", 0, 'is"}'), ("tool_end", 0, '{"city": "Paris"}')]
    assert s.flush() == []


def test_arguments_stream_in_canonical_pieces_whatever_the_spacing():
    s = ToolCallStreamer(TOOLS)
    text = '<tool_call>{"name":"search_web","arguments":{"query":"a\\u00e9\\n","n" : 1.50}}</tool_call>'
    got = [e for c in text for e in s.feed(c)] + s.flush()
    assert [e[0] for e in got] == ["tool_call"] + ["tool_args"] * (len(got) - 2) + ["tool_end"] and len(got) > 4
    assert "".join(e[-1] for e in got[:-1]) == got[-1][2] == '{"query": "aé\\n", "n": 1.5}'


def test_bare_json_that_is_not_a_call_streams_after_its_first_key():
    s = ToolCallStreamer(TOOLS)
    assert s.feed('{"ans') == []
    assert "".join(e[1] for e in s.feed('wer": 4')) == '{"answer": 4'
    s = ToolCallStreamer(TOOLS)
    assert s.feed("{x} here") == [("content", "{x} here")]


def test_code_fences_stream_and_their_closing_fence_is_not_an_opening():
    s = ToolCallStreamer(TOOLS)
    out = s.feed("Example:\n```python\nprint(1)\n")
    assert "".join(e[1] for e in out) == "Example:\n```python\nprint(1)"
    out = s.feed('```\n{"name": "get_weather", "arguments": {}}\n')
    assert all(e[0] == "content" for e in out)
    s = ToolCallStreamer(TOOLS)
    assert "".join(e[1] for e in s.feed("```\nls -la\n")) == "```\nls -la"  # no language: held only until the body


def test_mistral_prefix_is_held_then_resolved():
    s = ToolCallStreamer(TOOLS)
    assert s.feed("[TOOL_CA") == []
    assert s.feed("LLS]get_weather[ARGS]") == []
    events = s.feed('{"city": "Oslo"}')
    assert [e[0] for e in events] == ["tool_call", "tool_end"] and events[0][3] == "get_weather"
    assert events[1][2] == '{"city": "Oslo"}'


# --- reasoning ---
REASONING_TEXTS = [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", False, ("Let me think.", "The answer is 4.")),
    ("<think>\n\n</think>\n\nHello!", False, (None, "Hello!")),  # Qwen3 with thinking off
    ("  <think>a < b, and </thin is not a tag</think>ok", False, ("a < b, and </thin is not a tag", "ok")),
    ("Let me think.\n</think>\n\nAnswer.", True, ("Let me think.", "Answer.")),
    ("<think>\nrepeated open tag\n</think>\nAnswer.", True, ("repeated open tag", "Answer.")),
    ("No reasoning here. <think>not at the start</think>", False,
     (None, "No reasoning here. <think>not at the start</think>")),
    ("\n\nJust text", False, (None, "\n\nJust text")),
    ("<think>\nunfinished thought, cut by max_tokens", False, ("unfinished thought, cut by max_tokens", "")),
    ("still thinking </thi", True, ("still thinking </thi", "")),
    ("<thin", False, (None, "<thin")),
    ("<think>x</think></think>y", False, ("x", "</think>y")),
]


@pytest.mark.parametrize("text,starts,expected", REASONING_TEXTS)
def test_reasoning_whole_and_every_split(text, starts, expected):
    assert split_reasoning(text, starts) == expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            splitter = ReasoningSplitter(starts)
            parts = [splitter.feed(text[:i]), splitter.feed(text[i:j]), splitter.feed(text[j:]), splitter.flush()]
            assert ("".join(p[0] for p in parts) or None, "".join(p[1] for p in parts)) == expected, (i, j)


def test_reasoning_never_emits_part_of_a_tag():
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>\nStep one.\n</th") == ("Step one.", "")
    assert splitter.in_reasoning
    assert splitter.feed("ink>\n\n") == ("", "")
    assert not splitter.in_reasoning
    assert splitter.feed("Done.") == ("", "Done.")
    assert splitter.flush() == ("", "")
    splitter = ReasoningSplitter(starts_in_reasoning=True)
    assert splitter.feed("a\n\n") == ("a", "")
    assert splitter.feed("b</") == ("\n\nb", "")
    assert splitter.feed("think>c") == ("", "c")


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[1] is not None])
def test_reasoning_fixture_char_by_char(name):
    starts = CASES[name][0]
    text = load(name)
    splitter = ReasoningSplitter(starts)
    parts = [splitter.feed(c) for c in text] + [splitter.flush()]
    for r, c in parts:
        assert "</think" not in c and "<think" not in r
    assert ("".join(p[0] for p in parts) or None, "".join(p[1] for p in parts)) == split_reasoning(text, starts)


# --- tools and tool_choice ---
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tool_names_for():
    assert tool_names_for([WEATHER, TIME], None) == {"get_weather", "get_time"}
    assert tool_names_for([WEATHER, TIME], "auto") == {"get_weather", "get_time"}
    assert tool_names_for([WEATHER, TIME], "required") == {"get_weather", "get_time"}
    assert tool_names_for([WEATHER, TIME], "none") == set()
    assert tool_names_for(None, "auto") == set() == tool_names_for([], None)
    assert tool_names_for([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}) == {"get_time"}


def test_required_tool():
    assert required_tool("required") is True
    assert required_tool({"type": "function", "function": {"name": "get_time"}}) == "get_time"
    assert required_tool({"type": "function", "name": "get_time"}) == "get_time"
    assert required_tool("auto") is None and required_tool("none") is None and required_tool(None) is None


def test_validate_tools_accepts_good_requests():
    assert validate_tools(None) == []
    assert validate_tools([WEATHER, TIME], "auto") == []
    assert validate_tools([WEATHER], "required") == []
    assert validate_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}) == []
    assert validate_tools(None, "none") == []


@pytest.mark.parametrize("tools,choice,fragment", [
    ([{"type": "retrieval", "function": {"name": "x"}}], None, "type must be \"function\""),
    ([{"type": "function"}], None, "function must be an object"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "function.name"),
    ([{"type": "function", "function": {"name": "x" * 129}}], None, "function.name"),
    ([{"type": "function", "function": {"name": 3}}], None, "function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], None, "parameters"),
    ([WEATHER, WEATHER], None, "more than one tool"),
    ("get_weather", None, "tools must be a list"),
    (["get_weather"], None, "tools[0] must be an object"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "not among the tools"),
    ([WEATHER], {"type": "function"}, "tool_choice must be"),
    ([WEATHER], "always", "tool_choice must be"),
    (None, "required", "needs at least one tool"),
    (None, {"type": "function", "function": {"name": "get_time"}}, "not among the tools"),
])
def test_validate_tools_reports_problems(tools, choice, fragment):
    problems = validate_tools(tools, choice)
    assert problems and any(fragment in p for p in problems), problems
