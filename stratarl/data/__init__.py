"""Datasets (Search-R1 formats), the synthetic knowledge base, model loading."""
