"""``ninfer-eval kld``: how far a configuration's next-token distributions are from a reference configuration's.

The text (resources/eval/harbour.txt unless --text names another bundled text or a file) is cut into segments of
--ctx tokens; each segment runs through both engines as one prompt, and at every position but the last the
full-vocabulary distributions are compared: KL(reference || candidate) in nats, whether both put the same token
first (top-1 agreement), and each one's negative log-likelihood of the text's actual next token (perplexity = exp
of its mean). Every position of a segment
is scored (a segment's early positions see little context, as in any chunked perplexity). One line per segment goes
to the results file, with the per-position KL values, so mean and percentiles cover the whole text when resumed."""
from __future__ import annotations

import hashlib
import math
import shlex
from pathlib import Path
from typing import Any

import torch

from engine.errors import NInferError
from engine.tools.eval.results import ResultsFile, config_key
from engine.userfiles import read_user_file

TEXTS_DIR = Path(__file__).resolve().parents[3] / "resources" / "eval"
# the bundled texts --text names: a short one of the project's own, and a long public-domain one for long contexts
BUNDLED_TEXTS = {"harbour": TEXTS_DIR / "harbour.txt", "genesis": TEXTS_DIR / "genesis.txt"}
TEXT = BUNDLED_TEXTS["harbour"]
MAX_TEXT_BYTES = 2**26  # 64 MiB of text is ~16M tokens, far more than any --max-segments scores


def text_path(given: str | Path | None) -> Path:
    """--text: None is the default bundled text, a bundled text's name its file, anything else a path."""
    if given is None:
        return TEXT
    return BUNDLED_TEXTS.get(str(given), Path(given))

# The reference: the weights as the file decodes them, in fp32; fp32 KV; the whole context; nothing approximated.
REFERENCE = {"weight_dtype": "fp32", "kv_dtype": "fp32", "kv_window": 0, "kv_retrieve": 0, "kv_ring": "auto",
             "host_kv_mib": 0, "allow_lossy_window": False, "gdn_state_fp16": False, "spec": "none",
             "draft_model": None, "draft_tokens": 0, "lm_head_draft": False, "prefill_cublas": False,
             "kv_reuse_hostbacked": False}
# Both sides compute every position: a prompt prefix served from a cache would skip rows.
NO_PREFIX_REUSE = {"max_shared_prefixes": 0, "kv_reuse_hostbacked": False}


def add_arguments(p) -> None:
    p.add_argument("--text", default=None, metavar="NAME|FILE",
                   help="the text to score: 'harbour' (the default: resources/eval/harbour.txt, 2,837 tokens of "
                        "the default model), 'genesis' (resources/eval/genesis.txt, a long public-domain text of "
                        "45,927 tokens of the default model, for long contexts), or a UTF-8 text file")
    p.add_argument("--ctx", type=int, default=1024, help="tokens per segment (default 1024)")
    p.add_argument("--max-segments", type=int, default=0, help="score at most this many segments (0: all)")
    p.add_argument("--ref", default="", metavar="FLAGS",
                   help="ninfer-serve flags changing the reference, quoted as one argument (default: the same "
                        "model with fp32 weights, fp32 KV, no window), e.g. --ref '--weight-dtype bf16' or "
                        "--ref 'path/to/original-model'")
    p.add_argument("--ref-logits", type=Path, default=None, metavar="DIR",
                   help="keep the reference's logits in this folder (fp32, one file per segment) and reuse them: "
                        "later candidates against the same reference and text skip the reference run")
    p.add_argument("--llama-cpp", action="store_true",
                   help="the candidate is llama.cpp (the llama-cpp-python package, not a dependency) on the same "
                        "GGUF, compared over the full vocabulary like the engine")
    p.add_argument("--top-logprobs", type=int, default=20, metavar="K",
                   help="with --url: top logprobs asked of the server per position (default 20, the OpenAI "
                        "maximum); the KLD is then a lower bound (docs/EVAL.md)")
    p.add_argument("--stride", type=int, default=1, metavar="N",
                   help="with --url: score every N-th position (one request each; default 1, every position)")


