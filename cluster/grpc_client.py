"""A small synchronous client for dspark.v1.Generation (what `dspark-serve generate --server` uses)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb
from dspark_serve.protos.dspark.v1 import dspark_pb2_grpc

FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORTED: "abort"}


def stats_dict(s: pb.SpecStats) -> dict[str, Any]:
    """The same keys as the offline engine's stats."""
    return {"steps": s.num_spec_steps, "drafted": s.num_draft_tokens, "accepted": s.num_accepted_tokens,
            "accepted_per_step": list(s.accepted_per_step), "tau": s.mean_acceptance_length,
            "per_position_accepted": list(s.per_position_accepted), "draft_acceptance_rate": s.draft_acceptance_rate,
            "draft_ms": s.draft_ms, "verify_ms": s.verify_ms, "transfer_ms": s.transfer_ms}


class DSparkClient:
    def __init__(self, address: str, application: str | None = None, *, tls: bool = False,
                 root_certificates: bytes | None = None, private_key: bytes | None = None,
                 certificate_chain: bytes | None = None, api_key: str | None = None) -> None:
        """`application`: the Serve application name, when calling through Ray Serve's gRPC proxy. `tls`: connect
        over TLS, trusting `root_certificates` (PEM; None: the system's); `private_key` and `certificate_chain`
        (PEM) are this client's certificate for mutual TLS. `api_key`: sent as `authorization: Bearer KEY`."""
        if tls or root_certificates is not None or certificate_chain is not None:
            creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            self.channel = grpc.secure_channel(address, creds)
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = dspark_pb2_grpc.GenerationStub(self.channel)
        metadata = ([("application", application)] if application else []) + (
            [("authorization", f"Bearer {api_key}")] if api_key else [])
        self.metadata = tuple(metadata) or None

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def request(prompt: str | list[int] | list[dict], *, request_id: str = "",
                num_speculative_tokens: int | None = None,
                confidence_threshold: float | None = None, disable_speculation: bool = False,
                **sampling: Any) -> pb.GenerateRequest:
        """`prompt`: text, token ids, or chat messages ({role, content} dicts, rendered by the server's chat
        template). `sampling`: temperature, top_p, top_k, min_p, seed, max_tokens, stop, stop_token_ids, ignore_eos,
        structured_outputs (a pb.StructuredOutputs), ..."""
        req = pb.GenerateRequest(request_id=request_id)
        if isinstance(prompt, str):
            req.text = prompt
        elif prompt and isinstance(prompt[0], dict):
            req.chat.messages.extend(pb.ChatMessage(**m) for m in prompt)
        else:
            req.token_ids.ids.extend(prompt)
        for key, value in sampling.items():
            if value is None:
                continue
            if key in ("stop", "stop_token_ids"):
                getattr(req.sampling, key).extend(value)
            elif key == "structured_outputs":
                req.sampling.structured_outputs.CopyFrom(value)
            else:
                setattr(req.sampling, key, value)
        if num_speculative_tokens is not None:
            req.speculative.num_speculative_tokens = num_speculative_tokens
        if confidence_threshold is not None:
            req.speculative.confidence_threshold = confidence_threshold
        req.speculative.disable = disable_speculation
        return req

    def stream(self, prompt: str | list[int] | list[dict], timeout: float | None = None,
               **kw: Any) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(self.request(prompt, **kw), timeout=timeout, metadata=self.metadata)

    def generate(self, prompt: str | list[int] | list[dict], timeout: float | None = None,
                 **kw: Any) -> dict[str, Any]:
        """Run to completion: the offline CLI's JSON shape (token_ids, text, finish_reason, stats)."""
        for msg in self.stream(prompt, timeout=timeout, **kw):
            if msg.HasField("complete"):
                c = msg.complete
                return {"request_id": msg.request_id, "token_ids": list(c.output_ids), "text": c.text,
                        "finish_reason": FINISH_NAMES.get(c.finish_reason, "unknown"), "stats": stats_dict(c.stats)}
        raise RuntimeError("stream ended without a final message")

    def abort(self, *request_ids: str) -> list[str]:
        return list(self.stub.Abort(pb.AbortRequest(request_ids=request_ids), metadata=self.metadata).aborted)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata, timeout=30)

    def server_stats(self) -> pb.ServerStats:
        return self.stub.GetServerStats(pb.GetServerStatsRequest(), metadata=self.metadata, timeout=30)

    def health(self, service: str = "") -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        status = stub.Check(health_pb2.HealthCheckRequest(service=service)).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)
