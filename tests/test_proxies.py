"""The DeepSeek-V3 and Qwen3-235B proxies and their training script, on the CPU.

Real shapes are checked on the meta device; everything that computes runs the tiny presets:
forward/backward on both backends (kosmos under Triton's interpreter, in a subprocess), the
loss falling, bitwise resume, expert + data parallel training in two gloo processes against
one process with the same global batch, and the error messages.
"""

import importlib.util
import json
import math
import os
import struct
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import kosmos_moe
from kosmos_moe.demo import main as demo_main
from multiprocess import INTERPRET, run_world

# `proxies` is not an installed package: import it from the repository root under a bare
# `pytest` too (`python -m pytest` from the root has the root on sys.path already).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from proxies import DeepSeekV3Proxy, MoERuntime, Qwen3Proxy, build_model, get_config  # noqa: E402
from proxies.data import ByteTokenizer, Loader, SyntheticTokens, TextFileTokens  # noqa: E402
from proxies.flops import active_params, flops_per_token, total_params  # noqa: E402
from proxies.plot import _fallback as builtin_plot  # noqa: E402
from proxies.train import main  # noqa: E402

TINY = ["deepseek_v3_tiny", "qwen3_tiny"]


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny models gain nothing from intra-op threads, and on a loaded 2-core machine two
    spinning OpenMP threads per process make a step 5x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
FAST = ["--batch", "4", "--seq-len", "32", "--no-progress", "--log-every", "100"]


def loss_of(model, tokens):
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)), logits


# ---------------------------------------------------------------------------------------------
# Shapes


