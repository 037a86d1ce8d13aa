"""The training loop: setup, the step loop, logging, evaluation, checkpoints, resume, preemption.

Orchestration only; the maths of a step is in ``eslm.train.step``, of selection in ``eslm.selection``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eslm import metrics as M
from eslm.config import Config, to_yaml
from eslm.errors import ConfigError, ESLMError
from eslm.flops import FlopsCounter, FlopsModel
from eslm.methods import BuildContext, build_method
from eslm.model.gpt import GPT, pad_vocab, preset
from eslm.train import checkpoint as ckpt
from eslm.train.distributed import (DistInfo, FSDPModel, full_state_dicts, init_distributed,
                                    load_full_state_dicts, shard_fsdp, shutdown)
from eslm.train.optim import build_optimizer, lr_at
from eslm.train.resume import check_resume, lock_run_dir, record_resume
from eslm.tracking import open_trackers
from eslm.train import snapshots
from eslm.train.run_dir import MetricsWriter, env_info
from eslm.train.step import StepOptions, forward_backward

# peak dense bf16 FLOP/s for MFU (H100 SXM / H200: 989 TFLOP/s; A100: 312)
_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


class TrainingDiverged(ESLMError):
    """A non-finite loss or gradient: the run stops before the optimizer step."""


@dataclass
class RunResult:
    run_dir: Path
    step: int
    val_loss: float | None
    stopped_by: str  # "max_steps" | "max_flops" | "preempted"


def default_run_name(cfg: Config) -> str:
    return f"{cfg.method.name}-{cfg.model.preset}-s{cfg.run.seed}"


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.dist, self.device = init_distributed(cfg.train.device, cfg.distributed.backend)
        self._setup_torch()
        self.dataset = self._open_data()
        self.model_config = self._model_config()
        self.run_dir = Path(cfg.run.out_dir) / (cfg.run.name or default_run_name(cfg))
        # FSDP2 only with more than one process; raw_model is then the sharded module itself (DTensor parameters)
        self.fsdp = cfg.distributed.fsdp and self.dist.enabled
        if cfg.distributed.fsdp and not self.dist.enabled:
            self._log("distributed.fsdp=true is ignored with one process (nothing to shard)")
        self.raw_model = GPT(self.model_config).to(self.device)
        self._init_from()
        self.model = self._wrap(self.raw_model)
        t = cfg.train
        self.optimizer = build_optimizer(self.raw_model, lr=t.lr, weight_decay=t.weight_decay,
                                         betas=(t.beta1, t.beta2), device_type=self.device.type)
        self._build_data_streams()
        self.method = build_method(BuildContext(cfg=cfg, device=self.device, n_domains=len(self.dataset.domains),
                                                rank=self.dist.rank, model_config=self.model_config,
                                                val_loader_factory=self._val_loader_factory))
        self.fm = FlopsModel.from_config(self.model_config, cfg.data.seq_len)
        self.flops = FlopsCounter(cfg.flops.count_per)
        self.step, self.elapsed_s, self.cpu_s, self._preempted = 0, 0.0, 0.0, False
        self._load_samples: list[float] = []
        self.opts = StepOptions(accum_steps=t.grad_accum_steps, normalize=t.normalize, scope=cfg.method.scope,
                                world_size=self.dist.world_size, loss_impl=t.loss_impl, chunk_size=t.loss_chunk_size,
                                autocast=self._autocast())

    # ------------------------------------------------------------------ setup
    def _setup_torch(self) -> None:
        cfg = self.cfg
        if cfg.train.num_threads > 0:
            torch.set_num_threads(cfg.train.num_threads)
        seed = cfg.run.seed + self.dist.rank
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def _autocast(self):
        dtype = self.cfg.train.dtype
        if dtype == "bf16" or (dtype == "auto" and self.device.type == "cuda"):
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return None

    def _open_data(self):
        from eslm.data.loader import open_dataset

        d = self.cfg.data
        if d.dir:
            return open_dataset(d.dir)
        from eslm.data.prepare import ensure_prepared

        if self.dist.enabled:  # rank 0 prepares, the others wait
            import torch.distributed as dist

            if self.dist.is_main:
                ensure_prepared(d.source, d.tokenizer)
            dist.barrier()
        return open_dataset(ensure_prepared(d.source, d.tokenizer))

    def _model_config(self):
        m = self.cfg.model
        vocab = m.vocab_size or pad_vocab(self.dataset.vocab_size)
        check_data_tokenizer(self.dataset, self.cfg.data.tokenizer)
        self.dataset.check_vocab(vocab)
        overrides = {"vocab_size": vocab, "dropout": m.dropout}
        if m.block_size:
            overrides["block_size"] = m.block_size
        mc = preset(m.preset, **overrides)
        if self.cfg.data.seq_len > mc.block_size:
            raise ConfigError(f"data.seq_len={self.cfg.data.seq_len} exceeds the model's context "
                              f"{mc.block_size}; lower data.seq_len or set model.block_size")
        return mc

    def _init_from(self) -> None:
        if not self.cfg.model.init_from:
            return
        from eslm.model.loading import load_model

        src, info = load_model(self.cfg.model.init_from, device=self.device)
        self._adopt_init_vocab(src.config.vocab_size, info.get("tokenizer"))
        sd = src.state_dict()
        ckpt.check_model_matches({"model_config": src.config.to_dict()}, self.model_config.to_dict(),
                                 self.cfg.model.init_from, fix="set model.preset / model.block_size / "
                                 "model.vocab_size to the source model's, or point model.init_from elsewhere")
        self.raw_model.load_state_dict(sd)

    def _adopt_init_vocab(self, src_vocab: int, src_tokenizer: str | None) -> None:
        """model.init_from: the source's tokenizer must be the data's; with model.vocab_size=0 (auto) the
        source's vocabulary is used when it covers the data's (an export-hf or HF GPT-2 directory holds 50257
        rows, not the padded 50304: padding a tied head with rows would put mass on ids that do not exist)."""
        if src_tokenizer is not None and src_tokenizer != self.dataset.tokenizer_name:
            raise ConfigError(f"model.init_from {self.cfg.model.init_from!r} was trained with the {src_tokenizer!r} "
                              f"tokenizer, the data ({self.dataset.path}) with {self.dataset.tokenizer_name!r}; "
                              "use data prepared with the same tokenizer, or another model.init_from")
        if (self.cfg.model.vocab_size == 0 and src_vocab != self.model_config.vocab_size
                and src_vocab >= self.dataset.vocab_size):
            from dataclasses import replace

            self._log(f"model.init_from: vocabulary of {src_vocab} rows taken from the source "
                      f"(model.vocab_size=0 would pad to {self.model_config.vocab_size})")
            self.model_config = replace(self.model_config, vocab_size=src_vocab)
            self.raw_model = GPT(self.model_config).to(self.device)

    def _wrap(self, model):
        if self.fsdp:
            if self.cfg.train.compile:
                for block in model.transformer.h:
                    block.compile()
            return FSDPModel(shard_fsdp(model, self.dist, self.device))
        if self.cfg.train.compile:
            model = torch.compile(model)
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            model = DDP(model, device_ids=ids)
        return model

    def _build_data_streams(self) -> None:
        from eslm.data.loader import TrainLoader, val_batches
        from eslm.data.mixture import resolve_weights

        d, t = self.cfg.data, self.cfg.train
        counts = {dom: self.dataset.num_tokens("train", dom) for dom in self.dataset.domains}
        self.weights = resolve_weights(_parse_weights(d.weights), self.dataset.domains, token_counts=counts)
        self.loader = TrainLoader(self.dataset, seq_len=d.seq_len, micro_batch_size_seqs=t.micro_batch_size_seqs,
                                  weights=self.weights, seed=self.cfg.run.seed, rank=self.dist.rank,
                                  world_size=self.dist.world_size)
        e = self.cfg.eval
        self.val = {dom: [b.to(self.device) for b in bs] for dom, bs in val_batches(
            self.dataset, seq_len=d.seq_len, batch_size_seqs=e.batch_size_seqs,
            tokens_per_domain=e.tokens_per_domain, seed=0).items()}

    def _val_loader_factory(self, batch_size_seqs: int):
        from eslm.data.loader import TrainLoader

        return TrainLoader(self.dataset, seq_len=self.cfg.data.seq_len, micro_batch_size_seqs=batch_size_seqs,
                           weights=self.weights, seed=self.cfg.run.seed + 104729, rank=self.dist.rank,
                           world_size=self.dist.world_size, split="val")

    # ------------------------------------------------------------------ run directory
    def _prepare_run_dir(self) -> None:
        rd = self.run_dir
        has_metrics = (rd / "metrics.jsonl").is_file() and (rd / "metrics.jsonl").stat().st_size > 0
        if self.dist.is_main:
            # a resume must be the same run: compared (reading only) before anything is written
            self._resume_changes = check_resume(rd, self.cfg) if self.cfg.run.resume else None
            if has_metrics and not self.cfg.run.resume:
                raise ConfigError(f"run directory {str(rd)!r} already holds a run; pass run.resume=true "
                                  "(--resume) to continue it, or choose another run.name")
            self._lock = lock_run_dir(rd, self.cfg.run.resume, self._log)
            if not self.cfg.run.resume:  # config.yaml and env.json describe the run's start, written once
                (rd / "config.yaml").write_text(to_yaml(self.cfg))
                env = env_info(self.device, self.dist.world_size, self.cfg.run.seed)
                env["model_params_non_embedding"] = self.raw_model.num_params()
                env["load_avg_at_start"] = _load_avg()
                (rd / "env.json").write_text(json.dumps(env, indent=2) + "\n")
            self.writer = MetricsWriter(rd, self.cfg.log.tensorboard)
            self.writer.sinks += open_trackers(self.cfg, rd, _read_env(rd))

    def _maybe_resume(self) -> None:
        if not self.cfg.run.resume:
            return
        rf = self.cfg.run.resume_from
        path = ckpt.checkpoint_at(self.run_dir, rf) if rf else ckpt.latest_checkpoint(self.run_dir)
        if path is None:
            self._log(f"no checkpoint in {self.run_dir}; starting from step 0")
            self._record_resume(step=0)
            return
        # FSDP: every rank reads the full file memory-mapped on CPU (one page cache) and keeps its shard
        state = ckpt.load_checkpoint(path, map_location="cpu" if self.fsdp else self.device, mmap=self.fsdp)
        ckpt.check_model_matches(state, self.model_config.to_dict(), path)
        if self.fsdp:
            load_full_state_dicts(self.raw_model, self.optimizer, state["model"], state["optimizer"])
        else:
            self.raw_model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.loader.load_state_dict(state["loader"])
        self.method.load_state_dict(state["method"])
        self.flops.load_state_dict(state["flops"])
        ckpt.set_rng_state(state["rng"])
        self.step, self.elapsed_s = state["step"], state["elapsed_s"]
        self.cpu_s = float(state.get("cpu_s", 0.0))  # checkpoints written before cpu_s existed: 0
        self._log(f"resumed from {path} at step {self.step}")
        self._record_resume(step=self.step)

    def _record_resume(self, step: int) -> None:
        """Rank 0: supersede checkpoints after a --resume-from step; append the resumes.jsonl record."""
        if not self.dist.is_main:
            return
        extra = {}
        if self.cfg.run.resume_from:
            extra["resume_from"] = step
            extra["superseded"] = ckpt.supersede_after(self.run_dir, step)
            if extra["superseded"]:
                self._log(f"later checkpoints moved to {self.run_dir / 'checkpoints' / 'superseded'}: "
                          f"{', '.join(extra['superseded'])}")
        for key, (old, new) in (self._resume_changes or {}).items():
            self._log(f"resume changes {key}: {old!r} -> {new!r} (recorded in resumes.jsonl)")
        record_resume(self.run_dir, self._resume_changes or {}, step, **extra)

    def save(self) -> Path | None:
        """Rank 0 writes the checkpoint; under FSDP every rank must call this (the full state dicts are gathered)."""
        if not self._weights_finite():
            raise TrainingDiverged(f"the weights at step {self.step} are not finite; no checkpoint was written. "
                                   + self._last_good_hint())
        if self.fsdp:
            model_sd, optim_sd = full_state_dicts(self.raw_model, self.optimizer)
        if not self.dist.is_main:
            return None
        if not self.fsdp:
            model_sd = {k: v.detach().cpu() for k, v in self.raw_model.state_dict().items()}
            optim_sd = self.optimizer.state_dict()
        c = self.cfg.checkpoint
        state = {"model": model_sd,
                 "model_config": self.model_config.to_dict(), "tokenizer": self.dataset.tokenizer_name,
                 "step": self.step, "optimizer": optim_sd, "loader": self.loader.state_dict(),
                 "method": self.method.state_dict(), "flops": self.flops.state_dict(), "rng": ckpt.rng_state(),
                 "elapsed_s": self.elapsed_s, "cpu_s": self.cpu_s, "config": self.cfg.to_dict(),
                 **self.flops.totals()}
        return ckpt.save_checkpoint(self.run_dir / "checkpoints", state, keep_last=c.keep_last,
                                    milestones=tuple(c.milestones))

    def _weights_finite(self) -> bool:
        """Every parameter finite, on every rank (a collective when distributed: save() is one already)."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.raw_model.parameters()]
        ok = torch.stack([torch.isfinite(p.detach()).all() for p in local]).all().float().reshape(1)
        if self.dist.enabled:
            import torch.distributed as dist

            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def _last_good_hint(self) -> str:
        path = ckpt.latest_checkpoint(self.run_dir)
        kept = ckpt.kept_steps(self.run_dir / "checkpoints")
        if path is None:
            return "There is no checkpoint of this run; start again with a lower train.lr or check the data."
        return (f"The last good checkpoint is {path} (kept steps: {', '.join(map(str, kept))}); resume with "
                "--resume (add run.allow_change=train.lr train.lr=LOWER to lower the learning rate) or from an "
                "earlier step with --resume-from STEP, or check the data")

    # ------------------------------------------------------------------ loop
    def train(self) -> RunResult:
        """Runs under the run directory's lock (rank 0), released however the run ends."""
        try:
            return self._train_locked()
        finally:
            if getattr(self, "_lock", None) is not None:
                self._lock.release()

    def _train_locked(self) -> RunResult:
        self._prepare_run_dir()
        self._maybe_resume()
        old_handler = signal.signal(signal.SIGTERM, self._on_sigterm) if _in_main_thread() else None
        t = self.cfg.train
        stopped_by, last_val = "max_steps", None
        self._log(f"run directory: {self.run_dir}  | method {self.cfg.method.name} | model {self.cfg.model.preset} "
                  f"({self.raw_model.num_params() / 1e6:.2f}M non-embedding params) | "
                  f"{t.micro_batch_size_seqs}x{self.cfg.data.seq_len} tokens x {t.grad_accum_steps} micro-steps "
                  f"x {self.dist.world_size} ranks = {self.global_batch_tokens} tokens/step")
        window_t0, window_tokens = time.perf_counter(), 0
        try:
            while self.step < t.max_steps:
                if self._budget_reached():
                    stopped_by = "max_flops"
                    break
                t0, c0 = time.perf_counter(), time.process_time()
                rec = self._train_one_step()
                self._sync_device()
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                self.elapsed_s += dt
                self.cpu_s += dc
                rec[M.STEP_CPU_S] = dc
                window_tokens += rec[M.TOKENS_SEEN + "_step"]
                if self.step % self.cfg.log.interval == 0 or self.step == t.max_steps:
                    now = time.perf_counter()
                    rec[M.TOKENS_PER_S] = window_tokens / max(now - window_t0, 1e-9)
                    window_t0, window_tokens = now, 0
                    self._emit_train(rec, dt)
                if self.cfg.eval.interval and self.step % self.cfg.eval.interval == 0:
                    last_val = self._evaluate()
                snapshots.maybe_snapshot(self, at_eval=False)
                if self._preempted_any_rank():
                    stopped_by = "preempted"
                    break
                if self.cfg.checkpoint.interval and self.step % self.cfg.checkpoint.interval == 0:
                    self.save()
            if last_val is None or self.cfg.eval.interval == 0 or self.step % self.cfg.eval.interval != 0:
                if stopped_by != "preempted":
                    last_val = self._evaluate()
            path = self.save()
            if path is not None:
                self._log(f"saved {path}")
            if self.dist.is_main:
                self._record_load_in_env()
            if stopped_by != "preempted" and self.dist.is_main:
                (self.run_dir / "result.json").write_text(json.dumps(
                    {"step": self.step, "stopped_by": stopped_by, "val_loss": last_val,
                     "elapsed_s": self.elapsed_s, "cpu_s": self.cpu_s, "load_avg": self._load_summary(),
                     **self.flops.totals()}, indent=2) + "\n")
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGTERM, old_handler)
            if self.dist.is_main and hasattr(self, "writer"):
                self.writer.close()
        self._log(f"done ({stopped_by}) at step {self.step}; run directory: {self.run_dir}")
        return RunResult(self.run_dir, self.step, last_val, stopped_by)

    def _progress_fraction(self) -> tuple[float, str]:
        """(fraction of the run done, the step total to show). Under a FLOPs budget that will bind before
        train.max_steps, progress is measured against the budget and the total is the projected step count
        (``~N``); otherwise against max_steps."""
        t = self.cfg.train
        by_steps = self.step / t.max_steps
        if t.max_flops > 0:
            by_flops = self.flops.totals()[self.cfg.flops.budget_counter] / t.max_flops
            if by_flops > by_steps:
                projected = math.ceil(self.step / by_flops) if by_flops > 0 else t.max_steps
                return min(by_flops, 1.0), f"~{min(projected, t.max_steps)} ({100 * by_flops:.0f}% of the FLOPs budget)"
        return by_steps, str(t.max_steps)

    def _sync_device(self) -> None:
        """On CUDA, wait for the step's kernels so that wall-clock per step is the step's real time."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _record_load_in_env(self) -> None:
        """env.json gains the load average seen during this process's part of the run (one entry per
        start or resume), so a report can tell runs taken on an idle machine from runs on a busy one."""
        path = self.run_dir / "env.json"
        summary = self._load_summary()
        if summary is None or not path.is_file():
            return
        try:
            env = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return
        env.setdefault("load_avg_during_run", []).append({"until_step": self.step, **summary})
        (self.run_dir / "env.json").write_text(json.dumps(env, indent=2) + "\n")

    def _load_summary(self) -> dict | None:
        """Mean and max of the 1-minute load average sampled at every log line of this process."""
        s = self._load_samples
        if not s:
            return None
        return {"mean_1m": sum(s) / len(s), "max_1m": max(s), "samples": len(s)}

    @property
    def global_batch_tokens(self) -> int:
        t = self.cfg.train
        return t.micro_batch_size_seqs * self.cfg.data.seq_len * t.grad_accum_steps * self.dist.world_size

    def _train_one_step(self) -> dict:
        t = self.cfg.train
        lr = lr_at(self.step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps,
                   decay_steps=t.lr_decay_steps or t.max_steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        batches = [self.loader.next_batch().to(self.device) for _ in range(t.grad_accum_steps)]
        res = forward_backward(self.model, self.raw_model, self.method, batches, self.opts, self.step + 1, lr)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), t.grad_clip if t.grad_clip > 0
                                                   else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        loss = float(res.loss)  # one host sync per step: needed to refuse a non-finite update
        if not math.isfinite(loss) or not math.isfinite(float(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingDiverged(f"non-finite loss ({loss}) or gradient norm ({float(grad_norm)}) at step "
                                   f"{self.step + 1}; the optimizer step was not taken. " + self._last_good_hint())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.method.on_step_end(self.step)
        self.flops.add_step(self.fm, self.method, res, world_size=self.dist.world_size)
        return self._train_record(res, loss, lr, float(grad_norm))

    def _train_record(self, res, loss: float, lr: float, grad_norm: float) -> dict:
        W = self.dist.world_size
        rec = {M.KIND: M.KIND_TRAIN, M.STEP: self.step, M.TRAIN_LOSS: loss, M.LR: lr, M.GRAD_NORM: grad_norm,
               M.TOKENS_SEEN + "_step": res.tokens_seen * W, M.KEPT_FRAC: res.tokens_kept / max(res.tokens_seen, 1)}
        rec["_res"] = res
        return rec

    def _emit_train(self, rec: dict, dt: float) -> None:
        res = rec.pop("_res")
        rec.pop(M.TOKENS_SEEN + "_step")
        rec[M.TRAIN_LOSS_ALL] = float(res.loss_all)
        rec.update(self._selection_metrics(res))
        rec[M.TOKENS_SEEN] = self.loader_tokens_seen()
        rec[M.ELAPSED_S] = self.elapsed_s
        rec[M.CPU_S] = self.cpu_s
        rec[M.STEP_TIME_S] = dt
        load = _load_avg()
        if load is not None:
            rec[M.LOAD_AVG_1M] = load[0]
            self._load_samples.append(load[0])
        rec.update(self.flops.totals())
        mfu = self._mfu(rec[M.TOKENS_PER_S])
        if mfu is not None:
            rec[M.MFU] = mfu
        if self.dist.is_main:
            self.writer.write(rec)
            self._progress(rec)

    def loader_tokens_seen(self) -> int:
        b = self.cfg.train.micro_batch_size_seqs  # a row selector may score extra candidate rows (GREATS pool)
        return self.step * self.global_batch_tokens // b * self.method.rows.candidate_rows(b)

    def _selection_metrics(self, res) -> dict:
        sels = [s for s in res.selections if s.stats]
        out = {}
        if self.method.tokens.score is not None:
            out[M.ALPHA] = self.method.tokens.alpha
        if not sels:
            return out
        mean = lambda key: float(torch.stack([s.stats[key].float() for s in sels]).mean())  # noqa: E731
        out.update({M.THRESHOLD: mean("threshold"), M.CVAR: mean("cvar"),
                    M.SCORE_KEPT_MEAN: mean("score_kept_mean"), M.SCORE_DROPPED_MEAN: mean("score_dropped_mean")})
        kept = sum(s.stats["kept_per_domain"] for s in sels)
        tot = sum(s.stats["tokens_per_domain"] for s in sels)
        for i, dom in enumerate(self.dataset.domains):
            if float(tot[i]) > 0:
                out[M.kept_frac_key(dom)] = float(kept[i] / tot[i])
        return out

    def _mfu(self, tokens_per_s: float) -> float | None:
        if self.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        peak = next((v for k, v in _PEAK_FLOPS.items() if k in name), None)
        return None if peak is None else tokens_per_s * self.fm.train_per_token / (peak * self.dist.world_size)

    def _evaluate(self) -> float:
        from eslm.eval.val_loss import evaluate

        t0 = time.perf_counter()
        res = evaluate(self.raw_model, self.val, self.weights, impl=self.cfg.train.loss_impl,
                       chunk_size=self.cfg.train.loss_chunk_size, autocast=self._autocast())
        rec = {M.KIND: M.KIND_EVAL, M.STEP: self.step, M.TOKENS_SEEN: self.loader_tokens_seen(),
               M.ELAPSED_S: self.elapsed_s, M.CPU_S: self.cpu_s, **self.flops.totals(), **res}
        if self.dist.is_main:
            self.writer.write(rec)
            doms = " ".join(f"{k.split('/', 1)[1]}={v:.3f}" for k, v in res.items() if "/" in k)
            self._log(f"eval step {self.step}: val_loss {res[M.VAL_LOSS]:.4f} ({doms}) "
                      f"[{time.perf_counter() - t0:.1f}s]")
        snapshots.maybe_snapshot(self, at_eval=True)
        return res[M.VAL_LOSS]

    def _budget_reached(self) -> bool:
        t = self.cfg.train
        return t.max_flops > 0 and self.flops.totals()[self.cfg.flops.budget_counter] >= t.max_flops

    def _preempted_any_rank(self) -> bool:
        """All ranks stop after the same step if any of them got SIGTERM (the checkpoint that follows is a
        collective under FSDP, and DDP's next all-reduce would wait on a rank that left)."""
        if not self.dist.enabled:
            return self._preempted
        import torch.distributed as dist

        flag = torch.tensor([float(self._preempted)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._preempted = bool(flag.item())
        return self._preempted

    def _on_sigterm(self, signum, frame) -> None:
        self._preempted = True
        self._log("SIGTERM: saving a checkpoint after this step and exiting")

    # ------------------------------------------------------------------ output
    def _log(self, msg: str) -> None:
        if self.dist.is_main:
            print(msg, flush=True)

    def _progress(self, rec: dict) -> None:
        done, total = self._progress_fraction()
        remaining = self.elapsed_s * (1.0 - done) / max(done, 1e-12)
        parts = [f"step {self.step}/{total}", f"loss {rec[M.TRAIN_LOSS]:.4f}", f"lr {rec[M.LR]:.2e}"]
        if M.ALPHA in rec:
            parts.append(f"kept {rec[M.KEPT_FRAC]:.3f} (alpha {rec[M.ALPHA]:.3f})")
        parts.append(f"{rec[M.TOKENS_PER_S] / 1e3:.1f}k tok/s")
        if M.MFU in rec:
            parts.append(f"MFU {100 * rec[M.MFU]:.1f}%")
        parts.append(f"ETA {_fmt_time(remaining)}")
        print(" | ".join(parts), flush=True)


def check_data_tokenizer(dataset, tokenizer: str) -> None:
    """data.tokenizer must name the tokenizer the data was prepared with (it decides e.g. init_from checks)."""
    if dataset.tokenizer_name != tokenizer:
        raise ConfigError(f"data.tokenizer={tokenizer!r}, but {dataset.path} was prepared with the "
                          f"{dataset.tokenizer_name!r} tokenizer; set data.tokenizer={dataset.tokenizer_name} "
                          f"(or prepare the data with {tokenizer!r})")


def _read_env(run_dir: Path) -> dict:
    """The run's env.json (written at its start), {} when unreadable: the trackers' run config."""
    try:
        return json.loads((run_dir / "env.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _parse_weights(spec: str):
    """'unif' / 'doremi' / 'natural' or 'code=0.5,docs=0.5' -> what resolve_weights takes."""
    if "=" not in spec:
        return spec
    out = {}
    for part in spec.split(","):
        k, _, v = part.partition("=")
        try:
            out[k.strip()] = float(v)
        except ValueError:
            raise ConfigError(f"data.weights: expected domain=weight pairs, got {part!r}") from None
    return out


def _load_avg() -> list[float] | None:
    """The machine's (1, 5, 15)-minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def train(cfg: Config) -> RunResult:
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        shutdown(trainer.dist)
