"""Retrievers (BM25, dense, remote) behind one Protocol, and the `/retrieve` server."""

from stratarl.retrieval.base import Passage, Retriever

__all__ = ["Passage", "Retriever"]
