"""Hugging Face Hub I/O for :class:`~hf_cocktail.CocktailConfig` files (download, upload); no config logic here.

A hf-cocktail "model" repo holds no weights: only ``cocktail_config.json`` and a ``README.md`` card naming the base
model it was tuned or evaluated for. Loading goes through :func:`huggingface_hub.hf_hub_download` (so it honours
``HF_HUB_OFFLINE``, ``HF_HUB_CACHE`` and tokens); publishing through :class:`huggingface_hub.HfApi`, the way
transformers' ``PushToHubMixin`` does.
"""

from __future__ import annotations

import os

from hf_cocktail._version import __version__

CONFIG_NAME = "cocktail_config.json"
README_NAME = "README.md"


def _hub():
    try:
        import huggingface_hub
    except ImportError as e:  # a dependency of transformers, so this is rare
        raise ImportError(
            "loading or pushing from the Hugging Face Hub needs huggingface_hub: pip install -U huggingface_hub"
        ) from e
    return huggingface_hub


# ---------------------------------------------------------------------------------------------------- loading
def download_config(
    repo_id: str,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
) -> str:
    """Local path of ``cocktail_config.json`` of Hub repo ``repo_id`` (downloaded, or taken from the HF cache).

    Raises ``FileNotFoundError`` when the repo has no such file and ``OSError`` (with the fix) when the repo or
    revision does not exist, is gated, or the Hub cannot be reached (offline) and nothing is cached.
    """
    hf = _hub()
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"Hub repo {repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    not_local = f"{repo_id!r} is not a local file or folder (relative to {os.getcwd()!r}), so it was read as a Hub id"
    try:
        return hf.hf_hub_download(
            repo_id,
            CONFIG_NAME,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            local_files_only=bool(local_files_only),
            library_name="hf-cocktail",
            library_version=__version__,
        )
    except LocalEntryNotFoundError as e:
        offline = bool(local_files_only) or constants.is_offline_mode()
        reason = (
            "the Hub is offline (HF_HUB_OFFLINE=1 or local_files_only=True)"
            if offline
            else "the Hub could not be reached (no network?)"
        )
        raise OSError(
            f"cannot load {CONFIG_NAME} from {where}: {reason} and no copy is in the local Hugging Face cache "
            f"({cache_dir or constants.HF_HUB_CACHE}). {not_local}. Fix: pass a local folder holding {CONFIG_NAME} "
            f"(e.g. a preset of hf-cocktail's model_cards/), or download it once while online "
            f"(unset HF_HUB_OFFLINE and do not pass local_files_only=True, or run "
            f"`hf download {repo_id} {CONFIG_NAME}`) and load it again."
        ) from e
    except EntryNotFoundError as e:
        raise FileNotFoundError(f"{where} has no {CONFIG_NAME}: it is not a hf-cocktail config repo") from e
    except RevisionNotFoundError as e:
        raise OSError(
            f"{where}: revision {revision or 'main'!r} does not exist (pass a branch, tag or commit hash)"
        ) from e
    except GatedRepoError as e:
        raise OSError(f"{where} is gated: request access on the Hub, then pass token= or run `hf auth login`") from e
    except RepositoryNotFoundError as e:
        raise OSError(
            f"{not_local}, but no such Hub repo exists (if it is private, pass token= or run `hf auth login`)"
        ) from e
    except HFValidationError as e:
        raise FileNotFoundError(f"{not_local}, but it is not a valid Hub repo id either: {e}") from e


# ---------------------------------------------------------------------------------------------------- pushing
def upload_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    commit_message: str,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    allow_patterns: list[str] | None = None,
):
    """Create ``repo_id`` if needed (and branch ``revision``), then upload ``folder``; returns the ``CommitInfo``."""
    api = _hub().HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        commit_message=commit_message,
        token=token,
        revision=revision,
        create_pr=create_pr,
        allow_patterns=allow_patterns,
    )


def hub_has_readme(repo_id: str, token: str | bool | None = None, revision: str | None = None) -> bool:
    """Whether ``repo_id`` already has a ``README.md`` (False when the repo or revision does not exist yet)."""
    return _hub().HfApi(token=token).file_exists(repo_id, README_NAME, revision=revision, token=token)


def looks_like_local_path(name: str) -> bool:
    """True when ``name`` can only be meant as a filesystem path, never a ``namespace/repo`` Hub id."""
    return (
        os.path.isabs(name)
        or name.startswith((".", "~"))
        or "\\" in name
        or name.endswith(".json")
        or name.count("/") > 1
    )
