"""The ``composable_hf`` rollout (engine/integrations/verl/rollout.py) without Ray: what verl's
agent loop and weight sync ask of it. Skipped without verl."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

verl = pytest.importorskip("verl")

from tensordict import TensorDict  # noqa: E402
from verl.workers.config import HFModelConfig, RolloutConfig  # noqa: E402
from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.replica import get_rollout_replica_class  # noqa: E402

from engine import Engine  # noqa: E402
from engine.data.batching import jagged  # noqa: E402
from engine.integrations.verl import rollout, task  # noqa: E402
from engine.integrations.verl.rollout import (  # noqa: E402
    HFGenerator,
    HFReplica,
    HFServerAdapter,
    Sampling,
    _buckets,
)
from heads.errors import ConfigError  # noqa: E402

PROMPTS = [[2, 6, 4, 8, 9, 10, 3, 4, 2, 7, 4], [2, 6, 4, 8, 9, 12, 3, 4, 2, 7, 4], [2, 7, 4]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The shipped task's tiny Qwen3 and tokenizer."""
    directory = tmp_path_factory.mktemp("task") / "model"
    directory.mkdir()
    task.write_model(directory)
    return str(directory)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("task_moe") / "model"
    directory.mkdir()
    task.write_model(directory, moe=True)
    return str(directory)


def _config(**settings: Any) -> RolloutConfig:
    defaults: dict[str, Any] = dict(
        name=rollout.NAME, tensor_model_parallel_size=1, prompt_length=16, response_length=6
    )
    return RolloutConfig(**{**defaults, **settings})


def _synced(path: str, **settings: Any) -> tuple[HFGenerator, torch.nn.Module]:
    """A generator whose weights came through a sync from the checkpoint's model."""
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    generator = HFGenerator(_config(**settings), HFModelConfig(path=path), replica_rank=0)
    generator.sleep()
    for bucket, last in _buckets(iter(source.state_dict().items()), 1 << 12):
        generator.update_weights(bucket, last)
    return generator, source


def _generate(
    generator: HFGenerator, prompts: list[list[int]], ids: list[str] | None = None, **params: Any
) -> list[Any]:
    async def run() -> list[Any]:
        return await asyncio.gather(
            *[
                generator.generate(request, prompt_ids=p, sampling_params=dict(params))
                for request, p in zip(ids or map(str, range(len(prompts))), prompts, strict=True)
            ]
        )

    return asyncio.run(run())


def _in_process(generator: HFGenerator) -> Any:
    """The server adapter's actor handle on ``generator``, in this process."""

    class Server:
        def __getattr__(self, method: str) -> Any:
            class Remote:
                @staticmethod
                def remote(*args: Any) -> Any:
                    result = getattr(generator, method)(*args)

                    async def done() -> Any:
                        return result

                    return done()

            return Remote

    return Server()


