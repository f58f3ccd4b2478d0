"""Evaluation and evidence: greedy held-out evaluation (greedy), reading run directories (rundir), confidence
intervals and the collapse rule (stats), arms x seeds aggregation (aggregate), and the report: its numbers
(headline), figures (plots) and HTML page (report)."""
