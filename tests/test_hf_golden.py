"""The model against an external oracle: logits and greedy tokens of Hugging Face transformers' ``LlamaForCausalLM``.

``hf_golden/*.npz`` were made once by ``tests/make_hf_golden.py`` (not run in
CI; see its docstring for the command and ``hf_golden/versions.json`` for the
versions): three tiny models (GQA; plain multi-head with rope base 500000;
tied embeddings with one kv head and an explicit head_dim), two prompts of
lengths 5 and 7, float32 logits at every prompt position and for 9 greedy
tokens through transformers' own KV cache. Nothing of cupykv (config
parsing, weight names, rotary embedding, reference model) was used to make
them, so a mistake shared by ``Llama`` and ``LlamaReference`` shows here.

``Llama`` runs every prompt prefix (the prefill keeps only the last logits)
and then decodes teacher-forced on transformers' tokens, eagerly and through
a captured graph, in every storage dtype.
"""
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cupykv.graph import capture
from cupykv.models import Llama, LlamaConfig
from cupykv.rope import Rope
from cupykv.spec import IO_DTYPES as DTYPES
from cupykv.tolerances import FP32_ACCUMULATION, UNIT_ROUNDOFF
from backends import BACKENDS

GOLDEN = Path(__file__).parent / "hf_golden"
FIXTURES = ("gqa", "mha", "tied")
MIN_CLEAR_FRACTION = 0.5      # greedy checks must cover at least half of the steps, or they prove little


@dataclass(frozen=True)
class Golden:
    """One fixture: a model, its prompts, and what transformers computed for them."""

    name: str
    config: LlamaConfig
    weights: dict                  # HF name -> bfloat16 array
    prompts: list                  # [batch] lists of token ids
    prefill_logits: np.ndarray     # [batch, longest, vocab] float32, 0 past each prompt's length
    logits: np.ndarray             # [steps, batch, vocab] float32: the logits each greedy token came from
    tokens: np.ndarray             # [batch, steps] int64: transformers' greedy tokens

    @property
    def logit_scale(self) -> float:
        return float(max(np.abs(self.prefill_logits).max(), np.abs(self.logits).max()))

    def prefill_mask(self) -> np.ndarray:
        """[batch, longest] bool: the positions inside each prompt."""
        lengths = np.array([len(p) for p in self.prompts])
        return np.arange(self.prefill_logits.shape[1])[None, :] < lengths[:, None]

    def margins(self) -> np.ndarray:
        """[steps, batch]: how far transformers' greedy token leads the runner-up."""
        top2 = np.sort(self.logits, axis=-1)[..., -2:]
        return top2[..., 1] - top2[..., 0]


@functools.lru_cache(maxsize=None)
def load(name: str) -> Golden:
    with np.load(GOLDEN / f"{name}.npz") as archive:
        arrays = {key: archive[key] for key in archive.files}
    config = LlamaConfig.from_hf(json.loads(str(arrays.pop("config")[()])))
    weights = {key: arrays.pop(key).view(ml_dtypes.bfloat16) for key in list(arrays)
               if key.startswith(("model.", "lm_head."))}
    prompts = [row[:n].tolist() for row, n in zip(arrays["prompt_ids"], arrays["prompt_lengths"])]
    golden = Golden(name, config, weights, prompts, arrays["prefill_logits"], arrays["logits"], arrays["tokens"])
    last = [golden.prefill_logits[b, len(p) - 1] for b, p in enumerate(prompts)]
    assert np.array_equal(np.stack(last), golden.logits[0]), "the fixture's first step is its last prompt position"
    assert np.array_equal(golden.logits.argmax(-1).T, golden.tokens), "the fixture's tokens are its logits' argmax"
    return golden


def logits_bound(dtype: str, golden: Golden) -> float:
    """Largest allowed |cupykv logit - transformers' float32 logit|, for one fixture.

    ``max|logit| * (2 * n_layers * u(dtype) + 256 * u(float32))``, ``u`` the unit roundoff.

    The first term is the error of low precision itself. The weights are
    bfloat16-exact, so every dtype holds them exactly; what a low-precision
    model adds is the rounding of each op's output to the storage dtype
    (relative error <= u, about eight times per layer on the residual path).
    Independent roundings mostly cancel: measured against transformers,
    cupykv's ``Llama`` (and its NumPy ``LlamaReference``, which rounds at the
    same points in float64, by as much) is off by 0.7..1.2 u per layer,
    relative to max|logit| (gqa, mha, tied: bfloat16 1.6, 1.8, 2.7 u;
    float16 1.4, 1.8, 3.4 u; eager and graph alike). Allowing 2 u per layer
    keeps a margin of at least 1.75x over that and still catches a doubled
    rope base in the fast path (``test_rope_base_mutant_is_caught``: 1.4x the
    bound at worst, bfloat16 on mha); the worst-case sum of every rounding
    (16 u per layer, ``cupykv.tolerances.logits_tolerance``) lets that mutant
    pass. The second term, ``FP32_ACCUMULATION`` (1.5e-5), covers float32
    arithmetic: transformers and the kernels add dot products of up to 160
    terms in other orders and use other exp, sin and cos; in float32 the
    model differs from transformers by 6..11 u(float32) of max|logit|.
    """
    per_layer = 2 * UNIT_ROUNDOFF[dtype]
    return golden.logit_scale * (golden.config.num_hidden_layers * per_layer + FP32_ACCUMULATION)


