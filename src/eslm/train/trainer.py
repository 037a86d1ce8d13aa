"""The training loop (orchestration only): open the run directory, resume, then steps until ``train.max_steps``,
the FLOPs budget or SIGTERM, evaluating, snapshotting and saving on their intervals."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eslm import metrics as M
from eslm.config import Config, method_context
from eslm.data.loader import StepBatches
from eslm.eval import val_loss as validation
from eslm.files import atomic_write
from eslm.flops import FlopsCounter, FlopsModel
from eslm.methods import build_method
from eslm.model.gpt import GPT
from eslm.train import checkpoint as ckpt
from eslm.train import setup, snapshots
from eslm.train.branch import read_branch_point
from eslm.train.distributed import full_state_dicts, init_distributed, load_full_state_dicts, shutdown
from eslm.train.optim import build_optimizer, plan_schedule, skips_on_device, step_if_finite
from eslm.train.records import Update, eval_record, progress_line, readout, selection_metrics, train_record
from eslm.train.resume import check_checkpoint_of_run, open_run_dir, record_resumed_at
from eslm.train.run_dir import MetricsWriter, last_records
from eslm.train.step import StepOptions, forward_backward
from eslm.train.stopping import Budget, Preemption, TrainingDiverged, check_update, last_good_hint
from eslm.train.timing import LoadSampler, Throughput, mfu, timed

__all__ = ["RunResult", "Trainer", "TrainingDiverged", "train"]


@dataclass
class RunResult:
    run_dir: Path
    step: int
    val_loss: float | None
    stopped_by: str  # "max_steps" | "max_flops" | "preempted"


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg, t = cfg, cfg.train
        self.dist, self.device = init_distributed(t.device, cfg.distributed.backend)
        setup.setup_torch(cfg, self.dist.rank, self.device)
        self.dataset = setup.open_data(cfg, self.dist)
        self.model_config = setup.checked_model_config(cfg, self.dataset)
        self.run_dir = Path(cfg.run.out_dir) / (cfg.run.name or f"{cfg.method.name}-{cfg.model.preset}-s{cfg.run.seed}")
        # FSDP2 only with more than one process; raw_model is then the sharded module itself (DTensor parameters)
        self.fsdp = cfg.distributed.fsdp and self.dist.enabled
        if cfg.distributed.fsdp and not self.dist.enabled:
            self._log("distributed.fsdp=true is ignored with one process (nothing to shard)")
        self.raw_model = GPT(self.model_config).to(self.device)
        if cfg.model.init_from:
            self.model_config, self.raw_model = setup.init_from(cfg, self.dataset, self.model_config,
                                                                self.raw_model, self.device, self._log)
        self.model = setup.wrap(self.raw_model, cfg, self.dist, self.device, self.fsdp)
        self.optimizer = build_optimizer(self.raw_model, lr=t.lr, weight_decay=t.weight_decay,
                                         betas=(t.beta1, t.beta2), device_type=self.device.type)
        self.weights, self.loader, self.val = setup.data_streams(cfg, self.dataset, self.dist, self.device)
        self.method = build_method(method_context(
            cfg, device=self.device, n_domains=len(self.dataset.domains), rank=self.dist.rank,
            model_config=self.model_config,
            val_loader_factory=setup.val_loader_factory(cfg, self.dataset, self.weights, self.dist)))
        # a step ahead on CUDA; the row selector says how many micro-batches a step reads (instance selection: more)
        self.batches = StepBatches(self.loader, self.device, self.method.rows.candidate_batches(t.grad_accum_steps))
        self.fm = FlopsModel.from_config(self.model_config, cfg.data.seq_len)
        # a branched run continues another run's checkpoint (eslm.train.branch)
        self.branch = read_branch_point(cfg, self.global_batch_tokens) if t.branch_from else None
        self.schedule = plan_schedule(cfg, self.method, self.fm, self.branch)  # before resume: Ada at its start
        self.flops = FlopsCounter(cfg.flops.count_per)
        self.budget = Budget(t.max_steps, t.max_flops, cfg.flops.budget_counter)
        self.step, self.elapsed_s, self.cpu_s = 0, 0.0, 0.0
        self.load = LoadSampler()
        self.opts = StepOptions(accum_steps=t.grad_accum_steps, normalize=t.normalize,
                                world_size=self.dist.world_size, autocast=setup.autocast_for(t.dtype, self.device))
        self._lock = self._resume_changes = None
        self.writer: MetricsWriter | None = None  # rank 0's, once the run directory is open

    # ------------------------------------------------------------------ the loop
    def train(self) -> RunResult:
        """Runs under the run directory's lock (rank 0), released however the run ends."""
        try:
            return self._train_locked()
        finally:
            if self._lock is not None:
                self._lock.release()

    def _train_locked(self) -> RunResult:
        if self.dist.is_main:
            self._lock, self._resume_changes, self.writer = open_run_dir(
                self.run_dir, self.cfg, device=self.device, world_size=self.dist.world_size,
                num_params=self.raw_model.num_params(), log=self._log)
        self._maybe_resume()
        self._log(self._banner())
        c, max_steps = self.cfg, self.cfg.train.max_steps
        stopped_by, last_val, throughput = "max_steps", None, Throughput()
        with Preemption(self.dist, self.device, self._log) as preemption:  # held until the final save is written
            try:
                while self.step < max_steps:
                    if self.budget.flops_reached(self.flops.totals()):
                        stopped_by = "max_flops"
                        break
                    # where the update is queued before the step's read, that read is the step's end: no second sync
                    update, dt, dc = timed(self._train_one_step, self.device,
                                           synchronize=not skips_on_device(self.optimizer))
                    self.elapsed_s += dt
                    self.cpu_s += dc
                    throughput.add(update.tokens_seen, dt)  # the step's own time: evaluation excluded
                    if self._logs_at(self.step):
                        self._log_step(update, dt, dc, throughput.read())
                    if c.eval.interval and self.step % c.eval.interval == 0:
                        last_val = self._evaluate()
                    snapshots.maybe_snapshot(self, at_eval=False)
                    if preemption.any_rank():
                        stopped_by = "preempted"
                        break
                    if c.checkpoint.interval and self.step % c.checkpoint.interval == 0:
                        self.save()
                evaluated_now = last_val is not None and c.eval.interval and self.step % c.eval.interval == 0
                if stopped_by != "preempted" and not evaluated_now:
                    last_val = self._evaluate()
                self._finish(stopped_by, last_val)
            finally:
                if self.writer is not None:
                    self.writer.close()
        self._log(f"done ({stopped_by}) at step {self.step}; run directory: {self.run_dir}")
        return RunResult(self.run_dir, self.step, last_val, stopped_by)

    def _train_one_step(self) -> Update:
        t = self.cfg.train
        lr = self.schedule.lr(self.step, lr=t.lr, min_lr=t.min_lr)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        batches = self.batches.next_step()
        res = forward_backward(self.model, self.raw_model, self.method, batches, self.opts, self.step + 1, lr)
        self.batches.prefetch()  # CUDA: the next step's batches drawn and copied while this one's work runs
        norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), t.grad_clip if t.grad_clip > 0
                                              else float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP: a replicated DTensor
            norm = norm.full_tensor()
        # the step's one host sync: loss, gradient norm (and what a logged step records) read together, after
        # the update is queued where the optimizer skips a non-finite update on the device (train/optim.py)
        values = step_if_finite(self.optimizer, readout(res, norm, self._logs_at(self.step + 1)))
        self.optimizer.zero_grad(set_to_none=True)
        loss, grad_norm, loss_all = values[:3]
        check_update(loss, grad_norm, self.step + 1, self.run_dir)  # raises; the update was not applied
        self.step += 1
        self.method.on_step_end(self.step)
        self.flops.add_step(self.fm, self.method, res, world_size=self.dist.world_size)
        return Update(res, loss, lr, grad_norm, tokens_seen=res.tokens_seen * self.dist.world_size,
                      loss_all=loss_all, selection=values[3:])

    def _logs_at(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) writes a train record."""
        return step % self.cfg.log.interval == 0 or step == self.cfg.train.max_steps

    def _finish(self, stopped_by: str, last_val: float | None) -> None:
        """The final checkpoint, the load summary in env.json and (unless preempted) result.json."""
        path = self.save()
        if path is not None:
            self._log(f"saved {path}")
        if not self.dist.is_main:
            return
        self.load.record_in_env(self.run_dir, self.step)
        if stopped_by != "preempted":
            atomic_write(self.run_dir / "result.json", (json.dumps(
                {"step": self.step, "stopped_by": stopped_by, M.VAL_LOSS: last_val, M.ELAPSED_S: self.elapsed_s,
                 M.CPU_S: self.cpu_s, "load_avg": self.load.summary(), **self.flops.totals(),
                 **({"branch": self.branch.summary()} if self.branch is not None else {})}, indent=2) + "\n").encode())

    # ------------------------------------------------------------------ records
    def _log_step(self, update: Update, dt: float, dc: float, tokens_per_s: float) -> None:
        rec = train_record(
            update, self.step, tokens_seen_total=self.loader_tokens_seen(), step_cpu_s=dc, step_time_s=dt,
            tokens_per_s=tokens_per_s, elapsed_s=self.elapsed_s, cpu_s=self.cpu_s,
            selection=selection_metrics(update.selection, self.method.tokens, self.dataset.domains),
            flops_totals=self.flops.totals(), load_avg_1m=self.load.sample(),
            mfu=mfu(tokens_per_s, self.fm.train_per_token, self.device, self.dist.world_size))
        if self.dist.is_main:
            assert self.writer is not None
            self.writer.write(rec)
            done, total = self.budget.progress(self.step, self.flops.totals())
            print(progress_line(rec, self.step, total, done, self.elapsed_s), flush=True)

    def _evaluate(self) -> float:
        t0 = time.perf_counter()
        t = self.cfg.train
        if self.dist.is_main:  # the evaluation can take a while: say what it is doing before it starts
            n = sum(len(bs) for bs in self.val.values())
            self._log(f"eval step {self.step}: {n} batches over {len(self.val)} domain(s)...")
        res = validation.evaluate(self.raw_model, self.val, self.weights, impl=t.loss_impl,
                                  chunk_size=t.loss_chunk_size, autocast=setup.autocast_for(t.dtype, self.device))
        if self.dist.is_main:
            assert self.writer is not None
            self.writer.write(eval_record(self.step, tokens_seen_total=self.loader_tokens_seen(),
                                          elapsed_s=self.elapsed_s, cpu_s=self.cpu_s,
                                          flops_totals=self.flops.totals(), val=res))
            doms = " ".join(f"{k.split('/', 1)[1]}={v:.3f}" for k, v in res.items() if "/" in k)
            self._log(f"eval step {self.step}: val_loss {res[M.VAL_LOSS]:.4f} ({doms}) "
                      f"[{time.perf_counter() - t0:.1f}s]")
        snapshots.maybe_snapshot(self, at_eval=True)
        return res[M.VAL_LOSS]

    @property
    def global_batch_tokens(self) -> int:
        t = self.cfg.train
        return t.micro_batch_size_seqs * self.cfg.data.seq_len * t.grad_accum_steps * self.dist.world_size

    def loader_tokens_seen(self) -> int:
        # a row selector may read more micro-batches per step (instance selection) and score extra candidate rows
        # per micro-batch (GREATS pool)
        t, rows = self.cfg.train, self.method.rows
        return (self.step * rows.candidate_batches(t.grad_accum_steps) * self.dist.world_size * self.cfg.data.seq_len
                * rows.candidate_rows(t.micro_batch_size_seqs))

    # ------------------------------------------------------------------ checkpoints
    def _maybe_resume(self) -> None:
        if not self.cfg.run.resume:
            self._maybe_branch()
            return
        rf = self.cfg.run.resume_from
        path = ckpt.checkpoint_at(self.run_dir, rf) if rf else ckpt.latest_checkpoint(self.run_dir)
        if path is None:
            if self.branch is None:
                self._log(f"no checkpoint in {self.run_dir}; starting from step 0")
            self._maybe_branch()
        else:
            self._restore(path)
            self._log(f"resumed from {path} at step {self.step}")
        if self.dist.is_main:
            record_resumed_at(self.run_dir, self.cfg, self._resume_changes, self.step, self._log)

    def _maybe_branch(self) -> None:
        """A branched run's start: the trunk's checkpoint without its method state, and the trunk's evaluation
        at the branch point as this run's first eval record (the same weights: the curves start there)."""
        if self.branch is None:
            return
        self._restore(self.branch.path, own=False)
        if self.dist.is_main and self.writer is not None:
            trunk_metrics = self.branch.path.parent.parent / "metrics.jsonl"
            records = last_records(trunk_metrics)[0] if trunk_metrics.is_file() else []
            for rec in records:
                if rec.get(M.KIND) == M.KIND_EVAL and rec.get(M.STEP) == self.step:
                    self.writer.write(rec)
        self._log(f"branched from {self.branch.path} at step {self.step} (its weights, optimizer state and data "
                  f"position; {self.cfg.method.name} from here, to step ~{self.schedule.end_step})")

    def _restore(self, path: Path, own: bool = True) -> None:
        # FSDP: every rank reads the full file memory-mapped on CPU (one page cache) and keeps its shard
        state = ckpt.load_checkpoint(path, map_location="cpu" if self.fsdp else self.device, mmap=self.fsdp)
        ckpt.check_model_matches(state, self.model_config.to_dict(), path)
        if own:  # method, seed, data: this run's (a branch's trunk was checked by read_branch_point)
            check_checkpoint_of_run(state, self.cfg, self.run_dir, path)
        if self.fsdp:
            load_full_state_dicts(self.raw_model, self.optimizer, state["model"], state["optimizer"])
        else:
            self.raw_model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.batches.load_state_dict(state["loader"])
        if own:  # a branch starts its own method afresh
            self.method.load_state_dict(state["method"])
        self.flops.load_state_dict(state["flops"])
        ckpt.set_rng_state(state["rng"])
        self.step, self.elapsed_s, self.cpu_s = state["step"], state[M.ELAPSED_S], float(state[M.CPU_S])

    def save(self) -> Path | None:
        """Rank 0 writes the checkpoint; under FSDP every rank must call this (the full state dicts are gathered)."""
        bad = self._not_finite()
        if bad is not None:
            raise TrainingDiverged(f"the {bad} at step {self.step} {'is' if bad.endswith('state') else 'are'} not "
                                   "finite; no checkpoint was written. " + last_good_hint(self.run_dir))
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
                 "step": self.step, "optimizer": optim_sd, "loader": self.batches.state_dict(),
                 "method": self.method.state_dict(), "flops": self.flops.state_dict(), "rng": ckpt.rng_state(),
                 M.ELAPSED_S: self.elapsed_s, M.CPU_S: self.cpu_s, "config": self.cfg.to_dict(),
                 **self.flops.totals()}
        return ckpt.save_checkpoint(self.run_dir / "checkpoints", state, keep_last=c.keep_last,
                                    milestones=tuple(c.milestones))

    def _not_finite(self) -> str | None:
        """"weights" or "optimizer state" when one of them holds a NaN or inf on any rank, else None (a
        collective when distributed: save() is one already)."""
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        params = [local(p).detach() for p in self.raw_model.parameters()]
        moments = [local(v) for st in self.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.is_floating_point()]
        ok = torch.stack([torch.stack([torch.isfinite(t).all() for t in ts]).all() if ts else
                          torch.tensor(True, device=self.device) for ts in (params, moments)]).float()
        if self.dist.enabled:
            import torch.distributed as dist

            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        flags = ok.tolist()
        return "weights" if not flags[0] else "optimizer state" if not flags[1] else None

    # ------------------------------------------------------------------ output
    def _banner(self) -> str:
        # N as the FLOPs model counts it (all but the position embedding), split so that the tied embedding / LM
        # head, which dominates a small model with GPT-2's vocabulary, is not read as trunk
        t, n, emb = self.cfg.train, self.raw_model.num_params(), self.raw_model.head_weight.numel()
        return (f"run directory: {self.run_dir}  | method {self.cfg.method.name} | model {self.cfg.model.preset} "
                f"({n / 1e6:.2f}M params: {(n - emb) / 1e6:.2f}M in the blocks + {emb / 1e6:.2f}M tied "
                f"embedding/head) | "
                f"{t.micro_batch_size_seqs}x{self.cfg.data.seq_len} tokens x {t.grad_accum_steps} micro-steps "
                f"x {self.dist.world_size} ranks = {self.global_batch_tokens} tokens/step | lr warmup "
                f"{self.schedule.warmup_steps} steps, cosine to step {self.schedule.decay_steps}"
                + (f" (x{self.schedule.ratio:.4f}: this run's steps at the FLOPs budget)"
                   if self.schedule.ratio != 1.0 and not self.branch else "")
                + (f"; branched at step {self.branch.step}, cosine continued to step {self.schedule.end_step}"
                   if self.branch else ""))

    def _log(self, msg: str) -> None:
        if self.dist.is_main:
            print(msg, flush=True)


def train(cfg: Config) -> RunResult:
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        shutdown(trainer.dist)
