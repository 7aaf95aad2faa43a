"""A generator for verl's RL trainer where vLLM / SGLang cannot run (CPU hosts): Hugging Face
``transformers`` in a Ray actor, behind verl's rollout interfaces.

verl finds a rollout by name in two places: the replica (``RolloutReplicaRegistry``, which
starts the serving actor and answers the trainer's ``sleep`` / ``wake_up``) and the server
adapter (``verl.workers.rollout.base._ROLLOUT_REGISTRY``, built inside every trainer worker,
which receives the actor's weights). The plug-in registers both under :data:`NAME`
(``actor_rollout_ref.rollout.name=composable_hf``).

The model, its weight sync, the LoRA merge, the sampling loop and the routes are the shared
Hugging Face generator's (:mod:`engine.generation`, the demo's too); this module holds what is
verl's: request batching, request-id streams, sleep / resume, the bucketed sync protocol and
verl's rollout classes.

- **Generation** (:class:`HFGenerator`, one Ray actor per replica): verl's agent loop calls
  ``generate(request_id, prompt_ids=..., sampling_params=...)`` once per sample, concurrently;
  requests that arrive together are generated as one batch per distinct sampling setting
  (temperature, top-p, top-k, max tokens), stopping at the model's end-of-sequence tokens. Each
  sampled token's log-probability is the one it was drawn from (after temperature, top-k and
  top-p: vLLM's ``processed_logprobs``, verl's default). A mixture-of-experts model also
  returns the experts each token was routed to (``routed_experts``, for verl's R3 replay).
- **Weights** come only from verl's weight sync (``checkpoint_engine.backend=naive``:
  ``engine_workers.update_weights`` hands the trainer engine's ``get_per_tensor_param()`` to
  :class:`HFServerAdapter`): the replica's first trainer rank sends them in buckets of
  ``checkpoint_engine.update_weights_bucket_megabytes``; every other rank still walks the
  generator, whose collectives every rank takes part in. A replica apart gets them through the
  plug-in's ``composable_gloo`` checkpoint engine, whole or, with its ``delta``, as patches of
  what changed, written into the weights the generator holds. Nothing is read from disk but
  the model's config.
- **LoRA**: with ``model.lora.merge=True`` the adapters arrive merged, as plain weights.
  Otherwise (verl's default) the first sync sends the base model (each adapted linear's weight
  under its LoRA wrapper's name, ``...q_proj.base_layer.weight``) and every sync the adapters
  alone, under peft's names, with their PEFT config; the generator keeps each adapted linear's
  base weight and sets the linear to ``W + (B @ A) * alpha / r``, as the engine merges it.
- **Partial rollouts** (verl's ``colocate_async`` / ``separate_async`` trainers):
  ``abort_all_requests`` pauses generation and stops the batch in flight at its next token;
  its requests return what they generated (tokens, log-probs, routes) with
  ``stop_reason="aborted"``, and verl's ``FullyAsyncLLMServerClient`` continues each (prompt +
  part) after ``resume_generation``, from the weights synced meanwhile. Requests that arrive
  while paused wait for the resume (or are refused with ``reject_request=True``).
- **Sleep** (``free_cache_engine``, verl's default) frees the generator's weights; the sync
  allocates them again (``resume(["weights"])``) and fills them. With adapters synced alone
  the base model is sent once, so sleep keeps the weights (verl's level-1 sleep). Generating
  from released or never-synced weights is refused by name.

Settings this generator cannot honour (a tensor-, pipeline- or expert-parallel rollout,
multi-modal inputs, speculative decoding) are refused by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import threading
from collections.abc import Generator, Iterator
from typing import Any

import attrs
import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

from engine.generation.routes import RouteRecorder, is_moe
from engine.generation.sampling import GumbelMax, MostLikely, Warp, generate, left_padded
from engine.generation.weights import GeneratorWeights, build_model
from engine.integrations.verl.cells import ROLLOUT
from engine.integrations.verl.checkpoint_engine import NAMED_TENSORS, PATCHES
from engine.integrations.verl.translation import Refusals, lora_unwrapped_name, model_overrides
from engine.weight_sync import WeightPatch
from heads.errors import ConfigError
from strategies.hf.config_json import apply_overrides
from strategies.hf.experts import CheckpointLayout
from strategies.model.peft_lora import PEFT_PREFIX
from strategies.parallel.collectives import rank

logger = logging.getLogger(__name__)

NAME = ROLLOUT
#: The weight streams the server adapter takes: whole tensors, and the gloo checkpoint engine's
#: patches (its ``delta``).
WIRE_FORMATS = (NAMED_TENSORS, PATCHES)
#: What a weight stream carries of one name.
Sent = torch.Tensor | WeightPatch


def server_name(replica_rank: int) -> str:
    """The Ray actor name of a replica's generator (the adapters find it by name)."""
    return f"{NAME}_server_{replica_rank}"


