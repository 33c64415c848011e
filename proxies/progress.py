"""A progress bar that coexists with log lines: tqdm when installed, else a carriage-return bar.

The bar goes to stderr and only when stderr is a terminal (a redirected log gets the log
lines alone); log lines go to stdout through ``write``, which clears the bar first.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "train") -> None:
        self.total, self.n, self.desc = total, initial, desc
        self.enabled = enabled and sys.stderr.isatty()
        self.postfix = ""
        self._tqdm = None
        self._start = time.perf_counter()
        self._start_n = initial
        if self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._tqdm = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=False)

    def update(self, n: int = 1, postfix: str = "") -> None:
        self.n += n
        self.postfix = postfix or self.postfix
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(self.postfix, refresh=False)
            self._tqdm.update(n)
            return
        self._draw()

    def _draw(self) -> None:
        width = 30
        done = int(width * self.n / max(1, self.total))
        rate = (self.n - self._start_n) / max(1e-9, time.perf_counter() - self._start)
        eta = (self.total - self.n) / rate if rate > 0 else float("nan")
        bar = "#" * done + "." * (width - done)
        sys.stderr.write(f"\r\033[K{self.desc} [{bar}] {self.n}/{self.total} {rate:.2f} it/s eta {eta:.0f}s {self.postfix}")
        sys.stderr.flush()

    def write(self, line: str) -> None:
        if self._tqdm is not None:
            self._tqdm.write(line, file=sys.stdout)
            return
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        print(line, flush=True)
        if self.enabled:
            self._draw()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