def _direct_log_probs(
    source: torch.nn.Module, prompt: list[int], tokens: list[int], sampling: Sampling
) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = source(ids).logits[0, len(prompt) - 1 : -1]
    processed = sampling.warp(logits).log_softmax(-1)
    return processed.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_registered_under_its_name_in_both_of_verls_registries() -> None:
    assert get_rollout_replica_class(rollout.NAME) is HFReplica
    assert get_rollout_class(rollout.NAME, "async") is HFServerAdapter


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0, top_p=1.0, top_k=-1),
        dict(temperature=0.7, top_p=0.9, top_k=5),
        dict(temperature=0, top_p=1.0, top_k=-1),
    ],
    ids=["plain", "warped", "greedy"],
)
def test_concurrent_requests_are_one_batch_and_log_probs_are_the_drawn_distributions(
    model: str, params: dict[str, Any]
) -> None:
    """Requests that arrive together are generated as one left-padded batch; each token's
    log-probability is the one it was drawn from (vLLM's processed log-probs), equal to the
    synced model's own on the unpadded sequence."""
    generator, source = _synced(model)
    outputs = _generate(generator, PROMPTS, **params, logprobs=True, repetition_penalty=1.0)
    assert generator.statistics()["batches"] == 1
    sampling = Sampling.of(params, 6)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert 1 <= len(output.token_ids) <= 6
        assert len(output.log_probs) == len(output.token_ids)
        assert output.stop_reason == "completed"
        direct = _direct_log_probs(source, prompt, output.token_ids, sampling)
        # float32 logits over a short sequence; the padded batch reorders a few reductions
        torch.testing.assert_close(torch.tensor(output.log_probs), direct, atol=1e-5, rtol=1e-5)
        if params["temperature"] == 0:
            ids = torch.tensor([prompt + output.token_ids])
            with torch.no_grad():
                best = source(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
            assert output.token_ids == best.tolist()


def test_sampling_draws_from_the_processed_distribution(model: str) -> None:
    """First tokens of 4000 samples of one prompt: their frequencies are the processed
    distribution's probabilities (5 standard deviations of a frequency, sqrt(1/4 / 4000))."""
    generator, source = _synced(model)
    samples = 4000
    outputs = _generate(generator, PROMPTS[:1] * samples, temperature=0.8, top_k=6, max_tokens=1)
    with torch.no_grad():
        logits = source(torch.tensor([PROMPTS[0]])).logits[0, -1]
    expected = Sampling(temperature=0.8, top_k=6).warp(logits).softmax(-1)
    counts = torch.bincount(
        torch.tensor([o.token_ids[0] for o in outputs]), minlength=len(expected)
    )
    assert counts[expected == 0].sum() == 0  # nothing outside the top 6
    torch.testing.assert_close(counts / samples, expected, atol=5 * (0.25 / samples) ** 0.5, rtol=0)


def test_under_full_determinism_a_request_samples_alike_whatever_shares_its_batch(
    model: str,
) -> None:
    """verl's ``full_determinism`` sends stable request ids: a request's tokens depend on the
    seed, the weights' step, its id and its prompt, not on what shares its batch or arrives
    first, so a resumed run samples what the first one did."""
    generator, _ = _synced(model, full_determinism=True)
    generator.set_global_steps(3)
    alone = _generate(generator, PROMPTS[:1], ["det-5"], temperature=1.0)
    again, _ = _synced(model, full_determinism=True)  # a resumed run's generator
    again.set_global_steps(3)
    together = _generate(again, PROMPTS[::-1], ["det-9", "det-7", "det-5"], temperature=1.0)
    assert together[2].token_ids == alone[0].token_ids
    many = _generate(generator, PROMPTS[:1] * 8, [f"det-{i}" for i in range(8)], temperature=1.0)
    assert len({tuple(o.token_ids) for o in many}) > 1  # ids draw different streams
    # verl sends a prompt's n samples under one id: each still draws its own stream
    generator.set_global_steps(4)
    same = _generate(generator, PROMPTS[:1] * 8, ["det-1"] * 8, temperature=1.0)
    assert len({tuple(o.token_ids) for o in same}) > 1
    # verl's transfer-queue trainer sends every request under "det-0", in an order that differs
    # between runs: each prompt still draws the same samples, whatever the order
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[0]]

    def by_prompt(order: list[int]) -> dict[str, list[tuple[int, ...]]]:
        run, _ = _synced(model, full_determinism=True)
        run.set_global_steps(5)
        given = [prompts[i] for i in order]
        outputs = _generate(run, given, ["det-0"] * len(given), temperature=1.0)
        found: dict[str, list[tuple[int, ...]]] = {}
        for prompt, output in zip(given, outputs, strict=True):
            found.setdefault(str(prompt), []).append(tuple(output.token_ids))
        return {prompt: sorted(samples) for prompt, samples in found.items()}

    assert by_prompt([0, 1, 2, 3, 4, 5]) == by_prompt([5, 3, 1, 0, 4, 2])


