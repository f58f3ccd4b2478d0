"""Retrievers (BM25, dense, remote) behind one Protocol, and the `/retrieve` server.

Heavy dependencies (bm25s, transformers, fastapi, httpx) load only when a retriever or
the server is built, so importing this package is cheap.
"""

from stratarl.retrieval.base import Passage, RetrievalError, Retriever
from stratarl.retrieval.bm25 import BM25Retriever
from stratarl.retrieval.corpus import CorpusError, iter_corpus, load_corpus, write_corpus
from stratarl.retrieval.factory import build_retriever
from stratarl.retrieval.remote import RemoteRetriever
from stratarl.retrieval.server import ServerThread, create_app, serve


def __getattr__(name: str):
    if name == "DenseRetriever":
        from stratarl.retrieval.dense import DenseRetriever  # imports torch: keep `import stratarl.retrieval` light

        return DenseRetriever
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
    "serve",
    "write_corpus",
]
