"""The progress line printed at every log step: step, loss, lr, kept fraction, throughput, MFU, ETA."""

from __future__ import annotations

from eslm import metrics as M


def progress_line(rec: dict, step: int, total: str, done: float, elapsed_s: float) -> str:
    """``rec``: the step's metric record; ``total``: the step total to show; ``done``: the fraction of the run
    done (the ETA extrapolates elapsed_s linearly)."""
    remaining = elapsed_s * (1.0 - done) / max(done, 1e-12)
    parts = [f"step {step}/{total}", f"loss {rec[M.TRAIN_LOSS]:.4f}", f"lr {rec[M.LR]:.2e}"]
    if M.ALPHA in rec:
        parts.append(f"kept {rec[M.KEPT_FRAC]:.3f} (alpha {rec[M.ALPHA]:.3f})")
    parts.append(f"{rec[M.TOKENS_PER_S] / 1e3:.1f}k tok/s")
    if M.MFU in rec:
        parts.append(f"MFU {100 * rec[M.MFU]:.1f}%")
    parts.append(f"ETA {fmt_time(remaining)}")
    return " | ".join(parts)


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
