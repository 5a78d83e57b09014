"""The GPU check: what scripts/gpu_check.sh runs on a machine with one CUDA GPU, section by section.

Each section (`python -m benchmarks.gpu_check SECTION --device cuda --out DIR`) runs in its own process under
its own time limit and writes DIR/SECTION.json, so one section that fails or hangs costs only itself; `report`
merges the parts into ONE JSON (benchmarks/results/gpu_check.json: the device's name, every figure, every
section's raw numbers and errors) and `docs` turns that JSON into the docs/benchmarks.md block.

- env: the device, its memory, the library versions it ran with;
- ipc: a CUDA tensor read by another process through the shm connector's IPC handle, against a
  device-to-device copy in one process (the same GPU);
- exactness: greedy tokens of epd's CUDA decode step against Hugging Face `generate` on the same GPU, tiny
  Qwen2-VL, Qwen2.5-VL and LLaVA, float32 and bfloat16, a text and an image prompt each;
- decode: tok/s of the decode engine at 1, 16 and 64 streams against `generate` at those batch sizes (the
  medium demo model), and the host synchronisations per decode step counted with the CUDA profiler;
- cluster: a real `epd serve --device cuda` (CUDA IPC for embeddings and KV): exact tokens through every role,
  and TTFT at concurrency 1.

`--dry-run` runs the sections' code on CPU at small sizes (the test suite does, tests/benchmarks/
test_gpu_check.py), so the first real run has the best chance; its JSON says dry_run and is never a result.
"""
