"""Reading a Hugging Face config.json, shared by every model family's `from_hf_config`."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping


def read_config_json(source: str | os.PathLike | Mapping[str, Any]) -> dict:
    """The config as a dict, from a dict, a config.json file or a checkpoint directory.

    Raises FileNotFoundError when there is no config.json, ValueError when it cannot be read or
    is not a JSON object (both name the path)."""
    if isinstance(source, Mapping):
        return dict(source)
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json at {path}") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read model config {path}: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw
