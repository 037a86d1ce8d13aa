"""`eslm tokens` on a tiny random model: both variants rendered, highlights = tokens at or above VaR."""

from __future__ import annotations

import math
import re

import pytest
import torch

from eslm.analysis import tokens as tv
from eslm.errors import ESLMError
from eslm.model.gpt import GPT, preset

TEXT = ("<b>x</b> & y\n\tThe quick brown fox jumps over the lazy dog.\n\n"
        "def f(x):\n    return x * 2  # twice\n\n"
        "Zebras zigzag; ünïcode too.\n\n"
        "x\n")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """An eslm checkpoint of a tiny random byte-level model."""
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=257))
    path = tmp_path_factory.mktemp("ckpt") / "step_0000001.pt"
    torch.save({"format": "eslm-checkpoint-v1", "model": model.state_dict(), "model_config": model.config.to_dict(),
                "tokenizer": "byte", "step": 1}, path)
    return path, model


def spans(html_text: str, variant: str) -> list[tuple[float, bool]]:
    """(score, kept) of every highlighted token of one variant, in page order."""
    pat = rf"data-variant='{variant}' data-score='([^']+)' data-kept='([01])'"
    return [(float(s), k == "1") for s, k in re.findall(pat, html_text)]


def reference_scores(model, ids: list[int]) -> dict[str, list[float]]:
    """Entropy and loss of each next-token prediction, from full logits (independent of token_stats)."""
    with torch.no_grad():
        logits = model.logits(model(torch.tensor([ids[:-1]])))[0].double()
    logp = torch.log_softmax(logits, -1)
    ent = -(logp.exp() * logp).sum(-1)
    loss = -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return {"entropy": ent.tolist(), "loss": loss.tolist()}


@pytest.mark.parametrize("scope", ["batch", "passage"])
def test_highlights_are_exactly_tokens_at_or_above_var(ckpt, tmp_path, scope, monkeypatch):
    pytest.importorskip("matplotlib")
    if scope == "passage":  # the charts are checked once (batch); skip rendering them again
        monkeypatch.setattr(tv, "frequency_chart", lambda path, *a: path.write_bytes(b"png"))
    path, model = ckpt
    (tmp_path / "t.txt").write_text(TEXT)
    out = tmp_path / "view"
    alpha = 0.3
    res = tv.build_token_view(str(path), out, text=str(tmp_path / "t.txt"), alpha=alpha, num_passages=3,
                              max_tokens=40, scope=scope)
    page = (out / "index.html").read_text()
    for f in ("top_tokens_entropy.png", "top_tokens_loss.png", "tokens.json"):
        assert (out / f).stat().st_size > 0
    assert "ESLM-VaR-entropy" in page and "ESLM-CVaR-loss" in page
    assert "&lt;" in page and "&amp;" in page and "<b>x" not in page  # escaped
    assert "↵</span><br>" in page and "→" in page  # newline and tab made visible
    passages = res["passages"]
    assert len(passages) == 3 and all(len(p["ids"]) <= 41 for p in passages)
    refs = [reference_scores(model, p["ids"]) for p in passages]
    for key in ("entropy", "loss"):
        shown = spans(page, key)
        expected = [s for r in refs for s in r[key]]
        assert [s for s, _ in shown] == pytest.approx(expected, abs=1e-4)
        groups = [expected] if scope == "batch" else [r[key] for r in refs]
        flags, start = [k for _, k in shown], 0
        for g in groups:
            k = len(g) - math.floor(alpha * len(g))  # keep the top K = N - floor(alpha N)
            thr = sorted(g, reverse=True)[k - 1]
            assert flags[start:start + len(g)] == [s >= thr for s in g]
            assert sum(flags[start:start + len(g)]) == k  # continuous scores: no ties
            start += len(g)


def test_top_tokens_counts_kept_tokens():
    class Tok:
        def decode(self, ids):
            return {1: " the", 2: "\n", 3: "x"}[ids[0]]

    rec = {"ids": [3, 1, 2, 1, 3], "variants": {"loss": {"kept": [True, False, True, True]}}}
    # scored tokens are ids[1:] = " the", newline, " the", "x"; the newline is dropped
    assert tv.top_tokens([rec], Tok(), "loss") == [("␣the", 2), ("x", 1)]


