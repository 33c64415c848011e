"""What the benchmark scripts share: process group, timing, ceilings, environment, outputs.

Every script runs as ``python benchmarks/<script>.py`` on one device, or under ``torchrun``
on several; ``--smoke`` runs tiny shapes on the CPU (kosmos under Triton's interpreter), which
checks a script without measuring anything.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def smoke_requested() -> bool:
    """``--smoke`` on the command line; it must be known before Triton is imported."""
    return "--smoke" in sys.argv


if smoke_requested():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def require_cuda(what: str, hint: str | None = None) -> None:
    """Exit with status 2 and one line on stderr unless torch sees a CUDA device.

    Called after argument parsing, so that ``--help`` works anywhere; without it a script
    either crashes deep in CUDA initialisation or, worse, runs its full-size shapes on the CPU.
    ``hint`` says what can run on the CPU instead (``--smoke``), where the script has such a mode.
    """
    if torch.cuda.is_available():
        return
    print(f"{what}: needs a CUDA device, and torch sees none" + (f"; {hint}" if hint else ""),
          file=sys.stderr, flush=True)
    raise SystemExit(2)


def log(*args) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, file=sys.stderr, flush=True)


def init(smoke: bool) -> torch.device:
    """Join torchrun's process group, or make a group of one; return this rank's device.

    Only ``smoke`` runs on the CPU: full-size shapes there would run for minutes and measure nothing.
    """
    if not smoke:
        require_cuda(Path(sys.argv[0]).name, "--smoke runs tiny shapes on the CPU as a check of the script")
    use_cuda = torch.cuda.is_available() and not smoke
    backend = "nccl" if use_cuda else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# kosmos and the reference are two bf16 paths with fp32 accumulation: at the benchmark shapes
# they differ by about half a percent of a result's norm (the reference's own error against an
# fp32 layer is 0.43-0.46% at the Qwen3 and DeepSeek-V3 shapes, 256 tokens). A result 2% off
# overall, or one token's row 10% off, is wrong rather than rounded: a lost or misrouted row, an
# expert's share dropped or added twice. Rows are judged only where they are tokens' (outputs,
# input gradients): a weight gradient's row sums many tokens, and its spread is not measured. A
# token whose top-k the two fp32 routers break differently at a near tie would trip the row
# limit too; on the layer scripts' seeded inputs none has (stop 49: the largest element
# difference 0.016-0.031 at all four shapes, where such a row would differ by tenths).
AGREEMENT = {"relative": 2e-2, "worst_row": 1e-1}


def disagreement(parts: list[torch.Tensor], whole: torch.Tensor, elements: int = 1 << 24) -> dict[str, float]:
    """How far ``cat(parts)`` is from ``whole``, in fp32, about ``elements`` at a time so that no
    concatenated or fp32 copy of a large gradient is made: ``relative``, ``|d| / |whole|`` over
    everything; ``worst_row``, the largest such ratio of one row (the last dimension), a row of
    ``whole`` that is (nearly) zero judged against a thousandth of the mean row norm instead;
    ``max_abs`` and ``mean_abs``, the largest and the mean element of ``|d|``."""
    diffs, refs, peaks, sums = [], [], [], []
    at = 0
    for part in parts:
        step = max(1, elements // max(1, part[0].numel())) if part.shape[0] else 1
        for i in range(0, part.shape[0], step):
            got = part[i: i + step]
            want = whole[at + i: at + i + got.shape[0]].float()
            d = got.float() - want
            diffs.append(d.reshape(-1, d.shape[-1]).norm(dim=-1))
            refs.append(want.reshape(-1, d.shape[-1]).norm(dim=-1))
            size = d.abs()
            peaks.append(size.max())
            sums.append(size.sum(dtype=torch.float64))
        at += part.shape[0]
    if not diffs:
        return {"relative": 0.0, "worst_row": 0.0, "max_abs": 0.0, "mean_abs": 0.0}
    d, r = torch.cat(diffs).cpu().double(), torch.cat(refs).cpu().double()
    total = r.square().sum().sqrt().item()
    floor = 1e-3 * r.mean().item()
    return {"relative": d.square().sum().sqrt().item() / total if total else float(d.max().item() > 0),
            "worst_row": (d / r.clamp_min(floor)).max().item() if floor else float(d.max().item() > 0),
            "max_abs": torch.stack(peaks).max().item(),
            "mean_abs": torch.stack(sums).sum().item() / sum(part.numel() for part in parts)}


def disagrees(errors: dict[str, float], token_rows: bool) -> bool:
    """Whether :func:`disagreement`'s figures exceed :data:`AGREEMENT` (the worst row only
    where the rows are tokens')."""
    return errors["relative"] > AGREEMENT["relative"] or (token_rows and errors["worst_row"] > AGREEMENT["worst_row"])


def timed(fn, device: torch.device, warmup: int = 2, iters: int = 10) -> float:
    """Median seconds of ``fn()``, all ranks in step (a barrier before each run)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(device: torch.device, smoke: bool) -> dict[str, float]:
    """Dense bf16 matmul rate, device copy bandwidth, and peer copy bandwidth with several GPUs."""
    n = 256 if smoke else 8192
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t_mm = timed(lambda: a @ b, device, iters=5)
    src = torch.empty((1 << 20) if smoke else (1 << 30), device=device, dtype=dtype)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), device, iters=5)
    out = {
        "dense_tflops": 2 * n**3 / t_mm / 1e12,
        "copy_gbps": 2 * src.numel() * src.element_size() / t_copy / 1e9,  # read + write
    }
    world = dist.get_world_size()
    if device.type == "cuda" and world > 1:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(1 << 28, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        peer = handle.get_buffer((dist.get_rank() + 1) % world, (1 << 28,), torch.uint8)
        local = torch.empty(1 << 28, dtype=torch.uint8, device=device)
        t_peer = timed(lambda: local.copy_(peer), device, iters=5)
        out["peer_copy_gbps"] = (1 << 28) / t_peer / 1e9  # bytes read from the peer per second
    return out


def environment(device: torch.device) -> dict:
    import triton

    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "world_size": dist.get_world_size() if dist.is_initialized() else 1, "torch": torch.__version__,
        "triton": triton.__version__, "triton_path": os.path.dirname(triton.__file__),
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }
    try:
        import deep_ep  # noqa: F401

        env["deep_ep"] = getattr(deep_ep, "__version__", "installed")
    except ImportError:
        env["deep_ep"] = None
    return env


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format) triples."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else format(value, fmt) if fmt else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: str, title: str, x_label: str, y_label: str, series: dict[str, tuple[list, list]]) -> bool:
    """Write a line plot of ``series`` (name: (xs, ys)) as a PNG; False when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"matplotlib is not installed: no plot written to {path}")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set(title=title, xlabel=x_label, ylabel=y_label)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write(results: dict, table: str, out: str | None) -> None:
    """Print the table; with ``out``, write ``out`` (JSON) and ``out`` with ``.md`` (table + environment)."""
    if dist.get_rank() != 0:
        return
    print(table)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1))
        env = "\n".join(f"- {k}: {v}" for k, v in results["environment"].items())
        ceil = "\n".join(f"- {k}: {v:.1f}" for k, v in results["ceilings"].items())
        Path(out).with_suffix(".md").write_text(f"{table}\n\nEnvironment:\n{env}\n\nCeilings measured in this run:\n{ceil}\n")
