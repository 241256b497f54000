"""The parser's rules for repeated and cut-off tool calls (engine.server.toolcalls, engine.server.partialcalls)."""
import json

import pytest

from engine.server.parsers import ToolCallStreamer, parse_tool_calls
from engine.server.partialcalls import complete_object, cut_call

NAMES = {"get_weather", "search"}


@pytest.mark.parametrize("text, expected", [
    ('{"city": "Paris"}', {"city": "Paris"}),
    ('{"city": "Par', {"city": "Par"}),
    ('{"city": "Paris", "unit', {"city": "Paris"}),
    ('{"city": "Paris", "unit": ', {"city": "Paris"}),
    ('{"a": {"b": [1, 2', {"a": {"b": [1, 2]}}),
    ('{"a": "x\\', {}),
    ('{"q": "say \\"hi', {"q": 'say "hi'}),
    ('', {}),
    ('[1, 2', {}),
])
def test_complete_object(text, expected):
    assert complete_object(text) == expected


def test_a_repeated_call_is_dropped_and_a_different_one_kept():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
    same = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "C", "city": "Paris"}}\n</tool_call>\n'
    other = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    parsed = parse_tool_calls(call + same + other, NAMES)
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [{"city": "Paris", "unit": "C"}, {"city": "Oslo"}]
    assert parsed.content is None


@pytest.mark.parametrize("text, name, args", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "detail": "the wea', "get_weather",
     {"city": "Paris", "detail": "the wea"}),
    ('<tool_call>\n{"name": "search", "arguments": {"q": ', "search", {}),
    ('<tool_call>\n{"name": "search"', "search", {}),
    ('<tool_call>\n<function=get_weather>\n<parameter=city>\nPar', "get_weather", {"city": "Par"}),
    ('<tool_call>\n<function=search>\n<parameter=n>\n3\n</parameter>\n<parameter=q>\nca', "search",
     {"n": 3, "q": "ca"}),
])
def test_a_cut_call_stays_a_call(text, name, args):
    for chunks in ([text], list(text)):
        streamer = ToolCallStreamer(NAMES)
        events = [e for c in chunks for e in streamer.feed(c)] + streamer.flush()
        assert [e[0] for e in events] == ["tool_call"] and streamer.cut
        assert events[0][3] == name and json.loads(events[0][4]) == args


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "unknown", "arguments": {"a', '<tool_call>\n{"name": "get_w',
                                  '<tool_call>\n{"nam'])
def test_a_cut_call_of_no_offered_tool_is_content(text):
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.tool_calls == [] and parsed.content == text.strip()
    assert cut_call(text[len("<tool_call>"):], NAMES) is None


def test_a_complete_answer_is_not_cut():
    streamer = ToolCallStreamer(NAMES)
    streamer.feed('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>')
    streamer.flush()
    assert not streamer.cut and len(streamer.tool_calls) == 1
