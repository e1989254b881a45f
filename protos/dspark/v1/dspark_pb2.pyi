from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "logprobs", "include_stop_str_in_output", "skip_special_tokens", "n", "structured_outputs", "prompt_logprobs", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_tokens: int
    logprobs: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    n: int
    structured_outputs: StructuredOutputs
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar", "structural_tag", "disable_any_whitespace")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    structural_tag: str
    disable_any_whitespace: bool
    def __init__(self, json: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class SpeculativeOverrides(_message.Message):
    __slots__ = ("num_speculative_tokens", "confidence_threshold", "disable")
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    DISABLE_FIELD_NUMBER: _ClassVar[int]
    num_speculative_tokens: int
    confidence_threshold: float
    disable: bool
    def __init__(self, num_speculative_tokens: _Optional[int] = ..., confidence_threshold: _Optional[float] = ..., disable: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools_json", "tool_choice", "tool_choice_function", "parallel_tool_calls")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    tools_json: str
    tool_choice: str
    tool_choice_function: str
    parallel_tool_calls: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools_json: _Optional[str] = ..., tool_choice: _Optional[str] = ..., tool_choice_function: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "speculative")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: Chat
    sampling: SamplingParams
    speculative: SpeculativeOverrides
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., speculative: _Optional[_Union[SpeculativeOverrides, _Mapping]] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("num_spec_steps", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length", "draft_acceptance_rate", "per_position_accepted", "accepted_per_step", "draft_ms", "verify_ms", "transfer_ms", "queue_ms", "first_token_ms", "cached_tokens", "verified_per_step", "gateway_intake_ms", "gateway_first_token_ms", "finish_ms")
    NUM_SPEC_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    PER_POSITION_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_INTAKE_MS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    FINISH_MS_FIELD_NUMBER: _ClassVar[int]
    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float
    draft_acceptance_rate: float
    per_position_accepted: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_step: _containers.RepeatedScalarFieldContainer[int]
    draft_ms: float
    verify_ms: float
    transfer_ms: float
    queue_ms: float
    first_token_ms: float
    cached_tokens: int
    verified_per_step: _containers.RepeatedScalarFieldContainer[int]
    gateway_intake_ms: float
    gateway_first_token_ms: float
    finish_ms: float
    def __init__(self, num_spec_steps: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., draft_acceptance_rate: _Optional[float] = ..., per_position_accepted: _Optional[_Iterable[int]] = ..., accepted_per_step: _Optional[_Iterable[int]] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., first_token_ms: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., verified_per_step: _Optional[_Iterable[int]] = ..., gateway_intake_ms: _Optional[float] = ..., gateway_first_token_ms: _Optional[float] = ..., finish_ms: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "num_output_tokens", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    num_output_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., num_output_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateComplete(_message.Message):
    __slots__ = ("output_ids", "text", "finish_reason", "num_prompt_tokens", "stats")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    stats: SpecStats
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., stats: _Optional[_Union[SpecStats, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "complete", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: GenerateChunk
    complete: GenerateComplete
    index: int
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., complete: _Optional[_Union[GenerateComplete, _Mapping]] = ..., index: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted: _Optional[_Iterable[str]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("target", "draft", "method", "vocab_size", "max_model_len", "num_speculative_tokens", "eos_token_ids", "has_tokenizer", "served_model_name", "has_chat_template")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    target: str
    draft: str
    method: str
    vocab_size: int
    max_model_len: int
    num_speculative_tokens: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_tokenizer: bool
    served_model_name: str
    has_chat_template: bool
    def __init__(self, target: _Optional[str] = ..., draft: _Optional[str] = ..., method: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_tokenizer: _Optional[bool] = ..., served_model_name: _Optional[str] = ..., has_chat_template: _Optional[bool] = ...) -> None: ...

class GetServerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "free_target_blocks", "total_target_blocks", "free_draft_blocks", "total_draft_blocks", "requests_finished", "tokens_generated", "mean_acceptance_length", "steps", "draining", "num_cuda_graphs", "speculating", "finished_by_reason", "num_kernel_compiles", "loop_steps", "loop_step_s", "loop_intake_s", "loop_publish_s")
    class FinishedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_TARGET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TARGET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_DRAFT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_DRAFT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    SPECULATING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_KERNEL_COMPILES_FIELD_NUMBER: _ClassVar[int]
    LOOP_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOOP_STEP_S_FIELD_NUMBER: _ClassVar[int]
    LOOP_INTAKE_S_FIELD_NUMBER: _ClassVar[int]
    LOOP_PUBLISH_S_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    free_target_blocks: int
    total_target_blocks: int
    free_draft_blocks: int
    total_draft_blocks: int
    requests_finished: int
    tokens_generated: int
    mean_acceptance_length: float
    steps: int
    draining: bool
    num_cuda_graphs: int
    speculating: bool
    finished_by_reason: _containers.ScalarMap[str, int]
    num_kernel_compiles: int
    loop_steps: int
    loop_step_s: float
    loop_intake_s: float
    loop_publish_s: float
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., free_target_blocks: _Optional[int] = ..., total_target_blocks: _Optional[int] = ..., free_draft_blocks: _Optional[int] = ..., total_draft_blocks: _Optional[int] = ..., requests_finished: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., steps: _Optional[int] = ..., draining: _Optional[bool] = ..., num_cuda_graphs: _Optional[int] = ..., speculating: _Optional[bool] = ..., finished_by_reason: _Optional[_Mapping[str, int]] = ..., num_kernel_compiles: _Optional[int] = ..., loop_steps: _Optional[int] = ..., loop_step_s: _Optional[float] = ..., loop_intake_s: _Optional[float] = ..., loop_publish_s: _Optional[float] = ...) -> None: ...
