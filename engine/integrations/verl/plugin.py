"""The ``verl.plugins`` entry point: importing it registers the plug-in (verl imports it)."""

from engine.integrations.verl import register

register()
