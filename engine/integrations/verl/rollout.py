"""A generator for verl's RL trainer where vLLM / SGLang cannot run (CPU hosts): Hugging Face
``transformers`` in a Ray actor, behind verl's rollout interfaces.

verl finds a rollout by name in two places: the replica (``RolloutReplicaRegistry``, which
starts the serving actor and answers the trainer's ``sleep`` / ``wake_up``) and the server
adapter (``verl.workers.rollout.base._ROLLOUT_REGISTRY``, built inside every trainer worker,
which receives the actor's weights). The plug-in registers both under :data:`NAME`
(``actor_rollout_ref.rollout.name=composable_hf``).

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
  generator, whose collectives every rank takes part in. Nothing is read from disk but the
  model's config.
- **LoRA**: with ``model.lora.merge=True`` the adapters arrive merged, as plain weights.
  Otherwise (verl's default) the first sync sends the base model (each adapted linear's weight
  under its LoRA wrapper's name, ``...q_proj.base_layer.weight``) and every sync the adapters
  alone, under peft's names, with their PEFT config; the generator keeps each adapted linear's
  base weight and sets the linear to ``W + (B @ A) * alpha / r``, as the engine merges it.
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
from collections.abc import Generator, Iterator
from typing import Any

import attrs
import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from engine.integrations.verl.cells import ROLLOUT
from engine.integrations.verl.config import Refusals, lora_unwrapped_name, model_overrides
from heads.errors import ConfigError
from strategies.hf.config import apply_overrides
from strategies.hf.experts import CheckpointLayout
from strategies.model.peft_lora import PEFT_PREFIX

logger = logging.getLogger(__name__)

NAME = ROLLOUT


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


@attrs.define
class _Request:
    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    done: asyncio.Future[TokenOutput]


def _processed_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The logits a token is drawn from: temperature, then top-k, then top-p (as vLLM)."""
    logits = logits.float()
    if sampling.temperature > 0:
        logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        mass = ordered.softmax(-1).cumsum(-1)
        # drop a token once the mass before it reaches top_p (the first token always stays)
        drop = (mass - ordered.softmax(-1)) >= sampling.top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


