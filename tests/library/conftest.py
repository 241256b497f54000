"""A stand-in for the Hugging Face hub's HTTP API on the loopback, serving tiny real GGUF files, and a fresh
HF_HOME for every test. Nothing here reaches the network."""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import gguf
import numpy as np
import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_gguf(path: Path, arch: str = "llama", *, layers: int = 2, hidden: int = 32, heads: int = 4,
               kv_heads: int = 2, context: int = 2048, vocab: int = 64, dtype=np.float32, pad_mib: int = 0,
               split_max_tensors: int = 0, experts: int = 0) -> Path:
    """A tiny GGUF file with real metadata and tensors (random weights); ``pad_mib`` adds a tensor of that size;
    ``split_max_tensors``: split the way llama.cpp splits (path-00001-of-0000N.gguf ...; part 1's path returned);
    ``experts``: an ``{arch}.expert_count`` key (the tensors stay dense)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_name(path.stem)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(hidden * 2)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if experts:
        w.add_expert_count(experts)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    head_dim = hidden // heads

    def t(name, *shape):
        w.add_tensor(name, rng.standard_normal(shape).astype(dtype))

    t("token_embd.weight", vocab, hidden)
    for i in range(layers):
        t(f"blk.{i}.attn_norm.weight", hidden)
        t(f"blk.{i}.attn_q.weight", hidden, hidden)
        t(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        t(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        t(f"blk.{i}.attn_output.weight", hidden, hidden)
        t(f"blk.{i}.ffn_norm.weight", hidden)
        t(f"blk.{i}.ffn_gate.weight", hidden * 2, hidden)
        t(f"blk.{i}.ffn_up.weight", hidden * 2, hidden)
        t(f"blk.{i}.ffn_down.weight", hidden, hidden * 2)
    t("output_norm.weight", hidden)
    if pad_mib:
        t("pad.weight", pad_mib * 2**18)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path if not split_max_tensors else sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))[0]


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    architecture: str = "llama"
    downloads: int = 10
    parameters: int = 1000  # what the hub's GGUF summary reports
    gated_token: str = ""  # when set, the repository answers 401 (gated) to requests without this token
    published: dict[str, str] = field(default_factory=dict)  # filename -> sha256 the hub publishes (override)

    def sha(self, name: str) -> str:
        return self.published.get(name) or hashlib.sha256(self.files[name]).hexdigest()


class StandInHub:
    """Repositories, plus switches: ``cut`` (filenames whose next GET stops halfway), ``rate`` (bytes per second),
    ``stall`` (filename -> the offset where its GETs go quiet), ``silent`` (no request is answered),
    ``file_headers`` (headers a file's answer sends instead of the usual ones), ``requests`` (a log). ``released``
    ends every stall and silence (the fixture sets it at the end)."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.cut: set[str] = set()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range header)
        self.lock = threading.Lock()
        self.url = ""
        self.rate = 0  # bytes per second of a file's body (0: as fast as the loopback goes)
        self.stall: dict[str, int] = {}
        self.silent = False
        self.file_headers: dict[str, str] = {}
        self.released = threading.Event()

    def add(self, repo: Repo) -> Repo:
        self.repos[repo.repo_id] = repo
        return repo


def _handler(hub: StandInHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):
            pass

        def _json(self, obj, status=200):
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _missing(self):
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _refused(self, r: Repo) -> bool:
            if r.gated_token and self.headers.get("Authorization") != f"Bearer {r.gated_token}":
                self.send_response(401)
                self.send_header("X-Error-Code", "GatedRepo")
                self.send_header("X-Error-Message", "Access to this model is restricted.")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True
            return False

        def _model(self, r: Repo):
            return {"id": r.repo_id, "modelId": r.repo_id, "downloads": r.downloads, "likes": 1, "gated": False,
                    "private": False, "sha": COMMIT, "tags": ["gguf"],
                    "gguf": {"architecture": r.architecture, "context_length": 2048, "total": r.parameters}}

        def do_GET(self):
            self._serve(body=True)

        def do_HEAD(self):
            self._serve(body=False)

        def _serve(self, body: bool):
            u = urlparse(self.path)
            path = unquote(u.path)
            with hub.lock:
                hub.requests.append((self.command, path, self.headers.get("Range", "")))
            if hub.silent:  # a hub that accepts the connection and never answers
                hub.released.wait(120)
                return None
            if path == "/api/models":
                q = (parse_qs(u.query).get("search") or [""])[0].lower()
                return self._json([self._model(r) for r in hub.repos.values() if q in r.repo_id.lower()])
            if path.startswith("/api/models/"):
                rest = path[len("/api/models/"):]
                for repo_id, r in hub.repos.items():
                    if rest in (repo_id, f"{repo_id}/revision/main"):
                        return self._json(self._model(r))
                    if rest == f"{repo_id}/tree/main":
                        if self._refused(r):
                            return None
                        return self._json([{"type": "file", "path": n, "size": 134, "oid": "0" * 40,
                                            "lfs": {"oid": r.sha(n), "size": len(d), "pointerSize": 134}}
                                           for n, d in r.files.items()])
                return self._missing()
            for repo_id, r in hub.repos.items():
                prefix = f"/{repo_id}/resolve/main/"
                if path.startswith(prefix) and path[len(prefix):] in r.files:
                    if self._refused(r):
                        return None
                    return self._file(r, path[len(prefix):], body)
            return self._missing()

        def _file(self, r: Repo, name: str, body: bool):
            data = r.files[name]
            start, end = 0, len(data) - 1
            rng = self.headers.get("Range", "")
            if rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                start, end = int(a), min(int(b) if b else end, end)
            self.send_response(206 if rng else 200)
            self.send_header("Content-Length", str(end - start + 1))
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.send_header("Accept-Ranges", "bytes")
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{r.sha(name)}"', "X-Linked-Etag": f'"{r.sha(name)}"',
                       **hub.file_headers}
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("X-Linked-Size", str(len(data)))
            self.end_headers()
            if not body:
                return
            chunk = data[start:end + 1]
            if name in hub.stall:  # the file up to that offset, then nothing: the connection stays open and quiet
                self.wfile.write(chunk[:max(hub.stall[name] - start, 0)])
                self.wfile.flush()
                hub.released.wait(120)
                self.close_connection = True
                return
            with hub.lock:
                cut = name in hub.cut and not rng.startswith("bytes=0-") and len(chunk) > 1
                if cut:
                    hub.cut.discard(name)
            if cut:  # send half, then drop the connection: the client sees the body end early
                self.wfile.write(chunk[:len(chunk) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            sent = 0
            while hub.rate and sent < len(chunk):  # a slow link, for a download one can watch (and cancel)
                import time

                rate = hub.rate
                piece = max(rate // 20, 1)
                self.wfile.write(chunk[sent:sent + piece])
                sent += piece
                time.sleep(piece / rate)
            self.wfile.write(chunk[sent:])  # the rest at full speed (rate 0, set again meanwhile)

    return Handler


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # the hub client reads HF_HUB_OFFLINE once, at its import: the suite's conftest sets it before any test, so a
    # client imported earlier in the run would stay offline
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return home


@pytest.fixture
def hub(hf_home, monkeypatch):
    state = StandInHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", state.url)
    yield state
    state.released.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def tiny_repo(hub, tmp_path) -> Repo:
    """bartowski-like: two quants of one tiny llama, and a vision projector."""
    files = {}
    for name in ("Tiny-Llama-Q4_K_M.gguf", "Tiny-Llama-Q8_0.gguf", "mmproj-Tiny-F16.gguf"):
        files[name] = write_gguf(tmp_path / name, pad_mib=1).read_bytes()
    return hub.add(Repo("test-org/Tiny-Llama-GGUF", files))
