"""The peer, `transformers serve`, on the same checkpoint folder, able to see images.

`transformers serve` loads a processor with `AutoProcessor`.  On a Qwen2-VL folder without
torchvision that fails on the video processor, and a folder whose processor loads as a bare
tokenizer makes the peer treat the model as text-only: it answers image requests with a 200
and silently drops the images.  So the peer gets a *view* of the checkpoint: a folder of
symlinks to every file of the demo checkpoint (same config, weights, tokenizer, chat
template), plus a processor module that builds Qwen2VLProcessor with its PIL image processor
and no video slot, named in `auto_map` (served with `--trust-remote-code`).  Nothing else
differs.  `check_same_prompt` then proves it: the same image request must count the same
`prompt_tokens` on both servers and give the same greedy answer.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

PROCESSOR_MODULE = '''"""Image-only Qwen2-VL processor that loads without torchvision (from benchmarks/peer.py)."""
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        tokenizer = AutoTokenizer.from_pretrained(path)
        image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template)
'''
AUTO_MAP = {"AutoProcessor": "processing_epd.ImageOnlyQwen2VLProcessor"}
REWRITTEN = ("preprocessor_config.json", "processor_config.json", "processing_epd.py")


class PeerMismatch(RuntimeError):
    """The peer does not see the same prompt (e.g. it dropped the image)."""


def peer_folder(checkpoint: Path, root: Path | None = None) -> Path:
    """A folder that is `checkpoint` (symlinked file by file) plus a processor the peer can load."""
    root = root or Path(os.environ.get("EPD_CACHE_DIR") or Path.home() / ".cache" / "epd") / "peer"
    folder = root / checkpoint.name
    folder.mkdir(parents=True, exist_ok=True)
    for source in checkpoint.iterdir():
        link = folder / source.name
        if source.name in REWRITTEN or source.name == "DONE" or link.exists():
            continue
        link.symlink_to(source.resolve())
    preprocessor = json.loads((checkpoint / "preprocessor_config.json").read_text())
    processor_fields = {"processor_class": "ImageOnlyQwen2VLProcessor", "auto_map": AUTO_MAP}
    (folder / "preprocessor_config.json").write_text(json.dumps({**preprocessor, **processor_fields}, indent=2))
    (folder / "processor_config.json").write_text(json.dumps(processor_fields, indent=2))
    (folder / "processing_epd.py").write_text(PROCESSOR_MODULE)
    return folder


def _post(url: str, body: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def probe_body(model: str, with_image: bool, max_tokens: int = 8) -> dict[str, Any]:
    """One request from the benchmark's own workload (same words, same kind of image)."""
    from services.bench import WorkloadConfig
    from services.bench.workloads import make_workload

    config = WorkloadConfig(kind="random-mm" if with_image else "text", input_len=32, output_len=max_tokens,
                            seed=424242)
    body = json.loads(make_workload(config).build(0).payload(model, {"temperature": 0.0}))
    for field in ("stream", "stream_options", "ignore_eos"):
        body.pop(field, None)
    return body


def check_same_prompt(epd_url: str, epd_model: str, peer_url: str, peer_model: str) -> dict[str, Any]:
    """Image and text probes on both servers: prompt_tokens must match, and so should greedy text.

    Raises PeerMismatch when the peer counts fewer prompt tokens for the image request (images
    dropped).  Different greedy text (ignoring the leading space the peer strips) is reported, not
    raised: float summation order differs between the two servers' kernels."""
    report: dict[str, Any] = {}
    for name, with_image in (("image", True), ("text", False)):
        ours = _post(epd_url, probe_body(epd_model, with_image))
        theirs = _post(peer_url, probe_body(peer_model, with_image))
        report[name] = {
            "epd_prompt_tokens": ours["usage"]["prompt_tokens"], "peer_prompt_tokens": theirs["usage"]["prompt_tokens"],
            "epd_completion_tokens": ours["usage"]["completion_tokens"],
            "peer_completion_tokens": theirs["usage"]["completion_tokens"],
            # The peer strips the answer's leading space (" uh" -> "uh"); the tokens are the same.
            "same_text": _text(ours).lstrip() == _text(theirs).lstrip()}
    image = report["image"]
    if image["epd_prompt_tokens"] != image["peer_prompt_tokens"]:
        raise PeerMismatch(f"image request: epd counts {image['epd_prompt_tokens']} prompt tokens, the peer "
                           f"{image['peer_prompt_tokens']} (the peer dropped the image?)")
    return report


def _text(answer: dict[str, Any]) -> str:
    return answer["choices"][0]["message"]["content"] or ""


def peer_extra_body(output_len: int) -> dict[str, Any]:
    """Fields for the peer: no `ignore_eos` (it answers 422) but a generation config with no EOS,
    so it also produces exactly `max_tokens` tokens; greedy like epd (temperature 0)."""
    generation = {"max_new_tokens": output_len, "do_sample": False, "pad_token_id": 151643}
    return {"ignore_eos": None, "stream_options": None, "temperature": 0.0,
            "generation_config": json.dumps(generation)}
