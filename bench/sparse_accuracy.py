"""Accuracy of sparse decoding against budget: passkey retrieval and perplexity for `pulse`
(SoloHead) and `headwise` at each budget, next to `dense`, in one run on one loaded model;
with the share of dense attention mass the selections keep and the recall transfers per step.

    python -m pulseinfer.bench.sparse_accuracy [--budgets 256,512,1024,2048] [--modes pulse,headwise]
        [--lengths 1000,2000,4000,6500] [--trials 1] [--ppl-windows 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from pulseinfer.engine import EngineConfig
from pulseinfer.evals import PasskeyConfig, PerplexityConfig, evaluate
from pulseinfer.gpu_worker.model.loader import load_model
from pulseinfer.gpu_worker.offload import OffloadConfig
from pulseinfer.gpu_worker.runner import WorkerConfig


def _row(mode: str, budget: int | None, passkey: dict, ppl: dict, dense_ppl: float | None) -> dict:
    selection = passkey["selection"]
    return {
        "mode": mode,
        "budget": budget,
        "passkey_accuracy": passkey["accuracy"],
        "passkey_by_length": passkey["accuracy_by_length"],
        "perplexity": ppl["perplexity"],
        "perplexity_over_dense": ppl["perplexity"] / dense_ppl if dense_ppl else 1.0,
        "attention_mass_passkey": selection["attention_mass"],
        "attention_mass_ppl": ppl["selection"]["attention_mass"],
        "recall_transfers_per_step": ppl["selection"]["recall_transfers_per_step"],
        "recall_bytes_per_step": ppl["selection"]["recall_bytes_per_step"],
        "seconds": passkey["seconds"] + ppl["seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="256,512,1024,2048")
    parser.add_argument("--modes", default="pulse,headwise")
    parser.add_argument("--lengths", default=PasskeyConfig.lengths)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--ppl-context", type=int, default=4096)
    parser.add_argument("--ppl-windows", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    loaded = load_model()
    passkey = PasskeyConfig(lengths=args.lengths, trials=args.trials)
    ppl = PerplexityConfig(context=args.ppl_context, windows=args.ppl_windows)

    def run(mode: str, budget: int | None) -> dict:
        offload = OffloadConfig(budget=budget) if budget else OffloadConfig()
        config = EngineConfig(worker=WorkerConfig(mode=mode, device_kv_tokens=131072, offload=offload))
        return _row(mode, budget, evaluate("passkey", config, passkey, loaded), evaluate("ppl", config, ppl, loaded), dense_ppl)

    dense_ppl = None
    rows = [run("dense", None)]
    dense_ppl = rows[0]["perplexity"]
    print(json.dumps(rows[-1]), flush=True)
    for mode in args.modes.split(","):
        for budget in (int(b) for b in args.budgets.split(",")):
            rows.append(run(mode, budget))
            print(json.dumps(rows[-1]), flush=True)
    settings = {
        "passkey": dataclasses.asdict(passkey),
        "ppl": {**dataclasses.asdict(ppl), "file": "pydoc_data.topics"},
        "sink": 64,
        "recent": 256,
    }
    print(f"{'mode':9} {'budget':>6} {'passkey':>7} {'ppl':>7} {'ppl/dense':>9} {'mass':>6} {'transfers/step':>14} {'MB/step':>8}")
    for r in rows:
        print(
            f"{r['mode']:9} {r['budget'] or '-':>6} {r['passkey_accuracy']:7.3f} {r['perplexity']:7.3f} {r['perplexity_over_dense']:9.4f} "
            f"{r['attention_mass_ppl']:6.3f} {r['recall_transfers_per_step']:14.0f} {r['recall_bytes_per_step'] / 1e6:8.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