def check_settings(config: Any) -> None:
    """Refuse, naming them, the rollout settings a one-process Hugging Face generator cannot
    honour (all of them at once)."""
    refused = []
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if getattr(config, key, 1) != 1:
            refused.append(f"rollout.{key}={getattr(config, key)} (needs 1)")
    if getattr(config, "expert_parallel_size", 1) != 1:
        refused.append(f"rollout.expert_parallel_size={config.expert_parallel_size} (needs 1)")
    mtp = getattr(config, "mtp", None)
    if mtp is not None and getattr(mtp, "enable", False):
        refused.append("rollout.mtp.enable=True (no speculative decoding)")
    if getattr(config, "quantization", None):
        refused.append(f"rollout.quantization={config.quantization!r} (none)")
    if refused:
        raise ConfigError(
            f"the {NAME} rollout generates in one process with plain Hugging Face weights; "
            "it cannot honour: " + "; ".join(refused)
        )


@attrs.frozen
class Sampling:
    """One request's sampling settings, as verl's agent loop passes them (vLLM's names)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 1
    ignore_eos: bool = False
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, params: dict[str, Any], max_tokens: int) -> Sampling:
        """From verl's ``sampling_params`` dict; keys this generator does not know are refused."""
        params = dict(params)
        params.pop("logprobs", None)  # always computed
        params.pop("seed", None)
        stop = params.pop("stop_token_ids", None)
        if stop:
            raise ConfigError(
                f"{NAME} rollout: sampling_params.stop_token_ids={stop!r} is not supported "
                "(it stops at the model's end-of-sequence tokens)"
            )
        known = {field.name for field in attrs.fields(cls)} - {"max_tokens"}
        unknown = sorted(set(params) - known - {"max_tokens", "max_new_tokens"})
        if unknown:
            raise ConfigError(f"{NAME} rollout: sampling_params {unknown} are not supported")
        settings = {key: params[key] for key in known if key in params}
        for key in ("temperature", "top_p", "repetition_penalty"):
            if key in settings:
                settings[key] = float(settings[key])
        if "top_k" in settings:
            settings["top_k"] = int(settings["top_k"])
        if settings.get("repetition_penalty", 1.0) != 1.0:
            raise ConfigError(
                f"{NAME} rollout: repetition_penalty={settings['repetition_penalty']} is not "
                "supported (1.0 only)"
            )
        return cls(max_tokens=max_tokens, **settings)

    @property
    def warp(self) -> Warp:
        """The logits its tokens are drawn from."""
        return Warp(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@attrs.define
class _Request:
    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    done: asyncio.Future[TokenOutput]


class HFGenerator:
    """The serving actor (one per replica): a Hugging Face causal LM built from the model's
    config, its weights set by the trainer's sync."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int) -> None:
        from transformers import AutoConfig

        check_settings(config)
        self.config = config
        self.replica_rank = replica_rank
        path = getattr(model_config, "local_path", None) or model_config.path
        hf_config = AutoConfig.from_pretrained(
            path, trust_remote_code=bool(getattr(model_config, "trust_remote_code", False))
        )
        apply_overrides(hf_config, model_overrides(model_config, Refusals()))  # as the trainer
        if getattr(config, "enable_rollout_routing_replay", False) and not is_moe(hf_config):
            raise ConfigError(
                f"{NAME} rollout: enable_rollout_routing_replay=True needs a "
                f"mixture-of-experts model; {hf_config.model_type!r} has no router"
            )
        self.model = build_model(hf_config)
        self.weights = GeneratorWeights(
            self.model, CheckpointLayout(hf_config.model_type), f"{NAME} rollout: the trainer"
        )
        #: LoRA synced alone: adapter halves received (module -> {"lora_A": ..., "lora_B":
        #: ...}) until both are in.
        self.adapter_halves: dict[str, dict[str, torch.Tensor]] = {}
        self.adapter_mode = False
        self.stop_ids = _stop_token_ids(hf_config, path)
        self.max_model_len = config.max_model_len or (config.prompt_length + config.response_length)
        self.loaded = True  # weights allocated
        self.synced = False  # weights filled by a sync since they were allocated
        self.generator = torch.Generator().manual_seed(int(config.seed) + replica_rank)
        self.pending: list[_Request] = []
        self.wakeup: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.Task[None] | None = None
        self.batches = 0
        #: Partial rollouts (:meth:`abort_all_requests`): generation paused until
        #: :meth:`resume_generation`, arrivals held meanwhile (or refused: ``rejecting``); the
        #: batch in flight stops at its next token when ``stopping`` is set.
        self.paused = False
        self.rejecting = False
        self.stopping = threading.Event()
        self.resumed: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        #: The batch being generated: its requests' ids and its outputs to come.
        self.in_flight: tuple[list[str], asyncio.Future[list[TokenOutput]]] | None = None
        self.routes = RouteRecorder(self.model) if is_moe(hf_config) else None
        self.global_steps: int | None = None
        self.seen_step: int | None = None
        self.seen: dict[str, int] = {}

    # ---- verl's server calls -------------------------------------------------------------
    def get_server_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), 0

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """verl's token-in, token-out call; concurrent calls are batched."""
        if image_data is not None or video_data is not None or kwargs.get("audio_data"):
            raise ConfigError(f"{NAME} rollout generates from text token ids only")
        if self.paused:  # a partial rollout's pause: wait for the resume (new weights)
            if self.rejecting:
                raise RuntimeError(
                    f"{NAME} rollout: request {request_id} arrived while generation is paused "
                    "with abort_all_requests(reject_request=True)"
                )
            await self._resume_event().wait()
        if not self.synced:
            raise RuntimeError(
                f"{NAME} rollout: generate called before the trainer's weights reached the "
                "generator (its weights are released while it sleeps and set only by verl's "
                "weight sync, checkpoint_engine.backend=naive)"
            )
        prompt_ids = [int(token) for token in prompt_ids]
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt length {len(prompt_ids)} leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        params = dict(sampling_params)
        requested = params.pop("max_tokens", params.pop("max_new_tokens", None))
        if requested is None:
            requested = min(
                self.config.response_length,
                self.config.prompt_length + self.config.response_length - len(prompt_ids),
            )
        params.setdefault("ignore_eos", bool(getattr(self.config, "ignore_eos", False)))
        sampling = Sampling.of(params, max(1, min(int(requested), room)))
        done: asyncio.Future[TokenOutput] = asyncio.get_running_loop().create_future()
        key = self._stream_key(str(request_id), prompt_ids)
        self.pending.append(_Request(key, prompt_ids, sampling, done))
        loop = asyncio.get_running_loop()
        if self.wakeup is None or self.loop is not loop:  # one serving task per event loop
            self.loop, self.wakeup = loop, asyncio.Event()
            self.server = loop.create_task(self._serve())
        self.wakeup.set()
        return await done

    async def _serve(self) -> None:
        assert self.wakeup is not None
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            await asyncio.sleep(0.01)  # let the other requests of this round arrive
            while self.pending and not self.paused:
                taken, self.pending = self.pending, []
                groups: dict[Sampling, list[_Request]] = {}
                for request in taken:
                    groups.setdefault(request.sampling, []).append(request)
                for sampling, requests in groups.items():
                    if self.paused:  # not started before an abort: served after the resume
                        self.pending.extend(requests)
                        continue
                    ids = [r.request_id for r in requests]
                    running = asyncio.ensure_future(
                        asyncio.to_thread(
                            self._generate, [r.prompt_ids for r in requests], sampling, ids
                        )
                    )
                    self.in_flight = ids, running
                    try:
                        outputs = await running
                    except Exception as error:  # handed to each caller
                        for request in requests:
                            if not request.done.done():
                                request.done.set_exception(error)
                        continue
                    finally:
                        self.in_flight = None
                    for request, output in zip(requests, outputs, strict=True):
                        if not request.done.done():
                            request.done.set_result(output)

    def _stream_key(self, request_id: str, prompt_ids: list[int]) -> str:
        """A request's stream key: its id, its prompt, and how many requests with both came
        before in this step. The agent loops of :mod:`engine.integrations.verl.agent_loop`
        name each request by its sample, so every sample draws its own stream whatever the
        order requests arrive in. verl's own loops send the ``n`` samples of a prompt under
        one id (its v1 trainer every request under ``det-0``), in an order that differs from
        run to run: keyed by the prompt and the count, each prompt draws the same streams, but
        rows with the same prompt may swap samples, and with them verl's groups."""
        if self.seen_step != self.global_steps:
            self.seen_step, self.seen = self.global_steps, {}
        prompt = hashlib.sha256(str(prompt_ids).encode()).hexdigest()[:16]
        base = f"{request_id}/{prompt}"
        count = self.seen.get(base, 0)
        self.seen[base] = count + 1
        return f"{base}#{count}"

    def _row_generators(self, request_ids: list[str]) -> list[torch.Generator]:
        """Each row's random stream. Under ``full_determinism`` (verl then sends stable request
        ids) a row's stream depends on the seed, the weights' step and its stream key only,
        not on which requests share its batch: a run and its resumed copy sample alike.
        Otherwise the rows share the replica's stream."""
        if not getattr(self.config, "full_determinism", False):
            return [self.generator] * len(request_ids)
        streams = []
        for request_id in request_ids:
            key = f"{self.config.seed}/{self.global_steps}/{request_id}".encode()
            seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
            streams.append(torch.Generator().manual_seed(seed))
        return streams

    def _generate(
        self, prompts: list[list[int]], sampling: Sampling, request_ids: list[str]
    ) -> list[TokenOutput]:
        """One batch: left-padded prompts, a KV cache, one token per row per step."""
        self.batches += 1
        streams = self._row_generators(request_ids)
        input_ids, mask = left_padded(prompts, self.stop_ids[0] if self.stop_ids else 0)
        generation = generate(
            self.model,
            input_ids,
            attention_mask=mask,
            max_tokens=sampling.max_tokens,
            warp=sampling.warp,
            pick=GumbelMax(streams) if sampling.temperature > 0 else MostLikely(),
            stop_ids=() if sampling.ignore_eos else self.stop_ids,
            routes=self.routes,
            stop_early=self.stopping.is_set,
        )
        lengths = generation.lengths.tolist()
        stops = set(() if sampling.ignore_eos else self.stop_ids)
        outputs = []
        for row, length in enumerate(lengths):
            tokens = generation.tokens[row, :length].tolist()
            # a row the abort cut short: it neither stopped nor reached its limit
            cut = generation.aborted and not (tokens and tokens[-1] in stops)
            outputs.append(
                TokenOutput(
                    token_ids=tokens,
                    log_probs=generation.log_probs[row, :length].tolist(),
                    routed_experts=None if generation.routes is None else generation.routes[row],
                    stop_reason="aborted" if cut else "completed",
                    extra_fields={"global_steps": self.global_steps},
                )
            )
        return outputs

    def wake_up(self) -> None:
        """verl's replica wake-up: the weights come back with the next sync, if released."""
        return None

    def sleep(self) -> None:
        """Free the weights (``free_cache_engine``); the next sync allocates and fills them."""
        if self.config.free_cache_engine:
            self.release()

    def release(self) -> None:
        """Free the parameters' storage (buffers such as rotary tables stay); not while
        adapters are synced alone: the base model they adapt is sent once."""
        if self.adapter_mode:
            return
        for parameter in self.model.parameters():
            parameter.data = torch.empty(0, dtype=parameter.dtype)
        self.loaded = self.synced = False

    def resume(self, tags: list[str]) -> None:
        """Allocate the parameters again (their values come with the sync)."""
        if "weights" in tags and not self.loaded:
            for name, parameter in self.model.named_parameters():
                parameter.data = torch.empty(self.weights.shapes[name], dtype=parameter.dtype)
            self.loaded = True

    def update_weights(self, named: list[tuple[str, Sent]], last: bool, lora: Any = None) -> None:
        """Copy one bucket of (Hugging Face name, tensor) into the model: checkpoint names (the
        engine's export; a mixture-of-experts layer's experts one tensor each) or transformers'
        own parameter names. ``lora`` (the PEFT config's ``r``, ``lora_alpha``,
        ``use_rslora``): the base model under LoRA wrapper names, or adapters alone."""
        tensors = [(name, sent) for name, sent in named if isinstance(sent, torch.Tensor)]
        if len(tensors) < len(named):
            self._patch(named)
            return
        if lora is not None and tensors and tensors[0][0].startswith(PEFT_PREFIX):
            self._update_adapters(tensors, last, lora)
            return
        self.resume(["weights"])
        if lora is not None:  # the base model: adapters are merged again at their next sync
            tensors = [(lora_unwrapped_name(name), tensor) for name, tensor in tensors]
        self.weights.forget_adapters()  # the adapters' base is being replaced
        self.adapter_mode = lora is not None
        for name, tensor in tensors:
            self.weights.copy(name, tensor)
        if last:
            missing = self.weights.end_sync()
            if missing:
                raise ValueError(
                    f"{NAME} rollout: the trainer's weights lack {len(missing)} the generator "
                    f"needs, e.g. {missing[:3]} (they would keep stale or released values)"
                )
            self.synced = True

    def _patch(self, named: list[tuple[str, Sent]]) -> None:
        """One bucket of weight patches (``composable_gloo`` with ``delta``: the elements that
        changed since the last sync) written into the weights that sync left."""
        if not self.synced:
            raise RuntimeError(
                f"{NAME} rollout: a weight patch arrived, but the generator holds no weights to "
                "patch (released while it slept, or never synced); set "
                "actor_rollout_ref.rollout.free_cache_engine=False with the composable_gloo "
                "checkpoint engine's delta, or turn delta off"
            )
        if self.adapter_mode:
            raise RuntimeError(
                f"{NAME} rollout: weight patches of a base model whose LoRA adapters are synced "
                "alone are not supported (verl sends that base model once, whole)"
            )
        for name, patch in named:
            if not isinstance(patch, WeightPatch):
                raise ValueError(f"{NAME} rollout: {name!r} came whole in a sync of patches")
            self.weights.patch(name, patch)

    def _update_adapters(
        self, named: list[tuple[str, torch.Tensor]], last: bool, lora: Any
    ) -> None:
        """One bucket of adapters under peft's names (``base_model.model.<linear>.lora_A.weight``
        and ``lora_B``): each linear whose pair is complete becomes its base weight plus
        ``(B @ A) * scale``; the last bucket must have completed every pair, and every linear a
        previous sync adapted."""
        if not self.synced:
            raise RuntimeError(
                f"{NAME} rollout: LoRA adapters arrived before the base model (verl sends it "
                "once, when rollout.load_format contains 'dummy', its default; or set "
                "actor_rollout_ref.model.lora.merge=True to send merged weights every step)"
            )
        r, alpha = int(_field(lora, "r")), float(_field(lora, "lora_alpha"))
        scale = alpha / math.sqrt(r) if _field(lora, "use_rslora", False) else alpha / r
        for name, tensor in named:
            module, _, half = name[len(PEFT_PREFIX) :].removesuffix(".weight").rpartition(".")
            if half not in ("lora_A", "lora_B") or not self.weights.accepts(f"{module}.weight"):
                raise KeyError(
                    f"{NAME} rollout: the trainer sent the adapter tensor {name!r}, which "
                    f"adapts no linear of the generator's {type(self.model).__name__}"
                )
            halves = self.adapter_halves.setdefault(module, {})
            halves[half] = tensor
            if len(halves) == 2:
                lora_a, lora_b = halves.pop("lora_A"), halves.pop("lora_B")
                self.weights.merge_adapter(f"{module}.weight", lora_a, lora_b, scale)
                del self.adapter_halves[module]
        if last:
            incomplete = sorted(self.adapter_halves)
            missing = self.weights.end_adapter_sync()
            self.adapter_halves = {}
            if incomplete or missing:
                raise ValueError(
                    f"{NAME} rollout: the adapter sync left linears with an old or half "
                    f"adapter: {(incomplete + missing)[:3]}"
                )

    def set_global_steps(self, global_steps: int | None) -> None:
        self.global_steps = global_steps

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The generator's weights under checkpoint names (for checks: the trainer's sync must
        equal them)."""
        return self.weights.checkpoint_tensors()

    def statistics(self) -> dict[str, int]:
        return {"batches": self.batches}

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """verl's partial rollout: pause generation and stop the batch in flight at its next
        token; each of its requests returns what it generated so far (tokens, log-probs,
        routes) with ``stop_reason="aborted"``, which verl's ``FullyAsyncLLMServerClient``
        continues (prompt + those tokens) once generation resumes, from the weights synced
        meanwhile. Requests queued or arriving while paused wait for the resume
        (``reject_request``: arrivals are refused). Returns once nothing is generating, so
        verl may then sleep the replica and release its weights."""
        self.paused, self.rejecting = True, reject_request
        self._resume_event().clear()
        aborted: list[str] = []
        if self.in_flight is not None:
            ids, running = self.in_flight
            self.stopping.set()
            try:
                outputs = await asyncio.shield(running)
                aborted = [
                    i for i, o in zip(ids, outputs, strict=True) if o.stop_reason == "aborted"
                ]
            except Exception:  # the batch's own error, handed to its callers by _serve
                pass
            finally:
                self.stopping.clear()
        return {"aborted_count": len(aborted), "request_ids": aborted}

    def resume_generation(self) -> None:
        """Generate again: held requests and those queued before the abort are served."""
        self.paused = self.rejecting = False
        if self.resumed is not None:
            self.resumed[1].set()
        if self.wakeup is not None:
            self.wakeup.set()

    def _resume_event(self) -> asyncio.Event:
        """Set while generation runs (not paused by an abort); one per event loop."""
        loop = asyncio.get_running_loop()
        if self.resumed is None or self.resumed[0] is not loop:
            self.resumed = (loop, asyncio.Event())
            if not self.paused:
                self.resumed[1].set()
        return self.resumed[1]

    def clear_kv_cache(self) -> None:
        return None  # the cache lives for one batch

    release_kv_cache = resume_kv_cache = clear_kv_cache

    def start_profile(self, **kwargs: Any) -> None:
        return None

    def stop_profile(self) -> None:
        return None


def _stop_token_ids(hf_config: Any, path: str) -> list[int]:
    """The model's end-of-sequence ids: its generation config's, else its config's."""
    from transformers import GenerationConfig

    ids: Any = None
    with contextlib.suppress(OSError):
        ids = GenerationConfig.from_pretrained(path).eos_token_id
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list | tuple) else [ids])]


