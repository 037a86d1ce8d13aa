"""``eslm tokens CHECKPOINT (--data DIR | --text FILE) --out DIR``: which tokens ESLM keeps (the paper's
appendix "token selection analysis"; docs/report.md, "eslm tokens"). Scores come from full fp32 logits; the
VaR threshold is over all passages together (``--scope batch``) or per passage."""

from __future__ import annotations

import html
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eslm import metrics as M
from eslm.analysis import figures
from eslm.data.loader import open_dataset
from eslm.data.tokenizers import get_tokenizer
from eslm.errors import ConfigError, DataError
from eslm.files import check_output_dir, read_marker, replace_dir
from eslm.model.loading import load_model
from eslm.ops.naive_head import naive_token_stats
from eslm.selection.risk import at_or_above, check_alpha, var_threshold

# (score key, title, RGB of the highlight) — the paper's colours: electric blue for entropy, salmon for loss.
VARIANTS = (("entropy", "ESLM-VaR-entropy", (44, 117, 255)), ("loss", "ESLM-CVaR-loss", (250, 128, 114)))
TOP_K = 20


@dataclass
class Passage:
    """Token ids of one passage (its first token is context only; the others are scored)."""

    source: str
    ids: list[int]
    domain: str = "text"


# ---------------------------------------------------------------- inputs


def text_passages(text: str, tok, num: int, max_tokens: int) -> list[Passage]:
    """The first ``num`` paragraphs with at least two tokens, each cut to ``max_tokens + 1`` ids."""
    out: list[Passage] = []
    for para in (p.strip("\n") for p in text.replace("\r\n", "\n").split("\n\n")):
        ids = tok.encode(para)[: max_tokens + 1] if para.strip() else []
        if len(ids) >= 2:
            out.append(Passage(f"paragraph {len(out) + 1}", ids))
        if len(out) == num:
            break
    if not out:
        raise DataError("expected text with at least one paragraph of two or more tokens, found none; "
                              "pass a non-empty --text file")
    return out


def stream_passages(stream, eot_id: int, num: int, max_tokens: int, domain: str) -> list[Passage]:
    """``num`` passages evenly spread over a token stream, each starting at a document start (after an
    end-of-text token) and stopping at the next end-of-text or after ``max_tokens + 1`` ids."""
    arr = np.asarray(stream)
    starts = [0] + [int(i) + 1 for i in np.flatnonzero(arr == eot_id) if i + 2 < len(arr)]
    starts = [s for s in starts if s + 1 < len(arr) and arr[s] != eot_id and arr[s + 1] != eot_id]
    if not starts:
        return []
    picks = sorted({starts[round(k * (len(starts) - 1) / max(1, num - 1))] for k in range(num)})
    out = []
    for s in picks:
        window = arr[s: s + max_tokens + 1].tolist()
        if eot_id in window:
            window = window[: window.index(eot_id)]
        if len(window) >= 2:
            out.append(Passage(f"{domain} @ token {s}", [int(t) for t in window], domain))
    return out


# ---------------------------------------------------------------- scores and selection


@torch.no_grad()
def score_passage(model, ids: list[int], device: str = "cpu") -> dict[str, torch.Tensor]:
    """{"entropy", "loss"}: fp32 (len(ids) - 1,) for predicting ids[1:] from ids[:-1]."""
    x = torch.tensor(ids[:-1], dtype=torch.long, device=device)
    y = torch.tensor(ids[1:], dtype=torch.long, device=device)
    hidden = model(x[None])[0].float()
    stats = naive_token_stats(hidden, model.head_weight.float(), y, need_entropy=True)
    assert stats.entropy is not None  # need_entropy=True
    return {"entropy": stats.entropy.cpu(), "loss": stats.loss.cpu()}


def thresholds(scores: list[torch.Tensor], alpha: float, scope: str) -> list[float]:
    """VaR_alpha per passage: one shared value over all passages (batch) or one each (passage)."""
    if scope == "batch":
        return [float(var_threshold(torch.cat(scores), alpha))] * len(scores)
    return [float(var_threshold(s, alpha)) for s in scores]


def analyse(model, passages: list[Passage], alpha: float, scope: str, device: str = "cpu") -> list[dict]:
    """Per passage: scores and, per variant, the threshold and the kept flags (score >= threshold)."""
    scored = [score_passage(model, p.ids, device) for p in passages]
    out: list[dict[str, Any]] = [{"source": p.source, "domain": p.domain, "ids": p.ids,
                                  "scores": {k: s[k].tolist() for k, *_ in VARIANTS}, "variants": {}}
                                 for p, s in zip(passages, scored)]
    for key, *_ in VARIANTS:
        per = [s[key] for s in scored]
        for rec, s, t in zip(out, per, thresholds(per, alpha, scope)):
            kept = at_or_above(s, t)
            rec["variants"][key] = {M.THRESHOLD: t, "kept": kept.tolist(),
                                    M.CVAR: float(s[kept].mean()), M.KEPT_FRAC: float(kept.float().mean())}
    return out


