"""Two CPU processes with gloo, launched by torchrun --standalone (it picks a free port: no fixed port)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import read_metrics, tiny_overrides, torchrun
from eslm import metrics as M


@pytest.mark.slow
def test_two_process_gloo_training(tiny_data, tmp_path):
    out = torchrun(["-m", "eslm.cli", "train", *tiny_overrides(tiny_data, tmp_path, **{"train.max_steps": 3})])
    assert out.count("step 3/3") == 1  # rank 0 logs alone
    lines = read_metrics(tmp_path / "t", "train")
    assert lines[-1][M.TOKENS_SEEN] == 3 * 4 * 32 * 2 * 2  # steps x seqs x len x micro-steps x ranks
    assert (tmp_path / "t" / "checkpoints" / "latest").is_file()


GRAD_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    from eslm.data.batch import Batch
    from eslm.methods import build_method
    from eslm.config import build_config, method_context
    from eslm.model.gpt import GPT, preset
    from eslm.train.step import StepOptions, forward_backward
    from eslm.train.distributed import init_distributed

    out_path, scope = sys.argv[1], sys.argv[2]
    info, device = init_distributed("cpu", "gloo")
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=64))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(4)]
    batches = [Batch(x, x.roll(-1, 1), torch.zeros(2, dtype=torch.long)) for x in xs]
    wrapped = model
    if info.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        wrapped = DDP(model)
        batches = batches[info.rank * 2:(info.rank + 1) * 2]
    cfg = build_config(overrides=["method.name=eslm-loss", "method.alpha=0.3", f"method.scope={scope}",
                                  "train.loss_impl=naive"])
    method = build_method(method_context(cfg, device=device, n_domains=1))
    opts = StepOptions(accum_steps=len(batches), normalize="global", world_size=info.world_size)
    forward_backward(wrapped, model, method, batches, opts, step=1, lr=1e-3)
    if info.rank == 0:
        torch.save({n: p.grad.clone() for n, p in model.named_parameters()}, out_path)
    if info.world_size > 1:
        torch.distributed.barrier()  # no rank tears gloo down while its peer still saves (SIGABRT)
        torch.distributed.destroy_process_group()
''')


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["micro", "step"])
def test_global_normalisation_same_gradient_1x4_and_2x2(tmp_path, scope):
    script = tmp_path / "grad.py"
    script.write_text(GRAD_SCRIPT)
    one = tmp_path / "one.pt"
    two = tmp_path / "two.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(script), str(one), scope], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    torchrun([str(script), str(two), scope])
    g1, g2 = torch.load(one), torch.load(two)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-5, atol=1e-7, msg=name)
