"""A stand-in for torch_npu (tests/unit/test_devices.py puts its folder first on PYTHONPATH): registers the 'npu'
device type the way the real package does and exposes the torch.npu calls rlx makes, recording them."""

import types

import torch

torch.utils.rename_privateuse1_backend("npu")
calls = []
torch.npu = types.SimpleNamespace(
    is_available=lambda: True,
    device_count=lambda: 8,
    current_device=lambda: 0,
    set_device=lambda index: calls.append(("set_device", index)),
)
