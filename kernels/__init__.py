"""dspark_serve.kernels."""