def run_llama(golden: Golden, dtype: str, use_graph: bool, backend: str = "emulator", rope: Rope | None = None):
    """cupykv's view of a fixture.

    Returns the logits at every prompt position ``[batch, longest, vocab]``,
    the logits of every step teacher-forced on transformers' tokens
    ``[steps, batch, vocab]`` (step 0 from the prompts; decode steps eager or
    replayed from one captured graph), both float32, and the tokens of free
    greedy decoding ``[batch][steps]``. ``rope`` replaces the model's rotary
    settings (the fast path's only), to plant a mutant.
    """
    batch, longest = golden.prefill_mask().shape
    n_steps = golden.tokens.shape[1]
    model = Llama(golden.config, golden.weights, dtype=dtype, max_seq=longest + n_steps, batch=batch,
                  backend=backend)
    if rope is not None:
        model.rope = rope
    prefill = np.zeros(golden.prefill_logits.shape, np.float32)
    for n in range(1, longest + 1):      # the prefill keeps each prompt's last logits only: run every prefix
        _, logits = model.generate([p[:n] for p in golden.prompts], 1, return_logits=True)
        for b, prompt in enumerate(golden.prompts):
            if n <= len(prompt):
                prefill[b, n - 1] = logits[0, b]
    _, first = model.generate(golden.prompts, 1, return_logits=True)
    steps, graph = [first[0]], None
    for s in range(1, n_steps):
        model.feed(golden.tokens[:, s - 1].tolist())     # transformers' token, whatever ours was
        if not use_graph:
            model.decode_step()
        elif graph is None:
            graph = capture(model.decode_step)           # its warm-up run is this step
        else:
            graph.replay()
        steps.append(model._host_logits())
    greedy = model.generate(golden.prompts, n_steps, use_graph=use_graph)
    return prefill, np.stack(steps), greedy


def logit_errors(golden: Golden, prefill: np.ndarray, steps: np.ndarray) -> dict:
    """Max and mean |error| of the prefill positions and of the decode steps (step 0 is a prefill position)."""
    prefill_error = np.abs(prefill.astype(np.float64) - golden.prefill_logits)[golden.prefill_mask()]
    decode_error = np.abs(steps[1:].astype(np.float64) - golden.logits[1:])
    return {"prefill": float(prefill_error.max()), "decode": float(decode_error.max()),
            "mean": float(np.concatenate([prefill_error.ravel(), decode_error.ravel()]).mean())}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FIXTURES)
def test_logits_and_greedy_tokens_match_transformers(name, dtype, use_graph, backend):
    golden = load(name)
    prefill, steps, greedy = run_llama(golden, dtype, use_graph, backend)
    bound = logits_bound(dtype, golden)
    errors = logit_errors(golden, prefill, steps)
    worst = max(errors["prefill"], errors["decode"])
    print(f"{name} {dtype} {'graph' if use_graph else 'eager'}: max error prefill {errors['prefill']:.3g}, "
          f"decode {errors['decode']:.3g}, mean {errors['mean']:.3g}; bound {bound:.3g} ({worst / bound:.2f} of it)")
    assert worst <= bound, (f"logits outside the bound {bound:.3g}: max error prefill {errors['prefill']:.3g}, "
                            f"decode {errors['decode']:.3g}, mean {errors['mean']:.3g}")

    # every logit is within `bound`, so where transformers' token leads by more than twice that, it must win
    clear = golden.margins() > 2 * bound                                     # [steps, batch]
    assert clear.mean() >= MIN_CLEAR_FRACTION, f"only {int(clear.sum())}/{clear.size} steps are clear"
    assert np.array_equal(steps.argmax(-1)[clear], golden.tokens.T[clear])
    # free greedy decoding follows transformers' path up to the first step that is not clear
    for b, tokens in enumerate(greedy):
        agree = int(np.argmin(clear[:, b])) if not clear[:, b].all() else len(tokens)
        assert tokens[:agree] == golden.tokens[b, :agree].tolist(), f"sequence {b}, first {agree} tokens"


# bfloat16 only: its bound is the loosest (16 u(bf16) = 2**-4 per layer against 2**-7 and 2**-20), and the
# mutant's error is the rope error itself, whatever the dtype, so the tighter bounds catch it a fortiori.
@pytest.mark.parametrize("dtype", ["bfloat16"])
@pytest.mark.parametrize("name", FIXTURES)
def test_rope_base_mutant_is_caught(name, dtype):
    """Doubling the rope base in the fast path only (the reference model is not involved) breaks the bound."""
    golden = load(name)
    mutant = Rope(theta=2 * golden.config.rope_theta)
    prefill, steps, _ = run_llama(golden, dtype, use_graph=False, rope=mutant)
    errors = logit_errors(golden, prefill, steps)
    bound = logits_bound(dtype, golden)
    worst = max(errors["prefill"], errors["decode"])
    print(f"{name} {dtype} rope base x2: max error {worst:.3g} = {worst / bound:.2f} x bound {bound:.3g}")
    assert worst > bound, f"the mutant passed: max error {worst:.3g} <= bound {bound:.3g}"


def test_fixtures_cover_what_the_config_reads():
    configs = {name: load(name).config for name in FIXTURES}
    assert configs["gqa"].num_key_value_heads < configs["gqa"].num_attention_heads
    assert configs["mha"].num_key_value_heads == configs["mha"].num_attention_heads
    assert configs["mha"].rope_theta != configs["gqa"].rope_theta
    assert configs["mha"].rms_norm_eps != configs["gqa"].rms_norm_eps
    tied = configs["tied"]
    assert tied.tie_word_embeddings and "lm_head.weight" not in load("tied").weights
    assert tied.head_dim * tied.num_attention_heads != tied.hidden_size and tied.num_key_value_heads == 1
    versions = json.loads((GOLDEN / "versions.json").read_text())
    assert {"torch", "transformers"} <= set(versions)
