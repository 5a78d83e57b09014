"""The settings of every epd process, in frozen sections: server, checkpoint, stores, cluster, engines, cpu,
limits, security (services/config/__init__.py puts them together as EpdConfig).

Each setting is a field of one section; its flag (`--ec-connector`) and environment variable (`EPD_EC_CONNECTOR`)
come from the field name alone, so names are unique across sections and the same in every process.  Each section
checks its own fields when it is made (`__post_init__`); an invalid value is a ConfigError naming it.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.edge.auth import KeySet, parse_keys
from services.kernels.spec import FAMILIES as KERNEL_FAMILIES
from services.kernels.spec import KERNELS as _KERNELS
from services.rpc.tls import check_files

from .checks import ConfigError, _at_least, _check, _one_of, _role_map_ok, flag_name, is_loopback

CONNECTORS = ("shm", "redis")
DEVICES_PREFIXES = ("cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_DECODE_SLOTS, CUDA_DECODE_SLOTS = 16, 64   # --decode-slots auto (CUDA: the rows its CUDA graphs are captured for)
# The built-in demo models: alias -> (the size services/models/demo.py builds, the model id clients send).
DEMO_ALIASES = {"demo": ("tiny", "epd-demo-qwen2-vl"), "epd-demo-qwen2-vl": ("tiny", "epd-demo-qwen2-vl"),
                "demo-medium": ("medium", "epd-demo-qwen2-vl-medium"), "demo-deep": ("deep", "epd-demo-qwen2-vl-deep")}
LINEAR_KERNELS = ("auto", "panel", "prepacked", "default")   # services.models.prepack.MODES (checked by a test)
ROLES = ("coordinator", "render", "encode", "prefill", "decode")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")   # vLLM's LogprobsMode
EVENT_LOOPS = ("uvloop", "asyncio")   # services.runtime.event_loop.LOOPS (checked by a test)
# The names of coordinator.routing.policies.POLICIES (checked by a test): config cannot import the coordinator.
ROUTING_POLICIES = ("affinity", "least_loaded", "round_robin")
SWITCHES = ("auto", "on", "off")
KERNEL_NAMES = tuple(sorted(_KERNELS))


def _names(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def _f(default: Any, help: str, roles: str = "all", **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, "roles": roles, **kw})


@dataclass(frozen=True)
class ServerConfig:
    """Where a process listens and how it runs."""

    host: str = _f("127.0.0.1", "address the HTTP and gRPC servers bind")
    port: int = _f(8000, "coordinator HTTP port")
    grpc_port: int = _f(0, "this role's gRPC port (role processes; 0 = pick a free one)", roles="roles")
    http_port: int = _f(0, "this role's HTTP port (role processes; 0 = pick a free one)", roles="roles")
    grpc_host: str = _f("", "address role processes bind their gRPC server to (default: --host); e.g. 127.0.0.1 "
                        "when the coordinator is in the same pod", roles="roles")
    advertise_host: str = _f("", "host the coordinator reaches this role at when announcing (default: --host)",
                             roles="roles")
    instance_id: str = _f("", "unique id of this process; part of every shm and Redis name (default: random)")
    coordinator_url: str = _f("", "role processes: announce this instance to the coordinator's admin API at "
                              "this URL (POST /v1/instances, with --admin-token) at start, every 10 s, and every "
                              "second while no coordinator probe reaches it",
                              roles="roles")
    log_level: str = _f("info", "debug | info | warning | error")
    event_loop: str = _f("uvloop", "the event loop of every epd process: uvloop | asyncio (the standard library's)")
    fast_lane: bool = _f(True, "same-host calls between the coordinator and the roles over a private Unix socket "
                         "instead of gRPC (plaintext gRPC to loopback addresses only; docs/architecture.md); off: "
                         "every call over gRPC, e.g. to compare the two or where no private socket folder exists")
    shutdown_grace_s: float = _f(25.0, "on SIGTERM, seconds running requests get to finish: readiness turns "
                                 "false at once, new work is refused, then the process stops (keep it below "
                                 "the pods' terminationGracePeriodSeconds)")
    enable_per_request_metrics: bool = _f(False, "add vLLM's per-request `metrics` (time to first token, queue, "
                                          "generation time, mean inter-token latency, tokens/s) to chat and "
                                          "completion answers; streamed, on the include_usage chunk",
                                          roles="coordinator")

    def __post_init__(self) -> None:
        _one_of(self, ("event_loop",), EVENT_LOOPS)
        _check(all(0 <= p < 65536 for p in (self.port, self.grpc_port, self.http_port)), "ports must be in 0..65535")
        _at_least(self, ("shutdown_grace_s",), 0)
        if not self.instance_id:
            object.__setattr__(self, "instance_id", uuid.uuid4().hex[:8])


@dataclass(frozen=True)
class CheckpointConfig:
    """The model served and how its weights are loaded."""

    model: str = _f("demo", "Hugging Face id or local checkpoint folder; 'demo' is the built-in tiny Qwen2-VL")
    served_model_name: str = _f("", "model id clients send (default: the model's folder name or 'epd-demo-qwen2-vl')")
    device: str = _f("cpu", "torch device of model roles: cpu, cuda, cuda:N")
    dtype: str = _f("auto", "model dtype: auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 (CPU decode: "
                    "float32 math over bf16 weights) | float16")
    max_model_len: int = _f(8192, "upper bound on the context length (prompt + output tokens); every process uses "
                            "the smaller of it and the checkpoint's max_position_embeddings "
                            "(services/models/context.py)")

    def __post_init__(self) -> None:
        _one_of(self, ("dtype",), DTYPES)
        _check(self.device.split(":")[0] in DEVICES_PREFIXES, "device must be cpu, cuda or cuda:N")
        _at_least(self, ("max_model_len",), 1)

    def served_model_id(self) -> str:
        """The model id clients send and responses carry."""
        if self.served_model_name:
            return self.served_model_name
        if self.model in DEMO_ALIASES:
            return DEMO_ALIASES[self.model][1]
        return os.path.basename(os.path.normpath(self.model)) if os.path.isdir(self.model) else self.model


@dataclass(frozen=True)
class StoresConfig:
    """The connectors: where processed images, embeddings and KV caches travel."""

    ec_connector: str = _f("shm", "where image embeddings travel from encode to prefill: shm | redis")
    kv_connector: str = _f("shm", "where KV caches travel from prefill to decode: shm | redis")
    redis_url: str = _f("redis://127.0.0.1:6379/0", "Redis for the redis connectors: redis://host:port/db, or "
                        "redis+cluster://host:port,host:port for a Redis Cluster (entries spread over its nodes)")
    ec_capacity_mb: int = _f(256, "bytes (MiB) the EC store of one encode instance may hold")
    kv_capacity_mb: int = _f(256, "bytes (MiB) the KV store of one prefill instance may hold")
    ec_ttl_s: float = _f(600.0, "seconds an embedding stays in the EC store")
    kv_ttl_s: float = _f(120.0, "seconds a KV entry waits for its decode")
    mm_capacity_mb: int = _f(256, "bytes (MiB) of processed images (kwargs_data tensors) the mm store of one "
                             "render instance (or the coordinator, for features posted to it) may hold")
    mm_ttl_s: float = _f(120.0, "seconds a processed image stays in the mm store for encode to read")

    def __post_init__(self) -> None:
        _one_of(self, ("ec_connector", "kv_connector"), CONNECTORS)
        _at_least(self, ("ec_capacity_mb", "kv_capacity_mb", "mm_capacity_mb"), 1)


@dataclass(frozen=True)
class ClusterConfig:
    """Which instances make the cluster and how the coordinator routes to them."""

    encode_instances: int = _f(1, "encode processes `epd serve` starts", roles="serve")
    prefill_instances: int = _f(1, "prefill processes `epd serve` starts", roles="serve")
    decode_instances: int = _f(1, "decode processes `epd serve` starts", roles="serve")
    render_urls: str = _f("", "comma-separated gRPC addresses (host:port) of render instances", roles="coordinator")
    encode_urls: str = _f("", "comma-separated gRPC addresses of encode instances", roles="coordinator")
    prefill_urls: str = _f("", "comma-separated gRPC addresses of prefill instances", roles="coordinator")
    decode_urls: str = _f("", "comma-separated gRPC addresses of decode instances", roles="coordinator")
    render_http_urls: str = _f("", "comma-separated HTTP base URLs (http://host:port) of render instances, "
                               "in render_urls order (listed by GET /cluster)", roles="coordinator")
    encode_http_urls: str = _f("", "comma-separated encode HTTP base URLs (encode_urls order)", roles="coordinator")
    prefill_http_urls: str = _f("", "comma-separated HTTP base URLs of prefill instances (prefill_urls "
                                "order)", roles="coordinator")
    decode_http_urls: str = _f("", "comma-separated decode HTTP base URLs (decode_urls order)", roles="coordinator")
    openai_render_urls: str = _f("", "comma-separated HTTP base URLs of render instances on which encode, prefill and "
                                 "decode render llm-d's OpenAI-format /v1/chat/completions calls (in order, the "
                                 "next one when one is down; `epd serve` sets it)", roles="encode, prefill, decode")
    render_routing_policy: str = _f("least_loaded", "how the coordinator picks a render instance: "
                                    "least_loaded | round_robin | affinity", roles="coordinator")
    encode_routing_policy: str = _f("affinity", "how the coordinator picks an encode instance (affinity: "
                                    "by mm_hash, where the embedding likely is)", roles="coordinator")
    prefill_routing_policy: str = _f("least_loaded", "how the coordinator picks a prefill instance",
                                     roles="coordinator")
    decode_routing_policy: str = _f("least_loaded", "how the coordinator picks a decode instance", roles="coordinator")
    instance_forget_after_s: float = _f(30.0, "a registered instance that fails its health probes this long is "
                                        "forgotten", roles="coordinator")
    max_retries: int = _f(2, "retries one request gets after transport failures, all stages and instances "
                          "together; only the first failing instance is taken out (a request that crashes "
                          "instances must not take down the cluster)", roles="coordinator")
    weight_update_drain_s: float = _f(60.0, "POST /update_weights: how long requests on the old weights may take to "
                                      "finish before the switch aborts them (new requests wait meanwhile)",
                                      roles="coordinator")
    return_tokens_as_token_ids: bool = _f(False, "vLLM's --return-tokens-as-token-ids: logprobs name tokens "
                                          "'token_id:<id>' unless a request says otherwise (its "
                                          "return_tokens_as_token_ids)", roles="coordinator")

    def __post_init__(self) -> None:
        _at_least(self, ("encode_instances", "prefill_instances", "decode_instances"), 1)
        _at_least(self, ("weight_update_drain_s",), 0, strict=True)
        _at_least(self, ("instance_forget_after_s",), 0, strict=True)
        _at_least(self, ("max_retries",), 0)
        for role in ("render", "encode", "prefill", "decode"):
            policy, http = getattr(self, f"{role}_routing_policy"), self.http_urls(role)
            _check(policy in ROUTING_POLICIES,
                   f"{role}_routing_policy {policy!r} is unknown; supported: {', '.join(ROUTING_POLICIES)}")
            _check(not http or len(http) == len(self.urls(role)),
                   f"{role}_http_urls must list one URL per {role}_urls entry, in the same order")

    def urls(self, role: str) -> list[str]:
        raw = getattr(self, f"{role}_urls")
        return [u.strip().removeprefix("grpc://") for u in raw.split(",") if u.strip()]

    def http_urls(self, role: str) -> list[str]:
        """The HTTP base URLs of a role's instances (same order as `urls`); empty when not configured."""
        raw = getattr(self, f"{role}_http_urls")
        return [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]


