"""The GPU check: everything a GPU machine must show, run as one command (`make gpu-check`).

Parts, in order, each in its own process with its own time limit (benchmarks/gpu_check/profile.py):
environment, numerics, throughput, offload, checkpoint, cross_device, tensor_parallel, pipeline.
`make gpu-kit` gathers what the GPU machine lacks (benchmarks/gpu_check/kit.py);
`make gpu-check GPU_CHECK_DRY=1` runs every part here on the CPU. docs/gpu-check.md says how to run it
and read its results.
"""
