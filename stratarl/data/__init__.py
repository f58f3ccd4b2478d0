"""Datasets (Search-R1 formats), the synthetic knowledge base, model loading.

Model loading lives in ``stratarl.models`` (imports torch); it is not re-exported here.
"""

from stratarl.data.examples import Example
from stratarl.data.search_r1 import (
    DatasetFormatError,
    extract_question,
    load_example_files,
    load_examples,
    write_examples,
    write_search_r1_jsonl,
    write_search_r1_parquet,
)
from stratarl.data.synth import SyntheticKB, generate_knowledge_base, write_synthetic_kb

__all__ = [
    "DatasetFormatError",
    "Example",
    "SyntheticKB",
    "extract_question",
    "generate_knowledge_base",
    "load_example_files",
    "load_examples",
    "write_examples",
    "write_search_r1_jsonl",
    "write_search_r1_parquet",
    "write_synthetic_kb",
]