# ---------------------------------------------------------------- rendering


def visible(text: str) -> str:
    """Whitespace made visible for the frequency chart: ' the' -> '␣the', '\\n' -> '↵', tab -> '→'."""
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "→") or "∅"


def token_texts(tok, ids: list[int]) -> list[str]:
    """Each id decoded on its own (a multi-byte character split over tokens shows as U+FFFD)."""
    return [tok.decode([i]) for i in ids]


def _span_text(text: str) -> str:
    """HTML for one token: escaped, newlines shown as ↵ plus a line break, tabs as →."""
    esc = html.escape(text).replace("\t", "→")
    return esc.replace("\n", "<span class='ws'>↵</span><br>")


def passage_cell(rec: dict, texts: list[str], key: str, rgb) -> str:
    """One column: the passage with the variant's scores and kept flags."""
    scores, kept = rec["scores"][key], rec["variants"][key]["kept"]
    lo, hi = min(scores), max(scores)
    spans = [f"<span class='ctx' title='context only (not scored)'>{_span_text(texts[0])}</span>"]
    for i, (s, k) in enumerate(zip(scores, kept)):
        e, lo_ = rec["scores"]["entropy"][i], rec["scores"]["loss"][i]
        tip = html.escape(f"{texts[i + 1]!r}: entropy {e:.3f}, loss {lo_:.3f}, {'kept' if k else 'dropped'}")
        a = 0.08 + 0.8 * ((s - lo) / (hi - lo) if hi > lo else 1.0)
        spans.append(f"<span class='t {'k' if k else 'd'}' data-variant='{key}' data-score='{s!r}' "
                     f"data-kept='{int(bool(k))}' style='background:rgba({rgb[0]},{rgb[1]},{rgb[2]},{a:.3f})' "
                     f"title='{tip}'>{_span_text(texts[i + 1])}</span>")
    return "<div class='p'>" + "".join(spans) + "</div>"


CSS = """body{font-family:sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;color:#222}
table.v{border-collapse:collapse;width:100%;table-layout:fixed}table.v td,table.v th{border:1px solid #ddd;
padding:6px;vertical-align:top}.p{font-family:monospace;font-size:13px;white-space:pre-wrap;line-height:1.7}
.t.k{color:#000;border-bottom:2px solid #222}.t.d{color:#999}.ctx{color:#bbb}.ws{color:#aaa}
.note{color:#555;font-size:0.9em}img{max-width:49%;border:1px solid #eee}"""


def render_html(records: list[dict], tok, meta: dict, pngs: dict[str, str], by_domain: dict | None = None) -> str:
    """The page: settings, legend, one two-column table per passage, the frequency charts, and per domain the
    most often kept and dropped tokens (``by_domain``: {domain: {variant: kept_dropped_by_domain's entry}})."""
    head = "".join(f"<th>{title}</th>" for _, title, _ in VARIANTS)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>eslm tokens</title><style>{CSS}</style>"
             "</head><body><h1>Token selection view</h1>",
             f"<p>Checkpoint <code>{html.escape(str(meta['checkpoint']))}</code> (step {meta['step']}), "
             f"tokenizer {html.escape(str(meta['tokenizer']))}, alpha = {meta['alpha']} (keep the top "
             f"{1 - meta['alpha']:.0%} by score), threshold scope: {meta['scope']}.</p>",
             "<p class='note'>Each token is coloured by its score (darker = higher) under the token it predicts; "
             "<b>kept</b> tokens (score &ge; VaR threshold) are underlined and black, dropped ones grey. Left: "
             "predictive entropy (VaR-entropy); right: per-token loss (CVaR-loss). The first token of a passage is "
             "context only. ↵ marks a newline. Hover a token for its numbers.</p>"]
    for i, rec in enumerate(records):
        texts = token_texts(tok, rec["ids"])
        info = " | ".join(f"{title}: threshold {rec['variants'][k][M.THRESHOLD]:.3f}, kept "
                          f"{rec['variants'][k][M.KEPT_FRAC]:.0%}, CVaR {rec['variants'][k][M.CVAR]:.3f}"
                          for k, title, _ in VARIANTS)
        cells = "".join(f"<td>{passage_cell(rec, texts, k, rgb)}</td>" for k, _, rgb in VARIANTS)
        parts.append(f"<h3>Passage {i + 1}: {html.escape(rec['source'])}</h3><p class='note'>{info}</p>"
                     f"<table class='v'><tr>{head}</tr><tr>{cells}</tr></table>")
    parts.append(f"<h2>Top-{TOP_K} selected tokens</h2><p>"
                 + "".join(f"<img src='{pngs[k]}' alt='top tokens {t}'>" for k, t, _ in VARIANTS) + "</p>")
    if by_domain:
        parts.append("<h2>Most often kept and dropped tokens per domain</h2><p class='note'>Over the passages "
                     "shown: each token's count of kept (dropped) predictions and its number of occurrences.</p>")
        parts += [domain_table(d, v) for d, v in by_domain.items()]
    return "\n".join(parts) + "</body></html>"


