"""The runner layer: prepares loaded models for inference on their device and runs them there (fused layers on the
Triton kernels, CUDA graphs and their staging buffers). The models below it keep one plain forward per module."""
