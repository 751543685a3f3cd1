"""Where a piece of source text is: how the tests name the lines that emulator reports cite."""

from pathlib import Path


def line_number(path, needle, nth=None):
    """The 1-based number of the only line of ``path`` that holds ``needle`` (or of the ``nth``
    such line, when several do)."""
    hits = [i + 1 for i, text in enumerate(Path(path).read_text().splitlines()) if needle in text]
    if nth is not None:
        return hits[nth]
    assert len(hits) == 1, f"{needle!r} is on lines {hits} of {path}"
    return hits[0]


def source_site(path, needle):
    """``'name:LINE'`` of the only line of ``path`` that holds ``needle``: a site as the emulator's
    reports and traffic counts name it."""
    return f"{Path(path).name}:{line_number(path, needle)}"
