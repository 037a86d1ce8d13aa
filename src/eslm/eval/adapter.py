"""The lm-eval ``LM`` adapter for our model, registered in lm-eval as ``eslm`` (``lm_class``): it evaluates exactly
the module we trained with our own tokenizers and needs no transformers (why an adapter and not an HF export,
and how each request type follows the harness's HF model: docs/evaluation.md).
"""

from __future__ import annotations

import functools

import torch

from eslm.data.tokenizers import resolve_tokenizer
from eslm.errors import ConfigError
from eslm.eval.generate import generate
from eslm.eval.scoring import cut_at_stop, encode_pair, rolling_windows, score_continuations
from eslm.model.loading import load_model


@functools.cache
def lm_class():
    """The registered lm-eval ``LM`` subclass ``eslm`` (built on first use: lm_eval is optional)."""
    from lm_eval.api.model import LM

    class ESLMLM(LM):
        """lm-eval adapter around an eslm ``GPT`` and tokenizer (``.encode``, ``.decode``, ``.eot_id``)."""

        def __init__(self, model=None, tokenizer=None, batch_size: int | str = 16, progress: bool = False,
                     pretrained: str | None = None, run_dir: str | None = None, checkpoint: str | None = None,
                     device: str | None = None, **_):
            super().__init__()
            if model is None:  # by name from lm-eval's CLI: --model eslm --model_args run_dir=PATH (eslm lm-eval)
                path = run_dir or checkpoint or pretrained
                if not path:
                    raise ConfigError("expected --model_args run_dir=PATH (a run directory, checkpoint, snapshot "
                                      "or HF GPT-2 directory), found no path")
                model, info = load_model(path, device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
                tokenizer = resolve_tokenizer(tokenizer if isinstance(tokenizer, str) else info.get("tokenizer"))
            self.model, self.tok = model.eval(), tokenizer
            self.batch_size_ = int(batch_size) if str(batch_size).isdigit() else 16  # lm-eval may pass "auto"
            self.progress = progress

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            pairs = [encode_pair(self.tok, *r.args) for r in requests]
            res = score_continuations(self.model, pairs, self.batch_size_, self.progress and not disable_tqdm)
            for r, out in zip(requests, res):
                self.cache_hook.add_partial("loglikelihood", r.args, out)
            return res

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            block, lls = self.model.config.block_size, []
            for r in requests:
                windows = rolling_windows(self.tok.encode(r.args[0]), self.tok.eot_id, block)
                scores = score_continuations(self.model, windows, self.batch_size_) if windows else []
                lls.append(sum(s for s, _ in scores))
                self.cache_hook.add_partial("loglikelihood_rolling", r.args, lls[-1])
            return lls

        def generate_until(self, requests, disable_tqdm: bool = False):
            block, eot, outs = self.model.config.block_size, self.tok.eot_id, []
            for r in requests:
                context, kw = r.args[0], dict(r.args[1] or {})
                until = kw.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                max_new = int(kw.get("max_gen_toks", 256))
                ids = (self.tok.encode(context) or [eot])[-max(1, block - max_new):]  # room to generate, as HF's
                new = generate(self.model, ids, max_new, temperature=0, stop_ids={eot})
                outs.append(cut_at_stop(self.tok.decode([t for t in new if t != eot]), until))
                self.cache_hook.add_partial("generate_until", r.args, outs[-1])
            return outs

    try:
        from lm_eval.api.registry import register_model

        register_model("eslm")(ESLMLM)
    except Exception:  # already registered (module reloaded) or a registry API change: the class still works
        pass
    return ESLMLM
