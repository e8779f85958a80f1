"""Host syncs of a decode step, counted on the CPU.

On CUDA a host read of device memory stalls the CPU until the GPU drains, so it cannot queue the
next layer ahead; pulseinfer.common.syncs.count_host_syncs counts them there (the GPU check does,
and the `gpu` tests here). The other tests count what would be syncs on the CPU with
pulseinfer.bench.sync_proxy.DeviceTracker (its docstring says how, and what it misses), at the
package's sites (gpu_worker/'s are asserted on). A decode step may read the device once outside
sampling (docs/architecture.md), and once per selection: its recall lists are made on the host (see
RowSelector.select).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import torch

from pulseinfer.bench.sync_proxy import DeviceTracker
from pulseinfer.common.model.meta import GEOMETRIES, ModelLoadError
from pulseinfer.common.syncs import count_host_syncs, to_device, to_host
from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_check.fixtures import TOKENIZER_ENV, copy_tokenizer, materialized, tiny
from pulseinfer.gpu_worker.batch import build_batch
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.model.loader import load_model
from pulseinfer.gpu_worker.offload.config import OffloadConfig
from pulseinfer.gpu_worker.offload.selection import RowSelector
from pulseinfer.messages.plan import Chunk, SamplingSpec, StepPlan
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.scheduler.batcher import BatcherConfig


@pytest.fixture
def tracker():
    mode = DeviceTracker()
    with mode:
        yield mode


def _geometry(folder: Path, name: str, layers: int) -> Path:
    """A shipped geometry shrunk (the GPU check's tiny one, a small vocabulary) to `layers` layers,
    for --load-format dummy, with the GPU check's tokenizer or else the default model's."""
    config = tiny(json.loads((GEOMETRIES / name / "config.json").read_text())) | {"vocab_size": 512, "num_hidden_layers": layers}
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = os.environ.get(TOKENIZER_ENV)
    copy_tokenizer(Path(tokenizer) if tokenizer else None, folder)
    return folder


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Each geometry with 2 and with 4 layers (Gemma 3's: half of them sliding), each weight made once."""
    models = {}
    for name, geometry in GEOMETRY.items():
        for layers in (2, 4):
            try:
                path = _geometry(tmp_path_factory.mktemp(f"{geometry}-{layers}"), geometry, layers)
            except ModelLoadError as e:
                pytest.skip(f"no tokenizer for the dummy geometry: {e}")
            models[(name, layers)] = materialized(load_model(path, "dummy"))
    return models


GEOMETRY = {"qwen3": "qwen3-0.6b", "gemma3": "gemma-3-4b"}
CONFIGS = {
    "dense": ("qwen3", dict(mode="dense")),
    # the layer-ahead prediction selects too; rows whose recalls are in flight leave as cohorts
    "pulse": ("qwen3", dict(mode="pulse", layer_ahead="on", suspend="cursor")),
    "headwise": ("qwen3", dict(mode="headwise", layer_ahead="off")),
    "pulse-sliding": ("gemma3", dict(mode="pulse", layer_ahead="off")),
}
SAMPLER, SELECTION = "gpu_worker/sampler.py:sample_with_logprobs", "gpu_worker/offload/selection.py:select"
Counted = Callable[[], AbstractContextManager[Callable[[], Counter]]]  # counts a step's syncs: by (kind, site) once it ends


def _decode_steps(counted: Counted, loaded, device: str, mode: str, **offload) -> list[tuple[Counter, int]]:
    """Runs three requests to the end: per decode step, its syncs as `counted` counts them, and how
    many selections it made."""
    worker = WorkerConfig(
        mode=mode,
        device=device,
        block_size=8,
        device_kv_tokens=2048,
        offload=OffloadConfig(sink=8, recent=16, budget=16, scorer="quest", **offload),
    )
    batcher = BatcherConfig(offload="never" if mode == "dense" else "always")
    engine = Engine(EngineConfig(worker=worker, batcher=batcher, host_kv_tokens=4096), loaded=loaded)
    steps, select, execute = [], RowSelector.select, engine.runner.execute
    selections = Counter()

    def counted_select(self, *args):
        selections["now"] += 1
        return select(self, *args)

    def counted_execute(plan, pick=None):
        if not plan.chunks or any(len(c.token_ids) > 1 for c in plan.chunks):
            return execute(plan, pick)
        selections.clear()
        with counted() as syncs:
            outcome = execute(plan, pick)
        steps.append((syncs(), selections["now"]))
        return outcome

    engine.runner.execute, RowSelector.select = counted_execute, counted_select
    try:
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (60, 90, 75)]
        engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    finally:
        RowSelector.select = select
        engine.close()  # unpins its host pool on CUDA: the next engine's may map at the same address
    return steps


def _tracked(tracker: DeviceTracker) -> Counted:
    """The tracker's count of what gpu_worker/ does (kernels/ and kv_store/ run their CPU paths here)."""

    @contextmanager
    def counted():
        tracker.syncs.clear()
        tracker.counting = True
        try:
            yield lambda: Counter({key: n for key, n in tracker.syncs.items() if key[1].startswith("gpu_worker/")})
        finally:
            tracker.counting = False

    return counted


