"""lm-evaluation-harness bridge (eslm.eval: scoring, generate, adapter, tasks, tables, results, command): local task
YAMLs over local JSON, a tiny random model."""

import json
import math
import os
import re

import pytest
import torch

from eslm.eval import command, scoring, tables, tasks
from eslm.eval.generate import generate
from eslm.model.gpt import GPT, preset
from eslm.model.loading import load_model

from .local_tasks import MC_YAML

for _v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_v] = "1"


def _tokenizer():
    try:
        from eslm.data.tokenizers import get_tokenizer

        return get_tokenizer("byte")
    except ImportError:  # the data package not there yet: the same contract, bytes + end-of-text 256
        class Byte:
            name, vocab_size, eot_id = "byte", 257, 256

            def encode(self, s):
                return list(s.encode("utf-8"))

            def decode(self, ids):
                return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

        return Byte()


# ------------------------------------------------------------------------------ scoring without lm-eval


def test_score_continuations_matches_full_sequence_logprobs():
    torch.manual_seed(0)
    m = GPT(preset("tiny", vocab_size=50, block_size=16)).eval()
    pairs = [([1, 2, 3], [4, 5]), ([7], [8, 9, 10, 11]), (list(range(1, 30)), [3, 4])]  # last: truncated
    got = scoring.score_continuations(m, pairs, batch_size=2)
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        full = (ctx + cont)[-17:]
        with torch.no_grad():
            logp = m.logits(m(torch.tensor([full[:-1]]))).log_softmax(-1)[0]
        n = len(cont)
        ref = sum(logp[len(full) - 1 - n + j, cont[j]].item() for j in range(n))
        assert ll == pytest.approx(ref, abs=1e-4)
        assert greedy == all(logp[len(full) - 1 - n + j].argmax().item() == cont[j] for j in range(n))


def test_generation_is_greedy_through_the_kv_cache_and_stops_at_a_stop_id():
    # lm-eval's generate_until decodes with the one generation loop (eslm.eval.generate) at temperature 0
    torch.manual_seed(0)
    m = GPT(preset("tiny", vocab_size=40, block_size=12)).eval()
    for ctx in ([1, 2, 3], [5], list(range(1, 20))):  # the last is longer than block_size
        got = generate(m, ctx, 6, temperature=0)
        assert got == generate(m, ctx, 6, temperature=0, use_cache=False) and len(got) == 6
        seq = list(ctx)
        for tok in got:  # reference: argmax one step at a time over the last block_size tokens
            with torch.no_grad():
                assert m.logits(m(torch.tensor([seq[-12:]])))[0, -1].argmax().item() == tok
            seq.append(tok)
    for tok in got:  # a stop id ends the generation at its first occurrence (included: the adapter drops it)
        assert generate(m, ctx, 6, temperature=0, stop_ids={tok}) == got[: got.index(tok) + 1]


def test_rolling_windows_predict_every_token_once():
    pytest.importorskip("lm_eval")
    toks = list(range(1, 24))
    wins = scoring.rolling_windows(toks, eot_id=0, block_size=8)
    assert [t for _, cont in wins for t in cont] == toks
    assert wins[0][0] == [0] and all(len(c) + len(p) - 1 <= 8 for c, p in wins)


