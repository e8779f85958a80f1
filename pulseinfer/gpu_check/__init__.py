"""The GPU validation that scripts/gpu_check.sh runs once it has installed the project offline:
each step below on the CUDA device (or, with --cpu-dry-run, the same steps on the CPU with tiny
geometries, the CUDA-only parts listed as skipped), one JSON with every result, and the failed
steps named on stderr and in the exit code.

    python -m pulseinfer.gpu_check --repo DIR --work DIR --out FILE [--cpu-dry-run] [--tokenizer DIR]

Steps: install (what the shell did, and that its copy is the one imported); environment
(versions); gpu_tests (the kernel tests, which run their kernels on CUDA when there is one, and
every `gpu`-marked test); decode_matches_cpu (greedy tokens of dense, pulse at a covering
budget and at a sparse one, on CUDA in float32 against the CPU, on dummy weights of a Qwen3 and
of a hybrid sliding-window Gemma 3 geometry); decode_syncs (host syncs per decode step, dense
and pulse with offloaded requests, counted under torch.cuda.set_sync_debug_mode: at most
MAX_DECODE_STEP_SYNCS in each mode, nothing subtracted); serve_stream
(`pulseinfer serve --device cuda` with a device pool small enough to offload the request, one
streamed completion, recalls through the kv_store's CUDA IPC path counted on /metrics);
bench_decode (`pulseinfer bench decode` dense/headwise/pulse on dummy weights of the Qwen3-8B
geometry cut to 6 layers, under memory pressure, and on the default model when its file is
present).

Each step runs in a process of its own, under a time limit: a CUDA error (which poisons its
process's context), a crash or a hang fails that step alone, and the steps after it still run.
A step is given at least its budget while the deadline allows, and the time earlier steps left
unused; the JSON is rewritten after every step, so a check killed from outside still names
what it ran.
"""
