"""segback: long-context LoRA fine-tuning for MLX with segmented backward."""

__version__ = "0.1.0"
