#!/usr/bin/env bash
# Builds the wheelhouse that scripts/gpu_check.sh installs offline on a CUDA machine: every wheel
# the project needs beyond torch, triton and numpy (which such a machine's Python already has),
# resolved for each CPython VERSION on manylinux x86_64 (default: 3.12, the lent GPU machine's), plus
# pytest (the gpu tests) and setuptools (to build the project there without network), and the default
# model's tokenizer (tokenizer/, 2 MB): dummy-weight geometries borrow it where the model file (98 MB)
# does not travel. DIR/requirements-cpXY.txt pins what CPython X.Y installs; the wheels lie flat in
# DIR, each once. One Python's wheels and the checkout fit that machine's upload limit of 64 MiB.
#   scripts/gpu_wheels.sh [DIR [VERSION...]]    (make gpu-wheels [GPU_PYTHONS="3.11 3.13"]; needs PyPI)
#   scripts/gpu_wheels.sh --print-targets       (each VERSION it supports and its pip flags; no download)
set -euo pipefail
cd "$(dirname "$0")/.."
# Ubuntu 22.04 and older NGC images have 3.10, the Dockerfile 3.11, newer images 3.12 and 3.13
supported_versions=(3.10 3.11 3.12 3.13)
default_versions=(3.12)
python=${PYTHON:-.venv/bin/python}

# pip download's flags for CPython $1 on manylinux x86_64, one a line; glibc 2.31 (Ubuntu 20.04) and
# newer: llguidance's wheels since 1.7 are manylinux_2_31 only
target() {
    printf '%s\n' --only-binary=:all: --python-version "$1" --implementation cp --abi "cp${1/./}" --abi abi3 --abi none \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any
}

if [[ ${1:-} == --print-targets ]]; then
    for version in "${supported_versions[@]}"; do
        mapfile -t flags < <(target "$version")
        echo "$version ${flags[*]}"
    done
    exit 0
fi
out=${1:-wheelhouse}
shift $(($# ? 1 : 0))
versions=("$@")
((${#versions[@]})) || versions=("${default_versions[@]}")

# Downloads into $2 the wheels CPython $1 installs (the rest: pip download's arguments), less numpy
# (gguf's dependency: the machine's own is used), and fails naming any requirement they leave unmet
# beyond what the machine brings. pip evaluates dependency markers (pytest's `tomli; python_version
# < "3.11"`) for the Python it runs under whatever --python-version says: here it evaluates them,
# and so does the check, with the target's values.
download() {
    "$python" - "$@" <<'PY'
import email.parser
import sys
import zipfile
from pathlib import Path

from pip._internal.cli.main import main
from pip._vendor.packaging import markers
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

version, folder, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
environment = markers.default_environment() | {
    "python_version": version,
    "python_full_version": f"{version}.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
markers.default_environment = lambda: dict(environment)
if main(["download", "-q", "-d", str(folder), *args]):
    sys.exit(f"pip download failed for CPython {version}")
for numpy in folder.glob("numpy-*.whl"):
    numpy.unlink()
wheels = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in folder.glob("*.whl")}
unmet = []
for wheel in wheels.values():
    with zipfile.ZipFile(wheel) as z:
        metadata = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        requires = email.parser.Parser().parsestr(z.read(metadata).decode()).get_all("Requires-Dist") or []
    for line in map(Requirement, requires):
        name = canonicalize_name(line.name)
        if (line.marker and not line.marker.evaluate({"extra": ""})) or name in {"torch", "triton", "numpy"}:
            continue
        if name not in wheels or not line.specifier.contains(parse_wheel_filename(wheels[name].name)[1], prereleases=True):
            unmet.append(f"{wheel.name}: {line}")
if unmet:
    sys.exit(f"the wheels for CPython {version} leave requirements unmet:\n  " + "\n  ".join(unmet))
PY
}

# the project's runtime requirements, less what the machine brings
mapfile -t requirements < <("$python" - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
brought = {"torch", "triton", "numpy"}
print("\n".join(d for d in deps if re.match(r"[A-Za-z0-9_.-]+", d)[0].lower() not in brought))
PY
)
for version in "${versions[@]}"; do
    [[ $version =~ ^3\.[0-9]+$ ]] || { echo "not a CPython version: $version (e.g. 3.12)" >&2; exit 2; }
done
rm -rf "$out" && mkdir -p "$out"
for version in "${versions[@]}"; do
    tag=cp${version/./}
    mapfile -t flags < <(target "$version")
    download "$version" "$out/$tag" "${flags[@]}" "${requirements[@]}" "pytest>=8" "setuptools>=68"
    (cd "$out/$tag" && printf '%s\n' *.whl) | sed -E 's/-([^-]+)-[^-]+-[^-]+-[^-]+\.whl$/==\1/' >"$out/requirements-$tag.txt"
    mv -f "$out/$tag"/*.whl "$out" && rmdir "$out/$tag"
done
"$python" -c 'import sys; from pathlib import Path; from pulseinfer.common.model.meta import load_model_meta
path = Path(sys.argv[1]); path.mkdir(); load_model_meta().tokenizer.save_hf_dir(path)' "$out/tokenizer"
echo "wheelhouse $out: CPython ${versions[*]}, $(find "$out" -maxdepth 1 -name '*.whl' | wc -l) wheels, $(du -sh "$out" | cut -f1)"
