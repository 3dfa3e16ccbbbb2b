"""Bounds checked before any work: divisors by factorisation, finite numbers, a model's position
limit, argparse errors in one line, and the documented exit code of an estimate that does not fit."""
from __future__ import annotations

import json
import time

import pytest

from meshplan.planner.models.registry import PRESETS
from meshplan.planner.search.candidates import divisors

JOB = ("--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8")


def test_divisors_match_brute_force_and_factorise_a_huge_number_fast():
    for n in range(1, 3000):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    start = time.perf_counter()
    found = divisors(10**20 - 1)  # 3^2 * 11 * 41 * 101 * 271 * 3541 * 9091 * 27961
    assert time.perf_counter() - start < 5.0
    assert len(found) == 3 * 2**7 and found[0] == 1 and found[-1] == 10**20 - 1
    assert all((10**20 - 1) % d == 0 for d in found)


@pytest.mark.parametrize("flag,value", [("--train-tokens", "inf"), ("--train-tokens", "nan"),
                                        ("--time-limit", "infinity"), ("--moe-imbalance", "nan")])
def test_non_finite_numbers_exit_2_in_one_line(run_cli, flag, value):
    code, out, err = run_cli("plan", "--model", "gpt2", *JOB, flag, value)
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [f"meshplan plan: error: argument {flag}: must be a finite number, got "
                                        f"'{value}' (see meshplan plan --help)"]


def test_seq_beyond_learned_positions_exits_2_with_the_limit(run_cli):
    code, _, err = run_cli("estimate", "--model", "gpt2", *JOB, "--seq", 1025)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "exceeds the 1024 learned positions" in err and "--seq <= 1024" in err


@pytest.mark.parametrize("spec,limit", [("llama3-8b", 131072), ("llama2-7b", 4096), ("qwen3-30b-a3b", 40960)])
def test_a_rotary_model_past_its_trained_context_is_priced_with_a_note(run_cli, spec, limit):
    """torchtitan trains Llama 3.1 8B at 256K tokens (context extension): priced, and said."""
    code, _, err = run_cli("estimate", "--model", spec, *JOB, "--seq", limit * 2, "--json")
    assert code == 0, err
    assert f"trained on up to {limit} positions; --seq {limit * 2} assumes its rotary embedding extended" in err
    code, _, err = run_cli("estimate", "--model", spec, *JOB, "--seq", limit, "--json")
    assert code == 0 and "trained on up to" not in err


def test_every_preset_states_its_position_limit():
    assert all(cfg.position_limit > 0 for cfg in PRESETS.values())


@pytest.mark.parametrize("argv,command", [(("estimate", "--model", "gpt2", "--bogus"), "estimate"),
                                          (("plan", "--model", "gpt2"), "plan"),
                                          (("estimate", "--zero", "5"), "estimate"),
                                          (("--bogus",), None)])
def test_argparse_errors_are_one_line_with_the_help_hint(run_cli, argv, command):
    code, out, err = run_cli(*argv)
    prog = "meshplan" + (f" {command}" if command else "")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: ") and lines[0].endswith(f"(see {prog} --help)")


def test_an_estimate_that_does_not_fit_exits_2_and_0_with_json(run_cli):
    argv = ("estimate", "--model", "llama3-70b", "--cluster", "h100-sxm", "--gpus", "8", "--gbs", "8")
    code, out, err = run_cli(*argv)
    assert code == 2 and "fits: NO" in out
    assert err.strip().splitlines()[-1].startswith("meshplan estimate: does not fit: ")
    code, out, _ = run_cli(*argv, "--json")
    assert code == 0 and json.loads(out)["fits"] is False
    code, out, _ = run_cli("estimate", "--model", "gpt2", *JOB)
    assert code == 0 and "fits: yes" in out
    from meshplan.cli import build_parser

    assert "2 bad input or a configuration priced that does not fit" in " ".join(
        build_parser().command_parsers["estimate"].format_help().split())
