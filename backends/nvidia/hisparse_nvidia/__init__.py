"""hisparse_nvidia: the NVIDIA CUDA backend of hisparse.

Host pool registered with `cuMemHostRegister` (private, or one `/dev/shm` file shared by the
tensor-parallel ranks of a node), a fused GPU resolver with an exact per-request LRU, multi-block
zero-copy miss gathers, and batched row/page copies. Kernels are CUDA C++ compiled at run time by
NVRTC for the device's architecture and cached on disk (`hisparse_nvidia.compiler`).

Importing this package imports nothing heavy; the plugin entry point is `hisparse_nvidia.plugin`
and the backend class `hisparse_nvidia.backend:NvidiaBackend`.
"""
