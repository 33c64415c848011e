"""The DeepSeek-V3 and Qwen3-235B proxies and their training script, on the CPU.

Real shapes are checked on the meta device; everything that computes runs the tiny presets:
forward/backward on both backends (kosmos under Triton's interpreter, in a subprocess), the
loss falling, bitwise resume, expert + data parallel training in two gloo processes against
one process with the same global batch, and the error messages.
"""

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

import kosmos_moe
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


def test_expert_and_data_parallel_training(tmp_path):
    single = main(["--preset", "deepseek_v3_tiny", "--steps", "8", "--batch", "4", "--seq-len", "32",
                   "--no-progress", "--no-ckpt", "--out", str(tmp_path / "one")])
    expected = [r["loss"] for r in single["history"]]
    run_world(2, check_parallel_training, expected, str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Errors


def _error_of(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


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


def test_resume_rejects_another_layout(tmp_path):
    main(["--preset", "qwen3_tiny", "--steps", "2", *FAST, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="was written with config="):
        main(["--preset", "qwen3_tiny", "--steps", "4", "--layers", "3", *FAST, "--out", str(tmp_path),
              "--resume", "auto"])


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
