"""The command line: user errors print one line and exit 2; the demo sizes its cache from its arguments."""
import os
import subprocess
import sys

import pytest

import cupykv.backends
from cupykv.__main__ import main
from cupykv.demo import MAX_STEPS, run_demo
from cupykv.errors import InputError


def _one_line_error(capsys, prefix):
    err = capsys.readouterr().err
    assert err.startswith(prefix), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_cupy_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(cupykv.backends, "cuda_available", lambda: (False, "no CUDA device is visible"))
    for command in (["demo"], ["bench"], ["generate", "hi", "--gguf", "x.gguf"], ["validate"]):
        assert main([*command, "--backend", "cupy"]) == 2
        _one_line_error(capsys, f"cupykv {command[0]}: error: backend 'cupy' is not usable here: no CUDA device")


def test_emulator_without_gxx(capsys, monkeypatch, tmp_path):
    from cupykv.backends.emulator import build
    monkeypatch.setattr(build, "CXX", "g++")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["demo", "--backend", "emulator"]) == 2
    _one_line_error(capsys, "cupykv demo: error: the cupykv CPU emulator needs x86-64 Linux and GCC's g++")


def test_bad_backend_setting(capsys, monkeypatch):
    monkeypatch.setenv("CUPYKV_BACKEND", "tpu")
    assert main(["demo"]) == 2
    _one_line_error(capsys, "cupykv demo: error: CUPYKV_BACKEND: expected one of")


@pytest.mark.parametrize("steps", ["0", "-3", str(MAX_STEPS + 1)])
def test_demo_steps_out_of_range(capsys, steps):
    assert main(["demo", "--backend", "emulator", "--steps", steps]) == 2
    _one_line_error(capsys, f"cupykv demo: error: steps: expected an int in 1..{MAX_STEPS} (new tokens per "
                            f"prompt), got {int(steps)}")


def test_generate_missing_or_broken_file(capsys, tmp_path):
    missing = tmp_path / "missing.gguf"
    assert main(["generate", "hi", "--gguf", str(missing), "--backend", "emulator"]) == 2
    _one_line_error(capsys, "cupykv generate: error: path: expected a GGUF file")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    assert main(["generate", "hi", "--gguf", str(broken), "--backend", "emulator"]) == 2
    _one_line_error(capsys, "cupykv generate: error: path: ")
    assert main(["generate", "hi", "--gguf", str(broken), "--max-new-tokens", "0", "--backend", "emulator"]) == 2
    _one_line_error(capsys, "cupykv generate: error: --max-new-tokens: expected an int >= 1, got 0")


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(**kwargs):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr("cupykv.demo.run_demo", broken)
    with pytest.raises(ZeroDivisionError):
        main(["demo", "--backend", "emulator"])


def test_interrupt_exits_130(capsys, monkeypatch):
    def interrupted(**kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("cupykv.demo.run_demo", interrupted)
    assert main(["demo", "--backend", "emulator"]) == 130
    _one_line_error(capsys, "cupykv demo: interrupted")


def test_user_error_from_a_real_process():
    env = dict(os.environ, CUPYKV_BACKEND="tpu")
    proc = subprocess.run([sys.executable, "-m", "cupykv", "demo"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("cupykv demo: error: CUPYKV_BACKEND: expected one of") and \
        proc.stderr.count("\n") == 1, proc.stderr


def test_demo_steps_are_checked_for_python_callers():
    with pytest.raises(InputError, match=r"^steps: expected an int in 1\.\.4096"):
        run_demo(backend="emulator", steps=0)
    with pytest.raises(ValueError):   # InputError is a ValueError
        run_demo(backend="emulator", steps=True)


@pytest.mark.parametrize("steps", [1, 60])
def test_demo_cache_fits_the_steps(steps, capsys):
    """max_seq follows the prompts and the steps (it was fixed at 64: 60 steps overflowed it)."""
    assert run_demo(backend="emulator", steps=steps) == 0
    assert f"{steps} new tokens each" in capsys.readouterr().out
