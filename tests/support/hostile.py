"""A corpus of hostile requests against the coordinator and every role's HTTP API.

Each case names its target (a role, or "coordinator"), a path and a body
(bytes are sent as they are, anything else as JSON).  Every one must get a
4xx JSON error body (a few marked `may_succeed` are legal inputs at the edge,
such as a 1x1 image: they may also succeed, but never 5xx).  Role cases that
need a realistic starting point mutate a real render answer (`rendered`).
"""

from __future__ import annotations

import base64
import copy
import functools
import io
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
from PIL import Image

from tests.support.images import encode, noise_image

MODEL = "epd-demo-qwen2-vl"
CHAT = "/v1/chat/completions"
GENERATE = "/inference/v1/generate"


@dataclass(frozen=True)
class Case:
    name: str
    target: str            # "coordinator" | "admin" (its admin API) | "render" | "encode" | "prefill" | "decode"
    path: str
    body: Any              # bytes: sent raw; otherwise JSON
    may_succeed: bool = False
    headers: tuple[tuple[str, bytes], ...] = ()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat_with(*parts: dict, **extra: Any) -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}],
            "max_tokens": 2, **extra}


def png_url(data: bytes) -> str:
    return "data:image/png;base64," + b64(data)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


@functools.lru_cache(maxsize=2)
def png_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A valid grey PNG claiming width x height pixels (1.2 MB; 400 MB once decoded), built 100 rows at a time."""
    compressor, rows = zlib.compressobj(1), b"\0" * ((width + 1) * 100)
    idat = b"".join(compressor.compress(rows) for _ in range(height // 100)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def jpeg_bytes(width: int = 64, height: int = 64) -> bytes:
    buffer = io.BytesIO()
    noise_image(width, height, 3).save(buffer, format="JPEG")
    return buffer.getvalue()


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def coordinator_cases() -> list[Case]:
    png = encode(noise_image(56, 56, 7))
    cases = [
        Case("malformed_json", "coordinator", CHAT, b"{not json"),
        Case("empty_body", "coordinator", CHAT, b""),
        Case("json_array", "coordinator", CHAT, [1, 2, 3]),
        Case("json_string", "coordinator", CHAT, "hello"),
        Case("nan_literal", "coordinator", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], '
                                                   b'"temperature": NaN}'),
        Case("deeply_nested_body", "coordinator", CHAT, nested(200_000)),
        Case("deeply_nested_content", "coordinator", CHAT,
             b'{"messages": [{"role": "user", "content": ' + nested(900) + b"}]}"),
        Case("invalid_utf8", "coordinator", CHAT, b'{"messages": "\xff\xfe"}'),
        Case("messages_wrong_type", "coordinator", CHAT, {"messages": 5}),
        Case("content_wrong_type", "coordinator", CHAT, {"messages": [{"role": "user", "content": 17}]}),
        Case("unknown_role", "coordinator", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}),
        Case("max_tokens_string", "coordinator", CHAT, chat_with(max_tokens="ten")),
        Case("max_tokens_huge", "coordinator", CHAT, chat_with(max_tokens=10**30)),
        Case("max_tokens_negative", "coordinator", CHAT, chat_with(max_tokens=-1)),
        Case("temperature_negative_huge", "coordinator", CHAT, chat_with(temperature=-1e308)),
        Case("top_p_out_of_range", "coordinator", CHAT, chat_with(top_p=2.5)),
        Case("seed_beyond_int64", "coordinator", CHAT, chat_with(seed=2**70)),
        Case("stop_ten_thousand", "coordinator", CHAT, chat_with(stop=["x"] * 10_000), may_succeed=True),
        Case("stream_not_bool", "coordinator", CHAT, chat_with(stream="yes")),
        Case("n_zero", "coordinator", CHAT, chat_with(n=0)),
        Case("n_beyond_int64", "coordinator", CHAT, chat_with(n=2**70)),
        Case("enormous_string", "coordinator", CHAT,
             {"messages": [{"role": "user", "content": "a " * 1_000_000}], "max_tokens": 2}),
        Case("enormous_model_name", "coordinator", CHAT, chat_with(model="m" * 100_000)),
        Case("invalid_base64_image", "coordinator", CHAT, chat_with(image_part("data:image/png;base64,!!!="))),
        Case("corrupt_png", "coordinator", CHAT, chat_with(image_part(png_url(png[:8] + b"\0" * 200)))),
        Case("truncated_png", "coordinator", CHAT, chat_with(image_part(png_url(png[: len(png) // 2])))),
        Case("truncated_jpeg", "coordinator", CHAT,
             chat_with(image_part("data:image/jpeg;base64," + b64(jpeg_bytes()[:300])))),
        Case("decompression_bomb_20000px", "coordinator", CHAT, chat_with(image_part(png_url(png_bomb())))),
        Case("image_1x1", "coordinator", CHAT, chat_with(image_part(png_url(encode(Image.new("RGB", (1, 1)))))),
             may_succeed=True),
        Case("image_extreme_aspect", "coordinator", CHAT,
             chat_with(image_part(png_url(encode(Image.new("RGB", (4000, 2))))))),
        Case("svg_as_image", "coordinator", CHAT,
             chat_with(image_part("data:image/svg+xml;base64," + b64(b"<svg xmlns='http://www.w3.org/2000/svg'/>")))),
        Case("image_url_not_string", "coordinator", CHAT, chat_with({"type": "image_url", "image_url": {"url": 5}})),
        Case("unknown_part_type", "coordinator", CHAT, chat_with({"type": "hologram", "hologram": {}})),
        Case("too_many_tokens_in_prompt_ids", "coordinator", "/v1/completions",
             {"prompt": [1] * 100_000, "max_tokens": 2}),
        Case("prompt_ids_out_of_vocab", "coordinator", "/v1/completions", {"prompt": [2**31 - 1], "max_tokens": 2}),
        Case("prompt_ids_negative", "coordinator", "/v1/completions", {"prompt": [-5, 3], "max_tokens": 2}),
    ]
    return cases + ssrf_cases() + generate_cases() + control_cases() + limit_cases()


def limit_cases() -> list[Case]:
    """Size, deadline, id and uuid games (docs/security.md)."""
    uuid_part = {"type": "image_url", "image_url": {"url": png_url(encode(noise_image(56, 56, 8)))}}
    return [
        Case("enormous_message_20mb", "coordinator", CHAT,
             {"messages": [{"role": "user", "content": "x" * 20_000_000}], "max_tokens": 2}),
        Case("enormous_message_words", "coordinator", CHAT,
             {"messages": [{"role": "user", "content": "word " * 2_000_000}], "max_tokens": 2}),
        Case("request_timeout_not_a_number", "coordinator", CHAT, chat_with(),
             headers=(("X-Request-Timeout", b"soon"),)),
        Case("request_timeout_negative", "coordinator", CHAT, chat_with(), headers=(("X-Request-Timeout", b"-5"),)),
        Case("request_timeout_infinite", "coordinator", GENERATE, {"token_ids": [1, 2], "sampling_params": {
            "max_tokens": 2}}, headers=(("X-Request-Timeout", b"inf"),)),
        Case("x_request_id_too_long", "coordinator", CHAT, chat_with(), headers=(("X-Request-Id", b"r" * 300),)),
        Case("uuid_not_a_string", "coordinator", CHAT, chat_with({**uuid_part, "uuid": 5})),
        Case("uuid_empty", "coordinator", CHAT, chat_with({**uuid_part, "uuid": ""})),
        Case("uuid_huge", "coordinator", CHAT, chat_with({**uuid_part, "uuid": "u" * 5000})),
        Case("uuid_inside_image_url_not_a_string", "coordinator", CHAT, chat_with(
            {"type": "image_url", "image_url": {"url": uuid_part["image_url"]["url"], "uuid": ["a"]}})),
        Case("content_part_uuid_huge", "coordinator", GENERATE, {"token_ids": [151652, 151655, 151653],
             "content_parts": [{"type": "image_url", "url": uuid_part["image_url"]["url"], "uuid": "u" * 5000}]}),
        Case("cache_salt_empty", "coordinator", CHAT, chat_with(cache_salt="")),
        Case("unknown_route", "coordinator", "/v1/admin/shutdown", {}),
        Case("wrong_method", "coordinator", "/v1/models", {}),
    ]


def control_cases() -> list[Case]:
    return [
        Case("announce_unknown_role", "admin", "/v1/instances", {"role": "oracle", "grpc_address": "a:1"}),
        Case("announce_bad_address", "admin", "/v1/instances", {"role": "encode", "grpc_address": "a b"}),
        Case("announce_port_out_of_range", "admin", "/v1/instances",
             {"role": "encode", "grpc_address": "10.0.0.1:70000"}),
        Case("announce_url_with_path", "admin", "/v1/instances",
             {"role": "encode", "grpc_address": "10.0.0.1:5", "http_url": "http://x:1/../../admin"}),
        Case("abort_ids_not_a_list", "admin", "/abort_requests", {"request_ids": "all"}),
        Case("abort_malformed", "admin", "/abort_requests", b"\xff"),
        Case("announce_on_the_public_port", "coordinator", "/v1/instances",
             {"role": "encode", "grpc_address": "10.0.0.1:5"}),
        Case("abort_on_the_public_port", "coordinator", "/abort_requests", {"request_ids": ["x"]}),
    ]


def ssrf_cases() -> list[Case]:
    urls = {
        "ssrf_loopback": "http://127.0.0.1:9/x.png",
        "ssrf_localhost": "http://localhost:9/x.png",
        "ssrf_ipv6_loopback": "http://[::1]:9/x.png",
        "ssrf_ipv4_mapped_ipv6": "http://[::ffff:127.0.0.1]:9/x.png",
        "ssrf_ipv4_mapped_ipv6_hex": "http://[::ffff:7f00:1]:9/x.png",
        "ssrf_decimal_ip": "http://2130706433:9/x.png",
        "ssrf_hex_ip": "http://0x7f000001:9/x.png",
        "ssrf_zero_ip": "http://0.0.0.0:9/x.png",
        "ssrf_metadata": "http://169.254.169.254/latest/meta-data/",
        "ssrf_private": "http://10.0.0.1/x.png",
        "ssrf_userinfo_trick": "http://public.example@127.0.0.1:9/x.png",
        "ssrf_redirect_via_loopback": "http://127.0.0.1:9/redirect?to=http://169.254.169.254/",
        "ssrf_file_scheme": "file:///etc/passwd",
        "ssrf_gopher_scheme": "gopher://127.0.0.1:6379/_FLUSHALL",
        "url_host_label_too_long": "http://" + "a" * 300 + ".invalid/x.png",
    }
    return [Case(name, "coordinator", CHAT, chat_with(image_part(url))) for name, url in urls.items()]


def generate_cases() -> list[Case]:
    base = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    return [
        Case("generate_empty_tokens", "coordinator", GENERATE, {**base, "token_ids": []}),
        Case("generate_token_bool", "coordinator", GENERATE, {**base, "token_ids": [True]}),
        Case("generate_token_huge", "coordinator", GENERATE, {**base, "token_ids": [2**40]}),
        Case("generate_features_and_parts", "coordinator", GENERATE,
             {**base, "content_parts": [{"type": "image_url", "url": "http://127.0.0.1:9/x"}],
              "features": {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 1}]}}}),
        Case("generate_placeholder_out_of_range", "coordinator", GENERATE,
             {**base, "features": {"mm_hashes": {"image": ["h"]},
                                   "mm_placeholders": {"image": [{"offset": 2, "length": 50}]},
                                   "mm_metadata": {"image": [b64(b"\x80")]}},
              "ec_transfer_params": {"h": {"backend": "shm"}}}),
        Case("generate_ssrf_content_part", "coordinator", GENERATE,
             {**base, "content_parts": [{"type": "image_url", "url": "http://[::1]:9/x.png"}]}),
        Case("generate_request_id_unicode", "coordinator", GENERATE, {**base, "request_id": "caf\u00e9\u2603"}),
        Case("generate_request_id_newline", "coordinator", GENERATE, {**base, "request_id": "a\nb"}),
        Case("generate_request_id_huge", "coordinator", GENERATE, {**base, "request_id": "x" * 100_000}),
        Case("generate_cache_salt_lone_surrogate", "coordinator", GENERATE,
             b'{"token_ids": [1, 2], "cache_salt": "\\udafe"}'),
        Case("chat_lone_surrogate", "coordinator", CHAT,
             b'{"messages": [{"role": "user", "content": "\\ud800 hi"}], "max_tokens": 2}'),
        Case("x_request_id_latin1", "coordinator", CHAT, chat_with(), headers=(("X-Request-Id", b"caf\xe9"),)),
    ]


def _features(rendered: dict) -> dict:
    return rendered["features"]


def _with_kwargs(rendered: dict, payload: str) -> dict:
    body = copy.deepcopy(rendered)
    _features(body)["kwargs_data"]["image"][0] = payload
    return body


def _pickle_msgpack() -> bytes:
    evil = pickle.dumps(("os", "system", "echo pwned"))
    return msgpack.packb({"pixel_values": {"data": ["float32", [1], msgpack.ExtType(1, evil)],
                                           "field": ["batched", {}]}}, use_bin_type=True)


def role_cases(rendered: dict) -> list[Case]:
    """Cases for each role's HTTP API, built from a real render answer (one image)."""
    hash0 = _features(rendered)["mm_hashes"]["image"][0]
    meta_only = copy.deepcopy(rendered)
    _features(meta_only)["kwargs_data"] = None
    bogus_handle = {"backend": "shm", "key": "k", "segment": "../../etc/passwd", "slot": 0, "generation": 1,
                    "offset": 0, "length": 8, "checksum": None, "tensors": []}
    bad_kv = {"handle": bogus_handle, "num_prompt_tokens": 3, "rope_delta": 0, "first_token_id": 1}
    decode = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    no_pixels = _with_kwargs(rendered, _features(rendered)["mm_metadata"]["image"][0])
    _features(no_pixels)["mm_hashes"]["image"][0] = "no-pixels-" + hash0
    return [
        Case("generate_features_unknown_hash_no_handle", "coordinator", GENERATE, {**meta_only, "features": {
            **_features(meta_only), "mm_hashes": {"image": ["unknown-" + hash0]}}}),
        Case("generate_kwargs_without_pixels", "coordinator", GENERATE, no_pixels),
        Case("generate_bogus_ec_handle", "coordinator", GENERATE, {**meta_only, "ec_transfer_params": {
            hash0: bogus_handle}}),
        Case("render_malformed_json", "render", "/v1/chat/completions/render", b"{]"),
        Case("render_ssrf", "render", "/v1/chat/completions/render", chat_with(image_part("http://[::1]:9/x"))),
        Case("render_bomb", "render", "/v1/chat/completions/render", chat_with(image_part(png_url(png_bomb())))),
        Case("render_tokenize_wrong_type", "render", "/tokenize", {"prompt": 12}),
        Case("render_detokenize_negative", "render", "/detokenize", {"tokens": [-1]}),
        Case("render_detokenize_huge", "render", "/detokenize", {"tokens": [2**40]}),
        Case("encode_invalid_base64", "encode", GENERATE, _with_kwargs(rendered, "@@@")),
        Case("encode_not_msgpack", "encode", GENERATE, _with_kwargs(rendered, b64(b"\xc1\xc1\xc1 not msgpack"))),
        Case("encode_msgpack_list", "encode", GENERATE, _with_kwargs(rendered, b64(msgpack.packb([1, 2, 3])))),
        Case("encode_pickle_in_msgpack", "encode", GENERATE, _with_kwargs(rendered, b64(_pickle_msgpack()))),
        Case("encode_tensor_shape_lies", "encode", GENERATE, _with_kwargs(rendered, b64(msgpack.packb(
            {"pixel_values": {"data": ["float32", [10**9, 10**9], msgpack.ExtType(3, b"\0" * 8)],
                              "field": ["batched", {}]}}, use_bin_type=True)))),
        Case("encode_unknown_mm_hash", "encode", GENERATE, {**meta_only, "features": {
            **_features(meta_only), "mm_hashes": {"image": ["never-seen-" + hash0]}}}),
        Case("encode_no_items", "encode", GENERATE, {"token_ids": [1]}),
        Case("prefill_bogus_ec_params", "prefill", GENERATE, {**meta_only, "ec_transfer_params": {
            hash0: bogus_handle}}),
        Case("prefill_ec_params_not_object", "prefill", GENERATE, {**meta_only, "ec_transfer_params": {hash0: 5}}),
        Case("prefill_token_out_of_vocab", "prefill", GENERATE, {"token_ids": [2**31 - 1]}),
        Case("prefill_missing_ec_params", "prefill", GENERATE, meta_only),
        Case("decode_missing_kv", "decode", GENERATE, decode),
        Case("decode_path_traversal_segment", "decode", GENERATE, {**decode, "kv_transfer_params": bad_kv}),
        Case("decode_kv_not_object", "decode", GENERATE, {**decode, "kv_transfer_params": {"handle": "x"}}),
        Case("decode_kv_wrong_backend", "decode", GENERATE,
             {**decode, "kv_transfer_params": {**bad_kv, "handle": {"backend": "tape"}}}),
        Case("decode_kv_huge_numbers", "decode", GENERATE,
             {**decode, "kv_transfer_params": {**bad_kv, "num_prompt_tokens": 10**12, "rope_delta": -10**12}}),
        Case("decode_abort_wrong_type", "decode", "/abort_requests", {"request_ids": "all"}),
        Case("prefill_abort_malformed", "prefill", "/abort_requests", b"\x00\x01"),
    ]