def test_the_plug_ins_agent_loops_name_each_request_by_its_sample(model: str) -> None:
    """verl's v1 trainer names every request ``det-0``: rows that repeat a prompt took their
    streams in arrival order, so the samples of two such rows (two groups) swapped between
    runs. Through the plug-in's agent loop each request carries its sample's identity (dataset
    row, sample of the row, step), and each sample draws the same tokens whatever the order."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from engine.integrations.verl import agent_loop
    from engine.integrations.verl.cells import AGENT_LOOPS

    for name, target in AGENT_LOOPS.items():
        assert _agent_loop_registry[name] == {"_target_": target}
    assert issubclass(agent_loop.SingleTurnAgentLoop, SingleTurnAgentLoop)

    class VerlLoop:  # verl's loop, as far as the request goes: ``det-{priority}``
        def __init__(self, client: Any, config: Any) -> None:
            self.server_manager, self.rollout_config = client, config

        async def run(self, sampling_params: dict[str, Any], **entries: Any) -> Any:
            return await self.server_manager.generate(
                request_id=f"det-{entries.get('priority', 0)}",
                prompt_ids=entries["prompt_ids"],
                sampling_params=sampling_params,
            )

    class Keyed(agent_loop._SampleKeyed, VerlLoop):
        pass

    # dataset rows 0..5 repeat 3 prompts; 2 samples each, as verl's v1 trainer passes them
    rows = [(index, PROMPTS[index % 3]) for index in range(6)]
    samples = [(index, prompt, session) for index, prompt in rows for session in range(2)]

    def sampled(order: list[int], loop: type = Keyed) -> dict[tuple[int, int], tuple[int, ...]]:
        generator, _ = _synced(model, full_determinism=True)
        generator.set_global_steps(2)

        async def run() -> list[Any]:
            return await asyncio.gather(
                *[
                    loop(generator, generator.config).run(
                        {"temperature": 1.0},
                        prompt_ids=samples[i][1],
                        index=torch.tensor(samples[i][0]),  # verl's batch holds tensors
                        session_id=samples[i][2],
                        global_steps=2,
                    )
                    for i in order
                ]
            )

        outputs = asyncio.run(run())
        return {
            (samples[i][0], samples[i][2]): tuple(output.token_ids)
            for i, output in zip(order, outputs, strict=True)
        }

    forward, backward = list(range(12)), list(reversed(range(12)))
    first = sampled(forward)
    assert first == sampled(backward)
    assert len(set(first.values())) > 1
    # verl's own loop: the same rows, in another order, give some row another row's samples
    assert sampled(forward, VerlLoop) != sampled(backward, VerlLoop)
    assert (
        agent_loop.sample_key(
            {"index": torch.tensor(3), "session_id": 1, "global_steps": 7, "uid": "a1"}
        )
        == "global_steps=7,index=3,session_id=1"
    )


def test_an_aborted_request_keeps_its_part_and_continues_from_the_new_weights(
    model: str,
) -> None:
    """verl's partial rollout as its ``colocate_async`` trainer drives it: abort (the batch in
    flight returns what it generated, ``stop_reason="aborted"``), sleep, a weight sync, resume;
    verl's ``FullyAsyncLLMServerClient`` then sends prompt + part to continue. The part's tokens
    and log-probs are the old weights' (the tokens an uninterrupted request draws first), the
    rest the new weights'; a request arriving while paused waits for the resume."""
    import time

    settings = dict(full_determinism=True, response_length=40)
    sampling = {"temperature": 1.0, "ignore_eos": True, "max_tokens": 40}
    prompt = PROMPTS[0]
    whole, _ = _synced(model, **settings)
    [uninterrupted] = _generate(whole, [prompt], ["det-1"], **sampling)
    generator, source = _synced(model, **settings)
    forwards: list[int] = []

    def slowly(module: Any, args: Any) -> None:  # room to abort mid-request
        forwards.append(1)
        time.sleep(0.01)

    generator.model.register_forward_pre_hook(slowly)
    noise = torch.Generator().manual_seed(0)
    changed = {
        k: v + 0.05 * torch.randn(v.shape, generator=noise) for k, v in source.state_dict().items()
    }
    newer = type(source)(source.config).eval()
    newer.load_state_dict(changed)

    async def partial_rollout() -> tuple[Any, Any, Any, Any, bool]:
        request = asyncio.ensure_future(
            generator.generate("det-1", prompt_ids=prompt, sampling_params=dict(sampling))
        )
        while len(forwards) < 5:
            await asyncio.sleep(0.005)
        report = await generator.abort_all_requests()
        part = await request
        late = asyncio.ensure_future(
            generator.generate("det-2", prompt_ids=prompt, sampling_params={"max_tokens": 2})
        )
        generator.sleep()  # verl sleeps the replica, then syncs the new weights
        for bucket, last in _buckets(iter(changed.items()), 1 << 12):
            generator.update_weights(bucket, last)
        await asyncio.sleep(0.05)
        held = not late.done()
        generator.resume_generation()
        budget = {**sampling, "max_tokens": 40 - len(part.token_ids)}
        rest = await generator.generate(
            "det-1", prompt_ids=prompt + part.token_ids, sampling_params=budget
        )
        return report, part, rest, await late, held

    report, part, rest, late, held = asyncio.run(partial_rollout())
    assert held and len(late.token_ids) == 2
    assert part.stop_reason == "aborted" and 0 < len(part.token_ids) < 40
    assert report == {"aborted_count": 1, "request_ids": [report["request_ids"][0]]}
    assert part.token_ids == uninterrupted.token_ids[: len(part.token_ids)]
    assert part.log_probs == uninterrupted.log_probs[: len(part.log_probs)]
    assert rest.stop_reason == "completed" and len(part.token_ids) + len(rest.token_ids) == 40
    warp = Sampling(temperature=1.0)
    for weights, start, output in ((source, prompt, part), (newer, prompt + part.token_ids, rest)):
        direct = _direct_log_probs(weights, start, output.token_ids, warp)
        # float32 logits, the cached decode against one forward: as the batching test above
        torch.testing.assert_close(torch.tensor(output.log_probs), direct, atol=1e-5, rtol=1e-5)


