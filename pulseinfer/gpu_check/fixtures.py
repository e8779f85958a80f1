"""Model folders of the shipped geometries for --load-format dummy (cut to a few layers, or shrunk
to tiny ones for the dry run), with a tokenizer, and prompts for them: the check's steps use
them, and so do the gpu tests and the step-cost benchmark."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

from pulseinfer.gpu_check.config import CheckConfig

# the folder of tokenizer.json the gpu tests give dummy geometries (tests/test_offload.py), where the
# default model's file may not travel
TOKENIZER_ENV = "PULSEINFER_CHECK_TOKENIZER"


def tiny(config: dict) -> dict:
    """A geometry shrunk to a few thousand parameters per layer, its family and layer kinds kept."""
    small = dict(config, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    small["num_hidden_layers"] = 2
    if "sliding_window" in config:  # one sliding layer, then one global
        small.update(sliding_window=32, sliding_window_pattern=2, query_pre_attn_scalar=16)
    return small


def geometry_dir(geometry: str, folder: Path, tokenizer: Path | None, layers: int = 0, shrink: bool = False) -> Path:
    """A folder in `folder` with a shipped geometry's config.json (its first `layers` layers, all if
    0; tiny() if `shrink`) and a tokenizer (the files of `tokenizer`, else the default model's, which
    raises ModelLoadError where its file is not installed), for --load-format dummy."""
    from pulseinfer.common.model.meta import GEOMETRIES

    config = json.loads((GEOMETRIES / geometry / "config.json").read_text())
    if shrink:
        config = tiny(config)
    elif layers:
        config["num_hidden_layers"] = layers
    path = folder / (f"{geometry}-{config['num_hidden_layers']}l" + ("-tiny" if shrink else ""))
    if not path.is_dir():
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(config, indent=1))
        copy_tokenizer(tokenizer, path)
    return path


def model_dir(check: CheckConfig, geometry: str, layers: int) -> Path:
    return geometry_dir(geometry, check.work / "models", check.tokenizer, layers, shrink=check.cpu_dry_run)


def copy_tokenizer(tokenizer: Path | None, path: Path) -> None:
    if tokenizer is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer / name).is_file():
                shutil.copy(tokenizer / name, path / name)
        return
    from pulseinfer.common.model.meta import load_model_meta

    load_model_meta().tokenizer.save_hf_dir(path)  # the default model's, where its file is installed


def materialized(loaded):
    """The model with each weight made once and held: every engine built from it shares them, where
    a dummy weight is otherwise made anew (on one CPU core) for each engine that reads it."""
    return dataclasses.replace(loaded, weights=dict(loaded.weights))


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Token ids of ordinary text pieces of the borrowed tokenizer (no special tokens), fixed by the seed."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]
