#!/usr/bin/env bash
# Validates and measures the CUDA path in one command, offline, on a machine whose Python already
# has a CUDA torch, Triton and numpy (README, "GPU"):
#   scripts/gpu_check.sh [--wheelhouse DIR] [--out FILE] [--cpu-dry-run]
# 1. installs the wheelhouse's pins for this Python (`make gpu-wheels`) and this checkout, without
#    network, into a throw-away folder that shadows the machine's packages (PYTHONPATH) and is
#    removed at exit;
# 2. runs `python -m pulseinfer.gpu_check` from there, each step in a process of its own: versions,
#    the gpu tests, CUDA decoding against CPU decoding, host syncs per decode step, a streamed
#    request through `pulseinfer serve --device cuda`, and `pulseinfer bench decode`'s modes on
#    CUDA; one JSON with every result (--out).
# --cpu-dry-run runs the same steps on the CPU with tiny geometries and lists the CUDA-only ones
# as skipped (CI runs it); without a wheelhouse it installs over the running Python's packages.
# PYTHON picks the interpreter (default: python3).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=$(command -v "${PYTHON:-python3}") || { echo "no interpreter ${PYTHON:-python3}: set PYTHON=/path/to/python3" >&2; exit 2; }
[[ $python == */* ]] && python=$(realpath -s "$python")
wheelhouse=$repo/wheelhouse
out=$repo/gpu_check.json
dry_run=()
while (($#)); do
    case $1 in
        --wheelhouse) wheelhouse=$(realpath -m "$2"); shift 2 ;;
        --out) out=$(realpath -m "$2"); shift 2 ;;
        --cpu-dry-run) dry_run=(--cpu-dry-run); shift ;;
        *) echo "usage: $0 [--wheelhouse DIR] [--out FILE] [--cpu-dry-run]" >&2; exit 2 ;;
    esac
done
work=$(mktemp -d "${TMPDIR:-/tmp}/pulseinfer-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
site=$work/site
install_log=$work/install.log
requirements=""  # set by install: the wheelhouse's pins it installed

# The wheelhouse's pins for this interpreter (requirements-cpXY.txt), or, on stderr, why there are none
requirements() {
    local version built
    version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2] if sys.implementation.name == "cpython" else "")') || return
    if [[ -n $version && -f $wheelhouse/requirements-cp${version/./}.txt ]]; then
        echo "$wheelhouse/requirements-cp${version/./}.txt"
        return
    fi
    built=("$wheelhouse"/requirements-*.txt)
    if [[ -e ${built[0]} ]]; then built=("${built[@]##*/requirements-}"); else built=("no requirements-cpXY.txt (an older make gpu-wheels)"); fi
    if [[ -z $version ]]; then
        echo "$python is not CPython: the wheelhouse has wheels for ${built[*]%.txt}; pick one of those with PYTHON=" >&2
        return 1
    fi
    echo "the wheelhouse $wheelhouse has no wheels for $python (CPython $version); it has: ${built[*]%.txt}" >&2
    echo "on a machine with PyPI run 'make gpu-wheels GPU_PYTHONS=$version' and bring wheelhouse/ along, or pick a listed CPython with PYTHON=" >&2
    return 1
}

install() {
    local wheels=("$wheelhouse"/*.whl)
    if [[ -e ${wheels[0]} ]]; then
        # named before anything is installed: pip would stop at the first wheel "not supported" here
        requirements=$(requirements) || return
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links "$wheelhouse" --target "$site" \
            -r "$requirements" || return
    elif ((${#dry_run[@]} == 0)); then
        echo "no wheels in $wheelhouse: run 'make gpu-wheels' on a machine with PyPI and bring wheelhouse/ along" >&2
        return 1
    fi
    # built from a copy: pip builds in the source tree, and the checkout keeps no build/ of it
    mkdir "$work/src" && tar -C "$repo" --exclude=./.venv --exclude=./.git --exclude=./wheelhouse --exclude=./build -cf - . |
        tar -C "$work/src" -xf - || return
    # --no-build-isolation: setuptools comes from the wheelhouse (or the machine), not from PyPI
    # --upgrade: its console script joins the wheels' bin/ (pip leaves an existing folder of --target alone otherwise)
    PYTHONPATH=$site "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --upgrade \
        --target "$site" "$work/src"
}

started_ms=$(($(date +%s%N) / 1000000))
install >"$install_log" 2>&1
install_rc=$?
install_ms=$(($(date +%s%N) / 1000000 - started_ms))
printf '{"rc": %d, "ms": %d, "python": "%s", "site": "%s", "wheelhouse": "%s", "requirements": "%s"}\n' \
    "$install_rc" "$install_ms" "$python" "$site" "$wheelhouse" "$requirements" >"$work/install.json"
if ((install_rc != 0)); then
    echo "step install FAILED (the other steps need it); its log:" >&2
    tail -20 "$install_log" >&2
    "$python" -c 'import json, sys; json.dump({"failed": ["install"], "steps": [{"name": "install", "status": "failed",
        "error": open(sys.argv[2]).read()[-4000:]}]}, open(sys.argv[1], "w"), indent=1)' "$out" "$install_log"
    exit 1
fi
tokenizer=()
[[ -d $wheelhouse/tokenizer ]] && tokenizer=(--tokenizer "$wheelhouse/tokenizer")
# the installed copy comes first, the machine's packages after it; run from the work folder, where no
# folder of the checkout can shadow the installed package
cd "$work" || exit 1
PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} "$python" -m pulseinfer.gpu_check --repo "$repo" --work "$work" --out "$out" \
    --install-report "$work/install.json" "${tokenizer[@]}" "${dry_run[@]}"
