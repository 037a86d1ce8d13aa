"""One VaR threshold across ranks (group=): two gloo processes keep exactly the global top K of the union of
their tokens, and their summed gradients equal the exact mean CE over those kept tokens, computed by hand."""

import textwrap

import pytest
import torch
import torch.nn.functional as F

from conftest import torchrun

SCRIPT = textwrap.dedent('''
    import sys, torch, torch.distributed as dist
    from eslm.api import kept_tokens, selective_loss
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(2, 9, 7, generator=g) * (3 - 2 * r) for r in range(2)]  # rank 1: flatter, higher entropy
    targets = [torch.randint(0, 7, (2, 9), generator=g) for _ in range(2)]
    targets[0][0, :4] = -100
    z = logits[rank].clone().requires_grad_(True)
    k = kept_tokens(targets[rank], alpha=0.6, group=dist.group.WORLD)
    loss, st, tok = selective_loss(targets[rank], logits=z, alpha=0.6, group=dist.group.WORLD, return_tokens=True)
    loss.backward()
    torch.save({"grad": z.grad, "kept": tok.kept, "k": int(st.num_kept), "n": int(st.num_tokens),
                "threshold": float(st.threshold), "counted": int(k), "logits": logits, "targets": targets},
               f"{sys.argv[1]}/rank{rank}.pt")
    dist.barrier()  # both ranks leave together: gloo torn down under a peer can abort it
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_one_threshold_over_two_ranks(tmp_path):
    script = tmp_path / "group.py"
    script.write_text(SCRIPT)
    torchrun([str(script), str(tmp_path)])
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    logits, targets = r0["logits"], r0["targets"]
    z = torch.cat([x.reshape(-1, 7) for x in logits])
    t = torch.cat([x.reshape(-1) for x in targets])
    valid = t != -100
    logp = torch.log_softmax(z, -1)
    ent = (-(logp.exp() * logp).sum(-1)).masked_fill(~valid, float("-inf"))
    n = int(valid.sum())
    k = n - int(0.6 * n)
    top = torch.topk(ent, k).indices
    want = torch.zeros(len(t), dtype=torch.bool)
    want[top] = True
    got = torch.cat([r0["kept"].reshape(-1), r1["kept"].reshape(-1)])
    assert torch.equal(got, want)
    assert r0["k"] == r1["k"] == r0["counted"] == r1["counted"] == k and r0["n"] == n
    assert r0["threshold"] == r1["threshold"] == pytest.approx(float(ent[top].min()))
    assert int(r1["kept"].sum()) > int(r0["kept"].sum())  # the shared threshold moved budget to rank 1
    # the ranks' losses sum to the global kept mean: their gradients are its gradient (DDP would average, so
    # a DDP loop multiplies by the world size; a summing reduction does not)
    leaf = z.clone().requires_grad_(True)
    F.cross_entropy(leaf[top], t[top]).backward()
    grads = torch.cat([r0["grad"].reshape(-1, 7), r1["grad"].reshape(-1, 7)])
    assert torch.allclose(grads, leaf.grad, atol=1e-7)