class HFGenerator:
    """The serving actor (one per replica): a Hugging Face causal LM built from the model's
    config, its weights set by the trainer's sync."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        check_settings(config)
        self.config = config
        self.replica_rank = replica_rank
        path = getattr(model_config, "local_path", None) or model_config.path
        hf_config = AutoConfig.from_pretrained(
            path, trust_remote_code=bool(getattr(model_config, "trust_remote_code", False))
        )
        apply_overrides(hf_config, model_overrides(model_config, Refusals()))  # as the trainer
        if getattr(config, "enable_rollout_routing_replay", False) and not _is_moe(hf_config):
            raise ConfigError(
                f"{NAME} rollout: enable_rollout_routing_replay=True needs a "
                f"mixture-of-experts model; {hf_config.model_type!r} has no router"
            )
        self.model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
        self.shapes = {name: p.shape for name, p in self.model.named_parameters()}
        # the model's parameters and buffers by name: the same objects for its whole life
        # (release and resume swap a parameter's storage, not the parameter)
        self.state = self.model.state_dict(keep_vars=True)
        self.layout = CheckpointLayout(hf_config.model_type)
        # what a sync must fill: each parameter's checkpoint tensors (one, or its experts')
        self.pieces = {name: self.layout.names(name, shape) for name, shape in self.shapes.items()}
        self.targets = self._targets()
        self.received: set[str] = set()
        #: LoRA synced alone: each adapted linear's base weight, and adapter halves received
        #: (module -> {"lora_A": ..., "lora_B": ...}) until both are in.
        self.base_weights: dict[str, torch.Tensor] = {}
        #: The dtype each weight was sent in: a merged adapter is rounded to it, as the
        #: trainer's merged export rounds it.
        self.sent_dtypes: dict[str, torch.dtype] = {}
        self.adapter_halves: dict[str, dict[str, torch.Tensor]] = {}
        self.adapted: set[str] = set()
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
        self.paused = False
        self.routes = _RouteRecorder(self.model) if _is_moe(hf_config) else None
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
                    try:
                        outputs = await asyncio.to_thread(
                            self._generate,
                            [r.prompt_ids for r in requests],
                            sampling,
                            [r.request_id for r in requests],
                        )
                    except Exception as error:  # handed to each caller
                        for request in requests:
                            if not request.done.done():
                                request.done.set_exception(error)
                        continue
                    for request, output in zip(requests, outputs, strict=True):
                        if not request.done.done():
                            request.done.set_result(output)

    def _stream_key(self, request_id: str, prompt_ids: list[int]) -> str:
        """A request's stream key: its id, its prompt, and how many requests with both came
        before in this step. verl sends the ``n`` samples of a prompt under one id (its
        transfer-queue trainer every request under ``det-0``), in an order that differs from
        run to run: keyed by the prompt too, each prompt draws the same streams whatever the
        order (its samples may swap streams among themselves, being alike)."""
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

    @torch.no_grad()
    def _generate(
        self, prompts: list[list[int]], sampling: Sampling, request_ids: list[str]
    ) -> list[TokenOutput]:
        """One batch: left-padded prompts, a KV cache, one token per row per step."""
        self.batches += 1
        rows = len(prompts)
        streams = self._row_generators(request_ids)
        width = max(len(prompt) for prompt in prompts)
        pad = self.stop_ids[0] if self.stop_ids else 0
        input_ids = torch.full((rows, width), pad, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        stop = torch.tensor(self.stop_ids, dtype=torch.long)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        log_probs: list[list[float]] = [[] for _ in range(rows)]
        routes: list[list[Any]] = [[] for _ in range(rows)]
        finished = torch.zeros(rows, dtype=torch.bool)
        past = None
        step_ids = input_ids
        if self.routes is not None:
            self.routes.start()
        for step in range(sampling.max_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=past,
                use_cache=True,
            )
            past = out.past_key_values
            if self.routes is not None:
                chosen = self.routes.take(rows, step_ids.shape[1])  # [rows, positions, layers, k]
                for row in range(rows):
                    if step == 0:
                        length = len(prompts[row])
                        routes[row].extend(chosen[row, width - length :].tolist())
                    elif not finished[row]:
                        routes[row].extend(chosen[row].tolist())
            logits = _processed_logits(out.logits[:, -1], sampling)
            if sampling.temperature > 0:
                # Gumbel-max: argmax(logits + Gumbel noise) draws from softmax(logits)
                noise = torch.stack(
                    [torch.rand(logits.shape[-1], generator=stream) for stream in streams]
                )
                gumbel = -torch.log(-torch.log(noise.clamp(min=1e-20)))
                picked = (logits + gumbel).argmax(-1)
            else:
                picked = logits.argmax(-1)
            chosen_log_probs = logits.log_softmax(-1).gather(-1, picked[:, None])[:, 0]
            for row in range(rows):
                if not finished[row]:
                    tokens[row].append(int(picked[row]))
                    log_probs[row].append(float(chosen_log_probs[row]))
            if not sampling.ignore_eos and len(stop):
                finished |= torch.isin(picked, stop)
            if bool(finished.all()) or step + 1 == sampling.max_tokens:
                break
            step_ids = picked[:, None]
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], dim=1)
        outputs = []
        for row in range(rows):
            routed = None
            if self.routes is not None:
                # the last token's routes are not computed (it is never fed back): verl's R3
                # replays prompt + response minus one position
                routed = torch.tensor(routes[row][: len(prompts[row]) + len(tokens[row]) - 1])
            outputs.append(
                TokenOutput(
                    token_ids=tokens[row],
                    log_probs=log_probs[row],
                    routed_experts=routed,
                    stop_reason="completed",
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
                parameter.data = torch.empty(self.shapes[name], dtype=parameter.dtype)
            self.loaded = True

    def update_weights(
        self, named: list[tuple[str, torch.Tensor]], last: bool, lora: Any = None
    ) -> None:
        """Copy one bucket of (Hugging Face name, tensor) into the model: checkpoint names (the
        engine's export; a mixture-of-experts layer's experts one tensor each) or transformers'
        own parameter names. ``lora`` (the PEFT config's ``r``, ``lora_alpha``,
        ``use_rslora``): the base model under LoRA wrapper names, or adapters alone."""
        if lora is not None and named and named[0][0].startswith(PEFT_PREFIX):
            self._update_adapters(named, last, lora)
            return
        self.resume(["weights"])
        if lora is not None:  # the base model: adapters are merged again at their next sync
            named = [(lora_unwrapped_name(name), tensor) for name, tensor in named]
        self.base_weights, self.adapted = {}, set()  # the adapters' base is being replaced
        self.adapter_mode = lora is not None
        for name, tensor in named:
            target = self.targets.get(name)
            if target is None:
                raise KeyError(
                    f"{NAME} rollout: the trainer sent {name!r}, which the generator's "
                    f"{type(self.model).__name__} does not have"
                )
            parameter, rows = target
            destination = self.state[parameter].data
            if rows is not None:  # one expert's projection inside a fused parameter
                destination = destination.view(-1, destination.shape[-1])[rows]
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"{NAME} rollout: {name!r} has shape {tuple(tensor.shape)} from the "
                    f"trainer and {tuple(destination.shape)} in the generator"
                )
            destination.copy_(tensor)
            self.sent_dtypes[name] = tensor.dtype
            self.received.update(self.pieces.get(parameter, ()) if rows is None else (name,))
        if last:
            missing = sorted(
                piece
                for pieces in self.pieces.values()
                for piece in pieces
                if piece not in self.received
            )
            self.received = set()
            if missing:
                raise ValueError(
                    f"{NAME} rollout: the trainer's weights lack {len(missing)} the generator "
                    f"needs, e.g. {missing[:3]} (they would keep stale or released values)"
                )
            self.synced = True

    def _update_adapters(
        self, named: list[tuple[str, torch.Tensor]], last: bool, lora: Any
    ) -> None:
        """One bucket of adapters under peft's names (``base_model.model.<linear>.lora_A.weight``
        and ``lora_B``): each linear whose pair is complete becomes its base weight plus
        ``(B @ A) * scale`` (float32, as the engine's merged export); the last bucket must have
        completed every pair, and every linear a previous sync adapted."""
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
            if half not in ("lora_A", "lora_B") or f"{module}.weight" not in self.targets:
                raise KeyError(
                    f"{NAME} rollout: the trainer sent the adapter tensor {name!r}, which "
                    f"adapts no linear of the generator's {type(self.model).__name__}"
                )
            halves = self.adapter_halves.setdefault(module, {})
            halves[half] = tensor
            if len(halves) == 2:
                self._merge_adapter(module, halves.pop("lora_A"), halves.pop("lora_B"), scale)
                del self.adapter_halves[module]
        if last:
            incomplete = sorted(self.adapter_halves)
            missing = sorted(self.adapted - self.received)
            self.adapter_halves, self.received = {}, set()
            if incomplete or missing:
                raise ValueError(
                    f"{NAME} rollout: the adapter sync left linears with an old or half "
                    f"adapter: {(incomplete + missing)[:3]}"
                )

    def _merge_adapter(
        self, module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
    ) -> None:
        name = f"{module}.weight"
        parameter, rows = self.targets[name]
        weight = self.state[parameter].data
        if rows is not None:
            weight = weight.view(-1, weight.shape[-1])[rows]
        base = self.base_weights.setdefault(name, weight.detach().clone())
        delta = (lora_b.float() @ lora_a.float()) * scale
        if delta.shape != base.shape:
            raise ValueError(
                f"{NAME} rollout: the adapter of {module!r} makes {tuple(delta.shape)}, its "
                f"weight is {tuple(base.shape)}"
            )
        sent = self.sent_dtypes.get(name, base.dtype)
        weight.copy_((base.float() + delta).to(sent))
        self.adapted.add(name)
        self.received.add(name)

    def _targets(self) -> dict[str, tuple[str, slice | None]]:
        """Each name a sync may send -> (the model's parameter or buffer, its rows or None)."""
        targets: dict[str, tuple[str, slice | None]] = {}
        for name, tensor in self.state.items():
            shape = self.shapes.get(name, tensor.shape)
            targets[name] = (name, None)
            pieces = self.pieces.get(name) or self.layout.names(name, shape)
            if len(pieces) > 1:
                rows = math.prod(shape[:-1]) // len(pieces)
                for index, piece in enumerate(pieces):
                    targets[piece] = (name, slice(index * rows, (index + 1) * rows))
        return targets

    def set_global_steps(self, global_steps: int | None) -> None:
        self.global_steps = global_steps

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The generator's weights under checkpoint names (for checks: the trainer's sync must
        equal them)."""
        return {
            stored: piece.detach().clone()
            for name, tensor in self.model.state_dict().items()
            for stored, piece in self.layout.split(name, tensor)
        }

    def statistics(self) -> dict[str, int]:
        return {"batches": self.batches}

    def abort_all_requests(self, reject_request: bool = False) -> None:
        self.paused = True

    def resume_generation(self) -> None:
        self.paused = False
        if self.wakeup is not None:
            self.wakeup.set()

    def clear_kv_cache(self) -> None:
        return None  # the cache lives for one batch

    release_kv_cache = resume_kv_cache = clear_kv_cache

    def start_profile(self, **kwargs: Any) -> None:
        return None

    def stop_profile(self) -> None:
        return None


def _is_moe(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "num_experts", 0) or getattr(hf_config, "num_local_experts", 0))


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


class _RouteRecorder:
    """The experts each position was routed to, per MoE layer (a forward hook on every
    ``mlp.gate``: the indices it returns, or the top-k of its logits)."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        self.gates = [
            module
            for name, module in model.named_modules()
            if name.endswith("mlp.gate") and isinstance(module, torch.nn.Module)
        ]
        if not self.gates or self.top_k < 1:
            raise ConfigError(f"{NAME} rollout: no router found in {type(model).__name__}")
        self.records: list[torch.Tensor] = []
        for gate in self.gates:
            gate.register_forward_hook(self._hook)

    def start(self) -> None:
        self.records = []

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, tuple) and len(output) == 3:  # (logits, scores, indices)
            self.records.append(output[2])
        else:
            logits = output[0] if isinstance(output, tuple) else output
            self.records.append(torch.topk(logits.float(), self.top_k, dim=-1).indices)

    def take(self, rows: int, positions: int) -> torch.Tensor:
        """This forward's routes: ``[rows, positions, layers, top_k]``."""
        layers = [record.reshape(rows, positions, self.top_k) for record in self.records]
        self.records = []
        return torch.stack(layers, dim=2)


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
    """The trainer worker's side of the sync: the replica's first rank sends the weights to its
    generator in buckets; every rank walks the weights (their collectives need every rank)."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        check_settings(self.config)
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank, self.rank_in_replica = divmod(rank, size)
        self.bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        self.sleep_level = 2
        self._server: Any = None

    @property
    def server(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    @property
    def leader(self) -> bool:
        return self.rank_in_replica == 0

    async def resume(self, tags: list[str]) -> None:
        if self.leader:
            await self.server.resume.remote(tags)

    async def release(self) -> None:
        if self.leader:
            await self.server.release.remote()

    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        wire_format: str = "named_tensors",
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise ConfigError(
                f"{NAME} rollout: weights in {wire_format!r} are not supported (named_tensors)"
            )
        lora = _lora_settings(kwargs.get("peft_config"))
        if not self.leader:
            for _ in weights:
                pass
            return
        sent = []
        for bucket, last in _buckets(weights, self.bucket_bytes):
            sent.append(self.server.update_weights.remote(bucket, last, lora))
            if len(sent) > 1:  # at most two buckets in flight
                await sent.pop(0)
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


def _buckets(
    weights: Iterator[tuple[str, torch.Tensor]], limit: int
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Group (name, tensor) pairs into buckets of about ``limit`` bytes (a bigger tensor goes
    alone); the last bucket is flagged."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, tensor.detach().to("cpu")))
        size += nbytes
    yield bucket, True
