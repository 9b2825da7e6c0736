"""Regenerate the committed gRPC/protobuf stubs from protos/*.proto.

    python protos/generate.py            # rewrite the stubs in place
    python protos/generate.py --check    # exit 1 if the committed stubs are stale

Needs the pinned generator from the dev extra (grpcio-tools==1.85.1). The .proto
files are staged under hetlaunch/protos/ in a temporary folder so the generated
imports read `from hetlaunch.protos import control_pb2`, matching the installed
import name rather than the repository folder.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate_into(out_dir: Path) -> list[Path]:
    """Generate stubs for every .proto into out_dir; return the generated paths."""
    import grpc_tools
    from grpc_tools import protoc

    staging = out_dir / "src"
    package = staging / "hetlaunch" / "protos"
    package.mkdir(parents=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    for proto in protos:
        shutil.copy(proto, package / proto.name)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{staging}",
        f"-I{well_known}",
        f"--python_out={staging}",
        f"--pyi_out={staging}",
        f"--grpc_python_out={staging}",
        *(f"hetlaunch/protos/{p.name}" for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in package.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate_into(Path(tmp))
        stale = [g.name for g in generated
                 if not (PROTO_DIR / g.name).exists() or (PROTO_DIR / g.name).read_bytes() != g.read_bytes()]
        if args.check:
            if stale:
                print("stale generated stubs: " + ", ".join(stale) + " (run: python protos/generate.py)")
                return 1
            return 0
        for g in generated:
            shutil.copy(g, PROTO_DIR / g.name)
    print("generated: " + ", ".join(g.name for g in generated))
    return 0


if __name__ == "__main__":
    sys.exit(main())
