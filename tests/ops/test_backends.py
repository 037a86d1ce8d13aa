"""Every registered LM-head backend (eslm.ops.head_backend.BACKENDS) against the naive oracle (full logits): the
scores, the kept rows' summed loss and its gradients from the score pass's state, per-token losses for any upstream
gradient, dropped rows exactly zero, awkward shapes, fp32 and bf16; and the registry as the one dispatch."""

import pytest
import torch

from eslm.errors import ConfigError
from eslm.ops import head_backend as hb
from eslm.ops.naive_head import naive_selected_ce, naive_token_stats
from eslm.ops.token_stats import HeadOptions

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
SHAPES = [(45, 24, 131), (7, 8, 1031), (33, 5, 50), (1, 4, 7)]  # rows, width, vocabulary
KEEPS = [None, 1.0, 0.85, 0.5, "one"]
# Triton's interpreter runs one kernel program at a time, in Python: fewer rows (V = 1031 still spans two of the
# kernels' 1024-wide blocks, rows are not a multiple of anything, C = 5 and a single row stay)
SHAPES_INTERPRETED = [(7, 8, 1031), (13, 5, 50), (1, 4, 7)]
KEEPS_INTERPRETED = [None, 0.85, "one"]


def backends():
    """Every registered backend that can run here: one that needs an extra which is missing is skipped, named; a
    GPU backend runs its Triton kernels on these CPU tensors under Triton's interpreter (tests/conftest.py)."""
    return [s.name if hb.available(s.name) else
            pytest.param(s.name, marks=pytest.mark.skip(reason=f"needs the {s.extra} extra")) for s in hb.BACKENDS]


def _interpreted(name) -> bool:
    return "cpu" not in hb.spec(name).devices and not torch.cuda.is_available()


def cases(with_keep: bool = False):
    """(backend, n, c, v[, keep]) for every registered backend, fewer under the interpreter."""
    out = []
    for p in backends():
        name, marks = (p, ()) if isinstance(p, str) else (p.values[0], p.marks)
        shapes, keeps = (SHAPES_INTERPRETED, KEEPS_INTERPRETED) if _interpreted(name) else (SHAPES, KEEPS)
        for shape in shapes:
            for keep in (keeps if with_keep else [()]):
                vals = (name, *shape) + ((keep,) if with_keep else ())
                out.append(pytest.param(*vals, marks=marks, id="-".join(map(str, vals))))
    return out


def _backend(name, chunk=16):
    return hb.backend(name, "cpu", HeadOptions(chunk_size=chunk))


def _inputs(n, c, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, c, generator=g).to(dtype)
    w = (torch.randn(v, c, generator=g) * 0.3).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    return h, w, y


def _index(n, keep, seed=2):
    if keep is None:
        return None
    k = 1 if keep == "one" else max(1, int(round(keep * n)))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]


@pytest.mark.parametrize("name,n,c,v", cases())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_stats(name, dtype, n, c, v):
    h, w, y = _inputs(n, c, v, dtype)
    ref = naive_token_stats(h.float(), w.float(), y)
    got = _backend(name).token_stats(h, w, y, need_entropy=True)
    for field in ("loss", "entropy", "lse"):
        torch.testing.assert_close(getattr(got, field), getattr(ref, field), **TOL[dtype], msg=field)
    assert _backend(name).token_stats(h, w, y, need_entropy=False).entropy is None