def test_a_replica_leaving_rotation_refuses_requests_until_it_resumes(model: str) -> None:
    """``abort_all_requests(reject_request=True)`` (verl's replica handed back to training):
    with nothing in flight it aborts nothing, and requests are refused by name, not held,
    until ``resume_generation``."""
    generator, _ = _synced(model)

    async def run() -> tuple[Any, Any]:
        report = await generator.abort_all_requests(reject_request=True)
        with pytest.raises(RuntimeError, match=r"reject_request=True"):
            await generator.generate("r", prompt_ids=PROMPTS[0], sampling_params={})
        generator.resume_generation()
        output = await generator.generate(
            "r", prompt_ids=PROMPTS[0], sampling_params={"max_tokens": 2, "ignore_eos": True}
        )
        return report, output

    report, output = asyncio.run(run())
    assert report == {"aborted_count": 0, "request_ids": []}
    assert len(output.token_ids) == 2 and output.stop_reason == "completed"


def test_generation_stops_at_end_of_sequence_unless_told_to_ignore_it(model: str) -> None:
    """A model whose every next token is its end-of-sequence token: one token, or
    ``max_tokens`` with ``ignore_eos``."""
    generator, _ = _synced(model)
    with torch.no_grad():
        generator.model.lm_head.weight.zero_()
    generator.stop_ids = [0]  # all logits equal: greedy picks id 0
    [stopped] = _generate(generator, PROMPTS[:1], temperature=0)
    assert stopped.token_ids == [0]
    [ignored] = _generate(generator, PROMPTS[:1], temperature=0, ignore_eos=True, max_tokens=4)
    assert ignored.token_ids == [0, 0, 0, 0]


