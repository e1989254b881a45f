"""The OpenAI-compatible HTTP API, chat input and /metrics of `dspark-serve serve --http-port`: the official openai
client against a real server (tiny pair, byte-level tokenizer, a chat template in tokenizer_config.json), the chat
input against transformers' apply_chat_template, and the counters against the requests' final stats."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
from byte_tokenizer import byte_tokenizer
from prometheus_client.parser import text_string_to_metric_families
from service import ServerProcess
from tokenizers import processors

from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.models.random_init import random_pair
from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

KEY = "openai-test-key-" + "4" * 16
MODEL = "tiny-chat"
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}[sys]{{ m['content'] }}\n{% else %}<|{{ m['role'] }}|>"
            "{{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello 你好"},
        {"role": "assistant", "content": "hi 😀"}, {"role": "user", "content": "more"}]
GREEDY = dict(temperature=0.0, max_tokens=24)
LONG = dict(temperature=0.0, max_tokens=3500, ignore_eos=True)


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """The tiny pair with a byte-level tokenizer that adds a BOS (id 1) to plain text, so a chat tokenized with
    special tokens would show, and a chat template in tokenizer_config.json."""
    target, draft = random_pair(tmp_path_factory.mktemp("pair"), agree=0.005, block_size=6)
    tok = byte_tokenizer(512)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return target, draft


@pytest.fixture(scope="module")
def server(pair_dirs):
    srv = ServerProcess(*pair_dirs, "--http-port", "0", "--served-model-name", MODEL, "--api-key", KEY,
                        "--max-model-len", "4096")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"http://{server.http_address}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def grpc_client(server):
    c = DSparkClient(server.address, api_key=KEY)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf_tokenizer(pair_dirs):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(pair_dirs[0] / "tokenizer.json"))
    tok.chat_template = TEMPLATE
    return tok


def _http(server, path: str, body: dict | None = None, key: str | None = None,
          timeout: float = 30) -> tuple[int, str]:
    """(status, body text) of a plain HTTP call: GET, or POST with a JSON body."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.http_address}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _hf_chat_ids(tok, messages, add_generation_prompt=True) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _final(client, prompt, **kw) -> pb.GenerateComplete:
    return [m for m in client.stream(prompt, timeout=60, **kw)][-1].complete


def test_models_lists_the_served_model(oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_chat_completion_equals_its_stream(oai, hf_tokenizer):
    ignore_eos = {"ignore_eos": True}
    resp = oai.chat.completions.create(model=MODEL, messages=CHAT, extra_body=ignore_eos, **GREEDY)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason == "length" and choice.message.content
    prompt_tokens = len(_hf_chat_ids(hf_tokenizer, CHAT))
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (
        prompt_tokens, 24, prompt_tokens + 24)
    stats = resp.to_dict()["dspark"]
    assert stats["num_spec_steps"] >= 1 and stats["tau"] == pytest.approx(
        (stats["num_accepted_tokens"] + stats["num_spec_steps"]) / stats["num_spec_steps"], abs=1e-3)
    assert stats["tau"] > 1.5 and stats["num_accepted_tokens"] == sum(stats["per_position_accepted"])

    chunks = list(oai.chat.completions.create(model=MODEL, messages=CHAT, stream=True, extra_body=ignore_eos,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    u, v = chunks[-1].usage, resp.usage
    assert chunks[-1].choices == [] and (u.prompt_tokens, u.completion_tokens) == (v.prompt_tokens, v.completion_tokens)
    # the same chat again: its prompt's full blocks come from the prefix cache (OpenAI's usage field)
    assert u.prompt_tokens_details.cached_tokens >= u.prompt_tokens // 8 * 8 - 8 > 0
    assert chunks[-1].to_dict()["dspark"]["num_spec_steps"] >= 1


def test_completion_equals_its_stream_and_the_grpc_answer(oai, grpc_client, hf_tokenizer):
    ids = [5, 80, 300, 17, 42]
    ref = _final(grpc_client, ids, **GREEDY)
    resp = oai.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert resp.object == "text_completion" and resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}[
        ref.finish_reason]
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), len(ref.output_ids))
    chunks = list(oai.completions.create(model=MODEL, prompt=ids, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == resp.choices[0].finish_reason
    assert chunks[-1].to_dict()["dspark"]["num_spec_steps"] == ref.stats.num_spec_steps
    text = oai.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4, temperature=0.0)
    ids = hf_tokenizer("def f(x):")["input_ids"]
    assert ids[0] == 1 and text.usage.prompt_tokens == len(ids)  # a text prompt gets the tokenizer's BOS


def test_sampling_fields_are_accepted(oai):
    """vLLM's sampling fields map onto the request; each answers 200 with a sequence."""
    resp = oai.chat.completions.create(
        model=MODEL, messages=CHAT[:2], temperature=0.7, top_p=0.9, seed=3, max_completion_tokens=6, stop=["\n\n"],
        presence_penalty=0.1, frequency_penalty=0.1,
        extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
                    "include_stop_str_in_output": False, "skip_special_tokens": True, "stop_token_ids": [7]})
    assert resp.usage.completion_tokens <= 6 and resp.choices[0].finish_reason in ("stop", "length")


