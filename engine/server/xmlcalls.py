"""Qwen3-Coder's XML tool calls read as they are generated:
`<function=NAME>\n<parameter=P>\nVALUE\n</parameter>...</function>`, written out as the JSON object of the
arguments. A parameter whose schema type is "string" is a string; any other is read as JSON when its value parses
as JSON and kept as a string otherwise. A string value streams as it is written (the one newline before
`</parameter>` held until it is known not to be the value's last); any other is written once its
`</parameter>` came. Used by engine.server.livecalls, whose reader this completes."""
from __future__ import annotations

from typing import Any, Protocol

from engine.server.argstream import WS, canonical_json, escape
from engine.server.callsyntax import loads
from engine.server.reasoning import partial_tail

FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_JSON_START = set('{["-0123456789tfn') | set(WS)
WAIT = "wait"


class Sink(Protocol):
    def begin(self, name: str) -> None: ...
    def args(self, piece: str) -> None: ...
    def end(self) -> None: ...
    def whole(self, name: str, arguments: str) -> None: ...


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def xml_head(buf: str, i: int, names: set[str] | None):
    """For `<function=NAME>` at buf[i]: (NAME, index after ">") when NAME is offered; WAIT; None."""
    if not buf.startswith(FUNC_OPEN, i):
        return WAIT if FUNC_OPEN.startswith(buf[i:]) else None
    end = buf.find(">", i)
    if end < 0:
        return None if "\n" in buf[i:] else WAIT
    name = buf[i + len(FUNC_OPEN):end].strip()
    return (name, end + 1) if name and "\n" not in name and (names is None or name in names) else None


class XmlCalls:
    """The XML states of engine.server.livecalls.LiveCalls."""
    sink: Sink
    names: set[str] | None
    schemas: dict[str, Any]
    state: str
    function: str
    param: str
    params: int
    stripped: bool

    # --- a Qwen3-Coder XML call ---
    def _function(self, buf: str, i: int, final: bool):
        head = xml_head(buf, i, self.names)
        if head == WAIT and not final:
            return None
        if head in (WAIT, None):
            self.state = "junk"
            return i
        self.function, end = head
        self.sink.begin(self.function)
        self.sink.args("{")
        self.params, self.state = 0, "xml"
        return end

    def _xml(self, buf: str, i: int, final: bool):
        j = skip_ws(buf, i)
        if j == len(buf):
            return j if j > i else None
        if buf.startswith(FUNC_CLOSE, j):
            self.sink.args("}")
            self.sink.end()
            self.state = "value"
            return j + len(FUNC_CLOSE)
        if buf.startswith(PARAM_OPEN, j):
            end = buf.find(">", j)
            if end < 0:
                if "\n" not in buf[j:]:
                    return j if j > i else None
            else:
                self.param, self.stripped, self.state = buf[j + len(PARAM_OPEN):end].strip(), False, "xml_start"
                return end + 1
        elif any(t.startswith(buf[j:]) for t in (FUNC_CLOSE, PARAM_OPEN)):
            return j if j > i else None
        self.sink.args("}")  # not a parameter: the call ends here, broken
        self.sink.end()
        self.state = "junk"
        return j

    def _key(self) -> str:
        sep = ", " if self.params else ""
        self.params += 1
        return f'{sep}"{escape(self.param)}": '

    def _is_string(self) -> bool:
        props = (self.schemas.get(self.function) or {}).get("properties")
        spec = props.get(self.param) if isinstance(props, dict) else None
        return isinstance(spec, dict) and spec.get("type") == "string"

    def _xml_start(self, buf: str, i: int, final: bool):
        if buf[i] == "\n" and not self.stripped:
            self.stripped = True
            return i + 1
        self.stripped = True
        if self._is_string() or buf[i] not in _JSON_START:
            self.sink.args(self._key() + '"')
            self.state = "xml_string"
        else:
            self.state = "xml_json"
        return i

    def _xml_string(self, buf: str, i: int, final: bool):
        k = buf.find(PARAM_CLOSE, i)
        if k >= 0:
            self.sink.args(escape(self._strip_end(buf[i:k])) + '"')
            self.state = "xml"
            return k + len(PARAM_CLOSE)
        keep = max(partial_tail(buf, "\n" + PARAM_CLOSE), partial_tail(buf, PARAM_CLOSE))
        end = len(buf) - keep
        if end <= i:
            return None
        self.sink.args(escape(buf[i:end]))
        return end

    def _xml_json(self, buf: str, i: int, final: bool):
        k = buf.find(PARAM_CLOSE, i)
        if k < 0:
            return None
        self._param_value(self._strip_end(buf[i:k]))
        self.state = "xml"
        return k + len(PARAM_CLOSE)

    @staticmethod
    def _strip_end(raw: str) -> str:
        return raw.removesuffix("\n")

    def _param_value(self, raw: str) -> None:
        try:
            value = loads(raw)
        except ValueError:
            value = raw
        self.sink.args(self._key() + canonical_json(value))
