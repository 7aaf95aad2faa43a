"""The shared Hugging Face generator (engine/generation/): one sampling loop, one cache switch.
The demo's tests (tests/engine/cli/test_demo.py) and verl's (tests/integrations/
test_verl_rollout.py) check it through its two users."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.generation.sampling import MostLikely, cache_argument, generate, left_padded

ROOT = Path(__file__).resolve().parents[2]


def test_one_file_holds_a_sampling_loop() -> None:
    """A KV-cached sampling loop (``use_cache=True``) lives in engine/generation/sampling.py
    only: the demo and verl's rollout call it instead of holding their own."""
    holders = sorted(
        str(path.relative_to(ROOT))
        for top in ("engine", "strategies", "heads")
        for path in (ROOT / top).rglob("*.py")
        if "use_cache=True" in path.read_text()
    )
    assert holders == ["engine/generation/sampling.py"]


def test_the_cache_is_passed_under_the_name_the_models_forward_takes() -> None:
    class Current(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, cache: object = None) -> None: ...

    class Older(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, past_key_values: object = None) -> None: ...

    assert cache_argument(Current()) == "cache"
    assert cache_argument(Older()) == "past_key_values"


def test_a_left_padded_batch_generates_what_each_prompt_generates_alone() -> None:
    """Greedy tokens of prompts of different lengths in one left-padded batch equal each
    prompt's alone; a row stops after its stop token, the others go on."""
    from engine.generation.weights import build_model
    from strategies.hf.architecture import hf_config_for
    from strategies.part_configs import model_preset

    torch.manual_seed(0)
    model = build_model(hf_config_for(model_preset("tiny")))  # the demo's generator
    prompts = [[3, 9, 4, 1, 7], [5, 2]]
    input_ids, mask = left_padded(prompts, pad=0)
    batch = generate(model, input_ids, attention_mask=mask, max_tokens=6, pick=MostLikely())
    for row, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), max_tokens=6, pick=MostLikely())
        assert batch.tokens[row].tolist() == alone.tokens[0].tolist()
        torch.testing.assert_close(batch.log_probs[row], alone.log_probs[0])
    stop = int(batch.tokens[0, 2])
    stopped = generate(
        model, input_ids, attention_mask=mask, max_tokens=6, pick=MostLikely(), stop_ids=[stop]
    )
    first = batch.tokens[0].tolist().index(stop) + 1
    assert stopped.lengths[0] == first
    assert stopped.tokens[0, :first].tolist() == batch.tokens[0, :first].tolist()


def test_a_generation_stopped_early_returns_what_it_generated() -> None:
    """``stop_early`` (an abort) is asked before each step: the tokens before it are those of
    an uninterrupted run, marked ``aborted``; stopped before the first step, nothing."""
    from engine.generation.weights import build_model
    from strategies.hf.architecture import hf_config_for
    from strategies.part_configs import model_preset

    torch.manual_seed(0)
    model = build_model(hf_config_for(model_preset("tiny")))
    prompts = torch.tensor([[3, 9, 4, 1, 7], [5, 2, 8, 8, 1]])
    whole = generate(model, prompts, max_tokens=6, pick=MostLikely())
    asked: list[int] = []

    def after_three() -> bool:
        asked.append(1)
        return len(asked) > 3

    part = generate(model, prompts, max_tokens=6, pick=MostLikely(), stop_early=after_three)
    assert part.aborted and not whole.aborted
    assert part.tokens.tolist() == whole.tokens[:, :3].tolist()
    assert part.lengths.tolist() == [3, 3]
    torch.testing.assert_close(part.log_probs, whole.log_probs[:, :3], rtol=0, atol=0)
    nothing = generate(model, prompts, max_tokens=6, pick=MostLikely(), stop_early=lambda: True)
    assert nothing.aborted and nothing.tokens.shape == (2, 0) and nothing.lengths.tolist() == [0, 0]
