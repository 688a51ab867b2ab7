"""Model sources (random geometries, local checkpoints, Hub, embedded GGUF) and family adapters."""
