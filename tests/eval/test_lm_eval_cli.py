"""`eslm lm-eval`: lm-eval's own CLI with our model; our adapter and lm-eval's HFLM on the export of the same
weights give the same per-example log-likelihoods and the same accuracy on a local task."""

from __future__ import annotations

import json

import pytest
import torch

from eslm.model.gpt import GPT, preset
from eslm.train.snapshots import save_snapshot

from .local_tasks import MC_YAML


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("lm_eval")
    d = tmp_path_factory.mktemp("lmeval")
    rows = [{"question": f"what comes after {w}?", "choices": [a, b, "nothing at all"], "label": i % 3}
            for i, (w, a, b) in enumerate([("one", "two", "three"), ("Monday", "Tuesday", "Friday"),
                                           ("red", "orange", "blue"), ("spring", "summer", "winter"),
                                           ("A", "B", "Z"), ("north", "east", "south")])]
    (d / "tasks").mkdir()
    (d / "tasks" / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "tasks" / "mc.yaml").write_text(MC_YAML.format(data=d / "tasks" / "mc.jsonl"))
    torch.manual_seed(0)
    m = GPT(preset("tiny", vocab_size=50304, block_size=128))
    with torch.no_grad():  # spread the predictions: log-likelihoods far apart, no accuracy ties
        for p in m.parameters():
            p.mul_(3.0)
    snap = save_snapshot(d / "run" / "snapshots", m.state_dict(),
                         {"model_config": m.config.to_dict(), "tokenizer": "gpt2", "step": 7})
    return d, snap


def _evaluate(lm, tasks_dir):
    from lm_eval import evaluator

    from eslm.eval.tasks import task_manager

    tm = task_manager(str(tasks_dir), ["t_mc"])
    res = evaluator.evaluate(lm=lm, task_dict=tm.load(["t_mc"]), log_samples=True, bootstrap_iters=0)
    samples = sorted(res["samples"]["t_mc"], key=lambda s: s["doc_id"])
    return res["results"]["t_mc"], [[r[0][0] for r in s["resps"]] for s in samples]


def test_adapter_and_hflm_agree_on_the_export(setup):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # lm-eval's HFLM imports it
    from lm_eval.models.huggingface import HFLM

    from eslm.data.tokenizers import get_tokenizer
    from eslm.eval.adapter import lm_class
    from eslm.model.export_hf import export
    from eslm.model.loading import load_model

    d, snap = setup
    export(snap, d / "hf", keep_padded_vocab=True)  # the same softmax as ours (padded rows included)
    ours_res, ours = _evaluate(lm_class()(model=load_model(snap)[0], tokenizer=get_tokenizer("gpt2"),
                                          batch_size=4), d / "tasks")
    hf_res, theirs = _evaluate(HFLM(pretrained=str(d / "hf"), device="cpu", batch_size=4, dtype="float32"),
                               d / "tasks")
    assert len(ours) == 6 and all(len(x) == 3 for x in ours)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-4)
    assert ours_res["acc,none"] == hf_res["acc,none"] and ours_res["acc_norm,none"] == hf_res["acc_norm,none"]
    assert len({max(range(3), key=x.__getitem__) for x in ours}) > 1  # the model does not always pick one index


def test_eslm_lm_eval_runs_lm_evals_cli_with_our_model(setup, tmp_path):
    from eslm.cli import main

    d, snap = setup
    rc = main(["lm-eval", "run", "--model", "eslm", "--model_args", f"run_dir={snap.parent.parent}",
               "--tasks", "t_mc", "--include_path", str(d / "tasks"), "--output_path", str(tmp_path / "out"),
               "--batch_size", "4", "--device", "cpu"])
    assert rc == 0
    (path,) = list((tmp_path / "out").rglob("results_*.json"))
    res = json.loads(path.read_text())
    assert res["versions"]["t_mc"] is not None and res["n-shot"]["t_mc"] == 0
    assert res["lm_eval_version"] and "t_mc" in res["configs"]
    _, ours = _evaluate(__import__("eslm.eval.adapter", fromlist=["lm_class"]).lm_class()(
        run_dir=str(snap), batch_size=4, device="cpu"), d / "tasks")
    acc = sum(max(range(3), key=x.__getitem__) == i % 3 for i, x in enumerate(ours)) / 6
    assert res["results"]["t_mc"]["acc,none"] == pytest.approx(acc)
    assert main(["lm-eval", "run", "--model", "eslm", "--no-such-option"]) == 2
