"""ESLM in a Hugging Face ``Trainer`` or a TRL ``SFTTrainer`` without the full logits: ``use_eslm(trainer, ...)``
patches the model's training forward, makes ``num_items_in_batch`` the step's kept tokens and puts
``SelectiveLossCallback`` first (``remove()`` undoes all three); docs/dropin.md ("Hugging Face")."""

from __future__ import annotations

import functools
import sys
import types

import torch

from eslm.api import AdaAlpha, kept_tokens, select_tokens, selective_loss, shift_for_causal_lm
from eslm.api.ada import AlphaHandle
from eslm.api.head import check_head_logits, head_transform
from eslm.errors import ConfigError

try:
    from transformers import TrainerCallback
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
except ImportError as e:  # transformers is an optional extra
    raise ImportError("eslm.integrations.hf needs transformers; found none installed; "
                      "fix: pip install 'eslm[hf]'") from e

IGNORE_INDEX = -100
METRICS = ("eslm/kept_frac", "eslm/var", "eslm/cvar")


class _Metrics:
    """Selection statistics summed on the device since the last log (read, with one sync, at log time). The
    count is the tensor's last entry and a popped sum is zeroed, not dropped: the state a compiled forward
    reads keeps its type, so logging costs no recompile."""

    def __init__(self, device=None):
        self.sums = torch.zeros(len(METRICS) + 1, device=device)

    def add(self, stats) -> None:
        v = torch.stack([stats.kept_frac.float(), stats.threshold.float(), stats.cvar.float(),
                         torch.ones_like(stats.cvar, dtype=torch.float32)]).detach()
        self.sums = self.sums.to(v.device) + v

    def pop(self) -> dict:
        *sums, count = self.sums.tolist()
        self.sums = torch.zeros_like(self.sums)
        return dict(zip(METRICS, (x / count for x in sums))) if count else {}


