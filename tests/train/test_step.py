"""train/step.py: the one training step, in the selection scope "step" (one extra scoring forward and one VaR
threshold over the whole optimizer step)."""

import pytest
import torch

from conftest import HostReads
from eslm.config import build_config, method_context
from eslm.data.batch import Batch
from eslm.methods import build_method
from eslm.model.gpt import GPT, preset
from eslm.selection.scores import STANDARDIZE_MODES
from eslm.train.step import StepOptions, forward_backward


def _batches(n=2, rows=4, seq=16, vocab=64, n_domains=3):
    g = torch.Generator().manual_seed(1)
    return [Batch(x, x.roll(-1, 1), torch.arange(rows) % n_domains)
            for x in (torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(n))]


def _host_reads(**overrides) -> list[str]:
    """The device-to-host reads of one step-scope forward_backward of ESLM-entropy."""
    over = {"method.name": "eslm-entropy", "method.alpha": 0.3, "method.scope": "step", **overrides}
    cfg = build_config(overrides=[f"{k}={v}" for k, v in over.items()])
    method = build_method(method_context(cfg, device=torch.device("cpu"), n_domains=3))
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=64))
    batches = _batches()
    opts = StepOptions(accum_steps=len(batches), normalize=cfg.train.normalize)
    reads: list[str] = []
    with HostReads(record=reads):
        forward_backward(model, model, method, batches, opts, step=1, lr=1e-3)
    return reads


@pytest.mark.parametrize("standardize", [m for m in STANDARDIZE_MODES if m != "none"])
def test_step_scope_standardisation_adds_no_host_read(standardize):
    # the step scope reads the device where its kept count varies (the threshold's count, the kept indices);
    # ranking the scores must add nothing: domain standardisation knows the number of domains, it never reads
    # domain.max() from the device
    none = _host_reads()
    assert none  # the check sees the step scope's own reads
    assert _host_reads(**{"method.standardize": standardize}) == none


def test_the_step_calls_the_token_selector_and_reads_none_of_its_settings():
    # the selector owns its rule (scores, standardisation, alpha, the step-scope VaR): the step may read the
    # protocol's needs and scope and call its hooks, nothing else of method.tokens
    import ast
    from pathlib import Path

    import eslm.train.step as step

    used = {node.attr for node in ast.walk(ast.parse(Path(step.__file__).read_text()))
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "method.tokens"}
    assert used <= {"needs", "scope", "num_kept", "rank", "step_threshold", "select"}, used
    assert {"rank", "step_threshold", "select"} <= used
