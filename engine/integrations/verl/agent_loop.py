"""verl's agent loops with requests named by the sample they generate, for reproducible sampling.

Under ``rollout.full_determinism`` the ``composable_hf`` generator draws each request's tokens
from a random stream keyed by the request's id (:meth:`~engine.integrations.verl.rollout.
HFGenerator._stream_key`). verl's own agent loops name a request ``det-{priority}``, and
verl's v1 trainer (``main_ppo``'s default, every trainer mode) passes no priority: every
request is ``det-0``. Rows with the same prompt then take their streams in arrival order, which
changes from run to run, so which samples land in which group (verl's ``uid``) changes too, and
with it the advantages (a resumed GRPO run's gradient norm was 1.41 where the uninterrupted
run's was 1.00, on the same samples).

The loops here are verl's (``single_turn_agent``, ``tool_agent``), registered under
:data:`~engine.integrations.verl.cells.AGENT_LOOPS`'s names; under ``full_determinism`` each
names its requests by what identifies its sample in verl's batch, :func:`sample_key`: the
dataset row (``index``, verl's ``extra_info.index``), the sample of that row (``session_id``,
v1 trainer), the row of the repeated batch (``priority``, the classic trainer) and the step the
prompt was drawn at (``global_steps``). verl's ``uid`` is a fresh ``uuid4`` each run, so it
cannot key a stream. A multi-turn sample sends its turns one after another under one name; the
generator tells them apart by their order, which is the sample's own. The launcher
(:mod:`engine.integrations.verl.ppo`) makes the single-turn loop the default on a CPU host.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.single_turn_agent_loop import (
    SingleTurnAgentLoop as _VerlSingleTurn,
)
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop as _VerlTool

#: The batch entries that tell one sample from another in verl's trainers, in key order.
IDENTITY = ("global_steps", "index", "session_id", "priority")


def sample_key(entries: dict[str, Any]) -> str:
    """What identifies a sample among the entries verl hands its agent loop (``index=3,
    session_id=1``); the same in every run that draws the same rows."""
    parts = []
    for name in IDENTITY:
        if name in entries:
            value = entries[name]
            if getattr(value, "ndim", None) == 0:
                value = value.item()  # a 0-d tensor or numpy scalar from verl's batch
            parts.append(f"{name}={value}")
    return ",".join(parts)


class SampleKeyedClient:
    """verl's LLM server client, with each request id suffixed by the sample's key."""

    def __init__(self, client: Any, key: str) -> None:
        self._client = client
        self._key = key

    async def generate(self, request_id: str, **kwargs: Any) -> Any:
        return await self._client.generate(request_id=f"{request_id}|{self._key}", **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class _SampleKeyed:
    """The part shared by both loops: one instance runs one sample (verl builds a loop per
    sample), so its client is wrapped for that sample alone."""

    server_manager: Any
    rollout_config: Any

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        if getattr(self.rollout_config, "full_determinism", False):
            self.server_manager = SampleKeyedClient(self.server_manager, sample_key(kwargs))
        return await super().run(sampling_params, **kwargs)  # type: ignore[misc]


class SingleTurnAgentLoop(_SampleKeyed, _VerlSingleTurn):
    """verl's ``single_turn_agent``, its requests named by their sample."""


class ToolAgentLoop(_SampleKeyed, _VerlTool):
    """verl's ``tool_agent``, its requests named by their sample."""