def test_sleep_frees_the_weights_and_generating_before_a_sync_is_refused(model: str) -> None:
    generator, source = _synced(model)
    generator.sleep()
    assert sum(p.numel() for p in generator.model.parameters()) == 0
    with pytest.raises(RuntimeError, match="before the trainer's weights reached the generator"):
        _generate(generator, PROMPTS[:1], temperature=0)
    generator.resume(["weights"])
    with pytest.raises(RuntimeError, match="before the trainer's weights"):
        _generate(generator, PROMPTS[:1], temperature=0)  # allocated, not filled
    generator.update_weights(list(source.state_dict().items()), last=True)
    [output] = _generate(generator, PROMPTS[:1], temperature=0)
    assert output.token_ids


def test_what_it_cannot_honour_is_refused_by_name(model: str) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.tensor_model_parallel_size=2"):
        HFGenerator(_config(tensor_model_parallel_size=2), HFModelConfig(path=model), 0)
    generator, _ = _synced(model)
    with pytest.raises(ConfigError, match="n_best"):
        _generate(generator, PROMPTS[:1], temperature=1.0, n_best=2)
    with pytest.raises(ConfigError, match=r"repetition_penalty=1\.2"):
        _generate(generator, PROMPTS[:1], temperature=1.0, repetition_penalty=1.2)
    with pytest.raises(ConfigError, match="text token ids only"):
        asyncio.run(generator.generate("0", prompt_ids=[1], sampling_params={}, image_data=[1]))
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        HFGenerator(_config(enable_rollout_routing_replay=True), HFModelConfig(path=model), 0)
    with pytest.raises(KeyError, match="does not have"):
        generator.update_weights([("model.nothing.weight", torch.zeros(1))], last=True)
    with pytest.raises(ValueError, match="has shape"):
        generator.update_weights([("lm_head.weight", torch.zeros(3, 3))], last=True)


def test_mixture_of_experts_returns_each_tokens_routes(moe_model: str) -> None:
    """``routed_experts``: ``[prompt + response - 1, layers, top_k]``, the experts the router
    chose at each position, equal to the synced model's routers on the unpadded sequence."""
    generator, source = _synced(moe_model, enable_rollout_routing_replay=True)
    outputs = _generate(generator, PROMPTS, temperature=1.0)
    layers, top_k = source.config.num_hidden_layers, source.config.num_experts_per_tok
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        routes = output.routed_experts
        length = len(prompt) + len(output.token_ids) - 1
        assert routes.shape == (length, layers, top_k)
        chosen: list[torch.Tensor] = []
        hooks = [
            layer.mlp.gate.register_forward_hook(lambda m, a, out, into=chosen: into.append(out[2]))
            for layer in source.model.layers
        ]
        with torch.no_grad():
            source(torch.tensor([prompt + output.token_ids[:-1]]))
        for hook in hooks:
            hook.remove()
        expected = torch.stack(chosen, dim=1)  # [positions, layers, top_k]
        assert torch.equal(routes.sort(-1).values, expected.sort(-1).values)


