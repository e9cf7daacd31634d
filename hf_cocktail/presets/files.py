"""`CocktailConfig`'s files: ``save_pretrained`` / ``from_pretrained`` (a folder, the file or a Hub repo) and
``push_to_hub``, with the generated model card. A mixin of :class:`~hf_cocktail.CocktailConfig` (it uses
``to_json_string`` and ``from_dict``)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from hf_cocktail.presets.hub import (
    CONFIG_NAME,
    README_NAME,
    download_config,
    hub_has_readme,
    looks_like_local_path,
    upload_folder,
)
from hf_cocktail.presets.model_card import write_card

_COMMIT_MESSAGE = "Upload Cocktail KV-cache config"


class ConfigFiles:
    """Saving, loading and publishing a config (see the module docstring)."""

    to_json_string: Any
    from_dict: Any

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        push_to_hub: bool = False,
        repo_id: str | None = None,
        commit_message: str | None = None,
        token: str | bool | None = None,
        private: bool | None = None,
        model_card: bool | str = True,
        **card_kwargs: Any,
    ) -> str:
        """Write ``cocktail_config.json`` (and a model card) into ``save_directory``; returns the config file path.

        Args:
            model_card: ``True``: write a generated ``README.md``
                (:func:`hf_cocktail.presets.model_card.make_model_card`) unless the folder already has one, which is
                kept (a hand-written card is never overwritten silently); a ``str``: the card text, written over any
            existing ``README.md``; ``False``: no card. push_to_hub: then upload ``cocktail_config.json`` and
                ``README.md`` of the folder, as they are on disk, to ``repo_id`` (default: the folder's name),
            creating the repo if needed. card_kwargs: passed to ``make_model_card`` (``base_model``, ``notes``,
        ``license``, ...).
        """
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())
        if push_to_hub and repo_id is None:
            repo_id = os.path.basename(os.path.abspath(save_directory))
        write_card(self, save_directory, model_card, repo_id or os.fspath(save_directory), card_kwargs)
        if push_to_hub:
            assert repo_id is not None  # set from the folder's name above
            upload_folder(
                save_directory,
                repo_id,
                commit_message=commit_message or _COMMIT_MESSAGE,
                private=private,
                token=token,
                allow_patterns=[CONFIG_NAME] + ([README_NAME] if model_card is not False else []),
            )
        return path

    def push_to_hub(
        self,
        repo_id: str,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        model_card: bool | str = True,
        **card_kwargs: Any,
    ):
        """Upload this config (and a model card) to Hub repo ``repo_id``, created if needed; returns the CommitInfo.

        ``model_card``: ``True`` uploads a generated card unless the repo already has a ``README.md`` (kept); a
        ``str`` is uploaded as ``README.md`` (replacing the repo's); ``False`` uploads the config only.
        ``card_kwargs`` go to :func:`hf_cocktail.presets.model_card.make_model_card`.
        """
        if model_card is True:
            if hub_has_readme(repo_id, token=token, revision=revision):
                model_card, card_kwargs = False, {}
            else:
                card_kwargs = {"name_or_path": repo_id} | card_kwargs
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, model_card=model_card, **card_kwargs)
            return upload_folder(
                tmp,
                repo_id,
                commit_message=commit_message or _COMMIT_MESSAGE,
                private=private,
                token=token,
                revision=revision,
                create_pr=create_pr,
            )

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        token: str | bool | None = None,
        local_files_only: bool | None = None,
        **overrides: Any,
    ) -> Any:
        """Read ``cocktail_config.json`` from a local folder, the file itself, or a Hub repo id.

        A path that exists locally is read directly (``revision``/``cache_dir``/``token`` are then unused); any
        other name is a Hub repo id fetched with ``huggingface_hub.hf_hub_download``, which uses the local HF cache
        and honours ``HF_HUB_OFFLINE=1`` / ``local_files_only=True``. ``overrides`` replace fields, e.g.
        ``encoder=hf_cocktail.offline_encoder_path()`` to run a MiniLM preset without the Hub.
        """
        name = os.path.expanduser(os.fspath(name_or_path))
        if os.path.exists(name) or looks_like_local_path(name):
            path = os.path.join(name, CONFIG_NAME) if os.path.isdir(name) else name
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"no {CONFIG_NAME} found at {name!r}"
                    + (
                        f" (the folder exists but has no {CONFIG_NAME})"
                        if os.path.isdir(name)
                        else " (no such local file or folder)"
                    )
                )
        else:
            path = download_config(
                name, revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only
            )
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(d, **overrides)