def _at(step: Counter, site: str) -> int:
    return sum(n for (_, at), n in step.items() if at == site)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_decode_step_syncs_a_number_of_times_independent_of_its_layers(tracker, tiny_models, name):
    """One transfer in the sampler, one per selection, and at most one elsewhere (docs/architecture.md
    section 6); what is not selection the same with 2 layers and with 4."""
    geometry, config = CONFIGS[name]
    runs = {layers: _decode_steps(_tracked(tracker), tiny_models[(geometry, layers)], "cpu", **config) for layers in (2, 4)}
    report = {
        layers: [({f"{kind} {site}": n for (kind, site), n in syncs.items()}, selected) for syncs, selected in steps]
        for layers, steps in runs.items()
    }
    for steps in runs.values():
        assert steps, "no decode step ran"
        for syncs, selected in steps:
            assert syncs[("to_host", SAMPLER)] == _at(syncs, SAMPLER) == 1, report
            assert syncs[("to_host", SELECTION)] == _at(syncs, SELECTION) == selected, report
            assert sum(syncs.values()) - _at(syncs, SAMPLER) - _at(syncs, SELECTION) <= 1, report
    outside_selection = {layers: [sum(syncs.values()) - _at(syncs, SELECTION) for syncs, _ in steps] for layers, steps in runs.items()}
    assert outside_selection[2] == outside_selection[4], report


@pytest.mark.gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_a_decode_step_on_cuda_syncs_as_few_times_as_counted_on_the_cpu(tiny_models, name):
    """What CUDA reports (count_host_syncs, the compute thread's): per decode step at most one sync
    besides the sampler's and the selections', with 2 layers and with 4."""

    @contextmanager
    def counted():
        with count_host_syncs() as syncs:
            yield lambda: Counter({("sync", "step"): syncs.count})

    geometry, config = CONFIGS[name]
    runs = {layers: _decode_steps(counted, tiny_models[(geometry, layers)], "cuda", **config) for layers in (2, 4)}
    for steps in runs.values():
        assert steps, "no decode step ran"
        assert all(syncs[("sync", "step")] <= 1 + selected + 1 for syncs, selected in steps), runs


def test_to_device_and_to_host_move_any_tensors_in_one_buffer():
    parts = [torch.arange(5), torch.tensor([True, False, True]), torch.randn(2, 3), torch.tensor(7), torch.empty(0, 4, dtype=torch.long)]
    parts += [torch.arange(6).view(2, 3).T, torch.tensor([1, 2], dtype=torch.int32)]
    for moved in (to_host(parts), to_device(parts, torch.device("cpu"))):
        assert [(t.dtype, t.shape) for t in moved] == [(t.dtype, t.shape) for t in parts]
        assert all(torch.equal(a, b) for a, b in zip(moved, parts))
        assert moved[0].untyped_storage().data_ptr() == moved[-1].untyped_storage().data_ptr()  # one buffer, one copy
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(moved, parts) if a.numel())  # new tensors
        assert all(t.data_ptr() % 16 == 0 for t in moved)  # each part 16-byte aligned: one Triton specialization
    assert to_host([]) == [] and to_device([], torch.device("cpu")) == []
    wide = torch.randn(3, dtype=torch.complex128)  # 16-byte elements
    assert torch.equal(to_host([torch.arange(3, dtype=torch.int8), wide])[1], wide)
    with pytest.raises(ValueError, match="cannot pack"):
        to_host([torch.zeros(2), torch.zeros(2, device="meta")])
    with count_host_syncs() as syncs:
        to_host(parts)
    assert syncs.count == 0  # host tensors: nothing to wait for (and without CUDA nothing is counted)


@pytest.mark.gpu
def test_count_host_syncs_counts_what_cuda_reports():
    """A pinned copy in syncs none, one transfer out of several tensors syncs once, a read once more;
    the debug mode is restored after."""
    values = torch.arange(10)
    with count_host_syncs() as syncs:
        on_device = to_device([values, values > 4], torch.device("cuda"))
        copied = syncs.count
        back = to_host(on_device)
        read = syncs.count
        int(on_device[0].sum())
    assert (copied, read, syncs.count) == (0, 1, 2)
    assert torch.equal(back[0], values) and torch.equal(back[1], values > 4)
    assert torch.cuda.get_sync_debug_mode() == 0


def test_a_cohort_is_cut_from_the_batch_without_reading_the_device(tracker):
    """ForwardBatch.subset (rows suspended at a layer, and the rows going on) from the host copies of its indices."""
    spec = SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=0, step=0)
    chunks = (
        Chunk("a", (5,), 20, tuple(range(0, 3)), spec),
        Chunk("p", tuple(range(10, 17)), 0, (3,), spec),
        Chunk("b", (6,), 9, (4, 5), spec),
        Chunk("c", (7,), 30, (6, 7, 8, 9), spec),
    )
    batch = build_batch(StepPlan(0, chunks), 8, torch.device("cpu"))
    tracker.syncs.clear()
    tracker.counting = True
    try:
        suspended, kept = batch.subset([2, 0], prefills=False)
        going_on, _ = batch.subset([1], prefills=True)
    finally:
        tracker.counting = False
    assert not tracker.syncs, tracker.syncs
    assert kept.tolist() == [0, 9] and suspended.decode_index.tolist() == [1, 0]  # its rows in the order given
    assert suspended.decode_seq_ids == ("c", "a") and suspended.decode_ctx_lens.tolist() == [31, 21]
    assert going_on.input_ids.tolist() == [*range(10, 17), 6] and going_on.decode_index.tolist() == [7]
