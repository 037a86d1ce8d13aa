"""Names of the metrics written to ``metrics.jsonl`` (one JSON object per line) and TensorBoard.

Every writer and reader in the package uses these constants (tests/test_metrics.py finds other spellings of
the names that are not also ordinary words). Units are in the names: tokens, seconds, FLOPs.
"""

KIND = "kind"  # "train" or "eval"
KIND_TRAIN = "train"
KIND_EVAL = "eval"

STEP = "step"  # optimizer steps completed (1-based after the first update)
TOKENS_SEEN = "tokens_seen"  # tokens that went through a forward pass of the trained model, all ranks
TRAIN_LOSS = "train_loss"  # the loss that was optimized (over kept tokens), averaged over the step
TRAIN_LOSS_ALL = "train_loss_all"  # mean CE over ALL tokens of the step (comparable across methods)
LR = "lr"
GRAD_NORM = "grad_norm"  # before clipping
TOKENS_PER_S = "tokens_per_s"
ELAPSED_S = "elapsed_s"  # wall-clock seconds of training since the run started (excludes eval), resumes included
CPU_S = "cpu_s"  # process CPU seconds (user + system, all threads) of training (excludes eval), resumes included
STEP_TIME_S = "step_time_s"  # wall-clock seconds of the last optimizer step
STEP_CPU_S = "step_cpu_s"  # process CPU seconds of the last optimizer step
LOAD_AVG_1M = "load_avg_1m"  # the machine's 1-minute load average when the line was written (os.getloadavg)
MFU = "mfu"  # model FLOPs utilisation (GPU only)

# Measurements of the machine rather than of the training: they differ between two identical runs (and
# between a run and its resumed twin), so bit-exact comparisons of metrics leave them out.
TIMING_KEYS = (TOKENS_PER_S, ELAPSED_S, CPU_S, STEP_TIME_S, STEP_CPU_S, MFU, LOAD_AVG_1M)

FLOPS_PAPER = "flops_paper"  # cumulative, the paper's convention (backward scaled by kept fraction)
FLOPS_EXECUTED = "flops_executed"  # cumulative, what was actually computed
FLOPS_DENSE = "flops_dense"  # cumulative, what plain CLM would have spent on the same tokens

# selection statistics (selective methods)
KEPT_FRAC = "kept_frac"
ALPHA = "alpha"
THRESHOLD = "threshold"
CVAR = "cvar"
SCORE_DROPPED_MEAN = "score_dropped_mean"
KEPT_FRAC_DOMAIN_PREFIX = "kept_frac/"  # + domain name

# evaluation
VAL_LOSS = "val_loss"  # mixed: mean over domains weighted by the training mixture weights
VAL_LOSS_DOMAIN_PREFIX = "val_loss/"  # + domain name: mean CE over that domain's fixed validation budget


def val_loss_key(domain: str) -> str:
    return VAL_LOSS_DOMAIN_PREFIX + domain


def kept_frac_key(domain: str) -> str:
    return KEPT_FRAC_DOMAIN_PREFIX + domain