@dataclass(frozen=True)
class EnginesConfig:
    """The roles' engines: batching, queues, KV pools, kernels."""

    render_workers: int = _f(0, "processes per render instance that decode and process images (several images "
                             "and requests at once); 0 = one per two cores, at least 1", roles="render")
    render_cache_mb: int = _f(256, "bytes (MiB) of processed images a render instance keeps by content hash, so "
                              "an image it has seen is not decoded and processed again", roles="render")
    encode_max_batch_tokens: int = _f(16384, "patches one vision-tower forward may take")
    encode_max_queue: int = _f(256, "items one encode instance holds (running + waiting); more are refused")
    max_num_batched_tokens: int = _f(2048, "prompt tokens one prefill forward may take: waiting prompts are "
                                     "batched up to it, longer prompts run in chunks of it", roles="prefill")
    prefix_cache_mb: int = _f(256, "bytes (MiB) of prompt KV blocks one prefill instance keeps for later prompts "
                              "with the same prefix (LRU; 0 turns the prefix cache off)", roles="prefill")
    prefill_inline_encode: bool = _f(True, "when no encode instance can take an item, prefill encodes it "
                                     "itself (loads the vision tower on first need)")
    prefill_max_queue: int = _f(32, "requests one prefill instance holds (running + waiting); more are "
                                "refused (429, the coordinator tries another instance)")
    decode_slots: int = _f(0, "concurrent sequences one decode instance runs (continuous batching); 0 (auto): 16 on "
                           f"CPU, {CUDA_DECODE_SLOTS} on CUDA (its CUDA graphs are captured up to it)")
    gpu_memory_fraction: float = _f(0.9, "CUDA: the share of the GPU's memory all epd roles on it may use together; "
                                    "decode's KV pool is what is left of it once loaded "
                                    "(services/decode/gpu_budget.py)")
    decode_queue: int = _f(64, "requests waiting for a decode slot before new ones are refused")
    kv_cache_mb: int = _f(1024, "bytes (MiB) of one decode instance's KV block pool; running and waiting "
                          "requests share it (each reserves prompt + max_tokens at admission)")
    kv_block_size: int = _f(16, "tokens per KV block of the decode pool")
    decode_kv_wait_s: float = _f(10.0, "seconds a request waits for room in the decode KV pool before 429")
    linear_kernel: str = _f("auto", "matmuls of model roles: auto (time F.linear, the panel C kernel and oneDNN "
                            "prepacked weights on the role's batch sizes, the LM head apart, keep the fastest; kept "
                            "in $EPD_CACHE_DIR/kernel-choices) | panel | prepacked | default (also transformers' RoPE)")
    decode_fused: str = _f("auto", "decode step as one C call over the whole decoder stack (float32 CPU, panel "
                           "linears, Llama/Qwen-shaped layers): auto (wherever it applies; with --linear-kernel auto "
                           "the decoder stack then uses the panel kernel) | on (refuse to start where it does not "
                           "apply) | off (the eager step)", roles="decode")
    lm_head_screen: str = _f("auto", "greedy tokens from an int8 or bfloat16 copy of a float32 panel LM head, "
                             "decided exactly in float32 on the candidates a proven bound leaves, and temperature "
                             "draws by rejection from the int8 copy's bound: auto | on | off",
                             roles="prefill, decode")
    kernels_off: str = _f("", "native kernels to leave off, comma-separated (services/kernels/spec.py names them: "
                          "resize, panel, fused_step, ...); torch's path runs instead: to rule a kernel out "
                          "when chasing a wrong answer or a crash, or to measure what it gains")
    cpu_features_off: str = _f("", "CPU features the native kernels must not use, comma-separated as /proc/cpuinfo "
                               "names them (avx512f, avx2, ...; all: the portable variants only): to run one variant "
                               "across a fleet of mixed CPUs, or to exercise a fallback")
    logprobs_mode: str = _f("raw_logprobs", "what logprobs report (vLLM's --logprobs-mode): raw_logprobs (the model's "
                            "distribution) | processed_logprobs (the one sampled from: after penalties, temperature, "
                            "top-k/top-p/min-p) | raw_logits | processed_logits; prompt logprobs are raw either way",
                            roles="prefill, decode")
    decode_serial_rows: int = _f(-1, "decode steps of at most this many rows run on one thread; -1 (auto): none for "
                                  "the fused step (its one OpenMP region wins at every batch size on 2 cores); "
                                  "unfused, 4 rows where decode may use at most 2 cores, else 1; 0: never.  Why: to "
                                  "retune "
                                  "the eager step on another core count (benchmarks/decode_threads.py measures it)")

    def __post_init__(self) -> None:
        _one_of(self, ("linear_kernel",), LINEAR_KERNELS)
        _one_of(self, ("decode_fused", "lm_head_screen"), SWITCHES)
        _one_of(self, ("logprobs_mode",), LOGPROBS_MODES)
        _at_least(self, ("kv_cache_mb", "encode_max_batch_tokens", "prefill_max_queue", "encode_max_queue",
                         "max_num_batched_tokens"), 1)
        _at_least(self, ("decode_slots",), 0)   # 0: auto, resolved for the device (EpdConfig)
        _check(0 < self.gpu_memory_fraction <= 1, "gpu_memory_fraction must be in (0, 1]")
        _at_least(self, ("prefix_cache_mb", "render_workers", "render_cache_mb", "decode_kv_wait_s"), 0)
        _check(self.decode_serial_rows >= -1, "decode_serial_rows must be -1 (auto), 0 or more")
        _check(1 <= self.kv_block_size <= 256, "kv_block_size must be in 1..256")
        unknown = set(_names(self.kernels_off)) - {*KERNEL_NAMES, *KERNEL_FAMILIES}
        _check(not unknown, f"kernels_off names unknown kernels {sorted(unknown)}; known: {', '.join(KERNEL_NAMES)}")


