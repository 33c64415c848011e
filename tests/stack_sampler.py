"""Where a test's threads spend their time: every thread's Python stack, sampled.

An emulated world stalls when the host thread that launches the ranks, or the autograd thread
running a rank's backward, is held somewhere between two ranks' launches. The launch log
(``KOSMOS_TRACE_LAUNCHES=1``) shows when a launch came late; these samples show where the
host was meanwhile. That is how the stall of stops 16-28 was traced to one cuBLAS call
(kosmos_moe.fabric.EmulatedWorld). ``KOSMOS_SAMPLE_STACKS=DIR`` turns it on for a pytest run
(tests/conftest.py): one file per test in DIR, each line a time in seconds since the test
began, a thread and its innermost frames, written when a thread's stack changes, with the
fused launches logged in between.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from pathlib import Path

FRAMES = 14  # innermost frames kept per sample
PERIOD_S = 0.01


def _describe(frame) -> str:
    parts = []
    for f, line in traceback.walk_stack(frame):
        path = f.f_code.co_filename
        short = path.split("/site-packages/")[-1] if "/site-packages/" in path else "/".join(Path(path).parts[-2:])
        parts.append(f"{short}:{line}:{f.f_code.co_name}")
        if len(parts) == FRAMES:
            break
    return " < ".join(parts)


class StackSampler:
    """Samples every other thread's stack until stopped; keeps a line per change."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.lines: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._handler = logging.Handler(logging.DEBUG)
        self._handler.emit = self._log

    def _log(self, record: logging.LogRecord) -> None:
        self.lines.append((time.perf_counter() - self.start, "log " + threading.current_thread().name,
                           record.getMessage()))

    def _run(self) -> None:
        last: dict[int, str] = {}
        me = threading.get_ident()
        while not self._stop.is_set():
            now = time.perf_counter() - self.start
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = _describe(frame)
                if last.get(ident) != stack:
                    last[ident] = stack
                    self.lines.append((now, names.get(ident, str(ident)), stack))
            time.sleep(PERIOD_S)

    def __enter__(self) -> "StackSampler":
        launches = logging.getLogger("kosmos_moe.fused")
        self._level = launches.level
        launches.setLevel(logging.DEBUG)
        launches.addHandler(self._handler)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        launches = logging.getLogger("kosmos_moe.fused")
        launches.removeHandler(self._handler)
        launches.setLevel(self._level)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for t, who, what in sorted(self.lines, key=lambda line: line[0]):
                f.write(f"{t:9.3f} [{who}] {what}\n")
