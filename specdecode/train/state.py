"""A training run's state for `--resume` (heads and drafts alike): beside the model's own files,
in a folder of its own (engines that load a head, vLLM, SGLang and this one, read every
*.safetensors file at its top level). It holds the fp32 master weights (the model's own file is
bf16), the optimizer's moments and steps, the data order still to come and the generators, and
a JSON header: the step and time reached, the run's settings. Safetensors and JSON, no pickle.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from specdecode.errors import DataError

STATE_FILE = "resume/trainer_state.safetensors"


def train_digest(examples) -> str:
    """The training conversations in their order: a saved data order indexes them, so a resume
    needs the very same list."""
    ids = "\n".join(e.conversation_id for e in examples)
    return hashlib.sha256(ids.encode()).hexdigest()


def write_state(out_dir: Path, params, opt, tensors: dict, state: dict) -> None:
    """`params`' weights and `opt`'s state, `tensors` (data order, generators) and the header
    `state` (with the optimizer's param groups and the weights' shapes added)."""
    from specdecode.models.loader import write_safetensors

    opt_state = opt.state_dict()
    out = {
        f"optimizer.{i}.{k}": v.detach().contiguous()
        for i, st in opt_state["state"].items()
        for k, v in st.items()
        if torch.is_tensor(v)
    }
    out.update({f"weights.{i}": p.detach().contiguous() for i, p in enumerate(params)})
    out.update(tensors)
    header = {**state, "param_groups": opt_state["param_groups"],
              "param_shapes": [list(p.shape) for p in params]}  # fmt: skip
    (out_dir / STATE_FILE).parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(out, out_dir / STATE_FILE, {"state": json.dumps(header)})


def read_state(out_dir: Path, tensors: bool = True) -> tuple[dict, dict]:
    """(the header, the tensors: none unless asked) of the state saved in `out_dir`; a clear
    error for a missing, truncated or foreign file."""
    from safetensors import safe_open

    path = out_dir / STATE_FILE
    try:
        with safe_open(str(path), "pt") as f:
            state = json.loads(f.metadata()["state"])
            got = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}  # noqa: SIM118
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise DataError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    return state, got


def restore(params, opt, tensors: dict, state: dict) -> None:
    """Put the saved weights and optimizer state back (the step counts stay on the CPU, as the
    optimizer keeps them; `load_state_dict` places the moments beside their weights)."""
    if state["param_shapes"] != [list(p.shape) for p in params]:
        raise DataError("the saved state is of a model of another shape")
    per_param: dict[int, dict] = {}
    for key, v in tensors.items():
        if key.startswith("optimizer."):
            _, i, name = key.split(".", 2)
            per_param.setdefault(int(i), {})[name] = v
    opt.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(tensors[f"weights.{i}"])


def resume_settings(out_dir: Path, kind: str, config_class, older: str, **overrides):
    """The settings (a `config_class`) of the `kind` run saved in `out_dir`, to continue it with
    `resume`; `overrides` that are not None replace them (the steps, the time budget, the
    checkpoint interval). `older`: what to do with a folder that has no state."""
    path = out_dir / STATE_FILE
    if not out_dir.is_dir():
        raise DataError(f"nothing to resume: {out_dir} does not exist (a new run drops --resume)")
    if not path.is_file():
        raise DataError(f"{out_dir} holds no run to resume ({STATE_FILE} is missing: {older})")
    state, _ = read_state(out_dir, tensors=False)
    if state.get("kind") != kind:
        raise DataError(f"{out_dir} holds a {state.get('kind')} run, not {kind}")
    fields = set(config_class.__dataclass_fields__)
    cfg = {k: v for k, v in state["config"].items() if k in fields}
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    cfg.update(resume=True, init=str(out_dir))
    return config_class(**cfg)
