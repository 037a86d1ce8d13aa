"""The head's custom autograd Functions carry torch.amp.custom_fwd / custom_bwd for their input's device type
(``eslm.ops.fused_head.autocast_consistent``): the backward runs under the forward's autocast state, and the
values are bit-for-bit those of the same Functions without the decorators, in fp32 and under CPU bf16 autocast
(backward outside autocast, as the training step calls it, or inside)."""

import contextlib

import pytest
import torch

from eslm.ops import fused_head

N, C, V = 12, 16, 40


def _plain(cls):
    """The Function as written, without the decorators (the bodies they wrap)."""
    return type(cls.__name__ + "Plain", (torch.autograd.Function,),
                {"forward": staticmethod(cls.forward.__wrapped__), "backward": staticmethod(cls.backward.__wrapped__)})


def _inputs():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the Linear's bias
    lin = torch.nn.Linear(C, C)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(C, C, generator=g) * 0.3)
    x = torch.randn(N, C, generator=g)
    w = torch.nn.Parameter(torch.randn(V, C, generator=g) * 0.3)
    y = torch.randint(0, V, (N,), generator=g)
    return lin, x, w, y


# (Function, how its arguments are formed from (hidden, weight, targets))
FUNCTIONS = {
    "_SelectedCE": (fused_head._SelectedCE, lambda h, w, y: (h, w, y, None, 5)),
    "_RowGradCE": (fused_head._RowGradCE, lambda h, w, y: (h, w.detach(), y, 5)),
    "PrecomputedGrad": (fused_head.PrecomputedGrad,
                         lambda h, w, y: (h, w, (h.float().sum() + w.float().sum()).detach(),
                                          torch.ones_like(h) * 0.5, torch.ones_like(w) * 0.25)),
    "_TokenCE": (None, lambda h, w, y: (h, w, y)),  # eslm.ops.triton_head's: needs triton (the gpu extra)
}


def _function(name: str):
    cls, build = FUNCTIONS[name]
    if cls is None:
        cls = pytest.importorskip("eslm.ops.triton_head", reason="needs triton: pip install 'eslm[gpu]'")._TokenCE
    return cls, build


def _run(fn, build, precision: str, backward_in_autocast: bool):
    lin, x, w, y = _inputs()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision != "fp32" else contextlib.nullcontext()
    with autocast:
        h = lin(x) if precision != "bf16+fp32 hidden" else lin(x).float()  # CUDA's autocast LayerNorm gives fp32
        out = fn.apply(*build(h, w, y))
        loss = (out * torch.linspace(0.5, 1.5, out.numel()).view(out.shape)).sum() if out.dim() else out
        if backward_in_autocast:
            loss.backward()
    if not backward_in_autocast:
        loss.backward()
    return [out.detach(), lin.weight.grad, w.grad]


@pytest.mark.parametrize("name", list(FUNCTIONS))
@pytest.mark.parametrize("precision,backward_in_autocast", [("fp32", False), ("bf16", False), ("bf16", True),
                                                             ("bf16+fp32 hidden", False), ("bf16+fp32 hidden", True)])
def test_the_same_values_as_without_the_decorators(name, precision, backward_in_autocast):
    cls, build = _function(name)
    got = _run(cls, build, precision, backward_in_autocast)
    ref = _run(_plain(cls), build, precision, backward_in_autocast)
    for a, b in zip(got, ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_backward_runs_under_the_forwards_autocast_state(monkeypatch):
    """Forward under bf16 autocast, backward outside it (as on a CUDA autograd thread): the decorated backward sees
    autocast on, the undecorated one off."""
    seen = []
    original = fused_head.no_autocast

    def recording(t):
        seen.append(torch.is_autocast_enabled(t.device.type))
        return original(t)

    cls, build = FUNCTIONS["_SelectedCE"]
    for fn in (cls, _plain(cls)):
        lin, x, w, y = _inputs()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn.apply(*build(lin(x), w, y))
        monkeypatch.setattr(fused_head, "no_autocast", recording)
        out.sum().backward()
        monkeypatch.setattr(fused_head, "no_autocast", original)
    assert seen == [True, False]
