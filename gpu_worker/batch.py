"""Tensors for one forward pass, built from a step plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.plan import StepPlan


@dataclass(frozen=True)
class PrefillSpan:
    start: int  # index of the chunk's first token in the flat batch
    end: int
    ctx_blocks: torch.Tensor  # blocks holding context positions 0 .. ctx_len-1
    ctx_len: int


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] where each token's k/v goes
    decode_index: torch.Tensor  # [b] flat index of the single token of each decode chunk
    decode_block_tables: torch.Tensor  # [b, max_blocks]
    decode_ctx_lens: torch.Tensor  # [b]
    prefills: tuple[PrefillSpan, ...]
    sample_index: torch.Tensor  # [S] flat index of the tokens whose logits are sampled


def token_slots(block_table: tuple[int, ...], start: int, end: int, block_size: int) -> torch.Tensor:
    """Slot of each position start..end-1 of a sequence."""
    if end > len(block_table) * block_size:
        raise ValueError(f"block table of {len(block_table)} blocks cannot hold position {end - 1}")
    positions = torch.arange(start, end)
    return torch.tensor(block_table, dtype=torch.long)[positions // block_size] * block_size + positions % block_size


def build_batch(plan: StepPlan, block_size: int, device: torch.device) -> ForwardBatch:
    input_ids, positions, write_slots, sample_index = [], [], [], []
    decode_index, decode_tables, decode_lens, prefills = [], [], [], []
    offset = 0
    for chunk in plan.chunks:
        n = len(chunk.token_ids)
        input_ids.extend(chunk.token_ids)
        positions.append(torch.arange(chunk.start_pos, chunk.end_pos))
        write_slots.append(token_slots(chunk.block_table, chunk.start_pos, chunk.end_pos, block_size))
        blocks = torch.tensor(chunk.block_table[: -(-chunk.end_pos // block_size)], dtype=torch.long)
        if n == 1:
            decode_index.append(offset)
            decode_tables.append(blocks)
            decode_lens.append(chunk.end_pos)
        else:
            prefills.append(PrefillSpan(offset, offset + n, blocks.to(device), chunk.end_pos))
        offset += n
        if chunk.sampling is not None:
            sample_index.append(offset - 1)

    def to(values, dtype=torch.long) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype).to(device)

    return ForwardBatch(
        input_ids=to(input_ids),
        positions=torch.cat(positions).to(device),
        write_slots=torch.cat(write_slots).to(device),
        decode_index=to(decode_index),
        decode_block_tables=_pad_tables(decode_tables).to(device),
        decode_ctx_lens=to(decode_lens),
        prefills=tuple(prefills),
        sample_index=to(sample_index),
    )


def _pad_tables(rows: list[torch.Tensor]) -> torch.Tensor:
    """Pads each row with its own first block, so padding never points at unwritten memory."""
    width = max((len(r) for r in rows), default=0)
    padded = torch.empty(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
        padded[i, len(row) :] = row[0]
    return padded
