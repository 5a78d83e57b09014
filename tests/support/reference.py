"""The single-process reference: Hugging Face `generate` on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


class Reference:
    def __init__(self, model_path: str | Path) -> None:
        from transformers import Qwen2VLForConditionalGeneration

        from services.models.processing import load_processor

        self.processor = load_processor(model_path)
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(str(model_path)).eval()

    def greedy(self, text: str, images: list[Image.Image] = (), max_new_tokens: int = 16,
               **generate_kwargs) -> list[int]:
        import torch

        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content if images else text}]
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = self.processor(text=[prompt], images=list(images) or None, return_tensors="pt")
        with torch.no_grad():
            out = self.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **generate_kwargs)
        return out[0, inputs["input_ids"].shape[1]:].tolist()
