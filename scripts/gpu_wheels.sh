#!/usr/bin/env bash
# Builds the wheelhouse that scripts/gpu_check.sh installs offline on a CUDA machine: every wheel
# the project needs beyond torch, triton and numpy (which such a machine's Python already has),
# resolved for CPython 3.12 on manylinux x86_64, plus pytest (the gpu tests) and setuptools (to
# build the project there without network), and the default model's tokenizer (tokenizer/, 2 MB):
# dummy-weight geometries borrow it where the model file (98 MB) does not travel.
#   scripts/gpu_wheels.sh [DIR]      (make gpu-wheels; needs PyPI)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-wheelhouse}
python=${PYTHON:-.venv/bin/python}
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
# the project's runtime requirements, less what the machine brings
mapfile -t requirements < <("$python" - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
brought = {"torch", "triton", "numpy"}
print("\n".join(d for d in deps if re.match(r"[A-Za-z0-9_.-]+", d)[0].lower() not in brought))
PY
)
rm -rf "$out" && mkdir -p "$out"
"$python" -m pip download -q -d "$out" "${target[@]}" "${requirements[@]}" "pytest>=8" "setuptools>=68"
# numpy comes in as a dependency (gguf's); the machine's own is used
rm -f "$out"/numpy-*.whl
"$python" -c 'import sys; from pathlib import Path; from pulseinfer.common.model.meta import load_model_meta
path = Path(sys.argv[1]); path.mkdir(); load_model_meta().tokenizer.save_hf_dir(path)' "$out/tokenizer"
ls "$out" | grep '\.whl$' | sed -E 's/-([^-]+)-[^-]+-[^-]+-[^-]+\.whl$/==\1/' > "$out/MANIFEST"
echo "wheelhouse $out: $(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1)"
