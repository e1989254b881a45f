"""Deployments: KubeRay manifests against the CRD schemas, Serve configs against Ray's schema, the real Serve app
through Serve's gRPC proxy, the Dockerfiles' COPY list built into a wheel, their torch pins, and their install step
in a clean venv."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path, PurePosixPath

import grpc
import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from dspark_serve.cluster.grpc_client import DSparkClient
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


@pytest.mark.parametrize("config", ["serve.yaml", "serve-cpu.yaml"])
def test_autoscaling_follows_max_num_seqs(config):
    """The config autoscales on a full batch per replica; the app builder caps a replica at two batches and routes
    by prefix; the RayService lets the Ray autoscaler bring up GPU workers from zero."""
    from dspark_serve.cluster.serve_options import deployment_options

    app = _load(config)["applications"][0]
    [deployment] = app["deployments"]
    max_num_seqs = app["args"]["max_num_seqs"]
    scaling = deployment["autoscaling_config"]
    assert scaling["target_ongoing_requests"] == max_num_seqs and scaling["max_replicas"] > scaling["min_replicas"]
    assert "num_replicas" not in deployment and "max_ongoing_requests" not in deployment
    options, rest = deployment_options(app["args"])
    assert options["max_ongoing_requests"] == 2 * max_num_seqs and rest == app["args"]
    router = options["request_router_config"]
    assert router.request_router_kwargs["block_size"] == app["args"].get("block_size", 16)
    assert "request_router_config" not in deployment_options({**app["args"], "router": "power_of_two"})[0]
    with pytest.raises(ValueError, match="router must be"):
        deployment_options({**app["args"], "router": {"nope": 1}})
    cluster = _load("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert all(g["minReplicas"] == 0 and g["maxReplicas"] >= scaling["max_replicas"]
               for g in cluster["workerGroupSpecs"])


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
        # three drafts pinned: every step verifies them, whatever the policy measures on a busy machine
        msgs = list(serve_app.stream(prompt, temperature=0.0, max_tokens=24, num_speculative_tokens=3, timeout=60))
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


def test_serve_http_answers_an_openai_chat_completion(serve_app):
    """The same replica behind Serve's HTTP proxy: the openai client's chat completion, the gRPC chat's tokens."""
    import openai

    messages = [{"role": "user", "content": "hello"}]
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused", max_retries=0, timeout=60)
    resp = client.chat.completions.create(model="builtin:tiny", messages=messages, temperature=0.0, max_tokens=12,
                                          extra_body={"ignore_eos": True})
    ref = serve_app.generate(messages, temperature=0.0, max_tokens=12, ignore_eos=True, timeout=60)
    assert resp.choices[0].message.content == ref["text"] and resp.usage.completion_tokens == 12
    assert resp.choices[0].finish_reason == "length" and resp.to_dict()["dspark"]["num_spec_steps"] >= 1
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=messages, max_tokens=2)


def test_install_script_in_a_clean_venv(tmp_path):
    """What the Dockerfiles RUN (deploy/install.sh), in a fresh venv: the package, its stubs and the CLI."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    torch_pin = re.search(r"torch==\S+", (ROOT / "deploy" / "Dockerfile.cpu").read_text())[0]
    subprocess.run([str(py), "-m", "pip", "install", "-q", torch_pin], check=True, timeout=900)  # as the image does
    proc = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "cpu", str(ROOT)], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": str(py)}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dspark-serve installed (cpu)" in proc.stdout
    out = subprocess.run([str(venv / "bin" / "dspark-serve"), "--help"], capture_output=True, text=True, check=True)
    assert "serve" in out.stdout and "generate" in out.stdout
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        assert "bash deploy/install.sh" in (ROOT / "deploy" / dockerfile).read_text()


DOCKERFILES = ("Dockerfile", "Dockerfile.cpu")
_PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: continuation lines joined, comment lines dropped."""
    steps, pending = [], ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        word, _, args = (pending + line).strip().partition(" ")
        steps.append((word.upper(), args.strip()))
        pending = ""
    return steps


def _copy_args(args: str) -> tuple[dict[str, str], list[str], str]:
    """COPY [--flag[=value] ...] SRC... DEST, in shell or JSON form -> (flags, sources, dest)."""
    flags = {}
    while args.startswith("--"):
        flag, _, args = args.partition(" ")
        name, _, value = flag[2:].partition("=")
        flags[name] = value
        args = args.lstrip()
    words = json.loads(args) if args.startswith("[") else shlex.split(args)
    return flags, words[:-1], words[-1]


