"""The single-process reference: Hugging Face `generate` on the same checkpoint (any supported family)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


class Reference:
    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from services.models.processing import load_processor

        self.processor = load_processor(model_path)  # a text-only model's "processor" is its tokenizer
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.is_text_only = self.tokenizer is self.processor
        auto = AutoModelForCausalLM if self.is_text_only else AutoModelForImageTextToText
        self.device = device
        self.model_path = model_path
        if dtype is None:
            self.model = auto.from_pretrained(str(model_path)).to(device).eval()
        else:   # the cluster's own dtype (bfloat16 on CUDA by default)
            import torch

            self.model = auto.from_pretrained(str(model_path), dtype=getattr(torch, dtype)).to(device).eval()

    def greedy(self, text: str, images: list[Image.Image] = (), max_new_tokens: int = 16,
               **generate_kwargs) -> list[int]:
        return self.greedy_with_logits(text, images, max_new_tokens, **generate_kwargs)[0]

    def greedy_with_logits(self, text: str, images: list[Image.Image] = (), max_new_tokens: int = 16,
                           **generate_kwargs) -> tuple[list[int], list]:
        """The greedy ids and, per output token, the model's raw logits [vocab] (float32) that chose it."""
        import torch

        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content if images else text}]
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if self.is_text_only:  # render tokenizes the templated text without adding special tokens
            inputs = self.tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
        else:
            inputs = self.processor(text=[prompt], images=list(images) or None, return_tensors="pt")
            if images:
                _use_vllm_pixels(inputs, self.processor, images, self.model_path)
        inputs = inputs.to(self.device)
        with torch.no_grad():
            out = self.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, output_logits=True,
                                      return_dict_in_generate=True, **generate_kwargs)
        ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        return ids, [step[0].float() for step in out.logits]


def _use_vllm_pixels(inputs, processor, images, model_path) -> None:
    """Qwen-VL: the pixels vLLM (and epd) feed the tower, torchvision-resized, normalised as vLLM does.

    HF's PIL processor resizes differently from the torchvision backend vLLM uses; the reference
    keeps HF's model and generate but takes the pixels the serving side is meant to produce.
    """
    import torch

    from services.models.input_norm import NormParams, normalize_pixels
    from services.render.qwen_pixels import QwenPixelSettings, qwen_pixels

    settings = QwenPixelSettings.from_processor(getattr(processor, "image_processor", None))
    if settings is None:
        return
    params = NormParams.from_checkpoint(model_path)
    pixels = [normalize_pixels(torch.from_numpy(qwen_pixels(image, settings)["pixel_values"]), params)
              for image in images]
    inputs["pixel_values"] = torch.cat(pixels)