def test_deepseek_v3_real_shapes():
    cfg = get_config("deepseek_v3", n_layers=3, vocab_size=1000)
    with torch.device("meta"):
        model = DeepSeekV3Proxy(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    attn = "layers.0.self_attn."
    assert shapes[attn + "q_a_proj.weight"] == (1536, 7168)
    assert shapes[attn + "q_a_layernorm.weight"] == (1536,)
    assert shapes[attn + "q_b_proj.weight"] == (128 * (128 + 64), 1536)
    assert shapes[attn + "kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert shapes[attn + "kv_a_layernorm.weight"] == (512,)
    assert shapes[attn + "kv_b_proj.weight"] == (128 * (128 + 128), 512)
    assert shapes[attn + "o_proj.weight"] == (7168, 128 * 128)
    assert shapes["layers.0.mlp.gate_proj.weight"] == (18432, 7168)
    assert shapes["layers.0.mlp.down_proj.weight"] == (7168, 18432)
    for i in (1, 2):  # the rest are the DeepSeek-V3 MoE layer
        moe = model.layers[i].mlp
        assert moe.config == get_config("deepseek_v3").moe
        assert (moe.config.num_experts, moe.config.top_k, moe.config.router, moe.config.num_shared_experts) == (
            256, 8, "sigmoid_group", 1)
        assert shapes[f"layers.{i}.mlp.experts.gate_up_proj"] == (256, 2 * 2048, 7168)
        assert moe.gate.e_score_correction_bias.shape == (256,)
    assert shapes["embed_tokens.weight"] == (1000, 7168) and shapes["lm_head.weight"] == (1000, 7168)
    assert len(model.moe_layers()) == 2


def test_qwen3_real_shapes():
    cfg = get_config("qwen3_235b", n_layers=2, vocab_size=1000)
    with torch.device("meta"):
        model = Qwen3Proxy(cfg)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    attn = "layers.1.self_attn."
    assert shapes[attn + "q_proj.weight"] == (64 * 128, 4096)
    assert shapes[attn + "k_proj.weight"] == (4 * 128, 4096)
    assert shapes[attn + "v_proj.weight"] == (4 * 128, 4096)
    assert shapes[attn + "o_proj.weight"] == (4096, 64 * 128)
    assert shapes[attn + "q_norm.weight"] == (128,) and shapes[attn + "k_norm.weight"] == (128,)
    assert cfg.rope_theta == 1e6
    for layer in model.layers:
        c = layer.mlp.config
        assert (c.num_experts, c.top_k, c.router, c.moe_intermediate_size, c.num_shared_experts) == (
            128, 8, "softmax", 1536, 0)
    assert len(model.moe_layers()) == 2


def test_flops_count_active_experts_only():
    cfg = get_config("qwen3_235b", n_layers=1, vocab_size=1000)
    with torch.device("meta"):
        model = Qwen3Proxy(cfg)
    h, i = 4096, 1536
    attn = 4096 * (64 + 4 + 4) * 128 + 64 * 128 * 4096 + 2 * 128
    expected_active = attn + 2 * h + 128 * h + 8 * 3 * h * i + 1000 * h + h  # + norms, router, head
    assert active_params(model) == expected_active
    assert total_params(model) == expected_active + 120 * 3 * h * i + 1000 * h
    seq = 4096
    assert flops_per_token(model, seq) == 6 * expected_active + 3 * 2 * seq * 64 * 256 / 2


def _peak_allocated_bytes(fn, trace_path) -> int:
    """The peak of the CPU bytes that ``fn`` allocates and holds at once, from the profiler's
    memory events. Frees of blocks made before ``fn`` lower nothing: the profiler records some of
    them (the sizes of blocks it saw in an earlier session), which would hide new allocations."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    prof.export_chrome_trace(str(trace_path))
    events = [e["args"] for e in sorted(json.loads(Path(trace_path).read_text())["traceEvents"], key=lambda e: e["ts"])
              if e.get("name") == "[memory]"]
    assert events, "the profiler recorded no allocation"
    made: dict[int, int] = {}
    live = peak = 0
    for e in events:
        if e["Bytes"] > 0:
            made[e["Addr"]] = e["Bytes"]
            live += e["Bytes"]
            peak = max(peak, live)
        elif e["Addr"] in made:
            live -= made.pop(e["Addr"])
    return peak


@pytest.mark.parametrize("multi_tensor", [True, False], ids=["multi_tensor", "per_tensor"])
@pytest.mark.parametrize("preset", TINY)
def test_step_memory_is_what_the_step_allocates(preset, multi_tensor, tmp_path):
    """The floor that proxies.train checks before building a GPU run, against what moving the
    gradients to the masters and torch's AdamW allocate at a steady-state step of a bf16 model:
    the moments exist by then, the masters' fp32 gradients and the step's temporaries are new.
    Both of torch's implementations run on the CPU here (the multi-tensor one is the GPU's)."""
    from proxies.memory import step_memory
    from proxies.models import build_skeleton
    from proxies.optim import MasterWeights, build_adamw

    cfg = get_config(preset)
    model = build_model(cfg, MoERuntime("reference"), dtype=torch.bfloat16, seed=0)
    need = step_memory(build_skeleton(cfg, MoERuntime("reference"), dtype=torch.bfloat16), multi_tensor)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    assert (need.weights, need.masters, need.gradients, need.moments) == (2 * n, 4 * n, 4 * n, 8 * n)
    if multi_tensor:  # the decayed group (the matrices) is the larger
        assert need.step_temporary == 4 * sum(p.numel() for p in params if p.dim() >= 2)
    else:
        assert need.step_temporary == 2 * 4 * max(p.numel() for p in params)

    masters = MasterWeights(model)
    optimizer = build_adamw(masters, lr=1e-3, weight_decay=0.1, foreach=multi_tensor)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        masters.grads_to_master()
        optimizer.step()

    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    step()  # makes the moments
    masters.copy_to_model()
    masters.zero_grad()
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    peak = _peak_allocated_bytes(step, tmp_path / "trace.json")
    # Beyond the tensors: AdamW's step counters and scalars (measured: 12 B in all multi-tensor,
    # 2,060 B per-tensor), against temporaries of 128 KiB and more here.
    floor = need.gradients + need.step_temporary
    assert floor <= peak <= floor + 4096


def test_shortfall_names_the_floor_and_the_remedies():
    from proxies.memory import GiB, shortfall, step_memory
    from proxies.models import build_skeleton

    cfg = get_config("deepseek_v3")  # real shapes, two layers, 256 experts: far beyond one GPU
    need = step_memory(build_skeleton(cfg, MoERuntime("reference"), dtype=torch.bfloat16), multi_tensor=True)
    assert shortfall(need, need.total, "cuda:0") is None
    why = shortfall(need, 80 * GiB, "cuda:0")
    assert why.startswith(f"the training state needs at least {need.total / GiB:.2f} GiB (weights ")
    assert f"fp32 masters {need.masters / GiB:.2f} GiB" in why
    assert "more than the 80.00 GiB free on cuda:0" in why
    for remedy in ("--layers", "--num-experts", "--vocab-size", "--ep-size"):
        assert remedy in why


def test_kosmos_workspaces_count_once_per_layer_shape():
    """The floor holds the kosmos layers' worst-case workspaces (forward and backward), once per
    distinct layer shape: the proxies' layers share them (tests below check the sharing)."""
    from kosmos_moe.workspace import workspace_bytes
    from proxies.memory import step_memory, workspace_memory
    from proxies.models import build_skeleton

    cfg = get_config("qwen3_235b", n_layers=4, vocab_size=1024)
    tokens = 4096
    kosmos = build_skeleton(cfg, MoERuntime("kosmos", max_tokens_per_rank=tokens), dtype=torch.bfloat16)
    assert len(kosmos.moe_layers()) == 4
    pair = sum(workspace_bytes(cfg.moe, 1, tokens, torch.bfloat16).values())
    assert workspace_memory(kosmos) == pair > 1 << 30  # Qwen3-235B's layer at 4096 tokens: about 1.7 GiB
    need = step_memory(kosmos, multi_tensor=True)
    assert need.workspaces == pair and "kosmos workspaces 1." in need.describe()
    reference = step_memory(build_skeleton(cfg, MoERuntime("reference"), dtype=torch.bfloat16), multi_tensor=True)
    assert reference.workspaces == 0 and need.total == reference.total + pair
    # Another token bound is another layout: its own pair.
    bigger = build_skeleton(cfg, MoERuntime("kosmos", max_tokens_per_rank=2 * tokens), dtype=torch.bfloat16)
    assert workspace_memory(bigger) == sum(workspace_bytes(cfg.moe, 1, 2 * tokens, torch.bfloat16).values()) > pair


def test_skeleton_has_the_built_models_parameters():
    from proxies.models import build_skeleton

    for preset in TINY:
        cfg = get_config(preset)
        built = build_model(cfg, MoERuntime("reference"), dtype=torch.bfloat16, seed=0)
        skeleton = build_skeleton(cfg, MoERuntime("reference"), dtype=torch.bfloat16)
        shapes = {n: (p.shape, p.dtype) for n, p in built.named_parameters()}
        assert shapes == {n: (p.shape, p.dtype) for n, p in skeleton.named_parameters()}
        assert all(p.is_meta for p in skeleton.parameters())


# ---------------------------------------------------------------------------------------------
# Forward and backward


@pytest.mark.parametrize("preset", TINY)
def test_forward_backward_reference(preset):
    cfg = get_config(preset)
    model = build_model(cfg, MoERuntime("reference"), seed=3)
    tokens = torch.randint(cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss, logits = loss_of(model, tokens)
    assert logits.shape == (2, 16, cfg.vocab_size)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1  # init std 0.02: near-uniform predictions
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if ".experts." not in name:  # an expert no token chose has a zero gradient
            assert p.grad.abs().sum() > 0, name
    # Causal: the logits of position t do not depend on later tokens.
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % cfg.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(changed)[:, :10], model(tokens)[:, :10])


def test_init_is_independent_of_expert_layout():
    """Rank r of an EP group starts from the slice of experts a single rank would hold."""
    cfg = get_config("deepseek_v3_tiny")
    full = build_model(cfg, seed=5)
    layer = full.moe_layers()[0]
    other = build_model(cfg, seed=5)
    for a, b in zip(full.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert not torch.equal(layer.experts.gate_up_proj[0], layer.experts.gate_up_proj[1])


def check_kosmos_matches_reference(rank, world):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for preset in TINY:
        cfg = get_config(preset, hidden_size=32, n_layers=2, moe={"moe_intermediate_size": 16})
        b, s = 2, 8
        tokens = torch.randint(cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))
        results = {}
        for backend in ("reference", "kosmos"):
            model = build_model(cfg, MoERuntime(backend, max_tokens_per_rank=b * s), seed=1)
            assert [m.backend for m in model.moe_layers()] == [backend] * len(model.moe_layers())
            loss, logits = loss_of(model, tokens)
            loss.backward()
            results[backend] = logits.detach(), {n: p.grad for n, p in model.named_parameters()}
            if backend == "kosmos":  # the model's layers share one workspace per direction
                launchers = [m.fused() for m in model.moe_layers()]
                assert len({id(f.workspace) for f in launchers}) == len({id(f.backward.workspace) for f in launchers}) == 1
        ref_logits, ref_grads = results["reference"]
        logits, grads = results["kosmos"]
        # fp32 on both sides; the kernel sums in other orders (see test_fused_backward_cpu.py).
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=2e-5 * g.abs().max().item(),
                                       msg=lambda m: f"{preset} {name}: {m}")