def _stage_image(text: str, context: Path, image: Path) -> Path:
    """Lay out under `image` what the Dockerfile COPYs from `context`; returns the folder it runs install.sh on."""
    assert not (context / ".dockerignore").exists(), "a .dockerignore is not modelled here: teach _stage_image it"
    workdir, src = PurePosixPath("/"), None
    for word, args in _instructions(text):
        if word == "WORKDIR":
            workdir = workdir / args
        elif word == "RUN" and (m := re.search(r"deploy/install\.sh\s+\w+\s+(\S+)", args)):
            src = image / (workdir / m[1]).relative_to("/")
        elif word == "COPY":
            flags, sources, dest = _copy_args(args)
            if "from" in flags:
                continue  # another stage's or image's files, not the build context
            target = image / (workdir / dest).relative_to("/")
            into_dir = dest.endswith("/") or len(sources) > 1
            for source in sources:
                pattern = source.lstrip("/")
                paths = sorted(context.glob(pattern)) if any(c in pattern for c in "*?[") else [context / pattern]
                paths = [p for p in paths if p.exists()]
                assert paths, f"COPY source {source!r} does not exist in the build context {context}"
                for path in paths:
                    if path.is_dir():  # Docker copies a folder's contents, not the folder
                        shutil.copytree(path, target, dirs_exist_ok=True)
                    else:
                        out = target / path.name if into_dir or len(paths) > 1 else target
                        out.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(path, out)
    assert src is not None, "no RUN bash deploy/install.sh <flavor> <dir> in the Dockerfile"
    return src


def _expected_wheel_files() -> list[str]:
    """pyproject's packages (their __init__.py) and every file its package-data globs match here."""
    tool = _PYPROJECT["tool"]["setuptools"]
    dirs = tool["package-dir"]
    files = [pkg.replace(".", "/") + "/__init__.py" for pkg in tool["packages"]]
    for pkg, patterns in tool["package-data"].items():
        parent = max((p for p in dirs if pkg == p or pkg.startswith(p + ".")), key=len)
        folder = ROOT / dirs[parent] / pkg[len(parent):].lstrip(".").replace(".", "/")
        for pattern in patterns:
            matches = sorted(folder.glob(pattern))
            assert matches, f"package-data {pkg}: {pattern!r} matches nothing under {folder}"
            files += [pkg.replace(".", "/") + "/" + m.relative_to(folder).as_posix() for m in matches]
    return files


def _check_wheel_from_copies(text: str, tmp: Path) -> None:
    src = _stage_image(text, ROOT, tmp / "image")
    out = tmp / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out),
                           str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"no wheel from the COPYed files:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    [wheel] = out.glob("dspark_serve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    missing = [f for f in _expected_wheel_files() if f not in names]
    assert not missing, f"the wheel built from the COPYed files lacks {missing}"
    readme = _PYPROJECT["project"]["readme"]  # setuptools builds without it, silently dropping the description
    first_line = (ROOT / readme).read_text().splitlines()[0]
    assert first_line in metadata, f"the wheel's description lacks {readme} (not COPYed?)"


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_copies_build_the_whole_wheel(dockerfile, tmp_path):
    """Only what the Dockerfile COPYs, laid out as in the image, builds a wheel with every package and data file."""
    text = (ROOT / "deploy" / dockerfile).read_text()
    assert re.search(rf"docker build -f deploy/{re.escape(dockerfile)} .* \.(\s|$)", text)  # context: the repo root
    _check_wheel_from_copies(text, tmp_path)


def test_dockerfile_copy_check_can_fail(tmp_path):
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "COPY train train\n" in text
    with pytest.raises(AssertionError, match="'train' does not exist"):
        _check_wheel_from_copies(text.replace("COPY train train\n", ""), tmp_path / "no_train")
    with pytest.raises(AssertionError, match="'nowhere' does not exist"):
        _stage_image(text + "COPY nowhere /x/\n", ROOT, tmp_path / "no_source")


def _check_torch_install(text: str, index: str, pins: tuple[str, ...]) -> None:
    steps = _instructions(text)
    bases = [next(w for w in args.split() if not w.startswith("--")) for word, args in steps if word == "FROM"]
    [install] = [args for word, args in steps if word == "RUN" and re.search(r"pip install .*\btorch\b", args)]
    assert f"--index-url {index}" in install, f"torch should come from {index}: {install}"
    for pin in pins:
        assert re.search(rf"\b{re.escape(pin)}(\.\d+|\.\*)(\s|$)", install), f"expected {pin}.* in: {install}"
    cuda_bases = [b for b in bases if b.startswith("nvidia/cuda")]
    assert not cuda_bases, f"pip's torch brings CUDA's libraries; the base {cuda_bases} ships them again"


def test_images_install_the_pinned_torch_build():
    """CUDA: the torch and triton the GPU kernels are tested with, on a plain Python base; CPU: the CPU build."""
    cuda = (ROOT / "deploy" / "Dockerfile").read_text()
    _check_torch_install(cuda, "https://download.pytorch.org/whl/cu130", ("torch==2.11", "triton==3.6"))
    _check_torch_install((ROOT / "deploy" / "Dockerfile.cpu").read_text(), "https://download.pytorch.org/whl/cpu",
                         ("torch==2.13",))
    with pytest.raises(AssertionError, match="triton==3.6"):
        _check_torch_install(cuda.replace("triton==3.6.0", "triton"), "https://download.pytorch.org/whl/cu130",
                             ("torch==2.11", "triton==3.6"))
    with pytest.raises(AssertionError, match="ships them again"):
        _check_torch_install(re.sub(r"(?m)^FROM .*", "FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04", cuda),
                             "https://download.pytorch.org/whl/cu130", ("torch==2.11", "triton==3.6"))
