"""`TorchPagedAttention(batch_invariant=True)`: correct, and a group's output does not depend on
the other groups of the call (bitwise), on the CPU. Selection builds backends in that mode."""

from __future__ import annotations

import pytest
import torch
from rlt_attention import TorchPagedAttention, select_attention_backend
from rlt_contracts import (
    AttentionRequirements,
    ConfigurationError,
    KVLayout,
    PagedAttentionBatch,
)

MIXED_GROUPS = [(1, 9), (5, 5), (3, 17), (1, 1), (4, 12), (0, 0)]
TOLERANCE = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (6, 2), (2, 2)])
def test_matches_naive_reference(paged_case, reference, dtype, block_size, num_heads, num_kv_heads):
    case = paged_case(
        MIXED_GROUPS,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
        head_dim=16,
        seed=3,
    )
    attention = TorchPagedAttention(batch_invariant=True).bind(case.kv_cache, case.batch)
    out = attention(case.layer_index, case.query, case.key, case.value)
    assert out.dtype == dtype and out.shape == case.query.shape
    torch.testing.assert_close(out.double(), reference(case), rtol=TOLERANCE[dtype], atol=2e-6)


def _rows(case, group: int) -> slice:
    start = case.batch.query_start.tolist()
    return slice(start[group], start[group + 1])


def _call(case, groups: list[int], backend=None) -> dict[int, torch.Tensor]:
    """Run the call made of `groups` (indices into the case, in this order); outputs by group."""
    batch, lengths = case.batch, case.batch.context_lengths.tolist()
    q_lens = [case.groups[g][0] for g in groups]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    rows = [torch.arange(_rows(case, g).start, _rows(case, g).stop) for g in groups]
    index = torch.cat(rows)
    device = case.kv_cache.key_cache.device
    index = index.to(device)
    sub = PagedAttentionBatch(
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lengths=torch.tensor(
            [lengths[g] for g in groups], dtype=torch.int32, device=device
        ),
        block_tables=batch.block_tables[groups],
        write_slots=batch.write_slots[index],
        max_query_len=max(q_lens),
        max_context_len=max(lengths[g] for g in groups),
    )
    backend = backend or TorchPagedAttention(batch_invariant=True)
    attention = backend.bind(case.kv_cache, sub)
    out = attention(case.layer_index, case.query[index], case.key[index], case.value[index])
    return {g: out[starts[i] : starts[i + 1]] for i, g in enumerate(groups)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2)])