class HFReplica(RolloutReplica):
    """verl's replica for :class:`HFGenerator`: one serving actor per replica, placed beside the
    trainer workers (it takes no CPU of Ray's, as vLLM's server takes no GPU of its own)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_settings(self.config)

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        if self.is_reward_model or self.is_teacher_model:
            raise ConfigError(
                f"the {NAME} rollout serves the actor only (not a reward or teacher model)"
            )
        actor = ray.remote(HFGenerator).options(
            name=server_name(self.replica_rank),
            num_cpus=0,
            max_concurrency=self.max_concurrency,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}},
        )
        server = actor.remote(self.config, self.model_config, self.replica_rank)
        await server.get_server_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{NAME}:{self.replica_rank}"


class HFServerAdapter(BaseRollout):
    """The sync's receiving side: in a trainer worker (verl's colocated ``naive`` sync) or in a
    checkpoint-engine worker of a replica apart from the trainer (``separate_async``, which
    names the replica: ``replica_rank``), the replica's first rank sends the weights to its
    generator in buckets; every rank walks the weights (their collectives need every rank)."""

    def __init__(
        self,
        config: Any,
        model_config: Any,
        device_mesh: Any,
        replica_rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        check_settings(self.config)
        self.replica_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.given_replica_rank = replica_rank
        self.bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        self.sleep_level = 2
        self._server: Any = None

    @property
    def server(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    @property
    def replica_rank(self) -> int:
        if self.given_replica_rank is not None:
            return self.given_replica_rank
        return rank() // self.replica_size

    @property
    def leader(self) -> bool:
        """The replica's first rank (asked when used: a checkpoint-engine worker joins its
        process group after building its adapter)."""
        return rank() % self.replica_size == 0

    @property
    def is_leader_rank(self) -> bool:
        """verl's name for :attr:`leader` (its checkpoint-engine worker asks)."""
        return self.leader

    async def resume(self, tags: list[str]) -> None:
        if self.leader:
            await self.server.resume.remote(tags)

    async def release(self) -> None:
        if self.leader:
            await self.server.release.remote()

    async def update_weights(
        self,
        weights: Generator[tuple[str, Sent], None, None],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        if wire_format not in WIRE_FORMATS:
            raise ConfigError(
                f"{NAME} rollout: weights in {wire_format!r} are not supported "
                f"({', '.join(WIRE_FORMATS)})"
            )
        lora = _lora_settings(kwargs.get("peft_config"))
        if not self.leader:
            async for _ in ensure_async_iterator(weights):
                pass
            return
        sent: list[Any] = []

        async def send(bucket: list[tuple[str, Sent]], last: bool) -> None:
            sent.append(self.server.update_weights.remote(bucket, last, lora))
            if len(sent) > 1:  # at most two buckets in flight
                await sent.pop(0)

        # a checkpoint engine's stream is asynchronous (verl's naive sync hands a generator)
        buckets, received = _Buckets(self.bucket_bytes), False
        async for name, tensor in ensure_async_iterator(weights):
            received = True
            full = buckets.add(name, tensor)
            if full is not None:
                await send(full, False)
        if received or wire_format != PATCHES:  # no patch at all: nothing changed
            await send(buckets.items, True)
        for pending in sent:
            await pending
        await self.server.set_global_steps.remote(kwargs.get("global_steps"))


def _field(settings: Any, key: str, default: Any = None) -> Any:
    if isinstance(settings, dict):
        return settings.get(key, default)
    return getattr(settings, key, default)


def _lora_settings(peft_config: Any) -> dict[str, Any] | None:
    """What the generator needs of a PEFT config (peft's ``LoraConfig`` or its mapping)."""
    if peft_config is None:
        return None
    return {key: _field(peft_config, key) for key in ("r", "lora_alpha", "use_rslora")}


class _Buckets:
    """(name, tensor) pairs grouped into buckets of about ``limit`` bytes (a bigger tensor goes
    alone), one pair at a time; ``items``: the bucket being filled."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: list[tuple[str, torch.Tensor | WeightPatch]] = []
        self.size = 0

    def add(
        self, name: str, tensor: torch.Tensor | WeightPatch
    ) -> list[tuple[str, torch.Tensor | WeightPatch]] | None:
        """Add a pair; the bucket it closed, if it did not fit in the one being filled."""
        full = None
        nbytes = tensor.nbytes
        if self.items and self.size + nbytes > self.limit:
            full, self.items, self.size = self.items, [], 0
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.detach().to("cpu")
        self.items.append((name, tensor))
        self.size += nbytes
        return full


def _buckets(
    weights: Iterator[tuple[str, torch.Tensor]], limit: int
) -> Iterator[tuple[list[tuple[str, Sent]], bool]]:
    """:class:`_Buckets` of ``weights``; the last bucket is flagged."""
    buckets = _Buckets(limit)
    for name, tensor in weights:
        full = buckets.add(name, tensor)
        if full is not None:
            yield full, False
    yield buckets.items, True