@pytest.fixture(scope="module")
def distributed() -> None:
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
@pytest.mark.parametrize("experts", [False, True], ids=["dense", "moe"])
def test_a_sync_from_the_engine_gives_the_generator_its_weights_bit_for_bit(
    model: str, moe_model: str, distributed: None, backend: str, experts: bool
) -> None:
    """The engine's ``get_per_tensor_param`` through the adapter's buckets: every weight the
    generator has arrives, equal bit for bit (a mixture-of-experts layer's experts one tensor
    each, as checkpoints hold them, into transformers' fused parameters), and its log-probs
    are the engine's."""
    model = moe_model if experts else model
    engine = Engine.build(
        head="lm", backend=backend, device="cpu", config={"model": model, "micro_batch_size": 2}
    ).initialize()
    generator = HFGenerator(_config(), HFModelConfig(path=model), replica_rank=0)
    generator.sleep()
    generator.resume(["weights"])
    buckets = list(_buckets(engine.get_per_tensor_param(), 1 << 12))
    assert len(buckets) > 1 and [last for _, last in buckets].count(True) == 1
    for bucket, last in buckets:
        generator.update_weights(bucket, last)
    exported = dict(engine.get_per_tensor_param())
    mine = generator.named_weights()
    assert set(mine) == set(exported)
    for name, tensor in exported.items():
        assert torch.equal(mine[name], tensor.float()), name
    [output] = _generate(generator, PROMPTS[:1], temperature=1.0)
    ids = PROMPTS[0] + output.token_ids
    result = engine.infer_batch(
        TensorDict({"input_ids": jagged([torch.tensor(ids)])}, batch_size=[1])
    )
    theirs = result["log_probs"].unbind()[0][len(PROMPTS[0]) :]
    torch.testing.assert_close(torch.tensor(output.log_probs), theirs, atol=1e-5, rtol=1e-5)
    if backend == "megatron":
        from strategies.backends.megatron.mesh import destroy_mesh

        destroy_mesh()


@pytest.mark.parametrize("delta", [False, True], ids=["whole", "delta"])
def test_a_replica_apart_gets_the_engines_weights_through_the_gloo_checkpoint_engine(
    model: str, distributed: None, delta: bool
) -> None:
    """verl's ``separate_async`` path, in threads for its processes: the trainer's rank 0 sends
    the engine's ``get_per_tensor_param`` through ``composable_gloo`` (4 KiB buckets: the MLP's
    32 KiB weights go in chunks); the replica's checkpoint-engine worker hands the received
    stream (asynchronous) to the server adapter of replica 1, which syncs its generator. After
    each of three syncs (the engine trained a step before the second; not before the third),
    every weight equals the engine's bit for bit and the generator reports the step it was
    given. With ``delta``, the first sync is whole and the others carry only what changed: the
    second a part of the model, the third nothing."""
    import threading

    from engine.integrations.verl.checkpoint_engine import GlooCheckpointEngine
    from engine.losses import sft_loss

    engine = Engine.build(
        head="lm",
        backend="fsdp2",
        device="cpu",
        config={"model": model, "optimizer": {"lr": 1e-3}},
    )
    engine.initialize()
    generator = HFGenerator(_config(), HFModelConfig(path=model), replica_rank=1)
    adapter = HFServerAdapter(_config(), HFModelConfig(path=model), None, replica_rank=1)
    adapter._server, adapter.bucket_bytes = _in_process(generator), 1 << 12
    assert adapter.replica_rank == 1 and adapter.is_leader_rank
    sender = GlooCheckpointEngine(1 << 12, is_master=True, host="127.0.0.1", delta=delta)
    receiver = GlooCheckpointEngine(1 << 12, host="127.0.0.1", delta=delta)
    batch = TensorDict(
        {"input_ids": jagged([torch.tensor(p) for p in PROMPTS])}, batch_size=[len(PROMPTS)]
    )

    def sync(step: int) -> dict[str, float] | None:
        to_trainer, to_rollout = GlooCheckpointEngine.build_topology(
            1, 1, [sender.prepare(), receiver.prepare()]
        )
        errors: list[BaseException] = []
        metrics: list[dict[str, float] | None] = []

        def send() -> None:
            try:
                sender.init_process_group(**{k: v[0] for k, v in to_trainer.items()})
                metrics.append(asyncio.run(sender.send_weights(engine.get_per_tensor_param())))
            except BaseException as error:  # reported by the test's thread
                errors.append(error)

        def receive() -> None:
            try:
                receiver.init_process_group(**{k: v[0] for k, v in to_rollout.items()})
                weights = receiver.receive_weights()
                wire = receiver.wire_format
                asyncio.run(adapter.update_weights(weights, wire_format=wire, global_steps=step))
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=send), threading.Thread(target=receive)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors, errors
        sender.finalize()
        receiver.finalize()
        exported = dict(engine.get_per_tensor_param())
        mine = generator.named_weights()
        assert set(mine) == set(exported)
        for name, tensor in exported.items():
            assert torch.equal(mine[name], tensor.float()), name
        assert generator.global_steps == step
        return metrics[0]

    whole = sync(1)
    engine.train_batch(batch, sft_loss)
    changed = sync(2)
    unchanged = sync(3)
    if not delta:
        assert whole is changed is unchanged is None
        return
    assert whole is not None and changed is not None and unchanged is not None
    assert whole["checkpoint_engine/changed_ratio"] == 1.0
    assert 0 < changed["checkpoint_engine/changed_ratio"] < 1
    # each changed tensor as int32 positions + float32 values of its changed elements, or whole
    # where that is smaller: at most the whole model, and at most twice the changed share of it
    share, sent = (
        changed["checkpoint_engine/changed_ratio"],
        whole["checkpoint_engine/payload_mbytes"],
    )
    bound = min(sent, 2 * share * sent) * (1 + 1e-12)  # the ratios' float64 rounding
    assert 0 < changed["checkpoint_engine/payload_mbytes"] <= bound
    assert unchanged == {
        "checkpoint_engine/payload_mbytes": 0.0,
        "checkpoint_engine/changed_ratio": 0.0,
    }


