"""Training data as `mlx_lm.lora` reads it: sources (`sources`), chat rows to token ids
(`tokens`), packing short examples into long rows (`packing`)."""
