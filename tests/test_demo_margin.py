"""The demo's greedy check: tokens must match the reference where its margin is clear, on enough steps."""
import re

import numpy as np
import pytest

from cupykv import demo
from cupykv.demo import MIN_CLEAR_FRACTION, check_greedy_margins
from cupykv.models.llama_reference import LlamaReference


def _logits(winners, margin, vocab=8):
    """[steps, batch, vocab] logits whose best token is ``winners[step][b]``, ahead of the rest by ``margin``."""
    winners = np.asarray(winners)
    logits = np.zeros(winners.shape + (vocab,))
    np.put_along_axis(logits, winners[..., None], margin, axis=-1)
    return logits


def test_clear_steps_that_agree_pass():
    want = _logits([[1, 2], [3, 4], [5, 6]], margin=1.0)                # 3 steps, batch 2
    tokens = [[1, 3, 5], [2, 4, 6]]                                     # [batch][steps]
    assert check_greedy_margins(tokens, want, error=0.1) == (6, 3, None)


def test_a_clear_step_that_disagrees_fails():
    want = _logits([[1, 2], [3, 4], [5, 6]], margin=1.0)
    n_clear, _, failure = check_greedy_margins([[1, 3, 5], [2, 7, 6]], want, error=0.1)
    assert n_clear == 6 and failure == "greedy tokens disagree with the reference at 1 of 6 clear steps"


@pytest.mark.parametrize("error", [0.6, np.inf, np.nan])
def test_too_few_clear_steps_fail_even_when_every_token_disagrees(error):
    # no margin exceeds 2 * error, so no step is checked: the check must not pass vacuously
    want = _logits([[1, 2], [3, 4], [5, 6]], margin=1.0)
    n_clear, n_needed, failure = check_greedy_margins([[0, 0, 0], [0, 0, 0]], want, error=error)
    assert (n_clear, n_needed) == (0, 3)
    assert failure.startswith("greedy check covers too few steps: 0/6 have a reference margin above twice")


def test_the_minimum_is_a_fraction_of_the_steps_and_at_least_one():
    want = _logits([[1]] * 4, margin=1.0)
    want[:3, 0, 2] = 0.95                                # three near-ties: only the last step is clear
    assert check_greedy_margins([[1, 1, 1, 1]], want, error=0.1)[:2] == (1, int(np.ceil(4 * MIN_CLEAR_FRACTION)))
    assert check_greedy_margins([[1, 1, 1, 1]], want, error=0.1)[2].startswith("greedy check covers too few")
    one = _logits([[1]], margin=1.0)
    assert check_greedy_margins([[1]], one, error=0.1) == (1, 1, None)


def test_the_default_emulator_demo_meets_the_minimum_with_margin(capsys):
    assert demo.run_demo(backend="emulator") == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if "steps clear" in line)
    n_clear, n_steps, n_needed = map(int, re.search(r"\((\d+)/(\d+) steps clear, (\d+) needed\)", line).groups())
    assert n_needed == np.ceil(n_steps * MIN_CLEAR_FRACTION) and n_clear >= 1.5 * n_needed


def test_the_demo_fails_when_no_step_is_clear(monkeypatch, capsys):
    class TiedReference(LlamaReference):
        """The real reference logits with the runner-up raised to the best: every step a tie."""

        def logits(self, prompts, tokens):
            want = super().logits(prompts, tokens)
            runner_up = np.argsort(want, axis=-1)[..., -2:-1]
            np.put_along_axis(want, runner_up, want.max(-1, keepdims=True), axis=-1)
            return want

    monkeypatch.setattr(demo, "LlamaReference", TiedReference)
    assert demo.run_demo(backend="emulator", steps=4) == 1
    assert "FAILED: greedy check covers too few steps: 0/12 have a reference margin" in capsys.readouterr().out
