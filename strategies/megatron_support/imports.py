"""Importing megatron-core without its notices about GPU libraries it falls back from.

megatron-core warns (``UserWarning``, once per module, when the module is first imported) that
Apex or Transformer Engine is not installed and that it falls back to torch: "Apex is not
installed. Falling back to Torch Norm", "Transformer Engine and Apex are not installed. Falling
back to Torch optimizers". Without a GPU those libraries cannot be installed, and with one the
fallbacks are what the backend asks for unless ``layer_spec`` chooses Transformer Engine, so the
notice tells the user nothing they can act on. The megatron backend and the CPU platform import
megatron's modules through :func:`import_megatron`, inside a ``warnings.catch_warnings`` scope
that ignores exactly these messages: every other warning, megatron's included, still reaches
the user, and the user's own warning filters are left as they were.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

#: The start of each fallback notice of megatron-core (matched case-insensitively, as
#: ``warnings`` does): the library, "... not installed. Falling back".
FALLBACK_NOTICE = r"(Apex|Transformer Engine|TE)\b[\w ]* not installed\. Falling back"


@contextmanager
def fallback_notices_silenced() -> Iterator[None]:
    """Inside: megatron's fallback notices are ignored; outside, the filters are as before."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=FALLBACK_NOTICE, category=UserWarning, module=r"megatron\."
        )
        yield


def import_megatron(*names: str) -> dict[str, ModuleType]:
    """``megatron.core.<name>`` for each name, imported without the fallback notices (a module
    already imported is returned as it is)."""
    with fallback_notices_silenced():
        return {name: importlib.import_module(f"megatron.core.{name}") for name in names}