def top_tokens(records: list[dict], tok, key: str, k: int = TOP_K) -> list[tuple[str, int]]:
    """The k most frequent kept tokens of a variant, as (visible text, count)."""
    return Counter(visible(t) for rec in records
                   for t, kept in zip(token_texts(tok, rec["ids"])[1:], rec["variants"][key]["kept"]) if kept
                   ).most_common(k)


def kept_dropped_by_domain(records: list[dict], tok, key: str, k: int = TOP_K) -> dict[str, dict]:
    """Per domain (in first-seen order), for variant ``key``: the ``k`` tokens most often kept and the ``k`` most
    often dropped, as {"tokens": scored tokens of the domain, "kept_frac": their kept fraction,
    "kept": [[visible text, times kept, occurrences]], "dropped": [[visible text, times dropped, occurrences]]}.
    A token is a token id shown by its text; ties in the count go to the rarer token (a higher rate), then to
    the text, so the lists are deterministic."""
    seen: dict[str, Counter] = {}
    kept: dict[str, Counter] = {}
    for rec in records:
        texts = [visible(t) for t in token_texts(tok, rec["ids"])[1:]]
        d = rec.get("domain", "text")
        seen.setdefault(d, Counter()).update(texts)
        kept.setdefault(d, Counter()).update(t for t, f in zip(texts, rec["variants"][key]["kept"]) if f)
    out = {}
    for d, n in seen.items():
        dropped = Counter({t: c - kept[d][t] for t, c in n.items() if c > kept[d][t]})

        def ranked(counts: Counter, n: Counter = n) -> list[list]:
            order = sorted(counts.items(), key=lambda tc: (-tc[1], n[tc[0]], tc[0]))
            return [[t, c, n[t]] for t, c in order[:k]]

        total = sum(n.values())
        out[d] = {"tokens": total, M.KEPT_FRAC: sum(kept[d].values()) / total if total else 0.0,
                  "kept": ranked(+kept[d]), "dropped": ranked(dropped)}
    return out


def domain_table(domain: str, by_variant: dict[str, dict]) -> str:
    """HTML: one domain's most often kept and dropped tokens, two columns per variant."""
    head = "".join(f"<th colspan='2'>{title}</th>" for _, title, _ in VARIANTS)
    sub = "<th>kept (times kept / occurrences)</th><th>dropped (times dropped / occurrences)</th>" * len(VARIANTS)
    rows = max(len(by_variant[k][side]) for k, *_ in VARIANTS for side in ("kept", "dropped"))

    def cell(items: list, i: int) -> str:
        if i >= len(items):
            return "<td></td>"
        t, c, n = items[i]
        return f"<td><code>{html.escape(t)}</code> {c}/{n}</td>"

    body = "".join("<tr>" + "".join(cell(by_variant[k][side], i) for k, *_ in VARIANTS for side in ("kept", "dropped"))
                   + "</tr>" for i in range(rows))
    info = ", ".join(f"{title}: {by_variant[k][M.KEPT_FRAC]:.0%} kept" for k, title, _ in VARIANTS)
    return (f"<h3>{html.escape(domain)}</h3><p class='note'>{by_variant[VARIANTS[0][0]]['tokens']} scored tokens; "
            f"{info}</p><table class='v kd'><tr>{head}</tr><tr>{sub}</tr>{body}</table>")


def frequency_chart(path: Path, items: list[tuple[str, int]], title: str, rgb) -> None:
    """Horizontal bar chart of (token, count), most frequent on top."""
    from matplotlib.ticker import MaxNLocator

    plt = figures.pyplot()
    fig, ax = plt.subplots(figsize=(6, 0.28 * max(5, len(items)) + 1.2))
    labels = [repr(t)[1:-1] for t, _ in items][::-1]
    ax.barh(range(len(items)), [c for _, c in items][::-1], color=[v / 255 for v in rgb])
    ax.set_yticks(range(len(items)))
    ax.set_yticklabels(labels, fontsize=8, family="monospace")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("times selected")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    figures.save(plt, fig, path)