@dataclass(frozen=True)
class CpuConfig:
    """How role processes on one machine share its CPUs."""

    role_threads: str = _f("", "engine threads per role: '' (one per core), N, or 'encode=1,decode=2' (prefill-long=N: "
                           "prefill's while it runs a chunked prompt).  Why: roles or instances that share a machine "
                           "with other work, or each other, and should not each take every core", roles="roles")
    single_omp_team: str = _f("on", "on: only a model role's engine thread runs torch multi-threaded, so libgomp "
                              "keeps spinning between regions (services/hostcpu/compute_threads.py) | off.  Why: "
                              "only to measure what it gains (benchmarks/omp_team.py)", roles="roles")
    compute_lease: str = _f("auto", "auto: under `epd serve` encode's and prefill's forwards take turns on the cores "
                            "and decode steps pause (<= 0.5 s a step) while one runs; the next waits (<= 50 ms) for "
                            "decode to send the last's first tokens (services/hostcpu/compute_lease.py) | off.  Why: "
                            "roles pinned to cores of their own, which need no turns, or to measure it", roles="roles")
    role_nice: str = _f("auto", "niceness per role and its autogroup ('decode=0,prefill=5'; prefill-long=N: prefill's "
                        "while it runs a chunked prompt, decode-long=N: decode's meanwhile); auto under `epd serve`: "
                        "decode=15,decode-long=5,prefill-long=19, none alone.  Why: to weigh the roles against other "
                        "work on the machine, or each other on another core count", roles="roles")

    def __post_init__(self) -> None:
        _one_of(self, ("single_omp_team",), ("on", "off"))
        _one_of(self, ("compute_lease",), ("auto", "off"))
        nice = self.role_nice.replace("auto", "")
        for name, raw, keys in (("role_threads", self.role_threads, (*ROLES, "prefill-long")),
                                ("role_nice", nice, (*ROLES, "prefill-long", "decode-long"))):
            _check(_role_map_ok(raw, keys), f"{name} must be N or role=N,role=N (keys: {', '.join(keys)})")


