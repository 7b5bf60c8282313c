"""Fixed players named `module:function`: `kuberl eval --against` and self-play's `selfplay.fixed_players`
(docs/multi-agent.md). The function takes one agent's observation, or its observation and its action
mask (None where the env has none; a turn-based game's player must keep to it), and returns its action
(kuberl_envs.tron:scripted is one)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any
from collections.abc import Callable

import numpy as np

Player = Callable[[np.ndarray, Any], Any]   # (observation, mask or None) -> action


def load_player(name: str) -> Player:
    """The function `name` ("module:function") names, as a function of an observation and a mask.
    ValueError saying what is wrong with `name` where it cannot be imported or is not a function."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{name!r} is not module:function (a function of an observation)")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{name}: {err}") from None
    if not callable(fn):
        raise ValueError(f"{name}: {attr} is not a function (of an observation)")
    try:
        takes_mask = len(inspect.signature(fn).parameters) >= 2
    except (TypeError, ValueError):   # (a builtin without a signature: the observation alone)
        takes_mask = False
    return fn if takes_mask else (lambda obs, mask: fn(obs))
