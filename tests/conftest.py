"""Shared fixtures: a tiny prepared corpus (byte tokenizer, two domains) that every training test reuses; HostReads,
the CPU stand-in for a CUDA sync check."""

import os
from pathlib import Path

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "triton" not in __import__("sys").modules and not __import__("torch").cuda.is_available():
    # without a GPU the Triton kernels of the GPU head backend (eslm.ops.triton_head) run under Triton's
    # interpreter; it must be chosen before triton is first imported (its own helpers are jit functions too)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _write_corpus(root: Path) -> list[str]:
    import inspect
    import json as json_mod
    import textwrap

    code = root / "code"
    prose = root / "prose"
    code.mkdir(parents=True)
    prose.mkdir(parents=True)
    # real text: a few stdlib sources and their docstrings, enough for several windows per domain
    for mod in (json_mod, textwrap, inspect):
        src = Path(mod.__file__).read_text()
        (code / f"{mod.__name__}.py").write_text(src[:20000])
        (prose / f"{mod.__name__}.txt").write_text((mod.__doc__ or "") * 20)
    return [f"code={code}", f"prose={prose}"]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared byte-level corpus with domains 'code' and 'prose'."""
    from eslm.data.prepare import prepare

    root = tmp_path_factory.mktemp("corpus")
    paths = _write_corpus(root / "text")
    out = root / "prepared"
    prepare("text", out, tokenizer="byte", paths=paths, progress=False, workers=1)
    return out


def tiny_overrides(data_dir: Path, run_dir: Path, **extra) -> list[str]:
    """Overrides for a few-second training run of the tiny model on the tiny corpus."""
    base = {
        "data.dir": str(data_dir), "data.tokenizer": "byte", "data.seq_len": 32, "model.preset": "tiny",
        "run.out_dir": str(run_dir), "run.name": "t", "train.micro_batch_size_seqs": 4,
        "train.grad_accum_steps": 2, "train.max_steps": 6, "train.warmup_steps": 2, "train.lr": 3e-3,
        "eval.interval": 3, "eval.tokens_per_domain": 512, "eval.batch_size_seqs": 4, "log.interval": 1,
        "checkpoint.interval": 3, "log.tensorboard": "false", "method.ada.interval": 2,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="session")
def frozen_run(tiny_data, tmp_path_factory) -> Path:
    """A 3-step clm run directory on the tiny corpus: the frozen reference / teacher model of the methods that
    need one (``eslm.methods.Need`` with a config key)."""
    from eslm.config import build_config
    from eslm.train.trainer import train

    out = tmp_path_factory.mktemp("frozen")
    return train(build_config(overrides=tiny_overrides(tiny_data, out, **{"method.name": "clm",
                                                                           "train.max_steps": 3}))).run_dir


def needs_overrides(name: str, frozen: Path) -> dict:
    """{config key: value} that supplies every need of the registered method ``name`` that a run must name (its
    frozen models, each ``frozen``); held-out data is the run's own validation split."""
    from eslm.methods import METHODS

    return {need.key: str(frozen) for need in METHODS[name].frozen_models}


def build_registered(name: str, data_dir: Path, run_dir: Path, frozen: Path, **extra):
    """The registered method ``name`` built as a tiny run builds it (``eslm.train.trainer.Trainer``: its data,
    model and validation stream), every need supplied; nothing is trained or written."""
    from eslm.config import build_config
    from eslm.train.trainer import Trainer

    over = {"method.name": name, **needs_overrides(name, frozen), **extra}
    return Trainer(build_config(overrides=tiny_overrides(data_dir, run_dir, **over))).method


def torchrun(args, timeout=300) -> str:
    """Run ``python -m torch.distributed.run --standalone --nproc_per_node 2 ARGS`` (gloo, 1 thread per
    process, a free port chosen by torchrun); fail the test with the output's tail if it fails."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped where there is none, so a plain ``pytest`` on a CPU box skips them
    (``pytest -m gpu`` on a GPU machine runs them; benchmarks/gpu_suite.py does that)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# aten ops that read the device from the host (or wait for it to size their output)
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
             "equal", "is_nonzero", "bincount", "repeat_interleave", "histc", "allclose", "_assert_async"}
_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"}


class HostReads(TorchDispatchMode):
    """Raises on every op of ``_SYNC_OPS`` (item(), int/float/bool of a tensor, nonzero, boolean indexing ...)
    dispatched inside it, on any device: the CPU stand-in for torch.cuda.set_sync_debug_mode("error").
    With ``record`` (a list) it appends each such op's name there instead of raising."""

    def __init__(self, record: list | None = None):
        super().__init__()
        self.record = record

    def _found(self, what: str) -> None:
        if self.record is None:
            raise RuntimeError(f"host sync in the step: {what}")
        self.record.append(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch

        name = func.overloadpacket.__name__
        if name in _SYNC_OPS:
            self._found(f"aten.{name}")
        elif name in _INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                        for i in args[1]):  # a mask's nonzero runs inside the kernel, unseen here
            self._found(f"aten.{name} with a boolean mask")
        return func(*args, **(kwargs or {}))


def read_metrics(run_dir, kind: str | None = None) -> list[dict]:
    """metrics.jsonl of a run directory as a list (``eslm.train.run_dir.last_records``: the last line of every
    (kind, step)), only ``kind`` ("train" / "eval") if given; [] when there is no file."""
    from eslm.train.run_dir import last_records

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    recs, _ = last_records(path)
    return [r for r in recs if kind is None or r["kind"] == kind]
