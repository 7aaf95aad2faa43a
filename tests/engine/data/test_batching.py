"""Batches: jagged <-> padded conversion, fixed micro-batches, outputs back in input order."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from engine import Engine
from engine.data.batching import (
    RowSelector,
    from_token_lists,
    jagged,
    jagged_offsets,
    jagged_values,
    jagged_view,
    restore_outputs,
    sequence_lengths,
    split_fixed,
    take_rows,
    to_jagged,
    to_padded,
    validate_batch,
)
from heads.errors import BatchError, ConfigError
from tests.factories import random_batch, tiny_model

lengths_strategy = st.lists(st.integers(1, 12), min_size=1, max_size=7)


@settings(max_examples=50, deadline=None)
@given(lengths=lengths_strategy, side=st.sampled_from(["left", "right"]))
def test_padding_then_unpadding_gives_back_every_field(lengths: list[int], side: str) -> None:
    batch = random_batch(lengths, 50)
    padded = to_padded(batch, side=side)
    assert padded["attention_mask"].sum(-1).tolist() == lengths
    back = to_jagged(padded)
    for name in ("input_ids", "returns", "loss_mask"):
        for original, restored in zip(batch[name].unbind(), back[name].unbind(), strict=True):
            assert torch.equal(original, restored)


@settings(max_examples=50, deadline=None)
@given(lengths=lengths_strategy, size=st.integers(1, 8))
def test_fixed_micro_batches_pad_to_their_own_longest_and_restore_input_order(
    lengths: list[int], size: int
) -> None:
    batch = random_batch(lengths, 50)
    micro_batches = split_fixed(batch, size)
    assert [len(mb.indices) for mb in micro_batches[:-1]] == [size] * (len(micro_batches) - 1)
    for mb in micro_batches:
        assert mb.input_ids.shape[1] == max(lengths[int(i)] for i in mb.indices)
    restored = restore_outputs(
        [{"ids": mb.input_ids.float()} for mb in micro_batches], micro_batches, len(lengths)
    )
    for original, back in zip(batch["input_ids"].unbind(), restored["ids"].unbind(), strict=True):
        assert torch.equal(original.float(), back)


@pytest.mark.parametrize("row", [[1, 2.7, 3], [1.0, 2.0], [True, False]])
def test_from_token_lists_refuses_token_ids_that_are_not_integers(row: list[Any]) -> None:
    with pytest.raises(BatchError, match="sequence 1: token ids must be integers"):
        from_token_lists([[1, 2], row])


def test_from_token_lists_rejects_per_token_fields_of_other_lengths() -> None:
    with pytest.raises(BatchError, match="lengths of input_ids"):
        from_token_lists([[1, 2, 3]], loss_mask=[[1.0]])


def test_padded_input_without_attention_mask_counts_every_position() -> None:
    from tensordict import TensorDict

    batch = TensorDict({"input_ids": torch.ones(2, 5, dtype=torch.long)}, batch_size=[2])
    assert sequence_lengths(batch).tolist() == [5, 5]


def test_padding_side_must_be_left_or_right() -> None:
    with pytest.raises(BatchError, match="'left' or 'right'"):
        to_padded(random_batch([2], 10), side="middle")


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    lengths=lengths_strategy,
    size=st.integers(1, 8),
    budget=st.one_of(st.none(), st.integers(12, 60)),
    side=st.sampled_from(["left", "right"]),
)
def test_engine_outputs_do_not_depend_on_padding_side_micro_batch_size_or_token_budget(
    fresh_mesh: None, lengths: list[int], size: int, budget: int | None, side: str
) -> None:
    from strategies.backends.megatron.mesh import destroy_mesh

    destroy_mesh()
    batch = random_batch(lengths, 64)
    one_by_one = Engine.build(
        head="lm",
        device="cpu",
        config={"model": tiny_model(), "micro_batch_size": 1, "head": {"compute_entropy": True}},
    ).initialize()
    engine = Engine.build(
        head="lm",
        device="cpu",
        config={
            "model": tiny_model(),
            "micro_batch_size": size,
            "max_tokens_per_micro_batch": budget,
            "head": {"compute_entropy": True},
        },
    ).initialize()
    if budget is not None:
        plan = engine.plan_micro_batches(batch)
        assert all(load <= budget for load in plan.padded_tokens)
        assert sorted(i for group in plan.groups for i in group) == list(range(len(lengths)))
    expected = one_by_one.infer_batch(batch)
    got = engine.infer_batch(to_padded(batch, side=side))
    for key in ("log_probs", "entropy"):
        for want, have in zip(expected[key].unbind(), got[key].unbind(), strict=True):
            torch.testing.assert_close(have, want, atol=2e-5, rtol=1e-5)


@settings(max_examples=50, deadline=None)
@given(lengths=lengths_strategy, side=st.sampled_from(["left", "right", "jagged"]))
def test_validation_accepts_every_well_formed_batch(lengths: list[int], side: str) -> None:
    batch = random_batch(lengths, 50)
    if side != "jagged":
        batch = to_padded(batch, side=side)
    assert validate_batch(batch, ["returns"], vocab_size=50, max_length=12) is batch


@pytest.mark.parametrize("side", ["left", "right", "jagged"])
def test_refusals_name_rows_as_the_caller_names_them_and_each_length_limit_by_who_sets_it(
    side: str,
) -> None:
    batch = random_batch([3, 7, 5], 50)
    batch = batch if side == "jagged" else to_padded(batch, side=side)
    names = ["a.jsonl:1", "a.jsonl:4", "a.jsonl:9"]
    limits = [(10, "the model's max_sequence_length"), (6, "max_tokens_per_micro_batch")]
    with pytest.raises(BatchError, match=r"^a\.jsonl:4 has 7 tokens, more than max_tokens_per_"):
        validate_batch(batch, length_limits=limits, row_names=names)
    with pytest.raises(BatchError, match=r"^row 1 has 7 tokens, more than max_length \(6\)"):
        validate_batch(batch, max_length=6)
    with pytest.raises(BatchError, match=r"a\.jsonl:9, (token|position) \d holds 99"):
        bad = batch.clone()
        ids = bad["input_ids"]
        if ids.is_nested:
            ids.values()[-1] = 99  # the last row's last token
        else:
            ids[2, 0 if side == "right" else -1] = 99  # a real token of the last row
        validate_batch(bad, vocab_size=50, row_names=names)
    with pytest.raises(ConfigError, match="2 row_names for a batch of 3 rows"):
        validate_batch(batch, row_names=names[:2])


@settings(max_examples=30, deadline=None)
@given(lengths=lengths_strategy, side=st.sampled_from(["left", "right", "jagged"]))
def test_a_field_in_the_wrong_granularity_is_refused_by_name_and_the_right_one_accepted(
    lengths: list[int], side: str
) -> None:
    batch = random_batch(lengths, 50)
    batch["score"] = torch.ones(len(lengths))
    if side != "jagged":
        batch = to_padded(batch, side=side)
    right = {"returns": "token", "score": "sequence", "absent": "token"}
    assert validate_batch(batch, ["returns", "score"], granularity=right) is batch
    with pytest.raises(BatchError, match=r"field 'score' is per-sequence \(\[\d+\], one value"):
        validate_batch(batch, ["score"], granularity={"score": "token"})
    with pytest.raises(BatchError, match=r"field 'returns' is per-token .* reads it per sequence"):
        validate_batch(batch, ["returns"], granularity={"returns": "sequence"})
    with pytest.raises(ConfigError, match="field 'returns': granularity must be"):
        validate_batch(batch, granularity={"returns": "tokens"})


@settings(max_examples=50, deadline=None)
@given(
    lengths=lengths_strategy,
    side=st.sampled_from(["left", "right", "jagged"]),
    data=st.data(),
)
def test_a_mask_value_other_than_0_or_1_is_refused_naming_its_row_and_token(
    lengths: list[int], side: str, data: st.DataObject
) -> None:
    row = data.draw(st.integers(0, len(lengths) - 1))
    token = data.draw(st.integers(0, lengths[row] - 1))
    value = data.draw(st.sampled_from([-100.0, 0.5, 2.0, math.nan]))
    masks = [[1.0] * n for n in lengths]
    masks[row][token] = value
    batch = from_token_lists([[1] * n for n in lengths], loss_mask=masks)
    if side != "jagged":
        batch = to_padded(batch, side=side)
        token += batch["input_ids"].shape[1] - lengths[row] if side == "left" else 0
    place = f"row {row}, {'token' if side == 'jagged' else 'position'} {token} holds"
    with pytest.raises(BatchError, match=f"mask 'loss_mask' must hold only 0 and 1; {place}"):
        validate_batch(batch)


def rows_of(batch: TensorDict, name: str, chosen: list[int]) -> list[list[float]]:
    """Field ``name`` of rows ``chosen``, read row by row (jagged or not)."""
    value = batch[name]
    rows = value.unbind() if value.is_nested else list(value)
    return [rows[i].tolist() for i in chosen]


@settings(max_examples=100, deadline=None)
@given(
    lengths=lengths_strategy,
    data=st.data(),
    kind=st.sampled_from(["slice", "indices", "tensor", "mask"]),
    layout=st.sampled_from(["jagged", "padded"]),
)
def test_take_rows_gives_the_rows_that_indexing_names(
    lengths: list[int], data: st.DataObject, kind: str, layout: str
) -> None:
    """``take_rows(batch, rows)`` holds what ``batch[rows]`` names, on every tensordict version
    (0.10 cannot index jagged fields along the batch dim), in either layout."""
    batch = random_batch(lengths, 50)
    batch["score"] = torch.arange(len(lengths), dtype=torch.float32)
    if layout == "padded":
        batch = to_padded(batch)
    total = len(lengths)
    rows: Any
    if kind == "slice":
        start = data.draw(st.one_of(st.none(), st.integers(-total - 1, total + 1)))
        stop = data.draw(st.one_of(st.none(), st.integers(-total - 1, total + 1)))
        rows = slice(start, stop, data.draw(st.sampled_from([None, 1, 2, 3])))
        chosen = list(range(total))[rows]
    elif kind == "mask":
        keep = data.draw(st.lists(st.booleans(), min_size=total, max_size=total))
        rows, chosen = torch.tensor(keep), [i for i in range(total) if keep[i]]
    else:
        chosen = data.draw(st.lists(st.integers(-total, total - 1), max_size=10))
        rows = torch.tensor(chosen, dtype=torch.long) if kind == "tensor" else chosen
        chosen = [i % total for i in chosen]
    taken = take_rows(batch, rows)
    assert list(taken.batch_size) == [len(chosen)]
    assert sorted(taken.keys()) == sorted(batch.keys())
    for name in batch.keys():
        assert taken[name].is_nested == batch[name].is_nested
        assert rows_of(taken, name, list(range(len(chosen)))) == rows_of(batch, name, chosen)
    if chosen and layout == "jagged":
        assert validate_batch(taken, ["returns"]) is taken


def test_take_rows_of_a_contiguous_range_is_a_view_and_keeps_shared_offsets() -> None:
    """A slice reads no tokens (the engine's data-parallel shard of a big batch), and jagged
    fields that shared offsets still do, so torch can still combine them token by token."""
    ids = jagged([torch.arange(n) for n in (2, 3, 4, 1)])
    mask = torch.nested.nested_tensor_from_jagged(torch.ones(10), jagged_offsets(ids))
    batch = TensorDict({"input_ids": ids, "loss_mask": mask}, batch_size=[4])
    for rows in (slice(1, 3), [3, 0]):
        taken = take_rows(batch, rows)
        assert jagged_offsets(taken["input_ids"]) is jagged_offsets(taken["loss_mask"])
        assert (taken["input_ids"] * taken["loss_mask"]).shape[0] == 2
    view = take_rows(batch, slice(1, 3))["input_ids"]
    assert jagged_values(view).data_ptr() == jagged_values(ids)[2:].data_ptr()
    assert view.unbind()[1].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("rows", "error", "match"),
    [
        ([0, 5], IndexError, "out of bounds"),
        (torch.tensor([True, False]), BatchError, "a row mask needs 3 entries"),
        (torch.tensor([0.5]), BatchError, "1-D integer indices"),
        (torch.zeros(1, 1, dtype=torch.long), BatchError, "1-D integer indices"),
    ],
)
def test_take_rows_refuses_rows_the_batch_does_not_have(
    rows: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        take_rows(random_batch([1, 2, 3], 10), rows)


def test_take_rows_brings_non_tensor_entries_along() -> None:
    """A NonTensorStack (one object per row, e.g. verl's uids) gives the rows' objects; a
    NonTensorData (one value for the batch, e.g. verl's dp_size) comes whole."""
    batch = random_batch([2, 3, 4, 1], 10)
    batch.set_non_tensor("dp_size", 2)
    batch["uids"] = NonTensorStack(*(NonTensorData(f"u{row}") for row in range(4)))
    for rows, chosen in (([3, 0], [3, 0]), (slice(1, 3), [1, 2]), (slice(None, None, 2), [0, 2])):
        taken = take_rows(batch, rows)
        assert list(taken.keys()) == list(batch.keys())
        assert taken.get("uids").tolist() == [f"u{row}" for row in chosen]
        assert taken["dp_size"] == 2
        assert rows_of(taken, "input_ids", [0, 1]) == rows_of(batch, "input_ids", chosen)


def test_a_selector_takes_the_entries_the_batch_holds_at_each_take() -> None:
    """An entry set after the selector was made (verl's batch_num_tokens, assigned before each
    micro-batch's loss) comes along; the jagged fields' layouts are still read once."""
    batch = random_batch([2, 3, 4], 10)
    selector = RowSelector(batch)
    assert "batch_num_tokens" not in selector.take([0]).keys()
    batch.set_non_tensor("batch_num_tokens", 7)
    taken = selector.take([2, 1])
    assert taken["batch_num_tokens"] == 7
    assert rows_of(taken, "returns", [0, 1]) == rows_of(batch, "returns", [2, 1])


def test_fields_with_equal_offsets_share_one_gather_and_the_new_offsets() -> None:
    """Jagged fields laid out alike (equal offsets, not the same tensor) are selected by one
    gather and share the new offsets, so torch combines them token by token; a field laid out
    otherwise gets its own."""
    lengths = [2, 3, 4, 1]
    batch = TensorDict(
        {
            "input_ids": jagged([torch.arange(n) for n in lengths]),
            "loss_mask": jagged([torch.ones(n) for n in lengths]),
            "prompts": jagged([torch.arange(n + 1) for n in lengths]),
        },
        batch_size=[4],
    )
    assert jagged_offsets(batch["input_ids"]) is not jagged_offsets(batch["loss_mask"])
    selector = RowSelector(batch)
    for rows in ([3, 0, 2], torch.tensor([1, 2]), slice(1, 4), [0, 0]):
        taken = selector.take(rows)
        chosen = list(range(4))[rows] if isinstance(rows, slice) else list(map(int, rows))
        ids, mask, prompts = taken["input_ids"], taken["loss_mask"], taken["prompts"]
        assert jagged_offsets(ids) is jagged_offsets(mask)
        assert jagged_offsets(prompts) is not jagged_offsets(ids)
        assert (ids * mask).shape[0] == len(chosen)
        for name in batch.keys():
            assert rows_of(taken, name, list(range(len(chosen)))) == rows_of(batch, name, chosen)
            assert taken[name].dtype == batch[name].dtype


def test_a_selector_takes_the_rows_of_jagged_fields_with_holes() -> None:
    """A jagged field with lengths of its own (rows that need not touch in the buffer) gives
    its rows' tokens only, laid out without holes."""
    starts, lengths = torch.tensor([1, 0, 2, 3]), torch.tensor([3, 2, 1, 2])
    holed = torch.nested.narrow(
        torch.arange(20).reshape(4, 5), 1, starts, lengths, layout=torch.jagged
    )
    assert holed.lengths() is not None  # type: ignore[attr-defined]
    batch = TensorDict({"input_ids": holed}, batch_size=[4])
    for rows in ([2, 0], slice(1, 3)):
        taken = take_rows(batch, rows)["input_ids"]
        chosen = [2, 0] if isinstance(rows, list) else [1, 2]
        assert [row.tolist() for row in taken.unbind()] == [
            holed.unbind()[row].tolist() for row in chosen
        ]
        assert taken.lengths() is None  # type: ignore[attr-defined]


def test_feature_bounds_say_where_selected_rows_record_their_longest() -> None:
    """By default every jagged field's rows record their length bounds (tensordict pads to the
    longest selected row); without ``feature_bounds`` rows with feature dims do not (as verl's
    selection: padded to the buffer's length), rows of one dim still do."""
    lengths = [5, 1, 2]
    batch = TensorDict(
        {
            "input_ids": jagged([torch.arange(n) for n in lengths]),
            "features": jagged([torch.ones(n, 3) for n in lengths]),
        },
        batch_size=[3],
    )
    bounded = RowSelector(batch).take([1, 2]).to_padded_tensor()
    unbounded = RowSelector(batch, feature_bounds=False).take([1, 2]).to_padded_tensor()
    assert bounded["input_ids"].shape == unbounded["input_ids"].shape == (2, 2)
    assert bounded["features"].shape == (2, 2, 3)
    assert unbounded["features"].shape == (2, 3, 3)


def test_nested_tensors_not_ragged_in_the_rows_first_dim_go_to_other_nested() -> None:
    """A nested tensor ragged in a later dim (verl's 3-D position ids) is refused by name, or
    selected by the caller's ``other_nested``."""
    ids = jagged([torch.arange(n) for n in (2, 3, 1)])
    later = jagged([torch.arange(3 * n).reshape(n, 3) for n in (2, 3, 1)]).transpose(1, 2)
    batch = TensorDict({"input_ids": ids, "position_ids": later}, batch_size=[3])
    with pytest.raises(BatchError, match=r"'position_ids'.*ragged in dim 2"):
        take_rows(batch, [2, 0])
    asked: list[list[int]] = []

    def rows_by_hand(value: torch.Tensor, chosen: list[int]) -> torch.Tensor:
        asked.append(chosen)
        return torch.stack([value.unbind()[row].sum() for row in chosen])

    taken = RowSelector(batch, other_nested=rows_by_hand).take([2, 0])
    assert asked == [[2, 0]]
    assert taken["position_ids"].tolist() == [later.unbind()[2].sum(), later.unbind()[0].sum()]
    assert rows_of(taken, "input_ids", [0, 1]) == [[0], [0, 1]]


@pytest.mark.parametrize("features", [(), (3,)])
def test_a_jagged_view_is_torchs_jagged_tensor_of_the_buffer_with_its_gradient(
    features: tuple[int, ...],
) -> None:
    """``jagged_view`` makes what ``nested_tensor_from_jagged`` makes, and the gradient flows
    back to the buffer the same, bit for bit."""
    offsets = torch.tensor([0, 2, 7, 8])
    buffer = torch.randn(8, *features, generator=torch.Generator().manual_seed(0))
    weights = torch.randn(8, *features, generator=torch.Generator().manual_seed(1))
    made = {}
    for name, make in (("ours", jagged_view), ("torch's", torch.nested.nested_tensor_from_jagged)):
        values = buffer.clone().requires_grad_()
        view = make(values, offsets)
        (view.values() * weights).sum().backward()
        made[name] = (view, values.grad)
    (ours, our_grad), (theirs, their_grad) = made["ours"], made["torch's"]
    assert ours.shape == theirs.shape and ours.requires_grad
    assert torch.equal(ours.offsets(), theirs.offsets())
    assert all(map(torch.equal, ours.detach().unbind(), theirs.detach().unbind()))
    assert torch.equal(our_grad, their_grad)
    with torch.no_grad():
        assert not jagged_view(buffer.requires_grad_(), offsets).requires_grad
