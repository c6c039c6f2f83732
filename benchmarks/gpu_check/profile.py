"""What the GPU check runs, as a value: the GPU profile (an H100) and the dry profile (CPU, gloo, tiny).

The dry profile runs every part of the check with the same code on a CPU, small enough for a test, so
the script cannot rot between the rare runs on a GPU machine. Only sizes, device and precision differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "conf" / "tiny-cpu.yaml"
GPU_1B = ROOT / "conf" / "gpu-llama-1b.yaml"

# The H100 SXM's dense bf16 tensor-core peak (NVIDIA's datasheet: 1,979 TFLOP/s with sparsity, half
# without). MFU is stated against this figure; the PCIe card's is 756.
H100_SXM_BF16_DENSE_FLOPS = 989.4e12


@dataclass(frozen=True)
class Profile:
    name: str  # "gpu" or "dry"
    use_gpu: bool
    precision: str  # the training precision of every part: bf16 on the GPU, fp32 on CPU
    small_model: tuple[str, ...]  # overrides of conf/tiny-cpu.yaml: the numerics and cross-device model
    numerics_steps: int
    big_config: Path  # the throughput, offload and checkpoint model
    big_model: tuple[str, ...]
    warmup_steps: int  # skipped by every system alike
    measured_steps: int
    offload_steps: int
    peak_flops: float | None  # the device's dense peak for the training precision (None: no MFU)
    cpus_per_worker: int
    # Each part's time limit in seconds (the check's whole budget is their sum plus the kit's install).
    limits: dict[str, int] = field(default_factory=dict)

    def scaling(self, workers: int = 1) -> list[str]:
        return [
            f"scaling.min_workers={workers}",
            f"scaling.max_workers={workers}",
            f"scaling.use_gpu={str(self.use_gpu).lower()}",
            "scaling.gpus_per_worker=1",
            f"scaling.cpus_per_worker={self.cpus_per_worker}",
        ]

    @property
    def device(self) -> str:
        return "cuda" if self.use_gpu else "cpu"


# Part e (checkpoint on the GPU) rides on part c's two runs: a 1B model's set-up is the dearest thing there.
_PARTS = ("environment", "numerics", "throughput", "offload", "cross_device", "tensor_parallel", "pipeline")

GPU = Profile(
    name="gpu",
    use_gpu=True,
    precision="bf16",
    small_model=(
        "model.hf_config.hidden_size=256",
        "model.hf_config.intermediate_size=688",
        "model.hf_config.num_hidden_layers=4",
        "model.hf_config.num_attention_heads=8",
        "model.hf_config.num_key_value_heads=8",
        "model.hf_config.vocab_size=256",
        "model.hf_config.max_position_embeddings=256",
        "data.seq_len=256",
        "training.global_batch_size=16",
        "training.micro_batch_size=4",
    ),
    numerics_steps=20,
    big_config=GPU_1B,
    big_model=(
        "training.global_batch_size=8",  # 16k tokens a step; each rung of the ladder sets the micro batch
        "data.generated_chars=2000000",
        "training.warmup_steps=1",  # the preset's 200 exceed the check's few steps
    ),
    warmup_steps=2,
    measured_steps=20,  # 6 could not resolve 3% between two systems
    offload_steps=2,
    peak_flops=H100_SXM_BF16_DENSE_FLOPS,
    cpus_per_worker=8,
    # From the first run on an H200 (2026-11-28): environment 13-15 s, numerics 87 s, throughput 160 s
    # (plain DeepSpeed about 50, elastictrain 110 with two checkpoints of 11 GB), the 1B host-offload run
    # 87 s, cross-device 41 s to its first resumed step. Their sum stays under 526 s (525: the
    # ladder took time from the parts that had room): the check is one call of at most 540 s, the kit's
    # install included.
    limits={
        "environment": 20,
        "numerics": 90,
        "throughput": 200,  # the ladder: as many rungs as fit, the automatic choice first
        "offload": 120,  # the 1B host-offload run, then the small model on NVMe (after the op build)
        "cross_device": 60,
        "tensor_parallel": 25,  # two small runs where there are two GPUs; a second where there is one
        "pipeline": 10,  # the same where there are two GPUs (then given more); a second where there is one
    },
)

DRY = Profile(
    name="dry",
    use_gpu=False,
    precision="fp32",
    small_model=(),  # tiny-cpu's own model: hidden 64, 2 layers, sequence 64
    numerics_steps=6,
    big_config=TINY,
    big_model=(
        "training.global_batch_size=8",
        "data.generated_chars=50000",
        "training.warmup_steps=1",
    ),
    warmup_steps=1,
    measured_steps=3,
    offload_steps=2,
    peak_flops=None,
    cpus_per_worker=1,
    limits={
        "environment": 60,
        "numerics": 180,
        "throughput": 150,
        "offload": 300,  # the first NVMe offload on a fresh machine builds DeepSpeed's async_io op
        "cross_device": 240,
        "tensor_parallel": 180,
        "pipeline": 180,
    },
)

# The GPU's precision on the CPU: DeepSpeed's CPU accelerator trains bf16 too, so the bf16 reference and its
# tolerance are checked here before a GPU ever runs them (tests/integration/test_gpu_check_dry.py).
DRY_BF16 = replace(DRY, name="dry-bf16", precision="bf16")

PROFILES = {p.name: p for p in (GPU, DRY, DRY_BF16)}
PARTS = _PARTS