def test_logprobs_and_n(oai):
    resp = oai.chat.completions.create(model=MODEL, messages=CHAT[:2], logprobs=True, top_logprobs=2, n=2,
                                       temperature=1.0, seed=1, max_tokens=5, extra_body={"ignore_eos": True})
    if len(resp.choices) == 1:
        pytest.skip("n > 1 needs the gateway's fan-out (GenerateResponse.index), not here yet")
    assert sorted(c.index for c in resp.choices) == [0, 1] and resp.usage.completion_tokens == 10
    content = resp.choices[0].logprobs and resp.choices[0].logprobs.content
    if not content:
        pytest.skip("logprobs need GenerateChunk.logprobs from the step loop, not here yet")
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_errors_are_openai_error_objects(oai, server):
    cases = [(openai.BadRequestError, 400, "temperature", dict(temperature=-1.0)),
             (openai.NotFoundError, 404, "nope", dict(model="nope")),
             (openai.BadRequestError, 400, "max_tokens", dict(max_tokens=5000)),
             (openai.BadRequestError, 400, "prompt has", dict(messages=[{"role": "user", "content": "x" * 5000}])),
             (openai.BadRequestError, 400, "messages", dict(messages=[])),
             (openai.BadRequestError, 400, "chat.messages[0].role", dict(messages=[{"role": "wizard",
                                                                                     "content": "x"}]))]
    for cls, status, text, kw in cases:
        with pytest.raises(cls) as e:
            oai.chat.completions.create(**{"model": MODEL, "messages": CHAT[:2], "max_tokens": 4, **kw})
        err = e.value
        assert err.status_code == status and text in err.body["message"], (kw, err.body)
        assert set(err.body) == {"message", "type", "param", "code"} and err.body["type"] == "invalid_request_error"
    for key in ("wrong-key", None):
        status, text = _http(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT[:2]}, key)
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{server.http_address}/v1", api_key="wrong", max_retries=0).models.list()


def test_health_and_metrics_need_no_key(server):
    assert _http(server, "/health")[0] == 200
    status, text = _http(server, "/metrics")
    assert status == 200 and "dspark:kv_cache_usage_perc" in text