class SelectiveCausalLM(AlphaHandle):
    """The handle ``use_eslm`` / ``patch_causal_lm`` return: the options, the Ada controller, the metrics."""

    def __init__(self, model, *, alpha: float, score: str, scope: str, ada: AdaAlpha | None, impl: str,
                 chunk_size: int):
        device = model.get_output_embeddings().weight.device
        super().__init__(alpha, ada, device)
        self.model, self.score, self.scope, self.impl, self.chunk_size = model, score, scope, impl, chunk_size
        self.label_smoothing = 0.0  # the Trainer's label_smoothing_factor (use_eslm), on the kept tokens
        self._verified = False
        self.metrics = _Metrics(None if device.type == "meta" else device)
        self._original_forward = model.__dict__.get("forward")  # an instance patch (TRL's) or None
        self._undo: list = []
        wrapped = model.forward
        self._original_call = wrapped
        model.forward = types.MethodType(functools.wraps(type(model).forward)(
            lambda _self, *a, **kw: self._forward(wrapped, *a, **kw)), model)

    def remove(self) -> None:
        """Undo the patches (the model's forward, the trainer's count, the callback)."""
        if self._original_forward is None:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.forward = self._original_forward
        for undo in self._undo:
            undo()
        self._undo = []

    def _observe(self, stats) -> None:
        self.metrics.add(stats)
        if self.ada is not None:
            self.ada.observe(stats)

    def _forward(self, wrapped, *args, **kwargs):
        if not self.model.training or (kwargs.get("labels") is None and kwargs.get("shift_labels") is None):
            return wrapped(*args, **kwargs)  # eval, generation, no labels: the model's own forward and loss
        if kwargs.get("fused_lm_head"):
            if self.label_smoothing:
                raise ConfigError("label_smoothing_factor with TRL's fused head: TRL returns per-token "
                                  "log-probabilities only, so the smoothed loss cannot be formed; fix: "
                                  "label_smoothing_factor=0 under SFTTrainer")
            return self._select_on_trl(wrapped, *args, **kwargs)
        return self._hidden_forward(*args, **kwargs)

    def _hidden_forward(self, *args, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        kwargs.pop("logits_to_keep", None)
        kwargs["use_cache"] = False
        cfg = self.model.config.get_text_config()
        router = kwargs.get("output_router_logits")
        router = bool(getattr(cfg, "output_router_logits", False)) if router is None else bool(router)
        if router:
            kwargs["output_router_logits"] = True
        if not self._verified and not torch.compiler.is_compiling():
            self._verify_head(args[0] if args else kwargs.get("input_ids"))
        out = self.model.base_model(*args, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        hidden, targets = shift_for_causal_lm(hidden, labels) if shift_labels is None else (hidden, shift_labels)
        head = self.model.get_output_embeddings()
        loss, stats = selective_loss(
            targets.to(hidden.device), hidden=hidden, lm_weight=head.weight, bias=getattr(head, "bias", None),
            **head_transform(self.model.config), score=self.score, alpha=self.loss_alpha(), scope=self.scope,
            position_ids=kwargs.get("position_ids") if self.scope == "sequence" else None,
            num_items_in_batch=num_items_in_batch, impl=self.impl, chunk_size=self.chunk_size,
            alpha_min=self.ada.alpha_min if self.ada is not None else self._alpha,
            label_smoothing=self.label_smoothing)
        self._observe(stats)
        if not router:
            return CausalLMOutputWithPast(loss=loss)
        aux, coef = self._aux_loss(out, kwargs.get("attention_mask"))
        return MoeCausalLMOutputWithPast(loss=loss + coef * aux.to(loss.device), aux_loss=aux)

    def _aux_loss(self, out, attention_mask):
        """The MoE load-balancing loss and its coefficient, as the model's own forward adds them when it returns
        router logits; a model whose loss eslm cannot find is refused (no loss is silently dropped)."""
        cfg = self.model.config.get_text_config()
        func = getattr(sys.modules.get(type(self.model).__module__), "load_balancing_loss_func", None)
        experts = next((v for v in (getattr(self.model, "num_experts", None), getattr(cfg, "num_local_experts", None),
                                    getattr(cfg, "num_experts", None)) if v is not None), None)
        top_k = getattr(self.model, "num_experts_per_tok", getattr(cfg, "num_experts_per_tok", None))
        coef = getattr(self.model, "router_aux_loss_coef", getattr(cfg, "router_aux_loss_coef", None))
        logits = getattr(out, "router_logits", None)
        if func is None or experts is None or top_k is None or coef is None or logits is None:
            raise ConfigError(f"{type(self.model).__name__} returns router logits (config.output_router_logits) but "
                              "eslm cannot find its load-balancing loss (load_balancing_loss_func, num_experts, "
                              "num_experts_per_tok, router_aux_loss_coef); fix: set "
                              "model.config.output_router_logits = False to train without the auxiliary loss")
        return func(logits, experts, top_k, attention_mask), float(coef)

    @torch.no_grad()
    def _verify_head(self, ids: torch.Tensor | None) -> None:
        """Once, when patching (on a few synthetic tokens) or else on the first eager training forward: the model's
        own logits must be what eslm computes from the hidden states and the config's head transform."""
        if ids is None:
            return  # inputs_embeds only: nothing cheap to probe with (the config check still ran)
        probe = {"input_ids": ids[:1, :8], "use_cache": False}
        if hasattr(self.model.config.get_text_config(), "output_router_logits"):
            probe["output_router_logits"] = False  # the logits alone
        was_training = self.model.training
        self.model.eval()
        try:
            own = self._original_call(**probe).logits.float()
            out = self.model.base_model(**probe)
        finally:
            self.model.train(was_training)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        head = self.model.get_output_embeddings()
        check_head_logits(own, hidden, head.weight, getattr(head, "bias", None), head_transform(self.model.config),
                          self.model.config,
                          type(self.model).__name__)
        self._verified = True

    def _select_on_trl(self, wrapped, *args, num_items_in_batch=None, **kwargs):
        """TRL's fused forward gives per-token log-probabilities (with gradient), entropies and a label mask of
        shape (B, T-1) (or (B, T) with shift_labels): the dropped tokens' log-probabilities are zeroed, so TRL's
        -sum(log_probs) / num_items_in_batch is the selective loss."""
        out = wrapped(*args, num_items_in_batch=num_items_in_batch, **kwargs)
        if self.score == "entropy" and out.entropy is None:
            raise ConfigError("score='entropy' needs TRL's per-token entropy; found none; fix: score='loss'")
        position_ids = kwargs.get("position_ids")
        if self.scope == "sequence" and position_ids is not None and kwargs.get("shift_labels") is None:
            position_ids = position_ids[:, :-1]
        scores = out.entropy if self.score == "entropy" else -out.log_probs.detach()
        kept, stats = select_tokens(scores, out.label_mask, alpha=self.loss_alpha(), scope=self.scope,
                                    position_ids=position_ids if self.scope == "sequence" else None)
        out.log_probs = torch.where(kept, out.log_probs, torch.zeros_like(out.log_probs))
        denom = num_items_in_batch if num_items_in_batch is not None else stats.num_kept.clamp(min=1)
        out.loss = -out.log_probs.sum() / denom
        if getattr(out, "aux_loss", None) is not None:  # TRL's fused forward adds the MoE loss; keep it
            out.loss = out.loss + getattr(self.model.config.get_text_config(), "router_aux_loss_coef", 0.0) * out.aux_loss
        self._observe(stats)
        return out


def patch_causal_lm(model, *, alpha: float = 0.1, score: str = "entropy", scope: str = "batch",
                    ada: AdaAlpha | None = None, impl: str = "auto", chunk_size: int = 1024) -> SelectiveCausalLM:
    """Make ``model(**batch, labels=...)`` return the selective loss in training mode, without full logits
    (for your own loop; pass ``num_items_in_batch=`` to the forward for a step-exact mean)."""
    if score not in ("entropy", "loss"):
        raise ConfigError(f"score must be 'entropy' or 'loss'; found {score!r}")
    if model.get_output_embeddings() is None or not hasattr(model, "base_model"):
        raise ConfigError(f"expected a causal LM with an LM head (get_output_embeddings()); found "
                          f"{type(model).__name__}; fix: pass an AutoModelForCausalLM model")
    head_transform(model.config)  # an LM head eslm cannot reproduce is refused now, not at the first step
    weight = model.get_output_embeddings().weight
    sel = SelectiveCausalLM(model, alpha=alpha, score=score, scope=scope, ada=ada, impl=impl, chunk_size=chunk_size)
    if weight.device.type != "meta":
        ids = torch.arange(3, 3 + min(8, weight.shape[0] - 3), device=weight.device)[None]
        try:
            sel._verify_head(ids)
        except ConfigError:
            sel.remove()
            raise
        except Exception:  # noqa: BLE001 - a model that needs more than token ids: checked on the first forward
            pass
    return sel


class SelectiveLossFunc:
    """ESLM through the Trainer's public hook, ``compute_loss_func=SelectiveLossFunc(alpha=0.1)``, for a model
    ``use_eslm`` cannot patch (docs/dropin.md): a micro-batch with N_i of the step's N labels != -100 returns its
    kept mean x N_i / N. ``metrics`` and ``ada`` as on ``use_eslm``'s handle (call ``ada.step()`` after each
    optimizer step)."""

    def __init__(self, *, alpha: float = 0.1, score: str = "entropy", ada: AdaAlpha | None = None):
        if score not in ("entropy", "loss"):
            raise ConfigError(f"score must be 'entropy' or 'loss'; found {score!r}")
        kept_tokens(torch.zeros(1, dtype=torch.long), alpha=alpha)  # a bad alpha is refused now
        self.alpha, self.score, self.ada = alpha, score, ada
        self.metrics = _Metrics()

    def __call__(self, outputs, labels, num_items_in_batch=None):
        if labels is None:
            raise ConfigError("SelectiveLossFunc: expected the batch's labels; found none; fix: a collator that "
                              "sets labels (e.g. DataCollatorForLanguageModeling(tokenizer, mlm=False))")
        if getattr(outputs, "aux_loss", None) is not None:
            raise ConfigError("SelectiveLossFunc: the model returns an MoE aux loss, which compute_loss_func "
                              "would drop; fix: use_eslm(trainer) (it adds it), or config.output_router_logits = False")
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        logits, targets = shift_for_causal_lm(logits, labels.to(logits.device))
        alpha = self.ada.alpha if self.ada is not None else self.alpha
        loss, stats = selective_loss(targets, logits=logits, score=self.score, alpha=alpha,
                                     ignore_index=IGNORE_INDEX)
        if num_items_in_batch is not None:
            # weighted by this micro-batch's share of the Trainer's count (labels != -100, counted as it counts)
            loss = loss * (labels != IGNORE_INDEX).sum() / num_items_in_batch
        self.metrics.add(stats)
        if self.ada is not None:
            self.ada.observe(stats)
        return loss


def _targets_of(batch: dict) -> torch.Tensor:
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return torch.nn.functional.pad(batch["labels"][..., 1:], (0, 1), value=IGNORE_INDEX)


def _check_trainer(trainer) -> None:
    args = trainer.args
    problems = []
    if getattr(trainer, "compute_loss_func", None) is not None:
        problems.append("a compute_loss_func (drop it: ESLM is the loss; or keep the Trainer's own forward and pass "
                        "compute_loss_func=SelectiveLossFunc(alpha=...) instead of use_eslm)")
    if getattr(args, "use_liger_kernel", False):
        problems.append("use_liger_kernel (it pops the labels and builds its own loss; set it False)")
    if getattr(args, "n_gpu", 1) > 1:
        problems.append("DataParallel over several GPUs (launch one process per GPU: DDP)")
    for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
        if getattr(trainer, name, lambda: 1)() > 1:
            problems.append(f"{name[4:6]} parallelism (its item count is divided differently)")
    if problems:
        raise ConfigError("use_eslm: this Trainer uses " + "; ".join(problems))


def use_eslm(trainer, *, alpha: float = 0.1, score: str = "entropy", scope: str = "batch",
             ada: AdaAlpha | None = None, impl: str = "auto", chunk_size: int = 1024) -> SelectiveCausalLM:
    """Train ``trainer.model`` with ESLM's selective loss (see the module docstring). Returns the handle."""
    _check_trainer(trainer)
    model = trainer.model
    if hasattr(model, "get_base_model"):  # PEFT: patch the wrapped causal LM
        model = model.get_base_model()
    sel = patch_causal_lm(model, alpha=alpha, score=score, scope=scope, ada=ada, impl=impl, chunk_size=chunk_size)
    smoother = getattr(trainer, "label_smoother", None)
    if smoother is not None:
        # the Trainer pops the labels and smooths the full logits itself: hand its epsilon to the selective loss
        # (applied to the kept tokens, as LabelSmoother applies it to the valid ones) and keep the labels
        if getattr(smoother, "ignore_index", IGNORE_INDEX) != IGNORE_INDEX:
            sel.remove()
            raise ConfigError(f"use_eslm: expected the Trainer's LabelSmoother to ignore -100; found "
                              f"{smoother.ignore_index}")
        sel.label_smoothing = float(smoother.epsilon)
        trainer.label_smoother = None
    original_count = trainer.get_batch_samples
    original_accepts = trainer.model_accepts_loss_kwargs

    def get_batch_samples(epoch_iterator, num_batches, device):
        batches, n_items = original_count(epoch_iterator, num_batches, device)
        if not batches or n_items is None:
            return batches, n_items
        k = sum(kept_tokens(_targets_of(b), alpha=sel.alpha, scope=scope,
                            position_ids=b.get("position_ids") if scope == "sequence" else None).to(device)
                for b in batches)
        if trainer.args.average_tokens_across_devices and trainer.args.world_size > 1:
            k = trainer.accelerator.gather(k).sum()
        return batches, k

    trainer.get_batch_samples = get_batch_samples
    trainer.model_accepts_loss_kwargs = True  # so the Trainer passes num_items_in_batch to the forward
    callback = SelectiveLossCallback(sel)
    trainer.callback_handler.callbacks.insert(0, callback)

    def undo():
        if smoother is not None:
            trainer.label_smoother = smoother
        trainer.__dict__.pop("get_batch_samples", None)
        trainer.model_accepts_loss_kwargs = original_accepts
        trainer.callback_handler.callbacks.remove(callback)

    sel._undo.append(undo)
    return sel


class SelectiveLossCallback(TrainerCallback):
    """Logs the selection (means since the last log) and steps Ada after every optimizer step."""

    def __init__(self, sel: SelectiveCausalLM):
        self.sel = sel

    def on_step_end(self, args, state, control, **kwargs):
        if self.sel.ada is not None:
            self.sel.ada.step()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:  # training logs only (eval logs carry eval_loss)
            return
        extra = self.sel.metrics.pop()
        extra["eslm/alpha"] = self.sel.alpha
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)  # the Trainer appended its copy before calling the callbacks