def test_kosmos_backend_matches_reference():
    run_world(1, check_kosmos_matches_reference, env=INTERPRET)


# ---------------------------------------------------------------------------------------------
# Training


@pytest.mark.parametrize("preset", TINY)
def test_loss_falls(preset, tmp_path):
    result = main(["--preset", preset, "--steps", "50", "--batch", "8", "--seq-len", "48", "--no-progress",
                   "--no-ckpt", "--out", str(tmp_path)])
    losses = [r["loss"] for r in result["history"]]
    assert len(losses) == 50
    assert losses[0] > 0.9 * math.log(256)
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses
    assert (tmp_path / "log.json").is_file() and (tmp_path / "loss.png").is_file()
    logged = json.loads((tmp_path / "log.json").read_text())
    assert logged["history"][-1]["loss"] == losses[-1]
    assert logged["history"][-1]["load_max_over_mean"] >= 1.0


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_resume_is_bitwise(tmp_path):
    """16 steps straight equal 8 steps, a checkpoint, a fresh process state, and 8 more."""
    args = ["--preset", "deepseek_v3_tiny", "--steps", "16", "--aux-loss-coef", "0.01", *FAST]
    straight = main(args + ["--out", str(tmp_path / "a")])
    first = main(args + ["--out", str(tmp_path / "b"), "--stop-at", "8"])
    assert first["steps_done"] == 8 and len(first["history"]) == 8
    torch.manual_seed(1234)  # the resume restores the generator state; disturb it first
    resumed = main(args + ["--out", str(tmp_path / "b"), "--resume", "auto"])
    a = [(r["loss"], r["aux_loss"], r["grad_norm"]) for r in straight["history"]]
    b = [(r["loss"], r["aux_loss"], r["grad_norm"]) for r in resumed["history"]]
    assert a == b
    ta = _tensors(tmp_path / "a/checkpoints/step_000016/rank00000.safetensors")
    tb = _tensors(tmp_path / "b/checkpoints/step_000016/rank00000.safetensors")
    assert ta.keys() == tb.keys()
    assert any(k.endswith("e_score_correction_bias") for k in ta)
    assert any(k.startswith("optim/") and k.endswith("exp_avg_sq") for k in ta)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_text_file_training(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    result = main(["--preset", "qwen3_tiny", "--text-file", str(text), "--steps", "6", *FAST, "--no-ckpt",
                   "--out", str(tmp_path / "run")])
    assert result["config"]["vocab_size"] == ByteTokenizer.vocab_size == 258
    source = TextFileTokens(str(text), 32, seed=0)
    sample = source.sample(3)
    assert sample.shape == (33,) and int(sample.max()) < 258
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo")) == "héllo"
    assert tok.encode("ab") == [256, 97, 98, 257]


def test_data_is_a_function_of_the_global_sample():
    src = SyntheticTokens(64, 12, seed=2)
    one = Loader(src, batch_size=4)
    halves = [Loader(src, batch_size=2, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        x, y = one.next()
        parts = [h.next() for h in halves]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert one.position == halves[0].position == 12


def check_parallel_training(rank, world, expected, tmp):
    torch.set_num_threads(1)  # two processes on a 2-core machine: no oversubscription
    base = ["--preset", "deepseek_v3_tiny", "--steps", "8", "--batch", "2", "--seq-len", "32",
            "--no-progress", "--log-every", "4"]
    for ep in (2, 1):  # EP over both ranks; then pure data parallelism
        result = main(base + ["--ep-size", str(ep), "--no-ckpt", "--out", os.path.join(tmp, f"ep{ep}")])
        assert (result["ep"], result["dp"]) == (ep, world // ep)
        losses = [r["loss"] for r in result["history"]]
        # Same global batch and model as one rank with batch 4; sums in other orders.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-5, atol=0,
                                   msg=lambda m: f"ep {ep}: {m}")
    # Bitwise resume under expert parallelism: each rank restores its own shard.
    straight = main(base + ["--ep-size", "2", "--out", os.path.join(tmp, "s")])
    main(base + ["--ep-size", "2", "--out", os.path.join(tmp, "r"), "--stop-at", "4"])
    resumed = main(base + ["--ep-size", "2", "--out", os.path.join(tmp, "r"), "--resume", "auto"])
    assert [r["loss"] for r in straight["history"]] == [r["loss"] for r in resumed["history"]]


def check_save_returns_complete(rank, world, tmp):
    # Rank 0 is slow to finish the checkpoint (meta.json, written last). No rank may return
    # from the save before it is there: a resume right after a save once started rank 1 at
    # step 0 and rank 0 at the saved step, and the two ranks' collectives then hung.
    import time

    from proxies.checkpoint import latest_checkpoint, save_checkpoint, step_dir
    from proxies.optim import MasterWeights

    if rank == 0:
        write_text = Path.write_text

        def slow_write_text(self, *args, **kwargs):
            time.sleep(1.0)
            return write_text(self, *args, **kwargs)

        Path.write_text = slow_write_text
    model = torch.nn.Linear(4, 4)
    masters = MasterWeights(model)
    optimizer = torch.optim.AdamW(masters.masters)
    saved = save_checkpoint(step_dir(tmp, 3), rank=rank, world=world, model=model, masters=masters,
                            optimizer=optimizer, meta={"step": 3})
    assert latest_checkpoint(tmp) == saved.parent, f"rank {rank} returned before the checkpoint was complete"


def check_resume_auto_agrees(rank, world, tmp):
    # Each rank's view of the file system may lag (a network file system): rank 0's answer is
    # every rank's, here against a rank 1 that sees no checkpoint at all.
    import proxies.train as train

    if rank == 1:
        train.latest_checkpoint = lambda out: None
    resume, note = train._resolve_resume("auto", Path(tmp))
    assert resume == str(Path(tmp) / "checkpoints" / "step_000007") and note is None, (rank, resume, note)


def test_checkpoints_are_complete_and_resumed_alike_on_every_rank(tmp_path):
    run_world(2, check_save_returns_complete, str(tmp_path / "save"))
    step = tmp_path / "resume" / "checkpoints" / "step_000007"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    run_world(2, check_resume_auto_agrees, str(tmp_path / "resume"))


def test_expert_and_data_parallel_training(tmp_path):
    single = main(["--preset", "deepseek_v3_tiny", "--steps", "8", "--batch", "4", "--seq-len", "32",
                   "--no-progress", "--no-ckpt", "--out", str(tmp_path / "one")])
    expected = [r["loss"] for r in single["history"]]
    run_world(2, check_parallel_training, expected, str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Errors


def _error_of(capsys, argv, entry=main) -> str:
    with pytest.raises(SystemExit) as info:
        entry(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("usage: ")  # argparse's usage, then one error line
    return err


def test_bad_arguments(capsys, tmp_path, monkeypatch):
    assert "invalid choice: 'gpt4'" in _error_of(capsys, ["--preset", "gpt4"])
    assert "invalid choice: 'warp_drive'" in _error_of(capsys, ["--backend", "warp_drive"])
    err = _error_of(capsys, ["--preset", "qwen3_tiny", "--ep-size", "3"])
    assert "--ep-size 3 does not divide the number of experts 8" in err
    assert "--ep-size 2 does not divide the world size 1" in _error_of(capsys, ["--ep-size", "2"])
    missing = str(tmp_path / "missing.txt")
    assert f"--text-file {missing!r} does not exist" in _error_of(capsys, ["--text-file", missing])
    short = tmp_path / "short.txt"
    short.write_text("abc")
    assert "too short for seq_len 64" in _error_of(capsys, ["--text-file", str(short), "--no-progress"])
    assert "smaller than the byte tokenizer" in _error_of(capsys, ["--text-file", str(short), "--vocab-size", "100"])
    assert "--stop-at must be in [1, --steps=5]" in _error_of(capsys, ["--steps", "5", "--stop-at", "9"])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "set TRITON_INTERPRET=1" in _error_of(capsys, ["--backend", "kosmos", "--device", "cpu"])
    with pytest.raises(ValueError, match="unknown preset 'nope'; choose one of deepseek_v3, qwen3_235b"):
        get_config("nope")
    provided = ", ".join(kosmos_moe.BACKENDS)
    with pytest.raises(ValueError, match=f"unknown MoE backend 'warp_drive': this kosmos_moe provides {provided}"):
        MoERuntime("warp_drive")
    with pytest.raises(ValueError, match="needs max_tokens_per_rank"):
        MoERuntime("kosmos")


def test_a_run_that_cannot_fit_the_gpu_is_refused_before_the_build(capsys, monkeypatch, tmp_path):
    """The real DeepSeek-V3 shapes (two layers, 256 experts) on one 80 GiB GPU: refused with the
    floor's parts named, before any weight is made. CUDA is stood in for; nothing reaches it."""
    import proxies.train
    from proxies.memory import step_memory
    from proxies.models import build_skeleton

    free = 80 << 30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free))

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(proxies.train, "build_model", no_build)
    need = step_memory(build_skeleton(get_config("deepseek_v3"), dtype=torch.bfloat16), multi_tensor=True)
    err = _error_of(capsys, ["--preset", "deepseek_v3", "--device", "cuda", "--no-progress", "--out", str(tmp_path)])
    assert f"needs at least {need.describe()} per rank" in err
    assert "more than the 80.00 GiB free on cuda:0" in err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--seq-len", "-3"], "--seq-len must be >= 1, got -3"),
    (["--lr", "-1"], "--lr must be > 0 and finite, got -1.0"),
    (["--lr", "0"], "--lr must be > 0 and finite, got 0.0"),
    (["--lr", "nan"], "--lr must be > 0 and finite, got nan"),
    (["--lr", "inf"], "--lr must be > 0 and finite, got inf"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio must be in [0, 1], got 1.5"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0 and finite, got -0.1"),
    (["--clip", "-1"], "--clip must be >= 0 and finite, got -1.0"),
    (["--aux-loss-coef=-1e-3"], "--aux-loss-coef must be >= 0 and finite, got -0.001"),
    (["--bias-update-rate", "nan"], "--bias-update-rate must be >= 0 and finite, got nan"),
    (["--seed", "-1"], f"--seed must be in [0, {2**64 - 1}], got -1"),
    (["--seed", str(2**64)], f"--seed must be in [0, {2**64 - 1}], got {2**64}"),
    (["--vocab-size", "1"], "--vocab-size must be >= 2, got 1"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--dense-layers", "-1"], "--dense-layers must be >= 0, got -1"),
    (["--dense-layers", "4"], "--dense-layers must be in [0, 3] (the number of layers), got 4"),
    (["--layers", "2", "--dense-layers", "3"], "--dense-layers must be in [0, 2] (the number of layers), got 3"),
    (["--num-experts", "0"], "--num-experts must be >= 1, got 0"),
    (["--num-experts", "6"], "--num-experts must be a multiple of 4 and >= 4 (4, 8, ...) for deepseek_v3_tiny"),
    (["--preset", "deepseek_v3", "--num-experts", "8"], "--num-experts must be a multiple of 8 and >= 16"),
    (["--preset", "qwen3_tiny", "--num-experts", "1"], "--num-experts must be >= 2 for qwen3_tiny"),
    (["--ep-size", "0"], "--ep-size must be >= 1, got 0"),
    (["--branching", "0"], "--branching must be >= 1, got 0"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0 and finite, got 0.0"),
    (["--log-every", "0"], "--log-every must be >= 1, got 0"),
    (["--ckpt-every", "-5"], "--ckpt-every must be >= 0, got -5"),
])
def test_numeric_options_out_of_range(capsys, argv, message):
    assert message in _error_of(capsys, argv)


def test_resume_path_is_checked(capsys, tmp_path):
    missing = str(tmp_path / "nope")
    assert f"--resume {missing!r} does not exist" in _error_of(capsys, ["--resume", missing])
    err = _error_of(capsys, ["--resume", str(tmp_path)])
    assert f"--resume: no checkpoint for rank 0 in {str(tmp_path)!r} (expected rank00000.safetensors)" in err
    rank_file = tmp_path / "rank00000.safetensors"
    rank_file.write_bytes(b"")
    assert f"--resume {str(rank_file)!r} is not a directory" in _error_of(capsys, ["--resume", str(rank_file)])
    err = _error_of(capsys, ["--resume", str(tmp_path)])
    assert f"--resume: {str(rank_file)!r} is not a readable safetensors file" in err
    save_file({"x": torch.zeros(1)}, str(rank_file))
    err = _error_of(capsys, ["--resume", str(tmp_path)])
    assert f"--resume: {str(rank_file)!r} is not a proxy checkpoint (no 'kosmos_proxy' metadata)" in err


def _pretend_deep_ep(monkeypatch, installed: bool) -> None:
    real = importlib.util.find_spec
    fake = object() if installed else None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "deep_ep" else real(name, *a))


def test_deepep_backend_refusals(capsys, monkeypatch):
    _pretend_deep_ep(monkeypatch, installed=False)
    err = _error_of(capsys, ["--backend", "deepep"])
    assert "--backend deepep needs DeepEP's Python package `deep_ep`" in err
    assert "https://github.com/deepseek-ai/DeepEP" in err
    assert "deepep_buffer" not in err  # a Python argument: no use on the command line
    _pretend_deep_ep(monkeypatch, installed=True)
    err = _error_of(capsys, ["--backend", "deepep", "--device", "cpu"])
    assert "--backend deepep runs DeepEP's CUDA kernels: it needs a GPU" in err


# ---------------------------------------------------------------------------------------------
# kosmos_moe.demo's arguments (its only tests; the demo itself is a script)

DEMO_SMALL = ["--tokens", "16", "--hidden", "16", "--intermediate", "8"]


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "-1"], "--tokens must be >= 1, got -1"),
    (["--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["--hidden", "0"], "--hidden must be >= 1, got 0"),
    (["--intermediate", "0"], "--intermediate must be >= 1, got 0"),
    (["--top-k", "0"], "--top-k must be >= 1, got 0"),
    (["--n-group", "0"], "--n-group must be >= 1, got 0"),
    (["--topk-group", "9"], "--topk-group must be in [1, --n-group=8], got 9"),
    (["--seed", "-1"], f"--seed must be in [0, {2**64 - 1}], got -1"),
    (["--experts", "12"], "--experts must be a multiple of --n-group=8 and >= 8 (8, 16, ...) for --top-k 4 "
                          "from --topk-group 4 groups, got 12"),
    (["--experts", "8", "--top-k", "8"], "--experts must be a multiple of --n-group=8 and >= 16"),
])
def test_demo_bad_arguments(capsys, argv, message):
    assert message in _error_of(capsys, argv, entry=demo_main)