def reference_overrides(ref_flags: str) -> tuple[str | None, dict[str, Any]]:
    """The reference's model (None: the candidate's) and REFERENCE with the settings given in --ref applied."""
    from engine.config.loading import ConfigError, load_settings
    from engine.config.engine_config import EngineConfig

    overrides, model = dict(REFERENCE), None
    if ref_flags.strip():
        try:
            ref, _ = load_settings(shlex.split(ref_flags), env={})
        except ConfigError as e:
            raise NInferError(f"--ref: {e}", "Give --ref the ninfer-serve flags of the reference, in one quoted "
                              "argument, e.g. --ref '--weight-dtype bf16'.") from None
        given = {n for n, src in ref.sources.items() if src.startswith(("flag:", "arg:"))}
        overrides.update({n: getattr(ref, n) for n in given if n in EngineConfig.__dataclass_fields__})
        model = ref.model if "model" in given else None
    return model, overrides


def segments(ids: list[int], prefix: list[int], ctx: int, limit: int = 0) -> list[list[int]]:
    """The text's tokens in segments of ``ctx`` (the special-token prefix, e.g. BOS, starting each); a last
    segment shorter than half of ``ctx`` is dropped."""
    body = ctx - len(prefix)
    out = [prefix + ids[i:i + body] for i in range(0, len(ids), body) if len(ids[i:i + body]) * 2 >= body]
    return out[:limit] if limit else out


def compare(ref_logits: torch.Tensor, cand_logits: torch.Tensor, ids: list[int], block: int = 128) -> dict[str, Any]:
    """Per-segment sums over positions 0..n-2 (each predicting the next token), and the per-position KL values;
    in float64, ``block`` positions at a time (the full vocabulary of every position is compared)."""
    n = len(ids) - 1
    kl: list[float] = []
    same = 0
    nll_ref = nll_cand = 0.0
    for a in range(0, n, block):
        b = min(n, a + block)
        ref = torch.log_softmax(ref_logits[a:b].double(), dim=-1)
        cand = torch.log_softmax(cand_logits[a:b].double(), dim=-1)
        kl += (ref.exp() * (ref - cand)).sum(-1).tolist()
        same += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        nxt = torch.tensor(ids[a + 1:b + 1]).unsqueeze(1)
        nll_ref -= float(ref.gather(1, nxt).sum())
        nll_cand -= float(cand.gather(1, nxt).sum())
    return {"positions": n, "kl": kl, "top1_same": same, "nll_ref": nll_ref, "nll_cand": nll_cand}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    s = sorted(values)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarise(rows: list[dict]) -> dict[str, Any]:
    kl = [v for r in rows for v in r["kl"]]
    n = sum(r["positions"] for r in rows)
    if not n:
        return {"positions": 0}
    return {"segments": len(rows), "positions": n, "kld_mean": sum(kl) / n, "kld_p99": percentile(kl, 99),
            "kld_p999": percentile(kl, 99.9), "kld_max": max(kl),
            "top1_agreement": sum(r["top1_same"] for r in rows) / n,
            "ppl_ref": math.exp(sum(r["nll_ref"] for r in rows) / n),
            "ppl": math.exp(sum(r["nll_cand"] for r in rows) / n)}


