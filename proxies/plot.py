"""The loss curve as a PNG: matplotlib when installed, else a small pure-Python rasteriser.

The fallback draws axes, a grid with numeric labels (a built-in 5x7 pixel font), the raw loss
(light) and its centred moving average (dark), and encodes the PNG with zlib and struct.
"""

from __future__ import annotations

import math
import struct
import zlib

_FONT = {  # 5x7 glyphs, '#' = ink
    "0": [".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."],
    "1": ["..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."],
    "2": [".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"],
    "3": ["#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."],
    "4": ["...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."],
    "5": ["#####", "#....", "####.", "....#", "....#", "#...#", ".###."],
    "6": ["..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."],
    "7": ["#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."],
    "8": [".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."],
    "9": [".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."],
    ".": [".....", ".....", ".....", ".....", ".....", ".##..", ".##.."],
    "-": [".....", ".....", ".....", "#####", ".....", ".....", "....."],
    "e": [".....", ".....", ".###.", "#...#", "#####", "#....", ".###."],
    "l": [".##..", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."],
    "o": [".....", ".....", ".###.", "#...#", "#...#", "#...#", ".###."],
    "s": [".....", ".....", ".####", "#....", ".###.", "....#", "####."],
    "t": [".#...", ".#...", "####.", ".#...", ".#...", ".#..#", "..##."],
    "p": [".....", ".....", "####.", "#...#", "####.", "#....", "#...."],
    " ": ["....."] * 7,
}


def write_png(path: str, width: int, height: int, rgb: bytearray) -> None:
    """Write 8-bit RGB pixels (row-major, ``3 * width * height`` bytes) as a PNG."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    stride = 3 * width
    raw = b"".join(b"\x00" + bytes(rgb[y * stride:(y + 1) * stride]) for y in range(height))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    with open(path, "wb") as fh:
        fh.write(png)


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.w, self.h = width, height
        self.px = bytearray(b"\xff" * (3 * width * height))

    def dot(self, x: int, y: int, color) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(color)

    def line(self, x0, y0, x1, y1, color, width: int = 1) -> None:
        x0, y0, x1, y1 = int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1))
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for ox in range(width):
                for oy in range(width):
                    self.dot(x0 + ox - width // 2, y0 + oy - width // 2, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        for k, ch in enumerate(s):
            glyph = _FONT.get(ch, _FONT[" "])
            for r, row in enumerate(glyph):
                for c, ink in enumerate(row):
                    if ink == "#":
                        for a in range(scale):
                            for b in range(scale):
                                self.dot(x + (6 * k + c) * scale + a, y + r * scale + b, color)

    @staticmethod
    def text_width(s: str, scale: int = 2) -> int:
        return 6 * scale * len(s)


def _label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.1e}".replace("+", "")
    return f"{v:.3g}"


def _smooth(values: list[float]) -> list[float]:
    """Centred moving average over about a twentieth of the run (no lag, unlike an EMA)."""
    half = max(1, len(values) // 40)
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half):i + half + 1]
        out.append(sum(window) / len(window))
    return out


def _fallback(path: str, steps: list[int], losses: list[float]) -> None:
    W, H = 800, 480
    left, right, top, bottom = 80, 24, 40, 56
    cv = _Canvas(W, H)
    pw, ph = W - left - right, H - top - bottom
    finite = [v for v in losses if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    pad = 0.05 * (hi - lo)
    lo, hi = lo - pad, hi + pad
    s0, s1 = (steps[0], steps[-1]) if steps else (0, 1)
    if s1 == s0:
        s1 = s0 + 1

    def X(s):
        return left + (s - s0) / (s1 - s0) * pw

    def Y(v):
        return top + (hi - v) / (hi - lo) * ph

    grey, black = (225, 225, 225), (0, 0, 0)
    for i in range(6):
        v = lo + (hi - lo) * i / 5
        cv.line(left, Y(v), left + pw, Y(v), grey)
        lab = _label(v)
        cv.text(left - 8 - cv.text_width(lab), int(Y(v)) - 7, lab)
        s = s0 + (s1 - s0) * i / 5
        cv.line(X(s), top, X(s), top + ph, grey)
        lab = str(int(round(s)))
        cv.text(int(X(s)) - cv.text_width(lab) // 2, top + ph + 8, lab)
    cv.line(left, top, left, top + ph, black)
    cv.line(left, top + ph, left + pw, top + ph, black)
    cv.text(left + pw // 2 - cv.text_width("step") // 2, H - 22, "step")
    cv.text(8, 6, "loss")
    pts = [(X(s), Y(v)) for s, v in zip(steps, losses) if math.isfinite(v)]
    for (a, b), (c, d) in zip(pts, pts[1:]):
        cv.line(a, b, c, d, (160, 190, 235))
    smooth = _smooth([v for v in losses if math.isfinite(v)])
    pts = [(x, Y(v)) for (x, _), v in zip(pts, smooth)]
    for (a, b), (c, d) in zip(pts, pts[1:]):
        cv.line(a, b, c, d, (20, 60, 160), width=2)
    write_png(path, W, H, cv.px)


def plot_loss(path: str, steps: list[int], losses: list[float], title: str = "") -> str:
    """Write the loss curve to ``path``; return which renderer drew it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _fallback(path, steps, losses)
        return "builtin"
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=100)
    ax.plot(steps, losses, color="#a0bee8", lw=1, label="loss")
    ax.plot(steps, _smooth(losses), color="#143ca0", lw=2, label="moving average")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"
