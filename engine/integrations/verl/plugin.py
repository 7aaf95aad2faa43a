"""The ``verl.plugins`` entry point: importing it registers the plug-in (verl imports it).

verl logs a plug-in that fails to load at debug level only; this one says why at warning level
(then verl's lookups fail with "not found", naming no cause)."""

import logging

from engine.integrations.verl import register

try:
    register()
except Exception:
    logging.getLogger(__name__).warning("composable-engine's verl plug-in failed", exc_info=True)
    raise
