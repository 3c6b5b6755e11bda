"""A model argument that can only be a path, and names no folder, is reported as a missing folder.

`/srv/models/flux` cannot be a Hugging Face repo id, so "not in the local Hugging Face cache" and
`hf download /srv/models/flux` would send the reader the wrong way.
"""

from __future__ import annotations

import os
import re

from ..failures import FailureCode, HostWeightUsageError, usage_error

__all__ = ["check_folder_or_repo_id"]

# What huggingface_hub accepts as a repo id: a name, or 'org/name'.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def _missing(text: str) -> HostWeightUsageError:
    shown = os.path.abspath(os.path.expanduser(text))
    what = "is a file, not a folder" if os.path.isfile(shown) else "does not exist"
    return usage_error(
        f"the model folder {shown} {what}: pass the folder that holds model_index.json (or config.json), or a "
        "Hugging Face repo id ('org/name') in the local cache",
        code=FailureCode.NOT_FOUND,
        model_or_path=text,
    )


def check_folder_or_repo_id(text: str) -> None:
    """Raise HostWeightUsageError (NOT_FOUND) when `text` is not a folder and cannot be a repo id."""
    if os.path.isdir(text):
        return
    if not _REPO_ID.fullmatch(text) or "--" in text or ".." in text or os.path.exists(text):
        raise _missing(text)