def _scrape(server) -> dict:
    text = _http(server, "/metrics")[1]
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_what_the_final_stats_report(server, oai, grpc_client):
    before = _scrape(server)
    finals = [_final(grpc_client, [9, 8, 7, 6], **GREEDY), _final(grpc_client, CHAT[:2], max_tokens=12, ignore_eos=True,
                                                                    temperature=0.0)]
    seen = [(f.stats.num_spec_steps, f.stats.num_draft_tokens, f.stats.num_accepted_tokens,
             list(f.stats.per_position_accepted), f.num_prompt_tokens, len(f.output_ids),
             {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}[f.finish_reason]) for f in finals]
    resp = oai.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    chunks = list(oai.completions.create(model=MODEL, prompt=[3, 4, 5], stream=True, max_tokens=10,
                                         temperature=0.0, stream_options={"include_usage": True}))
    for stats, use, reason in ((resp.to_dict()["dspark"], resp.usage, resp.choices[0].finish_reason),
                               (chunks[-1].to_dict()["dspark"], chunks[-1].usage, chunks[-2].choices[0].finish_reason)):
        seen.append((stats["num_spec_steps"], stats["num_draft_tokens"], stats["num_accepted_tokens"],
                     stats["per_position_accepted"], use.prompt_tokens, use.completion_tokens, reason))
    after = _scrape(server)
    d = lambda name, **labels: _delta(after, before, "dspark:" + name, **labels)  # noqa: E731
    assert d("spec_decode_num_drafts_total") == sum(s[0] for s in seen) > 0
    assert d("spec_decode_num_draft_tokens_total") == sum(s[1] for s in seen)
    assert d("spec_decode_num_accepted_tokens_total") == sum(s[2] for s in seen) > 0
    for pos in range(max(len(s[3]) for s in seen)):
        expected = sum(s[3][pos] for s in seen if pos < len(s[3]))
        assert d("spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == expected
    assert d("prompt_tokens_total") == sum(s[4] for s in seen)
    assert d("generation_tokens_total") == sum(s[5] for s in seen)
    for reason in ("stop", "length"):
        assert d("request_success_total", finished_reason=reason) == sum(s[6] == reason for s in seen)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert d(hist + "_count") == 4
    assert ("dspark:num_requests_running", ()) in after and ("dspark:step_channel_ms_per_step", ()) in after


def test_a_finished_request_logs_one_json_line(server, oai):
    resp = oai.completions.create(model=MODEL, prompt=[11, 12], max_tokens=3, temperature=0.0)
    rid = resp.id.removeprefix("cmpl-")
    end = time.monotonic() + 10
    while time.monotonic() < end:
        lines = [json.loads(x) for x in list(server.log) if x.startswith("{") and rid in x]
        if lines:
            break
        time.sleep(0.05)
    [line] = lines
    assert line["prompt_tokens"] == 2 and line["output_tokens"] == resp.usage.completion_tokens
    assert line["finish_reason"] == resp.choices[0].finish_reason and line["ttft_s"] > 0 and line["tau"] >= 1


def _wait_idle(grpc_client, timeout_s: float = 3.0) -> int:
    end = time.monotonic() + timeout_s
    while grpc_client.server_stats().num_running and time.monotonic() < end:
        time.sleep(0.05)
    return grpc_client.server_stats().num_running


def test_a_client_that_leaves_frees_its_request(server, grpc_client):
    """Streamed or not, the server notices the closed connection and aborts the request (its blocks are freed)."""
    body = {"model": MODEL, "prompt": [1, 2, 3], **LONG}
    with pytest.raises(TimeoutError):
        _http(server, "/v1/completions", body, KEY, timeout=1.0)
    assert _wait_idle(grpc_client) == 0
    req = urllib.request.Request(f"http://{server.http_address}/v1/completions", json.dumps({**body, "stream": True})
                                 .encode(), {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.readline().startswith(b"data: {")
        assert grpc_client.server_stats().num_running == 1
    assert _wait_idle(grpc_client) == 0


def test_chat_input_renders_like_transformers(grpc_client, hf_tokenizer):
    """gRPC `chat` input: the same prompt ids as apply_chat_template (no special tokens added), so the same
    greedy output as those ids sent as token_ids."""
    info = grpc_client.model_info()
    assert info.served_model_name == MODEL and info.has_chat_template
    for messages, add in ((CHAT, True), (CHAT[:2], False)):
        ids = _hf_chat_ids(hf_tokenizer, messages, add)
        req = DSparkClient.request(messages, **GREEDY)
        req.chat.add_generation_prompt = add
        chat = [m for m in grpc_client.stub.Generate(req, metadata=grpc_client.metadata, timeout=60)][-1].complete
        ref = _final(grpc_client, ids, **GREEDY)
        assert chat.num_prompt_tokens == len(ids) and list(chat.output_ids) == list(ref.output_ids)
    for messages, field in (([], "chat.messages is empty"), ([{"role": "user", "content": "a"},
                                                              {"role": "bot", "content": "b"}],
                                                             "chat.messages[1].role")):
        req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in messages]))
        with pytest.raises(Exception) as e:
            list(grpc_client.stub.Generate(req, metadata=grpc_client.metadata, timeout=30))
        assert e.value.code().name == "INVALID_ARGUMENT" and field in e.value.details()