def run(settings: Any, args, results_path: Path | None, progress) -> dict[str, Any]:
    """Scores the candidate (``settings``) against the reference; returns the summary (also for resumed items).
    Engines are built only when a segment is left to score."""
    from engine.model.loader import resolve_model_path
    from engine.tokenizer import Tokenizer
    from engine.tools.eval.target import ENGINE_KEYS, EngineTarget

    if args.ctx < 16:
        raise NInferError(f"--ctx {args.ctx} is too short to score.", "Use --ctx 16 or more (e.g. 1024).")
    path = text_path(args.text)
    remedy = f"Give --text a UTF-8 text file, or the name of a bundled text ({', '.join(BUNDLED_TEXTS)})."
    try:
        text = read_user_file(path, "the text", MAX_TEXT_BYTES, remedy).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise NInferError(f"Cannot read the text {path}: {e}.", remedy) from None
    ref_model, ref_over = reference_overrides(args.ref)
    model_path = resolve_model_path(settings.model)
    tok = Tokenizer.from_path(model_path)
    ids = tok.encode(text, add_special_tokens=False)
    segs = segments(ids, tok.encode("", add_special_tokens=True), args.ctx, args.max_segments)
    if not segs:
        raise NInferError(f"{path} has {len(ids)} tokens, under half a segment of {args.ctx}.",
                          "Give a longer --text or a smaller --ctx.")
    text_hash = hashlib.sha256(text.encode()).hexdigest()
    ref_path = resolve_model_path(ref_model) if ref_model else model_path
    ref_settings = {**{k: getattr(settings, k) for k in ENGINE_KEYS}, **ref_over, "model": str(ref_path)}
    ref_key = config_key({"reference": ref_settings, "text": text_hash, "ctx": args.ctx})
    key = config_key({"candidate": {k: getattr(settings, k) for k in ENGINE_KEYS}, "reference": ref_key})
    if args.url and args.llama_cpp:
        raise NInferError("--llama-cpp runs llama.cpp in process and --url measures a server: give one of them.",
                          "Drop --url, or drop --llama-cpp.")
    if not args.url and (args.stride != 1 or args.top_logprobs != 20):
        raise NInferError("--stride and --top-logprobs apply to a server (--url) only; in process every position "
                          "is compared over the full vocabulary.", "Drop them, or give --url.")
    if args.url:
        if args.top_logprobs < 1 or args.stride < 1:
            raise NInferError("--top-logprobs and --stride must be 1 or more.", "E.g. --top-logprobs 20 --stride 4.")
        key = config_key({"candidate": {"url": args.url, "model": settings.model_id, "k": args.top_logprobs,
                                        "stride": args.stride}, "reference": ref_key})
    elif args.llama_cpp:
        key = config_key({"candidate": {"llama.cpp": str(model_path), "ctx": args.ctx}, "reference": ref_key})
    results = ResultsFile(results_path, "kld", key)
    todo = [i for i in range(len(segs)) if f"segment-{i}" not in results.done]
    info: dict[str, Any] = {"candidate": None, "text": path.name, "tokens": len(ids), "ctx": args.ctx, "key": key,
                            "resumed": len(segs) - len(todo)}
    if todo and args.url:
        _score_server(args, settings, segs, todo, results, info, progress, tok, (ref_over, ref_path, ref_key))
    elif todo:
        if args.llama_cpp:
            from engine.tools.eval.llamacpp import LlamaCppTarget

            candidate = LlamaCppTarget(model_path, args.ctx, settings.threads or 0)
        else:
            candidate = EngineTarget(settings, NO_PREFIX_REUSE)
        reference = None
        try:
            longest = max(len(segs[i]) for i in todo)
            window = getattr(candidate, "context_window", None)
            if window is not None and longest >= window:  # the engine keeps one token of the context free
                raise NInferError(f"--ctx {args.ctx} makes segments of {longest} tokens, but the engine's context "
                                  f"holds {window} and a segment must leave one token of it free.",
                                  f"Use --ctx {window - 1} or less (or raise --max-context / --kv-capacity where "
                                  "the model and memory allow).")
            info["candidate"] = candidate.describe()
            for i in progress(todo, desc="kld", unit="segment"):
                ref_logits = _cached(args.ref_logits, ref_key, i)
                if ref_logits is None:
                    reference = reference or EngineTarget(settings, {**ref_over, **NO_PREFIX_REUSE}, model=ref_path)
                    ref_logits = reference.logits(segs[i])
                    _store(args.ref_logits, ref_key, i, ref_logits)
                cand_logits = candidate.logits(segs[i])
                if cand_logits.shape != ref_logits.shape:
                    raise NInferError(f"The reference has a vocabulary of {ref_logits.shape[-1]} tokens and the "
                                      f"candidate {cand_logits.shape[-1]}: their distributions cannot be compared.",
                                      "Give --ref a model with the candidate's tokenizer.")
                results.add(f"segment-{i}", compare(ref_logits, cand_logits, segs[i]))
        finally:
            candidate.close()
            if reference is not None:
                reference.close()
    rows = [results.done[f"segment-{i}"] for i in range(len(segs))]
    summary = {**info, **summarise(rows)}
    if args.url and summary["positions"]:
        summary.update(bound=True, top_logprobs=args.top_logprobs, stride=args.stride,
                       next_in_top=sum(r["next_in_top"] for r in rows) / summary["positions"])
    return summary


