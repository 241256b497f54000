"""The parser's rules for repeated and cut-off tool calls (engine.server.toolcalls, engine.server.partialcalls)."""
import json

import pytest

from engine.server.parsers import ToolCallStreamer, parse_tool_calls
from engine.server.partialcalls import cut_call

NAMES = {"get_weather", "search"}


def test_a_repeated_call_is_dropped_before_any_of_it_is_sent_and_a_different_one_kept():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
    same = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris", "unit":"C"}}\n</tool_call>\n'
    other = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "F"}}\n</tool_call>'
    parsed = parse_tool_calls(call + same + other, NAMES)
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [{"city": "Paris", "unit": "C"},
                                                                    {"city": "Paris", "unit": "F"}]
    assert parsed.content is None
    streamer = ToolCallStreamer(NAMES)
    events = [e for c in call + same + other for e in streamer.feed(c)] + streamer.flush()
    assert [e[0] for e in events].count("tool_call") == 2 and [e[0] for e in events].count("tool_end") == 2
    second = [e for e in events if e[0] != "content" and e[1] == 1]
    assert second[0][0] == "tool_call" and second[0][4] == '{"city": "Paris", "unit": "F'  # held while the same
    assert "".join(e[-1] for e in second[:-1]) == second[-1][2]


def test_a_repeat_in_another_key_order_is_kept():
    """A repeat is the same arguments text once canonical: a call whose keys come in another order was already
    being sent when it could be told from the earlier one, so it stays (in the whole-text parse too)."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'
    swapped = '<tool_call>{"name": "get_weather", "arguments": {"unit": "C", "city": "Paris"}}</tool_call>'
    assert len(parse_tool_calls(call + swapped, NAMES).tool_calls) == 2


@pytest.mark.parametrize("text, name, args", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "detail": "the wea', "get_weather",
     {"city": "Paris", "detail": "the wea"}),
    ('<tool_call>\n{"name": "search", "arguments": {"q": ', "search", {}),
    ('<tool_call>\n{"name": "search"', "search", {}),
    ('<tool_call>\n<function=get_weather>\n<parameter=city>\nPar', "get_weather", {"city": "Par"}),
    ('<tool_call>\n<function=search>\n<parameter=n>\n3\n</parameter>\n<parameter=q>\nca', "search",
     {"n": 3, "q": "ca"}),
    ('<tool_call>\n<function=search>\n<parameter=n>\n12', "search", {"n": 12}),
    ('<tool_call>\n{"name": "search", "arguments": {"q": "x", "n": 4', "search", {"q": "x", "n": 4}),
    ('<tool_call>\n{"name": "search", "arguments": {"q": ["a", {"b": tr', "search", {"q": ["a", {}]}),
    ('{"name": "search", "arguments": {"q": "say \\"hi', "search", {"q": 'say "hi'}),
])
def test_a_cut_call_stays_a_call(text, name, args):
    for chunks in ([text], list(text)):
        streamer = ToolCallStreamer(NAMES)
        events = [e for c in chunks for e in streamer.feed(c)] + streamer.flush()
        kinds = [e[0] for e in events]
        assert kinds == ["tool_call"] + ["tool_args"] * (len(kinds) - 2) + ["tool_end"] and streamer.cut
        assert "".join(e[-1] for e in events[:-1]) == events[-1][2]
        assert events[0][3] == name and json.loads(events[-1][2]) == args


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


def test_xml_parameters_follow_their_schema_type_and_strings_stream_as_written():
    text = ('<tool_call>\n<function=search>\n<parameter=q>\n42\n</parameter>\n<parameter=n>\n42\n</parameter>\n'
            '<parameter=body>\n{"a": 1}\nline two\n</parameter>\n</function>\n</tool_call>')
    schemas = {"search": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"},
                                                           "body": {"type": "string"}}}}
    (call,) = parse_tool_calls(text, schemas).tool_calls
    assert json.loads(call.arguments) == {"q": "42", "n": 42, "body": '{"a": 1}\nline two'}
    (call,) = parse_tool_calls(text, NAMES).tool_calls  # no schema: JSON when it parses as JSON
    assert json.loads(call.arguments) == {"q": 42, "n": 42, "body": '{"a": 1}\nline two'}
    streamer = ToolCallStreamer(schemas)
    events = [e for c in text for e in streamer.feed(c)] + streamer.flush()
    pieces = [e[-1] for e in events[:-1]]
    assert "".join(pieces) == events[-1][2] == call.arguments.replace('"q": 42', '"q": "42"')
    assert len(pieces) > len("line two") + 5  # the string values came as they were written


def test_a_broken_bare_call_drops_up_to_where_its_brackets_close():
    parsed = parse_tool_calls('{"name": "search", "arguments": {"q": "x", "n": [1, 2}]}} And then text.', NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("search", {"q": "x", "n": [1, 2]})]
    assert parsed.content == "} And then text."


def test_with_parallel_calls_off_only_the_first_call_is_kept():
    text = ('<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> Done.')
    for chunks in ([text], list(text)):
        streamer = ToolCallStreamer(NAMES, parallel=False)
        events = [e for c in chunks for e in streamer.feed(c)] + streamer.flush()
        assert {e[1] for e in events if e[0] != "content"} == {0} and len(streamer.tool_calls) == 1
        assert streamer.tool_calls[0].name == "search"
        assert "".join(e[1] for e in events if e[0] == "content") == "Done."
