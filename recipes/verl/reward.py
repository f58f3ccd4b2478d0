"""veRL custom reward for the stratarl recipes: Search-R1 exact match (see stratarl.integrations.verl.reward)."""

from stratarl.integrations.verl.reward import compute_score

__all__ = ["compute_score"]
