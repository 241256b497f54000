"""The needle grid as a PNG, written with the standard library (zlib): one cell per (depth, length), red (0% passed)
through yellow to green (100%), each labelled with its pass rate; depths (%) down the left, lengths (tokens) along
the bottom, a colour scale on the right. The digits are drawn from a 5x7 pixel font, doubled."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

from engine.errors import NInferError

CELL_W, CELL_H, LEFT, TOP, BOTTOM, RIGHT, SCALE = 92, 40, 70, 16, 40, 90, 2
GLYPHS = {  # 5 columns x 7 rows
    "0": "01110 10001 10011 10101 11001 10001 01110", "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111", "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010", "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110", "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110", "9": "01110 10001 10001 01111 00001 00010 01100",
    "%": "11000 11001 00010 00100 01000 10011 00011", ".": "00000 00000 00000 00000 00000 01100 01100",
    " ": "00000 00000 00000 00000 00000 00000 00000",
}


def colour(rate: float) -> tuple[int, int, int]:
    """Red (0) -> yellow (0.5) -> green (1)."""
    r = min(max(rate, 0.0), 1.0)
    if r < 0.5:
        return 215, int(48 + 2 * r * 152), 39
    t = 2 * (r - 0.5)
    return int(215 - t * 189), int(200 - t * 48), int(39 + t * 41)


class Canvas:
    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def rect(self, x: int, y: int, w: int, h: int, rgb: tuple[int, int, int]) -> None:
        row = bytes(rgb) * max(0, min(w, self.w - x))
        for yy in range(max(y, 0), min(y + h, self.h)):
            i = (yy * self.w + x) * 3
            self.px[i:i + len(row)] = row

    def text(self, s: str, x: int, y: int, rgb=(0, 0, 0)) -> None:
        """``s`` (digits, %, ., space) with its top-left corner at (x, y)."""
        for k, ch in enumerate(s):
            rows = GLYPHS.get(ch, GLYPHS[" "]).split()
            for r, bits in enumerate(rows):
                for c, bit in enumerate(bits):
                    if bit == "1":
                        self.rect(x + (6 * k + c) * SCALE, y + r * SCALE, SCALE, SCALE, rgb)

    def text_centred(self, s: str, cx: int, cy: int, rgb=(0, 0, 0)) -> None:
        self.text(s, cx - (6 * len(s) - 1) * SCALE // 2, cy - 7 * SCALE // 2, rgb)

    def png(self) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _pct(v: float) -> str:
    return f"{100 * v:.1f}".rstrip("0").rstrip(".") + "%"


def write_heatmap(path: Path, lengths: list[int], depths: list[float], rates: dict[tuple[int, float], float]) -> None:
    """Rows are depths (0 at the top), columns lengths; ``rates[(length, depth)]`` is the pass rate 0..1."""
    grid_w, grid_h = CELL_W * len(lengths), CELL_H * len(depths)
    c = Canvas(LEFT + grid_w + RIGHT, TOP + grid_h + BOTTOM)
    for j, n in enumerate(lengths):
        for i, d in enumerate(depths):
            x, y = LEFT + j * CELL_W, TOP + i * CELL_H
            c.rect(x, y, CELL_W - 2, CELL_H - 2, colour(rates[(n, d)]))
            c.text_centred(_pct(rates[(n, d)]), x + CELL_W // 2 - 1, y + CELL_H // 2 - 1)
        c.text_centred(str(n), LEFT + j * CELL_W + CELL_W // 2, TOP + grid_h + BOTTOM // 2)
    for i, d in enumerate(depths):
        s = _pct(d)
        c.text(s, LEFT - 8 - (6 * len(s) - 1) * SCALE, TOP + i * CELL_H + CELL_H // 2 - 8)
    bar_x = LEFT + grid_w + 12
    for k in range(grid_h):  # the colour scale: 100% at the top
        c.rect(bar_x, TOP + k, 14, 1, colour(1 - k / max(grid_h - 1, 1)))
    c.text("100%", bar_x + 18, TOP)
    c.text("0%", bar_x + 18, TOP + grid_h - 14)
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(c.png())
    except OSError as e:
        raise NInferError(f"Cannot write the heatmap {path}: {e}.", "Give a writable --png path.") from None