@pytest.mark.parametrize("name,n,c,v,keep", cases(with_keep=True))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scored", [True, False])
def test_score_then_kept_loss(name, dtype, keep, scored, n, c, v):
    """The training step's use: score over all rows, then the kept rows' summed loss from the state, with a
    scalar upstream gradient; the scores (when asked), the kept per-token CE, both gradients against the oracle,
    the dropped rows' hidden-state gradient exactly zero, and the declared work within its bounds."""
    h0, w0, y = _inputs(n, c, v, dtype, seed=1)
    index = _index(n, keep)
    k = n if index is None else index.numel()
    hr, wr = h0.float().clone().requires_grad_(), w0.float().clone().requires_grad_()
    ref = naive_selected_ce(hr, wr, y, index)
    ref.sum().mul(0.37).backward()
    ref_stats = naive_token_stats(h0.float(), w0.float(), y)
    be = _backend(name)
    stats, state = be.score(h0, w0, y, num_kept=k, need_scores=scored, need_entropy=True)
    if scored:
        for field in ("loss", "entropy", "lse"):
            torch.testing.assert_close(getattr(stats, field), getattr(ref_stats, field), **TOL[dtype], msg=field)
        assert set(vars(stats)) == {"loss", "entropy", "lse"}  # nothing private in what a selector reads
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    total, per_token = be.kept_loss(h, w, y, index, state)
    total.mul(0.37).backward()
    assert total.dim() == 0 and total.dtype == torch.float32 and not per_token.requires_grad
    torch.testing.assert_close(per_token, ref.detach(), **TOL[dtype])
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    torch.testing.assert_close(h.grad.float(), hr.grad, **TOL[dtype], msg="grad_hidden")
    torch.testing.assert_close(w.grad.float(), wr.grad, **TOL[dtype], msg="grad_weight")
    if index is not None:
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[index] = False
        assert torch.all(h.grad[dropped] == 0)  # exactly zero, not merely small
    work = be.work(n, k, scored=scored, state=state)
    assert 0 <= work.forward_rows <= n and k <= work.backward_rows <= n and work.recompute_rows >= 0


@pytest.mark.parametrize("name", backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep", [None, 0.5, "one"])
@pytest.mark.parametrize("use_lse", [False, True])
def test_per_token_ce_any_upstream_gradient(name, dtype, keep, use_lse):
    n, c, v = (13, 24, 131) if _interpreted(name) else (45, 24, 131)
    h0, w0, y = _inputs(n, c, v, dtype, seed=3)
    index = _index(n, keep)
    up = torch.rand(n if index is None else index.numel(), generator=torch.Generator().manual_seed(4))
    hr, wr = h0.float().clone().requires_grad_(), w0.float().clone().requires_grad_()
    ref = naive_selected_ce(hr, wr, y, index)
    (ref * up).sum().backward()
    lse = naive_token_stats(h0.float(), w0.float(), y).lse if use_lse else None
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    got = _backend(name).per_token_ce(h, w, y, index, lse=lse)
    (got * up).sum().backward()
    torch.testing.assert_close(got.detach(), ref.detach(), **TOL[dtype])
    torch.testing.assert_close(h.grad.float(), hr.grad, **TOL[dtype])
    torch.testing.assert_close(w.grad.float(), wr.grad, **TOL[dtype])
    if index is not None:
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[index] = False
        assert torch.all(h.grad[dropped] == 0)


def test_the_registry_is_the_one_dispatch():
    """Names come from BACKENDS alone: config's and the drop-in API's choices are its names; an unknown name is
    one line with a fix; "auto" resolves per device to a registered backend; each backend is what its line says."""
    from eslm import config
    from eslm.api import loss as api_loss

    assert config._CHOICES["train.loss_impl"] is hb.IMPL_CHOICES and api_loss.IMPLS is hb.IMPL_CHOICES
    assert hb.IMPL_CHOICES == ("auto",) + tuple(s.name for s in hb.BACKENDS)
    with pytest.raises(ConfigError, match="fix:") as e:
        hb.backend("fastest")
    assert "\n" not in str(e.value)
    for dev in ("cpu", "cuda"):
        assert hb.resolve("auto", dev) in hb.NAMES
    assert hb.resolve("auto", "cpu") == "fused"  # the CPU routes are unchanged
    for s in hb.BACKENDS:
        if hb.available(s.name):
            b = hb.backend(s.name)
            assert isinstance(b, hb.HeadBackend) and b.name == s.name


def test_options_are_checked_in_one_place():
    with pytest.raises(ConfigError, match="loss_cache_probs=false forbids"):
        hb.backend("fused", "cpu", HeadOptions(cache_probs=False, route="kept_cached"))
    with pytest.raises(ConfigError, match="train.loss_route must be one of"):
        hb.backend("naive", "cpu", HeadOptions(route="fastest"))
