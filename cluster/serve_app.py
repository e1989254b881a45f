"""The Ray Serve application: one ingress deployment that owns a draft+verifier pair and answers dspark.v1 gRPC and,
at Serve's HTTP proxy, the OpenAI-compatible API (metrics go through Ray's metrics API).

The pair's actors get their own GPUs and placement group (bundle 0 verifier, bundle 1 draft), steered by custom
resources onto the target-gpu / draft-gpu worker groups. The step loop runs inside the pair and streams each step's
tokens to the replica over the request stream; the replica supervises the pair (a lost draft is replaced, a lost
verifier means a new pair). `import_path: dspark_serve.cluster.serve_app:app`.

With `api_key` (or DSPARK_API_KEY in the replica's environment) every call needs `authorization: Bearer KEY`, checked
here. Serve's gRPC proxy serves plaintext: TLS is terminated in front of it (an ingress or load balancer).
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

from ray import serve

from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

from .auth import Access
from .config import GatewayConfig, PairConfig
from .gateway import GatewayCore
from .grpc_methods import gateway_request, status
from .metrics import GaugeRefresher, RaySink, ServingMetrics, log_requests_to_stderr

BUILTIN_TINY = "builtin:tiny"  # a tiny constructed pair written at startup, with a byte-level tokenizer (laptop / CI)
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GATEWAY_OPTIONS = ("max_queue", "max_request_bytes", "served_model_name", "max_prompt_chars", "abort_window_s",
                   "enable_auto_tool_choice", "tool_call_parser")  # the GatewayConfig fields it takes (the HTTP
# listener is Serve's proxy)


REPLICA_HEADER = "x-dspark-replica"  # which replica answered: an HTTP response header, gRPC trailing metadata


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, health_check_period_s=10, health_check_timeout_s=30,
                  graceful_shutdown_timeout_s=60)
@serve.ingress()
class DSpark:
    def __init__(self, target: str, api_key: str | None = None, **options: Any) -> None:
        """`options` (the config's `args:`): EngineConfig's fields (draft, speculative_config and kernel_config as
        mappings or JSON, device, dtype, block_size, num_kv_blocks, ...), PairConfig's deployment fields
        (placement, colocate, channel_host, num_cpus, cpu_threads, target_resources / draft_resources as mappings,
        ...) and GATEWAY_OPTIONS; any other name is refused."""
        import ray

        from dspark_serve.engine.engine_config import EngineConfig, split_options

        from .pair import create_pair

        log_requests_to_stderr()
        engine_options, rest = split_options({**options, "target": target})
        gateway_options = {k: rest.pop(k) for k in GATEWAY_OPTIONS if k in rest}
        gateway_options["served_model_name"] = gateway_options.get("served_model_name") or target
        if target == BUILTIN_TINY:
            from dspark_serve.models.random_init import random_pair

            self._tmp = tempfile.TemporaryDirectory()
            tiny_target, tiny_draft = map(str, random_pair(self._tmp.name, agree=0.005, block_size=6))
            _write_tiny_tokenizer(tiny_target)
            engine_options.update(target=tiny_target, draft=tiny_draft)
        self.pair_cfg = PairConfig.from_options(EngineConfig.from_options(engine_options), rest)
        self.pair = create_pair(self.pair_cfg)
        info = ray.get(self.pair.verifier.model_info.remote())
        self.gateway_cfg = GatewayConfig(**{k: v for k, v in gateway_options.items() if v is not None})
        self.core = GatewayCore(self.pair.verifier, info, self.gateway_cfg)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.core.metrics = ServingMetrics(RaySink({"replica": self.replica}), self.core.served_model_name)
        self.access = _access(api_key)
        self._started: asyncio.Task | None = None

    async def _ready(self) -> None:
        """The request stream, the tokenizer and the pair's supervisor, on this replica's event loop, once
        (concurrent first calls wait)."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        from .supervisor import PairSupervisor

        await self.core.start()
        self.supervisor = PairSupervisor(self.pair_cfg, self.pair, self.core.detach, self._attach)
        loop = asyncio.get_running_loop()
        self._watch = loop.create_task(self.supervisor.run())
        self._gauges = loop.create_task(GaugeRefresher(self.core.metrics, self.core.server_stats).run())

    def __serve_build_asgi_app__(self) -> Any:
        """The OpenAI-compatible HTTP API on this replica's core (Serve's HTTP proxy routes to it)."""
        from .openai_api import HttpApi, build_app

        async def core() -> GatewayCore:
            await self._ready()
            return self.core

        async def serving() -> bool:
            await self._ready()
            return self.core.conn is not None and not self.core.draining

        return _with_header(build_app(HttpApi(core, self.access, serving, self.gateway_cfg.max_request_bytes)),
                            REPLICA_HEADER, self.replica)

    async def _attach(self, pair) -> None:
        self.pair = pair
        await self.core.attach(pair.verifier)

    async def Generate(self, request: pb.GenerateRequest, grpc_context: Any = None):
        if grpc_context is not None:
            grpc_context.set_trailing_metadata([(REPLICA_HEADER, self.replica)])
        try:
            caller = self.access.caller(grpc_context)
            await self._ready()
            req = gateway_request(request, self.gateway_cfg.max_request_bytes)
            async for response in self.core.generate(req, None, caller):
                yield response
        except Exception as e:
            _fail(grpc_context, e)

    async def Abort(self, request: pb.AbortRequest, grpc_context: Any = None) -> pb.AbortResponse:
        try:
            caller = self.access.caller(grpc_context)
            await self._ready()
            return pb.AbortResponse(aborted=await self.core.abort(list(request.request_ids), caller))
        except Exception as e:
            _fail(grpc_context, e)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context: Any = None) -> pb.ModelInfo:
        try:
            self.access.caller(grpc_context)
            await self._ready()
            return self.core.model_info()
        except Exception as e:
            _fail(grpc_context, e)

    async def GetServerStats(self, request: pb.GetServerStatsRequest, grpc_context: Any = None) -> pb.ServerStats:
        try:
            self.access.caller(grpc_context)
            await self._ready()
            return await self.core.server_stats()
        except Exception as e:
            _fail(grpc_context, e)

    async def check_health(self) -> None:
        """The real request path: a dead or failed step loop fails the replica (a long step does not)."""
        health = await self.pair.verifier.health.remote()
        if not health["ok"]:
            raise RuntimeError(f"step loop unhealthy: {health}")

    def __del__(self) -> None:
        supervisor = getattr(self, "supervisor", None)
        if supervisor is not None:
            supervisor.stop()
        pair = getattr(self, "pair", None)
        if pair is not None:
            pair.shutdown()