@dataclass(frozen=True)
class LimitsConfig:
    """Bounds on what a request may ask and how long each wait may take."""

    max_images_per_request: int = _f(8, "images one request may carry")
    max_image_pixels: int = _f(16_777_216, "largest accepted image, width x height")
    max_image_bytes: int = _f(20 * 1024 * 1024, "largest accepted encoded image, bytes")
    max_videos_per_request: int = _f(2, "videos one request may carry (each is thousands of vision tokens and "
                                     "seconds of encoder time)", roles="render")
    max_video_bytes: int = _f(32 * 1024 * 1024, "largest accepted encoded video, bytes (a data URL or a fetched "
                              "file); with --max-request-bytes it also bounds videos sent inline", roles="render")
    max_video_frames: int = _f(64, "frames a video may sample to (2 per second of video, as vLLM samples "
                               "Qwen-VL videos); each decoded frame is held in render and costs its patches "
                               "in the encoder: the bound on a video's memory and tokens", roles="render")
    max_video_duration_s: float = _f(300.0, "longest accepted video, seconds (from its headers, before any frame "
                                     "is decoded; vLLM's default maximum)", roles="render")
    max_video_frame_pixels: int = _f(1920 * 1088, "largest accepted video frame, width x height (from the "
                                     "headers, before decoding)", roles="render")
    video_decode_timeout_s: float = _f(30.0, "deadline to decode one video in a render worker; a worker past "
                                       "it is replaced and the request answered 400", roles="render")
    allowed_media_domains: str = _f("", "comma-separated hosts image and video URLs may point to (empty: any "
                                    "public host)")
    allow_private_media_urls: bool = _f(False, "allow image and video URLs on loopback/private networks (tests, "
                                        "in-cluster)")
    media_timeout_s: float = _f(10.0, "deadline to fetch one image or video URL")
    request_timeout_s: float = _f(30.0, "roles: the longest one wait inside a role may take (an item in the encode "
                                  "queue, the next decode event)", roles="roles")
    max_inflight_requests: int = _f(256, "generation requests the coordinator runs at once; more are answered "
                                    "429 with Retry-After at once", roles="coordinator")
    ttft_slo_ms: float = _f(0.0, "time-to-first-token target of admission: past capacity a request that would get "
                            "its first token later is answered 429 with Retry-After at once, so those admitted "
                            "still meet it (coordinator/slo_gate.py); 0: admit and queue", roles="coordinator")
    tpot_slo_ms: float = _f(0.0, "time-per-output-token target of admission: while the decoding streams' TPOT, "
                            "projected to their max_tokens at the pace of all streams, is past it on average, a new "
                            "request is answered 429 with Retry-After at once (coordinator/slo_gate.py); 0: admit",
                            roles="coordinator")
    ttft_timeout_s: float = _f(60.0, "time from a request's body to its first token (render, encode, prefill, the "
                               "first decode step); then 504", roles="coordinator")
    stream_idle_timeout_s: float = _f(30.0, "longest wait for the next token once an answer has started, and for a "
                                      "client to take what was sent; then the answer is cut", roles="coordinator")
    max_request_timeout_s: float = _f(3600.0, "the longest total deadline a request may have: a client sets its own "
                                      "with the X-Request-Timeout header (seconds), capped by this; without one, "
                                      "this", roles="coordinator")
    max_request_bytes: int = _f(64 * 1024 * 1024, "largest request body the coordinator reads: a larger one is "
                                "answered 413 at once, unread", roles="coordinator")
    body_read_timeout_s: float = _f(30.0, "a request body must arrive within this; a client trickling it gets 408 "
                                    "and is dropped", roles="coordinator")

    def __post_init__(self) -> None:
        _at_least(self, ("max_images_per_request", "max_image_pixels", "max_image_bytes", "max_inflight_requests"), 1)
        _at_least(self, ("max_video_bytes", "max_video_frames", "max_video_frame_pixels"), 1)
        _at_least(self, ("max_videos_per_request", "ttft_slo_ms", "tpot_slo_ms"), 0)   # 0: no videos; no target
        _at_least(self, ("request_timeout_s", "media_timeout_s", "ttft_timeout_s", "stream_idle_timeout_s",
                         "max_request_timeout_s", "body_read_timeout_s", "max_video_duration_s",
                         "video_decode_timeout_s"), 0, strict=True)
        _check(self.max_request_bytes >= 1024, "max_request_bytes must be >= 1024")

    def media_domains(self) -> tuple[str, ...]:
        return tuple(d.strip().lower() for d in self.allowed_media_domains.split(",") if d.strip())


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call what: API keys, the admin plane, TLS on the internal hops."""

    api_key: str = _f("", "API keys clients must send as 'Authorization: Bearer KEY' (comma-separated; @FILE reads "
                      "one key per line): the coordinator's OpenAI and scale-out endpoints, and the roles' HTTP "
                      "APIs unless --role-api-key is set; empty: unauthenticated (a warning at start)", secret=True)
    role_api_key: str = _f("", "API keys of the roles' HTTP APIs (same syntax; default: --api-key)", secret=True)
    admin_host: str = _f("127.0.0.1", "address of the coordinator's admin API (instance registration, aborts); "
                         "anything but loopback needs --admin-token", roles="coordinator")
    admin_port: int = _f(0, "port of the coordinator's admin API (0: a free one, logged at start)", roles="coordinator")
    admin_token: str = _f("", "tokens the admin API requires as 'Authorization: Bearer TOKEN' (same syntax as "
                          "--api-key); role processes send the first one when they announce themselves", secret=True)
    grpc_tls_cert: str = _f("", "PEM certificate: roles serve gRPC over TLS with it; the coordinator presents it as "
                            "its client certificate (with --grpc-tls-key)")
    grpc_tls_key: str = _f("", "PEM private key of --grpc-tls-cert")
    grpc_tls_ca: str = _f("", "PEM CA bundle: the coordinator verifies the roles' certificates with it; roles "
                          "given it require client certificates signed by it (mTLS)")
    grpc_tls_server_name: str = _f("", "the name the roles' certificates carry, checked by the coordinator instead "
                                   "of the dialled host (pods are dialled by IP)", roles="coordinator")

    def __post_init__(self) -> None:
        _check(0 <= self.admin_port < 65536, "admin_port must be in 0..65535")
        _check(is_loopback(self.admin_host) or bool(self.admin_token),
               f"--admin-host {self.admin_host} is not a loopback address: set --admin-token (EPD_ADMIN_TOKEN) so "
               "only the cluster's own processes can register instances")
        try:
            check_files(self.grpc_tls_cert, self.grpc_tls_key, self.grpc_tls_ca)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for name in ("api_key", "role_api_key", "admin_token"):
            try:
                parse_keys(getattr(self, name), name.replace("_", " "))
            except ValueError as exc:
                raise ConfigError(f"{flag_name(name)}: {exc}") from None

    def api_keys(self) -> KeySet:
        """Keys of the coordinator's public API."""
        return KeySet.of(parse_keys(self.api_key))

    def admin_tokens(self) -> KeySet:
        return KeySet.of(parse_keys(self.admin_token))

    def role_api_keys(self) -> KeySet:
        """Keys of a role's HTTP API: --role-api-key, else --api-key."""
        return KeySet.of(parse_keys(self.role_api_key or self.api_key))
