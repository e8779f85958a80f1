#!/usr/bin/env bash
# Validates and measures the CUDA path in one command, offline, on a machine whose Python already
# has a CUDA torch, Triton and numpy (README, "GPU"):
#   scripts/gpu_check.sh [--wheelhouse DIR] [--out FILE] [--cpu-dry-run]
# 1. installs the wheelhouse (`make gpu-wheels`) and this checkout, without network, into a
#    throw-away folder that shadows the machine's packages (PYTHONPATH) and is removed at exit;
# 2. runs `python -m pulseinfer.gpu_check` from there: versions, the gpu tests, CUDA decoding
#    against CPU decoding, a streamed request through `pulseinfer serve --device cuda`, and
#    `pulseinfer bench decode --device cuda`; one JSON with every result (--out).
# --cpu-dry-run runs the same steps on the CPU with tiny geometries and lists the CUDA-only ones
# as skipped (CI runs it); without a wheelhouse it installs over the running Python's packages.
# PYTHON picks the interpreter (default: python3).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=$(command -v "${PYTHON:-python3}") && [[ $python == */* ]] && python=$(realpath -s "$python")
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

install() {
    local wheels=("$wheelhouse"/*.whl)
    if [[ -e ${wheels[0]} ]]; then
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" || return
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
echo "{\"rc\": $install_rc, \"ms\": $install_ms, \"site\": \"$site\", \"wheelhouse\": \"$wheelhouse\"}" >"$work/install.json"
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
    --install-report "$work/install.json" --install-log "$install_log" "${tokenizer[@]}" "${dry_run[@]}"
