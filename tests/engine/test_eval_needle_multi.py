"""ninfer-eval needle --keys / --values: multi-key prompts hide one key per door and ask for one door's; multi-value
prompts hide several keys of the asked door and want all of them. A reader that takes any key fails multi-key, one
that gives a single key fails multi-value, and a reader that finds the asked door's keys passes both."""
from __future__ import annotations

import json
import re

from engine.tools.eval import cli, needle


def _tokens(text: str) -> int:
    return len(text) // 4


def test_multi_key_prompt_hides_every_door_and_asks_one():
    prompt, wanted = needle.build_multi(1024, 0.0, 3, _tokens, keys=4, values=1)
    found = re.findall(r"One pass key for the (\w+) door is (\d{5})\.", prompt)
    assert len(found) == 4 and len({d for d, _ in found}) == 4
    asked = re.search(r"What is the pass key for the (\w+) door\?", prompt).group(1)
    assert wanted == [k for d, k in found if d == asked]
    filler_at = prompt.index("The grass is green")
    assert prompt.index(f"the {asked} door is {wanted[0]}") < filler_at  # depth 0: before all filler
    assert abs(_tokens(prompt) - 1024) < 40


def test_multi_value_prompt_wants_all_keys_of_the_door():
    prompt, wanted = needle.build_multi(2048, 0.5, 1, _tokens, keys=2, values=3)
    asked = re.search(r"What are all the pass keys for the (\w+) door\?", prompt).group(1)
    found = re.findall(rf"One pass key for the {asked} door is (\d{{5}})\.", prompt)
    assert sorted(found) == sorted(wanted) and len(wanted) == 3
    assert len(re.findall(r"One pass key for the \w+ door", prompt)) == 4


class _Reader:
    """A stand-in model that reads the whole prompt; ``mode`` says how it answers."""
    mode = "right"

    def __init__(self, *args, **kwargs):
        pass

    context_window = 100_000

    def describe(self):
        return {"reader": self.mode}

    def count_tokens(self, text):
        return _tokens(text)

    def complete(self, prompt, max_tokens):
        door = re.search(r"for the (\w+) door\?", prompt).group(1)
        every = re.findall(r"for the (\w+) door is (\d{5})", prompt)
        mine = [k for d, k in every if d == door]
        if self.mode == "last key":
            return " " + every[-1][1]
        if self.mode == "one key":
            return " " + mine[0]
        return " " + ", ".join(mine)

    def close(self):
        pass


def _run(tmp_path, monkeypatch, mode, *flags) -> dict:
    from engine.tools.eval import target

    monkeypatch.setattr(target, "EngineTarget", _Reader)
    _Reader.mode = mode
    out = tmp_path / f"{mode}.json"
    assert cli.main(["needle", "--lengths", "512,1024", "--depths", "0,0.5,1", "--seeds", "3", "--no-progress",
                     "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


def test_multi_key_fails_a_reader_that_takes_any_key(tmp_path, monkeypatch):
    right = _run(tmp_path, monkeypatch, "right", "--keys", "4")
    assert right["passed"] == right["items"] == 18
    careless = _run(tmp_path, monkeypatch, "last key", "--keys", "4")
    assert careless["passed"] < careless["items"] // 2


def test_multi_value_fails_a_reader_that_gives_one_key(tmp_path, monkeypatch, capsys):
    right = _run(tmp_path, monkeypatch, "right", "--values", "3")
    assert right["passed"] == right["items"]
    assert "3 key(s) of the asked door wanted" in capsys.readouterr().out
    one = _run(tmp_path, monkeypatch, "one key", "--values", "3")
    assert one["passed"] == 0


def test_out_of_range_keys_are_refused(capsys):
    assert cli.main(["needle", "--keys", "40", "--no-progress"]) == 1
    assert "--keys must be 1 to 12" in capsys.readouterr().err
