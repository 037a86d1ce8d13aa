"""The typed, frozen config tree (docs/training.md, ``eslm train --help`` for every key): defaults in code, YAML
deltas, then dotted overrides; validated whole before anything runs. ``method`` is assembled from the registry;
nothing below this module imports it: the registry's builders receive plain values (``method_context``)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from eslm import metrics as M
from eslm.data.mixture import PRESETS as MIXTURES
from eslm.data.tokenizers import TOKENIZER_NAMES, tokenizer_class
from eslm.errors import ConfigError
from eslm.files import name_problem, read_yaml
from eslm.flops import COUNT_PER, COUNTER_KEYS, FlopsModel
from eslm.methods import METHODS, BuildContext, SharedMethodSettings
from eslm.model.gpt import PRESETS, ModelConfig, pad_vocab, preset
from eslm.ops.head_backend import BACKENDS, IMPL_CHOICES, HeadOptions, option_problems
from eslm.ops.head_route import ROUTE_CHOICES
from eslm.selection.risk import check_alpha
from eslm.selection.scores import STANDARDIZE_MODES
from eslm.selection.selectors import SCOPES
from eslm.settings import Section, key_of
from eslm.settings import setting as _f


@dataclass(frozen=True)
class RunConfig:
    name: str = _f("", "run name; the run directory is <out_dir>/<name> (default: method-preset-seed)")
    out_dir: str = _f("runs", "parent directory of run directories")
    seed: int = _f(1337, "base random seed (each rank adds its rank)")
    resume: bool = _f(False, "continue from the run directory's latest checkpoint")
    resume_from: int = _f(0, "with resume: the step of a kept checkpoint to continue from instead of the latest (e.g. before a divergence); later checkpoints are moved to checkpoints/superseded/")
    allow_change: str = _f("", "with resume: comma-separated keys that may differ from the run's config (e.g. train.lr after a divergence); applied from the resume step, recorded in resumes.jsonl")
    allow_version_change: bool = _f(False, "with resume: continue a run whose last segment ran another eslm version or commit (refused by default; recorded in resumes.jsonl)")


@dataclass(frozen=True)
class ModelSection:
    preset: str = _f("small", " | ".join(PRESETS))
    vocab_size: int = _f(0, "0 = the tokenizer's vocabulary padded up to a multiple of 64 (GPT-2: 50304)")
    block_size: int = _f(0, "context length; 0 = the preset's")
    dropout: float = _f(0.0, "dropout (the paper: 0)")
    init_from: str = _f("", "optional: a checkpoint, run directory or local HF GPT-2 dir to start from")


@dataclass(frozen=True)
class DataSection:
    source: str = _f("stdlib", "built-in corpus prepared on first use (stdlib); ignored when dir is set")
    dir: str = _f("", "a prepared data directory (eslm prepare SOURCE --out DIR)")
    tokenizer: str = _f("gpt2", "gpt2 (exact GPT-2 BPE, offline) | byte")
    weights: str = _f("natural", f"domain mixture: {' | '.join(MIXTURES)} | domain=w,domain=w,...")
    seq_len: int = _f(128, "tokens per training sequence (the paper: 1024); when not set, at most the model's "
                           "context (model.preset=tiny: 64)")


@dataclass(frozen=True)
class TrainSection:
    micro_batch_size_seqs: int = _f(8, "sequences per rank per micro-step (the paper: 12 for 124M/350M, 8 for 774M)")
    grad_accum_steps: int = _f(1, "micro-steps per optimizer step (the paper: 40)")
    max_steps: int = _f(240, "optimizer steps to run (default sized for about 4 minutes on 2 CPU cores)")
    max_flops: float = _f(0.0, "stop once the flops.budget_counter counter reaches this (0 = no FLOPs budget)")
    lr: float = _f(2e-3, "max learning rate (default sized for the small CPU run; the paper: 6e-4, configs/paper/base.yaml)")
    min_lr: float = _f(2e-4, "learning rate at the end of the cosine decay (the paper: 6e-5)")
    warmup_steps: int = _f(30, "linear warmup steps (default sized for the 240-step CPU run; the paper: 2000)")
    lr_decay_steps: int = _f(0, "cosine decay length in steps; 0 = max_steps (the paper: 200k SlimPajama, 600k OWT)")
    lr_schedule: str = _f("budget", "budget: under a FLOPs budget (train.max_flops > 0) warmup_steps and the decay length are stretched by (a dense step's FLOPs / this method's planned step FLOPs, Ada at its starting alpha), so each run's schedule ends at its own step count where a dense run's ends | steps: as given for every method (the paper's schedule)")
    weight_decay: float = _f(0.1, "AdamW weight decay on tensors with 2+ dimensions only")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "gradient clipping max norm (0 = off)")
    device: str = _f("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = _f("auto", "auto (bf16 autocast on CUDA, fp32 on CPU) | fp32 | bf16")
    compile: bool = _f(False, "torch.compile each transformer block (one graph all blocks share; the step scope's and evaluation's forwards run compiled too)")
    loss_impl: str = _f("auto", "the LM-head backend (eslm.ops.head_backend): auto (the device's default: fused on CPU; triton on CUDA where the gpu extra is installed, else fused) | " + " | ".join(f"{s.name} ({s.summary}{'; the ' + s.extra + ' extra' if s.extra else ''})" for s in BACKENDS))
    loss_chunk_size: int = _f(1024, "tokens per chunk in the fused loss")
    loss_cache_probs: bool = _f(True, "fused loss with selection scores: allow keeping the scoring pass's softmax (one tokens x vocab fp32 buffer per micro-batch) so the gradients need no second logits matmul; false: no such buffer, recompute instead")
    loss_route: str = _f("auto", "fused loss route (docs/fused_loss.md): auto (by a fixed rule: kept_cached with scores, kept_recompute without, the one pass for CLM) | kept_cached | all_rows | grads_in_pass | kept_recompute (forced where it can run: the cached two need selection scores)")
    normalize: str = _f("paper", "paper (mean over kept tokens per micro-batch / accum steps) | global (sum / kept tokens of the whole step, all ranks)")
    num_threads: int = _f(0, "torch CPU threads; 0 = torch's default (torchrun sets 1 per process)")
    branch_from: str = _f("", "a checkpoint file of another run to continue from (a branched study's trunk): its weights, optimizer state, data position, step, FLOPs and time; this run's method starts fresh and its cosine continues from there to its own last step (docs/study.md)")


def method_section_class(specs) -> type[SharedMethodSettings]:
    """The ``method`` section's class: the shared settings, then one field per config section the method specs
    declare (``MethodSpec.settings``). Two classes claiming one key are a programming error."""
    sections: dict[str, type[Section]] = {}
    shared = {key_of(f) for f in fields(SharedMethodSettings)}
    for spec in specs:
        for cls in spec.settings:
            have = sections.setdefault(cls.key, cls)
            if have is not cls or not cls.key or cls.key in shared:
                raise TypeError(f"method {spec.name!r}: config section {cls.__name__} needs a key of its own, found "
                                f"{cls.key!r} (taken by {have.__name__ if have is not cls else 'the shared settings'})")
    doc = "``method.*``: the shared settings and every registered method's section."
    made: type[SharedMethodSettings] = dataclasses.make_dataclass(
        "MethodSection", [(key, cls, field(default_factory=cls, metadata={"help": cls.help}))
                          for key, cls in sections.items()],
        bases=(SharedMethodSettings,), frozen=True, namespace={"__doc__": doc, "__module__": __name__})
    return made


# The ``method`` section's class. Statically it is ``SharedMethodSettings`` (code reads a method's own section as
# the class its builder receives: ``eslm.methods.BuildContext.section``); at run time it also has one field per
# registered section, so YAML, overrides and ``--help`` reach ``method.<key>.*``.
MethodSection = method_section_class(METHODS.values())


@dataclass(frozen=True)
class EvalSection:
    interval: int = _f(100, "optimizer steps between validation evaluations (0 = only at the end)")
    tokens_per_domain: int = _f(8192, "fixed validation budget per domain, tokens (the paper: 1638400, configs/paper/base.yaml)")
    batch_size_seqs: int = _f(8, "validation sequences per forward")


# log.tensorboard's default: on where tensorboard is installed, off elsewhere (a default run does not warn about
# a logger nobody asked for; log.tensorboard=true without it still warns)
try:
    TENSORBOARD_INSTALLED = importlib.util.find_spec("tensorboard") is not None
except (ImportError, ValueError):  # an import hook or a broken install made the look-up itself raise
    TENSORBOARD_INSTALLED = False


@dataclass(frozen=True)
class LogSection:
    interval: int = _f(10, "optimizer steps between progress lines / metrics lines")
    tensorboard: bool = _f(TENSORBOARD_INSTALLED, "write TensorBoard event files to <run>/tb (default: on when "
                           "tensorboard is installed, pip install 'eslm[tb]')")
    wandb: bool = _f(False, "log to Weights & Biases (pip install 'eslm[wandb]'; WANDB_MODE=offline works)")
    wandb_project: str = _f("eslm", "W&B project")
    wandb_run_name: str = _f("", "W&B run name; empty = the run directory's name")


@dataclass(frozen=True)
class CheckpointSection:
    interval: int = _f(100, "optimizer steps between checkpoints (0 = only at the end)")
    keep_last: int = _f(2, "keep the last K regular checkpoints")
    milestones: tuple = _f((), "steps whose checkpoints are always kept (e.g. Rho-1 references, KD teachers)")
    snapshot_interval: int = _f(0, "model-only safetensors snapshots in <run>/snapshots: 0 = at every evaluation, "
                                   "N = every N steps, -1 = none")
    snapshot_keep: int = _f(0, "snapshots kept (the newest K); 0 = all")


@dataclass(frozen=True)
class FlopsSection:
    count_per: str = _f("global", "global (every micro-batch of every rank) | micro (one micro-batch per step, the paper's budgets)")
    budget_counter: str = _f(M.FLOPS_PAPER, "which counter train.max_flops applies to: flops_paper | flops_executed | flops_dense")


@dataclass(frozen=True)
class DistributedSection:
    fsdp: bool = _f(False, "shard parameters, gradients and optimizer state with FSDP2 instead of DDP (ignored with one process; docs/training.md)")
    backend: str = _f("auto", "auto (nccl on CUDA, gloo on CPU) | nccl | gloo")


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    method: SharedMethodSettings = field(default_factory=MethodSection)
    eval: EvalSection = field(default_factory=EvalSection)
    log: LogSection = field(default_factory=LogSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    flops: FlopsSection = field(default_factory=FlopsSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)

    def to_dict(self) -> dict:
        return _to_dict(self)


# ---------------------------------------------------------------- building from deltas


def _to_dict(obj) -> Any:
    if is_dataclass(obj):
        return {key_of(f): _to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, tuple):
        return list(obj)
    return obj


def all_keys(cls=Config, prefix: str = "") -> dict[str, tuple[Any, str]]:
    """Every dotted leaf key -> (default, help)."""
    out: dict[str, tuple[Any, str]] = {}
    inst = cls()
    for f in fields(cls):
        val = getattr(inst, f.name)
        if is_dataclass(val):
            out.update(all_keys(type(val), prefix + key_of(f) + "."))
        else:
            out[prefix + key_of(f)] = (val, f.metadata.get("help", ""))
    return out


def _coerce(value: Any, typ, key: str, problems: list[str]) -> Any:
    """Convert a YAML or command-line value to the field's type, or record a problem."""
    origin = typing.get_origin(typ)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return value.lower() in ("true", "1", "yes", "on")
            raise ValueError
        if typ in (int, float) and isinstance(value, bool):
            raise ValueError
        if typ is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)
        if typ is float:
            return float(value)
        if typ is str:
            return "" if value is None else str(value)
        if typ is tuple or origin is tuple:
            if isinstance(value, str):
                value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
            return tuple(int(v) for v in (value or []))
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("1e400")), an infinite number
        pass
    else:
        return value
    words = {bool: "true or false", int: "an integer", float: "a number", str: "text"}.get(typ) or (
        "a list of integers" if typ is tuple or origin is tuple else getattr(typ, "__name__", str(typ)))
    problems.append(f"{key}: expected {words}, found {value!r}")
    return None


