"""Real peer servers the benchmarks and the interop suite compare epd with (vLLM CPU)."""
