"""Datasets (registered formats: Search-R1, MedQA, MedMCQA, PhantomWiki, yours), the synthetic knowledge base, model loading.

Model loading lives in ``stratarl.models`` (imports torch); it is not re-exported here.
"""

from stratarl.data.examples import Example
from stratarl.data.formats import dataset_format_names, register_dataset_format
from stratarl.data.multiple_choice import medmcqa_example, medqa_example  # registers the medqa and medmcqa formats
from stratarl.data.phantomwiki import phantomwiki_example  # registers the phantomwiki format
from stratarl.data.search_r1 import (
    DatasetFormatError,
    extract_question,
    load_example_files,
    load_examples,
    search_r1_example,  # registers the search_r1 format
    write_examples,
    write_search_r1_jsonl,
    write_search_r1_parquet,
)
from stratarl.data.synth import SyntheticKB, generate_knowledge_base, write_synthetic_kb

__all__ = [
    "DatasetFormatError",
    "Example",
    "SyntheticKB",
    "dataset_format_names",
    "extract_question",
    "generate_knowledge_base",
    "load_example_files",
    "load_examples",
    "medmcqa_example",
    "medqa_example",
    "phantomwiki_example",
    "register_dataset_format",
    "search_r1_example",
    "write_examples",
    "write_search_r1_jsonl",
    "write_search_r1_parquet",
    "write_synthetic_kb",
]
