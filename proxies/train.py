"""Train a DeepSeek-V3 or Qwen3-235B proxy with kosmos_moe expert layers.

One process (CPU or one GPU):

    python -m proxies.train --preset deepseek_v3_tiny --steps 60

Several GPUs, expert parallel over groups of ``--ep-size`` consecutive ranks, data parallel
over the rest:

    torchrun --nproc-per-node 8 -m proxies.train --preset deepseek_v3 --backend kosmos \\
        --ep-size 8 --batch 1 --seq-len 4096 --steps 100

Every ``--log-every`` steps rank 0 prints the loss (mean over all ranks), learning rate,
gradient norm, step time, tokens/s (all ranks), MFU per GPU against ``--peak-tflops`` and the
load balance (max/mean tokens per expert, over all ranks' tokens). At the end it writes
``log.json`` and ``loss.png`` to ``--out``; checkpoints go to ``--out/checkpoints`` and
``--resume auto`` continues from the newest one, bit for bit on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kosmos_moe import BACKENDS, MoEConfig
from kosmos_moe.config import smallest_expert_count
from kosmos_moe.deepep_backend import INSTALL_HINT as DEEPEP_INSTALL_HINT

from .checkpoint import latest_checkpoint, load_checkpoint, read_meta, save_checkpoint, step_dir
from .common import MoERuntime
from .data import ByteTokenizer, Loader, SyntheticTokens, TextFileTokens
from .flops import active_params, flops_per_token, total_params
from .memory import shortfall, size, step_memory
from .models import PRESETS, build_model, build_skeleton, get_config
from .optim import MasterWeights, build_adamw, lr_at
from .parallel import build_parallel, check_ep_size, clip_grad_norm, init_distributed, reduce_gradients
from .plot import plot_loss
from .progress import Progress

DEFAULT_GPU_PEAK_TFLOPS = 989.0  # H100/H200 SXM, bf16 dense (no sparsity)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m proxies.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--preset", default="deepseek_v3_tiny", choices=list(PRESETS))
    m.add_argument("--layers", type=int, default=None, help="number of layers (default: the preset's)")
    m.add_argument("--dense-layers", type=int, default=None, help="DeepSeek-V3: leading dense layers")
    m.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer (default: the preset's)")
    m.add_argument("--vocab-size", type=int, default=None,
                   help="default: the preset's with synthetic data, the byte tokenizer's (258) with --text-file")
    m.add_argument("--backend", default="reference", choices=list(BACKENDS), help="MoE backend")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=60, help="total optimizer steps (the schedule's length)")
    t.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    t.add_argument("--seq-len", type=int, default=64)
    t.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 1e-2 for the tiny presets, 2.2e-4 (DeepSeek-V3's) for real shapes)")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    t.add_argument("--warmup", type=int, default=5, help="linear warmup steps")
    t.add_argument("--schedule", default="cosine", choices=["cosine", "constant"])
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    t.add_argument("--aux-loss-coef", type=float, default=None,
                   help="weight of the switch balance loss (default: 1e-3 for Qwen3 as released, 0 for DeepSeek-V3, "
                        "which balances with the router bias instead)")
    t.add_argument("--bias-update-rate", type=float, default=1e-3,
                   help="DeepSeek-V3 aux-loss-free balancing: bias step per optimizer step")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ep-size", type=int, default=1, help="expert-parallel group size (divides the world)")
    d = p.add_argument_group("data")
    d.add_argument("--text-file", default=None, help="train on this file's bytes instead of synthetic tokens")
    d.add_argument("--branching", type=int, default=4, help="synthetic data: successors per token")
    r = p.add_argument_group("run")
    r.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    r.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="parameter/compute dtype (auto: bf16 on the GPU with fp32 masters, fp32 on the CPU)")
    r.add_argument("--peak-tflops", type=float, default=None,
                   help=f"per-device peak for MFU (default on the GPU: {DEFAULT_GPU_PEAK_TFLOPS:g}, "
                        "bf16 dense H100/H200; the CPU reports no MFU unless given)")
    r.add_argument("--log-every", type=int, default=10)
    r.add_argument("--out", default=None, help="output directory (default: results/proxies/<preset>)")
    r.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    r.add_argument("--no-ckpt", action="store_true", help="write no checkpoint at the end")
    r.add_argument("--resume", default=None, help="a checkpoint step directory, or 'auto' (newest in --out)")
    r.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step and checkpoint, as if interrupted (the schedule still spans --steps)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


# The valid range of every numeric option: (lowest, highest or None, whether the lowest itself
# is allowed). Options left at None take a default later and are not checked here.
_RANGES: dict[str, tuple[float, float | None, bool]] = {
    "layers": (1, None, True),
    "dense_layers": (0, None, True),  # at most the layer count: _check_model_options
    "num_experts": (1, None, True),  # the preset's routing narrows it: _check_model_options
    "vocab_size": (2, None, True),  # a Markov chain needs two tokens to move between
    "steps": (1, None, True),
    "batch": (1, None, True),
    "seq_len": (1, None, True),
    "lr": (0, None, False),  # lr 0 would train nothing
    "min_lr_ratio": (0, 1, True),
    "warmup": (0, None, True),
    "weight_decay": (0, None, True),
    "clip": (0, None, True),
    "aux_loss_coef": (0, None, True),
    "bias_update_rate": (0, None, True),
    "seed": (0, 2**64 - 1, True),  # the unsigned 64-bit seeds of torch's generators
    "ep_size": (1, None, True),
    "branching": (1, None, True),
    "peak_tflops": (0, None, False),
    "log_every": (1, None, True),
    "ckpt_every": (0, None, True),
}


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _range_text(low: float, high: float | None, closed: bool) -> str:
    if high is not None:
        return f"in [{low}, {high}]"
    return f">= {low}" if closed else f"> {low}"


def _in_range(value: float, low: float, high: float | None, closed: bool) -> bool:
    if isinstance(value, float) and not math.isfinite(value):  # argparse's float() takes 'nan' and 'inf'
        return False
    return (value >= low if closed else value > low) and (high is None or value <= high)


def _check_ranges(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name, (low, high, closed) in _RANGES.items():
        value = getattr(a, name)
        if value is not None and not _in_range(value, low, high, closed):
            finite = " and finite" if isinstance(value, float) and high is None else ""
            p.error(f"{_option(name)} must be {_range_text(low, high, closed)}{finite}, got {value}")


def _check_resume(p: argparse.ArgumentParser, resume: str | None) -> None:
    if resume is None or resume == "auto":
        return
    if not os.path.exists(resume):
        p.error(f"--resume {resume!r} does not exist (give a checkpoint step directory, or 'auto')")
    if not os.path.isdir(resume):
        p.error(f"--resume {resume!r} is not a directory (give a step directory such as "
                f"<out>/checkpoints/step_000060, or 'auto')")


def _check_deepep(p: argparse.ArgumentParser) -> None:
    if importlib.util.find_spec("deep_ep") is None:
        # The hint's last sentence names a Python argument (deepep_buffer) that this script has not.
        hint = DEEPEP_INSTALL_HINT.partition(" To compare")[0].replace("backend='deepep'", "--backend deepep", 1)
        p.error(hint)


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    _check_ranges(p, a)
    if a.stop_at is not None and not 1 <= a.stop_at <= a.steps:
        p.error(f"--stop-at must be in [1, --steps={a.steps}], got {a.stop_at}")
    if a.text_file is not None and not os.path.isfile(a.text_file):
        p.error(f"--text-file {a.text_file!r} does not exist (or is not a file)")
    if a.dense_layers is not None and not a.preset.startswith("deepseek_v3"):
        p.error(f"--dense-layers applies to the DeepSeek-V3 presets, not {a.preset!r}")
    _check_resume(p, a.resume)
    if a.backend == "deepep":
        _check_deepep(p)


def _expert_count_rule(moe: MoEConfig) -> tuple[int, int, str]:
    """(multiple, minimum, reason) of the expert counts ``moe``'s routing allows: the experts
    split evenly into ``n_group`` groups, and the ``topk_group`` groups a token keeps hold at
    least ``top_k`` experts."""
    least = smallest_expert_count(moe.top_k, moe.n_group, moe.topk_group)
    if moe.n_group == 1:
        return 1, least, f"each token goes to {moe.top_k} experts"
    reason = f"each token picks {moe.top_k} experts from its best {moe.topk_group} of {moe.n_group} groups"
    return moe.n_group, least, reason


def _check_model_options(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The options whose valid range depends on the preset, checked before get_config, whose
    messages name config fields rather than options."""
    preset = PRESETS[a.preset]
    layers = a.layers if a.layers is not None else preset.n_layers
    if a.dense_layers is not None and a.dense_layers > layers:
        p.error(f"--dense-layers must be in [0, {layers}] (the number of layers), got {a.dense_layers}")
    if a.num_experts is not None:
        step, least, reason = _expert_count_rule(preset.moe)
        if a.num_experts % step or a.num_experts < least:
            rule = (f">= {least}" if step == 1 else
                    f"a multiple of {step} and >= {least} ({least}, {least + step}, ...)")
            p.error(f"--num-experts must be {rule} for {a.preset} ({reason}), got {a.num_experts}")


