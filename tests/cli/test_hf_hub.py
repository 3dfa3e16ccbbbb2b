"""`hf:owner/name`: a Hugging Face hub repository's config.json, read from the local cache (never the
network in these tests: every hub call is either a cache hit or a stand-in that raises)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("huggingface_hub")
from huggingface_hub import constants, errors  # noqa: E402

from meshplan.planner.models import hf_hub  # noqa: E402

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
REPO, COMMIT = "acme/tiny-llama", "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding acme/tiny-llama's config.json at `main`, the hub unreachable."""
    root = tmp_path / "hub"
    repo = root / f"models--{REPO.replace('/', '--')}"
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "config.json").write_text(json.dumps(LLAMA))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(hf_hub, "_hub_resolvable", lambda endpoint: False)
    hf_hub.hub_config_file.cache_clear()
    yield repo / "snapshots" / COMMIT / "config.json"
    hf_hub.hub_config_file.cache_clear()


def one_line_error(code: int, err: str) -> str:
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("text, hub", [("acme/tiny-llama", True), ("gpt2", True), ("acme/tiny-llama@v1.0", True),
                                       ("configs/llama.json", False), ("../acme/x", False), ("/abs/path", False),
                                       ("a/b/c", False)])
def test_what_reads_as_a_hub_repository_id(text, hub):
    assert hf_hub.is_hub_id(text) is hub


def test_a_local_directory_wins_over_a_hub_id_of_the_same_name(tmp_path, monkeypatch):
    (tmp_path / "acme" / "tiny-llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hf_hub.config_file("acme/tiny-llama") == "acme/tiny-llama/config.json"


def test_a_cached_repository_profiles_as_its_config_file_does(run_cli, hub_cache):
    assert hf_hub.config_file(REPO) == str(hub_cache)
    assert hf_hub.config_file(f"{REPO}@main") == str(hub_cache)
    by_id = run_cli("profile", "--model", f"hf:{REPO}", "--seq", 16, "--no-cache", "--json")
    by_path = run_cli("profile", "--model", f"hf:{hub_cache}", "--seq", 16, "--no-cache", "--json")
    assert by_id[0] == by_path[0] == 0
    id_data, path_data = json.loads(by_id[1]), json.loads(by_path[1])
    assert id_data["total_params"] == path_data["total_params"] > 0
    assert [layer["fwd_flops"] for layer in id_data["layers"]] == [layer["fwd_flops"] for layer in path_data["layers"]]
    code, text, _ = run_cli("profile", "--model", f"hf:{REPO}", "--seq", 16, "--no-cache")
    assert code == 0 and f"config: {hub_cache} (the local Hugging Face cache's copy of {REPO})" in text


def test_a_plan_keeps_the_hub_id_and_resolves_it_when_read(run_cli, hub_cache, tmp_path):
    out = tmp_path / "plan.json"
    code, _, err = run_cli("plan", "--model", f"hf:{REPO}", "--cluster", "cpu", "--gpus", 2, "--gbs", 4,
                           "--seq", 16, "--out", out)
    assert code == 0, err
    model = json.loads(out.read_text())["model"]
    assert model["spec"] == f"hf:{REPO}" and len(model["digest"]) == 64
    code, out_text, err = run_cli("simulate", "--plan", out)
    assert code == 0 and "fits: yes" in out_text, err
    hub_cache.write_text(json.dumps({**LLAMA, "intermediate_size": 256}))  # a new revision behind the same id
    code, _, err = run_cli("report", "--plan", out, "--out", tmp_path / "report.html")
    assert code == 0 and "is not the one it was planned for: " in err and str(hub_cache) in err


def test_uncached_and_offline_names_the_download_command(run_cli, hub_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, _, err = run_cli("profile", "--model", "hf:acme/other@v2", "--seq", 16, "--no-cache")
    err = one_line_error(code, err)
    assert "HF_HUB_OFFLINE is set" in err and "`hf download acme/other config.json --revision v2`" in err


def test_uncached_without_network_fails_at_once(run_cli, hub_cache):
    code, _, err = run_cli("estimate", "--model", "hf:acme/other", "--cluster", "cpu", "--gpus", 1, "--gbs", 2,
                           "--seq", 16)
    assert "cannot be resolved (no network)" in one_line_error(code, err)


def hub_error(kind: type[Exception], message: str) -> Exception:
    """An instance of huggingface_hub's error `kind` without its HTTP response (constructors differ
    across versions; the resolver reads only the type)."""
    err = kind.__new__(kind)
    BaseException.__init__(err, message)
    return err


@pytest.mark.parametrize("kind, words", [
    (errors.GatedRepoError, "is gated: accept its licence on huggingface.co and set HF_TOKEN"),
    (errors.RepositoryNotFoundError, "no local path or hub repository 'acme/other'"),
    (errors.RemoteEntryNotFoundError, "has no config.json"),
    (errors.LocalEntryNotFoundError, "the hub cannot be reached"),
])
def test_hub_failures_are_one_line_naming_the_fix(run_cli, hub_cache, monkeypatch, kind, words):
    import huggingface_hub

    failure = hub_error(kind, "the hub said no")

    cached = huggingface_hub.hf_hub_download

    def download(repo, filename, local_files_only=False, **kwargs):
        if local_files_only:
            return cached(repo, filename, local_files_only=True, **kwargs)
        raise failure

    monkeypatch.setattr(hf_hub, "_hub_resolvable", lambda endpoint: True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    code, _, err = run_cli("profile", "--model", "hf:acme/other", "--seq", 16, "--no-cache")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2 and "downloading it" in lines[0], err  # the notice, then the error
    assert words in lines[1] and "hf:path/config.json" in lines[1]
