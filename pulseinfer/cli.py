"""`pulseinfer` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from pulseinfer.common.flags import add_flags, from_flags


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt with the in-process engine")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", type=Path, help="file holding the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=[], help="stop token id (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    from pulseinfer.engine import EngineConfig
    from pulseinfer.messages.sampling import SamplingParams

    add_flags(p, SamplingParams, skip=("stop", "stop_token_ids"))
    add_flags(p, EngineConfig)
    p.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from pulseinfer.common.model.meta import load_model_config
    from pulseinfer.engine import Engine, EngineConfig
    from pulseinfer.messages.sampling import SamplingParams

    text = args.prompt if args.prompt is not None else _read_prompt(args.prompt_file)
    params = dataclasses.replace(from_flags(SamplingParams, args), stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_ids))
    config = from_flags(EngineConfig, args)
    params.validate(load_model_config(config.model, config.load_format).vocab_size)  # a bad flag fails before the model loads
    engine = Engine(config)
    tok = engine.tokenizer
    prompt_ids = tok.encode_chat([{"role": "user", "content": text}]) if args.chat else tok.encode(text)
    (completion,) = engine.generate([prompt_ids], params)
    if args.json:
        print(json.dumps(completion.to_json()))
    else:
        print(completion.text)
    return 0


def _read_prompt(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read prompt file {path}: {e.strerror}") from e


def _serve_parser(sub) -> None:
    from pulseinfer.gateway.server import GatewayConfig
    from pulseinfer.launcher import NodeConfig, ServeConfig

    commands = (
        ("serve", ServeConfig, _serve, "run the cluster: gateway, scheduler, workers and kv_store as separate processes"),
        ("node", NodeConfig, _node, "run one node of several: kv_store, scheduler and workers, for gateways elsewhere (--listen)"),
        ("gateway", GatewayConfig, _gateway, "run a gateway routing to nodes (--nodes HOST:PORT,... or dns:NAME:PORT)"),
    )
    for name, config, handler, help_text in commands:
        p = sub.add_parser(name, help=help_text)
        add_flags(p, config)
        p.set_defaults(handler=handler, config=config)


def _serve(args: argparse.Namespace) -> int:
    from pulseinfer.launcher import serve

    return serve(from_flags(args.config, args))


def _node(args: argparse.Namespace) -> int:
    from pulseinfer.launcher import node

    return node(from_flags(args.config, args))


def _gateway(args: argparse.Namespace) -> int:
    import uvloop

    from pulseinfer.common.proc import setup_logging
    from pulseinfer.gateway.server import serve

    config = from_flags(args.config, args)
    setup_logging("gateway")
    try:
        uvloop.run(serve(config))
    except KeyboardInterrupt:
        pass
    return 0


def _eval_parser(sub) -> None:
    from pulseinfer.engine import EngineConfig
    from pulseinfer.evals import ChoiceConfig, PasskeyConfig, PerplexityConfig

    p = sub.add_parser("eval", help="accuracy of a decoding mode on the real model")
    tasks = p.add_subparsers(dest="task", required=True)
    for task, config, help_text in (
        ("passkey", PasskeyConfig, "retrieval of a 5-digit key hidden in plain-text filler"),
        ("ppl", PerplexityConfig, "perplexity of the last tokens of each window, each predicted by a decode step"),
        ("choice", ChoiceConfig, "multiple-choice loglikelihood accuracy, scored as lm-evaluation-harness scores it"),
    ):
        t = tasks.add_parser(task, help=help_text)
        add_flags(t, config)
        add_flags(t, EngineConfig)
        t.add_argument("--json", action="store_true", help="print the whole result as one JSON line (with every case)")
        t.set_defaults(handler=_eval, task_config=config)


def _eval(args: argparse.Namespace) -> int:
    from pulseinfer.engine import EngineConfig
    from pulseinfer.evals import evaluate

    result = evaluate(args.task, from_flags(EngineConfig, args), from_flags(args.task_config, args))
    if args.json:
        print(json.dumps(result))
    else:  # the same object, readable, without the per-case list
        print(json.dumps({k: v for k, v in result.items() if k != "cases"}, indent=1))
    return 0


def _plan_parser(sub) -> None:
    from pulseinfer.gpu_worker.config import WorkerConfig
    from pulseinfer.gpu_worker.memory_plan import PlanConfig

    p = sub.add_parser(
        "plan",
        help="a CUDA worker's device memory, term by term, for a batch of long rows (no weights read); exit 1 if it does not fit",
    )
    add_flags(p, PlanConfig)
    add_flags(p, WorkerConfig, skip=("device", "device_kv_tokens"))  # the pool's flag is PlanConfig's (0: what the batch needs)
    p.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace) -> int:
    from pulseinfer.common.model.meta import load_model_config
    from pulseinfer.gpu_worker.config import WorkerConfig
    from pulseinfer.gpu_worker.memory_plan import PlanConfig, Workload, parse_bytes, plan_memory

    config = from_flags(PlanConfig, args)
    worker = dataclasses.replace(from_flags(WorkerConfig, args), device="cuda")  # --dtype auto: bfloat16, as on a GPU
    if not worker.device_memory:
        raise ValueError("plan needs --device-memory, e.g. 80GB")
    model = load_model_config(config.model, config.load_format)
    workload = Workload(config.batch, config.context, config.prefill_chunk)
    plan = plan_memory(model, worker, workload, parse_bytes(worker.device_memory), worker.mode != "dense")
    print(plan.table())
    return 0 if plan.fits else 1


def _bench_parser(sub) -> None:
    from pulseinfer.bench import (
        control_plane,
        dense_decode,
        grammar_stall,
        host_pool,
        kernels_compile,
        layer_ahead,
        multinode,
        prefix_tiers,
        recall_gather,
        selection_scorers,
        serving_overhead,
        step_cost,
        structured_masks,
    )
    from pulseinfer.bench import serve as serve_bench
    from pulseinfer.bench.decode import DecodeBenchConfig
    from pulseinfer.bench.soak import SoakConfig

    p = sub.add_parser("bench", help="benchmarks on the real model")
    kinds = p.add_subparsers(dest="kind", required=True)
    decode = kinds.add_parser("decode", help="the same long requests decoded by each mode at the same device memory")
    add_flags(decode, DecodeBenchConfig)
    decode.add_argument("--json", type=Path, help="write the results here")
    decode.add_argument("--plot", type=Path, help="write a PNG of throughput, TPOT and recall bytes per layer here")
    decode.set_defaults(handler=_bench_decode)
    serve = kinds.add_parser(
        "serve",
        help="a load generator over the HTTP API of a running `pulseinfer serve`: random prompts, or a Mooncake trace (--trace)",
        description=serve_bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(serve, serve_bench.ServeBenchConfig)
    serve.add_argument("--json", type=Path, help="write the results here")
    serve.set_defaults(handler=_bench_serve)
    soak = kinds.add_parser("soak", help="a long mix of normal, hostile and abandoned requests; the server must stay right and end idle")
    add_flags(soak, SoakConfig)
    soak.add_argument("--json", type=Path, help="write the report here")
    soak.set_defaults(handler=_bench_soak)
    compile_gate = kinds.add_parser(
        "kernels-compile",
        help="the compile gate: every Triton kernel compiled for sm_90/sm_80 at every shipped geometry (registers, spills, shared memory)",
        description=kernels_compile.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(compile_gate, kernels_compile.KernelsCompileConfig)
    compile_gate.add_argument("--json", type=Path, help="write the report here")
    compile_gate.add_argument("--markdown", type=Path, help="write the table here")
    compile_gate.set_defaults(handler=_bench_kernels_compile)
    control = kinds.add_parser(
        "control-plane",
        help="the control plane alone: the real cluster with workers whose forward is a fixed simulated time (starts its own servers)",
        description=control_plane.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(control, control_plane.ControlPlaneBenchConfig)
    control.add_argument("--json", type=Path, default=control_plane.DEFAULT_JSON, help="write the results here (default: %(default)s)")
    control.add_argument("--markdown", type=Path, help="write the table here")
    control.set_defaults(handler=_bench_control_plane)
    for name, module, config, help_text in (  # the studies behind docs/benchmarks.md and docs/accuracy.md
        ("dense-decode", dense_decode, dense_decode.DenseDecodeBenchConfig, "dense decode tok/s of the engine against HF transformers"),
        (
            "serving-overhead",
            serving_overhead,
            serving_overhead.ServingOverheadBenchConfig,
            "what the process split costs: scheduler<->worker round trip, HTTP path vs the in-process engine (starts its own server)",
        ),
        ("host-pool", host_pool, host_pool.HostPoolBenchConfig, "host KV pool write-back and read-back bandwidth vs a contiguous copy"),
        (
            "recall-gather",
            recall_gather,
            recall_gather.RecallGatherBenchConfig,
            "fragmented SoloHead recalls vs a contiguous copy of the same bytes vs head-wise recalls",
        ),
        (
            "layer-ahead",
            layer_ahead,
            layer_ahead.LayerAheadBenchConfig,
            "the compute's wait on recalls: synchronous, suspension, layer cursors, layer-ahead, a recall deadline",
        ),
        (
            "prefix-tiers",
            prefix_tiers,
            prefix_tiers.PrefixTiersBenchConfig,
            "a trace replay with the host tier as the prefix cache's second level and without, per mode (starts its servers)",
        ),
        (
            "multinode",
            multinode,
            multinode.MultinodeBenchConfig,
            "a trace replay on one node, then two emulated nodes routed cache_aware and round_robin (root; starts its servers)",
        ),
        (
            "structured-masks",
            structured_masks,
            structured_masks.StructuredMasksBenchConfig,
            "structured outputs' grammar masks: the sampler of a batch under JSON schemas against it unconstrained",
        ),
        (
            "grammar-stall",
            grammar_stall,
            grammar_stall.GrammarStallBenchConfig,
            "a stream's largest gap between tokens while a 500 KB JSON schema is checked and compiled, against alone (starts its server)",
        ),
        (
            "step-cost",
            step_cost,
            step_cost.StepCostBenchConfig,
            "how GPU-shaped a decode step is, on the CPU: ops, host syncs and bytes per step of each mode against the bandwidth floor",
        ),
        (
            "selection-scorers",
            selection_scorers,
            selection_scorers.ScorerStudyConfig,
            "block scorers (low-rank, Quest, variants, an oracle) on teacher-forced perplexity",
        ),
    ):
        study = kinds.add_parser(name, help=help_text, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        add_flags(study, config)
        study.add_argument("--json", type=Path, help="write the results here")
        study.set_defaults(handler=_bench_study, study_config=config, study_main=module.main)


def _bench_decode(args: argparse.Namespace) -> int:
    from pulseinfer.bench.decode import DecodeBenchConfig, main

    return main(from_flags(DecodeBenchConfig, args), args.json, args.plot)


def _bench_serve(args: argparse.Namespace) -> int:
    from pulseinfer.bench.serve import ServeBenchConfig, main

    return main(from_flags(ServeBenchConfig, args), args.json)


def _bench_soak(args: argparse.Namespace) -> int:
    from pulseinfer.bench.soak import SoakConfig, main

    return main(from_flags(SoakConfig, args), args.json)


def _bench_kernels_compile(args: argparse.Namespace) -> int:
    from pulseinfer.bench.kernels_compile import KernelsCompileConfig, main

    return main(from_flags(KernelsCompileConfig, args), args.json, args.markdown)


def _bench_control_plane(args: argparse.Namespace) -> int:
    from pulseinfer.bench.control_plane import ControlPlaneBenchConfig, main

    return main(from_flags(ControlPlaneBenchConfig, args), args.json, args.markdown)


def _bench_study(args: argparse.Namespace) -> int:
    return args.study_main(from_flags(args.study_config, args), args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pulseinfer", description="PulseInfer: sparse KV-cache offloading for long-context decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _eval_parser(sub)
    _plan_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, RuntimeError) as e:  # load errors, bad parameters, requests that cannot fit
        print(f"pulseinfer: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
