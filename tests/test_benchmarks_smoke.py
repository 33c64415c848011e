"""Every benchmark script runs end to end in its CPU smoke mode (tiny shapes, one iteration).

These check that the scripts work and write their JSON and markdown; they measure nothing.
The GPU session script's commands are checked against the scripts' own cases and variants.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def benchmark_module(name: str, monkeypatch):
    """benchmarks/<name>.py imported as a module (its main() not run)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the scripts import each other
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.parametrize("script", ["bench_dispatch_combine.py", "bench_layer.py"])
def test_script_smoke(script, tmp_path):
    out = tmp_path / "result.json"
    run(script, "--out", str(out))
    results = json.loads(out.read_text())
    assert results["environment"]["torch"] and results["ceilings"]["dense_tflops"] > 0
    assert results["rows"] and (tmp_path / "result.md").read_text().startswith("|")
    measured = [r for r in results["rows"] if "skipped" not in r]
    assert "kosmos" in {r.get("path", r.get("backend")) for r in measured}
    if script == "bench_dispatch_combine.py":
        assert measured[0]["path"] == "kosmos" and measured[0]["max_abs_err"] < 1e-4


def test_dispatch_combine_sweep_smoke(tmp_path):
    out = tmp_path / "sweep.json"
    run("bench_dispatch_combine.py", "--sweep", "8", "24", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert sorted({r["tokens"] for r in rows}) == [8, 24] and all(r["dispatch_gbps"] > 0 for r in rows)


def test_e2e_smoke(tmp_path):
    out = tmp_path / "e2e.json"
    run("bench_e2e.py", "--cases", "dsv3_rank", "--backends", "reference", "--seq-len", "16", "--warmup", "0",
        "--iters", "1", "--out", str(out))
    assert json.loads(out.read_text())


def test_e2e_reports_a_case_that_cannot_fit_before_building_it(monkeypatch):
    """The DeepSeek-V3 rank case's full step (4.1 B parameters, 89.7 GB at the optimizer step) on
    an 80 GiB GPU, and the 256-expert forward + backward on 40 GiB: refused with the floor named,
    before a weight is made. CUDA is stood in for."""
    import argparse

    bench = benchmark_module("bench_e2e", monkeypatch)
    free = [80 << 30]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], free[0]))

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(bench, "build_model", no_build)
    args = argparse.Namespace(layers=2, smoke=False, vocab_size=None, batch=1, seq_len=4096, device="cuda")
    with pytest.raises(bench.DoesNotFit, match=r"needs at least 83\.54 GiB .* at the optimizer step, "
                                                r"more than the 80\.00 GiB free on cuda"):
        bench.run_backend("dsv3_rank", "reference", args)
    # Without an optimizer step: 13.9 B bf16 parameters and their gradients, 51.9 GiB.
    free[0] = 40 << 30
    with pytest.raises(bench.DoesNotFit, match=r"needs at least 51\.9\d GiB \(weights 25\.9\d GiB, gradients "
                                                r"25\.9\d GiB\) per rank at the end of the backward, more than the "
                                                r"40\.00 GiB"):
        bench.run_backend("dsv3_full", "reference", args)