def test_generate_chat_cli_in_process_and_served(server, pair_dirs, grpc_client):
    ref = grpc_client.generate([{"role": "user", "content": "hi"}], max_tokens=8, temperature=0.0, ignore_eos=True)
    common = ["--chat", "--prompt", "hi", "--max-tokens", "8", "--ignore-eos", "--json"]
    runs = [["--server", server.address, "--api-key", KEY], ["--target", str(pair_dirs[0]), "--draft",
                                                              str(pair_dirs[1]), "--device", "cpu"]]
    for where in runs:
        out = subprocess.run([sys.executable, "-m", "dspark_serve.cluster.commands", "generate", *where, *common],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout.strip().splitlines()[-1])["token_ids"] == ref["token_ids"]


class _Core:
    """A started core whose generate fails as told."""

    served_model_name = MODEL
    info = {"vocab_size": 512}

    def __init__(self, error: Exception) -> None:
        from dspark_serve.cluster.config import GatewayConfig

        self.cfg = GatewayConfig()
        self.error = error

    async def generate(self, req, deadline_s, caller):
        raise self.error
        yield


def test_status_mapping_without_a_server():
    """Queue full, unavailable and faults keep their status and OpenAI's shape; faults say nothing inside."""
    from starlette.testclient import TestClient

    from dspark_serve.cluster.auth import Access
    from dspark_serve.cluster.gateway import GatewayError
    from dspark_serve.cluster.openai_api import HttpApi, build_app

    body = {"model": MODEL, "prompt": "x"}
    for error, status in ((GatewayError("RESOURCE_EXHAUSTED", "queue full"), 429),
                          (GatewayError("UNAVAILABLE", "the pair is gone"), 503),
                          (RuntimeError("actor 5f3c at 10.1.2.3"), 500)):
        async def core(error=error):
            return _Core(error)

        async def serving():
            return False

        client = TestClient(build_app(HttpApi(core, Access(), serving, 1000)))
        r = client.post("/v1/completions", json=body)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "10.1.2.3" not in r.text
    assert client.get("/health").status_code == 503
    assert client.post("/v1/completions", json={**body, "prompt": "x" * 2000}).status_code == 413
    assert client.post("/v1/completions", content=b"{not json").status_code == 400
    assert client.get("/metrics").status_code == 404  # no metrics_text: the Serve app exports through Ray


def test_serve_flags_reach_the_configs_and_the_verifier(monkeypatch, pair_dirs, tmp_path):
    """--http-port, --served-model-name and --chat-template land in the configs; the verifier reads the file, which
    overrides the target's template (and the target's own is used without it)."""
    from types import SimpleNamespace

    from dspark_serve.actors.verifier_actor import VerifierActor
    from dspark_serve.cluster import standalone
    from dspark_serve.cluster.commands import cli
    from dspark_serve.cluster.config import PairConfig
    from dspark_serve.engine.engine_config import EngineConfig

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}!")
    seen = {}
    monkeypatch.setattr(standalone, "run", lambda pair, gateway, address, num_cpus: seen.update(pair=pair, gw=gateway))
    cli.main(["serve", str(pair_dirs[0]), "--http-port", "8123", "--served-model-name", "m", "--chat-template",
              str(path)])
    assert (seen["pair"].engine.chat_template, seen["gw"].http_port, seen["gw"].served_model_name) == \
        (str(path), 8123, "m")
    for file, expected in ((str(path), "{{ messages[0]['content'] }}!"), (None, TEMPLATE)):
        actor = SimpleNamespace(cfg=PairConfig(EngineConfig(target=str(pair_dirs[0]), chat_template=file)))
        assert VerifierActor.chat_template(actor).template == expected
    assert VerifierActor.chat_template(SimpleNamespace(cfg=PairConfig(EngineConfig(target=str(tmp_path))))) is None


def test_a_failing_chat_template_is_the_clients_error_without_the_servers_paths():
    from dspark_serve.cluster.chat import render
    from dspark_serve.cluster.gateway_request import Chat, ChatMessage
    from dspark_serve.models.chat_template import ChatTemplate

    template = ChatTemplate("/srv/models/secret/tokenizer_config.json",
                            "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}x")
    assert render(template, Chat((ChatMessage("user", "a"),))) == "x"
    with pytest.raises(ValueError) as e:
        render(template, Chat((ChatMessage("user", "a"),) * 2))
    assert "one message only" in str(e.value) and "/srv" not in str(e.value)
