"""Tool-call arguments written as they stream (engine/server/argstream.py), against Python's json module: the
pieces of any JSON object, however it is spaced, escaped or cut, concatenate to json.dumps of its value, and at any
cut what was written closes into a valid object."""
import json
import random

import pytest

from engine.server.argstream import ArgsWriter, canonical_json


def random_value(rng, depth=0):
    kind = rng.randint(0, 7 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-10**20, 10**20)
    if kind == 1:
        return rng.choice([0.5, -1e-7, 1e300, 3.0, -0.0, 12345.678])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind in (3, 4):
        return "".join(rng.choice('ab"\\\n\t\x01é東😀/ \x7f') for _ in range(rng.randint(0, 6)))
    if kind == 5:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {"".join(rng.choice('ab"\\é😀') for _ in range(rng.randint(0, 4))) + str(i): random_value(rng, depth + 1)
            for i in range(rng.randint(0, 3))}


@pytest.mark.parametrize("seed", range(4))
def test_pieces_concatenate_to_json_dumps_and_every_cut_closes(seed):
    rng = random.Random(seed)
    for _ in range(300):
        value = {f"k{i}": random_value(rng) for i in range(rng.randint(0, 4))}
        want = json.dumps(value, ensure_ascii=False)
        assert canonical_json(value) == want
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]),
                          separators=rng.choice([None, (",", ":")]))
        writer, pieces, i = ArgsWriter(), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            pieces.append(writer.feed(text[i:i + n]))
            i += n
            assert want.startswith("".join(pieces)), text  # nothing written is ever taken back
        assert writer.done and not writer.bad and "".join(pieces) == want
        for cut in range(0, len(text), 5):
            writer = ArgsWriter()
            written = writer.feed(text[:cut])
            assert isinstance(json.loads(written + writer.close()), dict)


def test_the_rest_after_the_object_and_where_broken_json_starts():
    writer = ArgsWriter()
    assert writer.feed('{"a": [1, true]} tail') == '{"a": [1, true]}' and writer.done and writer.rest == " tail"
    writer = ArgsWriter()
    assert writer.feed('{"a": 1, "b": NaN}') == '{"a": 1' and writer.bad and writer.rest == 'NaN}'
    assert writer.close() == "}"
    for broken in ('{"a": 1,}', '{"a" 1}', "{'a': 1}", '{"a": 01}', '{"a": 1e999}', '{"a": tru}', '[1]'):
        writer = ArgsWriter()
        writer.feed(broken)
        assert writer.bad and isinstance(json.loads(writer.text + writer.close()), dict), broken


def test_raw_control_characters_in_strings_are_escaped():
    writer = ArgsWriter()
    assert writer.feed('{"code": "a\n\tb"}') == '{"code": "a\\n\\tb"}' and writer.done