def test_demo_group_options(capsys):
    demo_main(["--experts", "12", "--n-group", "4", "--topk-group", "2", *DEMO_SMALL])
    out = capsys.readouterr().out
    assert "total 64 (= tokens x top_k = 64)" in out
    with pytest.raises(SystemExit):
        demo_main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m kosmos_moe.demo ")


def test_resume_rejects_another_layout(capsys, tmp_path):
    main(["--preset", "qwen3_tiny", "--steps", "2", *FAST, "--out", str(tmp_path)])
    capsys.readouterr()
    err = _error_of(capsys, ["--preset", "qwen3_tiny", "--steps", "4", "--layers", "3", *FAST,
                             "--out", str(tmp_path), "--resume", "auto"])
    # Only the differing field is named, not the whole config.
    assert "was written with another model config (n_layers: 2 in the checkpoint, 3 in this run)" in err


# ---------------------------------------------------------------------------------------------
# The loss curve


def test_builtin_png(tmp_path):
    path = tmp_path / "curve.png"
    builtin_plot(str(path), list(range(1, 31)), [5.0 / (1 + 0.1 * s) for s in range(30)])
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    width, height = struct.unpack(">II", data[16:24])
    assert kind == b"IHDR" and length == 13 and width > 100 and height > 100
    # Decode the single IDAT chunk: one filter byte + width RGB triplets per row.
    offset = 8 + 12 + length
    idat_len, idat = struct.unpack(">I4s", data[offset:offset + 8])
    assert idat == b"IDAT"
    raw = zlib.decompress(data[offset + 8:offset + 8 + idat_len])
    assert len(raw) == height * (1 + 3 * width)
    assert raw.count(b"\x14\x3c\xa0") > 50  # the moving average's dark blue is drawn
