"""Tuning profiles: what `localllm tune` chose and measured for one (GPU, model, budget), kept as
MODEL/profiles/<gpu>__<budget>pct.json (e.g. nvidia-h100-80gb-hbm3__5pct.json), and how the runtime picks one.

Selection (select): among the folder's profiles made on this GPU (same name and SM count) for this model
(manifest model_id), the one with the largest budget <= the budget asked for (default 5%); when every such profile
has a larger budget, the smallest of them. The others follow in the same order (Selection.candidates): where a
profile does not fit the model after all (a k_chunk past its calibration, a block it does not have: a hand edit),
the runtime says so and takes the next. Profiles of other GPUs or models are never used: the runtime warns in
one line and runs with the default k_chunk. An unreadable profile is skipped with a one-line warning naming it.

Writing (write): atomic (temp file + rename). A profile of the same (GPU, model, budget) is replaced, since
re-tuning is done on purpose, and the caller says so; any other file at that name (unreadable, or another GPU or
model whose name maps to the same file name) is left alone unless force=True.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from localllm import atomic
from localllm.errors import LocalLLMError, is_real, is_whole
from localllm.model import KINDS

FORMAT = 2  # 2: layers.<kind>.blocks, the blocks compensated where not all are (format 1 profiles still read)
READS = (1, 2)
DEFAULT_BUDGET = 0.05  # the slowdown budget the runtime looks for when none is given
DIR = "profiles"


class ProfileError(LocalLLMError):
    """A profile file that cannot be used as one (unreadable, malformed, another format); `why` is the reason alone
    and `readable` whether the file read as JSON at all (listing shows both)."""

    def __init__(self, path: Path, why: str, readable: bool):
        what = f"is not usable ({why})" if readable else why
        super().__init__(f"tuning profile {path} {what}; delete it or re-run `localllm tune`")
        self.why, self.readable = why, readable


def parse_budgets(text: str, example: str = "e.g. 5 or 2.5,5,10,20") -> list[float]:
    """"2.5,5,10,20", "5%" or "5" -> fractions [0.025, ...]: numbers are percent of the decode step."""
    out = []
    for part in str(text).split(","):
        p = part.strip().removesuffix("%").strip()
        if not p:
            continue
        try:
            v = float(p)
        except ValueError:
            v = math.nan
        if not 0 < v <= 100 or round(v / 100, 6) == 0:  # (a budget that rounds to 0 would be a 0 profile)
            raise LocalLLMError(f"a budget is a percentage of the decode time from 0.0001 to 100, {example}; got "
                                f"{part.strip()!r}")
        out.append(round(v / 100, 6))
    if not out:
        raise LocalLLMError(f"no budget given in {text!r}; give one, {example}")
    return sorted(set(out))


def parse_budget(text: str) -> float:
    """One budget, as parse_budgets reads it: "5", "5%" or "2.5" -> a fraction."""
    budgets = parse_budgets(text, "e.g. 5 or 2.5")
    if len(budgets) != 1:
        raise LocalLLMError(f"give one budget here, e.g. 5 or 5%, not {text!r}")
    return budgets[0]


def percent(budget: float) -> str:
    """0.025 -> "2.5", 0.05 -> "5"."""
    return f"{round(budget * 100, 4):g}"


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def file_name(gpu_name: str, budget: float) -> str:
    return f"{gpu_slug(gpu_name)}__{percent(budget)}pct.json"


def path_for(model_dir: str | Path, gpu_name: str, budget: float) -> Path:
    return Path(model_dir) / DIR / file_name(gpu_name, budget)


def gpu_identity(device=None) -> dict:
    """What a profile records of the GPU it was made on (and the runtime matches: name and SM count)."""
    import torch
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    p = torch.cuda.get_device_properties(dev)
    ident = {"name": p.name, "compute_capability": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
             "shared_memory_per_block": p.shared_memory_per_block_optin, "memory_bytes": p.total_memory,
             "torch": torch.__version__, "torch_cuda": torch.version.cuda, "driver": None, "cuda_runtime": None}
    try:
        import cupy
        v = cupy.cuda.runtime.driverGetVersion()
        ident["driver"] = f"CUDA {v // 1000}.{v % 1000 // 10}"
        v = cupy.cuda.runtime.runtimeGetVersion()
        ident["cuda_runtime"] = f"{v // 1000}.{v % 1000 // 10}"
    except Exception:  # noqa: BLE001 - versions are information, not a requirement
        pass
    return ident


def _is_int(v, lo: int) -> bool:
    return is_whole(v) and v >= lo


def _is_num(v) -> bool:
    return is_real(v) and math.isfinite(v)


def problems(d) -> str | None:
    """What makes `d` not a usable profile, or None."""
    if not isinstance(d, dict):
        return "not a JSON object"
    if d.get("format") not in READS:
        return f"format {d.get('format')!r}, this localllm reads formats {', '.join(map(str, READS))}"
    gpu = d.get("gpu")
    if not isinstance(gpu, dict) or not isinstance(gpu.get("name"), str) or not _is_int(gpu.get("sm_count"), 1):
        return "no gpu name and sm_count"
    if not isinstance(d.get("model_id"), str):
        return "no model_id"
    if not _is_num(d.get("budget")) or not 1e-6 <= d["budget"] <= 1:  # (as load() takes budgets: 5% is 0.05)
        return "no budget between 0.0001% and 100%, as a fraction"
    layers = d.get("layers")
    if not isinstance(layers, dict) or set(layers) != set(KINDS):
        return f"layers must give {', '.join(KINDS)}"
    for kind, v in layers.items():
        if not isinstance(v, dict) or not _is_int(v.get("k_chunk"), 0) or not _is_int(v.get("n_tb"), 1):
            return f"layers.{kind} needs an integer k_chunk >= 0 and n_tb >= 1"
        b = v.get("blocks")
        if b is not None and (not isinstance(b, list) or not all(_is_int(i, 0) for i in b) or len(set(b)) < len(b)):
            return f"layers.{kind}.blocks must be a list of distinct block indices"
    if d.get("slowdown") is not None and not _is_num(d["slowdown"]):
        return "slowdown is not a number"
    return None


def read(path: str | Path) -> dict:
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(path, f"cannot be read ({e})", False) from None
    except json.JSONDecodeError as e:
        raise ProfileError(path, f"is not valid JSON ({e.msg}, line {e.lineno})", False) from None
    except (ValueError, RecursionError) as e:  # a number past Python's limits, nesting past its stack
        raise ProfileError(path, f"is not a profile ({type(e).__name__})", False) from None
    why = problems(d)
    if why:
        raise ProfileError(path, why, True)
    return d


def _target(gpu_name: str, sm_count: int, model_id: str, budget: float) -> tuple:
    return gpu_name, sm_count, model_id, percent(budget)


def target_of(d: dict) -> tuple:
    """(GPU name, SM count, model_id, budget): what a profile was made for."""
    return _target(d["gpu"]["name"], d["gpu"]["sm_count"], d["model_id"], d["budget"])


def check_free(model_dir: str | Path, gpu_name: str, sm_count: int, model_id: str, budget: float,
               force: bool = False) -> tuple[Path, dict | None]:
    """(path, the profile there to be replaced or None) for this target's profile; raises when the file at that
    path is something else (unreadable, or another GPU or model with the same file name) and not force."""
    path = path_for(model_dir, gpu_name, budget)
    atomic.check_writable(path, f"make {Path(model_dir)} writable (or move the file that stands where its "
                                "profiles folder goes)")  # one line, before the timing
    if not path.exists():
        return path, None
    try:
        old = read(path)
    except ProfileError as e:
        if force:
            return path, None
        raise LocalLLMError(f"{e.args[0].split(';')[0]}; it was left as it is: move it away or run `localllm tune` "
                            "with --force to replace it") from None
    if target_of(old) != _target(gpu_name, sm_count, model_id, budget) and not force:
        raise LocalLLMError(f"{path} holds the profile of {old['gpu']['name']} ({old['gpu'].get('sm_count')} SMs) / "
                            f"model {old['model_id']}, not {gpu_name} ({sm_count} SMs) / model {model_id}; it was "
                            "left as it is: move it away or run `localllm tune` with --force to replace it")
    return path, old


def write(model_dir: str | Path, profile: dict, force: bool = False) -> tuple[Path, dict | None]:
    """Write atomically; returns (path, the profile it replaced or None). See the module doc for what is replaced."""
    why = problems(profile)
    if why:
        raise ValueError(f"not a profile: {why}")
    path, old = check_free(model_dir, *target_of(profile)[:3], profile["budget"], force=force)
    atomic.write_text(path, json.dumps(profile, indent=2) + "\n")
    return path, old


def source_of(profile: dict) -> str:
    """One line for LocalModel.qdec_source."""
    where = f"tuned on {profile['gpu']['name']} for a {percent(profile['budget'])}% budget"
    if not any(v["k_chunk"] for v in profile["layers"].values()):
        return f"{where}: no compensation fits it"
    s = profile.get("slowdown")
    some = "".join(f", {k} in {len(v['blocks'])} block{'s' * (len(v['blocks']) != 1)}"
                   for k, v in profile["layers"].items() if "blocks" in v)
    return f"{where} (measured {100 * s:+.1f}%{some})" if s is not None else f"{where} (slowdown not measured{some})"


@dataclass
class Selection:
    profile: dict | None = None
    path: Path | None = None
    warnings: list[str] = field(default_factory=list)
    candidates: list[tuple[Path, dict]] = field(default_factory=list)  # in order of preference: path, profile first
    misfits: list[Path] = field(default_factory=list)  # candidates the runtime found not to fit the model


def misfit(d: dict, kmax: int, blocks: int) -> str | None:
    """Why a (readable) profile cannot run on a model whose calibration covers k_chunk <= kmax and that has `blocks`
    decoder blocks, or None. (The runtime's own check, when it applies one, also knows the GPU.)"""
    for kind, v in d["layers"].items():
        if v["k_chunk"] > kmax:
            return f"{kind} k_chunk {v['k_chunk']}, past the {kmax} its calibration covers"
        if any(i >= blocks for i in v.get("blocks") or ()):
            return f"{kind} blocks past this model's {blocks}"
    return None


def listing(model_dir: str | Path, model_id: str | None, kmax: int, blocks: int) -> dict[str, str]:
    """Each profile file of the model folder -> what it is (the GPU and budget it was tuned for) where it is a
    profile this model can run, else why it is not one."""
    folder = Path(model_dir) / DIR
    out = {}
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            d = read(p)
        except ProfileError as e:
            what = f"not usable: {e.why}" if e.readable else f"unreadable: {e.why.removeprefix('is ')}"
            out[p.name] = f"{what}; delete it or re-run `localllm tune`"
            continue
        why = f"made for another model ({d['model_id']})" if d["model_id"] != model_id else misfit(d, kmax, blocks)
        out[p.name] = f"not usable: {why}" if why else \
            f"{d['gpu']['name']} ({d['gpu']['sm_count']} SMs), {percent(d['budget'])}% budget"
    return out


def select(model_dir: str | Path, gpu_name: str, sm_count: int, model_id: str | None,
           budget: float = DEFAULT_BUDGET) -> Selection:
    """The profile the runtime uses for this GPU, model and budget (rules: module doc), with the warnings to show."""
    sel = Selection()
    folder = Path(model_dir) / DIR
    mine, others = [], []
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            d = read(p)
        except ProfileError as e:
            sel.warnings.append(f"ignoring {e.args[0]}")
            continue
        if d["gpu"]["name"] != gpu_name or d["gpu"]["sm_count"] != sm_count:
            others.append(f"{p.name} was made on {d['gpu']['name']} ({d['gpu']['sm_count']} SMs)")
        elif d["model_id"] != model_id:
            others.append(f"{p.name} was made for model {d['model_id']}, this one is {model_id}")
        else:
            mine.append((d["budget"], p, d))
    if mine:
        within = sorted((m for m in mine if m[0] <= budget + 1e-9), key=lambda m: -m[0])  # the largest first
        sel.candidates = [(p, d) for _, p, d in within + sorted((m for m in mine if m[0] > budget + 1e-9),
                                                                 key=lambda m: m[0])]
        sel.path, sel.profile = sel.candidates[0]
    elif others:
        more = f" and {len(others) - 2} more" if len(others) > 2 else ""
        sel.warnings.append(f"no tuning profile in {folder} fits this GPU ({gpu_name}, {sm_count} SMs) and model: "
                            f"{'; '.join(others[:2])}{more}; QDEC runs with the default setting: run `localllm tune "
                            f"{Path(model_dir)}` on this GPU")
    return sel
