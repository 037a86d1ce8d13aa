"""The training step with compiled blocks (train.compile): one graph per grad mode, no recompile as the kept set
changes from step to step, and the eager step's loss and gradients; TF32 through torch's newer API; fused AdamW."""

import warnings

import pytest
import torch


def _batches(step, n=2, b=3, t=24, v=131):
    from eslm.data.batch import Batch

    g = torch.Generator().manual_seed(100 + step)
    return [Batch(x=torch.randint(0, v, (b, t), generator=g), y=torch.randint(0, v, (b, t), generator=g),
                  domain=torch.zeros(b, dtype=torch.long)) for _ in range(n)]


def _run(compiled: bool, method_name: str, scope: str, steps: int = 4):
    from eslm.config import build_config, method_context
    from eslm.methods import build_method
    from eslm.model.gpt import GPT, preset
    from eslm.train.setup import compile_blocks
    from eslm.train.step import StepOptions, forward_backward

    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=131))
    if compiled:
        compile_blocks(model, fullgraph=True, backend="aot_eager")
    cfg = build_config(overrides=[f"method.name={method_name}", "method.alpha=0.3", f"method.scope={scope}"])
    method = build_method(method_context(cfg, device=torch.device("cpu"), n_domains=1))
    out, graphs = [], []
    for step in range(1, steps + 1):
        model.zero_grad(set_to_none=True)
        res = forward_backward(model, model, method, _batches(step), StepOptions(accum_steps=2), step, 1e-3)
        out.append((res.loss, [s.index.sort().values for s in res.selections],
                    {n: p.grad.clone() for n, p in model.named_parameters()}))
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return out, graphs


@pytest.mark.parametrize("scope", ["micro", "step"])
def test_compiled_blocks_do_not_recompile_as_the_kept_set_changes(scope):
    """ESLM for 4 steps with fullgraph aot_eager blocks: the graphs are made in the first step (one per grad
    mode: the step scope's scoring forward runs without gradient) and never again though every step keeps other
    tokens; loss and gradients equal the eager run's."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got, graphs = _run(True, "eslm-entropy", scope)
    ref, _ = _run(False, "eslm-entropy", scope)
    assert graphs[0] >= 1 and graphs == [graphs[0]] * len(graphs), graphs  # nothing compiled after step 1
    assert not torch.equal(got[0][1][0], got[1][1][0])  # the kept set changed
    for (loss, kept, grads), (rloss, rkept, rgrads) in zip(got, ref):
        torch.testing.assert_close(loss, rloss, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(kept, rkept))
        for n in rgrads:
            torch.testing.assert_close(grads[n], rgrads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_tf32_through_the_new_api_without_a_warning():
    from eslm.train.setup import enable_tf32

    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has only the legacy allow_tf32 flags")
    before = (matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            enable_tf32()
        assert matmul.fp32_precision == "tf32" and torch.backends.cudnn.conv.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before


def test_fused_adamw_as_built_for_cuda_steps_like_the_default():
    """build_optimizer asks for the fused AdamW on CUDA; torch runs it on the CPU too: the same update as the
    default implementation."""
    from eslm.train.optim import build_optimizer

    out = []
    for dev in ("cuda", "cpu"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
        opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), device_type=dev)
        assert bool(opt.defaults.get("fused")) == (dev == "cuda")
        for _ in range(3):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).square().sum().backward()
            opt.step()
            opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