# ---------------------------------------------------------------- entry point


def _passages(data, text, tok_name, num, max_tokens):
    """(passages, tokenizer name) from --data (each domain's validation tokens) or --text."""
    if data:
        ds = open_dataset(data)
        passages = [p for domain in ds.domains
                    for p in stream_passages(ds.tokens("val", domain), ds.eot_id, num, max_tokens, domain)]
        if not passages:
            raise DataError(f"expected validation tokens in {data}, found no passage of two or more tokens; "
                            "prepare the data with a validation split (eslm prepare ... --out DIR)")
        if tok_name and ds.tokenizer_name != tok_name:
            raise DataError(f"expected data tokenized with the model's tokenizer {tok_name!r}, found "
                            f"{ds.tokenizer_name!r} in {data}; prepare the data with --tokenizer {tok_name}")
        return passages, ds.tokenizer_name
    p = Path(text)
    if not p.is_file():
        raise DataError(f"expected a text file at {p}, found none; check the --text path")
    name = tok_name or "gpt2"
    return text_passages(p.read_text(encoding="utf-8", errors="replace"), get_tokenizer(name), num, max_tokens), name


def _check_options(alpha: float, num: int, max_tokens: int, top: int = TOP_K) -> None:
    check_alpha(alpha)
    if num < 1 or max_tokens < 1 or top < 1:
        raise ConfigError(f"expected --num-passages, --max-tokens and --top >= 1, found {num}, {max_tokens} "
                              f"and {top}; pass positive values")


def build_token_view(checkpoint: str, out_dir: str | Path, *, data: str | None = None, text: str | None = None,
                     alpha: float = 0.1, num_passages: int = 4, max_tokens: int = 256, scope: str = "batch",
                     tokenizer: str | None = None, device: str = "cpu", top: int = TOP_K) -> dict:
    """Score, select, and write index.html, top_tokens_<variant>.png and tokens.json; returns the JSON dict
    (``by_domain``: per domain and variant, the ``top`` tokens most often kept and most often dropped)."""
    _check_options(alpha, num_passages, max_tokens, top)
    model, info = load_model(checkpoint, device)
    max_tokens = min(max_tokens, model.config.block_size)  # inputs are the first max_tokens ids
    passages, tok_name = _passages(data, text, tokenizer or info.get("tokenizer"), num_passages, max_tokens)
    if (bad := max(max(p.ids) for p in passages)) >= (vocab := model.config.vocab_size):
        raise DataError(f"expected token ids below the model's vocab_size {vocab}, found {bad}; "
                        "use the tokenizer the model was trained with (--tokenizer)")
    tok = get_tokenizer(tok_name)
    out = Path(out_dir)
    check_output_dir(out, "the token view's output", is_token_view)  # before the work: refused in one line
    records = analyse(model, passages, alpha, scope, device)
    meta = {"checkpoint": str(checkpoint), "step": info.get("step"), "tokenizer": tok_name,
            "alpha": alpha, "scope": scope}
    by_variant = {k: kept_dropped_by_domain(records, tok, k, top) for k, *_ in VARIANTS}
    by_domain = {d: {k: by_variant[k][d] for k, *_ in VARIANTS} for d in by_variant[VARIANTS[0][0]]}
    pngs = {key: f"top_tokens_{key}.png" for key, *_ in VARIANTS}
    result = {"format": VIEW_FORMAT, **meta, "passages": records,
              "top_tokens": {k: top_tokens(records, tok, k) for k, *_ in VARIANTS}, "by_domain": by_domain}

    def fill(d: Path) -> None:
        for key, title, rgb in VARIANTS:
            frequency_chart(d / pngs[key], top_tokens(records, tok, key),
                            f"{title}: top-{TOP_K} selected tokens (alpha={alpha})", rgb)
        (d / "index.html").write_text(render_html(records, tok, meta, pngs, by_domain), encoding="utf-8")
        (d / "tokens.json").write_text(json.dumps(result))

    replace_dir(out, fill, what="the token view's output", is_ours=is_token_view)
    return result


VIEW_FORMAT = "eslm-token-view-v1"


def is_token_view(d: Path) -> bool:
    """``d`` holds only what ``eslm tokens`` writes (index.html, tokens.json, top_tokens_*.png) and its tokens.json
    says so (``format: VIEW_FORMAT``): an earlier view, proven by its marker, not by its file names."""
    names = {p.name for p in Path(d).iterdir()}
    if not ("tokens.json" in names and all(n in ("index.html", "tokens.json") or
                                           (n.startswith("top_tokens_") and n.endswith(".png")) for n in names)):
        return False
    return read_marker(Path(d) / "tokens.json", VIEW_FORMAT) is not None
