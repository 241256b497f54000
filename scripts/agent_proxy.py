"""A logging reverse proxy for scripts/agent_check.sh: forwards every request to the server unchanged and prints
a one-line summary of what the client sent (method, path, API headers, the body's fields, tools by type) and the
status it got back; answers are passed on as they come (streams stay streams). Standard library only.

    python scripts/agent_proxy.py LISTEN_PORT SERVER_PORT
"""
from __future__ import annotations

import http.client
import json
import os
import sys
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SHOWN_HEADERS = ("anthropic-version", "anthropic-beta", "openai-beta", "originator")
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def summary(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return f"{len(body)} bytes (not JSON)"
    if not isinstance(data, dict):
        return f"{len(body)} bytes"
    parts = [f"{len(body)} bytes", f"model={data.get('model')!r}", "fields=" + ",".join(sorted(data))]
    tools = data.get("tools") or []
    if tools:
        kinds = Counter(t.get("type") or "custom" for t in tools if isinstance(t, dict))
        parts.append("tools=" + ",".join(f"{k}x{n}" for k, n in sorted(kinds.items())))
    for key in ("input", "messages"):
        items = data.get(key)
        if isinstance(items, list):
            kinds = Counter((i.get("type") or i.get("role")) if isinstance(i, dict) else "?" for i in items)
            parts.append(f"{key}=" + ",".join(f"{k}x{n}" for k, n in sorted(kinds.items())))
    system = data.get("system")
    if isinstance(system, list):
        parts.append(f"system={len(system)} blocks")
    for key in ("tool_choice", "thinking", "reasoning", "max_tokens", "max_output_tokens", "stream"):
        if key in data:
            parts.append(f"{key}={json.dumps(data[key])}")
    return " ".join(parts)


class Proxy(BaseHTTPRequestHandler):
    server_port = 0
    saved = 0

    protocol_version = "HTTP/1.1"

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        shown = " ".join(f"{h}={self.headers[h]!r}" for h in SHOWN_HEADERS if self.headers.get(h))
        print(f"{self.command} {self.path} {shown} {summary(body) if body else ''}".rstrip(), flush=True)
        if body and os.environ.get("AGENT_PROXY_SAVE"):  # keep the bodies, e.g. to replay them
            Proxy.saved += 1
            path = os.path.join(os.environ["AGENT_PROXY_SAVE"], f"{Proxy.saved:03d}.json")
            with open(path, "wb") as f:
                f.write(body)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = http.client.HTTPConnection("127.0.0.1", self.server_port, timeout=600)
        upstream.request(self.command, self.path, body=body or None, headers=headers)
        answer = upstream.getresponse()
        print(f"  -> {answer.status}", flush=True)
        self.send_response(answer.status)
        for k, v in answer.getheaders():
            if k.lower() not in HOP_HEADERS:
                self.send_header(k, v)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:  # passed on as it comes, so streamed answers stay streamed
            chunk = answer.read1(65536)
            if not chunk:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    do_GET = do_POST = do_PUT = do_HEAD = _forward

    def log_message(self, *args):
        pass


def main() -> None:
    listen, target = int(sys.argv[1]), int(sys.argv[2])
    Proxy.server_port = target
    ThreadingHTTPServer(("127.0.0.1", listen), Proxy).serve_forever()


if __name__ == "__main__":
    main()
