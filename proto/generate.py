"""Regenerates the Python modules for proto/pulseinfer/v1/*.proto: `python -m proto.generate [--out DIR]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = sorted((ROOT / "proto" / "pulseinfer" / "v1").glob("*.proto"))


def generate(out: Path) -> None:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    # paths relative to the repo root, so generated imports read `from proto.pulseinfer.v1 import ...`
    code = protoc.main(args + [str(s.relative_to(ROOT)) for s in SCHEMAS])
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