def _model_config(p, a):
    _check_model_options(p, a)
    overrides = {}
    if a.layers is not None:
        overrides["n_layers"] = a.layers
    if a.dense_layers is not None:
        overrides["n_dense_layers"] = a.dense_layers
    if a.num_experts is not None:
        overrides["moe"] = {"num_experts": a.num_experts}
    if a.text_file is not None:
        tok = ByteTokenizer.vocab_size
        if a.vocab_size is not None and a.vocab_size < tok:
            p.error(f"--vocab-size {a.vocab_size} is smaller than the byte tokenizer's vocabulary ({tok})")
        overrides["vocab_size"] = a.vocab_size or tok
    elif a.vocab_size is not None:
        overrides["vocab_size"] = a.vocab_size
    try:
        return get_config(a.preset, **overrides)
    except ValueError as e:
        p.error(str(e))


def _describe(config, a, par, device, dtype) -> list[str]:
    moe = config.moe
    dense = getattr(config, "n_dense_layers", 0)
    return [
        f"proxy {config.name}: {config.n_layers} layers ({dense} dense + {config.n_layers - dense} MoE), "
        f"hidden {config.hidden_size}, vocab {config.vocab_size}; MoE {moe.num_experts} experts "
        f"(I {moe.moe_intermediate_size}, top-{moe.top_k}, {moe.router}, {moe.num_shared_experts} shared); "
        f"backend {a.backend}",
        f"world {par.world} = EP {par.ep} x DP {par.dp}; batch {a.batch} x seq {a.seq_len} per rank = "
        f"{a.batch * a.seq_len * par.world} tokens/step; {str(dtype).replace('torch.', '')} params on {device.type}"
        + (" (fp32 master weights)" if dtype != torch.float32 else ""),
    ]


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _load_balance(moes, par) -> tuple[float, float] | None:
    """(mean over MoE layers, worst layer) of max/mean tokens per expert, over all ranks' tokens."""
    if not moes:
        return None
    counts = torch.stack([m.tokens_per_expert for m in moes]).to(torch.int64)
    if par.world > 1:
        dist.all_reduce(counts)
    counts = counts.double()
    ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
    return float(ratio.mean()), float(ratio.max())


