"""Where a test's threads spend their time: every thread's Python stack, sampled.

An emulated world stalls when the host thread that launches the ranks, or the autograd thread
running a rank's backward, is held somewhere between two ranks' launches. The launch log
(``KOSMOS_TRACE_LAUNCHES=1``) shows when a launch came late; these samples show where the
host was meanwhile. That is how the stall of stops 16-28 was traced to one cuBLAS call
(kosmos_moe.fabric.EmulatedWorld). ``KOSMOS_SAMPLE_STACKS=DIR`` turns it on for a pytest run
(tests/conftest.py): one file per test in DIR, each line a time in seconds since the test
began, a thread and its innermost frames, written when a thread's stack changes, with the
fused launches logged in between (lines of different threads may be a sample period out of
order).
"""

from __future__ import annotations

import hashlib
import logging
import re
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
    """Samples every other thread's stack until stopped, a line per change, written to ``path``
    as it goes (flushed every second: a run killed by its time limit keeps what was sampled)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w")
        self._lock = threading.Lock()
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._handler = logging.Handler(logging.DEBUG)
        self._handler.emit = self._log

    def _line(self, t: float, who: str, what: str) -> None:
        with self._lock:
            self._file.write(f"{t:9.3f} [{who}] {what}\n")

    def _log(self, record: logging.LogRecord) -> None:
        try:
            self._line(time.perf_counter() - self.start, "log " + threading.current_thread().name, record.getMessage())
        except Exception:
            self._handler.handleError(record)

    def _run(self) -> None:
        last: dict[int, str] = {}
        me = threading.get_ident()
        flushed = time.perf_counter()
        while not self._stop.is_set():
            now = time.perf_counter() - self.start
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = _describe(frame)
                if last.get(ident) != stack:
                    last[ident] = stack
                    self._line(now, names.get(ident, str(ident)), stack)
            if time.perf_counter() - flushed > 1.0:
                with self._lock:
                    self._file.flush()
                flushed = time.perf_counter()
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
        self._file.close()


def sample_file(directory: str, nodeid: str) -> Path:
    """A file name per test: the node id made safe and cut short, and a hash of it (two ids
    that read the same once made safe, or long ones, never share a file)."""
    digest = hashlib.sha1(nodeid.encode()).hexdigest()[:10]
    safe = re.sub(r"[^\w.-]+", "_", nodeid)[:120]
    return Path(directory) / f"{safe}-{digest}.txt"