def test_parse_tasks_and_metric_choice():
    assert tasks.parse_tasks(None, None) == tasks.PAPER_TASKS
    assert tasks.parse_tasks(["piqa,arc_easy:3", "foo"], None) == {"piqa": 5, "arc_easy": 3, "foo": 0}
    assert tasks.parse_tasks(["piqa"], 2) == {"piqa": 2}
    r = {"acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.6, "acc_norm_stderr,none": 0.09}
    assert tasks.headline_metric(r) == ("acc_norm", 0.6, 0.09)
    assert tasks.headline_metric({"exact_match,strict": 0.2, "exact_match_stderr,strict": 0.05})[0] == "exact_match"
    assert tasks.headline_metric({"word_perplexity,none": 9.0, "word_perplexity_stderr,none": "N/A"}) == (
        "word_perplexity", 9.0, None)


# ------------------------------------------------------------------------------ end to end with lm-eval

ROLL_YAML = """task: t_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""
GEN_YAML = """task: t_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 5
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def _write_tasks(d):
    d.mkdir()
    mc = [{"question": f"what is {i}+{i}?", "choices": [str(2 * i), str(2 * i + 1), "no"], "label": i % 3}
          for i in range(6)]
    ppl = [{"text": f"The number {i} is followed by {i + 1}, and that is the end of line {i}."} for i in range(4)]
    gen = [{"question": f"say {w}", "answer": w} for w in ("yes", "no", "cat", "dog")]
    for name, rows, yaml in (("mc", mc, MC_YAML), ("ppl", ppl, ROLL_YAML), ("gen", gen, GEN_YAML)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / f"{name}.yaml").write_text(yaml.format(data=d / f"{name}.jsonl"))


def _mc_reference(run, step, tok, tmp_path):
    """(acc, acc_norm) of the first 4 multiple-choice docs, scored directly (0-shot), as lm-eval defines them:
    choice = " " + text after "Q: ...\\nA:"; acc_norm divides the log-likelihood by the choice's length."""
    model, _ = load_model(run / "checkpoints" / f"step_{step:07d}.pt")
    rows = [json.loads(line) for line in (tmp_path / "tasks" / "mc.jsonl").read_text().splitlines()][:4]
    acc = acc_norm = 0.0
    for r in rows:
        ctx = f"Q: {r['question']}\nA:"
        lls = [s for s, _ in scoring.score_continuations(
            model, [scoring.encode_pair(tok, ctx, " " + c) for c in r["choices"]])]
        acc += max(range(len(lls)), key=lambda i: lls[i]) == r["label"]
        acc_norm += max(range(len(lls)), key=lambda i: lls[i] / len(r["choices"][i])) == r["label"]
    return acc / len(rows), acc_norm / len(rows)


def test_eslm_eval_end_to_end_on_local_tasks(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from eslm.cli import main

    tok = _tokenizer()
    if not hasattr(tok, "encode_batch"):  # our fallback, not eslm.data.tokenizers
        monkeypatch.setattr(command, "resolve_tokenizer", lambda name, *a: tok)
    torch.manual_seed(0)
    run = tmp_path / "run"
    for step in (10, 20):
        m = GPT(preset("tiny", vocab_size=257 + 7, block_size=32))  # padded vocab; context < one ppl doc
        (run / "checkpoints").mkdir(parents=True, exist_ok=True)
        torch.save({"format": "eslm-checkpoint-v1", "model": m.state_dict(), "model_config": m.config.to_dict(),
                    "tokenizer": "byte", "step": step, "flops_paper": 1.5e9 * step, "flops_executed": 1e9 * step},
                   run / "checkpoints" / f"step_{step:07d}.pt")
    (run / "checkpoints" / "latest").write_text("step_0000020.pt")
    _write_tasks(tmp_path / "tasks")
    rc = main(["eval", str(run), "--all-checkpoints", "--tasks", "t_mc:0,t_ppl,t_gen:1", "--limit", "4",
               "--batch-size", "4", "--device", "cpu", "--include-path", str(tmp_path / "tasks")])
    assert rc == 0
    for step in (10, 20):
        rec = json.loads((run / "eval" / f"step_{step:07d}.json").read_text())
        assert rec["step"] == step and rec["flops_paper"] == 1.5e9 * step
        mc, ppl, gen = rec["tasks"]["t_mc"], rec["tasks"]["t_ppl"], rec["tasks"]["t_gen"]
        assert mc["num_fewshot"] == 0 and gen["num_fewshot"] == 1 and mc["metric"] == "acc_norm"
        assert mc["n_samples"] == 4 and (mc["metrics"]["acc,none"], mc["value"]) == _mc_reference(run, step, tok, tmp_path)
        assert 0.0 <= mc["value"] <= 1.0 and mc["stderr"] is not None
        assert ppl["metric"] == "word_perplexity" and ppl["value"] > 1.0
        assert gen["metric"] == "exact_match" and gen["value"] == 0.0 and gen["stderr"] is not None
        md = (run / "eval" / f"step_{step:07d}.md").read_text()
        assert f"| t_mc | 0 | acc_norm | {mc['value']:.4f} ({mc['stderr']:.4f}) | 4 |" in md
    # word perplexity recomputed from the rolling windows, against what the harness aggregated
    m20, _ = load_model(run)
    docs = [json.loads(line)["text"] for line in (tmp_path / "tasks" / "ppl.jsonl").read_text().splitlines()]
    ll = sum(s for d in docs for s, _ in scoring.score_continuations(
        m20, scoring.rolling_windows(tok.encode(d), tok.eot_id, 32)))
    words = sum(len(re.split(r"\s+", d)) for d in docs)
    assert math.log(ppl["value"]) == pytest.approx(-ll / words, rel=1e-4)
    assert list(rec["tasks"]) == ["t_mc", "t_ppl", "t_gen"]
    summary = (run / "eval" / "summary.md").read_text()
    assert "t_mc (acc_norm)" in summary and "| 10 | 1.500e+10 | 1.000e+10 |" in summary
    assert "| 20 | 3.000e+10 |" in summary and "Best during training" in summary


def test_best_per_task_picks_highest_accuracy_and_lowest_perplexity():
    def rec(step, acc, ppl):
        return {"step": step, "tasks": {
            "a": {"metric": "acc", "value": acc, "stderr": 0.01, "num_fewshot": 0},
            "p": {"metric": "word_perplexity", "value": ppl, "stderr": None, "num_fewshot": 0}}}
    best = tables.best_per_task([rec(1, 0.3, 50.0), rec(2, 0.5, 60.0), rec(3, 0.4, 40.0)])
    assert (best["a"]["step"], best["a"]["value"]) == (2, 0.5)
    assert (best["p"]["step"], best["p"]["value"]) == (3, 40.0)