def _score_server(args, settings, segs, todo, results, info, progress, tok, ref) -> None:
    """kld --url: the server's top-k logprobs against the reference in process (kld_url.py); ``ref`` is the
    reference's (overrides, model path, key)."""
    from engine.tools.eval.kld_url import score_segment, text_buckets
    from engine.tools.eval.target import EngineTarget, RemoteTarget

    ref_over, ref_path, ref_key = ref
    remote, reference = RemoteTarget(args.url, settings.api_key, (settings.model_id or [None])[0]), None
    try:
        info["candidate"] = {"url": remote.url, "model": remote.model}
        buckets = text_buckets(tok)
        id_text = [tok.token_text(i) for i in range(tok.vocab_size)]
        for i in progress(todo, desc="kld", unit="segment"):
            ref_logits = _cached(args.ref_logits, ref_key, i)
            if ref_logits is None:
                reference = reference or EngineTarget(settings, {**ref_over, **NO_PREFIX_REUSE}, model=ref_path)
                ref_logits = reference.logits(segs[i])
                _store(args.ref_logits, ref_key, i, ref_logits)
            results.add(f"segment-{i}", score_segment(remote, ref_logits, segs[i], args.top_logprobs,
                                                      args.stride, buckets, id_text))
    finally:
        remote.close()
        if reference is not None:
            reference.close()


def _cache_file(folder: Path, ref_key: str, i: int) -> Path:
    return Path(folder) / f"reference-{ref_key}-segment-{i}.pt"


def _cached(folder: Path | None, ref_key: str, i: int) -> torch.Tensor | None:
    if folder is None or not _cache_file(folder, ref_key, i).is_file():
        return None
    try:
        return torch.load(_cache_file(folder, ref_key, i), weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError):  # a file cut short: computed again
        return None


def _store(folder: Path | None, ref_key: str, i: int, logits: torch.Tensor) -> None:
    if folder is None:
        return
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tmp = _cache_file(folder, ref_key, i).with_suffix(".part")
        torch.save(logits.contiguous(), tmp)
        tmp.replace(_cache_file(folder, ref_key, i))
    except OSError as e:
        raise NInferError(f"Cannot write the reference logits to {folder}: {e}.",
                          "Give --ref-logits a writable folder (about 200 MB per 1024-token segment of a "
                          "50K vocabulary), or drop it.") from None


def format_table(summary: dict[str, Any], command: str) -> str:
    c = summary["candidate"]
    lines = [f"ninfer-eval kld: {command}"]
    if c and "url" in c:
        lines.append(f"  candidate: {c['model']} at {c['url']}")
    elif c:
        lines.append(f"  candidate: {c['weights']} weights, {c['kv']} KV, window {c['window']} ({c['model']}, "
                     f"{c['device']})")
    lines += [f"  text: {summary['text']}, {summary['tokens']} tokens in {summary['segments']} segment{'s' if summary['segments'] != 1 else ''} of up to "
              f"{summary['ctx']}; {summary['positions']} positions scored"
              + (f" ({summary['resumed']} segments from the results file)" if summary["resumed"] else "")]
    if summary.get("bound"):
        lines.append(f"  from the server's top-{summary['top_logprobs']} logprobs at every "
                     f"{'' if summary['stride'] == 1 else str(summary['stride']) + 'th '}position (the next token was in them at {100 * summary['next_in_top']:.1f}%): values marked "
                     f"≥ are lower bounds of the full-vocabulary ones")
    lines += ["",
              "| KLD mean | KLD p99 | KLD p99.9 | KLD max | top-1 agreement | PPL | PPL reference |"
              if not summary.get("bound") else "| KLD mean ≥ | KLD p99 ≥ | KLD p99.9 ≥ | KLD max ≥ | top-1 agreement"
              " | PPL ≥ | PPL reference |",
              "|---|---|---|---|---|---|---|",
              (f"| {summary['kld_mean']:.6f} | {summary['kld_p99']:.6f} | {summary['kld_p999']:.6f} | "
               f"{summary['kld_max']:.6f} | {100 * summary['top1_agreement']:.2f}% | {summary['ppl']:.4f} | "
               f"{summary['ppl_ref']:.4f} |")]
    return "\n".join(lines)
