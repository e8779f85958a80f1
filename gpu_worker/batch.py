"""Tensors for one forward pass, built from a step plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from pulseinfer.common.syncs import to_device
from pulseinfer.messages.plan import StepPlan


@dataclass(frozen=True)
class PrefillSpan:
    seq_id: str
    start: int  # index of the chunk's first token in the flat batch
    end: int
    ctx_blocks: torch.Tensor | None  # blocks holding context positions 0 .. ctx_len-1; None when offloaded
    ctx_len: int


class HostIndex(NamedTuple):
    """A batch's flat token indices on the host as well: cohorts are cut from them (and the host
    reads them) without reading the device, where a read waits for the GPU to drain."""

    resident_index: torch.Tensor
    decode_index: torch.Tensor
    sample_index: torch.Tensor


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    resident_index: torch.Tensor  # [R] flat index of the tokens of resident chunks
    write_slots: torch.Tensor  # [R] where each of those tokens' k/v goes
    decode_index: torch.Tensor  # [b] flat index of the single token of each decode chunk
    decode_seq_ids: tuple[str, ...]  # [b]
    decode_rows: tuple[list[int], ...]  # [b] block table rows (offloaded rows: placeholders filled per layer)
    decode_block_tables: torch.Tensor  # [b, max_blocks], decode_rows padded
    decode_ctx_lens: torch.Tensor  # [b]
    prefills: tuple[PrefillSpan, ...]
    sample_index: torch.Tensor  # [S] flat index of the tokens whose logits are sampled
    chunk_starts: dict[str, int]  # seq_id -> flat index of its chunk's first token
    host: HostIndex  # resident_index, decode_index and sample_index on the host

    def subset(self, decode_rows: list[int], prefills: bool) -> tuple[ForwardBatch, torch.Tensor]:
        """These decode rows (in the order given), with every prefill chunk too or without them, as a batch
        of their own; and the flat index here of each of its tokens. Rows suspended at a layer go on
        as such a batch, and so do the others. Its indices are made on the host and moved in one copy."""
        host, total = self.host, len(self.input_ids)
        rows = torch.tensor(decode_rows, dtype=torch.long)
        keep = torch.zeros(total, dtype=torch.bool)
        if prefills:
            for span in self.prefills:
                keep[span.start : span.end] = True
        keep[host.decode_index[rows]] = True
        tokens = keep.nonzero().squeeze(1)
        new = torch.full((total,), -1, dtype=torch.long)
        new[tokens] = torch.arange(len(tokens))
        kept_resident = keep[host.resident_index]
        index = HostIndex(
            resident_index=new[host.resident_index[kept_resident]],
            decode_index=new[host.decode_index[rows]],
            sample_index=new[host.sample_index[keep[host.sample_index]]],
        )
        written = kept_resident.nonzero().squeeze(1)
        on_device = to_device([tokens, written, rows, *index], self.input_ids.device)
        tokens_at, written_at, rows_at, resident_index, decode_index, sample_index = on_device
        batch = ForwardBatch(
            input_ids=self.input_ids[tokens_at],
            positions=self.positions[tokens_at],
            resident_index=resident_index,
            write_slots=self.write_slots[written_at],
            decode_index=decode_index,
            decode_seq_ids=tuple(self.decode_seq_ids[r] for r in decode_rows),
            decode_rows=tuple(self.decode_rows[r] for r in decode_rows),
            decode_block_tables=self.decode_block_tables[rows_at],
            decode_ctx_lens=self.decode_ctx_lens[rows_at],
            prefills=tuple(replace(span, start=int(new[span.start]), end=int(new[span.end - 1]) + 1) for span in self.prefills)
            if prefills
            else (),
            sample_index=sample_index,
            chunk_starts={seq_id: int(new[start]) for seq_id, start in self.chunk_starts.items() if keep[start]},
            host=index,
        )
        return batch, tokens_at


class DecodePhase(NamedTuple):
    """Decode rows that attend together at a layer, over their block tables."""

    rows: torch.Tensor | None  # None: every decode row of the batch
    tables: torch.Tensor  # [rows, max_blocks], or [rows, kv_heads, max_blocks] in headwise mode
    lens: torch.Tensor
    # layer cursors: these rows (`rows`, on the host) leave the batch here and attend when they resume
    suspended_rows: tuple[int, ...] = ()


def token_slots(block_table: tuple[int, ...], start: int, end: int, block_size: int) -> torch.Tensor:
    """Slot of each position start..end-1 of a sequence."""
    if end > len(block_table) * block_size:
        raise ValueError(f"block table of {len(block_table)} blocks cannot hold position {end - 1}")
    positions = torch.arange(start, end)
    return torch.tensor(block_table, dtype=torch.long)[positions // block_size] * block_size + positions % block_size


def build_batch(plan: StepPlan, block_size: int, device: torch.device) -> ForwardBatch:
    """The plan's tensors, made on the host and moved to the device in one copy."""
    input_ids, positions, resident_index, write_slots, sample_index = [], [], [], [], []
    decode_index, decode_ids, decode_rows, decode_lens, prefills, starts = [], [], [], [], [], {}
    offset = 0
    for chunk in plan.chunks:
        n = len(chunk.token_ids)
        starts[chunk.seq_id] = offset
        input_ids.extend(chunk.token_ids)
        positions.append(torch.arange(chunk.start_pos, chunk.end_pos))
        # an offloaded chunk's table is its device footprint, not position-indexed: the offload step places its tokens
        blocks = list(chunk.block_table[: 1 if chunk.offloaded else -(-chunk.end_pos // block_size)])
        if not chunk.offloaded:
            resident_index.append(torch.arange(offset, offset + n))
            write_slots.append(token_slots(chunk.block_table, chunk.start_pos, chunk.end_pos, block_size))
        if n == 1:
            decode_index.append(offset)
            decode_ids.append(chunk.seq_id)
            decode_rows.append(blocks)
            decode_lens.append(chunk.end_pos)
        else:
            ctx_blocks = None if chunk.offloaded else torch.tensor(blocks, dtype=torch.long)
            prefills.append(PrefillSpan(chunk.seq_id, offset, offset + n, ctx_blocks, chunk.end_pos))
        offset += n
        if chunk.sampling is not None:
            sample_index.append(offset - 1)

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    host = HostIndex(cat(resident_index), longs(decode_index), longs(sample_index))
    contexts = [span.ctx_blocks for span in prefills if span.ctx_blocks is not None]
    tensors = [longs(input_ids), cat(positions), cat(write_slots), pad_tables(decode_rows), longs(decode_lens), *host, *contexts]
    input_ids, positions, write_slots, tables, lens, resident, decode, sample, *contexts = to_device(tensors, device)
    on_device = iter(contexts)
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        resident_index=resident,
        write_slots=write_slots,
        decode_index=decode,
        decode_seq_ids=tuple(decode_ids),
        decode_rows=tuple(decode_rows),
        decode_block_tables=tables,
        decode_ctx_lens=lens,
        prefills=tuple(span if span.ctx_blocks is None else replace(span, ctx_blocks=next(on_device)) for span in prefills),
        sample_index=sample,
        chunk_starts=starts,
        host=host,
    )


def pad_tables(rows: Sequence[list[int] | list[list[int]]]) -> torch.Tensor:
    """Pads each row with its own first block, so padding never points at unwritten memory. Rows
    are lists of blocks, or one list per kv head where each kv head attends its own blocks: then
    every row becomes per-head ([b, kv_heads, width]), shared rows repeated for each head."""
    if not rows:
        return torch.empty((0, 0), dtype=torch.long)
    per_head = next((row for row in rows if isinstance(row[0], list)), None)
    nested = [row if isinstance(row[0], list) else [row] * (len(per_head) if per_head else 1) for row in rows]
    width = max(len(row[0]) for row in nested)
    table = torch.tensor([[group + group[:1] * (width - len(group)) for group in row] for row in nested], dtype=torch.long)
    return table if per_head else table[:, 0]