GPU_ONLY = ["bench_dispatch_combine.py", "bench_layer.py", "bench_e2e.py", "gemm_tiles.py", "layer_forward.py",
            "layer_backward.py", "world_liveness.py", "host_blocking.py"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on CPU-only machines, and a CUDA device is present")
@pytest.mark.parametrize("script", GPU_ONLY)
def test_gpu_only_script_refuses_without_cuda(script):
    """Without a GPU a full run must stop at once with one line saying so (status 2), not run full-size
    shapes on the CPU for minutes, crash in CUDA initialisation, or list every variant as failed and
    exit 0."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)  # as a user would run it
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"{script}: needs a CUDA device"), done.stderr
    assert not done.stdout


def test_gpu_session_names_real_tests_cases_and_variants(monkeypatch):
    """benchmarks/gpu_session.sh runs on GPU time that is scarce: a test file, case or variant it
    names that no longer exists would only fail there. Each of its commands is checked here."""
    import re
    import shlex

    choices = {
        "layer_forward.py": lambda m: {"--cases": m.CASES, "--variants": m.TILE_VARIANTS},
        "layer_backward.py": lambda m: {"--cases": m.CASES, "--variants": m.VARIANTS},
        "gemm_tiles.py": lambda m: {"--shapes": m.SHAPES, "--variants": m.VARIANTS,
                                    "--wgrad-variants": m.WGRAD_VARIANTS},
        "host_blocking.py": lambda m: {},
        "stall_profile.py": lambda m: {"--case": m.CASES, "--variant": {
            *m.FORWARD_VARIANTS, *benchmark_module("layer_backward", monkeypatch).VARIANTS}},
    }
    text = (ROOT / "benchmarks" / "gpu_session.sh").read_text().replace("\\\n", " ")
    stages = re.findall(r"^\s+[\w-]+\)\s+(python .*?;;)", text, re.M)
    assert len(stages) == 27, stages
    commands = []
    for stage in stages:
        for part in re.split(r"&&|;", stage.split(";;")[0]):
            words = shlex.split(part)
            if "python" in words:  # past environment assignments or `env SETTINGS` before it
                words = words[words.index("python"):]
            if words and words[0] == "python":
                commands.append(words)
    nodes = []
    for words in commands:
        if words[1:3] == ["-m", "pytest"]:
            tests = [w for w in words if w.startswith("tests/")]
            assert tests and all((ROOT / t.split("::")[0]).is_file() for t in tests), words
            nodes += [t for t in tests if "::" in t]
            continue
        script = Path(words[1]).name
        allowed = choices[script](benchmark_module(script[:-3], monkeypatch))
        option = None
        for w in words[2:]:
            if w.startswith("--"):
                option = w
            elif option in allowed:
                assert w in allowed[option], f"{script} {option}: no {w!r}"
    # Test nodes, parameters included, are what pytest collects (on a CPU too: GPU tests skip
    # when run, not when collected).
    assert nodes
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *nodes],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = set(done.stdout.split())
    assert all(node in collected for node in nodes), (nodes, done.stdout[-3000:])


def test_stall_profile_aggregates_an_export(tmp_path, monkeypatch):
    """stall_profile.aggregate reads ncu's per-line source export (a section per file, a line's
    totals row followed by its SASS rows) and ranks lines by samples; no GPU or ncu needed."""
    stall = benchmark_module("stall_profile", monkeypatch)
    header = ["Line No", "Source", "Address", "Source", "Warp Stall Sampling (All Samples)",
              "Warp Stall Sampling (Not-issued Samples)", "stall_barrier", "stall_long_sb",
              "stall_barrier (Not Issued)"]
    rows = [
        ["File Path", str(ROOT / "kernels" / "tile_gemm.py")], ["Function Name", "expert_forward_kernel"], header,
        ["209", "for k0 in tl.range(...):", "-", "-", "30", "28", "20", "10", "19"],
        ["", "", "0x10", "BAR.SYNC", "20", "19", "20", "0", "19"],
        ["215", "a = tl.load(...)", "-", "-", "60", "50", "0", "60", "0"],
        ["File Path", "/somewhere/triton/language/standard.py"], header,
        ["43", "return (x + (div - 1)) // div", "-", "-", "10", "9", "0", "10", "0"],
    ]
    export = tmp_path / "case_forward_lines.csv"
    export.write_text("\n".join(",".join(f'"{c}"' for c in r) for r in rows) + "\n")
    table = stall.aggregate(str(export))
    lines = table.splitlines()
    assert "100 stall samples" in lines[0]
    assert "long_sb 80.0%" in lines[1] and "barrier 20.0%" in lines[1]  # Not-issued columns not added twice
    ranked = [line for line in lines if "%  " in line]
    assert ranked[0].split()[:2] == ["60.0%", "kernels/tile_gemm.py:215"]
    assert ranked[1].split()[:2] == ["30.0%", "kernels/tile_gemm.py:209"] and "barrier 67%" in ranked[1]
    assert ranked[2].split()[:2] == ["10.0%", "standard.py:43"]
    with pytest.raises(ValueError, match="no stall samples"):
        empty = tmp_path / "empty_lines.csv"
        empty.write_text('"File Path","x.py"\n' + ",".join(f'"{c}"' for c in header) + "\n")
        stall.aggregate(str(empty))


def test_stall_profile_finds_the_innermost_loops(tmp_path, monkeypatch):
    """stall_profile.loops reads ncu's per-instruction export, takes each backward branch and
    its target as a loop, keeps the innermost ones and ranks them by samples, counting their
    products, copies, spills and barriers (predicates stripped); no GPU or ncu needed."""
    stall = benchmark_module("stall_profile", monkeypatch)
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_barrier", "stall_long_sb", "stall_barrier (Not Issued)"]
    code = [  # address, instruction, samples, executed, barrier, long scoreboard
        (0x00, "MOV R1, c[0x0][0x28]", 1, 8, 0, 1),
        (0x10, "LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]", 4, 64, 0, 4),   # inner loop A
        (0x20, "@!PT  LDL R9, [R1+0x28]", 6, 64, 6, 0),
        (0x30, "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24", 10, 64, 0, 10),
        (0x40, "@P1   BRA 0x10", 0, 64, 0, 0),
        (0x50, "BAR.SYNC.DEFER_BLOCKING 0x0", 20, 16, 20, 0),                # inner loop B
        (0x60, "UTMALDG.2D [UR32], [UR26]", 30, 16, 10, 20),
        (0x70, "@!P2  BRA `(0x50)", 9, 16, 0, 9),
        (0x80, "BRA 0x0", 0, 8, 0, 0),                                        # the outer loop
        (0x90, "EXIT", 0, 8, 0, 0),
    ]
    rows = [["Kernel Name", "expert_backward_kernel"], header]
    rows += [[hex(a), src, str(n), str(ex), str(bar), str(lsb), str(bar)] for a, src, n, ex, bar, lsb in code]
    export = tmp_path / "case_backward_sass.csv"
    export.write_text("\n".join(",".join(f'"{c}"' for c in r) for r in rows) + "\n")
    table = stall.loops(str(export)).splitlines()
    assert "80 stall samples, 2 innermost loops" in table[0]
    heads = [line for line in table if ".." in line]
    assert heads[0].split()[:3] == ["73.8%", "0x50..0x70:", "3"] and "UTMALDG 1" in heads[0]
    assert "BAR.SYNC 1" in heads[0] and "branch ran 16 times" in heads[0] and "long_sb 49%" in heads[0]
    assert heads[1].split()[:3] == ["25.0%", "0x10..0x40:", "4"]
    assert "HGMMA 1, LDGSTS 1, UTMALDG 0, LDL 1, STL 0" in heads[1]
    assert any("UTMALDG.2D" in line and "| long_sb" in line for line in table)
    with pytest.raises(ValueError, match="no header row"):
        bad = tmp_path / "bad_sass.csv"
        bad.write_text('"Kernel Name","x"\n')
        stall.loops(str(bad))


def test_stall_profile_reads_the_traffic_metrics(monkeypatch):
    """stall_profile.traffic picks the DRAM and L2 metrics out of ncu's details page (base
    units, thousands separators) and nothing else."""
    stall = benchmark_module("stall_profile", monkeypatch)
    details = """
    Section: Command line profiler metrics
    ----------------------------------------------- ----------- ----------------
    Metric Name                                     Metric Unit     Metric Value
    ----------------------------------------------- ----------- ----------------
    dram__bytes_read.sum                                   byte    7,123,456,789
    dram__bytes_write.sum                                  byte      612,000,000
    lts__t_sector_op_read_hit_rate.pct                        %            53.12
    L2 Hit Rate                                               %            53.12
    lts__t_sectors.avg.pct_of_peak_sustained_elapsed          %            92.19
    lts__t_sectors_srcunit_ltcfabric.sum                 sector      250,000,000
