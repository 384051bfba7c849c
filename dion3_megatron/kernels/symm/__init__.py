"""The symmetric GEMM of Gram Newton-Schulz on Hopper: the CuTe DSL kernel (:mod:`.kernel`), its
launch and compile cache (:mod:`.launch`), the routing and tile model that decide each launch
(:mod:`.heuristics`) and the matmul backend that offers it to the orthogonalization
(:mod:`.backend`). Only :mod:`.kernel` and :mod:`.launch` import nvidia-cutlass-dsl; the backend
imports them when a product first goes to the kernel.
"""
