"""docs/migrating.md: every Python block runs as written, in order, on the default backend."""
import logging
import os
import re

import numpy as np

MIGRATING = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "migrating.md")


def python_blocks():
    with open(MIGRATING, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def table_rows(heading):
    """The snippet column of the table under ``heading``: one entry per call."""
    with open(MIGRATING, encoding="utf-8") as f:
        section = f.read().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [line.rstrip(" |").rsplit("|", 1)[1].strip() for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("|---")][1:]


def test_migration_snippets_run_in_order():
    blocks = python_blocks()
    assert len(blocks) == 11          # the setup, G1-G5, A1-A4 and the overflow example
    logger = logging.getLogger("cupykv")
    level = logger.level
    namespace = {}
    try:
        for block in blocks:                  # later snippets build on the setup and on each other
            exec(compile(block, "docs/migrating.md", "exec"), namespace)
    finally:
        logger.setLevel(level)                # A1 turns on the creation records
    cache, kv = namespace["cache"], namespace["kv"]
    assert namespace["draft"].lengths is namespace["target"].lengths
    assert cache.lengths_host().tolist() == [3, 8]
    assert np.asarray(kv._backend.to_host(namespace["where"])).tolist() == [[0, 1, 2, 3]]
    assert kv.lengths_host().tolist() == [0] and not kv._backend.to_host(kv.overflow).any()


def test_every_table_row_names_a_snippet_that_exists():
    with open(MIGRATING, encoding="utf-8") as f:
        text = f.read()
    graphsafe, abaddon = table_rows("GraphSafeKV → cupykv"), table_rows("abaddon `KvCache` → cupykv")
    assert graphsafe == ["G1", "G2", "G3", "G4", "G5"]
    assert abaddon == ["A1", "A2", "A3", "A4", "A4"]
    for name in set(graphsafe + abaddon):
        after = text.split(f"**{name}.**", 1)[1] if f"**{name}.**" in text else ""
        block, label = after.find("```python\n"), re.search(r"\*\*[GA]\d\.\*\*", after)
        assert block >= 0 and (label is None or block < label.start()), f"no snippet follows **{name}.**"
