from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MultiModalItem(_message.Message):
    __slots__ = ("modality", "mm_hash", "offset", "length", "kwargs_data", "mm_metadata", "kwargs_ref_json")
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    KWARGS_DATA_FIELD_NUMBER: _ClassVar[int]
    MM_METADATA_FIELD_NUMBER: _ClassVar[int]
    KWARGS_REF_JSON_FIELD_NUMBER: _ClassVar[int]
    modality: str
    mm_hash: str
    offset: int
    length: int
    kwargs_data: bytes
    mm_metadata: bytes
    kwargs_ref_json: bytes
    def __init__(self, modality: _Optional[str] = ..., mm_hash: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., kwargs_data: _Optional[bytes] = ..., mm_metadata: _Optional[bytes] = ..., kwargs_ref_json: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens", "include_stop_str_in_output", "logprobs", "n", "prompt_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    logprobs: int
    n: int
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class RenderChatRequest(_message.Message):
    __slots__ = ("request_id", "chat_request_json")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_REQUEST_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chat_request_json: bytes
    def __init__(self, request_id: _Optional[str] = ..., chat_request_json: _Optional[bytes] = ...) -> None: ...

class RenderCompletionRequest(_message.Message):
    __slots__ = ("request_id", "completion_request_json")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_REQUEST_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    completion_request_json: bytes
    def __init__(self, request_id: _Optional[str] = ..., completion_request_json: _Optional[bytes] = ...) -> None: ...

class RenderResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "items", "sampling_params_json", "model", "cache_salt", "max_model_len")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    sampling_params_json: bytes
    model: str
    cache_salt: str
    max_model_len: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., sampling_params_json: _Optional[bytes] = ..., model: _Optional[str] = ..., cache_salt: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class RenderContentPartsRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "content_parts_json", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_PARTS_JSON_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    content_parts_json: bytes
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., content_parts_json: _Optional[bytes] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "items", "weight_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    weight_version: str
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., weight_version: _Optional[str] = ...) -> None: ...

class EncodedItem(_message.Message):
    __slots__ = ("mm_hash", "handle_json", "cache_hit")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    HANDLE_JSON_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    handle_json: bytes
    cache_hit: bool
    def __init__(self, mm_hash: _Optional[str] = ..., handle_json: _Optional[bytes] = ..., cache_hit: _Optional[bool] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("request_id", "items", "weight_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[EncodedItem]
    weight_version: str
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[EncodedItem, _Mapping]]] = ..., weight_version: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "items", "ec_transfer_params_json", "sampling", "cache_salt", "weight_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    EC_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    ec_transfer_params_json: bytes
    sampling: SamplingParams
    cache_salt: str
    weight_version: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ..., ec_transfer_params_json: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., weight_version: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "kv_transfer_params_json", "prompt_tokens", "cached_tokens", "first_token_ids", "weight_version", "prompt_logprobs_json")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_JSON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    kv_transfer_params_json: bytes
    prompt_tokens: int
    cached_tokens: int
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    weight_version: str
    prompt_logprobs_json: bytes
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., kv_transfer_params_json: _Optional[bytes] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., weight_version: _Optional[str] = ..., prompt_logprobs_json: _Optional[bytes] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "kv_transfer_params_json", "sampling", "prompt_tokens", "first_token_id", "prompt_token_ids", "resumed_token_ids", "weight_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_transfer_params_json: bytes
    sampling: SamplingParams
    prompt_tokens: int
    first_token_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    weight_version: str
    def __init__(self, request_id: _Optional[str] = ..., kv_transfer_params_json: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., first_token_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., resumed_token_ids: _Optional[_Iterable[int]] = ..., weight_version: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stop_reason", "usage", "logprobs_json", "index", "weight_version")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_JSON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stop_reason: str
    usage: Usage
    logprobs_json: bytes
    index: int
    weight_version: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs_json: _Optional[bytes] = ..., index: _Optional[int] = ..., weight_version: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("weight_version", "path")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    path: str
    def __init__(self, weight_version: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class WeightsInfo(_message.Message):
    __slots__ = ("weight_version", "path", "staged_version", "stage_s", "commit_s")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STAGED_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_S_FIELD_NUMBER: _ClassVar[int]
    COMMIT_S_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    path: str
    staged_version: str
    stage_s: float
    commit_s: float
    def __init__(self, weight_version: _Optional[str] = ..., path: _Optional[str] = ..., staged_version: _Optional[str] = ..., stage_s: _Optional[float] = ..., commit_s: _Optional[float] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    def __init__(self, weight_version: _Optional[str] = ...) -> None: ...

class DiscardRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    def __init__(self, weight_version: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    def __init__(self, weight_version: _Optional[str] = ...) -> None: ...
