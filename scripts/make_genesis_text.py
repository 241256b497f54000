"""Writes resources/eval/genesis.txt, the long text of `ninfer-eval kld --text genesis`: the book of Genesis from
the World English Bible, which is in the public domain, as SWORD's Debian package of it holds it.

    apt-get install diatheke sword-text-web
    diatheke -b engWEB2015eb -f plain -o f -k Genesis | python scripts/make_genesis_text.py

The verses of each chapter are joined into one paragraph under a "Chapter N" line; the translators' footnotes
(printed in brackets with -o f, so that a note's word and the next one keep their space) are left out; the words
themselves are not changed."""
from __future__ import annotations

import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "resources" / "eval" / "genesis.txt"
VERSE = re.compile(r"Genesis (\d+):(\d+): (.*)$")
NOTE = re.compile(r" ?\[\d+:\d+ [^\]]*\]")


def main() -> None:
    chapters: dict[int, list[str]] = {}
    for line in sys.stdin.read().splitlines():
        m = VERSE.match(line)
        if m:
            chapters.setdefault(int(m[1]), []).append(NOTE.sub("", m[3]).strip())
    if len(chapters) != 50:
        sys.exit(f"expected the 50 chapters of Genesis on standard input, got {len(chapters)}")
    text = "The First Book of Moses, Commonly Called Genesis\n" + "".join(
        f"\nChapter {n}\n\n" + " ".join(verses) + "\n" for n, verses in chapters.items())
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT} ({len(text)} characters)")


if __name__ == "__main__":
    main()
