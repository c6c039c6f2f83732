"""Adam's step is rebuilt where the loading optimizer reads it, not where the saving one kept it: a
checkpoint saved on the CPU resumes under CUDA's fused AdamW, which reads `step` on the GPU."""

from __future__ import annotations

import torch

from elastictrain.checkpoint.zero_layouts import rebuild_scalar, scalar_device

SAVED_ON_CPU = {"value": 4.0, "kind": "tensor", "dtype": "torch.float32", "on_accelerator": False}
META = torch.device("meta")  # stands in for the GPU: a device other than the CPU


def _adamw(**options: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], lr=1e-3, **options)


def test_a_step_saved_on_the_cpu_goes_to_the_parameters_device_under_a_fused_adamw() -> None:
    device = scalar_device(_adamw(fused=True), None, META)
    step = rebuild_scalar(SAVED_ON_CPU, device)
    assert step.device == META and step.dtype == torch.float32


def test_a_capturable_adamw_reads_its_step_on_the_parameters_device_too() -> None:
    assert scalar_device(_adamw(capturable=True), None, META) == META


def test_a_plain_adamw_keeps_its_step_on_the_cpu_whatever_the_saver_did() -> None:
    saved_on_gpu = {**SAVED_ON_CPU, "on_accelerator": True}
    step = rebuild_scalar(saved_on_gpu, scalar_device(_adamw(), None, META))
    assert step.device.type == "cpu" and float(step) == 4.0


def test_a_step_the_optimizer_already_holds_keeps_its_device() -> None:
    held = torch.tensor(1.0, device=META)
    assert scalar_device(_adamw(), held, torch.device("cpu")) == META


def test_integer_and_float_scalars_are_plain_numbers() -> None:
    assert rebuild_scalar({"value": 3.0, "kind": "int"}, META) == 3
    assert rebuild_scalar({"value": 0.5, "kind": "float"}, META) == 0.5
