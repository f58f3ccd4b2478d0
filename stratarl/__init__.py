"""stratarl: structure-aware reinforcement learning for LLM search agents.

Stratified GRPO (arXiv 2510.06214) and SORL's SO-PPO / SO-GRPO (arXiv 2511.20718),
with a Search-R1-compatible rollout engine, retrievers, server and trainer.
"""

__version__ = "0.1.0"
