"""The single-process reference: Hugging Face `generate` on the same checkpoint (any supported family)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


class Reference:
    def __init__(self, model_path: str | Path, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from services.models.processing import load_processor

        self.processor = load_processor(model_path)  # a text-only model's "processor" is its tokenizer
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.is_text_only = self.tokenizer is self.processor
        auto = AutoModelForCausalLM if self.is_text_only else AutoModelForImageTextToText
        self.device = device
        self.model = auto.from_pretrained(str(model_path)).to(device).eval()

    def greedy(self, text: str, images: list[Image.Image] = (), max_new_tokens: int = 16,
               **generate_kwargs) -> list[int]:
        import torch

        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content if images else text}]
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if self.is_text_only:  # render tokenizes the templated text without adding special tokens
            inputs = self.tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
        else:
            inputs = self.processor(text=[prompt], images=list(images) or None, return_tensors="pt")
        inputs = inputs.to(self.device)
        with torch.no_grad():
            out = self.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **generate_kwargs)
        return out[0, inputs["input_ids"].shape[1]:].tolist()
