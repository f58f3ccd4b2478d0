"""Integrations with other training engines. Each subpackage imports its engine lazily.

- :mod:`stratarl.integrations.verl`: veRL plugins (Stratified GRPO estimator, turn-level PPO
  loss, SORL's clipping-triggered normalisation). Load it in every Ray worker with
  ``VERL_USE_EXTERNAL_MODULES=stratarl.integrations.verl``; see docs/verl.md.
- :mod:`stratarl.integrations.verl_data`: veRL's Search-R1 parquet variant (no veRL import;
  used by ``stratarl verl convert-data``).
- :mod:`stratarl.integrations.search_tool`: the ``/retrieve`` client behind ``recipes/verl/search_tool.py``
  (no veRL import, no plugin: serves plain veRL runs too).

The veRL test harness (CPU smoke runs of veRL's trainer, a CPU platform for veRL) is not part of the package:
tests/verl/harness.
"""
