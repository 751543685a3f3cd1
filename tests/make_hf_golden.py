"""Write tests/hf_golden/*.npz: logits and greedy tokens of tiny LLaMA models, computed by Hugging Face transformers.

The fixtures are an oracle that shares no code with cupykv: the model is
transformers' own ``LlamaForCausalLM`` (float32, eager attention, its own
rotary embedding and KV cache). ``tests/test_hf_golden.py`` checks
``cupykv.models.Llama`` against them. Not run in CI (it needs torch and
transformers). The committed files were made, on x86-64 Linux with Python
3.11, by

    python -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    /tmp/hfvenv/bin/pip install transformers==5.24.0 numpy==2.4.6
    /tmp/hfvenv/bin/python tests/make_hf_golden.py

(torch's CPU wheel, 2.13.0+cpu); the versions are written to ``hf_golden/versions.json``.

Each ``<name>.npz`` holds

- ``config``: the Hugging Face ``config.json`` text of the model (0-d str);
- every parameter under its Hugging Face name (``model.embed_tokens.weight``,
  ...), as bfloat16 bit patterns (uint16). The weights are drawn in float32,
  rounded to bfloat16 (as a bfloat16 checkpoint stores them) and run by
  transformers in float32, so every cupykv dtype reads the same values;
- ``prompt_ids`` ``[batch, longest]`` int64, padded with -1, and ``prompt_lengths`` ``[batch]``;
- ``prefill_logits`` ``[batch, longest, vocab]`` float32: the logits at every
  prompt position of one forward pass over each prompt (0 past its length);
- ``tokens`` ``[batch, steps]`` int64: greedy tokens; ``tokens[:, 0]`` comes
  from the prompt, ``tokens[:, s]`` from feeding ``tokens[:, s - 1]`` through
  transformers' KV cache;
- ``logits`` ``[steps, batch, vocab]`` float32: the logits each greedy token
  was picked from (``Llama.generate(..., return_logits=True)``'s layout).
"""
import json
import math
import platform
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "hf_golden"
STEPS = 9                         # greedy tokens: one from the prompt, then 8 decode steps through the cache
PROMPT_LENGTHS = (5, 7)           # batch 2, different lengths (each prompt runs on its own in transformers)

# Three tiny models that between them cover what cupykv's LlamaConfig reads.
CONFIGS = {
    # GQA (2 query heads per kv head), head_dim = hidden / heads, the classic rope base
    "gqa": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=97, rope_theta=10000.0, rms_norm_eps=1e-6),
    # plain multi-head attention, head_dim 32, LLaMA 3's rope base, another eps
    "mha": dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
                intermediate_size=160, vocab_size=89, rope_theta=500000.0, rms_norm_eps=1e-5),
    # tied embeddings, one kv head (MQA), an explicit head_dim (4 * 24 != 64), three layers
    "tied": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                 intermediate_size=112, vocab_size=101, rope_theta=20000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=True),
}


def _bfloat16_bits(tensor) -> np.ndarray:
    """float32 tensor (already bfloat16-exact) -> its bfloat16 bit patterns, uint16."""
    bits = tensor.detach().float().numpy().view(np.uint32)
    assert not (bits & 0xFFFF).any(), "expected bfloat16-exact values"
    return (bits >> 16).astype(np.uint16)


def _init_weights(model, seed: int, tied: bool) -> None:
    """Seeded weights that give O(1..10) logits; every value rounded to bfloat16.

    Projections are N(0, 1/fan_in) (unit-scale activations), norm gains
    1 + N(0, 0.1^2), embeddings N(0, 1) and the LM head N(0, 2.5^2/hidden),
    so logits have a standard deviation near 2.5. Tied, the embedding is
    N(0, 0.3^2), for logits of the same size.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name == "model.embed_tokens.weight":
                value = noise * (0.3 if tied else 1.0)
            elif name == "lm_head.weight":
                value = noise * (2.5 / math.sqrt(hidden))
            else:
                value = noise / math.sqrt(param.shape[1])
            param.copy_(value.to(torch.bfloat16).float())


def _greedy(model, prompt: list[int]):
    """Prompt logits at every position, then STEPS greedy tokens with their logits, through the KV cache."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        prefill = out.logits[0].float().numpy()                     # [len, vocab]
        cache, step_logits, tokens = out.cache, [prefill[-1]], [int(prefill[-1].argmax())]
        for _ in range(STEPS - 1):
            out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            cache = out.cache
            step_logits.append(out.logits[0, -1].float().numpy())
            tokens.append(int(step_logits[-1].argmax()))
        # transformers' generate() must pick the same tokens
        generated = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False,
                                   min_new_tokens=STEPS)[0, len(prompt):].tolist()
        assert generated == tokens, (generated, tokens)
        # and one forward pass over prompt + tokens (no cache) must give the decode logits to float32 accuracy
        full = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float().numpy()
        drift = float(np.abs(full - np.stack(step_logits)).max())
    return prefill, np.stack(step_logits), tokens, drift


def make(name: str, spec: dict, seed: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(**spec, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                     max_position_embeddings=64, attn_implementation="eager")
    model = LlamaForCausalLM(hf).float().eval()
    _init_weights(model, seed, spec.get("tie_word_embeddings", False))
    generator = torch.Generator().manual_seed(seed + 1000)
    prompts = [torch.randint(0, spec["vocab_size"], (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]

    batch, longest, vocab = len(prompts), max(PROMPT_LENGTHS), spec["vocab_size"]
    prompt_ids = np.full((batch, longest), -1, np.int64)
    prefill_logits = np.zeros((batch, longest, vocab), np.float32)
    logits = np.zeros((STEPS, batch, vocab), np.float32)
    tokens = np.zeros((batch, STEPS), np.int64)
    for b, prompt in enumerate(prompts):
        prompt_ids[b, : len(prompt)] = prompt
        prefill, steps, greedy, drift = _greedy(model, prompt)
        prefill_logits[b, : len(prompt)] = prefill
        logits[:, b] = steps
        tokens[b] = greedy
        top2 = np.sort(steps, axis=-1)[:, -2:]
        print(f"{name}[{b}]: prompt {prompt} -> {greedy}; max |logit| {np.abs(steps).max():.2f}, "
              f"smallest top-1 margin {float((top2[:, 1] - top2[:, 0]).min()):.3f}, cache vs no cache {drift:.2g}")

    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not hf.tie_word_embeddings}
    config = {key: value for key, value in hf.to_dict().items() if key in (
        "model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "hidden_act",
        "rope_parameters", "rope_theta", "tie_word_embeddings", "attention_bias", "mlp_bias")}
    arrays = {name: _bfloat16_bits(tensor) for name, tensor in state.items()}
    arrays.update(config=np.array(json.dumps(config, sort_keys=True)), prompt_ids=prompt_ids,
                  prompt_lengths=np.array(PROMPT_LENGTHS, np.int64), prefill_logits=prefill_logits,
                  logits=logits, tokens=tokens)
    return arrays


def main() -> None:
    import torch
    import transformers

    torch.use_deterministic_algorithms(True)
    OUT.mkdir(exist_ok=True)
    for seed, (name, spec) in enumerate(CONFIGS.items()):
        path = OUT / f"{name}.npz"
        np.savez_compressed(path, **make(name, spec, seed))
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
                "python": platform.python_version(), "machine": platform.machine(),
                "attn_implementation": "eager", "dtype": "float32"}
    (OUT / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")


if __name__ == "__main__":
    main()