"""
    assert stall.traffic(details) == {"dram__bytes_read.sum": 7123456789.0, "dram__bytes_write.sum": 612000000.0,
                                      "lts__t_sector_op_read_hit_rate.pct": 53.12,
                                      "lts__t_sectors_srcunit_ltcfabric.sum": 250000000.0}


def test_stall_profile_once_traffic(monkeypatch):
    """The DRAM baseline stall_profile prints: at DeepSeek-V3 32 experts the forward reads the
    roofline's weight bytes (layer_forward.work) plus tokens, intermediate rows (8 routed and
    the shared expert's per token) and combine rows once, and writes those rows and the output;
    the backward writes the weight gradients, as many bytes as the weights, among the rest."""
    stall = benchmark_module("stall_profile", monkeypatch)
    forward = benchmark_module("layer_forward", monkeypatch)
    from kosmos_moe.config import DEEPSEEK_V3

    T, H, I, K = 4096, 7168, 2048, 8
    config = dataclasses.replace(DEEPSEEK_V3, num_experts=32)
    weights = forward.work(config, T, 32)["weight_bytes"]
    inter, comb, out = 2 * T * (K * I + I), 2 * T * (K + 1) * H, 2 * T * H
    assert stall.once_traffic("dsv3_rank", backward=False) == {"read": weights + out + inter + comb,
                                                                "write": inter + comb + out}
    # Without the shared expert: its weights, intermediate rows and combine rows (slot K) go.
    alone = stall.once_traffic("dsv3_rank", backward=False, shared=False)
    assert alone == {"read": weights - 2 * 3 * H * I + out + 2 * T * K * I + 2 * T * K * H,
                     "write": 2 * T * K * I + 2 * T * K * H + out}
    back = stall.once_traffic("dsv3_rank", backward=True)
    assert back["write"] > 2 * 3 * 32 * H * I > 0.5 * back["write"]
    assert round(back["read"] / 1e9, 2) == 5.08 and round(back["write"] / 1e9, 2) == 4.75


def test_wgrad_l2_model(monkeypatch):
    """benchmarks/wgrad_l2_model.py: every strip length reads the same bytes from L2 and at
    least each operand once from DRAM; at Qwen3 16 experts (2,048 rows an expert) shorter
    strips miss less in a 25 MB cache, and a cache big enough for everything misses each chunk
    once (its rows padded to whole 64-row steps)."""
    model = benchmark_module("wgrad_l2_model", monkeypatch)
    long, short = (model.dram_reads("qwen3_rank", strip, 25) for strip in (16, 4))
    assert long["l2_reads"] == short["l2_reads"]
    assert long["dram_reads"] > 1.5 * short["dram_reads"] > 1.5 * short["once"]
    assert long["once"] <= model.dram_reads("qwen3_rank", 16, 1e6)["dram_reads"] <= 1.02 * long["once"]


def test_disagreement_flags_wrong_results_not_rounding(monkeypatch):
    """benchmarks/common.disagreement, which layer_forward.py and layer_backward.py use to refuse
    timing a wrong kernel: bf16 rounding of both sides passes; one token's row lost, or every
    row a quarter short (an expert's share of top-4 dropped), fails; a weight gradient's rows
    are not judged one by one; parts of a split match the whole they came from."""
    common = benchmark_module("common", monkeypatch)
    torch.manual_seed(0)
    truth = torch.randn(4096, 512)
    ref = truth.to(torch.bfloat16)
    fused = (truth + 2e-3 * torch.randn_like(truth)).to(torch.bfloat16)
    parts = list(fused.split([1000, 0, 3096]))
    rounded = common.disagreement(parts, ref, elements=4096)
    assert rounded["relative"] < 1e-2 and rounded["worst_row"] < 2e-2
    assert rounded["max_abs"] == (fused.float() - ref.float()).abs().max().item()
    assert abs(rounded["mean_abs"] - (fused.float() - ref.float()).abs().mean().item()) < 1e-9
    assert not common.disagrees(rounded, token_rows=True)

    lost = fused.clone()
    lost[1234] = 0
    row = common.disagreement([lost], ref)
    assert row["relative"] < common.AGREEMENT["relative"] < row["worst_row"]
    assert common.disagrees(row, token_rows=True) and not common.disagrees(row, token_rows=False)
    short = common.disagreement([fused * 0.75], ref)
    assert common.disagrees(short, token_rows=False)

    # A [experts, rows, cols] gradient, an expert with no tokens (zeros on both sides).
    grad = torch.randn(4, 64, 32)
    grad[2] = 0
    same = common.disagreement([grad[:1], grad[1:]], grad, elements=100)
    assert same == {"relative": 0.0, "worst_row": 0.0, "max_abs": 0.0, "mean_abs": 0.0}
    stray = grad.clone()
    stray[2, 5, 7] = 1.0
    assert common.disagreement([stray], grad)["worst_row"] > 1


def test_launch_ends_summarise_worker_spans(monkeypatch):
    """A profile buffer's span slots become microseconds from the first start
    (``_PersistentLaunch.worker_spans_us``), and ``launch_ends`` reports the rank whose workers
    waited longest, as a share of its launch, for the last one out; no GPU needed."""
    from types import SimpleNamespace

    from kosmos_moe.fused import _PersistentLaunch

    forward = benchmark_module("layer_forward", monkeypatch)
    counts = torch.zeros(32, dtype=torch.int64)
    # Timestamps in ns: three workers start 0-2 us after 1 s and leave at 100, 60 and 100 us.
    spans = torch.tensor([1_000_001_000, 1_000_100_000, 1_000_000_000, 1_000_060_000, 1_000_002_000, 1_000_100_000])
    even = SimpleNamespace(profile=torch.cat([counts, spans]), workers=3)
    got = _PersistentLaunch.worker_spans_us(even)
    assert torch.allclose(got, torch.tensor([[1.0, 100.0], [0.0, 60.0], [2.0, 100.0]], dtype=torch.float64))
    uneven = SimpleNamespace(profile=torch.cat([counts, spans - 1_000_000_000 + 5]), workers=3)
    uneven.profile[33] = 1_000 + 5  # worker 0 leaves as it starts, 1 us after worker 1
    launchers = [SimpleNamespace(worker_spans_us=lambda: _PersistentLaunch.worker_spans_us(launch))
                 for launch in (even, uneven)]
    ends = forward.launch_ends(launchers)
    assert ends["launch_us"] == 100.0 and ends["start_spread_us"] == 2.0 and ends["exit_spread_us"] == 99.0
    # Exits at 1, 60 and 100 us: the workers wait 99, 40 and 0 us for the last.
    assert abs(ends["mean_tail_us"] - 139.0 / 3) < 1e-9 and abs(ends["mean_tail_share"] - 1.39 / 3) < 1e-9
    assert "left within 99.0 us" in forward.describe_launch_ends(ends)
    with pytest.raises(RuntimeError, match="no profiled call"):
        _PersistentLaunch.worker_spans_us(SimpleNamespace(profile=torch.zeros(38, dtype=torch.int64), workers=3))


@pytest.mark.skipif(not __import__("triton").__version__.startswith("3.9."),
                    reason="the expected answers were read off Triton 3.9, the version CI installs")
def test_warp_specialization_probe_tells_split_from_dropped(monkeypatch):
    """The probe's three answers come from the compiler, not from the script: under the Triton
    CI installs (3.9), a 4-warp 64 x 128 tile is split into partitions, the same loop at 8 warps
    is left whole, and a 128-row tile at 4 warps fails in the pass. A newer Triton that changes
    these answers should fail here, since the README's account of why the kernels issue their
    own copies rests on them."""
    probe = benchmark_module("warp_specialization_probe", monkeypatch)
    assert probe.probe(probe.one_tile, 4, 64, 128) == "split"
    assert probe.probe(probe.one_tile, 8, 128, 256) == "not split"
    failed = probe.probe(probe.one_tile, 4, 128, 128)
    assert failed.startswith("failed in NVGPUWarpSpecialization: ") and "descriptor block" in failed, failed
