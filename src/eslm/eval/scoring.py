"""The lm-eval requests on token ids, as lm-eval's HF model computes them (the same context / continuation split,
the same rolling windows), so numbers are comparable (docs/evaluation.md).
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm


@torch.no_grad()
def score_continuations(model, pairs: list[tuple[list[int], list[int]]], batch_size: int = 16,
                        progress: bool = False) -> list[tuple[float, bool]]:
    """Log-likelihood of each continuation given its context, and whether it is the greedy one.

    ``pairs``: (context ids, continuation ids), context non-empty. Returns (sum of log-probs in nats,
    is_greedy) per pair, in input order. Logits are computed only at continuation positions.
    """
    block = model.config.block_size
    device = next(model.parameters()).device
    # Longest first: the batch shape is set by its first row, and out-of-memory shows up at once.
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    results: list[tuple[float, bool] | None] = [None] * len(pairs)
    for start in tqdm(range(0, len(order), batch_size), disable=not progress, desc="loglikelihood"):
        idxs = order[start : start + batch_size]
        inputs, targets = [], []
        for i in idxs:
            ctx, cont = pairs[i]
            full = (ctx + cont)[-(block + 1):]
            inputs.append(full[:-1])
            targets.append(cont[-(len(full) - 1):])  # a continuation longer than the window is cut too
        hidden = model(pad_sequence([torch.tensor(s) for s in inputs], batch_first=True).to(device))  # zeros after
        for row, i in enumerate(idxs):
            n_in, tgt = len(inputs[row]), targets[row]
            h = hidden[row, n_in - len(tgt) : n_in]  # positions predicting the continuation
            logp = model.logits(h).float().log_softmax(-1)
            t = torch.tensor(tgt, device=device)
            ll = logp.gather(1, t[:, None]).sum().item()
            results[i] = (ll, bool((logp.argmax(-1) == t).all()))
    return results  # type: ignore[return-value]


def rolling_windows(tokens: list[int], eot_id: int, block_size: int) -> list[tuple[list[int], list[int]]]:
    """The harness's disjoint rolling windows: every token predicted once, with up to block_size context."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    return [make_disjoint_window(w) for w in get_rolling_token_windows(
        token_list=tokens, prefix_token=eot_id, max_seq_len=block_size, context_len=1)]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation) as the harness's HF model splits them: trailing spaces of the
    context move to the continuation, the pair is encoded whole and split at the context's length, and an
    empty context becomes end-of-text."""
    if context == "":
        return [tokenizer.eot_id], tokenizer.encode(continuation)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def cut_at_stop(text: str, until: list[str]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    cut = len(text)
    for s in until:
        if s and (k := text.find(s)) != -1:
            cut = min(cut, k)
    return text[:cut]
