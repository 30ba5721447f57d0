"""What every backend does to a patched model's saving: the tokenizer's length and ``save_pretrained``.

A patch may be given a tokenizer: its ``model_max_length`` follows the new window (so that a saved tokenizer
tells vLLM and the Trainer the served length) and ``unpatch`` puts the old value back. A patched model's
``save_pretrained`` is the stock one followed by what the backend adds to the folder (RoPE: the legacy config
fields; absolute: the original position tables), installed on the instance and removed by ``unpatch``.
"""

from __future__ import annotations

import os
import types
from typing import Any, Callable

from torch import nn

__all__ = [
    "check_tokenizer",
    "set_tokenizer_lengths",
    "restore_tokenizer_lengths",
    "install_save_pretrained",
    "remove_save_pretrained",
]

#: (tokenizer, its ``model_max_length`` before any patch) pairs, kept by a patch for ``unpatch``.
TokenizerLengths = list[tuple[Any, Any]]


def check_tokenizer(tokenizer: Any) -> None:
    """Refuse a ``tokenizer=`` that is not a transformers tokenizer (before anything changes).

    Raises:
        TypeError: ``tokenizer`` has no int ``model_max_length``.
    """
    if tokenizer is not None and not isinstance(getattr(tokenizer, "model_max_length", None), int):
        raise TypeError(
            f"tokenizer= must be a transformers tokenizer (with an int model_max_length), got {type(tokenizer).__name__}."
        )


def set_tokenizer_lengths(previous: TokenizerLengths, tokenizer: Any, length: int) -> TokenizerLengths:
    """Give this patch's tokenizer (the new one, else the previous patch's) ``model_max_length = length``.

    A new tokenizer replaces the previous patch's, whose length is restored first (so that the same
    tokenizer given twice keeps its pre-patch length as the one to restore).

    Args:
        previous: the pairs the previous patch kept (empty when the model was not patched).
        tokenizer: the tokenizer given to this patch, or None.
        length: the new window.

    Returns:
        (tokenizer, its length before any patch) pairs, for :func:`restore_tokenizer_lengths`.
    """
    kept = list(previous)
    if tokenizer is not None:
        restore_tokenizer_lengths(kept)
        kept = [(tokenizer, tokenizer.model_max_length)]
    for tok, _ in kept:
        tok.model_max_length = length
    return kept


def restore_tokenizer_lengths(kept: TokenizerLengths) -> None:
    """Put back the ``model_max_length`` each tokenizer had before the patch."""
    for tokenizer, value in kept:
        tokenizer.model_max_length = value


class _SavePretrained:
    """A patched model's ``save_pretrained``: the stock one, then ``after_save(model, folder)`` on the main process.

    Named ``save_pretrained`` so that pickling the bound method (dill, multiprocess) looks the name up again.
    """

    __name__ = "save_pretrained"

    def __init__(self, after_save: Callable[[nn.Module, str], None]) -> None:
        self.after_save = after_save

    def __call__(self, model: nn.Module, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        result = type(model).save_pretrained(model, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            self.after_save(model, os.fspath(save_directory))
        return result


def install_save_pretrained(model: nn.Module, after_save: Callable[[nn.Module, str], None]) -> None:
    """Make ``model.save_pretrained`` the stock save followed by ``after_save(model, folder)``.

    Args:
        model: the patched model (the method is set on this instance only).
        after_save: what the backend adds to the saved folder; called on the main process only.
    """
    model.__dict__["save_pretrained"] = types.MethodType(_SavePretrained(after_save), model)


def remove_save_pretrained(model: nn.Module) -> None:
    """Give ``model`` back its class's ``save_pretrained``."""
    model.__dict__.pop("save_pretrained", None)
