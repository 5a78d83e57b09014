"""Run by the vLLM venv's interpreter (not epd's): vLLM's own pydantic models judge JSON bodies.

stdin: {"validate": [[model, body], ...]}; stdout: {"results": [{"ok": bool, "error": str}], "fields":
{model: [field names]}}.  Models are vLLM's scale-out protocol classes, by name.
"""

from __future__ import annotations

import json
import sys

from pydantic import TypeAdapter
from vllm.entrypoints.openai.chat_completion import protocol as chat
from vllm.entrypoints.openai.completion import protocol as completion
from vllm.entrypoints.scale_out.token_in_token_out import protocol as p
from vllm.sampling_params import SamplingParams

MODELS = {
    "GenerateRequest": p.GenerateRequest, "MultiModalFeatures": p.MultiModalFeatures,
    "GenerateTokensResponse": p.GenerateTokensResponse, "GenerateTokensStreamResponse": p.GenerateTokensStreamResponse,
    "GenerateTextResponse": p.GenerateTextResponse, "GenerateTextStreamResponse": p.GenerateTextStreamResponse,
    "DerenderChatRequest": p.DerenderChatRequest, "DerenderChatStreamRequest": p.DerenderChatStreamRequest,
    "DerenderCompletionRequest": p.DerenderCompletionRequest,
    "DerenderChatStreamResponse": p.DerenderChatStreamResponse,
    "ChatCompletionResponse": chat.ChatCompletionResponse,
    "ChatCompletionStreamResponse": chat.ChatCompletionStreamResponse,
    "CompletionResponse": completion.CompletionResponse,
}


def judge(name: str, body: object) -> dict:
    try:
        TypeAdapter(MODELS[name]).validate_python(body)
        return {"ok": True, "error": ""}
    except Exception as exc:  # noqa: BLE001 - ValidationError, VLLMValidationError (a 400 in vLLM)
        return {"ok": False, "error": str(exc).splitlines()[0][:300]}


def main() -> None:
    job = json.load(sys.stdin)
    fields = {name: sorted(getattr(model, "model_fields", {})) for name, model in MODELS.items()}
    fields["SamplingParams"] = sorted(f for f in SamplingParams.__struct_fields__ if not f.startswith("_"))
    print(json.dumps({"results": [judge(n, b) for n, b in job.get("validate", [])], "fields": fields}))


if __name__ == "__main__":
    main()
