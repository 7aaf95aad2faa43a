"""megatron-core's "Apex / Transformer Engine is not installed. Falling back ..." notices are
silenced where the library imports megatron, by message, inside a scope: other warnings
(megatron's own included) and the user's filters are untouched."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from strategies.megatron_support.imports import fallback_notices_silenced

ROOT = Path(__file__).resolve().parents[3]
#: megatron-core 0.16's fallback notices, as its modules word them.
NOTICES = (
    "Apex is not installed. Falling back to Torch Norm",
    "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
    "Transformer Engine and Apex are not installed. Falling back to local implementations of "
    "multi_tensor_applier and multi_tensor_scale",
)


def recorded(message: str, module: str, *, silenced: bool) -> list[str]:
    """The messages a user recording every warning sees when ``module`` warns ``message``."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if silenced:
            with fallback_notices_silenced():
                warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module)
        else:
            warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module)
    return [str(warning.message) for warning in seen]


@pytest.mark.parametrize("notice", NOTICES)
def test_the_fallback_notices_are_silenced_in_the_scope_only(notice: str) -> None:
    assert recorded(notice, "megatron.core.optimizer", silenced=True) == []
    assert recorded(notice, "megatron.core.optimizer", silenced=False) == [notice]


@pytest.mark.parametrize(
    ("message", "module"),
    [
        # megatron's other warnings pass: the filter matches the message, not the module only
        ("full scope is deprecated. Use empty cuda_graph_scope.", "megatron.core.transformer"),
        ("Transformer Engine was not detected while capturing training cudagraphs.", "megatron"),
        # the same words from user code pass: only megatron's notices are silenced
        ("Apex is not installed. Falling back to Torch Norm", "my_project.model"),
    ],
)
def test_other_warnings_pass_the_scope(message: str, module: str) -> None:
    assert recorded(message, module, silenced=True) == [message]


#: Builds, initialises and trains a tiny megatron engine on CPU while recording every warning;
#: then imports a megatron module the backend does not (outside the library: its notice shows).
SCRIPT = """
import json, sys, warnings
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    from engine import Engine
    from engine.config import EngineConfig
    from engine.losses import sft_loss
    from tests.factories import random_batch, tiny_model
    config = EngineConfig.from_dict({"model": tiny_model(), "micro_batch_size": 4})
    engine = Engine.build(head="lm", backend="megatron", device="cpu", config=config)
    engine.initialize().train_batch(random_batch([3, 5], 64), sft_loss)
    library = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    imported = "megatron.core.optimizer" in sys.modules
    import megatron.core.models.bert.bert_layer_specs  # the user's own import
    after = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
print(json.dumps({"library": library, "imported": imported, "user": after[len(library):]}))
"""


def test_building_and_training_a_megatron_engine_shows_no_fallback_notice() -> None:
    # A fresh process: megatron announces a fallback only when a module is first imported.
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["imported"]  # megatron's noisy modules were imported in the recorded scope
    assert not [m for m in report["library"] if "not installed" in m], report["library"]
    # nor megatron's deprecation of its own default cuda_graph_scope (the backend passes [])
    assert not [m for m in report["library"] if "full scope" in m], report["library"]
    if importlib.util.find_spec("apex") is None:  # the notice exists here: outside, it shows
        assert "Apex is not installed. Falling back to Torch Norm" in report["user"]
