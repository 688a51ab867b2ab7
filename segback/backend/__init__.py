"""Backend set-up the CLI runs before MLX evaluates anything: the OpenBLAS preload on Linux CPU
(`blas`), a kernel cache that survives the process on CUDA (`kernel_cache`) and the bound on
ops per CUDA graph (`ops_per_buffer`)."""
