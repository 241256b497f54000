"""`python -m engine.library`: search the hub, list a repository's files marked for this machine, download, and list
the models on disk."""
from __future__ import annotations

import argparse
import sys

from engine.errors import NInferError


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _search(args) -> int:
    from engine.library.hub import search

    for r in search(args.query, args.limit):
        print(f"{r.repo_id:<60} {r.architecture or '?':<12} {r.downloads:>10,} downloads")
    return 0


def _files(args) -> int:
    from engine.library.fit import machine_memory, mark_hub_file
    from engine.library.hub import list_files

    vram, ram = args.vram_mib, args.ram_mib
    if vram is None or ram is None:
        measured = machine_memory()
        vram = measured[0] if vram is None else vram
        ram = measured[1] if ram is None else ram
    settings = {"max_context": args.max_context, "kv_dtype": args.kv_dtype}
    print(f"planning for {vram:,} MiB VRAM, {ram:,} MiB RAM")
    for f in list_files(args.repo):
        mark = mark_hub_file(f, vram_mib=vram, ram_mib=ram, settings=settings)
        vision = f"  vision ({f.mmproj.filename}, {_size(f.mmproj.size)})" if f.vision else ""
        print(f"{f.filename:<56} {f.quant or '?':<8} {_size(f.size):>10}  {mark}{vision}")
    return 0


def _download(args) -> int:
    from engine.library.resolve import resolve_hf

    def show(p):
        eta = f", {p.eta_s:.0f} s left" if p.eta_s else ""
        print(f"\r{p.fraction * 100:5.1f}% of {_size(p.total)} at {p.rate / 2**20:.1f} MiB/s{eta}   ", end="",
              file=sys.stderr, flush=True)

    path = resolve_hf(args.spec, on_progress=show)
    print(file=sys.stderr)
    print(path)
    return 0


def _list(args) -> int:
    from engine.library.local import scan

    for m in scan(args.folders):
        state = "" if m.supported else f"  [{m.problem or 'architecture not supported'}]"
        vision = f"  vision ({m.mmproj.name})" if m.vision else ""
        print(f"{m.source:<12} {m.name:<60} {m.architecture or '?':<10} {m.quant or '?':<8} "
              f"{m.context_length:>8,} ctx {_size(m.size):>10}{vision}{state}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.library", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("search", help="GGUF repositories on the hub")
    s.add_argument("query")
    s.add_argument("--limit", type=int, default=20)
    s.set_defaults(run=_search)
    f = sub.add_parser("files", help="a repository's GGUF files, marked by the memory ledger for this machine")
    f.add_argument("repo", metavar="ORG/REPO")
    f.add_argument("--vram-mib", type=int, help="GPU memory to plan for (0: no GPU); default: this GPU's free")
    f.add_argument("--ram-mib", type=int, help="host RAM to plan for; default: available RAM")
    f.add_argument("--max-context", type=int, help="tokens per conversation; default: the model's")
    f.add_argument("--kv-dtype", help="KV cache format (see ninfer-serve --help)")
    f.set_defaults(run=_files)
    d = sub.add_parser("download", help="download hf:ORG/REPO[:QUANT] into the hub cache and print its path")
    d.add_argument("spec", metavar="hf:ORG/REPO[:QUANT]")
    d.set_defaults(run=_download)
    ls = sub.add_parser("list", help="models on disk: hub cache, LM Studio, Ollama, and FOLDERs")
    ls.add_argument("folders", nargs="*", metavar="FOLDER")
    ls.set_defaults(run=_list)
    args = p.parse_args(argv)
    try:
        return args.run(args)
    except NInferError as e:
        print(f"error: {e.problem}" + (f"\n  -> {e.remedy}" if e.remedy else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
