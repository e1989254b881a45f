"""Deployments: KubeRay manifests against the CRD schemas, Serve configs against Ray's schema, the real Serve app
through Serve's gRPC proxy, and the Dockerfiles' install step in a clean venv."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from dspark_serve.cluster.client import DSparkClient
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.random_init import random_pair

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT.parent / "shared" / "data" / "kuberay"
MANIFESTS = {"rayservice.yaml": "ray.io_rayservices.yaml", "raycluster.yaml": "ray.io_rayclusters.yaml"}


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / "deploy" / name).read_text())


def _crd_schema(crd_file: str) -> dict:
    crd = yaml.safe_load((CRDS / crd_file).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("manifest", list(MANIFESTS))
def test_manifest_validates_against_the_crd(manifest):
    if not CRDS.is_dir():
        pytest.skip(f"KubeRay CRDs not found at {CRDS}")
    obj = _load(f"kuberay/{manifest}")
    schema = _crd_schema(MANIFESTS[manifest])
    jsonschema.validate(obj, schema)
    broken = yaml.safe_load(yaml.safe_dump(obj))  # the check can fail: a wrong type is caught
    cluster = broken["spec"].get("rayClusterConfig", broken["spec"])
    cluster["workerGroupSpecs"][0]["minReplicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


@pytest.mark.parametrize("config", ["serve.yaml", "serve-cpu.yaml", "rayservice"])
def test_serve_configs_parse_with_rays_schema(config):
    raw = yaml.safe_load(_load("kuberay/rayservice.yaml")["spec"]["serveConfigV2"]) if config == "rayservice" \
        else _load(config)
    parsed = ServeDeploySchema.model_validate(raw)
    assert parsed.grpc_options.port == 9000
    assert parsed.grpc_options.grpc_servicer_functions == [
        "dspark_serve.protos.dspark.v1.dspark_pb2_grpc.add_GenerationServicer_to_server"]
    app = parsed.applications[0]
    assert app.import_path == "dspark_serve.cluster.serve_app:app" and app.name == "dspark"
    with pytest.raises(Exception):
        ServeDeploySchema.model_validate({**raw, "applications": [{**raw["applications"][0], "deployments": "x"}]})


def test_rayservice_embeds_the_gpu_serve_config_and_steers_groups():
    svc = _load("kuberay/rayservice.yaml")
    assert yaml.safe_load(svc["spec"]["serveConfigV2"]) == _load("serve.yaml")
    cluster = svc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports["serve"] == 8000 and ports["serve-grpc"] == 9000 and "metrics" in ports
    args = _load("serve.yaml")["applications"][0]["args"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    for group, key in (("target-gpu", "target_resources"), ("draft-gpu", "draft_resources")):
        container = groups[group]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        advertised = yaml.safe_load(groups[group]["rayStartParams"]["resources"].strip('"').replace('\\"', '"'))
        assert set(advertised) == set(args[key])  # the actor's resource is what its worker group offers
        assert any(m["mountPath"] == "/models" for m in container["volumeMounts"])


@pytest.fixture(scope="module")
def serve_app(tmp_path_factory):
    """`serve run deploy/serve-cpu.yaml`, as a user starts it, in its own process session."""
    serve_cli = Path(sys.executable).parent / "serve"
    proc = subprocess.Popen([str(serve_cli), "run", str(ROOT / "deploy" / "serve-cpu.yaml")],
                            cwd=tmp_path_factory.mktemp("serve"), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    client = DSparkClient("127.0.0.1:9000", application="dspark")
    end = time.monotonic() + 240
    while True:
        try:
            client.model_info()
            break
        except grpc.RpcError:
            if time.monotonic() > end or proc.poll() is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(f"Serve app did not come up (exit {proc.poll()})")
            time.sleep(1)
    yield client
    client.close()
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def test_serve_grpc_proxy_generates_what_the_engine_does(serve_app, tmp_path):
    target, draft = random_pair(tmp_path, agree=0.005, block_size=6)  # what "builtin:tiny" builds
    local = LLM(str(target), str(draft), device="cpu", block_size=8)
    for prompt in ([1, 2, 3], [40, 41, 42, 43, 44]):
        msgs = list(serve_app.stream(prompt, temperature=0.0, max_tokens=24, timeout=60))
        ref = local.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0]
        assert list(msgs[-1].complete.output_ids) == ref.token_ids
        assert [t for m in msgs[:-1] for t in m.chunk.token_ids] == ref.token_ids
        assert msgs[-1].complete.stats.mean_acceptance_length > 2.0


def test_serve_grpc_proxy_maps_errors_and_keeps_serving(serve_app):
    with pytest.raises(grpc.RpcError) as e:
        serve_app.generate([1, 2], temperature=0.0, max_tokens=4, top_p=1.5, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p must be in (0, 1]" in e.value.details()
    stats = serve_app.server_stats()
    assert stats.total_target_blocks == 1024 and stats.free_target_blocks == 1024
    assert len(serve_app.generate([1, 2], temperature=0.0, max_tokens=4, timeout=30)["token_ids"]) == 4


def test_install_script_in_a_clean_venv(tmp_path):
    """What the Dockerfiles RUN (deploy/install.sh), in a fresh venv: the package, its stubs and the CLI."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    proc = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "cpu", str(ROOT)], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": str(py)}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dspark-serve installed (cpu)" in proc.stdout
    out = subprocess.run([str(venv / "bin" / "dspark-serve"), "--help"], capture_output=True, text=True, check=True)
    assert "serve" in out.stdout and "generate" in out.stdout
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        assert "bash deploy/install.sh" in (ROOT / "deploy" / dockerfile).read_text()