def _apply(cfg, delta: dict, prefix: str, problems: list[str]):
    """Return cfg with the nested mapping ``delta`` applied; unknown keys become problems."""
    hints = typing.get_type_hints(type(cfg))
    names = {key_of(f): f.name for f in fields(cfg)}  # config key -> attribute
    changes = {}
    for k, v in delta.items():
        key = prefix + str(k)
        if k not in names:
            problems.append(unknown_key_message(key))
            continue
        k = names[k]
        cur = getattr(cfg, k)
        if is_dataclass(cur):
            if not isinstance(v, dict):
                problems.append(f"{key}: expected a mapping of sub-keys, got {v!r}")
                continue
            changes[k] = _apply(cur, v, key + ".", problems)
        else:
            coerced = _coerce(v, hints[k], key, problems)
            if coerced is not None:
                changes[k] = coerced
    return replace(cfg, **changes)


def unknown_key_message(key: str) -> str:
    """One line for a key the config does not have, with the nearest key that it has."""
    close = difflib.get_close_matches(key, list(all_keys()), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "; see `eslm train --help` for the keys"
    return f"unknown config key {key!r}{hint}"


def parse_override(text: str) -> dict:
    """'method.alpha=0.2' -> {'method': {'alpha': '0.2'}} (values are coerced later by type)."""
    if "=" not in text:
        raise ConfigError(f"expected an override of the form section.key=value, got {text!r}; fix: write "
                          f"{text.strip().rstrip(':') or 'section.key'}=VALUE as one argument, no spaces")
    key, value = text.split("=", 1)
    out: dict = {}
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file() and p.parts[:1] == ("configs",):  # the copy inside the package (a pip install)
        p = Path(__file__).resolve().parent / p if (Path(__file__).parent / p).is_file() else p
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found; expected a YAML file of config deltas")
    return read_yaml(p, "config file", fix="fix the file (a mapping of sections: run, model, data, train, method)")


def build_config(files: Sequence[str] = (), overrides: Sequence[str] = (), base: Config | None = None) -> Config:
    """Defaults <- YAML files in order <- dotted overrides; validated (ConfigError listing all problems), then a
    warning for each setting that is valid but probably not meant (``config_warnings``)."""
    cfg = base or Config()
    problems: list[str] = []
    deltas = [load_yaml(f) for f in files] + [parse_override(o) for o in overrides]
    for d in deltas:
        cfg = _apply(cfg, d, "", problems)
    if base is None and not any(isinstance(d.get("data"), dict) and "seq_len" in d["data"] for d in deltas):
        cfg = _fit_seq_len(cfg)
    if lines := [with_fix(p) for p in problems + validate(cfg)]:  # one per line, each with its fix
        raise ConfigError(f"config problem: {lines[0]}" if len(lines) == 1 else f"{len(lines)} config problems:"
                          + "".join(f"\n  - {line}" for line in lines), tuple(lines))
    for message in config_warnings(cfg):
        warnings.warn(message, stacklevel=1)
    return cfg


def with_fix(problem: str) -> str:
    """``problem`` ending in a fix: a check that says only what it expected and found (``train.lr: expected
    float, got 'abc'``) gets the key's default as a value that passes; a line with a fix of its own is kept."""
    if any(w in problem for w in ("fix:", "did you mean", "; set ", "see `eslm")):
        return problem
    key = problem.split(":", 1)[0].split(" ", 1)[0]
    default = all_keys().get(key)
    if default is None:
        return problem
    value = default[0]
    shown = "[" + ",".join(map(str, value)) + "]" if isinstance(value, tuple) else \
        str(value).lower() if isinstance(value, bool) else repr(value) if value == "" else str(value)
    return f"{problem}; fix: set {key} as expected, e.g. its default {key}={shown}"


def _fit_seq_len(cfg: Config) -> Config:
    """data.seq_len left at its default is at most the model's context (model.preset=tiny: 64)."""
    try:
        context = model_config_for(cfg).block_size
    except ConfigError:  # an unknown preset or tokenizer: validate() reports it with the other problems
        return cfg
    if 0 < context < cfg.data.seq_len:
        return replace(cfg, data=replace(cfg.data, seq_len=context))
    return cfg


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are valid but probably not what was meant (``build_config`` warns about each)."""
    out = []
    t = cfg.train
    if t.warmup_steps > t.max_steps:
        out.append(f"train.warmup_steps={t.warmup_steps} exceeds train.max_steps={t.max_steps}: the learning rate "
                   f"stays in its warmup for the whole run and never reaches train.lr={t.lr:g}; fix: set "
                   f"train.warmup_steps below train.max_steps")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if t.num_threads > cpus:
        out.append(f"train.num_threads={t.num_threads} exceeds the {cpus} CPUs this process may use: the extra "
                   f"threads only wait for a core; fix: train.num_threads={cpus}, or 0 (torch's default)")
    return out


def stored_config_problem(d: dict, *, complete: bool = False) -> str | None:
    """Why a run directory's stored config mapping is not in this version's format, or None: an unknown key or a
    value of the wrong type; with ``complete`` (a resume) also a key it lacks (filled with today's default it
    would be misread). eslm 0.x reads only its own format: no upgrade path."""
    problems: list[str] = []
    _apply(Config(), d, "", problems)
    if not problems and complete:
        have = flat(d)
        missing = [k for k in all_keys() if k not in have]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            problems.append(f"no {missing[0]}{more}: written before the key existed")
    return problems[0] if problems else None


def flat(d: Config | dict, prefix: str = "") -> dict:
    """{dotted key: value} of every leaf of a nested mapping or a Config (tuples as lists, as in config.yaml)."""
    out: dict = {}
    for k, v in (d.to_dict() if isinstance(d, Config) else d).items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def from_dict(d: dict) -> Config:
    """A Config from a full or partial nested mapping (e.g. a run directory's config.yaml)."""
    problems: list[str] = []
    cfg = _apply(Config(), d, "", problems)
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg


# ---------------------------------------------------------------- what a config trains


def model_config_for(cfg: Config) -> ModelConfig:
    """The ``ModelConfig`` a run of ``cfg`` trains, from the config alone (for the trainer and for FLOPs budgets
    sized before the run); only ``model.init_from`` with ``model.vocab_size=0`` may later swap in the source's
    vocabulary (``eslm.train.setup.init_from``)."""
    m = cfg.model
    overrides = {"vocab_size": m.vocab_size or pad_vocab(tokenizer_class(cfg.data.tokenizer).vocab_size),
                 "dropout": m.dropout}
    if m.block_size:
        overrides["block_size"] = m.block_size
    return preset(m.preset, **overrides)


def training_flops_model(cfg: Config) -> FlopsModel:
    """The ``FlopsModel`` of the model a ``Config`` trains (``model_config_for``)."""
    return FlopsModel.from_config(model_config_for(cfg), cfg.data.seq_len)


def equal_flops_budget(cfg: Config) -> tuple[float, int]:
    """(train.max_flops, train.max_steps) of an equal-FLOPs run of ``cfg``: what ``max_steps`` dense steps cost,
    and a step cap the budget always reaches first (every step spends at least its forward, a third of a dense
    step)."""
    fm, t = training_flops_model(cfg), cfg.train
    micro_batches = t.grad_accum_steps if cfg.flops.count_per == "global" else 1
    tokens_per_step = t.micro_batch_size_seqs * cfg.data.seq_len * micro_batches
    return fm.train_per_token * tokens_per_step * t.max_steps, 3 * t.max_steps + 1


def method_context(cfg: Config, *, device, n_domains: int, rank: int = 0, model_config: ModelConfig | None = None,
                   val_loader_factory=None) -> BuildContext:
    """What the registry's builders receive for a run of ``cfg`` (``eslm.methods.BuildContext``)."""
    t = cfg.train
    return BuildContext(method=cfg.method, sections=method_sections(cfg.method), device=device, n_domains=n_domains,
                        seq_len=cfg.data.seq_len, micro_batch_size_seqs=t.micro_batch_size_seqs, seed=cfg.run.seed,
                        loss_impl=t.loss_impl, loss_chunk_size=t.loss_chunk_size,
                        loss_cache_probs=t.loss_cache_probs, loss_route=t.loss_route, rank=rank,
                        model_config=model_config, val_loader_factory=val_loader_factory)


# ---------------------------------------------------------------- validation

_CHOICES = {  # the constants of the code that reads each key, where it has one
    "model.preset": tuple(PRESETS),
    "data.tokenizer": TOKENIZER_NAMES,
    "train.dtype": ("auto", "fp32", "bf16"),
    "train.loss_impl": IMPL_CHOICES,
    "train.loss_route": ROUTE_CHOICES,
    "train.normalize": ("paper", "global"),
    "train.lr_schedule": ("budget", "steps"),
    "method.standardize": STANDARDIZE_MODES,
    "method.scope": SCOPES,
    "flops.count_per": COUNT_PER,
    "flops.budget_counter": COUNTER_KEYS,
    "distributed.backend": ("auto", "nccl", "gloo"),
}

_POSITIVE = ["data.seq_len", "train.micro_batch_size_seqs", "train.grad_accum_steps", "train.max_steps",
             "train.loss_chunk_size", "eval.tokens_per_domain", "eval.batch_size_seqs", "log.interval"]
_NON_NEGATIVE = ["train.lr", "train.min_lr", "train.warmup_steps", "train.lr_decay_steps", "train.weight_decay",
                 "train.grad_clip", "train.max_flops", "eval.interval", "checkpoint.interval", "checkpoint.keep_last",
                 "checkpoint.snapshot_keep", "model.vocab_size", "model.block_size",
                 "train.num_threads", "run.resume_from"]


def method_sections(method: SharedMethodSettings) -> dict[str, Section]:
    """{key: section} of the per-method sections of ``method`` (``ada``, ``rho1``, ``kd``, ...)."""
    return {key_of(f): getattr(method, f.name) for f in fields(method)
            if isinstance(getattr(method, f.name), Section)}


def method_problem(name) -> str | None:
    """Why ``name`` is not a registered method (with the nearest one), or None."""
    if not isinstance(name, str):
        return f"expected a method name, found {name!r}"
    close = difflib.get_close_matches(name, list(METHODS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return None if name in METHODS else f"unknown method {name!r}{hint}; expected one of {', '.join(METHODS)}"


def is_int(v) -> bool:
    """An integer that is not a bool (YAML's and JSON's true is an int to Python)."""
    return isinstance(v, int) and not isinstance(v, bool)


MAX_INT = 2**53  # a larger integer setting is a mistake (and overflows the int64 counters and seeds it feeds)
MAX_SEED = 2**32  # numpy's seeds are 32-bit; each rank and stream adds a small offset


def memory_problems(cfg: Config, memory: int | None = None) -> list[str]:
    """Sizes that cannot fit in this machine's memory (``memory`` bytes; default: its physical memory), each with a
    lower bound of what it needs: the activations one micro-batch keeps for backward (tokens x width x (layers +
    1), float32), the micro-batches of one step (drawn together: inputs and targets, int64) and the positional
    table (model.block_size x width, float32)."""
    try:
        memory = memory or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # the OS does not say
        return []
    if not memory or cfg.model.preset not in PRESETS or cfg.data.tokenizer not in TOKENIZER_NAMES:
        return []
    mc = model_config_for(cfg)
    t = cfg.train
    tokens = t.micro_batch_size_seqs * cfg.data.seq_len
    gib, have = 2.0 ** 30, memory / 2.0 ** 30
    out = []
    for need, what, fix in (
            (tokens * mc.n_embd * 4 * (mc.n_layer + 1),
             f"train.micro_batch_size_seqs x data.seq_len = {tokens} tokens per micro-batch: the activations kept "
             f"for backward ({mc.n_layer} layers of width {mc.n_embd})",
             "set train.micro_batch_size_seqs (or data.seq_len) smaller; raise train.grad_accum_steps to keep the "
             "tokens per step"),
            (t.grad_accum_steps * tokens * 16,
             f"train.grad_accum_steps x {tokens} tokens = {t.grad_accum_steps * tokens} tokens per optimizer step "
             "(its micro-batches are drawn together)", "set train.grad_accum_steps smaller"),
            (mc.block_size * mc.n_embd * 4, f"model.block_size={mc.block_size}: the positional table",
             "set model.block_size to the context you train (0: the preset's)")):
        if need > memory:
            out.append(f"{what} need at least {need / gib:.3g} GiB, more than this machine's {have:.3g} GiB; "
                       f"fix: {fix}")
    return out


def validate(cfg: Config) -> list[str]:
    """Every problem of a built config (empty list when valid)."""
    problems, values = [], flat(cfg)
    for key, choices in _CHOICES.items():
        if values[key] not in choices:
            problems.append(f"{key}: expected one of {', '.join(choices)}, got {values[key]!r}")
    for key in _POSITIVE:
        if values[key] <= 0:
            problems.append(f"{key}: expected a positive number, got {values[key]!r}")
    for key in _NON_NEGATIVE:
        if values[key] < 0:
            problems.append(f"{key}: expected >= 0, got {values[key]!r}")
    if cfg.checkpoint.snapshot_interval < -1:
        problems.append(f"checkpoint.snapshot_interval: expected -1 (none), 0 (at every evaluation) or a step "
                        f"count, got {cfg.checkpoint.snapshot_interval!r}")
    try:
        check_alpha(cfg.method.alpha)
    except ConfigError as e:
        problems.append(f"method.{e}")
    for name, sec in method_sections(cfg.method).items():  # each section's own checks (eslm.settings.Section)
        problems += [f"method.{name}.{p}" for p in sec.problems()]
    for key, (default, _) in all_keys().items():  # nan passes every comparison below; inf is no setting
        if isinstance(default, float) and not math.isfinite(values[key]):
            problems.append(f"{key}: expected a finite number, got {values[key]!r}")
        elif is_int(default) and abs(values[key]) >= MAX_INT:
            problems.append(f"{key}: expected an integer below 2**53, got {values[key]!r}")
    for key in ("train.beta1", "train.beta2", "model.dropout"):  # AdamW's moment decays, a probability
        if math.isfinite(values[key]) and not 0.0 <= values[key] < 1.0:
            problems.append(f"{key}: expected 0 <= {key.split('.')[1]} < 1, got {values[key]!r}")
    if abs(cfg.run.seed) < MAX_INT and not 0 <= cfg.run.seed < MAX_SEED - 1024:
        problems.append(f"run.seed: expected an integer in [0, {MAX_SEED - 1024}), got {cfg.run.seed!r}")
    if cfg.run.name and (problem := name_problem(cfg.run.name, "run.name")):  # <out_dir>/<name>: one component
        problems.append(problem)
    if cfg.run.resume_from and not cfg.run.resume:
        problems.append("run.resume_from: needs run.resume=true (--resume-from STEP sets both)")
    if cfg.train.loss_route in ROUTE_CHOICES:  # the combination, as the head backend checks it
        problems += option_problems(HeadOptions(cfg.train.loss_chunk_size, cfg.train.loss_cache_probs,
                                                 cfg.train.loss_route))
    if cfg.train.min_lr > cfg.train.lr:
        problems.append(f"train.min_lr ({cfg.train.min_lr}) must not exceed train.lr ({cfg.train.lr})")
    dev = cfg.train.device
    if not (dev in ("auto", "cpu", "cuda") or dev.startswith("cuda:")):
        problems.append(f"train.device: expected auto, cpu, cuda or cuda:N, got {dev!r}")
    if why := method_problem(cfg.method.name):
        problems.append(f"method.name: {why}")
    else:
        problems += METHODS[cfg.method.name].problems(cfg.method)
    if not problems:  # sizes are estimated from a config that is otherwise valid
        problems += memory_problems(cfg)
    return problems


def to_yaml(cfg: Config) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def describe_keys() -> str:
    """A table of every key, its default and meaning (for --help)."""
    return "\n".join(f"  {key:<32} {str(default):<14} {help}" for key, (default, help) in all_keys().items())


__all__ = ["Config", "build_config", "config_warnings", "from_dict", "stored_config_problem", "validate", "to_yaml",
           "describe_keys", "all_keys", "method_context", "model_config_for", "equal_flops_budget"]
