"""Regenerates the Python modules for proto/pulseinfer/v1/*.proto: `python -m pulseinfer.proto.generate [--out DIR]`."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROTO = Path(__file__).resolve().parent  # installed as the package pulseinfer.proto
SCHEMAS = sorted((PROTO / "pulseinfer" / "v1").glob("*.proto"))


def generate(out: Path) -> None:
    """Writes the modules under `out` as if it were the proto/ folder."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        # protoc names generated imports by the schema's path under its include root: seen from a root
        # where proto/ is pulseinfer/proto, they read `from pulseinfer.proto.pulseinfer.v1 import ...`
        src, dst = Path(tmp, "src"), Path(tmp, "dst")
        for root, target in ((src, PROTO), (dst, out.resolve())):
            (root / "pulseinfer").mkdir(parents=True)
            (root / "pulseinfer" / "proto").symlink_to(target)
        args = ["protoc", f"-I{src}", f"-I{include}", f"--python_out={dst}", f"--pyi_out={dst}", f"--grpc_python_out={dst}"]
        code = protoc.main(args + [f"pulseinfer/proto/{s.relative_to(PROTO)}" for s in SCHEMAS])
    if code != 0:
        raise SystemExit(f"protoc failed with exit code {code}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=PROTO)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