def test_group_output_is_independent_of_the_other_groups(
    paged_case, dtype, num_heads, num_kv_heads
):
    # targets: a decode row, a 1-token prefill chunk, a prompt's first chunk, a continuing
    # chunk; around them: longer contexts (more key chunks), longer chunks (larger Qmax).
    groups = [(1, 17), (1, 10), (5, 5), (3, 70), (1, 200), (12, 30), (40, 140), (1, 1)]
    case = paged_case(
        groups,
        block_size=16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        dtype=dtype,
        seed=7,
    )
    everything = _call(case, list(range(len(groups))))
    for target in range(4):
        alone = _call(case, [target])[target]
        assert torch.equal(alone, everything[target])
        others = [g for g in range(len(groups)) if g != target]
        for layout in (others[:1] + [target], [target] + others[3:], others[::-1] + [target]):
            assert torch.equal(_call(case, layout)[target], alone), (target, layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prompt_rows_do_not_depend_on_the_chunking(paged_case, dtype):
    """The same prompt positions computed as one chunk of 20, as chunks of 5 + 15, or one
    token at a time (as the scheduler may cut a prompt under load) give the same rows."""
    case = paged_case(
        [(20, 30)], block_size=4, num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype, seed=11
    )
    first = 30 - 20  # the chunk's first position

    def chunk(begin: int, end: int) -> torch.Tensor:
        """Rows [begin, end) of the 20 as one call (context = first + end)."""
        sub = PagedAttentionBatch(
            query_start=torch.tensor([0, end - begin], dtype=torch.int32),
            context_lengths=torch.tensor([first + end], dtype=torch.int32),
            block_tables=case.batch.block_tables,
            write_slots=case.batch.write_slots[begin:end],
            max_query_len=end - begin,
            max_context_len=first + end,
        )
        attention = TorchPagedAttention(batch_invariant=True).bind(case.kv_cache, sub)
        rows = slice(begin, end)
        return attention(case.layer_index, case.query[rows], case.key[rows], case.value[rows])

    whole = chunk(0, 20)
    assert torch.equal(torch.cat([chunk(0, 5), chunk(5, 20)]), whole)
    assert torch.equal(torch.cat([chunk(i, i + 1) for i in range(20)]), whole)
    assert torch.equal(torch.cat([chunk(0, 9), chunk(9, 11), chunk(11, 20)]), whole)


def _triton_backend():
    from rlt_attention import triton_backend

    if triton_backend.triton_kernel is None:
        pytest.skip("triton is not importable")
    if not torch.cuda.is_available() and not triton_backend.triton_kernel.INTERPRETED:
        pytest.skip("needs CUDA or Triton's interpreter")
    return triton_backend.TritonPagedAttention(batch_invariant=True)


def test_triton_mode_in_the_interpreter(paged_case, reference):
    """The Triton mode's logic (one tile for decode and prefill, masked steps past a row's
    causal limit) in Triton's CPU interpreter, fp32: correct, and a decode row and a 1-token
    chunk equal alone and among longer chunks. Not evidence of GPU behaviour."""
    backend = _triton_backend()
    groups = [(1, 17), (1, 10), (5, 5), (12, 30), (1, 1)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = paged_case(groups, block_size=4, head_dim=16, seed=5, device=device)
    everything = _call(case, list(range(len(groups))), backend)
    torch.testing.assert_close(
        torch.cat([everything[g] for g in range(len(groups))]).double().cpu(),
        reference(case),
        rtol=1e-5,
        atol=2e-6,
    )
    for target in (0, 1):
        alone = _call(case, [target], backend)[target]
        assert torch.equal(alone, everything[target])
        assert torch.equal(_call(case, [3, target], backend)[target], alone)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_mode_on_cuda(paged_case, dtype):
    """On a GPU (never run yet): the same independence for the compiled kernel."""
    backend = _triton_backend()
    groups = [(1, 17), (1, 10), (5, 5), (3, 70), (1, 2000), (120, 300), (40, 1400), (1, 1)]
    case = paged_case(
        groups,
        block_size=16,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
        dtype=dtype,
        seed=7,
        device="cuda",
    )
    everything = _call(case, list(range(len(groups))), backend)
    for target in range(4):
        alone = _call(case, [target], backend)[target]
        assert torch.equal(alone, everything[target])
        others = [g for g in range(len(groups)) if g != target]
        assert torch.equal(_call(case, others[::-1] + [target], backend)[target], alone)


def test_selection_builds_the_batch_invariant_mode_and_names_the_option():
    requirements = AttentionRequirements(
        device_type="cpu",
        dtype="float32",
        head_dim=16,
        num_heads=4,
        num_kv_heads=2,
        block_size=16,
        kv_layout=KVLayout.LAST_EXITED,
        batch_invariant=True,
    )
    selection = select_attention_backend(requirements)
    assert selection.name == "torch" and selection.backend.batch_invariant
    assert "batch-invariant" in selection.reason
    assert any("batch-invariant" in r for r in selection.rejected["flash_attn"])
    plain = select_attention_backend(
        AttentionRequirements(**{**_fields(requirements), "batch_invariant": False})
    )
    assert not plain.backend.batch_invariant
    with pytest.raises(ConfigurationError) as error:
        select_attention_backend(requirements, "flash_attn")
    assert "batch_invariant" in error.value.options


def _fields(requirements: AttentionRequirements) -> dict:
    return {name: getattr(requirements, name) for name in requirements.__struct_fields__}