@pytest.mark.parametrize("strategy", ["fsdp2", "megatron"])
def test_lora_adapters_synced_alone_set_the_generator_to_the_merged_weights_bit_for_bit(
    model: str, distributed: None, strategy: str
) -> None:
    """verl's LoRA sync with ``lora.merge`` off (its default), through the adapter and the
    server adapter's buckets: the base model once (adapted linears under ``base_layer``
    names), then the adapters alone under peft's names with their PEFT config, after each
    update. The generator's weights then equal the engine's merged export bit for bit
    (megatron: verl trains it in bf16, and the trainer's merge rounds an adapted weight to
    bf16 before its float32 export, so those are within a bf16 rounding, 2^-8 relative), the
    base model stays through sleep, and an adapter before any base is refused naming
    verl's setting."""
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, McoreEngineConfig
    from verl.workers.config.checkpoint import CheckpointConfig

    from engine.integrations.verl.adapter import ComposableEngine
    from engine.losses import sft_loss

    engine_config = (
        FSDPEngineConfig(strategy="fsdp2", mixed_precision={"param_dtype": "fp32"})
        if strategy == "fsdp2"
        else McoreEngineConfig()  # verl's megatron: bf16 (weights sent in bf16)
    )
    lora = {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    worker = ComposableEngine(
        HFModelConfig(path=model, load_tokenizer=False, **lora),
        engine_config,
        FSDPOptimizerConfig(lr=1e-2),
        CheckpointConfig(),
    )
    worker.initialize()
    engine = worker.engine
    batch = TensorDict(
        {"input_ids": jagged([torch.tensor(p) for p in PROMPTS])}, batch_size=[len(PROMPTS)]
    )
    generator = HFGenerator(_config(), HFModelConfig(path=model), replica_rank=0)

    adapter = HFServerAdapter(_config(), HFModelConfig(path=model), None)
    adapter._server, adapter.bucket_bytes = _in_process(generator), 1 << 11

    adapted = tuple(f"{target}.weight" for target in lora["target_modules"])

    def sync(base_sync_done: bool) -> list[str]:
        weights, peft_config = worker.get_per_tensor_param(base_sync_done=base_sync_done)
        assert peft_config is not None and peft_config.r == 4 and peft_config.lora_alpha == 8
        names: list[str] = []

        def seen() -> Any:
            for name, tensor in weights:
                names.append(name)
                yield name, tensor

        asyncio.run(adapter.update_weights(seen(), peft_config=peft_config, global_steps=1))
        return names

    with pytest.raises(RuntimeError, match=r"rollout\.load_format"):
        sync(base_sync_done=True)
    for step in range(2):
        engine.train_batch(batch, sft_loss)  # adapters move (B leaves 0)
        if step == 0:
            base_names = sync(base_sync_done=False)
            assert "model.layers.0.self_attn.q_proj.base_layer.weight" in base_names
            assert "model.layers.0.self_attn.k_proj.base_layer.weight" in base_names  # verl's
            assert "model.embed_tokens.weight" in base_names
        adapter_names = sync(base_sync_done=True)
        assert set(adapter_names) == set(dict(engine.get_per_tensor_param(adapter_only=True)))
        assert all(name.startswith("base_model.model.") for name in adapter_names)
        generator.sleep()  # the base model is sent once: sleep keeps it
        merged = dict(engine.get_per_tensor_param())
        mine = generator.named_weights()
        assert set(mine) == set(merged)
        for name, tensor in merged.items():
            if strategy == "fsdp2" or not name.endswith(adapted):
                assert torch.equal(mine[name], tensor.float()), (step, name)
            else:  # verl's megatron trains in bf16 and the trainer's merge rounds to it
                torch.testing.assert_close(mine[name], tensor.float(), rtol=2**-8, atol=0.0)
    with engine.disable_adapter():
        base = dict(engine.get_per_tensor_param())
    assert any(not torch.equal(base[name], merged[name]) for name in merged)
    if strategy == "megatron":
        from strategies.backends.megatron.mesh import destroy_mesh

        destroy_mesh()


def test_the_adapter_sends_from_the_replicas_first_rank_and_others_walk_the_weights(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of each replica sends buckets to its replica's generator; the other ranks only
    walk the generator (its collectives need every rank) and send nothing."""
    sent: list[tuple[int, list[str], bool]] = []

    class Server:
        def __init__(self, replica: int) -> None:
            self.replica = replica

        def __getattr__(self, method: str) -> Any:
            outer = self

            class Remote:
                @staticmethod
                def remote(*args: Any) -> Any:
                    if method == "update_weights":
                        bucket, last, _ = args
                        sent.append((outer.replica, [n for n, _ in bucket], last))

                    async def done() -> None:
                        return None

                    return done()

            return Remote

    monkeypatch.setattr(rollout.ray, "get_actor", lambda name: Server(int(name.rsplit("_", 1)[1])))
    weights = [(f"w{i}", torch.zeros(256)) for i in range(5)]  # 1 KiB each
    walked = []

    def walk() -> Any:
        for item in weights:
            walked.append(item[0])
            yield item

    for rank in range(4):
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda rank=rank: rank)
        adapter = HFServerAdapter(_config(data_parallel_size=2), HFModelConfig(path=model), None)
        adapter.bucket_bytes = 2048
        asyncio.run(adapter.update_weights(walk()))
    assert walked == [f"w{i}" for i in range(5)] * 4
    assert sent == [
        (0, ["w0", "w1"], False),
        (0, ["w2", "w3"], False),
        (0, ["w4"], True),
        (1, ["w0", "w1"], False),
        (1, ["w2", "w3"], False),
        (1, ["w4"], True),
    ]


def test_the_shipped_reward_scores_the_share_of_the_answer_that_repeats_the_word(
    tmp_path: Path,
) -> None:
    assert task.compute_score(task.DATA_SOURCE, "kiwi kiwi plum kiwi fig", "kiwi") == 0.75
    assert task.compute_score(task.DATA_SOURCE, "", "kiwi") == 0.0
    with pytest.raises(ValueError, match="scores"):
        task.compute_score("gsm8k", "kiwi", "kiwi")
    paths = task.write_data(tmp_path, train=8, test=4)
    import pandas as pd

    frame = pd.read_parquet(paths["train"])
    assert len(frame) == 8 and set(frame["data_source"]) == {task.DATA_SOURCE}
    row = frame.iloc[1]
    assert row["reward_model"]["ground_truth"] in row["prompt"][0]["content"]
