"""Generate the Python stubs of dspark/v1/*.proto (run after editing a .proto; the stubs are committed).

usage: python protos/build.py [--check]   (--check: exit 1 if the committed stubs differ from a fresh build)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = sorted((HERE / "dspark" / "v1").glob("*.proto"))


def generate(out: Path) -> dict[str, str]:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{HERE}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    if protoc.main(args + [str(p) for p in PROTOS]) != 0:
        raise SystemExit("protoc failed")
    files = {}
    for f in sorted((out / "dspark" / "v1").glob("*_pb2*.py*")):
        text = f.read_text()
        # generated code names its module `dspark.v1.*`; inside our namespace the sibling is relative and the
        # message classes must carry the real module name, or pickling them (Ray Serve does) fails
        text = text.replace("from dspark.v1 import", "from . import")
        files[f.name] = text.replace("BuildTopDescriptorsAndMessages(DESCRIPTOR, 'dspark.v1.dspark_pb2', _globals)",
                                     "BuildTopDescriptorsAndMessages(DESCRIPTOR, __name__, _globals)")
    return files


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
    target = HERE / "dspark" / "v1"
    if "--check" in argv:
        stale = [n for n, t in files.items() if not (target / n).is_file() or (target / n).read_text() != t]
        if stale:
            print(f"stale generated stubs: {stale}; run python protos/build.py", file=sys.stderr)
            return 1
        return 0
    for name, text in files.items():
        (target / name).write_text(text)
    print(f"wrote {sorted(files)} to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
