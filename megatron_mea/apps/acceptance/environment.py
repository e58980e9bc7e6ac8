"""The machine an acceptance run meets: versions, the GPU and its peak."""

import os
import platform
import subprocess
import sys
from typing import Optional

# Dense bf16 peak of the GPUs this is likely to meet, in TFLOP/s (NVIDIA data sheets, SXM parts
# unless named); the first name contained in torch's device name wins. `--peak-tflops` overrides.
PEAK_BF16_TFLOPS = (
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),
    ("H800", 989.4),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
)

def peak_bf16_tflops(device_name: Optional[str]) -> Optional[float]:
    """The dense bf16 peak of a GPU from its name, or None if unknown."""
    if not device_name:
        return None
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def describe_environment(peak_override: Optional[float] = None) -> dict:
    """Versions and hardware: Python, torch, CUDA, the GPU, NCCL, the driver, Transformer Engine,
    megatron-core, megatron_mea; `peak_bf16_tflops` (`peak_override` if given) and `te_usable`
    (TE's torch extension imports and a GPU is there)."""
    import torch

    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=props.total_memory / 2**30,
            compute_capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            fp8_capable=torch.cuda.get_device_capability(0) >= (8, 9),
            cudnn=torch.backends.cudnn.version(),
            nccl=_nccl_version(),
            flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
            driver=_driver_version(),
        )
    env["peak_bf16_tflops"] = peak_override or peak_bf16_tflops(env.get("gpu"))
    env["transformer_engine"] = _module_version("transformer_engine")
    # Used only if its torch extension really imports (a broken install counts as absent).
    env["te_usable"] = torch.cuda.is_available() and not _module_version(
        "transformer_engine.pytorch").startswith("missing")
    env["megatron_core"] = _module_version("megatron.core")
    env["megatron_mea"] = _module_version("megatron_mea")
    for name in ("pynvml", "pytest", "numpy"):
        env[name] = _module_version(name)
    return env


def _module_version(name: str) -> str:
    try:
        module = __import__(name, fromlist=["_"])
    except Exception as exc:  # noqa: BLE001 -- TE raises all sorts when its CUDA libs mismatch
        return f"missing ({type(exc).__name__}: {str(exc)[:120]})"
    version = getattr(module, "__version__", None)
    if version is None and name == "megatron.core":
        from megatron.core import package_info

        version = package_info.__version__
    path = os.path.dirname(getattr(module, "__file__", "") or "")
    version = version or "installed"
    return f"{version} ({path})" if name in ("megatron_mea", "megatron.core") else str(version)


def _nccl_version() -> Optional[str]:
    import torch

    try:
        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
    except Exception:  # noqa: BLE001 -- informational only
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _driver_version() -> Optional[str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: BLE001 -- fall back to nvidia-smi
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