def _with_header(asgi: Any, name: str, value: str) -> Any:
    """The ASGI app with one more header on every HTTP response."""
    header = (name.encode(), value.encode())

    async def app(scope: dict, receive: Any, send: Any) -> None:
        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await asgi(scope, receive, send_with_header if scope["type"] == "http" else send)

    return app


def _write_tiny_tokenizer(target: str) -> None:
    """Byte-level BPE over the tiny pair's 512 ids (the 256 bytes, then 256 letter pairs) and a chat template."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from dspark_serve.engine.detokenize import _CHAR_BYTES

    vocab = {c: b for c, b in _CHAR_BYTES.items()}
    letters = "etaoinshrdlucmfw"
    merges = [(a, b) for a in letters for b in letters]
    vocab.update((a + b, 256 + i) for i, (a, b) in enumerate(merges))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(Path(target) / "tokenizer.json"))
    (Path(target) / "tokenizer_config.json").write_text(json.dumps({"chat_template": TINY_CHAT_TEMPLATE}))


def _access(api_key: str | None) -> Access:
    """The key from the app's args, else DSPARK_API_KEY in the replica's environment (on Kubernetes, a Secret)."""
    import os

    key = api_key or os.environ.get("DSPARK_API_KEY")
    return Access((key,) if key else ())


def _fail(grpc_context: Any, e: Exception) -> None:
    """Serve's proxy answers with the code set on the context before the method raises."""
    code, message = status(e)
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(message)
    raise RuntimeError(message) from None


def app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder: `args` are DSpark's constructor arguments (from the config's `args:`), and
    `router`; max_ongoing_requests and the request router follow from them (serve_options.py)."""
    from .serve_options import deployment_options

    options, rest = deployment_options(args)
    return DSpark.options(**options).bind(**rest)
