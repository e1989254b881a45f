"""The committed stubs are what protos/build.py generates from the .proto, and the gateway imports no torch."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_match_the_proto():
    proc = subprocess.run([sys.executable, str(ROOT / "protos" / "build.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_stale_stubs_are_detected(tmp_path):
    import shutil

    copy = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", copy)
    proto = copy / "dspark" / "v1" / "dspark.proto"
    proto.write_text(proto.read_text().replace("bool has_tokenizer = 8;", "bool has_tokenizer = 8;\n  string extra = 99;"))
    proc = subprocess.run([sys.executable, str(copy / "build.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 1 and "stale generated stubs" in proc.stderr


def test_gateway_and_client_import_without_torch():
    code = ("import sys, dspark_serve.cluster.grpc_server, dspark_serve.cluster.grpc_client, "
            "dspark_serve.cluster.gateway; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
