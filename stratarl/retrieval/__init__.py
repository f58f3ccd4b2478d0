"""Retrievers (BM25, dense, remote, and kinds of your own: `register_retriever`) behind one Protocol, and the
`/retrieve` server.

Heavy dependencies (torch, bm25s, transformers, fastapi, httpx) load only when a retriever or
the server is built, so importing this package is cheap.
"""

import importlib

from stratarl.retrieval.base import Passage, RetrievalError, Retriever
from stratarl.retrieval.corpus import CorpusError, iter_corpus, load_corpus, write_corpus
from stratarl.retrieval.factory import build_retriever, register_retriever, retriever_names
from stratarl.retrieval.remote import RemoteRetriever
from stratarl.retrieval.server import ServerThread, create_app, serve

# Imported on first use: these modules import torch, and `import stratarl.retrieval` stays light.
_LAZY_NAMES = {"BM25Retriever": "stratarl.retrieval.bm25", "DenseRetriever": "stratarl.retrieval.dense"}


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'stratarl.retrieval' has no attribute {name!r}")


__all__ = [
    "BM25Retriever",
    "CorpusError",
    "DenseRetriever",
    "Passage",
    "RemoteRetriever",
    "RetrievalError",
    "Retriever",
    "ServerThread",
    "build_retriever",
    "create_app",
    "iter_corpus",
    "load_corpus",
    "register_retriever",
    "retriever_names",
    "serve",
    "write_corpus",
]
