"""tests/verl run against a real veRL in .venv-verl (`make test-verl`); in the main venv they skip."""

from __future__ import annotations


def pytest_configure(config):
    # veRL probes optional engines (Megatron, VeOmni, …) at import and warns for each missing one.
    config.addinivalue_line("filterwarnings", "ignore:.*engine is not available:UserWarning")
    config.addinivalue_line("filterwarnings", "ignore:Disabled critic as algorithm.adv_estimator:UserWarning")
