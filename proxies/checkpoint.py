"""Checkpoints in safetensors: one file per rank, the whole training state of that rank.

``{out}/checkpoints/step_000120/rank00000.safetensors`` holds, for its rank:

* ``model/<name>``: the model's state dict (parameters in the compute dtype, the routers'
  correction biases; an EP rank's own experts only);
* ``master/<name>``: the fp32 master weights, when they are copies (a bf16 model);
* ``optim/<name>/{step,exp_avg,exp_avg_sq}``: AdamW's state of each master;
* ``rng/cpu`` and ``rng/cuda``: the generator states;
* metadata ``kosmos_proxy``: JSON of the step, the data position, the loss history so far,
  the world and EP sizes and the model config, which a resume checks.

``meta.json`` beside the rank files is written last, by rank 0 after every rank has written:
a step directory without it is incomplete and ``latest_checkpoint`` skips it. A save returns
on no rank before ``meta.json`` is written, so a rank that goes on to look for the latest
checkpoint (a resume right after a save) finds the one just saved.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .optim import MasterWeights

_META_KEY = "kosmos_proxy"


def step_dir(out: str | Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step_{step:06d}"


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank:05d}.safetensors"


def save_checkpoint(directory: str | Path, *, rank: int, world: int, model, masters: MasterWeights,
                    optimizer: torch.optim.Optimizer, meta: dict) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        tensors[f"model/{name}"] = value.detach().cpu().contiguous()
    for name, master, param in zip(masters.names, masters.masters, masters.params):
        if master is not param:
            tensors[f"master/{name}"] = master.detach().cpu().contiguous()
        for key, value in optimizer.state.get(master, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{name}/{key}"] = value.detach().cpu().contiguous()
    tensors["rng/cpu"] = torch.get_rng_state()
    device = masters.params[0].device
    if device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(device)
    # Distinct storages for safetensors (a CPU state dict may alias parameters; that is fine,
    # but two entries must not alias each other).
    tensors = {k: v.clone() for k, v in tensors.items()}
    path = _rank_file(directory, rank)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps(meta)})
    os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        summary = {k: meta[k] for k in ("step", "world", "ep", "preset") if k in meta}
        (directory / "meta.json").write_text(json.dumps(summary, indent=1))
    if dist.is_initialized():
        # Without it, rank 1 could return and look for the latest checkpoint before rank 0 had
        # written meta.json: a resume right after a save then started rank 1 at step 0 and
        # rank 0 at the saved step, and their collectives paired up wrongly until one waited
        # forever (a hang seen in tests/test_proxies.py on a busy 2-core machine).
        dist.barrier()
    return path


def latest_checkpoint(out: str | Path) -> Path | None:
    root = Path(out) / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if (p / "meta.json").is_file()) if root.is_dir() else []
    return done[-1] if done else None


def read_meta(directory: str | Path, rank: int) -> dict:
    path = _rank_file(Path(directory), rank)
    if not path.is_file():
        raise ValueError(f"no checkpoint for rank {rank} in {str(directory)!r} (expected {path.name})")
    # ValueErrors throughout, so that the training script can report a bad --resume as such.
    try:
        with safe_open(str(path), "pt") as fh:
            metadata = fh.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f"{str(path)!r} is not a readable safetensors file: {e}") from e
    if _META_KEY not in metadata:
        raise ValueError(f"{str(path)!r} is not a proxy checkpoint (no {_META_KEY!r} metadata)")
    return json.loads(metadata[_META_KEY])


@torch.no_grad()
def load_checkpoint(directory: str | Path, *, rank: int, model, masters: MasterWeights,
                    optimizer: torch.optim.Optimizer) -> dict:
    """Restore this rank's state in place; return the checkpoint's metadata."""
    path = _rank_file(Path(directory), rank)
    meta = read_meta(directory, rank)
    device = masters.params[0].device
    tensors = {}
    with safe_open(str(path), "pt") as fh:
        for key in fh.keys():
            tensors[key] = fh.get_tensor(key)
    state = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    model.load_state_dict(state, strict=True)
    for name, master, param in zip(masters.names, masters.masters, masters.params):
        if master is not param:
            master.copy_(tensors[f"master/{name}"])
        prefix = f"optim/{name}/"
        entry = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if entry:
            # AdamW keeps 'step' on the CPU (not capturable, not fused); the moments beside the weight.
            optimizer.state[master] = {k: (v if k == "step" else v.to(device)) for k, v in entry.items()}
    torch.set_rng_state(tensors["rng/cpu"])
    if "rng/cuda" in tensors and device.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng/cuda"], device)
    return meta
