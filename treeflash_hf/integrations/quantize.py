"""Quantized targets (`--target-quant SPEC`): one loaded target quantized by one of the backends tested on this CPU.

Every spec computes in float32 by default; the torchao specs also compute in bfloat16 (`compute_dtype`: on a CPU
with bfloat16 matrix units a multi-token verification then costs little more than one token). torchao, bitsandbytes
and optimum-quanto go through transformers' `quantization_config`: the loaded target's weights are loaded again into
a fresh model with that config, exactly as `from_pretrained(..., quantization_config=...)` quantizes a checkpoint.
HQQ, whose `HqqConfig` transformers 5.24 does not run ("HQQ is not available yet"), quantizes the loaded model's
layers in place. lm_head stays as the backend's
default leaves it (a plain, possibly tied, Linear for all of them) unless `quantize_head` asks for it too.
The libraries are the `quant` extra: `pip install treeflash-hf[quant]`.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch


@dataclass(frozen=True)
class Backend:
    """What a spec needs: the distribution to install, the module to import, and what it does, for messages."""

    distribution: str
    module: str
    summary: str


BACKENDS = {
    "none": Backend("", "", "dense, not quantized"),
    "torchao-int8": Backend("torchao", "torchao", "Int8WeightOnlyConfig"),
    "torchao-int4": Backend("torchao", "torchao", "IntxWeightOnlyConfig(int4, group 32)"),
    "bnb-8bit": Backend("bitsandbytes", "bitsandbytes", "LLM.int8 (load_in_8bit)"),
    "bnb-nf4": Backend("bitsandbytes", "bitsandbytes", "4-bit nf4, float32 compute"),
    "quanto-int8": Backend("optimum-quanto", "optimum.quanto", "int8 weights"),
    "quanto-int4": Backend("optimum-quanto", "optimum.quanto", "int4 weights"),
    "hqq-4bit": Backend("hqq", "hqq", "4-bit, group 64, applied to the loaded model"),
}
QUANT_SPECS = tuple(BACKENDS)
BFLOAT16_COMPUTE_SPECS = ("torchao-int8", "torchao-int4")  # tested in bfloat16 compute too


class QuantizationUnavailable(ImportError, ValueError):
    """A spec's library is not installed. Also a ValueError, so that the command line reports it in one line."""


def describe(spec: str) -> str:
    """`spec`'s backend and installed version, e.g. "torchao 0.18.0 Int8WeightOnlyConfig"."""
    backend = BACKENDS[spec]
    if not backend.distribution:
        return backend.summary
    try:
        installed = version(backend.distribution)
    except PackageNotFoundError:
        installed = "(not installed)"
    return f"{backend.distribution} {installed} {backend.summary}"


def _require(spec: str):
    """The module `spec` needs, imported, or an error that says how to install it."""
    backend = BACKENDS[spec]
    try:
        return importlib.import_module(backend.module)
    except ImportError as err:
        raise QuantizationUnavailable(
            f"--target-quant {spec} needs {backend.distribution}, which is not installed ({err}): "
            "pip install treeflash-hf[quant]") from None


def quantization_config(spec: str, quantize_head: bool = False):
    """transformers' `quantization_config` for `spec`; None for "none" and "hqq-4bit" (which transformers does not
    apply). `quantize_head`: quantize every Linear, lm_head included, instead of the default (lm_head kept)."""
    if spec not in BACKENDS:
        raise ValueError(f"unknown quantization spec {spec!r}: choose from {', '.join(QUANT_SPECS)}")
    if spec in ("none", "hqq-4bit"):
        return None
    _require(spec)
    skip = [] if quantize_head else None  # []: convert every Linear; None: transformers' default, lm_head kept
    if spec.startswith("torchao"):
        from torchao import quantization
        from transformers import TorchAoConfig

        if spec == "torchao-int8":
            config = quantization.Int8WeightOnlyConfig()
        else:
            config = quantization.IntxWeightOnlyConfig(torch.int4, quantization.PerGroup(32))
        return TorchAoConfig(config, modules_to_not_convert=skip)
    if spec.startswith("quanto"):
        from transformers import QuantoConfig

        return QuantoConfig(weights=spec.removeprefix("quanto-"), modules_to_not_convert=skip)
    from transformers import BitsAndBytesConfig

    if spec == "bnb-8bit":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
                              llm_int8_skip_modules=skip)


def reload_quantized(target, config, compute_dtype: torch.dtype = torch.float32):
    """`target`'s weights loaded into a new model of its class, quantized on load by transformers' `config`, in
    `compute_dtype` on `target`'s device (the weights are passed in memory: nothing is written to disk)."""
    quantized = type(target).from_pretrained(
        None, config=copy.deepcopy(target.config), state_dict=target.state_dict(), quantization_config=config,
        dtype=compute_dtype, device_map=target.device, attn_implementation=target.config._attn_implementation)
    quantized.generation_config = copy.deepcopy(target.generation_config)
    return quantized.eval()


def quantize_target(target, spec: str, quantize_head: bool = False, compute_dtype: torch.dtype = torch.float32):
    """`target` (loaded, float32 or bfloat16) quantized by `spec`, computing in `compute_dtype` (float32, or
    bfloat16 for `BFLOAT16_COMPUTE_SPECS`). Use the returned model: it is a new one for the backends transformers
    applies, `target` itself quantized in place for "hqq-4bit", and `target` unchanged for "none"."""
    if spec == "none":
        return target  # dense: whatever dtype it was loaded in
    if not (compute_dtype == torch.float32 or (compute_dtype == torch.bfloat16 and spec in BFLOAT16_COMPUTE_SPECS)):
        raise ValueError(f"--target-quant {spec} computes in float32 here ({compute_dtype} asked); bfloat16 compute "
                         f"is tested for {', '.join(BFLOAT16_COMPUTE_SPECS)}: use one of those or float32.")
    config = quantization_config(spec, quantize_head)
    if config is not None:
        return reload_quantized(target, config, compute_dtype)
    _require(spec)
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
    from hqq.models.hf.base import AutoHQQHFModel

    target, device = target.to(torch.float32), str(target.device)
    hqq_config = BaseQuantizeConfig(nbits=4, group_size=64)
    AutoHQQHFModel.quantize_model(target, quant_config=hqq_config, compute_dtype=torch.float32, device=device)
    if quantize_head:  # quantize_model leaves lm_head a Linear
        target.lm_head = HQQLinear(target.lm_head, hqq_config, compute_dtype=torch.float32, device=device)
    return target.eval()
