"""Reusable training parts, independent of any loop: atomic checkpoints and the data sampler (checkpoint),
the device / precision policy (precision), the FLOP model (flops), run-directory metrics and transcripts
(metrics), learning-rate schedules (schedules), intra-op threads (threads), progress displays (progress),
and functions named in a config (callables)."""