def test_kept_dropped_by_domain_counts_each_domain_apart():
    class Tok:
        def decode(self, ids):
            return {1: " the", 2: "\n", 3: "x", 4: "("}[ids[0]]

    recs = [{"domain": "code", "ids": [3, 4, 2, 4, 2, 1], "variants": {"e": {"kept": [True, False, True, False, True]}}},
            {"domain": "prose", "ids": [3, 1, 1, 2], "variants": {"e": {"kept": [True, False, True]}}},
            {"domain": "code", "ids": [1, 4], "variants": {"e": {"kept": [False]}}}]
    got = tv.kept_dropped_by_domain(recs, Tok(), "e", k=5)
    assert list(got) == ["code", "prose"]
    code = got["code"]
    # code scores "(", "\n", "(", "\n", " the" and "(": "(" kept 2 of 3, "\n" kept 0 of 2, " the" kept 1 of 1
    assert code["tokens"] == 6 and code["kept_frac"] == 3 / 6
    assert code["kept"] == [["(", 2, 3], ["␣the", 1, 1]]
    assert code["dropped"] == [["↵", 2, 2], ["(", 1, 3]]
    assert got["prose"] == {"tokens": 3, "kept_frac": 2 / 3, "kept": [["↵", 1, 1], ["␣the", 1, 2]],  # tie: the higher rate first
                            "dropped": [["␣the", 1, 2]]}
    assert tv.kept_dropped_by_domain(recs, Tok(), "e", k=1)["code"]["kept"] == [["(", 2, 3]]


def test_stream_passages_start_at_documents():
    eot = 9
    stream = [1, 2, 3, eot, 4, 5, 6, 7, eot, eot, 8, 1]
    ps = tv.stream_passages(stream, eot, num=3, max_tokens=2, domain="d")
    assert [p.ids for p in ps] == [[1, 2, 3], [4, 5, 6], [8, 1]]


def test_data_dir_passages(ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(tv, "frequency_chart", lambda path, *a: path.write_bytes(b"png"))
    prepare = pytest.importorskip("eslm.data.prepare")
    for dom in ("prose", "code"):
        (tmp_path / dom).mkdir()
        for i in range(8):
            (tmp_path / dom / f"f{i}.txt").write_text(f"{dom} document {i}: " + "some words here. " * 5)
    data = tmp_path / "data"
    prepare.prepare("text", data, tokenizer="byte", paths=[f"{d}={tmp_path / d}" for d in ("prose", "code")],
                    val_fraction=0.5, workers=1, progress=False)
    res = tv.build_token_view(str(ckpt[0]), tmp_path / "v", data=str(data), num_passages=2, max_tokens=30)
    domains = {p["source"].split(" @")[0] for p in res["passages"]}
    assert domains == {"prose", "code"} and {p["domain"] for p in res["passages"]} == domains
    # per domain and variant: the kept and dropped counts add up to the domain's scored tokens and kept flags
    assert set(res["by_domain"]) == domains
    for d in domains:
        recs = [p for p in res["passages"] if p["domain"] == d]
        for key in ("entropy", "loss"):
            flags = [f for p in recs for f in p["variants"][key]["kept"]]
            entry = res["by_domain"][d][key]
            assert entry["tokens"] == len(flags) and entry["kept_frac"] == pytest.approx(sum(flags) / len(flags))
            kept_counts = [c for _, c, _ in entry["kept"]]
            assert kept_counts == sorted(kept_counts, reverse=True)
            assert all(0 < c <= n for _, c, n in entry["kept"] + entry["dropped"])
    page = (tmp_path / "v" / "index.html").read_text()
    assert "Most often kept and dropped tokens per domain" in page and "<h3>code</h3>" in page


def test_errors(ckpt, tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(ESLMError, match="at least one paragraph"):
        tv.build_token_view(str(ckpt[0]), tmp_path / "o", text=str(tmp_path / "empty.txt"))
    with pytest.raises(ESLMError, match="alpha"):
        tv.build_token_view(str(ckpt[0]), tmp_path / "o", text=str(tmp_path / "empty.txt"), alpha=1.0)
    (tmp_path / "t.txt").write_text("hello world")
    with pytest.raises(ESLMError, match="vocab_size"):  # GPT-2 ids do not fit a byte-level model
        tv.build_token_view(str(ckpt[0]), tmp_path / "o", text=str(tmp_path / "t.txt"), tokenizer="gpt2")


def test_a_directory_with_the_views_file_names_but_no_marker_is_refused(ckpt, tmp_path):
    """issue 47: ownership by the marker (tokens.json's format), not by file names: a user's index.html and
    tokens.json are never overwritten."""
    (tmp_path / "t.txt").write_text("hello world, some words here")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "index.html").write_text("my page")
    (out / "tokens.json").write_text('{"mine": true}')
    with pytest.raises(ESLMError, match="the token view's output"):
        tv.build_token_view(str(ckpt[0]), out, text=str(tmp_path / "t.txt"))
    assert (out / "index.html").read_text() == "my page" and (out / "tokens.json").read_text() == '{"mine": true}'