def _resolve_resume(resume: str | None, out: Path) -> tuple[str | None, str | None]:
    """(the step directory to resume from or None, a note to print when 'auto' found none).

    With several ranks, rank 0 looks and every rank takes its answer: ranks that resumed from
    different steps would pair their collectives wrongly and wait forever.
    """
    if resume != "auto":
        return resume, None
    found = [latest_checkpoint(out)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return None, f"--resume auto: no complete checkpoint in {out}; starting at step 0"
    return str(found[0]), None


def _checkpoint_meta(p: argparse.ArgumentParser, resume: str, rank: int) -> dict:
    try:
        return read_meta(resume, rank)
    except ValueError as e:  # no file for this rank, not safetensors, or not written by this script
        p.error(f"--resume: {e}")


def _check_checkpoint_layout(p: argparse.ArgumentParser, resume: str, meta: dict, *, world: int, ep: int,
                             config) -> None:
    """Refuse a checkpoint of another world, EP size or model: its shards would not fit."""
    # Through JSON, as the checkpoint stored it (tuples become lists).
    want = {"world": world, "ep": ep, "config": json.loads(json.dumps(dataclasses.asdict(config)))}
    for key, value in want.items():
        stored = meta.get(key)
        if stored == value:
            continue
        if isinstance(stored, dict) and isinstance(value, dict):
            fields = sorted(set(stored) | set(value))
            diff = "; ".join(f"{f}: {stored.get(f)!r} in the checkpoint, {value.get(f)!r} in this run"
                             for f in fields if stored.get(f) != value.get(f))
            p.error(f"--resume: checkpoint {resume!r} was written with another model config ({diff}); "
                    f"run with its options, or give another --out")
        p.error(f"--resume: checkpoint {resume!r} was written with {key}={stored!r}, this run has {key}={value!r}")


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    a = parser.parse_args(argv)
    _check_args(parser, a)
    if a.lr is None:
        a.lr = 1e-2 if a.preset.endswith("_tiny") else 2.2e-4
    if a.aux_loss_coef is None:
        a.aux_loss_coef = 1e-3 if a.preset.startswith("qwen3") else 0.0
    config = _model_config(parser, a)
    try:
        check_ep_size(a.ep_size, a.ep_size, config.moe.num_experts)  # experts first: no world needed
    except ValueError as e:
        parser.error(str(e))

    use_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA device is available")
    if a.backend == "deepep" and not use_cuda:
        parser.error("--backend deepep runs DeepEP's CUDA kernels: it needs a GPU")
    if a.backend == "kosmos" and not use_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        parser.error("--backend kosmos on the CPU runs under Triton's interpreter: set TRITON_INTERPRET=1 "
                     "in the environment before starting (and keep the model tiny: it is slow)")
    if use_cuda:  # the device first, so that NCCL binds each rank to its own GPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    rank, world = init_distributed(device.type)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(a.dtype, torch.bfloat16 if use_cuda else torch.float32)
    try:
        par = build_parallel(a.ep_size, config.moe.num_experts)
    except ValueError as e:
        parser.error(str(e))
    peak = a.peak_tflops if a.peak_tflops is not None else (DEFAULT_GPU_PEAK_TFLOPS if use_cuda else None)
    out = Path(a.out or f"results/proxies/{a.preset}")
    lead = rank == 0

    if a.text_file is not None:
        try:
            source = TextFileTokens(a.text_file, a.seq_len, seed=a.seed)
        except ValueError as e:
            parser.error(str(e))
    else:
        source = SyntheticTokens(config.vocab_size, a.seq_len, seed=a.seed, branching=a.branching)
    # Before building the model, so that a bad checkpoint costs no time.
    resume, fresh_note = _resolve_resume(a.resume, out)
    if resume is not None:
        meta = _checkpoint_meta(parser, resume, rank)
        _check_checkpoint_layout(parser, resume, meta, world=world, ep=par.ep, config=config)
    tokens_per_rank = a.batch * a.seq_len
    runtime = MoERuntime(
        backend=a.backend, group=par.ep_group,
        max_tokens_per_rank=tokens_per_rank,  # the bound fused backends size their buffers from
        compute_aux_loss=a.aux_loss_coef > 0,
    )
    # Before building the model: a run whose state cannot fit would otherwise fail at its first
    # optimizer step, after the build and the first step's compile.
    need = step_memory(build_skeleton(config, runtime, dtype=dtype), multi_tensor=use_cuda)  # build_adamw's default
    free = torch.cuda.mem_get_info(device)[0] if use_cuda else None
    if free is not None and (why := shortfall(need, free, str(device))):
        parser.error(why)
    # The weights draw from their own seeded generators (init_weights); the global generators
    # are seeded too, and saved in checkpoints, for anything stochastic a user adds.
    torch.manual_seed(a.seed)
    model = build_model(config, runtime, device=device, dtype=dtype, seed=a.seed)
    moes = model.moe_layers()
    biased = [m for m in moes if m.gate.e_score_correction_bias is not None]
    masters = MasterWeights(model)
    optimizer = build_adamw(masters, a.lr, a.weight_decay)
    loader = Loader(source, a.batch, rank=rank, world_size=world, device=device)
    fpt = flops_per_token(model, a.seq_len)
    n_total, n_active = total_params(model), active_params(model)

    start, history, prior_wall = 0, [], 0.0
    if resume is not None:
        meta = load_checkpoint(resume, rank=rank, model=model, masters=masters, optimizer=optimizer)
        start, history, prior_wall = meta["step"], meta["history"], meta.get("wall_s", 0.0)
        loader.load_state_dict(meta["data"])
    stop = a.stop_at or a.steps

    progress = Progress(a.steps, initial=start, enabled=lead and not a.no_progress, desc=config.name)
    say = progress.write if lead else (lambda line: None)
    for line in _describe(config, a, par, device, dtype):
        say(line)
    say(f"params: {_fmt_count(n_total)} total, {_fmt_count(n_active)} active per token (no embedding); "
        f"model FLOPs {_fmt_count(fpt)}/token = 6 x active + causal attention")
    say(f"memory: the training state needs at least {need.describe()} per rank at the optimizer step"
        + (f"; {size(free)} were free on {device} before the build" if free is not None else ""))
    say(f"data: {source.describe()}")
    say(f"MFU: per device against a peak of {peak:g} TFLOP/s"
        + (" (bf16 dense H100/H200; --peak-tflops to change)" if a.peak_tflops is None else " (--peak-tflops)")
        if peak else "MFU: not reported on the CPU (pass --peak-tflops to set a peak)")
    if fresh_note:
        say(fresh_note)
    if resume is not None:
        say(f"resumed from {resume} at step {start} (data position {loader.position})")

    def checkpoint(step: int, wall: float) -> None:
        meta = {"step": step, "world": world, "ep": par.ep, "preset": a.preset,
                "config": dataclasses.asdict(config), "data": loader.state_dict(), "history": history,
                "wall_s": wall}
        path = save_checkpoint(step_dir(out, step), rank=rank, world=world, model=model, masters=masters,
                               optimizer=optimizer, meta=meta)
        say(f"checkpoint: {path.parent}")

    t_run = time.perf_counter()
    window = {"steps": 0, "time": 0.0}
    if use_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step = start
    for step in range(start + 1, stop + 1):
        t0 = time.perf_counter()
        lr = lr_at(step, lr=a.lr, warmup=a.warmup, total=a.steps, schedule=a.schedule, min_lr_ratio=a.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = loader.next()
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        aux = model.aux_loss() if a.aux_loss_coef > 0 else None
        objective = loss + a.aux_loss_coef * aux if aux is not None else loss
        objective.backward()
        del logits, objective

        named_grads = masters.grads_to_master()
        reduce_gradients(named_grads, par)
        grad_norm = clip_grad_norm(named_grads, a.clip, par)
        optimizer.step()
        masters.copy_to_model()
        masters.zero_grad()
        for layer in biased:  # aux-loss-free balancing, from the load of all ranks
            layer.update_router_bias(rate=a.bias_update_rate, group=par.dp_group)

        scalars = torch.stack([loss.detach().float(), (aux if aux is not None else loss.new_zeros(())).detach().float()])
        if world > 1:
            dist.all_reduce(scalars)
            scalars /= world
        loss_value, aux_value = scalars.tolist()  # a host sync: the step is done
        dt = time.perf_counter() - t0
        window["steps"] += 1
        window["time"] += dt
        record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm, "step_time_s": dt}
        if aux is not None:
            record["aux_loss"] = aux_value
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"loss is {loss_value} at step {step}")

        if step % a.log_every == 0 or step == stop or step == start + 1:  # the first step too: where the loss starts
            per_step = window["time"] / window["steps"]
            tok_s = tokens_per_rank * world / per_step
            mfu = fpt * tokens_per_rank / per_step / (peak * 1e12) if peak else None
            balance = _load_balance(moes, par)
            record.update(tokens_per_s=tok_s, mfu=mfu)
            parts = [f"step {step:>{len(str(a.steps))}}/{a.steps}", f"loss {loss_value:.4f}", f"lr {lr:.2e}",
                     f"gnorm {grad_norm:.3f}", f"{per_step * 1e3:.1f} ms/step", f"{_fmt_count(tok_s)} tok/s",
                     f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU n/a"]
            if balance is not None:
                record.update(load_max_over_mean=balance[0], load_max_over_mean_worst=balance[1])
                parts.append(f"load max/mean {balance[0]:.2f} (worst layer {balance[1]:.2f})")
            if use_cuda:
                mem = torch.cuda.max_memory_allocated(device)
                record["max_memory_bytes"] = mem
                parts.append(f"mem {mem / 2**30:.1f} GiB")
            say(" | ".join(parts))
            window = {"steps": 0, "time": 0.0}
            for layer in moes:
                if layer.backend == "kosmos":
                    layer.fused().raise_if_failed(block=False)
        history.append(record)
        progress.update(1, postfix=f"loss {loss_value:.4f}")
        if a.ckpt_every and step % a.ckpt_every == 0 and step != stop:
            checkpoint(step, prior_wall + time.perf_counter() - t_run)
    progress.close()
    for layer in moes:
        if layer.backend == "kosmos":
            layer.fused().raise_if_failed()

    wall = prior_wall + time.perf_counter() - t_run
    if not a.no_ckpt and step > start:
        checkpoint(step, wall)
    result = {
        "preset": a.preset, "args": vars(a), "config": dataclasses.asdict(config),
        "world": world, "ep": par.ep, "dp": par.dp, "device": str(device), "dtype": str(dtype),
        "params_total": n_total, "params_active": n_active, "flops_per_token": fpt,
        "flops_counting": "6 * active params (non-embedding; top_k of the routed experts) + causal attention",
        "peak_tflops": peak, "data": source.describe(), "steps_done": step, "wall_s": wall,
        "final_loss": history[-1]["loss"] if history else None, "history": history,
    }
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        (out / "log.json").write_text(json.dumps(result, indent=1))
        if history:
            renderer = plot_loss(str(out / "loss.png"), [r["step"] for r in history],
                                 [r["loss"] for r in history], title=f"{config.name} ({a.backend})")
            say(f"wrote {out / 'log.json'} and {out / 'loss.png'} ({renderer} renderer)")
    return result


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0)
