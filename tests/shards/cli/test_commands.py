"""The model subcommands of the ncm CLI, run as a user would run them."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shards.cli import commands as cli

REPO_ROOT = Path(__file__).resolve().parents[3]


def run_cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NCM_HOME": str(home), "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "shards.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_register_adds_the_subcommands() -> None:
    parser = argparse.ArgumentParser(prog="ncm")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.register(sub)
    for argv in (["pull", "smollm2-135m", "--weights", "q4"], ["import", "x.gguf", "--name", "x"], ["models"],
                 ["generate", "m", "hi", "--raw", "--max-tokens", "3", "--temperature", "0.5", "--top-p", "0.9",
                  "--top-k", "5", "--seed", "1", "--system", "s"]):
        args = parser.parse_args(argv)
        assert callable(args.func)


def test_generate_unknown_model_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_cli("generate", "no-such-model", "hello", home=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-model" in lines[0]
    assert result.stdout == ""


def test_other_errors_exit_2(tmp_path: Path) -> None:
    for argv in (["import", str(tmp_path / "missing.gguf")], ["pull", "gpt-17"]):
        result = run_cli(*argv, home=tmp_path)
        assert result.returncode == 2, argv
        assert len(result.stderr.strip().splitlines()) == 1


def test_bad_sampling_option_exits_2(smollm2_store, smollm2_home: Path) -> None:
    result = run_cli("generate", "smollm2-135m", "hi", "--top-p", "0", home=smollm2_home)
    assert result.returncode == 2 and "top_p" in result.stderr


def test_models_on_an_empty_store(tmp_path: Path) -> None:
    result = run_cli("models", home=tmp_path)
    assert result.returncode == 0 and "ncm pull" in result.stdout


def test_models_table(smollm2_store, smollm2_home: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["models", "--home", str(smollm2_home)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "ARCH", "LAYERS", "WEIGHTS", "SIZE"]
    assert out[1].split()[:4] == ["smollm2-135m", "llama", "30", "f32"]


@pytest.mark.slow
def test_generate_streams_the_answer(smollm2_store, smollm2_home: Path) -> None:
    result = run_cli("generate", "smollm2-135m", "What is the capital of France?", "--max-tokens", "24",
                     home=smollm2_home)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_import_keeps_a_quantised_files_precision_by_default(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tests.shards.fragment_helpers import make_hf_checkpoint, write_gguf_from_hf

    model = make_hf_checkpoint(tmp_path / "hf", "llama", seed=2)
    quantised = write_gguf_from_hf(model, tmp_path / "q.gguf", "llama", types={"attn_q": "Q4_0", "ffn_up": "Q4_1",
                                                                               "ffn_down": "Q8_0"})
    floats = write_gguf_from_hf(model, tmp_path / "f.gguf", "llama")
    home = str(tmp_path / "home")
    for path, expected in ((quantised, "mixed"), (floats, "f32"), (tmp_path / "hf", "f32")):
        assert cli.main(["import", str(path), "--name", path.stem, "--home", home, "--quiet"]) == 0
        assert capsys.readouterr().out.strip().endswith(f"{expected})"), path
    assert cli.main(["import", str(quantised), "--name", "q4", "--weights", "q4", "--home", home, "--quiet"]) == 0
    assert capsys.readouterr().out.strip().endswith("q4)")
